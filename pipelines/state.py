"""The working memory of one forward (:class:`ForwardState`: what each step of the program hands to the next) and
what a forward returns (:class:`PrunedOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.selection import Decision

if TYPE_CHECKING:
    from .eva import RotaryRows


@dataclass(frozen=True, eq=False)
class MergeFusion:
    """The work around a merge that the Triton merge kernel takes over from a plain block.

    Attributes:
        branch: the block's attention branch ``ls1(proj(attend))`` ``[T, C]``, whose residual add the merge makes
            (each row's sum rounded as the add rounds it).
        norm: the block's ``norm2``; the merge also writes it of the merged rows, for the MLP, in small buffers
            (:data:`ragged_vit.pipelines.stages.MERGE_NORM_MAX_ROWS`).
    """

    branch: torch.Tensor
    norm: nn.LayerNorm


@dataclass
class ForwardState:
    """What one step of a forward hands to the next.

    Attributes:
        batch: ``B``, the real images (padding images, where a buffer has them, come after them in ``cu_seqlens``).
        x: the images ``[B, 3, H, W]`` before FRONT; the packed residual stream ``[T, C]`` after it.
        cu_seqlens: int32 offsets of ``x``'s images (an executor may set them before FRONT: a static buffer).
        max_seqlen: a host bound on every image's rows in ``x``.
        num_patches: patches of one unpruned image of this batch, set by FRONT; the stages count from it.
        qkv: the last attention half's qkv projection ``[T, 3*H*D]`` (what a mid-block decision scores).
        selection: the last decision, until its REPACK.
        logits: ``[B, classes]`` after HEAD.
        sizes: int32 ``[T]``: the patches each row holds, after a merging stage (None before: 1 each).
        key_bias: fp32 ``[T]``: ``log(sizes)``, added to every key's attention logits after a merge (ToMe's
            proportional attention); None before the first merge.
        prepared: ``(block, normed, qkv)``: ``norm1`` of ``x`` and the qkv projection of ``block``, computed by an
            MLP step with ``prepare`` for the ATTENTION step after it (:meth:`take_prepared`).
        fusion: what the merge after an ATTENTION step with ``branch`` takes over (:meth:`take_fusion`); while it
            holds a branch, the residual stream is ``x + branch``.
        normed: ``norm2(x)`` of the rows a merge wrote, for the MLP step after it (:meth:`take_normed`).
        rotary: a RoPE model's rotation of the rows of ``x`` (each row's rope table row, set by FRONT, moved by every
            repack: :class:`ragged_vit.pipelines.eva.RotaryRows`; an executor may set it before FRONT: a static
            table and positions); None for a model without RoPE.
        image_patches: int64 ``[B]``: each image's own unpruned patch count in a batch of several image sizes (set by
            the native-resolution front, :mod:`ragged_vit.pipelines.naflex`; ``num_patches`` is then the largest);
            None when every image has ``num_patches``.
        stats: ``(rows, stats)``: the LayerNorm statistics ``[P, T, 2]`` of the buffer ``rows``, left by the fused
            linear that wrote it (:meth:`x_stats`, :meth:`set_x`); None before any.
    """

    batch: int
    x: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    num_patches: int = 0
    qkv: torch.Tensor | None = None
    selection: Decision | None = None
    logits: torch.Tensor | None = None
    sizes: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    prepared: tuple[int, torch.Tensor, torch.Tensor] | None = None
    fusion: MergeFusion | None = None
    normed: torch.Tensor | None = None
    rotary: RotaryRows | None = None
    image_patches: torch.Tensor | None = None
    stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def x_stats(self) -> torch.Tensor | None:
        """The statistics of the rows of ``x`` if the fused linear that wrote this very buffer left them, else None:
        a step that writes a new buffer (a repack, a merge, an unfused half) leaves none, so the next fused linear
        computes them from the rows it finds."""
        stats = self.stats
        return stats[1] if stats is not None and stats[0] is self.x else None

    def set_x(self, x: torch.Tensor, stats: torch.Tensor | None) -> None:
        """``x`` and, where not None, the statistics of its rows."""
        self.x, self.stats = x, None if stats is None else (x, stats)

    def take_fusion(self) -> MergeFusion | None:
        """``fusion`` (cleared here), or None."""
        fusion, self.fusion = self.fusion, None
        return fusion

    def take_normed(self) -> torch.Tensor | None:
        """``normed`` (cleared here), or None."""
        normed, self.normed = self.normed, None
        return normed

    def take_prepared(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(normed, qkv)`` of ``block`` if the step before computed them (``prepared``, cleared here), else None."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        if prepared[0] != block:
            raise RuntimeError(f"block {prepared[0]}'s qkv was prepared, but block {block}'s attention runs next")
        return prepared[1], prepared[2]

    def row_sizes(self) -> torch.Tensor:
        """``sizes``, or before the first merge int32 ones ``[T]`` (every row holds one patch): what a merge weighs
        the rows of ``x`` by."""
        if self.sizes is not None:
            return self.sizes
        return torch.ones(self.x.shape[0], dtype=torch.int32, device=self.x.device)


@dataclass
class PrunedOutput:
    """What one forward of :class:`PrunedViT` produces.

    Attributes:
        logits: ``[B, classes]`` in input order.
        counts: int64 ``[B, S]``: tokens per image after each of the ``S`` stages, prefix rows (CLS) excluded
            (EViT's fused token counted, as the golden counts 139/99/71 do). On CUDA it is not read back.
        selections: the decision of each stage, to replay in another run (``PrunedViT.run(selections=...)``).
    """

    logits: torch.Tensor
    counts: torch.Tensor
    selections: list[Decision] = field(default_factory=list)
