"""Position embeddings of native-resolution images (ragged_vit.reference.native) on their own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragged_vit.reference.native import axis_weights, resample_axis, resample_factorized, resample_grid


def test_a_table_at_its_own_grid_is_its_rows(gen):
    table = torch.randn(4, 6, 8, generator=gen)
    assert torch.equal(resample_grid(table, (4, 6)), table.reshape(24, 8))
    assert torch.equal(resample_axis(table[0], 6), table[0])


@pytest.mark.parametrize("grid", [(2, 7), (7, 2), (5, 5), (1, 9)])
def test_the_aspect_preserving_resample_is_the_square_one_cropped(grid, gen):
    """Row-major ``[h*w, C]`` rows of the stretched table, and of the square one's top-left corner."""
    table = torch.randn(4, 4, 8, generator=gen)
    h, w = grid
    side = max(h, w)
    square = resample_grid(table, (side, side), mode="bilinear").reshape(side, side, 8)
    got = resample_grid(table, grid, square=True, mode="bilinear")
    assert torch.equal(got, square[:h, :w].reshape(h * w, 8))
    stretched = resample_grid(table, grid, mode="bilinear")
    want = F.interpolate(table.permute(2, 0, 1)[None].contiguous(), size=grid, mode="bilinear", antialias=True)
    torch.testing.assert_close(stretched, want[0].flatten(1).t(), atol=1e-6, rtol=1e-6)


def test_a_factorized_table_is_the_sum_of_its_resampled_axes(gen):
    rows, cols = torch.randn(5, 4, generator=gen), torch.randn(7, 4, generator=gen)
    got = resample_factorized(rows, cols, (3, 2)).reshape(3, 2, 4)
    y, x = resample_axis(rows, 3), resample_axis(cols, 2)
    torch.testing.assert_close(got, y[:, None] + x[None, :])
    square = resample_factorized(rows, cols, (3, 2), square=True).reshape(3, 2, 4)
    torch.testing.assert_close(square, resample_axis(rows, 3)[:, None] + resample_axis(cols, 3)[None, :2])


@pytest.mark.parametrize("mode, antialias", [("bicubic", True), ("bicubic", False), ("bilinear", True)])
@pytest.mark.parametrize("grid", [(7, 21), (20, 30), (16, 16), (1, 5), (33, 2)])
def test_axis_weights_reproduce_the_resample(grid, mode, antialias, gen):
    """A table resampled to ``(h, w)`` is its rows mixed by ``axis_weights(gh, h)`` and its columns by
    ``axis_weights(gw, w)`` (separable, to float64 rounding), down- and upsampled, antialiased or not; the identity at
    the table's own size; ``mode="linear"``: :func:`resample_axis`'s map."""
    table = torch.randn(16, 12, 5, generator=gen, dtype=torch.float64)
    h, w = grid
    want = F.interpolate(table.permute(2, 0, 1)[None], size=grid, mode=mode, align_corners=False, antialias=antialias)
    rows, cols = axis_weights(16, h, mode, False, antialias), axis_weights(12, w, mode, False, antialias)
    got = torch.einsum("yi,xj,ijc->yxc", rows, cols, table)
    torch.testing.assert_close(got, want[0].permute(1, 2, 0), rtol=0, atol=1e-12)  # the same map in float64
    fp32 = resample_grid(table, grid, mode=mode, antialias=antialias).reshape(h, w, 5)  # the reference, in fp32
    torch.testing.assert_close(got.float(), fp32, rtol=1e-5, atol=1e-5)
    assert torch.equal(axis_weights(16, 16, mode, False, antialias), torch.eye(16, dtype=torch.float64))
    line = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    linear = F.interpolate(line.t()[None], size=w, mode="linear", align_corners=False)[0].t()
    torch.testing.assert_close(axis_weights(9, w, "linear") @ line, linear, rtol=0, atol=1e-12)
