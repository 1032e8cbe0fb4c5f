"""The pruner interface: where a pruner acts, what it sees, and the one result type it returns.

Every pruner works on the packed layout (``x [T, C]`` + ``cu_seqlens``); a dense batch ``[B, N, C]`` is the
special case of equal lengths (:func:`ragged_vit.core.segments.uniform_cu_seqlens`), so one code path serves the
first stage (on a padded batch) and later stages (on an already packed buffer). Pruners that keep a fixed
count per image say so, and tell the count on the host, so packing needs no device-to-host read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from ragged_vit.core.validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_tensor

_SCORE_DTYPES = (*FLOAT_DTYPES, torch.float64)


class Placement(str, enum.Enum):
    """Where in a transformer block a pruning stage acts (timm block ``k``, 0-indexed)."""

    BEFORE_BLOCK = "before_block"  # on the input of block k (DynamicViT: before blocks 3, 6, 9)
    MID_BLOCK = "mid_block"  # after block k's attention residual, before its MLP (EViT, ATS)
    AFTER_BLOCK = "after_block"  # on the output of block k (Threshold-L2 after block 3)


@dataclass
class PruneInput:
    """What a pruner sees at one stage, always packed.

    Attributes:
        x: ``[T, C]`` residual stream at the placement point (for MID_BLOCK: after the attention residual).
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``; row ``cu_seqlens[b]`` is image ``b``'s CLS token.
        stage: index of this stage in the pruner's schedule (0 for the first).
        num_patches: patches of the unpruned image (196 at 224x224), for counts defined on the original.
        cls_attn: fp32 ``[T, H]`` CLS-query attention of this block (:func:`ragged_vit.reference.cls_attention`);
            given to pruners with ``needs_attention``.
        v: ``[T, H*D]`` value vectors of this block; given to pruners with ``needs_attention``.
    """

    x: torch.Tensor
    cu_seqlens: torch.Tensor
    stage: int
    num_patches: int
    cls_attn: torch.Tensor | None = None
    v: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenSelection:
    """The decision of one pruning stage.

    Attributes:
        keep: bool mask over the input rows: ``[T]`` for packed input (``[B, N]`` from :meth:`Pruner.select`
            on a dense batch). Each image's CLS row is always True.
        fixed_count: True when every image keeps the same number of rows.
        count: rows per image after the stage (CLS and extra token included) when ``fixed_count``, a host
            int known without reading the device; else None.
        extra_token: ``[B, C]`` one extra token per image appended after its kept rows (EViT's fused token),
            or None.
        kept: int ``[B]`` rows each image keeps (CLS included, extra token excluded) when the pruner counted
            them on the device as it decided (the fused Triton Threshold-L2 does), so packing need not recount
            them; else None.
    """

    keep: torch.Tensor
    fixed_count: bool
    count: int | None = None
    extra_token: torch.Tensor | None = None
    kept: torch.Tensor | None = None


def check_prune_input(inp: object, *, attention: bool = False, values: bool = False) -> PruneInput:
    """Checks a :class:`PruneInput` at a pruner's entry; ``attention`` / ``values`` require ``cls_attn`` / ``v``."""
    if not isinstance(inp, PruneInput):
        raise TypeError(f"inp must be a PruneInput, got {type(inp).__name__}")
    x = check_tensor(inp.x, "inp.x", ndim=2, dtypes=_SCORE_DTYPES)
    check_cu_seqlens(inp.cu_seqlens, total=x.shape[0], device=x.device, name="inp.cu_seqlens")
    check_int(inp.stage, "inp.stage", 0)
    check_int(inp.num_patches, "inp.num_patches", 1)
    required = {"cls_attn": attention, "v": values}
    for name, needed in required.items():
        if not needed:
            continue
        value = getattr(inp, name)
        if value is None:
            raise ValueError(f"inp.{name} is required by this pruner (it scores tokens by attention), got None")
        check_tensor(value, f"inp.{name}", ndim=2, dtypes=_SCORE_DTYPES, device=x.device)
        if value.shape[0] != x.shape[0]:
            raise ValueError(f"inp.{name} must have {x.shape[0]} rows like inp.x, got shape {tuple(value.shape)}")
    return inp


class Pruner(nn.Module):
    """Base class of every pruner: one stage schedule, one ``forward(PruneInput) -> TokenSelection``.

    Subclasses set ``placement``, ``blocks`` (the timm block index of each stage), ``fixed_count`` and
    ``needs_attention``, and implement :meth:`forward` on the packed layout. Pruners with weights
    (DynamicViT) hold them as submodules so their state-dict keys load from official checkpoints.
    """

    name: str = "pruner"
    placement: Placement
    blocks: tuple[int, ...]
    fixed_count: bool
    needs_attention: bool = False

    def count_after(self, stage: int, current: int, num_patches: int) -> int | None:
        """Rows per image after ``stage`` given ``current`` rows before it (CLS included), or None if variable."""
        return None

    def max_count_after(self, stage: int, current: int, num_patches: int) -> int:
        """An upper bound on any image's rows after ``stage`` given at most ``current`` rows before it (CLS
        included), known on the host: :meth:`count_after` where the count is fixed, else ``current`` (nothing
        known). Variable-count pruners with a tighter bound override it (ATS keeps at most its sample count);
        the CUDA-graph runner sizes its buffers with it (``ragged_vit.pipelines.buckets.plan_segments``)."""
        count = self.count_after(stage, current, num_patches)
        return current if count is None else count

    def forward(self, inp: PruneInput) -> TokenSelection:  # pragma: no cover - abstract
        raise NotImplementedError

    def select(
        self, x: torch.Tensor, stage: int = 0, num_patches: int | None = None, **extra: torch.Tensor
    ) -> TokenSelection:
        """Convenience entry on a dense batch ``[B, N, C]``: returns a selection whose ``keep`` is ``[B, N]``.

        ``num_patches`` defaults to ``N - 1`` (an unpruned batch). ``extra`` passes ``cls_attn`` ``[B, N, H]``
        and ``v`` ``[B, N, H*D]`` for attention-based pruners.
        """
        from ragged_vit.core.segments import uniform_cu_seqlens

        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a [B, N, C] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        batch, n, c = x.shape
        if batch == 0:
            raise ValueError("x must hold at least one image, got batch size 0")
        flat = {k: v.reshape(batch * n, *v.shape[2:]) for k, v in extra.items()}
        inp = PruneInput(
            x=x.reshape(batch * n, c),
            cu_seqlens=uniform_cu_seqlens(batch, n, x.device),
            stage=stage,
            num_patches=n - 1 if num_patches is None else num_patches,
            **flat,
        )
        sel = self(inp)
        return TokenSelection(sel.keep.view(batch, n), sel.fixed_count, sel.count, sel.extra_token, sel.kept)
