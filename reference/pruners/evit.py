"""EViT: keep the patches the CLS token attends to most, inside blocks 3, 6, 9 (between attention and MLP).

Liang et al., "Not All Patches are What You Need: Expediting Vision Transformers via Token Reorganizations",
ICLR 2022. The score of patch ``j`` is the head-mean CLS attention ``mean_h A_h[0, j]`` of the same block; each
stage keeps the top ``ceil(rate * patches)`` of the CURRENT patches (138, 97, 68 from 196 at rate 0.7), a fixed
count. With ``fuse_token`` the dropped patches are folded into one extra token per image, ``sum_j a_j x_j`` with
the raw (not renormalised) attention weights, appended after the kept rows (139, 99, 71 counting it); at later
stages it is a candidate like any other patch. No parameters: runs on vanilla DeiT weights.

Not supported: training-time keep-rate warm-up schedules; kept tokens stay in their original order instead of the
official score order (the MLP and later blocks are permutation-equivariant).
"""

from __future__ import annotations

import math

import torch

from ...core.segments import (
    ceil_rate,
    patch_counts,
    prefix_rows,
    segment_ids,
    segment_rank,
    segment_sum,
)
from ...core.selection import DecisionInput, Placement, Pruner, TokenSelection, kept_counts
from ...core.validation import check_blocks, check_rate
from ..cls_attention import attention_inputs
from .schedule import at_depth


class EViTPruner(Pruner):
    """Keeps the patches with the highest head-mean CLS attention, optionally fusing the rest into one token.

    Args:
        rate: keep rate of the current patches at every stage, in ``(0, 1]``.
        blocks: the timm blocks inside which each stage acts (after the attention residual, before the MLP).
        fuse_token: append one token per image, the attention-weighted sum of the dropped patches.
    """

    name = "evit"
    placement = Placement.MID_BLOCK
    blocks = (3, 6, 9)
    fixed_count = True
    needs_attention = True

    def __init__(self, rate: float = 0.7, blocks: tuple[int, ...] = (3, 6, 9), fuse_token: bool = False) -> None:
        super().__init__()
        self.rate = check_rate(rate, "rate")
        self.blocks = check_blocks(blocks)
        if not isinstance(fuse_token, bool):
            raise TypeError(f"fuse_token must be a bool, got {type(fuse_token).__name__}")
        self.fuse_token = fuse_token

    @classmethod
    def from_keep_rate(
        cls, keep_rate: float, *, embed_dim: int, num_patches: int, depth: int = 12, fuse_token: bool = False
    ) -> EViTPruner:
        """Inside blocks 3, 6, 9 of 12 (the same fractions of another depth: :func:`ragged_vit.reference.pruners.
        schedule.at_depth`), ``ceil(keep_rate * current)`` patches at each stage; ``fuse_token`` adds EViT's fused
        token."""
        blocks = at_depth((3, 6, 9), depth, merge=False, name="evit")
        return cls(rate=keep_rate, blocks=blocks, fuse_token=fuse_token)

    def extra_repr(self) -> str:
        return f"rate={self.rate}, blocks={self.blocks}, fuse_token={self.fuse_token}"

    @property
    def appends_token(self) -> bool:
        """With ``fuse_token``, a stage's selection may append the fused token."""
        return self.fuse_token

    def fuses(self, patches: int | None) -> bool:
        """Whether a stage on images of ``patches`` patches (None: a ragged batch) appends the fused token.

        As in the official code, no token is fused when the stage drops nothing. A ragged batch fuses whenever
        ``rate < 1``, so that one image's length never decides another image's layout.
        """
        if not self.fuse_token:
            return False
        if patches is None:
            return self.rate < 1.0
        return math.ceil(self.rate * patches) < patches

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        return math.ceil(self.rate * patches) + int(self.fuses(patches))

    def decide(self, inp: DecisionInput) -> TokenSelection:
        x, cu, num_prefix = inp.x, inp.cu_seqlens, inp.num_prefix
        total = x.shape[0]
        batch = cu.numel() - 1
        seg = segment_ids(cu, total)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 math, fp64 stays fp64
        score = attention_inputs(inp)[0].to(acc).mean(dim=-1)  # [T]
        k = ceil_rate(self.rate, patch_counts(cu, num_prefix))[seg]
        keep = prefix_rows(cu, total, num_prefix) | (segment_rank(score, cu, num_prefix) < k)
        current = inp.uniform_rows
        patches = None if current is None else current - num_prefix
        extra = None
        if self.fuses(patches):
            weight = score.masked_fill(keep, 0.0)[:, None]  # raw weights of the dropped patches only
            extra = segment_sum(weight * x.to(acc), seg, batch).to(x.dtype)  # [B, C]
        count = None if patches is None else num_prefix + self.count_after(inp.stage, patches, inp.num_patches)
        return TokenSelection(keep, kept_counts(keep, cu), count is not None, count, extra)
