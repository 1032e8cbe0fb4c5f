"""The lab's mutant zoo: deliberately broken ports of the attention, pack, fused linear and decision contracts, each of
which the quick level must catch, and correct ports that must pass. The score (caught / mutants) is printed here and
stated in ``docs/porting.md``.

Each mutant is one classic bug of a port (cross-image attention, a missing max subtraction, a batch-wide stabiliser,
an off-by-one offset, ``max_seqlen`` taken as every image's length, a dropped row, int64 offsets, the wrong tie rule,
...), written as a knob of one port per contract, or as a broken copy of the worked examples' ports
(``tests/test_porting_example.py``, ``tests/test_porting_decision.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from ragged_vit.core.selection import DecisionInput, TokenSelection
from ragged_vit.reference.linear import layer_norm_stats, merge_ln_stats
from ragged_vit.reference.pruners import EViTPruner, ThresholdL2Pruner
from ragged_vit.testing import (
    ConformanceError,
    attention_suite,
    check_attention,
    check_decision,
    check_linear,
    check_pack,
    linear_suite,
    pack_suite,
)
from tests.test_porting_decision import floor_count, int64_counts, later_ties, top_rate_per_image
from tests.test_porting_example import drops_last_row, off_by_one, starts_late, wrong_scale

# --- attention: one tiled port (online softmax over key tiles, as a fused kernel computes it) -----------------------


def online_softmax(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float,
    *,
    tile: int = 16,
    span: str = "image",
    stabiliser: str = "row",
    normalise: bool = True,
    key_tiles: int | None = None,
    layout: str = "qkv",
    offsets: str = "int32",
    last_row: bool = True,
) -> torch.Tensor:
    """The contract's ``qkv`` layout, one image at a time, keys in tiles of ``tile`` rows with a running maximum and
    sum in fp32 (flash attention's recurrence). The keyword arguments are the mutants' knobs; the defaults are the
    correct port."""
    total, width = qkv.shape
    dim = width // (3 * num_heads)
    split = (3, num_heads, dim) if layout == "qkv" else (num_heads, 3, dim)
    q, k, v = qkv.unflatten(1, split).unbind(1 if layout == "qkv" else 2)  # [T, H, D] each
    if offsets == "int64":  # read the int32 offsets as if they were int64
        raw = torch.cat([cu_seqlens, cu_seqlens.new_zeros(len(cu_seqlens) % 2)])
        cu_seqlens = raw.view(torch.int64).clamp(0, total)
    bounds = cu_seqlens.tolist()
    if span == "batch":  # one softmax over every row: images attend to each other
        bounds = [0, total]
    elif span == "bound":  # every image taken as max_seqlen rows from its start
        bounds = [(s, min(s + max_seqlen, total)) for s in bounds[:-1]]
    pairs = bounds if span == "bound" else list(zip(bounds[:-1], bounds[1:], strict=True))
    peak = (torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale).amax() if stabiliser == "batch" else None
    out = torch.zeros_like(q)
    for start, end in pairs:
        if end <= start:
            continue
        qs = q[start:end].float()
        m = torch.full((num_heads, end - start), -math.inf)
        s = torch.zeros(num_heads, end - start)
        acc = torch.zeros(num_heads, end - start, dim)
        for index, first in enumerate(range(start, end, tile)):
            if key_tiles is not None and index >= key_tiles:
                break
            ks, vs = k[first : min(first + tile, end)].float(), v[first : min(first + tile, end)].float()
            logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            if stabiliser == "none":  # exp of the raw logits, in the inputs' dtype
                p = logits.to(qkv.dtype).exp().float()
                acc += torch.einsum("hqk,khd->hqd", p, vs)
                s += p.sum(-1)
                continue
            top = torch.maximum(m, logits.amax(-1)) if stabiliser == "row" else peak.expand_as(m)
            p = (logits - top[..., None]).exp()
            correction = (m - top).exp().nan_to_num(0.0) if stabiliser == "row" else torch.ones_like(m)
            acc = acc * correction[..., None] + torch.einsum("hqk,khd->hqd", p, vs)
            s = s * correction + p.sum(-1)
            m = top
        result = acc / s[..., None] if normalise else acc
        out[start:end] = result.transpose(0, 1).to(qkv.dtype)
        if not last_row:
            out[end - 1] = 0
    return out.flatten(1)


ATTENTION_MUTANTS = {
    "wrong_scale": wrong_scale,
    "off_by_one_offsets": off_by_one,
    "cross_image": functools.partial(online_softmax, span="batch"),
    "max_seqlen_as_every_length": functools.partial(online_softmax, span="bound"),
    "no_max_subtraction": functools.partial(online_softmax, stabiliser="none"),
    "batch_wide_stabiliser": functools.partial(online_softmax, stabiliser="batch"),
    "unnormalised": functools.partial(online_softmax, normalise=False),
    "first_key_tile_only": functools.partial(online_softmax, tile=64, key_tiles=1),
    "heads_interleaved": functools.partial(online_softmax, layout="hqkv"),
    "int64_offsets": functools.partial(online_softmax, offsets="int64"),
    "last_row_unwritten": functools.partial(online_softmax, last_row=False),
}

# --- pack: a repack port by boolean indexing, one image at a time ---------------------------------------------------


def repack_by_indexing(tokens, cu_seqlens, keep, max_seqlen, *, order=1, bound=0, offsets="int32", uniform=False,
                       in_place=False):  # fmt: skip
    """The contract's ``repack``: each image's kept rows in order, then the offsets and the longest image. The
    keyword arguments are the mutants' knobs; the defaults are the correct port."""
    bounds = cu_seqlens.tolist()
    rows, lengths = [], []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        kept = tokens[start:end][keep[start:end]]
        rows.append(kept.flip(0) if order < 0 else kept)
        lengths.append(kept.shape[0])
    if in_place:  # writes its input: zeroes the dropped rows
        tokens[~keep] = 0
    out = torch.cat(rows) if rows else tokens[:0]
    counts = torch.tensor(lengths, dtype=torch.int64)
    if uniform:  # offsets as if every image kept the same number of rows
        counts = torch.full_like(counts, out.shape[0] // max(len(lengths), 1))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = counts.cumsum(0)
    cu = cu.to(torch.int32 if offsets == "int32" else torch.int64)
    return out, cu.to(tokens.device), max(lengths, default=0) + bound


PACK_MUTANTS = {
    "pack_drops_last_row": ("pack", drops_last_row),
    "pack_starts_late": ("pack", starts_late),
    "repack_reversed_rows": ("repack", functools.partial(repack_by_indexing, order=-1)),
    "repack_bound_below_longest": ("repack", functools.partial(repack_by_indexing, bound=-1)),
    "repack_int64_offsets": ("repack", functools.partial(repack_by_indexing, offsets="int64")),
    "repack_uniform_offsets": ("repack", functools.partial(repack_by_indexing, uniform=True)),
    "repack_writes_its_input": ("repack", functools.partial(repack_by_indexing, in_place=True)),
}

# --- fused linear: a split-K port in PyTorch, K in slabs whose fp32 partials are added in order ---------------------


def split_k_linear(x, weight, bias=None, *, ln_weight=None, ln_bias=None, eps=1e-5, activation=None, residual=None,
                   gamma=None, ln_stats=None, stats_out=None, splits=3, centre=True, eps_inside=True,
                   drop_split=False, residual_first=False, accumulator=None, naive_tanh=False, tile_stats=False,
                   moments=False, equal_chunks=False, stats_before_residual=False, fixup=None, arrival_order=False,
                   reset=True):  # fmt: skip
    """The contract's fused linear as a split-K kernel computes it: the LayerNorm in fp32 rounded to the inputs' dtype
    (from ``ln_stats`` where given), K in ``splits`` slabs of fp32 partial sums added in order (by a second kernel,
    or with ``fixup``, a dict kept between calls as a counter buffer is, by the last program to arrive:
    :func:`_last_program_sum`), the epilogue in fp32, one rounding, and the output's statistics into ``stats_out``.
    The keyword arguments after ``stats_out`` are the mutants' knobs; the defaults are the correct port."""
    h = x.float()
    if ln_weight is not None:
        rows = h if not tile_stats else h.reshape(1, -1)  # statistics over every row together
        mean = rows.mean(-1, keepdim=True)
        var = (rows - mean).square().mean(-1, keepdim=True)
        if moments:  # E[x^2] - E[x]^2 in fp32: cancellation on a large mean
            var = (rows * rows).mean(-1, keepdim=True) - mean * mean
        if ln_stats is not None:
            mean, var = _merged(ln_stats, x.shape[1], equal_chunks)
        rstd = torch.rsqrt(var + eps) if eps_inside else 1.0 / (var.sqrt() + eps)
        if tile_stats:
            mean, rstd = mean.expand(h.shape[0], 1), rstd.expand(h.shape[0], 1)
        h = ((h - mean) if centre else h) * rstd * ln_weight.float()
        if ln_bias is not None:
            h = h + ln_bias.float()
    h = h.to(x.dtype).float()
    depth = x.shape[1]
    slab = -(-depth // splits)
    if accumulator is not None:  # a low-precision accumulator: every 16-wide step rounded to it
        y = torch.zeros(x.shape[0], weight.shape[0], dtype=accumulator)
        for k in range(0, depth, 16):
            y = (y.float() + h[:, k : k + 16] @ weight[:, k : k + 16].float().T).to(accumulator)
        y = y.float()
    else:
        parts = [h[:, k : k + slab] @ weight[:, k : k + slab].float().T for k in range(0, depth, slab)]
        parts = parts[:-1] if drop_split else parts
        y = sum(parts) if fixup is None else _last_program_sum(parts, fixup, arrival_order, reset)
    if bias is not None:
        y = y + bias.float()
    if residual_first and residual is not None:
        y = y + residual.float()
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        if naive_tanh:  # tanh as (e^2u - 1) / (e^2u + 1): inf / inf for a large u
            u = 0.7978845608028654 * (y + 0.044715 * y**3)
            y = 0.5 * y * (1.0 + (torch.exp(2 * u) - 1) / (torch.exp(2 * u) + 1))
        else:
            y = F.gelu(y, approximate="tanh")
    if gamma is not None:
        y = gamma.float() * y
    if residual is not None and not residual_first:
        y = residual.float() + y
    out = y.to(x.dtype)
    if stats_out is not None:  # of the rounded output (the mutant: of the sum before the residual add)
        source = y - residual.float() if stats_before_residual and residual is not None else out
        stats_out.copy_(layer_norm_stats(source.float(), stats_out.shape[0]))
    return out


def _last_program_sum(parts, counter, arrival_order, reset):
    """The single-launch split-K on one output tile: the split programs arrive in an order that changes from call to
    call (rotated, as a GPU schedules them), each adds one to the tile's count after storing its partial, and the one
    that sees ``splits - 1`` adds the partials in split order (the mutant: in arrival order) and sets the count back
    to 0 (the mutant: leaves it, so no later call finds a last program and the output stays unwritten, NaN)."""
    counter["calls"] = counter.get("calls", 0) + 1
    arrivals = [(counter["calls"] + s) % len(parts) for s in range(len(parts))]
    total = torch.full_like(parts[0], float("nan"))
    for _ in arrivals:
        counter["count"] = counter.get("count", 0) + 1
        if counter["count"] == len(parts):  # this program saw splits - 1 before its add
            total = sum(parts[s] for s in arrivals) if arrival_order else sum(parts)
            if reset:
                counter["count"] = 0
    return total


def _merged(ln_stats, depth, equal_chunks):
    """Mean and variance ``[M, 1]`` from chunked statistics (the mutant: every chunk counted as ``depth / P``
    columns, wrong for an uneven last chunk)."""
    if not equal_chunks:
        return (t[:, None] for t in merge_ln_stats(ln_stats, depth))
    count = depth / ln_stats.shape[0]
    mean = ln_stats[..., 0].mean(0)
    m2 = ln_stats[..., 1].sum(0) + count * (ln_stats[..., 0] - mean).square().sum(0)
    return mean[:, None], (m2 / depth)[:, None]


def two_chunk_stats(rows, cols, device):
    """The split-K port's ``stats_out`` buffer: two chunks (uneven where ``cols`` is not a power of two)."""
    return torch.empty((2, rows, 2), device=device)


LINEAR_MUTANTS = {
    "layer_norm_without_mean": functools.partial(split_k_linear, centre=False),
    "layer_norm_eps_outside_sqrt": functools.partial(split_k_linear, eps_inside=False),
    "layer_norm_stats_over_the_tile": functools.partial(split_k_linear, tile_stats=True),
    "layer_norm_variance_by_moments": functools.partial(split_k_linear, moments=True),
    "split_k_partial_dropped": functools.partial(split_k_linear, drop_split=True),
    "residual_added_before_gelu": functools.partial(split_k_linear, residual_first=True),
    "fp16_accumulator": functools.partial(split_k_linear, accumulator=torch.float16),
    "tanh_overflows": functools.partial(split_k_linear, naive_tanh=True),
    "ln_stats_chunks_counted_equal": functools.partial(split_k_linear, equal_chunks=True),
    "stats_out_before_residual": functools.partial(split_k_linear, stats_before_residual=True),
    "split_k_partials_in_arrival_order": functools.partial(split_k_linear, fixup={}, arrival_order=True),
    "split_k_counter_not_reset": functools.partial(split_k_linear, fixup={}, reset=False),
}
LINEAR_OPTIONS = {"ln_stats": True, "stats_buffer": two_chunk_stats}  # the port takes and writes statistics

# --- decision: broken copies of the worked example's Threshold-L2 ratio port ----------------------------------------


def fp16_scores(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """Broken: norms summed in the inputs' fp16 (overflow to inf, then ties, on large rows)."""
    half = inp.x.half() if inp.x.dtype == torch.float16 else inp.x
    norms = half.pow(2).sum(-1).sqrt()  # summed in fp16 when x is fp16
    scaled = inp.x * (norms / torch.linalg.vector_norm(inp.x.float(), dim=-1).clamp_min(1e-30)).to(inp.x.dtype)[:, None]
    return top_rate_per_image(pruner, DecisionInput(**{**vars(inp), "x": scaled}))


def batch_top_k(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """Broken: one top-k over the whole batch's patches (as many as the images keep together)."""
    sel = top_rate_per_image(pruner, inp)
    bounds, prefix = inp.cu_seqlens.tolist(), inp.num_prefix
    patch = torch.ones(inp.x.shape[0], dtype=torch.bool)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        patch[start : min(start + prefix, end)] = False
    scores = torch.linalg.vector_norm(inp.x.float(), dim=-1).masked_fill(~patch, -math.inf)
    best = scores.argsort(descending=True, stable=True)[: int((sel.keep & patch).sum())]
    keep = ~patch
    keep[best] = True
    kept = torch.tensor([int(keep[s:e].sum()) for s, e in zip(bounds[:-1], bounds[1:], strict=True)], dtype=torch.int32)
    return TokenSelection(keep, kept, sel.fixed_count, sel.count)


def drops_prefix(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """Broken: the prefix rows (class token, registers) are not kept."""
    sel = top_rate_per_image(pruner, inp)
    keep = sel.keep.clone()
    for start in inp.cu_seqlens.tolist()[:-1]:
        keep[start : start + inp.num_prefix] = False
    return TokenSelection(keep, sel.kept, sel.fixed_count, sel.count)


def counts_off_by_one(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """Broken: every image's kept count one too many (the repack would read a row no image keeps)."""
    sel = top_rate_per_image(pruner, inp)
    return TokenSelection(sel.keep, sel.kept + 1, sel.fixed_count, sel.count)


def count_from_total(pruner: ThresholdL2Pruner, inp: DecisionInput) -> TokenSelection:
    """Broken: the batch taken as uniform whenever its size divides the total (the offsets unread, as on a GPU; a
    batch of several image sizes, ``image_patches``, too), the host count of that one length."""
    sel, batch = top_rate_per_image(pruner, inp), inp.cu_seqlens.numel() - 1
    if inp.x.shape[0] % batch:
        return sel
    count = inp.num_prefix + pruner.count_after(inp.stage, inp.x.shape[0] // batch - inp.num_prefix, inp.num_patches)
    return TokenSelection(sel.keep, sel.kept, True, count)


DECISION_MUTANTS = {
    "later_ties": later_ties,
    "floor_count": floor_count,
    "int64_counts": int64_counts,
    "fp16_scores": fp16_scores,
    "batch_top_k": batch_top_k,
    "drops_prefix": drops_prefix,
    "counts_off_by_one": counts_off_by_one,
    "count_from_total": count_from_total,
}

PRUNER = ThresholdL2Pruner("ratio", rate=0.5, min_keep=0)


def ignores_rotation(pruner: EViTPruner, inp: DecisionInput) -> TokenSelection:
    """Broken: a decision by attention that scores the keys unrotated (a RoPE model's ``inp.rotary`` dropped)."""
    return pruner(dataclasses.replace(inp, rotary=None))


ATTENTION_DECISION_MUTANTS = {"ignores_rotation": ignores_rotation}
ATTENTION_PRUNER = EViTPruner(rate=0.5)


def _caught(check) -> bool:
    try:
        check()
    except ConformanceError:
        return True
    return False


def _zoo() -> dict[str, bool]:
    """Every mutant, caught or not at the quick level."""
    caught = {f"attention/{n}": _caught(lambda f=f: check_attention(f, level_name="quick")) for n, f in
              ATTENTION_MUTANTS.items()}  # fmt: skip
    caught |= {f"pack/{n}": _caught(lambda op=op, f=f: check_pack(**{op: f}, level_name="quick")) for n, (op, f) in
               PACK_MUTANTS.items()}  # fmt: skip
    caught |= {f"linear/{n}": _caught(lambda f=f: check_linear(f, level_name="quick", **LINEAR_OPTIONS)) for n, f in
               LINEAR_MUTANTS.items()}  # fmt: skip
    caught |= {f"decision/{n}": _caught(lambda f=f: check_decision(PRUNER, f, "quick")) for n, f in
               DECISION_MUTANTS.items()}  # fmt: skip
    caught |= {f"decision/{n}": _caught(lambda f=f: check_decision(ATTENTION_PRUNER, f, "quick", exact=False))
               for n, f in ATTENTION_DECISION_MUTANTS.items()}  # fmt: skip
    return caught


def test_every_mutant_is_caught_at_the_quick_level():
    caught = _zoo()
    assert len(caught) >= 30
    score = sum(caught.values())
    print(f"\nmutation score: {score}/{len(caught)} caught at the quick level")  # shown with pytest -s
    assert score == len(caught), f"survivors: {[name for name, ok in caught.items() if not ok]}"


# The correct ports: every case passes, each a test item.
test_online_softmax_conforms = attention_suite(online_softmax, layout="qkv")
test_repack_by_indexing_conforms = pack_suite(repack=repack_by_indexing)
test_split_k_linear_conforms = linear_suite(split_k_linear, **LINEAR_OPTIONS)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_k_linear_at_other_splits(splits):
    check_linear(functools.partial(split_k_linear, splits=splits), level_name="quick", **LINEAR_OPTIONS)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_linear_single_launch(splits):
    """The last-program port (partials in split order, its count reset) conforms, call after call."""
    check_linear(functools.partial(split_k_linear, splits=splits, fixup={}), level_name="quick", **LINEAR_OPTIONS)


@pytest.mark.parametrize("tile", [1, 7, 64])
def test_online_softmax_at_other_tiles(tile):
    check_attention(functools.partial(online_softmax, tile=tile), level_name="quick")
