"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from benchmarks.e2e_common import no_tf32  # noqa: F401  (re-exported: the tests' one fp32 switch)
from ragged_vit import PrunedViT

#: Pruner cases of the pipeline tests: name -> (pruner, options); "evit_fused" is EViT with its fused token.
PRUNER_CASES = {
    "threshold_l2": ("threshold_l2", {}),
    "dynamicvit": ("dynamicvit", {}),
    "evit": ("evit", {}),
    "evit_fused": ("evit", {"fuse_token": True}),
    "ats": ("ats", {}),
}


def tiny_pipeline(pruner_factory, backend: str = "reference") -> PrunedViT:
    """A 6-block ViT on 32x32 images (16 patches + CLS) with seeded weights, its pruner from ``pruner_factory``;
    its qkv weights are scaled up so that attention is peaked and ATS keeps a different count per image
    (near-uniform attention at random init makes it keep the same count)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=6, num_heads=2, num_classes=10)
        pruner = pruner_factory()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
    return PrunedViT(model, pruner, backend)


def tiny_images(n: int, seed: int) -> torch.Tensor:
    """Images of increasing contrast for :func:`tiny_pipeline`: the pruners keep different counts per image."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g) * torch.linspace(0.1, 3.0, n)[:, None, None, None]
