"""``ci.tune_linear`` without a GPU: its pruned candidate space, the sweep's bookkeeping on fake checks and times, the
scores and the proposed table it writes, and its "no GPU" exit (the sweep itself runs on the device)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch

from benchmarks.report_linear import LAYERS
from ci import tune_linear as tune
from ragged_vit.triton_impl.configs import LinearConfig, linear_split


@pytest.mark.parametrize("rows", tune.ROWS)
def test_candidates_are_pruned_by_rows(rows):
    """Each M's space: the table's pick in it, no duplicates, every tile within shared memory, BLOCK_M from the row
    count, two programs per SM only where that splits some layer's K otherwise, and few enough kernels to compile."""
    space = tune.candidates(rows)
    assert tune.table_pick(rows) in space and len(set(space)) == len(space)
    assert all(tune._smem(c) <= tune.SMEM_BYTES for c in space)
    top = max(16, 1 << (rows - 1).bit_length())
    assert all(c.block_m <= top and 4 * c.block_m >= min(top, 128) for c in space if c != tune.table_pick(rows))
    for twice in (c for c in space if c.per_sm == 2):
        once = dataclasses.replace(twice, per_sm=1)
        assert once in space
        assert any(
            linear_split(twice, rows, n, k, 132) != linear_split(once, rows, n, k, 132) for k, n, _ in LAYERS.values()
        )
    assert len({(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) for c in space}) <= 40


def test_whole_space_stays_small():
    """Every M together: at most 60 distinct kernels per layer and dtype, at most 1600 fp16 checks."""
    space = [c for rows in tune.ROWS for c in tune.candidates(rows)]
    assert len({(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) for c in space}) <= 60
    assert len(space) * len(LAYERS) <= 1600


def test_scores_and_table():
    times = {"qkv/M1": {"torch": 9.0, "a": 2.0, "b": 4.0}, "fc2/M1": {"torch": 9.0, "a": 3.0, "b": 1.5}}
    got = tune.scores(times, ["a", "b"])
    assert got["a"] == pytest.approx(math.sqrt(2.0)) and got["b"] == pytest.approx(math.sqrt(2.0))
    assert tune.scores({**times, "x/M1": {"torch": 1.0, "a": math.nan, "b": 1.0}}, ["a", "b"]).keys() == {"b"}
    a, b = repr(LinearConfig(16, 64, 128, 4, 4)), repr(LinearConfig(64, 64, 64, 4, 3, per_sm=2))
    bands = tune.propose_table({1: a, 50: a, 99: b, 197: b, 788: a})
    assert bands == [(50, a), (197, b), (math.inf, a)]
    source = tune.table_source(bands, "a note")
    assert source.startswith("# a note\n")
    entry = eval("{" + source.split("\n", 1)[1] + "}", {"LinearConfig": LinearConfig, "_OPEN": math.inf})
    assert entry == {(9, 0): ((50, eval(a)), (197, eval(b)), (math.inf, eval(a)))}


def test_fixup_twins():
    """A single-launch twin only of the two-kernel configs that split some layer's K at that M, the same tiles."""
    space = tune.candidates(394)
    twins = tune.fixup_twins(space, 394)
    assert twins and all(t.fixup for t in twins) and len(twins) < len(space)
    for config in space:
        splits = any(linear_split(config, 394, n, k, 132)[0] > 1 for k, n, _ in LAYERS.values())
        assert (dataclasses.replace(config, fixup=True) in twins) == splits
    assert tune.fixup_twins(twins, 394) == []


def test_sweep_bookkeeping(monkeypatch):
    """Fake checks (one config wrong everywhere) and times (a single launch faster than its two-kernel twin): the
    wrong one is never timed, the twins of the best are timed in fp16, bf16 times only the finalists and the table's
    pick, every M gets a pick (here a single launch) with a score over both dtypes; past the budget, cells are skipped
    and said so, once each."""
    wrong = tune.candidates(50)[-1]
    monkeypatch.setattr(tune, "check", lambda job: "wrong: fake" if job[3] == wrong else None)

    def fake_time(layer, rows, dtype, configs, seed, l2):
        assert wrong not in configs
        return {"torch": 10.0, **{repr(c): 1.0 + c.block_m / 64 + c.num_stages / 8 + c.per_sm - c.fixup / 4
                                  for c in configs}}  # fmt: skip

    monkeypatch.setattr(tune, "time_cell", fake_time)
    args = argparse.Namespace(rows=(1, 50), dtypes=("float16", "bfloat16"), jobs=1, budget_s=1e9, seed=0)
    result = tune.sweep(args, tune.H100_SMS, 50 << 20, started=0.0)
    assert len(result["failures"]) == len(LAYERS) * (2 if wrong in tune.candidates(1) else 1)
    assert all(len(result["times"][f"qkv/M{m}/bfloat16"]) <= tune.FINALISTS + 2 for m in (1, 50))
    assert set(result["picks"]) == {1, 50}
    for rows in (1, 50):
        pick = eval(result["picks"][rows], {"LinearConfig": LinearConfig})
        assert pick.block_m == 16 and pick.fixup
        assert any("fixup=True" in c for c in result["times"][f"fc2/M{rows}/float16"])
    assert not result["skipped"]
    args.budget_s = -1.0
    assert len(tune.sweep(args, tune.H100_SMS, 50 << 20, started=0.0)["skipped"]) == 2 * 2 * len(LAYERS)


def test_no_gpu_exits_0(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU suite runs the sweep itself (gpu_suite.sh tune-linear)")
    assert tune.main(["--out", "unused.json"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
