"""The class token's attention row in Triton, the score source of EViT and ATS (the reference:
:func:`ragged_vit.reference.cls_attention.cls_attention`).

``_logits_kernel`` (one program per image, head and 16-row block) computes the CLS query's logit against every key of
its image, per head, straight from the block's qkv projection (``[T, H]`` fp32), and optionally every value's squared
norm per head (what ATS weighs its scores with). ``_mean_kernel`` (one program per image, its rows in registers)
takes each head's softmax over the image's rows on one ``[rows, heads]`` tile and averages the heads: EViT's score.
:func:`cls_attention_logits` and :func:`cls_attention_mean` launch them without checks: they serve the fused
decisions (:mod:`ragged_vit.triton_impl.evit`, :mod:`ragged_vit.triton_impl.ats`), which built their input. A RoPE
model's rotation (``rotary=``, a decision input's) is applied to the CLS query and the keys as they are loaded, pair by
pair as the attention kernel applies it (:func:`ragged_vit.triton_impl.attention.rotate_pairs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.rotary import Rotary
from ..core.selection import DecisionInput
from ..core.validation import FLOAT_DTYPES, check_int, check_max_seqlen, check_tensor
from .attention import load_pairs, rotary_key, rotary_table_args, rotate_pairs
from .launcher import CompiledLauncher, aligned, cdiv, next_power_of_2

_BLOCK_T = 16  # rows per step of the logits kernel: a DeiT image spreads over 13 programs


@triton.jit
def image_rows(CU, b, total):
    """Rows ``[start, end)`` of image ``b``, clamped to ``[0, total]``: malformed offsets cannot reach out of
    bounds."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    return start, end


@triton.jit(do_not_specialize=["total", "stride", "scale", "rope_rows"])
def _logits_kernel(
    QKV, CU, LOGITS, SQUARES, total, stride, scale,
    ROPE_TABLE, ROPE_POS,  # [N, 2*D] or [H, N, 2*D] and int [T], or None (HAS_ROPE False: compiled out)
    rope_rows, stride_rh, stride_rn,  # the table's rows (positions outside [0, N): unrotated) and strides
    H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VALUES: tl.constexpr,
    HAS_ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(2)
    start, end = image_rows(CU, b, total)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    if HAS_ROPE:  # q and k as their pairs' two lanes (the attention kernel's rotation), each logit two half sums
        table = ROPE_TABLE + h * stride_rh
        # The CLS row as a tile of BLOCK_T copies (cached reads): each key row then meets its own copy, elementwise.
        cls_rows = tl.zeros([BLOCK_T, 1], dtype=tl.int32)
        has_cls = cls_rows < end - start
        cls = QKV + start.to(tl.int64) * stride + h * D + cls_rows
        qa, qb = load_pairs(cls, 1, has_cls, 0.0, D, BLOCK_H, ROPE_HALF, True)
        cls_pos = tl.load(ROPE_POS + start + cls_rows, mask=has_cls, other=-1)  # not `pos`: the loop's
        qa, qb = rotate_pairs(qa, qb, cls_pos, rope_rows, table, stride_rn, D, BLOCK_H, ROPE_HALF)
        qa, qb = qa.to(tl.float32), qb.to(tl.float32)
    else:
        q = tl.load(QKV + start.to(tl.int64) * stride + h * D + offs_d, mask=in_d & (end > start), other=0.0)
        q = q.to(tl.float32)  # the CLS query of head h
    # Grid-stride loop over this image's row blocks: the grid's second axis is only a bound on the work.
    for t0 in range(start + tl.program_id(1) * BLOCK_T, end, tl.num_programs(1) * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        in_t = t < end
        head = QKV + t.to(tl.int64)[:, None] * stride + h * D
        if HAS_ROPE:
            ka, kb = load_pairs(head + H * D, 1, in_t[:, None], 0.0, D, BLOCK_H, ROPE_HALF, True)
            pos = tl.load(ROPE_POS + t, mask=in_t, other=-1)
            ka, kb = rotate_pairs(ka, kb, pos[:, None], rope_rows, table, stride_rn, D, BLOCK_H, ROPE_HALF)
            logit = tl.sum(ka.to(tl.float32) * qa, axis=1) + tl.sum(kb.to(tl.float32) * qb, axis=1)
        else:
            k = tl.load(head + H * D + offs_d[None, :], mask=in_t[:, None] & in_d[None, :], other=0.0)
            logit = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        tl.store(LOGITS + t * H + h, logit * scale, mask=in_t)
        if VALUES:
            v = tl.load(head + 2 * H * D + offs_d[None, :], mask=in_t[:, None] & in_d[None, :], other=0.0)
            v = v.to(tl.float32)
            tl.store(SQUARES + t * H + h, tl.sum(v * v, axis=1), mask=in_t)


@triton.jit(do_not_specialize=["total"])
def _mean_kernel(LOGITS, CU, SCORES, total, H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    start, end = image_rows(CU, b, total)
    offs = tl.arange(0, BLOCK_W)
    offs_h = tl.arange(0, BLOCK_H)
    for r0 in range(start, end, BLOCK_W):  # an image longer than the tile: its tail is scored 0 (past the bound)
        in_image = (r0 + offs < end) & (r0 == start)
        cells = (r0 + offs)[:, None] * H + offs_h[None, :]
        mask = in_image[:, None] & (offs_h < H)[None, :]
        logit = tl.load(LOGITS + cells, mask=mask, other=0.0)  # [W, heads]: every head's softmax at once
        peak = tl.max(tl.where(mask, logit, float("-inf")), 0)
        e = tl.where(mask, tl.exp(logit - peak[None, :]), 0.0)
        probs = e / tl.maximum(tl.sum(e, 0), 1.0)[None, :]  # the peak adds exp(0) = 1 per head
        tl.store(SCORES + r0 + offs, tl.sum(probs, 1) / H, mask=r0 + offs < end)


_logits_launcher = CompiledLauncher(_logits_kernel)
_mean_launcher = CompiledLauncher(_mean_kernel)


def check_qkv(qkv: torch.Tensor, num_heads: int, scale: float) -> tuple[int, int]:
    check_tensor(qkv, "qkv", ndim=2, dtypes=FLOAT_DTYPES)
    check_int(num_heads, "num_heads", 1)
    if qkv.shape[1] % (3 * num_heads):
        raise ValueError(f"qkv.shape[1] ({qkv.shape[1]}) must be divisible by 3 * num_heads ({3 * num_heads})")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv must have contiguous rows (stride 1 along dim 1), got strides {qkv.stride()}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    return num_heads, qkv.shape[1] // (3 * num_heads)


def check_qkv_input(inp: DecisionInput, method: str) -> None:
    """Checks what a fused decision that scores from the block's qkv projection reads of ``inp`` (already checked by
    its pruner): the projection itself, its heads and scale, the row bound."""
    if inp.qkv is None:
        raise ValueError(f"inp.qkv is required: the fused {method} decision scores from the block's qkv projection")
    check_qkv(inp.qkv, inp.num_heads, inp.scale)
    check_max_seqlen(inp.row_bound, "inp.max_seqlen")


def cls_attention_logits(
    qkv: torch.Tensor,
    cu: torch.Tensor,
    heads: int,
    scale: float,
    max_seqlen: int,
    values: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotary: Rotary | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``[T, H]`` CLS-query logits of every row (scaled), and with ``values`` the squared norm of every row's
    value per head (else None), from a checked qkv projection ``[T, 3*H*D]`` (contiguous rows); into ``out`` (two
    contiguous fp32 buffers of at least ``T * H`` elements, any shape: views of one allocation) when given. A checked
    ``rotary`` (a RoPE model's) rotates the CLS query and the keys as they are loaded, as the attention kernel does."""
    total, head_dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
    if out is not None:
        logits, squares = out
    else:
        logits = torch.empty(total, heads, dtype=torch.float32, device=qkv.device)
        squares = torch.empty(total, heads, dtype=torch.float32, device=qkv.device) if values else logits
    block_d = next_power_of_2(head_dim)
    args = (qkv, cu, logits, squares, total, qkv.stride(0), float(scale))
    key = (qkv.dtype, heads, head_dim, values) if aligned(qkv, cu, logits, squares) else None
    if rotary is None:
        args += (None, None, 0, 0, 0, heads, head_dim, _BLOCK_T, block_d, values, False, False, 1)
    else:
        table, positions, half = rotary
        args += (table, positions, *rotary_table_args(table), heads, head_dim, _BLOCK_T, block_d, values, True,
                 bool(half), next_power_of_2(head_dim // 2))  # fmt: skip
        key = rotary_key(key, rotary)
    grid = (cu.shape[0] - 1, cdiv(max_seqlen, _BLOCK_T), heads)
    _logits_launcher(key, qkv.get_device(), grid, args, num_warps=2, num_stages=1)
    return logits, squares if values else None


def cls_attention_mean(
    qkv: torch.Tensor, cu: torch.Tensor, heads: int, scale: float, max_seqlen: int, rotary: Rotary | None = None
) -> torch.Tensor:
    """fp32 ``[T]``: the CLS query's attention probability of every row of its image, averaged over the heads (EViT's
    score; prefix rows get theirs too), from a checked qkv projection (and ``rotary``, as
    :func:`cls_attention_logits` takes it); rows past ``max_seqlen`` in an image get 0, rows outside every image are
    not written."""
    logits, _ = cls_attention_logits(qkv, cu, heads, scale, max_seqlen, values=False, rotary=rotary)
    # Every row of every image is written (a tail past the tile: 0), so no zero-fill launch first; rows outside
    # every image (a buffer longer than ``cu[-1]``) are left as allocated: no decision reads them.
    scores = torch.empty(qkv.shape[0], dtype=torch.float32, device=qkv.device)
    width, block_h = next_power_of_2(max(max_seqlen, 16)), next_power_of_2(heads)
    args = (logits, cu, scores, qkv.shape[0], heads, width, block_h)
    key = (heads, width) if aligned(logits, cu, scores) else None
    _mean_launcher(key, qkv.get_device(), (cu.shape[0] - 1,), args, num_warps=4, num_stages=1)
    return scores
