"""Bidirectional ragged (varlen) attention for packed ViT tokens, in Triton.

Supported:
    * Packed layout ``[T, ...]`` + int32 ``cu_seqlens [B+1]`` (FlashAttention's varlen contract); each image
      attends to its own tokens only. No causal mask, no dropout, no KV cache: ViT inference attention.
    * Input straight from the qkv projection, ``qkv [T, 3*H*D]`` in timm's layout (q heads, k heads, v heads),
      read through strides: no ``.contiguous()`` copy, no permute. Output ``[T, H*D]``, ready for ``proj``.
    * Separate ``q, k, v [T, H, D]`` with arbitrary strides.
    * fp16, bf16, fp32 inputs; output in the input dtype (bf16 is never routed through fp16). fp32 dot products
      run in IEEE fp32 (not TF32) so fp32 results are fp32-accurate.
    * head_dim any multiple of 8 up to 256 (DeiT's 64, ViT-H/14's 80). A head dim that is not a power of two of at
      least 16 (``tl.dot``'s smallest width) is padded to one inside the kernel (masked loads and stores: zeros that
      change no dot product); other head dims raise ``ValueError``.
    * softmax scale ``head_dim ** -0.5`` unless given; ``log2(e)`` is folded into it and ``exp2`` is used.
    * an optional per-key additive bias ``key_bias`` (float32 ``[T]``, contiguous, natural-log units, added to the
      scaled logits of key row ``t`` for every head and query: ToMe's proportional attention passes ``log(size)``),
      as :func:`ragged_vit.reference.ragged_attention` takes it. A constexpr switches it: without a bias the compiled
      kernel has no bias argument and no bias instruction.
    * an optional rotary position embedding ``rotary`` (:class:`ragged_vit.core.rotary.Rotary`: a RoPE ViT's
      table of ``[sin | cos]`` per position, shared or one per head, each row's position, the interleaved or half
      layout): q and k are rotated in fp32 as they are loaded, rounded to the input dtype, as
      :func:`ragged_vit.reference.rotary.rotate` does (rows at positions outside the table, the prefix rows, stay as
      they are). Another constexpr: without it nothing of the rotation is compiled in.

Dispatch: no host synchronisation and no allocation besides the output (none with ``out=``). ``max_seqlen``
is only an upper bound that sizes the grid; ``cu_seqlens`` is read on the GPU. Every program walks its query
tiles with a grid-stride loop, so an underestimated bound is slower, never wrong, and offsets are clamped to
``[0, T]`` inside the kernel so malformed ``cu_seqlens`` cannot read or write out of bounds (validate them
with ``check_values=True`` when they come from untrusted code; that check does read the device).

Two entry points per layout: the direct call (lowest dispatch cost; capturable in CUDA graphs) and a
``torch.library`` custom op ``torch.ops.ragged_vit.ragged_attention_qkv`` with a fake implementation, for
``torch.compile``.

Not supported: any other attention bias or mask (per query, per head), a non-finite key bias, backward pass, head
dims outside the range above.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..core.rotary import Rotary, check_rotary
from ..core.validation import FLOAT_DTYPES, check_cu_seqlens, check_max_seqlen, check_tensor
from .configs import AttentionConfig, attention_config
from .launcher import CompiledLauncher, aligned, cdiv, next_power_of_2

SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8))
_LOG2E = tl.constexpr(1.4426950408889634)
_MIN_DOT = 16  # tl.dot's smallest reduction width: a head dim (and the rotary dots' half) is padded up to it


def _block_d(lanes: int) -> int:
    """The tile width of ``lanes`` lanes of a dot (a head dim, or its half for the rotary dots): a power of two, at
    least :data:`_MIN_DOT` (masked lanes: zeros)."""
    return max(_MIN_DOT, next_power_of_2(lanes))


def rotary_table_args(table: torch.Tensor) -> tuple[int, int, int]:
    """A rope table's rows, head stride (0: one table for every head) and row stride, as the kernels take them."""
    return table.shape[-2], table.stride(0) if table.dim() == 3 else 0, table.stride(-2)


def rotary_key(key: tuple | None, rotary: Rotary) -> tuple | None:
    """A launch ``key`` (:mod:`ragged_vit.triton_impl.launcher`) extended by what Triton specialises on a rotation's
    arguments: dtypes, the table's rank and strides mod 16, the layout; None without a key or where a rotation pointer
    is misaligned (Triton's own path)."""
    table, positions, half = rotary
    if key is None or not aligned(table, positions):
        return None
    return (*key, table.dtype, positions.dtype, table.dim(), table.stride(0) % 16, table.stride(-2) % 16, half)


@triton.jit
def load_pairs(rows, stride_d, row_mask, other, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """RoPE's pairs of lanes of a tile's rows (``rows``: ``[R, 1]`` pointers to each row's first lane, lanes
    ``stride_d`` apart) as two ``[R, BLOCK_H]`` tiles, the pairs' first lanes and their second: a row's two halves
    (``HALF``), or its even and odd lanes, read as one contiguous tile and split (strided loads cost a load per
    element). ``MASKED`` reads only the rows of ``row_mask`` (``[R, 1]``) and the ``HEAD_DIM / 2`` real pairs
    (``other`` elsewhere); without it every row and pair must be real."""
    if HALF:
        offs_h = tl.arange(0, BLOCK_H)[None, :]
        if MASKED:
            lanes = row_mask & (offs_h < HEAD_DIM // 2)
            a = tl.load(rows + offs_h * stride_d, mask=lanes, other=other)
            b = tl.load(rows + (offs_h + HEAD_DIM // 2) * stride_d, mask=lanes, other=other)
        else:
            a = tl.load(rows + offs_h * stride_d)
            b = tl.load(rows + (offs_h + HEAD_DIM // 2) * stride_d)
    else:
        offs_p = tl.arange(0, 2 * BLOCK_H)[None, :]
        if MASKED:
            pairs = tl.load(rows + offs_p * stride_d, mask=row_mask & (offs_p < HEAD_DIM), other=other)
        else:
            pairs = tl.load(rows + offs_p * stride_d)
        a, b = tl.split(tl.reshape(pairs, [pairs.shape[0], BLOCK_H, 2]))
    return a, b


@triton.jit
def rotate_pairs(a, b, pos, rope_rows, table, stride_rn, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 HALF: tl.constexpr):  # fmt: skip
    """RoPE on a tile's pairs (:func:`load_pairs`'s ``a`` and ``b``), each row turned by the angle of its position
    ``pos`` (``[R, 1]``) in the head's ``table`` (rows of ``[sin | cos]``, ``stride_rn`` apart; a pair's angle read
    at its first lane): ``a cos - b sin`` and ``b cos + a sin`` in fp32, rounded to the tile's dtype (timm's order).
    A row at a position outside ``[0, rope_rows)`` stays as it is."""
    rotated_rows = (pos >= 0) & (pos < rope_rows)
    angles = table + tl.where(rotated_rows, pos, 0).to(tl.int64) * stride_rn
    sin, _ = load_pairs(angles, 1, rotated_rows, 0.0, HEAD_DIM, BLOCK_H, HALF, True)
    cos, _ = load_pairs(angles + HEAD_DIM, 1, rotated_rows, 1.0, HEAD_DIM, BLOCK_H, HALF, True)
    sin, cos = sin.to(tl.float32), cos.to(tl.float32)
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    turned_a = (a32 * cos - b32 * sin).to(a.dtype)
    turned_b = (b32 * cos + a32 * sin).to(b.dtype)
    return tl.where(rotated_rows, turned_a, a), tl.where(rotated_rows, turned_b, b)


@triton.jit
def _attend_key_tile(
    q, q2, acc, m_i, l_i, k_base, v_base, b_base, n0, seqlen, qk_scale,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_n0, offs_d, mask_d,
    p_base, t_base, rope_rows, stride_rn,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``n0 : n0 + BLOCK_N``; only the ragged last tile is masked (and the padded
    head-dim lanes, when the head dim is not a power of two). ``b_base`` points at the image's first key bias. With
    ``HAS_ROPE`` the keys are loaded as their pairs' two lanes (:func:`load_pairs`), rotated (``p_base``: the image's
    first position, ``t_base``: the head's rope table), and scored against the queries' pair lanes ``q`` and ``q2``
    by two dots: each key element and its table entry are read once."""
    offs_n = n0 + offs_n0
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]
    if MASKED:
        mask_n = offs_n < seqlen
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    if HAS_ROPE:
        k_rows = k_base + offs_n[:, None] * stride_kt
        if MASKED:
            pos = tl.load(p_base + offs_n, mask=mask_n, other=-1)
            ka, kb = load_pairs(k_rows, stride_kd, mask_n[:, None], 0.0, HEAD_DIM, BLOCK_H, ROPE_HALF, True)
        else:
            pos = tl.load(p_base + offs_n)
            ka, kb = load_pairs(k_rows, stride_kd, offs_n[:, None] >= 0, 0.0, HEAD_DIM, BLOCK_H, ROPE_HALF, not EVEN_H)
        ka, kb = rotate_pairs(ka, kb, pos[:, None], rope_rows, t_base, stride_rn, HEAD_DIM, BLOCK_H, ROPE_HALF)
        s = tl.dot(q, tl.trans(ka), input_precision=DOT_PRECISION)
        s = tl.dot(q2, tl.trans(kb), acc=s, input_precision=DOT_PRECISION)
    else:
        k_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]
        if MASKED:
            kt = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        elif EVEN_D:
            kt = tl.load(k_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    if HAS_BIAS:
        # The bias joins the scaled logits in the exp2 domain (one multiply per key, one fused multiply-add per score)
        # before the running max, so a large bias can neither overflow nor underflow exp2. Masked keys stay -inf.
        if MASKED:
            bias = tl.load(b_base + offs_n, mask=mask_n, other=0.0)
        else:
            bias = tl.load(b_base + offs_n)
        s = s * qk_scale + (bias * _LOG2E)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    else:
        # The running max in unscaled units, subtracted before the scale (with log2(e)): the largest score's exponent
        # is exactly 0. Scaling first lets the compiler fuse it into an FMA whose unrounded product misses the rounded
        # max by half an ulp: at logits past about 1e9 every exponent of a row underflows and the row is 0/0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2((s - m_new[:, None]) * qk_scale)
        alpha = tl.math.exp2((m_i - m_new) * qk_scale)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["total_rows", "rope_rows"])
def _ragged_attention_kernel(
    Q, K, V, O, CU_SEQLENS,
    KEY_BIAS,  # float32 [T], or None (then HAS_BIAS is False and the argument is compiled out)
    ROPE_TABLE, ROPE_POS,  # [N, 2*D] or [H, N, 2*D] and int [T], or None (HAS_ROPE False: compiled out)
    total_rows,
    rope_rows,  # N: positions outside [0, N) are left unrotated
    stride_rh, stride_rn,  # the rope table's head (0: one table for every head) and row strides
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    K_OFFSET: tl.constexpr,  # elements from K (V) to the first key (value): H*D (2*H*D) inside a packed qkv row
    V_OFFSET: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    BLOCK_H: tl.constexpr,  # with HAS_ROPE: HEAD_DIM / 2 rounded up to a power of two, at least 16 (a dot's minimum)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_HALF: tl.constexpr,  # the half layout (partners D/2 apart), else interleaved (neighbours)
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NUM_HEADS
    h = pid_bh % NUM_HEADS
    # Clamp the offsets into [0, T] so malformed cu_seqlens can never address memory outside the buffers.
    start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + b), 0), total_rows)
    end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + b + 1), start), total_rows)
    seqlen = end - start
    full_end = (seqlen // BLOCK_N) * BLOCK_N

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    q_base = Q + start.to(tl.int64) * stride_qt + h * stride_qh
    k_base = K + K_OFFSET + start.to(tl.int64) * stride_kt + h * stride_kh
    v_base = V + V_OFFSET + start.to(tl.int64) * stride_vt + h * stride_vh
    o_base = O + start.to(tl.int64) * stride_ot + h * stride_oh
    b_base = KEY_BIAS + start if HAS_BIAS else KEY_BIAS
    if HAS_ROPE:
        p_base = ROPE_POS + start
        t_base = ROPE_TABLE + h * stride_rh
    else:
        p_base, t_base = ROPE_POS, ROPE_TABLE
    EVEN_H: tl.constexpr = 2 * BLOCK_H == HEAD_DIM

    # Grid-stride loop over query tiles: correct for any grid size along axis 0.
    for tile in range(pid_m, tl.cdiv(seqlen, BLOCK_M), tl.num_programs(0)):
        offs_m = tile * BLOCK_M + offs_m0
        mask_m = offs_m < seqlen
        if HAS_ROPE:  # q as its pairs' two lanes, rotated once per query tile
            q_rows = q_base + offs_m[:, None] * stride_qt
            q, q2 = load_pairs(q_rows, stride_qd, mask_m[:, None], 0.0, HEAD_DIM, BLOCK_H, ROPE_HALF, True)
            pos = tl.load(p_base + offs_m, mask=mask_m, other=-1)
            q, q2 = rotate_pairs(q, q2, pos[:, None], rope_rows, t_base, stride_rn, HEAD_DIM, BLOCK_H, ROPE_HALF)
        else:
            q = tl.load(
                q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :],
                other=0.0,
            )
            q2 = q
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                q, q2, acc, m_i, l_i, k_base, v_base, b_base, n0, seqlen, qk_scale,
                stride_kt, stride_kd, stride_vt, stride_vd, offs_n0, offs_d, mask_d,
                p_base, t_base, rope_rows, stride_rn,
                MASKED=False, EVEN_D=EVEN_D, EVEN_H=EVEN_H, HAS_BIAS=HAS_BIAS, HAS_ROPE=HAS_ROPE, ROPE_HALF=ROPE_HALF,
                HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        if full_end < seqlen:
            acc, m_i, l_i = _attend_key_tile(
                q, q2, acc, m_i, l_i, k_base, v_base, b_base, full_end, seqlen, qk_scale,
                stride_kt, stride_kd, stride_vt, stride_vd, offs_n0, offs_d, mask_d,
                p_base, t_base, rope_rows, stride_rn,
                MASKED=True, EVEN_D=EVEN_D, EVEN_H=EVEN_H, HAS_BIAS=HAS_BIAS, HAS_ROPE=HAS_ROPE, ROPE_HALF=ROPE_HALF,
                HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        acc = acc / l_i[:, None]
        tl.store(
            o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
            acc.to(O.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


_launcher = CompiledLauncher(_ragged_attention_kernel)


def _launch(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    strides: tuple[int, ...],
    offsets: tuple[int, int],
    cu_seqlens: torch.Tensor,
    shape: tuple[int, int, int],
    max_seqlen: int,
    scale: float,
    key_bias: torch.Tensor | None,
    config: AttentionConfig,
    key: tuple | None = None,
    rotary: Rotary | None = None,
) -> None:
    """Launches the kernel on validated input; writes the output tensor (``tensors[3]``) in place.

    ``tensors`` are the q, k, v, o base tensors, ``strides`` their (token, head, dim) strides (12 ints),
    ``offsets`` the element offsets of k and v from their base, ``shape`` is ``(T, H, D)``. ``key`` (see
    :mod:`ragged_vit.triton_impl.launcher`) enables the cached launch; None always goes through Triton's binder.
    """
    total, heads, head_dim = shape
    batch = cu_seqlens.shape[0] - 1
    grid = (cdiv(max_seqlen, config.block_m) if config.grid_per_tile else 1, batch * heads)
    precision = "ieee" if tensors[0].dtype == torch.float32 else "tf32"
    if rotary is None:
        args = (
            *tensors, cu_seqlens, key_bias, None, None, total, 0, 0, 0, scale * _LOG2E.value, *strides, *offsets,
            heads, head_dim, _block_d(head_dim), _MIN_DOT, config.block_m, config.block_n, key_bias is not None,
            False, False, precision,
        )  # fmt: skip
    else:
        args = (
            *tensors, cu_seqlens, key_bias, rotary.table, rotary.positions, total, *rotary_table_args(rotary.table),
            scale * _LOG2E.value, *strides, *offsets, heads, head_dim, _block_d(head_dim), _block_d(head_dim // 2),
            config.block_m, config.block_n, key_bias is not None, True, bool(rotary.half), precision,
        )  # fmt: skip
    device = tensors[0].get_device()
    _launcher(key, device, grid, args, num_warps=config.num_warps, num_stages=config.num_stages)


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return like.new_empty(shape)
    check_tensor(out, "out", ndim=len(shape), dtypes=(like.dtype,), device=like.device)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    return out


def _check_common(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None,
    key_bias: torch.Tensor | None,
    total: int,
    head_dim: int,
    device: torch.device,
    check_values: bool | None,
    rotary: Rotary | None = None,
    heads: int = 1,
) -> float:
    """Checks what both layouts share; returns the softmax scale."""
    if total == 0:
        raise ValueError("the packed input must hold at least one token (T >= 1)")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 8 up to 256, got {head_dim}")
    check_cu_seqlens(cu_seqlens, total=total, device=device, check_values=check_values)
    check_max_seqlen(max_seqlen)
    if key_bias is not None:
        check_tensor(key_bias, "key_bias", ndim=1, dtypes=(torch.float32,), device=device)
        if key_bias.shape[0] != total:
            raise ValueError(f"key_bias must have one value per packed row ({total}), got {key_bias.shape[0]}")
        if not key_bias.is_contiguous():
            raise ValueError(f"key_bias must be contiguous, got stride {key_bias.stride(0)}")
    if rotary is not None:
        _check_rotary(rotary, total, heads, head_dim, device)
    if scale is None:
        return head_dim**-0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    return float(scale)


def _check_rotary(rotary: object, total: int, heads: int, head_dim: int, device: torch.device) -> None:
    if not isinstance(rotary, Rotary):
        raise TypeError(f"rotary must be a ragged_vit.core.rotary.Rotary or None, got {type(rotary).__name__}")
    check_rotary(rotary.table, rotary.positions, total, heads, head_dim, device)
    if rotary.table.stride(-1) != 1 or not rotary.positions.is_contiguous():
        raise ValueError("rotary table must have a contiguous last dimension and rotary positions must be contiguous")
    if not isinstance(rotary.half, bool):
        raise TypeError(f"rotary half must be a bool, got {type(rotary.half).__name__}")


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    *,
    key_bias: torch.Tensor | None = None,
    rotary: Rotary | None = None,
    out: torch.Tensor | None = None,
    check_values: bool | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Ragged attention on separate ``q, k, v [T, H, D]`` (any strides). Returns ``[T, H, D]``.

    Args:
        q, k, v: packed queries, keys and values, one dtype, one device.
        cu_seqlens: int32 ``[B+1]`` offsets on the same device.
        max_seqlen: an upper bound on every image's length (the unpruned N is fine); sizes the grid only.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        key_bias: optional float32 ``[T]`` (contiguous, finite), added to every logit of key row ``t`` after the
            scale, in natural-log units (ToMe's proportional attention passes ``log(size)``).
        rotary: optional :class:`ragged_vit.core.rotary.Rotary`: q and k rotated by their rows' rope table rows
            as they are loaded (``table`` ``[N, 2*D]`` or ``[H, N, 2*D]``, last dimension contiguous; ``positions``
            int32/int64 ``[T]``, contiguous, outside ``[0, N)`` unrotated), as
            :func:`ragged_vit.reference.rotary.rotate` does (fp32, rounded to the input dtype).
        out: optional ``[T, H, D]`` output (any strides) to write into.
        check_values: read ``cu_seqlens`` to validate its values; default only on CPU (no GPU sync).
        config: launch configuration; ``None`` takes the tuned table's choice (``ragged_vit.triton_impl.configs``).
    """
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(k, "k", ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor(v, "v", ndim=3, dtypes=(q.dtype,), device=q.device)
    if q.shape != k.shape or q.shape != v.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"q, k, v must share one shape [T, H, D], got {shapes}")
    total, heads, head_dim = q.shape
    scale = _check_common(
        cu_seqlens, max_seqlen, scale, key_bias, total, head_dim, q.device, check_values, rotary, heads
    )
    o = _check_out(out, (total, heads, head_dim), q)
    config = config or attention_config(q.device, head_dim, total / (cu_seqlens.shape[0] - 1))
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    _launch(
        (q, k, v, o), strides, (0, 0), cu_seqlens, (total, heads, head_dim), max_seqlen, scale, key_bias, config,
        rotary=rotary,
    )  # fmt: skip
    return o


def ragged_attention_qkv(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float | None = None,
    *,
    key_bias: torch.Tensor | None = None,
    rotary: Rotary | None = None,
    out: torch.Tensor | None = None,
    check_values: bool | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Ragged attention read straight from timm's packed qkv projection output.

    This is the hot path of the pipelines: no views are built (q, k and v are addressed as offsets into the qkv
    row) and repeated calls launch the compiled kernel directly (:mod:`ragged_vit.triton_impl.launcher`).

    Args:
        qkv: ``[T, 3*H*D]`` output of ``Attention.qkv`` on the packed tokens; rows may be strided, the last
            dimension must be contiguous.
        cu_seqlens: int32 ``[B+1]`` offsets.
        max_seqlen: an upper bound on every image's length; sizes the grid only.
        num_heads: ``H``.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        key_bias: optional float32 ``[T]`` per-key bias, as :func:`ragged_attention` takes it.
        rotary: optional RoPE of q and k (a RoPE ViT's), as :func:`ragged_attention` takes it.
        out: optional ``[T, H*D]`` output (contiguous last dimension) to write into.
        check_values: read ``cu_seqlens`` to validate its values; default only on CPU (no GPU sync).
        config: launch configuration; ``None`` takes the tuned table's choice (``ragged_vit.triton_impl.configs``).

    Returns:
        ``[T, H*D]`` in the dtype of ``qkv``, ready for ``Attention.proj``.
    """
    check_tensor(qkv, "qkv", ndim=2, dtypes=FLOAT_DTYPES)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    total, width = qkv.shape
    if width % (3 * num_heads):
        raise ValueError(f"qkv.shape[1] ({width}) must be divisible by 3 * num_heads ({3 * num_heads})")
    head_dim = width // (3 * num_heads)
    scale = _check_common(
        cu_seqlens, max_seqlen, scale, key_bias, total, head_dim, qkv.device, check_values, rotary, num_heads
    )
    inner = num_heads * head_dim
    o = _check_out(out, (total, inner), qkv)
    if qkv.stride(1) != 1 or o.stride(1) != 1:
        name = "qkv" if qkv.stride(1) != 1 else "out"
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1)")
    return ragged_attention_qkv_unchecked(
        qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias, o, config, rotary=rotary
    )


def ragged_attention_qkv_unchecked(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """:func:`ragged_attention_qkv` without its checks (``scale`` required), for callers that validated their
    input once at their own entry: the pipelines' attention backend, called once per block. Wrong arguments here
    give wrong results, not errors."""
    total, width = qkv.shape
    head_dim = width // (3 * num_heads)
    inner = num_heads * head_dim
    o = qkv.new_empty((total, inner)) if out is None else out
    config = config or attention_config(qkv.device, head_dim, total / (cu_seqlens.shape[0] - 1))
    row, out_row = qkv.stride(0), o.stride(0)
    strides = (row, head_dim, 1, row, head_dim, 1, row, head_dim, 1, out_row, head_dim, 1)
    # What Triton specialises on that can vary between calls: dtypes, strides mod 16 and pointer alignment. Only
    # the all-aligned case is cached (the usual one); any misaligned pointer takes Triton's own path.
    biases = () if key_bias is None else (key_bias,)
    bias_dtype = None if key_bias is None else key_bias.dtype
    cached = aligned(qkv, o, cu_seqlens, *biases)
    key = (qkv.dtype, bias_dtype, num_heads, head_dim, config, row % 16, out_row % 16) if cached else None
    if rotary is not None:
        key = rotary_key(key, rotary)
    _launch(
        (qkv, qkv, qkv, o), strides, (inner, 2 * inner), cu_seqlens, (total, num_heads, head_dim), max_seqlen,
        scale, key_bias, config, key, rotary,
    )  # fmt: skip
    return o


# The custom op for torch.compile. Registered through torch.library.Library rather than the custom_op
# decorator: the decorator's Python wrapper adds host time to every eager call (docs/tuning.md#attention-custom-op).
_LIBRARY = torch.library.Library("ragged_vit", "DEF")
_LIBRARY.define(
    "ragged_attention_qkv(Tensor qkv, Tensor cu_seqlens, SymInt max_seqlen, int num_heads, float scale, "
    "Tensor? key_bias=None, Tensor? rope_table=None, Tensor? rope_positions=None, bool rope_half=False) -> Tensor"
)


def _op_impl(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
    rope_table: torch.Tensor | None = None,
    rope_positions: torch.Tensor | None = None,
    rope_half: bool = False,
) -> torch.Tensor:
    if (rope_table is None) != (rope_positions is None):
        raise ValueError("rope_table and rope_positions come together (the rotary= of ragged_attention_qkv)")
    rotary = None if rope_table is None else Rotary(rope_table, rope_positions, rope_half)
    return ragged_attention_qkv(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias=key_bias, rotary=rotary)


_LIBRARY.impl("ragged_attention_qkv", _op_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("ragged_vit::ragged_attention_qkv")
def _(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
    rope_table: torch.Tensor | None = None,
    rope_positions: torch.Tensor | None = None,
    rope_half: bool = False,
) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))


ragged_attention_qkv_op = torch.ops.ragged_vit.ragged_attention_qkv.default
"""``torch.ops.ragged_vit.ragged_attention_qkv``: :func:`ragged_attention_qkv` as an op (every argument but
``key_bias`` and the rotation required; ``rotary=Rotary(table, positions, half)`` as ``rope_table``,
``rope_positions``, ``rope_half``)."""
