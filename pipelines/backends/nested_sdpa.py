"""NestedTensor baseline: PyTorch's public ragged API, ``F.scaled_dot_product_attention`` on jagged tensors.

q, k, v become jagged NestedTensors over strided views of the qkv buffer (no copies), with the offsets and a min/max
length given at construction so that PyTorch does not compute them on the device (a sync per call), and the flash
backend is forced (otherwise SDPA may take its math path). Even so, building the NestedTensors costs milliseconds of
host time per call at ViT lengths (docs/targets.md, docs/results.md). ``min_seqlen=1`` is a valid lower bound since
every image keeps its CLS token. CUDA only, fp16/bf16. No key bias: the flash kernel takes no mask on jagged tensors
(``attend`` refuses a ``key_bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...reference.attention import split_qkv
from .base import AttentionBackend, Capabilities, aligned


class NestedSDPABackend(AttentionBackend):
    """Jagged NestedTensor SDPA, flash forced."""

    name = "nested_sdpa"
    capabilities = Capabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        capturable=False,
        not_capturable_because="building NestedTensors is not capturable in a CUDA graph",
    )
    sdpa_backends: tuple[SDPBackend, ...] = (SDPBackend.FLASH_ATTENTION,)

    def _attend(
        self, qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, scale: float
    ) -> torch.Tensor:
        offsets = cu_seqlens.long()

        def jagged(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, j, D]
            nt = torch.nested.nested_tensor_from_jagged(t, offsets=offsets, min_seqlen=1, max_seqlen=max_seqlen)
            return nt.transpose(1, 2)

        q, k, v = (jagged(t) for t in split_qkv(aligned(qkv), num_heads))
        with sdpa_kernel(list(self.sdpa_backends)):
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, H, j, D]
        return out.transpose(1, 2).values().flatten(1)  # [T, H*D]
