"""DynamicViT's inference-time pruning: a small learned predictor scores the patches before blocks 3, 6, 9.

Rao et al., "DynamicViT: Efficient Vision Transformers with Dynamic Token Sparsification", NeurIPS 2021. Each stage
``s`` keeps the top ``int(num_patches * rate ** (s + 1))`` patches (counted from the ORIGINAL patch count: 196 ->
137, 96, 67 at rate 0.7) by the predictor's keep log-probability, a fixed count per image; the others are
discarded. The predictor's state-dict keys match the official checkpoints (``score_predictor.{p}.in_conv.*`` /
``.out_conv.*``), so trained weights load. With its random initial weights it is random pruning: fine for speed
measurements, meaningless for accuracy.

Not supported: training (Gumbel-softmax decisions, attention masking, distillation losses); kept tokens stay in
their original order instead of the official score order (blocks are permutation-equivariant).
"""

from __future__ import annotations

import torch
from torch import nn

from ...core.segments import prefix_rows, segment_ids, segment_rank, segment_sum
from ...core.selection import DecisionInput, Placement, Pruner, TokenSelection, kept_counts
from ...core.validation import check_blocks, check_int, check_rate
from .schedule import at_depth


class PredictorLG(nn.Module):
    """DynamicViT's local-global score predictor (module names as in the official code, for checkpoints).

    Args:
        embed_dim: channels ``C`` of the residual stream.
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.in_conv = nn.Sequential(nn.LayerNorm(embed_dim, eps=1e-5), nn.Linear(embed_dim, embed_dim), nn.GELU())
        self.out_conv = nn.Sequential(
            nn.Linear(embed_dim, embed_dim // 2),
            nn.GELU(),
            nn.Linear(embed_dim // 2, embed_dim // 4),
            nn.GELU(),
            nn.Linear(embed_dim // 4, 2),
            nn.LogSoftmax(dim=-1),
        )

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, num_prefix: int = 1) -> torch.Tensor:
        """Log-probabilities ``[T, 2]`` (channel 0 = keep) of packed rows ``x [T, C]``; prefix rows (the first
        ``num_prefix`` of each image) are not meaningful.

        The global half of the features is the mean over each image's own patch rows (not CLS), as the official
        policy-weighted mean is at inference, where every current token has policy 1.
        """
        total = x.shape[0]
        batch = cu_seqlens.numel() - 1
        seg = segment_ids(cu_seqlens, total)
        is_patch = ~prefix_rows(cu_seqlens, total, num_prefix)[:, None]
        z = self.in_conv(x)  # [T, C]
        half = z.shape[-1] // 2
        # The sum in fp32, rounded once to z's dtype, as the official code's ``.sum(dim=1)`` of a half tensor runs
        # on a GPU; the division in z's dtype, as there.
        glob = segment_sum(z[:, half:].float().masked_fill(~is_patch, 0.0), seg, batch).to(z.dtype)  # [B, C - C//2]
        glob = glob / segment_sum(is_patch.to(z.dtype), seg, batch).clamp_min(1.0)
        return self.out_conv(torch.cat([z[:, :half], glob[seg]], dim=-1))


class DynamicViTPruner(Pruner):
    """Keeps the patches DynamicViT's predictor scores highest, a fixed count per stage.

    Args:
        embed_dim: channels ``C`` of the model (384 for DeiT-S).
        rate: base keep rate ``rho``; stage ``s`` keeps ``int(num_patches * rho ** (s + 1))`` patches.
        blocks: the timm blocks whose input each stage prunes; one predictor per stage.
    """

    name = "dynamicvit"
    placement = Placement.BEFORE_BLOCK
    blocks = (3, 6, 9)
    fixed_count = True

    def __init__(self, embed_dim: int, rate: float = 0.7, blocks: tuple[int, ...] = (3, 6, 9)) -> None:
        super().__init__()
        check_int(embed_dim, "embed_dim", 4)  # out_conv narrows to C // 4 channels
        self.rate = check_rate(rate, "rate")
        self.blocks = check_blocks(blocks)
        self.score_predictor = nn.ModuleList(PredictorLG(embed_dim) for _ in self.blocks)

    @classmethod
    def from_keep_rate(cls, keep_rate: float, *, embed_dim: int, num_patches: int, depth: int = 12) -> DynamicViTPruner:
        """Before blocks 3, 6, 9 of 12 (the same fractions of another depth: :func:`ragged_vit.reference.pruners.
        schedule.at_depth`), ``int(num_patches * keep_rate ** s)`` patches at stage ``s`` (0.7 -> 137/96/67)."""
        return cls(embed_dim, rate=keep_rate, blocks=at_depth((3, 6, 9), depth, merge=False, name="dynamicvit"))

    def extra_repr(self) -> str:
        return f"rate={self.rate}, blocks={self.blocks}"

    def keep_patches(self, stage: int, num_patches: int) -> int:
        """Patches kept by ``stage``, counted from the original ``num_patches`` (before capping at those left)."""
        return int(num_patches * self.rate ** (stage + 1))

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        return min(self.keep_patches(stage, num_patches), patches)

    def check_input(self, inp: object) -> DecisionInput:
        inp = super().check_input(inp)
        if inp.stage >= len(self.blocks):
            raise ValueError(
                f"inp.stage must be < {len(self.blocks)} (one predictor per block in {self.blocks}), got {inp.stage}"
            )
        return inp

    def image_keep(self, inp: DecisionInput) -> torch.Tensor:
        """int64 ``[T]``: the patches the image of each row keeps at ``inp.stage`` (at least ``inp.min_patches``),
        counted from its own unpruned count (``inp.image_patches``, a batch of several image sizes) in float64, as
        :meth:`keep_patches` counts from one."""
        counts = (inp.image_patches.double() * self.rate ** (inp.stage + 1)).floor().long()
        return counts.clamp_min(inp.min_patches)[segment_ids(inp.cu_seqlens, inp.x.shape[0])]

    def decide(self, inp: DecisionInput) -> TokenSelection:
        score = self.score_predictor[inp.stage](inp.x, inp.cu_seqlens, inp.num_prefix)[:, 0].float()
        return self.select_by_scores(score, inp)

    def select_by_scores(self, score: torch.Tensor, inp: DecisionInput) -> TokenSelection:
        """The top patches of each image by its keep scores ``[T]`` (fp32): the decision after the predictor."""
        x, cu, num_prefix = inp.x, inp.cu_seqlens, inp.num_prefix
        total = x.shape[0]
        if inp.image_patches is None:
            k = max(self.keep_patches(inp.stage, inp.num_patches), inp.min_patches)
        else:
            k = self.image_keep(inp)
        keep = prefix_rows(cu, total, num_prefix) | (segment_rank(score, cu, num_prefix) < k)
        current = inp.uniform_rows
        count = (
            None if current is None else num_prefix + self.count_after(inp.stage, current - num_prefix, inp.num_patches)
        )
        return TokenSelection(keep, kept_counts(keep, cu), fixed_count=count is not None, count=count)
