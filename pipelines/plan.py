"""The forward plan of a pruned ViT, and the program each way of running it executes. Pure host logic, no tensors.

:func:`build_plan` reads the model's depth, its token count and the pruner once per image size. A forward is a list
of :class:`Step` s::

    FRONT   patch embedding, then timm's own blocks before the first stage on the dense [B, N, C] batch
    BLOCKS  consecutive whole blocks on the packed buffer [T, C] (one compiled region with compiled parts)
    ATTENTION / MLP   the two halves of a block, where a stage sits between them (MID_BLOCK)
    DECIDE  a stage decides which rows survive (pruner, or its fused kernel), or which merge (ToMe)
    REPACK  the decision applied to the packed buffer (a merge: size-weighted averages, the rows' sizes carried)
    HEAD    the final norm, each image's pooled rows (its class row, or a pool of its kept rows), the classifier

For each stage the plan also records what the host knows of its counts (:class:`Counts`: fixed, bounded by the
pruner, or variable), the bound on an image's rows before and after it, and whether the MLP half that follows its
repack may run beside its decision (the MLP acts per row, so it commutes with the repack: ``mlp_beside``).

**The program.** :meth:`ForwardPlan.program` turns the plan's steps into the final list one executor loop runs
(:func:`ragged_vit.pipelines.executor.execute`) for one batch size and one way of running (eager, or captured in
CUDA graphs), fused steps included: an MLP step that also computes the next block's qkv (``prepare``), an attention
half that leaves its residual add to the merge after it (``branch``), and, in CUDA graphs, work that runs on a second
stream beside other work (``beside``): a mid-block decision beside its block's MLP half, in small buffers
(:data:`MLP_OVERLAP_MAX_ROWS`); a merge's decision beside its block's attention core, in small batches
(:data:`OVERLAP_MAX_IMAGES`). In forwards of at most ``fused_block_rows`` rows (``B x N``; the pipeline passes
:data:`ragged_vit.triton_impl.configs.FUSED_BLOCK_MAX_ROWS` where every packed block has the form), the packed
blocks and halves take the fused-linear form (``linear``: four fused linears and the attention a block, the
LayerNorm statistics handed from one to the next). A new fused step is a new step here and its function in the
executor.

**Host reads.** A variable-count stage decides on the device how many rows survive; an executor that needs the
exact total (to size a buffer) reads it between DECIDE and REPACK. :attr:`Program.segments` cuts the steps at
those points: one segment when every count is known on the host (the whole forward is one CUDA graph), else one cut
before every stage's REPACK, so that segment ``j`` starts with stage ``j - 1``'s repack and ends with stage ``j``'s
decision (the last ends with the head). The graph executor may still chain segments without reading
(:class:`ragged_vit.pipelines.buckets.TokenBuckets`, ``sync_free_rows``); it never re-derives the cuts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

from ..core.selection import Placement, Pruner
from ..core.validation import check_int


class StepKind(str, enum.Enum):
    """What one step of a forward does (see the module docstring)."""

    FRONT = "front"
    BLOCKS = "blocks"
    ATTENTION = "attention"
    MLP = "mlp"
    DECIDE = "decide"
    REPACK = "repack"
    HEAD = "head"


class Counts(str, enum.Enum):
    """What the host knows of the rows an image keeps after a stage."""

    FIXED = "fixed"  # the count itself (DynamicViT, EViT, Threshold-L2 ratio)
    BOUNDED = "bounded"  # a bound below an unpruned image's rows (ATS: its sample count)
    VARIABLE = "variable"  # no bound below an unpruned image's rows (Threshold-L2 threshold / calibrated)


MLP_OVERLAP_MAX_ROWS = 256
"""In CUDA graphs of a fixed-count forward, a mid-block stage decides beside its block's MLP half (which then runs on
every row, before the repack) in buffers of at most this many rows: two 128-row GEMM tiles, where the MLP on every
row costs what it costs on the kept ones and the decision hides behind it (``docs/graphs.md``)."""

OVERLAP_MAX_IMAGES = 8
"""In a CUDA graph of a whole forward, batches of at most this many images run a merging stage's decision beside its
block's attention core: up to there the two leave room for each other on the GPU; past it the attention's programs
fill the GPU and the decision only delays them (``docs/tome.md``)."""


@dataclass(frozen=True)
class Step:
    """One step: ``blocks`` are the timm block indices it runs (FRONT, BLOCKS: a run; ATTENTION, MLP: one),
    ``stage`` the stage it serves (DECIDE, REPACK; an ATTENTION step with ``beside``: the stage it decides).

    The fused forms (only in a :class:`Program`):
        beside: ATTENTION: stage ``stage``'s decision runs beside the attention core (the DECIDE step is gone);
            DECIDE: the block's MLP half runs beside the decision, on every row (the MLP step after the REPACK is
            gone). On a second stream while a CUDA graph is captured, else one after the other.
        prepare: MLP: also ``norm1`` and the qkv projection of the block of the ATTENTION step after it.
        branch: ATTENTION: the merge after it makes the residual add (and ``norm2``), where the block is plain.
        linear: BLOCKS, ATTENTION, MLP: the fused-linear form (:func:`ragged_vit.pipelines.packed_block.fused_blocks`);
            not with ``beside`` or ``branch`` (the decision's and the merge's own fusions), nor with ``prepare``
            (the statistics its last linear writes serve the next ``norm1``).
    """

    kind: StepKind
    blocks: tuple[int, ...] = ()
    stage: int | None = None
    beside: bool = False
    prepare: bool = False
    branch: bool = False
    linear: bool = False

    def __repr__(self) -> str:
        what = f"stage={self.stage}" if self.stage is not None and self.kind is not StepKind.ATTENTION else ""
        what = what or f"blocks={self.blocks}"
        fused = [name for name in ("beside", "prepare", "branch", "linear") if getattr(self, name)]
        return f"Step({self.kind.value}, {what}{''.join(', ' + f for f in fused)})"


@dataclass(frozen=True)
class Program:
    """The final steps of one way of running a plan (:meth:`ForwardPlan.program`).

    Attributes:
        steps: every step, fused ones included, in forward order.
        segments: the steps cut where a host read may happen: the whole forward for a fixed plan, else before every
            REPACK (``len(stages) + 1`` segments).
    """

    steps: tuple[Step, ...]
    segments: tuple[tuple[Step, ...], ...]


@dataclass(frozen=True)
class StagePlan:
    """One pruning stage as the host knows it.

    Attributes:
        index: the stage's position in ``pruner.blocks`` (``DecisionInput.stage``).
        block: the timm block it belongs to.
        placement: before the block, between its halves, or after it.
        counts: what the host knows of the rows kept (:class:`Counts`).
        rows_before: the most rows (prefix rows included) an image can have when the stage decides.
        rows_after: the rows an image has after it when ``counts`` is FIXED; otherwise the most it can have.
        mlp_beside: for a MID_BLOCK pruning stage, the block whose MLP half follows the repack and may run beside the
            decision, on every row (before the repack); None otherwise (a merge averages rows, and a pruner that
            appends a token makes it from the rows before the MLP: neither commutes with the MLP).
    """

    index: int
    block: int
    placement: Placement
    counts: Counts
    rows_before: int
    rows_after: int
    mlp_beside: int | None


@dataclass(frozen=True)
class ForwardPlan:
    """The steps of a pruned forward and its stages (see the module docstring).

    Attributes:
        depth: transformer blocks of the model.
        tokens: rows of an unpruned image, prefix rows included (``N``; 197 for DeiT at 224x224 with 16x16 patches).
        num_prefix: prefix rows of every image (class, distillation, register tokens), always kept.
        dense_blocks: blocks the FRONT step runs densely (all of them without a pruner).
        stages: one :class:`StagePlan` per stage, in forward order.
        steps: every step, in forward order.
    """

    depth: int
    tokens: int
    num_prefix: int
    dense_blocks: int
    stages: tuple[StagePlan, ...]
    steps: tuple[Step, ...]

    @functools.cached_property
    def fixed(self) -> bool:
        """Whether every count is known on the host: the forward has host-known shapes throughout."""
        return all(stage.counts is Counts.FIXED for stage in self.stages)

    @functools.cached_property
    def segments(self) -> tuple[tuple[Step, ...], ...]:
        """The plan's steps cut where a host read may happen (as :attr:`Program.segments`)."""
        return _segments(self.steps, self.fixed)

    @functools.cached_property
    def row_bounds(self) -> tuple[int, ...]:
        """The most rows an image can have in each segment of :attr:`segments` (a variable plan: ``N``, then each
        stage's ``rows_after``); ``(N,)`` for a fixed plan."""
        if self.fixed:
            return (self.tokens,)
        return (self.tokens, *(stage.rows_after for stage in self.stages))

    def program(
        self,
        batch: int,
        *,
        graphs: bool = False,
        fuse_merge: bool = False,
        decide_beside_attention: bool = False,
        overlap_rows: int = 0,
        fused_block_rows: int = 0,
    ) -> Program:
        """The program of a forward of ``batch`` images (see the module docstring).

        Args:
            batch: images per forward (the overlaps depend on the buffers' sizes).
            graphs: the forward is captured in CUDA graphs, where work beside other work runs on a second stream
                (eager, the same steps would only run one after the other: no ``beside``).
            fuse_merge: the stages' repacks take the residual add of the attention half before them (``branch``).
            decide_beside_attention: the stages decide from their block's qkv alone, so a whole-forward graph of at
                most :data:`OVERLAP_MAX_IMAGES` images decides beside the attention core.
            overlap_rows: with ``graphs``, a mid-block stage with ``mlp_beside`` decides beside that MLP half when
                its input has at most this many rows (``batch * rows_before``).
            fused_block_rows: the packed blocks take the fused-linear form (``linear``) when the forward has at most
                this many rows (``batch * tokens``); 0: never.
        """
        return _program(self, check_int(batch, "batch", 1), bool(graphs), bool(fuse_merge),
                        bool(decide_beside_attention), check_int(overlap_rows, "overlap_rows", 0),
                        check_int(fused_block_rows, "fused_block_rows", 0))  # fmt: skip

    def stage_at(self, step: Step) -> StagePlan:
        """The stage a DECIDE or REPACK step serves."""
        if step.stage is None:
            raise ValueError(f"{step!r} serves no stage")
        return self.stages[step.stage]


# Positions count half blocks: 2k is the input of block k, 2k + 1 the point between its attention and MLP halves.
_OFFSET = {Placement.BEFORE_BLOCK: 0, Placement.MID_BLOCK: 1, Placement.AFTER_BLOCK: 2}


def build_plan(
    pruner: Pruner | None, depth: int, tokens: int, num_prefix: int = 1, *, mlp_commutes: bool = True
) -> ForwardPlan:
    """The plan of a forward of a ``depth``-block model on images of ``tokens`` rows, the first ``num_prefix`` of
    them prefix rows, with ``pruner`` (its ``blocks``, ``placement``, ``fixed_count``, ``count_after`` and
    ``max_count_after``; None: unpruned). ``mlp_commutes``: the stages' repacks commute with the MLP half after them
    (their stage objects say: :attr:`ragged_vit.pipelines.stages.Stage.commutes_with_mlp`)."""
    check_int(depth, "depth", 1)
    check_int(num_prefix, "num_prefix", 0)
    check_int(tokens, "tokens", num_prefix + 1)
    if pruner is None:
        steps = (Step(StepKind.FRONT, tuple(range(depth))), Step(StepKind.HEAD))
        return ForwardPlan(depth, tokens, num_prefix, depth, (), steps)
    placement = Placement(pruner.placement)
    points = [2 * b + _OFFSET[placement] for b in pruner.blocks]
    dense = points[0] // 2
    steps = [Step(StepKind.FRONT, tuple(range(dense)))]
    stages, rows, position = [], tokens, 2 * dense
    for index, (block, point) in enumerate(zip(pruner.blocks, points, strict=True)):
        steps += _halves(position, point)
        steps += [Step(StepKind.DECIDE, stage=index), Step(StepKind.REPACK, stage=index)]
        counts, patches = _counts(pruner, index, rows - num_prefix, tokens - num_prefix)
        mlp_beside = block if placement is Placement.MID_BLOCK and mlp_commutes else None
        stages.append(StagePlan(index, block, placement, counts, rows, num_prefix + patches, mlp_beside))
        rows, position = num_prefix + patches, point
    steps += [*_halves(position, 2 * depth), Step(StepKind.HEAD)]
    return ForwardPlan(depth, tokens, num_prefix, dense, tuple(stages), tuple(steps))


@functools.lru_cache(maxsize=512)
def _program(
    plan: ForwardPlan,
    batch: int,
    graphs: bool,
    fuse_merge: bool,
    beside_attention: bool,
    overlap_rows: int,
    fused_block_rows: int,
) -> Program:
    beside_attention = graphs and beside_attention and plan.fixed and batch <= OVERLAP_MAX_IMAGES
    steps: list[Step] = []
    mlp_done = None  # the block whose MLP half ran beside its stage's decision
    for i, step in enumerate(plan.steps):
        after = plan.steps[i + 1] if i + 1 < len(plan.steps) else None
        if step.kind is StepKind.DECIDE:
            stage = plan.stages[step.stage]
            if beside_attention and stage.placement is Placement.MID_BLOCK:
                continue  # decided beside the attention step before it
            if graphs and stage.mlp_beside is not None and batch * stage.rows_before <= overlap_rows:
                step, mlp_done = dataclasses.replace(step, beside=True), stage.mlp_beside
        elif step.kind is StepKind.MLP and step.blocks[0] == mlp_done:
            mlp_done = None
            continue
        elif step.kind is StepKind.ATTENTION and after is not None and after.kind is StepKind.DECIDE:
            beside = beside_attention
            step = dataclasses.replace(step, stage=after.stage if beside else None, beside=beside, branch=fuse_merge)
        steps.append(step)
    if batch * plan.tokens <= fused_block_rows:  # the fused-linear form, where no other fusion holds the step
        packed = (StepKind.BLOCKS, StepKind.ATTENTION, StepKind.MLP)
        steps = [dataclasses.replace(s, linear=s.kind in packed and not (s.beside or s.branch)) for s in steps]
    for i, step in enumerate(steps[:-1]):  # an unfused MLP half right before an attention half prepares its qkv
        if step.kind is StepKind.MLP and not step.linear and steps[i + 1].kind is StepKind.ATTENTION:
            steps[i] = dataclasses.replace(step, prepare=True)
    return Program(tuple(steps), _segments(tuple(steps), plan.fixed))


def _segments(steps: tuple[Step, ...], fixed: bool) -> tuple[tuple[Step, ...], ...]:
    if fixed:
        return (steps,)
    out: list[list[Step]] = [[]]
    for step in steps:
        if step.kind is StepKind.REPACK:
            out.append([])
        out[-1].append(step)
    return tuple(tuple(segment) for segment in out)


def _counts(pruner: Pruner, stage: int, patches: int, num_patches: int) -> tuple[Counts, int]:
    """What the host knows of a stage's patches after it: the count, or a bound."""
    count = pruner.count_after(stage, patches, num_patches) if pruner.fixed_count else None
    if count is not None:
        return Counts.FIXED, check_int(count, "pruner.count_after()", 0)
    bound = min(patches, check_int(pruner.max_count_after(stage, patches, num_patches), "pruner.max_count_after()", 0))
    return (Counts.BOUNDED if bound < num_patches else Counts.VARIABLE), bound


def _halves(start: int, end: int) -> list[Step]:
    """The packed steps from half-block position ``start`` to ``end``: a leading MLP half, a run of whole blocks,
    a trailing attention half."""
    steps = []
    if start % 2 and start < end:
        steps.append(Step(StepKind.MLP, (start // 2,)))
        start += 1
    whole = tuple(range(start // 2, end // 2))
    if whole:
        steps.append(Step(StepKind.BLOCKS, whole))
    if end % 2 and end > start:
        steps.append(Step(StepKind.ATTENTION, (end // 2,)))
    return steps
