"""FlashAttention-2 varlen through the direct aten call ``torch.ops.aten._flash_attention_forward``.

The same FA2 kernel PyTorch's SDPA uses, called with the packed layout and ``cu_seqlens`` directly: q, k, v are strided
views of the qkv buffer (no ``.contiguous()`` copies), and no wrapper adds host work (the public ``varlen_attn`` wrapper
costs a few times as much per call; docs/tuning.md#fa2-varlen-direct-call). CUDA only, fp16/bf16, head_dim a multiple of
8 up to 256. ``scale`` is passed by keyword: it is keyword-only in newer torch (2.14) and positional-or-keyword in older
ones (2.11), and the keyword form works in both. No key bias: the varlen forward takes no additive bias (``attend``
refuses a ``key_bias``).
"""

from __future__ import annotations

import torch

from ...reference.attention import split_qkv
from .base import AttentionBackend, Capabilities, aligned


class FA2VarlenBackend(AttentionBackend):
    """FA2 varlen forward on the packed qkv views."""

    name = "fa2_varlen"
    capabilities = Capabilities(
        devices=("cuda",), dtypes=(torch.float16, torch.bfloat16), head_dims=tuple(range(8, 257, 8)), custom_op=True
    )

    def _attend(
        self, qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, scale: float
    ) -> torch.Tensor:
        q, k, v = split_qkv(aligned(qkv), num_heads)  # [T, H, D] views, last dimension contiguous
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
        )[0]  # [T, H, D]
        return out.flatten(1)
