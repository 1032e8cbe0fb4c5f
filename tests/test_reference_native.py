"""Position embeddings of native-resolution images (ragged_vit.reference.native) on their own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragged_vit.reference.native import resample_axis, resample_factorized, resample_grid


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
