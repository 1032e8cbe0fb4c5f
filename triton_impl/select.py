"""Per-image top-k selection by rank, in one Triton kernel: the reference is
:func:`ragged_vit.core.segments.segment_rank` (descending score, ties to the earlier row, NaN first as in
``torch.sort``; prefix rows never ranked, always kept).

The reference ranks every patch inside its image with two stable argsorts over the packed rows, then compares ranks;
on a GPU that is ~40 small kernels (sorts, scans, gathers, comparisons): more of a graphed DeiT-B forward at batch
1-4 than the attention itself (``docs/tuning.md#rank-select-kernel``). Here programs of 16 rows each rank their
image's patches by counting, for each patch, the patches that beat it, and write the keep mask; the image's kept
count is ``min(k, patches)`` plus its prefix rows, written by its first program (the ranks are a permutation),
except in the threshold mode, where every program adds its kept rows to it (integer atomics: order-free). ``N``
patches cost ``N^2`` comparisons in 16x64 tiles, nothing next to a GEMM; one program per image was too serial
(``docs/tuning.md#rank-select-kernel``).

Three ways to choose ``k``, each a pruner's rule: ``rate`` keeps ``ceil(rate * patches)`` (Threshold-L2 ratio, EViT;
computed in float64 from the exact bits of ``rate``, as the reference's ``ceil_rate``), ``count`` keeps
``min(count, patches)`` (DynamicViT), ``threshold`` keeps ``score >= threshold`` and at least the ``min_keep`` best
(Threshold-L2 threshold / calibrated; compared in float32, as torch compares a float32 tensor with a Python float).
The fused decisions (:mod:`ragged_vit.triton_impl.threshold_l2`, ...) call :func:`rank_keep_unchecked`.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ..core.validation import check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from .launcher import CompiledLauncher, aligned, cdiv

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
    RATIO: tl.constexpr, THRESHOLD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
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
        k = min_keep  # the count, or the threshold's floor
    offs_i = tl.arange(0, BLOCK_I)
    offs_j = tl.arange(0, BLOCK_J)
    kept = tl.where(tl.program_id(1) == 0, first - start, 0)  # threshold mode: the prefix rows, counted once
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
        if THRESHOLD:
            keep = keep | (s_i >= threshold)
            kept += tl.sum((keep & in_i).to(tl.int32), 0)
        tl.store(KEEP + i, keep.to(tl.int8), mask=in_i)
    if tl.program_id(1) == 0:
        for r0 in range(start, first, BLOCK_I):
            tl.store(KEEP + r0 + offs_i, tl.full([BLOCK_I], 1, tl.int8), mask=r0 + offs_i < first)
    if THRESHOLD:
        tl.atomic_add(KEPT + b, kept)  # integer adds: the same total in any order
    elif tl.program_id(1) == 0:  # the ranks are a permutation: exactly min(k, patches) of them are below k
        tl.store(KEPT + b, first - start + tl.minimum(tl.maximum(k, 0), patches))


_launcher = CompiledLauncher(_keep_kernel)


def _float_bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as a signed int64 (the kernel bitcasts them back)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def rank_keep(
    scores: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    rate: float | None = None,
    count: int | None = None,
    threshold: float | None = None,
    min_keep: int = 0,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's top patches by score: one launch, no host synchronisation.

    Args:
        scores: fp32 ``[T]`` patch scores (prefix rows are never ranked: their values are ignored).
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        max_seqlen: a bound on the image lengths that sizes the grid (an underestimate is slower, never wrong).
        rate: keep the top ``ceil(rate * patches)`` patches of each image.
        count: keep the top ``min(count, patches)``.
        threshold: keep patches with ``score >= threshold``, and at least the ``min_keep`` best. Give exactly one
            of ``rate``, ``count`` and ``threshold``.
        min_keep: the floor of ``threshold`` mode.
        num_prefix: prefix rows at the start of every image (class, distillation, register tokens), always kept.
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).

    Returns:
        ``keep`` bool ``[T]`` (every image's prefix rows True) and ``kept`` int32 ``[B]``, the rows each image keeps
        (prefix rows included).
    """
    check_tensor(scores, "scores", ndim=1, dtypes=(torch.float32,))
    check_cu_seqlens(cu_seqlens, total=scores.shape[0], device=scores.device, check_values=check_values)
    if sum(mode is not None for mode in (rate, count, threshold)) != 1:
        raise ValueError(
            f"give exactly one of rate, count and threshold, got rate={rate!r}, count={count!r}, "
            f"threshold={threshold!r}"
        )
    if rate is not None and not (isinstance(rate, float) and 0.0 < rate <= 1.0):
        raise ValueError(f"rate must be a float in (0, 1], got {rate!r}")
    if count is not None:
        check_int(count, "count", 0)
    if threshold is not None and not isinstance(threshold, float):
        raise TypeError(f"threshold must be a float, got {type(threshold).__name__}")
    check_int(min_keep, "min_keep", 0)
    check_int(num_prefix, "num_prefix", 0)
    check_max_seqlen(max_seqlen)
    if not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous, got strides {scores.stride()}")
    return rank_keep_unchecked(scores, cu_seqlens, max_seqlen, rate, count, threshold, min_keep, num_prefix)


def rank_keep_unchecked(
    scores: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    rate: float | None,
    count: int | None,
    threshold: float | None,
    min_keep: int,
    num_prefix: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rank_keep` without its checks (all arguments positional, exactly one mode given), for the fused
    decisions, which built their input themselves."""
    total, batch = scores.shape[0], cu.shape[0] - 1
    keep = torch.empty(total, dtype=torch.bool, device=scores.device)
    ratio, by_threshold = rate is not None, threshold is not None
    # Only the threshold's counts are summed by the programs (atomics on zeros); the others are written once.
    kept = (torch.zeros if by_threshold else torch.empty)(batch, dtype=torch.int32, device=scores.device)
    args = (
        scores, cu, keep.view(torch.int8), kept, total, _float_bits(rate) if ratio else 0,
        threshold if by_threshold else 0.0, count if count is not None else min_keep, num_prefix, ratio, by_threshold,
        _BLOCK_I, _BLOCK_J,
    )  # fmt: skip
    is_aligned = aligned(scores, cu, keep, kept)
    grid = (batch, cdiv(max(max_seqlen - num_prefix, 1), _BLOCK_I))
    key = (ratio, by_threshold) if is_aligned else None
    _launcher(key, scores.get_device(), grid, args, num_warps=4, num_stages=1)
    return keep, kept
