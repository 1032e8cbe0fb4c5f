"""timm's ``Eva`` ViTs on the packed runtime: EVA-02, DINOv3, Perception Encoder, the ``vit_*_rope_*`` models.

timm's ``Eva`` differs from its ``VisionTransformer`` in four places the pipeline cares about, each handled here:

* **rotary position embeddings** (``model.rope``): ``Eva._pos_embed`` returns the rope table of the image size with
  the tokens, and every block rotates the queries and keys of its patch rows by it (prefix rows unrotated). The
  packed runtime carries each row's table index (:class:`RotaryRows`, built by FRONT, moved by every repack) and the
  attention rotates by it (:mod:`ragged_vit.reference.rotary`; the Triton kernel as it loads q and k).
  :func:`rope_spec` says which table and layout a model uses, or refuses it in one line;
* **its attention** (``EvaAttention`` or timm's ``AttentionRope``): a qkv projection fused or split in three, a
  separate q/v bias, optional q/k norms, an inner norm after the attention (``scale_attn_inner``) and an optional
  gate; :func:`eva_qkv` and :class:`EvaPath` compute them on packed rows with the module's own parameters;
* **its blocks** (``EvaBlock``: pre-norm, LayerScale as ``gamma_1``/``gamma_2``; ``EvaBlockPostNorm``: the norms after
  each branch): :class:`EvaPath` gives a block's parts in the form :mod:`ragged_vit.pipelines.packed_block` runs;
* **its MLPs** (``Mlp``, ``GluMlp`` and ``SwiGLU`` with their optional inner norm): timm's own modules, per row.

Supported rope tables (``model.rope``): ``RotaryEmbeddingCat`` (EVA-02, the ``vit_*_rope_*`` axial models, PE),
``RotaryEmbeddingDinoV3`` (DINOv3), ``RotaryEmbeddingMixed`` (RoPE-Mixed: one table per block and head) and
``RotaryEmbeddingMRope`` where timm has it; interleaved or half layout (``rotate_half``). Refused, in one line naming
what the model has: any other rope module, grouped-query attention (``num_kv_heads`` below ``num_heads``), blocks or
attentions of other types, and attention modules whose own prefix count or layout disagrees with the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import timm.layers
import torch
import torch.nn.functional as F
from timm.models.eva import Eva, EvaAttention, EvaBlock
from torch import nn

from ..core.rotary import Rotary
from ..reference.attention import split_qkv
from ..reference.rotary import patch_positions

EvaBlockPostNorm = getattr(timm.models.eva, "EvaBlockPostNorm", None)
AttentionRope = getattr(timm.layers, "AttentionRope", None)
EVA_BLOCKS = tuple(t for t in (EvaBlock, EvaBlockPostNorm) if t is not None)
EVA_ATTENTIONS = tuple(t for t in (EvaAttention, AttentionRope) if t is not None)

ROPE_TABLES = {
    "RotaryEmbeddingCat": False,  # class name -> one table per block (True) or one for the whole model
    "RotaryEmbeddingDinoV3": False,
    "RotaryEmbeddingMRope": False,
    "RotaryEmbeddingMixed": True,
}
"""The rope modules whose tables the runtime takes: each ``get_embed`` gives ``[N, 2*D]`` rows of ``[sin | cos]``
(RoPE-Mixed: ``[depth, H, N, 2*D]``), which timm's attention applies with ``apply_rot_embed_cat``."""


def is_eva(model: object) -> bool:
    """Whether ``model`` is a timm ``Eva`` (or subclass)."""
    return isinstance(model, Eva)


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates its queries and keys.

    Attributes:
        table: the rope module's class name (a key of :data:`ROPE_TABLES`).
        half: the ``"half"`` layout, else ``"interleaved"`` (:data:`ragged_vit.reference.rotary.LAYOUTS`).
        per_block: one table per block (``[depth, H, N, 2*D]``), else one shared by every block and head.
    """

    table: str
    half: bool
    per_block: bool

    @property
    def layout(self) -> str:
        return "half" if self.half else "interleaved"


def rope_spec(model: nn.Module) -> RopeSpec | None:
    """The rope of an ``Eva`` model (None without one); raises ``NotImplementedError`` naming the model's layout where
    the runtime does not take it."""
    rope = getattr(model, "rope", None)
    if rope is None:
        return None
    name = type(rope).__name__
    if name not in ROPE_TABLES:
        raise NotImplementedError(
            f"model.rope is a {name}, whose rotary layout the packed runtime does not take (supported: "
            f"{', '.join(ROPE_TABLES)})"
        )
    halves = {bool(getattr(block.attn, "rotate_half", False)) for block in model.blocks}
    prefixes = {getattr(block.attn, "num_prefix_tokens", model.num_prefix_tokens) for block in model.blocks}
    if len(halves) != 1 or prefixes != {model.num_prefix_tokens}:
        raise NotImplementedError(
            f"model.rope ({name}) with blocks that disagree on its layout (rotate_half {sorted(halves)}) or on the "
            f"unrotated prefix rows ({sorted(prefixes)}, the model has {model.num_prefix_tokens}) is not supported"
        )
    return RopeSpec(name, halves.pop(), ROPE_TABLES[name] or bool(getattr(model, "rope_mixed", False)))


def check_eva(model: nn.Module) -> RopeSpec | None:
    """Raises ``NotImplementedError`` (one line) for what the packed runtime does not take in an ``Eva`` model
    (module docstring); returns its :func:`rope_spec`."""
    spec = rope_spec(model)
    for k, block in enumerate(model.blocks):
        check_eva_block(block, f"model.blocks[{k}]")
    return spec


def check_eva_block(block: nn.Module, name: str = "block") -> None:
    """Raises ``NotImplementedError`` unless ``block`` is an Eva block with an Eva attention of full heads."""
    if not isinstance(block, EVA_BLOCKS):
        raise NotImplementedError(f"{name} must be a timm EvaBlock to run packed, got {type(block).__name__}")
    attn = block.attn
    if not isinstance(attn, EVA_ATTENTIONS):
        raise NotImplementedError(
            f"{name}.attn must be a timm EvaAttention or AttentionRope to run packed, got {type(attn).__name__}"
        )
    kv_heads = getattr(attn, "num_kv_heads", attn.num_heads)
    if kv_heads != attn.num_heads:
        raise NotImplementedError(
            f"{name}.attn has grouped-query attention ({kv_heads} key/value heads for {attn.num_heads} query heads), "
            "which the packed runtime does not take yet"
        )


def eva_qkv(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The qkv projection of normalised rows ``x [T, C]`` -> ``[T, 3*H*D]`` (timm's layout), as the Eva attention
    computes it: one fused Linear (its separate q/v bias concatenated with the zero k bias, added in the Linear or
    after it as the module says) or three, then the per-head q/k norms. Three plain Linears run as one GEMM over their
    weights concatenated (each call, so later weights are seen): one launch for three, and no copy of three outputs
    into one buffer."""
    fused = attn.qkv
    if fused is None:
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        if all(type(p) is nn.Linear and not p._forward_hooks and not p._forward_pre_hooks for p in projections):
            weight = torch.cat([p.weight for p in projections])
            bias = None
            if any(p.bias is not None for p in projections):  # a missing one (EVA-02's k) as zeros
                bias = torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias
                                  for p in projections])  # fmt: skip
            qkv = F.linear(x, weight, bias)
        else:
            qkv = torch.cat([p(x) for p in projections], dim=1)
    elif getattr(attn, "q_bias", None) is None:
        qkv = fused(x)
    else:
        bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        if getattr(attn, "qkv_bias_separate", False):
            qkv = fused(x)
            qkv += bias
        else:
            qkv = F.linear(x, fused.weight, bias)
    if isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity):
        return qkv
    q, k, v = split_qkv(qkv, attn.num_heads)
    return torch.cat([attn.q_norm(q).flatten(1), attn.k_norm(k).flatten(1), v.flatten(1)], dim=1)


class EvaPath:
    """An Eva block's parts on packed rows, its modules called as timm calls them (the form of
    :mod:`ragged_vit.pipelines.packed_block`'s paths: ``x + attn_out(attend(qkv(norm1(x))))``, then
    ``x + mlp(norm2(x))``). A post-norm block's norms close its branches, so its ``norm1``/``norm2`` are identities
    and its branch ends carry them."""

    __slots__ = ("attn", "block", "post")

    def __init__(self, block: nn.Module) -> None:
        self.block, self.attn = block, block.attn
        self.post = EvaBlockPostNorm is not None and type(block) is EvaBlockPostNorm

    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.post else self.block.norm1(x)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return eva_qkv(self.attn, x)

    def attn_out(self, a: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The attention output ``a [T, H*D]`` to the residual branch: inner norm, gate, proj, LayerScale or the
        post-norm."""
        block, attn = self.block, self.attn
        a = attn.norm(a)
        gate = getattr(attn, "gate", None)
        if gate is not None:
            a = a * gate(normed).sigmoid()
        a = attn.proj_drop(attn.proj(a))
        if self.post:
            return block.drop_path1(block.norm1(a))
        gamma = getattr(block, "gamma_1", None)
        return block.drop_path1(a if gamma is None else gamma * a)

    def norm2(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.post else self.block.norm2(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        y = block.mlp(x)
        if self.post:
            return block.drop_path2(block.norm2(y))
        gamma = getattr(block, "gamma_2", None)
        return block.drop_path2(y if gamma is None else gamma * y)


@dataclass(frozen=True, eq=False)
class RotaryRows:
    """The rotation of a forward's packed rows: where each row's patch sits in the model's rope table.

    Attributes:
        positions: int32 ``[T]``: each row's table row, ``-1`` for rows left unrotated (prefix rows, EViT's fused
            token); moved with the rows by every repack (rows past a buffer's real total hold anything).
        table: the rope table of this forward's image size: ``[N, 2*D]``, or ``[depth, H, N, 2*D]`` per block (a
            native batch: the tables of its grid sizes one after the other along ``N``).
        half: the half layout, else interleaved.
        blocks: for a per-block table, each block's attention module -> its block index; None for a shared table.
    """

    positions: torch.Tensor
    table: torch.Tensor
    half: bool
    blocks: dict[nn.Module, int] | None = None

    def of(self, attn: nn.Module) -> Rotary:
        """The rotation of the block of ``attn``, as the attention takes it."""
        table = self.table if self.blocks is None else self.table[self.blocks[attn]]
        return Rotary(table, self.positions, self.half)

    def moved(self, positions: torch.Tensor) -> RotaryRows:
        """The same rotation for the rows a repack made (their ``positions``)."""
        return RotaryRows(positions, self.table, self.half, self.blocks)


def rotary_rows(
    spec: RopeSpec, table: torch.Tensor, blocks: dict[nn.Module, int] | None, batch: int, tokens: int, prefix: int
) -> RotaryRows:
    """The rotation of an unpruned batch of ``batch`` images of ``tokens`` rows (``prefix`` of them unrotated)."""
    return rotary_at(spec, table, blocks, patch_positions(batch, tokens, prefix, table.device))


def rotary_at(
    spec: RopeSpec, table: torch.Tensor, blocks: dict[nn.Module, int] | None, positions: torch.Tensor
) -> RotaryRows:
    """The rotation of rows at ``positions`` (int32 ``[T]``: each row's row of ``table``, ``-1`` unrotated)."""
    return RotaryRows(positions, table, spec.half, blocks if spec.per_block else None)


def block_table(table: torch.Tensor | None, spec: RopeSpec | None, index: int) -> torch.Tensor | None:
    """The rope table block ``index`` takes in timm's own forward (its slice of a per-block table)."""
    if table is None or spec is None or not spec.per_block:
        return table
    return table[index]


class _WithoutRope:
    """An Eva model seen without its rope module: timm's ``_pos_embed`` on it embeds the tokens and builds no table
    (every other attribute is the model's)."""

    rope = None

    def __init__(self, model: nn.Module) -> None:
        self.__dict__["model"] = model

    def __getattr__(self, name: str) -> object:
        return getattr(self.__dict__["model"], name)


def embed_tokens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``Eva._pos_embed`` of the patch embedding ``x`` (prefix tokens, position embeddings) without its rope
    table: a forward given a table built earlier (:func:`rope_table`) builds none of its own (DINOv3 builds its grid on
    the host, which a CUDA graph cannot capture)."""
    return type(model)._pos_embed(_WithoutRope(model), x)[0]


def rope_table(model: nn.Module, grid: tuple[int, int]) -> torch.Tensor:
    """The rope table timm's ``Eva._pos_embed`` hands its blocks for images of ``grid = (h, w)`` patches (timm's own
    call, on one zero image of that grid: the same table at any timm version)."""
    weight = model.patch_embed.proj.weight
    shape = (1, *grid, model.embed_dim) if model.dynamic_img_size else (1, grid[0] * grid[1], model.embed_dim)
    return model._pos_embed(torch.zeros(shape, dtype=weight.dtype, device=weight.device))[1]
