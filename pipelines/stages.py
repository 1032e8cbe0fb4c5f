"""The stages of a pruned forward: one object per stage that knows its decision, its repack and what a graph runner
keeps of it between two graphs. The pipelines ask a pruner whether it merges in one place: :func:`make_stages`.

* :class:`PruneStage`: a keep mask (:class:`~ragged_vit.core.selection.TokenSelection`); the repack keeps the rows
  it marks (:mod:`ragged_vit.triton_impl.pack`; the pure-PyTorch :mod:`ragged_vit.reference.packing` where the
  target says so: the CPU's eager forward).
* :class:`MergeStage`: a destination map (:class:`~ragged_vit.core.selection.MergeSelection`, ToMe); the repack
  writes each merged row as the size-weighted average of its sources, the rows' sizes and ``log(size)`` for the
  attention after it (:mod:`ragged_vit.triton_impl.merging`; :mod:`ragged_vit.reference.merging`).

A repack writes into a :class:`Target`: its buffer's rows, the bound on an image's rows, the padding images over
the rows no image owns. Who sizes the target is the executor's repack strategy
(:mod:`ragged_vit.pipelines.executor`): exact (the host knows the count, or reads it: :class:`HostCounts`), bounded
by the plan (eager, no read), or a captured capacity (the graph runner).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from timm.models.vision_transformer import VisionTransformer

from ..core.segments import seqlens
from ..core.selection import Decision, DecisionInput, MergeSelection, Placement, Pruner, TokenSelection
from ..reference import merging as ref_merging
from ..reference import packing as ref_packing
from ..reference import rotary as ref_rotary
from ..triton_impl import merging as triton_merging
from ..triton_impl import pack as triton_pack
from .eva import RotaryRows
from .heads import MERGE_POOLS, pool_of
from .parts import Parts
from .state import ForwardState

MERGE_NORM_MAX_ROWS = 1024
"""The merge kernel also writes ``norm2`` of the merged rows (whole rows a program) for merges of at most this many
input rows; larger buffers leave it to the MLP's LayerNorm (``docs/tome.md``, the merge's fusions)."""

_POLLS_PER_QUERY = 64
"""Reads of a pinned row between two queries of the stream (:meth:`HostCounts.read`): a read costs the host well
under a microsecond, a query a driver call."""


@dataclass(frozen=True)
class Target:
    """Where a repack writes.

    Attributes:
        capacity: rows of the new buffer (the real images' rows first; the rest form the padding images).
        max_seqlen: a bound on an image's rows in it, padding images included.
        pads: padding images after the ``B`` real ones (at most ``max_seqlen`` rows each).
        count: every image's rows, when the host knows them (then ``capacity == B * count`` and no padding).
        cu_out: int32 ``[B + 1 + pads]`` to write the offsets into (a graph runner's static row); None: a new tensor.
        reference: repack with the pure-PyTorch reference (exact sizes, read on the host: the CPU's eager forward).
    """

    capacity: int
    max_seqlen: int
    pads: int = 0
    count: int | None = None
    cu_out: torch.Tensor | None = None
    reference: bool = False


class HostCounts:
    """Rows of int32 the host reads back after a variable-count stage: the kept total and the longest image.

    On a GPU the rows live in pinned host memory, a kernel writes a stage's two integers straight into its row
    (:func:`ragged_vit.triton_impl.pack.total_and_longest`, or the merge kernel itself) and the host polls the row,
    so it neither waits for the rest of the stream nor copies. Each row is -1 until written.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.device = device
        self.rows = torch.full((rows, 4), -1, dtype=torch.int32, pin_memory=pinned)  # 16-byte rows: aligned
        self._view = self.rows.numpy()  # the same memory: no torch op per poll

    def clear(self) -> None:
        """Marks every row unwritten (on the host)."""
        self.rows.fill_(-1)

    def request(self, row: int, kept: torch.Tensor) -> None:
        """Launches the kernel that writes ``kept.sum()`` and ``kept.max()`` into ``row``."""
        triton_pack.total_and_longest_unchecked(kept, self.rows[row])

    def read(self, row: int) -> tuple[int, int]:
        """``row``'s total and longest image, as soon as its kernel has run. Every ``_POLLS_PER_QUERY`` reads it asks
        the stream whether it is done (a driver call), and raises if it is and the row was never written (no
        hang)."""
        values = self._view[row]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        while True:
            for _ in range(_POLLS_PER_QUERY):
                total, longest = int(values[0]), int(values[1])
                if total >= 0 and longest >= 0:
                    return total, longest
            done = stream is None or stream.query()
            total, longest = int(values[0]), int(values[1])  # read after the query: a finished stream's writes show
            if total >= 0 and longest >= 0:
                return total, longest
            if done:
                raise RuntimeError(f"row {row}'s kept total was never written by its kernel (internal error)")

    def total_and_longest(self, kept: torch.Tensor) -> tuple[int, int]:
        """``kept``'s total and longest image, read now (row 0): the wait of an exact repack of a variable count."""
        if not kept.is_cuda:
            return ref_packing.total_and_longest(kept)
        self.rows[0].fill_(-1)
        self.request(0, kept)
        return self.read(0)


_HOST_COUNTS = threading.local()  # one pinned row per thread and device: an exact repack's read (HostCounts)


def host_counts(device: torch.device) -> HostCounts:
    """This thread's :class:`HostCounts` of one row on ``device`` (an eager forward's reads, one at a time)."""
    cache = _HOST_COUNTS.__dict__.setdefault("by_device", {})
    counts = cache.get(device)
    if counts is None:
        counts = cache[device] = HostCounts(1, device)
    return counts


class Stage:
    """One stage of the plan: where it decides (``index``, ``block``, ``placement``) and how.

    Subclasses implement :meth:`repack`, :meth:`check_replayed` and :meth:`handover`; the decision and the exact
    target are common."""

    selection_type: type = TokenSelection  # what its decision returns (and a replayed one must be)
    commutes_with_mlp = True  # its repack may follow the MLP half after it (the MLP acts per row)
    fuses_attention = False  # its repack takes the residual add of the attention half before it
    decides_from_keys = False  # its decision reads only its block's qkv: it may run beside the attention core

    def __init__(self, index: int, block: int, placement: Placement, pruner: Pruner, model: VisionTransformer) -> None:
        self.index, self.block, self.placement, self.pruner = index, block, placement, pruner
        self.mid = placement is Placement.MID_BLOCK  # only a mid-block stage has its own block's qkv
        attn = self.attn = model.blocks[block].attn
        self.num_heads, self.scale = (attn.num_heads, attn.scale) if self.mid else (None, None)
        self.num_prefix = model.num_prefix_tokens
        # A RoPE model's decision by attention scores the rotated keys its block attends with.
        self.rotates = self.mid and pruner.needs_attention and getattr(model, "rope", None) is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index}, block={self.block}, {self.placement.value})"

    def check_backend(self, backend) -> None:
        """Raises ``ValueError`` if this kind of stage needs what ``backend`` lacks."""

    def decision_input(self, state: ForwardState) -> DecisionInput:
        """What this stage decides on, from the state its DECIDE step finds (also for timing a decision alone): a
        RoPE model's rotation goes with the block's qkv, for the decision to apply as it reads it."""
        return DecisionInput(
            x=state.x, cu_seqlens=state.cu_seqlens, stage=self.index, num_patches=state.num_patches,
            max_seqlen=state.max_seqlen, qkv=state.qkv if self.mid else None, num_heads=self.num_heads,
            scale=self.scale, num_prefix=self.num_prefix,
            image_patches=_images_of(state.image_patches, state.cu_seqlens),
            rotary=state.rotary.of(self.attn) if self.rotates else None,
        )  # fmt: skip

    def decide(self, state: ForwardState, parts: Parts) -> Decision:
        """This stage's decision on ``state`` (the fused one where registered: :func:`ragged_vit.pipelines.parts.
        decide`)."""
        return parts.decide(self.pruner, self.decision_input(state))

    def exact_target(self, state: ForwardState, counts: HostCounts, reference: bool = False) -> Target:
        """The buffer that holds exactly the kept rows: from the decision's host count, else read (one wait)."""
        sel = state.selection
        extra = int(getattr(sel, "extra_token", None) is not None)
        if reference:
            return Target(0, 0, reference=True)  # the reference reads its own sizes
        if sel.fixed_count and sel.count is not None:
            return Target(state.batch * sel.count, sel.count, count=sel.count)
        total, longest = counts.total_and_longest(sel.kept)
        return Target(total + state.batch * extra, longest + extra)

    def repack(self, state: ForwardState, target: Target) -> None:  # pragma: no cover - abstract
        """Applies ``state.selection`` to the packed buffer, into ``target``."""
        raise NotImplementedError

    def check_replayed(self, sel: Decision, state: ForwardState) -> None:  # pragma: no cover - abstract
        """Raises ``ValueError`` unless a replayed decision fits ``state``'s rows."""
        raise NotImplementedError

    def handover(
        self, batch: int, rows: int, width: int, dtype: torch.dtype, device: torch.device, rotary: RotaryRows | None
    ) -> Handover:
        """The static buffers in which a graph leaves this kind of stage's decision for the next graph (``rotary``: a
        RoPE model's static table and unpruned positions, whose rows' positions go with the decision; None without)."""
        raise NotImplementedError  # pragma: no cover - abstract


def _images_of(patches: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """Each image's patches for the images of ``cu_seqlens`` (a graph runner's static counts hold more: the most
    padding images any of its buffers has)."""
    images = cu_seqlens.shape[0] - 1
    return patches if patches is None or patches.shape[0] == images else patches[:images]


class Handover:
    """Static buffers that hold a stage's decision from one CUDA graph to the next, two sides (a graph reads one and
    writes the other, so a warm-up run never overwrites its own input)."""

    def store(self, state: ForwardState, side: int, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Writes ``state``'s decision to ``side``; first, with ``stats = (kept, row)``, the kept total and longest
        image to the pinned ``row``."""
        raise NotImplementedError  # pragma: no cover - abstract

    def resume(self, side: int, batch: int, rows: int, cu: torch.Tensor, num_patches: int, bound: int) -> ForwardState:
        """The state a graph starts from: ``side``'s decision, over the previous buffer's ``rows`` (``cu``, at most
        ``bound`` rows an image)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (for the memory report)."""
        raise NotImplementedError  # pragma: no cover - abstract


class PruneStage(Stage):
    """A stage that keeps some rows of each image (and may append one token per image: EViT's fused token)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # An appended token is made from the rows before the MLP and must go through it.
        self.commutes_with_mlp = not self.pruner.appends_token

    def check_replayed(self, sel: Decision, state: ForwardState) -> None:
        x, keep, kept = state.x, sel.keep, sel.kept
        if keep.dim() != 1 or keep.shape[0] != x.shape[0] or keep.device != x.device or kept.shape != (state.batch,):
            raise ValueError(
                f"selections[{self.index}].keep must be a [{x.shape[0]}] mask and .kept [{state.batch}] counts on "
                f"{x.device} (this batch's packed rows), got {tuple(keep.shape)} and {tuple(kept.shape)} on "
                f"{keep.device}: replay selections only on the images they were made for"
            )

    def repack(self, state: ForwardState, target: Target) -> None:
        sel, x, rotary = state.selection, state.x, state.rotary
        extra = None if sel.extra_token is None else sel.extra_token.to(x.dtype)
        if target.reference:
            if rotary is not None:  # the kept rows' positions; an appended token is unrotated
                state.rotary = rotary.moved(
                    ref_rotary.repack_positions(rotary.positions, state.cu_seqlens, sel.keep, extra is not None)
                )
            state.x, state.cu_seqlens, state.max_seqlen = ref_packing.repack(
                x, state.cu_seqlens, sel.keep, extra, self.num_prefix
            )
        else:
            if extra is not None and target.count is None and target.pads:
                raise NotImplementedError(
                    f"pruner {self.pruner.name!r} appends an extra token at a variable-count stage, which a buffer "
                    "with padding images does not hold"
                )
            fixed = target.count is not None
            moved = None
            if rotary is not None:  # the kept rows' positions, copied by the same kernel
                rows = state.batch * target.count if fixed else target.capacity
                moved = torch.empty(rows, dtype=torch.int32, device=x.device)
            state.x, state.cu_seqlens, _ = triton_pack.repack_unchecked(
                x, state.cu_seqlens, sel.keep, state.max_seqlen, count=target.count,
                capacity=None if fixed else target.capacity, extra_token=extra, kept=sel.kept,
                padding_images=target.pads, padding_len=target.max_seqlen if target.pads else None,
                cu_out=target.cu_out, batch=state.batch, positions=None if rotary is None else rotary.positions,
                positions_out=moved,
            )  # fmt: skip  # rows from the real total on are not written
            state.max_seqlen = target.max_seqlen
            if rotary is not None:
                state.rotary = rotary.moved(moved)
        state.selection = state.qkv = None

    def handover(
        self, batch: int, rows: int, width: int, dtype: torch.dtype, device: torch.device, rotary: RotaryRows | None
    ) -> Handover:
        return _PruneHandover(batch, rows, width, dtype, device, rotary)


class _PruneHandover(Handover):
    """The residual stream (NaN until written), the keep mask, the kept counts and, for a RoPE model, the rows' rope
    positions (-1 until written), resumed with the static table of ``rotary``."""

    def __init__(
        self, batch: int, rows: int, width: int, dtype: torch.dtype, device: torch.device, rotary: RotaryRows | None
    ) -> None:
        self.x = tuple(torch.full((rows, width), float("nan"), dtype=dtype, device=device) for _ in range(2))
        self.keep = tuple(torch.zeros(rows, dtype=torch.bool, device=device) for _ in range(2))
        self.kept = tuple(torch.zeros(batch, dtype=torch.int32, device=device) for _ in range(2))
        self.rotary = rotary
        self.positions = () if rotary is None else tuple(
            torch.full((rows,), -1, dtype=torch.int32, device=device) for _ in range(2)
        )  # fmt: skip

    def store(self, state: ForwardState, side: int, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        sel, rows = state.selection, state.x.shape[0]
        if sel.extra_token is not None:
            raise NotImplementedError("a variable-count stage that appends an extra token is not staged between graphs")
        if stats is not None:
            triton_pack.total_and_longest_unchecked(*stats)
        self.x[side][:rows].copy_(state.x)
        self.kept[side].copy_(sel.kept[: state.batch])
        self.keep[side][:rows].copy_(sel.keep)
        if self.positions:
            self.positions[side][:rows].copy_(state.rotary.positions)

    def resume(self, side: int, batch: int, rows: int, cu: torch.Tensor, num_patches: int, bound: int) -> ForwardState:
        selection = TokenSelection(self.keep[side], self.kept[side])
        rotary = self.rotary.moved(self.positions[side]) if self.positions else None
        return ForwardState(batch, self.x[side], cu, bound, num_patches, selection=selection, rotary=rotary)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.x, *self.keep, *self.kept, *self.positions]


class MergeStage(Stage):
    """A stage that merges rows (ToMe): size-weighted averages, the rows' sizes carried, ``log(size)`` as the key
    bias of the attention after it. Its decision reads its block's keys alone; a merge averages rows, so it does not
    commute with the MLP."""

    selection_type = MergeSelection
    commutes_with_mlp = False
    fuses_attention = True  # where the Triton merge kernel runs: the program says (its ``fuse_merge``)
    decides_from_keys = True

    def check_backend(self, backend) -> None:
        if not backend.capabilities.key_bias:
            raise ValueError(
                f"backend {backend.name!r} takes no key_bias, which merging (pruner {self.pruner.name!r}: "
                "proportional attention, log(size) per key) needs: use 'triton', 'reference' or 'padded_sdpa'"
            )

    def check_replayed(self, sel: Decision, state: ForwardState) -> None:
        x, dest, kept = state.x, sel.destination, sel.kept
        if dest.shape != (x.shape[0],) or dest.device != x.device or kept.shape != (state.batch,):
            raise ValueError(
                f"selections[{self.index}].destination must be a [{x.shape[0]}] map and .kept [{state.batch}] counts "
                f"on {x.device} (this batch's packed rows), got {tuple(dest.shape)} and {tuple(kept.shape)} on "
                f"{dest.device}: replay selections only on the images they were made for"
            )
        lists = (sel.sources, sel.source_offsets)
        if any(t is not None for t in lists) and not all(
            t is not None and t.shape == (x.shape[0] + i,) and t.dtype == torch.int32 and t.device == x.device
            and t.is_contiguous()
            for i, t in enumerate(lists)
        ):  # fmt: skip
            raise ValueError(
                f"selections[{self.index}].sources and .source_offsets must both be None or contiguous int32 "
                f"[{x.shape[0]}] and [{x.shape[0] + 1}] on {x.device} (the decision's source lists)"
            )

    def repack(self, state: ForwardState, target: Target) -> None:
        sel, x, batch = state.selection, state.x, state.batch
        if sel is None:  # merged already, by the graph before (its handover): this buffer's offsets only
            triton_merging.merged_offsets_unchecked(
                state.cu_seqlens, target.cu_out, target.capacity, target.pads, target.max_seqlen
            )
            state.cu_seqlens, state.max_seqlen = target.cu_out, target.max_seqlen
            return
        sizes = state.row_sizes()
        if target.reference:
            rows = int(sel.cu_seqlens[-1])
            merged = ref_merging.merge_rows(x, sizes, sel.destination.long(), rows).to(x.dtype)
            new_sizes = sizes.new_zeros(rows).index_add_(0, sel.destination.long(), sizes)
            state.x, state.cu_seqlens, state.sizes = merged, sel.cu_seqlens, new_sizes
            state.max_seqlen = int(seqlens(sel.cu_seqlens).max())
            state.key_bias = new_sizes.double().log().float()  # rounded once, as the reference
        else:
            capacity = target.capacity
            cu_out = target.cu_out
            if cu_out is None and target.pads:
                cu_out = torch.empty(batch + 1 + target.pads, dtype=torch.int32, device=x.device)
            merged_cu = sel.cu_seqlens if sel.cu_seqlens.shape[0] == batch + 1 else sel.cu_seqlens[: batch + 1]
            state.key_bias = torch.empty(capacity, dtype=torch.float32, device=x.device)  # the kernel writes it
            state.x, state.sizes = triton_merging.merge_rows_unchecked(
                x, sizes, *merge_sources_of(sel), merged_cu, x.new_empty((capacity, x.shape[1])),
                sizes.new_empty(capacity), state.key_bias, cu_out=cu_out, padding_images=target.pads,
                padding_len=target.max_seqlen, **merge_fusion(state, capacity),
            )  # fmt: skip  # rows from the real total on are not written (the padding images': theirs only)
            state.cu_seqlens = merged_cu if cu_out is None else cu_out
            state.max_seqlen = target.max_seqlen
        state.selection = state.qkv = None

    def handover(
        self, batch: int, rows: int, width: int, dtype: torch.dtype, device: torch.device, rotary: RotaryRows | None
    ) -> Handover:
        return _MergeHandover(batch, rows, width, dtype, device)  # (no rotary: merging refuses RoPE models)


class _MergeHandover(Handover):
    """The merged rows, their sizes, ``log(size)`` and offsets: the merge runs before the graph ends, straight into
    these buffers, so nothing is copied; the next graph reads the first ``capacity`` rows."""

    def __init__(self, batch: int, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.x = tuple(torch.full((rows, width), float("nan"), dtype=dtype, device=device) for _ in range(2))
        self.cu = tuple(torch.zeros(batch + 1, dtype=torch.int32, device=device) for _ in range(2))
        self.sizes = tuple(torch.ones(rows, dtype=torch.int32, device=device) for _ in range(2))
        self.key_bias = tuple(torch.zeros(rows, dtype=torch.float32, device=device) for _ in range(2))

    def store(self, state: ForwardState, side: int, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        sel, batch = state.selection, state.batch
        triton_merging.merge_rows_unchecked(
            state.x, state.row_sizes(), *merge_sources_of(sel), sel.cu_seqlens[: batch + 1], self.x[side],
            self.sizes[side], self.key_bias[side], cu_out=self.cu[side], total_and_longest=stats,
            **merge_fusion(state, None),  # the residual add; the next graph's MLP normalises its rows itself
        )  # fmt: skip  # rows from the merged total on keep what they held (the next graph's padding rows)

    def resume(self, side: int, batch: int, rows: int, cu: torch.Tensor, num_patches: int, bound: int) -> ForwardState:
        return ForwardState(
            batch, self.x[side][:rows], self.cu[side], bound, num_patches, sizes=self.sizes[side][:rows],
            key_bias=self.key_bias[side][:rows],
        )  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [*self.x, *self.cu, *self.sizes, *self.key_bias]


def make_stages(pruner: Pruner | None, model: VisionTransformer) -> tuple[Stage, ...]:
    """The stage objects of ``pruner``'s schedule on ``model`` (the same at every image size); raises ``ValueError``
    where the model's pooling does not suit the kind of stage."""
    if pruner is None:
        return ()
    placement = Placement(pruner.placement)
    if pruner.merges and getattr(model, "rope", None) is not None:
        raise NotImplementedError(
            f"pruner {pruner.name!r} merges rows, and the model has rotary position embeddings "
            f"({type(model.rope).__name__}): a merged row stands for several patch positions, which RoPE cannot "
            "rotate as one; use a pruner that keeps rows (threshold_l2, dynamicvit, evit, ats)"
        )
    if not pruner.merges:
        return tuple(PruneStage(i, block, placement, pruner, model) for i, block in enumerate(pruner.blocks))
    if pool_of(model) not in MERGE_POOLS:
        raise ValueError(
            f"pruner {pruner.name!r} merges rows, and the model pools with {pool_of(model)!r}: merging supports "
            f"{' and '.join(map(repr, MERGE_POOLS))} pooling (the average weighted by the patches each row holds)"
        )
    return tuple(MergeStage(i, block, placement, pruner, model) for i, block in enumerate(pruner.blocks))


def merge_fusion(state: ForwardState, rows: int | None) -> dict[str, object]:
    """The Triton merge kernel's fused arguments for ``state.fusion`` (taken), if any: its branch as ``residual``
    and, with ``rows`` (the merged buffer's; None: the MLP normalises itself) and at most
    :data:`MERGE_NORM_MAX_ROWS` input rows, the block's ``norm2`` into a new ``[rows, C]`` buffer, which
    ``state.normed`` holds for the MLP step."""
    fusion = state.take_fusion()
    if fusion is None:
        return {}
    fused: dict[str, object] = {"residual": fusion.branch}
    if rows is not None and state.x.shape[0] <= MERGE_NORM_MAX_ROWS:
        norm, state.normed = fusion.norm, state.x.new_empty((rows, state.x.shape[1]))
        fused.update(normed=state.normed, norm_weight=norm.weight, norm_bias=norm.bias, norm_eps=norm.eps)
    return fused


def merge_sources_of(sel: MergeSelection) -> tuple[torch.Tensor, torch.Tensor]:
    """A merge decision's source lists: the ones its decision wrote, else derived from its map (a selection built
    by hand)."""
    if sel.sources is not None and sel.source_offsets is not None:
        return sel.sources, sel.source_offsets
    return ref_merging.merge_sources(sel.destination)
