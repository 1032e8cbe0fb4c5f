"""The decision interface of a pruning stage: where it acts, what it sees, and the one result type it returns.

Every decision works on the packed layout (``x [T, C]`` + ``cu_seqlens``); a dense batch ``[B, N, C]`` is the
special case of equal lengths (:func:`ragged_vit.core.segments.uniform_cu_seqlens`), so one code path serves the
first stage (on a dense batch) and later stages (on an already packed buffer).

* :class:`DecisionInput` -- what a stage's decision sees: the packed residual stream, its offsets, a host bound on
  an image's rows, and for pruners that score by attention the block's qkv projection (or the CLS attention
  itself).
* :class:`TokenSelection` -- what a pruning stage returns: the keep mask over the packed rows and the rows each
  image keeps, counted on the device (so packing needs no count of its own and no device-to-host read), plus the
  count itself when the host knows it.
* :class:`MergeSelection` -- what a merging stage (ToMe) returns: every row's destination row in the merged buffer
  (rows merged together share one), the rows each image has after the merge and the merged offsets. The repack
  applies it as a size-weighted average and writes the merged rows' sizes (the patches each holds).
  :data:`Decision` is either.
* :class:`Pruner` -- the ground-truth decision (``forward`` checks its input, :meth:`Pruner.decide` decides);
  faster device implementations register for a pruner type in :mod:`ragged_vit.core.decisions`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from .rotary import Rotary, check_rotary
from .segments import segment_ids, segment_sum, uniform_cu_seqlens, uniform_length
from .validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_tensor

_SCORE_DTYPES = (*FLOAT_DTYPES, torch.float64)


class Placement(str, enum.Enum):
    """Where in a transformer block a pruning stage acts (timm block ``k``, 0-indexed)."""

    BEFORE_BLOCK = "before_block"  # on the input of block k (DynamicViT: before blocks 3, 6, 9)
    MID_BLOCK = "mid_block"  # after block k's attention residual, before its MLP (EViT, ATS)
    AFTER_BLOCK = "after_block"  # on the output of block k (Threshold-L2 after block 3)


@dataclass(frozen=True)
class DecisionInput:
    """What a stage's decision sees, always packed.

    Attributes:
        x: ``[T, C]`` residual stream at the placement point (for MID_BLOCK: after the attention residual).
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``; image ``b``'s rows start at ``cu_seqlens[b]`` with its
            ``num_prefix`` prefix rows (the class token first, where the model has one).
        stage: index of this stage in the pruner's schedule (0 for the first).
        num_patches: patches of the unpruned image (196 at 224x224), for counts defined on the original.
        max_seqlen: a host bound on every image's rows (None: ``num_patches + num_prefix``, an unpruned image);
            kernels size their tiles with it.
        qkv: ``[T, 3*H*D]`` the stage block's qkv projection (timm's layout), for pruners that score by attention
            (``Pruner.needs_attention``); the pipeline gives it at MID_BLOCK stages.
        num_heads, scale: ``H`` and the softmax scale of that attention (with ``qkv``).
        cls_attn: fp32 ``[T, H]`` CLS-query attention, given instead of ``qkv`` (e.g. by tests); derived from ``qkv``
            otherwise (:func:`ragged_vit.reference.cls_attention.attention_inputs`).
        v: ``[T, H*D]`` value vectors, given with ``cls_attn``.
        num_prefix: prefix rows at the start of every image (class, distillation, register tokens: 1 for DeiT, 0
            for a model without any): always kept, never scored. A model without prefix rows keeps at least one
            row (its best-scoring patch) of every image.
        image_patches: int64 ``[B]``: each image's own unpruned patch count, in a batch of images of different sizes
            (native resolution); ``num_patches`` is then the largest. None: every image has ``num_patches``.
        rotary: a RoPE model's rotation of the queries and keys in ``qkv`` (:class:`ragged_vit.core.rotary.Rotary`),
            which its block's attention applies as it reads them: a decision that scores by attention rotates them
            too (the Triton kernels as they load them). None: ``qkv`` as the scores read it.
    """

    x: torch.Tensor
    cu_seqlens: torch.Tensor
    stage: int
    num_patches: int
    max_seqlen: int | None = None
    qkv: torch.Tensor | None = None
    num_heads: int | None = None
    scale: float | None = None
    cls_attn: torch.Tensor | None = None
    v: torch.Tensor | None = None
    num_prefix: int = 1
    image_patches: torch.Tensor | None = None
    rotary: Rotary | None = None

    @property
    def row_bound(self) -> int:
        """``max_seqlen``, or ``num_patches + num_prefix`` (an unpruned image) when none was given."""
        return self.num_patches + self.num_prefix if self.max_seqlen is None else self.max_seqlen

    @property
    def uniform_rows(self) -> int | None:
        """Rows per image when the batch is uniform, from host shapes (:func:`ragged_vit.core.segments.uniform_length`),
        else None. A batch of several image sizes (``image_patches``) is ragged whatever its total: ``T % B == 0``
        says nothing there, and the GPU does not read the offsets to check."""
        return None if self.image_patches is not None else uniform_length(self.cu_seqlens, self.x.shape[0])

    @property
    def min_patches(self) -> int:
        """Patches every image keeps at the least whatever the rule: 1 without prefix rows (no image may end up
        empty), else 0."""
        return int(self.num_prefix == 0)


@dataclass(frozen=True)
class TokenSelection:
    """The decision of one pruning stage.

    Attributes:
        keep: bool mask over the input rows: ``[T]`` for packed input (``[B, N]`` from :meth:`Pruner.select`
            on a dense batch). Each image's prefix rows are always True.
        kept: int32 ``[B]`` (contiguous, on ``keep``'s device): the rows each image keeps, prefix rows included, an
            extra token excluded, counted on the device as the decision was made.
        fixed_count: True when every image keeps the same number of rows.
        count: rows per image after the stage (prefix rows and extra token included) when ``fixed_count``, a host
            int known without reading the device; else None.
        extra_token: ``[B, C]`` one extra token per image appended after its kept rows (EViT's fused token),
            or None.
    """

    keep: torch.Tensor
    kept: torch.Tensor
    fixed_count: bool = False
    count: int | None = None
    extra_token: torch.Tensor | None = None


@dataclass(frozen=True)
class MergeSelection:
    """The decision of one merging stage (ToMe), as a destination map.

    Attributes:
        destination: int32 (or int64) ``[T]``: the row of the merged buffer each input row goes to; rows merged
            together share it, every merged row receives at least one input row, each image's rows stay inside its
            own merged rows (its prefix rows first, unmerged).
        kept: int32 ``[B]``: rows of each image after the merge, prefix rows included (as ``TokenSelection.kept``).
        cu_seqlens: int32 ``[B+1]`` offsets of the merged buffer (``T' = cu_seqlens[-1]``, on the device).
        fixed_count: True when every image has the same number of rows after the merge.
        count: rows per image after the merge (prefix rows included) when ``fixed_count``, a host int; else None.
        sources: optional int32 ``[T]``, the map as source lists: the input rows grouped by destination, in row
            order inside a group (``ragged_vit.reference.merging.merge_sources`` defines them); the Triton matching
            writes them so that the merge reads its rows directly. None: the merge derives them from the map.
        source_offsets: int32 ``[T + 1]`` with ``sources``: where each merged row's group starts; entry ``T'`` is
            ``T``, the entries after it are unspecified.
    """

    destination: torch.Tensor
    kept: torch.Tensor
    cu_seqlens: torch.Tensor
    fixed_count: bool = False
    count: int | None = None
    sources: torch.Tensor | None = None
    source_offsets: torch.Tensor | None = None


Decision = TokenSelection | MergeSelection
"""What a stage's decision returns: a keep mask (pruning) or a destination map (merging)."""


def kept_counts(keep: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The rows each image keeps: bool ``[T]`` + offsets ``[B+1]`` -> int32 ``[B]`` (no host read)."""
    batch = cu_seqlens.numel() - 1
    return segment_sum(keep.to(torch.int32), segment_ids(cu_seqlens, keep.shape[0]), batch)


def check_decision_input(inp: object, *, attention: bool = False, values: bool = False) -> DecisionInput:
    """Checks a :class:`DecisionInput` at a decision's public entry.

    ``attention`` requires the CLS attention (``cls_attn``, or ``qkv`` with ``num_heads`` and ``scale``); ``values``
    requires the value vectors (``v``, or ``qkv``).
    """
    if not isinstance(inp, DecisionInput):
        raise TypeError(f"inp must be a DecisionInput, got {type(inp).__name__}")
    x = check_tensor(inp.x, "inp.x", ndim=2, dtypes=_SCORE_DTYPES)
    check_cu_seqlens(inp.cu_seqlens, total=x.shape[0], device=x.device, name="inp.cu_seqlens")
    check_int(inp.stage, "inp.stage", 0)
    check_int(inp.num_patches, "inp.num_patches", 1)
    check_int(inp.num_prefix, "inp.num_prefix", 0)
    if inp.max_seqlen is not None:
        check_int(inp.max_seqlen, "inp.max_seqlen", 1)
    if inp.image_patches is not None:
        check_tensor(inp.image_patches, "inp.image_patches", ndim=1, dtypes=(torch.int64,), device=x.device)
        if inp.image_patches.shape[0] != inp.cu_seqlens.shape[0] - 1:
            raise ValueError(
                f"inp.image_patches must hold one count per image ({inp.cu_seqlens.shape[0] - 1}), got "
                f"{inp.image_patches.shape[0]}"
            )
    if inp.qkv is not None:
        qkv = check_tensor(inp.qkv, "inp.qkv", ndim=2, dtypes=_SCORE_DTYPES, device=x.device)
        heads = check_int(inp.num_heads, "inp.num_heads", 1)
        if qkv.shape[0] != x.shape[0] or qkv.shape[1] % (3 * heads):
            raise ValueError(
                f"inp.qkv must have shape [{x.shape[0]}, 3*H*D] with H = inp.num_heads = {heads}, got "
                f"{tuple(qkv.shape)}"
            )
        if isinstance(inp.scale, bool) or not isinstance(inp.scale, (int, float)):
            raise TypeError(f"inp.scale must be a float with inp.qkv, got {type(inp.scale).__name__}")
    if inp.rotary is not None:
        if inp.qkv is None:
            raise ValueError("inp.rotary rotates inp.qkv's queries and keys: give inp.qkv too")
        if not isinstance(inp.rotary, Rotary):
            raise TypeError(f"inp.rotary must be a ragged_vit.core.rotary.Rotary, got {type(inp.rotary).__name__}")
        check_rotary(inp.rotary.table, inp.rotary.positions, x.shape[0], heads, qkv.shape[1] // (3 * heads), x.device)
    required = {"cls_attn": attention, "v": values}
    for name, needed in required.items():
        value = getattr(inp, name)
        if value is None:
            if needed and inp.qkv is None:
                raise ValueError(
                    f"inp.{name} (or inp.qkv) is required by this pruner (it scores tokens by attention), got None"
                )
            continue
        check_tensor(value, f"inp.{name}", ndim=2, dtypes=_SCORE_DTYPES, device=x.device)
        if value.shape[0] != x.shape[0]:
            raise ValueError(f"inp.{name} must have {x.shape[0]} rows like inp.x, got shape {tuple(value.shape)}")
    if attention and inp.num_prefix < 1:
        raise ValueError("inp.num_prefix must be >= 1 for a pruner that scores by the class token's attention, got 0")
    return inp


class Pruner(nn.Module):
    """Base class of every pruner (and of ToMe's merger): one stage schedule, one ``forward(DecisionInput) ->
    Decision``.

    Subclasses set ``placement``, ``blocks`` (the timm block index of each stage), ``fixed_count``,
    ``needs_attention`` / ``needs_values`` / ``needs_keys``, ``merges`` and ``appends_token``, and implement
    :meth:`decide` on the packed layout (``forward`` checks the input first; the pipelines, which build the input
    themselves, call :meth:`decide`). They build themselves for a model and one keep rate with
    :meth:`from_keep_rate`. Pruners with weights (DynamicViT) hold them as submodules so their state-dict keys load
    from official checkpoints.
    """

    name: str = "pruner"
    placement: Placement
    blocks: tuple[int, ...]
    fixed_count: bool
    needs_attention: bool = False  # scores from the class token's attention row of its block (MID_BLOCK)
    needs_values: bool = False  # and from the value vectors
    needs_keys: bool = False  # decides from its block's attention keys (``DecisionInput.qkv``; ToMe's metric)
    merges: bool = False  # returns a MergeSelection (rows merge, with sizes) instead of a TokenSelection
    appends_token: bool = False  # its selections may append one token per image (``TokenSelection.extra_token``)

    @classmethod
    def from_keep_rate(cls, keep_rate: float, *, embed_dim: int, num_patches: int, **options: object) -> Pruner:
        """The pruner for a model of ``embed_dim`` channels and ``num_patches`` patches at one keep rate in
        ``(0, 1]``, mapped onto its own parameters (the CLI and the benchmarks speak of one keep rate)."""
        raise NotImplementedError(f"{cls.__name__} does not say how a keep rate maps onto its parameters")

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        """Patches per image after ``stage`` (an extra token counted) given ``patches`` before it, or None if the
        count varies per image. Prefix rows are not counted: they are always kept."""
        return None

    def max_count_after(self, stage: int, patches: int, num_patches: int) -> int:
        """An upper bound on any image's patches after ``stage`` given at most ``patches`` before it, known on the
        host: :meth:`count_after` where the count is fixed, else ``patches`` (nothing known). Variable-count
        pruners with a tighter bound override it (ATS keeps at most its sample count); the plan records it
        (:func:`ragged_vit.pipelines.plan.build_plan`) and the CUDA-graph runner sizes its buffers with it."""
        count = self.count_after(stage, patches, num_patches)
        return patches if count is None else count

    def check_ready(self) -> None:
        """Raises ``RuntimeError`` if the pruner cannot decide yet (Threshold-L2 ``calibrated`` before
        ``calibrate()``); the pipelines call it once per forward, before any launch."""

    def check_input(self, inp: object) -> DecisionInput:
        """Checks ``inp`` for this pruner, and that it is ready (what :meth:`forward` does before :meth:`decide`)."""
        self.check_ready()
        return check_decision_input(inp, attention=self.needs_attention, values=self.needs_values)

    def forward(self, inp: DecisionInput) -> Decision:
        """Checks ``inp``, then decides (:meth:`decide`)."""
        return self.decide(self.check_input(inp))

    def decide(self, inp: DecisionInput) -> Decision:  # pragma: no cover - abstract
        """The stage's decision on checked input: a :class:`TokenSelection` (a :class:`MergeSelection` if
        ``merges``)."""
        raise NotImplementedError

    def select(
        self,
        x: torch.Tensor,
        stage: int = 0,
        num_patches: int | None = None,
        num_prefix: int = 1,
        **extra: torch.Tensor,
    ) -> TokenSelection:
        """Convenience entry on a dense batch ``[B, N, C]``: returns a selection whose ``keep`` is ``[B, N]``.

        ``num_patches`` defaults to ``N - num_prefix`` (an unpruned batch). ``extra`` passes ``cls_attn``
        ``[B, N, H]`` and ``v`` ``[B, N, H*D]`` for attention-based pruners.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a [B, N, C] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        batch, n, c = x.shape
        if batch == 0:
            raise ValueError("x must hold at least one image, got batch size 0")
        flat = {k: v.reshape(batch * n, *v.shape[2:]) for k, v in extra.items()}
        inp = DecisionInput(
            x=x.reshape(batch * n, c),
            cu_seqlens=uniform_cu_seqlens(batch, n, x.device),
            stage=stage,
            num_patches=n - num_prefix if num_patches is None else num_patches,
            num_prefix=num_prefix,
            **flat,
        )
        sel = self(inp)
        return TokenSelection(sel.keep.view(batch, n), sel.kept, sel.fixed_count, sel.count, sel.extra_token)
