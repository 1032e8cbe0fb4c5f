"""ragged_vit.triton_impl.threshold_l2 (and the rank-select kernel under it, ragged_vit.triton_impl.select) against
ragged_vit.reference.pruners.ThresholdL2Pruner: a decision is a mask, so every comparison is exact (keep masks equal,
kept counts equal). ``tests/test_triton_select.py`` checks the kernel's ``count`` mode against ``segment_rank``.

CPU runs use Triton's interpreter; the ``gpu`` cases run DeiT-sized batches (577 tokens included) on a CUDA card.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts, segment_ids, segment_sum
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import ThresholdL2Pruner
from ragged_vit.triton_impl import select
from ragged_vit.triton_impl import threshold_l2 as tl2

RATES = (0.5, 0.3, 0.7, 0.1, 1.0, 1 / 3)


def _ragged(lengths, channels, device, gen, ties=False, nan_rows=0):
    """Packed rows with per-image ``lengths`` (0 = empty image); ``ties`` quantises values so norms repeat."""
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    x = torch.randn(int(cu[-1]), channels, generator=gen)
    if ties:
        x = torch.round(x)
    if nan_rows:
        x[torch.randperm(x.shape[0], generator=gen)[:nan_rows]] = float("nan")
    return x.to(device), cu.to(device)


def _check_against_reference(x, cu, num_patches=196, num_prefix=1):
    total = x.shape[0]
    pruners = [ThresholdL2Pruner("ratio", rate=r) for r in RATES]
    scores = tl2.l2_scores(x)
    positive = scores[~scores.isnan()]
    quantiles = [0.0, 1.0] if positive.numel() == 0 else torch.quantile(positive.cpu(), torch.tensor([0.3, 0.6]))
    pruners += [ThresholdL2Pruner("threshold", threshold=float(t), min_keep=m) for t in quantiles for m in (0, 3)]
    for pruner in pruners:
        inp = DecisionInput(x=x, cu_seqlens=cu, stage=0, num_patches=num_patches, num_prefix=num_prefix)
        ref = pruner(inp)
        got = tl2.threshold_l2_select(pruner, inp)
        assert torch.equal(got.keep, ref.keep), pruner.extra_repr()
        assert (got.fixed_count, got.count) == (ref.fixed_count, ref.count)
        expected = segment_sum(ref.keep.long(), segment_ids(cu, total), cu.numel() - 1)
        assert torch.equal(got.kept.long(), expected), pruner.extra_repr()


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "lengths",
    [(197,), (1, 2, 3), (0, 70, 0, 5), (65, 64, 63, 129), (197, 197, 197)],
    ids=["one", "tiny", "empty-images", "tile-edges", "uniform"],
)
@pytest.mark.parametrize("ties", [False, True])
def test_keep_matches_reference_interpreter(lengths, ties, gen):
    x, cu = _ragged(lengths, 8, "cpu", gen, ties=ties)
    _check_against_reference(x, cu)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_prefix", [0, 2, 5])
def test_prefix_rows_are_kept_and_never_ranked_interpreter(num_prefix, gen):
    """Register and distillation tokens (several prefix rows), or none at all (then every image keeps at least its
    best patch): the kernel's decisions are the reference's."""
    x, cu = _ragged((0, 1, 3, 6, 40, 65), 8, "cpu", gen, ties=True)
    _check_against_reference(x, cu, 64, num_prefix)


@pytest.mark.interpreter
def test_underestimated_bound_is_only_slower_interpreter(gen):
    x, cu = _ragged((70, 5, 33), 8, "cpu", gen)
    scores = tl2.l2_scores(x)
    full = select.rank_keep(scores, cu, 70, rate=0.4)
    for bound in (1, 17, 40):
        got = select.rank_keep(scores, cu, bound, rate=0.4)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])


@pytest.mark.interpreter
def test_nan_scores_rank_first_like_torch_sort_interpreter(gen):
    x, cu = _ragged((40, 33), 8, "cpu", gen, nan_rows=6)
    _check_against_reference(x, cu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 197), (64, 197), (16, 577)])
def test_keep_matches_reference_gpu(shape, dtype, gen):
    batch, n = shape
    for ties in (False, True):
        lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
        x, cu = _ragged(lengths, 768, "cuda", gen, ties=ties, nan_rows=3 if ties else 0)
        _check_against_reference(x.to(dtype), cu, n - 1)
        uniform, ucu = _ragged([n] * batch, 768, "cuda", gen)
        _check_against_reference(uniform.to(dtype), ucu, n - 1)
        for num_prefix in (0, 5):  # no prefix rows; a class token and four registers
            _check_against_reference(x.to(dtype), cu, n - num_prefix, num_prefix)


@pytest.mark.gpu
def test_keep_is_sync_free_and_capturable_gpu(gen):
    x, cu = _ragged((197, 120, 5), 768, "cuda", gen)
    scores = tl2.l2_scores(x)
    ref = select.rank_keep(scores, cu, 197, rate=0.5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select.rank_keep(scores, cu, 197, rate=0.5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            keep, kept = select.rank_keep(scores, cu, 197, rate=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    keep.fill_(False)
    graph.replay()
    assert torch.equal(keep, ref[0]) and torch.equal(kept, ref[1])


def _bad_calls():
    s, cu = torch.rand(10), torch.tensor([0, 4, 10], dtype=torch.int32)
    return [
        (lambda: select.rank_keep(s.half(), cu, 10, rate=0.5), "scores"),
        (lambda: select.rank_keep(s, cu.long(), 10, rate=0.5), "cu_seqlens"),
        (lambda: select.rank_keep(s, torch.tensor([0, 4, 9], dtype=torch.int32), 10, rate=0.5), "cu_seqlens"),
        (lambda: select.rank_keep(s, cu, 10), "rate, count and threshold"),
        (lambda: select.rank_keep(s, cu, 10, rate=0.5, threshold=1.0), "rate, count and threshold"),
        (lambda: select.rank_keep(s, cu, 10, rate=0.0), "rate"),
        (lambda: select.rank_keep(s, cu, 10, rate=1.5), "rate"),
        (lambda: select.rank_keep(s, cu, 10, threshold=1), "threshold"),
        (lambda: select.rank_keep(s, cu, 10, threshold=1.0, min_keep=-1), "min_keep"),
        (lambda: select.rank_keep(torch.rand(20)[::2], cu, 10, rate=0.5), "scores"),
        (lambda: select.rank_keep(s, cu, 0, rate=0.5), "max_seqlen"),
        (lambda: tl2.threshold_l2_select(ThresholdL2Pruner("calibrated", rate=0.5),
                                         DecisionInput(s[:, None], cu, 0, 9)), "calibrate"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    forbid_launch(select, "_launcher")
    call, word = _bad_calls()[index]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=word):
        call()
