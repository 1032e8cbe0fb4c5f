"""Which patches ToMe merged: ``python -m ci.tome_figure [--r 13] [--out docs/figures/tome_merges.png]``.

Runs the reference ToMe forward (``ragged_vit.reference.tome.tome_forward``, fixed ``r`` in every block) on the
demo's sample photos (``ragged_vit.pipelines.apps.images``: scikit-image's ``chelsea``, ``astronaut``, ``coffee``,
``rocket``, or ``--images`` files) and draws, as the paper's figures do, each photo's model input with the patches
that ended in the same row after the last block painted in one colour (the mean colour of that group's pixels) and
the group borders outlined. ``tome_forward``'s ``sources`` say, for every original patch, the row holding it at the
end; patches sharing a row form a group.

Weights: random (seeded, ``--seed``) unless ``--checkpoint`` names a local checkpoint (``ragged_vit.pipelines.weights
.load_checkpoint``; nothing is downloaded). With random weights the keys are random projections of the patch
embedding (plus small position embeddings) carried through random blocks, so the merges follow the similarity of
the patches' pixels, not what the photo shows. CPU, fp32, under a minute for DeiT-B and four photos.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.make_results import panels, save_figure
from ragged_vit.pipelines.apps.images import SAMPLE_IMAGES, LoadedImage, load_images, preprocess
from ragged_vit.pipelines.weights import create_model, load_checkpoint
from ragged_vit.reference.tome import tome_forward

DEFAULT_OUT = Path("docs/figures/tome_merges.png")
DEFAULT_MODEL = "deit_base_patch16_224"
BORDER = (1.0, 1.0, 1.0)  # group outlines: white


@dataclass(frozen=True)
class MergeMaps:
    """What the figure shows, per image (``B`` images of ``H x W`` pixels, a ``gh x gw`` patch grid).

    Attributes:
        names: the images' names.
        pixels: fp32 ``[B, H, W, 3]`` in ``[0, 1]``: the model's input, its normalisation undone.
        groups: int64 ``[B, gh, gw]``: the row holding each patch after the last block (``sources`` on the grid).
        painted: fp32 ``[B, H, W, 3]``: every pixel in its group's mean colour.
        borders: bool ``[B, H, W]``: the pixels outlining the groups (the last pixel column / row of a patch whose
            right / lower neighbour lies in another group).
        rows: int64 ``[B]``: rows of each image after the last block, prefix rows included.
    """

    names: list[str]
    pixels: torch.Tensor
    groups: torch.Tensor
    painted: torch.Tensor
    borders: torch.Tensor
    rows: torch.Tensor


def display_pixels(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """``preprocess``'s normalised ``[B, 3, H, W]`` back to ``[B, H, W, 3]`` pixels in ``[0, 1]``."""
    cfg = model.pretrained_cfg
    mean = torch.tensor(cfg.get("mean", (0.485, 0.456, 0.406)))[:, None, None]
    std = torch.tensor(cfg.get("std", (0.229, 0.224, 0.225)))[:, None, None]
    return (batch * std + mean).clamp(0.0, 1.0).permute(0, 2, 3, 1)


def group_means(pixels: torch.Tensor, groups: torch.Tensor, patch: int) -> torch.Tensor:
    """Every pixel in the mean colour of its group's pixels: ``pixels [H, W, 3]``, ``groups [gh, gw]`` ->
    ``[H, W, 3]``."""
    ids = groups.repeat_interleave(patch, 0).repeat_interleave(patch, 1).reshape(-1)  # [H * W]
    flat = pixels.reshape(-1, 3)
    sums = torch.zeros(int(ids.max()) + 1, 3).index_add_(0, ids, flat)
    counts = torch.zeros(int(ids.max()) + 1).index_add_(0, ids, torch.ones(ids.shape[0]))
    return (sums[ids] / counts[ids, None]).reshape(pixels.shape)


def group_borders(groups: torch.Tensor, patch: int) -> torch.Tensor:
    """bool ``[H, W]``: the last pixel column of a patch whose right neighbour is in another group, and the last
    pixel row of a patch whose lower neighbour is."""
    gh, gw = groups.shape
    borders = torch.zeros(gh * patch, gw * patch, dtype=torch.bool)
    right = (groups[:, :-1] != groups[:, 1:]).repeat_interleave(patch, 0)  # [H, gw - 1]
    below = (groups[:-1] != groups[1:]).repeat_interleave(patch, 1)  # [gh - 1, W]
    borders[:, patch - 1 : (gw - 1) * patch : patch] |= right
    borders[patch - 1 : (gh - 1) * patch : patch, :] |= below
    return borders


@torch.no_grad()
def merge_maps(model: nn.Module, images: list[LoadedImage], r: int | Sequence[int]) -> MergeMaps:
    """Runs ``tome_forward(model, preprocess(images), r)`` and builds the figure's maps (fp32, CPU)."""
    model = model.float().eval()
    batch = preprocess(images, model)
    out = tome_forward(model, batch, r)
    (gh, gw), patch = model.patch_embed.grid_size, model.patch_embed.patch_size[0]
    groups = out.sources.reshape(-1, gh, gw)
    pixels = display_pixels(model, batch)
    painted = torch.stack([group_means(p, g, patch) for p, g in zip(pixels, groups, strict=True)])
    borders = torch.stack([group_borders(g, patch) for g in groups])
    return MergeMaps([im.name for im in images], pixels, groups, painted, borders, out.counts[-1])


def draw(maps: MergeMaps, title: str, out: Path) -> Path:
    """Two rows of panels (matplotlib, no display): the model's inputs, then their merge groups outlined."""
    count = len(maps.names)
    fig, axes = panels(2, count, 2.6, 2.7)
    outlined = torch.where(maps.borders[..., None], torch.tensor(BORDER), maps.painted)
    for i, name in enumerate(maps.names):
        groups = maps.groups[i].unique().numel()
        for ax, image, label in (
            (axes[0, i], maps.pixels[i], name),
            (axes[1, i], outlined[i], f"{maps.groups[i].numel()} patches -> {groups} groups"),
        ):
            ax.imshow(image.numpy(), interpolation="nearest")
            ax.set_title(label, fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
    save_figure(fig, out, title)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ci.tome_figure", description=__doc__.split("\n")[0])
    parser.add_argument("--r", type=int, default=13, help="A rows merged per image and block (default 13)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG file (default {DEFAULT_OUT})")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a timm DeiT/ViT name (default {DEFAULT_MODEL})")
    parser.add_argument("--checkpoint", default=None, help="a local checkpoint file (default: random weights)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--images", nargs="+", default=None, help=f"files, folders or scikit-image samples (default {SAMPLE_IMAGES})"
    )
    args = parser.parse_args(argv)
    if args.r < 0:
        parser.error(f"--r: must be >= 0, got {args.r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        model = create_model(args.model)
    if args.checkpoint is not None:
        load_checkpoint(model, None, args.checkpoint)
        weights = f"weights from {Path(args.checkpoint).name}"
    else:
        weights = f"random weights (seed {args.seed}): merges follow patch-embedding similarity"
    maps = merge_maps(model, load_images(args.images), args.r)
    depth = len(model.blocks)
    title = f"ToMe merges after {depth} blocks, r={args.r}: {args.model}, {weights}"
    draw(maps, title, args.out)
    rows = ", ".join(f"{n}: {int(c)}" for n, c in zip(maps.names, maps.rows, strict=True))
    print(f"wrote {args.out} ({title}); rows after the last block (class row included): {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
