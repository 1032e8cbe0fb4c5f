"""``validate``'s options and the setup every rank builds before its loop (the run: :mod:`.evaluate`; the report:
:mod:`.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .folder import ImageFolderDataset, ImageFolderIndex


@dataclass
class ValidateOptions:
    """Everything a validation run needs; the command line fills it (:func:`.validate.main`)."""

    data_dir: str
    model: str
    pruner: str
    keep_rate: float
    backend: str
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    workers: int
    model_kwargs: dict[str, object] = field(default_factory=dict)
    pruner_options: dict[str, object] = field(default_factory=dict)
    class_map: str | None = None
    checkpoint: str | None = None
    strip_prefix: str | None = None
    seed: int = 0
    graphs: bool = False
    compile_blocks: bool = False
    compare_unpruned: bool = False
    warmup: int = 0
    skip_bad: bool = False
    results_json: str | None = None
    results_csv: str | None = None
    command: str = ""


@dataclass
class Setup:
    """What the run needs, built the same on every rank before the loop (:func:`.evaluate._prepare`)."""

    index: ImageFolderIndex
    pv: object  # PrunedViT
    dataset: ImageFolderDataset
    data_config: dict
    notes: list[str]
    weights: str
    fingerprint: tuple[int, int]
