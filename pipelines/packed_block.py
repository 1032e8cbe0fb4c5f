"""One timm transformer block on a packed buffer ``[T, C]``, attention through a backend.

timm's ``Block.forward`` is ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``. Every module in it but
the attention core acts on each token independently (LayerNorm, the Linear layers, LayerScale, GELU, identity
dropouts), so it runs unchanged on the flat ``[T, C]`` buffer; only ``softmax(q k^T) v`` must respect image
boundaries, and that is the backend's job. The same modules and parameters are used: no copy, no fork of timm.

A MID_BLOCK pruning stage (EViT, ATS) sits between the attention residual and the MLP, so the two halves are also
callable on their own: :func:`packed_attention` (which returns the block's qkv projection too, for the stage's
CLS-attention scores) and :func:`packed_mlp`; the forward plan (:mod:`ragged_vit.pipelines.plan`) says where.

Supported: ``timm.models.vision_transformer.Block`` with ``timm.layers.Attention`` (qk_norm, scale_norm and the
gated variant of newer timm included), in eval mode. Not supported: other block types (ResPostBlock,
ParallelScalingBlock, ...), attention masks, rotary embeddings, dropout at training time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from timm.models.vision_transformer import Attention, Block  # Attention lives in timm.layers in newer timm
from torch import nn

from ragged_vit.pipelines.backends.base import AttentionBackend
from ragged_vit.reference.attention import split_qkv


def check_packable(block: nn.Module, name: str = "block") -> None:
    """Raises ``NotImplementedError`` unless ``block`` is a timm ``Block`` with a timm ``Attention``."""
    if not isinstance(block, Block):
        raise NotImplementedError(
            f"{name} must be a timm vision_transformer.Block to run packed, got {type(block).__name__}"
        )
    if not isinstance(block.attn, Attention):
        raise NotImplementedError(
            f"{name}.attn must be a timm Attention to run packed, got {type(block.attn).__name__}"
        )


def block_qkv(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The qkv projection of normalised tokens ``x [T, C]`` -> ``[T, 3*H*D]``, with q_norm / k_norm applied.

    With identity q/k norms (DeiT) this is the Linear layer's output itself, which the backends read through
    strides. timm normalises q and k per head over ``D``; so does this, on ``[T, H, D]`` views.
    """
    qkv = attn.qkv(x)
    if isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity):
        return qkv
    q, k, v = split_qkv(qkv, attn.num_heads)
    return torch.cat([attn.q_norm(q).flatten(1), attn.k_norm(k).flatten(1), v.flatten(1)], dim=1)


def packed_attention(
    block: Block, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, backend: AttentionBackend
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of ``block`` on packed tokens: ``x + ls1(attn(norm1(x)))``.

    Args: as :func:`packed_block`.

    Returns:
        The residual stream after the attention residual ``[T, C]`` and the block's qkv projection ``[T, 3*H*D]``
        (what a MID_BLOCK pruning stage scores).
    """
    attn = block.attn
    normed = block.norm1(x)
    qkv = block_qkv(attn, normed)  # [T, 3*H*D]
    a = backend.attend(qkv, cu_seqlens, max_seqlen, attn.num_heads, attn.scale)  # [T, H*D]
    a = attn.norm(a) if hasattr(attn, "norm") else a  # scale_norm (identity unless configured)
    gate = getattr(attn, "gate", None)  # gated attention of newer timm versions
    if gate is not None:
        a = a * gate(normed).sigmoid()
    return x + block.drop_path1(block.ls1(attn.proj_drop(attn.proj(a)))), qkv


def packed_mlp(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The MLP half of ``block`` on packed tokens ``[T, C]``: ``x + ls2(mlp(norm2(x)))`` (no attention: any rows)."""
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def packed_blocks(
    blocks: Sequence[Block], x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, backend: AttentionBackend
) -> torch.Tensor:
    """Consecutive blocks with no pruning stage among them, on one packed buffer: ``[T, C]`` -> ``[T, C]``."""
    for block in blocks:
        x = packed_block(block, x, cu_seqlens, max_seqlen, backend)
    return x


@functools.cache
def compiled_halves() -> tuple[Callable, Callable]:
    """:func:`packed_attention` and :func:`packed_mlp` under ``torch.compile`` (Inductor fuses the LayerNorms,
    residual adds and GELU around the GEMMs; the attention backend stays one opaque op). Compiled on first use."""
    return torch.compile(packed_attention), torch.compile(packed_mlp)


@functools.cache
def compiled_blocks() -> Callable:
    """:func:`packed_blocks` under ``torch.compile``: one graph over the whole run of blocks, so Inductor also
    fuses each residual add with the next LayerNorm across the attention ops (which stay opaque custom ops)."""
    return torch.compile(packed_blocks)


def packed_block(
    block: Block, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, backend: AttentionBackend
) -> torch.Tensor:
    """Runs ``block`` on packed tokens: :func:`packed_attention`, then :func:`packed_mlp`.

    Args:
        block: a timm ``Block`` (see :func:`check_packable`).
        x: ``[T, C]`` packed residual stream.
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``.
        max_seqlen: host int bounding every image's length.
        backend: the attention backend.

    Returns:
        The block's output ``[T, C]``.
    """
    return packed_mlp(block, packed_attention(block, x, cu_seqlens, max_seqlen, backend)[0])
