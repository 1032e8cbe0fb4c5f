"""Threshold-L2: keep the patches whose residual-stream L2 norm is large (our own baseline, no paper).

The score of a patch is ``||x_i||_2`` of the residual stream after block 3 (before the next LayerNorm). Three
modes: ``threshold`` (keep ``s >= tau``: a variable count per image), ``ratio`` (the top
``ceil(rate * patches)``: a fixed count) and ``calibrated`` (``tau`` is the ``(1 - rate)`` quantile of the scores
of a calibration batch, then as ``threshold``: variable count, mean keep ~ ``rate``). CLS is always kept and never
scored; every image keeps at least ``min_keep`` patches. Dropped tokens are discarded (no fusion), no weights.

This module also holds the per-image helpers every pruner of this package shares (ranking on the packed layout,
the host-side length of a uniform batch, argument checks). Not supported: several stages, learned thresholds.
"""

from __future__ import annotations

import math

import torch

from reference.segments import positions, segment_ids, seqlens
from reference.selection import Placement, PruneInput, Pruner, TokenSelection
from reference.validation import FLOAT_DTYPES, check_cu_seqlens, check_rate, check_tensor

_SCORE_DTYPES = (*FLOAT_DTYPES, torch.float64)
MODES = ("threshold", "ratio", "calibrated")


def check_int(value: object, name: str, minimum: int) -> int:
    """Checks that ``value`` is a Python int (not a bool) ``>= minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_blocks(blocks: object, name: str = "blocks") -> tuple[int, ...]:
    """Checks a stage schedule: a non-empty, strictly increasing sequence of timm block indices; returns a tuple."""
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise TypeError(f"{name} must be a tuple of block indices, got {type(blocks).__name__}")
    blocks = tuple(blocks)
    if not blocks:
        raise ValueError(f"{name} must name at least one block, got ()")
    for i, b in enumerate(blocks):
        check_int(b, f"{name}[{i}]", 0)
    if any(b >= c for b, c in zip(blocks[:-1], blocks[1:], strict=True)):
        raise ValueError(f"{name} must be strictly increasing, got {blocks}")
    return blocks


def check_prune_input(inp: object, *, attention: bool = False, values: bool = False) -> PruneInput:
    """Checks a :class:`PruneInput` at a pruner's entry; ``attention`` / ``values`` require ``cls_attn`` / ``v``."""
    if not isinstance(inp, PruneInput):
        raise TypeError(f"inp must be a PruneInput, got {type(inp).__name__}")
    x = check_tensor(inp.x, "inp.x", ndim=2, dtypes=_SCORE_DTYPES)
    check_cu_seqlens(inp.cu_seqlens, total=x.shape[0], device=x.device, name="inp.cu_seqlens")
    check_int(inp.stage, "inp.stage", 0)
    check_int(inp.num_patches, "inp.num_patches", 1)
    required = {"cls_attn": attention, "v": values}
    for name, needed in required.items():
        if not needed:
            continue
        value = getattr(inp, name)
        if value is None:
            raise ValueError(f"inp.{name} is required by this pruner (it scores tokens by attention), got None")
        check_tensor(value, f"inp.{name}", ndim=2, dtypes=_SCORE_DTYPES, device=x.device)
        if value.shape[0] != x.shape[0]:
            raise ValueError(f"inp.{name} must have {x.shape[0]} rows like inp.x, got shape {tuple(value.shape)}")
    return inp


def patch_rank(scores: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Rank of every patch row by descending score inside its own image (0 = best): ``[T]`` -> int64 ``[T]``.

    Ties go to the earlier row, so a rank depends on the image's own scores only. Each image's CLS row ranks after
    all its patches, hence ``rank < k`` marks exactly ``min(k, patches)`` patches (plus CLS when ``k > patches``).
    Sorting the packed rows by (image, CLS last, score) needs no padding and no device-to-host read.
    """
    total = scores.shape[0]
    seg = segment_ids(cu_seqlens, total)
    is_cls = positions(cu_seqlens, total) == 0
    by_score = torch.argsort(scores, descending=True, stable=True)
    group = 2 * seg + is_cls.long()
    order = by_score[torch.argsort(group[by_score], stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(total, device=scores.device) - cu_seqlens.long()[seg[order]]
    return rank


def patch_counts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Patches (rows after CLS) per image ``[B]`` (int64); an empty image has none."""
    return (seqlens(cu_seqlens) - 1).clamp_min(0)


def ceil_rate(rate: float, patches: torch.Tensor) -> torch.Tensor:
    """``ceil(rate * patches)`` per image, in float64 so that it equals Python's ``math.ceil`` on the host."""
    return torch.ceil(patches.double() * rate).long()


def uniform_length(cu_seqlens: torch.Tensor, total: int) -> int | None:
    """Rows per image of a uniform batch, from host shapes; None when the batch is known to be ragged.

    Fixed-count pipelines only ever produce uniform batches, so ``T // B`` is the length without reading the
    device. The offsets are read to confirm it only where that is free (CPU), as ``check_cu_seqlens`` does; on a
    GPU a ragged batch with ``T % B == 0`` goes undetected and only the host ``count`` is wrong, not the mask.
    """
    batch = cu_seqlens.numel() - 1
    if total % batch:
        return None
    length = total // batch
    if cu_seqlens.device.type == "cpu" and not bool((seqlens(cu_seqlens) == length).all()):
        return None
    return length


class ThresholdL2Pruner(Pruner):
    """Keeps the patches with a large residual-stream L2 norm, once, after one block.

    Args:
        mode: ``"threshold"`` (keep ``s >= threshold``), ``"ratio"`` (top ``ceil(rate * patches)``) or
            ``"calibrated"`` (``threshold`` set by :meth:`calibrate` from ``rate``).
        threshold: the norm threshold ``tau`` (mode ``threshold`` only).
        rate: keep rate in ``(0, 1]`` (modes ``ratio`` and ``calibrated``).
        min_keep: patches every image keeps at least (or all it has, if fewer).
        block: the timm block after which the pruner acts.
    """

    name = "threshold_l2"
    placement = Placement.AFTER_BLOCK
    blocks = (3,)
    fixed_count = False

    def __init__(
        self,
        mode: str = "threshold",
        threshold: float | None = None,
        rate: float | None = None,
        min_keep: int = 8,
        block: int = 3,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "threshold":
            if threshold is None:
                raise ValueError("threshold must be given for mode='threshold', got None")
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
                raise TypeError(f"threshold must be a float, got {type(threshold).__name__}")
            if not math.isfinite(threshold):
                raise ValueError(f"threshold must be finite, got {threshold}")
            if rate is not None:
                raise ValueError(f"rate is not used by mode='threshold' (it keeps s >= threshold), got {rate}")
            threshold = float(threshold)
        else:
            if rate is None:
                raise ValueError(f"rate must be given for mode={mode!r}, got None")
            rate = check_rate(rate, "rate")
            if threshold is not None:
                raise ValueError(
                    f"threshold is only given with mode='threshold' (got mode={mode!r}): "
                    "mode='calibrated' sets it with calibrate()"
                )
        self.mode = mode
        self.threshold = threshold
        self.rate = rate
        self.min_keep = check_int(min_keep, "min_keep", 0)
        self.blocks = (check_int(block, "block", 0),)
        self.fixed_count = mode == "ratio"

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, threshold={self.threshold}, rate={self.rate}, min_keep={self.min_keep}"

    def count_after(self, stage: int, current: int, num_patches: int) -> int | None:
        if self.mode != "ratio":
            return None
        return 1 + math.ceil(self.rate * (current - 1))

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor | PruneInput) -> float:
        """Sets ``threshold`` to the ``(1 - rate)`` quantile of the patch scores of a calibration batch.

        Args:
            x: a dense batch ``[B, N, C]`` (CLS at index 0) or a packed :class:`PruneInput`.

        Returns:
            The threshold, also stored in ``self.threshold``.
        """
        if self.mode != "calibrated":
            raise ValueError(f"calibrate() needs mode='calibrated', this pruner has mode={self.mode!r}")
        if isinstance(x, PruneInput):
            check_prune_input(x)
            is_patch = positions(x.cu_seqlens, x.x.shape[0]) > 0
            scores = x.x[is_patch].float().norm(dim=-1)
        else:
            check_tensor(x, "x", ndim=3, dtypes=_SCORE_DTYPES)
            scores = x[:, 1:].float().norm(dim=-1).flatten()
        if scores.numel() == 0:
            raise ValueError("x must hold at least one patch token to calibrate on, got none")
        self.threshold = float(torch.quantile(scores, 1.0 - self.rate))
        return self.threshold

    def forward(self, inp: PruneInput) -> TokenSelection:
        check_prune_input(inp)
        if self.threshold is None and self.mode == "calibrated":
            raise RuntimeError("ThresholdL2Pruner(mode='calibrated') has no threshold yet: call calibrate() first")
        x, cu = inp.x, inp.cu_seqlens
        total = x.shape[0]
        seg = segment_ids(cu, total)
        is_cls = positions(cu, total) == 0
        score = x.float().norm(dim=-1)  # fp32 whatever the stream dtype: decisions on fp32 scores
        rank = patch_rank(score, cu)
        if self.mode == "ratio":
            keep = is_cls | (rank < ceil_rate(self.rate, patch_counts(cu))[seg])
            current = uniform_length(cu, total)
            count = None if current is None else self.count_after(inp.stage, current, inp.num_patches)
            return TokenSelection(keep, fixed_count=count is not None, count=count)
        # The floor adds the best-scoring patches, a superset of those passing the threshold.
        keep = is_cls | (score >= self.threshold) | (rank < self.min_keep)
        return TokenSelection(keep, fixed_count=False)
