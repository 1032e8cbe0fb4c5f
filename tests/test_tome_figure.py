"""ci.tome_figure: the merge-group maps follow tome_forward's ``sources``, and the figure is written (CPU, small).

Exactness: groups and borders are integer/boolean maps compared exactly; group colours are fp32 means, compared
with an independent per-group mean at ``1e-6``.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from ci import tome_figure
from ci.tome_figure import draw, merge_maps
from ragged_vit.pipelines.apps.images import load_images, preprocess
from ragged_vit.reference.tome import tome_forward


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[str]:
    """Three noisy RGB files of different sizes (noise: no two groups share a mean colour by accident)."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(5)
    paths = []
    for i, (h, w) in enumerate([(80, 96), (64, 64), (120, 70)]):
        path = folder / f"photo{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return timm.create_model(
            "deit_tiny_patch16_224", pretrained=False, depth=4, embed_dim=64, num_heads=2, img_size=64
        ).eval()


def test_maps_follow_sources(tiny, photos):
    images = load_images(photos)
    r = [2, 1, 2, 0]
    maps = merge_maps(tiny, images, r)
    ref = tome_forward(tiny, preprocess(images, tiny), r)
    patch = 16
    assert maps.names == [p.rsplit("/", 1)[-1] for p in photos]
    assert torch.equal(maps.groups.reshape(3, -1), ref.sources)
    assert maps.rows.tolist() == ref.counts[-1].tolist() == [17 - 5] * 3
    for b in range(3):
        groups = maps.groups[b]
        pixel_group = groups.repeat_interleave(patch, 0).repeat_interleave(patch, 1)
        colours = maps.painted[b].reshape(-1, 3).unique(dim=0)
        assert colours.shape[0] == groups.unique().numel() == int(maps.rows[b]) - 1  # one colour per group
        for g in groups.unique():
            inside = pixel_group == g
            expected = maps.pixels[b][inside].double().mean(0).float()
            assert torch.allclose(maps.painted[b][inside], expected.expand(int(inside.sum()), 3), atol=1e-6)
        # borders: exactly the last pixel column / row of a patch whose right / lower neighbour is in another group
        expected = torch.zeros(64, 64, dtype=torch.bool)
        for i in range(4):
            for j in range(4):
                if j < 3 and groups[i, j] != groups[i, j + 1]:
                    expected[i * patch : (i + 1) * patch, (j + 1) * patch - 1] = True
                if i < 3 and groups[i, j] != groups[i + 1, j]:
                    expected[(i + 1) * patch - 1, j * patch : (j + 1) * patch] = True
        assert torch.equal(maps.borders[b], expected)
    assert bool(maps.borders.any()), "merged groups of noise images should meet somewhere"


def test_r0_leaves_every_patch_alone(tiny, photos):
    maps = merge_maps(tiny, load_images(photos[:1]), 0)
    assert torch.equal(maps.groups[0].reshape(-1), torch.arange(1, 17))
    grid = torch.zeros(64, 64, dtype=torch.bool)
    grid[:, [15, 31, 47]] = True
    grid[[15, 31, 47], :] = True
    assert torch.equal(maps.borders[0], grid)  # every patch its own group: the full grid is outlined


def test_figure_is_written(tmp_path, tiny, photos, capsys):
    maps = merge_maps(tiny, load_images(photos[:2]), 2)
    out = draw(maps, "tiny", tmp_path / "sub" / "fig.png")
    with Image.open(out) as image:
        assert image.format == "PNG" and min(image.size) > 100
    cli = tmp_path / "cli.png"
    argv = ["--model", "deit_tiny_patch16_224", "--r", "8", "--images", *photos[:2], "--out", str(cli)]
    assert tome_figure.main(argv) == 0
    assert cli.is_file()
    assert "photo0.png: 101, photo1.png: 101" in capsys.readouterr().out  # 197 - 12 blocks x 8
