"""A skinny fused linear layer in Triton: ``[M, K] @ [N, K].T`` for the few hundred packed rows of a small-batch ViT
forward, with its LayerNorm, bias, GELU, LayerScale and residual fused in.

The op is :func:`ragged_vit.reference.linear.fused_linear` (its docstring states it); this is its kernel twin:

    * prologue (``ln_weight=``): each row's LayerNorm over K from its statistics, computed once per row and not once per
      program: ``ln_stats=`` (``[P, M, 2]`` fp32 chunk means and M2, see :mod:`ragged_vit.reference.linear`), as the
      fused linear that wrote ``x`` left them (``stats_out=``), or else a small statistics kernel launched first (one
      pass over the row in fp32, chunk by chunk, merged with Chan's update, so a large mean costs no precision); each
      program merges the P chunks of its rows, adds ``eps``, and rounds the normalised tile to the weight's dtype
      before the dot, as timm's ``norm`` hands its output to ``Linear``;
    * main loop: ``tl.dot`` of ``[BLOCK_M, BLOCK_K]`` row tiles with ``[BLOCK_K, BLOCK_N]`` tiles of the weight read
      transposed through strides (nn.Linear's ``[N, K]`` as stored, no copy), accumulated in fp32 (IEEE fp32 dots for
      fp32 inputs, no TF32);
    * epilogue, on the fp32 sum: ``+ bias``, GELU (``"gelu"``: exact erf, timm's ``nn.GELU`` default; ``"gelu_tanh"``:
      the tanh approximation, written so that it cannot overflow), ``* gamma`` (LayerScale), ``residual +``, then one
      rounding to the output dtype; with ``stats_out=``, each output tile's rows' mean and M2 over its columns, of the
      rounded values (the next LayerNorm's statistics: chunk ``p`` is output tile column ``p``), summed by a fixed
      pairwise tree and compiled without FMA contraction (which would fuse a product into the tree's adds where a
      pair sits in one thread, and not where the tile's layout splits it), so that every path below writes the same
      bits.

Split-K: a small M leaves few output tiles, too few to stream the weight with every SM. The grid is ``(M tiles, N
tiles, K splits)``; with more than one split each program writes its fp32 partial sum into a workspace ``[splits, M,
N]`` and a second small kernel adds the partials in split order (deterministic: the same bits on every run) and applies
the epilogue, on tiles of the same ``BLOCK_N`` (so ``stats_out`` has one chunk per ``BLOCK_N`` columns either way).
With one split the epilogue runs in the main kernel and there is no workspace. The split count comes from the
configuration table (:func:`ragged_vit.triton_impl.configs.linear_split`: about one or two programs per SM).

Single-launch split-K (``LinearConfig.fixup``): no second kernel. After storing its partial, each program adds one to
its output tile's counter (an int32 atomic with acquire-release semantics, after a barrier, so that every thread's
stores precede it); the program that sees ``splits - 1`` is the tile's last, so every partial is in the workspace: it
adds them in split order (the reduction kernel's own helper: the same bits as the two-kernel path), runs the epilogue
and sets the counter back to 0. The counters (one per tile, :data:`FIXUP_MAX_TILES` of them) are allocated zeroed
once per device and every launch leaves them zero, so a CUDA graph replays the launch without a memset; a launch with
more tiles, or a first use inside a graph capture, takes the two-kernel path (the same bits). Launches on one device
share the counters: two of them must not run at once on two streams.

Programmatic dependent launch (``M`` up to :data:`ragged_vit.triton_impl.configs.LINEAR_PDL_MAX_ROWS`, on GPUs that
have it): every kernel of a launch waits for the kernel before it in the stream (``gdc_wait``) before its first read,
and lets the next one start once its main loop is done (``gdc_launch_dependents``), so a chain of fused linears
overlaps each launch with the previous kernel's tail; the bits are the same.

Supported: fp16, bf16, fp32 inputs (``x``, ``weight`` and ``residual`` of one dtype; the vectors ``bias``,
``ln_weight``, ``ln_bias``, ``gamma`` in that dtype or fp32); K and N multiples of 16 up to 8192; any M (tuned for M
up to 256); the last dimension of every matrix contiguous, rows at any stride. ``out`` may be ``residual`` itself (an
in-place residual add) but must not overlap ``x`` or ``weight``. Not supported: other activations or norms, a backward.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..core.validation import FLOAT_DTYPES, check_tensor
from ..reference.linear import ACTIVATIONS, stats_chunk_width
from . import configs
from .configs import INTERPRETER_SMS, LinearConfig, linear_config, linear_split, sm_count
from .launcher import INTERPRETED, CompiledLauncher, aligned, cdiv, int_spec, pdl_supported

MAX_DIM = 8192
_ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _tanh(u):
    """tanh through the exp of ``-2|u|``, which never overflows: ``sign(u) (1 - e) / (1 + e)``."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _row_sum(v):
    """Each row's sum over the columns of a tile (a power of two wide) by a fixed tree: halve the columns, adding
    column j + width / 2 to column j, until one is left. Two-term adds only, so the bits do not depend on the tile's
    height or register layout: every path (unsplit, reduction kernel, last program) writes the same statistics."""
    for _ in tl.static_range(16):
        if v.shape[1] > 1:
            v = tl.sum(tl.reshape(v, [v.shape[0], 2, v.shape[1] // 2]), 1)
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def _epilogue(
    acc, offs_m, offs_n, M, N, B, G, R, Y, SO, stride_rm, stride_ym,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STATS_OUT: tl.constexpr,
):  # fmt: skip
    """``residual + gamma * act(acc + bias)`` on an fp32 tile, rounded once and stored, and with ``STATS_OUT`` the
    rounded rows' mean and M2 over the tile's columns into chunk ``program_id(1)`` of ``SO``; every step switched by a
    constexpr, so an unused one compiles to nothing."""
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # exact GELU: x * Phi(x)
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACTIVATION == 2:  # tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        acc = 0.5 * acc * (1.0 + _tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
    if HAS_GAMMA:
        acc *= tl.load(G + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    rounded = acc.to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], rounded, mask=mask)
    if STATS_OUT:  # of the values stored, as the next LayerNorm reads them
        chunk = tl.program_id(1)
        count = tl.minimum(N - chunk * offs_n.shape[0], offs_n.shape[0]) * 1.0
        v = tl.where(mask, rounded.to(tl.float32), 0.0)
        mean = _row_sum(v) / count
        dev = tl.where(mask, v - mean[:, None], 0.0)
        mask_m = offs_m < M
        stats = SO + chunk * M * 2 + offs_m * 2
        tl.store(stats, mean, mask=mask_m)
        tl.store(stats + 1, _row_sum(dev * dev), mask=mask_m)


@triton.jit
def _split_sum(WS, offs_m, offs_n, M, N, SPLITS: tl.constexpr):
    """The ``SPLITS`` fp32 partials of a tile in ``WS [SPLITS, M, N]``, added in split order (the same bits on every
    run, from either split-K path); read past L1, which may hold no line another program wrote."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = WS + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit(do_not_specialize=["M"])
def _stats_kernel(X, S, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Mean and M2 of each row of ``X`` over its K values into ``S [1, M, 2]``, in fp32, in one pass: each chunk's
    mean and sum of squared deviations, merged into the running ones by Chan's update (no E[x^2] - E[x]^2
    cancellation). ``PDL``: launched with programmatic dependent launch (waits for the kernel before it first)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    mean = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    m2 = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lanes = (k0 + offs_k) < K
        x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None] & lanes[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        seen = k0 * 1.0
        count = tl.minimum(K - k0, BLOCK_K) * 1.0
        chunk_mean = tl.sum(x, 1) / count
        dev = tl.where(lanes[None, :], x - chunk_mean[:, None], 0.0)
        delta = chunk_mean - mean
        mean += delta * (count / (seen + count))
        m2 += tl.sum(dev * dev, 1) + delta * delta * (seen * count / (seen + count))
    tl.store(S + offs_m * 2, mean, mask=mask_m)
    tl.store(S + offs_m * 2 + 1, m2, mask=mask_m)


@triton.jit
def _merged_stats(S, offs_m, mask_m, M, K, chunks, width, eps):
    """Mean and 1 / std of each row from its ``chunks`` chunks of ``S [chunks, M, 2]`` (``width`` columns each, the
    last one shorter), merged in chunk order by Chan's update, as ``reference.linear.merge_ln_stats``."""
    mean = tl.load(S + offs_m * 2, mask=mask_m, other=0.0)
    m2 = tl.load(S + offs_m * 2 + 1, mask=mask_m, other=0.0)
    seen = tl.minimum(width, K) * 1.0
    for p in range(1, chunks):
        count = tl.minimum(width, K - p * width) * 1.0
        part = S + p * M * 2 + offs_m * 2
        delta = tl.load(part, mask=mask_m, other=0.0) - mean
        mean += delta * (count / (seen + count))
        m2 += tl.load(part + 1, mask=mask_m, other=0.0) + delta * delta * (seen * count / (seen + count))
        seen += count
    return mean, 1.0 / tl.sqrt(m2 / K + eps)


@triton.jit(do_not_specialize=["M", "eps", "chunks", "width"])
def _linear_kernel(
    X, W, B, LNW, LNB, S, G, R, Y, WS, SO, CNT,
    M, N, K, k_per_split, eps, chunks, width,
    stride_xm, stride_wn, stride_rm, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LN: tl.constexpr,  # the rows' statistics in S [chunks, M, 2]
    HAS_LN_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 erf GELU, 2 tanh GELU
    HAS_GAMMA: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STATS_OUT: tl.constexpr,
    PARTIAL: tl.constexpr,  # several K splits: write the fp32 partial to WS [splits, M, N]
    FIXUP_SPLITS: tl.constexpr,  # 0: a second kernel adds the partials; else the tile's last program, counted in CNT
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no N masks on the weight
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # bf16 tiles widened to fp32 before the dot (exact products): the interpreter's bf16 dot
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the kernel before, release the next
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()  # before the first read: the rows (and statistics) are the previous kernel's output
    pid_m = tl.program_id(0)  # M tiles vary fastest: the programs that share a weight slab run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_LN:
        mean, rstd = _merged_stats(S, offs_m, mask_m, M, K, chunks, width, eps)
    x_rows = X + offs_m[:, None] * stride_xm
    w_cols = W + offs_n[None, :] * stride_wn  # the weight's rows, read as the columns of a [BLOCK_K, BLOCK_N] tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_k0
        if EVEN_K:
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_cols + offs_k[:, None])
            else:
                w = tl.load(w_cols + offs_k[:, None], mask=mask_n[None, :], other=0.0)
        else:
            lanes = offs_k < K  # a split never crosses into the next one: only K's own end is masked
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & lanes[None, :], other=0.0)
            w = tl.load(w_cols + offs_k[:, None], mask=lanes[:, None] & mask_n[None, :], other=0.0)
        if HAS_LN:
            if EVEN_K:
                scale = tl.load(LNW + offs_k).to(tl.float32)
            else:
                scale = tl.load(LNW + offs_k, mask=lanes, other=0.0).to(tl.float32)
            h = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * scale[None, :]
            if HAS_LN_BIAS:
                if EVEN_K:
                    h += tl.load(LNB + offs_k).to(tl.float32)[None, :]
                else:
                    h += tl.load(LNB + offs_k, mask=lanes, other=0.0).to(tl.float32)[None, :]
            a = h.to(w.dtype)  # the normalised rows in the weight's dtype, as the unfused norm would store them
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits for this one before any read
    if PARTIAL:
        ws = WS + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask_m[:, None] & mask_n[None, :])
        if FIXUP_SPLITS:
            count = CNT + pid_m * tl.num_programs(1) + pid_n
            tl.debug_barrier()  # every thread's partial stored before the count releases it
            if tl.atomic_add(count, 1, sem="acq_rel") == FIXUP_SPLITS - 1:  # the last: every partial is in
                tl.store(count, 0)  # zero again for the next launch (no memset, CUDA-graph safe)
                acc = _split_sum(WS, offs_m, offs_n, M, N, FIXUP_SPLITS)
                _epilogue(acc, offs_m, offs_n, M, N, B, G, R, Y, SO, stride_rm, stride_ym,
                          HAS_BIAS, ACTIVATION, HAS_GAMMA, HAS_RESIDUAL, STATS_OUT)  # fmt: skip
    else:
        _epilogue(acc, offs_m, offs_n, M, N, B, G, R, Y, SO, stride_rm, stride_ym,
                  HAS_BIAS, ACTIVATION, HAS_GAMMA, HAS_RESIDUAL, STATS_OUT)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    WS, B, G, R, Y, SO,
    M, N, stride_rm, stride_ym,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STATS_OUT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Adds the ``SPLITS`` fp32 partials of a tile in split order (the same bits on every run), then the epilogue."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _split_sum(WS, offs_m, offs_n, M, N, SPLITS)
    _epilogue(acc, offs_m, offs_n, M, N, B, G, R, Y, SO, stride_rm, stride_ym, HAS_BIAS, ACTIVATION, HAS_GAMMA,
              HAS_RESIDUAL, STATS_OUT)  # fmt: skip


_main = CompiledLauncher(_linear_kernel)
_reduce = CompiledLauncher(_reduce_kernel)
_stats = CompiledLauncher(_stats_kernel)
STATS_BLOCK_M = 8
"""Rows per program of the statistics kernel (a few, so that a few hundred rows spread over many SMs)."""
STATS_BLOCK_K = 256
"""Columns per step of the statistics kernel."""
FIXUP_MAX_TILES = 4096
"""Output tiles the per-device counters of the single-launch split-K cover (16 KiB); a launch with more tiles takes
the two-kernel path."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The int32 tile counters of the single-launch split-K on ``device``: zeroed once, left zero by every launch;
    None where ``tiles`` exceeds them or where their first use would be inside a CUDA graph capture (an allocation the
    graph's pool would own), and the two-kernel path runs instead."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if tiles > FIXUP_MAX_TILES or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        counters = _COUNTERS[device] = torch.zeros(FIXUP_MAX_TILES, dtype=torch.int32, device=device)
    return counters if tiles <= FIXUP_MAX_TILES else None


def _check_vector(value: object, name: str, length: int, x: torch.Tensor, what: str) -> None:
    check_tensor(value, name, ndim=1, dtypes=(x.dtype, torch.float32), device=x.device)
    if value.shape[0] != length:
        raise ValueError(f"{name} must hold {length} values ({what}), got {value.shape[0]}")
    if value.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {value.stride(0)}")


def _check_matrix(value: object, name: str, shape: tuple[int, int], x: torch.Tensor) -> None:
    check_tensor(value, name, ndim=2, dtypes=(x.dtype,), device=x.device)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if value.stride(1) != 1 and shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {value.stride()}")


def _check_stats(value: object, name: str, chunks: int | None, rows: int, columns: int, x: torch.Tensor) -> None:
    """``value`` as ``[chunks, rows, 2]`` contiguous fp32 stats of ``columns`` columns (any valid chunk count when
    ``chunks`` is None)."""
    check_tensor(value, name, ndim=3, dtypes=(torch.float32,), device=x.device)
    if value.shape[1:] != (rows, 2) or (chunks is not None and value.shape[0] != chunks):
        shape = f"[{'P' if chunks is None else chunks}, {rows}, 2]"
        raise ValueError(f"{name} must have shape {shape} (chunks, M, mean and M2), got {tuple(value.shape)}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {value.stride()}")
    try:
        stats_chunk_width(columns, value.shape[0])
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_linear_args(
    x: object,
    weight: object,
    bias: object = None,
    *,
    ln_weight: object = None,
    ln_bias: object = None,
    eps: object = 1e-5,
    activation: object = None,
    residual: object = None,
    gamma: object = None,
    out: object = None,
    ln_stats: object = None,
) -> None:
    """Every check of :func:`fused_linear`, each raising one line that names the argument (``TypeError`` for a wrong
    kind or dtype, ``ValueError`` for a wrong shape, layout, device or value); reads metadata only."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(weight, "weight", ndim=2, dtypes=(x.dtype,), device=x.device)
    rows, depth = x.shape
    cols = weight.shape[0]
    if weight.shape[1] != depth:
        raise ValueError(f"weight must be [N, K] with K = x.shape[1] = {depth}, got shape {tuple(weight.shape)}")
    for name, value in (("K (x.shape[1])", depth), ("N (weight.shape[0])", cols)):
        if value % 16 or not 16 <= value <= MAX_DIM:
            raise ValueError(f"{name} must be a multiple of 16 from 16 to {MAX_DIM}, got {value}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dimension (stride 1), got strides {x.stride()}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have a contiguous last dimension (stride 1), got strides {weight.stride()}")
    if bias is not None:
        _check_vector(bias, "bias", cols, x, "N")
    if ln_weight is not None:
        _check_vector(ln_weight, "ln_weight", depth, x, "K")
    if ln_bias is not None:
        if ln_weight is None:
            raise ValueError("ln_bias needs ln_weight: the LayerNorm is on iff ln_weight is given")
        _check_vector(ln_bias, "ln_bias", depth, x, "K")
    if ln_stats is not None:
        if ln_weight is None:
            raise ValueError("ln_stats needs ln_weight: they are the statistics of its LayerNorm")
        _check_stats(ln_stats, "ln_stats", None, rows, depth, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gamma is not None:
        _check_vector(gamma, "gamma", cols, x, "N")
    if residual is not None:
        _check_matrix(residual, "residual", (rows, cols), x)
    if out is not None:
        _check_matrix(out, "out", (rows, cols), x)
        if _shares_memory(out, x) or _shares_memory(out, weight):
            raise ValueError("out must not overlap x or weight (every program reads them whole)")
        if residual is not None and _shares_memory(out, residual):
            if out.data_ptr() != residual.data_ptr() or out.stride() != residual.stride():
                raise ValueError("out may be residual itself (an in-place residual add) but no other view of it")


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    ln_stats: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``residual + gamma * act(LayerNorm(x) @ weight.T + bias)``, each part optional, in one to three launches.

    Args:
        x: ``[M, K]`` rows (fp16, bf16 or fp32; last dimension contiguous).
        weight: ``[N, K]`` as ``nn.Linear`` stores it, ``x``'s dtype.
        bias: optional ``[N]``.
        ln_weight, ln_bias: the LayerNorm of the rows over K before the product (on iff ``ln_weight`` is given);
            ``[K]`` each; ``eps`` its epsilon (``nn.LayerNorm``'s ``eps``; timm's ViTs use 1e-6).
        activation: None, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``.
        residual: optional ``[M, N]`` added last (``x``'s dtype); ``gamma``: optional ``[N]`` LayerScale, multiplied
            before the residual add.
        out: optional ``[M, N]`` output; may be ``residual`` itself.
        ln_stats: optional (with ``ln_weight``) ``[P, M, 2]`` fp32 statistics of ``x``'s rows (chunk means and M2, as
            ``stats_out`` of the call that wrote ``x`` holds them); without them a statistics kernel runs first.
        stats_out: optional ``[P, M, 2]`` fp32 buffer (:func:`empty_ln_stats`) filled with the output rows'
            statistics, for the next LayerNorm's ``ln_stats``.
        config: launch configuration; None takes the table's (:func:`ragged_vit.triton_impl.configs.linear_config`).

    Returns:
        ``[M, N]`` in ``x``'s dtype. The vectors may be fp32 or ``x``'s dtype; every step runs in fp32 and the result
        is rounded once. See :mod:`ragged_vit.reference.linear` for the op, this module's docstring for the kernel.
    """
    check_linear_args(
        x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, activation=activation, residual=residual,
        gamma=gamma, out=out, ln_stats=ln_stats,
    )  # fmt: skip
    if config is not None and not isinstance(config, LinearConfig):
        raise TypeError(f"config must be a LinearConfig or None, got {type(config).__name__}")
    if stats_out is not None:
        rows, cols = x.shape[0], weight.shape[0]
        _check_stats(stats_out, "stats_out", ln_stats_chunks(rows, cols, x.device, config), rows, cols, x)
        if ln_stats is not None and _shares_memory(stats_out, ln_stats):
            raise ValueError("stats_out must not overlap ln_stats (every program reads them whole)")
    return fused_linear_unchecked(
        x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=float(eps), activation=activation,
        residual=residual, gamma=gamma, out=out, ln_stats=ln_stats, stats_out=stats_out, config=config,
    )  # fmt: skip


def ln_stats_chunks(rows: int, cols: int, device: torch.device, config: LinearConfig | None = None) -> int:
    """How many column chunks the ``stats_out`` of an ``[rows, cols]`` output has: one per ``block_n`` columns."""
    return cdiv(cols, (config or linear_config(device, rows)).block_n)


def empty_ln_stats(rows: int, cols: int, device: torch.device, config: LinearConfig | None = None) -> torch.Tensor:
    """A ``stats_out`` buffer for an ``[rows, cols]`` output of :func:`fused_linear` under ``config`` (None: the
    table's)."""
    return torch.empty((ln_stats_chunks(rows, cols, device, config), rows, 2), dtype=torch.float32, device=device)


def fused_linear_unchecked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    ln_stats: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """:func:`fused_linear` without its checks, for callers that validated their arguments once (wrong arguments here
    give wrong results, not errors)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    y = x.new_empty((rows, cols)) if out is None else out
    if rows == 0:
        return y
    device = x.device
    config = config or linear_config(device, rows)
    sms = sm_count(device.index) if device.type == "cuda" else INTERPRETER_SMS
    splits, k_per_split = linear_split(config, rows, cols, depth, sms)
    workspace = torch.empty((splits, rows, cols), dtype=torch.float32, device=device) if splits > 1 else None
    grid = (cdiv(rows, config.block_m), cdiv(cols, config.block_n), splits)
    counters = tile_counters(device, grid[0] * grid[1]) if config.fixup and splits > 1 else None
    index = x.get_device()
    pdl = rows <= configs.LINEAR_PDL_MAX_ROWS and device.type == "cuda" and pdl_supported(index)
    launch = {"launch_pdl": True} if pdl else {}  # with the kernels' PDL constexpr: their waits compiled in
    if ln_weight is not None and ln_stats is None:  # the rows' statistics, once per row, before the product
        ln_stats = torch.empty((1, rows, 2), dtype=torch.float32, device=device)
        stats_key = (x.dtype, int_spec(x.stride(0)), depth, pdl) if aligned(x, ln_stats) else None
        _stats(
            stats_key,
            index,
            (cdiv(rows, STATS_BLOCK_M),),
            (x, ln_stats, rows, depth, x.stride(0), STATS_BLOCK_M, STATS_BLOCK_K, pdl),
            num_warps=4,
            num_stages=1,
            **launch,
        )
    chunks = 0 if ln_stats is None else ln_stats.shape[0]
    width = 0 if ln_stats is None else stats_chunk_width(depth, chunks)
    flags = (bias is not None, _ACTIVATION_CODES[activation], gamma is not None, residual is not None,
             stats_out is not None)  # fmt: skip
    stride_rm = residual.stride(0) if residual is not None else 0
    tensors = (x, weight, bias, ln_weight, ln_bias, ln_stats, gamma, residual, y, workspace, stats_out, counters)
    present = [t for t in tensors if t is not None]
    # What Triton specialises on that can vary between calls: dtypes, row strides mod 16, pointer alignment; only
    # the all-aligned case is cached, any misaligned pointer takes Triton's own path.
    key = None
    if aligned(*present):
        strides = (x.stride(0), weight.stride(0), stride_rm, y.stride(0))
        key = (tuple(None if t is None else t.dtype for t in tensors), tuple(int_spec(s) for s in strides), config,
               splits, depth, cols, k_per_split, flags, ln_bias is not None, pdl)  # fmt: skip
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    fusion = {"enable_fp_fusion": stats_out is None}  # the statistics' sums as written, whatever the tile layout
    _main(
        key, index, grid,
        (*tensors, rows, cols, depth, k_per_split, eps, chunks, width, x.stride(0), weight.stride(0), stride_rm,
         y.stride(0), config.block_m, config.block_n, config.block_k, ln_weight is not None, ln_bias is not None,
         *flags, splits > 1, 0 if counters is None else splits, depth % config.block_k == 0,
         cols % config.block_n == 0, precision, INTERPRETED and x.dtype == torch.bfloat16, pdl),
        num_warps=config.num_warps, num_stages=config.num_stages, **fusion, **launch,
    )  # fmt: skip
    if splits > 1 and counters is None:
        block_m = min(16, 1 << (rows - 1).bit_length())  # a constexpr of the reduction: part of its launch key
        _reduce(
            key and (key, "reduce", block_m), index, (cdiv(rows, block_m), cdiv(cols, config.block_n)),
            (workspace, bias, gamma, residual, y, stats_out, rows, cols, stride_rm, y.stride(0), splits, block_m,
             config.block_n, *flags, pdl),
            num_warps=4, num_stages=1, **fusion, **launch,
        )  # fmt: skip
    return y


# The custom op for torch.compile and the CUDA graphs of compiled blocks, registered as the attention's is
# (docs/tuning.md#attention-custom-op). It is functional: no ``out``, and the output rows' statistics are returned.
_LIBRARY = torch.library.Library("ragged_vit", "FRAGMENT")
_LIBRARY.define(
    "fused_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? ln_weight, Tensor? ln_bias, float eps, "
    "str? activation, Tensor? residual, Tensor? gamma, Tensor? ln_stats, bool stats_out) -> (Tensor, Tensor)"
)


def _op_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    eps: float,
    activation: str | None,
    residual: torch.Tensor | None,
    gamma: torch.Tensor | None,
    ln_stats: torch.Tensor | None,
    stats_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape[0], weight.shape[0]
    stats = empty_ln_stats(rows, cols, x.device) if stats_out else x.new_empty((0, rows, 2), dtype=torch.float32)
    y = fused_linear(
        x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, activation=activation, residual=residual,
        gamma=gamma, ln_stats=ln_stats, stats_out=stats if stats_out else None,
    )  # fmt: skip
    return y, stats


_LIBRARY.impl("fused_linear", _op_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("ragged_vit::fused_linear")
def _(x, weight, bias, ln_weight, ln_bias, eps, activation, residual, gamma, ln_stats, stats_out):
    rows, cols = x.shape[0], weight.shape[0]
    chunks = ln_stats_chunks(rows, cols, x.device) if stats_out else 0
    return x.new_empty((rows, cols)), x.new_empty((chunks, rows, 2), dtype=torch.float32)


fused_linear_op = torch.ops.ragged_vit.fused_linear.default
"""``torch.ops.ragged_vit.fused_linear``: :func:`fused_linear` as an op, every argument positional and required;
returns ``(y, stats)``, ``stats`` the output rows' ``[P, M, 2]`` statistics with ``stats_out`` (else ``[0, M, 2]``)."""
