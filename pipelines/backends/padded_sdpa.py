"""Padded baseline: gather the packed tokens to ``[B, L, ...]`` (L = the batch's longest survivor), run
``F.scaled_dot_product_attention`` with a boolean key-padding mask, gather the real rows back.

This is what a user without a varlen kernel would write, done well: the padding goes to the longest image of
the batch (not back to the unpruned N), and both gathers are index computations on the device (no Python loop
over images, no host synchronisation). PyTorch picks the SDPA kernel (a mask rules out flash; memory-efficient
attention or math run). A ``key_bias`` becomes what a user would pass: a float mask in the activations' dtype, the
bias on real keys and ``-inf`` on padded ones (so it is rounded to that dtype).

``PaddedSDPABackend(pad_to=N)`` pads every image to at least ``N`` rows instead: with ``N`` the unpruned length
(197 at 224x224) it is the paper's padded baseline, which pads back to the full length whatever was pruned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.segments import positions, segment_ids, seqlens
from .base import AttentionBackend, Capabilities


class PaddedSDPABackend(AttentionBackend):
    """Padding + key-padding mask + SDPA; any device, any float dtype."""

    name = "padded_sdpa"
    capabilities = Capabilities(key_bias=True)

    def __init__(self, pad_to: int | None = None) -> None:
        if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1):
            raise ValueError(f"pad_to must be a positive int or None, got {pad_to!r}")
        self.pad_to = pad_to

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, pad_to={self.pad_to})"

    def _attend(
        self,
        qkv: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        num_heads: int,
        scale: float,
        key_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total, width = qkv.shape
        batch = cu_seqlens.numel() - 1
        head_dim = width // (3 * num_heads)
        max_seqlen = max(max_seqlen, self.pad_to or 0)  # the padded length L
        slot = torch.arange(max_seqlen, device=qkv.device)
        valid = slot[None, :] < seqlens(cu_seqlens)[:, None]  # [B, L]
        # Padded slots read row 0 (any real row will do): their queries are discarded and their keys masked.
        rows = torch.where(valid, cu_seqlens[:-1].long()[:, None] + slot[None, :], 0)
        padded = qkv[rows.flatten()].view(batch, max_seqlen, 3, num_heads, head_dim)
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D] each
        mask = valid if key_bias is None else key_bias[rows].to(qkv.dtype).masked_fill_(~valid, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        out = out.transpose(1, 2).reshape(batch * max_seqlen, num_heads * head_dim)  # [B*L, H*D]
        dest = segment_ids(cu_seqlens, total) * max_seqlen + positions(cu_seqlens, total)  # [T]
        return out[dest]
