"""A token-pruned timm ViT, run eagerly from its forward plan: dense blocks, pruning stages, packed blocks, head.

:class:`PrunedViT` wraps a timm ``VisionTransformer`` (its modules and parameter names untouched, so official
checkpoints load) and a pruner from :mod:`ragged_vit.reference.pruners`. At construction it builds the forward plan
(:func:`ragged_vit.pipelines.plan.build_plan`) once, and :meth:`PrunedViT.run` executes it step by step:

1. FRONT: timm's own embedding (prefix tokens first) and the blocks before the first pruning stage, on the dense
   ``[B, N, C]`` batch, which is then viewed as packed (``[B*N, C]``, uniform ``cu_seqlens``);
2. DECIDE / REPACK at each stage: the pruner's decision (or the fused device decision registered for it,
   :mod:`ragged_vit.core.decisions`), then the packed buffer repacked ragged to ragged (no detour through padding);
3. BLOCKS / ATTENTION / MLP: every later block on the packed buffer
   (:mod:`ragged_vit.pipelines.packed_block`), attention through the chosen backend;
4. HEAD: ``model.norm``, the model's pooling of each image's kept rows, ``fc_norm`` and ``head``: logits
   ``[B, classes]`` in input order (:mod:`ragged_vit.pipelines.heads`).

:meth:`PrunedViT.run_step` runs one step on a :class:`ForwardState`; the CUDA-graph executor
(:class:`ragged_vit.pipelines.graphs.GraphedPrunedViT`) runs the same steps through it, with its own repack into
fixed-capacity buffers. The decisions of a run (one :class:`TokenSelection` per stage) are returned, and a later run
may replay them (``selections=``), so two backends see exactly the same keep masks and differ only in layout and
attention. A replayed selection is used as recorded, EViT's fused token included (cast to the replaying run's
dtype): it is part of the decision.

Packing: on CUDA the sync-free kernels of :mod:`ragged_vit.triton_impl.pack` (fixed-count stages pass ``count``
from the host, so nothing synchronises; in :meth:`PrunedViT.run` a variable-count stage reads its kept counts once,
in one transfer, for the exact total and longest image; :meth:`PrunedViT.forward`, which returns no selections,
reads them only where the host holds no bound on the total, and otherwise packs into the bound with padding images,
as the graph runner does: :func:`_repack_bounded`). On the CPU :mod:`ragged_vit.reference.packing` is
used: the CPU path exists to run the reference backend without a GPU, and Triton's pack kernels would only run there
under the interpreter, slowly.

Validation happens once, at :meth:`PrunedViT.run`'s entry (images, backend against the model, pruner ready,
replayed selections); the steps call the kernels' unchecked entry points.

Supported: timm ``VisionTransformer`` and its subclasses with any number of prefix tokens (class, distillation,
register tokens, or none), every timm pooling (``token``, ``avg``, ``max``, ``avgmax``, ``map``:
:mod:`ragged_vit.pipelines.heads`), blocks from the first stage on being timm ``Block``/``Attention``; inference only
(eval mode). ``docs/models.md`` lists the tested families. Not supported: training.

Image sizes: a model built with ``dynamic_img_size=False`` (timm's default) takes its own input size only
(:attr:`PrunedViT.image_size`). One built with ``dynamic_img_size=True`` takes any height and width that are
positive multiples of the patch size, one size per batch (timm resamples the position embeddings for each). The
plan's token count, row bounds and fixed counts depend on the size, so :meth:`PrunedViT.plan_for` builds one plan per
patch count on first use and caches it; the steps are the same at every size. Stage decisions count from the
batch's own unpruned patch count (``ForwardState.num_patches`` -> ``DecisionInput.num_patches``: DynamicViT's
``int(num_patches * rate ** (s + 1))``, ATS's sample count from a keep rate or by default).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ragged_vit.core.decisions import fused_decision
from ragged_vit.core.segments import seqlens, uniform_cu_seqlens
from ragged_vit.core.selection import Decision, DecisionInput, MergeSelection, Placement, Pruner, TokenSelection
from ragged_vit.core.validation import check_tensor
from ragged_vit.pipelines.backends import AttentionBackend, make_backend
from ragged_vit.pipelines.buckets import default_sync_free_rows, padding_images
from ragged_vit.pipelines.heads import MERGE_POOLS, head_logits, pool_of
from ragged_vit.pipelines.packed_block import (
    check_packable,
    compiled_attention_parts,
    compiled_blocks,
    compiled_halves,
    compiled_mlp_qkv,
    dense_block,
    lean_block,
    packed_attention,
    packed_attention_branch,
    packed_attention_residual,
    packed_blocks,
    packed_mlp,
    packed_mlp_qkv,
    packed_qkv,
)
from ragged_vit.pipelines.patch_embed import patch_embed_gemm, supports_gemm
from ragged_vit.pipelines.plan import ForwardPlan, Step, StepKind, build_plan
from ragged_vit.reference import merging as ref_merging
from ragged_vit.reference import packing as ref_packing
from ragged_vit.reference.tome import bisect_threshold
from ragged_vit.triton_impl import merging as triton_merging
from ragged_vit.triton_impl import pack as triton_pack

OnStep = Callable[[Step, "ForwardState"], None]
"""``on_step(step, state)``: called by :meth:`PrunedViT.run` before each step, with the forward's state as that step
will find it (instrumentation: a CUDA event per region, or a stage's decision input to time); it must not change it."""

OVERLAP_MAX_IMAGES = 8
"""Batches of at most this many images run a merging stage's decision beside its block's attention core while a
CUDA graph is captured (:meth:`PrunedViT._attention`): up to there the decision's small grids and the attention's
leave room for each other; past it the attention's programs fill the GPU and the decision only delays them. ToMe
r = 13, graphs + compile_blocks, H100, beside against after (one call, in turn, two rounds,
``docs/data/tome_overlap_h100_4d407d2.json``): B = 4 5,078 / 5,096 -> 5,619 / 5,641 img/s (+11%), B = 8 8,422 /
8,370 -> 9,036 / 9,013 (+7%), B = 16 -13%, B = 32 -11%, B = 64 -5%; B = 1 the same within 0.1% with the merge's
fusions beside it or not (``docs/tome.md``). After is faster from B = 10 (+6%; +11% at B = 12, 02497df,
``docs/data/tome_overlap_b8_16_h100_02497df.json``)."""


@dataclass
class PrunedOutput:
    """What one forward of :class:`PrunedViT` produces.

    Attributes:
        logits: ``[B, classes]`` in input order.
        counts: int64 ``[B, S]``: tokens per image after each of the ``S`` stages, prefix rows (CLS) excluded
            (EViT's fused token counted, as the golden counts 139/99/71 do). On CUDA it is not read back.
        selections: the decision of each stage, to replay in another run (``PrunedViT.run(selections=...)``).
    """

    logits: torch.Tensor
    counts: torch.Tensor
    selections: list[Decision] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class MergeFusion:
    """The work around a merge that the Triton merge kernel takes over from a plain block (``merge_fusion``).

    Attributes:
        branch: the block's attention branch ``ls1(proj(attend))`` ``[T, C]``, whose residual add the merge makes
            (each row's sum rounded as the add rounds it).
        norm: the block's ``norm2``; the merge also writes it of the merged rows, for the MLP, in buffers of at most
            :data:`MERGE_NORM_MAX_ROWS` rows.
    """

    branch: torch.Tensor
    norm: nn.LayerNorm


MERGE_NORM_MAX_ROWS = 1024
"""The merge kernel writes ``norm2`` of the merged rows (whole rows a program) for merges of at most this many rows;
larger buffers leave it to the MLP's compiled LayerNorm. Measured (ToMe r = 13, graphs + compile_blocks, H100, two
rounds in turn against the merge with neither fusion, ``docs/data/tome_merge_fusion_h100_8cbd859.json``): both
fusions at every size +2.1 / +2.8% at B = 4 (788 rows), -1.1 / -1.2% at B = 64 (12,608 rows); with this bound +2.1 /
+3.1% at B = 4 and +1.6 / +1.9% at B = 64 (the residual add alone there). With one row a program
(``merging._NORM_ROWS``, fcfdf62) fusing it at every size still cost 1% at B = 8 and 16 and 3% at B = 64."""


@dataclass
class ForwardState:
    """What one step of a forward hands to the next (an executor's working memory).

    Attributes:
        batch: ``B``, the real images (a graph executor's padding images come after them in ``cu_seqlens``).
        x: the images ``[B, 3, H, W]`` before FRONT; the packed residual stream ``[T, C]`` after it.
        cu_seqlens: int32 offsets of ``x``'s images (an executor may set them before FRONT: a static buffer).
        max_seqlen: a host bound on every image's rows in ``x``.
        qkv: the last attention half's qkv projection ``[T, 3*H*D]`` (what a MID_BLOCK decision scores).
        selection: the last decision, until its REPACK.
        logits: ``[B, classes]`` after HEAD.
        num_patches: patches of one unpruned image of this batch (``H/p * W/q``), set by FRONT (an executor that
            starts after FRONT sets it itself); the stages' decisions count from it.
        sizes: int32 ``[T]``: the patches each row of ``x`` holds, after a merging stage's REPACK (None before: 1
            each).
        key_bias: fp32 ``[T]``: ``log(sizes)``, added to every key's attention logits in the blocks after a merge
            (ToMe's proportional attention); None before the first merge.
        prepared: ``(block, normed, qkv)``: ``norm1`` of ``x`` and the qkv projection of ``block``, computed by the
            MLP step before that block's ATTENTION step (:meth:`PrunedViT.run_step`'s ``following``), which takes
            them (:meth:`take_prepared`); None otherwise.
        fuse_merge: set by an executor whose merging REPACK runs the Triton merge kernel: the ATTENTION step of a
            plain block (:func:`lean_block`) before a merging stage then hands the merge work of its own (``fusion``).
        fusion: what the merge after the ATTENTION step takes over (:class:`MergeFusion`), taken by the REPACK
            (:meth:`take_fusion`); while it holds a branch, the residual stream is ``x + branch`` (``x`` alone holds
            the rows before the block's attention).
        normed: ``norm2(x)`` of the rows the merge wrote, for the MLP step after it (taken: :meth:`take_normed`).
    """

    batch: int
    x: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    qkv: torch.Tensor | None = None
    selection: Decision | None = None
    logits: torch.Tensor | None = None
    num_patches: int = 0
    sizes: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    prepared: tuple[int, torch.Tensor, torch.Tensor] | None = None
    fuse_merge: bool = False
    fusion: MergeFusion | None = None
    normed: torch.Tensor | None = None

    def take_fusion(self) -> MergeFusion | None:
        """``fusion`` (cleared here), or None."""
        fusion, self.fusion = self.fusion, None
        return fusion

    def take_normed(self) -> torch.Tensor | None:
        """``normed`` (cleared here), or None."""
        normed, self.normed = self.normed, None
        return normed

    def take_prepared(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(normed, qkv)`` of ``block`` if the step before computed them (``prepared``, cleared here), else None."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        if prepared[0] != block:
            raise RuntimeError(f"block {prepared[0]}'s qkv was prepared, but block {block}'s attention runs next")
        return prepared[1], prepared[2]

    def row_sizes(self) -> torch.Tensor:
        """``sizes``, or before the first merge int32 ones ``[T]`` (every row holds one patch): what a merge weighs
        the rows of ``x`` by."""
        if self.sizes is not None:
            return self.sizes
        return torch.ones(self.x.shape[0], dtype=torch.int32, device=self.x.device)


class PrunedViT(nn.Module):
    """A timm ViT with token pruning and packed (ragged) blocks.

    Args:
        model: a timm ``VisionTransformer`` (``timm.create_model``); its modules are used as they are.
        pruner: a :class:`ragged_vit.core.selection.Pruner`, or None for the unpruned model (then every block runs
            timm's own dense forward and the backend is unused).
        backend: attention backend name (see :data:`ragged_vit.pipelines.backends.BACKENDS`) or instance.
        compile_blocks: run every block's non-attention work through ``torch.compile`` (Inductor fusions around
            the GEMMs; the attention backend stays one op). Compiles on first use of each shape.
        gemm_patch_embed: on CUDA, compute the patch embedding as one GEMM on patch rows instead of cuDNN's strided
            convolution (:mod:`ragged_vit.pipelines.patch_embed`; same math, rounding-level differences). The CPU
            always runs timm's own convolution.

    The module is put in eval mode; it is inference only. A model built with ``dynamic_img_size=True`` takes every
    image size that is a multiple of its patch size, one per batch (module docstring; :meth:`plan_for`).
    """

    def __init__(
        self,
        model: VisionTransformer,
        pruner: Pruner | None = None,
        backend: str | AttentionBackend = "reference",
        compile_blocks: bool = False,
        gemm_patch_embed: bool = True,
    ) -> None:
        super().__init__()
        self.compile_blocks = compile_blocks
        self.gemm_patch_embed = gemm_patch_embed
        _check_model(model)
        self.model = model
        self.pruner = _check_pruner(pruner, len(model.blocks))
        self.backend = backend
        self._plans: dict[tuple[int, int], ForwardPlan] = {}  # by image size (H, W): plan_for()
        self._plan = self.plan_for(self.image_size)
        for k in range(self._plan.dense_blocks, len(model.blocks)):
            check_packable(model.blocks[k], f"model.blocks[{k}]")
        self._head_dims = {blk.attn.head_dim for blk in model.blocks[self._plan.dense_blocks :]}
        self._merges = self.pruner is not None and self.pruner.merges
        self.eval()

    @property
    def plan(self) -> ForwardPlan:
        """The forward plan (steps, stages, host knowledge of counts) at :attr:`image_size`, built at construction.
        Other sizes (``dynamic_img_size``): :meth:`plan_for`."""
        return self._plan

    def plan_for(self, image_size: Sequence[int]) -> ForwardPlan:
        """The forward plan of images of ``image_size = (H, W)``, an input size this model takes (:meth:`check_images`).

        The steps and stages are the same at every size; the token count ``N``, the row bounds and the fixed counts
        are those of ``H/p * W/q`` patches (ForwardPlan is a few host objects). Built on the first use of each size,
        then cached: a forward looks its plan up by its images' size.
        """
        plan = self._plans.get(image_size) if isinstance(image_size, tuple) else None  # torch.Size is a tuple
        if plan is not None:
            return plan
        size = tuple(image_size) if isinstance(image_size, Sequence) else ()
        if len(size) != 2 or not all(isinstance(v, int) for v in size) or not _takes_size(self.model, size):
            raise ValueError(
                f"image_size must be (H, W) of images of shape {_allowed_shape(self.model)} for this model, got "
                f"{image_size!r}"
            )
        plan = self._plans.get(size)
        if plan is None:
            (height, width), (p, q) = size, self.patch_size
            prefix = self.model.num_prefix_tokens
            plan = build_plan(self.pruner, len(self.model.blocks), (height // p) * (width // q) + prefix, prefix)
            _check_stages(plan, self.pruner, self.model, f"{height}x{width}")
            self._plans[size] = plan
        return plan

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend of the packed blocks; assign a name or an instance to switch."""
        return self._backend

    @backend.setter
    def backend(self, value: str | AttentionBackend) -> None:
        self._backend = make_backend(value)

    @property
    def num_stages(self) -> int:
        """Pruning stages per forward (0 without a pruner)."""
        return len(self._plan.stages)

    @property
    def num_dense_blocks(self) -> int:
        """Blocks run densely by timm before the first stage; the rest run packed."""
        return self._plan.dense_blocks

    @property
    def num_patches(self) -> int:
        """Patches of an unpruned image at :attr:`image_size` (196 at 224x224 with 16x16 patches)."""
        return self._plan.tokens - self._plan.num_prefix

    @property
    def image_size(self) -> tuple[int, int]:
        """The model's input size ``(H, W)`` (timm's ``img_size``): the only one it takes unless it was built with
        ``dynamic_img_size=True``, then the size of :attr:`plan` and :attr:`num_patches`."""
        return tuple(self.model.patch_embed.img_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        """``(p, q)``: the height and width of one patch."""
        return tuple(self.model.patch_embed.patch_size)

    @property
    def dynamic_img_size(self) -> bool:
        """Whether the model takes every image size that is a multiple of :attr:`patch_size` (one per batch)."""
        return bool(getattr(self.model, "dynamic_img_size", False))

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter dtype: images are cast to it."""
        return self.model.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        """The model's device: images must be on it."""
        return self.model.patch_embed.proj.weight.device

    def extra_repr(self) -> str:
        return f"backend={self._backend.name!r}, dense_blocks={self._plan.dense_blocks}"

    def forward(
        self,
        images: torch.Tensor,
        selections: Sequence[Decision] | None = None,
        return_counts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, classes]`` of ``images [B, 3, H, W]``; with ``return_counts`` also the counts ``[B, S]``.

        The same forward as :meth:`run` (see it for the arguments), which it leaves the selections to. Without them it
        needs no stage's decision over exactly the real rows, so on CUDA a variable-count stage reads its kept total
        only where the host holds no bound on it (:func:`_repack_bounded`): ATS's forward waits for the device at none
        of its nine stages (``run``: at each), Threshold-L2 threshold/calibrated's at its one stage, as ``run``.
        """
        out = self._execute(images, selections, None, lean=selections is None, counts=return_counts)
        return (out.logits, out.counts) if return_counts else out.logits

    def run(
        self,
        images: torch.Tensor,
        selections: Sequence[Decision] | None = None,
        on_step: OnStep | None = None,
        *,
        overlap_decisions: bool = True,
    ) -> PrunedOutput:
        """The full forward, returning logits, per-stage counts and the selections made (or replayed).

        Args:
            images: ``[B, 3, H, W]`` float images, normalised, at the model's input size (any multiple of the patch
                size with ``dynamic_img_size``: the plan of that size runs, :meth:`plan_for`); cast to the model dtype.
            selections: one decision (:class:`TokenSelection`, or :class:`MergeSelection` for a merging pruner) per
                stage from an earlier run on the same images, to replay
                instead of deciding.
            on_step: called with each step of :attr:`plan` before it runs (instrumentation; see :data:`OnStep`).
            overlap_decisions: in buffers of at most :data:`MLP_OVERLAP_MAX_ROWS` rows, a mid-block pruning stage's
                decision runs beside its block's MLP half, which then runs on every row before the repack
                (:meth:`decide_beside_mlp`; not with ``selections`` or ``on_step``). False: the MLP after the repack.
        """
        return self._execute(images, selections, on_step, lean=False, overlap=overlap_decisions)

    @torch.no_grad()
    def _execute(
        self,
        images: object,
        selections: Sequence[Decision] | None,
        on_step: OnStep | None,
        lean: bool,
        counts: bool = True,
        overlap: bool = True,
    ) -> PrunedOutput:
        """:meth:`run`; ``lean``: with Triton packing (CUDA) and a backend the graph runner takes (``capturable``:
        the others read the host per call anyway), token-selection stages repack into host bounds
        (:func:`_repack_bounded`) and no selections are returned (theirs cover padding rows too); without
        ``counts`` the output's counts are an empty ``[B, 0]`` tensor (their ops are a share of an eager forward's
        host dispatches: ATS's nine stages, ~20 of ~250); ``overlap``: :meth:`run`'s ``overlap_decisions``."""
        images = self.check_inputs(images)
        selections = self._check_selections(selections)
        plan = self.plan_for(images.shape[-2:])
        state = ForwardState(images.shape[0], images.to(self.dtype), fuse_merge=self._merges and images.is_cuda)
        made: list[Decision] = []
        offsets: list[torch.Tensor] = []
        bounded = (
            lean and not self._merges and not plan.fixed and _packs_with_triton(images.device)
            and self._backend.capabilities.capturable  # the graph runner's backends: they take padding images
        )  # fmt: skip
        sync_free_rows, may_read = default_sync_free_rows(len(plan.stages)), True
        # A merging stage decides from its block's keys alone: beside the block's attention core (in a CUDA graph),
        # where that core leaves the GPU idle (``OVERLAP_MAX_IMAGES``).
        split = self._merges and selections is None and on_step is None and state.batch <= OVERLAP_MAX_IMAGES
        decided = None  # the stage whose decision ran with its block's attention half
        # A mid-block pruning stage decides beside its block's MLP half in small buffers (``MLP_OVERLAP_MAX_ROWS``).
        overlap = overlap and selections is None and on_step is None
        mlp_done = None  # the block whose MLP half ran beside its stage's decision
        for index, step in enumerate(plan.steps):
            if on_step is not None:
                on_step(step, state)
            if step.kind is StepKind.DECIDE and selections is not None:
                state.selection = selections[step.stage]
            elif step.kind is StepKind.DECIDE and step.stage == decided:
                pass
            elif step.kind is StepKind.DECIDE and overlap and _beside_mlp(plan, step, state):
                self.decide_beside_mlp(step, state)
                mlp_done = plan.stage_at(step).mlp_beside
            elif step.kind is StepKind.MLP and step.blocks[0] == mlp_done:
                mlp_done = None
            elif step.kind is StepKind.ATTENTION and split and plan.steps[index + 1].kind is StepKind.DECIDE:
                decided = plan.steps[index + 1].stage
                self._attention(step, state, plan.steps[index + 1], beside_decision=True)
            elif step.kind is StepKind.REPACK:
                made.append(state.selection)
                if bounded:
                    rows_after = plan.stages[step.stage].rows_after
                    may_read = _repack_bounded(state, rows_after, sync_free_rows, may_read)
                else:
                    (_merge_exact if self._merges else _repack_exact)(state, step.stage, plan.num_prefix)
                offsets.append(state.cu_seqlens)
            else:
                self.run_step(step, state, plan.steps[index + 1] if index + 1 < len(plan.steps) else None)
        if offsets and counts:  # every stage's lengths in one go (a few launches, not two per stage)
            cu = torch.stack([c if c.shape[0] == state.batch + 1 else c[: state.batch + 1] for c in offsets])
            lengths = (cu[:, 1:] - cu[:, :-1] - plan.num_prefix).t()  # [B, S] int32, transposed
            lengths = lengths.to(torch.long, memory_format=torch.contiguous_format)
        else:
            lengths = state.logits.new_zeros((state.batch, 0), dtype=torch.long)
        return PrunedOutput(state.logits, lengths, [] if bounded else made)

    def check_inputs(self, images: object) -> torch.Tensor:
        """Everything a forward checks before its first launch: eval mode, ``images`` (returned), the backend against
        the model's device, dtype and head dims, and the pruner's readiness."""
        if self.training:
            raise RuntimeError("PrunedViT is inference only: call .eval() before running it")
        images = self.check_images(images)
        for head_dim in self._head_dims:
            self._backend.check(images.device, self.dtype, head_dim)
        if self._merges and not self._backend.capabilities.key_bias:
            raise ValueError(
                f"backend {self._backend.name!r} takes no key_bias, which merging (pruner {self.pruner.name!r}: "
                "proportional attention, log(size) per key) needs: use 'triton', 'reference' or 'padded_sdpa'"
            )
        if self.pruner is not None:
            self.pruner.check_ready()
        return images

    def run_step(self, step: Step, state: ForwardState, following: Step | None = None) -> None:
        """Runs one step of the plan of ``state``'s image size (:meth:`plan_for`; what a step does is the same at
        every size) on ``state`` (in place), on checked input; REPACK is the executor's own (exact sizes here in
        :meth:`run`; fixed capacities in the graph executor). ``following``: the step that runs next on the same
        state, if the executor knows it: an MLP step followed by an ATTENTION step also computes that block's
        ``norm1`` and qkv (``state.prepared``, :func:`packed_mlp_qkv`), which the ATTENTION step takes."""
        kind = step.kind
        blocks = self.model.blocks
        if kind is StepKind.FRONT:
            x = (_compiled_front() if self.compile_blocks else _front)(self, state.x)  # [B, N, C]
            batch, tokens, channels = x.shape
            state.x = x.reshape(batch * tokens, channels)
            state.num_patches = tokens - self._plan.num_prefix
            if state.cu_seqlens is None:
                state.cu_seqlens = uniform_cu_seqlens(batch, tokens, x.device)
            state.max_seqlen = tokens
        elif kind is StepKind.BLOCKS:
            run_blocks = compiled_blocks() if self.compile_blocks else packed_blocks
            group = [blocks[k] for k in step.blocks]
            x, cu, bias = state.x, state.cu_seqlens, state.key_bias
            state.x = run_blocks(group, x, cu, state.max_seqlen, self._backend, key_bias=bias)
        elif kind is StepKind.ATTENTION:
            self._attention(step, state, following)
        elif kind is StepKind.MLP and following is not None and following.kind is StepKind.ATTENTION:
            mlp_qkv = compiled_mlp_qkv() if self.compile_blocks else packed_mlp_qkv
            (block,), (after,) = step.blocks, following.blocks
            state.x, normed, qkv = mlp_qkv(blocks[block], state.x, blocks[after], state.take_normed())
            state.prepared = (after, normed, qkv)
        elif kind is StepKind.MLP:
            mlp_half = compiled_halves()[1] if self.compile_blocks else packed_mlp
            (block,) = step.blocks
            state.x = mlp_half(blocks[block], state.x, state.take_normed())
        elif kind is StepKind.DECIDE:
            state.selection = self._decide(step.stage, state)
        elif kind is StepKind.HEAD:
            state.logits = head_logits(self.model, state.x, state.cu_seqlens, state.batch, state.sizes)
        else:
            raise ValueError(f"{step!r} is run by the executor itself (its buffers decide the repack's sizes)")

    def _attention(
        self, step: Step, state: ForwardState, following: Step | None, beside_decision: bool = False
    ) -> None:
        """An ATTENTION step: ``x + ls1(proj(attend(qkv(norm1(x)))))`` and the qkv projection, from the ``norm1`` and
        qkv the MLP step before prepared if it did (``state.prepared``). Before a merging stage whose merge is the
        Triton kernel's (``state.fuse_merge``, a plain block) the merge takes the residual add (the branch is left in
        ``state.fusion`` and ``x`` stays) and ``norm2`` (:func:`merge_fusion`), beside a decision or not.

        ``beside_decision``: ``following`` is a merging stage's DECIDE step (its decision reads only the block's
        keys), run here beside the attention core, projection and residual add (or branch). While a CUDA graph is
        captured the decision runs on a second stream, so the graph holds the two as parallel branches (at small
        batch both are latency-bound and fill few SMs); otherwise one after the other, the same kernels (the graph
        runner's warm-up compiles the same parts it captures)."""
        (index,) = step.blocks
        block, x, prepared = self.model.blocks[index], state.x, state.take_prepared(index)
        packed = (state.cu_seqlens, state.max_seqlen, self._backend)
        before_decision = following is not None and following.kind is StepKind.DECIDE
        fuses = state.fuse_merge and before_decision
        lean = lean_block(block) if fuses else None
        if prepared is None and lean is None and not beside_decision:  # the whole half: one compiled call
            attention_half = compiled_halves()[0] if self.compile_blocks else packed_attention
            state.x, state.qkv = attention_half(block, x, *packed, key_bias=state.key_bias)
            return
        qkv_part, residual_part, branch_part = compiled_attention_parts() if self.compile_blocks else (
            packed_qkv, packed_attention_residual, packed_attention_branch)  # fmt: skip
        normed, state.qkv = qkv_part(block, x) if prepared is None else prepared
        rest = (normed, state.qkv, *packed)
        if lean is not None:  # the merge after it adds the branch: x stays
            half = functools.partial(branch_part, block, *rest, key_bias=state.key_bias)
        else:
            half = functools.partial(residual_part, block, x, *rest, key_bias=state.key_bias)
        if beside_decision:  # the decision reads the qkv projection (and the rows' count) only
            state.selection, out = beside(x.device, lambda: self._decide(following.stage, state), half)
        else:
            out = half()
        if lean is not None:
            state.fusion = MergeFusion(out, lean.ln2)
        else:
            state.x = out

    def decide_beside_mlp(self, step: Step, state: ForwardState) -> None:
        """A mid-block stage's DECIDE step and its block's MLP half (the plan's ``mlp_beside``), which acts per row
        and so commutes with the repack: the MLP runs on every row of the buffer (pruned ones too). While a CUDA
        graph is captured the decision runs on a second stream beside it (the graph holds two parallel branches: at
        small batch both are latency-bound and fill few SMs, so the decision's microseconds hide behind the MLP's
        GEMMs); otherwise one after the other, the same kernels (a graph runner's warm-up compiles what it
        captures)."""
        mlp = Step(StepKind.MLP, (self._plan.stage_at(step).mlp_beside,))
        scored = state.x  # what the decision reads, kept alive until the side stream is done with it
        beside(scored.device, lambda: self.run_step(step, state), lambda: self.run_step(mlp, state))
        del scored

    @torch.no_grad()
    def calibrate(self, images: torch.Tensor) -> float:
        """Calibrates the pruner's threshold on ``images``; returns it (also set on the pruner).

        * Threshold-L2 ``calibrated`` mode (a pruner with a ``calibrate(x [B, N, C])`` method): on the residual
          stream its (single, before/after-block) stage sees for ``images``.
        * ToMe's ``calibrated`` mode (``ToMeMerger(r_max=..., rate=...)``): the similarity threshold is bisected on
          this pipeline's own forward (:meth:`run`: its dtype, backend and device) until the mean of
          ``run(images).counts`` (patch rows per image after each merging stage, prefix rows excluded) is
          ``rate * num_patches`` of ``images``' size. The bracket is ``[-2, 2]`` (every similarity passes / none
          does); at most 30 halvings, stopping at an exact hit; the best threshold seen is kept (within about a row of
          the target unless one similarity decides many rows at once). A forward per halving: calibrate on a
          calibration batch, not on every batch.

        The threshold is a norm (Threshold-L2) or a cosine similarity (ToMe), not a count: it applies unchanged to
        every image size of a ``dynamic_img_size`` model, and keeps the calibrated rate on average only for images
        like those it was calibrated on (calibrate on the size you serve; at another size the mean kept fraction may
        differ). A :class:`~ragged_vit.pipelines.graphs.GraphedPrunedViT` bound to this pipeline sees the new
        threshold (the pruner's ``extra_repr``) and raises at its next call: calibrate before graphing, or call its
        ``reset()`` after.
        """
        if self.pruner is not None and self.pruner.merges:
            merger = self.pruner
            mode = getattr(merger, "mode", None)
            if mode != "calibrated":
                raise ValueError(
                    f"calibrate() needs a merger in the calibrated mode (ToMeMerger(r_max=..., rate=...)), pruner "
                    f"{merger.name!r} has mode={mode!r}"
                )
            images = self.check_images(images)
            plan = self.plan_for(images.shape[-2:])
            num_patches = plan.tokens - plan.num_prefix
            target = merger.check_target(num_patches)
            fewest = sum(merger.capped_counts(num_patches)) / len(merger.blocks)
            previous = merger.threshold

            def miss(threshold: float) -> float:
                merger.threshold = threshold
                return float(self.run(images).counts.double().mean()) - target

            try:
                merger.threshold = bisect_threshold(miss, fewest - target, num_patches - target)
            except BaseException:
                merger.threshold = previous
                raise
            return merger.threshold
        if self.pruner is None or not hasattr(self.pruner, "calibrate"):
            raise ValueError(f"pruner {getattr(self.pruner, 'name', None)!r} has no calibrate() method")
        if self._plan.stages[0].placement is Placement.MID_BLOCK:
            raise NotImplementedError("calibrate() supports before/after-block stages only")
        x = _front(self, self.check_images(images).to(self.dtype))
        return self.pruner.calibrate(x, num_prefix=self._plan.num_prefix)

    def check_images(self, images: object) -> torch.Tensor:
        """Checks a batch of images for this model (float ``[B, C, H, W]`` at its input size, or with
        ``dynamic_img_size`` at any size whose height and width are positive multiples of the patch size; on its
        device); returns it."""
        images = check_tensor(images, "images", ndim=4)
        if not images.is_floating_point():
            raise TypeError(f"images must be a floating-point tensor, got {images.dtype}")
        channels = self.model.patch_embed.proj.in_channels
        if images.shape[1] != channels or not _takes_size(self.model, images.shape[-2:]):
            raise ValueError(
                f"images must have shape {_allowed_shape(self.model)} for this model, got {list(images.shape)}"
            )
        if images.shape[0] == 0:
            raise ValueError("images must hold at least one image, got batch size 0")
        device = self.device
        if images.device != device:
            raise ValueError(f"images must be on the model's device {device}, got {images.device}")
        return images

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The patch embedding with the class token and position embeddings: ``[B, 3, H, W]`` -> ``[B, N, C]``
        (timm's ``_pos_embed``, which resamples them to the image size with ``dynamic_img_size``)."""
        m = self.model
        if self.gemm_patch_embed and images.is_cuda and supports_gemm(m.patch_embed):
            x = patch_embed_gemm(m.patch_embed, images)  # the image size was checked by the caller (NLC or NHWC)
        else:
            x = m.patch_embed(images)
        return m.norm_pre(m.patch_drop(m._pos_embed(x)))

    def _decide(self, index: int, state: ForwardState) -> Decision:
        return decide(self.pruner, self.decision_input(index, state), compiled=self.compile_blocks)

    def decision_input(self, index: int, state: ForwardState) -> DecisionInput:
        """What stage ``index`` decides on, from the state its DECIDE step finds (also for timing a decision alone)."""
        stage = self._plan.stages[index]
        attn = self.model.blocks[stage.block].attn
        mid = stage.placement is Placement.MID_BLOCK  # only a MID_BLOCK stage has its own block's qkv
        return DecisionInput(
            x=state.x, cu_seqlens=state.cu_seqlens, stage=index, num_patches=state.num_patches,
            max_seqlen=state.max_seqlen, qkv=state.qkv if mid else None, num_heads=attn.num_heads if mid else None,
            scale=attn.scale if mid else None, num_prefix=self._plan.num_prefix,
        )  # fmt: skip

    def _check_selections(self, selections: Sequence[Decision] | None) -> list[Decision] | None:
        if selections is None:
            return None
        selections = list(selections)
        if len(selections) != self.num_stages:
            raise ValueError(
                f"selections must hold one decision per stage ({self.num_stages}), got {len(selections)}"
            )
        kind = MergeSelection if self._merges else TokenSelection
        for i, sel in enumerate(selections):
            if not isinstance(sel, kind):
                raise TypeError(f"selections[{i}] must be a {kind.__name__}, got {type(sel).__name__}")
        return selections


def decide(pruner: Pruner, inp: DecisionInput, compiled: bool = False) -> Decision:
    """One stage's decision on checked input: the fused decision registered for the pruner on ``inp``'s device
    (:mod:`ragged_vit.core.decisions`), else the pruner itself; with ``compiled`` on CUDA the pruner runs under
    ``torch.compile`` together with its CLS-attention scores (Inductor fuses their segment operations; its reductions
    may round differently, like the compiled blocks)."""
    fused = fused_decision(pruner, inp.x.device)
    if fused is not None:
        return fused(pruner, inp)
    if compiled and inp.x.is_cuda:  # the bound is left out: reference decisions do not read it (no recompiles)
        return _compiled_decision()(pruner, inp.x, inp.cu_seqlens, inp.stage, inp.num_patches, inp.qkv,
                                    inp.num_heads, inp.scale, inp.num_prefix)  # fmt: skip
    return pruner.decide(inp)


def _decision(pruner: Pruner, x, cu, stage, num_patches, qkv, num_heads, scale, num_prefix) -> Decision:
    return pruner.decide(DecisionInput(x, cu, stage, num_patches, None, qkv, num_heads, scale, num_prefix=num_prefix))


@functools.cache
def _compiled_decision():
    return torch.compile(_decision)


def _front(pipeline: PrunedViT, images: torch.Tensor) -> torch.Tensor:
    """Embedding and the dense blocks before the first stage: ``[B, 3, H, W]`` -> ``[B, N, C]``. With a pruner the
    blocks run through :func:`dense_block` (lean when plain: bitwise timm's ``block(x)``, fewer host ops); the
    unpruned pipeline runs timm's own blocks."""
    x = pipeline.embed(images)
    lean = pipeline.pruner is not None
    for block in pipeline.model.blocks[: pipeline.num_dense_blocks]:
        x = dense_block(block, x) if lean else block(x)
    return x


@functools.cache
def _compiled_front():
    return torch.compile(_front)


def _repack_exact(state: ForwardState, index: int, num_prefix: int) -> None:
    """Applies stage ``index``'s selection to the packed buffer at its exact size (eager REPACK)."""
    sel, x, cu = state.selection, state.x, state.cu_seqlens
    keep, kept = sel.keep, sel.kept
    if keep.dim() != 1 or keep.shape[0] != x.shape[0] or keep.device != x.device or kept.shape != (state.batch,):
        raise ValueError(
            f"selections[{index}].keep must be a [{x.shape[0]}] mask and .kept [{state.batch}] counts on {x.device} "
            f"(this batch's packed rows), got {tuple(keep.shape)} and {tuple(kept.shape)} on {keep.device}: "
            "replay selections only on the images they were made for"
        )
    extra = None if sel.extra_token is None else sel.extra_token.to(x.dtype)
    if not _packs_with_triton(x.device):
        state.x, state.cu_seqlens, state.max_seqlen = ref_packing.repack(x, cu, keep, extra, num_prefix)
    elif sel.fixed_count and sel.count is not None:
        state.x, state.cu_seqlens, state.max_seqlen = triton_pack.repack_unchecked(
            x, cu, keep, state.max_seqlen, count=sel.count, extra_token=extra, kept=kept
        )
    else:
        lens = kept.tolist()  # the one sync of a variable-count stage
        state.x, state.cu_seqlens, _ = triton_pack.repack_unchecked(
            x, cu, keep, state.max_seqlen, capacity=sum(lens) + len(lens) * (extra is not None), extra_token=extra,
            kept=kept,
        )  # fmt: skip
        state.max_seqlen = max(lens) + (extra is not None)
    state.selection = state.qkv = None


def _packs_with_triton(device: torch.device) -> bool:
    """Whether the forward packs with the Triton kernels on ``device`` (CUDA; the CPU packs with the reference)."""
    return device.type == "cuda"


MLP_OVERLAP_MAX_ROWS = 256
"""A fixed-count forward (:meth:`PrunedViT.run`) decides a mid-block pruning stage beside its block's MLP half
(:meth:`PrunedViT.decide_beside_mlp`, the MLP on every row, before the repack) in buffers of at most this many rows:
two 128-row GEMM tiles, where the MLP on every row costs what it costs on the kept ones and the decision hides behind
it. Measured (H100, graphed DeiT-B, ``docs/data/mlp_beside_in_run_h100_3c285c5.json``): EViT 0.7 +2.5-3.2% at B = 1
(197 rows), with or without ``compile_blocks``; at B = 4 (788 rows) EViT -0.4 to +1.3% and Threshold-L2 ratio 0.5
-1.4 to +0.6%, where its ~4 us decision saves less than the MLP on the pruned rows costs. The graph runner's chains
of read-free segments overlap at every size they chain (ATS's decision is several times longer)."""


def _beside_mlp(plan: ForwardPlan, step: Step, state: ForwardState) -> bool:
    """Whether :meth:`PrunedViT._execute` runs this DECIDE step beside its block's MLP half."""
    return plan.stage_at(step).mlp_beside is not None and state.x.shape[0] <= MLP_OVERLAP_MAX_ROWS


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of ``device`` on which work runs beside the current stream's (:func:`beside`): one per device
    and process, not held by a module (a CUDA stream cannot be copied or pickled: ``copy.deepcopy(pv)`` must work). A
    captured graph keeps the fork and join as edges; no replay uses the stream."""
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


def _repack_bounded(state: ForwardState, rows_after: int, sync_free_rows: int, may_read: bool) -> bool:
    """Eager REPACK of a token-selection stage with Triton packing (:meth:`PrunedViT.forward`), into a buffer the
    host sizes without waiting for the device wherever it holds a bound, as the graph runner's sync-free segments do
    (:mod:`ragged_vit.pipelines.graphs`); returns whether a later stage may still read (``may_read`` for the next).

    * a fixed count: exact, as in ``run``;
    * a variable count whose bound ``B * rows_after`` (the pruner's) is below the input's rows, or an input of at most
      ``sync_free_rows`` rows, or any stage after one that did not read: no read; the smaller of the input's rows and
      that bound holds the kept total (an image never grows);
    * otherwise (nothing bounds the total below the input: Threshold-L2 threshold/calibrated) the exact total and
      longest image, read from the kept counts: the stage's one wait.

    An eager forward's host dispatches about as fast as the device runs (DeiT-B fp16 on an H100: timm's 227 ops take
    about as long as its kernels at B=64), so every wait serialises the two; a bound costs GEMM rows instead. Rows past
    the real total form padding images after the ``B`` real ones (at most ``B``, each at most the new ``max_seqlen``),
    which every later step handles as the graph runner's do; the counts and the head read the real images only. The
    selections then cover padding rows too, so :meth:`PrunedViT.forward` returns none."""
    sel, x, batch, cu, kept = state.selection, state.x, state.batch, state.cu_seqlens, state.selection.kept
    extra = None if sel.extra_token is None else sel.extra_token.to(x.dtype)
    if sel.fixed_count and sel.count is not None:  # (the real images only: batch=)
        state.x, state.cu_seqlens, state.max_seqlen = triton_pack.repack_unchecked(
            x, cu, sel.keep, state.max_seqlen, count=sel.count, extra_token=extra, kept=kept, batch=batch
        )
        state.selection = state.qkv = None
        return may_read
    if extra is not None:
        raise NotImplementedError(
            "a variable-count stage that appends an extra token is not supported by the eager forward's bounded "
            "repack: call PrunedViT.run"
        )
    rows = x.shape[0]
    capacity = min(rows, batch * rows_after)
    if may_read and capacity == rows and rows > sync_free_rows:  # every earlier stage read: no padding images
        lens = kept.tolist()  # the one wait of this stage
        capacity, longest, pads = sum(lens), max(lens), 0
    else:  # at most B padding images, as many as the rows past the smallest possible total need
        longest = max(rows_after, -(-(capacity - batch) // batch))
        pads, may_read = padding_images(capacity, batch, longest), False
    state.x, state.cu_seqlens, _ = triton_pack.repack_unchecked(
        x, cu, sel.keep, state.max_seqlen, capacity=capacity, kept=kept, padding_images=pads,
        padding_len=longest if pads else None, batch=batch,
    )  # fmt: skip
    state.max_seqlen = longest
    state.selection = state.qkv = None
    return may_read


def _merge_exact(state: ForwardState, index: int, num_prefix: int) -> None:
    """Applies stage ``index``'s merge (a :class:`MergeSelection`) to the packed buffer at its exact size (eager
    REPACK of a merging stage): each merged row the size-weighted average of the rows sent to it, its size their sum;
    then ``key_bias = log(sizes)`` for the attention of the blocks after it."""
    sel, x = state.selection, state.x
    dest, kept = sel.destination, sel.kept
    if dest.shape != (x.shape[0],) or dest.device != x.device or kept.shape != (state.batch,):
        raise ValueError(
            f"selections[{index}].destination must be a [{x.shape[0]}] map and .kept [{state.batch}] counts on "
            f"{x.device} (this batch's packed rows), got {tuple(dest.shape)} and {tuple(kept.shape)} on "
            f"{dest.device}: replay selections only on the images they were made for"
        )
    lists = (sel.sources, sel.source_offsets)
    if any(t is not None for t in lists) and not all(
        t is not None and t.shape == (x.shape[0] + i,) and t.dtype == torch.int32 and t.device == x.device
        and t.is_contiguous()
        for i, t in enumerate(lists)
    ):  # fmt: skip
        raise ValueError(
            f"selections[{index}].sources and .source_offsets must both be None or contiguous int32 [{x.shape[0]}] "
            f"and [{x.shape[0] + 1}] on {x.device} (the decision's source lists)"
        )
    sizes = state.row_sizes()
    if x.device.type != "cuda":
        rows = int(sel.cu_seqlens[-1])
        merged = ref_merging.merge_rows(x, sizes, dest.long(), rows).to(x.dtype)
        new_sizes = sizes.new_zeros(rows).index_add_(0, dest.long(), sizes)
        longest = int(seqlens(sel.cu_seqlens).max())
    else:
        if sel.fixed_count and sel.count is not None:
            rows, longest = state.batch * sel.count, sel.count
        else:
            lens = kept.tolist()  # the one sync of a variable-count stage
            rows, longest = sum(lens), max(lens)
        log_sizes = torch.empty(rows, dtype=torch.float32, device=x.device)  # the kernel writes log(size) too
        merged, new_sizes = triton_merging.merge_rows_unchecked(
            x, sizes, *merge_sources_of(sel), sel.cu_seqlens, x.new_empty((rows, x.shape[1])), sizes.new_empty(rows),
            log_sizes, **merge_fusion(state, rows),
        )  # fmt: skip
    state.x, state.cu_seqlens, state.max_seqlen, state.sizes = merged, sel.cu_seqlens, longest, new_sizes
    state.key_bias = log_sizes if x.is_cuda else new_sizes.double().log().float()  # rounded once, as the reference
    state.selection = state.qkv = None


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


def _check_model(model: object) -> None:
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a timm VisionTransformer, got {type(model).__name__}")
    pool_of(model)  # a pooling the head supports


def _allowed_shape(model: VisionTransformer) -> str:
    """The image shapes ``model`` takes, for error messages."""
    channels = model.patch_embed.proj.in_channels
    height, width = model.patch_embed.img_size
    if not getattr(model, "dynamic_img_size", False):
        return f"[B, {channels}, {height}, {width}]"
    p, q = model.patch_embed.patch_size
    return (
        f"[B, {channels}, H, W] with H a positive multiple of {p} and W of {q} (dynamic_img_size=True; "
        f"{height}x{width} by default)"
    )


def _takes_size(model: VisionTransformer, size: Sequence[int]) -> bool:
    """Whether ``model`` takes images of ``size = (H, W)``: its own size, or with ``dynamic_img_size`` any positive
    multiples of the patch size."""
    height, width = size
    if not getattr(model, "dynamic_img_size", False):
        return (height, width) == tuple(model.patch_embed.img_size)
    p, q = model.patch_embed.patch_size
    return height > 0 and width > 0 and height % p == 0 and width % q == 0


def _check_stages(plan: ForwardPlan, pruner: Pruner | None, model: VisionTransformer, size: str) -> None:
    """What a model's prefix rows allow: a class token for pruners that score by its attention, and at least one
    row per image after every stage (at the image size ``size``, ``"HxW"``)."""
    if pruner is None:
        return
    if pruner.merges and pool_of(model) not in MERGE_POOLS:
        raise ValueError(
            f"pruner {pruner.name!r} merges rows, and the model pools with {pool_of(model)!r}: merging supports "
            f"{' and '.join(map(repr, MERGE_POOLS))} pooling (the average weighted by the patches each row holds)"
        )
    if pruner.needs_attention and model.cls_token is None:
        raise ValueError(
            f"pruner {pruner.name!r} scores patches by the class token's attention row, and the model has no class "
            "token (class_token=False): use a pruner that scores the tokens themselves (threshold_l2, dynamicvit)"
        )
    if plan.num_prefix == 0 and any(s.rows_after == 0 for s in plan.stages):
        raise ValueError(
            f"pruner {pruner.name!r} would leave images without a single row on this model (no prefix tokens) at "
            f"{size}: rows after each stage {[s.rows_after for s in plan.stages]}"
        )


def _check_pruner(pruner: object, depth: int) -> Pruner | None:
    if pruner is None:
        return None
    if not isinstance(pruner, Pruner):
        raise TypeError(f"pruner must be a ragged_vit.core.selection.Pruner or None, got {type(pruner).__name__}")
    blocks = tuple(pruner.blocks)
    if not blocks or any(not 0 <= b < depth for b in blocks) or list(blocks) != sorted(set(blocks)):
        raise ValueError(f"pruner.blocks must be strictly increasing block indices in [0, {depth}), got {blocks}")
    placement = Placement(pruner.placement)
    if pruner.needs_attention and placement != Placement.MID_BLOCK:
        raise NotImplementedError(
            f"pruner {pruner.name!r} needs its block's attention, which the pipeline "
            f"provides only for placement {Placement.MID_BLOCK.value!r}, got {placement.value!r}"
        )
    return pruner
