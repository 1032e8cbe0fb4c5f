"""ToMe's merge in sync-free Triton kernels: the bipartite matching and the size-weighted merge, beside their
reference :mod:`ragged_vit.reference.merging` (the rule: ``docs/tome.md``).

:func:`decide_merges` (the reference's ``decide_merges`` without the sizes, which only the merge needs) is three
launches in the fixed mode and four in the adaptive one, each spread over as many programs as its work allows (one
program per image doing everything is L1-bound on one SM: ``docs/tuning.md#tome-decision-split``):

1. ``_metric_kernel`` (grid ``(B, cdiv(n, 256 / D))``): the metric of every row (the keys summed over
   heads in head order, every head's load in flight at once, divided by ``H``, then by the L2 norm clamped to
   ``1e-12``: ``F.normalize``; fp32, divisions and square root correctly rounded) into a ``[T, D]`` fp32 scratch.
   Every row's metric comes from the same tile shape, so equal keys give equal metrics, bit for bit.
2. ``_best_kernel`` (grid ``(B, cdiv(n / 2, 16))``: an image and 16 of its A rows, 32 once the programs no
   longer fit on the SMs at once): each A row's best B row,
   by ``tl.dot`` of fp32 metric tiles (IEEE fp32, not TF32) against B tiles of up to 64 rows in order, the first
   maximum winning (the lowest B index); its similarity's bits and the B index into a ``[4, T]`` int32 scratch.
3. ``_match_kernel`` (grid ``(B, cdiv(n, S))``: an image and ``S`` of its rows, 32, 64 or 128, the least whose
   programs all fit on the SMs at once): each A row's rank among its image's A rows, by counting those that beat it
   (a higher best similarity, or an equal one and a lower index: the reference's stable descending sort), the merged
   ones, of rank ``< min(limit, patches // 2)`` (and best ``>= threshold`` in the adaptive mode), with their running
   count and ranks; then every row's destination (an image of up to 1024 rows in one step): the prefix rows, the
   other unmerged A rows, the other B rows, a merged A row where its B row goes; then the *source lists*
   (``MergeSelection.sources``, :func:`ragged_vit.reference.merging.merge_sources`): the rows grouped by
   destination, in row order inside a group, and where each group starts, by counting the merged A rows sent below
   or beside each row (``[S, 64]`` tiles of rows against A rows). Every program of an image ranks and writes all
   its destinations (the same values; the source lists read every merged A row's), then lists its own rows: the
   image's longest serial phase spread over programs. In the fixed mode the counts are the rule's,
   ``n - min(r, patches // 2)`` from the lengths alone, so each program also computes its image's offset in the
   merged buffer from every image's length, writes its destinations and group starts final and its entry of
   ``cu_seqlens``.
4. adaptive mode only: ``_offset_kernel`` (grid ``(B,)``) adds to each image's destinations the rows the images
   before it keep (their counts, from launch 3), moves its group starts to their merged rows and writes the merged
   ``cu_seqlens``.

:func:`merge_rows` is one launch, ``_merge_kernel`` (grid ``(cdiv(capacity, 8), cdiv(C, 128))``: 8 rows of the
merged buffer, 128 channels, grid-stride up to ``T' = merged_cu_seqlens[B]``): each merged row reads its group of
sources from the source lists (derived from the map by a stable sort when the caller has none), gathers them in row
order (the k-th source of every row at a time), sums ``size * x`` in fp32 and the sizes in their integer dtype,
divides (correctly rounded) and writes the quotient in ``x``'s dtype; a row that receives a single row is that row,
bit for bit, whatever its size (as in the reference, whose float64 products are exact); for the pipelines' merge
stage it also writes ``log(size)`` of every merged row (float64, rounded once to fp32: the key bias of the blocks
after it, as the reference rounds it), so no separate launch computes it. No atomics: every row's sum runs in row
order, so the same bits on every run, eager or replayed from a CUDA graph, whatever the tile sizes. (It searched the
destination map before, a ``[16, 64]`` match per step of the image's rows: at large batches slower than the whole
decision; ``docs/tuning.md#tome-source-lists``.)

The same launch can take in the two launches around the merge in a ToMe block, each switched by a constexpr (off,
the kernel and its tiling are the above, instruction for instruction): with ``residual`` every source row is
``x + residual`` (the attention's residual add: summed in fp32, rounded once to ``x``'s dtype, ``torch.add``'s
bits) before it is weighted, so the merged rows are the merged residual stream; with ``normed`` it also writes the
LayerNorm (the MLP's ``norm2``) of every merged row as stored in ``x``'s dtype, what ``F.layer_norm(out)`` reads.
The LayerNorm holds whole rows: ``_NORM_ROWS = 1`` merged row of ``next_power_of_2(C)`` channels per step (grid
``(capacity, 1)``; DeiT-B: 1,024 fp32 lanes, 8 a thread in 4 warps).

The rules (``tests/test_triton_merging.py``):

* the destination map is int32 (as ``cu_seqlens``: ``T < 2**31``; half the bytes), not the reference's int64;
  :func:`merge_rows` takes either;
* decisions: every similarity is computed in fp32 as the reference computes it, but summed in another order (the
  head sum, the norm, the dot products), so it may differ from the reference's by a few units of fp32's last place.
  Where the reference's margins are clear (each merged A row's best B row ahead of every other B row by more than
  that, the merged A rows ahead of the unmerged ones, every best similarity away from the threshold) the merges are
  the reference's, bit for bit. Exact ties are broken by index as in the reference: equal keys give equal metrics
  and equal similarities, bit for bit, and so do similarities that are exact in fp32 (dyadic unit vectors). Where
  two different pairs of vectors are equally similar in exact arithmetic only (e.g. two vectors' similarities to
  themselves, both 1 up to rounding), either side may round either above: a near-tie, decided as the rounding
  falls. The threshold is compared in fp32, as the reference compares it (clamped to ``[-2, 2]`` first, which
  changes no comparison);
* counts: the fixed mode's are the rule's whatever the keys; the adaptive mode's count the merged rows;
* merged rows: the reference sums in float64 and rounds once; here a row of ``k`` sources is within
  ``(k + 1) * 2**-24 * sum(size * |x|) / sum(size)`` of the exact average in fp32, then rounded once to ``x``'s
  dtype. Where every partial sum is exact in fp32 (small integer sizes, dyadic rows) the row is the reference's
  rounded to ``x``'s dtype, bit for bit (the quotient is correctly rounded both ways, and rounding float64 to fp32
  gives fp32's correctly rounded quotient);
* fused residual add: a source row is ``torch.add(x, residual)``'s row bit for bit, so the merged rows are those of
  ``x + residual`` merged alone, bit for bit, and a row that receives a single row is ``(x + residual)[row]``;
* fused LayerNorm: from the merged row ``v`` as stored (rounded to ``x``'s dtype), in fp32: ``mean`` over ``C``,
  the biased variance (mean of ``(v - mean)**2``), ``rstd = 1 / sqrt(var + eps)`` (division and square root
  correctly rounded), ``(v - mean) * rstd * weight + bias`` (weight 1 and bias 0 when absent), rounded once to
  ``x``'s dtype. Against ``F.layer_norm`` of the same rows in fp32 it is within ``eps * |want|`` of ``x``'s dtype
  (its rounding) plus ``16 * 2**-24 * ((|xhat| + mean(|v|) * rstd) * |weight| + |bias|)`` (fp32 sums in another
  order; ``xhat = (v - mean) * rstd``) plus half a subnormal step. It depends on the stored row only: the same bits
  with or without the residual add for the same merged rows;
* isolation: an image's decisions, count, destinations relative to its offset and merged rows depend on its own
  rows only, bit for bit.

No host reads: ``max_seqlen`` (a host bound on every image's rows) sizes tiles and grids only; an underestimate is
slower, never wrong. ``T'`` is not known on the host: :func:`merge_rows` writes rows ``[0, T')`` of a buffer of
``capacity`` rows (default ``T``, always enough) and leaves the rest as allocated, in its ``normed`` rows too (read
``merged_cu_seqlens[-1]`` for ``T'`` where it matters). No zero-fills: every output is written by the kernels.

Cost: what each kernel costs and why the launches and tiles are what they are is in ``docs/tuning.md`` (its ToMe
sections, from ``#tome-decision-split``). The similarity tiles stay fp32: fp16/TF32 tiles would lose the fp32
exactness above.

Not supported: fp64 (the reference's fp64 metric and float64 sums); non-finite keys (the reference refuses them;
here a NaN best similarity ranks last, as ``-inf``, and the map stays valid: every destination inside its image's
merged rows, the fixed counts the rule's); maps that break :func:`merge_rows`'s contract are not detected (a row
sent outside its image's merged rows joins the group of the row it names, one sent past ``T'`` is ignored, a merged
row that receives no row is zeros of size 0).
The pipelines' merge stage (:class:`ragged_vit.reference.pruners.ToMeMerger`, registered below) runs on these kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import triton
import triton.language as tl

from ..core.decisions import register_decision
from ..core.selection import DecisionInput, MergeSelection
from ..core.validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from ..reference.merging import check_merge_mode, check_sizes, merge_sources
from ..reference.pruners.tome import ToMeMerger, fixed_count
from .cls_attention import image_rows
from .launcher import (
    CompiledLauncher,
    aligned,
    cdiv,
    int_spec,
    next_power_of_2,
    pdl_supported,
    scratch,
)
from .pack import store_total_and_longest

# Keys per head of one metric step (DeiT-B: 4 rows of 64), every head loaded at once: the fastest decision of the
# sizes swept (docs/tuning.md#tome-metric-tile)
_METRIC_ELEMENTS = 256
_MAX_BLOCK_DST = 1024  # rows per step of the destinations (an image's rows in one step up to this)
# A rows per tile of the match's rank and source lists (DeiT-B's 98 in 2 tiles)
_BLOCK_AB = 64
_MAX_HEAD_DIM = 256  # D of one metric tile in registers
# Merged rows per step of the merge: the fastest of the sizes swept (docs/tuning.md#tome-merge-rows)
_BLOCK_D = 8
# Rows per program of the source lists (against _BLOCK_AB A rows): the smallest of these whose programs all fit on the
# SMs at once (_list_rows); every program of an image also ranks its A rows and writes all its destinations.
_LIST_ROWS = (32, 64, 128)
# The SMs the interpreter assumes (those of the SM90 cards the tiles were chosen on, so the CPU twins run the GPU's
# tiles: docs/tuning.md#tome-one-wave-tiles)
_INTERPRETER_SMS = 132
_BLOCK_C = 128  # channels per program of the merge (DeiT-B: 6)
# Merged rows per step when the merge also writes their LayerNorm (whole rows: next_power_of_2(C) channels, one
# program column): 1 row of DeiT-B's 768 channels is 1,024 fp32 lanes, 8 a thread in 4 warps: faster than 2 rows a
# program, with the same logits bit for bit (docs/tuning.md#tome-merge-layernorm-rows)
_NORM_ROWS = 1
# Channels of the fused LayerNorm's whole-row tiles at most: up to 2048 no spills (ptxas -v for sm_90a: 234 registers at
# ViT-H's 1280), at 8192 ~10 kB of spills a thread, correct but slow; wider rows take a separate LayerNorm
_MAX_NORM_CHANNELS = 8192
# A rows and warps per program of the best-match search: the first tile whose programs all run at once
# (_best_tile), else the last; and its B rows per tile, at most _BEST_B_ELEMENTS fp32 a tile (DeiT-B's 98 B rows in
# one tile of 128 for D = 64): a faster decision than the fixed tiles before it (docs/tuning.md#tome-best-match-tiles).
_BEST_TILES = ((16, 2), (32, 4), (64, 8))
_BEST_B_ELEMENTS = 8192
_NUM_WARPS = 4
_MATCH_WARPS = 8  # the match kernel: one program per image (8 warps: faster than 4, docs/tuning.md#tome-match-warps)

DECISION_PDL_MAX_IMAGES = 1
"""Batches of at most this many images launch the best match and the match with programmatic dependent launch where
the GPU and Triton allow it (:func:`ragged_vit.triton_impl.launcher.pdl_supported`): each may start while the kernel
before it runs (the metric and the best match let it at once) and waits for it before any memory access, so the
results are the same bits; it saves the launch gaps between the decision's three dependent kernels, but the early
programs hold SM slots while they wait: a gain for one image, a loss from two up (the waiting programs crowd the
attention the decision runs beside, or the decision's own later programs; ``docs/tuning.md#tome-decision-pdl``)."""


@triton.jit
def _image_sets(CU, b, total, num_prefix, limit):
    """Image ``b``'s rows (the split alternates over all of them: A rows ``start + 2i``, B rows ``start + 2j + 1``),
    the sizes of A and B, its cap ``min(limit, patches // 2)``, its protected A and B rows (the first ``a0`` and
    ``b0``: prefix rows) and its prefix rows."""
    start, end = image_rows(CU, b, total)
    first = tl.minimum(start + num_prefix, end)
    prefix = first - start
    num_a = (end - start + 1) // 2
    num_b = (end - start) // 2
    a0 = (prefix + 1) // 2
    b0 = prefix // 2
    return start, end, num_a, num_b, tl.minimum(limit, (end - first) // 2), a0, b0, prefix


@triton.jit(do_not_specialize=["total", "limit", "num_prefix"])
def _metric_kernel(
    KEYS, CU, METRIC, total, stride_kt, stride_kh, stride_kd, limit, num_prefix,
    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The metric of every row of images that merge: the keys' mean over heads, L2-normalised (F.normalize:
    eps 1e-12), fp32, into ``METRIC [T, D_PAD]``; a program per image and ``BLOCK_M`` rows (grid-stride). With
    ``PDL`` it lets the best match (launched with PDL) start at once: that waits for this kernel before any access."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    start, end, num_a, num_b, cap, a0, b0, prefix = _image_sets(CU, b, total, num_prefix, limit)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    if cap > 0:
        for r0 in range(start + tl.program_id(1) * BLOCK_M, end, tl.num_programs(1) * BLOCK_M):
            rows = r0 + offs_m
            mask = (rows < end)[:, None] & (offs_d < D)[None, :]
            keys = KEYS + rows.to(tl.int64)[:, None] * stride_kt + offs_d[None, :] * stride_kd
            acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
            for h in tl.static_range(H):  # unrolled: every head's load in flight at once, summed in head order
                acc += tl.load(keys + h * stride_kh, mask=mask, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(acc, tl.full([BLOCK_M, D_PAD], H, tl.float32))
            norm = tl.maximum(tl.sqrt_rn(tl.sum(mean * mean, 1)), 1e-12)
            metric = tl.math.div_rn(mean, norm[:, None])
            tl.store(METRIC + rows.to(tl.int64)[:, None] * D_PAD + offs_d[None, :], metric, mask=(rows < end)[:, None])


@triton.jit(do_not_specialize=["total", "limit", "num_prefix"])
def _best_kernel(
    CU, METRIC, WORK, total, limit, num_prefix,
    D_PAD: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Each A row's best B row: the first maximum over B tiles in order, the lowest index inside a tile; a program
    per image and ``BLOCK_A`` A rows (grid-stride). Writes the best similarity's bits and the B index to ``WORK``.
    With ``PDL`` (launched with PDL) it first waits for the kernel before it, then lets the match start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    start, end, num_a, num_b, cap, a0, b0, prefix = _image_sets(CU, b, total, num_prefix, limit)
    BEST = WORK + start
    MATCH = WORK + total + start
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, D_PAD)
    if cap > 0:
        for i0 in range(tl.program_id(1) * BLOCK_A, num_a, tl.num_programs(1) * BLOCK_A):
            i = i0 + offs_a
            in_a = i < num_a
            rows_a = (start + 2 * i).to(tl.int64)
            metric_a = tl.load(METRIC + rows_a[:, None] * D_PAD + offs_d[None, :], mask=in_a[:, None], other=0.0)
            best = tl.full([BLOCK_A], float("-inf"), tl.float32)
            match = tl.zeros([BLOCK_A], dtype=tl.int32)
            for j0 in range(0, num_b, BLOCK_B):
                j = j0 + offs_b
                in_b = j < num_b
                rows_b = (start + 2 * j + 1).to(tl.int64)
                metric_bt = tl.load(METRIC + rows_b[None, :] * D_PAD + offs_d[:, None], mask=in_b[None, :], other=0.0)
                sim = tl.dot(metric_a, metric_bt, input_precision="ieee")  # [A, B] cosine similarities
                sim = tl.where((in_b & (j >= b0))[None, :], sim, float("-inf"))  # a protected B row: no destination
                tile_best = tl.max(sim, 1)
                tile_match = tl.min(tl.where(sim == tile_best[:, None], j[None, :], num_b), 1)
                better = tile_best > best
                best = tl.where(better, tile_best, best)
                match = tl.where(better, tile_match, match)
            best = tl.where((best == best) & (i >= a0), best, float("-inf"))  # NaN, or a protected A row: last
            tl.store(BEST + i, best.to(tl.int32, bitcast=True), mask=in_a)
            tl.store(MATCH + i, match, mask=in_a)


@triton.jit(do_not_specialize=["total", "batch", "limit", "threshold", "num_prefix"])
def _match_kernel(
    CU, WORK, DEST, COUNTS, CU_OUT, SRC, SRC_OFF, total, batch, limit, threshold, num_prefix,
    BLOCK_AB: tl.constexpr, BLOCK_DST: tl.constexpr, BLOCK_S: tl.constexpr, B_PAD: tl.constexpr,
    ADAPTIVE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The merged A rows (ranked by best similarity, descending, then index), the image's count and (fixed mode)
    offsets, every row's destination and the source lists; a program per image and ``BLOCK_S`` of its rows: each
    program ranks the image's A rows and writes every destination (the same values as its image's other programs),
    then the source lists of its own rows, which read the destinations of every merged A row. With ``PDL`` (launched
    with PDL) it first waits for the kernel before it."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    lead = tl.program_id(1) == 0  # the program that writes the image's count and offsets
    start, end, num_a, num_b, cap, a0, b0, prefix = _image_sets(CU, b, total, num_prefix, limit)
    # WORK (int32 [4, T]), at the image's first rows: per A row i, row start + i holds its best similarity's bits,
    # start + total + i its best B row, start + 2 * total + i the merged A rows up to i (inclusive) * 2 + merged, and
    # start + 3 * total + i its rank.
    BEST = WORK + start
    MATCH = WORK + total + start
    MERGED = WORK + 2 * total + start
    RANK = WORK + 3 * total + start
    offs_a = tl.arange(0, BLOCK_AB)
    offs_b = tl.arange(0, BLOCK_AB)
    merged_rows = 0
    if cap > 0:
        # The merged A rows: rank by (best descending, index ascending) below the cap (and passing the threshold).
        for i0 in range(0, num_a, BLOCK_AB):
            i = i0 + offs_a
            in_a = i < num_a
            best_i = tl.load(BEST + i, mask=in_a, other=0).to(tl.float32, bitcast=True)
            rank = tl.zeros([BLOCK_AB], dtype=tl.int32)
            for k0 in range(0, num_a, BLOCK_AB):
                k = k0 + offs_b
                best_k = tl.load(BEST + k, mask=k < num_a, other=0).to(tl.float32, bitcast=True)
                ahead = (best_k[None, :] > best_i[:, None]) | ((best_k[None, :] == best_i[:, None]) & (k < i[:, None]))
                rank += tl.sum((ahead & (k < num_a)[None, :]).to(tl.int32), 1)
            merged = in_a & (rank < cap)
            if ADAPTIVE:
                merged = merged & (best_i >= threshold)
            merged = merged.to(tl.int32)
            tl.store(RANK + i, rank, mask=in_a)
            tl.store(MERGED + i, (merged_rows + tl.cumsum(merged, 0)) * 2 + merged, mask=in_a)
            merged_rows += tl.sum(merged, 0)
        tl.debug_barrier()
    count = end - start - merged_rows
    if ADAPTIVE:  # offsets in the merged buffer: _offset_kernel adds the images before this one
        base_out = 0
        if lead:
            tl.store(COUNTS + b, count)
    else:  # the rule's counts, n - min(r, patches // 2), from every image's length
        offs_img = tl.arange(0, B_PAD)
        lo = tl.load(CU + offs_img, mask=offs_img < batch, other=0)
        lo = tl.minimum(tl.maximum(lo, 0), total)
        hi = tl.load(CU + offs_img + 1, mask=offs_img < batch, other=0)
        hi = tl.minimum(tl.maximum(hi, lo), total)
        rows_left = hi - lo - tl.minimum(limit, tl.maximum(hi - lo - num_prefix, 0) // 2)
        base_out = tl.sum(tl.where(offs_img < b, rows_left, 0), 0)
        if lead:
            tl.store(COUNTS + b, count)
            tl.store(CU_OUT + b + 1, base_out + count)
            if b == 0:
                tl.store(CU_OUT, 0)
    # Destinations: the prefix rows, the other unmerged A rows (in order; in rank order without prefix rows), the other
    # B rows, a merged A row where its B row goes; an image that merges nothing keeps its order.
    offs_r = tl.arange(0, BLOCK_DST)
    kept_a = num_a - a0 - merged_rows  # the unmerged unprotected A rows, before the B rows
    for r0 in range(start, end, BLOCK_DST):  # one step for an image of up to BLOCK_DST rows: its gathers at once
        rows = r0 + offs_r
        in_r = rows < end
        q = rows - start  # position in the image and its split
        slot = q // 2  # A row `slot` for an even position, B row `slot` for an odd one
        state = tl.load(MERGED + slot, mask=in_r & (cap > 0), other=0)
        is_a = q % 2 == 0
        merges = in_r & is_a & ((state & 1) == 1)
        j = tl.load(MATCH + slot, mask=merges, other=0)
        rank = tl.load(RANK + slot, mask=in_r & is_a & (cap > 0) & (prefix == 0), other=0)
        a_place = tl.where(prefix > 0, prefix + slot - a0 - (state >> 1), rank - merged_rows)
        b_place = prefix + kept_a + tl.where(merges, j, slot) - b0
        local = tl.where(q < prefix, q, tl.where(is_a & ~merges, a_place, b_place))
        local = tl.where(merged_rows == 0, q, local)
        tl.store(DEST + rows, base_out + local, mask=in_r)
    # Source lists: image b's rows grouped by destination in SRC[start:end), row order inside a group; the group of
    # its merged row d (local) starts at start + d + (merged A rows sent below d): the rows sent below d are the d
    # surviving rows before it and those. Its start goes to SRC_OFF[base_out + d] (adaptive: to SRC_OFF[start + d],
    # moved by _offset_kernel, which knows base_out).
    tl.debug_barrier()  # the destinations above, read back
    offs_s = tl.arange(0, BLOCK_S)
    offs_k = tl.arange(0, BLOCK_AB)
    for r0 in range(start + tl.program_id(1) * BLOCK_S, end, tl.num_programs(1) * BLOCK_S):
        rows = r0 + offs_s
        in_r = rows < end
        dest = tl.load(DEST + rows, mask=in_r, other=0)
        q = rows - start
        slot = q // 2
        state = tl.load(MERGED + slot, mask=in_r & (q % 2 == 0) & (cap > 0), other=0)
        merges = in_r & (q % 2 == 0) & ((state & 1) == 1)
        joins = start + 2 * tl.load(MATCH + slot, mask=merges, other=0) + 1  # the B row a merged A row joins
        below = tl.zeros([BLOCK_S], dtype=tl.int32)  # merged A rows sent below the row's destination
        ahead = tl.zeros([BLOCK_S], dtype=tl.int32)  # merged A rows before it sent to its destination
        if cap > 0:
            for k0 in range(0, num_a, BLOCK_AB):
                k = k0 + offs_k
                in_k = k < num_a
                merged_k = in_k & ((tl.load(MERGED + k, mask=in_k, other=0) & 1) == 1)
                dest_k = tl.load(DEST + start + 2 * k, mask=merged_k, other=0)
                to_k = merged_k[None, :] & (dest_k[None, :] <= dest[:, None])
                below += tl.sum((to_k & (dest_k[None, :] < dest[:, None])).to(tl.int32), 1)
                same = to_k & (dest_k[None, :] == dest[:, None]) & ((start + 2 * k)[None, :] < rows[:, None])
                ahead += tl.sum(same.to(tl.int32), 1)
        group = start + dest - base_out + below
        tl.store(SRC + group + ahead + (merges & (joins < rows)).to(tl.int32), rows, mask=in_r)
        if ADAPTIVE:  # base_out is 0 here: into the starts scratch, by input row
            tl.store(SRC_OFF + start + dest, group, mask=in_r & ~merges)
        else:
            tl.store(SRC_OFF + dest, group, mask=in_r & ~merges)
    if not ADAPTIVE and lead:
        tl.store(SRC_OFF + base_out + count, end)  # the end of the last group (T at T'; equal values elsewhere)


@triton.jit(do_not_specialize=["total", "batch"])
def _offset_kernel(
    CU, COUNTS, DEST, CU_OUT, STARTS, SRC_OFF, total, batch, BLOCK_R: tl.constexpr, B_PAD: tl.constexpr,
):  # fmt: skip
    """Adaptive mode: image b's offset in the merged buffer (the counts before it) added to its destinations, its
    entry of the merged offsets, and its source groups' starts moved from ``STARTS[start + d]`` to
    ``SRC_OFF[base + d]``."""
    b = tl.program_id(0)
    start, end = image_rows(CU, b, total)
    offs_img = tl.arange(0, B_PAD)
    counts = tl.load(COUNTS + offs_img, mask=offs_img < batch, other=0)
    base = tl.sum(tl.where(offs_img < b, counts, 0), 0)
    count = tl.sum(tl.where(offs_img == b, counts, 0), 0)
    tl.store(CU_OUT + b + 1, base + count)
    if b == 0:
        tl.store(CU_OUT, 0)
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        tl.store(DEST + rows, tl.load(DEST + rows, mask=rows < end) + base, mask=rows < end)
        d = rows - start
        tl.store(SRC_OFF + base + d, tl.load(STARTS + rows, mask=d < count), mask=d < count)
    tl.store(SRC_OFF + base + count, end)


@triton.jit
def _write_offsets(NEW_CU, CU_OUT, batch, capacity, pads, pad_len, BLOCK_B: tl.constexpr, PADS_PAD: tl.constexpr):
    """``CU_OUT[:B + 1] = NEW_CU[:B + 1]``, then ``pads`` padding images' offsets ``min(T' + (i + 1) * pad_len,
    capacity)`` (one program)."""
    offs_b = tl.arange(0, BLOCK_B)
    for b0 in range(0, batch + 1, BLOCK_B):
        b = b0 + offs_b
        tl.store(CU_OUT + b, tl.load(NEW_CU + b, mask=b <= batch), mask=b <= batch)
    if PADS_PAD > 0:
        i = tl.arange(0, PADS_PAD)
        ends = tl.minimum(tl.load(NEW_CU + batch) + (i + 1) * pad_len, capacity)
        tl.store(CU_OUT + batch + 1 + i, ends, mask=i < pads)


@triton.jit(do_not_specialize=["batch", "capacity", "pads", "pad_len"])
def _offsets_kernel(NEW_CU, CU_OUT, batch, capacity, pads, pad_len, BLOCK_B: tl.constexpr, PADS_PAD: tl.constexpr):
    _write_offsets(NEW_CU, CU_OUT, batch, capacity, pads, pad_len, BLOCK_B, PADS_PAD)


@triton.jit(do_not_specialize=["total", "batch", "capacity", "pads", "pad_len"])
def _merge_kernel(
    X, SIZES, SRC, SRC_OFF, NEW_CU, OUT, OUT_SIZES, LOG_SIZES, CU_OUT, KEPT, STATS, RES, NORMED, NORM_W, NORM_B,
    total, batch, capacity, pads, pad_len, stride_xt, stride_xc, stride_rt, stride_rc, eps,
    CHANNELS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, HAS_LOG: tl.constexpr,
    HAS_CU: tl.constexpr, HAS_STATS: tl.constexpr, BLOCK_B: tl.constexpr, PADS_PAD: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    """``BLOCK_D`` merged rows and ``BLOCK_C`` channels per step (grid-stride over the ``T'`` merged rows): each row
    gathers its group of sources, the k-th source of every row at a time, in row order. Offsets and source rows are
    clamped into ``[0, T]``: lists that break the contract give wrong rows, never an access outside the buffers.
    With ``HAS_CU`` the first program also writes the merged offsets to ``CU_OUT`` and after them ``pads`` padding
    images' offsets, ``min(T' + (i + 1) * pad_len, capacity)``. With ``HAS_STATS`` it first writes the sum and the
    max of ``KEPT[:batch]`` to ``STATS`` (the graph runner's host read, as ``triton_impl.pack`` writes it).

    With ``HAS_RES`` every source row is ``X + RES`` (fp32 sum rounded once to ``X``'s dtype: what ``torch.add``
    stores) before it is weighted. With ``HAS_NORM`` (whole rows: ``BLOCK_C >= CHANNELS``, one program column) each
    merged row as stored in ``OUT``'s dtype is also layer-normalised in fp32 (``eps``; ``NORM_W`` / ``NORM_B`` with
    ``HAS_W`` / ``HAS_B``, else 1 / 0) into ``NORMED``. Switched off, each adds no instruction."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        if HAS_STATS:
            store_total_and_longest(KEPT, STATS, batch, BLOCK_B)
        if HAS_CU:
            _write_offsets(NEW_CU, CU_OUT, batch, capacity, pads, pad_len, BLOCK_B, PADS_PAD)
    merged_total = tl.minimum(tl.minimum(tl.load(NEW_CU + batch), capacity), total)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < CHANNELS
    if HAS_NORM:  # the LayerNorm's parameters, once per program
        gain = tl.full([BLOCK_C], 1.0, tl.float32)
        shift = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_W:
            gain = tl.load(NORM_W + offs_c, mask=in_c, other=0.0).to(tl.float32)
        if HAS_B:
            shift = tl.load(NORM_B + offs_c, mask=in_c, other=0.0).to(tl.float32)
    for d0 in range(tl.program_id(0) * BLOCK_D, merged_total, tl.num_programs(0) * BLOCK_D):
        d = d0 + offs_d
        in_d = d < merged_total
        lo = tl.minimum(tl.maximum(tl.load(SRC_OFF + d, mask=in_d, other=0), 0), total)
        sources = tl.minimum(tl.maximum(tl.load(SRC_OFF + d + 1, mask=in_d, other=0), lo), total) - lo
        acc = tl.zeros([BLOCK_D, BLOCK_C], dtype=tl.float32)
        lone = tl.zeros([BLOCK_D, BLOCK_C], dtype=tl.float32)  # the first source: the row if it is the only one
        weight = tl.zeros([BLOCK_D], dtype=SIZES.dtype.element_ty)
        for k in range(0, tl.max(sources, 0)):
            has = sources > k
            row = tl.minimum(tl.maximum(tl.load(SRC + lo + k, mask=has, other=0), 0), total - 1)
            size = tl.load(SIZES + row, mask=has, other=0)
            vals = tl.load(
                X + row.to(tl.int64)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                mask=has[:, None] & in_c[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_RES:  # the attention's residual add, rounded once to x's dtype as torch.add rounds it
                res = tl.load(
                    RES + row.to(tl.int64)[:, None] * stride_rt + offs_c[None, :] * stride_rc,
                    mask=has[:, None] & in_c[None, :],
                    other=0.0,
                ).to(tl.float32)
                vals = (vals + res).to(X.dtype.element_ty).to(tl.float32)
            acc += size.to(tl.float32)[:, None] * vals
            weight += size
            lone = tl.where(k == 0, vals, lone)
        divisor = tl.where(weight > 0, weight, 1).to(tl.float32)  # a row no row is sent to (a broken map): zeros
        mean = tl.math.div_rn(acc, tl.broadcast_to(divisor[:, None], [BLOCK_D, BLOCK_C]))
        rows = tl.where((sources == 1)[:, None], lone, mean).to(OUT.dtype.element_ty)
        out = OUT + d.to(tl.int64)[:, None] * CHANNELS + offs_c[None, :]
        tl.store(out, rows, mask=in_d[:, None] & in_c[None, :])
        if HAS_NORM:  # norm2 of the row as stored (what F.layer_norm(out) reads), in fp32; padding channels are 0
            v = rows.to(tl.float32)
            count = tl.full([BLOCK_D], CHANNELS, tl.float32)
            mu = tl.math.div_rn(tl.sum(v, 1), count)
            diff = tl.where(in_c[None, :], v - mu[:, None], 0.0)
            var = tl.math.div_rn(tl.sum(diff * diff, 1), count)  # biased, as F.layer_norm
            # rows past T' (in_d false) hold zeros: 1 keeps their 1 / sqrt(0) out of the arithmetic (never stored)
            root = tl.sqrt_rn(tl.where(in_d, var + eps, 1.0))
            rstd = tl.math.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), root)
            y = diff * rstd[:, None] * gain[None, :] + shift[None, :]
            normed = NORMED + d.to(tl.int64)[:, None] * CHANNELS + offs_c[None, :]
            tl.store(normed, y.to(NORMED.dtype.element_ty), mask=in_d[:, None] & in_c[None, :])
        if tl.program_id(1) == 0:
            tl.store(OUT_SIZES + d, weight, mask=in_d)
            if HAS_LOG:  # log(size) in float64, rounded once to fp32 (as the reference rounds it)
                tl.store(LOG_SIZES + d, tl.log(weight.to(tl.float64)).to(tl.float32), mask=in_d)


_metric_launcher = CompiledLauncher(_metric_kernel)
_best_launcher = CompiledLauncher(_best_kernel)
_match_launcher = CompiledLauncher(_match_kernel)
_offset_launcher = CompiledLauncher(_offset_kernel)
_merge_launcher = CompiledLauncher(_merge_kernel)
_offsets_launcher = CompiledLauncher(_offsets_kernel)


def _pdl_option(pdl: bool) -> dict[str, bool]:
    """The compile option of a kernel launched with PDL (none otherwise: the interpreter takes no options)."""
    return {"launch_pdl": True} if pdl else {}


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_Tile = TypeVar("_Tile")


def _one_wave(tiles: Sequence[_Tile], rows_of: Callable[[_Tile], int], batch: int, n: int, sms: int) -> _Tile:
    """The first of ``tiles`` whose ``batch * cdiv(n, rows_of(tile))`` programs all run at once on ``sms`` SMs, else
    the last: what :func:`_list_rows` and :func:`_best_tile` pick by."""
    return next((t for t in tiles if batch * cdiv(max(n, 1), rows_of(t)) <= sms), tiles[-1])


def _list_rows(batch: int, max_seqlen: int, sms: int) -> int:
    """Rows per program of the match's source lists: the smallest tile whose ``batch * cdiv(max_seqlen, tile)``
    programs all run at once on ``sms`` SMs, else the largest. Smaller tiles shorten the serial phase; past one
    wave, the ranking each program repeats costs more (``docs/tuning.md#tome-source-lists``)."""
    return _one_wave(_LIST_ROWS, int, batch, max_seqlen, sms)


def _best_tile(batch: int, num_a: int, sms: int) -> tuple[int, int]:
    """A rows and warps per program of the best-match search (``_BEST_TILES``): the first tile whose ``batch *
    cdiv(num_a, rows)`` programs all run at once on ``sms`` SMs, else the last."""
    return _one_wave(_BEST_TILES, lambda tile: tile[0], batch, num_a, sms)


def _tile(width: int, cap: int) -> int:
    """A power-of-two tile of at least 16 (``tl.dot``'s least) and at most ``cap`` covering ``width`` if it can."""
    return min(cap, max(16, next_power_of_2(width)))


def _fp32_threshold(threshold: float) -> float:
    """The threshold as the fp32 value the reference compares with (clamped to ``[-2, 2]`` first: no similarity
    lies outside, and fp32 rounding of a larger value could overflow)."""
    return struct.unpack("<f", struct.pack("<f", min(max(threshold, -2.0), 2.0)))[0]


def decide_merges(
    keys: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_prefix: int = 1,
    *,
    r: int | None = None,
    threshold: float | None = None,
    r_max: int | None = None,
    check_values: bool | None = None,
) -> MergeSelection:
    """One block's merges by bipartite soft matching, per image: the kernels' twin of
    :func:`ragged_vit.reference.merging.decide_merges` (module docstring: the rules), three launches in the fixed
    mode, four in the adaptive one, no host synchronisation.

    Args:
        keys: ``[T, H, D]`` the block's attention keys (after ``k_norm``), fp16, bf16 or fp32, any strides (e.g. a
            view of the qkv projection); ``D <= 256``.
        cu_seqlens: int32 ``[B+1]`` offsets; image ``b``'s rows start with its ``num_prefix`` prefix rows.
        max_seqlen: a bound on the image lengths that sizes the tiles (an underestimate is slower, never wrong).
        num_prefix: prefix rows at the start of every image; they never merge.
        r: fixed mode: each image merges ``min(r, patches // 2)`` A rows.
        threshold: adaptive mode: each image merges the A rows whose best cosine similarity is ``>= threshold``
            (compared in fp32), at most ``min(r_max, patches // 2)`` of them.
        r_max: the cap of the adaptive mode (with ``threshold`` only).
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).

    Returns:
        :class:`~ragged_vit.core.selection.MergeSelection`: the destination map (int32), the rows of each image
        after the merge (``kept``) and the merged offsets; ``fixed_count`` and ``count`` are the caller's to set
        (the pipeline's merge stage knows them on the host).
    """
    threshold = check_merge_mode(r, threshold, r_max)
    limit = check_int(r, "r", 0) if threshold is None else check_int(r_max, "r_max", 0)
    check_tensor(keys, "keys", ndim=3, dtypes=FLOAT_DTYPES)
    if not 1 <= keys.shape[2] <= _MAX_HEAD_DIM or keys.shape[1] < 1:
        raise ValueError(f"keys must have shape [T, H, D] with H >= 1 and 1 <= D <= {_MAX_HEAD_DIM}, got "
                         f"{tuple(keys.shape)}")  # fmt: skip
    cu = check_cu_seqlens(cu_seqlens, total=keys.shape[0], device=keys.device, check_values=check_values)
    check_max_seqlen(max_seqlen)
    check_int(num_prefix, "num_prefix", 0)
    return decide_merges_unchecked(keys, cu, max_seqlen, num_prefix, limit, threshold)


def decide_merges_unchecked(
    keys: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    num_prefix: int,
    limit: int,
    threshold: float | None,
    out: MergeSelection | None = None,
) -> MergeSelection:
    """:func:`decide_merges` without its checks (``limit``: ``r``, or ``r_max`` with a ``threshold``), written into
    ``out`` (contiguous int32 tensors of the right shapes, every element overwritten but the source offsets past
    ``T'``) when given: for a merge stage that built its input itself. An ``out`` without source lists gets new ones
    (a copy of ``out`` with them is returned)."""
    total, heads, dim = keys.shape
    batch = cu.shape[0] - 1
    device = keys.device
    adaptive = threshold is not None
    # Every int32 output and scratch buffer is a view of one allocation (``scratch``: two host ops instead of five to
    # seven, at each of a ToMe forward's twelve stages when it runs eagerly). Only the buffers ``out`` does not bring:
    # the map, counts and offsets, the source lists, the matching's work and (adaptive) the group starts.
    need_out, need_lists = out is None, out is None or out.sources is None or out.source_offsets is None
    lengths = [total, batch, batch + 1] * need_out + [total, total + 1] * need_lists + [4 * total]
    lengths += [total] * adaptive
    views = iter(scratch(lengths, torch.int32, device))
    if need_out:
        out = MergeSelection(next(views), next(views), next(views))
    if need_lists:
        out = dataclasses.replace(out, sources=next(views), source_offsets=next(views))
    work = next(views)  # [4, T] flat: best similarities' bits, best B rows, merged A rows, their ranks
    d_pad = _tile(dim, _MAX_HEAD_DIM)
    metric = torch.empty(total, d_pad, dtype=torch.float32, device=device)
    split = max(max_seqlen, 1)  # rows of an image's split, at most
    num_a = cdiv(split, 2)  # a bound on every image's A rows
    block_ab = _tile(num_a, _BLOCK_AB)
    b_pad = 1 if adaptive else next_power_of_2(batch)  # the fixed mode's offsets read every image's length
    block_m = max(1, _METRIC_ELEMENTS // d_pad)
    block_dst = min(_MAX_BLOCK_DST, next_power_of_2(max(max_seqlen, 16)))
    strides = keys.stride()
    device_index = keys.get_device()
    starts = next(views) if adaptive else out.source_offsets
    sms = _sm_count(device_index) if keys.is_cuda else _INTERPRETER_SMS
    block_s = _list_rows(batch, max_seqlen, sms)
    block_a, best_warps = _best_tile(batch, num_a, sms)
    block_b = _tile(num_a, _BEST_B_ELEMENTS // d_pad)  # B rows per similarity tile of the best-match search
    ok = aligned(keys, cu, metric, work, out.destination, out.kept, out.cu_seqlens, out.sources, out.source_offsets,
                 starts)  # fmt: skip
    pdl = batch <= DECISION_PDL_MAX_IMAGES and keys.is_cuda and pdl_supported(device_index)
    args = (keys, cu, metric, total, *strides, limit, num_prefix, heads, dim, d_pad, block_m, pdl)
    key = (keys.dtype, heads, dim, block_m, *map(int_spec, strides), pdl) if ok else None
    grid = (batch, cdiv(split, block_m))
    _metric_launcher(key, device_index, grid, args, num_warps=_NUM_WARPS, num_stages=1)
    args = (cu, metric, work, total, limit, num_prefix, d_pad, block_a, block_b, pdl)
    grid = (batch, cdiv(num_a, block_a))
    key = (d_pad, block_b, block_a, best_warps, pdl) if ok else None
    _best_launcher(key, device_index, grid, args, num_warps=best_warps, num_stages=1, **_pdl_option(pdl))
    args = (
        cu, work, out.destination, out.kept, out.cu_seqlens, out.sources, starts, total, batch, limit,
        _fp32_threshold(threshold) if adaptive else 0.0, num_prefix, block_ab, block_dst, block_s, b_pad, adaptive,
        pdl,
    )  # fmt: skip
    key = (block_ab, block_dst, block_s, b_pad, adaptive, pdl) if ok else None
    grid = (batch, cdiv(max(max_seqlen, 1), block_s))  # the source lists' row tiles over programs
    _match_launcher(key, device_index, grid, args, num_warps=_MATCH_WARPS, num_stages=1, **_pdl_option(pdl))
    if adaptive:
        b_pad = next_power_of_2(batch)
        # an image in one step, as for the destinations (32 rows a step was slower:
        # docs/tuning.md#tome-offsets-in-one-step)
        args = (cu, out.kept, out.destination, out.cu_seqlens, starts, out.source_offsets, total, batch, block_dst,
                b_pad)  # fmt: skip
        key = (block_dst, b_pad) if ok else None
        _offset_launcher(key, device_index, (batch,), args, num_warps=_NUM_WARPS, num_stages=1)
    return out


def merge_rows(
    x: torch.Tensor,
    sizes: torch.Tensor,
    destination: torch.Tensor,
    cu_seqlens: torch.Tensor,
    merged_cu_seqlens: torch.Tensor,
    *,
    sources: tuple[torch.Tensor, torch.Tensor] | None = None,
    capacity: int | None = None,
    check_values: bool | None = None,
    residual: torch.Tensor | None = None,
    normed: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies a destination map as a size-weighted average, per image: the kernel's twin of
    :func:`ragged_vit.reference.merging.merge_rows` (module docstring: the rules), one launch (two torch ops more
    without ``sources``), no host synchronisation.

    Args:
        x: ``[T, C]`` rows, fp16, bf16 or fp32, any strides.
        sizes: int32 or int64 ``[T]`` the patches each row holds (>= 1), contiguous.
        destination: int32 or int64 ``[T]``, contiguous: the merged row each row goes to, inside its image's merged
            rows (``merged_cu_seqlens``); every merged row receives at least one row. Not read on the host.
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``.
        merged_cu_seqlens: int32 ``[B+1]`` offsets of the merged rows.
        sources: the map's source lists ``(sources [T], offsets [T + 1])``, int32, as :func:`decide_merges` writes
            them (:func:`ragged_vit.reference.merging.merge_sources` defines them); derived from ``destination``
            when None.
        capacity: rows of the merged buffer, ``>= T'`` (default ``T``: always enough); rows past ``T'`` are left
            as allocated, rows past ``capacity`` are not written.
        check_values: read both offsets to validate them (default: only on the CPU).
        residual: ``[T, C]`` in ``x``'s dtype, any strides: merge ``x + residual`` instead of ``x`` (each row's sum
            in fp32, rounded once to ``x``'s dtype: ``torch.add(x, residual)``'s bits), the attention's residual
            add fused into the merge.
        normed: ``[capacity, C]`` contiguous, ``x``'s dtype, not sharing memory with ``x`` or ``residual``: where
            the same launch writes the LayerNorm of each merged row (the block's ``norm2``), rows ``[0, T')``;
            the rest is left as it was. At most 8192 channels (whole rows in registers).
        norm_weight: ``[C]`` contiguous, ``x``'s dtype or fp32: the LayerNorm's weight (None: 1); with ``normed``.
        norm_bias: ``[C]`` contiguous, ``x``'s dtype or fp32: the LayerNorm's bias (None: 0); with ``normed``.
        norm_eps: the LayerNorm's ``eps``, finite and ``>= 0`` (default ``nn.LayerNorm``'s).

    Returns:
        The merged rows ``[capacity, C]`` in ``x``'s dtype and their sizes ``[capacity]`` in ``sizes``' dtype
        (with ``normed``: also written, in place, as ``F.layer_norm(rows[:T'], (C,), norm_weight, norm_bias,
        norm_eps)`` computed in fp32 from the rows as returned; the module docstring states the bound).
    """
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    total, channels = x.shape
    if channels < 1:
        raise ValueError(f"x must have at least one channel, got shape {tuple(x.shape)}")
    check_sizes(sizes, total, x.device)  # values >= 1 read on a CPU only
    check_tensor(destination, "destination", ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
    if destination.shape[0] != total:
        raise ValueError(f"destination must have shape ({total},) to match x, got {tuple(destination.shape)}")
    for name, value in (("sizes", sizes), ("destination", destination)):
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {value.stride()}")
    cu = check_cu_seqlens(cu_seqlens, total=total, device=x.device, check_values=check_values)
    capacity = total if capacity is None else check_int(capacity, "capacity", 0)
    merged_cu = check_cu_seqlens(
        merged_cu_seqlens, device=x.device, name="merged_cu_seqlens", check_values=check_values
    )
    if merged_cu.shape[0] != cu.shape[0]:
        raise ValueError(
            f"merged_cu_seqlens must have one offset per image like cu_seqlens ({cu.shape[0]}), got "
            f"{merged_cu.shape[0]}"
        )
    norm_eps = _check_fusions(x, capacity, residual, normed, norm_weight, norm_bias, norm_eps)
    if sources is None:
        sources = merge_sources(destination)
    else:
        for name, value, n in (("sources[0]", sources[0], total), ("sources[1]", sources[1], total + 1)):
            check_tensor(value, name, ndim=1, dtypes=(torch.int32,), device=x.device)
            if value.shape[0] != n or not value.is_contiguous():
                raise ValueError(f"{name} must be contiguous of shape ({n},), got {tuple(value.shape)}")
    out = x.new_empty((capacity, channels))
    out_sizes = sizes.new_empty(capacity)
    return merge_rows_unchecked(x, sizes, *sources, merged_cu, out, out_sizes, residual=residual, normed=normed,
                                norm_weight=norm_weight, norm_bias=norm_bias, norm_eps=norm_eps)  # fmt: skip


def _check_fusions(
    x: torch.Tensor,
    capacity: int,
    residual: object,
    normed: object,
    weight: object,
    bias: object,
    eps: object,
) -> float:
    """:func:`merge_rows`'s checks of the fused residual add and LayerNorm; returns ``eps`` as a float."""
    channels = x.shape[1]
    if residual is not None:
        check_tensor(residual, "residual", ndim=2, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have shape {tuple(x.shape)} like x, got {tuple(residual.shape)}")
    if normed is None:
        for name, value in (("norm_weight", weight), ("norm_bias", bias)):
            if value is not None:
                raise ValueError(f"{name} is given without normed: the LayerNorm runs only into a normed buffer")
    else:
        check_tensor(normed, "normed", ndim=2, dtypes=(x.dtype,), device=x.device)
        if normed.shape != (capacity, channels) or not normed.is_contiguous():
            raise ValueError(f"normed must be contiguous of shape ({capacity}, {channels}) (capacity, C), got "
                             f"{tuple(normed.shape)} with strides {normed.stride()}")  # fmt: skip
        if channels > _MAX_NORM_CHANNELS:
            raise ValueError(f"normed: the fused LayerNorm holds whole rows, at most {_MAX_NORM_CHANNELS} channels, "
                             f"got {channels}")  # fmt: skip
        for name, value in (("x", x), ("residual", residual)):
            if value is not None and _shares_memory(normed, value):
                raise ValueError(f"normed must not share memory with {name} (the launch reads {name} as it writes)")
        for name, value in (("norm_weight", weight), ("norm_bias", bias)):
            if value is not None:
                dtypes = (x.dtype,) if x.dtype == torch.float32 else (x.dtype, torch.float32)
                check_tensor(value, name, ndim=1, dtypes=dtypes, device=x.device)
                if value.shape[0] != channels or not value.is_contiguous():
                    raise ValueError(f"{name} must be contiguous of shape ({channels},) (x's channels), got "
                                     f"{tuple(value.shape)} with strides {value.stride()}")  # fmt: skip
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"norm_eps must be a float (the LayerNorm's eps), got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"norm_eps must be finite and >= 0, got {eps}")
    return float(eps)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges in one storage overlap (conservative: their spans, not their elements)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or not a.numel() or not b.numel():
        return False
    spans = []
    for t in (a, b):
        first = t.data_ptr()
        last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) * t.element_size()
        spans.append((first, last + t.element_size()))
    return spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


def merge_rows_unchecked(
    x: torch.Tensor,
    sizes: torch.Tensor,
    sources: torch.Tensor,
    source_offsets: torch.Tensor,
    merged_cu: torch.Tensor,
    out: torch.Tensor,
    out_sizes: torch.Tensor,
    log_sizes: torch.Tensor | None = None,
    *,
    cu_out: torch.Tensor | None = None,
    padding_images: int = 0,
    padding_len: int = 0,
    total_and_longest: tuple[torch.Tensor, torch.Tensor] | None = None,
    residual: torch.Tensor | None = None,
    normed: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_rows` from the source lists, without its checks, written into ``out`` (contiguous
    ``[capacity, C]`` in ``x``'s dtype) and ``out_sizes`` (contiguous ``[capacity]`` in ``sizes``' dtype), rows
    ``[0, T')`` overwritten, and returned: for a merge stage that built its input itself. With ``log_sizes``
    (contiguous fp32 ``[capacity]``) the kernel also writes ``log(size)`` of the merged rows there (in float64,
    rounded once: the reference's key bias), for the attention of the blocks after the merge.

    With ``cu_out`` (contiguous int32 ``[B + 1 + padding_images]``) the same launch writes the merged offsets there,
    then the offsets of ``padding_images`` padding images of ``padding_len`` rows over the rows ``[T', capacity)``
    (each clamped to ``capacity``): the graph runner's offsets for a buffer of ``capacity`` rows, as the pack kernel
    writes them for a pruning stage (``ragged_vit.triton_impl.pack``).

    With ``total_and_longest = (kept, stats)`` (contiguous int32 ``[B]`` and at least 2 elements, on ``x``'s device
    or in pinned host memory) its first program writes ``kept.sum()`` and ``kept.max()`` to ``stats[0]`` and
    ``stats[1]`` before anything else, as :func:`ragged_vit.triton_impl.pack.total_and_longest` does: the graph
    runner's host read of a merging stage, without a launch of its own.

    With ``residual`` (``[T, C]`` in ``x``'s dtype, any strides) the rows merged are ``x + residual``, each sum in
    fp32 rounded once to ``x``'s dtype. With ``normed`` (contiguous ``[capacity, C]`` in ``x``'s dtype, ``C <=
    8192``) rows ``[0, T')`` also get the LayerNorm of the merged rows as written to ``out`` (``norm_weight`` /
    ``norm_bias``: contiguous ``[C]`` in ``x``'s dtype or fp32, or None; ``norm_eps``); the launch then runs
    whole-row tiles of one row. Returns ``(out, out_sizes)`` either way."""
    channels, capacity, batch = x.shape[1], out.shape[0], merged_cu.shape[0] - 1
    has_log, has_cu, has_stats = log_sizes is not None, cu_out is not None, total_and_longest is not None
    has_res, has_norm = residual is not None, normed is not None
    has_w, has_b = has_norm and norm_weight is not None, has_norm and norm_bias is not None
    if has_norm:  # whole rows in one program column
        block_d, block_c = _NORM_ROWS, next_power_of_2(channels)
    else:
        block_d, block_c = _BLOCK_D, min(_BLOCK_C, next_power_of_2(channels))
    grid = (max(1, cdiv(capacity, block_d)), cdiv(channels, block_c))
    block_b, pads_pad = _offset_tiles(batch, padding_images if has_cu else 0)
    kept, stats = total_and_longest if has_stats else (merged_cu, merged_cu)
    res_strides = residual.stride() if has_res else (0, 0)
    # Absent tensors pass a present one of a fixed dtype in their place (never read: their switch is off)
    args = (
        x, sizes, sources, source_offsets, merged_cu, out, out_sizes, log_sizes if has_log else out_sizes,
        cu_out if has_cu else merged_cu, kept, stats, residual if has_res else x, normed if has_norm else out,
        norm_weight if has_w else out, norm_bias if has_b else out, x.shape[0], batch, capacity, padding_images,
        padding_len, *x.stride(), *res_strides, float(norm_eps) if has_norm else 0.0, channels, block_d, block_c,
        has_log, has_cu, has_stats, block_b, pads_pad, has_res, has_norm, has_w, has_b,
    )  # fmt: skip
    extra = [t for t in (log_sizes, cu_out, kept if has_stats else None, residual, normed) if t is not None]
    extra += [t for t in (norm_weight if has_w else None, norm_bias if has_b else None) if t is not None]
    ok = aligned(x, sizes, sources, source_offsets, merged_cu, out, out_sizes, *extra) and stats.data_ptr() % 16 == 0
    key = (x.dtype, sizes.dtype, channels, has_log, has_cu, has_stats, block_b, pads_pad, *map(int_spec, x.stride()),
           has_res, has_norm, norm_weight.dtype if has_w else None, norm_bias.dtype if has_b else None,
           *map(int_spec, res_strides))  # fmt: skip
    key = key if ok else None
    _merge_launcher(key, x.get_device(), grid, args, num_warps=_NUM_WARPS, num_stages=1)
    return out, out_sizes


def merged_offsets_unchecked(
    merged_cu: torch.Tensor, cu_out: torch.Tensor, capacity: int, padding_images: int = 0, padding_len: int = 0
) -> torch.Tensor:
    """Writes a merged buffer's offsets into ``cu_out`` (contiguous int32 ``[B + 1 + padding_images]``) in one launch:
    ``merged_cu`` (``[B + 1]``), then those of ``padding_images`` padding images of ``padding_len`` rows over the rows
    ``[T', capacity)``, each clamped to ``capacity``; what :func:`merge_rows_unchecked` writes with ``cu_out``, for a
    merge whose rows were written before its buffer's capacity was known (the graph runner merges before the host
    reads the total). Unchecked: the graph runner's hot path."""
    batch = merged_cu.shape[0] - 1
    block_b, pads_pad = _offset_tiles(batch, padding_images)
    args = (merged_cu, cu_out, batch, capacity, padding_images, padding_len, block_b, pads_pad)
    key = (block_b, pads_pad) if aligned(merged_cu, cu_out) else None
    _offsets_launcher(key, merged_cu.get_device(), (1,), args, num_warps=1, num_stages=1)
    return cu_out


def _offset_tiles(batch: int, padding_images: int) -> tuple[int, int]:
    return min(next_power_of_2(batch + 1), 1024), next_power_of_2(padding_images) if padding_images else 0


@register_decision(ToMeMerger)
def _decide(merger: ToMeMerger, inp: DecisionInput) -> MergeSelection:
    """:func:`decide_merges` on checked input (the block's keys, a view of its qkv): the fused decision the pipelines
    look up for ToMe's merger."""
    qkv, heads = inp.qkv, inp.num_heads
    keys = qkv.view(qkv.shape[0], 3, heads, qkv.shape[1] // (3 * heads))[:, 1]  # [T, H, D], strided
    merged = decide_merges_unchecked(keys, inp.cu_seqlens, inp.row_bound, inp.num_prefix, merger.limit(inp.stage),
                                     merger.threshold)  # fmt: skip
    fixed, count = fixed_count(merger, inp)
    return dataclasses.replace(merged, fixed_count=fixed, count=count)
