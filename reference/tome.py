"""Token Merging (ToMe) forward of a timm VisionTransformer in plain PyTorch, on the packed layout: the ground truth.

Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, implemented from the paper's description. timm's
patch embedding, position embedding and ``norm_pre``, then per block:

1. ``x = x + ls1(attn(norm1(x)))`` with the block's own qkv/proj weights through the reference ragged attention,
   with *proportional attention*: ``log(size)`` of every key added to its logits after the scale
   (``key_bias``), so a row holding ``s`` patches weighs as ``s`` copies of itself;
2. the merge (:mod:`ragged_vit.reference.merging`): bipartite soft matching on the keys of that attention,
   averaged over heads; merged rows are size-weighted averages, the sizes add up;
3. ``x = x + ls2(mlp(norm2(x)))``;

then the final norm and the head: the class row (``token`` pooling; a distilled DeiT averages its two heads on
the class and distillation rows as timm does at inference), or the size-weighted mean of the patch rows (``avg``
pooling: every patch counts once, as in the unmerged model). Merging starts in block 0; ``r=0`` is timm's forward.

Modes: a fixed ``r`` (one for every block, or one per block: any schedule), or adaptive (``threshold`` with a cap
``r_max``: a different count per image, ragged); :func:`calibrate_threshold` sets the threshold so that a
calibration batch keeps a target mean token count.

Not supported: other poolings (``max``, ``avgmax``, attention pooling), other block types, training (dropout,
gradients); the paper's decreasing schedule is not built in (pass its per-block values as ``r``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from timm.models.vision_transformer import Attention, Block, VisionTransformer
from torch import nn

from ..core.segments import positions, segment_ids, segment_sum, seqlens, uniform_cu_seqlens
from ..core.validation import check_int, check_tensor
from .attention import ragged_attention, split_qkv
from .merging import check_merge_mode, decide_merges, fixed_r_counts, merge_rows

POOLS = ("token", "avg")
_CALIBRATION_STEPS = 30  # halvings of [-2, 2]: below fp32's spacing near 1 (6e-8), every fp32 threshold resolved


@dataclass(frozen=True)
class ToMeOutput:
    """What :func:`tome_forward` returns.

    Attributes:
        logits: ``[B, classes]``.
        counts: int64 ``[depth, B]``: rows of each image after each block's merge, prefix rows included.
        sources: int64 ``[B, num_patches]``: for every original patch (in patch order), the position inside its
            image of the row that holds it after the last block (prefix rows counted, so >= ``num_prefix``).
    """

    logits: torch.Tensor
    counts: torch.Tensor
    sources: torch.Tensor


def tome_attention(
    block: Block, x: torch.Tensor, cu_seqlens: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a timm ``Block`` with proportional attention: ``x + ls1(attn(norm1(x)))``.

    Args:
        block: a timm ``Block`` with a timm ``Attention``.
        x: ``[T, C]`` packed residual stream.
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``.
        sizes: int ``[T]`` the patches each row holds; ``log(size)`` (rounded once from float64) is added to the
            logits of every key.

    Returns:
        The residual stream ``[T, C]`` after the attention residual and the keys ``[T, H, D]`` that attention used
        (after ``k_norm``): the merge metric's input.
    """
    attn = block.attn
    normed = block.norm1(x)
    q, k, v = split_qkv(attn.qkv(normed), attn.num_heads)
    q, k = attn.q_norm(q), attn.k_norm(k)  # timm normalises per head over D, as on these [T, H, D] views
    a = ragged_attention(q, k, v, cu_seqlens, attn.scale, key_bias=sizes.double().log()).flatten(1)  # [T, H*D]
    a = attn.norm(a) if hasattr(attn, "norm") else a  # scale_norm (identity unless configured)
    gate = getattr(attn, "gate", None)  # gated attention of newer timm versions
    if gate is not None:
        a = a * gate(normed).sigmoid()
    return x + block.drop_path1(block.ls1(attn.proj_drop(attn.proj(a)))), k


@torch.no_grad()
def tome_forward(
    model: VisionTransformer,
    images: torch.Tensor,
    r: int | Sequence[int] | None = None,
    *,
    threshold: float | None = None,
    r_max: int | Sequence[int] | None = None,
) -> ToMeOutput:
    """ToMe's forward of ``model`` on ``images``, merging in every block.

    Args:
        model: a timm ``VisionTransformer`` whose blocks are timm ``Block``, in eval mode, fp32 or fp64.
        images: ``[B, in_chans, H, W]`` at the model's input size, its dtype and device.
        r: fixed mode: the A rows each image merges per block (an int for every block, or one per block), capped
            at half its patch rows.
        threshold: adaptive mode: merge the A rows whose best cosine similarity is ``>= threshold``...
        r_max: ...at most ``r_max`` per image and block (an int, or one per block), capped as ``r``.

    Returns:
        :class:`ToMeOutput`: logits, the rows of each image after each block, and where each patch ended up.
    """
    modes = merge_schedule(check_model(model), r, threshold, r_max)
    check_images(model, images)
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))  # [B, N, C]
    batch, n, channels = x.shape
    num_prefix = model.num_prefix_tokens
    x = x.reshape(batch * n, channels)
    cu = uniform_cu_seqlens(batch, n, x.device)
    sizes = torch.ones(batch * n, dtype=torch.int64, device=x.device)
    sources = torch.arange(num_prefix, n, device=x.device).expand(batch, -1)  # [B, num_patches]
    counts = []
    for block, mode in zip(model.blocks, modes, strict=True):
        x, keys = tome_attention(block, x, cu, sizes)
        decision = decide_merges(keys, cu, sizes, num_prefix, **mode)
        x = merge_rows(x, sizes, decision.destination, decision.sizes.shape[0])
        held = decision.destination[cu[:-1, None].long() + sources]  # [B, num_patches] rows of the merged buffer
        sources = held - decision.cu_seqlens[:-1, None].long()
        cu, sizes = decision.cu_seqlens, decision.sizes
        x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
        counts.append(seqlens(cu))
    return ToMeOutput(tome_head(model, x, cu, sizes), torch.stack(counts), sources)


def tome_head(model: VisionTransformer, x: torch.Tensor, cu_seqlens: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, classes]`` from the merged rows ``x [T, C]``: final norm, pooling (:data:`POOLS`), ``fc_norm``,
    head. ``avg`` weighs every row by its size (the mean over the patches it holds); prefix rows take part only
    where the model pools them too (``pool_include_prefix``)."""
    starts = cu_seqlens[:-1].long()
    if getattr(model, "dist_token", None) is not None:  # distilled DeiT: the mean of its two heads at inference
        cls, dist = model.norm(x[starts]), model.norm(x[starts + 1])
        return (model.head(model.head_drop(cls)) + model.head_dist(model.head_drop(dist))) / 2
    if model.global_pool == "token":
        feats = model.norm(x[starts])  # per-token norm: the class rows suffice
    else:
        total, batch = x.shape[0], starts.shape[0]
        seg = segment_ids(cu_seqlens, total)
        prefix = 0 if getattr(model, "pool_include_prefix", False) else model.num_prefix_tokens
        weight = sizes.to(x.dtype) * (positions(cu_seqlens, total) >= prefix)  # [T]
        feats = segment_sum(model.norm(x) * weight[:, None], seg, batch) / segment_sum(weight, seg, batch)[:, None]
    return model.head(model.head_drop(model.fc_norm(feats)))


@torch.no_grad()
def calibrate_threshold(
    model: VisionTransformer, images: torch.Tensor, target: float, r_max: int | Sequence[int]
) -> float:
    """The adaptive threshold at which ``images`` (a calibration batch) keep ``target`` rows per image and block.

    The quantity matched is the mean of :attr:`ToMeOutput.counts` (prefix rows included) over images AND blocks:
    each block's MLP and the next block's attention run on those rows, so it tracks the forward's compute, and
    ``mean(fixed_r_counts(N, [r] * depth))`` targets the compute of a fixed ``r``. Found by bisection on the
    threshold (the mean falls as the threshold falls); the best threshold seen is returned, within one row of the
    target unless one similarity decides many rows at once (ties).

    Args:
        model, images: as :func:`tome_forward`.
        target: rows per image and block, between the mean of the fixed ``r_max`` schedule (every similarity
            passes) and the unmerged row count.
        r_max: the adaptive mode's cap, as in :func:`tome_forward`.
    """
    depth = check_model(model)
    caps = per_block(r_max, "r_max", depth)
    check_images(model, images)
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise TypeError(f"target must be a float (rows per image and block), got {type(target).__name__}")
    n = model.patch_embed.num_patches + model.num_prefix_tokens
    fewest = sum(fixed_r_counts(n, caps, model.num_prefix_tokens)) / depth
    if not fewest <= target <= n:
        raise ValueError(f"target must lie in [{fewest}, {n}] (r_max merging everywhere, no merging), got {target}")

    def miss(threshold: float) -> float:
        counts = tome_forward(model, images, threshold=threshold, r_max=r_max).counts
        return float(counts.double().mean()) - target

    return bisect_threshold(miss, fewest - target, n - target)


def bisect_threshold(
    miss: Callable[[float], float], miss_low: float, miss_high: float, steps: int = _CALIBRATION_STEPS
) -> float:
    """The threshold in ``[-2, 2]`` whose ``miss(threshold)`` (rows above the target; it falls as the threshold
    falls) is nearest 0, by bisection: ``miss_low`` / ``miss_high`` are the ends' (every similarity passes / none
    does), known without a forward. At most ``steps`` halvings; stops at an exact hit; the best seen wins. The one
    search of the reference's :func:`calibrate_threshold` and of the pipelines' ``PrunedViT.calibrate``."""
    low, high = -2.0, 2.0
    best, best_miss = min((low, miss_low), (high, miss_high), key=lambda end: abs(end[1]))
    for _ in range(steps):
        if best_miss == 0:
            break
        mid = (low + high) / 2
        m = miss(mid)
        if abs(m) < abs(best_miss):
            best, best_miss = mid, m
        low, high = (low, mid) if m > 0 else (mid, high)  # too many rows left: lower the threshold
    return best


def merge_schedule(depth: int, r: object, threshold: object, r_max: object) -> list[dict[str, int | float | None]]:
    """Checks a mode and spreads it over ``depth`` blocks: ``decide_merges``'s keyword arguments, one per block."""
    threshold = check_merge_mode(r, threshold, r_max)
    if threshold is None:
        return [{"r": r_k} for r_k in per_block(r, "r", depth)]
    return [{"threshold": threshold, "r_max": r_k} for r_k in per_block(r_max, "r_max", depth)]


def per_block(value: object, name: str, depth: int) -> tuple[int, ...]:
    """An int for every block, or a sequence of ``depth`` ints (each >= 0) -> a tuple of ``depth`` ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (check_int(value, name, 0),) * depth
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be an int or a sequence of {depth} ints (one per block), got {type(value).__name__}"
        )
    if len(value) != depth:
        raise ValueError(f"{name} must hold one value per block ({depth}), got {len(value)}")
    return tuple(check_int(v, f"{name}[{i}]", 0) for i, v in enumerate(value))


def check_model(model: object) -> int:
    """Checks that ``model`` is a timm ``VisionTransformer`` this reference runs (timm blocks, a supported pooling,
    eval mode); returns its depth."""
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a timm VisionTransformer, got {type(model).__name__}")
    if model.training:
        raise ValueError("model must be in eval mode (call model.eval()): the reference has no dropout")
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Block) or not isinstance(block.attn, Attention):
            raise TypeError(f"model.blocks[{i}] must be a timm Block with a timm Attention, got {type(block).__name__}")
    if getattr(model, "attn_pool", None) is not None or model.global_pool not in POOLS:
        raise ValueError(f"model.global_pool must be one of {POOLS} (no attention pooling), got {model.global_pool!r}")
    return len(model.blocks)


def check_images(model: nn.Module, images: object) -> torch.Tensor:
    """Checks a batch for ``model``: ``[B, in_chans, H, W]`` at its input size, its dtype (fp32 or fp64) and
    device, at least one image."""
    param = next(model.parameters())
    images = check_tensor(images, "images", ndim=4, dtypes=(torch.float32, torch.float64), device=param.device)
    if images.dtype != param.dtype:
        raise TypeError(f"images must have the model's dtype {param.dtype}, got {images.dtype}")
    expected = (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)
    if tuple(images.shape[1:]) != expected:
        raise ValueError(f"images must have shape [B, {', '.join(map(str, expected))}], got {list(images.shape)}")
    if images.shape[0] == 0:
        raise ValueError("images must hold at least one image, got batch size 0")
    return images
