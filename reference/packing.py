"""Packing surviving tokens into one flat buffer, and back: the ground truth for ``ragged_vit.triton_impl.pack``.

Layout (FlashAttention's varlen contract): image ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]`` of the packed
``tokens [T, C]``, its surviving tokens contiguous and in their original order, so the CLS token of image ``b``
sits at row ``cu_seqlens[b]``. ``cu_seqlens`` is int32 ``[B+1]`` with a leading 0.

These functions favour clarity over speed and may synchronise with the device (``max_seqlen`` is returned as a
Python int). The kernels in ``ragged_vit.triton_impl.pack`` compute the same results without host synchronisation.
"""

from __future__ import annotations

import torch

from ..core.segments import cu_seqlens_from_counts, positions, segment_ids, seqlens
from ..core.validation import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_int,
    check_keep_mask,
    check_max_seqlen,
    check_tensor,
)


def pack(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Gathers the kept tokens of a padded batch into one flat buffer.

    Args:
        x: ``[B, N, C]`` token features.
        keep: bool ``[B, N]``; ``keep[:, 0]`` (CLS) must be True.

    Returns:
        ``tokens [T, C]``, ``cu_seqlens`` int32 ``[B+1]`` and ``max_seqlen`` (longest image, Python int).
    """
    check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES)
    batch, n, _ = x.shape
    if batch == 0:
        raise ValueError("x must hold at least one image, got batch size 0")
    check_keep_mask(keep, batch, n, x.device)
    counts = keep.sum(dim=1)
    tokens = x[keep]  # boolean indexing walks row-major: image by image, original order inside each
    return tokens, cu_seqlens_from_counts(counts), int(counts.max())


def unpack(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, fill: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatters a packed buffer back to a padded batch.

    Args:
        tokens: ``[T, C]`` packed features.
        cu_seqlens: int32 ``[B+1]`` offsets.
        max_seqlen: padded length ``Lmax``; defaults to the longest image.
        fill: value written at padded positions.

    Returns:
        ``padded [B, Lmax, C]`` and the bool validity mask ``[B, Lmax]``.
    """
    check_tensor(tokens, "tokens", ndim=2)
    check_cu_seqlens(cu_seqlens, total=tokens.shape[0], device=tokens.device)
    lens = seqlens(cu_seqlens)
    longest = int(lens.max())
    if max_seqlen is None:
        max_seqlen = longest
    elif check_max_seqlen(max_seqlen) < longest:
        raise ValueError(f"max_seqlen must be >= the longest sequence ({longest}), got {max_seqlen}")
    batch = lens.numel()
    mask = torch.arange(max_seqlen, device=tokens.device)[None, :] < lens[:, None]
    padded = tokens.new_full((batch, max_seqlen, tokens.shape[1]), fill)
    padded[mask] = tokens
    return padded, mask


def repack(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    keep: torch.Tensor,
    extra_token: torch.Tensor | None = None,
    num_prefix: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Second pruning stage on a packed buffer: keeps the rows where ``keep`` is True, ragged to ragged.

    Args:
        tokens: ``[T, C]`` packed features.
        cu_seqlens: int32 ``[B+1]`` offsets.
        keep: bool ``[T]``; the first ``num_prefix`` rows of every image (CLS first) must be kept.
        extra_token: optional ``[B, C]``, one token appended after each image's kept rows (EViT fusion).
        num_prefix: prefix rows at the start of every image (class, distillation, register tokens; 0 for a model
            without any).

    Returns:
        ``tokens [T', C]``, ``cu_seqlens`` int32 ``[B+1]`` and ``max_seqlen`` like :func:`pack`.
    """
    check_tensor(tokens, "tokens", ndim=2)
    total, channels = tokens.shape
    check_cu_seqlens(cu_seqlens, total=total, device=tokens.device)
    batch = cu_seqlens.numel() - 1
    check_tensor(keep, "keep", ndim=1, dtypes=(torch.bool,), device=tokens.device)
    if keep.shape[0] != total:
        raise ValueError(f"keep must have shape ({total},) to match tokens, got {tuple(keep.shape)}")
    check_int(num_prefix, "num_prefix", 0)
    if not bool(keep[positions(cu_seqlens, total) < num_prefix].all()):
        rows = "first row (CLS, at cu_seqlens[b])" if num_prefix == 1 else f"first {num_prefix} rows (its prefix)"
        raise ValueError(f"keep must be True at every image's {rows}")
    seg = segment_ids(cu_seqlens, total)
    counts = torch.zeros(batch, dtype=torch.long, device=tokens.device).index_add_(0, seg, keep.long())
    if extra_token is None:
        return tokens[keep], cu_seqlens_from_counts(counts), int(counts.max())
    check_tensor(extra_token, "extra_token", ndim=2, dtypes=(tokens.dtype,), device=tokens.device)
    if tuple(extra_token.shape) != (batch, channels):
        raise ValueError(f"extra_token must have shape ({batch}, {channels}), got {tuple(extra_token.shape)}")
    new_cu = cu_seqlens_from_counts(counts + 1)
    out = tokens.new_empty((int(new_cu[-1]), channels))
    rank = torch.cumsum(keep.long(), 0) - 1 - (cu_seqlens_from_counts(counts)[:-1].long())[seg]
    dest = new_cu[:-1].long()[seg] + rank
    out[dest[keep]] = tokens[keep]
    out[new_cu[1:].long() - 1] = extra_token
    return out, new_cu, int(counts.max()) + 1


def cls_rows(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The CLS row of every image of a packed buffer ``[T, C]`` -> ``[B, C]`` (every image must be non-empty)."""
    check_tensor(tokens, "tokens", ndim=2)
    check_cu_seqlens(cu_seqlens, total=tokens.shape[0], device=tokens.device)
    if bool((seqlens(cu_seqlens) == 0).any()):
        raise ValueError("cu_seqlens describes an empty image: every image needs its CLS row")
    return tokens[cu_seqlens[:-1].long()]


def total_and_longest(kept: torch.Tensor) -> tuple[int, int]:
    """The rows of a batch's images all told and its longest image's rows, from the rows each image keeps
    (``kept``: int ``[B]``, B >= 1): what a graph runner reads back to size the buffer after a variable-count stage."""
    check_tensor(kept, "kept", ndim=1, dtypes=(torch.int32, torch.int64))
    if kept.shape[0] == 0:
        raise ValueError("kept must hold at least one image's count, got an empty tensor")
    return int(kept.sum()), int(kept.max())
