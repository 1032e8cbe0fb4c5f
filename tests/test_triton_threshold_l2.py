"""ragged_vit.triton_impl.threshold_l2 (and the rank-select kernel under it, ragged_vit.triton_impl.select) against
ragged_vit.reference.pruners.ThresholdL2Pruner: a decision is a mask, so every comparison is exact (keep masks equal,
kept counts equal). ``tests/test_triton_select.py`` checks the kernel's ``count`` mode against ``segment_rank``.

CPU runs use Triton's interpreter; the ``gpu`` cases run DeiT-sized batches (577 tokens included) on a CUDA card.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import ThresholdL2Pruner
from ragged_vit.testing import decision_suite
from ragged_vit.triton_impl import select
from ragged_vit.triton_impl import threshold_l2 as tl2
from tests.helpers import one_per_family

RATES = (0.5, 0.3, 0.7, 0.1, 1.0, 1 / 3)


# The conformance lab's decision cases (ragged_vit.testing.decision: adversarial lengths, ties, NaN rows, prefix rows
# 0 and 5, empty images, a loose bound, isolation, capture on CUDA), exact rule, for every mode: the ratio at several
# rates, fixed thresholds around the norms of the lab's rows (about 5.7) with and without a floor, and a calibrated one.
def _pruners() -> dict[str, ThresholdL2Pruner]:
    pruners = {f"ratio{rate:.3g}": ThresholdL2Pruner("ratio", rate=rate) for rate in RATES}
    for threshold, min_keep in ((5.0, 0), (5.7, 3), (6.5, 0), (6.5, 8)):
        pruners[f"threshold{threshold}-min{min_keep}"] = ThresholdL2Pruner("threshold", threshold=threshold,
                                                                          min_keep=min_keep)  # fmt: skip
    calibrated = ThresholdL2Pruner("calibrated", rate=0.4, min_keep=2)
    calibrated.calibrate(torch.randn(4, 65, 32, generator=torch.Generator().manual_seed(0)))
    return pruners | {"calibrated0.4": calibrated}


# Quick (CPU and GPU): each case once, the pruners and dtypes in turn; full: every case for each pruner in each dtype.
test_select_conforms_interpreter = pytest.mark.interpreter(
    one_per_family(decision_suite(tl2.threshold_l2_select, _pruners(), bad_inputs=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip
test_select_conforms_gpu = pytest.mark.gpu(
    one_per_family(decision_suite(tl2.threshold_l2_select, _pruners(), device="cuda", level_name="full",
                                  capturable=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip


def _ragged(lengths, channels, device, gen):
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    return torch.randn(int(cu[-1]), channels, generator=gen).to(device), cu.to(device)


@pytest.mark.interpreter
def test_underestimated_bound_is_only_slower_interpreter(gen):
    x, cu = _ragged((70, 5, 33), 8, "cpu", gen)
    scores = tl2.l2_scores(x)
    full = select.rank_keep(scores, cu, 70, rate=0.4)
    for bound in (1, 17, 40):
        got = select.rank_keep(scores, cu, bound, rate=0.4)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])


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
