"""ToMe's merge kernels (:mod:`ragged_vit.triton_impl.merging`) against their reference,
:mod:`ragged_vit.reference.merging`, run on the CPU.

Rules (the module docstring says why):

* decisions (destinations, counts, offsets): bit for bit the reference's (the kernel's int32 destinations compared as
  int64) on keys where the reference's margins are clear, checked in float64 (:func:`_clear`): each merged A row's
  best B row more than ``MARGIN = 1e-5`` above every other B row, the merged A rows' best similarities more than that
  above the unmerged ones', every best similarity more than that away from the threshold, and, in an image without
  prefix rows that merges (its unmerged A rows follow in rank order), every two unmerged A rows' best similarities
  more than ``ORDER_MARGIN = 1e-6`` apart; random keys are redrawn image by image until they are clear. Closer than
  a margin only where the tie is exact in any order: the same two vectors (``duplicates``: every A row one of 3
  vectors, every B row one of 3 others) or similarities exact in fp32 (``dyadic`` unit vectors, a zero key among
  them: ties everywhere, thresholds equal to similarities). The ties must break by index as in the reference. The
  kept order compares every pair of unmerged A rows (276 of them at 577 rows and ``r = 13``, where 1e-5 would leave
  one draw in 200 clear), so its margin is tighter, still far above the spread of fp32 best similarities between
  summation orders (sequential or pairwise head sums, tree or sequential norms, rsqrt, FMA dot products in one chain
  or in blocks of 16, against the reference's: a standard deviation of 5e-8, at most 3e-7 over 100,000 rows of
  DeiT-B's geometry). Without it a draw with two unmerged rows 4e-8 apart in float64 (1.4 fp32 units) had their
  order, and so their destinations, swapped on a GPU (one FMA chain over ``D`` for the dot product reverses them);
* merged rows (on the reference's own map, int64, and on the kernel's, int32): a row that receives one row is that
  row, bit for bit; bit for bit the reference's rounded to ``x``'s dtype where every partial sum is exact (quarter
  steps, sizes up to 8); else within ``(k + 2) * 2**-24 * sum(size * |x|) / sum(size)`` for ``k`` sources (the
  kernel's ``k + 1`` fp32 roundings and the reference's one) plus one rounding of ``x``'s dtype (``eps * |ref|``,
  half a subnormal step near zero). Sizes: exact;
* fused residual add: the merged rows of ``x`` and ``residual`` are the unfused merge of ``torch.add(x, residual)``,
  bit for bit (so the merge rules above hold for them); fused LayerNorm (:func:`_check_normed`): within
  ``eps * |want|`` of ``x``'s dtype plus ``NORM_ULPS = 16`` fp32 units of the normalised row's scale of
  ``F.layer_norm`` in fp32 of the merged rows as stored (measured under the interpreter: at most 0.7 of that bound
  in fp16, 0.3 in fp32);
* isolation (an image's results whatever the other images hold, and alone as in a batch), repeated calls, CUDA graph
  replays and poisoned outputs: bit for bit.

GPU tests run DeiT-B's geometry (12 heads of 64, 768 channels) in fp16, bf16 and fp32; their CPU twins run small
images (3 heads of 8: ``D`` below ``tl.dot``'s 16, padded) under Triton's interpreter in fp32 and fp16 (bf16 is not
exact there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragged_vit.core.segments import cu_seqlens_from_counts, seqlens
from ragged_vit.core.selection import MergeSelection
from ragged_vit.reference import merging as ref
from ragged_vit.reference import packing as ref_packing
from ragged_vit.testing.ops import op_names
from ragged_vit.triton_impl import merging as ker
from ragged_vit.triton_impl.launcher import pdl_supported
from tests.helpers import levels, rotated, sync_free

MARGIN = 1e-5  # far above fp32's rounding of a similarity (~1e-7), far below the gaps of random keys
ORDER_MARGIN = 1e-6  # the kept order without prefix rows: every pair of unmerged A rows (module docstring)
LENGTHS = (1, 2, 3, 63, 64, 65, 197, 0)  # around the 64-row tiles, DeiT's 197, an empty image
EDGE_LENGTHS = (1, 2, 3, 63, 64, 65, 0)  # the quick level's: the tile edges without DeiT's 197 (a third of the work)
RANDOM = "random"  # a threshold drawn per case, where it splits the best similarities
MODES = [
    {"r": 0}, {"r": 1}, {"r": 8}, {"r": 13}, {"r": 16}, {"r": 200},  # 200: capped at patches // 2 everywhere
    {"threshold": -1.01, "r_max": 13}, {"threshold": 1.01, "r_max": 13}, {"threshold": RANDOM, "r_max": 40},
]  # fmt: skip
CPU_SHAPE = dict(heads=3, dim=8)
GPU_SHAPE = dict(heads=12, dim=64)


def _mode_id(mode):
    return "-".join(f"{k}{v}" for k, v in mode.items())


# --- inputs ---------------------------------------------------------------------------------------------------------


def _limit_threshold(mode):
    return (mode["r"], None) if "r" in mode else (mode["r_max"], mode["threshold"])


def _clear(keys64, labels, num_prefix, limit, threshold):
    """Whether the reference's decision on one image (float64 keys ``[n, H, D]``) has clear margins (module
    docstring). ``labels`` ``[n]`` names each row's vector: two similarities are exact ties in any order only where
    they pair the same two vectors (the similarity of two different vectors to themselves is 1 in exact arithmetic,
    not in fp32)."""
    metric = F.normalize(keys64.mean(1), dim=-1)
    rows = torch.arange(metric.shape[0])
    a_rows, b_rows = rows[0::2], rows[1::2]  # the split over every row; prefix rows never merge
    a_rows, b_rows = a_rows[a_rows >= num_prefix], b_rows[b_rows >= num_prefix]
    a, b = metric[a_rows], metric[b_rows]
    label_a, label_b = labels[a_rows], labels[b_rows]
    cap = min(limit, max(metric.shape[0] - num_prefix, 0) // 2)
    if cap == 0:
        return True
    sim = a @ b.T
    best, match = sim.max(1)
    off = (best - threshold).abs() if threshold is not None else None
    if off is not None and bool(((off > 0) & (off <= MARGIN)).any()):  # equal: only dyadic keys, exact
        return False
    count = cap if threshold is None else min(cap, int((best >= threshold).sum()))
    merged = torch.zeros_like(best, dtype=torch.bool)
    merged[torch.argsort(best, descending=True, stable=True)[:count]] = True
    # a merged row's best B row: every B row as similar up to the margin is the same vector
    near = (best[:, None] - sim <= MARGIN) & (label_b[None, :] != label_b[match][:, None])
    if bool(near[merged].any()):
        return False
    # across the cut: a merged and an unmerged row as similar up to the margin pair the same two vectors
    pair = torch.minimum(label_a, label_b[match]) * (labels.numel() + 1) + torch.maximum(label_a, label_b[match])
    close = best[merged][:, None] - best[~merged][None, :] <= MARGIN
    if bool((close & (pair[merged][:, None] != pair[~merged][None, :])).any()):
        return False
    if num_prefix > 0 or count == 0:  # the unmerged A rows stay in index order (none merged: every row does)
        return True
    # without prefix rows the unmerged A rows follow in rank order: two as similar up to the margin pair the same two
    # vectors (a swap of their best similarities' last bits swaps their destinations)
    kept, kept_pair = best[~merged], pair[~merged]
    tied = (kept[:, None] - kept[None, :]).abs() <= ORDER_MARGIN
    return not bool((tied & (kept_pair[:, None] != kept_pair[None, :])).any())


def _dyadic_vectors(count, dim, gen):
    """``count`` unit vectors whose similarities are exact in fp32 in any order: zero, ``+-e_k``, or four entries
    ``+-0.5``; similarities in ``{-1, -0.5, 0, 0.5, 1}``."""
    vectors = torch.zeros(count, dim)
    for v in vectors[1:]:
        picks = torch.randperm(dim, generator=gen)[: 1 if torch.rand((), generator=gen) < 0.5 else 4]
        v[picks] = (torch.randint(0, 2, (picks.numel(),), generator=gen) * 2 - 1) / (1 if picks.numel() == 1 else 2)
    return vectors


def _image_keys(n, num_prefix, gen, heads, dim, ties):
    """One image's keys and the labels naming each row's vector (:func:`_clear`)."""
    if ties == "dyadic":  # every head the same vector scaled by a power of two: the mean and the norm exact
        labels = torch.randint(0, 6, (n,), generator=gen)
        scale = 2.0 ** torch.randint(-2, 3, (n, 1, 1), generator=gen)
        keys = _dyadic_vectors(6, dim, gen)[labels][:, None, :].expand(n, heads, dim) * scale
        return keys, torch.zeros(n, dtype=torch.int64)  # every similarity exact: ties are ties in any order
    labels, keys = torch.arange(n), torch.randn(n, heads, dim, generator=gen)
    if ties == "duplicates":  # A rows drawn from 3 vectors, B rows from 3 others
        vectors = torch.randn(6, heads, dim, generator=gen)
        patch = torch.arange(n) - num_prefix
        labels = torch.where(patch < 0, 6 + torch.arange(n), torch.randint(0, 3, (n,), generator=gen) + 3 * (patch % 2))
        keys = torch.where((patch < 0)[:, None, None], keys, vectors[labels.clamp(max=5)])
    return keys, labels


def _keys(lengths, mode, num_prefix, gen, *, heads, dim, dtype=torch.float32, ties=None):
    """Keys ``[T, H, D]`` in ``dtype``, each image redrawn until the reference's margins are clear; ``ties``:
    ``duplicates`` (every A row one of 3 vectors, every B row one of 3 others) or ``dyadic``
    (:func:`_dyadic_vectors`, one of them zero)."""
    limit, threshold = _limit_threshold(mode)
    images = []
    for n in lengths:
        for _ in range(100):
            keys, labels = _image_keys(n, num_prefix, gen, heads, dim, ties)
            keys = keys.to(dtype)
            if _clear(keys.double(), labels, num_prefix, limit, threshold):
                break
        else:
            raise AssertionError(f"no keys with clear margins for an image of {n} rows in 100 draws")
        images.append(keys)
    return torch.cat(images)


def _resolve(mode, gen):
    """The mode with a random threshold drawn (between typical best similarities of random keys)."""
    if mode.get("threshold") == RANDOM:
        return {**mode, "threshold": float(torch.empty(()).uniform_(0.2, 0.8, generator=gen))}
    return mode


def _strided(keys):
    """``keys`` as the key part of a packed qkv buffer ``[T, 3, H, D]`` (the pipelines' layout): row stride 3*H*D."""
    qkv = torch.full((keys.shape[0], 3, *keys.shape[1:]), float("nan"), dtype=keys.dtype, device=keys.device)
    qkv[:, 1] = keys
    return qkv[:, 1]


def _kept_order_keys(delta, same=False):
    """Ten rows of one head (float64): B rows ``e0..e4``; A row 2 is ``e0`` (best 1: the one merged at ``r = 1``),
    A rows 4 and 6 best ``0.5`` to ``e1`` and ``0.5 + delta`` to ``e2`` (``same``: row 6 is row 4, label too), A rows 0
    and 8 far from both. Labels: every row its own vector."""

    def unit(k, c, side):
        v = torch.zeros(8, dtype=torch.float64)
        v[k], v[side] = c, (1 - c * c) ** 0.5
        return v

    e = torch.eye(8, dtype=torch.float64)
    rows = [e[7], e[0], e[0], e[1], unit(1, 0.5, 5), e[2], unit(2, 0.5 + delta, 6), e[3], unit(3, 0.3, 7), e[4]]
    labels = torch.arange(10)
    if same:
        rows[6], labels[6] = rows[4], labels[4]
    return torch.stack(rows)[:, None, :], labels


def test_clear_rejects_near_ties_in_the_kept_order():
    """Without prefix rows the unmerged A rows go in rank order (the reference's ``order[count:]``): two of them
    closer than ``ORDER_MARGIN``, not the same pair of vectors, may swap in fp32 (a GPU swapped two 4e-8 apart),
    so :func:`_clear` redraws them; farther apart, an exact tie, a prefix row (index order) or an image
    that merges nothing (kept as it is) are clear."""
    for delta in (0.0, 1e-7, ORDER_MARGIN / 2):
        assert not _clear(*_kept_order_keys(delta), 0, 1, None), delta
        assert _clear(*_kept_order_keys(delta), 1, 1, None), delta  # a prefix row: unmerged rows in index order
        assert _clear(*_kept_order_keys(delta), 0, 1, 1.01), delta  # none passes the threshold: nothing moves
    assert not _clear(*_kept_order_keys(1e-7), 0, 1, 0.9)  # adaptive: one merges, the rest in rank order
    assert _clear(*_kept_order_keys(2 * ORDER_MARGIN), 0, 1, None)
    assert _clear(*_kept_order_keys(0.0, same=True), 0, 1, None)  # the same two vectors: equal bits in any order


# --- decisions ------------------------------------------------------------------------------------------------------


def _check_decision(keys, cu, max_seqlen, num_prefix, mode):
    """The kernel's map against the reference's, bit for bit; returns the kernel's."""
    ones = torch.ones(keys.shape[0], dtype=torch.int64)
    want = ref.decide_merges(keys.cpu(), cu.cpu(), ones, num_prefix, **mode)
    got = ker.decide_merges(keys, cu, max_seqlen, num_prefix, **mode)
    batch = cu.shape[0] - 1
    for name, tensor, shape in (("destination", got.destination, keys.shape[:1]), ("kept", got.kept, (batch,)),
                                ("cu_seqlens", got.cu_seqlens, (batch + 1,))):  # fmt: skip
        assert tensor.dtype == torch.int32 and tensor.shape == shape and tensor.device == keys.device, name
    assert torch.equal(got.cu_seqlens.cpu(), want.cu_seqlens), (got.cu_seqlens.tolist(), want.cu_seqlens.tolist())
    assert torch.equal(got.kept.cpu(), seqlens(want.cu_seqlens).int())
    differ = (got.destination.cpu().long() != want.destination).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} destinations differ, first at row {differ[:1].tolist()}"
    # The source lists are the map's (merge_sources), up to T' for the offsets (the kernel writes no more).
    sources, offsets = ref.merge_sources(want.destination)
    merged = int(want.cu_seqlens[-1])
    assert got.sources.shape == keys.shape[:1] and got.source_offsets.shape == (keys.shape[0] + 1,)
    assert torch.equal(got.sources.cpu(), sources)
    assert torch.equal(got.source_offsets[: merged + 1].cpu(), offsets[: merged + 1])
    return got


def _decisions(device, lengths, mode, num_prefix, gen, shape, dtype=torch.float32, ties=None, bound=None):
    mode = _resolve(mode, gen)
    keys = _keys(lengths, mode, num_prefix, gen, dtype=dtype, ties=ties, **shape).to(device)
    cu = cu_seqlens_from_counts(torch.tensor(lengths)).to(device)
    if num_prefix == 1:  # the pipelines' layout: a view of the qkv projection
        keys = _strided(keys)
    _check_decision(keys, cu, bound or max(max(lengths), 1), num_prefix, mode)


DECISION_SETUPS = [(0, torch.float32), (1, torch.float32), (2, torch.float32), (1, torch.float16)]


def _decision_rows():
    """Quick: every mode once on the tile edges, the setups (prefix rows, dtype) in turn; full: every setup
    in every mode on the lengths with DeiT's 197."""
    edges = [(*DECISION_SETUPS[i % len(DECISION_SETUPS)], mode, "edges") for i, mode in enumerate(MODES)]
    return edges + [(*setup, mode, "deit") for setup in DECISION_SETUPS for mode in MODES]


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "num_prefix,dtype,mode,lengths",
    levels(_decision_rows(), lambda *row: row[-1] == "edges",
           ids=lambda n, dtype, mode, lengths: f"p{n}-{str(dtype)[6:]}-{_mode_id(mode)}-{lengths}"),
)  # fmt: skip
def test_decisions_are_the_reference_interpreter(num_prefix, dtype, mode, lengths, gen):
    lengths = EDGE_LENGTHS if lengths == "edges" else LENGTHS
    _decisions("cpu", lengths, mode, num_prefix, gen, CPU_SHAPE, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "sms,tile,mode",
    levels([(sms, tile, mode) for sms, tile in ((32, 1), (1, 2)) for mode in MODES],
           lambda sms, tile, mode: mode == ({"r": 13} if tile == 1 else {"threshold": RANDOM, "r_max": 40}),
           ids=lambda sms, tile, mode: f"{sms}-{tile}-{_mode_id(mode)}"),
)  # fmt: skip
def test_decisions_on_large_batch_tiles_interpreter(sms, tile, mode, gen, monkeypatch):
    """The tiles of batches too large for the SMs (the best match's larger A tiles; 64 and 128 rows of the source
    lists): the same maps as the reference's (quick: a fixed and an adaptive mode, one per tile)."""
    monkeypatch.setattr(ker, "_INTERPRETER_SMS", sms)
    num_a = ker.cdiv(max(LENGTHS), 2)  # the split over every row
    assert ker._best_tile(len(LENGTHS), num_a, sms) == ker._BEST_TILES[tile]
    assert ker._list_rows(len(LENGTHS), max(LENGTHS), sms) == ker._LIST_ROWS[tile]
    _decisions("cpu", LENGTHS, mode, 1, gen, CPU_SHAPE)


GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each mode once, the prefix counts and dtypes in turn
    "mode,num_prefix,dtype",
    rotated([(m, n, d) for m in MODES for n in (0, 1, 2) for d in GPU_DTYPES], lambda m, n, d: _mode_id(m),
            lambda m, n, d: (n, d), ids=lambda m, n, d: f"{_mode_id(m)}-p{n}-{str(d)[6:]}"),
)  # fmt: skip
def test_decisions_are_the_reference_gpu(mode, num_prefix, dtype, gen):
    ragged = tuple(torch.randint(0, 198, (64,), generator=gen).tolist())
    for lengths in (LENGTHS, (197,) * 8, ragged, (577,) * 4):
        _decisions("cuda", lengths, mode, num_prefix, gen, GPU_SHAPE, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [{"r": 13}, {"threshold": RANDOM, "r_max": 40}], ids=_mode_id)
def test_dependent_launches_change_no_bit_gpu(mode, gen, monkeypatch):
    """One image's decision (``DECISION_PDL_MAX_IMAGES``) launched with programmatic dependent launch and without:
    the reference's maps, the same bits. (The interpreter launches nothing: its twins are the tests above.)"""
    if not pdl_supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs a Hopper or newer GPU and a Triton with launch_pdl")
    mode = _resolve(mode, gen)
    assert ker.DECISION_PDL_MAX_IMAGES >= 1
    for n in (197, 577, 65, 2):
        keys = _strided(_keys((n,), mode, 1, gen, dtype=torch.float16, **GPU_SHAPE).cuda())
        cu = cu_seqlens_from_counts(torch.tensor([n])).cuda()
        runs = []
        for bound in (1, 0):  # with PDL, then without
            monkeypatch.setattr(ker, "DECISION_PDL_MAX_IMAGES", bound)
            got = _check_decision(keys, cu, n, 1, mode)
            merged = int(got.cu_seqlens[-1])
            runs.append((got.destination, got.kept, got.cu_seqlens, got.sources, got.source_offsets[: merged + 1]))
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


TIE_LENGTHS = (2, 9, 64, 65, 150, 33)  # 150: 74 B rows, two B tiles
TIE_KINDS = ("duplicates", "dyadic")
TIE_MODES = ({"r": 4}, {"r": 40}, {"threshold": RANDOM, "r_max": 40}, {"threshold": 0.5, "r_max": 9})


def _tie_bounds(device, shape, gen, dtype=torch.float32):
    """Exact ties with a loose bound (twice the longest image) and a short one."""
    _decisions(device, TIE_LENGTHS, {"r": 13}, 1, gen, shape, dtype, "dyadic", bound=2 * 65 + 7)
    _decisions(device, TIE_LENGTHS, {"threshold": 0.5, "r_max": 13}, 1, gen, shape, dtype, "duplicates", bound=5)


def _ties(device, shape, gen, dtype=torch.float32):
    """Exact ties (duplicate keys; dyadic keys, whose similarities are exact): broken by index as the reference
    breaks them, in both modes; also with a loose bound (twice the longest image) and a short one."""
    for ties in TIE_KINDS:
        for num_prefix in (0, 1, 2):
            for mode in TIE_MODES:
                _decisions(device, TIE_LENGTHS, mode, num_prefix, gen, shape, dtype, ties)
    _tie_bounds(device, shape, gen, dtype)


TIE_QUICK = {("duplicates", 0): 0, ("duplicates", 2): 2, ("dyadic", 1): 1, ("dyadic", 2): 3}  # -> TIE_MODES index


def _tie_quick(ties, num_prefix, mode):
    """Quick: each tie kind twice, each prefix count and each mode once or more."""
    return TIE_MODES.index(mode) == TIE_QUICK.get((ties, num_prefix))


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "ties,num_prefix,mode",
    levels([(t, n, m) for t in TIE_KINDS for n in (0, 1, 2) for m in TIE_MODES], _tie_quick,
           ids=lambda t, n, m: f"{t}-p{n}-{_mode_id(m)}"),
)  # fmt: skip
def test_exact_ties_break_by_index_interpreter(ties, num_prefix, mode, gen):
    _decisions("cpu", TIE_LENGTHS, mode, num_prefix, gen, CPU_SHAPE, ties=ties)


@pytest.mark.interpreter
def test_exact_ties_with_loose_and_short_bounds_interpreter(gen):
    _tie_bounds("cpu", CPU_SHAPE, gen)


@pytest.mark.interpreter
def test_exact_ties_at_deit_heads_interpreter(gen):
    """DeiT's heads (12 of 64), 4 A rows and 3 B rows: there torch's CPU GEMM often summed two equal A rows
    differently, and the reference broke their tie by rounding (it now sums every pair alike)."""
    for mode in ({"r": 2}, {"r": 3}, {"threshold": 0.5, "r_max": 3}):
        _decisions("cpu", (9,) * 8, mode, 2, gen, GPU_SHAPE, ties="duplicates")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_ties_break_by_index_gpu(dtype, gen):
    _ties("cuda", GPU_SHAPE, gen, dtype)


def _nonfinite(device, shape, gen):
    """NaN and infinite keys (the reference refuses them): the fixed counts are the rule's, every destination lies in
    its image's merged rows, prefix rows stay first, and every merged row receives a row."""
    lengths = (40, 1, 65, 30)
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    keys = torch.randn(int(cu[-1]), shape["heads"], shape["dim"], generator=gen)
    keys[torch.randperm(keys.shape[0], generator=gen)[:20]] = float("nan")
    keys[torch.randperm(keys.shape[0], generator=gen)[:5], 0] = float("inf")
    keys[cu[2] : cu[3]] = float("nan")  # an image of NaN only
    for mode in ({"r": 9}, {"threshold": 0.1, "r_max": 9}):
        got = ker.decide_merges(keys.to(device), cu.to(device), 65, 2, **mode)
        new_cu, dest = got.cu_seqlens.cpu(), got.destination.cpu().long()
        if "r" in mode:
            counts = [n - ref.merge_count(max(n - 2, 0), 9) for n in lengths]
            assert torch.equal(new_cu, cu_seqlens_from_counts(torch.tensor(counts)))
        for b in range(len(lengths)):
            image = dest[cu[b] : cu[b + 1]]
            assert image.tolist()[:2] == list(range(int(new_cu[b]), int(new_cu[b]) + min(2, lengths[b])))
            assert sorted(set(image.tolist())) == list(range(int(new_cu[b]), int(new_cu[b + 1])))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf / inf, as intended
def test_nonfinite_keys_keep_the_map_valid_interpreter(gen):
    _nonfinite("cpu", CPU_SHAPE, gen)


@pytest.mark.gpu
def test_nonfinite_keys_keep_the_map_valid_gpu(gen):
    _nonfinite("cuda", GPU_SHAPE, gen)


# --- merged rows ----------------------------------------------------------------------------------------------------


def _rows(total, channels, dtype, gen, kind):
    """Rows and sizes: ``dyadic`` rows in quarter steps and sizes up to 8 (every partial sum exact in fp32)."""
    if kind == "dyadic":
        x = torch.randint(-64, 65, (total, channels), generator=gen).float() / 4
        sizes = torch.randint(1, 9, (total,), generator=gen)
    else:
        x = torch.randn(total, channels, generator=gen) * torch.rand(total, 1, generator=gen) * 4
        sizes = torch.randint(1, 200, (total,), generator=gen)
    return x.to(dtype), sizes


def _check_rows(got, got_sizes, x, sizes, destination, new_cu, kind):
    """The merge rule (module docstring) for the merged rows ``[0, T')`` of ``got``."""
    rows = int(new_cu[-1])
    x, sizes, destination = x.cpu(), sizes.cpu(), destination.cpu().long()
    want = ref.merge_rows(x.float(), sizes, destination, rows)  # float64 sums, rounded to fp32
    want_sizes = torch.zeros(rows, dtype=torch.int64).index_add_(0, destination, sizes.long())
    got, got_sizes = got[:rows].cpu(), got_sizes[:rows].cpu()
    assert got.dtype == x.dtype and got_sizes.dtype == sizes.dtype
    assert torch.equal(got_sizes.long(), want_sizes)
    sources = torch.zeros(rows, dtype=torch.int64).index_add_(0, destination, torch.ones_like(destination))
    lone = sources == 1
    assert torch.equal(got[lone].float(), want[lone]), "a row that receives one row is that row"
    if kind == "dyadic":
        assert torch.equal(got, want.to(x.dtype)), (got.float() - want).abs().max()
        return
    info = torch.finfo(x.dtype)
    magnitude = torch.zeros(rows, x.shape[1], dtype=torch.float64)
    magnitude.index_add_(0, destination, x.double().abs() * sizes.double()[:, None])
    magnitude /= want_sizes.double()[:, None]
    allowed = (sources[:, None] + 2) * 2.0**-24 * magnitude
    allowed = allowed + info.eps * want.double().abs() + info.smallest_normal * info.eps / 2
    over = (got.double() - want.double()).abs() - allowed
    assert bool((over <= 0).all()), f"{over.max().item():.3g} over the rule"


def _merges(device, lengths, channels, dtype, gen, kind, num_prefix=1, mode=None, strided=False):
    """The reference's map (int64) and the kernel's (int32) on the same keys, merged by the kernel."""
    mode = _resolve(mode or {"r": 13}, gen)
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = int(cu[-1])
    keys = _keys(lengths, mode, num_prefix, gen, **CPU_SHAPE)
    x, sizes = _rows(total, channels, dtype, gen, kind)
    decision = ref.decide_merges(keys, cu, sizes, num_prefix, **mode)
    kernel_map = ker.decide_merges(keys.to(device), cu.to(device), max(lengths), num_prefix, **mode)
    x_dev = x.to(device)
    if strided:  # rows inside a wider buffer, row stride C + 24
        wide = torch.full((total, channels + 24), float("nan"), dtype=dtype, device=device)
        wide[:, 8 : 8 + channels] = x_dev
        x_dev = wide[:, 8 : 8 + channels]
    for destination in (decision.destination, kernel_map.destination.cpu()):
        got, got_sizes = ker.merge_rows(
            x_dev, sizes.to(device), destination.to(device), cu.to(device), decision.cu_seqlens.to(device)
        )
        assert got.shape == (total, channels) and got_sizes.shape == (total,) and got.device == x_dev.device
        _check_rows(got, got_sizes, x, sizes, destination, decision.cu_seqlens, kind)
    # The pipelines' entry also writes log(size) (float64, rounded once to fp32: the reference's key bias).
    rows = int(decision.cu_seqlens[-1])
    log_sizes = torch.full((total,), float("nan"), device=device)
    _, got_sizes = ker.merge_rows_unchecked(
        x_dev, sizes.to(device), kernel_map.sources, kernel_map.source_offsets, decision.cu_seqlens.to(device),
        torch.empty_like(x_dev, memory_format=torch.contiguous_format), torch.empty_like(sizes.to(device)), log_sizes,
    )  # fmt: skip
    assert torch.equal(log_sizes[:rows].cpu(), got_sizes[:rows].cpu().double().log().float())


# Quick: random rows in fp16, dyadic rows in fp32, on the tile edges; full: both kinds in both dtypes with DeiT's 197.
KIND_DTYPES = [(kind, dtype) for kind in ("random", "dyadic") for dtype in (torch.float32, torch.float16)]
QUICK_KIND_DTYPES = [("random", torch.float16), ("dyadic", torch.float32)]


def _kind_rows(quick_shape, full_shape):
    return levels([(*kd, quick_shape) for kd in QUICK_KIND_DTYPES] + [(*kd, full_shape) for kd in KIND_DTYPES],
                  lambda kind, dtype, shape: shape == quick_shape, ids=lambda k, d, shape: f"{k}-{str(d)[6:]}-{shape}")


@pytest.mark.interpreter
@pytest.mark.parametrize("kind,dtype,lengths", _kind_rows("edges", "deit"))
def test_merged_rows_follow_the_rule_interpreter(kind, dtype, lengths, gen):
    _merges("cpu", EDGE_LENGTHS if lengths == "edges" else LENGTHS, 24, dtype, gen, kind, strided=kind == "random")


@pytest.mark.interpreter
def test_merged_rows_adaptive_no_prefix_interpreter(gen):
    _merges("cpu", (5, 70, 0, 33), 20, torch.float32, gen, "random", 0, {"threshold": RANDOM, "r_max": 40})


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each width once, the kinds and dtypes in turn
    "channels,kind,dtype",
    rotated([(c, k, d) for c in (64, 200, 768) for k in ("random", "dyadic") for d in GPU_DTYPES],
            lambda c, k, d: c, lambda c, k, d: (k, d), ids=lambda c, k, d: f"c{c}-{k}-{str(d)[6:]}"),
)  # fmt: skip
def test_merged_rows_follow_the_rule_gpu(channels, kind, dtype, gen):
    ragged = tuple(torch.randint(0, 198, (64,), generator=gen).tolist())
    for lengths in (LENGTHS, ragged, (577,) * 4):
        for num_prefix, mode in ((1, {"r": 16}), (0, {"threshold": RANDOM, "r_max": 100}), (2, {"r": 300})):
            _merges("cuda", lengths, channels, dtype, gen, kind, num_prefix, mode, strided=channels == 200)


# --- isolation, repeatability, poisoned outputs ---------------------------------------------------------------------


def _isolated(device, shape, channels, dtype, gen):
    """Changing the middle image's keys and rows changes no other image's count, local destinations or merged rows
    (in the adaptive mode its own count moves: its keys become equal, every similarity 1); each image alone gives the
    bits it gets in the batch."""
    lengths = (65, 40, 30)
    cu = cu_seqlens_from_counts(torch.tensor(lengths)).to(device)
    total, mid = int(cu[-1]), slice(65, 105)
    for mode in ({"r": 13}, {"threshold": 0.9, "r_max": 30}):
        keys = torch.randn(total, shape["heads"], shape["dim"], generator=gen).to(device, dtype)
        x, sizes = _rows(total, channels, dtype, gen, "random")
        x, sizes = x.to(device), sizes.to(device)
        keys2, x2 = keys.clone(), x.clone()
        keys2[mid] = torch.randn(shape["heads"], shape["dim"], generator=gen).to(device, dtype)
        x2[mid] = torch.randn(40, channels, generator=gen).to(device, dtype)
        results = []
        for k, rows_in in ((keys, x), (keys2, x2)):
            got = ker.decide_merges(k, cu, 65, 1, **mode)
            rows, new_sizes = ker.merge_rows(rows_in, sizes, got.destination, cu, got.cu_seqlens)
            results.append((got, rows, new_sizes))
        if "threshold" in mode:
            assert results[0][0].kept[1] != results[1][0].kept[1]
        for b in (0, 2):
            image = []
            for got, rows, new_sizes in results:
                start, end, new_start, new_end = int(cu[b]), int(cu[b + 1]), *got.cu_seqlens[b : b + 2].tolist()
                local = got.destination[start:end] - new_start
                image.append((got.kept[b], local, rows[new_start:new_end], new_sizes[new_start:new_end]))
            for before, after in zip(*image, strict=True):
                assert torch.equal(before, after)
        got, rows, _ = results[0]
        for b in range(3):  # alone as in the batch
            start, end, new_start, new_end = int(cu[b]), int(cu[b + 1]), *got.cu_seqlens[b : b + 2].tolist()
            alone_cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
            alone = ker.decide_merges(keys[start:end], alone_cu, 65, 1, **mode)
            assert torch.equal(alone.destination, got.destination[start:end] - new_start)
            alone_rows, _ = ker.merge_rows(x[start:end], sizes[start:end], alone.destination, alone_cu,
                                           alone.cu_seqlens)  # fmt: skip
            assert torch.equal(alone_rows[: new_end - new_start], rows[new_start:new_end])


@pytest.mark.interpreter
def test_isolation_interpreter(gen):
    _isolated("cpu", CPU_SHAPE, 24, torch.float32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_isolation_gpu(dtype, gen):
    _isolated("cuda", GPU_SHAPE, 768, dtype, gen)


POISON_LENGTHS = (65, 0, 1, 40, 30)
SMALL_POISON_LENGTHS = (33, 0, 1, 12, 9)  # the interpreter's: the same paths, a third of the merged rows


def _poisoned(device, shape, channels, dtype, gen, mode, lengths=POISON_LENGTHS):
    """Outputs filled with garbage (-7, NaN) are overwritten with the fresh call's bits; merged-buffer rows past
    ``T'`` (a capacity of T + 5) are left as they were."""
    cu = cu_seqlens_from_counts(torch.tensor(lengths)).to(device)
    total, batch = int(cu[-1]), len(lengths)
    keys = torch.randn(total, shape["heads"], shape["dim"], generator=gen).to(device, dtype)
    x, sizes = _rows(total, channels, dtype, gen, "random")
    x, sizes = x.to(device), sizes.to(device)
    limit, threshold = _limit_threshold(mode)
    want = ker.decide_merges(keys, cu, max(lengths), 1, **mode)
    out = MergeSelection(
        *(torch.full((n,), -7, dtype=torch.int32, device=device) for n in (total, batch, batch + 1)),
        sources=torch.full((total,), -7, dtype=torch.int32, device=device),
        source_offsets=torch.full((total + 1,), -7, dtype=torch.int32, device=device),
    )
    got = ker.decide_merges_unchecked(keys, cu, max(lengths), 1, limit, threshold, out)
    assert got is out
    for name in ("destination", "kept", "cu_seqlens", "sources"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    merged = int(want.cu_seqlens[-1])
    assert torch.equal(got.source_offsets[: merged + 1], want.source_offsets[: merged + 1])
    want_rows, want_sizes = ker.merge_rows(x, sizes, want.destination, cu, want.cu_seqlens)
    rows = torch.full((total + 5, channels), float("nan"), dtype=dtype, device=device)
    new_sizes = torch.full((total + 5,), -1, dtype=sizes.dtype, device=device)
    ker.merge_rows_unchecked(x, sizes, want.sources, want.source_offsets, want.cu_seqlens, rows, new_sizes)
    assert torch.equal(rows[:merged], want_rows[:merged]) and torch.equal(new_sizes[:merged], want_sizes[:merged])
    assert bool(rows[merged:].isnan().all()) and bool((new_sizes[merged:] == -1).all())
    # The graph runner's call: the merged offsets and 3 padding images of 2 rows over the 5 spare rows (the last one
    # clamped to the capacity) in the same launch, into a poisoned slice, and the host read's total and longest image
    # (in pinned host memory on a GPU, as the runner has it); the rows and sizes as without them.
    cu_out = torch.full((batch + 6,), -7, dtype=torch.int32, device=device)
    stats = torch.full((8,), -7, dtype=torch.int32, pin_memory=device == "cuda")
    again = torch.full((merged + 5, channels), float("nan"), dtype=dtype, device=device)
    ker.merge_rows_unchecked(x, sizes, want.sources, want.source_offsets, want.cu_seqlens, again,
                             new_sizes[: merged + 5], cu_out=cu_out[: batch + 4], padding_images=3,
                             padding_len=2, total_and_longest=(want.kept, stats[4:]))  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()  # the pinned row is read on the host
    pads = [merged + 2, merged + 4, merged + 5]
    assert cu_out.tolist() == want.cu_seqlens.tolist() + pads + [-7, -7]
    assert stats.tolist() == [-7] * 4 + [*ref_packing.total_and_longest(want.kept.cpu()), -7, -7]
    cu_out.fill_(-7)  # the same offsets alone, for rows merged before the capacity was known
    ker.merged_offsets_unchecked(want.cu_seqlens, cu_out[: batch + 4], merged + 5, 3, 2)
    assert cu_out.tolist() == want.cu_seqlens.tolist() + pads + [-7, -7]
    assert torch.equal(again[:merged], want_rows[:merged]) and bool(again[merged:].isnan().all())
    short, short_sizes = ker.merge_rows(x, sizes, want.destination, cu, want.cu_seqlens, capacity=merged - 3)
    assert torch.equal(short, want_rows[: merged - 3]) and torch.equal(short_sizes, want_sizes[: merged - 3])
    return keys, cu, x, sizes, want, want_rows


POISON_MODES = [{"r": 13}, {"threshold": 0.3, "r_max": 30}]


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", levels([(m,) for m in POISON_MODES], lambda m: "threshold" in m, ids=_mode_id))
def test_poisoned_outputs_are_overwritten_interpreter(mode, gen):
    _poisoned("cpu", CPU_SHAPE, 24, torch.float16, gen, mode, SMALL_POISON_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each mode plain and fused once, the dtypes in turn
    "mode,dtype,fused",
    rotated([(m, d, f) for m in POISON_MODES for d in GPU_DTYPES for f in (False, True)],
            lambda m, d, f: (_mode_id(m), f), lambda m, d, f: (d,),
            ids=lambda m, d, f: f"{_mode_id(m)}-{str(d)[6:]}-{'fused' if f else 'plain'}"),
)  # fmt: skip
def test_poisoned_outputs_replayed_from_a_graph_gpu(mode, dtype, fused, gen):
    """And without a device-to-host sync: the decision and the merge (``fused``: with the residual add and the
    LayerNorm) captured in a CUDA graph and replayed over poisoned outputs give the eager bits, run after run."""
    if fused:
        keys, cu, x, sizes, residual, norm, want, want_rows, want_normed = _poisoned_fused(
            "cuda", GPU_SHAPE, 768, dtype, gen, mode
        )
        normed = torch.empty_like(want_normed)
        fusion = dict(residual=residual, normed=normed, **norm)
    else:
        keys, cu, x, sizes, want, want_rows = _poisoned("cuda", GPU_SHAPE, 768, dtype, gen, mode)
        fusion = {}
    with sync_free():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = ker.decide_merges(keys, cu, 65, 1, **mode)
            sources = (got.sources, got.source_offsets)
            rows, new_sizes = ker.merge_rows(x, sizes, got.destination, cu, got.cu_seqlens, sources=sources, **fusion)
    merged = int(want.cu_seqlens[-1])
    for _ in range(2):
        for t in (got.destination, got.kept, got.cu_seqlens, got.sources, got.source_offsets, new_sizes):
            t.fill_(-7)
        for t in (rows, normed) if fused else (rows,):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.destination, want.destination) and torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert torch.equal(got.kept, want.kept) and torch.equal(rows[:merged], want_rows[:merged])
        if fused:
            assert torch.equal(normed[:merged], want_normed[:merged]) and bool(normed[merged:].isnan().all())


def _garbage_lists(device, gen):
    """Source lists that break the contract (random offsets and rows, inside and far outside ``[0, T]``) give wrong
    rows but stay inside the buffers (clamped): the run completes, rows past ``T'`` untouched (and normed rows, with
    the fusions)."""
    total, channels = 40, 24
    x = torch.randn(total, channels, generator=gen).to(device)
    sizes = torch.ones(total, dtype=torch.int32, device=device)
    sources = torch.randint(-100, 3 * total, (total,), generator=gen, dtype=torch.int32).to(device)
    offsets = torch.randint(-100, 3 * total, (total + 1,), generator=gen, dtype=torch.int32).to(device)
    merged_cu = torch.tensor([0, 10, 3 * total], dtype=torch.int32, device=device)  # T' past T: clamped to T
    out = torch.full((total + 4, channels), float("nan"), device=device)
    out_sizes = torch.full((total + 4,), -1, dtype=torch.int32, device=device)
    ker.merge_rows_unchecked(x, sizes, sources, offsets, merged_cu, out, out_sizes)
    if device == "cuda":
        torch.cuda.synchronize()
    assert bool(out[total:].isnan().all()) and bool((out_sizes[total:] == -1).all())
    assert bool((out_sizes[:total] >= 0).all())
    # and with both fusions (whole-row tiles): nothing past T' in either output
    residual, normed = torch.randn(channels, total, generator=gen).to(device).t(), torch.full_like(out, float("nan"))
    out.fill_(float("nan"))
    ker.merge_rows_unchecked(x, sizes, sources, offsets, merged_cu, out, out_sizes, residual=residual, normed=normed)
    if device == "cuda":
        torch.cuda.synchronize()
    assert bool(out[total:].isnan().all()) and bool(normed[total:].isnan().all())


@pytest.mark.interpreter
def test_garbage_source_lists_stay_in_bounds_interpreter(gen):
    _garbage_lists("cpu", gen)


@pytest.mark.gpu
def test_garbage_source_lists_stay_in_bounds_gpu(gen):
    _garbage_lists("cuda", gen)


def _empty(device):
    """A batch of empty images: nothing to merge, offsets of zeros."""
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    for mode in ({"r": 3}, {"threshold": 0.1, "r_max": 3}):
        got = ker.decide_merges(torch.randn(0, 2, 8, device=device), cu, 1, 1, **mode)
        assert got.destination.shape == (0,) and got.kept.tolist() == [0, 0] and got.cu_seqlens.tolist() == [0] * 3
        sizes = torch.ones(0, dtype=torch.int64, device=device)
        rows, new_sizes = ker.merge_rows(torch.randn(0, 5, device=device), sizes, got.destination, cu, cu)
        assert rows.shape == (0, 5) and new_sizes.shape == (0,)


@pytest.mark.interpreter
def test_empty_images_interpreter():
    _empty("cpu")


@pytest.mark.gpu
def test_empty_images_gpu():
    _empty("cuda")


# --- fused residual add and LayerNorm -------------------------------------------------------------------------------

# (residual add, LayerNorm parameters, eps): "wb" weight and bias in x's dtype, "w" / "b" one of them, "" neither,
# "wb32" both in fp32; None: no LayerNorm. 1e-6: timm's ViTs' eps; 0: none at all.
TOME_BLOCK = (True, "wb", 1e-6)  # a ToMe block's call: both fusions
FUSIONS = (
    (True, None, None), (False, "wb", 1e-6), TOME_BLOCK, (True, "w", 1e-5), (True, "b", 0.0), (False, "", 1e-5),
    (True, "wb32", 1e-6),
)  # fmt: skip
NORM_ULPS = 16  # fp32 units of a normalised row's scale between two fp32 LayerNorms summed in different orders


def _norm_params(channels, dtype, device, gen, which):
    """The LayerNorm's weight and bias (None where ``which`` leaves them out; ``wb32``: both in fp32)."""
    dtype = torch.float32 if which == "wb32" else dtype
    weight = (1 + 0.5 * torch.randn(channels, generator=gen)).to(device, dtype) if "w" in which else None
    bias = (0.5 * torch.randn(channels, generator=gen)).to(device, dtype) if "b" in which else None
    return weight, bias


def _check_normed(normed, rows, weight, bias, eps):
    """The LayerNorm rule (module docstring) for ``normed [T', C]`` against ``F.layer_norm`` in fp32 of the merged
    rows as stored (``rows``, in ``x``'s dtype): within ``eps * |want|`` of the dtype (its rounding, with room) plus
    ``NORM_ULPS * 2**-24 * ((|xhat| + mean(|v|) * rstd) * |weight| + |bias|)`` (fp32 sums in another order) plus half
    a subnormal step."""
    normed, rows = normed.cpu(), rows.cpu()
    weight = None if weight is None else weight.cpu().float()
    bias = None if bias is None else bias.cpu().float()
    assert normed.dtype == rows.dtype and normed.shape == rows.shape
    want = F.layer_norm(rows.float(), rows.shape[1:], weight, bias, eps).double()
    v = rows.double()
    centred = v - v.mean(1, keepdim=True)
    rstd = ((centred * centred).mean(1, keepdim=True) + eps).rsqrt()
    scale = (centred.abs() + v.abs().mean(1, keepdim=True)) * rstd
    scale = scale * (1.0 if weight is None else weight.double().abs()) + (0.0 if bias is None else bias.double().abs())
    info = torch.finfo(rows.dtype)
    allowed = info.eps * want.abs() + NORM_ULPS * 2.0**-24 * scale + info.smallest_normal * info.eps / 2
    over = (normed.double() - want).abs() - allowed
    assert bool((over <= 0).all()), f"{over.max().item():.3g} over the LayerNorm rule"


def _fused(device, lengths, channels, dtype, gen, kind, num_prefix=1, mode=None, fusions=FUSIONS, strided=False):
    """The fused residual add and LayerNorm (``fusions`` on the reference's map, int64; both on the kernel's, int32),
    the maps as :func:`_merges` builds them. The merged rows follow the merge rule for ``x + residual``
    (``torch.add``'s rows on the device: a row that receives one row is that row, bit for bit; with ``dyadic`` rows,
    the reference's merge of them rounded to ``x``'s dtype, bit for bit) and are the unfused merge of
    ``x + residual``, bit for bit; ``normed`` follows the LayerNorm rule (:func:`_check_normed`) against
    ``F.layer_norm`` of those rows (with ``dyadic`` rows: of the reference's), and its rows past ``T'`` are left as
    they were. ``residual`` is column-major (any strides); ``x`` inside a wider buffer with ``strided``."""
    mode = _resolve(mode or {"r": 13}, gen)
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = int(cu[-1])
    keys = _keys(lengths, mode, num_prefix, gen, **CPU_SHAPE)
    x, sizes = _rows(total, channels, dtype, gen, kind)
    residual = _rows(total, channels, dtype, gen, kind)[0].to(device)
    decision = ref.decide_merges(keys, cu, sizes, num_prefix, **mode)
    kernel_map = ker.decide_merges(keys.to(device), cu.to(device), max(lengths), num_prefix, **mode)
    x_dev = x.to(device)
    summed = torch.add(x_dev, residual)  # what the unfused block stores
    if strided:  # rows inside a wider buffer, row stride C + 24
        wide = torch.full((total, channels + 24), float("nan"), dtype=dtype, device=device)
        wide[:, 8 : 8 + channels] = x_dev
        x_dev = wide[:, 8 : 8 + channels]
    residual = residual.t().contiguous().t()  # column-major: strides (1, T)
    rows = int(decision.cu_seqlens[-1])
    for destination, cases in ((decision.destination, fusions), (kernel_map.destination.cpu(), [TOME_BLOCK])):
        args = (sizes.to(device), destination.to(device), cu.to(device), decision.cu_seqlens.to(device))
        plain, plain_sizes = ker.merge_rows(summed, *args)
        for with_residual, norm, eps in cases:
            weight, bias = _norm_params(channels, dtype, device, gen, norm or "")
            normed = None if norm is None else torch.full((total, channels), float("nan"), dtype=dtype, device=device)
            fused = dict(residual=residual if with_residual else None, normed=normed, norm_weight=weight,
                         norm_bias=bias, norm_eps=1e-5 if eps is None else eps)  # fmt: skip
            got, got_sizes = ker.merge_rows(x_dev, *args, **fused)
            _check_rows(got, got_sizes, summed if with_residual else x, sizes, destination, decision.cu_seqlens, kind)
            if with_residual:
                assert torch.equal(got[:rows], plain[:rows]) and torch.equal(got_sizes[:rows], plain_sizes[:rows])
            if normed is not None:
                _check_normed(normed[:rows], got[:rows], weight, bias, eps)
                assert bool(normed[rows:].isnan().all()), "rows past T' written"


# One program per merged row: the quick level's few rows take the same paths as the tile edges' many.
FUSED_LENGTHS = {"few_rows": (1, 2, 0, 17, 6), "tile_edges": (1, 2, 63, 0, 65, 30)}


@pytest.mark.interpreter
@pytest.mark.parametrize("kind,dtype,lengths", _kind_rows("few_rows", "tile_edges"))
def test_fused_merge_follows_the_rules_interpreter(kind, dtype, lengths, gen):
    """72 channels (masked: a tile of 128 unfused, of 128 whole-row fused), every fusion, both maps."""
    _fused("cpu", FUSED_LENGTHS[lengths], 72, dtype, gen, kind, strided=True)


DEIT_ROW_LENGTHS, DEIT_ROW_QUICK = (5, 40, 0, 33), (5, 17, 0, 9)  # quick: the fixed map on fewer rows
DEIT_ROW_MODES = ({"r": 13}, {"threshold": RANDOM, "r_max": 40})


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "mode,lengths",
    levels([(DEIT_ROW_MODES[0], DEIT_ROW_QUICK)] + [(m, DEIT_ROW_LENGTHS) for m in DEIT_ROW_MODES],
           lambda mode, lengths: lengths == DEIT_ROW_QUICK, ids=lambda m, lengths: f"{_mode_id(m)}-{max(lengths)}"),
)  # fmt: skip
def test_fused_merge_deit_rows_interpreter(mode, lengths, gen):
    """DeiT-B's 768 channels (whole-row tiles of 1024), fp16, the fixed and adaptive maps without prefix rows."""
    fusions = [f for f in FUSIONS if f[1] in (None, "wb", "")]
    _fused("cpu", lengths, 768, torch.float16, gen, "random", 0, mode, fusions)


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each width once, the kinds and dtypes in turn
    "channels,kind,dtype",
    rotated([(c, k, d) for c in (72, 200, 768) for k in ("random", "dyadic") for d in GPU_DTYPES],
            lambda c, k, d: c, lambda c, k, d: (k, d), ids=lambda c, k, d: f"c{c}-{k}-{str(d)[6:]}"),
)  # fmt: skip
def test_fused_merge_follows_the_rules_gpu(channels, kind, dtype, gen):
    ragged = tuple(torch.randint(0, 198, (64,), generator=gen).tolist())
    for lengths in (LENGTHS, ragged, (577,) * 4):
        for num_prefix, mode in ((1, {"r": 16}), (0, {"threshold": RANDOM, "r_max": 100})):
            _fused("cuda", lengths, channels, dtype, gen, kind, num_prefix, mode, strided=channels == 200)


def _poisoned_fused(device, shape, channels, dtype, gen, mode, lengths=POISON_LENGTHS):
    """Every combination of the fusions into poisoned outputs (NaN rows and normed rows, -1 sizes) of capacity
    T + 5: rows ``[0, T')`` of ``out`` and ``normed`` get a fresh call's bits, rows past ``T'`` are left as they were
    in both; the same bits with the log sizes, the offsets and the host read in the same launch (the graph runner's
    call). ``normed`` depends on the merged rows only: the LayerNorm of ``x`` and ``residual`` merged is that of their
    sum merged, bit for bit."""
    cu = cu_seqlens_from_counts(torch.tensor(lengths)).to(device)
    total, batch = int(cu[-1]), len(lengths)
    keys = torch.randn(total, shape["heads"], shape["dim"], generator=gen).to(device, dtype)
    x, sizes = _rows(total, channels, dtype, gen, "random")
    residual, _ = _rows(total, channels, dtype, gen, "random")
    x, sizes, residual = x.to(device), sizes.to(device), residual.to(device)
    weight, bias = _norm_params(channels, dtype, device, gen, "wb")
    want = ker.decide_merges(keys, cu, max(lengths), 1, **mode)
    merged = int(want.cu_seqlens[-1])
    lists = (want.sources, want.source_offsets, want.cu_seqlens)
    want_normed = torch.empty(total, channels, dtype=dtype, device=device)
    norm = dict(norm_weight=weight, norm_bias=bias, norm_eps=1e-6)
    want_rows, want_sizes = ker.merge_rows(x, sizes, want.destination, cu, want.cu_seqlens, residual=residual,
                                           normed=want_normed, **norm)  # fmt: skip
    plain_rows, _ = ker.merge_rows(x, sizes, want.destination, cu, want.cu_seqlens)
    for with_residual, with_norm in ((True, False), (False, True), (True, True)):
        rows = torch.full((total + 5, channels), float("nan"), dtype=dtype, device=device)
        normed = torch.full((total + 5, channels), float("nan"), dtype=dtype, device=device)
        new_sizes = torch.full((total + 5,), -1, dtype=sizes.dtype, device=device)
        source = x if with_residual else torch.add(x, residual)
        ker.merge_rows_unchecked(source, sizes, *lists, rows, new_sizes, residual=residual if with_residual else None,
                                 **(dict(normed=normed, **norm) if with_norm else {}))  # fmt: skip
        assert torch.equal(rows[:merged], want_rows[:merged]) and torch.equal(new_sizes[:merged], want_sizes[:merged])
        assert bool(rows[merged:].isnan().all()) and bool((new_sizes[merged:] == -1).all())
        if with_norm:
            assert torch.equal(normed[:merged], want_normed[:merged])
        assert bool(normed[merged if with_norm else 0 :].isnan().all()), "normed rows past T' written"
    # The norm alone on x: the LayerNorm of x's merged rows, whatever the tile
    normed = torch.full((total + 5, channels), float("nan"), dtype=dtype, device=device)
    ker.merge_rows(x, sizes, want.destination, cu, want.cu_seqlens, normed=normed[:total], **norm)
    _check_normed(normed[:merged], plain_rows[:merged], weight, bias, 1e-6)
    assert bool(normed[merged:].isnan().all())
    # The graph runner's call with both fusions: log sizes, offsets and 3 padding images, the host read.
    rows = torch.full((merged + 5, channels), float("nan"), dtype=dtype, device=device)
    normed = torch.full((merged + 5, channels), float("nan"), dtype=dtype, device=device)
    new_sizes = torch.full((merged + 5,), -1, dtype=sizes.dtype, device=device)
    log_sizes = torch.full((merged + 5,), float("nan"), device=device)
    cu_out = torch.full((batch + 4,), -7, dtype=torch.int32, device=device)
    stats = torch.full((4,), -7, dtype=torch.int32, pin_memory=device == "cuda")
    ker.merge_rows_unchecked(x, sizes, *lists, rows, new_sizes, log_sizes, cu_out=cu_out, padding_images=3,
                             padding_len=2, total_and_longest=(want.kept, stats), residual=residual, normed=normed,
                             **norm)  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()  # the pinned row is read on the host
    assert cu_out.tolist() == want.cu_seqlens.tolist() + [merged + 2, merged + 4, merged + 5]
    assert stats.tolist() == [*ref_packing.total_and_longest(want.kept.cpu()), -7, -7]
    assert torch.equal(rows[:merged], want_rows[:merged]) and torch.equal(normed[:merged], want_normed[:merged])
    assert torch.equal(log_sizes[:merged].cpu(), want_sizes[:merged].cpu().double().log().float())
    assert bool(rows[merged:].isnan().all()) and bool(normed[merged:].isnan().all())
    assert bool(log_sizes[merged:].isnan().all()) and bool((new_sizes[merged:] == -1).all())
    return keys, cu, x, sizes, residual, norm, want, want_rows, want_normed


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # numpy's log(0) past T'
@pytest.mark.parametrize("mode", levels([(m,) for m in POISON_MODES], lambda m: "r" in m, ids=_mode_id))
def test_fused_poisoned_outputs_are_overwritten_interpreter(mode, gen):
    _poisoned_fused("cpu", CPU_SHAPE, 40, torch.float16, gen, mode, SMALL_POISON_LENGTHS)


# --- bad inputs -----------------------------------------------------------------------------------------------------


def _bad_calls():
    keys, cu = torch.randn(10, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32)
    x, sizes, dest = torch.randn(10, 6), torch.ones(10, dtype=torch.int64), torch.arange(10, dtype=torch.int32)
    normed, tall = torch.empty(10, 6), torch.randn(16, 6)

    def decide(**kw):
        args = dict(keys=keys, cu_seqlens=cu, max_seqlen=6, num_prefix=1, r=2) | kw
        return lambda: ker.decide_merges(**args)

    def merge(**kw):
        args = dict(x=x, sizes=sizes, destination=dest, cu_seqlens=cu, merged_cu_seqlens=cu) | kw
        return lambda: ker.merge_rows(**args)

    return [
        (decide(keys=keys.numpy()), "keys"),
        (decide(keys=keys[:, 0]), "keys"),
        (decide(keys=keys.double()), "keys"),
        (decide(keys=torch.randn(10, 2, 300)), "keys"),
        (decide(keys=torch.randn(10, 0, 8)), "keys"),
        (decide(cu_seqlens=cu.long()), "cu_seqlens"),
        (decide(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), "cu_seqlens"),
        (decide(cu_seqlens=torch.tensor([0, 5, 4, 10], dtype=torch.int32)), "cu_seqlens"),
        (decide(max_seqlen=0), "max_seqlen"),
        (decide(max_seqlen=6.0), "max_seqlen"),
        (decide(num_prefix=-1), "num_prefix"),
        (decide(r=-1), "r"),
        (decide(r=True), "r"),
        (decide(r=None), "r"),
        (decide(threshold=0.5), "r"),
        (decide(r=None, threshold=0.5), "r_max"),
        (decide(r=None, threshold="0.5", r_max=3), "threshold"),
        (decide(r=None, threshold=float("nan"), r_max=3), "threshold"),
        (decide(r=None, threshold=0.5, r_max=-2), "r_max"),
        (merge(x=x.numpy()), "x"),
        (merge(x=x[:, 0]), "x"),
        (merge(x=x.double()), "x"),
        (merge(x=x[:, :0]), "x"),
        (merge(sizes=sizes.float()), "sizes"),
        (merge(sizes=sizes[:9]), "sizes"),
        (merge(sizes=torch.ones(20, dtype=torch.int64)[::2]), "sizes"),
        (merge(sizes=torch.zeros(10, dtype=torch.int64)), "sizes"),
        (merge(destination=dest.float()), "destination"),
        (merge(destination=dest[:, None]), "destination"),
        (merge(destination=torch.arange(20, dtype=torch.int32)[::2]), "destination"),
        (merge(cu_seqlens=cu.long()), "cu_seqlens"),
        (merge(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), "cu_seqlens"),
        (merge(merged_cu_seqlens=cu.long()), "merged_cu_seqlens"),
        (merge(merged_cu_seqlens=torch.tensor([0, 10], dtype=torch.int32)), "merged_cu_seqlens"),
        (merge(merged_cu_seqlens=torch.tensor([1, 4, 10], dtype=torch.int32)), "merged_cu_seqlens"),
        (merge(sources=(dest, dest)), r"sources\[1\]"),
        (merge(sources=(dest.long(), torch.arange(11, dtype=torch.int32))), r"sources\[0\]"),
        (merge(capacity=-1), "capacity"),
        (merge(capacity=4.0), "capacity"),
        (merge(residual=x.numpy()), "residual"),
        (merge(residual=x[None]), "residual"),
        (merge(residual=x[:, :5]), "residual"),
        (merge(residual=x.half()), "residual"),
        (merge(residual=torch.randn(10, 6, device="meta")), "residual"),
        (merge(normed=normed.numpy()), "normed"),
        (merge(normed=normed[:9]), "normed"),
        (merge(normed=normed, capacity=12), "normed"),
        (merge(normed=normed.half()), "normed"),
        (merge(normed=torch.empty(6, 10).t()), "normed"),
        (merge(normed=torch.empty(10, 6, device="meta")), "normed"),
        (merge(normed=x), "normed must not share memory with x"),  # read and written by one launch
        (merge(residual=tall[:10], normed=tall[6:]), "normed must not share memory with residual"),
        (merge(x=torch.randn(10, 8193), normed=torch.empty(10, 8193)), "normed"),  # whole rows in registers
        (merge(norm_weight=torch.ones(6)), "norm_weight"),  # without normed
        (merge(norm_bias=torch.ones(6)), "norm_bias"),
        (merge(normed=normed, norm_weight=torch.ones(6).numpy()), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(5)), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(1, 6)), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(12)[::2]), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(6).double()), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(6, dtype=torch.int32)), "norm_weight"),
        (merge(normed=normed, norm_weight=torch.ones(6, device="meta")), "norm_weight"),
        (merge(x=x.half(), normed=normed.half(), norm_weight=torch.ones(6, dtype=torch.bfloat16)), "norm_weight"),
        (merge(normed=normed, norm_bias=torch.ones(7)), "norm_bias"),
        (merge(normed=normed, norm_bias=torch.ones(6).half()), "norm_bias"),  # fp32 x: fp32 parameters
        (merge(normed=normed, norm_bias=torch.ones(6, device="meta")), "norm_bias"),
        (merge(normed=normed, norm_eps=-1e-5), "norm_eps"),
        (merge(normed=normed, norm_eps=float("nan")), "norm_eps"),
        (merge(normed=normed, norm_eps=float("inf")), "norm_eps"),
        (merge(normed=normed, norm_eps="1e-5"), "norm_eps"),
        (merge(normed=normed, norm_eps=True), "norm_eps"),
        (merge(normed=normed, norm_eps=None), "norm_eps"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    forbid_launch(ker, "_match_launcher", "_offset_launcher", "_merge_launcher")
    call, word = _bad_calls()[index]
    with pytest.raises((ValueError, TypeError), match=word):
        call()


@pytest.mark.parametrize("mode", [{"r": 2}, {"threshold": 0.5, "r_max": 2}], ids=_mode_id)
def test_decision_host_ops(mode, monkeypatch):
    """The host dispatches of one block's merge decision besides its launches (an eager ToMe forward pays them at each
    of its twelve stages): every int32 output and scratch buffer a view of one allocation, and the fp32 metric. The
    launches are stubbed out: only the torch ops around them are counted."""
    for name in ("_metric_launcher", "_best_launcher", "_match_launcher", "_offset_launcher"):
        monkeypatch.setattr(ker, name, lambda *args, **kwargs: None)
    keys, cu = torch.randn(10, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32)
    limit, threshold = _limit_threshold(mode)
    names = op_names(ker.decide_merges_unchecked, keys, cu, 6, 1, limit, threshold)
    assert sorted(names) == ["aten::empty", "aten::empty", "aten::split_with_sizes"], names


def test_best_match_tiles_fill_one_wave():
    """The best match's A rows and warps per program: the first tile whose programs all run at once (DeiT-B's 98 A
    rows on 132 SMs: 16 rows in 2 warps up to B = 18, 32 in 4 up to B = 33, then 64 in 8)."""
    got = [ker._best_tile(b, 98, 132) for b in (1, 4, 18, 19, 33, 34, 64, 256)]
    assert got == [(16, 2)] * 3 + [(32, 4)] * 2 + [(64, 8)] * 3


def test_source_list_tiles_fill_one_wave():
    """The match's rows per program: the least tile whose programs all run at once (DeiT-B's 197 rows on 132 SMs:
    32 up to B = 18, 64 up to B = 33, then 128)."""
    assert [ker._list_rows(b, 197, 132) for b in (1, 4, 18, 19, 33, 34, 64)] == [32, 32, 32, 64, 64, 128, 128]
