"""CLS-query attention row, the score source of EViT and ATS, without the full ``N x N`` matrix.

The pruners only need ``softmax(q_cls . K^T * scale)`` per image and head: one row per image instead of ``N``.
Recomputing it from q and k (cheap: ``T * H * D`` multiply-adds) keeps the main attention fused.
"""

from __future__ import annotations

import torch

from ..core.segments import segment_ids, segment_softmax
from ..core.selection import DecisionInput
from ..core.validation import check_cu_seqlens, check_same_device, check_tensor
from .attention import split_qkv
from .rotary import rotate

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cls_attention(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention probabilities of each image's CLS query over that image's keys.

    Args:
        q, k: ``[T, H, D]`` packed queries and keys (any strides); the CLS row of image ``b`` is
            ``cu_seqlens[b]``.
        cu_seqlens: int32 ``[B+1]`` offsets.
        scale: softmax scale; ``None`` means ``D ** -0.5``.

    Returns:
        fp32 ``[T, H]``: row ``t`` holds ``A_h[0, j]`` for the image that owns row ``t`` (``j`` its position);
        every image's column sums to 1 per head.
    """
    check_tensor(q, "q", ndim=3, dtypes=_DTYPES)
    check_tensor(k, "k", ndim=3, dtypes=_DTYPES)
    check_same_device({"q": q, "k": k})
    if q.shape != k.shape:
        raise ValueError(f"q and k must share one shape [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    total = q.shape[0]
    check_cu_seqlens(cu_seqlens, total=total, device=q.device)
    batch = cu_seqlens.numel() - 1
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seg = segment_ids(cu_seqlens, total)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_cls = q[cu_seqlens[:-1].long().clamp(max=max(total - 1, 0))].to(dt)  # [B, H, D]
    logits = (q_cls[seg] * k.to(dt)).sum(-1) * scale  # [T, H]
    return segment_softmax(logits, seg, batch)


def attention_inputs(inp: DecisionInput) -> tuple[torch.Tensor, torch.Tensor]:
    """What an attention-scoring pruner reads at a stage: fp32 ``[T, H]`` CLS attention and ``[T, H*D]`` values,
    as given in ``inp`` (``cls_attn``, ``v``) or else derived from its block's ``qkv`` (the one definition of both),
    its queries and keys rotated by ``inp.rotary`` first where given (a RoPE model's, as its attention reads them)."""
    cls_attn, v = inp.cls_attn, inp.v
    if inp.qkv is not None and (cls_attn is None or v is None):
        q, k, values = split_qkv(inp.qkv, inp.num_heads)
        if cls_attn is None:
            if inp.rotary is not None:
                q, k = (rotate(t, *inp.rotary) for t in (q, k))
            cls_attn = cls_attention(q, k, inp.cu_seqlens, inp.scale)
        if v is None:
            v = values.flatten(1)
    return cls_attn, v
