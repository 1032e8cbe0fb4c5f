"""timm's patch embedding as one GEMM: a ``p x p`` convolution with stride ``p`` is a Linear layer on patches.

``PatchEmbed.proj`` is a ``Conv2d(C, D, kernel=p, stride=p)``: every output token is ``W [D, C*p*p]`` times one
non-overlapping ``C x p x p`` patch, plus the bias. Rearranging the image into patch rows (one copy) and calling
``F.linear`` computes exactly that sum (in another accumulation order: rounding-level differences, no others).

Why: cuDNN runs the 16x16/stride-16 convolution of DeiT-B as an implicit-GEMM kernel plus two layout transposes,
a noticeable share of a graphed pruned forward, where the GEMM on patch rows needs a few microseconds
(``docs/tuning.md#gemm-patch-embedding``). ``PrunedViT`` uses it on CUDA
(``gemm_patch_embed=True``, the default); on the CPU timm's own convolution runs, so the reference path stays
timm's forward exactly. ``ci/forward_profile.py`` measures both, and the unpruned timm model with the same
embedding, so the gain is not credited to pruning.

Supported: timm ``PatchEmbed`` with a bias-or-not ``Conv2d`` projection whose kernel equals its stride, no
padding, dilation or groups, flattened NLC output or NHWC output (what timm builds for ``dynamic_img_size=True``:
``[B, H/p, W/q, D]``, which ``VisionTransformer._pos_embed`` flattens after resampling the position embeddings),
any ``norm`` (applied after, as timm does), and any input whose height and width are multiples of the patch size
(no dynamic padding; the caller checks the size). :func:`supports_gemm` says whether a module qualifies.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from timm.layers import Format, PatchEmbed
from torch import nn


def supports_gemm(patch_embed: nn.Module) -> bool:
    """Whether :func:`patch_embed_gemm` computes ``patch_embed``'s forward (see the module docstring)."""
    proj = getattr(patch_embed, "proj", None)
    if type(proj) is not nn.Conv2d:  # subclasses (e.g. timm's Conv2dSame) pad or reshape: not covered
        return False
    return (
        tuple(proj.kernel_size) == tuple(proj.stride)
        and tuple(proj.padding) == (0, 0)
        and tuple(proj.dilation) == (1, 1)
        and proj.groups == 1
        and proj.padding_mode == "zeros"
        and _layout(patch_embed) is not None
        and not getattr(patch_embed, "dynamic_img_pad", False)
    )


def _layout(patch_embed: nn.Module) -> str | None:
    """``"NLC"`` (flattened) or ``"NHWC"`` (``dynamic_img_size``): the output layouts the GEMM writes; None else."""
    if getattr(patch_embed, "flatten", False) is True or getattr(patch_embed, "output_fmt", None) == Format.NLC:
        return "NLC"
    if getattr(patch_embed, "output_fmt", None) == Format.NHWC:
        return "NHWC"
    return None


def patch_rows(images: torch.Tensor, patch: tuple[int, int], channels_last: bool = False) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B * H/p * W/q, C*p*q]``: one row per patch, row-major over the patch grid, each row
    ordered (channel, y, x) like a ``Conv2d`` weight, or with ``channels_last`` (y, x, channel) as NaFlex's patches."""
    b, c, h, w = images.shape
    p, q = patch
    order = (0, 2, 4, 3, 5, 1) if channels_last else (0, 2, 4, 1, 3, 5)
    grid = images.reshape(b, c, h // p, p, w // q, q).permute(*order)
    return grid.reshape(b * (h // p) * (w // q), c * p * q)


def patch_embed_gemm(patch_embed: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """``patch_embed(images)`` as one GEMM: ``[B, C, H, W]`` -> ``[B, H/p * W/q, D]`` (NLC), or ``[B, H/p, W/q, D]``
    for an NHWC embedding (``dynamic_img_size``); then ``patch_embed.norm``.

    The caller checks :func:`supports_gemm` and the image size (``PrunedViT`` does both).
    """
    proj = patch_embed.proj
    b, _, h, w = images.shape
    p, q = proj.kernel_size
    rows = patch_rows(images, (p, q))
    tokens = F.linear(rows, proj.weight.reshape(proj.out_channels, -1), proj.bias)
    grid = (h // p, w // q) if _layout(patch_embed) == "NHWC" else ((h // p) * (w // q),)
    return patch_embed.norm(tokens.reshape(b, *grid, proj.out_channels))


class GemmPatchEmbed(PatchEmbed):
    """timm's ``PatchEmbed`` whose forward is :func:`patch_embed_gemm` (same parameters, same state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_embed_gemm(self, x)


def with_gemm_patch_embed(model: nn.Module) -> nn.Module:
    """A copy of a timm ViT whose ``patch_embed`` is a :class:`GemmPatchEmbed` (the parameters are copied too).

    For comparisons: the unpruned model with the embedding the pipelines use, so that benchmarks credit pruning
    only with what pruning does. (A plain subclass, not a patched ``forward`` attribute, so that
    ``torch.compile`` traces it without a graph break.)
    """
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, PatchEmbed) or not supports_gemm(embed):
        raise ValueError("model.patch_embed must be a timm PatchEmbed that supports_gemm()")
    copied = copy.deepcopy(model)
    copied.patch_embed.__class__ = GemmPatchEmbed
    return copied
