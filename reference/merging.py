"""Token merging (ToMe) on the packed layout: the bipartite matching decision and the size-weighted merge.

Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, implemented from the paper's description (the
official code is not used). Inside a block, between the attention residual and the MLP, each image's rows are split
alternately into two sets, A and B; the metric is the block's keys averaged over heads and L2-normalised; each A
row's match is the B row of highest cosine similarity (ties: the lowest B index). The A rows of highest best-match
similarity (ties: the lower A index first) merge into their matches, several possibly into one B row. The prefix rows
(class, distillation, register tokens: the first ``num_prefix`` of an image) never merge. The sets and the row
order are the paper's: the split alternates over ALL of an image's rows, A holding positions 0, 2, 4, ... (the class
token, position 0, is in A) and B positions 1, 3, 5, ... (a distillation token, position 1, is B's first row); a
prefix row in A is never a source (its best similarity is minus infinity) and one in B never a destination. After the
merge an image's rows are its prefix rows, then its other unmerged A rows (in their order where the image has prefix
rows, else in rank order: the best remaining match first), then its other B rows in order, each merged group in its B
row's place; an image that merges no row keeps its order (the paper's ``r = 0``). An earlier ordering of this project
(the split over the patch rows alone, every row kept in order) was measured no faster and removed (``docs/tome.md``).

The counts are:

* fixed: ``min(r, patches // 2)`` A rows per image;
* adaptive: the A rows whose best similarity is ``>= threshold``, at most ``min(r_max, patches // 2)`` of them
  (a different count per image).

``patches // 2`` (``patches``: the rows after the prefix rows) caps every image: at most half its patch rows merge in
one block, and no A row is left without a B row to merge into. A merge is expressed as a *destination map*: every
input row names the row of the merged buffer it goes to (merged rows share one). Each image's rows stay contiguous,
in the order above. A merged row is the size-weighted average of the rows sent to it, and its size (the patches it
holds) is their sum.

Readable before fast: the decision loops over images. ``docs/tome.md`` states the rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.segments import cu_seqlens_from_counts
from ..core.validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_tensor

_REF_DTYPES = (*FLOAT_DTYPES, torch.float64)
_SIZE_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MergeDecision:
    """The merges of one block, as a destination map.

    Attributes:
        destination: int64 ``[T]``: the row of the merged buffer that each input row goes to; rows merged
            together share it, every merged row receives at least one input row.
        cu_seqlens: int32 ``[B+1]`` offsets of the merged buffer (``T'`` rows).
        sizes: int64 ``[T']``: the patches each merged row holds (the sum of the sizes sent to it).
    """

    destination: torch.Tensor
    cu_seqlens: torch.Tensor
    sizes: torch.Tensor


def merge_count(patches: int, r: int) -> int:
    """A rows an image of ``patches`` patch rows merges with a fixed ``r``: ``min(r, patches // 2)``, B's size
    (at most half the patch rows, and never an A row without a B row)."""
    return min(r, patches // 2)


def fixed_r_counts(num_tokens: int, r: Sequence[int], num_prefix: int = 1) -> list[int]:
    """Rows of an image of ``num_tokens`` rows (prefix rows included) after each block of a fixed-``r`` schedule
    (``r[k]`` for block ``k``): the counts the rule gives whatever the weights and images."""
    counts, rows = [], num_tokens
    for r_k in r:
        rows -= merge_count(max(rows - num_prefix, 0), r_k)
        counts.append(rows)
    return counts


def check_merge_mode(r: object, threshold: object, r_max: object) -> float | None:
    """Checks that exactly one mode is asked for: ``r`` (fixed) or ``threshold`` with ``r_max`` (adaptive).

    Only presence and the threshold are checked here (``r`` and ``r_max`` are counts the callers check, one per
    block or one in all). Returns the threshold as a float, or None in the fixed mode.
    """
    if threshold is None:
        if r is None:
            raise ValueError("r must be given (the A rows merged per block) unless threshold and r_max are, got None")
        if r_max is not None:
            raise ValueError(f"r_max caps the adaptive mode: give it with threshold, not with r (got r_max={r_max!r})")
        return None
    if r is not None:
        raise ValueError(f"r (fixed count) and threshold (adaptive) exclude each other, got r={r!r}")
    if r_max is None:
        raise ValueError("r_max must be given with threshold (the most A rows an image merges per block), got None")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a float (a cosine similarity), got {type(threshold).__name__}")
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be finite, got {threshold}")
    return float(threshold)


def merge_metric(keys: torch.Tensor) -> torch.Tensor:
    """The similarity metric of every row: keys ``[T, H, D]`` averaged over heads, then L2-normalised -> ``[T, D]``
    in fp32 (fp64 for fp64 keys); a zero key gets a zero vector (similarity 0 to every row)."""
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    return F.normalize(keys.to(dt).mean(dim=1), dim=-1)


def decide_merges(
    keys: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sizes: torch.Tensor,
    num_prefix: int = 1,
    *,
    r: int | None = None,
    threshold: float | None = None,
    r_max: int | None = None,
) -> MergeDecision:
    """Decides one block's merges by bipartite soft matching, per image.

    Args:
        keys: ``[T, H, D]`` the block's attention keys (after ``k_norm``), the rows of the packed buffer.
        cu_seqlens: int32 ``[B+1]`` offsets; image ``b``'s rows start with its ``num_prefix`` prefix rows.
        sizes: int ``[T]`` the patches each row holds (1 for a patch never merged and for prefix rows).
        num_prefix: prefix rows at the start of every image; they never merge.
        r: fixed mode: each image merges ``min(r, patches // 2)`` A rows.
        threshold: adaptive mode: each image merges the A rows whose best cosine similarity is ``>= threshold``
            (compared in the metric's precision), at most ``min(r_max, patches // 2)`` of them.
        r_max: the cap of the adaptive mode (with ``threshold`` only).

    Returns:
        The :class:`MergeDecision`: destination map, offsets and sizes of the merged buffer.
    """
    threshold = check_merge_mode(r, threshold, r_max)
    limit = check_int(r, "r", 0) if threshold is None else check_int(r_max, "r_max", 0)
    check_tensor(keys, "keys", ndim=3, dtypes=_REF_DTYPES)
    total, device = keys.shape[0], keys.device
    check_cu_seqlens(cu_seqlens, total=total, device=device)
    check_sizes(sizes, total, device)
    check_int(num_prefix, "num_prefix", 0)
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("keys must be finite: the similarity of a NaN or infinite key is undefined")
    metric = merge_metric(keys)  # [T, D]
    destination = torch.empty(total, dtype=torch.int64, device=device)
    counts, base = [], 0
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        local = _image_merges(metric[start:end], min(num_prefix, end - start), limit, threshold)
        destination[start:end] = base + local
        counts.append(int(local.max()) + 1 if end > start else 0)
        base += counts[-1]
    new_cu = cu_seqlens_from_counts(torch.tensor(counts, dtype=torch.int64, device=device))
    new_sizes = torch.zeros(base, dtype=torch.int64, device=device)
    return MergeDecision(destination, new_cu, new_sizes.index_add_(0, destination, sizes.long()))


def _image_merges(metric: torch.Tensor, prefix: int, limit: int, threshold: float | None) -> torch.Tensor:
    """One image's merges: its rows' metrics ``[n, D]`` -> int64 ``[n]``, the merged row (of the image's own, from
    0) each row goes to."""
    n, device = metric.shape[0], metric.device
    rows = torch.arange(n, device=device)
    a, b = rows[0::2], rows[1::2]
    count = merge_count(n - prefix, limit)
    merged = torch.zeros(a.numel(), dtype=torch.bool, device=device)
    match = torch.zeros(a.numel(), dtype=torch.int64, device=device)
    order = torch.arange(a.numel(), device=device)
    if count > 0:
        # [|A|, |B|] cosine similarities, each pair's products summed over D alike: equal keys give equal
        # similarities bit for bit, so the tie rules below apply to them (a CPU GEMM may sum two equal rows otherwise)
        sim = (metric[a][:, None, :] * metric[b][None, :, :]).sum(-1)
        sim[a < prefix, :] = -math.inf  # a prefix row is never a source, never a destination
        sim[:, b < prefix] = -math.inf
        best = sim.amax(dim=1)
        columns = torch.arange(b.numel(), device=device).expand_as(sim)
        match = torch.where(sim == best[:, None], columns, b.numel()).amin(dim=1)  # ties: the lowest B index
        order = torch.argsort(best, descending=True, stable=True)  # ties: the lower A index first
        if threshold is not None:
            count = min(count, int((best >= threshold).sum()))  # those passing lead ``order``
        merged[order[:count]] = True
    if count == 0:  # an image that merges nothing keeps its rows as they are (the paper's r = 0)
        return rows
    # prefix rows, the other unmerged A rows, the other B rows
    rest_a = a[~merged & (a >= prefix)] if prefix else a[order[count:]]
    survivors = torch.cat([rows[:prefix], rest_a, b[b >= prefix]])
    position = torch.empty(n, dtype=torch.int64, device=device)
    position[survivors] = torch.arange(survivors.numel(), device=device)
    position[a[merged]] = position[b[match[merged]]]
    return position


def merge_rows(x: torch.Tensor, sizes: torch.Tensor, destination: torch.Tensor, rows: int) -> torch.Tensor:
    """Applies a destination map as a size-weighted average: row ``d`` of the result is
    ``sum(sizes[t] * x[t]) / sum(sizes[t])`` over the rows ``t`` with ``destination[t] == d``.

    Args:
        x: ``[T, C]`` rows.
        sizes: int ``[T]`` the patches each row holds.
        destination: int64 ``[T]`` values in ``[0, rows)``, each value taken at least once.
        rows: ``T'``, the rows of the result.

    Returns:
        ``[T', C]`` in fp32 (fp64 for fp64 input). The weighted sums and the division run in float64, then are
        rounded to the result's precision: ``size * x`` is exact there, so a row that receives only itself keeps
        its value bit for bit whatever its size.
    """
    check_tensor(x, "x", ndim=2, dtypes=_REF_DTYPES)
    total, device = x.shape[0], x.device
    check_sizes(sizes, total, device)
    check_tensor(destination, "destination", ndim=1, dtypes=(torch.int64,), device=device)
    if destination.shape[0] != total:
        raise ValueError(f"destination must have one value per row of x ({total}), got {destination.shape[0]}")
    check_int(rows, "rows", 0)
    if total and (int(destination.min()) < 0 or int(destination.max()) >= rows):
        low, high = int(destination.min()), int(destination.max())
        raise ValueError(f"destination must lie in [0, rows={rows}), got values in [{low}, {high}]")
    weight = torch.zeros(rows, dtype=torch.float64, device=device).index_add_(0, destination, sizes.double())
    if not bool((weight > 0).all()):
        raise ValueError(f"destination must send at least one row to each of the {rows} rows of the result")
    acc = torch.zeros(rows, x.shape[1], dtype=torch.float64, device=device)
    acc.index_add_(0, destination, x.double() * sizes.double()[:, None])
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (acc / weight[:, None]).to(dt)


def merge_sources(destination: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A destination map as source lists: the input rows grouped by the merged row they go to, in row order inside
    each group, and where each group starts. What the Triton merge reads instead of searching the map (the Triton
    matching writes them beside the map; this is their definition, and the merge's fallback for a bare map).

    Args:
        destination: int ``[T]``, values in ``[0, T')``.

    Returns:
        ``(sources, offsets)``, int32: ``sources [T]`` the rows sorted by destination (stable: row order within a
        group), and ``offsets [T + 1]`` with ``offsets[d]`` the rows sent below ``d`` (group ``d`` is
        ``sources[offsets[d]:offsets[d + 1]]``; ``offsets[d] = T`` from ``d = T'`` on, where a kernel's lists need
        only entry ``T'``). No host synchronisation.
    """
    order, sources = torch.sort(destination, stable=True)
    steps = torch.arange(destination.shape[0] + 1, dtype=order.dtype, device=destination.device)
    return sources.int(), torch.searchsorted(order, steps).int()


def check_sizes(sizes: object, total: int, device: torch.device) -> torch.Tensor:
    """Checks the per-row sizes: an int32/int64 ``[T]`` tensor on ``device``, every value >= 1 (read on a CPU)."""
    sizes = check_tensor(sizes, "sizes", ndim=1, dtypes=_SIZE_DTYPES, device=device)
    if sizes.shape[0] != total:
        raise ValueError(f"sizes must have one value per row ({total}), got {sizes.shape[0]}")
    if sizes.device.type == "cpu" and total and int(sizes.min()) < 1:
        raise ValueError(f"sizes must be >= 1 (patches a row holds), got {int(sizes.min())}")
    return sizes
