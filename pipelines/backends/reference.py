"""Reference backend: fp32 math, one image at a time (:func:`ragged_vit.reference.attention.ragged_attention`); runs on
CPU.

The ground truth the other backends are compared with. It reads the offsets on the host (one synchronisation
per call on a GPU) and loops over images in Python: correct and slow, never a baseline for speed. It takes a
``key_bias`` (the reference's).
"""

from __future__ import annotations

import torch

from ...reference.attention import ragged_attention, split_qkv
from .base import AttentionBackend, Capabilities


class ReferenceBackend(AttentionBackend):
    """fp32 (fp64 for fp64) attention, cast back to the input dtype."""

    name = "reference"
    capabilities = Capabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        capturable=False,
        not_capturable_because="it reads cu_seqlens on the host for every call (a synchronisation)",
        key_bias=True,
    )

    def _attend(
        self,
        qkv: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        num_heads: int,
        scale: float,
        key_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = split_qkv(qkv, num_heads)
        out = ragged_attention(q, k, v, cu_seqlens, scale=scale, key_bias=key_bias)  # [T, H, D], fp32 math
        return out.flatten(1).to(qkv.dtype)
