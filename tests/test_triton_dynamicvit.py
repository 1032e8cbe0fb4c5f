"""ragged_vit.triton_impl.dynamicvit against ragged_vit.reference.pruners.DynamicViTPruner (its predictor, PredictorLG).

Tolerance rules. The kernels round where the reference's ops round and sum the GEMMs in fp32 in another order, so:

* scores: ``|s - s_ref| <= rtol * |s_ref| + atol`` with ``rtol = 1e-5, atol = 1e-6`` in fp32, ``rtol = 2 * eps, atol =
  1e-6`` in fp16 and ``rtol = 8 * eps`` in bf16 (``eps`` of the model dtype; an H100 measured bf16 up to 4.8 eps: an
  intermediate the two sides round one bf16 unit apart moves every later layer); NaN exactly where the reference has
  NaN. Measured on the CPU: 2e-7 relative in fp32, one unit in the last place in fp16, all of it from the CPU's fp16
  ``log_softmax``, which rounds its log-sum to fp16 where the GPU's (the form the kernel follows) does not: applied to
  the reference's own logits, the GPU form gave the kernel's scores bit for bit.
* decisions (the margin rule), with ``b`` the bound above at an image's cut: kept counts are the pruner's; where the
  reference's last kept and first dropped scores are more than ``2 b`` apart, the image's mask is the pruner's;
  nearer, a row the pruner keeps with ``s <= s_first_dropped + 2 b`` or drops with ``s >= s_last_kept - 2 b`` may be
  decided the other way, no other row. Equal rows of an image score bit for bit alike (ties go to the earlier row,
  as in the reference); an image with a NaN patch row scores NaN throughout and is decided as the reference decides
  it (NaN first, then by row), bit for bit.
* the conformance lab (:mod:`ragged_vit.testing.decision`, near-tie rule ``exact=False``) in fp32 on the CPU, fp32
  and fp16 on a GPU. Not fp16 on the CPU: the CPU's fp16 ``log_softmax`` above moves about half the scores by one
  unit, and a random predictor's scores lie within a few fp16 units of each other, so more than the lab's
  ``max(2, T // 500)`` rows change sides. Not bf16: its 8-bit scores tie in groups at the cut, where a single
  rounding flip moves two rows (an emulation of the kernel's rounding with another fp32 summation order exceeded the
  lab's budget in about one case in 60); bf16 decisions are checked by the margin rule.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import DynamicViTPruner
from ragged_vit.testing import decision_suite
from ragged_vit.triton_impl import dynamicvit, select
from tests.helpers import levels, one_per_family, rotated, sync_free

LAUNCHERS = ("_global_launcher", "_out_conv_launcher", "_out_head_launcher")
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pruners(channels: int) -> dict[str, DynamicViTPruner]:
    """Predictors with seeded random weights (the rates change every stage's count)."""
    with torch.random.fork_rng():
        torch.manual_seed(channels)
        return {f"rate{rate}": DynamicViTPruner(channels, rate=rate) for rate in (0.7, 0.5, 0.9)}


# The conformance lab's decision cases (ragged_vit.testing.decision), near-tie rule, first and last stage; on a GPU at
# DeiT-B's width (module docstring: why these dtypes). Quick: each case once, the pruners (and GPU dtypes) in turn.
test_select_conforms_interpreter = pytest.mark.interpreter(
    one_per_family(
        decision_suite(dynamicvit.dynamicvit_select, _pruners(16), exact=False, channels=16, dtypes=(torch.float32,),
                       bad_inputs=True),
        lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner),),
    )
)  # fmt: skip
test_select_conforms_gpu = pytest.mark.gpu(
    one_per_family(
        decision_suite(dynamicvit.dynamicvit_select, _pruners(768), device="cuda", level_name="full", exact=False,
                       channels=768, dtypes=(torch.float32, torch.float16), capturable=True),
        lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype),
    )
)  # fmt: skip


def _pruner(channels, dtype, device, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DynamicViTPruner(channels).to(device=device, dtype=dtype)


def _case(lengths, channels, dtype, device, gen):
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    return torch.randn(int(cu[-1]), channels, generator=gen).to(device, dtype), cu.to(device)


def _tolerance(dtype):
    """(rtol, atol) of the scores (module docstring)."""
    if dtype == torch.float32:
        return 1e-5, 1e-6
    return (8 if dtype == torch.bfloat16 else 2) * torch.finfo(dtype).eps, 1e-6


def _reference(predictor, x, cu, num_prefix):
    with torch.no_grad():
        return predictor(x, cu, num_prefix)[:, 0].float()


def _check_scores(predictor, x, cu, num_prefix, bound=None):
    got = dynamicvit.dynamicvit_scores(predictor, x, cu, bound or _longest(cu), num_prefix=num_prefix)
    rtol, atol = _tolerance(x.dtype)
    torch.testing.assert_close(got, _reference(predictor, x, cu, num_prefix), rtol=rtol, atol=atol, equal_nan=True)
    return got


def _longest(cu):
    return max(int((cu[1:] - cu[:-1]).max()), 1)


def _images(cu):
    bounds = cu.tolist()
    return [(bounds[b], bounds[b + 1]) for b in range(len(bounds) - 1)]


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "channels,dtype",
    levels([(c, d) for c in (64, 22) for d in (torch.float32, torch.float16)],
           lambda c, d: (c, d) in ((64, torch.float32), (22, torch.float16)), ids=lambda c, d: f"c{c}-{str(d)[6:]}"),
)  # fmt: skip
def test_scores_match_the_reference_interpreter(channels, dtype, gen):
    """Empty images and images of only prefix rows among the others; no prefix, a class token, two prefix rows.
    Quick: each width and each dtype once."""
    predictor = _pruner(channels, dtype, "cpu").score_predictor[0]
    x, cu = _case((5, 0, 40, 1, 70, 2, 0), channels, dtype, "cpu", gen)
    for num_prefix in (0, 1, 2):
        _check_scores(predictor, x, cu, num_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each width once, the dtypes in turn
    "channels,dtype", rotated([(c, d) for c in (192, 384, 768) for d in GPU_DTYPES], lambda c, d: c,
                              lambda c, d: (d,), ids=lambda c, d: f"c{c}-{str(d)[6:]}"),
)  # fmt: skip
def test_scores_match_the_reference_gpu(channels, dtype, gen):
    """DeiT-T/S/B widths: one image, four, 64 ragged ones (the large tiles), 577/1025 rows with empty images."""
    predictor = _pruner(channels, dtype, "cuda").score_predictor[1]
    layouts = [(197,), (197,) * 4, tuple(torch.randint(1, 198, (64,), generator=gen).tolist()), (577, 0, 1, 1025, 0)]
    for lengths in layouts:
        x, cu = _case(lengths, channels, dtype, "cuda", gen)
        for num_prefix in (0, 1, 2):
            _check_scores(predictor, x, cu, num_prefix)


@pytest.mark.interpreter
def test_large_tiles_and_masked_tails_interpreter(gen, monkeypatch):
    """The large-batch tiles with every tile's tail masked (C = 160: 80-wide halves, 40 narrow channels), and the
    mean in steps of 16 rows (an image of 70: five steps, the last one partly past the image)."""
    monkeypatch.setattr(dynamicvit, "_SMALL_ROWS", 0)
    monkeypatch.setattr(dynamicvit, "_MEAN_ROWS", 16)
    predictor = _pruner(160, torch.float32, "cpu").score_predictor[0]
    for dtype in (torch.float32, torch.float16):
        x, cu = _case((70, 0, 3, 20), 160, dtype, "cpu", gen)
        _check_scores(predictor.to(dtype), x, cu, 1)


def _margin_failures(pruner, inp, sel):
    """Rows the margin rule (module docstring) does not allow to differ from the pruner's decision, per image."""
    ref = pruner(inp)
    assert torch.equal(sel.kept.cpu(), ref.kept.cpu())
    assert (sel.fixed_count, sel.count) == (ref.fixed_count, ref.count)
    scores = _reference(pruner.score_predictor[inp.stage], inp.x, inp.cu_seqlens, inp.num_prefix).cpu()
    keep, want = sel.keep.cpu(), ref.keep.cpu()
    k = max(pruner.keep_patches(inp.stage, inp.num_patches), inp.min_patches)
    rtol, atol = _tolerance(inp.x.dtype)
    failures = []
    for b, (start, end) in enumerate(_images(inp.cu_seqlens)):
        first = min(start + inp.num_prefix, end)
        s, got, ref_keep = scores[first:end], keep[first:end], want[first:end]
        count = min(k, end - first)
        may_differ = torch.zeros_like(ref_keep)
        if not s.isnan().any() and 0 < count < end - first:
            ordered = torch.sort(s, descending=True, stable=True).values
            last_kept, first_dropped = float(ordered[count - 1]), float(ordered[count])
            band = 2 * (rtol * max(abs(last_kept), abs(first_dropped)) + atol)
            may_differ = (ref_keep & (s <= first_dropped + band)) | (~ref_keep & (s >= last_kept - band))
        if not torch.equal(keep[start:first], want[start:first]) or bool(((got != ref_keep) & ~may_differ).any()):
            failures.append(b)
    return failures


def _check_margin_rule(pruner, x, cu, num_prefix, num_patches, bound=None):
    for stage in (0, len(pruner.blocks) - 1):
        inp = DecisionInput(x, cu, stage, num_patches, bound, num_prefix=num_prefix)
        sel = dynamicvit.dynamicvit_select(pruner, inp)
        assert not _margin_failures(pruner, inp, sel), (stage, num_prefix)


@pytest.mark.interpreter
@pytest.mark.parametrize(  # quick: fp16, the dtype the lab's CPU cases leave out
    "dtype", levels([(torch.float32,), (torch.float16,)], lambda d: d == torch.float16, ids=lambda d: str(d)[6:])
)
def test_decisions_follow_the_margin_rule_interpreter(dtype, gen):
    pruner = _pruner(64, dtype, "cpu")
    x, cu = _case((65, 0, 30, 1, 64), 64, dtype, "cpu", gen)
    for num_prefix in (0, 1):
        _check_margin_rule(pruner, x, cu, num_prefix, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_decisions_follow_the_margin_rule_gpu(dtype, gen):
    pruner = _pruner(768, dtype, "cuda")
    layouts = [(197,), (197,) * 4, tuple(torch.randint(1, 198, (64,), generator=gen).tolist()), (577, 1, 0, 300)]
    for lengths in layouts:
        x, cu = _case(lengths, 768, dtype, "cuda", gen)
        for num_prefix in (0, 1):
            _check_margin_rule(pruner, x, cu, num_prefix, max(lengths) - 1, bound=max(lengths) + 3)


def _equal_rows(device, dtype, channels, gen):
    """Every patch of an image equal: bit-identical scores, and the reference's decision (ties to the earlier row)."""
    pruner = _pruner(channels, dtype, device)
    x, cu = _case((33, 65, 0, 9), channels, dtype, device, gen)
    for start, end in _images(cu):
        x[start + 1 : end] = x[min(start + 1, end - 1)]
    scores = _check_scores(pruner.score_predictor[0], x, cu, 1)
    for start, end in _images(cu):
        assert bool((scores[start + 1 : end] == scores[min(start + 1, end - 1)]).all())
    inp = DecisionInput(x, cu, 0, 64)
    sel, ref = dynamicvit.dynamicvit_select(pruner, inp), pruner(inp)
    assert torch.equal(sel.keep, ref.keep) and torch.equal(sel.kept, ref.kept)


@pytest.mark.interpreter
def test_equal_rows_score_alike_interpreter(gen):
    _equal_rows("cpu", torch.float16, 64, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_equal_rows_score_alike_gpu(dtype, gen):
    _equal_rows("cuda", dtype, 768, gen)


def _saturated(device, dtype, channels, gen):
    """Logits 30 apart: torch's log_softmax gives exactly 0 (keep) or -30 (drop), every score ties, the decision is
    the first rows, as in the reference. The parameters are read at each call: a changed bias is seen at once."""
    pruner = _pruner(channels, dtype, device)
    x, cu = _case((20, 0, 41), channels, dtype, device, gen)
    inp = DecisionInput(x, cu, 0, 40)
    head = pruner.score_predictor[0].out_conv[4]
    for bias in ((30.0, 0.0), (0.0, 30.0)):
        with torch.no_grad():
            head.weight.zero_()
            head.bias.copy_(torch.tensor(bias))
        scores = dynamicvit.dynamicvit_scores(pruner.score_predictor[0], x, cu, 41)
        assert torch.equal(scores, _reference(pruner.score_predictor[0], x, cu, 1))
        assert bool((scores == (0.0 if bias[0] else -30.0)).all())
        sel, ref = dynamicvit.dynamicvit_select(pruner, inp), pruner(inp)
        assert torch.equal(sel.keep, ref.keep) and torch.equal(sel.kept, ref.kept)


@pytest.mark.interpreter
def test_saturated_scores_are_torchs_interpreter(gen):
    _saturated("cpu", torch.float32, 64, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_saturated_scores_are_torchs_gpu(dtype, gen):
    _saturated("cuda", dtype, 768, gen)


def _nan_rows(device, dtype, channels, gen):
    """A NaN patch row makes its image's mean, so every score of the image, NaN (decided as the reference decides:
    NaN first, then by row); a NaN prefix row only its own score. Other images keep their bits."""
    pruner = _pruner(channels, dtype, device)
    x, cu = _case((20, 30, 9), channels, dtype, device, gen)
    clean = dynamicvit.dynamicvit_scores(pruner.score_predictor[0], x, cu, 30)
    x[20 + 5] = float("nan")  # a patch of image 1
    x[50] = float("nan")  # image 2's class token
    scores = _check_scores(pruner.score_predictor[0], x, cu, 1)
    assert bool(scores[20:50].isnan().all()) and bool(scores[50].isnan()) and not scores[51:].isnan().any()
    assert torch.equal(scores[:20], clean[:20]) and torch.equal(scores[51:], clean[51:])
    inp = DecisionInput(x, cu, 0, 29)
    sel, ref = dynamicvit.dynamicvit_select(pruner, inp), pruner(inp)
    assert torch.equal(sel.keep[20:50], ref.keep[20:50]) and torch.equal(sel.kept, ref.kept)
    assert not _margin_failures(pruner, inp, sel)


@pytest.mark.interpreter
def test_nan_rows_interpreter(gen):
    _nan_rows("cpu", torch.float32, 64, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_nan_rows_gpu(dtype, gen):
    _nan_rows("cuda", dtype, 768, gen)


def _isolation(device, dtype, channels, gen):
    """Changing image 1's rows changes no other image's scores or decisions, bit for bit; a strided ``x`` (every
    other column of a wider tensor) scores as its contiguous copy (to the tolerance: its loads, so the order of its
    LayerNorm sums, may differ)."""
    pruner = _pruner(channels, dtype, device)
    x, cu = _case((40, 70, 9), channels, dtype, device, gen)
    wide = torch.randn(x.shape[0], 2 * channels, generator=gen).to(device, dtype)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    predictor = pruner.score_predictor[0]
    scores = dynamicvit.dynamicvit_scores(predictor, x, cu, 70)
    rtol, atol = _tolerance(dtype)
    torch.testing.assert_close(dynamicvit.dynamicvit_scores(predictor, strided, cu, 70), scores, rtol=rtol, atol=atol)
    changed = x.clone()
    changed[40:110] = torch.randn(70, channels, generator=gen).to(device, dtype)
    again = dynamicvit.dynamicvit_scores(predictor, changed, cu, 70)
    assert torch.equal(again[:40], scores[:40]) and torch.equal(again[110:], scores[110:])
    assert not torch.equal(again[40:110], scores[40:110])
    sel = dynamicvit.dynamicvit_select(pruner, DecisionInput(x, cu, 0, 69))
    other = dynamicvit.dynamicvit_select(pruner, DecisionInput(changed, cu, 0, 69))
    rows = torch.cat([torch.arange(40), torch.arange(110, 119)]).to(device)
    assert torch.equal(other.keep[rows], sel.keep[rows]) and torch.equal(other.kept[[0, 2]], sel.kept[[0, 2]])


@pytest.mark.interpreter
def test_isolation_and_strides_interpreter(gen):
    _isolation("cpu", torch.float32, 64, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_isolation_and_strides_gpu(dtype, gen):
    _isolation("cuda", dtype, 768, gen)


def _poisoned(device, dtype, channels, gen, monkeypatch):
    """Every buffer the decision allocates uninitialised starts NaN (True, -1): the scores and the decision are the
    reference's all the same, so every element the kernels read was written first."""
    pruner = _pruner(channels, dtype, device)
    length = 197 if device == "cuda" else 65
    x, cu = _case((length, 0, 3, length - 40), channels, dtype, device, gen)
    inp = DecisionInput(x, cu, 0, length - 1)
    want = _reference(pruner.score_predictor[0], x, cu, 1)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else True if out.dtype == torch.bool else -1)

    monkeypatch.setattr(torch, "empty", poisoned)
    scores = dynamicvit.dynamicvit_scores(pruner.score_predictor[0], x, cu, length)
    rtol, atol = _tolerance(dtype)
    torch.testing.assert_close(scores, want, rtol=rtol, atol=atol)
    assert not _margin_failures(pruner, inp, dynamicvit.dynamicvit_select(pruner, inp))


@pytest.mark.interpreter
def test_poisoned_buffers_are_overwritten_interpreter(gen, monkeypatch):
    _poisoned("cpu", torch.float32, 16, gen, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_poisoned_buffers_are_overwritten_gpu(dtype, gen, monkeypatch):
    _poisoned("cuda", dtype, 768, gen, monkeypatch)


def _repeatable(device, dtype, channels, gen):
    """The same bits run after run (no atomics on floats); returns the input and the eager results."""
    pruner = _pruner(channels, dtype, device)
    length = 197 if device == "cuda" else 40
    x, cu = _case((length, length - 30, length), channels, dtype, device, gen)
    inp = DecisionInput(x, cu, 0, length - 1)
    scores = dynamicvit.dynamicvit_scores(pruner.score_predictor[0], x, cu, length)
    sel = dynamicvit.dynamicvit_select(pruner, inp)
    for _ in range(2):
        assert torch.equal(dynamicvit.dynamicvit_scores(pruner.score_predictor[0], x, cu, length), scores)
        again = dynamicvit.dynamicvit_select(pruner, inp)
        assert torch.equal(again.keep, sel.keep) and torch.equal(again.kept, sel.kept)
    return pruner, inp, scores, sel


@pytest.mark.interpreter
def test_repeatable_interpreter(gen):
    _repeatable("cpu", torch.float16, 16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_repeatable_and_captured_gpu(dtype, gen):
    """And without a device-to-host sync, captured in a CUDA graph and replayed over poisoned outputs: the eager
    bits."""
    pruner, inp, want_scores, want = _repeatable("cuda", dtype, 768, gen)
    predictor = pruner.score_predictor[0]
    with sync_free():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scores = dynamicvit.dynamicvit_scores(predictor, inp.x, inp.cu_seqlens, inp.row_bound)
            sel = dynamicvit.dynamicvit_select(pruner, inp)
    scores.fill_(float("nan"))
    sel.keep.fill_(True)
    sel.kept.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(scores, want_scores)
    assert torch.equal(sel.keep, want.keep) and torch.equal(sel.kept, want.kept)


def test_bad_input_raises_before_launch(forbid_launch):
    forbid_launch(dynamicvit, *LAUNCHERS)
    forbid_launch(select, "_launcher")
    pruner = DynamicViTPruner(8)
    predictor = pruner.score_predictor[0]
    x, cu = torch.zeros(10, 8), torch.tensor([0, 4, 10], dtype=torch.int32)
    inp = DecisionInput(x, cu, 0, 9)
    calls = [
        (lambda: dynamicvit.dynamicvit_select(object(), inp), "pruner must be a DynamicViTPruner"),
        (lambda: dynamicvit.dynamicvit_select(pruner, x), "inp must be a DecisionInput"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x, cu, 3, 9)), "inp.stage must be < 3"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x[:, 0], cu, 0, 9)), "inp.x"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x[:, :4], cu, 0, 9)), "inp.x must have 8 channels"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x.half(), cu, 0, 9)), "inp.x's dtype"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x, cu.long(), 0, 9)), "inp.cu_seqlens"),
        (lambda: dynamicvit.dynamicvit_select(pruner, DecisionInput(x, cu, 0, 9, 0)), "inp.max_seqlen"),
        (lambda: dynamicvit.dynamicvit_scores(pruner, x, cu, 6), "predictor must be a PredictorLG"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x[:, 0], cu, 6), "x must have 2 dimensions"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x.int(), cu, 6), "x"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x[:, :4], cu, 6), "x must have 8 channels"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x, cu[:2], 6), "cu_seqlens"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x, cu, 0), "max_seqlen"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x, cu, 6.0), "max_seqlen"),
        (lambda: dynamicvit.dynamicvit_scores(predictor, x, cu, 6, num_prefix=-1), "num_prefix"),
    ]
    for call, match in calls:
        with pytest.raises((TypeError, ValueError), match=match):
            call()


def test_tolerances_are_a_few_units_in_the_last_place():
    """The rule's rtol near a score of log 0.5 (-0.69): 2 to 4 units in the last place in fp16, at most 16 in bf16."""
    for dtype, most in ((torch.float16, 4), (torch.bfloat16, 16)):
        unit = torch.finfo(dtype).eps / 2  # the spacing of [0.5, 1)
        assert 2 <= _tolerance(dtype)[0] * 0.69 / unit <= most
