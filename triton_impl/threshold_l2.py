"""Threshold-L2's keep decision in one Triton kernel (the reference: ``reference/pruners/threshold_l2.py``).

The reference ranks every patch inside its image with two stable argsorts over the packed rows, then compares
ranks and scores; on a GPU that is ~40 small kernels (sorts, scans, gathers, comparisons): ~60-140 us of a
graphed DeiT-B forward at batch 1-4 on an H200, more than the attention itself. Here programs of 16 rows each rank
their image's patches by counting, for each patch, the patches that beat it (higher score, or the same score and an
earlier row: the reference's tie rule; NaN beats every number, as in ``torch.sort``), and write the keep mask
and add to the image's kept count (integer atomics: order-free). ``N`` patches cost ``N^2`` comparisons in 16x64
tiles, nothing next to a GEMM; one program per image took 14 us at B=4 on an H200, too serial.

Same decisions as :class:`ragged_vit.reference.pruners.ThresholdL2Pruner`, bit for bit: the scores come from the same
function (:func:`ragged_vit.reference.pruners.threshold_l2.l2_scores`), the ratio count ``ceil(rate * patches)`` is
computed in float64 from the exact bits of ``rate``, and the threshold is compared in float32, as torch
compares a float32 tensor with a Python float.

:func:`threshold_l2_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on
CUDA (:mod:`ragged_vit.core.decisions`), which the pipelines use.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ragged_vit.core.decisions import register_decision
from ragged_vit.core.segments import uniform_length
from ragged_vit.core.selection import DecisionInput, TokenSelection
from ragged_vit.core.validation import check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from ragged_vit.reference.pruners.threshold_l2 import ThresholdL2Pruner, l2_scores
from ragged_vit.triton_impl.launcher import CompiledLauncher

_BLOCK_I = 16  # rows ranked per step: a DeiT image spreads over 13 programs, so batch 1-4 fills the card
_BLOCK_J = 64  # rows compared against per step


@triton.jit
def _beats(s_j, s_i, j, i):
    """Whether score ``s_j`` (row ``j``) ranks before ``s_i`` (row ``i``): descending, NaN first, ties by row."""
    nan_j = s_j != s_j
    nan_i = s_i != s_i
    greater = (s_j > s_i) | (nan_j & ~nan_i)
    same = (s_j == s_i) | (nan_j & nan_i)
    return greater | (same & (j < i))


@triton.jit(do_not_specialize=["total", "rate_bits", "threshold", "min_keep", "num_prefix"])
def _keep_kernel(
    SCORES, CU, KEEP, KEPT, total, rate_bits, threshold, min_keep, num_prefix,
    RATIO: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    # Offsets clamped to [0, total]: malformed cu_seqlens cannot read or write out of bounds.
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    first = tl.minimum(start + num_prefix, end)  # the image's first patch row, after its prefix rows
    patches = end - first
    if RATIO:
        rate = rate_bits.to(tl.float64, bitcast=True)
        k = tl.math.ceil(patches.to(tl.float64) * rate).to(tl.int32)
    else:
        k = min_keep
    offs_i = tl.arange(0, BLOCK_I)
    offs_j = tl.arange(0, BLOCK_J)
    kept = tl.where(tl.program_id(1) == 0, first - start, 0)  # the prefix rows, counted once
    # Grid-stride loop over this image's row blocks: the grid's second axis is only a bound on the work.
    for i0 in range(first + tl.program_id(1) * BLOCK_I, end, tl.num_programs(1) * BLOCK_I):
        i = i0 + offs_i
        in_i = i < end
        s_i = tl.load(SCORES + i, mask=in_i, other=0.0)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(first, end, BLOCK_J):
            j = j0 + offs_j
            in_j = j < end
            s_j = tl.load(SCORES + j, mask=in_j, other=0.0)
            better = _beats(s_j[None, :], s_i[:, None], j[None, :], i[:, None]) & in_j[None, :]
            rank += tl.sum(better.to(tl.int32), axis=1)
        keep = rank < k
        if not RATIO:
            keep = keep | (s_i >= threshold)
        tl.store(KEEP + i, keep.to(tl.int8), mask=in_i)
        kept += tl.sum((keep & in_i).to(tl.int32), 0)
    if tl.program_id(1) == 0:
        for r0 in range(start, first, BLOCK_I):
            tl.store(KEEP + r0 + offs_i, tl.full([BLOCK_I], 1, tl.int8), mask=r0 + offs_i < first)
    tl.atomic_add(KEPT + b, kept)  # integer adds: the same total in any order


_launcher = CompiledLauncher(_keep_kernel)


def _float_bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as a signed int64 (the kernel bitcasts them back)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def threshold_l2_keep(
    scores: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    rate: float | None = None,
    threshold: float | None = None,
    min_keep: int = 0,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep mask of Threshold-L2 from per-row scores: one launch, no host synchronisation.

    Args:
        scores: fp32 ``[T]`` patch scores (prefix rows are never scored: their values are ignored).
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        max_seqlen: a bound on the image lengths that sizes the grid (an underestimate is slower, never wrong).
        rate: ``ratio`` mode: keep the top ``ceil(rate * patches)`` patches of each image.
        threshold: ``threshold`` mode: keep patches with ``score >= threshold``, and at least the ``min_keep``
            best (give exactly one of ``rate`` and ``threshold``).
        min_keep: the floor of ``threshold`` mode.
        num_prefix: prefix rows at the start of every image (class, distillation, register tokens), always kept.
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).

    Returns:
        ``keep`` bool ``[T]`` (every image's prefix rows True) and ``kept`` int32 ``[B]``, the rows each image keeps
        (prefix rows included).
    """
    check_tensor(scores, "scores", ndim=1, dtypes=(torch.float32,))
    check_cu_seqlens(cu_seqlens, total=scores.shape[0], device=scores.device, check_values=check_values)
    if (rate is None) == (threshold is None):
        raise ValueError(f"give exactly one of rate and threshold, got rate={rate!r}, threshold={threshold!r}")
    if rate is not None and not (isinstance(rate, float) and 0.0 < rate <= 1.0):
        raise ValueError(f"rate must be a float in (0, 1], got {rate!r}")
    if threshold is not None and not isinstance(threshold, float):
        raise TypeError(f"threshold must be a float, got {type(threshold).__name__}")
    check_int(min_keep, "min_keep", 0)
    check_int(num_prefix, "num_prefix", 0)
    check_max_seqlen(max_seqlen)
    if not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous, got strides {scores.stride()}")
    return _keep(scores, cu_seqlens, max_seqlen, rate, threshold, min_keep, num_prefix)


def _keep(
    scores: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    rate: float | None,
    threshold: float | None,
    min_keep: int,
    num_prefix: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`threshold_l2_keep` on checked arguments."""
    total, batch = scores.shape[0], cu.shape[0] - 1
    keep = torch.empty(total, dtype=torch.bool, device=scores.device)
    kept = torch.zeros(batch, dtype=torch.int32, device=scores.device)
    ratio = rate is not None
    args = (
        scores, cu, keep.view(torch.int8), kept, total,
        _float_bits(rate) if ratio else 0, 0.0 if ratio else threshold, min_keep, num_prefix, ratio, _BLOCK_I,
        _BLOCK_J,
    )  # fmt: skip
    aligned = scores.is_cuda and all(t.data_ptr() % 16 == 0 for t in (scores, cu, keep, kept))
    grid = (batch, triton.cdiv(max(max_seqlen - num_prefix, 1), _BLOCK_I))
    _launcher((ratio,) if aligned else None, scores.get_device(), grid, args, num_warps=4, num_stages=1)
    return keep, kept


def threshold_l2_select(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)`` through :func:`threshold_l2_keep`: the same :class:`TokenSelection`, kept counts included."""
    if not isinstance(pruner, ThresholdL2Pruner):
        raise TypeError(f"pruner must be a ThresholdL2Pruner, got {type(pruner).__name__}")
    return _select(pruner, pruner.check_input(inp))


@register_decision(ThresholdL2Pruner)
def _select(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """:func:`threshold_l2_select` on checked input: the fused decision the pipelines look up."""
    scores, cu, prefix = l2_scores(inp.x), inp.cu_seqlens, inp.num_prefix
    if pruner.mode == "ratio":
        keep, kept = _keep(scores, cu, inp.row_bound, pruner.rate, None, 0, prefix)
        current = uniform_length(cu, inp.x.shape[0])
        count = None if current is None else prefix + pruner.count_after(inp.stage, current - prefix, inp.num_patches)
        return TokenSelection(keep, kept, fixed_count=count is not None, count=count)
    floor = max(pruner.min_keep, inp.min_patches)
    keep, kept = _keep(scores, cu, inp.row_bound, None, pruner.threshold, floor, prefix)
    return TokenSelection(keep, kept)
