"""The functions a forward's steps call, plain or under ``torch.compile``: one :class:`Parts` each way, chosen once
when a forward's program is built (:meth:`ragged_vit.pipelines.model.PrunedViT.program`), never per call.

Compiled parts run every block's non-attention work through Inductor (it fuses the LayerNorms, residual adds and
GELU around the GEMMs; the attention backend and the Triton decisions stay opaque ops), and the pruners that have no
fused decision run under ``torch.compile`` together with their CLS-attention scores; a RoPE model's rotation of the
qkv a decision scores from is one fused kernel instead of a dozen small ones. Compiled on first use of each
shape; their results agree with the plain parts' to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.decisions import fused_decision
from ..core.selection import Decision, DecisionInput, Pruner
from .eva import block_table
from .packed_block import (
    dense_block,
    fused_attention,
    fused_blocks,
    fused_mlp,
    packed_attention,
    packed_attention_branch,
    packed_attention_residual,
    packed_blocks,
    packed_mlp,
    packed_mlp_qkv,
    packed_qkv,
)


@dataclass(frozen=True)
class Parts:
    """What the steps of a forward call (see :mod:`ragged_vit.pipelines.packed_block` for the block functions).

    Attributes:
        compiled: whether these are the ``torch.compile`` versions.
        front: ``(pipeline, images [B, 3, H, W], table=None) -> ([B, N, C], rope table or None)``: the embedding and
            the dense blocks (:func:`front`).
        blocks: a run of whole packed blocks (:func:`packed_blocks`).
        attention: a block's attention half and its qkv projection (:func:`packed_attention`).
        qkv, residual, branch: the attention half in parts (:func:`packed_qkv`, :func:`packed_attention_residual`,
            :func:`packed_attention_branch`), where a decision or a merge takes part of it.
        mlp: a block's MLP half (:func:`packed_mlp`); mlp_qkv: it and the next block's qkv (:func:`packed_mlp_qkv`).
        fused_blocks, fused_attention, fused_mlp: the same in the fused-linear form (:func:`fused_blocks`,
            :func:`fused_attention`, :func:`fused_mlp`), the steps with ``linear``.
        decide: ``(pruner, inp) -> Decision``: a stage's decision (:func:`decide`).
    """

    compiled: bool
    front: Callable
    blocks: Callable
    attention: Callable
    qkv: Callable
    residual: Callable
    branch: Callable
    mlp: Callable
    mlp_qkv: Callable
    fused_blocks: Callable
    fused_attention: Callable
    fused_mlp: Callable
    decide: Callable[[Pruner, DecisionInput], Decision]


@functools.cache
def parts(compiled: bool) -> Parts:
    """The plain parts, or the compiled ones (made once per process; each compiles on its first call)."""
    plain = (front, packed_blocks, packed_attention, packed_qkv, packed_attention_residual, packed_attention_branch,
             packed_mlp, packed_mlp_qkv, fused_blocks, fused_attention, fused_mlp)  # fmt: skip
    if not compiled:
        return Parts(False, *plain, decide)
    return Parts(True, *map(torch.compile, plain), _decide_compiled)


def front(
    pipeline, images: torch.Tensor, table: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Embedding and the dense blocks before the first stage: ``[B, 3, H, W]`` -> ``[B, N, C]``, and the model's rope
    table at this image size (None without RoPE; ``table``: that table, built earlier). With a pruner the blocks of a
    ViT run through :func:`dense_block` (lean when plain: bitwise timm's ``block(x)``, fewer host ops); the unpruned
    pipeline runs timm's own blocks, and so does an Eva model, each block given its rope table as timm's forward gives
    it."""
    if pipeline.eva:
        x, table = pipeline.embed_rope(images, table)
        for index, block in enumerate(pipeline.model.blocks[: pipeline.num_dense_blocks]):
            x = block(x, rope=block_table(table, pipeline.rope, index))
        return x, table
    x = pipeline.embed(images)
    lean = pipeline.pruner is not None
    for block in pipeline.model.blocks[: pipeline.num_dense_blocks]:
        x = dense_block(block, x) if lean else block(x)
    return x, None


def decide(pruner: Pruner, inp: DecisionInput) -> Decision:
    """One stage's decision on checked input: the fused decision registered for the pruner on ``inp``'s device
    (:mod:`ragged_vit.core.decisions`), else the pruner itself."""
    fused = fused_decision(pruner, inp.x.device)
    return fused(pruner, inp) if fused is not None else pruner.decide(inp)


def _decide_compiled(pruner: Pruner, inp: DecisionInput) -> Decision:
    """:func:`decide`, with a pruner that has no fused decision run under ``torch.compile`` on CUDA (Inductor fuses
    its segment operations; its reductions may round differently, like the compiled blocks)."""
    fused = fused_decision(pruner, inp.x.device)
    if fused is not None:
        return fused(pruner, inp)
    if not inp.x.is_cuda:
        return pruner.decide(inp)
    # The row bound is left out: reference decisions do not read it (no recompiles when it changes).
    return _compiled_decision()(pruner, inp.x, inp.cu_seqlens, inp.stage, inp.num_patches, inp.qkv, inp.num_heads,
                                inp.scale, inp.num_prefix)  # fmt: skip


def _decision(pruner: Pruner, x, cu, stage, num_patches, qkv, num_heads, scale, num_prefix) -> Decision:
    return pruner.decide(DecisionInput(x, cu, stage, num_patches, None, qkv, num_heads, scale, num_prefix=num_prefix))


@functools.cache
def _compiled_decision() -> Callable:
    return torch.compile(_decision)
