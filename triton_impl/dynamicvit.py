"""DynamicViT's keep decision: the predictor's first layer as the reference computes it, then three or four Triton
launches (the reference: ``reference/pruners/dynamicvit.py``).

The reference runs the predictor (``PredictorLG``) as ~25 small torch ops and ranks with ~35 more (sorts, scans,
gathers): per stage of a graphed DeiT-B forward it costs more than the blocks it saves
(``docs/tuning.md#dynamicvit-decision-kernels``). Here:

1. The first layer, ``z = GELU(LayerNorm(x) @ W1^T + b1)`` ``[T, C]``, is the reference's own three ops (cuBLAS's
   GEMM), bit for bit the reference's ``z``: it follows torch's matmul settings as the reference does (TF32 for an
   fp32 model only where the caller allows it). A fused Triton kernel (LayerNorm statistics per row tile, then the
   GEMM with ``tl.dot``) was slower at every batch size (``docs/tuning.md#dynamicvit-first-layer``).
2. ``_global_kernel`` (a program per image and 32 columns of the global half ``z[:, C/2:]``): the image's sum over
   its patch rows (prefix rows excluded) in fp32, 256 rows a step (one load each, summed by a fixed tree), rounded
   once, then the mean (an image without patches divides by 1) and that chunk's share of the second layer's global
   half, ``glob[chunk] @ W2[:, C/2 + chunk]^T``, fp32 ``[B, chunks, C/2]``. No atomics: the same bits on every run,
   in a graph or not. (The reference once summed row after row in the model dtype, rounding at every step: a
   serial chain that bounded this kernel whatever its launch shape, ``docs/tuning.md#dynamicvit-mean-in-fp32``; the
   sum in fp32 is also what the official code's ``.sum()`` of a half tensor computes on a GPU.)
3. ``_out_conv_kernel`` (a program per image and 16 or 64 of its rows): ``g = b2 + sum of the shares`` (in chunk
   order), ``h1 = GELU(z[:, :C/2] @ W2[:, :C/2]^T + g)`` in chunks of 64 columns, each chunk accumulated at once
   into ``h2 += h1_chunk @ W3^T[chunk]`` (``h1`` never leaves the program), then ``GELU(h2 + b3) @ W4^T + b4`` and
   the keep log-probability, fp32 ``[T]`` (every row's, prefix rows included, as the reference computes them).
   Small batches (up to ``_SMALL_ROWS`` rows) give each 64-column chunk its own program (DeiT-B: 6 per row tile;
   one program walking all six was nearly half of a stage at B = 1: ``docs/tuning.md#dynamicvit-tiles``), which
   writes its share of ``h2`` (fp32 ``[T, 6, C/4]``); ``_out_head_kernel`` (a program per 8 rows) adds the shares
   in chunk order and computes the rest.
4. the rank-select kernel of :mod:`ragged_vit.triton_impl.select` (``count`` mode): each image's top
   ``max(keep_patches, min_patches)`` patches, NaN first and ties to the earlier row as the reference ranks them
   (``segment_rank``: ``torch.sort`` order), and the kept counts.

The kernels read the predictor's own parameters in the model dtype, through their strides (no copies, no cache: a
changed parameter is read at the next call); every GEMM accumulates in fp32 (``tl.dot``; IEEE fp32, not TF32, for
an fp32 model). They round where the reference's ops round, to the model dtype: each Linear's output, each GELU's
output, the mean's fp32 sum, the patch count and the quotient (the reference divides in the model dtype), the
logits and the log-probability, computed as torch's CUDA ``log_softmax`` computes it: ``(l0 - m) - log(exp(l0 - m)
+ exp(l1 - m))`` in fp32, ``m = max(l0, l1)`` (a saturated keep scores exactly 0 as in torch, where ``-softplus``
would give a tiny negative; non-finite logits give what torch gives). So in fp16 and bf16 the scores are quantised
as the reference's are, and the ties that quantisation makes are broken by row as the reference breaks them.

What still differs (after the first layer, which is the reference's): the order of the mean's and the later GEMMs'
fp32 sums, and the exp/log approximations; where the two sides round an intermediate differently it moves by one
unit in the last place. The scores agree to ``rtol = 1e-5`` in fp32, ``2 eps`` relative in fp16 and ``8 eps`` in
bf16 (``tests/test_triton_dynamicvit.py``; the observed errors behind these bounds:
``docs/tuning.md#dynamicvit-score-tolerances``). Rule for the decisions, with ``b`` that bound at an image's cut: the
kept counts are the pruner's; where the pruner's own scores at the cut are more than ``2 b`` apart (last kept minus
first dropped) the image's mask is the pruner's; closer, only rows within ``2 b`` of the cut may change sides.
Equal rows of an image score bit for bit alike (ties go to the earlier row, as in the reference); a NaN patch row
makes its image's mean, hence every score of the image, NaN, as in the reference, and the image is decided as the
reference decides it (NaN first, then by row). An image's scores never depend on another image's values, bit for
bit. The tile shapes (``_tiles``, and cuBLAS's choice of GEMM) depend on the batch's total rows, so an image's
scores may differ in their last bits between batches of different totals; never between runs, nor between a graph
and eager calls.

:func:`dynamicvit_select` is the drop-in for ``pruner(inp)``; it is registered as the pruner's fused decision on CUDA
(:mod:`ragged_vit.core.decisions`), which the pipelines use. :func:`dynamicvit_scores` is the predictor alone. No
host synchronisation: ``inp.row_bound`` (a host int) sizes a grid, never the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..core.decisions import register_decision
from ..core.selection import DecisionInput, TokenSelection
from ..core.validation import check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from ..reference.pruners.dynamicvit import DynamicViTPruner, PredictorLG
from .cls_attention import image_rows
from .launcher import CompiledLauncher, aligned, cdiv, next_power_of_2, scratch
from .select import rank_keep_unchecked


@triton.jit
def _gelu(v):
    """Exact (erf) GELU in fp32, as torch writes it."""
    return v * 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _rounded(v, DTYPE: tl.constexpr):
    """``v`` rounded to the model dtype, as fp32 (a no-op for an fp32 model)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["total", "num_prefix"])
def _global_kernel(
    Z, CU, W2, PARTS, total, num_prefix, stride_wn, stride_wk,
    C: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    dtype = Z.dtype.element_ty
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    start, end = image_rows(CU, b, total)
    first = tl.minimum(start + num_prefix, end)  # the image's first patch row
    k = LOCAL + chunk * BLOCK_G + tl.arange(0, BLOCK_G)
    in_k = k < C
    offs_r = tl.arange(0, BLOCK_R)
    # The reference's sum: in fp32, rounded once to the model dtype. BLOCK_R rows a step, all loads in flight at
    # once, each step's rows summed by one fixed tree: the order depends on the image's own row count only (a row
    # past the image adds 0, which changes no sum).
    acc = tl.zeros([BLOCK_G], dtype=tl.float32)
    for r0 in range(first, end, BLOCK_R):
        rows = r0 + offs_r
        tile = tl.load(Z + rows.to(tl.int64)[:, None] * C + k[None, :], mask=(rows < end)[:, None] & in_k[None, :],
                       other=0.0)  # fmt: skip
        acc += tl.sum(tile.to(tl.float32), 0)
    patches = end - first
    count = _rounded(tl.maximum(patches, 1).to(tl.float32), dtype)  # the reference divides in the model dtype
    glob = _rounded(tl.math.div_rn(_rounded(acc, dtype), count), dtype)
    # This chunk's share of glob @ W2[:, C/2:]^T, summed over the chunks by the third kernel (a fixed order).
    parts = PARTS + (b.to(tl.int64) * tl.num_programs(1) + chunk) * HIDDEN
    for h0 in range(0, HIDDEN, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        in_h = offs_h < HIDDEN
        w = tl.load(W2 + offs_h[:, None] * stride_wn + k[None, :] * stride_wk, mask=in_h[:, None] & in_k[None, :],
                    other=0.0)  # fmt: skip  # [BLOCK_H, BLOCK_G]
        tl.store(parts + offs_h, tl.sum(w.to(tl.float32) * glob[None, :], 1), mask=in_h)


@triton.jit
def _keep_score(h2, B3, W4, B4, stride_w4n, stride_w4k, offs_n, NARROW: tl.constexpr, DTYPE: tl.constexpr):
    """The predictor's last layers on the third layer's fp32 sums ``h2 [rows, BLOCK_N]``: ``GELU(h2 + b3) @ W4^T +
    b4`` and the keep log-probability, rounded as the reference rounds them."""
    in_n = offs_n < NARROW
    b3 = tl.load(B3 + offs_n, mask=in_n, other=0.0).to(tl.float32)
    w4_keep = tl.load(W4 + offs_n * stride_w4k, mask=in_n, other=0.0).to(tl.float32)
    w4_drop = tl.load(W4 + stride_w4n + offs_n * stride_w4k, mask=in_n, other=0.0).to(tl.float32)
    h2 = _rounded(_gelu(_rounded(h2 + b3[None, :], DTYPE)), DTYPE)
    keep = _rounded(tl.sum(h2 * w4_keep[None, :], 1) + tl.load(B4).to(tl.float32), DTYPE)
    drop = _rounded(tl.sum(h2 * w4_drop[None, :], 1) + tl.load(B4 + 1).to(tl.float32), DTYPE)
    # log_softmax(logits)[0] in torch's form; a NaN logit makes the score NaN (NaN compares false).
    peak = tl.where(keep >= drop, keep, drop)
    return _rounded((keep - peak) - tl.log(tl.exp(keep - peak) + tl.exp(drop - peak)), DTYPE)


@triton.jit(do_not_specialize=["total"])
def _out_conv_kernel(
    Z, CU, PARTS, W2, B2, W3, B3, W4, B4, SCORES, H2, total, stride_w2n, stride_w2k, stride_w3n, stride_w3k,
    stride_w4n, stride_w4k, C: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr, NARROW: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """Rows of image ``program_id(0)``, a tile per step (grid-stride over axis 1), and the second layer's hidden
    chunks ``program_id(2)``, ``program_id(2) + num_programs(2)``, ... (grid-stride over axis 2). ``SPLIT``: the
    third layer's partial sums over those chunks go to ``H2 [T, num_programs(2), BLOCK_N]`` for
    ``_out_head_kernel``; else (one program per row tile, every chunk) the scores go to ``SCORES`` directly."""
    dtype = Z.dtype.element_ty
    b = tl.program_id(0)
    start, end = image_rows(CU, b, total)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    in_n = offs_n < NARROW
    for r0 in range(start + tl.program_id(1) * BLOCK_M, end, tl.num_programs(1) * BLOCK_M):
        rows = r0 + offs_m
        in_rows = rows < end
        z_rows = Z + rows.to(tl.int64)[:, None] * C
        h2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h0 in range(tl.program_id(2) * BLOCK_H, HIDDEN, tl.num_programs(2) * BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            in_h = offs_h < HIDDEN
            h1 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            for k0 in range(0, LOCAL, BLOCK_K):
                k = k0 + offs_k
                in_k = k < LOCAL
                local = tl.load(z_rows + k[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
                w = tl.load(W2 + offs_h[None, :] * stride_w2n + k[:, None] * stride_w2k,
                            mask=in_k[:, None] & in_h[None, :], other=0.0)  # fmt: skip  # [BLOCK_K, BLOCK_H]
                h1 = tl.dot(local, w, h1, input_precision="ieee")
            g = tl.zeros([BLOCK_H], dtype=tl.float32)  # the image's glob @ W2[:, C/2:]^T, from the chunks' shares
            for c in range(CHUNKS):
                g += tl.load(PARTS + (b.to(tl.int64) * CHUNKS + c) * HIDDEN + offs_h, mask=in_h, other=0.0)
            g += tl.load(B2 + offs_h, mask=in_h, other=0.0).to(tl.float32)
            h1 = _gelu(_rounded(h1 + g[None, :], dtype)).to(dtype)
            w = tl.load(W3 + offs_n[None, :] * stride_w3n + offs_h[:, None] * stride_w3k,
                        mask=in_h[:, None] & in_n[None, :], other=0.0)  # fmt: skip  # W3^T [BLOCK_H, BLOCK_N]
            h2 = tl.dot(h1, w, h2, input_precision="ieee")
        if SPLIT:
            part = H2 + (rows.to(tl.int64)[:, None] * tl.num_programs(2) + tl.program_id(2)) * BLOCK_N
            tl.store(part + offs_n[None, :], h2, mask=in_rows[:, None] & in_n[None, :])
        else:
            score = _keep_score(h2, B3, W4, B4, stride_w4n, stride_w4k, offs_n, NARROW, dtype)
            tl.store(SCORES + rows, score, mask=in_rows)


@triton.jit(do_not_specialize=["total"])
def _out_head_kernel(
    H2, B3, W4, B4, SCORES, Z, total, stride_w4n, stride_w4k,
    NARROW: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The scores of ``BLOCK_M`` rows from the ``SPLITS`` partial sums of the third layer, added in split order
    (``Z``: the first layer's output, of which only the dtype is used: the model's)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < total
    offs_n = tl.arange(0, BLOCK_N)
    parts = H2 + rows.to(tl.int64)[:, None] * (SPLITS * BLOCK_N) + offs_n[None, :]
    mask = in_rows[:, None] & (offs_n < NARROW)[None, :]
    h2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        h2 += tl.load(parts + s * BLOCK_N, mask=mask, other=0.0)
    score = _keep_score(h2, B3, W4, B4, stride_w4n, stride_w4k, offs_n, NARROW, Z.dtype.element_ty)
    tl.store(SCORES + rows, score, mask=in_rows)


_global_launcher = CompiledLauncher(_global_kernel)
_out_conv_launcher = CompiledLauncher(_out_conv_kernel)
_out_head_launcher = CompiledLauncher(_out_head_kernel)


@dataclass(frozen=True)
class _Tiles:
    """Launch shape of the predictor's kernels for a batch size (untuned: chosen for enough programs at T=197)."""

    rows_out: int  # rows per program of the second to fourth layers
    num_warps: int
    split_hidden: bool  # a program per hidden chunk of the second layer (and a launch to add them up)


_SMALL_ROWS = 2048  # up to ~10 DeiT images: small tiles for more programs; larger batches want larger tiles
_SMALL = _Tiles(rows_out=16, num_warps=4, split_hidden=True)
_LARGE = _Tiles(rows_out=64, num_warps=8, split_hidden=False)
# Rows per program of the scores from the split sums (32 left too few programs at B=1: docs/tuning.md#dynamicvit-tiles)
_HEAD_ROWS = 8
_BLOCK_K = 64  # reduction step of every GEMM
_BLOCK_H = 64  # hidden columns of the second layer per step of the third
_GLOBAL_COLUMNS = 32  # columns of the global half per program of the mean (12 programs per DeiT-B image)
_MEAN_ROWS = 256  # patch rows per step of the mean (a DeiT image at 224 in one step: one round trip to L2)


def _tiles(total: int) -> _Tiles:
    return _SMALL if total <= _SMALL_ROWS else _LARGE


def _block(width: int, cap: int) -> int:
    """A power-of-two tile of at least 16 (``tl.dot``'s least) and at most ``cap`` covering ``width`` if it can."""
    return min(cap, max(16, next_power_of_2(width)))


def _layers(predictor: PredictorLG) -> tuple[torch.nn.Module, ...]:
    """The predictor's last three Linears (checkpoint names out_conv.0/2/4), which the kernels read."""
    fc2, _, fc3, _, fc4, _ = predictor.out_conv
    return fc2, fc3, fc4


def _first_layer(predictor: PredictorLG, x: torch.Tensor) -> torch.Tensor:
    """``GELU(LayerNorm(x) @ W1^T + b1)``, contiguous ``[T, C]``: the reference's own ops, as functional calls on the
    module's parameters (no module calls: fewer host ops in an eager forward)."""
    norm, fc1, gelu = predictor.in_conv
    normed = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return F.gelu(F.linear(normed, fc1.weight, fc1.bias), approximate=gelu.approximate)


def _scores(
    predictor: PredictorLG, x: torch.Tensor, cu: torch.Tensor, max_seqlen: int, num_prefix: int
) -> torch.Tensor:
    """The predictor's keep log-probability of every row, fp32 ``[T]`` (prefix rows included): the first layer's
    three torch ops, then two or three launches; inputs checked (``x`` in the predictor's dtype and width, on its
    device)."""
    fc2, fc3, fc4 = _layers(predictor)
    total, channels = x.shape
    batch = cu.shape[0] - 1
    local, hidden, narrow = channels // 2, fc2.out_features, fc3.out_features
    if total == 0:
        return torch.empty(0, dtype=torch.float32, device=x.device)
    z = _first_layer(predictor, x)  # [T, C] contiguous, in the model dtype
    chunks = cdiv(channels - local, _GLOBAL_COLUMNS)
    tiles = _tiles(total)
    blocks = (_block(local, _BLOCK_K), _block(hidden, _BLOCK_H), max(16, next_power_of_2(narrow)))
    # Small batches split the second layer's hidden chunks over programs (one each), then add the partial sums of
    # the third layer in a second launch; large ones have programs enough without it.
    splits = cdiv(hidden, blocks[1]) if tiles.split_hidden else 1
    # fp32 [T] scores, [B, chunks, C/2] shares of the global half and, split, [T, splits, C/4] partial sums
    lengths = (total, batch * chunks * hidden) + ((total * splits * blocks[2],) if splits > 1 else ())
    scores, parts, *split_sums = scratch(lengths, torch.float32, x.device)
    h2 = split_sums[0] if split_sums else scores
    device = x.get_device()
    w2, w3, w4 = fc2.weight, fc3.weight, fc4.weight
    # the kernels' tensors (not ``predictor.parameters()``: a walk of the module tree at every stage of a forward)
    ok = aligned(cu, z, parts, scores, w2, fc2.bias, w3, fc3.bias, w4, fc4.bias)

    args = (z, cu, w2, parts, total, num_prefix, *w2.stride(), channels, local, hidden, _GLOBAL_COLUMNS, _BLOCK_H,
            _MEAN_ROWS)  # fmt: skip
    key = (x.dtype, channels, w2.stride(), _MEAN_ROWS) if ok else None
    _global_launcher(key, device, (batch, chunks), args, num_warps=4, num_stages=1)

    args = (
        z, cu, parts, w2, fc2.bias, w3, fc3.bias, w4, fc4.bias, scores, h2, total, *w2.stride(), *w3.stride(),
        *w4.stride(), channels, local, hidden, narrow, chunks, tiles.rows_out, *blocks, splits > 1,
    )  # fmt: skip
    key = (x.dtype, channels, tiles, splits, w2.stride(), w3.stride(), w4.stride()) if ok else None
    grid = (batch, cdiv(max_seqlen, tiles.rows_out), splits)
    _out_conv_launcher(key, device, grid, args, num_warps=tiles.num_warps, num_stages=2)
    if splits > 1:
        args = (h2, fc3.bias, w4, fc4.bias, scores, z, total, *w4.stride(), narrow, splits, _HEAD_ROWS, blocks[2])
        key = (x.dtype, narrow, splits, blocks[2], w4.stride()) if ok and aligned(h2) else None
        _out_head_launcher(key, device, (cdiv(total, _HEAD_ROWS),), args, num_warps=4, num_stages=1)
    return scores


def _check_predictor(predictor: object, x: torch.Tensor, name: str) -> None:
    """``x`` is the predictor's input: its width, dtype and device."""
    if not isinstance(predictor, PredictorLG):
        raise TypeError(f"predictor must be a PredictorLG, got {type(predictor).__name__}")
    norm = predictor.in_conv[0]
    if x.shape[1] != norm.normalized_shape[0]:
        raise ValueError(f"{name} must have {norm.normalized_shape[0]} channels (the predictor's), got {x.shape[1]}")
    for pname, p in predictor.named_parameters():
        if p.dtype != x.dtype or p.device != x.device:
            raise ValueError(
                f"the predictor's parameters must be in {name}'s dtype and on its device ({x.dtype}, {x.device}), got "
                f"{pname} in {p.dtype} on {p.device}"
            )


def dynamicvit_scores(
    predictor: PredictorLG,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    num_prefix: int = 1,
    check_values: bool | None = None,
) -> torch.Tensor:
    """DynamicViT's predictor: the first layer's three torch ops, then two or three launches; the kernels' twin of
    ``predictor(x, cu_seqlens, num_prefix)[:, 0]`` as fp32 (see the module docstring for the rounding), no host
    synchronisation.

    Args:
        predictor: a :class:`PredictorLG` in ``x``'s dtype, on its device.
        x: ``[T, C]`` packed rows (any strides).
        cu_seqlens: int32 ``[B+1]`` offsets of the rows.
        max_seqlen: a bound on the image lengths that sizes the grid (an underestimate is slower, never wrong).
        num_prefix: prefix rows at the start of every image, excluded from the mean (their scores are computed
            all the same, as the reference's are, and mean nothing).
        check_values: read ``cu_seqlens`` to validate it (default: only on the CPU).

    Returns:
        fp32 ``[T]``: every row's keep log-probability.
    """
    check_tensor(x, "x", ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    _check_predictor(predictor, x, "x")
    cu = check_cu_seqlens(cu_seqlens, total=x.shape[0], device=x.device, check_values=check_values)
    check_max_seqlen(max_seqlen)
    check_int(num_prefix, "num_prefix", 0)
    return _scores(predictor, x, cu, max_seqlen, num_prefix)


def dynamicvit_select(pruner: DynamicViTPruner, inp: DecisionInput) -> TokenSelection:
    """``pruner(inp)``: the first layer's three torch ops, then three or four launches; the same
    :class:`TokenSelection` (up to the score rounding the module docstring states), kept counts included."""
    if not isinstance(pruner, DynamicViTPruner):
        raise TypeError(f"pruner must be a DynamicViTPruner, got {type(pruner).__name__}")
    inp = pruner.check_input(inp)
    _check_predictor(pruner.score_predictor[inp.stage], inp.x, "inp.x")
    check_max_seqlen(inp.row_bound, "inp.max_seqlen")
    return _select(pruner, inp)


@register_decision(DynamicViTPruner)
def _select(pruner: DynamicViTPruner, inp: DecisionInput) -> TokenSelection:
    """:func:`dynamicvit_select` on checked input: the fused decision the pipelines look up."""
    x, cu, prefix, bound = inp.x, inp.cu_seqlens, inp.num_prefix, inp.row_bound
    scores = _scores(pruner.score_predictor[inp.stage], x, cu, bound, prefix)
    if inp.image_patches is not None:  # images of several sizes: each its own count, ranked by torch
        return pruner.select_by_scores(scores.float(), inp)
    k = max(pruner.keep_patches(inp.stage, inp.num_patches), inp.min_patches)
    keep, kept = rank_keep_unchecked(scores, cu, bound, None, k, None, 0, prefix)
    current = inp.uniform_rows
    count = None if current is None else prefix + pruner.count_after(inp.stage, current - prefix, inp.num_patches)
    return TokenSelection(keep, kept, fixed_count=count is not None, count=count)
