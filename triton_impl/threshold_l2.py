"""Threshold-L2's keep decision fused: its scores, then one rank-select kernel (:mod:`ragged_vit.triton_impl.select`;
the reference: ``reference/pruners/threshold_l2.py``).

Same decisions as :class:`ragged_vit.reference.pruners.ThresholdL2Pruner`, bit for bit: the scores come from the same
function (:func:`ragged_vit.reference.pruners.threshold_l2.l2_scores`), the ratio count ``ceil(rate * patches)`` is
computed in float64 from the exact bits of ``rate``, and the threshold is compared in float32, as torch
compares a float32 tensor with a Python float.

:func:`threshold_l2_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on
CUDA (:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

from ..core.decisions import register_decision
from ..core.selection import DecisionInput, TokenSelection
from ..reference.pruners.threshold_l2 import ThresholdL2Pruner, l2_scores
from .select import rank_keep_unchecked


def threshold_l2_select(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)`` through one rank-select kernel: the same :class:`TokenSelection`, kept counts included."""
    if not isinstance(pruner, ThresholdL2Pruner):
        raise TypeError(f"pruner must be a ThresholdL2Pruner, got {type(pruner).__name__}")
    return _select(pruner, pruner.check_input(inp))


@register_decision(ThresholdL2Pruner)
def _select(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """:func:`threshold_l2_select` on checked input: the fused decision the pipelines look up."""
    scores, cu, prefix = l2_scores(inp.x), inp.cu_seqlens, inp.num_prefix
    if pruner.mode == "ratio":
        keep, kept = rank_keep_unchecked(scores, cu, inp.row_bound, pruner.rate, None, None, 0, prefix)
        current = inp.uniform_rows
        count = None if current is None else prefix + pruner.count_after(inp.stage, current - prefix, inp.num_patches)
        return TokenSelection(keep, kept, fixed_count=count is not None, count=count)
    floor = max(pruner.min_keep, inp.min_patches)
    keep, kept = rank_keep_unchecked(scores, cu, inp.row_bound, None, None, pruner.threshold, floor, prefix)
    return TokenSelection(keep, kept)
