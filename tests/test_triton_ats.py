"""ragged_vit.triton_impl.ats against ragged_vit.reference.pruners.ats.

Scores are compared with a tolerance (sums in another order). Keep masks are compared exactly where the CDF is
exact in fp32 (dyadic scores: every summation order gives the same CDF, so the kernel must make the reference's
decisions bit for bit, ties and the floor included), and by agreement on random scores, where the CDF's last bits
depend on the summation order. ``kept`` must always count the kernel's own keep mask.

CPU runs use Triton's interpreter; the ``gpu`` cases run DeiT-sized batches (577 tokens included) on a CUDA card.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts, positions, segment_ids, segment_sum
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.pruners import ATSPruner
from ragged_vit.reference.pruners.ats import sample_keep, significance
from ragged_vit.testing import decision_suite
from ragged_vit.testing.ops import op_names
from ragged_vit.triton_impl import ats
from ragged_vit.triton_impl import cls_attention as cls_kernels
from tests.helpers import levels, one_per_family, rotated

LENGTHS = {
    "deit": (197, 197),
    "ragged": (197, 60, 2, 1, 131),
    "empty-images": (0, 70, 0, 5),
    "tile-edges": (65, 64, 63, 129),
}


def _cu(lengths, device="cpu"):
    return cu_seqlens_from_counts(torch.tensor(lengths)).to(device)


def _dyadic_scores(cu, gen, kind="flat"):
    """Scores whose CDF is the same in fp32 in any summation order; CLS rows hold garbage (the kernel must ignore
    them). ``flat``: multiples of 1/16 (ties abound). ``peaked``: a few of 2**10 among multiples of 2**-10.
    ``needle``: a few of 1 among multiples of 2**-40, whose sum rounds away next to any 1 (so every order gives
    the same sums): targets far above the tiny CDF values see them all at the same rounded fp32 distance, and
    ``argmin`` must take the first of them."""
    total = int(cu[-1])
    if kind == "flat":
        scores = torch.randint(0, 17, (total,), generator=gen) / 16
    else:
        tiny, big = (2.0**-10, 2.0**10) if kind == "peaked" else (2.0**-40, 1.0)
        scores = torch.randint(0, 4, (total,), generator=gen) * tiny
        scores[torch.randperm(total, generator=gen)[: max(1, total // 40)]] = big
    scores[cu[:-1].long().clamp(max=max(total - 1, 0))] = 7.5
    return scores.float()


def _kept_counts(keep, cu):
    return segment_sum(keep.long(), segment_ids(cu, keep.shape[0]), cu.numel() - 1)


def _check_exact(scores, cu, bound, num_samples, min_keep, num_prefix=1):
    keep, kept = ats.ats_keep(scores, cu, bound, num_samples, min_keep, num_prefix=num_prefix)
    ref = sample_keep(scores.cpu(), cu.cpu(), bound, num_samples, min_keep, num_prefix)
    assert torch.equal(keep.cpu(), ref), (num_samples, min_keep)
    assert torch.equal(kept.long().cpu(), _kept_counts(ref, cu.cpu()))


def _qkv(lengths, heads, head_dim, device, gen, dtype=torch.float32):
    cu = _cu(lengths)
    qkv = torch.randn(int(cu[-1]), 3 * heads * head_dim, generator=gen)
    return qkv.to(device=device, dtype=dtype), cu.to(device)


def _inp(qkv, cu, num_patches, heads, scale, max_seqlen=None):
    """A stage's :class:`DecisionInput` from a qkv projection (``x`` is any ``[T, C]``: ATS does not read it)."""
    return DecisionInput(qkv[:, : qkv.shape[1] // 3], cu, 0, num_patches, max_seqlen, qkv, heads, scale)


def _reference_scores(qkv, cu, heads, scale):
    q, k, v = split_qkv(qkv.float(), heads)
    return significance(cls_attention(q, k, cu, scale), v.flatten(1), cu)


SCORE_KINDS = ("flat", "peaked", "needle")
SAMPLINGS = ((196, 8), (40, 0), (3, 8), (1, 30))  # (num_samples, min_keep); small ones: the floor tops up


def _exact_cdf_quick(name, kind, sampling):
    """Quick: each batch of lengths once, the score kinds and samplings in turn."""
    k = list(LENGTHS).index(name)
    return kind == SCORE_KINDS[k % len(SCORE_KINDS)] and sampling == SAMPLINGS[k % len(SAMPLINGS)]


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "name,kind,sampling",
    levels([(n, k, s) for n in LENGTHS for k in SCORE_KINDS for s in SAMPLINGS], _exact_cdf_quick,
           ids=lambda n, k, s: f"{k}-{n}-s{s[0]}-min{s[1]}"),
)  # fmt: skip
def test_keep_equals_reference_on_exact_cdf_interpreter(name, kind, sampling, gen):
    cu = _cu(LENGTHS[name])
    _check_exact(_dyadic_scores(cu, gen, kind), cu, 197, *sampling)


@pytest.mark.interpreter
def test_zero_scores_and_single_patches_interpreter():
    cu = _cu((65, 2, 1, 9))  # 65 rows: one past a 64-row tile
    scores = torch.zeros(int(cu[-1]))
    keep, kept = ats.ats_keep(scores, cu, 65, 64, 8)
    assert kept.tolist() == [9, 2, 1, 9]  # one sampled patch (every target ties at CDF 1), topped up to 8
    assert keep[1:9].all() and not keep[9:65].any()  # ties: the floor takes the earliest patches
    _check_exact(scores, cu, 65, 64, 8)


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
def test_scores_match_reference_interpreter(lengths, gen):
    heads, head_dim = 3, 16
    qkv, cu = _qkv(lengths, heads, head_dim, "cpu", gen)
    got = ats.ats_scores(qkv, cu, heads, head_dim**-0.5, 197)
    torch.testing.assert_close(got, _reference_scores(qkv, cu, heads, head_dim**-0.5), rtol=1e-5, atol=1e-7)


# The conformance lab's decision cases (ragged_vit.testing.decision), near-tie rule (the CDF's last bits depend on the
# summation order); one stage (ATS decides alike at every stage); on a GPU at DeiT-B's width (12 heads of 64).
PRUNERS = {"default": ATSPruner(blocks=(3,)), "samples20-min12": ATSPruner(blocks=(3,), num_samples=20, min_keep=12)}
# Quick (CPU and GPU): each case once, the pruners and dtypes in turn; full: every case for each pruner in each dtype.
test_select_conforms_interpreter = pytest.mark.interpreter(
    one_per_family(decision_suite(ats.ats_select, PRUNERS, exact=False, bad_inputs=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip
test_select_conforms_gpu = pytest.mark.gpu(
    one_per_family(decision_suite(ats.ats_select, PRUNERS, device="cuda", level_name="full", exact=False,
                                  channels=768, capturable=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("name", levels([(n,) for n in PRUNERS], lambda n: n == "samples20-min12", ids=str))
def test_sampler_on_its_own_scores_is_the_reference_interpreter(name, gen):
    """Given the kernel's own scores, the sampler makes the reference's decisions bit for bit (numpy sums as torch on
    the CPU): the fused decision differs from the pruner's only through the scores' rounding."""
    heads, head_dim = 3, 16
    qkv, cu = _qkv(LENGTHS["ragged"], heads, head_dim, "cpu", gen)
    scale = head_dim**-0.5
    pruner = PRUNERS[name]
    got = ats.ats_select(pruner, _inp(qkv, cu, 196, heads, scale))
    scores = ats.ats_scores(qkv, cu, heads, scale, 197)
    assert torch.equal(got.keep, sample_keep(scores, cu, 197, pruner.num_samples or 196, pruner.min_keep))


PREFIX_SAMPLINGS = ((60, 8), (4, 2), (3, 0))


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "num_prefix,sampling",
    levels([(n, s) for n in (2, 5) for s in PREFIX_SAMPLINGS], lambda n, s: s == PREFIX_SAMPLINGS[n % 3],
           ids=lambda n, s: f"p{n}-s{s[0]}-min{s[1]}"),
)  # fmt: skip
def test_prefix_rows_are_kept_and_never_sampled_interpreter(num_prefix, sampling, gen):
    """A class token plus distillation or register tokens: the prefix rows hold garbage scores (the kernel must
    ignore them), are always kept, and the sampling over the patches is the reference's, bit for bit (quick: two
    samplings, one per prefix count)."""
    cu = _cu((0, 1, 3, 7, 70, 5))
    scores = _dyadic_scores(cu, gen, "flat")
    prefix = positions(cu, int(cu[-1])) < num_prefix
    scores[prefix] = 7.5
    _check_exact(scores, cu, 70, *sampling, num_prefix)


@pytest.mark.interpreter
def test_tighter_row_bound_changes_the_tile_not_the_result_interpreter(gen):
    """After an earlier ATS stage no image has more than ``samples + 1`` rows: the graph runner passes that bound
    (``max_seqlen=99``: a 128-wide tile instead of 256) and gets the decisions of the default bound (197)."""
    heads, head_dim = 2, 16
    qkv, cu = _qkv((99, 2, 90), heads, head_dim, "cpu", gen)
    pruner = ATSPruner(num_samples=98)
    wide = ats.ats_select(pruner, _inp(qkv, cu, 196, heads, head_dim**-0.5))
    tight = ats.ats_select(pruner, _inp(qkv, cu, 196, heads, head_dim**-0.5, max_seqlen=99))
    assert torch.equal(tight.keep, wide.keep) and torch.equal(tight.kept, wide.kept)
    assert ats._sample_shape(99)[0] < ats._sample_shape(197)[0]  # the narrower tile really is narrower


@pytest.mark.interpreter
def test_more_targets_than_rows_interpreter(gen):
    """``num_samples`` above the register width: the targets are searched in several chunks."""
    cu = _cu((197, 60))
    for kind in ("flat", "needle"):
        _check_exact(_dyadic_scores(cu, gen, kind), cu, 197, 600, 8)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_scores_stay_in_bounds_interpreter(gen):
    """NaN scores (garbage rows) decide nothing sensible, but every write stays inside its image and the counts
    match the mask."""
    cu = _cu((70, 5, 33))
    scores = torch.rand(108, generator=gen)
    scores[torch.randperm(108, generator=gen)[:9]] = float("nan")
    keep, kept = ats.ats_keep(scores, cu, 70, 69, 8)
    assert keep[cu[:-1].long()].all()
    assert torch.equal(kept.long(), _kept_counts(keep, cu))


@pytest.mark.interpreter
def test_rows_past_the_bound_are_never_kept_interpreter(gen):
    cu = _cu((40, 10))
    scores = torch.rand(50, generator=gen)
    keep, kept = ats.ats_keep(scores, cu, 16, 16, 4)  # image 0 has 40 rows, the bound is 16
    assert not keep[16:40].any() and kept[0] <= 16
    assert torch.equal(kept.long(), _kept_counts(keep, cu))
    assert torch.equal(keep[40:], sample_keep(scores[40:], _cu((10,)), 16, 16, 4))


def _bad_calls():
    s, cu = torch.rand(10), torch.tensor([0, 4, 10], dtype=torch.int32)
    qkv = torch.randn(10, 3 * 2 * 4)
    return [
        (lambda: ats.ats_keep(s.half(), cu, 10, 9), "scores"),
        (lambda: ats.ats_keep(torch.rand(20)[::2], cu, 10, 9), "scores"),
        (lambda: ats.ats_keep(s, cu.long(), 10, 9), "cu_seqlens"),
        (lambda: ats.ats_keep(s, torch.tensor([0, 4, 9], dtype=torch.int32), 10, 9), "cu_seqlens"),
        (lambda: ats.ats_keep(s, cu, 0, 9), "max_seqlen"),
        (lambda: ats.ats_keep(s, cu, 10, 0), "num_samples"),
        (lambda: ats.ats_keep(s, cu, 10, 9, -1), "min_keep"),
        (lambda: ats.ats_scores(qkv, cu, 5, 0.5, 10), "num_heads"),
        (lambda: ats.ats_scores(qkv.t(), cu, 2, 0.5, 10), "qkv"),
        (lambda: ats.ats_scores(qkv.int(), cu, 2, 0.5, 10), "qkv"),
        (lambda: ats.ats_scores(qkv[:, ::2], cu, 1, 0.5, 10), "qkv"),
        (lambda: ats.ats_scores(qkv, cu, 2, "0.5", 10), "scale"),
        (lambda: ats.ats_select(ATSPruner, _inp(qkv, cu, 9, 2, 0.5)), "pruner"),
        (lambda: ats.ats_select(ATSPruner(), _inp(qkv, cu, 0, 2, 0.5)), "num_patches"),
        (lambda: ats.ats_select(ATSPruner(), _inp(qkv, cu, 9, 2, 0.5, max_seqlen=0)), "max_seqlen"),
        (lambda: ats.ats_select(ATSPruner(), _inp(qkv, cu, 9, 5, 0.5)), "num_heads"),
        (lambda: ats.ats_select(ATSPruner(), _inp(qkv, cu, 9, 2, "0.5")), "scale"),
        (lambda: ats.ats_select(ATSPruner(), DecisionInput(qkv, cu, 0, 9, cls_attn=qkv[:, :2], v=qkv)), "inp.qkv"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    forbid_launch(cls_kernels, "_logits_launcher")
    forbid_launch(ats, "_sample_launcher")
    call, word = _bad_calls()[index]
    with pytest.raises((ValueError, TypeError), match=word):
        call()


# --- GPU -------------------------------------------------------------------------------------------------------


GPU_SHAPES = ((1, 197), (64, 197), (16, 577))


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each shape once, the score kinds in turn
    "shape,kind", rotated([(s, k) for s in GPU_SHAPES for k in SCORE_KINDS], lambda s, k: s, lambda s, k: (k,),
                          ids=lambda s, k: f"{k}-{s[0]}x{s[1]}"),
)  # fmt: skip
def test_keep_equals_reference_on_exact_cdf_gpu(shape, kind, gen):
    batch, n = shape
    lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
    cu = _cu(lengths, "cuda")
    scores = _dyadic_scores(cu.cpu(), gen, kind).cuda()
    for num_samples, min_keep in ((n - 1, 8), (40, 0), (3, 8)):
        _check_exact(scores, cu, n, num_samples, min_keep)
    _check_exact(scores, cu, n, n - 5, 8, num_prefix=5)  # a class token and four registers


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each shape once, the dtypes in turn
    "shape,dtype",
    rotated([(s, d) for s in GPU_SHAPES for d in (torch.float16, torch.bfloat16, torch.float32)], lambda s, d: s,
            lambda s, d: (d,), ids=lambda s, d: f"{s[0]}x{s[1]}-{str(d)[6:]}"),
)  # fmt: skip
def test_scores_match_reference_gpu(shape, dtype, gen):
    batch, n = shape
    heads, head_dim = 12, 64
    lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
    qkv, cu = _qkv(lengths, heads, head_dim, "cuda", gen, dtype)
    scale = head_dim**-0.5
    scores = ats.ats_scores(qkv, cu, heads, scale, n)
    torch.testing.assert_close(scores, _reference_scores(qkv, cu, heads, scale), rtol=2e-5, atol=1e-7)


def test_fused_decision_host_ops(monkeypatch, gen):
    """The host dispatches of one ATS stage's fused decision besides its two launches (an eager forward at batch 1-4
    pays each): the fp32 scratch in one allocation split four ways, the keep mask, the counts, the mask's int8 view.
    The launches are stubbed out: only the torch ops around them are counted."""
    monkeypatch.setattr(cls_kernels, "_logits_launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(ats, "_sample_launcher", lambda *args, **kwargs: None)
    heads, head_dim, lengths = 3, 8, (17, 9)
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    qkv = torch.randn(int(cu[-1]), 3 * heads * head_dim, generator=gen)
    inp = _inp(qkv, cu, 16, heads, head_dim**-0.5, max_seqlen=17)
    names = op_names(ats._select, ATSPruner(num_samples=6, min_keep=2), inp)
    assert sorted(names) == sorted(["aten::empty", "aten::split_with_sizes", "aten::empty", "aten::empty",
                                    "aten::view"]), names  # fmt: skip
