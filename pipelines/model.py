"""A token-pruned timm ViT: its forward plan, the stage objects and the eager entry points of the one executor.

:class:`PrunedViT` wraps a timm ``VisionTransformer`` (its modules and parameter names untouched, so official
checkpoints load) and a pruner from :mod:`ragged_vit.reference.pruners`. At construction it builds the forward plan
(:func:`ragged_vit.pipelines.plan.build_plan`) and one stage object per stage (:mod:`ragged_vit.pipelines.stages`);
a forward runs the plan's program (:meth:`PrunedViT.program`) through the executor loop
(:func:`ragged_vit.pipelines.executor.execute`):

1. FRONT: timm's own embedding (prefix tokens first) and the blocks before the first pruning stage, on the dense
   ``[B, N, C]`` batch, which is then viewed as packed (``[B*N, C]``, uniform ``cu_seqlens``);
2. DECIDE / REPACK at each stage: the pruner's decision (or the fused device decision registered for it,
   :mod:`ragged_vit.core.decisions`), then the packed buffer repacked ragged to ragged (no detour through padding);
3. BLOCKS / ATTENTION / MLP: every later block on the packed buffer
   (:mod:`ragged_vit.pipelines.packed_block`), attention through the chosen backend;
4. HEAD: ``model.norm``, the model's pooling of each image's kept rows, ``fc_norm`` and ``head``: logits
   ``[B, classes]`` in input order (:mod:`ragged_vit.pipelines.heads`).

:meth:`PrunedViT.run` returns the decisions of a forward (one per stage), and a later run may replay them
(``selections=``), so two backends see exactly the same keep masks and differ only in layout and attention. A replayed
selection is used as recorded, EViT's fused token included (cast to the replaying run's dtype): it is part of the
decision. Its repacks are exact (:class:`ragged_vit.pipelines.executor.ExactRepack`): a variable-count stage reads
its kept total back, once. :meth:`PrunedViT.forward`, which returns no decisions, sizes each buffer by the plan's
host bound wherever that bound saves rows (:class:`ragged_vit.pipelines.executor.BoundedRepack`), and reads back only
where none does. On CUDA the sync-free kernels of :mod:`ragged_vit.triton_impl.pack` repack; on the CPU
:mod:`ragged_vit.reference.packing` does: the CPU path exists to run the reference backend without a GPU, and
Triton's pack kernels would only run there under the interpreter, slowly.

Validation happens once, at a forward's entry (images, backend against the model, pruner ready, replayed
selections' types; their shapes at their stage); the steps call the kernels' unchecked entry points.

Supported: timm ``VisionTransformer`` and its subclasses with any number of prefix tokens (class, distillation,
register tokens, or none), every timm pooling (``token``, ``avg``, ``max``, ``avgmax``, ``map``:
:mod:`ragged_vit.pipelines.heads`), blocks from the first stage on being timm ``Block``/``Attention``; timm's ``Eva``
(EVA-02, DINOv3, Perception Encoder, ``vit_*_rope_*``: :mod:`ragged_vit.pipelines.eva`), whose rotary position
embeddings travel with the packed rows (each row's rope table position, moved by every repack); inference only
(eval mode). ``docs/models.md`` lists the tested families. Not supported: training; on a RoPE model, merging (ToMe).

Image sizes: a model built with ``dynamic_img_size=False`` (timm's default) takes its own input size only
(:attr:`PrunedViT.image_size`). One built with ``dynamic_img_size=True`` takes any height and width that are
positive multiples of the patch size, one size per batch (timm resamples the position embeddings for each). The
plan's token count, row bounds and fixed counts depend on the size, so :meth:`PrunedViT.plan_for` builds one plan per
patch count on first use and caches it; the steps are the same at every size. Stage decisions count from the
batch's own unpruned patch count (``ForwardState.num_patches`` -> ``DecisionInput.num_patches``: DynamicViT's
``int(num_patches * rate ** (s + 1))``, ATS's sample count from a keep rate or by default).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..core.selection import Decision, DecisionInput, Placement, Pruner
from ..core.validation import check_tensor
from ..reference.pruners.tome import ToMeMerger
from ..reference.tome import bisect_threshold
from ..triton_impl import configs
from .backends import AttentionBackend, make_backend
from .backends.triton import TritonBackend
from .buckets import default_sync_free_rows
from .eva import RopeSpec, RotaryRows, check_eva, embed_tokens, is_eva, rope_table, rotary_rows
from .executor import BoundedRepack, ExactRepack, OnStep, Run, execute, stage_counts
from .graphs import GraphedPrunedViT
from .heads import pool_of
from .naflex import (
    GridCache,
    NativeBatch,
    check_naflex,
    check_native_pruner,
    is_naflex,
    native_batch,
    native_front,
    native_image_size,
    native_refusal,
)
from .packed_block import check_packable, fused_refusal
from .parts import Parts, front, parts
from .patch_embed import patch_embed_gemm, supports_gemm
from .plan import ForwardPlan, Program, build_plan
from .stages import Stage, host_counts, make_stages
from .state import ForwardState, PrunedOutput

MODES = ("auto", "eager", "graphs")
"""How :meth:`PrunedViT.forward` runs: ``auto`` (CUDA graphs where the call can be captured, else eager, saying once
why), ``eager`` (every call eagerly), ``graphs`` (every call from CUDA graphs; a call that cannot be captured is an
error)."""

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""The batch sizes the graph modes capture: a batch is padded to the smallest that holds it (a padding image costs
less than a capture of its own); a larger batch runs eagerly (``auto``), where its kernels are long enough for the
host to keep ahead of them. With the static buffers of each size and one shared pool for the graphs' temporaries,
they bound the graphs' device memory (:meth:`PrunedViT.graph_memory` lists what is held)."""

MAX_GRAPHS = 128
"""The most CUDA graphs the graph modes capture per pipeline (a variable-count forward captures one per chain of
segments and token bucket); past it, segments run eagerly on the static buffers."""


class EagerFallbackWarning(UserWarning):
    """A forward of ``mode="auto"`` ran eagerly; the message says why (once per reason and pipeline)."""


class PrunedViT(nn.Module):
    """A timm ViT with token pruning and packed (ragged) blocks.

    Args:
        model: a timm ``VisionTransformer`` or ``Eva`` (``timm.create_model``); its modules are used as they are.
        pruner: a :class:`ragged_vit.core.selection.Pruner`, or None for the unpruned model (then every block runs
            timm's own dense forward and the backend is unused).
        backend: attention backend name (see :data:`ragged_vit.pipelines.backends.BACKENDS`) or instance.
        compile_blocks: run every block's non-attention work through ``torch.compile`` (Inductor fusions around
            the GEMMs; the attention backend stays one op; compiled on first use of each shape). None (default): in
            the CUDA graphs of the graph modes, not eagerly; True: everywhere; False: nowhere.
        gemm_patch_embed: on CUDA, compute the patch embedding as one GEMM on patch rows instead of cuDNN's strided
            convolution (:mod:`ragged_vit.pipelines.patch_embed`; same math, rounding-level differences). The CPU
            always runs timm's own convolution.
        mode: how :meth:`forward` runs (:data:`MODES`). ``"auto"`` (default): on CUDA, from CUDA graphs captured on
            first use per batch bucket (:data:`BATCH_BUCKETS`) and image size, with compiled blocks; a call that
            cannot be captured (on the CPU, a backend that cannot run in a graph, replayed selections, a batch over
            the largest bucket, under ``torch.compile``) runs eagerly and says once why
            (:class:`EagerFallbackWarning`). :meth:`run`, which returns the decisions, always runs eagerly.

    The module is put in eval mode; it is inference only (its outputs never carry autograd history, so grad mode
    does not matter). A model built with ``dynamic_img_size=True`` takes every image size that is a multiple of its
    patch size, one per batch (module docstring; :meth:`plan_for`).
    """

    def __init__(
        self,
        model: VisionTransformer,
        pruner: Pruner | None = None,
        backend: str | AttentionBackend = "reference",
        compile_blocks: bool | None = None,
        gemm_patch_embed: bool = True,
        mode: str = "auto",
    ) -> None:
        super().__init__()
        if compile_blocks is not None and not isinstance(compile_blocks, bool):
            raise TypeError(f"compile_blocks must be a bool or None, got {type(compile_blocks).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        self.compile_blocks = compile_blocks
        self.gemm_patch_embed = gemm_patch_embed
        self.mode = mode
        self.last_call: str | None = None  # how the last forward ran: "graphs", or "eager: <why>"
        # the forward's rows (B x N) up to which the packed blocks take the fused-linear form; None: the tuned limit
        self.fused_block_rows: int | None = None
        self._runner = None  # the graph modes' GraphedPrunedViT, made on first use
        self._said: set[str] = set()  # the eager reasons said so far
        self._compile_failed = False  # torch.compile failed here once: the graphs run the plain parts
        self.rope = _check_model(model)  # a RoPE model's rope table and layout (None without RoPE)
        self.eva = is_eva(model)
        self.native = is_naflex(model)  # a NaFlexVit: batches of images of their own sizes, every block packed
        self.grid_cache = GridCache() if self.native else None  # its position rows and rope tables per patch grid
        # A per-block rope table (RoPE-Mixed) is indexed by each block's attention module.
        self._rope_blocks = {blk.attn: k for k, blk in enumerate(model.blocks)} if self.rope is not None else None
        self.model = model
        self.pruner = _check_pruner(pruner, len(model.blocks))
        if self.native:
            check_native_pruner(self.pruner)
        self.backend = backend
        self.stages: tuple[Stage, ...] = make_stages(self.pruner, model)
        self._plans: dict[tuple[int, int], ForwardPlan] = {}  # by image size (H, W): plan_for()
        self._token_plans: dict[int, ForwardPlan] = {}  # by rows of the longest image: plan_of_tokens()
        self._plan = self.plan_for(self.image_size)
        packed = self.first_packed_block
        for k in range(packed, len(model.blocks)):
            check_packable(model.blocks[k], f"model.blocks[{k}]")
        self._head_dims = {blk.attn.head_dim for blk in model.blocks[packed:]}
        self._programs: dict[tuple, Program] = {}  # by (H, W, B, way of running): program()
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
            tokens = (height // p) * (width // q) + self.model.num_prefix_tokens
            plan = self._plans[size] = self.plan_of_tokens(tokens, f"{height}x{width}")
        return plan

    def plan_of_tokens(self, tokens: int, label: str) -> ForwardPlan:
        """The forward plan of images of at most ``tokens`` rows, prefix rows included (a native batch's longest
        image; :meth:`plan_for` of a size), built on first use and cached; ``label`` names the size in errors."""
        plan = self._token_plans.get(tokens)
        if plan is None:
            prefix = self.model.num_prefix_tokens
            commutes = all(stage.commutes_with_mlp for stage in self.stages)
            plan = build_plan(self.pruner, len(self.model.blocks), tokens, prefix, mlp_commutes=commutes)
            _check_stages(plan, self.pruner, self.model, label)
            self._token_plans[tokens] = plan
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
        """Blocks before the first stage, run densely by timm (packed on a NaFlexVit, which has no dense batch: see
        :attr:`first_packed_block`); the rest run packed."""
        return self._plan.dense_blocks

    @property
    def first_packed_block(self) -> int:
        """The first block that runs packed: :attr:`num_dense_blocks`, or 0 on a NaFlexVit (every block packed)."""
        return 0 if self.native else self._plan.dense_blocks

    @property
    def num_patches(self) -> int:
        """Patches of an unpruned image at :attr:`image_size` (196 at 224x224 with 16x16 patches)."""
        return self._plan.tokens - self._plan.num_prefix

    @property
    def image_size(self) -> tuple[int, int]:
        """The model's input size ``(H, W)`` (timm's ``img_size``): the only one it takes unless it was built with
        ``dynamic_img_size=True``, then the size of :attr:`plan` and :attr:`num_patches`."""
        return input_shape(self.model)[1:]

    @property
    def patch_size(self) -> tuple[int, int]:
        """``(p, q)``: the height and width of one patch."""
        return tuple(_embedding(self.model).patch_size)

    @property
    def dynamic_img_size(self) -> bool:
        """Whether the model takes every image size that is a multiple of :attr:`patch_size` (one per batch)."""
        return bool(getattr(self.model, "dynamic_img_size", False))

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter dtype: images are cast to it."""
        return _embedding(self.model).proj.weight.dtype

    @property
    def device(self) -> torch.device:
        """The model's device: images must be on it."""
        return _embedding(self.model).proj.weight.device

    @property
    def parts(self) -> Parts:
        """The functions an eager forward's steps call: compiled when :attr:`compile_blocks` is True, else plain."""
        return parts(self.compile_blocks is True)

    def parts_for(self, compiled: bool) -> Parts:
        """The compiled or the plain functions (:func:`ragged_vit.pipelines.parts.parts`)."""
        return parts(compiled)

    def program(self, plan: ForwardPlan, batch: int, *, graphs: bool = False, triton: bool = True,
                overlap_rows: int = 0, fused_block_rows: int | None = None) -> Program:  # fmt: skip
        """The program of a forward of ``batch`` images of ``plan``'s size (:meth:`ForwardPlan.program`): ``graphs``
        when it is captured in CUDA graphs, ``triton`` when the Triton kernels repack (the merge kernel then takes
        the residual add before it), ``overlap_rows`` as there; ``fused_block_rows`` as there where the packed
        blocks have the fused-linear form (:meth:`fused_block_refusal`), None: the pipeline's ``fused_block_rows``
        (a test or a profile sets it), else the tuned :data:`ragged_vit.triton_impl.configs.FUSED_BLOCK_MAX_ROWS`.
        Built once per key and cached."""
        limits = (fused_block_rows, self.fused_block_rows, configs.FUSED_BLOCK_MAX_ROWS)
        limit = next(v for v in limits if v is not None)
        key = (plan.tokens, batch, graphs, triton, overlap_rows, limit, self._backend.name)
        program = self._programs.get(key)
        if program is None:
            stages = self.stages
            fused = batch * plan.tokens <= limit and self.fused_block_refusal() is None
            program = self._programs[key] = plan.program(
                batch, graphs=graphs, fuse_merge=triton and any(s.fuses_attention for s in stages),
                decide_beside_attention=bool(stages) and all(s.decides_from_keys for s in stages),
                overlap_rows=overlap_rows, fused_block_rows=limit if fused else 0,
            )  # fmt: skip
        return program

    def fused_block_refusal(self) -> str | None:
        """Why the packed blocks cannot take the fused-linear form, or None: it needs the Triton backend (its linears
        are Triton kernels beside the attention's) and blocks that have the form
        (:func:`ragged_vit.pipelines.packed_block.fused_refusal`); checked when a program is built."""
        if not isinstance(self._backend, TritonBackend):
            return f"backend {self._backend.name!r}: the fused linears run beside the Triton backend's attention"
        for k in range(self.first_packed_block, len(self.model.blocks)):
            why = fused_refusal(self.model.blocks[k])
            if why is not None:
                return f"model.blocks[{k}]: {why}"
        return None

    def extra_repr(self) -> str:
        return f"backend={self._backend.name!r}, dense_blocks={self._plan.dense_blocks}, mode={self.mode!r}"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_runner"], state["_said"] = None, set()  # CUDA graphs are neither copied nor pickled
        return state

    def graph_memory(self):
        """What the graph modes' CUDA graphs hold (:class:`ragged_vit.pipelines.graphs.GraphMemory`: the graphs,
        their keys ``(B, H, W, ...)``, the pool's and the static buffers' bytes), or None before the first capture."""
        return None if self._runner is None else self._runner.memory_report()

    def reset_graphs(self) -> None:
        """Drops the graph modes' CUDA graphs and buffers (the next call captures anew)."""
        if self._runner is not None:
            self._runner.reset()
        self._runner = None

    def forward(
        self,
        images: torch.Tensor,
        selections: Sequence[Decision] | None = None,
        return_counts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, classes]`` of ``images [B, 3, H, W]``; with ``return_counts`` also the counts ``[B, S]``.

        Runs as :attr:`mode` says: from CUDA graphs (``auto`` where the call can be captured, ``graphs``), or
        eagerly, the same forward as :meth:`run` (see it for the arguments), which it leaves the selections to.
        Eagerly without selections it needs no stage's decision over exactly the real rows, so on CUDA a
        variable-count stage reads its kept total only where the host holds no bound on it
        (:class:`ragged_vit.pipelines.executor.BoundedRepack`): ATS's forward waits for the device at none of its
        nine stages (``run``: at each), Threshold-L2 threshold/calibrated's at its one stage, as ``run``. The logits
        and counts are the caller's own tensors (a later call never overwrites them).
        """
        if self.mode != "eager":
            if self.training:
                raise RuntimeError("PrunedViT is inference only: call .eval() before running it")
            images = self.check_images(images)
            why = self._not_capturable(images, selections)
            if why is None:
                out = self._graphed(images, return_counts)
                return (out.logits, out.counts) if return_counts else out.logits
            if self.mode == "graphs":
                raise ValueError(f"mode='graphs' cannot capture this call: {why} (use mode='auto' or 'eager')")
            self._eager_because(why)
        out = self._execute(images, selections, None, bounded=selections is None, counts=return_counts)
        return (out.logits, out.counts) if return_counts else out.logits

    def _not_capturable(self, images: torch.Tensor, selections: object) -> str | None:
        """Why a forward of ``images`` cannot run from CUDA graphs, or None."""
        if selections is not None:
            return "selections are replayed eagerly (CUDA graphs make their own decisions on the device)"
        if self.native and (why := native_refusal(self)) is not None:
            return f"a NaFlexVit's native batches run eagerly here: {why}"
        if images.device.type != "cuda":
            return f"the model is on {images.device.type.upper()}: CUDA graphs need a CUDA GPU"
        caps = self._backend.capabilities
        if not caps.capturable:
            return f"backend {self._backend.name!r} cannot run in a CUDA graph: {caps.not_capturable_because}"
        if not self.native and images.shape[0] > BATCH_BUCKETS[-1]:  # (native batches: captured per exact size)
            return f"a batch of {images.shape[0]} images is above the largest graph bucket, {BATCH_BUCKETS[-1]}"
        if torch.compiler.is_compiling():
            return "called under torch.compile, which captures graphs of its own"
        return None

    def _eager_because(self, why: str) -> None:
        self.last_call = f"eager: {why}"
        if self.mode == "auto" and why not in self._said:
            self._said.add(why)
            warnings.warn(f"PrunedViT ran eagerly: {why}", EagerFallbackWarning, stacklevel=3)

    def _graphed(self, images: torch.Tensor, counts: bool) -> PrunedOutput:
        """The graph modes' forward of checked ``images``: replayed (or captured first) by this pipeline's runner
        (the counts copied out only when ``counts``)."""
        runner = self._runner
        if runner is None:
            runner = self._runner = GraphedPrunedViT(
                self, batch_buckets=BATCH_BUCKETS, max_graphs=MAX_GRAPHS, rebind=True
            )
        runner.compile_blocks = self.compile_blocks is not False and not self._compile_failed
        try:
            out = runner.run_checked(images, counts)
        except torch._dynamo.exc.TorchDynamoException as error:  # Inductor cannot compile here: plain parts
            if not runner.compile_blocks:
                raise
            self._compile_failed = True
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(f"PrunedViT's CUDA graphs run without compiled blocks: torch.compile failed "
                          f"({type(error).__name__}: {first})", EagerFallbackWarning, stacklevel=3)  # fmt: skip
            runner.reset()
            runner.compile_blocks = False
            out = runner.run_checked(images, counts)
        self.last_call = "graphs"
        return out

    def run(
        self,
        images: torch.Tensor,
        selections: Sequence[Decision] | None = None,
        on_step: OnStep | None = None,
    ) -> PrunedOutput:
        """The full forward, returning logits, per-stage counts and the selections made (or replayed).

        Args:
            images: ``[B, 3, H, W]`` float images, normalised, at the model's input size (any multiple of the patch
                size with ``dynamic_img_size``: the plan of that size runs, :meth:`plan_for`); cast to the model dtype.
            selections: one decision (:class:`TokenSelection`, or :class:`MergeSelection` for a merging pruner) per
                stage from an earlier run on the same images, to replay instead of deciding.
            on_step: called with each step of the program before it runs (instrumentation; see :data:`OnStep`).
        """
        return self._execute(images, selections, on_step, bounded=False)

    @torch.no_grad()
    def _execute(
        self,
        images: object,
        selections: Sequence[Decision] | None,
        on_step: OnStep | None,
        bounded: bool,
        counts: bool = True,
    ) -> PrunedOutput:
        """:meth:`run`; ``bounded``: with Triton packing (CUDA) and a backend that takes padding images
        (``capturable``), buffers sized by host bounds (:class:`BoundedRepack`) and no selections returned (theirs
        cover padding rows too); without ``counts`` the output's counts are an empty ``[B, 0]`` tensor (their ops are
        a share of an eager forward's host dispatches)."""
        images = self.check_inputs(images)
        selections = self._check_selections(selections)
        native = isinstance(images, NativeBatch)
        if native:
            plan = self.plan_of_tokens(images.max_patches + self.model.num_prefix_tokens, "the longest image")
        else:
            plan = self.plan_for(images.shape[-2:])
        batch, device = len(images), images.device
        triton = _packs_with_triton(device)
        bounded = bounded and triton and not plan.fixed and self._backend.capabilities.capturable
        if bounded:
            repack = BoundedRepack(host_counts(device), plan, default_sync_free_rows(len(plan.stages)))
        else:
            repack = ExactRepack(host_counts(device), reference=not triton)
        run = Run(self, self.parts, repack, selections, on_step)
        steps = self.program(plan, batch, triton=triton).steps
        if native:  # FRONT packs the images ragged and runs its blocks packed
            state, steps = native_front(self, run.parts, images, steps[0].blocks), steps[1:]
        else:
            state = ForwardState(batch, images.to(self.dtype))
        execute(run, steps, state)
        if counts:
            lengths = stage_counts(run, batch, plan.num_prefix, device)
        else:
            lengths = torch.zeros((batch, 0), dtype=torch.long, device=device)
        return PrunedOutput(state.logits, lengths, [] if bounded else run.made)

    def check_inputs(self, images: object) -> torch.Tensor:
        """Everything a forward checks before its first launch: eval mode, ``images`` (returned), the backend against
        the model's device, dtype and head dims, and the pruner's readiness."""
        if self.training:
            raise RuntimeError("PrunedViT is inference only: call .eval() before running it")
        images = self.check_images(images)
        for head_dim in self._head_dims:
            self._backend.check(images.device, self.dtype, head_dim)
        if self.stages:
            self.stages[0].check_backend(self._backend)
        if self.pruner is not None:
            self.pruner.check_ready()
        return images

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
        if isinstance(self.pruner, ToMeMerger):
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
        if self.native:
            state = native_front(self, self.parts, self.check_images(images), range(self.num_dense_blocks))
            inp = DecisionInput(state.x, state.cu_seqlens, 0, state.num_patches, num_prefix=self._plan.num_prefix)
            return self.pruner.calibrate(inp)
        x, _ = front(self, self.check_images(images).to(self.dtype))
        return self.pruner.calibrate(x, num_prefix=self._plan.num_prefix)

    def check_images(self, images: object) -> torch.Tensor:
        """Checks a batch of images for this model (float ``[B, C, H, W]`` at its input size, or with
        ``dynamic_img_size`` at any size whose height and width are positive multiples of the patch size; on its
        device); returns it. A NaFlexVit takes a list of images of their own sizes or NaFlex's patch dict
        (:func:`ragged_vit.pipelines.naflex.native_batch`), returned as their patch rows."""
        if self.native:
            return native_batch(self.model, images, self.device, self.dtype)
        images = check_tensor(images, "images", ndim=4)
        if not images.is_floating_point():
            raise TypeError(f"images must be a floating-point tensor, got {images.dtype}")
        if images.shape[1] != input_shape(self.model)[0] or not _takes_size(self.model, images.shape[-2:]):
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

    def embed_rope(
        self, images: torch.Tensor, table: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An Eva model's embedding: ``[B, 3, H, W]`` -> ``[B, N, C]`` (its ``_pos_embed``: prefix tokens, position
        embeddings resampled to the image size with ``dynamic_img_size``, then ``norm_pre``) and its rope table at
        that size (None without RoPE), the one timm's forward hands its blocks; given the ``table`` of that size
        (:meth:`rope_table`: a graph runner's static one), builds none."""
        m = self.model
        if self.gemm_patch_embed and images.is_cuda and supports_gemm(m.patch_embed):
            x = patch_embed_gemm(m.patch_embed, images)  # the image size was checked by the caller (NLC or NHWC)
        else:
            x = m.patch_embed(images)
        if table is None:
            x, table = m._pos_embed(x)
        else:
            x = embed_tokens(m, x)
        return m.norm_pre(x), table

    def rope_table(self, image_size: Sequence[int]) -> torch.Tensor | None:
        """The rope table of images of ``image_size = (H, W)`` (None without RoPE): timm's, built now (a graph runner
        builds it once per size, outside its graphs)."""
        if self.rope is None:
            return None
        (height, width), (p, q) = image_size, self.patch_size
        return rope_table(self.model, (height // p, width // q))

    def rotary_rows(self, table: torch.Tensor, batch: int, tokens: int) -> RotaryRows:
        """The rotation of an unpruned batch of ``batch`` images of ``tokens`` rows (FRONT's), by the rope ``table``
        of their size (:class:`ragged_vit.pipelines.eva.RotaryRows`)."""
        return rotary_rows(self.rope, table, self._rope_blocks, batch, tokens, self.model.num_prefix_tokens)

    def decision_input(self, index: int, state: ForwardState) -> DecisionInput:
        """What stage ``index`` decides on, from the state its DECIDE step finds (also for timing a decision alone)."""
        return self.stages[index].decision_input(state)

    def _check_selections(self, selections: Sequence[Decision] | None) -> list[Decision] | None:
        if selections is None:
            return None
        selections = list(selections)
        if len(selections) != self.num_stages:
            raise ValueError(
                f"selections must hold one decision per stage ({self.num_stages}), got {len(selections)}"
            )
        kind = self.stages[0].selection_type if self.stages else None
        for i, sel in enumerate(selections):
            if not isinstance(sel, kind):
                raise TypeError(f"selections[{i}] must be a {kind.__name__}, got {type(sel).__name__}")
        return selections




def _packs_with_triton(device: torch.device) -> bool:
    """Whether an eager forward repacks with the Triton kernels on ``device`` (CUDA; the CPU: the reference)."""
    return device.type == "cuda"


def _check_model(model: object) -> RopeSpec | None:
    """Raises unless ``model`` is a timm ``VisionTransformer``, ``Eva`` or ``NaFlexVit`` the runtime takes; returns an
    Eva or NaFlexVit model's rope (:func:`ragged_vit.pipelines.eva.check_eva`)."""
    spec = None
    if is_eva(model):
        spec = check_eva(model)
    elif is_naflex(model):
        spec = check_naflex(model)
    elif not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a timm VisionTransformer, Eva or NaFlexVit, got {type(model).__name__}")
    pool_of(model)  # a pooling the head supports
    return spec


def _embedding(model: nn.Module) -> nn.Module:
    """The patch embedding module (its ``patch_size`` and ``proj``): a NaFlexVit's ``embeds``, else ``patch_embed``."""
    return model.embeds if is_naflex(model) else model.patch_embed


def input_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(C, H, W)`` of the images a timm ViT takes at its own size: a NaFlexVit's position-embedding grid in pixels
    (it takes other sizes too), else its ``patch_embed``'s ``img_size``."""
    if is_naflex(model):
        return (model.embeds.in_chans, *native_image_size(model))
    return (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)


def _allowed_shape(model: VisionTransformer) -> str:
    """The image shapes ``model`` takes, for error messages."""
    if is_naflex(model):
        p, q = model.embeds.patch_size
        return f"(H, W) with H a positive multiple of {p} and W of {q} (NaFlexVit)"
    channels, height, width = input_shape(model)
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
    if not getattr(model, "dynamic_img_size", False) and not is_naflex(model):
        return (height, width) == tuple(model.patch_embed.img_size)
    p, q = _embedding(model).patch_size
    return height > 0 and width > 0 and height % p == 0 and width % q == 0


def _check_stages(plan: ForwardPlan, pruner: Pruner | None, model: VisionTransformer, size: str) -> None:
    """What a model's prefix rows allow: a class token for pruners that score by its attention, and at least one
    row per image after every stage (at the image size ``size``, ``"HxW"``)."""
    if pruner is None:
        return
    if pruner.needs_attention and not _has_class_token(model):
        raise ValueError(
            f"pruner {pruner.name!r} scores patches by the class token's attention row, and the model has no class "
            "token (class_token=False): use a pruner that scores the tokens themselves (threshold_l2, dynamicvit)"
        )
    if plan.num_prefix == 0 and any(s.rows_after == 0 for s in plan.stages):
        raise ValueError(
            f"pruner {pruner.name!r} would leave images without a single row on this model (no prefix tokens) at "
            f"{size}: rows after each stage {[s.rows_after for s in plan.stages]}"
        )


def _has_class_token(model: nn.Module) -> bool:
    """Whether ``model``'s first prefix row is a class token (a NaFlexVit keeps it in its ``embeds``)."""
    return getattr(model, "cls_token", None) is not None or bool(getattr(model, "has_class_token", False))


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
