"""ragged_vit.triton_impl.dynamicvit against ragged_vit.reference.pruners.DynamicViTPruner: the same predictor, so the
same scores, and the rank-select kernel for the per-image top-k: keep masks and counts equal bit for bit, in every
dtype (the scores are computed by the same ops; only the ranking is another implementation of the same rule).

The cases (adversarial lengths, equal rows, NaN rows, prefix rows 0, 1 and 5, empty images, isolation, capture) are
the conformance lab's (:mod:`ragged_vit.testing.decision`).
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import DynamicViTPruner
from ragged_vit.testing import decision_suite
from ragged_vit.triton_impl import dynamicvit, select


def _pruners(channels: int) -> dict[str, DynamicViTPruner]:
    """Predictors with seeded random weights (the rates change every stage's count)."""
    with torch.random.fork_rng():
        torch.manual_seed(channels)
        return {f"rate{rate}": DynamicViTPruner(channels, rate=rate) for rate in (0.7, 0.5, 0.9)}


# The conformance lab's decision cases (ragged_vit.testing.decision), exact rule, first and last stage; on a GPU at
# DeiT-B's width.
test_select_conforms_interpreter = pytest.mark.interpreter(
    decision_suite(dynamicvit.dynamicvit_select, _pruners(16), channels=16, bad_inputs=True)
)
test_select_conforms_gpu = pytest.mark.gpu(
    decision_suite(dynamicvit.dynamicvit_select, _pruners(768), device="cuda", level_name="full", channels=768,
                   capturable=True)
)  # fmt: skip


def test_bad_input_raises_before_launch(forbid_launch):
    forbid_launch(select, "_launcher")
    pruner = DynamicViTPruner(8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="pruner must be a DynamicViTPruner"):
        dynamicvit.dynamicvit_select(object(), DecisionInput(torch.zeros(10, 8), cu, 0, 9))
    with pytest.raises(ValueError, match="inp.stage must be < 3"):
        dynamicvit.dynamicvit_select(pruner, DecisionInput(torch.zeros(10, 8), cu, 3, 9))
    with pytest.raises(ValueError, match="inp.x"):
        dynamicvit.dynamicvit_select(pruner, DecisionInput(torch.zeros(10), cu, 0, 9))
