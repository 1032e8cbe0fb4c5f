"""DynamicViT's keep decision fused: its predictor, then one rank-select kernel (:mod:`ragged_vit.triton_impl.select`;
the reference: ``reference/pruners/dynamicvit.py``).

The predictor runs as the reference runs it (the same module and ops: the same scores); the per-image top-k, ~35
small kernels of sorts, scans and gathers in the reference (``segment_rank``), is one launch that also counts the kept
rows. Same decisions as :class:`ragged_vit.reference.pruners.DynamicViTPruner`, bit for bit.

:func:`dynamicvit_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on CUDA
(:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

from ragged_vit.core.decisions import register_decision
from ragged_vit.core.segments import uniform_length
from ragged_vit.core.selection import DecisionInput, TokenSelection
from ragged_vit.reference.pruners.dynamicvit import DynamicViTPruner
from ragged_vit.triton_impl.select import rank_keep_unchecked


def dynamicvit_select(pruner: DynamicViTPruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)`` through one rank-select kernel: the same :class:`TokenSelection`, kept counts included."""
    if not isinstance(pruner, DynamicViTPruner):
        raise TypeError(f"pruner must be a DynamicViTPruner, got {type(pruner).__name__}")
    return _select(pruner, pruner.check_input(inp))


@register_decision(DynamicViTPruner)
def _select(pruner: DynamicViTPruner, inp: DecisionInput) -> TokenSelection:
    """:func:`dynamicvit_select` on checked input: the fused decision the pipelines look up."""
    x, cu, prefix = inp.x, inp.cu_seqlens, inp.num_prefix
    score = pruner.score_predictor[inp.stage](x, cu, prefix)[:, 0].float().contiguous()
    k = max(pruner.keep_patches(inp.stage, inp.num_patches), inp.min_patches)
    keep, kept = rank_keep_unchecked(score, cu, inp.row_bound, None, k, None, 0, prefix)
    current = uniform_length(cu, x.shape[0])
    count = None if current is None else prefix + pruner.count_after(inp.stage, current - prefix, inp.num_patches)
    return TokenSelection(keep, kept, fixed_count=count is not None, count=count)
