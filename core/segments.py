"""Per-image (segment) operations on the packed layout ``[T, ...]`` + ``cu_seqlens``.

Everything here is vectorised over the whole batch (no Python loop over images), so the pruners can score
packed buffers at any stage without a detour through padding.
"""

from __future__ import annotations

import torch


def host_ints(values: object, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host integers (a list, or a list of lists) as a tensor on ``device`` without waiting for the device: on CUDA
    staged in pinned memory and copied asynchronously, since a copy from pageable memory waits for every kernel
    queued before it (a whole forward, when a call follows a call)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def cu_seqlens_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Per-image token counts ``[B]`` -> int32 offsets ``[B+1]`` with a leading zero."""
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    cu[1:] = torch.cumsum(counts, 0)
    return cu


def uniform_cu_seqlens(batch: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Offsets of ``batch`` images of ``length`` tokens each (a dense ``[B, N, C]`` batch viewed as packed)."""
    return (torch.arange(batch + 1, device=device) * length).to(torch.int32)


def seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Offsets ``[B+1]`` -> per-image lengths ``[B]`` (int64)."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Offsets ``[B+1]`` -> the image index of every packed row ``[T]`` (int64)."""
    return torch.repeat_interleave(
        torch.arange(cu_seqlens.numel() - 1, device=cu_seqlens.device), seqlens(cu_seqlens), output_size=total
    )


def positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Offsets ``[B+1]`` -> the position of every packed row inside its own image ``[T]`` (int64)."""
    seg = segment_ids(cu_seqlens, total)
    return torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seg]


def segment_sum(values: torch.Tensor, seg: torch.Tensor, batch: int) -> torch.Tensor:
    """Sums rows ``[T, ...]`` per image -> ``[B, ...]``, deterministically.

    Floating-point sums run over each image's rows in order (``torch.segment_reduce``), never through atomic
    adds, whose order varies between GPU runs: a pruner's top-k must not flip on a last-bit difference, or
    image i's decision would depend on the timing of image j's work.
    """
    if not values.is_floating_point():
        return values.new_zeros((batch, *values.shape[1:])).index_add_(0, seg, values)  # integer adds commute
    lengths = torch.zeros(batch, dtype=torch.long, device=values.device).index_add_(0, seg, torch.ones_like(seg))
    return torch.segment_reduce(values, "sum", lengths=lengths, axis=0, unsafe=True)


def segment_softmax(logits: torch.Tensor, seg: torch.Tensor, batch: int) -> torch.Tensor:
    """Softmax over the rows of each image, independently per trailing column: ``[T, ...]`` -> ``[T, ...]``."""
    index = seg.view(-1, *([1] * (logits.dim() - 1))).expand_as(logits)
    peak = logits.new_full((batch, *logits.shape[1:]), float("-inf"))
    peak = peak.scatter_reduce(0, index, logits, reduce="amax", include_self=True)
    e = torch.exp(logits - peak[seg])
    return e / segment_sum(e, seg, batch)[seg]


def to_padded(values: torch.Tensor, cu_seqlens: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """Scatters per-row scalars ``[T]`` into ``[B, length]`` (``fill`` elsewhere), e.g. to run a per-image top-k.

    Only scores travel through this padded view; token features never do.
    """
    total = values.shape[0]
    seg = segment_ids(cu_seqlens, total)
    out = values.new_full((cu_seqlens.numel() - 1, length), fill)
    out[seg, positions(cu_seqlens, total)] = values
    return out


def segment_rank(scores: torch.Tensor, cu_seqlens: torch.Tensor, num_prefix: int = 1) -> torch.Tensor:
    """Rank of every patch row by descending score inside its own image (0 = best): ``[T]`` -> int64 ``[T]``.

    Ties go to the earlier row, so a rank depends on the image's own scores only. Each image's ``num_prefix`` first
    rows (class, distillation, register tokens) rank after all its patches, hence ``rank < k`` marks exactly
    ``min(k, patches)`` patches (plus prefix rows when ``k > patches``). Sorting the packed rows by (image, prefix
    last, score) needs no padding and no device-to-host read.
    """
    total = scores.shape[0]
    seg = segment_ids(cu_seqlens, total)
    prefix = positions(cu_seqlens, total) < num_prefix
    by_score = torch.argsort(scores, descending=True, stable=True)
    group = 2 * seg + prefix.long()
    order = by_score[torch.argsort(group[by_score], stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(total, device=scores.device) - cu_seqlens.long()[seg[order]]
    return rank


def patch_counts(cu_seqlens: torch.Tensor, num_prefix: int = 1) -> torch.Tensor:
    """Patches (rows after the ``num_prefix`` prefix rows) per image ``[B]`` (int64); an empty image has none."""
    return (seqlens(cu_seqlens) - num_prefix).clamp_min(0)


def prefix_rows(cu_seqlens: torch.Tensor, total: int, num_prefix: int = 1) -> torch.Tensor:
    """bool ``[T]``: whether each row is one of its image's ``num_prefix`` prefix rows (class, distillation,
    register tokens), which every pruner keeps and never scores."""
    return positions(cu_seqlens, total) < num_prefix


def ceil_rate(rate: float, patches: torch.Tensor) -> torch.Tensor:
    """``ceil(rate * patches)`` per image, in float64 so that it equals Python's ``math.ceil`` on the host."""
    return torch.ceil(patches.double() * rate).long()


def uniform_length(cu_seqlens: torch.Tensor, total: int) -> int | None:
    """Rows per image of a uniform batch, from host shapes; None when the batch is known to be ragged.

    Fixed-count pipelines only ever produce uniform batches of one image size, so ``T // B`` is the length without
    reading the device. The offsets are read to confirm it only where that is free (CPU), as ``check_cu_seqlens``
    does; on a GPU a ragged batch with ``T % B == 0`` goes undetected, so a batch of several image sizes must say
    so itself (:attr:`ragged_vit.core.selection.DecisionInput.uniform_rows`).
    """
    batch = cu_seqlens.numel() - 1
    if total % batch:
        return None
    length = total // batch
    if cu_seqlens.device.type == "cpu" and not bool((seqlens(cu_seqlens) == length).all()):
        return None
    return length
