"""pytest-benchmark suite of the end-to-end pipelines: a small representative grid of ``report_e2e``'s Table III.

One benchmark per (batch size, workload, row) of the grid below, DeiT-B 224, fp16, 50% pruning, built and checked by
``report_e2e.Runner``. pytest-benchmark stores and compares the wall time of one forward (a synchronize after each,
three input batches rotated); the per-forward clock of ``report_e2e`` (``timing.forward_times``), img/s, the
workload kind and its kept counts, the check, the card and the versions go into ``extra_info``. A row that cannot
run here is skipped with the reason; a pipeline that computes wrong logits fails and is not timed. Times are never
asserted: regressions are ``--benchmark-compare-fail`` against a stored baseline (``python -m benchmarks.run_bench``).

    RAGGED_BENCH_QUICK=1 python -m pytest benchmarks/test_bench_e2e.py --benchmark-only   # B 1, 64; 14 rows
    python -m pytest benchmarks/test_bench_e2e.py --benchmark-only      # B 1, 4, 64; ATS, torch.compile rows too
"""

from __future__ import annotations

import os

import pytest
import timm
import torch

from benchmarks.e2e_common import DEIT_B, Lab
from benchmarks.report_e2e import Runner, Settings, Task, Unavailable
from benchmarks.timing import SyncEvery, forward_times, gc_off, warmup

QUICK = os.environ.get("RAGGED_BENCH_QUICK", "") not in ("", "0")
BATCHES = (1, 64) if QUICK else (1, 4, 64)
WORKLOADS = ("l2_ratio", "synthetic") if QUICK else ("l2_ratio", "ats", "synthetic")
ROWS = (
    ("padded", "fa2_varlen", "triton", "triton_graphed")
    if QUICK
    else (
        "padded", "padded_full", "fa2_varlen", "triton", "triton_graphed", "fa2_varlen_graphed",
        "triton_graphed_compiled",
    )
)  # fmt: skip
UNPRUNED = ("timm_eager",) if QUICK else ("timm_eager", "timm_compiled", "timm_compiled_gemm")
KEEP_RATE = 0.5
ROUNDS = 20 if QUICK else 50

CASES = [
    pytest.param(batch, workload, row, id=f"B{batch}-{workload}-{row}", marks=pytest.mark.benchmark(group=f"B{batch}"))
    for batch in BATCHES
    for workload, rows in (("none", UNPRUNED), *((w, ROWS) for w in WORKLOADS))
    for row in rows
]


@pytest.fixture(scope="session")
def runner() -> Runner:
    return Runner(Lab(torch.device("cuda"), torch.float16), Settings.make(quick=True))


@pytest.mark.parametrize(("batch", "workload", "row"), CASES)
def test_e2e(benchmark, bench_env: dict, runner: Runner, batch: int, workload: str, row: str) -> None:
    keep = 1.0 if workload == "none" else KEEP_RATE
    task = Task("bench", DEIT_B, workload, keep, batch, row)
    try:
        prep = runner.prepare(task)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        if prep.calls is None:
            pytest.fail(f"{task.key} is not timed: {prep.entry.get('reason')}")
        device = runner.lab.device
        warmup(prep.calls, prep.context)  # prepare already ran each pipeline once
        # One forward, then a synchronize, per round: the wall clock of report_e2e as a pytest-benchmark target.
        with prep.context(), gc_off():
            benchmark.pedantic(SyncEvery(prep.calls, 1), rounds=ROUNDS, iterations=1, warmup_rounds=2)
        events = forward_times(prep.calls, device, context=prep.context, warmup=1, min_iters=ROUNDS, max_iters=ROUNDS)
        info = runner.describe_task(task)
        benchmark.extra_info.update(
            workload_kind=info["workload_kind"],
            label=info["label"],
            counts=prep.entry.get("counts"),
            check=prep.entry.get("check"),
            compile_s=prep.entry.get("compile_s"),
            img_per_s=batch / benchmark.stats.stats.median,
            events_us=events.events.to_dict() if events.events else None,
            wall_us_report_e2e=events.wall.to_dict(),
            timm=timm.__version__,
            **{k: bench_env[k] for k in ("card", "capability", "torch", "triton", "cuda", "commit")},
        )
    finally:
        prep.cleanup()
