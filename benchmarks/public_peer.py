"""The pruned forward a user could assemble from PyTorch's and timm's public APIs alone, for ``torch.compile``.

The issue's strongest public-API peer is "padded SDPA under ``torch.compile(mode="reduce-overhead")`` where shapes
allow". ``reduce-overhead`` replays CUDA graphs, so the shapes must not change from call to call:

* fixed counts (DynamicViT, EViT without its fused token, Threshold-L2 ratio): after each stage the kept tokens
  are gathered into a smaller dense ``[B, k, C]`` batch (``torch.gather``) and timm's own blocks run on it: the
  compute shrinks as in our pipeline, with no padding at all;
* variable counts (ATS, Threshold-L2 calibrated, drawn masks): the batch stays ``[B, N, C]`` (padding to the
  batch's longest survivor would change the shape every call), and every attention after a stage gets a key mask
  (``attn_mask`` of timm's ``Attention``, i.e. SDPA's boolean mask): the paper's padded-full layout.

The decisions are replayed, not made: :func:`dense_plan` turns a packed run's selections (``ragged_vit.core.selection
.TokenSelection`` per stage) into gather indices or key masks computed before the timed call, so the peer's time
leaves out its pruner, which only favours the peer. Not supported: an appended extra token (EViT's fused token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ragged_vit.core.selection import Placement, Pruner, TokenSelection


def dense_plan(selections: Sequence[TokenSelection], batch: int, tokens: int, gather: bool) -> list[torch.Tensor]:
    """Per stage: int64 gather indices ``[B, k]`` into the current dense rows (``gather``, fixed counts), or the
    bool key mask ``[B, N]`` over the original positions after that stage.

    ``selections`` come from a packed run that started from ``batch`` dense images of ``tokens`` rows: a stage's
    ``keep`` covers the surviving rows of every image, in image order and, inside an image, in original order.
    """
    if not selections:
        raise ValueError("selections must hold one TokenSelection per stage, got none")
    device = selections[0].keep.device
    alive = torch.ones(batch, tokens, dtype=torch.bool, device=device)
    plan = []
    for index, sel in enumerate(selections):
        if sel.extra_token is not None:
            raise ValueError(f"selections[{index}] appends an extra token (EViT's fused token): not supported here")
        keep = sel.keep.reshape(-1)
        if keep.numel() != int(alive.sum()):
            raise ValueError(f"selections[{index}].keep has {keep.numel()} rows, expected {int(alive.sum())}")
        if gather:
            rows = keep.view(batch, -1)  # fixed counts: the current layout is dense [B, k]
            counts = rows.sum(1)
            if bool((counts != counts[0]).any()):
                raise ValueError(f"selections[{index}] keeps different counts per image: gather needs equal counts")
            plan.append(torch.nonzero(rows)[:, 1].view(batch, -1))
        after = alive.clone()
        after[alive] = keep
        alive = after
        if not gather:
            plan.append(alive)
    return plan


class PublicPrunedViT(nn.Module):
    """A timm ``VisionTransformer`` run with a pruner's stage schedule and a replayed :func:`dense_plan`.

    Args:
        model: the timm model (its modules are used as they are).
        pruner: gives the schedule only (``blocks`` and ``placement``).
        gather: gather the kept tokens (fixed counts) instead of masking them (variable counts).
    """

    def __init__(self, model: VisionTransformer, pruner: Pruner, gather: bool) -> None:
        super().__init__()
        self.model = model
        self.gather = gather
        placement = Placement(pruner.placement)
        self.stages = {(block, placement): index for index, block in enumerate(pruner.blocks)}

    def forward(self, images: torch.Tensor, *plan: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(images))))
        mask = None  # [B, 1, 1, N] bool: the keys attention may use (variable counts)
        for k, block in enumerate(m.blocks):
            x, mask = self._stage(x, mask, plan, (k, Placement.BEFORE_BLOCK))
            if (k, Placement.MID_BLOCK) in self.stages:
                x = x + block.drop_path1(block.ls1(block.attn(block.norm1(x), attn_mask=mask)))
                x, mask = self._stage(x, mask, plan, (k, Placement.MID_BLOCK))
                x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
            elif mask is None:
                x = block(x)
            else:
                x = block(x, attn_mask=mask)
            x, mask = self._stage(x, mask, plan, (k, Placement.AFTER_BLOCK))
        return m.head(m.head_drop(m.fc_norm(m.norm(x)[:, 0])))

    def _stage(self, x, mask, plan, point):
        index = self.stages.get(point)
        if index is None:
            return x, mask
        if self.gather:
            idx = plan[index][:, :, None].expand(-1, -1, x.shape[-1])
            return x.gather(1, idx), None
        return x, plan[index][:, None, None, :]
