"""ATS's keep decision in two Triton kernels (the reference: ``reference/pruners/ats.py``).

The reference scores and samples with ~250 small kernels per stage on a GPU (CLS attention, segment softmax, value
norms, a padded sort, a cumulative sum, a ``[B, S, W]`` distance argmin, a scatter, a rank for the floor); ATS has
a stage in each of blocks 3-11, so its decisions were most of a graphed DeiT-B forward at batch 1
(``docs/tuning.md#ats-decision-kernels``). Here one stage is two launches:

1. the CLS-logits kernel of :mod:`ragged_vit.triton_impl.cls_attention` (one program per image, head and 16-row
   block): the CLS query's logit against every key and the squared norm of every value, per head (two ``[T, H]``
   fp32 buffers).
2. ``_sample_kernel`` (one program per image, its rows in registers): the softmax of every head at once on a
   ``[rows, heads]`` tile, the normalised significance ``S_j`` (CLS 0), then the sampling itself: one
   ``tl.sort`` of 64-bit keys ``(score bits, row)`` (non-negative floats order as their bits, so this is the
   reference's stable ascending sort), ``tl.cumsum``, min-max normalisation, then every target's nearest CDF
   value by binary search in the sorted CDF (a per-image scratch row; far cheaper than the reference's
   ``[targets, rows]`` distance argmin: ``docs/tuning.md#ats-decision-kernels``), and the floor: a second sort of
   the unsampled patches by (descending score, row) whose ``k``-th key is the cut. It writes every row's keep
   flag and the image's kept count.

Same decisions as :func:`ragged_vit.reference.pruners.ats.sample_keep` given the same scores, except where the CDF's
fp32 rounding decides: ``tl.cumsum`` adds in a tree, ``torch.cumsum`` in another order, and with peaked scores a target
can sit between two CDF values that differ only in their last bits. The divisions are correctly rounded (``div_rn``) and
the kernel is compiled without FMA contraction, so when the CDF is exact (dyadic scores: every order gives the same
sums) the keep masks are equal bit for bit; the tests check that, and the agreement on random scores. The scores
themselves agree with :func:`ragged_vit.reference.pruners.ats.significance` to fp32 rounding.

:func:`ats_select` is the drop-in for ``ATSPruner(inp)``; it is registered as the pruner's fused decision on CUDA
(:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.decisions import register_decision
from ..core.selection import DecisionInput, TokenSelection
from ..core.validation import check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from ..reference.pruners.ats import ATSPruner
from .cls_attention import (
    check_qkv,
    check_qkv_input,
    cls_attention_logits,
    image_rows,
)
from .launcher import CompiledLauncher, aligned, next_power_of_2, scratch


@triton.jit
def _count_below(CDF, t, n, LOG_W: tl.constexpr):
    """``#{j < n : CDF[j] < t}`` for every target ``t``: binary search over the ascending ``CDF[0:n]``."""
    count = tl.zeros(t.shape, dtype=tl.int32)
    for k in tl.static_range(LOG_W):
        probe = count + (1 << (LOG_W - 1 - k))
        fits = probe <= n
        c = tl.load(CDF + probe - 1, mask=fits, other=0.0)
        count = tl.where(fits & (c < t), probe, count)
    return count


@triton.jit
def _first_as_near(CDF, t, below, near, LOG_W: tl.constexpr):
    """``#{j < below : t - CDF[j] > near}`` (fp32 differences, decreasing in ``j``): the first of the CDF values
    below ``t`` whose rounded distance equals the nearest one's (``near``), as ``argmin`` takes it."""
    count = tl.zeros(t.shape, dtype=tl.int32)
    for k in tl.static_range(LOG_W):
        probe = count + (1 << (LOG_W - 1 - k))
        fits = probe <= below
        c = tl.load(CDF + probe - 1, mask=fits, other=0.0)
        count = tl.where(fits & ((t - c) > near), probe, count)
    return count


@triton.jit(do_not_specialize=["total", "num_samples", "min_keep", "num_prefix"])
def _sample_kernel(
    LOGITS, SQUARES, SCORES, WORK, CU, KEEP, KEPT, total, num_samples, min_keep, num_prefix,
    H: tl.constexpr, FROM_LOGITS: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr, LOG_W: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    start, end = image_rows(CU, b, total)
    length = tl.minimum(end - start, BLOCK_W)  # rows past the bound are never kept (zeroed at the end)
    offs = tl.arange(0, BLOCK_W)
    in_image = offs < length
    is_patch = in_image & (offs >= num_prefix)
    if FROM_LOGITS:  # S_j = sum_h softmax_h(logits)[j] * ||V_j||, normalised over the image's patches
        offs_h = tl.arange(0, BLOCK_H)
        cells = (start + offs)[:, None] * H + offs_h[None, :]
        mask = in_image[:, None] & (offs_h < H)[None, :]
        logit = tl.load(LOGITS + cells, mask=mask, other=0.0)  # [W, heads]: every head's softmax at once
        peak = tl.max(tl.where(mask, logit, float("-inf")), 0)
        e = tl.where(mask, tl.exp(logit - peak[None, :]), 0.0)
        attn = tl.sum(e / tl.maximum(tl.sum(e, 0), 1.0)[None, :], 1)  # the peak adds exp(0) = 1 per head
        norm = tl.sqrt_rn(tl.sum(tl.load(SQUARES + cells, mask=mask, other=0.0), 1))
        raw = tl.where(is_patch, attn * norm, 0.0)
        mass = tl.sum(raw, 0)
        score = tl.where(mass > 0, tl.math.div_rn(raw, tl.where(mass > 0, mass, 1.0)), 0.0)
        tl.store(SCORES + start + offs, score, mask=in_image)
        if not SAMPLE:
            return
        tl.debug_barrier()  # the sampling below reads the scores back as ats_keep does
    score = tl.load(SCORES + start + offs, mask=is_patch, other=0.0)
    patches = tl.maximum(length - num_prefix, 0)
    # Ascending by (score, row), prefix rows and rows outside the image last; the low 32 bits keep the row.
    bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    row = offs.to(tl.int64)
    keys = tl.sort(tl.where(is_patch, (bits << 32) | row, (0x7FFFFFFF << 32) | row))
    sorted_bits = keys >> 32
    pos = (keys & 0xFFFFFFFF).to(tl.int32)
    valid = offs < patches  # sorted slots that hold patches
    cdf = tl.cumsum(tl.where(valid, sorted_bits.to(tl.int32).to(tl.float32, bitcast=True), 0.0), 0)
    low = tl.sum(tl.where(offs == 0, cdf, 0.0), 0)
    span = tl.sum(tl.where(offs == patches - 1, cdf, 0.0), 0) - low
    # One patch, or all scores zero: the CDF is a single point; at 1, every target picks it.
    cdf = tl.where(span > 0, tl.math.div_rn(cdf - low, tl.where(span > 0, span, 1.0)), 1.0)
    cdf = tl.where(valid, cdf, float("inf"))
    first = tl.minimum(tl.min(tl.where(cdf > 0, cdf, float("inf")), 0), 1.0)  # the smallest non-zero CDF value
    last = tl.maximum(num_samples - 1, 1).to(tl.float32)
    # Each target's nearest CDF value by binary search in the sorted CDF (global scratch: WORK[b, 0]); the picks
    # are flagged in WORK[b, 1]. The distances are the reference's fp32 ones, ties to the first (see below).
    work = WORK + b.to(tl.int64) * (2 * BLOCK_W)
    tl.store(work + offs, cdf)
    tl.store(work + BLOCK_W + offs, tl.zeros([BLOCK_W], dtype=tl.float32))
    tl.debug_barrier()
    for s0 in range(0, num_samples, BLOCK_W):
        s = s0 + offs
        ramp = tl.math.div_rn(s.to(tl.float32), last)  # s / (S - 1), rounded once (reference: sample_ramp)
        target = first + (1.0 - first) * ramp  # compiled without FMA contraction: rounded as torch rounds it
        below = _count_below(work, target, patches, LOG_W)
        # fp32 distances fall towards the target and rise after it: the minimum is at a neighbour, and argmin's
        # first-of-equals is the first below-target value as near as the left neighbour, else the right one.
        left = tl.load(work + below - 1, mask=below > 0, other=float("-inf"))
        right = tl.load(work + below, mask=below < patches, other=float("inf"))
        near = target - left
        use_left = (below > 0) & (near <= right - target)
        pick = tl.where(use_left, _first_as_near(work, target, below, near, LOG_W), below)
        tl.store(work + BLOCK_W + pick, tl.full([BLOCK_W], 1.0, tl.float32), mask=(s < num_samples) & (patches > 0))
    tl.debug_barrier()
    chosen = tl.load(work + BLOCK_W + offs)
    chosen = (chosen != 0) & valid
    sampled = tl.sum(chosen.to(tl.int32), 0)
    extra = tl.minimum(min_keep, patches) - sampled
    keep = chosen
    if extra > 0:  # the floor: the best unsampled patches by (descending score, row); the extra-th key is the cut
        top = tl.where(valid & ~chosen, ((0x7FFFFFFF - sorted_bits) << 32) | pos.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
        cut = tl.sum(tl.where(offs == extra - 1, tl.sort(top), 0), 0)
        keep = keep | (top <= cut)
    tl.store(KEEP + start + pos, (keep | (pos < num_prefix)).to(tl.int8), mask=pos < length)
    for r in range(start + BLOCK_W, end, BLOCK_W):  # an image longer than the bound: its tail is dropped
        tl.store(KEEP + r + offs, tl.zeros([BLOCK_W], dtype=tl.int8), mask=r + offs < end)
    tl.store(KEPT + b, tl.minimum(num_prefix, length) + sampled + tl.maximum(extra, 0))


_sample_launcher = CompiledLauncher(_sample_kernel)


def _sample_shape(max_seqlen: int) -> tuple[int, int]:
    """``BLOCK_W`` (rows of an image in registers, also the targets per step) and its log2 for a bound."""
    width = next_power_of_2(max(max_seqlen, 16))
    return width, width.bit_length() - 1


def _sample(logits, squares, scores, cu, max_seqlen, num_samples, min_keep, num_prefix, *, from_logits, sample,
            work=None, heads=None):  # fmt: skip
    """The sampling kernel's launch; ``work`` and ``heads`` for flat scratch views (``_select``)."""
    total = scores.shape[0]
    heads = logits.shape[1] if heads is None else heads
    batch = cu.shape[0] - 1
    device = scores.device
    width, log_w = _sample_shape(max_seqlen)
    keep = torch.empty(total, dtype=torch.bool, device=device) if sample else scores
    kept = torch.empty(batch, dtype=torch.int32, device=device) if sample else cu
    if work is None:
        work = torch.empty(batch, 2, width, dtype=torch.float32, device=device) if sample else scores
    args = (
        logits, squares, scores, work, cu, keep.view(torch.int8) if sample else keep, kept, total, num_samples,
        min_keep, num_prefix, heads, from_logits, sample, width, next_power_of_2(heads), log_w,
    )  # fmt: skip
    key = (heads, from_logits, sample, width) if aligned(logits, squares, scores, work, cu, keep, kept) else None
    _sample_launcher(key, scores.get_device(), (batch, 1), args, num_warps=8, num_stages=1, enable_fp_fusion=False)
    return keep, kept


def _check_sampling(cu_seqlens, total, device, max_seqlen, num_samples, min_keep, num_prefix, check_values):
    cu = check_cu_seqlens(cu_seqlens, total=total, device=device, check_values=check_values)
    check_max_seqlen(max_seqlen)
    check_int(num_samples, "num_samples", 1)
    check_int(min_keep, "min_keep", 0)
    check_int(num_prefix, "num_prefix", 1)  # the class token's row is the query
    return cu


def ats_scores(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    scale: float,
    max_seqlen: int,
    *,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> torch.Tensor:
    """ATS's normalised significance of every row from a block's qkv projection: fp32 ``[T]``, 0 on prefix rows.

    The kernels' twin of ``significance(cls_attention(q, k, cu, scale), v, cu)``
    (:mod:`ragged_vit.reference.pruners.ats`).

    Args:
        qkv: ``[T, 3*H*D]`` packed qkv projection (timm's layout: q heads, k heads, v heads), contiguous rows.
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        num_heads: ``H``.
        scale: softmax scale of the attention logits.
        max_seqlen: a bound on the image lengths (an image longer than it is scored on its first rows only).
        num_prefix: prefix rows of every image (the class token first: its row is the query), never scored.
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).
    """
    heads, _ = check_qkv(qkv, num_heads, scale)
    total = qkv.shape[0]
    cu = _check_sampling(cu_seqlens, total, qkv.device, max_seqlen, 1, 0, num_prefix, check_values)
    logits, squares = cls_attention_logits(qkv, cu, heads, scale, max_seqlen, values=True)
    scores = torch.empty(total, dtype=torch.float32, device=qkv.device)
    _sample(logits, squares, scores, cu, max_seqlen, 1, 0, num_prefix, from_logits=True, sample=False)
    return scores


def ats_keep(
    scores: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_samples: int,
    min_keep: int = 8,
    *,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ATS's keep mask from normalised scores: one launch, no host synchronisation.

    The kernel's twin of :func:`ragged_vit.reference.pruners.ats.sample_keep` (see the module docstring for where the
    two may differ).

    Args:
        scores: fp32 ``[T]`` non-negative patch scores (prefix rows are ignored).
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        max_seqlen: a bound on the image lengths: rows of an image past it are never kept.
        num_samples: CDF targets per image.
        min_keep: patches every image keeps at least (or all it has).
        num_prefix: prefix rows of every image (at least the class token), always kept.
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).

    Returns:
        ``keep`` bool ``[T]`` (every image's prefix rows True) and ``kept`` int32 ``[B]``, the rows each image keeps
        (prefix rows included).
    """
    check_tensor(scores, "scores", ndim=1, dtypes=(torch.float32,))
    if not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous, got strides {scores.stride()}")
    cu = _check_sampling(
        cu_seqlens, scores.shape[0], scores.device, max_seqlen, num_samples, min_keep, num_prefix, check_values
    )
    none = scores.new_empty(0, 1)  # no logits, no squares of values: the kernel reads the scores
    return _sample(none, scores, scores, cu, max_seqlen, num_samples, min_keep, num_prefix, from_logits=False,
                   sample=True)  # fmt: skip


def ats_select(pruner: ATSPruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)`` from the stage block's qkv projection (``inp.qkv``, contiguous rows), in two launches: the
    same :class:`TokenSelection` (up to the CDF rounding described above), kept counts included.

    ``inp.row_bound`` bounds every image's rows (rows past it are never kept); a tighter bound than an unpruned
    image (e.g. after an earlier ATS stage: :meth:`ATSPruner.max_count_after`) narrows the sampling kernel's tile.
    """
    if not isinstance(pruner, ATSPruner):
        raise TypeError(f"pruner must be an ATSPruner, got {type(pruner).__name__}")
    inp = pruner.check_input(inp)
    check_qkv_input(inp, "ATS")
    return _select(pruner, inp)


@register_decision(ATSPruner)
def _select(pruner: ATSPruner, inp: DecisionInput) -> TokenSelection:
    """:func:`ats_select` on checked input: the fused decision the pipelines look up."""
    qkv, cu, bound = inp.qkv, inp.cu_seqlens, inp.row_bound
    samples = pruner.samples(inp.num_patches)
    # The fp32 scratch (logits, squared values, scores, the sampler's work) in one allocation
    cells, batch = qkv.shape[0] * inp.num_heads, cu.shape[0] - 1
    lengths = (cells, cells, qkv.shape[0], batch * 2 * _sample_shape(bound)[0])
    logits, squares, scores, work = scratch(lengths, torch.float32, qkv.device)
    cls_attention_logits(
        qkv, cu, inp.num_heads, inp.scale, bound, values=True, out=(logits, squares), rotary=inp.rotary
    )
    keep, kept = _sample(logits, squares, scores, cu, bound, samples, pruner.min_keep, inp.num_prefix,
                         from_logits=True, sample=True, work=work, heads=inp.num_heads)  # fmt: skip
    return TokenSelection(keep, kept)
