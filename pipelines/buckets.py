"""Token-budget buckets of a CUDA-graphed pruned forward: pure host logic, no tensors.

A CUDA graph replays fixed shapes. A pruned forward has fixed shapes when every stage keeps a count known on the host
(DynamicViT, EViT, Threshold-L2 ratio, or no pruner): it is captured whole. A variable-count stage (ATS, Threshold-L2
threshold/calibrated) decides on the device how many rows survive; the forward plan
(:attr:`ragged_vit.pipelines.plan.ForwardPlan.segments`) cuts the forward at each such decision into *segments*, and
:mod:`ragged_vit.pipelines.graphs` reads the kept total once per stage and replays the next segment as captured for
the smallest *capacity* (rows of the packed buffer) that holds that total. :class:`TokenBuckets` says which capacities
exist, which one a total gets, the ``max_seqlen`` bound that goes with it, and which stages skip their read.

Rows of a capacity beyond the real total form one padding image (:mod:`ragged_vit.pipelines.graphs`). Consecutive
capacities are at most ``min(step, N)`` rows apart (``N``: rows of an unpruned image, CLS included), so the padding
image is never longer than an unpruned image, which every pruner and backend already handles. Stages that skip their
read (``sync_free_rows``) may have more padding rows than that; they split them into several padding images no longer
than the segment's bound on an image's rows (:func:`padding_images`).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from ..core.validation import check_int

AUTO_SYNC_FREE_ROWS = 1024
"""``sync_free_rows`` of a forward with several variable-count stages (:func:`default_sync_free_rows`), in the
graph runner's default buckets and in the eager ``PrunedViT.forward``."""


NATIVE_GRAPH_MAX_ROWS = 8192
"""The most rows of a pruned native batch (a NaFlexVit's images of their own sizes) the graph runner replays: its
stages' buffers hold every image at the longest image's count, so past this the eager forward, which sizes them
exactly, is as fast (measured: ``docs/graphs.md``, Native batches)."""


NATIVE_KEYS = 16
"""Native-batch keys whose static buffers and graph a graph runner keeps, the most recently used (the images' sizes
make the keys, and a stream of sizes makes many): past them the oldest key's are dropped."""

NATIVE_SEEN_KEYS = 4096
"""Native-batch keys met once that a graph runner remembers, the most recent: a key's first call runs the eager
forward and keeps nothing but the key, its second call captures."""


def default_sync_free_rows(variable_stages: int) -> int:
    """:data:`AUTO_SYNC_FREE_ROWS` for a forward with several variable-count stages (ATS: 9), else 0: a single
    stage reads its total, which sizes everything after it."""
    return AUTO_SYNC_FREE_ROWS if variable_stages > 1 else 0


@dataclass(frozen=True)
class TokenBuckets:
    """The capacities (packed rows) for which the segments after a variable-count stage are captured.

    Attributes:
        step: the largest gap between consecutive capacities, in rows; clamped to ``N``. A replay's padding
            image has fewer rows than this. With ``growth == 1`` the capacities are the multiples of ``step``.
        growth: above 1.0, each capacity is ``growth`` times the previous one (rounded up, at least one row more)
            until the gap reaches ``step``: finer buckets, hence less padding and more graphs, for small totals.
        seqlen_step: the ``max_seqlen`` bound given to attention is rounded up to a multiple of this. The varlen
            kernels only size their grid with it; ``padded_sdpa`` pads every image to it, so it is bucketed
            finely rather than fixed at ``N``.
        sync_free_rows: a stage whose input buffer has at most this many rows (``B * N`` for the first stage,
            else the capacity it was replayed at) skips its host read: the segment after it reuses that capacity (a
            later total can only be smaller), or ``B`` times the pruner's bound on an image's rows
            (:attr:`ragged_vit.pipelines.plan.ForwardPlan.row_bounds`) if smaller, and that bound as ``max_seqlen``; so
            do all later ones, and the rest of the forward replays as one graph without waiting for the host. The
            padding rows grow as the pruner keeps removing tokens and are split into padding images of at most that
            bound. With ``sync_free_rows >= B * N`` the forward reads nothing at all. For small batches of multi-stage
            pruners (ATS: 9 reads), where the GEMMs cost about the same for fewer rows. 0 (the default): every stage
            reads its total.
        lagged_reads: every stage's total is read one stage late, without stalling the device (with
            ``sync_free_rows`` unused): the segment after stage ``j`` is sized by stage ``j - 1``'s total, which bounds
            stage ``j``'s (rows never grow), read while the device runs stage ``j``'s segment; the host stays one
            graph ahead. The price: each buffer holds about one stage's worth of removed rows more than it needs (the
            first stage's repack the plan's whole bound). For many variable-count stages at large batches (ToMe's
            adaptive merges: 12), where waiting for every read idles the device between graphs.
    """

    step: int = 64
    growth: float = 1.0
    seqlen_step: int = 32
    sync_free_rows: int = 0
    lagged_reads: bool = False

    def __post_init__(self) -> None:
        check_int(self.step, "step", 1)
        check_int(self.seqlen_step, "seqlen_step", 1)
        check_int(self.sync_free_rows, "sync_free_rows", 0)
        if not isinstance(self.lagged_reads, bool):
            raise TypeError(f"lagged_reads must be a bool, got {type(self.lagged_reads).__name__}")
        if self.lagged_reads and self.sync_free_rows:
            raise ValueError("sync_free_rows skips reads, lagged_reads delays them: give one of them, not both")
        if isinstance(self.growth, bool) or not isinstance(self.growth, (int, float)):
            raise TypeError(f"growth must be a float >= 1, got {type(self.growth).__name__}")
        if not 1.0 <= self.growth < math.inf:
            raise ValueError(f"growth must be a finite float >= 1, got {self.growth}")

    def capacities(self, batch: int, tokens: int) -> tuple[int, ...]:
        """Every capacity for ``batch`` images of at most ``tokens`` rows each, increasing: from the first that
        holds ``batch`` rows (each image keeps its CLS row) to ``batch * tokens`` (nothing pruned)."""
        check_int(batch, "batch", 1)
        check_int(tokens, "tokens", 1)
        return _capacities(min(self.step, tokens), float(self.growth), batch, tokens)

    def capacity(self, total: int, batch: int, tokens: int) -> int:
        """The smallest capacity that holds ``total`` rows (``batch`` images of at most ``tokens`` rows)."""
        caps = self.capacities(batch, tokens)
        if isinstance(total, bool) or not isinstance(total, int) or not batch <= total <= caps[-1]:
            raise ValueError(
                f"total must be an int in [{batch}, {caps[-1]}] (batch {batch}, {tokens} rows), got {total}"
            )
        return caps[bisect.bisect_left(caps, total)]

    def native_capacity(self, total: int) -> int:
        """The rows of a native batch's buffer (a NaFlexVit's images of their own sizes, no unpruned size bounding
        them): the smallest multiple of ``step`` that holds ``total``."""
        check_int(total, "total", 1)
        return -(-total // self.step) * self.step

    def rereads_after(self, capacity: int) -> bool:
        """Whether a stage whose input buffer has ``capacity`` rows reads its total (see ``sync_free_rows``)."""
        return capacity > self.sync_free_rows

    def seqlen_bound(self, longest: int, tokens: int) -> int:
        """A ``max_seqlen`` for images of at most ``longest`` rows: ``longest`` rounded up to a multiple of
        ``seqlen_step``, but no more than ``max(tokens, longest)`` (no image outgrows the unpruned length)."""
        check_int(longest, "longest", 1)
        check_int(tokens, "tokens", 1)
        return min(-(-longest // self.seqlen_step) * self.seqlen_step, max(tokens, longest))


def padding_images(capacity: int, batch: int, tokens: int) -> int:
    """Padding images that cover every row of a ``capacity`` buffer beyond ``batch`` images' real rows, at most
    ``tokens`` rows each (a bound on an image's rows), whatever the real total (at least ``batch``: every image
    keeps its CLS row)."""
    check_int(batch, "batch", 1)
    check_int(tokens, "tokens", 1)
    if not batch <= capacity:
        raise ValueError(f"capacity must hold the {batch} CLS rows, got {capacity}")
    return max(1, -(-(capacity - batch) // tokens))


@functools.lru_cache(maxsize=256)
def _capacities(gap: int, growth: float, batch: int, tokens: int) -> tuple[int, ...]:
    top = batch * tokens
    if growth == 1.0:
        first = -(-batch // gap) * gap
        return (*range(first, top, gap), top)
    caps = [batch]
    while caps[-1] < top:
        caps.append(min(top, caps[-1] + min(gap, max(1, math.ceil(caps[-1] * (growth - 1.0))))))
    return tuple(caps)
