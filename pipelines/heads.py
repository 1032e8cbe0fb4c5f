"""A timm ViT's head on the packed rows: the final norm, the pooling of each image's kept rows, the classifier.

timm's ``forward_features`` ends with ``model.norm`` on every token and ``forward_head`` pools, then applies
``fc_norm``, ``head_drop`` and ``head``. On the packed layout ``[T, C]`` + ``cu_seqlens`` the pooling is per image,
over the rows that survived pruning:

* ``'token'``: the class token's row (each image's first); the norm acts per token, so only those rows are normed.
* ``'avg'`` / ``'max'`` / ``'avgmax'``: mean / max / their average over each image's patch rows (its prefix rows
  left out, as timm leaves them out, unless the model pools them too: ``pool_include_prefix``). EViT's fused
  token is a patch row here.
* ``'map'``: timm's ``AttentionPoolLatent`` (SigLIP's multi-head attention pooling), on the packed rows: its latent
  queries attend over each image's own rows through a per-image softmax (no padding), then its projection and MLP;
  prefix rows included unless ``pool_include_prefix`` is False (timm's Eva, e.g. Perception Encoder, pools them).
* Distilled DeiT: the average of its two heads on the class and distillation rows, as timm does at inference.

The rows after the ``B`` real images (a graph executor's padding images) are left out of every pool.
Not supported: ``AttentionPoolLatent`` with its own position embedding (``pos_embed='abs'``).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from ..core.segments import positions, segment_ids, segment_softmax, segment_sum

POOLS = ("token", "avg", "max", "avgmax", "map")
MERGE_POOLS = ("token", "avg")
"""The poolings a merged forward (ToMe) supports: ``avg`` weights each row by the patches it holds."""


def pool_of(model: VisionTransformer) -> str:
    """The pooling ``model`` uses (one of :data:`POOLS`); raises ``NotImplementedError`` for others."""
    attn_pool = getattr(model, "attn_pool", None)
    if attn_pool is not None:
        if getattr(attn_pool, "pos_embed", None) is not None:
            raise NotImplementedError("model.attn_pool with a position embedding (pos_embed='abs') is not supported")
        if not hasattr(attn_pool, "latent"):
            name = type(attn_pool).__name__
            raise NotImplementedError(f"model.attn_pool must be a timm AttentionPoolLatent, got {name}")
        return "map"
    if model.global_pool not in POOLS:
        raise NotImplementedError(f"model.global_pool must be one of {POOLS[:4]} or 'map', got {model.global_pool!r}")
    return model.global_pool


def is_distilled(model: VisionTransformer) -> bool:
    """Whether ``model`` is a distilled DeiT (a distillation token and its own head)."""
    return getattr(model, "dist_token", None) is not None and hasattr(model, "head_dist")


def head_logits(
    model: VisionTransformer,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    batch: int,
    sizes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[B, classes]`` of the ``batch`` real images of the packed rows ``x [T, C]`` (``cu_seqlens`` may
    describe padding images after them). ``sizes`` (after a merge: the patches each row holds) weights ``avg``
    pooling, so that every patch counts once as in the unmerged model (:data:`MERGE_POOLS`)."""
    pool = pool_of(model)
    starts = cu_seqlens[:batch]
    if is_distilled(model):
        cls, dist = model.norm(x.index_select(0, starts)), model.norm(x.index_select(0, starts + 1))
        return (model.head(model.head_drop(cls)) + model.head_dist(model.head_drop(dist))) / 2
    if pool == "token":
        feats = model.norm(x.index_select(0, starts))  # per-token norm: the class rows suffice
    else:
        total, images = x.shape[0], cu_seqlens.shape[0] - 1
        seg = segment_ids(cu_seqlens, total)
        # An attention pool reads every row unless the model says otherwise (timm's Eva has no such switch).
        prefix = 0 if getattr(model, "pool_include_prefix", pool == "map") else model.num_prefix_tokens
        pooled = (positions(cu_seqlens, total) >= prefix) & (seg < batch)  # [T]: the rows this pool reads
        normed = model.norm(x)
        if pool == "map":
            feats = _attention_pool(model.attn_pool, normed, pooled, seg, images)[:batch]
        else:
            feats = _reduce(normed, pooled, seg, images, pool, sizes)[:batch]
    return model.head(model.head_drop(model.fc_norm(feats)))


def _reduce(
    x: torch.Tensor, pooled: torch.Tensor, seg: torch.Tensor, images: int, pool: str, sizes: torch.Tensor | None
) -> torch.Tensor:
    """Mean (weighted by ``sizes`` if given) / max / their average of each image's ``pooled`` rows: ``[T, C]`` ->
    ``[images, C]``."""
    keep = pooled[:, None]
    if sizes is not None:  # a merged forward: avg only (MERGE_POOLS)
        weight = sizes.to(x.dtype)[:, None].masked_fill(~keep, 0.0)
        return segment_sum(x * weight, seg, images) / segment_sum(weight, seg, images)
    count = segment_sum(keep.to(torch.int32), seg, images).to(x.dtype)  # integer adds: one launch, no segment scan
    mean = segment_sum(x.masked_fill(~keep, 0.0), seg, images) / count
    if pool == "avg":
        return mean
    index = seg[:, None].expand_as(x)
    peak = x.new_full((images, x.shape[1]), float("-inf"))
    peak = peak.scatter_reduce(0, index, x.masked_fill(~keep, float("-inf")), reduce="amax", include_self=True)
    return peak if pool == "max" else 0.5 * (peak + mean)


def _attention_pool(pool: torch.nn.Module, x: torch.Tensor, pooled: torch.Tensor, seg: torch.Tensor, images: int):
    """timm's ``AttentionPoolLatent`` on packed rows: its latent queries attend over each image's ``pooled`` rows
    (a per-image softmax), then its projection, norm + MLP residual and latent pooling: ``[T, C]`` -> ``[images,
    C']``."""
    heads, head_dim = pool.num_heads, pool.head_dim
    latent = pool.latent[0]  # [L, C_latent]
    q = pool.q_norm(pool.q(latent).view(latent.shape[0], heads, head_dim))  # [L, H, D]
    k, v = pool.kv(x).view(x.shape[0], 2, heads, head_dim).unbind(1)  # [T, H, D] each
    k = pool.k_norm(k)
    logits = torch.einsum("lhd,thd->tlh", q.float(), k.float()) * pool.scale  # [T, L, H], fp32
    logits = logits.masked_fill(~pooled[:, None, None], float("-inf"))
    probs = segment_softmax(logits, seg, images).nan_to_num(0.0)  # rows left out weigh 0
    out = segment_sum(probs[..., None] * v.float()[:, None], seg, images)  # [images, L, H, D]
    out = pool.proj_drop(pool.proj(out.flatten(2).to(x.dtype)))  # [images, L, C']
    if pool.mlp is not None:
        out = out + pool.mlp(pool.norm(out))
    if pool.pool == "token":
        return out[:, 0]
    if pool.pool == "avg":
        return out.mean(1)
    return out
