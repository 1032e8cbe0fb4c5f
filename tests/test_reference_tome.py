"""Reference ToMe on the CPU: the merge rule (``reference/merging.py``) and the timm forward (``reference/tome.py``).

Tolerance rules:
* decisions, counts, sizes and sources: exact;
* hand-made merges: exact (integer sums, exact in float64; the quotient is rounded to float64, then to the
  result's dtype, as the expected values are);
* ``r=0`` (and a threshold nothing passes) against timm's own forward: fp32, ``atol = rtol = 1e-5`` (the same
  modules; only the attention's summation order differs);
* proportional attention against repeated rows, and the size-weighted head against repeated rows: fp64,
  ``1e-12``;
* isolation and mode-equivalences (threshold -1.01 vs r = r_max): bitwise (fp32).

Models have random weights: for a fixed ``r`` the counts depend on the image geometry only, so DeiT-S and DeiT-B
are built at full size (197 tokens, 12 blocks) for the golden counts; every other test uses 4 blocks of width 64.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts, seqlens
from ragged_vit.reference.merging import decide_merges, fixed_r_counts, merge_rows, merge_sources
from ragged_vit.reference.tome import calibrate_threshold, tome_attention, tome_forward, tome_head

SMALL = dict(depth=4, embed_dim=64, num_heads=2, num_classes=10)
FAMILIES = {
    "deit": ("deit_tiny_patch16_224", dict(img_size=64)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=64)),  # 2 prefix rows, two heads
    "deit3_layerscale": ("deit3_small_patch16_224", dict(img_size=64)),  # LayerScale, no_embed_class
    "dinov2_reg4": ("vit_small_patch14_reg4_dinov2", dict(img_size=56)),  # class + 4 registers, LayerScale
    "reg4_avg_no_class": ("vit_base_patch16_reg4_gap_256", dict(img_size=64)),  # 4 registers, no class, avg
    "class_avg": ("vit_small_patch16_224", dict(img_size=64, global_pool="avg")),  # avg with a class token
    "qk_norm": ("vit_small_patch16_224", dict(img_size=64, qk_norm=True)),
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}
FP64 = {"atol": 1e-12, "rtol": 1e-12}

# Rows per image (class row included) after each of 12 blocks, 197 rows at the start, by the rule: block k merges
# min(r, patches // 2) of its patches. Only r = 16's last block is capped (20 patches: 10 merge).
GOLDEN = {
    8: (189, 181, 173, 165, 157, 149, 141, 133, 125, 117, 109, 101),
    13: (184, 171, 158, 145, 132, 119, 106, 93, 80, 67, 54, 41),
    16: (181, 165, 149, 133, 117, 101, 85, 69, 53, 37, 21, 11),
}


def family(name: str, seed: int = 0) -> torch.nn.Module:
    model_name, kwargs = FAMILIES[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return timm.create_model(model_name, pretrained=False, **SMALL, **kwargs).eval()


def images(model: torch.nn.Module, count: int, seed: int) -> torch.Tensor:
    """Images of increasing contrast: the adaptive mode merges a different number of rows in each."""
    g = torch.Generator().manual_seed(seed)
    size = model.patch_embed.img_size
    return torch.randn(count, 3, *size, generator=g) * torch.linspace(0.2, 3.0, count)[:, None, None, None]


@pytest.fixture(scope="module")
def deit() -> torch.nn.Module:
    return family("deit")


# --- golden counts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", list(GOLDEN))
def test_golden_counts_rule(r):
    assert tuple(fixed_r_counts(197, [r] * 12)) == GOLDEN[r]


@pytest.mark.parametrize("model_name", ["deit_small_patch16_224", "deit_base_patch16_224"])
def test_golden_counts_forward(model_name):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = timm.create_model(model_name, pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    for r, golden in GOLDEN.items():
        out = tome_forward(model, x, r)
        assert out.counts[:, 0].tolist() == list(golden), r
        # every patch sits in a patch row, and every patch row of the last block holds at least one patch
        assert sorted(set(out.sources[0].tolist())) == list(range(1, golden[-1]))


# --- r = 0 is timm; the families -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_r0_is_timm_and_merging_runs(name):
    model = family(name)
    x = images(model, 3, 1)
    with torch.no_grad():
        ref = model(x)
    out = tome_forward(model, x, 0)
    torch.testing.assert_close(out.logits, ref, **FP32)
    n, prefix = model.patch_embed.num_patches + model.num_prefix_tokens, model.num_prefix_tokens
    assert out.counts.eq(n).all()
    assert torch.equal(out.sources, torch.arange(prefix, n).expand(3, -1))
    merged = tome_forward(model, x, [3, 2, 0, 4])
    assert bool(merged.logits.isfinite().all())
    assert merged.counts.T.tolist() == [fixed_r_counts(n, [3, 2, 0, 4], prefix)] * 3
    assert bool((merged.sources >= prefix).all())  # prefix rows never merge: patches never reach them


# --- the merge rule on hand-made cases ------------------------------------------------------------------------------

# One image of 7 rows: the class row, then rows 1 to 6. The head-mean keys (integers; cosine similarity after
# normalisation) are below; large opposite per-head offsets make each head alone (or both flattened) match
# differently, their mean cancels.
MEAN_KEYS = [(5, 5), (8, 1), (1, 0), (4, -1), (0, 1), (-1, 1), (-1, 0)]
OFFSETS = [(3, -7), (-6, 9), (9, 4), (-5, -8), (7, -3), (-9, -6), (4, 8)]
SIZES = [1, 2, 3, 5, 1, 4, 1]
X = [10.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def hand_keys() -> torch.Tensor:
    mean, offset = torch.tensor(MEAN_KEYS, dtype=torch.float64), torch.tensor(OFFSETS, dtype=torch.float64)
    return torch.stack([mean + 8 * offset, mean - 8 * offset], dim=1)  # [7, H=2, D=2]: mean over heads exact


def one_image(rows: int) -> torch.Tensor:
    return torch.tensor([0, rows], dtype=torch.int32)


# The paper's algorithm on these rows: A = rows 0 (the class row: never a source), 2, 4, 6 and B = rows 1, 3, 5
# (head means (8, 1), (4, -1), (-1, 1)). Row 2 (1, 0) matches row 1 at 0.992; rows 4 (0, 1) and 6 (-1, 0) both match
# row 5 at 0.707 exactly, rank 2 and 3 (the lower A index first). After a merge: the class row, the other unmerged A
# rows in order, the B rows in order; nothing merged: the order as it was.
@pytest.mark.parametrize(
    "prefix,mode,destination,sizes,values",
    [
        (1, {"r": 0}, [0, 1, 2, 3, 4, 5, 6], SIZES, X),
        (1, {"r": 1}, [0, 3, 3, 4, 1, 5, 2], [1, 1, 1, 5, 5, 4], [10, 8, 32, 8 / 5, 4, 16]),
        (1, {"r": 2}, [0, 2, 2, 3, 4, 4, 1], [1, 1, 5, 5, 5], [10, 32, 8 / 5, 4, 72 / 5]),
        (1, {"r": 3}, [0, 1, 1, 2, 3, 3, 3], [1, 5, 5, 6], [10, 8 / 5, 4, 104 / 6]),
        (1, {"r": 9}, [0, 1, 1, 2, 3, 3, 3], [1, 5, 5, 6], [10, 8 / 5, 4, 104 / 6]),  # capped at (7 - 1) // 2
        (1, {"threshold": 0.8, "r_max": 3}, [0, 3, 3, 4, 1, 5, 2], [1, 1, 1, 5, 5, 4], [10, 8, 32, 8 / 5, 4, 16]),
        (1, {"threshold": 0.5, "r_max": 3}, [0, 1, 1, 2, 3, 3, 3], [1, 5, 5, 6], [10, 8 / 5, 4, 104 / 6]),
        (1, {"threshold": 0.9999, "r_max": 3}, [0, 1, 2, 3, 4, 5, 6], SIZES, X),  # none passes: order kept
        # no prefix row: row 0 (5, 5) merges too (into row 1, 0.789); the unmerged A rows follow their rank
        (0, {"r": 2}, [2, 2, 2, 3, 0, 4, 1], [1, 1, 6, 5, 4], [8, 32, 18 / 6, 4, 16]),
        # a distillation row (row 1, B's first: never a destination): row 2 now matches row 3
        (2, {"r": 1}, [0, 1, 4, 4, 2, 5, 3], [1, 2, 1, 1, 8, 4], [10, 1, 8, 32, 26 / 8, 16]),
    ],
)
def test_published_merges_by_hand(prefix, mode, destination, sizes, values):
    sizes_in = torch.tensor(SIZES)
    decision = decide_merges(hand_keys(), one_image(7), sizes_in, prefix, **mode)
    assert decision.destination.tolist() == destination
    assert decision.sizes.tolist() == sizes
    assert decision.cu_seqlens.tolist() == [0, len(sizes)]
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(X, dtype=dtype)[:, None].expand(-1, 3)
        merged = merge_rows(x, sizes_in, decision.destination, len(sizes))
        expected = torch.tensor(values, dtype=torch.float64).to(dtype)[:, None].expand(-1, 3)
        torch.testing.assert_close(merged, expected, atol=0, rtol=2**-52 if dtype == torch.float64 else 2**-23)


def test_ties_go_to_the_lower_a_row_and_prefix_rows_never_merge():
    # Two prefix rows equal to every patch key (similarity 1), then a0 b0 a1 b1: a0 and a1 both match exactly
    # (similarity 1, different B rows); r = 1 merges a0, the lower A index.
    keys = torch.tensor([(1, 0), (0, 1), (1, 0), (1, 0), (0, 1), (0, 1)], dtype=torch.float32)[:, None, :]
    keys[0], keys[1] = keys[2], keys[4]
    # A = rows 0 (protected), 2, 4; B = rows 1 (protected), 3, 5; rows 2 and 4 tie at similarity 1 (with rows 3 and
    # 5): row 2, the lower A index, merges into row 3
    decision = decide_merges(keys, one_image(6), torch.ones(6, dtype=torch.int64), 2, r=1)
    assert decision.destination.tolist() == [0, 1, 3, 3, 2, 4]
    assert decision.sizes.tolist() == [1, 1, 1, 2, 1]
    # equal A rows (2 and 4) matching the same B row (1): the first merges; the class row, row 4, then the B rows
    keys = torch.tensor([(0, 1), (3, 4), (3, 4), (-4, 3), (3, 4)], dtype=torch.float32)[:, None, :]
    decision = decide_merges(keys, one_image(5), torch.ones(5, dtype=torch.int32), r=1)
    assert decision.destination.tolist() == [0, 2, 2, 3, 1]


@pytest.mark.parametrize("num_prefix", [0, 1, 2])
def test_random_ragged_batch_invariants(num_prefix):
    # Every image decided on its own rows: prefix rows map to the first rows of their image, merged rows to a B row
    # of their own image, min(r, patches // 2) merges each, and the size-weighted sum of x is conserved.
    g = torch.Generator().manual_seed(num_prefix)
    lengths = torch.tensor([1, 2, 3, 0, 7, 16, 17, 40])
    cu, total, r = cu_seqlens_from_counts(lengths), int(lengths.sum()), 5
    keys, x = torch.randn(total, 3, 8, generator=g), torch.randn(total, 4, generator=g)
    sizes = torch.randint(1, 6, (total,), generator=g)
    decision = decide_merges(keys, cu, sizes, num_prefix, r=r)
    new_cu = decision.cu_seqlens
    patches = (lengths - num_prefix).clamp_min(0)
    assert torch.equal(seqlens(new_cu), lengths - torch.minimum(patches // 2, torch.tensor(r)))
    merged = merge_rows(x, sizes, decision.destination, int(new_cu[-1]))
    for b in range(lengths.numel()):
        start, end, new_start, new_end = int(cu[b]), int(cu[b + 1]), int(new_cu[b]), int(new_cu[b + 1])
        dest = decision.destination[start:end]
        assert bool(((dest >= new_start) & (dest < new_end)).all())
        prefix = min(num_prefix, end - start)
        assert dest[:prefix].tolist() == list(range(new_start, new_start + prefix))
        assert decision.sizes[new_start : new_start + prefix].tolist() == sizes[start : start + prefix].tolist()
        local = torch.arange(end - start)  # position in the split
        for d in dest.unique().tolist():
            members = local[dest == d]  # several: A rows (even) merged into one B row (odd)
            assert members.numel() == 1 or (bool((members >= prefix).all()) and int((members % 2).sum()) == 1)
        assert int(decision.sizes[new_start:new_end].sum()) == int(sizes[start:end].sum())
        mass = (x[start:end].double() * sizes[start:end, None]).sum(0)
        new_mass = (merged[new_start:new_end].double() * decision.sizes[new_start:new_end, None]).sum(0)
        torch.testing.assert_close(new_mass, mass, atol=1e-5, rtol=1e-6)


def test_merge_sources_group_rows_by_destination_in_row_order():
    """Rows 0 and 2 go to merged row 0, 1 and 4 to row 1, 3 to row 2: groups in destination order, rows ascending
    inside each; offsets count the rows sent below each merged row (T from T' on)."""
    for dtype in (torch.int64, torch.int32):
        sources, offsets = merge_sources(torch.tensor([0, 1, 0, 2, 1], dtype=dtype))
        assert sources.dtype == offsets.dtype == torch.int32
        assert sources.tolist() == [0, 2, 1, 4, 3] and offsets.tolist() == [0, 2, 4, 5, 5, 5]
    sources, offsets = merge_sources(torch.zeros(0, dtype=torch.int64))
    assert sources.shape == (0,) and offsets.tolist() == [0]


# --- proportional attention and the size-weighted head --------------------------------------------------------------


def expand_rows(x: torch.Tensor, sizes: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row repeated ``size`` times (sizes 1): what a merged row stands for."""
    lengths = torch.stack([sizes[int(s) : int(e)].sum() for s, e in zip(cu[:-1], cu[1:], strict=True)])
    return x.repeat_interleave(sizes, 0), cu_seqlens_from_counts(lengths)


def test_proportional_attention_weighs_a_row_as_its_size_in_copies():
    block = family("qk_norm").double().blocks[1]
    g = torch.Generator().manual_seed(3)
    sizes, cu = torch.tensor([1, 3, 1, 2, 1, 1, 4, 1]), torch.tensor([0, 5, 8], dtype=torch.int32)
    x = torch.randn(8, 64, generator=g, dtype=torch.float64)
    out, keys = tome_attention(block, x, cu, sizes)
    wide, wide_cu = expand_rows(x, sizes, cu)
    wide_out, wide_keys = tome_attention(block, wide, wide_cu, torch.ones(wide.shape[0], dtype=torch.int64))
    torch.testing.assert_close(out.repeat_interleave(sizes, 0), wide_out, **FP64)
    torch.testing.assert_close(keys.repeat_interleave(sizes, 0), wide_keys, **FP64)
    assert keys.shape == (8, 2, 32)


@pytest.mark.parametrize("name", ["deit", "class_avg"])
def test_merging_duplicate_patches_loses_nothing(name):
    # Patches 2k and 2k+1 (A and B neighbours in a row of the 4x4 grid) are made equal, position embedding
    # included: merging each pair in block 0 keeps one row of size 2 per pair, which with proportional attention
    # (and the size-weighted avg pool) stands exactly for the two, so the logits are those of r = 0.
    model = family(name)
    with torch.no_grad():
        model.pos_embed[:, 2::2] = model.pos_embed[:, 1::2]  # row 0 is the class token's
    x = images(model, 2, 10)
    x[..., 16:32], x[..., 48:64] = x[..., 0:16], x[..., 32:48]
    merged = tome_forward(model, x, [8, 0, 0, 0])
    assert merged.counts.T.tolist() == [[9, 9, 9, 9]] * 2
    assert merged.sources.tolist() == [[1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]] * 2
    torch.testing.assert_close(merged.logits, tome_forward(model, x, 0).logits, **FP32)


@pytest.mark.parametrize("name", ["class_avg", "reg4_avg_no_class", "deit"])
def test_head_weighs_a_row_as_its_size_in_copies(name):
    model = family(name).double()
    prefix = model.num_prefix_tokens
    g = torch.Generator().manual_seed(4)
    sizes = torch.tensor([1] * prefix + [2, 1, 5] + [1] * prefix + [1, 3])
    cu = torch.tensor([0, prefix + 3, 2 * prefix + 5], dtype=torch.int32)
    x = torch.randn(sizes.numel(), 64, generator=g, dtype=torch.float64)
    wide, wide_cu = expand_rows(x, sizes, cu)
    expected = tome_head(model, wide, wide_cu, torch.ones(wide.shape[0], dtype=torch.int64))
    torch.testing.assert_close(tome_head(model, x, cu, sizes), expected, **FP64)


# --- adaptive merging -----------------------------------------------------------------------------------------------


def test_threshold_extremes(deit):
    x = images(deit, 3, 5)
    none = tome_forward(deit, x, threshold=1.01, r_max=8)
    assert torch.equal(none.logits, tome_forward(deit, x, 0).logits)
    assert none.counts.eq(17).all()
    every = tome_forward(deit, x, threshold=-1.01, r_max=[3, 8, 1, 2])
    fixed = tome_forward(deit, x, [3, 8, 1, 2])
    assert torch.equal(every.logits, fixed.logits) and torch.equal(every.sources, fixed.sources)
    assert every.counts.T.tolist() == [fixed_r_counts(17, [3, 8, 1, 2])] * 3 == [[14, 8, 7, 5]] * 3


def test_adaptive_counts_vary_per_image_and_never_grow(deit):
    out = tome_forward(deit, images(deit, 6, 6), threshold=0.5, r_max=3)
    counts = torch.cat([torch.full((1, 6), 17), out.counts])
    steps = counts[:-1] - counts[1:]
    assert bool(((steps >= 0) & (steps <= 3)).all())
    assert len(set(out.counts[-1].tolist())) > 1
    assert len({tuple(c) for c in out.counts.T.tolist()}) > 2


def test_calibrated_threshold_hits_its_target(deit):
    x, r_max = images(deit, 8, 7), 4
    target = sum(fixed_r_counts(17, [2] * 4)) / 4  # the compute of a fixed r = 2: 12 rows per image and block
    threshold = calibrate_threshold(deit, x, target, r_max)
    out = tome_forward(deit, x, threshold=threshold, r_max=r_max)
    assert abs(float(out.counts.double().mean()) - target) <= 1.0
    assert len(set(out.counts[-1].tolist())) > 1
    assert calibrate_threshold(deit, x, 17, r_max) > 1.0  # no merging: above every similarity
    assert calibrate_threshold(deit, x, 7.5, r_max) < -1.0  # the fewest rows r_max allows: below every one


# --- isolation --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [{"r": 3}, {"threshold": 0.5, "r_max": 3}])
def test_isolation(deit, mode):
    x = images(deit, 3, 8)
    changed = x.clone()
    changed[2] = 0.0  # a flat image: its patches differ by their position embedding only
    a, b = tome_forward(deit, x, **mode), tome_forward(deit, changed, **mode)
    assert torch.equal(a.logits[:2], b.logits[:2])
    assert torch.equal(a.counts[:, :2], b.counts[:, :2]) and torch.equal(a.sources[:2], b.sources[:2])
    assert not torch.equal(a.logits[2], b.logits[2])
    if "threshold" in mode:
        assert not torch.equal(a.counts[:, 2], b.counts[:, 2])  # the packed length changed too


# --- bad input ------------------------------------------------------------------------------------------------------

KEYS, CU, ONES = torch.zeros(4, 1, 2), torch.tensor([0, 4], dtype=torch.int32), torch.ones(4, dtype=torch.int64)
BAD = {
    "r < 0": (lambda m, x: tome_forward(m, x, -1), ValueError, "r must be >= 0"),
    "r float": (lambda m, x: tome_forward(m, x, 1.5), TypeError, "r must be an int or a sequence"),
    "r bool": (lambda m, x: tome_forward(m, x, True), TypeError, "r must be an int or a sequence"),
    "r per block": (lambda m, x: tome_forward(m, x, [1, 2]), ValueError, r"r must hold one value per block \(4\)"),
    "r[2] < 0": (lambda m, x: tome_forward(m, x, [1, 2, -1, 0]), ValueError, r"r\[2\] must be >= 0"),
    "no mode": (lambda m, x: tome_forward(m, x), ValueError, "r must be given"),
    "no r_max": (lambda m, x: tome_forward(m, x, threshold=0.5), ValueError, "r_max must be given with threshold"),
    "r and threshold": (lambda m, x: tome_forward(m, x, 2, threshold=0.5, r_max=2), ValueError, "exclude each other"),
    "r_max with r": (lambda m, x: tome_forward(m, x, 2, r_max=3), ValueError, "r_max caps the adaptive mode"),
    "r_max < 0": (lambda m, x: tome_forward(m, x, threshold=0.5, r_max=-1), ValueError, "r_max must be >= 0"),
    "nan threshold": (lambda m, x: tome_forward(m, x, threshold=math.nan, r_max=1), ValueError, "threshold must be fi"),
    "str threshold": (lambda m, x: tome_forward(m, x, threshold="high", r_max=1), TypeError, "threshold must be a fl"),
    "not a vit": (lambda m, x: tome_forward(m.blocks, x, 1), TypeError, "model must be a timm VisionTransformer"),
    "image size": (
        lambda m, x: tome_forward(m, x[..., :32], 1),
        ValueError,
        r"images must have shape \[B, 3, 64, 64\]",
    ),
    "image dtype": (lambda m, x: tome_forward(m, x.double(), 1), TypeError, "images must have the model's dtype"),
    "images list": (lambda m, x: tome_forward(m, [x], 1), TypeError, "images must be a torch.Tensor"),
    "target range": (lambda m, x: calibrate_threshold(m, x, 18.0, 4), ValueError, r"target must lie in \[7.5, 17\]"),
    "target str": (lambda m, x: calibrate_threshold(m, x, "12", 4), TypeError, "target must be a float"),
    "calibrate r_max": (lambda m, x: calibrate_threshold(m, x, 12.0, None), TypeError, "r_max must be an int or"),
    "keys rank": (lambda m, x: decide_merges(KEYS[:, 0], CU, ONES, r=1), ValueError, "keys must have 3 dimensions"),
    "keys nan": (lambda m, x: decide_merges(KEYS * math.nan, CU, ONES, r=1), ValueError, "keys must be finite"),
    "cu_seqlens": (lambda m, x: decide_merges(KEYS, CU + 1, ONES, r=1), ValueError, r"cu_seqlens\[0\] must be 0"),
    "sizes length": (lambda m, x: decide_merges(KEYS, CU, ONES[:3], r=1), ValueError, "sizes must have one value per"),
    "sizes zero": (lambda m, x: decide_merges(KEYS, CU, ONES * 0, r=1), ValueError, "sizes must be >= 1"),
    "sizes float": (lambda m, x: decide_merges(KEYS, CU, ONES.float(), r=1), TypeError, "sizes must have dtype"),
    "num_prefix": (lambda m, x: decide_merges(KEYS, CU, ONES, -1, r=1), ValueError, "num_prefix must be >= 0"),
    "decide no mode": (lambda m, x: decide_merges(KEYS, CU, ONES), ValueError, "r must be given"),
    "destination range": (
        lambda m, x: merge_rows(KEYS[:, 0], ONES, torch.tensor([0, 1, 2, 3]), 3),
        ValueError,
        r"destination must lie in \[0, rows=3\)",
    ),
    "destination gap": (
        lambda m, x: merge_rows(KEYS[:, 0], ONES, torch.tensor([0, 0, 2, 2]), 3),
        ValueError,
        "destination must send at least one row to each of the 3 rows",
    ),
    "destination dtype": (
        lambda m, x: merge_rows(KEYS[:, 0], ONES, torch.zeros(4, dtype=torch.int32), 1),
        TypeError,
        "destination must have dtype",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_one_line_error_naming_the_argument(deit, case):
    call, error, match = BAD[case]
    with pytest.raises(error, match=match) as info:
        call(deit, images(deit, 2, 9))
    assert "\n" not in str(info.value)


def test_training_mode_is_refused():
    model = family("deit").train()
    with pytest.raises(ValueError, match=r"model must be in eval mode"):
        tome_forward(model, images(model, 1, 0), 1)
