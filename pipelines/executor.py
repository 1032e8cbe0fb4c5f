"""The one executor loop: runs a program's steps (:class:`ragged_vit.pipelines.plan.Program`) on a forward's state.

Eager forwards (:class:`ragged_vit.pipelines.model.PrunedViT`) and CUDA-graph replays
(:class:`ragged_vit.pipelines.graphs.GraphedPrunedViT`) run the same loop, :func:`execute`. They differ only in the
program they run (built once per batch size and way of running: the fused steps) and in how a REPACK sizes its
buffer, a repack strategy chosen with the program:

* :class:`ExactRepack`: the exact kept rows, from the decision's host count or read back (``PrunedViT.run``, which
  returns the decisions; the CPU);
* :class:`BoundedRepack`: a buffer sized by the plan's host bound where that bound saves rows, with padding images
  over the rows no image owns, so the forward does not wait for the device (``PrunedViT.forward``);
* :class:`CapturedRepack`: the capacity the graph runner chose for the segment (from its own reads).

What a step does is a function of this module (:data:`_STEPS`); what a stage does (its decision, its repack) is its
stage object's (:mod:`ragged_vit.pipelines.stages`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..core.segments import uniform_cu_seqlens
from ..core.selection import Decision
from .buckets import padding_images
from .heads import head_logits
from .packed_block import lean_block
from .parts import Parts
from .plan import ForwardPlan, Step, StepKind
from .stages import HostCounts, Stage, Target
from .state import ForwardState, MergeFusion

OnStep = Callable[[Step, ForwardState], None]
"""``on_step(step, state)``: called before each step with the forward's state as that step will find it
(instrumentation: a CUDA event per region, or a stage's decision input to time); it must not change it."""


class ExactRepack:
    """Buffers of exactly the kept rows: the host count where the decision has one, else the stage's kept total
    read back (one wait); on the CPU's eager forward, the pure-PyTorch reference repack."""

    def __init__(self, counts: HostCounts, reference: bool) -> None:
        self.counts, self.reference = counts, reference

    def target(self, stage: Stage, state: ForwardState) -> Target:
        return stage.exact_target(state, self.counts, self.reference)


class BoundedRepack(ExactRepack):
    """Buffers the host sizes without waiting for the device wherever it holds a bound (the eager forward):

    * a fixed count: exact;
    * a variable count whose bound ``B * rows_after`` (the pruner's) is below the input's rows, or an input of at
      most ``sync_free_rows`` rows, or any stage after one that did not read: no read; the smaller of the input's
      rows and that bound holds the kept total (an image never grows), the rows past it form at most ``B`` padding
      images;
    * otherwise (nothing bounds the total below the input: Threshold-L2 threshold / calibrated, adaptive merging)
      the exact total and longest image, read back: the stage's one wait.

    The padding images make the decisions cover rows no image owns, so a bounded forward returns none.
    """

    def __init__(self, counts: HostCounts, plan: ForwardPlan, sync_free_rows: int) -> None:
        super().__init__(counts, reference=False)
        self.plan, self.sync_free_rows, self.may_read = plan, sync_free_rows, True

    def target(self, stage: Stage, state: ForwardState) -> Target:
        sel, batch, rows = state.selection, state.batch, state.x.shape[0]
        rows_after = self.plan.stages[stage.index].rows_after
        capacity = min(rows, batch * rows_after)
        fixed = sel.fixed_count and sel.count is not None
        extra = getattr(sel, "extra_token", None) is not None
        if fixed or extra or (self.may_read and capacity == rows and rows > self.sync_free_rows):
            return super().target(stage, state)  # the host count, or a read: no padding images
        self.may_read = False  # at most B padding images, as many as the rows past the smallest total need
        longest = max(rows_after, -(-(capacity - batch) // batch))
        return Target(capacity, longest, padding_images(capacity, batch, longest))


@dataclass(frozen=True)
class CapturedRepack:
    """The graph runner's buffers: stage ``j``'s repack writes into ``targets[j]``."""

    targets: dict[int, Target]

    def target(self, stage: Stage, state: ForwardState) -> Target:
        return self.targets[stage.index]


@dataclass
class Run:
    """One forward's context.

    Attributes:
        pipeline: the :class:`~ragged_vit.pipelines.model.PrunedViT` (model, backend, stages).
        parts: the plain or compiled functions the steps call.
        repack: the repack strategy (``target(stage, state) -> Target``).
        selections: decisions to replay instead of deciding (one per stage), or None.
        on_step: called before each step, or None.
        made: the decisions made or replayed, in stage order.
        offsets: every stage's offsets after its repack (the counts read the real images' entries).
    """

    pipeline: object
    parts: Parts
    repack: ExactRepack | CapturedRepack
    selections: Sequence[Decision] | None = None
    on_step: OnStep | None = None
    made: list[Decision] = field(default_factory=list)
    offsets: list[torch.Tensor] = field(default_factory=list)


def execute(run: Run, steps: Sequence[Step], state: ForwardState) -> None:
    """Runs ``steps`` on ``state`` (in place): the one executor loop."""
    on_step = run.on_step
    for step in steps:
        if on_step is not None:
            on_step(step, state)
        _STEPS[step.kind](run, step, state)


def stage_counts(run: Run, batch: int, num_prefix: int, device: torch.device) -> torch.Tensor:
    """int64 ``[B, S]``: the patches each real image has after each stage, from :attr:`Run.offsets` (a few
    launches, not two per stage)."""
    if not run.offsets:
        return torch.zeros((batch, 0), dtype=torch.long, device=device)
    cu = torch.stack([c if c.shape[0] == batch + 1 else c[: batch + 1] for c in run.offsets])
    lengths = (cu[:, 1:] - cu[:, :-1] - num_prefix).t()  # [B, S] int32, transposed
    return lengths.to(torch.long, memory_format=torch.contiguous_format)


def _front(run: Run, step: Step, state: ForwardState) -> None:
    """The embedding and the dense blocks; a RoPE model's rows get their rotation, unless the executor set it before
    (a graph runner's static table and positions: nothing built inside its graphs)."""
    preset = state.rotary
    x, table = run.parts.front(run.pipeline, state.x, None if preset is None else preset.table)  # rope table or None
    batch, tokens, channels = x.shape
    state.x = x.reshape(batch * tokens, channels)
    state.num_patches = tokens - run.pipeline.model.num_prefix_tokens
    if state.cu_seqlens is None:
        state.cu_seqlens = uniform_cu_seqlens(batch, tokens, x.device)
    state.max_seqlen = tokens
    if table is not None and preset is None:
        state.rotary = run.pipeline.rotary_rows(table, batch, tokens)


def _blocks(run: Run, step: Step, state: ForwardState) -> None:
    """A run of whole blocks; with ``linear``, in the fused-linear form, from and to the rows' LayerNorm statistics
    (``state.stats``)."""
    pv = run.pipeline
    group = [pv.model.blocks[k] for k in step.blocks]
    if step.linear:
        state.set_x(*run.parts.fused_blocks(group, state.x, state.x_stats(), state.cu_seqlens, state.max_seqlen,
                                            pv.backend, key_bias=state.key_bias))  # fmt: skip
        return
    state.x = run.parts.blocks(group, state.x, state.cu_seqlens, state.max_seqlen, pv.backend, key_bias=state.key_bias,
                               rotary=state.rotary)  # fmt: skip


def _attention(run: Run, step: Step, state: ForwardState) -> None:
    """``x + ls1(proj(attend(qkv(norm1(x)))))`` and the qkv projection, from the ``norm1`` and qkv the MLP step
    before prepared (``state.prepared``); with ``branch`` and a plain block, the branch is left to the merge after
    it (``state.fusion``; ``x`` stays); with ``beside``, stage ``step.stage``'s decision runs beside the attention
    core, projection and residual add (it reads the qkv projection only); with ``linear``, the fused-linear form (as
    :func:`_blocks`)."""
    pv, parts, (index,) = run.pipeline, run.parts, step.blocks
    block, x, prepared = pv.model.blocks[index], state.x, state.take_prepared(index)
    packed = (state.cu_seqlens, state.max_seqlen, pv.backend)
    if step.linear:
        x, state.qkv, stats = parts.fused_attention(block, x, state.x_stats(), *packed, key_bias=state.key_bias)
        state.set_x(x, stats)
        return
    lean = lean_block(block) if step.branch else None
    if prepared is None and lean is None and not step.beside:  # the whole half: one call
        state.x, state.qkv = parts.attention(block, x, *packed, key_bias=state.key_bias, rotary=state.rotary)
        return
    normed, state.qkv = parts.qkv(block, x) if prepared is None else prepared
    rest = (normed, state.qkv, *packed)
    if lean is not None:
        half = functools.partial(parts.branch, block, *rest, key_bias=state.key_bias, rotary=state.rotary)
    else:
        half = functools.partial(parts.residual, block, x, *rest, key_bias=state.key_bias, rotary=state.rotary)
    if step.beside:
        state.selection, out = beside(x.device, lambda: _decision(run, step.stage, state), half)
    else:
        out = half()
    if lean is not None:
        state.fusion = MergeFusion(out, lean.ln2)
    else:
        state.x = out


def _mlp(run: Run, step: Step, state: ForwardState) -> None:
    """``x + ls2(mlp(norm2(x)))`` (``norm2(x)`` from the merge before it, if it wrote it); with ``prepare``, also
    ``norm1`` and the qkv projection of the next block (one compiled region: the residual add and the LayerNorm in
    one kernel); with ``linear``, the fused-linear form (as :func:`_blocks`)."""
    blocks, (index,) = run.pipeline.model.blocks, step.blocks
    if step.linear:
        state.set_x(*run.parts.fused_mlp(blocks[index], state.x, state.x_stats(), state.take_normed()))
    elif step.prepare:
        state.x, normed, qkv = run.parts.mlp_qkv(blocks[index], state.x, blocks[index + 1], state.take_normed())
        state.prepared = (index + 1, normed, qkv)
    else:
        state.x = run.parts.mlp(blocks[index], state.x, state.take_normed())


def _decide(run: Run, step: Step, state: ForwardState) -> None:
    """A stage's decision; with ``beside``, its block's MLP half beside it, on every row (it acts per row, so it
    commutes with the repack): at small batch both are latency-bound and fill few SMs."""
    if not step.beside:
        state.selection = _decision(run, step.stage, state)
        return
    stage = run.pipeline.stages[step.stage]
    scored = state.x  # what the decision reads, alive until the side stream is done with it

    def decide() -> None:
        state.selection = _decision(run, step.stage, state)

    beside(scored.device, decide, lambda: _mlp(run, Step(StepKind.MLP, (stage.block,)), state))
    del scored


def _decision(run: Run, index: int, state: ForwardState) -> Decision:
    stage = run.pipeline.stages[index]
    if run.selections is None:
        return stage.decide(state, run.parts)
    selection = run.selections[index]
    stage.check_replayed(selection, state)
    return selection


def _repack(run: Run, step: Step, state: ForwardState) -> None:
    stage = run.pipeline.stages[step.stage]
    run.made.append(state.selection)
    stage.repack(state, run.repack.target(stage, state))
    run.offsets.append(state.cu_seqlens)


def _head(run: Run, step: Step, state: ForwardState) -> None:
    state.logits = head_logits(run.pipeline.model, state.x, state.cu_seqlens, state.batch, state.sizes)


_STEPS: dict[StepKind, Callable[[Run, Step, ForwardState], None]] = {
    StepKind.FRONT: _front,
    StepKind.BLOCKS: _blocks,
    StepKind.ATTENTION: _attention,
    StepKind.MLP: _mlp,
    StepKind.DECIDE: _decide,
    StepKind.REPACK: _repack,
    StepKind.HEAD: _head,
}


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of ``device`` on which work runs beside the current stream's (:func:`beside`): one per device
    and process, not held by a module (a CUDA stream cannot be copied or pickled). A captured graph keeps the fork
    and join as edges; no replay uses the stream."""
    return torch.cuda.Stream(device)


def beside(device: torch.device, side: Callable[[], object], main: Callable[[], object]) -> tuple[object, object]:
    """``(side(), main())``. While a CUDA graph is captured on ``device``: ``side`` on :func:`side_stream` beside
    ``main`` on the current stream, forked after the work queued so far and joined before anything queued after (the
    graph holds two parallel branches). Tensors ``side`` reads must stay alive until the join (the caller holds them);
    those it makes are used (and freed) on the current stream after it. Otherwise (the CPU, eager calls, a graph
    runner's warm-up, which compiles what it captures) one after the other, ``side`` first: the same kernels."""
    if device.type != "cuda":
        return side(), main()
    stream = side_stream(device)  # made outside a capture: a graph runner's warm-up runs first
    if not torch.cuda.is_current_stream_capturing():
        return side(), main()
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        first = side()
    second = main()
    current.wait_stream(stream)
    return first, second
