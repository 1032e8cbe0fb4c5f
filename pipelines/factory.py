"""From names to a ready pipeline: a registered pruner built for a model at one keep rate, then a PrunedViT.

The CLI and the tests speak of one ``keep_rate`` in ``(0, 1]``; each method defines its schedule differently, so
each pruner class maps it onto its own parameters (``Pruner.from_keep_rate``; the rules and golden counts are in
``docs/pruners.md``):

* ``threshold_l2``: one stage after block 3 (blocks 0-3 dense). ``ratio`` mode (default) keeps the top
  ``ceil(keep_rate * 196)`` patches; ``calibrated`` sets the threshold to keep ``keep_rate`` on average (call
  :meth:`PrunedViT.calibrate`); ``threshold`` keeps ``||x|| >= threshold`` (``keep_rate`` unused).
* ``dynamicvit``: before blocks 3, 6, 9, ``int(196 * keep_rate ** s)`` patches at stage s (0.7 -> 137/96/67).
* ``evit``: inside blocks 3, 6, 9, ``ceil(keep_rate * current)`` patches; ``fuse_token`` adds EViT's fused token.
* ``ats``: inside blocks 3-11; ``keep_rate`` sets the number of CDF samples, ``ceil(keep_rate * 196)``, an upper
  bound on the patches kept (ATS keeps fewer where its scores are peaked; 1.0 is the method's default, N).
* ``none``: no pruning (timm's own dense forward).

A keep rate of 1.0 keeps every token with threshold_l2 (ratio), dynamicvit and evit, so their pipelines
reproduce timm's forward; ATS at 1.0 still samples adaptively.
"""

from __future__ import annotations

import inspect
import os

from torch import nn

from ragged_vit.core.selection import Pruner
from ragged_vit.core.validation import check_rate
from ragged_vit.pipelines.backends import AttentionBackend
from ragged_vit.pipelines.model import PrunedViT
from ragged_vit.pipelines.weights import create_model, load_checkpoint
from ragged_vit.reference.pruners import PRUNERS

PRUNER_NAMES: tuple[str, ...] = (*PRUNERS, "none")


def pruner_options(name: str) -> tuple[str, ...]:
    """The options the pruner registered under ``name`` takes besides the keep rate (``()`` for ``"none"``)."""
    if name == "none":
        return ()
    params = inspect.signature(PRUNERS[name].from_keep_rate).parameters
    return tuple(p for p, v in params.items() if v.kind is v.KEYWORD_ONLY and p not in ("embed_dim", "num_patches"))


def build_pruner(name: str, model: nn.Module, keep_rate: float = 0.5, **options: object) -> Pruner | None:
    """The pruner ``name`` configured for ``model`` at ``keep_rate`` (None for ``"none"``).

    Args:
        name: one of :data:`PRUNER_NAMES`.
        model: the timm model (its embedding width and patch count size the pruner).
        keep_rate: in ``(0, 1]``, mapped as in the module docstring.
        options: the pruner's own options (:func:`pruner_options`): Threshold-L2's ``threshold_mode`` and
            ``threshold``, EViT's ``fuse_token``. An option the pruner does not take is an error.
    """
    if not isinstance(name, str) or name not in PRUNER_NAMES:
        raise ValueError(f"pruner must be one of {', '.join(PRUNER_NAMES)}, got {name!r}")
    keep_rate = check_rate(keep_rate, "keep_rate")
    unknown = sorted(set(options) - set(pruner_options(name)))
    if unknown:
        takes = ", ".join(pruner_options(name)) or "none"
        raise ValueError(f"pruner {name!r} takes no option {', '.join(map(repr, unknown))} (its options: {takes})")
    if name == "none":
        return None
    return PRUNERS[name].from_keep_rate(
        keep_rate, embed_dim=model.embed_dim, num_patches=model.patch_embed.num_patches, **options
    )


def build_pipeline(
    model_name: str,
    pruner: str = "threshold_l2",
    keep_rate: float = 0.5,
    backend: str | AttentionBackend = "reference",
    *,
    checkpoint: str | os.PathLike | None = None,
    **pruner_options: object,
) -> PrunedViT:
    """``create_model`` + :func:`build_pruner` + optional local checkpoint -> :class:`PrunedViT` (on the CPU).

    Random weights unless ``checkpoint`` is given. ``pruner_options`` go to :func:`build_pruner`.
    """
    model = create_model(model_name)
    pruner_module = build_pruner(pruner, model, keep_rate, **pruner_options)
    if checkpoint is not None:
        load_checkpoint(model, pruner_module, checkpoint)
    return PrunedViT(model, pruner_module, backend)
