"""Threshold-L2: keep the patches whose residual-stream L2 norm is large (our own baseline, no paper).

The score of a patch is ``||x_i||_2`` of the residual stream after block 3 (before the next LayerNorm). Three
modes: ``threshold`` (keep ``s >= tau``: a variable count per image), ``ratio`` (the top
``ceil(rate * patches)``: a fixed count) and ``calibrated`` (``tau`` is the ``(1 - rate)`` quantile of the scores
of a calibration batch, then as ``threshold``: variable count, mean keep ~ ``rate``). Prefix rows (class,
distillation, register tokens) are always kept and never scored; every image keeps at least ``min_keep`` patches
(at least one on a model without prefix rows). Dropped tokens are discarded (no fusion), no weights.

Not supported: several stages, learned thresholds.
"""

from __future__ import annotations

import math

import torch

from ...core.segments import (
    ceil_rate,
    patch_counts,
    prefix_rows,
    segment_ids,
    segment_rank,
)
from ...core.selection import (
    DecisionInput,
    Placement,
    Pruner,
    TokenSelection,
    check_decision_input,
    kept_counts,
)
from ...core.validation import FLOAT_DTYPES, check_int, check_rate, check_tensor
from .schedule import at_depth

_SCORE_DTYPES = (*FLOAT_DTYPES, torch.float64)
MODES = ("threshold", "ratio", "calibrated")


def l2_scores(x: torch.Tensor) -> torch.Tensor:
    """The score of every row ``[T, C]`` -> fp32 ``[T]``: its L2 norm, accumulated in fp32 whatever ``x``'s dtype
    (decisions are made on fp32 scores). The one definition, shared with the fused Triton selection."""
    if x.dtype == torch.float64:
        x = x.float()
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)


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

    @classmethod
    def from_keep_rate(
        cls,
        keep_rate: float,
        *,
        embed_dim: int,
        num_patches: int,
        depth: int = 12,
        threshold_mode: str = "ratio",
        threshold: float | None = None,
    ) -> ThresholdL2Pruner:
        """One stage after block 3 of 12 (the same fraction of another depth: :func:`ragged_vit.reference.pruners.
        schedule.at_depth`). ``ratio`` keeps the top ``ceil(keep_rate * patches)``; ``calibrated`` keeps
        ``keep_rate`` on average once :meth:`calibrate` set the threshold; ``threshold`` keeps ``||x|| >= threshold``
        (``keep_rate`` unused)."""
        (block,) = at_depth((3,), depth, merge=True, name="threshold_l2")
        if threshold_mode == "threshold":
            return cls(mode="threshold", threshold=threshold, block=block)
        return cls(mode=threshold_mode, threshold=threshold, rate=keep_rate, block=block)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, threshold={self.threshold}, rate={self.rate}, min_keep={self.min_keep}"

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        if self.mode != "ratio":
            return None
        return math.ceil(self.rate * patches)

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor | DecisionInput, num_prefix: int = 1) -> float:
        """Sets ``threshold`` to the ``(1 - rate)`` quantile of the patch scores of a calibration batch.

        Args:
            x: a dense batch ``[B, N, C]`` whose first ``num_prefix`` rows are prefix tokens, or a packed
                :class:`DecisionInput` (its own ``num_prefix``).

        Returns:
            The threshold, also stored in ``self.threshold``.
        """
        if self.mode != "calibrated":
            raise ValueError(f"calibrate() needs mode='calibrated', this pruner has mode={self.mode!r}")
        if isinstance(x, DecisionInput):
            check_decision_input(x)
            scores = l2_scores(x.x[~prefix_rows(x.cu_seqlens, x.x.shape[0], x.num_prefix)])
        else:
            check_tensor(x, "x", ndim=3, dtypes=_SCORE_DTYPES)
            scores = l2_scores(x[:, check_int(num_prefix, "num_prefix", 0) :]).flatten()
        if scores.numel() == 0:
            raise ValueError("x must hold at least one patch token to calibrate on, got none")
        self.threshold = float(torch.quantile(scores, 1.0 - self.rate))
        return self.threshold

    def check_ready(self) -> None:
        if self.threshold is None and self.mode == "calibrated":
            raise RuntimeError("ThresholdL2Pruner(mode='calibrated') has no threshold yet: call calibrate() first")

    def decide(self, inp: DecisionInput) -> TokenSelection:
        x, cu, num_prefix = inp.x, inp.cu_seqlens, inp.num_prefix
        total = x.shape[0]
        seg = segment_ids(cu, total)
        prefix = prefix_rows(cu, total, num_prefix)
        score = l2_scores(x)
        rank = segment_rank(score, cu, num_prefix)
        if self.mode == "ratio":
            keep = prefix | (rank < ceil_rate(self.rate, patch_counts(cu, num_prefix))[seg])
            current = inp.uniform_rows
            count = None if current is None else num_prefix + self.count_after(inp.stage, current - num_prefix, 0)
            return TokenSelection(keep, kept_counts(keep, cu), fixed_count=count is not None, count=count)
        # The floor adds the best-scoring patches, a superset of those passing the threshold.
        keep = prefix | (score >= self.threshold) | (rank < max(self.min_keep, inp.min_patches))
        return TokenSelection(keep, kept_counts(keep, cu))
