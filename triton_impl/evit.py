"""EViT's keep decision fused: the class token's mean attention row, one rank-select kernel, and the optional fused
token in one more (the reference: ``reference/pruners/evit.py``).

Two launches score the patches (:func:`ragged_vit.triton_impl.cls_attention.cls_attention_mean`: the CLS query's
logits per head straight from the block's qkv projection, then every head's softmax over the image's rows on one
tile, averaged), one ranks and selects them (:mod:`ragged_vit.triton_impl.select`, ``rate`` mode: the top
``ceil(rate * patches)``, counted from the exact bits of the rate), and where the stage fuses a token one more
computes it (:func:`fused_token`), besides two zero-fills (the scores, the kept counts): 3 launches a stage without
the fused token, 4 with it, whatever the batch. The reference computes the same scores with segment operations
(~30 kernels), ranks them with two sorts (~35 more) and fuses the token with ~8 more (masks, products, a segment
sum, casts: several times the rest of this decision, ``docs/tuning.md#evit-decision-kernels``).

Same decisions as :class:`ragged_vit.reference.pruners.EViTPruner` given the same scores (the selection is exact); the
scores agree with the reference's to fp32 rounding (the kernels sum in another order), so two patches whose scores
differ only in their last bits may swap places at the cut: the tests bound how many rows may differ.

The fused token, ``extra[b] = sum of score[t] * x[t]`` over image ``b``'s dropped patch rows (zeros where it drops
none, an empty image included), is the reference's sum in another order. ``_fused_token_kernel`` (one program per
image and 32-channel block: 24 programs for one DeiT-B image of 768 channels; no atomics, no host read) walks its
image's patches in tiles of 128 rows: lane ``i`` adds rows ``first + i``, ``first + i + 128``, ... in sequence, then
the lanes are summed in a tree whose shape is the compiler's, fixed for one compiled kernel (one per dtype, ``C`` and
16-byte alignment of ``x`` and of its row stride; the pipelines' contiguous rows always take the same one). Hence the
same bits run after run, eager or replayed from a CUDA graph, and an image's token depends on its own rows only.

The rule: the sum runs in the reference's accumulator, ``promote_types(x.dtype, float32)`` (fp32; fp64 for fp64
rows), and every term passes through at most ``L = ceil(patches / 128) + 128`` roundings (its product, its lane's
adds, the lanes' tree), so the sum is within ``L * u * sum_t |score[t] * x[t]|`` of the exact one (``u`` the
accumulator's unit roundoff, ``2**-24`` in fp32; random rows land within a few ``u`` of that sum of magnitudes), then
it is rounded once to ``x``'s dtype. Where every partial sum is exact (dyadic scores, small integer rows) that is the
exact sum rounded to ``x``'s dtype, bit for bit, in any order. The reference multiplies every row by its masked
weight, so a NaN or an infinity in a kept row makes its token NaN (``0 * inf``); here only the dropped patches are
read, as the official code gathers them: kept and prefix rows never reach the token.

:func:`evit_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on CUDA
(:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.decisions import register_decision
from ..core.selection import DecisionInput, TokenSelection
from ..core.validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_tensor
from ..reference.pruners.evit import EViTPruner
from .cls_attention import check_qkv_input, cls_attention_mean, image_rows
from .launcher import CompiledLauncher, aligned, cdiv, int_spec
from .select import rank_keep_unchecked

_BLOCK_T = 128  # patch rows per step: DeiT-B's 196 patches in two steps, its later stages in one
_BLOCK_C = 32  # channels per program: one DeiT-B image (768) spreads over 24 programs, batch 64 over 1536


@triton.jit(do_not_specialize=["total", "num_prefix"])
def _fused_token_kernel(
    X, SCORES, KEEP, CU, OUT, total, stride_xt, stride_xc, num_prefix,
    CHANNELS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, FP64: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    start, end = image_rows(CU, b, total)
    first = end - tl.maximum(end - start - num_prefix, 0)  # prefix rows are never summed, kept or not
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < CHANNELS
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float64 if FP64 else tl.float32)
    for t0 in range(first, end, BLOCK_T):
        t = t0 + offs_t
        dropped = tl.load(KEEP + t, mask=t < end, other=1) == 0
        weight = tl.load(SCORES + t, mask=dropped, other=0.0).to(acc.dtype)
        rows = X + t.to(tl.int64)[:, None] * stride_xt + offs_c[None, :] * stride_xc
        vals = tl.load(rows, mask=dropped[:, None] & in_c[None, :], other=0.0)  # dropped rows only: kept ones unread
        acc += weight[:, None] * vals.to(acc.dtype)
    tl.store(OUT + b.to(tl.int64) * CHANNELS + offs_c, tl.sum(acc, 0).to(OUT.dtype.element_ty), mask=in_c)


_fused_token_launcher = CompiledLauncher(_fused_token_kernel)


def fused_token(
    x: torch.Tensor,
    scores: torch.Tensor,
    keep: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> torch.Tensor:
    """EViT's fused token of every image: ``[B, C]`` in ``x``'s dtype, one launch, no host synchronisation.

    ``out[b] = sum of scores[t] * x[t]`` over the rows ``t`` of image ``b`` past its ``num_prefix`` first that
    ``keep`` drops, accumulated in ``promote_types(x.dtype, float32)``; zeros for an image that drops nothing (an
    empty one included). The reference's arithmetic up to the order of the sum (module docstring: the rule).

    Args:
        x: ``[T, C]`` packed rows (any strides), fp16, bf16, fp32 or fp64.
        scores: fp32 ``[T]`` weights (EViT: the CLS attention), contiguous; read on dropped patch rows only.
        keep: bool ``[T]`` keep mask, contiguous.
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        num_prefix: prefix rows at the start of every image (class, distillation, register tokens), never summed.
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).
    """
    check_tensor(x, "x", ndim=2, dtypes=(*FLOAT_DTYPES, torch.float64))
    total, channels = x.shape
    if channels < 1:
        raise ValueError(f"x must have at least one channel, got shape {tuple(x.shape)}")
    for name, value, dtype in (("scores", scores, torch.float32), ("keep", keep, torch.bool)):
        check_tensor(value, name, ndim=1, dtypes=(dtype,), device=x.device)
        if value.shape[0] != total:
            raise ValueError(f"{name} must have shape ({total},) to match x, got {tuple(value.shape)}")
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {value.stride()}")
    cu = check_cu_seqlens(cu_seqlens, total=total, device=x.device, check_values=check_values)
    check_int(num_prefix, "num_prefix", 0)
    return fused_token_unchecked(x, scores, keep, cu, num_prefix, x.new_empty((cu.shape[0] - 1, channels)))


def fused_token_unchecked(
    x: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, cu: torch.Tensor, num_prefix: int, out: torch.Tensor
) -> torch.Tensor:
    """:func:`fused_token` without its checks, written into ``out`` (contiguous ``[B, C]`` in ``x``'s dtype, every
    element overwritten) and returned: for the fused decision, which built its input itself."""
    channels = x.shape[1]
    keep = keep.view(torch.int8)
    fp64 = x.dtype == torch.float64
    args = (x, scores, keep, cu, out, x.shape[0], x.stride(0), x.stride(1), num_prefix, channels, _BLOCK_T, _BLOCK_C,
            fp64)  # fmt: skip
    key = (x.dtype, channels, int_spec(x.stride(0)), int_spec(x.stride(1)))
    grid = (cu.shape[0] - 1, cdiv(channels, _BLOCK_C))
    launch_key = key if aligned(x, scores, keep, cu, out) else None
    _fused_token_launcher(launch_key, x.get_device(), grid, args, num_warps=4, num_stages=1)
    return out


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
    score = cls_attention_mean(inp.qkv, cu, inp.num_heads, inp.scale, inp.row_bound, inp.rotary)  # fp32 [T]
    keep, kept = rank_keep_unchecked(score, cu, inp.row_bound, pruner.rate, None, None, 0, prefix)
    batch = cu.shape[0] - 1
    current = inp.uniform_rows
    patches = None if current is None else current - prefix
    extra = None
    if pruner.fuses(patches):  # the dropped patches weighted by their raw scores
        extra = fused_token_unchecked(x, score, keep, cu, prefix, x.new_empty((batch, x.shape[1])))  # [B, C]
    count = None if patches is None else prefix + pruner.count_after(inp.stage, patches, inp.num_patches)
    return TokenSelection(keep, kept, count is not None, count, extra)
