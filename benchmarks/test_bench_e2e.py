"""pytest-benchmark suite of the end-to-end pipelines: a small representative grid of ``report_e2e``'s Table III.

One benchmark per (batch size, workload, row) of the grid below, DeiT-B 224, fp16, 50% pruning, built and checked by
``report_e2e.Runner``. pytest-benchmark stores the wall time of one forward (a synchronize after each, three input
batches rotated); the per-forward clock of ``report_e2e`` (``timing.forward_times``), img/s, the device time under
graph replay where the row has no host synchronisation, the workload kind and its kept counts, the check, the card
and the versions go into ``extra_info``. A row that cannot run here is skipped with the reason; a pipeline that
computes wrong logits fails and is not timed. Times are never asserted.

Our rows (``triton``, ``triton_graphed``) also carry what ``python -m benchmarks.run_bench`` gates on, in
``extra_info["gate"]``:

* ``ratio_vs_<peer>`` -- the peer's time over ours, the median of ``PAIRED_ROUNDS`` rounds that time the peer and
  our row in turn (``timing.paired_spans``; above 1: ours is faster), against each peer of :data:`PEERS`: the
  other attention backend's pipeline and the unpruned timm model, run the same way as our row (eager with eager,
  CUDA graphs with CUDA graphs), so that a slower host moves both sides alike;
* ``device_us`` -- where our row has no host synchronisation (fixed counts, eager): the device time of a forward
  under CUDA-graph replay (``timing.graph_time``).

``RAGGED_BENCH_INJECT`` (``benchmarks/conftest.py``) slows our rows on purpose, to prove that gate red.

    RAGGED_BENCH_QUICK=1 python -m pytest benchmarks/test_bench_e2e.py --benchmark-only   # B 1, 64; 14 rows
    python -m pytest benchmarks/test_bench_e2e.py --benchmark-only      # B 1, 4, 64; ATS, torch.compile rows too
"""

from __future__ import annotations

import contextlib
import os

import pytest
import timm
import torch

from benchmarks.e2e_common import DEIT_B, Lab
from benchmarks.report_e2e import Prepared, Runner, Settings, Task, Unavailable
from benchmarks.timing import (
    SyncEvery,
    forward_times,
    gc_off,
    graph_time,
    graphed_calls,
    paired_ratio,
    paired_spans,
    warmup,
)

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
# Our rows and the peers each is paired with in its gated ratios; timm_graphed is timm_eager's forwards replayed
# from one CUDA graph each (timing.graphed_calls), the unpruned model run as our graphed row runs.
PEERS = {"triton": ("fa2_varlen", "timm_eager"), "triton_graphed": ("fa2_varlen_graphed", "timm_graphed")}
PAIRED_ROUNDS = 15
GRAPH_CALLS, GRAPH_REPLAYS = 6, 10  # forwards per captured graph and replays of the device-time clock

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
def test_e2e(benchmark, bench_env: dict, runner: Runner, inject, batch: int, workload: str, row: str) -> None:
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
        ours = row in PEERS
        paired: dict[str, object] = {}
        # The injected regression (if any) slows our eager row's blocks in the wall clocks, not in graph replay.
        with inject.synced_blocks(prep.pipeline) if ours else contextlib.nullcontext():
            warmup(prep.calls, prep.context)  # prepare already ran each pipeline once
            # One forward, then a synchronize, per round: the wall clock of report_e2e as a pytest-benchmark target.
            with prep.context(), gc_off():
                benchmark.pedantic(SyncEvery(prep.calls, 1), rounds=ROUNDS, iterations=1, warmup_rounds=2)
            events = forward_times(
                prep.calls, device, context=prep.context, warmup=1, min_iters=ROUNDS, max_iters=ROUNDS
            )
            if ours:
                paired = paired_with_peers(runner, task, prep)
        graph = graph_time(prep.calls, GRAPH_CALLS, GRAPH_REPLAYS, prep.context) if prep.capturable else None
        gated: dict[str, float | None] = {}
        if ours:
            gated = {f"ratio_vs_{peer}": ratio["median"] for peer, ratio in paired["paired"].items()}
            if graph is not None:
                gated["device_us"] = graph.spread.median if graph.spread else None
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
            graph_us=graph.spread.to_dict() if graph is not None and graph.spread else None,
            graph_reason=graph.reason if graph is not None else prep.entry.get("graph_reason"),
            **paired,
            **({"gate": gated, "inject": inject.mode} if ours else {}),
            timm=timm.__version__,
            **{k: bench_env[k] for k in ("card", "capability", "torch", "triton", "cuda", "commit")},
        )
    finally:
        prep.cleanup()


def peer_task(task: Task, peer: str) -> Task:
    """The task of one of :data:`PEERS`: the same batch and workload, or the unpruned model on the same batch."""
    if peer.startswith("timm_"):
        return Task(task.part, task.model, "none", 1.0, task.batch, "timm_eager")
    return Task(task.part, task.model, task.workload, task.keep_rate, task.batch, peer)


def paired_with_peers(runner: Runner, task: Task, ours: Prepared) -> dict[str, object]:
    """``paired``: each peer of our row (:data:`PEERS`) and our row timed in turn, each peer's per-round ratio to
    ours (``timing.paired_ratio``); ``paired_reasons``: the peers that cannot run here, and why."""
    peers: dict[str, Prepared] = {}
    reasons: dict[str, str] = {}
    try:
        for name in PEERS[task.row]:
            try:
                peers[name] = runner.prepare(peer_task(task, name))
            except Unavailable as exc:
                reasons[name] = str(exc)
                continue
            if peers[name].calls is None:
                reasons[name] = str(peers[name].entry.get("reason"))
            elif name == "timm_graphed":  # the graphs live as long as the Prepared holds their replays
                peers[name].calls = graphed_calls(peers[name].calls, peers[name].context)
                peers[name].context = contextlib.nullcontext
        timed = {name: (prep.calls, prep.context) for name, prep in peers.items() if prep.calls is not None}
        for calls, context in timed.values():
            warmup(calls, context)
        spans = paired_spans({**timed, "ours": (ours.calls, ours.context)}, PAIRED_ROUNDS)
        del timed
    finally:
        for prep in peers.values():
            prep.calls = None  # graph replays first: their pools are freed before the cleanup empties the cache
            prep.cleanup()
    ratios = {name: paired_ratio(spans, name, "ours") for name in PEERS[task.row] if name in spans}
    return {"paired": ratios, "paired_reasons": reasons}
