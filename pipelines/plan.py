"""The forward plan of a pruned ViT: built once from the model's depth, its token count and the pruner; read by
both executors (:class:`ragged_vit.pipelines.model.PrunedViT`, eager, and
:class:`ragged_vit.pipelines.graphs.GraphedPrunedViT`, CUDA graphs). Pure host logic, no tensors.

A forward is a list of :class:`Step` s::

    FRONT   patch embedding, then timm's own blocks before the first stage on the dense [B, N, C] batch
    BLOCKS  consecutive whole blocks on the packed buffer [T, C] (one compiled region with compile_blocks)
    ATTENTION / MLP   the two halves of a block, where a stage sits between them (MID_BLOCK)
    DECIDE  a stage decides which rows survive (pruner, or its fused kernel), or which merge (ToMe)
    REPACK  the decision applied to the packed buffer (a merge: size-weighted averages, the rows' sizes carried)
    HEAD    the final norm, each image's pooled rows (its class row, or a pool of its kept rows), the classifier

For each stage the plan also records what the host knows of its counts (:class:`Counts`: fixed, bounded by the
pruner, or variable), the bound on an image's rows before and after it, and whether the MLP half that follows its
repack may run beside its decision (the MLP acts per row, so it commutes with the repack: ``mlp_beside``).

**Host reads.** A variable-count stage decides on the device how many rows survive; an executor that needs the
exact total (to size a buffer) reads it between DECIDE and REPACK. :attr:`ForwardPlan.segments` cuts the steps at
those points: one segment when every count is known on the host (the whole forward is one CUDA graph), else one cut
before every stage's REPACK, so that segment ``j`` starts with stage ``j - 1``'s repack and ends with stage ``j``'s
decision (the last ends with the head). The graph executor may still chain segments without reading
(:class:`ragged_vit.pipelines.buckets.TokenBuckets`, ``sync_free_rows``); it never re-derives the cuts.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from ragged_vit.core.selection import Placement, Pruner
from ragged_vit.core.validation import check_int


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


@dataclass(frozen=True)
class Step:
    """One step: ``blocks`` are the timm block indices it runs (FRONT, BLOCKS: a run; ATTENTION, MLP: one),
    ``stage`` the stage it serves (DECIDE, REPACK)."""

    kind: StepKind
    blocks: tuple[int, ...] = ()
    stage: int | None = None

    def __repr__(self) -> str:
        what = f"stage={self.stage}" if self.stage is not None else f"blocks={self.blocks}"
        return f"Step({self.kind.value}, {what})"


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

    @functools.cached_property  # the executors read it on every call: computed once
    def segments(self) -> tuple[tuple[Step, ...], ...]:
        """The steps cut where a host read may happen: the whole forward when :attr:`fixed`, else before every
        stage's REPACK (``len(stages) + 1`` segments)."""
        if self.fixed:
            return (self.steps,)
        out: list[list[Step]] = [[]]
        for step in self.steps:
            if step.kind is StepKind.REPACK:
                out.append([])
            out[-1].append(step)
        return tuple(tuple(segment) for segment in out)

    @functools.cached_property
    def row_bounds(self) -> tuple[int, ...]:
        """The most rows an image can have in each segment of :attr:`segments` (a variable plan: ``N``, then each
        stage's ``rows_after``); ``(N,)`` for a fixed plan."""
        if self.fixed:
            return (self.tokens,)
        return (self.tokens, *(stage.rows_after for stage in self.stages))

    def stage_at(self, step: Step) -> StagePlan:
        """The stage a DECIDE or REPACK step serves."""
        if step.stage is None:
            raise ValueError(f"{step!r} serves no stage")
        return self.stages[step.stage]


# Positions count half blocks: 2k is the input of block k, 2k + 1 the point between its attention and MLP halves.
_OFFSET = {Placement.BEFORE_BLOCK: 0, Placement.MID_BLOCK: 1, Placement.AFTER_BLOCK: 2}


def build_plan(pruner: Pruner | None, depth: int, tokens: int, num_prefix: int = 1) -> ForwardPlan:
    """The plan of a forward of a ``depth``-block model on images of ``tokens`` rows, the first ``num_prefix`` of
    them prefix rows, with ``pruner`` (its ``blocks``, ``placement``, ``fixed_count``, ``count_after`` and
    ``max_count_after``; None: unpruned)."""
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
        # A merge averages rows, and an appended token (EViT's fused one) is made from the rows before the MLP and
        # must go through it: neither commutes with the MLP.
        commutes = not pruner.merges and not pruner.appends_token
        mlp_beside = block if placement is Placement.MID_BLOCK and commutes else None
        stages.append(StagePlan(index, block, placement, counts, rows, num_prefix + patches, mlp_beside))
        rows, position = num_prefix + patches, point
    steps += [*_halves(position, 2 * depth), Step(StepKind.HEAD)]
    return ForwardPlan(depth, tokens, num_prefix, dense, tuple(stages), tuple(steps))


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
