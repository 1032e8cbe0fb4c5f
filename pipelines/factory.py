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
* ``tome``: token merging in every block (ToMe, ``docs/tome.md``): ``r`` rows merged per image and block, or
  ``threshold`` with ``r_max`` (adaptive; ``keep_rate`` unused); ``r_max`` alone: calibrated, the threshold set by
  :meth:`PrunedViT.calibrate` for a mean of ``keep_rate * 196`` patch rows per image and block (after each block's
  merge); none of them, the constant ``r`` whose mean patch count over the blocks is nearest ``keep_rate * 196``
  (r=13: 0.57).
* ``none``: no pruning (timm's own dense forward).

A keep rate of 1.0 keeps every token with threshold_l2 (ratio), dynamicvit and evit, so their pipelines
reproduce timm's forward; ATS at 1.0 still samples adaptively.

Image sizes (a model built with ``dynamic_img_size=True``, ``docs/models.md``): the 196 above is the batch's own
patch count for threshold_l2 (ratio), dynamicvit, evit and ats (``ATSPruner(sample_rate=keep_rate)``:
``ceil(keep_rate * N)`` CDF samples of the batch's ``N``), so their keep rate holds at every size. The same absolute
count at every size (ATS's ``K``): ``PrunedViT(model, ATSPruner(num_samples=K))``.
"""

from __future__ import annotations

import inspect
import os

from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..core.selection import Pruner
from ..core.validation import check_rate
from ..reference.pruners import PRUNERS
from .backends import AttentionBackend
from .eva import is_eva
from .model import PrunedViT
from .naflex import is_naflex, native_image_size
from .weights import create_model, load_checkpoint

PRUNER_NAMES: tuple[str, ...] = (*PRUNERS, "none")
_MODEL_FACTS = ("embed_dim", "num_patches", "depth")  # what build_pruner reads from the model, not the caller


def pruner_options(name: str) -> tuple[str, ...]:
    """The options the pruner registered under ``name`` takes besides the keep rate (``()`` for ``"none"``)."""
    if name == "none":
        return ()
    params = inspect.signature(PRUNERS[name].from_keep_rate).parameters
    return tuple(p for p, v in params.items() if v.kind is v.KEYWORD_ONLY and p not in _MODEL_FACTS)


def _check_options(name: str, options: dict[str, object], hint: str = "") -> None:
    unknown = sorted(set(options) - set(pruner_options(name)))
    if unknown:
        takes = ", ".join(pruner_options(name)) or "none"
        raise ValueError(
            f"pruner {name!r} takes no option {', '.join(map(repr, unknown))} (its options: {takes}){hint}"
        )


def build_pruner(name: str, model: nn.Module, keep_rate: float = 0.5, **options: object) -> Pruner | None:
    """The pruner ``name`` configured for ``model`` at ``keep_rate`` (None for ``"none"``).

    Args:
        name: one of :data:`PRUNER_NAMES`.
        model: the timm model (its embedding width and patch count size the pruner).
        keep_rate: in ``(0, 1]``, mapped as in the module docstring.
        options: the pruner's own options (:func:`pruner_options`): Threshold-L2's ``threshold_mode`` and
            ``threshold``, EViT's ``fuse_token``, ToMe's ``r``, ``threshold`` and ``r_max``. An option the pruner
            does not take is an error.
    """
    if not isinstance(name, str) or name not in PRUNER_NAMES:
        raise ValueError(f"pruner must be one of {', '.join(PRUNER_NAMES)}, got {name!r}")
    keep_rate = check_rate(keep_rate, "keep_rate")
    native = is_naflex(model)
    if not isinstance(model, VisionTransformer) and not is_eva(model) and not native:
        raise TypeError(f"model must be a timm VisionTransformer, Eva or NaFlexVit, got {type(model).__name__}")
    _check_options(name, options)
    if name == "none":
        return None
    cls = PRUNERS[name]
    if "depth" in inspect.signature(cls.from_keep_rate).parameters:  # a schedule over every block (ToMe)
        options = {**options, "depth": len(model.blocks)}
    if native:  # a NaFlexVit's patches at its position-embedding grid
        (height, width), (p, q) = native_image_size(model), model.embeds.patch_size
        num_patches = (height // p) * (width // q)
    else:
        num_patches = model.patch_embed.num_patches
    return cls.from_keep_rate(keep_rate, embed_dim=model.embed_dim, num_patches=num_patches, **options)


def prune(
    model: nn.Module,
    pruner: str = "threshold_l2",
    keep_rate: float = 0.5,
    backend: str | AttentionBackend = "triton",
    *,
    mode: str = "auto",
    **options: object,
) -> PrunedViT:
    """Wraps a timm ViT the caller already has (built, loaded, moved) into a pruned pipeline, in one line.

    The :class:`PrunedViT` shares ``model``'s modules and parameters and leaves them as they are (it puts the model
    in eval mode: inference only); a checkpoint can still be loaded afterwards, into ``pipeline.model`` (and, for
    DynamicViT, ``pipeline.pruner``: :func:`ragged_vit.pipelines.weights.load_checkpoint`). The pruner is built on
    ``model``'s device and dtype. Calling it runs its fastest path: on CUDA, CUDA graphs with compiled blocks,
    captured on first use of each batch bucket (``mode``: :class:`PrunedViT`).

    Args:
        model: a timm ``VisionTransformer`` or ``Eva`` instance.
        pruner: one of :data:`PRUNER_NAMES`.
        keep_rate: in ``(0, 1]``, mapped onto the pruner's own parameters (module docstring).
        backend: the attention backend (``"triton"``: ours, on CUDA; ``"reference"`` on a CPU without Triton's
            interpreter).
        mode: ``"auto"``, ``"eager"`` or ``"graphs"`` (:data:`ragged_vit.pipelines.model.MODES`).
        options: the pruner's own options (:func:`pruner_options`).
    """
    pruner_module = build_pruner(pruner, model, keep_rate, **options)
    if pruner_module is not None:
        parameter = next(model.parameters(), None)
        if parameter is not None:
            pruner_module = pruner_module.to(device=parameter.device, dtype=parameter.dtype)
    return PrunedViT(model, pruner_module, backend, mode=mode)


def build_pipeline(
    model_name: str,
    pruner: str = "threshold_l2",
    keep_rate: float = 0.5,
    backend: str | AttentionBackend = "reference",
    *,
    checkpoint: str | os.PathLike | None = None,
    strip_prefix: str | None = None,
    model_kwargs: dict[str, object] | None = None,
    mode: str = "auto",
    **options: object,
) -> PrunedViT:
    """``create_model`` + :func:`build_pruner` + optional local checkpoint -> :class:`PrunedViT` (on the CPU).

    Random weights unless ``checkpoint`` is given (or timm's own local-file loading: ``model_kwargs=dict(
    pretrained=True, pretrained_cfg_overlay=dict(file=PATH))``). ``model_kwargs`` go to ``timm.create_model``
    (:func:`ragged_vit.pipelines.weights.create_model`: e.g. ``num_classes``, ``img_size``); ``options`` (the pruner's
    own) go to :func:`build_pruner`. ``strip_prefix`` (``"module."`` for a ``DistributedDataParallel`` checkpoint) goes
    to :func:`ragged_vit.pipelines.weights.load_checkpoint` with ``checkpoint``. ``mode``: as :func:`prune` (move the
    pipeline to the GPU, ``pv.cuda().half()``, and its calls run from CUDA graphs).
    """
    if strip_prefix is not None and checkpoint is None:
        raise ValueError("strip_prefix applies to a checkpoint: give checkpoint= too")
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(
            f"model_kwargs must be a dict of timm.create_model arguments, got {type(model_kwargs).__name__}"
        )
    if pruner in PRUNER_NAMES:  # before the model is built; other names fail in build_pruner
        _check_options(pruner, options, "; timm.create_model arguments go in model_kwargs=dict(...)")
    model = create_model(model_name, **(model_kwargs or {}))
    pruner_module = build_pruner(pruner, model, keep_rate, **options)
    if checkpoint is not None:
        load_checkpoint(model, pruner_module, checkpoint, strip_prefix=strip_prefix)
    return PrunedViT(model, pruner_module, backend, mode=mode)
