"""ragged_vit.triton_impl.dynamicvit against ragged_vit.reference.pruners.DynamicViTPruner: the same predictor, so the
same scores, and the rank-select kernel for the per-image top-k: keep masks and counts equal bit for bit, in every
dtype (the scores are computed by the same ops; only the ranking is another implementation of the same rule).

Adversarial rows: equal rows (equal scores: ties go to the earlier row) and NaN rows (NaN scores rank first, as in
``torch.sort``); prefix rows 0, 1 and 5; ragged and uniform batches.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import DynamicViTPruner
from ragged_vit.triton_impl import dynamicvit, select


def _case(lengths, channels, device, gen, dtype=torch.float32, adversarial=False):
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    x = torch.randn(int(cu[-1]), channels, generator=gen)
    if adversarial:
        total = x.shape[0]
        x[1::3] = x[0]  # many equal rows: equal scores, ties
        x[torch.randperm(total, generator=gen)[:3]] = float("nan")  # NaN rows: NaN scores
    return x.to(device, dtype), cu.to(device)


def _pruner(channels, device, dtype, gen):
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        pruner = DynamicViTPruner(channels, rate=0.7)
    return pruner.to(device, dtype)


def _check(pruner, x, cu, stage, num_patches, num_prefix):
    inp = DecisionInput(x, cu, stage, num_patches, num_prefix=num_prefix)
    ref, got = pruner(inp), dynamicvit.dynamicvit_select(pruner, inp)
    assert torch.equal(got.keep, ref.keep), (stage, num_prefix)
    assert torch.equal(got.kept, ref.kept)
    assert (got.fixed_count, got.count, got.extra_token) == (ref.fixed_count, ref.count, None)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_prefix", [0, 1, 5])
@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("lengths", [(21, 21, 21), (21, 3, 0, 14, 1)], ids=["uniform", "ragged"])
def test_select_matches_pruner_interpreter(lengths, adversarial, num_prefix, gen):
    x, cu = _case(lengths, 16, "cpu", gen, adversarial=adversarial)
    pruner = _pruner(16, "cpu", torch.float32, gen)
    for stage in range(3):
        _check(pruner, x, cu, stage, 20, num_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 197), (64, 197), (16, 577)])
def test_select_matches_pruner_gpu(shape, dtype, gen):
    batch, n = shape
    pruner = _pruner(768, "cuda", dtype, gen)
    for adversarial in (False, True):
        lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
        for lens in (lengths, [n] * batch):
            x, cu = _case(lens, 768, "cuda", gen, dtype, adversarial)
            for stage in range(3):
                _check(pruner, x, cu, stage, n - 1, 1)
        _check(pruner, x, cu, 0, n - 5, 5)


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
