"""CUDA-graph runner of a pruned ViT: the whole pruned forward replayed without per-kernel host dispatch.

:class:`GraphedPrunedViT` wraps a :class:`ragged_vit.pipelines.model.PrunedViT` and executes the pipeline's forward
plan (:meth:`PrunedViT.plan_for` the images' size, :mod:`ragged_vit.pipelines.plan`) from CUDA graphs captured on
first use, per input shape (batch size and image size), running every step but the repack through
:meth:`PrunedViT.run_step`. What is captured depends on the plan:

* **Fixed counts** (DynamicViT, EViT, Threshold-L2 ratio, or no pruner): every shape is known on the host, so
  ``PrunedViT.run`` itself is captured whole, in ONE graph per input shape. A call copies the images into the
  graph's input buffer and replays it: no host synchronisation at all.
* **Variable counts** (ATS, Threshold-L2 threshold/calibrated): the plan cuts the forward before every stage's
  repack into segments (:attr:`ForwardPlan.segments`). Segment 0 runs the embedding, the dense blocks and the packed
  blocks up to stage 0's decision; segment ``j`` repacks stage ``j - 1``'s decision into a buffer of ``capacity`` rows
  (``ragged_vit.triton_impl.pack.repack(capacity=...)``) and runs the blocks up to the next decision (the last one ends
  with the head). Before a segment the host may read the kept total and the longest image (one read per stage, as
  the eager pipeline makes; a kernel writes the two integers straight into pinned host memory and the host polls
  them, so it neither waits for the rest of the stream nor copies), take the smallest capacity holding that total
  (:class:`ragged_vit.pipelines.buckets.TokenBuckets`) and replay the segment as captured for that capacity. With
  ``sync_free_rows`` (on by default for pruners with several variable-count stages), a stage whose input has at most
  that many rows skips the read: it takes the previous capacity, or the pruner's own bound on the rows it keeps
  (``Pruner.max_count_after``; ATS keeps at most its sample count) if smaller, and so does every later stage. The
  segments between two reads are ONE graph, keyed by their :class:`SegmentShape` s, and hand their decisions to each
  other directly: a small ATS batch replays its whole forward as one graph. Inside such a graph a mid-block stage's MLP
  half (the plan's ``StagePlan.mlp_beside``: per row, so it commutes with the repack) runs on every row beside the
  decision, which runs on a second stream: the graph holds them as parallel branches
  (:meth:`ragged_vit.pipelines.model.PrunedViT.decide_beside_mlp`); a fixed-count forward does the same in buffers of
  at most ``MLP_OVERLAP_MAX_ROWS`` rows.

**Padding rows.** A capacity buffer has ``capacity - total`` rows that no image owns (the pack kernel leaves them
unwritten). Inside a segment they form padding images after the ``B`` real ones, each at most ``max_seqlen``
rows (one after a read; as many as needed without), whose offsets the pack kernel writes after the real ones, so
``T == cu_seqlens[-1]`` holds for every consumer and no backend or pruner needs a special case. Every operation
acts per row (LayerNorm, Linear, GELU) or per image (attention, the pruners' segment reductions and sorts), so
whatever those rows hold stays in them; packing, the counts and the head read the real ``B + 1`` offsets only.
``tests/test_graphs.py`` fills them with NaN. After a read, capacities are at most ``min(step, N)`` rows apart,
so the one padding image is never longer than ``max_seqlen`` (rounded up from ``max(longest, padding)``).

**Image sizes.** A model built with ``dynamic_img_size=True`` takes one image size per batch, any multiple of the
patch size (:meth:`PrunedViT.check_images`). Static buffers, graph keys (:data:`GraphKey`) and the plan a forward
follows are all per ``(B, H, W)``: a new size allocates its own buffers and captures its own graphs (its token count,
capacities and row bounds are its own), and a graph captured for one size never replays for another. ``batch_sizes``
and ``max_graphs`` count over every size.

**Buffers and memory.** Graphs read and write only static buffers of their input shape, allocated outside the graph
memory pool: the input images (model dtype), logits, counts and, for variable counts, the state at a decision handed
from one graph to the next (residual stream, keep mask, kept counts, a RoPE model's row positions; for a merging
stage the merged rows, their sizes, ``log(size)`` and offsets, merged before the graph ends; double-buffered, so a
graph never overwrites its own input when it runs twice: warm-up, then replay), every segment's offsets and, in
pinned host memory, each stage's two read-back integers; a RoPE model's rope table per image size. Everything a
graph allocates is its own temporary, so all graphs share one memory pool (``pool``, by default one new
``torch.cuda.graph_pool_handle()``) that holds about the largest graph's temporaries, not their sum.
:meth:`GraphedPrunedViT.memory_report` gives the pool's reserved bytes and the buffers' bytes. A graph is captured
on first use: warm-up on a side stream, then capture, as ``torch.cuda.graph`` requires.

**Eager fallback.** A batch size outside ``batch_sizes`` runs the pipeline's eager forward (``pipeline(images)``:
no selections, so the fewest host reads, :meth:`PrunedViT.forward`). Once ``max_graphs`` graphs
exist, a missing one runs the same segment code eagerly on the same buffers (identical results, dispatch paid).
On a CPU nothing is captured and every segment runs eagerly (packing under Triton's interpreter): that is how the
CPU tests check the buckets and the padding image.

**Outputs.** :meth:`GraphedPrunedViT.run` returns a :class:`PrunedOutput` with logits and counts, cloned from the
static buffers (with ``clone_outputs=False`` they are the buffers themselves, overwritten by the next call with
the same batch and image size), and no selections: the decisions stay on the device.

**Misuse.** A runner is bound to its pipeline as it was at the first call: every parameter and buffer (storage
pointer and version counter), the backend object, the pruner object and its settings (``extra_repr``, e.g. a
calibrated threshold) and eval mode. A change raises ``RuntimeError`` at the next call; :meth:`reset` drops every
graph and re-binds. The check runs on the host while the call's first graph executes; the bound storages are kept
alive until ``reset()``, so a graph never reads freed memory. Not detected: in-place writes through ``.data``
(they bypass the version counter) and parameters replaced by new ``Parameter`` objects; call ``reset()`` after
those. Not thread-safe: one runner, one thread, the model's device current.

**RoPE models** (timm's ``Eva``: :mod:`ragged_vit.pipelines.eva`). The rope table of an image size is built once,
outside every graph (timm's own call: DINOv3's builds its grid on the host, which a capture cannot hold), and kept as
a static buffer per size that every graph of that size reads (RoPE-Mixed's per-block table too); the unpruned
batch's row positions are static per input shape. The positions travel with the rows through every repack inside a
graph (the pack kernel copies them beside the rows) and, between two graphs, with the decision in the stage's
handover.

**Native batches** (a NaFlexVit's images of their own sizes, :mod:`ragged_vit.pipelines.naflex`). The front runs
eagerly (each image's patch rows, their resampled position embeddings, the prefix rows and offsets, a RoPE model's
tables of the batch's grids and each row's position in them, are shaped on the host by the images' grids) and is
copied into static buffers of ``TokenBuckets.native_capacity(total)`` rows; the blocks, stages and head replay from
ONE graph keyed by ``("native", B, capacity, max_seqlen)``, ``max_seqlen`` the longest image (or the padding image)
rounded up to ``seqlen_step``, the rows past the total one padding image. No stage reads its total: each repacks
into a static buffer of at most the previous one's rows or ``B`` images of the stage's bound on an image's rows (the
plan of ``max_seqlen`` rows), the rows past the real total padding images, as a read-free chain does; the stages
count each image from its own patches, copied in per call (a padding image's: 0). A RoPE model's table buffer has
``capacity`` rows (the batch's distinct grids never hold more positions than its patches). An appended token is
refused (``naflex.native_refusal``). Without reads the stages' buffers hold each image at the key's bound (the
longest image's count), so a pruned batch of more than ``NATIVE_GRAPH_MAX_ROWS`` rows runs the pipeline's eager
forward, which sizes them exactly. A key's first call runs the pipeline's eager forward and keeps nothing but the key
(the last ``NATIVE_SEEN_KEYS``); its second allocates the static buffers and captures. A stream of one-off size mixes
captures and allocates nothing, and the ``NATIVE_KEYS`` keys used last keep their buffers and graphs (the oldest
are dropped).

Not supported: ``selections=`` replay, training, the ``nested_sdpa`` backend (NestedTensor construction is not
capturable), the ``reference`` backend on CUDA (it reads the offsets on the host), and variable-count stages
that append an extra token (no registered pruner does).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch

from ..core.validation import check_int
from ..triton_impl.launcher import INTERPRETED
from .backends import BACKENDS
from .buckets import (
    NATIVE_GRAPH_MAX_ROWS,
    NATIVE_KEYS,
    NATIVE_SEEN_KEYS,
    TokenBuckets,
    default_sync_free_rows,
    padding_images,
)
from .eva import RotaryRows
from .executor import CapturedRepack, ExactRepack, Run, execute, stage_counts
from .naflex import NativeBatch, native_front, native_refusal
from .plan import MLP_OVERLAP_MAX_ROWS, ForwardPlan, Program, StepKind
from .stages import HostCounts, Target, host_counts
from .state import ForwardState, PrunedOutput

Pipeline = torch.nn.Module
"""A :class:`ragged_vit.pipelines.model.PrunedViT` (not imported here: that module builds its runner from this one)."""


class SegmentShape(NamedTuple):
    """How one segment of a variable-count forward is replayed (part of its graph's key)."""

    index: int  # the segment (0: embedding to stage 0's decision; j: stage j - 1's repack to stage j's decision)
    capacity: int  # rows of its packed buffer
    max_seqlen: int  # bound on its images' rows, padding images included
    pads: int  # padding images after the B real ones (0 in segment 0)


GraphKey = tuple
"""``(B, H, W)`` (batch and image size) for a whole fixed-count forward; ``(B, H, W, SegmentShape, ...)`` for
consecutive segments of a variable-count forward replayed as one graph (from one host read to the next);
``("native", B, capacity, max_seqlen)`` for the blocks, stages and head of a native batch."""


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """What the graphs of a :class:`GraphedPrunedViT` hold on the device.

    Attributes:
        graphs: number of captured graphs.
        pool_bytes: bytes reserved by the graph memory pool (the graphs' temporaries; shared with any other user
            of the same pool; 0 before the first capture).
        buffer_bytes: bytes of the static buffers (inputs, outputs, stage state) of every input shape.
        keys: the captured graphs (see :data:`GraphKey`).
    """

    graphs: int
    pool_bytes: int
    buffer_bytes: int
    keys: tuple[GraphKey, ...]


@dataclasses.dataclass
class GraphCounters:
    """How calls were served: graphs captured and replayed, segments run eagerly (graph budget spent, or CPU),
    and calls handed to the pipeline's eager forward (batch size outside ``batch_sizes``)."""

    captures: int = 0
    replays: int = 0
    eager_segments: int = 0
    eager_calls: int = 0


class _Buffers:
    """The static tensors of one input shape ``(B, H, W)``, allocated outside the graph pool and kept until
    ``reset()``, with the plan of that image size."""

    def __init__(self, pipeline: Pipeline, batch: int, size: tuple[int, int], table: torch.Tensor | None) -> None:
        model = pipeline.model
        dtype, device = pipeline.dtype, pipeline.device
        channels = model.patch_embed.proj.in_channels
        width = model.num_classes if model.num_classes > 0 else model.embed_dim
        self.batch = batch
        self.key: GraphKey = (batch, *size)  # every graph key of this shape starts with it
        self.plan = plan = pipeline.plan_for(size)
        self.tokens = tokens = plan.tokens  # N: rows of an unpruned image of this size
        self.images = torch.zeros((batch, channels, *size), dtype=dtype, device=device)  # zeros: padding images
        self.logits = torch.empty((batch, width), dtype=dtype, device=device)
        self.counts = torch.zeros((batch, pipeline.num_stages), dtype=torch.long, device=device)
        # A RoPE model's rotation of the unpruned batch: the size's static rope table and every row's position.
        self.rotary = None if table is None else pipeline.rotary_rows(table, batch, tokens)
        # Variable counts: the decision handed from one graph to the next (the stage's handover, two sides), the
        # offsets of every segment and each stage's two read-back integers.
        self.handover = None
        # int32 [stages + 1, >= 2B + 1]: row j holds segment j's offsets, the B + 1 real ones then those of its
        # padding images (at most B); row 0 is the dense batch's, written once here. Rows start 16-byte aligned
        # (the kernels' cached launches need that).
        self.cu: torch.Tensor | None = None
        # Stage j's kept total and longest image, written by a kernel straight into pinned host memory (the pack
        # kernels' total_and_longest; a merging stage's merge kernel) and polled by the host.
        self.stats: HostCounts | None = None
        if not plan.fixed:
            rows = batch * tokens
            self.handover = pipeline.stages[0].handover(batch, rows, model.embed_dim, dtype, device, self.rotary)
            width = -(-(2 * batch + 1) // 4) * 4
            self.cu = torch.zeros((pipeline.num_stages + 1, width), dtype=torch.int32, device=device)
            self.cu[0, : batch + 1] = torch.arange(batch + 1, dtype=torch.int32, device=device) * tokens
            self.stats = HostCounts(pipeline.num_stages, device)

    def nbytes(self) -> int:
        tensors = [self.images, self.logits, self.counts]
        tensors += [self.rotary.positions] if self.rotary is not None else []  # (the table: the runner's, per size)
        tensors += [*self.handover.tensors(), self.cu] if self.handover is not None else []  # (stats: host memory)
        return sum(t.numel() * t.element_size() for t in tensors)


class _NativeBuffers:
    """The static tensors of one native-batch key ``("native", B, capacity, max_seqlen)`` (see the module docstring,
    Native batches) and the plan of its stages, allocated outside the graph pool and kept until ``reset()`` or until
    the key is the oldest of more than ``NATIVE_KEYS``."""

    def __init__(
        self, pipeline: Pipeline, batch: int, capacity: int, plan: ForwardPlan, rotary: RotaryRows | None
    ) -> None:
        model, dtype, device = pipeline.model, pipeline.dtype, pipeline.device
        width = model.num_classes if model.num_classes > 0 else model.embed_dim
        self.batch, self.plan, self.bound = batch, plan, plan.tokens
        self.x = torch.zeros((capacity, model.embed_dim), dtype=dtype, device=device)  # the front's rows, then padding
        # Each stage's buffer: at most the previous one's rows or B images of the stage's bound, whatever the front's
        # total; the rows past the real ones form padding images of at most that bound.
        self.shapes = [(capacity, plan.tokens, 1)]
        for stage in plan.stages:
            rows = min(self.shapes[-1][0], batch * stage.rows_after)
            self.shapes.append((rows, stage.rows_after, padding_images(rows, batch, stage.rows_after)))
        pads = max(p for _, _, p in self.shapes)
        # Row j: the offsets of the buffer after stage j - 1, the real images' then the padding images' (the repack
        # writes them; row 0's are copied in per call, then the padding image's end, the buffer's last row).
        self.cu = torch.full((len(self.shapes), batch + 1 + pads), capacity, dtype=torch.int32, device=device)
        # Each image's patches (the stages count from them), copied in per call; a padding image's 0.
        self.patches = torch.zeros(batch + pads, dtype=torch.int64, device=device)
        self.logits = torch.empty((batch, width), dtype=dtype, device=device)
        self.counts = torch.zeros((batch, len(plan.stages)), dtype=torch.long, device=device)
        # A RoPE model: the batch's grids' tables (fewer rows than the patches, so at most ``capacity``) and each row's
        # position, copied in per call; padding rows keep -1 or an earlier call's position, inside the table.
        self.rotary = None
        if rotary is not None:
            table = rotary.table.new_zeros((*rotary.table.shape[:-2], capacity, rotary.table.shape[-1]))
            positions = torch.full((capacity,), -1, dtype=torch.int32, device=device)
            self.rotary = dataclasses.replace(rotary, positions=positions, table=table)

    def targets(self) -> dict[int, Target]:
        """Where each stage's repack writes (:class:`CapturedRepack`)."""
        return {j: Target(rows, bound, pads, cu_out=self.cu[j + 1, : self.batch + 1 + pads])
                for j, (rows, bound, pads) in enumerate(self.shapes[1:])}  # fmt: skip

    def load(self, front: ForwardState) -> None:
        """Copies a call's front (its rows, offsets, images' patches and rotation) into the buffers."""
        total = front.x.shape[0]
        self.x[:total].copy_(front.x)
        self.cu[0, : self.batch + 1].copy_(front.cu_seqlens)
        if self.plan.stages:  # the front's counts on the device (several sizes), else every image has num_patches
            patches = self.patches[: self.batch]
            if front.image_patches is None:
                patches.fill_(front.num_patches)
            else:
                patches.copy_(front.image_patches)
        if self.rotary is not None:
            table = front.rotary.table
            self.rotary.table[..., : table.shape[-2], :].copy_(table)
            self.rotary.positions[:total].copy_(front.rotary.positions)

    def nbytes(self) -> int:
        tensors = [self.x, self.cu, self.patches, self.logits, self.counts]
        tensors += [self.rotary.table, self.rotary.positions] if self.rotary is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)


class _Binding:
    """The pipeline state the graphs were captured against (see the module docstring, Misuse)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.tensors = [*pipeline.parameters(), *pipeline.buffers()]
        self.storages = [t.detach() for t in self.tensors]  # keeps the captured storages alive
        self.state = self._state(pipeline)

    def _state(self, pipeline: Pipeline) -> tuple:
        pruner = pipeline.pruner
        return (
            [t.data_ptr() for t in self.tensors],
            [t._version for t in self.tensors],
            pipeline.backend,
            pruner,
            None if pruner is None else pruner.extra_repr(),
            pipeline.training,
            pipeline.compile_blocks,
            pipeline.gemm_patch_embed,
        )

    def matches(self, pipeline: Pipeline) -> bool:
        return self._state(pipeline) == self.state

    def check(self, pipeline: Pipeline) -> None:
        if not self.matches(pipeline):
            raise RuntimeError(
                "the pipeline changed after GraphedPrunedViT bound to it (parameters or buffers written or moved, "
                "backend, pruner or its settings, train mode, compile_blocks or gemm_patch_embed): call reset() to "
                "drop the graphs and re-capture"
            )


class GraphedPrunedViT:
    """Replays a :class:`PrunedViT` forward from CUDA graphs captured on first use (see the module docstring).

    Args:
        pipeline: the pipeline to run; its backend must be capturable (``triton``, ``fa2_varlen``,
            ``padded_sdpa``; ``reference`` on a CPU, where nothing is captured).
        buckets: the token-budget capacities of variable-count segments. None: ``TokenBuckets()``, with
            ``sync_free_rows=1024`` when the pruner has several variable-count stages (ATS: 9 host reads per
            forward) and 0 for one (Threshold-L2 threshold/calibrated keeps its one read); the measurements behind
            the default: ``docs/graphs.md``, ``sync_free_rows``.
        batch_sizes: the batch sizes graphs are captured for (at every image size); others run the pipeline's eager
            forward. None: any.
        max_graphs: at most this many graphs; beyond, segments run eagerly on the static buffers. None: no limit.
        pool: a CUDA graph memory pool (``torch.cuda.graph_pool_handle()``) to share, e.g. with other runners
            replayed on the same stream; None creates one.
        warmup: eager runs on a side stream before each capture.
        clone_outputs: return copies of the static output buffers (else the buffers, overwritten by the next call
            with the same batch and image size).
        overlap_decisions: inside a chain of read-free segments, and in a fixed-count forward of small buffers, run
            each mid-block decision on a second stream beside its block's MLP half (applied before the repack; see the
            module docstring): the program's ``beside`` steps. False: one stream, the MLP after the repack.
        batch_buckets: increasing batch sizes; a batch is padded to the smallest that holds it (its graphs and
            buffers are that size's; the padding images hold zeros or earlier images, and only the real images'
            logits and counts are returned), and a batch above the largest runs the pipeline's eager forward. None:
            every batch size its own graphs. Not with ``batch_sizes``.
        compile_blocks: the graphs run the compiled parts (:mod:`ragged_vit.pipelines.parts`). None: the
            pipeline's ``compile_blocks`` is True.
        rebind: when the pipeline changed since the graphs were captured (see the module docstring, Misuse), drop
            them and capture anew instead of raising (the automatic mode of ``PrunedViT``).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        buckets: TokenBuckets | None = None,
        *,
        batch_sizes: Collection[int] | None = None,
        max_graphs: int | None = None,
        pool: tuple[int, int] | None = None,
        warmup: int = 2,
        clone_outputs: bool = True,
        overlap_decisions: bool = True,
        batch_buckets: Sequence[int] | None = None,
        compile_blocks: bool | None = None,
        rebind: bool = False,
    ) -> None:
        if not (isinstance(pipeline, torch.nn.Module) and hasattr(pipeline, "stages") and hasattr(pipeline, "program")):
            raise TypeError(f"pipeline must be a PrunedViT, got {type(pipeline).__name__}")
        if buckets is not None and not isinstance(buckets, TokenBuckets):
            raise TypeError(f"buckets must be a TokenBuckets or None, got {type(buckets).__name__}")
        if batch_sizes is not None:
            batch_sizes = frozenset(check_int(b, "batch_sizes[i]", 1) for b in batch_sizes)
        if batch_buckets is not None:
            if batch_sizes is not None:
                raise ValueError("batch_sizes and batch_buckets both choose the captured batch sizes: give one")
            batch_buckets = tuple(check_int(b, "batch_buckets[i]", 1) for b in batch_buckets)
            if not batch_buckets or list(batch_buckets) != sorted(set(batch_buckets)):
                raise ValueError(f"batch_buckets must be increasing batch sizes, got {batch_buckets}")
        if compile_blocks is not None and not isinstance(compile_blocks, bool):
            raise TypeError(f"compile_blocks must be a bool or None, got {type(compile_blocks).__name__}")
        if max_graphs is not None:
            check_int(max_graphs, "max_graphs", 0)
        _check_capturable(pipeline)
        self.pipeline = pipeline
        self.batch_sizes = batch_sizes
        self.max_graphs = max_graphs
        self.warmup = check_int(warmup, "warmup", 1)
        self.clone_outputs = bool(clone_outputs)
        self.overlap_decisions = bool(overlap_decisions)
        self.batch_buckets = batch_buckets
        self.compile_blocks = compile_blocks
        self.rebind = bool(rebind)
        self.counters = GraphCounters()
        self._plan = pipeline.plan  # the steps, segments and fixedness are the same at every image size
        if buckets is None:
            buckets = TokenBuckets(sync_free_rows=default_sync_free_rows(len(self._plan.segments) - 1))
        self.buckets = buckets
        self._pool, self._own_pool = pool, pool is None
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._buffers: dict[tuple, _Buffers] = {}  # by (B, H, W)
        self._native: collections.OrderedDict[GraphKey, _NativeBuffers] = collections.OrderedDict()  # used last: last
        self._seen: collections.OrderedDict[GraphKey, None] = collections.OrderedDict()  # native keys met once
        self._tables: dict[tuple[int, int], torch.Tensor | None] = {}  # a RoPE model's static rope table by (H, W)
        self._binding: _Binding | None = None

    @property
    def plan(self) -> ForwardPlan:
        """The pipeline's forward plan at its default image size, which says how the forward is cut into graphs
        (:attr:`ForwardPlan.segments`; the same cuts at every size, other row bounds: :meth:`PrunedViT.plan_for`)."""
        return self._plan

    def __call__(
        self, images: torch.Tensor, return_counts: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, classes]`` of ``images [B, 3, H, W]``; with ``return_counts`` also the counts ``[B, S]``."""
        out = self.run(images)
        return (out.logits, out.counts) if return_counts else out.logits

    @torch.no_grad()
    def run(self, images: torch.Tensor) -> PrunedOutput:
        """The forward of ``images`` (on the model's device, at an input size it takes: its own, or with
        ``dynamic_img_size`` any multiple of the patch size): logits and counts, no selections."""
        pipeline = self.pipeline
        if pipeline.training:
            raise RuntimeError("GraphedPrunedViT is inference only: call .eval() on the pipeline")
        return self.run_checked(pipeline.check_images(images))  # the rest of check_inputs runs at binding

    def bucket(self, batch: int) -> int | None:
        """The batch size whose graphs serve a batch of ``batch`` images (None: the eager forward serves it)."""
        if self.batch_buckets is not None:
            index = bisect.bisect_left(self.batch_buckets, batch)
            return self.batch_buckets[index] if index < len(self.batch_buckets) else None
        return batch if self.batch_sizes is None or batch in self.batch_sizes else None

    @torch.no_grad()
    def run_checked(self, images: torch.Tensor, counts: bool = True) -> PrunedOutput:
        """:meth:`run` on images the pipeline checked (``check_images``); without ``counts`` the output's counts are
        an empty ``[B, 0]`` tensor (no copy of them: one launch fewer behind the graphs)."""
        if isinstance(images, NativeBatch):
            return self._run_native(images, counts)
        batch = images.shape[0]
        size = self.bucket(batch)
        if size is None:
            return self._eager(images, counts)
        if self._binding is None:
            self._bind(images)
        key = (size, *images.shape[-2:])
        bufs = self._buffers.get(key) or self._allocate(key)
        (bufs.images if size == batch else bufs.images[:batch]).copy_(images)
        try:
            if bufs.plan.fixed:
                self._launch(bufs.key, functools.partial(self._whole, bufs))
                self._check_binding()
            else:
                self._run_segments(bufs)
        except _Changed:
            self.reset()
            return self.run_checked(images, counts)
        logits, lengths = bufs.logits, bufs.counts
        if size != batch:
            logits, lengths = logits[:batch], lengths[:batch]
        return self._outputs(logits, lengths, counts)

    def _check_binding(self) -> None:
        """Raises ``RuntimeError`` (with ``rebind``: :class:`_Changed`) if the pipeline changed since binding."""
        if self._binding.matches(self.pipeline):  # the state computed once on the hot path
            return
        if self.rebind:
            raise _Changed
        self._binding.check(self.pipeline)  # raises, naming what may have changed

    def memory_report(self) -> GraphMemory:
        """Graphs captured, bytes reserved by their memory pool and bytes of the static buffers."""
        pool_bytes = 0
        if self._pool is not None:
            pool = tuple(self._pool)
            segments = torch.cuda.memory_snapshot()
            pool_bytes = sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == pool)
        tensors = [t for t in self._tables.values() if t is not None]
        buffers = [*self._buffers.values(), *self._native.values()]
        buffer_bytes = sum(b.nbytes() for b in buffers) + sum(t.nbytes for t in tensors)
        return GraphMemory(len(self._graphs), pool_bytes, buffer_bytes, tuple(self._graphs))

    def reset(self) -> None:
        """Drops every graph and buffer and unbinds: the next call re-binds to the pipeline and captures anew."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay in flight on what is freed
        self._graphs.clear()
        self._buffers.clear()
        self._native.clear()
        self._seen.clear()
        self._tables.clear()
        self._binding = None
        if self._own_pool:
            self._pool = None  # (the pipeline may have moved to another device)

    # -- internals --------------------------------------------------------------------------------------------

    def _bind(self, images: torch.Tensor) -> None:
        pipeline, device = self.pipeline, images.device
        pipeline.check_inputs(images)  # the backend against the model, the pruner ready
        _check_capturable(pipeline)
        if device.type == "cpu" and not self._plan.fixed and not INTERPRETED:
            raise ValueError(
                "GraphedPrunedViT on the CPU (nothing is captured there) packs variable counts with Triton's "
                "kernels: set TRITON_INTERPRET=1 before triton (or timm) is first imported"
            )
        self._binding = _Binding(pipeline)

    def _allocate(self, key: tuple[int, int, int]) -> _Buffers:
        batch, *size = key
        size = tuple(size)
        with torch.inference_mode(False):  # normal tensors: writable inside and outside inference mode
            if size not in self._tables:  # built once per size, outside every graph, read by all of them
                self._tables[size] = self.pipeline.rope_table(size)
            self._buffers[key] = _Buffers(self.pipeline, batch, size, self._tables[size])
        return self._buffers[key]

    def _run_native(self, batch: NativeBatch, counts: bool) -> PrunedOutput:
        """A native batch: on its key's first call the pipeline's eager forward, then the front eagerly and the blocks,
        stages and head from the graph of its key (module docstring)."""
        pipeline = self.pipeline
        why = native_refusal(pipeline)
        if why is not None:
            raise ValueError(f"GraphedPrunedViT cannot replay this NaFlexVit's native batches: {why}")
        if self._binding is None:
            self._bind(batch)
        prefix, images = pipeline.model.num_prefix_tokens, len(batch)
        longest, total = batch.max_patches + prefix, sum(batch.counts) + images * prefix
        capacity = self.buckets.native_capacity(total)
        if pipeline.num_stages and capacity > NATIVE_GRAPH_MAX_ROWS:  # the eager forward sizes its buffers exactly
            return self._eager(batch, counts)
        pipeline.plan_of_tokens(longest, "the longest image")  # checked as the eager forward
        key = ("native", images, capacity, self.buckets.seqlen_bound(max(longest, capacity - total), capacity))
        bufs = self._native.get(key)
        if bufs is None and key not in self._seen:  # met once: the eager forward, nothing kept but the key
            self._seen[key] = None
            if len(self._seen) > NATIVE_SEEN_KEYS:
                self._seen.popitem(last=False)
            return self._eager(batch, counts)
        front = native_front(pipeline, self._parts(), batch, ())  # eager: rows, offsets, rotation
        if bufs is None:  # met again: static buffers, captured (where allowed) by _launch
            del self._seen[key]
            bufs = self._keep_native(key, front.rotary)
        self._native.move_to_end(key)
        bufs.load(front)
        try:
            self._launch(key, functools.partial(self._native_forward, bufs))
            self._check_binding()
        except _Changed:
            self.reset()
            return self._run_native(batch, counts)
        return self._outputs(bufs.logits, bufs.counts, counts)

    def _eager(self, images: torch.Tensor | NativeBatch, counts: bool) -> PrunedOutput:
        """``images`` by the pipeline's eager forward (its buffers sized from the host's bounds: as few host reads)."""
        self.counters.eager_calls += 1
        out = self.pipeline._execute(images, None, None, bounded=True, counts=counts)
        return PrunedOutput(out.logits, out.counts, [])

    def _outputs(self, logits: torch.Tensor, lengths: torch.Tensor, counts: bool) -> PrunedOutput:
        """A call's outputs from the static logits and counts of its real images: without ``counts`` an empty
        ``[B, 0]`` counts tensor (no copy), with ``clone_outputs`` the caller's own copies."""
        if not counts:
            lengths = lengths.new_empty((lengths.shape[0], 0))
        elif self.clone_outputs:
            lengths = lengths.clone()
        return PrunedOutput(logits.clone() if self.clone_outputs else logits, lengths, [])

    def _keep_native(self, key: GraphKey, rotary: RotaryRows | None) -> _NativeBuffers:
        """Allocates ``key``'s static buffers, dropping the buffers and graph of the key used longest ago past
        :data:`NATIVE_KEYS`."""
        _, images, capacity, bound = key
        plan = self.pipeline.plan_of_tokens(bound, "the longest image")  # the key's bounds on every stage's rows
        with torch.inference_mode(False):  # normal tensors: writable inside and outside inference mode
            bufs = self._native[key] = _NativeBuffers(self.pipeline, images, capacity, plan, rotary)
        if len(self._native) > NATIVE_KEYS:
            oldest, _ = self._native.popitem(last=False)
            if self._graphs.pop(oldest, None) is not None:
                torch.cuda.synchronize(self.pipeline.device)  # no replay in flight on what is freed
        return bufs

    def _native_forward(self, bufs: _NativeBuffers) -> None:
        """The blocks, stages and head of a native batch on its static rows, into its static logits and counts: the
        program's steps (its FRONT's blocks run on the rows the eager front left), each stage repacking into its
        static buffer with padding images (no host read), every image counted from its own patches."""
        pipeline, plan, batch = self.pipeline, bufs.plan, bufs.batch
        triton = pipeline.device.type == "cuda" or bool(plan.stages)  # the CPU repacks under the interpreter
        overlap = MLP_OVERLAP_MAX_ROWS if self.overlap_decisions else 0
        steps = list(pipeline.program(plan, batch, graphs=True, triton=triton, overlap_rows=overlap).steps)
        steps[0] = dataclasses.replace(steps[0], kind=StepKind.BLOCKS)  # FRONT ran eagerly, but for its blocks
        run = Run(pipeline, self._parts(), CapturedRepack(bufs.targets()))
        state = ForwardState(batch, bufs.x, bufs.cu[0, : batch + 2], bufs.bound, bufs.bound - plan.num_prefix,
                             rotary=bufs.rotary, image_patches=bufs.patches if plan.stages else None)  # fmt: skip
        execute(run, steps, state)
        bufs.logits.copy_(state.logits)
        if plan.stages:
            offsets = bufs.cu[1:, : batch + 1]  # every stage's real offsets
            bufs.counts.copy_((offsets[:, 1:] - offsets[:, :-1] - plan.num_prefix).t())

    def _launch(self, key: GraphKey, fn: Callable[[], None]) -> None:
        """Replays the graph of ``key``, capturing it first if allowed; else runs ``fn`` eagerly."""
        graph = self._graphs.get(key)
        if graph is None and self._may_capture():
            graph = self._graphs[key] = self._capture(fn)
        if graph is None:
            fn()
            self.counters.eager_segments += 1
        else:
            graph.replay()
            self.counters.replays += 1

    def _may_capture(self) -> bool:
        on_cuda = self.pipeline.device.type == "cuda"
        return on_cuda and (self.max_graphs is None or len(self._graphs) < self.max_graphs)

    def _parts(self):
        compiled = self.pipeline.compile_blocks is True if self.compile_blocks is None else self.compile_blocks
        return self.pipeline.parts_for(compiled)

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        device = self.pipeline.device
        with torch.cuda.device(device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # Warm-up on a side stream (lazy handles, Triton compilation, cached launchers), then capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                fn()
        self.counters.captures += 1
        return graph

    def _program(self, bufs: _Buffers) -> Program:
        """The program the graphs of ``bufs``' shape run: a mid-block decision beside its MLP half where the plan
        allows it (``overlap_decisions``) in buffers of at most :data:`MLP_OVERLAP_MAX_ROWS` rows (a whole-forward
        graph) or ``buckets.sync_free_rows`` (read-free segments, chained into one graph)."""
        fixed = bufs.plan.fixed
        rows = MLP_OVERLAP_MAX_ROWS if fixed else self.buckets.sync_free_rows
        triton = self.pipeline.device.type == "cuda" or not fixed  # the CPU: the reference repacks a whole forward
        return self.pipeline.program(
            bufs.plan, bufs.batch, graphs=True, triton=triton, overlap_rows=rows if self.overlap_decisions else 0
        )

    def _whole(self, bufs: _Buffers) -> None:
        """A fixed-count forward on the static images, into the static outputs (the CPU repacks with the
        reference)."""
        pipeline, program = self.pipeline, self._program(bufs)
        on_cuda = pipeline.device.type == "cuda"
        run = Run(pipeline, self._parts(), ExactRepack(host_counts(pipeline.device), reference=not on_cuda))
        state = ForwardState(bufs.batch, bufs.images, rotary=bufs.rotary)
        execute(run, program.steps, state)
        bufs.logits.copy_(state.logits)
        bufs.counts.copy_(stage_counts(run, bufs.batch, bufs.plan.num_prefix, pipeline.device))

    def _run_segments(self, bufs: _Buffers) -> None:
        """A variable-count forward: the segments from one host read to the next, each run one graph."""
        bufs.stats.clear()  # on the host: no stage's total is in yet
        if self.buckets.lagged_reads:
            self._run_lagged(bufs)
            return
        batch, tokens, plan = bufs.batch, bufs.tokens, bufs.plan
        chain = [SegmentShape(0, batch * tokens, tokens, 0)]  # segment 0: the whole dense batch
        for index in range(1, len(plan.segments)):
            previous, rows = chain[-1], plan.row_bounds[index]
            if self.buckets.rereads_after(previous.capacity):
                self._launch_chain(bufs, chain)  # writes the decision's total and longest image to bufs.stats
                total, longest = bufs.stats.read(index - 1)  # the one read of this stage
                capacity = min(self.buckets.capacity(total, batch, tokens), batch * rows)
                bound = self.buckets.seqlen_bound(max(longest, capacity - total), tokens)
                chain = [SegmentShape(index, capacity, bound, 1)]
            else:  # no read: the previous capacity (or the pruner's bound) holds this stage's smaller total
                capacity = min(previous.capacity, batch * rows)
                chain.append(SegmentShape(index, capacity, rows, padding_images(capacity, batch, rows)))
        self._launch_chain(bufs, chain)

    def _run_lagged(self, bufs: _Buffers) -> None:
        """A variable-count forward with reads one stage behind (``TokenBuckets.lagged_reads``): every segment is
        one graph; segment ``j`` repacks stage ``j - 1``'s decision into the capacity that holds stage ``j - 2``'s
        total (an image's rows never grow from stage to stage, so that total bounds the next), read by the host while
        the device runs segment ``j - 1``: the host waits for a decision only once the next segment is queued
        behind it. Segment 1 has no earlier total: the plan's bound sizes it."""
        batch, tokens, plan = bufs.batch, bufs.tokens, bufs.plan
        stages = len(plan.segments) - 1
        for index in range(stages + 1):
            if index == 0:
                shape = SegmentShape(0, batch * tokens, tokens, 0)
            else:
                rows = plan.row_bounds[index]
                capacity, bound = batch * rows, rows
                if index >= 2:  # stage index - 2's total and longest image bound stage index - 1's
                    total, longest = bufs.stats.read(index - 2)
                    capacity = min(self.buckets.capacity(total, batch, tokens), capacity)
                    bound = min(self.buckets.seqlen_bound(longest, tokens), rows)
                bound = max(bound, -(-(capacity - batch) // batch))  # at most B padding images (bufs.cu's width)
                shape = SegmentShape(index, capacity, bound, padding_images(capacity, batch, bound))
            self._launch_chain(bufs, [shape])  # its stage's total, if read (index <= stages - 2), to bufs.stats

    def _launch_chain(self, bufs: _Buffers, chain: list[SegmentShape]) -> None:
        # A chain that hands its decision to the next graph is one segment (the capacity never grows, so once a
        # stage skips its read every later one does): its sides (read (j - 1) % 2, write j % 2) differ.
        assert len(chain) == 1 or chain[-1].index == len(bufs.plan.segments) - 1
        chain = tuple(chain)
        self._launch((*bufs.key, *chain), functools.partial(self._chain, bufs, chain))
        if chain[0].index == 0:
            self._check_binding()  # on the host, while the first graph runs

    def _chain(self, bufs: _Buffers, chain: tuple[SegmentShape, ...]) -> None:
        """Consecutive segments of the program in one graph: each hands its decision to the next directly; the last
        one stores it in the static buffers (unless it ends with the head).

        Segment 0 reads the images; segment ``j > 0`` starts with stage ``j - 1``'s REPACK (of the decision handed
        over, or of the static buffers' side ``(j - 1) % 2``) into ``shape.capacity`` rows, whose rows past the real
        total form ``shape.pads`` padding images of at most ``shape.max_seqlen`` rows (the repack writes their
        offsets after the real ones, into ``bufs.cu[j]``). Every step runs through the executor loop.
        """
        pipeline, batch, plan, program = self.pipeline, bufs.batch, bufs.plan, self._program(bufs)
        targets = {
            shape.index - 1: Target(shape.capacity, shape.max_seqlen, shape.pads,
                                    cu_out=bufs.cu[shape.index, : batch + 1 + shape.pads])
            for shape in chain
            if shape.index > 0
        }  # fmt: skip
        state = self._chain_input(bufs, chain[0])
        run = Run(pipeline, self._parts(), CapturedRepack(targets))
        execute(run, [step for shape in chain for step in program.segments[shape.index]], state)
        last = chain[-1]
        if last.index == len(plan.segments) - 1:
            bufs.logits.copy_(state.logits)
            offsets = bufs.cu[1:, : batch + 1]  # every stage's real offsets
            prefix = plan.num_prefix  # rows after each stage, prefix rows excluded
            bufs.counts.copy_((offsets[:, 1:] - offsets[:, :-1] - prefix).t())
        else:
            # The kept total and longest image first, when the host reads them: it reads them while the device goes
            # on (a merging stage merges here, straight into the static buffers: its kernel writes them itself).
            stats = (state.selection.kept[:batch], bufs.stats.rows[last.index]) if self._reads(bufs, last) else None
            bufs.handover.store(state, last.index % 2, stats)

    def _chain_input(self, bufs: _Buffers, first: SegmentShape) -> ForwardState:
        """The state a chain starts from: the images, or the decision the previous graph stored."""
        batch, index = bufs.batch, first.index
        if index == 0:
            return ForwardState(batch, bufs.images, cu_seqlens=bufs.cu[0, : batch + 1], rotary=bufs.rotary)
        num_patches = bufs.tokens - bufs.plan.num_prefix  # FRONT sets it in segment 0
        cu, bound = bufs.cu[index - 1, : batch + 1], bufs.plan.row_bounds[index - 1]
        return bufs.handover.resume((index - 1) % 2, batch, first.capacity, cu, num_patches, bound)

    def _reads(self, bufs: _Buffers, shape: SegmentShape) -> bool:
        """Whether the host reads the total of the stage that ends segment ``shape``: after it (``_run_segments``;
        a stored chain always ends at a read), or two segments later (``_run_lagged``: the last stage's total is
        never read, so never written: no write lands after the call returns)."""
        if self.buckets.lagged_reads:
            return shape.index <= len(bufs.plan.segments) - 3
        return True


class _Changed(Exception):
    """The pipeline changed since the graphs were captured (raised with ``rebind``: capture anew)."""


def _check_capturable(pipeline: Pipeline) -> None:
    backend = pipeline.backend
    caps = backend.capabilities
    on_cuda = pipeline.device.type == "cuda"
    if not caps.capturable and (on_cuda or caps.devices == ("cuda",)):
        capturable = [name for name, cls in BACKENDS.items() if cls.capabilities.capturable]
        raise ValueError(
            f"backend {backend.name!r} cannot run in a CUDA graph: {caps.not_capturable_because}; "
            f"use one of {', '.join(map(repr, capturable))}"
        )
