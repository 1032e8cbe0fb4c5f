"""A token-pruned timm ViT end to end: dense blocks, pruning stages, packed blocks, head.

:class:`PrunedViT` wraps a timm ``VisionTransformer`` (its modules and parameter names untouched, so official
checkpoints load) and a pruner from :mod:`ragged_vit.reference.pruners`, and runs:

1. timm's own embedding and the blocks before the first pruning stage, on the dense ``[B, N, C]`` batch;
2. at the first stage, the batch viewed as packed (``[B*N, C]``, uniform ``cu_seqlens``) and pruned;
3. every later block on the packed buffer (:func:`ragged_vit.pipelines.packed_block.packed_block`), attention through
the
   chosen backend, later stages repacking the packed buffer directly (no detour through padding);
4. ``model.norm``, ``fc_norm`` and ``head`` on each image's CLS row: logits ``[B, classes]`` in input order.

The stage schedule comes from the pruner: ``pruner.blocks`` and ``pruner.placement`` (before a block, between
its attention residual and its MLP, or after it). The decisions of a run (one :class:`TokenSelection` per stage)
are returned, and a later run may replay them (``selections=``), so two backends see exactly the same keep masks
and differ only in layout and attention. A replayed selection is used as recorded, EViT's fused token included
(cast to the replaying run's dtype): it is part of the decision.

Packing: on CUDA the sync-free kernels of :mod:`ragged_vit.triton_impl.pack` (fixed-count pruners pass ``count`` from
the host, so nothing synchronises; a variable-count stage reads its total and longest image once, in one transfer, so
that every backend gets the exact longest length). On the CPU :mod:`ragged_vit.reference.packing` is used: the CPU path
exists to run the reference backend without a GPU, and Triton's pack kernels would only run there under the interpreter,
slowly.

Supported: timm ``VisionTransformer`` with a class token, no register tokens, ``global_pool='token'`` (DeiT,
original ViT), blocks from the first stage on being timm ``Block``/``Attention``; inference only (eval mode).
Not supported: distilled DeiT (two prefix tokens), average/attention pooling, dynamic image sizes other than the
model's, training.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ragged_vit.core.segments import segment_ids, segment_sum, seqlens, uniform_cu_seqlens
from ragged_vit.core.selection import Placement, PruneInput, Pruner, TokenSelection
from ragged_vit.core.validation import check_tensor
from ragged_vit.pipelines.backends import AttentionBackend, make_backend
from ragged_vit.pipelines.packed_block import check_packable, compiled_blocks, packed_block, packed_blocks
from ragged_vit.pipelines.patch_embed import patch_embed_gemm, supports_gemm
from ragged_vit.reference import packing as ref_packing
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.pruners.ats import ATSPruner
from ragged_vit.reference.pruners.threshold_l2 import ThresholdL2Pruner
from ragged_vit.triton_impl import pack as triton_pack
from ragged_vit.triton_impl.ats import ats_select
from ragged_vit.triton_impl.threshold_l2 import threshold_l2_select


@dataclass
class PrunedOutput:
    """What one forward of :class:`PrunedViT` produces.

    Attributes:
        logits: ``[B, classes]`` in input order.
        counts: int64 ``[B, S]``: tokens per image after each of the ``S`` stages, CLS excluded (EViT's fused
            token counted, as the golden counts 139/99/71 do). On CUDA it is not read back.
        selections: the decision of each stage, to replay in another run (``PrunedViT.run(selections=...)``).
    """

    logits: torch.Tensor
    counts: torch.Tensor
    selections: list[TokenSelection] = field(default_factory=list)


@dataclass(frozen=True)
class _Stage:
    index: int  # position in pruner.blocks (PruneInput.stage)
    block: int  # timm block index
    placement: Placement

    @property
    def boundary(self) -> int | None:
        """Index of the block whose input this stage prunes (BEFORE k and AFTER k-1 prune the same tensor)."""
        if self.placement == Placement.BEFORE_BLOCK:
            return self.block
        if self.placement == Placement.AFTER_BLOCK:
            return self.block + 1
        return None


class PrunedViT(nn.Module):
    """A timm ViT with token pruning and packed (ragged) blocks.

    Args:
        model: a timm ``VisionTransformer`` (``timm.create_model``); its modules are used as they are.
        pruner: a :class:`ragged_vit.core.selection.Pruner`, or None for the unpruned model (then every block runs
            timm's own dense forward and the backend is unused).
        backend: attention backend name (see :data:`ragged_vit.pipelines.backends.BACKENDS`) or instance.
        compile_blocks: run every block's non-attention work through ``torch.compile`` (Inductor fusions around
            the GEMMs; the attention backend stays one op). Compiles on first use of each shape.
        gemm_patch_embed: on CUDA, compute the patch embedding as one GEMM on patch rows instead of cuDNN's
            strided convolution (:mod:`ragged_vit.pipelines.patch_embed`; same math, rounding-level differences). The
            CPU always runs timm's own convolution.

    The module is put in eval mode; it is inference only.
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
        self._stages = (
            ()
            if pruner is None
            else tuple(_Stage(i, b, Placement(pruner.placement)) for i, b in enumerate(pruner.blocks))
        )
        self._start = min(
            (s.boundary if s.boundary is not None else s.block for s in self._stages), default=len(model.blocks)
        )
        for k in range(self._start, len(model.blocks)):
            check_packable(model.blocks[k], f"model.blocks[{k}]")
        self._steps = _schedule(self._stages, self._start, len(model.blocks))
        self.eval()

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
        return len(self._stages)

    @property
    def num_dense_blocks(self) -> int:
        """Blocks run densely by timm before the first stage; the rest run packed."""
        return self._start

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.model.patch_embed.img_size)

    def extra_repr(self) -> str:
        return f"backend={self._backend.name!r}, dense_blocks={self._start}"

    def forward(
        self,
        images: torch.Tensor,
        selections: Sequence[TokenSelection] | None = None,
        return_counts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, classes]`` of ``images [B, 3, H, W]``; with ``return_counts`` also the counts ``[B, S]``.

        See :meth:`run` for the arguments and for the recorded selections.
        """
        out = self.run(images, selections)
        return (out.logits, out.counts) if return_counts else out.logits

    @torch.no_grad()
    def run(self, images: torch.Tensor, selections: Sequence[TokenSelection] | None = None) -> PrunedOutput:
        """The full forward, returning logits, per-stage counts and the selections made (or replayed).

        Args:
            images: ``[B, 3, H, W]`` float images at the model's input size, normalised; cast to the model dtype.
            selections: one :class:`TokenSelection` per stage from an earlier run on the same images, to replay
                instead of running the pruner.
        """
        if self.training:
            raise RuntimeError("PrunedViT is inference only: call .eval() before running it")
        images = self._check_images(images)
        dtype = self.model.cls_token.dtype
        self._backend.check(images.device, dtype)
        selections = self._check_selections(selections)

        x = self.front(images.to(dtype))  # [B, N, C]
        batch, n, channels = x.shape
        made: list[TokenSelection] = []
        counts: list[torch.Tensor] = []
        if not self._stages:
            return PrunedOutput(self._head(x[:, 0]), x.new_zeros((batch, 0), dtype=torch.long), made)

        def prune(stage: _Stage, x: torch.Tensor, cu: torch.Tensor, max_seqlen: int, qkv: torch.Tensor | None = None):
            if selections is not None:
                sel = selections[stage.index]
            else:
                sel = self.decide(stage, x, cu, n - 1, qkv, max_seqlen)
            x, cu, max_seqlen = _repack(x, cu, max_seqlen, sel, stage.index)
            made.append(sel)
            counts.append(seqlens(cu) - 1)
            return x, cu, max_seqlen

        x, cu, max_seqlen = x.reshape(batch * n, channels), uniform_cu_seqlens(batch, n, x.device), n
        blocks = self.model.blocks
        run_blocks = compiled_blocks() if self.compile_blocks else packed_blocks
        for step in self._steps:
            if step.kind == "prune":
                x, cu, max_seqlen = prune(step.stage, x, cu, max_seqlen)
            elif step.kind == "mid":
                hook = functools.partial(prune, step.stage)
                block = blocks[step.blocks[0]]
                x, cu, max_seqlen = packed_block(block, x, cu, max_seqlen, self._backend, hook, self.compile_blocks)
            else:
                x = run_blocks([blocks[k] for k in step.blocks], x, cu, max_seqlen, self._backend)
        cls = x.index_select(0, cu[:-1])  # [B, C]: every image's CLS row, one gather
        return PrunedOutput(self._head(cls), torch.stack(counts, dim=1), made)

    @torch.no_grad()
    def calibrate(self, images: torch.Tensor) -> float:
        """Calibrates a pruner with a ``calibrate(x [B, N, C])`` method (Threshold-L2 ``calibrated`` mode) on the
        residual stream its (single, before/after-block) stage sees for ``images``; returns its threshold."""
        if self.pruner is None or not hasattr(self.pruner, "calibrate"):
            raise ValueError(f"pruner {getattr(self.pruner, 'name', None)!r} has no calibrate() method")
        first = self._stages[0]
        if first.boundary is None:
            raise NotImplementedError("calibrate() supports before/after-block stages only")
        x = self._embed(self._check_images(images).to(self.model.cls_token.dtype))
        for blk in self.model.blocks[: first.boundary]:
            x = blk(x)
        return self.pruner.calibrate(x)

    def front(self, images: torch.Tensor) -> torch.Tensor:
        """Embedding and the dense blocks before the first stage, on checked images in the model dtype:
        ``[B, 3, H, W]`` -> ``[B, N, C]`` (one compiled graph with ``compile_blocks``)."""
        return (_compiled_front() if self.compile_blocks else _front)(self, images)

    def decide(
        self,
        stage: _Stage,
        x: torch.Tensor,
        cu: torch.Tensor,
        num_patches: int,
        qkv: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> TokenSelection:
        """One stage's decision on the packed stream ``x`` (and its block's ``qkv`` for attention-based pruners);
        ``max_seqlen`` bounds the images' rows (None: ``num_patches + 1``).

        ``pruner(inp)``, except on CUDA: Threshold-L2 runs its fused Triton twin
        (:mod:`ragged_vit.triton_impl.threshold_l2`: the same keep masks bit for bit, one kernel instead of ~40), ATS
        its two-kernel twin (:mod:`ragged_vit.triton_impl.ats`: the same decisions up to the CDF's fp32 rounding, 2
        kernels instead of ~250), and with ``compile_blocks`` the other pruners run under ``torch.compile`` together
        with their CLS-attention scores (Inductor fuses their segment operations; its reductions may round differently,
        like the compiled blocks).
        """
        if x.is_cuda and type(self.pruner) is ThresholdL2Pruner:
            return threshold_l2_select(self.pruner, self._prune_input(stage, x, cu, num_patches, qkv))
        if x.is_cuda and type(self.pruner) is ATSPruner:
            attn = self.model.blocks[stage.block].attn
            return ats_select(self.pruner, qkv, cu, num_patches, attn.num_heads, attn.scale, max_seqlen)
        if x.is_cuda and self.compile_blocks:
            attn = self.model.blocks[stage.block].attn
            return _compiled_decision()(self.pruner, x, cu, stage.index, num_patches, qkv, attn.num_heads, attn.scale)
        return self.pruner(self._prune_input(stage, x, cu, num_patches, qkv))

    def _embed(self, images: torch.Tensor) -> torch.Tensor:
        m = self.model
        if self.gemm_patch_embed and images.is_cuda and supports_gemm(m.patch_embed):
            x = patch_embed_gemm(m.patch_embed, images)  # the image size was checked by the caller
        else:
            x = m.patch_embed(images)
        return m.norm_pre(m.patch_drop(m._pos_embed(x)))

    def _head(self, cls: torch.Tensor) -> torch.Tensor:
        # timm: norm on every token, then 'token' pooling picks CLS; per-token norms commute with that choice.
        m = self.model
        return m.head(m.head_drop(m.fc_norm(m.norm(cls))))

    def _prune_input(
        self, stage: _Stage, x: torch.Tensor, cu: torch.Tensor, num_patches: int, qkv: torch.Tensor | None
    ) -> PruneInput:
        attn = self.model.blocks[stage.block].attn
        return prune_input(self.pruner, x, cu, stage.index, num_patches, qkv, attn.num_heads, attn.scale)

    def _check_images(self, images: object) -> torch.Tensor:
        images = check_tensor(images, "images", ndim=4)
        if not images.is_floating_point():
            raise TypeError(f"images must be a floating-point tensor, got {images.dtype}")
        channels = self.model.patch_embed.proj.in_channels
        height, width = self.image_size
        expected = (channels, height, width)
        if tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images must have shape [B, {channels}, {height}, {width}] for this model, got {list(images.shape)}"
            )
        if images.shape[0] == 0:
            raise ValueError("images must hold at least one image, got batch size 0")
        device = self.model.cls_token.device
        if images.device != device:
            raise ValueError(f"images must be on the model's device {device}, got {images.device}")
        return images

    def _check_selections(self, selections: Sequence[TokenSelection] | None) -> list[TokenSelection] | None:
        if selections is None:
            return None
        selections = list(selections)
        if len(selections) != len(self._stages):
            raise ValueError(
                f"selections must hold one TokenSelection per stage ({len(self._stages)}), got {len(selections)}"
            )
        for i, sel in enumerate(selections):
            if not isinstance(sel, TokenSelection):
                raise TypeError(f"selections[{i}] must be a TokenSelection, got {type(sel).__name__}")
        return selections


@dataclass(frozen=True)
class _Step:
    """One step of the packed part of a forward: a pruning stage at a block boundary (``prune``), a block with
    a stage between its halves (``mid``), or a run of consecutive blocks with no stage (``blocks``)."""

    kind: str  # "prune" | "mid" | "blocks"
    blocks: tuple[int, ...] = ()
    stage: _Stage | None = None


def _schedule(stages: tuple[_Stage, ...], start: int, depth: int) -> tuple[_Step, ...]:
    """The steps from block ``start`` to the head, runs of stage-free blocks grouped (one compiled graph each)."""
    steps: list[_Step] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            steps.append(_Step("blocks", tuple(run)))
            run.clear()

    for k in range(start, depth + 1):
        at_boundary = [s for s in stages if s.boundary == k]
        if at_boundary:
            flush()
            steps.extend(_Step("prune", stage=s) for s in at_boundary)
        if k == depth:
            break
        mid = next((s for s in stages if s.placement == Placement.MID_BLOCK and s.block == k), None)
        if mid is None:
            run.append(k)
        else:
            flush()
            steps.append(_Step("mid", (k,), mid))
    flush()
    return tuple(steps)


def _front(pipeline: PrunedViT, images: torch.Tensor) -> torch.Tensor:
    """Embedding and the dense blocks before the first stage: ``[B, 3, H, W]`` -> ``[B, N, C]``."""
    x = pipeline._embed(images)
    for block in pipeline.model.blocks[: pipeline.num_dense_blocks]:
        x = block(x)
    return x


@functools.cache
def _compiled_front():
    return torch.compile(_front)


def prune_input(
    pruner: Pruner,
    x: torch.Tensor,
    cu: torch.Tensor,
    stage: int,
    num_patches: int,
    qkv: torch.Tensor | None,
    num_heads: int,
    scale: float,
) -> PruneInput:
    """What ``pruner`` sees at a stage; attention-based pruners also get the CLS-attention row and the values."""
    cls_attn = v = None
    if pruner.needs_attention:
        q, k, v = split_qkv(qkv, num_heads)
        cls_attn = cls_attention(q, k, cu, scale)  # fp32 [T, H]
        v = v.flatten(1)  # [T, H*D]
    return PruneInput(x=x, cu_seqlens=cu, stage=stage, num_patches=num_patches, cls_attn=cls_attn, v=v)


def _decision(pruner: Pruner, *args: object) -> TokenSelection:
    return pruner(prune_input(pruner, *args))


@functools.cache
def _compiled_decision():
    return torch.compile(_decision)


def _repack(
    x: torch.Tensor, cu: torch.Tensor, max_seqlen: int, sel: TokenSelection, index: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Applies one stage's selection to the packed buffer: ``(x', cu', exact longest length)``."""
    keep = sel.keep
    if keep.dim() != 1 or keep.shape[0] != x.shape[0] or keep.device != x.device:
        raise ValueError(
            f"selections[{index}].keep must be a [{x.shape[0]}] mask on {x.device} (this batch's "
            f"packed rows), got shape {tuple(keep.shape)} on {keep.device}: "
            "replay selections only on the images they were made for"
        )
    extra = None if sel.extra_token is None else sel.extra_token.to(x.dtype)
    if x.device.type != "cuda":
        return ref_packing.repack(x, cu, keep, extra)
    if sel.fixed_count and sel.count is not None:
        tokens, new_cu, _ = triton_pack.repack(
            x, cu, keep, max_seqlen, count=sel.count, extra_token=extra, kept=decision_counts(sel)
        )
        return tokens, new_cu, sel.count
    lens = kept_rows(sel, cu) + (extra is not None)
    total, longest = torch.stack([lens.sum(), lens.max()]).tolist()  # the one sync of a variable-count stage
    tokens, new_cu, _ = triton_pack.repack(
        x, cu, keep, max_seqlen, capacity=total, extra_token=extra, kept=decision_counts(sel)
    )
    return tokens, new_cu, longest


def decision_counts(sel: TokenSelection) -> torch.Tensor | None:
    """``sel.kept`` when a decision kernel counted the rows (int32 ``[B]``), for the repack to skip its own count;
    else None."""
    kept = sel.kept
    return kept if kept is not None and kept.dtype == torch.int32 and kept.is_contiguous() else None


def kept_rows(sel: TokenSelection, cu: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the rows each image of ``cu``'s batch keeps (CLS included, an extra token excluded)."""
    if sel.kept is not None:
        return sel.kept.long()
    return segment_sum(sel.keep.long(), segment_ids(cu, sel.keep.shape[0]), cu.numel() - 1)


def _check_model(model: object) -> None:
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a timm VisionTransformer, got {type(model).__name__}")
    if model.cls_token is None or model.num_prefix_tokens != 1:
        raise NotImplementedError(
            "model must have exactly one prefix token (a class token, no register or "
            f"distillation tokens), got num_prefix_tokens={model.num_prefix_tokens}"
        )
    if model.global_pool != "token" or getattr(model, "attn_pool", None) is not None:
        raise NotImplementedError(
            f"model must pool with its class token (global_pool='token'), got global_pool={model.global_pool!r}"
        )
    if getattr(model, "dynamic_img_size", False):
        raise NotImplementedError("model must have a fixed input size (dynamic_img_size=False)")


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
