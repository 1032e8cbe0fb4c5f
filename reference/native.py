"""Native-resolution batches (NaViT, timm's NaFlexVit): each image's position embeddings at its own patch grid.

A learned ``[gh, gw, C]`` table is resampled to an image of ``h x w`` patches by interpolation (in fp32), to
``h x w`` itself or, preserving the aspect ratio, to the square of the longer side and then cropped to its top-left
``h x w``; a factorized table (one ``[L, C]`` table per axis) is resampled per axis (linearly) and summed. An image's
rows are row-major (``y * w + x``); a ragged batch holds the images' rows one after the other, no padding
(:mod:`ragged_vit.pipelines.naflex`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def resample_grid(
    table: torch.Tensor,
    grid: tuple[int, int],
    *,
    square: bool = False,
    mode: str = "bicubic",
    align_corners: bool = False,
    antialias: bool = True,
) -> torch.Tensor:
    """A learned table ``[gh, gw, C]`` at ``grid = (h, w)``: ``[h*w, C]`` row-major, fp32. ``square``: resampled to
    ``max(h, w)`` on both sides, then cropped (the aspect ratio kept)."""
    h, w = grid
    if tuple(table.shape[:2]) == (h, w):
        return table.reshape(h * w, -1).float()
    # Resized in timm's memory layout (channels last): PyTorch's antialiased resize of one table differs by layout.
    resampled = F.interpolate(
        table[None].permute(0, 3, 1, 2).float(), size=(max(h, w),) * 2 if square else (h, w), mode=mode,
        align_corners=align_corners, antialias=antialias,
    )  # fmt: skip
    return resampled[0, :, :h, :w].flatten(1).t()


@functools.lru_cache(maxsize=1024)
def axis_weights(
    source: int, length: int, mode: str = "bicubic", align_corners: bool = False, antialias: bool = True
) -> torch.Tensor:
    """``[length, source]`` float64 on the CPU (shared: do not write to it): the weights with which the interpolation
    of :func:`resample_grid` (``mode="linear"``: :func:`resample_axis`) forms each of an axis's ``length`` outputs from
    its ``source`` inputs. The resize is linear and separable, so a ``[gh, gw, C]`` table resampled to ``(h, w)`` is
    ``axis_weights(gh, h)`` along the rows and ``axis_weights(gw, w)`` along the columns, to float64 rounding. Found
    by resizing each basis vector, beside a 4-wide dummy axis: PyTorch's antialiased resize of a 1-wide axis is
    another map."""
    if mode == "linear":
        basis = torch.eye(source, dtype=torch.float64)[None]  # [1, source channels, source]
        return F.interpolate(basis, size=length, mode=mode, align_corners=align_corners)[0].t().contiguous()
    basis = torch.eye(source, dtype=torch.float64)[None, :, :, None].expand(1, source, source, 4)
    out = F.interpolate(basis, size=(length, 4), mode=mode, align_corners=align_corners, antialias=antialias)
    return out[0, :, :, 0].t().contiguous()


def resample_axis(table: torch.Tensor, length: int) -> torch.Tensor:
    """One axis of a factorized table, ``[L, C]`` at ``length`` positions: ``[length, C]``, linear, fp32."""
    if table.shape[0] == length:
        return table.float()
    return F.interpolate(table.t()[None].float(), size=length, mode="linear", align_corners=False)[0].t()


def resample_factorized(
    rows: torch.Tensor, cols: torch.Tensor, grid: tuple[int, int], *, square: bool = False
) -> torch.Tensor:
    """A factorized table (``rows [Ly, C]``, ``cols [Lx, C]``) at ``grid = (h, w)``: ``[h*w, C]``, fp32, each axis
    resampled (to ``max(h, w)`` with ``square``, then cut) and the two summed."""
    h, w = grid
    y = resample_axis(rows, max(h, w) if square else h)[:h]
    x = resample_axis(cols, max(h, w) if square else w)[:w]
    return (y[:, None] + x[None, :]).flatten(0, 1)

