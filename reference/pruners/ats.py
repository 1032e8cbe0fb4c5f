"""ATS: adaptive token sampling, a different number of patches per image, in every block from 3 to 11.

Fayyaz et al., "Adaptive Token Sampling For Efficient Vision Transformers", ECCV 2022. The significance of patch
``j`` is ``S_j = sum_h A_h[0, j] * ||V_j||_2`` (CLS attention of the same block times the value norm over all
heads), normalised to sum 1 per image. Deterministic inverse-transform sampling then picks the patches: sort ``S``
ascending, take the cumulative sum, min-max normalise it; ``num_samples`` evenly spaced targets from its smallest
non-zero value to 1 each pick the patch whose CDF value is nearest (ties, on the fp32 distances: the first);
duplicates collapse, so flat scores keep many patches and peaked scores few. Every image keeps at least
``min(min_keep, patches)`` patches (the best-scoring ones are added) and its CLS token. No parameters:
plug-and-play on vanilla DeiT weights.

Each image is sampled from its own scores only, in a padded ``[B, num_patches + 1]`` view of the SCORES (the
features stay packed); the width is a host bound, so nothing is read back from the device.
Not supported: the official code's padding-and-masking of the pruned batch (packing replaces it), training.
"""

from __future__ import annotations

import math

import torch

from ...core.segments import (
    patch_counts,
    positions,
    prefix_rows,
    segment_ids,
    segment_rank,
    segment_sum,
    seqlens,
    to_padded,
)
from ...core.selection import DecisionInput, Placement, Pruner, TokenSelection, kept_counts
from ...core.validation import check_blocks, check_int, check_rate
from ..cls_attention import attention_inputs
from .schedule import at_depth


def inverse_transform_sample(
    scores: torch.Tensor, cu_seqlens: torch.Tensor, width: int, num_samples: int, num_prefix: int = 1
) -> torch.Tensor:
    """ATS's deterministic inverse-transform sampling of every image's patches: ``[T]`` scores -> bool ``[T]``.

    Args:
        scores: ``[T]`` non-negative patch scores (prefix rows are ignored).
        cu_seqlens: int32 ``[B+1]`` offsets.
        width: an upper bound on the rows of every image (the padded view's width).
        num_samples: number of evenly spaced CDF targets.
        num_prefix: prefix rows at the start of every image (the class token first).

    Returns:
        bool ``[T]``: the patches some target picked (never a prefix row).
    """
    total = scores.shape[0]
    patches = patch_counts(cu_seqlens, num_prefix)[:, None]  # [B, 1]
    prefix = prefix_rows(cu_seqlens, total, num_prefix)
    inf = float("inf")
    # Prefix rows and padding (+inf) sort after the patches: each sorted row starts with its own image's patches.
    padded = to_padded(scores.masked_fill(prefix, inf), cu_seqlens, width, inf)  # [B, W]
    ascending, order = padded.sort(dim=1, stable=True)
    valid = torch.arange(width, device=scores.device) < patches  # [B, W]
    cdf = ascending.masked_fill(~valid, 0.0).cumsum(dim=1)
    low = cdf[:, :1]
    span = cdf.gather(1, (patches - 1).clamp_min(0)) - low
    # One patch, or all scores zero: the CDF is a single point; put it at 1 so that every target picks it.
    cdf = torch.where(span > 0, (cdf - low) / span, torch.ones_like(cdf)).masked_fill(~valid, inf)
    start = cdf.masked_fill(cdf <= 0, inf).amin(dim=1, keepdim=True).clamp(max=1.0)  # smallest non-zero value
    # With CDF steps of ~1e-9 (peaked scores) the fp32 distances round to ties, so which target picks which patch
    # depends on how the targets round. The official code's targets ``start + (linspace(0, 1, S) * (S - 1) -
    # start * s) / (S - 1)`` inherit torch.linspace's rounding, which is implementation-specific (on the CPU it
    # is up to 1 ulp off ``s / (S - 1)``, measured; CUDA has its own kernel); these are the same targets, rounded
    # the same way on every device and in the Triton kernel: ``s / (S - 1)`` rounded once, then one multiply and
    # one add, each rounded.
    targets = start + (1.0 - start) * sample_ramp(num_samples, scores.device, cdf.dtype)  # [B, S]: start, ..., 1
    # [B, S, W] distances (~10 MB at B=64, 224x224); argmin takes the first of equal minima.
    picked = (targets[:, :, None] - cdf[:, None, :]).abs().argmin(dim=2)
    cols = order.gather(1, picked)  # positions inside each image
    chosen = torch.zeros_like(valid).scatter_(1, cols, (patches > 0).expand_as(cols))
    return chosen[segment_ids(cu_seqlens, total), positions(cu_seqlens, total)] & ~prefix


def sample_ramp(
    num_samples: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[num_samples]``: ``s / (num_samples - 1)`` for ``s = 0 .. num_samples - 1``, each correctly rounded to
    ``dtype`` (fp32: computed in float64, then rounded once), so every device gets the same bits; ``[0.0]`` for one
    sample."""
    last = max(num_samples - 1, 1)
    return (torch.arange(num_samples, device=device, dtype=torch.float64) / last).to(dtype)


def significance(
    cls_attn: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, num_prefix: int = 1
) -> torch.Tensor:
    """ATS's normalised patch scores ``S_j = sum_h A_h[0, j] * ||V_j||_2 / sum_j (...)``: fp32 ``[T]`` (float64 for
    float64 inputs), 0 on prefix rows and in images whose scores are all zero.

    Args:
        cls_attn: ``[T, H]`` CLS-query attention (:func:`ragged_vit.reference.cls_attention`).
        v: ``[T, H*D]`` value vectors.
        cu_seqlens: int32 ``[B+1]`` offsets.
        num_prefix: prefix rows at the start of every image (never scored).
    """
    total = v.shape[0]
    batch = cu_seqlens.numel() - 1
    seg = segment_ids(cu_seqlens, total)
    acc = torch.promote_types(v.dtype, torch.float32)
    raw = cls_attn.to(acc).sum(dim=-1) * v.to(acc).norm(dim=-1)  # [T]
    raw = raw.masked_fill(prefix_rows(cu_seqlens, total, num_prefix), 0.0)
    mass = segment_sum(raw, seg, batch)[seg]
    return torch.where(mass > 0, raw / mass, torch.zeros_like(raw))


def sample_keep(
    score: torch.Tensor, cu_seqlens: torch.Tensor, width: int, num_samples: int, min_keep: int, num_prefix: int = 1
) -> torch.Tensor:
    """ATS's keep mask from normalised scores ``[T]`` (:func:`significance`): the sampled patches, topped up to
    ``min(min_keep, patches)`` per image with the best-scoring others (ties: the earlier row), and every prefix
    row."""
    total = score.shape[0]
    batch = cu_seqlens.numel() - 1
    seg = segment_ids(cu_seqlens, total)
    chosen = inverse_transform_sample(score, cu_seqlens, width, num_samples, num_prefix)
    # The floor adds the best-scoring patches not sampled yet: sampled ones rank first.
    floor = patch_counts(cu_seqlens, num_prefix).clamp(max=min_keep)
    target = torch.maximum(segment_sum(chosen.long(), seg, batch), floor)
    rank = segment_rank(score.masked_fill(chosen, float("inf")), cu_seqlens, num_prefix)
    return prefix_rows(cu_seqlens, total, num_prefix) | (rank < target[seg])


class ATSPruner(Pruner):
    """Adaptive token sampling: a variable number of patches per image, chosen from CLS attention and value norms.

    Args:
        blocks: the timm blocks inside which a stage acts (after the attention residual, before the MLP).
        num_samples: CDF targets per image; None means the original patch count (``inp.num_patches``), or
            ``ceil(sample_rate * inp.num_patches)`` with ``sample_rate``.
        sample_rate: CDF targets per image as a fraction of its original patch count (so a model that takes several
            image sizes samples the same fraction at each); not with ``num_samples``.
        min_keep: patches every image keeps at least (or all it has, if fewer).
    """

    name = "ats"
    placement = Placement.MID_BLOCK
    blocks = tuple(range(3, 12))
    fixed_count = False
    needs_attention = True
    needs_values = True

    def __init__(
        self,
        blocks: tuple[int, ...] = tuple(range(3, 12)),
        num_samples: int | None = None,
        min_keep: int = 8,
        sample_rate: float | None = None,
    ) -> None:
        super().__init__()
        self.blocks = check_blocks(blocks)
        self.num_samples = None if num_samples is None else check_int(num_samples, "num_samples", 1)
        if sample_rate is not None and num_samples is not None:
            raise ValueError("sample_rate and num_samples exclude each other: give one")
        self.sample_rate = None if sample_rate is None else check_rate(sample_rate, "sample_rate")
        self.min_keep = check_int(min_keep, "min_keep", 0)

    @classmethod
    def from_keep_rate(cls, keep_rate: float, *, embed_dim: int, num_patches: int, depth: int = 12) -> ATSPruner:
        """Inside blocks 3-11 of 12 (the same fractions of another depth, stages that coincide merged:
        :func:`ragged_vit.reference.pruners.schedule.at_depth`), ``ceil(keep_rate * N)`` CDF samples of an image of
        ``N`` patches (the batch's own ``N`` at every image size): an upper bound on the patches kept (ATS keeps fewer
        where its scores are peaked); 1.0 is the method's default, ``N`` samples."""
        blocks = at_depth(range(3, 12), depth, merge=True, name="ats")
        return cls(blocks=blocks, sample_rate=None if keep_rate == 1.0 else keep_rate)

    def extra_repr(self) -> str:
        rate = self.sample_rate
        samples = f"sample_rate={rate}" if rate is not None else f"num_samples={self.num_samples}"
        return f"blocks={self.blocks}, {samples}, min_keep={self.min_keep}"

    def samples(self, num_patches: int) -> int:
        """CDF targets per image of an unpruned image of ``num_patches`` patches."""
        if self.num_samples is not None:
            return self.num_samples
        if self.sample_rate is not None:
            return max(1, math.ceil(self.sample_rate * num_patches))
        return num_patches

    def max_count_after(self, stage: int, patches: int, num_patches: int) -> int:
        """At most ``max(samples, min_keep)`` patches survive (each target picks one, duplicates collapse; the
        floor tops up to ``min_keep``), and never more than the image had."""
        return min(patches, max(self.samples(num_patches), self.min_keep))

    def check_input(self, inp: object) -> DecisionInput:
        inp = super().check_input(inp)
        cu, width = inp.cu_seqlens, inp.num_patches + inp.num_prefix
        if cu.device.type == "cpu" and bool((seqlens(cu) > width).any()):
            raise ValueError(
                f"inp.num_patches ({inp.num_patches}) must count the patches of the unpruned image: "
                f"an image has more than {width} rows"
            )
        return inp

    def decide(self, inp: DecisionInput) -> TokenSelection:
        cu = inp.cu_seqlens
        score = significance(*attention_inputs(inp), cu, inp.num_prefix)
        width = inp.num_patches + inp.num_prefix
        keep = sample_keep(score, cu, width, self.samples(inp.num_patches), self.min_keep, inp.num_prefix)
        return TokenSelection(keep, kept_counts(keep, cu))
