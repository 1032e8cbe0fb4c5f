"""One timm transformer block on a packed buffer ``[T, C]``, attention through a backend.

timm's ``Block.forward`` is ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``. Every module in it but
the attention core acts on each token independently (LayerNorm, the Linear layers, LayerScale, GELU, identity
dropouts), so it runs unchanged on the flat ``[T, C]`` buffer; only ``softmax(q k^T) v`` must respect image
boundaries, and that is the backend's job. The same modules and parameters are used: no copy, no fork of timm.

A MID_BLOCK pruning stage (EViT, ATS) sits between the attention residual and the MLP, so the two halves are also
callable on their own: :func:`packed_attention` (which returns the block's qkv projection too, for the stage's
CLS-attention scores) and :func:`packed_mlp`; the forward plan (:mod:`ragged_vit.pipelines.plan`) says where.
An optional ``key_bias [T]`` (ToMe's proportional attention) is handed to the backend's ``attend``; backends
without ``capabilities.key_bias`` refuse it.

The lean path. Eager at batch 1-4 is bound by the host: every aten op and every ``nn.Module.__call__`` costs
microseconds of Python and dispatch while the GPU idles, and a timm block issues ~18 top-level aten ops through ~20
module calls, three of them dropouts that are no-ops in eval but still dispatch ``aten::dropout``. So a *plain*
block in eval mode runs as direct functional calls on its modules' own parameters instead: ``F.layer_norm``,
``F.linear`` (qkv), the attention, ``F.linear`` (proj), ``* gamma``, add; ``F.layer_norm``, ``F.linear``,
``F.gelu``, ``F.linear``, ``* gamma``, add: the ops the modules would issue, in the same order (bitwise the same
result), without the module calls or the dropouts. Plain (:func:`lean_block`): a timm ``Block`` (exact type) with a
timm ``Attention`` and ``Mlp``, LayerNorms (``nn.LayerNorm`` or timm's without fast-norm), ``nn.Linear`` layers
(bias or not), identity q/k/scale norms and MLP norm, no gate, LayerScale or identity, GELU (any ``approximate``),
and dropouts / drop paths (identity in eval). It is decided on a block's first eval forward and cached (re-decided
when a child of the block, its ``attn`` or its ``mlp`` is replaced); the parameters are read from the modules at
every call, so weights loaded later (``assign=True`` too), ``.half()`` and ``.to()`` are seen. Anything else runs
the module path: a non-plain block, training mode (read from the block), a block with hooks on any of its modules,
and code under ``torch.compile`` (Inductor sees the modules as before). :func:`dense_block` is the same lean block on
a dense batch ``[B, N, C]`` with timm's own SDPA call (bitwise timm's ``block(x)``), for the pipeline's dense blocks
before its first stage.

The fused-linear form. Where the program says so (a step's ``linear``: :mod:`ragged_vit.pipelines.plan`), a plain
block with the Triton backend runs as four fused linears (:func:`ragged_vit.triton_impl.linear.fused_linear`) and
the attention: the LayerNorms in the prologues from each row's statistics, which proj and fc2 write in their
epilogues for the next LayerNorm, and bias, GELU, LayerScale and the residual adds in the epilogues
(:func:`fused_blocks`, :func:`fused_attention`, :func:`fused_mlp`; :func:`fused_refusal` says which blocks have no
such form). The statistics come in and go out with the rows (the executor keeps them with the buffer they describe);
under ``torch.compile`` the linears are the custom op ``torch.ops.ragged_vit.fused_linear``.

Supported: ``timm.models.vision_transformer.Block`` with ``timm.layers.Attention`` (qk_norm, scale_norm and the
gated variant of newer timm included), and timm's Eva blocks (their module path, :class:`ragged_vit.pipelines.eva.
EvaPath`; a ``rotary`` argument carries the rows' RoPE positions), in eval mode. Not supported: other block types
(ResPostBlock, ParallelScalingBlock, ...), attention masks, dropout at training time.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, activations
from timm.layers import LayerNorm as TimmLayerNorm
from timm.models.vision_transformer import (  # Attention lives in timm.layers in newer timm, LayerScale too
    Attention,
    Block,
    LayerScale,
)
from torch import nn
from torch.nn.modules import module as _module

from ..reference.attention import split_qkv
from ..reference.rotary import rotate_qkv
from ..triton_impl.linear import MAX_DIM, empty_ln_stats, fused_linear_op, fused_linear_unchecked
from .backends.base import AttentionBackend
from .eva import EVA_BLOCKS, EvaPath, RotaryRows, check_eva_block


def check_packable(block: nn.Module, name: str = "block") -> None:
    """Raises ``NotImplementedError`` unless ``block`` is a timm ``Block`` with a timm ``Attention`` (or an Eva block:
    :func:`ragged_vit.pipelines.eva.check_eva_block`)."""
    if isinstance(block, EVA_BLOCKS):
        check_eva_block(block, name)
        return
    if not isinstance(block, Block):
        raise NotImplementedError(
            f"{name} must be a timm vision_transformer.Block to run packed, got {type(block).__name__}"
        )
    if not isinstance(block.attn, Attention):
        raise NotImplementedError(
            f"{name}.attn must be a timm Attention to run packed, got {type(block.attn).__name__}"
        )


def block_qkv(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The qkv projection of normalised tokens ``x [T, C]`` -> ``[T, 3*H*D]``, with q_norm / k_norm applied.

    With identity q/k norms (DeiT) this is the Linear layer's output itself, which the backends read through
    strides. timm normalises q and k per head over ``D``; so does this, on ``[T, H, D]`` views.
    """
    qkv = attn.qkv(x)
    if isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity):
        return qkv
    q, k, v = split_qkv(qkv, attn.num_heads)
    return torch.cat([attn.q_norm(q).flatten(1), attn.k_norm(k).flatten(1), v.flatten(1)], dim=1)


# --- the two ways to run a block's parts: its modules, or lean functional calls ------------------------------------
#
# A block is norm1 -> qkv -> attention -> attn_out (+ residual), then norm2 -> mlp (+ residual); :func:`_attention_half`
# and :func:`_mlp_half` say that once, and each path supplies the parts.


class _ModulePath:
    """A block's parts as its modules, called as timm calls them (every block :func:`check_packable` accepts)."""

    __slots__ = ("block",)

    def __init__(self, block: Block) -> None:
        self.block = block

    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.norm1(x)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return block_qkv(self.block.attn, x)

    def attn_out(self, a: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The attention output ``a`` to the residual branch: scale_norm, gate, proj, dropouts, LayerScale."""
        block = self.block
        attn = block.attn
        a = attn.norm(a) if hasattr(attn, "norm") else a  # scale_norm (identity unless configured)
        gate = getattr(attn, "gate", None)  # gated attention of newer timm versions
        if gate is not None:
            a = a * gate(normed).sigmoid()
        return block.drop_path1(block.ls1(attn.proj_drop(attn.proj(a))))

    def norm2(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.norm2(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        return block.drop_path2(block.ls2(block.mlp(x)))


@dataclass(frozen=True, eq=False)
class LeanBlock:
    """A plain block's parts as functional calls on its modules' parameters, read at call time (module docstring).

    Attributes: the block's modules (``ls1``/``ls2`` None for identity), the GELU's ``approximate``, and ``hooks``:
    the hook dictionaries of every module of the block and the global ones (any entry sends the block down the
    module path, which calls them).
    """

    attn: Attention
    ln1: nn.LayerNorm
    qkv_fc: nn.Linear
    proj_fc: nn.Linear
    ls1: LayerScale | None
    ln2: nn.LayerNorm
    fc1: nn.Linear
    approximate: str
    fc2: nn.Linear
    ls2: LayerScale | None
    hooks: tuple[dict, ...]

    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(self.ln1, x)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.qkv_fc, x)

    def attn_out(self, a: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return _layer_scale(self.ls1, _linear(self.proj_fc, a))

    def norm2(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(self.ln2, x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(_linear(self.fc1, x), approximate=self.approximate)
        return _layer_scale(self.ls2, _linear(self.fc2, hidden))


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)  # nn.LayerNorm.forward


def _linear(fc: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, fc.weight, fc.bias)  # nn.Linear.forward


def _layer_scale(ls: LayerScale | None, x: torch.Tensor) -> torch.Tensor:
    if ls is None:
        return x
    return x.mul_(ls.gamma) if ls.inplace else x * ls.gamma  # LayerScale.forward


_NO_OPS = (nn.Identity, nn.Dropout, DropPath)  # dropouts and drop paths: identities in eval
_GELUS = {nn.GELU: None, activations.GELU: "none"}  # None: the module's own ``approximate``
if hasattr(activations, "GELUTanh"):
    _GELUS[activations.GELUTanh] = "tanh"
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")  # what _call_impl runs
_GLOBAL_HOOKS = tuple(getattr(_module, f"_global{name}") for name in _HOOKS if hasattr(_module, f"_global{name}"))


def _is_layer_norm(norm: nn.Module) -> bool:
    return type(norm) is nn.LayerNorm or (type(norm) is TimmLayerNorm and not getattr(norm, "_fast_norm", False))


def _plain(block: nn.Module) -> LeanBlock | None:
    """The lean parts of ``block`` if it is plain (module docstring), else None."""
    if type(block) is not Block or type(block.attn) is not Attention or type(block.mlp) is not Mlp:
        return None
    attn, mlp = block.attn, block.mlp
    identities = (attn.q_norm, attn.k_norm, getattr(attn, "norm", None), getattr(mlp, "norm", None))
    no_ops = (attn.proj_drop, block.drop_path1, block.drop_path2, mlp.drop1, mlp.drop2)
    if (
        getattr(attn, "gate", None) is not None
        or any(m is not None and type(m) is not nn.Identity for m in identities)
        or any(type(m) not in _NO_OPS for m in no_ops)
        or any(type(m) is not nn.Linear for m in (attn.qkv, attn.proj, mlp.fc1, mlp.fc2))
        or not (_is_layer_norm(block.norm1) and _is_layer_norm(block.norm2))
        or any(type(m) not in (nn.Identity, LayerScale) for m in (block.ls1, block.ls2))
        or type(mlp.act) not in _GELUS
    ):
        return None
    approximate = _GELUS[type(mlp.act)] or mlp.act.approximate
    hooks = tuple(getattr(m, name) for m in block.modules() for name in _HOOKS if hasattr(m, name))
    return LeanBlock(
        attn=attn, ln1=block.norm1, qkv_fc=attn.qkv, proj_fc=attn.proj,
        ls1=block.ls1 if type(block.ls1) is LayerScale else None, ln2=block.norm2, fc1=mlp.fc1,
        approximate=approximate, fc2=mlp.fc2, ls2=block.ls2 if type(block.ls2) is LayerScale else None,
        hooks=_GLOBAL_HOOKS + hooks,
    )  # fmt: skip


def _children(block: nn.Module) -> tuple:
    """Every module :func:`_plain` looks at: the block's children and those of its ``attn`` and ``mlp``."""
    mods = block._modules
    attn, mlp = mods.get("attn"), mods.get("mlp")
    return (
        *mods.values(),
        *(attn._modules.values() if attn is not None else ()),
        *(mlp._modules.values() if mlp is not None else ()),
    )


_DECIDED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, LeanBlock | None]] = weakref.WeakKeyDictionary()


def lean_block(block: nn.Module) -> LeanBlock | None:
    """The lean parts of ``block`` when this call may take the lean path, else None (module docstring).

    Decided once per block and cached (weakly: the cache does not keep blocks alive), re-decided when one of the
    modules it looked at was replaced; checked at every call: eval mode, not compiling, no hooks.
    """
    if block.training or torch.compiler.is_compiling():
        return None
    children = _children(block)
    decided = _DECIDED.get(block)
    if decided is None or decided[0] != children:
        decided = _DECIDED[block] = (children, _plain(block))
    lean = decided[1]
    if lean is None or any(lean.hooks):
        return None
    return lean


_PATHS: dict[type, type] = dict.fromkeys(EVA_BLOCKS, EvaPath)  # block type -> its module path (default _ModulePath)


def _parts(block: Block) -> LeanBlock | _ModulePath | EvaPath:
    return lean_block(block) or _PATHS.get(type(block), _ModulePath)(block)


def _attention_half(
    parts: LeanBlock | _ModulePath, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + attn_out(attend(qkv(norm1(x))))`` and the qkv projection, on any leading shape ``attend`` takes."""
    normed = parts.norm1(x)
    qkv = parts.qkv(normed)
    return _attention_residual(parts, x, normed, qkv, attend), qkv


def _attention_residual(
    parts: LeanBlock | _ModulePath,
    x: torch.Tensor,
    normed: torch.Tensor,
    qkv: torch.Tensor,
    attend: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The attention half after its qkv projection: ``x + attn_out(attend(qkv))``."""
    return x + parts.attn_out(attend(qkv), normed)


def _mlp_half(parts: LeanBlock | _ModulePath, x: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
    """``x + mlp(norm2(x))``; with ``normed``, that ``norm2(x)`` (computed elsewhere: a merge that wrote it)."""
    return x + parts.mlp(parts.norm2(x) if normed is None else normed)


def _backend_attend(
    backend: AttentionBackend,
    attn: Attention,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    key_bias: torch.Tensor | None,
    rotary: RotaryRows | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``qkv [T, 3*H*D] -> [T, H*D]`` through ``backend`` (``attend`` itself skips a ``key_bias`` of None); with
    ``rotary``, q and k rotated first: by the backend as it reads them where it declares ``capabilities.rotary``,
    else here (:func:`ragged_vit.reference.rotary.rotate_qkv`)."""
    if rotary is None:
        return lambda qkv: backend.attend(qkv, cu_seqlens, max_seqlen, attn.num_heads, attn.scale, key_bias=key_bias)
    rot, heads, scale = rotary.of(attn), attn.num_heads, attn.scale
    if backend.capabilities.rotary:
        return lambda qkv: backend.attend_rotary(qkv, cu_seqlens, max_seqlen, heads, scale, rot, key_bias=key_bias)
    return lambda qkv: backend.attend(rotate_qkv(qkv, heads, *rot), cu_seqlens, max_seqlen, heads, scale,
                                      key_bias=key_bias)  # fmt: skip


def _dense_attend(attn: Attention, qkv: torch.Tensor) -> torch.Tensor:
    """timm's fused attention core on a dense batch: ``qkv [B, N, 3*H*D] -> [B, N, H*D]`` (its very ops)."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.reshape(batch, tokens, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(batch, tokens, attn.num_heads * attn.head_dim)


# --- public entry points ---------------------------------------------------------------------------------------


def packed_attention(
    block: Block,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
    rotary: RotaryRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of ``block`` on packed tokens: ``x + ls1(attn(norm1(x)))``.

    Args: as :func:`packed_block`.

    Returns:
        The residual stream after the attention residual ``[T, C]`` and the block's qkv projection ``[T, 3*H*D]``
        (what a MID_BLOCK pruning stage scores).
    """
    attend = _backend_attend(backend, block.attn, cu_seqlens, max_seqlen, key_bias, rotary)
    return _attention_half(_parts(block), x, attend)


def packed_qkv(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first part of :func:`packed_attention`: ``norm1(x)`` and the block's qkv projection ``[T, 3*H*D]``. With
    :func:`packed_attention_residual` it is :func:`packed_attention`, split where a decision that reads only the qkv
    projection can start (a ToMe merge beside the attention core)."""
    parts = _parts(block)
    normed = parts.norm1(x)
    return normed, parts.qkv(normed)


def packed_attention_residual(
    block: Block,
    x: torch.Tensor,
    normed: torch.Tensor,
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
    rotary: RotaryRows | None = None,
) -> torch.Tensor:
    """The rest of :func:`packed_attention` from :func:`packed_qkv`'s ``(normed, qkv)``: ``x + ls1(proj(attend))``."""
    return x + packed_attention_branch(block, normed, qkv, cu_seqlens, max_seqlen, backend, key_bias, rotary)


def packed_attention_branch(
    block: Block,
    normed: torch.Tensor,
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
    rotary: RotaryRows | None = None,
) -> torch.Tensor:
    """:func:`packed_attention_residual` without its residual add: ``ls1(proj(attend))``, for a consumer that adds it
    itself (ToMe's merge kernel adds it to each row it reads)."""
    attend = _backend_attend(backend, block.attn, cu_seqlens, max_seqlen, key_bias, rotary)
    return _parts(block).attn_out(attend(qkv), normed)


def packed_mlp(block: Block, x: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP half of ``block`` on packed tokens ``[T, C]``: ``x + ls2(mlp(norm2(x)))`` (no attention: any rows);
    ``normed``: ``norm2(x)`` if already computed (ToMe's merge kernel writes it)."""
    return _mlp_half(_parts(block), x, normed)


def packed_mlp_qkv(
    block: Block, x: torch.Tensor, following: Block, normed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`packed_mlp` of ``block`` (``normed`` as there), then :func:`packed_qkv` of the block after it, in one
    call: the residual stream ``[T, C]``, ``following.norm1`` of it and ``following``'s qkv projection. The same ops
    as the two calls; under ``torch.compile`` the MLP's residual add and the next ``norm1`` become one kernel (a
    launch less per block where a mid-block stage splits every block, as ToMe's merge does)."""
    x = _mlp_half(_parts(block), x, normed)
    return (x, *packed_qkv(following, x))


def packed_block(
    block: Block,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
    rotary: RotaryRows | None = None,
) -> torch.Tensor:
    """Runs ``block`` on packed tokens: :func:`packed_attention`, then :func:`packed_mlp`.

    Args:
        block: a timm ``Block`` (see :func:`check_packable`).
        x: ``[T, C]`` packed residual stream.
        cu_seqlens: int32 ``[B+1]`` offsets of ``x``.
        max_seqlen: host int bounding every image's length.
        backend: the attention backend.
        key_bias: optional float32 ``[T]`` added to every attention logit of key row ``t`` (ToMe's proportional
            attention, ``log(size)``); only for backends with ``capabilities.key_bias`` (the others raise).
        rotary: the rows' rotary positions and the model's rope table (an Eva block with RoPE), or None.

    Returns:
        The block's output ``[T, C]``.
    """
    parts = _parts(block)
    attend = _backend_attend(backend, block.attn, cu_seqlens, max_seqlen, key_bias, rotary)
    return _mlp_half(parts, _attention_half(parts, x, attend)[0])


def packed_blocks(
    blocks: Sequence[Block],
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
    rotary: RotaryRows | None = None,
) -> torch.Tensor:
    """Consecutive blocks with no pruning stage among them, on one packed buffer: ``[T, C]`` -> ``[T, C]`` (the same
    ``key_bias`` and ``rotary``, if any, for every block)."""
    for block in blocks:
        x = packed_block(block, x, cu_seqlens, max_seqlen, backend, key_bias, rotary)
    return x


# --- the fused-linear form ---------------------------------------------------------------------------------------
#
# qkv = fused_linear(x; norm1 from the rows' statistics), attention, x = fused_linear(a; proj, ls1, residual x, the
# statistics of its output), h = fused_linear(x; norm2 from them, fc1, GELU), x = fused_linear(h; fc2, ls2, residual x,
# the statistics of its output): four launches and the attention a block. The statistics of the residual stream pass
# from one linear to the next; a step that starts from rows no fused linear wrote has them computed first.

_ACTIVATION_NAMES = {"none": "gelu", "tanh": "gelu_tanh"}  # GELU's ``approximate`` -> the fused linear's activation


def fused_refusal(block: nn.Module) -> str | None:
    """Why ``block`` has no fused-linear form, or None: it needs a plain block (module docstring: a timm ``Block``
    with LayerNorms, ``nn.Linear`` layers, a GELU, no q/k or scale norms; not an Eva block, nor a SwiGLU or gated
    MLP) without hooks, whose LayerNorms have weights and whose layers' widths the fused linear takes."""
    lean = _plain(block)
    if lean is None:
        return f"{type(block).__name__} is not a plain timm Block (LayerNorm, nn.Linear, GELU, no q/k norm)"
    if any(lean.hooks):
        return "a module of the block has hooks"
    if lean.ln1.weight is None or lean.ln2.weight is None:
        return "a LayerNorm has no weight (elementwise_affine=False)"
    for fc in (lean.qkv_fc, lean.proj_fc, lean.fc1, lean.fc2):
        if any(width % 16 or width > MAX_DIM for width in fc.weight.shape):
            return f"a linear layer of shape {tuple(fc.weight.shape)} (the fused linear takes multiples of 16)"
    return None


def _fused_linear(
    x: torch.Tensor,
    fc: nn.Linear,
    norm: nn.LayerNorm | None = None,
    stats: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    scale: nn.Module | None = None,
    stats_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``residual + scale(act(fc(norm(x))))`` in one fused linear (the custom op under ``torch.compile``, else the
    direct call), ``norm`` from the rows' ``stats`` where given; and with ``stats_out`` the statistics of its output
    rows (else None)."""
    ln_weight, ln_bias, eps = (None, None, 1e-5) if norm is None else (norm.weight, norm.bias, norm.eps)
    gamma = scale.gamma if isinstance(scale, LayerScale) else None
    if torch.compiler.is_compiling():
        y, out = fused_linear_op(x, fc.weight, fc.bias, ln_weight, ln_bias, eps, activation, residual, gamma, stats,
                                 stats_out)  # fmt: skip
        return y, out if stats_out else None
    out = empty_ln_stats(x.shape[0], fc.weight.shape[0], x.device) if stats_out else None
    y = fused_linear_unchecked(
        x, fc.weight, fc.bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, activation=activation,
        residual=residual, gamma=gamma, ln_stats=stats, stats_out=out,
    )  # fmt: skip
    return y, out


def _fused_activation(act: nn.Module) -> str:
    return _ACTIVATION_NAMES[_GELUS[type(act)] or act.approximate]


def fused_attention(
    block: Block,
    x: torch.Tensor,
    stats: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`packed_attention` in the fused-linear form (a block :func:`fused_refusal` accepts), ``stats``: the
    statistics of ``x``'s rows or None (computed first). Returns the residual stream, the qkv projection and the
    statistics of the residual stream's rows (for ``norm2``)."""
    attn = block.attn
    qkv, _ = _fused_linear(x, attn.qkv, block.norm1, stats)
    attend = _backend_attend(backend, attn, cu_seqlens, max_seqlen, key_bias)
    x, stats = _fused_linear(attend(qkv), attn.proj, residual=x, scale=block.ls1, stats_out=True)
    return x, qkv, stats


def fused_mlp(
    block: Block, x: torch.Tensor, stats: torch.Tensor | None, normed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`packed_mlp` in the fused-linear form: ``stats`` as in :func:`fused_attention` (unused with ``normed``,
    ``norm2(x)`` computed elsewhere). Returns the residual stream and its rows' statistics (for the next ``norm1``)."""
    mlp = block.mlp
    activation = _fused_activation(mlp.act)
    if normed is None:
        h, _ = _fused_linear(x, mlp.fc1, block.norm2, stats, activation)
    else:
        h, _ = _fused_linear(normed, mlp.fc1, activation=activation)
    return _fused_linear(h, mlp.fc2, residual=x, scale=block.ls2, stats_out=True)


def fused_blocks(
    blocks: Sequence[Block],
    x: torch.Tensor,
    stats: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: AttentionBackend,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`packed_blocks` in the fused-linear form: each block's four fused linears and its attention, the
    statistics of the residual stream handed from one to the next (``stats`` as in :func:`fused_attention`). Returns
    the residual stream and its rows' statistics."""
    for block in blocks:
        x, _, stats = fused_attention(block, x, stats, cu_seqlens, max_seqlen, backend, key_bias)
        x, stats = fused_mlp(block, x, stats)
    return x, stats


def dense_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``block(x)`` on a dense batch ``[B, N, C]``: the lean path with timm's own SDPA call when the block is
    plain and its attention fused (timm's default; then bitwise ``block(x)``), else ``block(x)`` itself."""
    lean = lean_block(block)
    if lean is None or not lean.attn.fused_attn:
        return block(x)
    return _mlp_half(lean, _attention_half(lean, x, functools.partial(_dense_attend, lean.attn))[0])
