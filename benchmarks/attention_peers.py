"""The attention peers of the kernel benchmark, each built once per workload and called the cheapest honest way.

Every peer computes bidirectional attention on the packed DeiT-B ``qkv [T, 3*H*D]`` of a pruned batch and returns
``[T, H*D]`` or ``[T, H, D]``. Everything a pipeline would compute once per forward (index tensors, masks, int64
offsets, views, output buffers) is built here, outside the timed region; everything it must do per layer call is
inside the callable. Peers:

* ``padded_sdpa`` -- gather the packed rows into a ``[B, L, 3, H, D]`` batch padded to the longest survivor ``L``,
  ``F.scaled_dot_product_attention`` with an additive key-padding mask, gather the output back to packed rows.
  The key-padding mask is precomputed in the form SDPA consumes without per-call work (additive, query dtype,
  row stride padded to 16 elements): a bool mask would add a conversion and a padding copy to every call. When
  every image has the same length (B = 1, fixed-ratio batches) there is nothing to pad: plain views, no mask.
* ``fa2_aten`` -- ``torch.ops.aten._flash_attention_forward.default`` called directly on ``[T, H, D]`` views of
  qkv, arguments laid out from the op's schema at build time.
* ``varlen_attn`` -- ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9), arguments laid out from its
  signature at build time.
* ``nested_sdpa`` -- jagged NestedTensors wrapped around the q, k, v views in every call (a pipeline gets a new
  qkv from every layer), ``[B, H, j, D]`` SDPA with the flash backend forced (``sdpa_kernel`` entered once around
  all calls), ``.values()`` of the result. Offsets (int64) and min/max lengths are precomputed.
* ``ours`` -- ``ragged_vit.triton_impl.attention.ragged_attention_qkv`` into a preallocated ``out``,
  ``max_seqlen = 197``.
* ``ours_op`` -- the custom op ``torch.ops.ragged_vit.ragged_attention_qkv.default`` (allocates its output).

Each peer is checked once against ``ragged_vit.reference.attention.ragged_attention`` (fp32) before it is timed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.timing import Call, ContextFactory, describe
from benchmarks.workloads import (
    HEAD_DIM,
    MAX_SEQLEN,
    NUM_HEADS,
    Workload,
    attention_bytes,
    make_qkv_sets,
    sets_to_rotate,
)
from ragged_vit.reference.attention import ragged_attention, split_qkv
from ragged_vit.triton_impl.attention import ragged_attention_qkv

PEER_NAMES = ("padded_sdpa", "fa2_aten", "varlen_attn", "nested_sdpa", "ours", "ours_op")
TOLERANCE = 2e-2  # max abs error of an fp16 peer against the fp32 reference


class PeerUnavailable(RuntimeError):
    """The peer does not exist in this torch build (reported with the reason, not timed)."""


@dataclass
class Problem:
    """One workload on one device: its input copies and offsets."""

    workload: Workload
    qkv_sets: list[torch.Tensor]  # each [T, 3*H*D]
    cu_seqlens: torch.Tensor  # int32 [B+1], on the inputs' device
    num_heads: int = NUM_HEADS
    head_dim: int = HEAD_DIM

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def total(self) -> int:
        return self.workload.total


def make_problem(
    workload: Workload, n_sets: int, device: torch.device | str, dtype: torch.dtype = torch.float16, seed: int = 0
) -> Problem:
    """Draws ``n_sets`` input copies of ``workload`` on ``device``."""
    return Problem(
        workload=workload,
        qkv_sets=make_qkv_sets(workload, n_sets, device, dtype, seed),
        cu_seqlens=workload.cu_seqlens(device),
    )


def cell_problem(workload: Workload, l2_bytes: int, seed: int = 0) -> tuple[Problem, torch.Tensor]:
    """A benchmark cell on the GPU in fp16, with enough input copies to cover 2.5x the L2 (``sets_to_rotate``: one
    copy touches the q, k, v, o bytes), and the fp32 reference of its first copy."""
    copies = sets_to_rotate(attention_bytes(workload.total), l2_bytes)
    problem = make_problem(workload, copies, "cuda", torch.float16, seed)
    return problem, reference_output(problem)


@dataclass
class BuiltPeer:
    """A peer ready to time: one zero-argument call per input copy, and the context to enter around calls."""

    name: str
    calls: list[Call]
    context: ContextFactory = contextlib.nullcontext
    note: str = ""


@dataclass(frozen=True)
class PaddingIndex:
    """Integer indices between packed rows and a batch padded to the longest image ``L``."""

    pad_index: torch.Tensor  # int64 [B*L]: packed row feeding each padded slot (the image's first row if padding)
    unpad_index: torch.Tensor  # int64 [T]: padded slot of each packed row
    key_mask: torch.Tensor  # bool [B, L]: True where the slot holds a real token
    max_len: int  # L


def padding_indices(lengths: Sequence[int], device: torch.device | str = "cpu") -> PaddingIndex:
    """The gather indices of the padded peer: ``packed[pad_index]`` is the padded batch, ``padded[unpad_index]``
    the packed rows again. Padding slots read their image's first row, so every slot holds finite data."""
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    if lens.numel() == 0 or bool((lens < 1).any()):
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {list(lengths)}")
    max_len = int(lens.max())
    starts = torch.cumsum(lens, 0) - lens  # [B]
    pos = torch.arange(max_len)  # [L]
    valid = pos[None, :] < lens[:, None]  # [B, L]
    pad_index = torch.where(valid, starts[:, None] + pos[None, :], starts[:, None]).reshape(-1)
    slots = torch.arange(lens.numel())[:, None] * max_len + pos[None, :]
    unpad_index = slots[valid]  # row-major over valid slots = image-major packed order
    return PaddingIndex(pad_index.to(device), unpad_index.to(device), valid.to(device), max_len)


def additive_key_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, 1, L]`` additive mask (0 keep, -inf drop) whose row stride is a multiple of 16 elements, the
    alignment SDPA's memory-efficient kernel needs to take it without a per-call padding copy."""
    batch, max_len = key_mask.shape
    storage = torch.full((batch, 1, 1, -(-max_len // 16) * 16), float("-inf"), dtype=dtype, device=key_mask.device)
    mask = storage[..., :max_len]
    mask.masked_fill_(key_mask[:, None, None, :], 0.0)
    return mask


def build_padded_sdpa(problem: Problem) -> BuiltPeer:
    wl, h, d, scale = problem.workload, problem.num_heads, problem.head_dim, problem.scale
    batch = wl.batch
    device = problem.qkv_sets[0].device
    if len(set(wl.lengths)) == 1:
        length = wl.lengths[0]

        def dense(qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = qkv.view(batch, length, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D] views
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
            return o.transpose(1, 2).reshape(wl.total, h * d)

        calls = [functools.partial(dense, qkv) for qkv in problem.qkv_sets]
        return BuiltPeer("padded_sdpa", calls, note="equal lengths: no padding, no mask")

    idx = padding_indices(wl.lengths, device)
    length = idx.max_len
    mask = additive_key_mask(idx.key_mask, problem.qkv_sets[0].dtype)

    def padded(qkv: torch.Tensor) -> torch.Tensor:
        x = torch.index_select(qkv, 0, idx.pad_index).view(batch, length, 3, h, d)
        q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D] views
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return torch.index_select(o.transpose(1, 2).reshape(batch * length, h * d), 0, idx.unpad_index)

    calls = [functools.partial(padded, qkv) for qkv in problem.qkv_sets]
    return BuiltPeer("padded_sdpa", calls, note=f"padded to L={length}, additive key mask")


def _fa2_arguments(schema: torch.FunctionSchema, values: dict[str, object]) -> tuple[int, dict[str, object]]:
    """How many leading positional arguments to pass from ``values``, and the keyword ones, per ``schema``."""
    n_positional = 0
    for arg in schema.arguments:
        if arg.kwarg_only:
            break
        if arg.name not in values:
            raise PeerUnavailable(f"unexpected positional argument {arg.name!r} in {schema}")
        n_positional += 1
    kwargs = {a.name: values[a.name] for a in schema.arguments if a.kwarg_only and a.name in values}
    return n_positional, kwargs


def build_fa2_aten(problem: Problem) -> BuiltPeer:
    packet = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if packet is None:
        raise PeerUnavailable("torch.ops.aten._flash_attention_forward does not exist in this torch")
    op = packet.default
    schema = op._schema
    wl = problem.workload
    names = [a.name for a in schema.arguments]
    calls = []
    for qkv in problem.qkv_sets:
        q, k, v = split_qkv(qkv, problem.num_heads)  # [T, H, D] views, no copy
        values = dict(
            zip(names[:3], (q, k, v), strict=True),
            cum_seq_q=problem.cu_seqlens,
            cum_seq_k=problem.cu_seqlens,
            max_q=wl.max_len,
            max_k=wl.max_len,
            dropout_p=0.0,
            is_causal=False,
            return_debug_mask=False,
            scale=problem.scale,
        )
        n_positional, kwargs = _fa2_arguments(schema, values)
        args = tuple(values[name] for name in names[:n_positional])
        calls.append(_first_output(op, args, kwargs))
    return BuiltPeer("fa2_aten", calls, note=str(schema).split("->")[0])


def _first_output(op: Callable[..., tuple[torch.Tensor, ...]], args: tuple, kwargs: dict[str, object]) -> Call:
    def call() -> torch.Tensor:
        return op(*args, **kwargs)[0]  # (output, logsumexp, rng state...): the output only

    return call


def build_varlen_attn(problem: Problem) -> BuiltPeer:
    attention = getattr(torch.nn, "attention", None)
    try:
        module = getattr(attention, "varlen", None) or importlib.import_module("torch.nn.attention.varlen")
    except ImportError as exc:
        raise PeerUnavailable(f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.9)") from exc
    fn = getattr(module, "varlen_attn", None)
    if fn is None:
        raise PeerUnavailable(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    sig = inspect.signature(fn)
    positional = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # documented order: query, key, value, cu_seq_q, cu_seq_k, max_q, max_k
    required = [p.name for p in sig.parameters.values() if p.default is p.empty and p.kind != p.VAR_KEYWORD]
    if len(positional) < 7 or len(required) > 7:
        raise PeerUnavailable(f"unexpected varlen_attn signature {sig}")
    kwargs: dict[str, object] = {}
    if "scale" in sig.parameters:
        kwargs["scale"] = problem.scale
    if "is_causal" in sig.parameters:
        kwargs["is_causal"] = False
    wl = problem.workload
    calls = []
    for qkv in problem.qkv_sets:
        q, k, v = split_qkv(qkv, problem.num_heads)
        args = (q, k, v, problem.cu_seqlens, problem.cu_seqlens, wl.max_len, wl.max_len)
        calls.append(functools.partial(fn, *args, **kwargs))
    return BuiltPeer("varlen_attn", calls, note=f"varlen_attn{sig}")


def build_nested_sdpa(problem: Problem) -> BuiltPeer:
    wl, scale = problem.workload, problem.scale
    offsets = problem.cu_seqlens.long()  # jagged layout stores int64 offsets
    jagged = torch.nested.nested_tensor_from_jagged
    params = inspect.signature(jagged).parameters
    lengths = {}
    if "min_seqlen" in params and "max_seqlen" in params:
        lengths = {"min_seqlen": wl.min_len, "max_seqlen": wl.max_len}

    def nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nq, nk, nv = (jagged(t, offsets, **lengths).transpose(1, 2) for t in (q, k, v))  # [B, H, j, D]
        return F.scaled_dot_product_attention(nq, nk, nv, scale=scale).transpose(1, 2).values()  # [T, H, D]

    calls = [functools.partial(nested, *split_qkv(qkv, problem.num_heads)) for qkv in problem.qkv_sets]
    note = "flash forced" + (", min/max seqlen given" if lengths else ", no min/max seqlen (old torch)")
    return BuiltPeer(
        "nested_sdpa", calls, context=functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION), note=note
    )


def build_ours(problem: Problem) -> BuiltPeer:
    h, d = problem.num_heads, problem.head_dim
    outs = [qkv.new_full((problem.total, h * d), float("nan")) for qkv in problem.qkv_sets]  # poisoned
    calls = [
        functools.partial(ragged_attention_qkv, qkv, problem.cu_seqlens, MAX_SEQLEN, h, problem.scale, out=out)
        for qkv, out in zip(problem.qkv_sets, outs, strict=True)
    ]
    return BuiltPeer("ours", calls, note=f"direct call, out= preallocated, max_seqlen={MAX_SEQLEN}")


def build_ours_op(problem: Problem) -> BuiltPeer:
    op = torch.ops.ragged_vit.ragged_attention_qkv.default
    calls = [
        functools.partial(op, qkv, problem.cu_seqlens, MAX_SEQLEN, problem.num_heads, problem.scale)
        for qkv in problem.qkv_sets
    ]
    return BuiltPeer("ours_op", calls, note=f"torch.ops.ragged_vit.ragged_attention_qkv, max_seqlen={MAX_SEQLEN}")


BUILDERS: dict[str, Callable[[Problem], BuiltPeer]] = {
    "padded_sdpa": build_padded_sdpa,
    "fa2_aten": build_fa2_aten,
    "varlen_attn": build_varlen_attn,
    "nested_sdpa": build_nested_sdpa,
    "ours": build_ours,
    "ours_op": build_ours_op,
}


def build_peer(name: str, problem: Problem) -> BuiltPeer:
    """Builds peer ``name``; raises :class:`PeerUnavailable` when this torch does not have it."""
    if name not in BUILDERS:
        raise ValueError(f"unknown peer {name!r}; expected one of {PEER_NAMES}")
    return BUILDERS[name](problem)


def reference_output(problem: Problem, set_index: int = 0) -> torch.Tensor:
    """fp32 ``[T, H, D]`` ground truth for input copy ``set_index``."""
    q, k, v = split_qkv(problem.qkv_sets[set_index], problem.num_heads)
    return ragged_attention(q, k, v, problem.cu_seqlens, scale=problem.scale)


def checked_peer(name: str, problem: Problem, reference: torch.Tensor) -> tuple[BuiltPeer | None, dict]:
    """Builds peer ``name`` and checks it: the peer (None where it may not be timed) and its result entry (``note``,
    ``max_abs_err``; ``status`` and ``reason`` where the peer is unavailable or wrong)."""
    try:
        peer = build_peer(name, problem)
    except PeerUnavailable as exc:
        return None, {"status": "unavailable", "reason": str(exc)}
    check = check_peer(peer, problem, reference)
    entry = {"note": peer.note, "max_abs_err": check.max_abs_err}
    if not check.ok:
        return None, {**entry, "status": "failed", "reason": check.reason}
    return peer, entry


@dataclass(frozen=True)
class Check:
    """Outcome of a peer's correctness check."""

    ok: bool
    max_abs_err: float | None
    reason: str | None = None


def check_peer(
    peer: BuiltPeer, problem: Problem, reference: torch.Tensor, set_index: int = 0, tol: float = TOLERANCE
) -> Check:
    """Runs the peer once on input copy ``set_index`` and compares with ``reference`` (max abs error < ``tol``).

    An exception in the peer is a failed check (its message is the reason), not a crash of the benchmark."""
    shape = (problem.total, problem.num_heads, problem.head_dim)
    try:
        with peer.context():
            out = peer.calls[set_index]()
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        if out.numel() != reference.numel():
            return Check(False, None, f"output has shape {tuple(out.shape)}, expected {shape} or [T, H*D]")
        err = (out.reshape(shape).to(reference.dtype) - reference).abs().max().item()
    except Exception as exc:  # a peer that raises is reported, not timed
        return Check(False, None, f"raised {describe(exc)}")
    if not err < tol:  # also catches NaN
        return Check(False, err, f"max abs error {err:.3g} >= {tol:g} against the fp32 reference")
    return Check(True, err)
