"""EViT's keep decision fused: the class token's mean attention row, then one rank-select kernel (the reference:
``reference/pruners/evit.py``).

Two launches score the patches (:func:`ragged_vit.triton_impl.cls_attention.cls_attention_mean`: the CLS query's
logits per head straight from the block's qkv projection, then every head's softmax over the image's rows on one
tile, averaged), one ranks and selects them (:mod:`ragged_vit.triton_impl.select`, ``rate`` mode: the top
``ceil(rate * patches)``, counted from the exact bits of the rate); the optional fused token (the score-weighted sum
of the dropped patches) is the reference's own arithmetic on these scores. The reference computes the same scores
with segment operations (~30 kernels) and ranks them with two sorts (~35 more).

Same decisions as :class:`ragged_vit.reference.pruners.EViTPruner` given the same scores (the selection is exact); the
scores agree with the reference's to fp32 rounding (the kernels sum in another order), so two patches whose scores
differ only in their last bits may swap places at the cut: the tests bound how many rows may differ.

:func:`evit_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on CUDA
(:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

import torch

from ragged_vit.core.decisions import register_decision
from ragged_vit.core.segments import segment_ids, segment_sum, uniform_length
from ragged_vit.core.selection import DecisionInput, TokenSelection
from ragged_vit.reference.pruners.evit import EViTPruner
from ragged_vit.triton_impl.cls_attention import check_qkv_input, cls_attention_mean
from ragged_vit.triton_impl.select import rank_keep_unchecked


def evit_select(pruner: EViTPruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)`` from the stage block's qkv projection (``inp.qkv``, contiguous rows): the same
    :class:`TokenSelection` up to the scores' fp32 rounding (module docstring), kept counts included."""
    if not isinstance(pruner, EViTPruner):
        raise TypeError(f"pruner must be an EViTPruner, got {type(pruner).__name__}")
    inp = pruner.check_input(inp)
    check_qkv_input(inp, "EViT")
    return _select(pruner, inp)


@register_decision(EViTPruner)
def _select(pruner: EViTPruner, inp: DecisionInput) -> TokenSelection:
    """:func:`evit_select` on checked input: the fused decision the pipelines look up."""
    x, cu, prefix = inp.x, inp.cu_seqlens, inp.num_prefix
    score = cls_attention_mean(inp.qkv, cu, inp.num_heads, inp.scale, inp.row_bound)  # fp32 [T]
    keep, kept = rank_keep_unchecked(score, cu, inp.row_bound, pruner.rate, None, None, 0, prefix)
    total, batch = x.shape[0], cu.shape[0] - 1
    current = uniform_length(cu, total)
    patches = None if current is None else current - prefix
    extra = None
    if pruner.fuses(patches):  # the reference's arithmetic: raw weights of the dropped patches only
        acc = torch.promote_types(x.dtype, torch.float32)
        weight = score.to(acc).masked_fill(keep, 0.0)[:, None]
        extra = segment_sum(weight * x.to(acc), segment_ids(cu, total), batch).to(x.dtype)  # [B, C]
    count = None if patches is None else prefix + pruner.count_after(inp.stage, patches, inp.num_patches)
    return TokenSelection(keep, kept, count is not None, count, extra)
