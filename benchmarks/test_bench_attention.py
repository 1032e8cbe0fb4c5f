"""pytest-benchmark suite of the attention peers: the grid of ``report_attention`` as one benchmark per
(B, pruned %, peer), DeiT-B geometry, fp16.

pytest-benchmark stores the ``wall`` clock (back-to-back calls, one synchronize per round, time per call); the
CUDA-event and CUDA-graph clocks, the memory roofline, the correctness error and the environment go into
``extra_info``. A peer missing from this torch is skipped with the reason; a peer that computes the wrong result
fails and is not timed. Times are never asserted.

Our two entries (``ours``, ``ours_op``) also carry what ``run_bench`` gates on, in ``extra_info["gate"]``:

* ``device_us`` (``ours``, every cell) -- the kernel's device time under CUDA-graph replay (``timing.graph_time``);
* ``ratio_vs_fa2_aten`` (both, cells of at most ``HOST_BOUND_BATCH`` images, where a call costs its launch more
  than its kernel) -- ``fa2_aten``'s time over ours, the median of ``PAIRED_ROUNDS`` rounds that time the two in
  turn (``timing.paired_spans``; above 1: ours is faster). Larger cells keep it in ``extra_info["paired"]`` only:
  there one side may be bound by its launches and the other by its kernel, and a slower host moves their ratio.

``RAGGED_BENCH_INJECT`` (``benchmarks/conftest.py``) slows our entries on purpose, to prove that gate red.

    python -m pytest benchmarks/test_bench_attention.py --benchmark-only            # full grid
    RAGGED_BENCH_QUICK=1 python -m pytest benchmarks/test_bench_attention.py --benchmark-only   # B 1, 64 x 0, 80%
    RAGGED_BENCH_FIXED=1 ...                                                         # equal per-image counts
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.attention_peers import PEER_NAMES, Problem, cell_problem, checked_peer
from benchmarks.timing import (
    SyncEvery,
    calls_per_round,
    event_time,
    gc_off,
    graph_time,
    l2_bytes,
    paired_ratio,
    paired_spans,
    warmup,
)
from benchmarks.workloads import attention_bytes, grid, make_workload

QUICK = os.environ.get("RAGGED_BENCH_QUICK", "") not in ("", "0")
VARIABLE = os.environ.get("RAGGED_BENCH_FIXED", "") in ("", "0")
ROUNDS = 7
EVENT_ITERS = 100
REPLAYS = 10
OURS = ("ours", "ours_op")
RATIO_PEER = "fa2_aten"  # the peer our gated ratio is taken against: the varlen kernel of torch itself
HOST_BOUND_BATCH = 4  # cells of at most this many images are launch-bound: their ratio is gated
PAIRED_ROUNDS = 21

CASES = [
    pytest.param(
        batch, pruned, peer, id=f"B{batch}-p{pruned}-{peer}", marks=pytest.mark.benchmark(group=f"B{batch}-p{pruned}")
    )
    for batch, pruned in grid(QUICK)
    for peer in PEER_NAMES
]


class _Cells:
    """The current cell's inputs and reference; cases run cell by cell, so one cell is kept at a time."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._value: tuple[Problem, torch.Tensor] | None = None

    def get(self, batch: int, pruned: int) -> tuple[Problem, torch.Tensor]:
        if self._key != (batch, pruned) or self._value is None:
            self._value = None
            torch.cuda.empty_cache()
            self._key, self._value = (batch, pruned), cell_problem(make_workload(batch, pruned, VARIABLE), l2_bytes())
        return self._value


@pytest.fixture(scope="session")
def cells() -> _Cells:
    return _Cells()


@pytest.mark.parametrize(("batch", "pruned", "peer_name"), CASES)
def test_attention(benchmark, bench_env: dict, cells: _Cells, inject, batch: int, pruned: int, peer_name: str) -> None:
    problem, reference = cells.get(batch, pruned)
    wl = problem.workload
    peer, entry = checked_peer(peer_name, problem, reference)
    if entry.get("status") == "unavailable":
        pytest.skip(entry["reason"])
    if peer is None:
        pytest.fail(f"{peer_name} is wrong on {wl.label}, not timed: {entry['reason']}")
    ours = peer_name in OURS
    # The injected regression (if any): a slower kernel for every clock, a synchronize for the wall clocks only.
    device_calls = inject.kernel_calls(peer.calls) if peer_name == "ours" else peer.calls
    timed = inject.timed_calls(device_calls) if ours else device_calls

    warmup(timed, peer.context)
    n = calls_per_round(timed, peer.context)
    torch.cuda.synchronize()
    with peer.context(), gc_off():
        benchmark.pedantic(SyncEvery(timed, n), iterations=n, rounds=ROUNDS, warmup_rounds=1)
    torch.cuda.synchronize()
    events = event_time(timed, EVENT_ITERS, peer.context)
    graph = graph_time(device_calls, replays=REPLAYS, context=peer.context)

    roofline_us = attention_bytes(wl.total) / (bench_env["copy_bandwidth_gbps"] * 1e9) * 1e6
    gated: dict[str, float | None] = {}
    if ours:
        benchmark.extra_info.update(paired_with_peer(problem, reference, timed, peer.context))
        ratio = benchmark.extra_info["paired"].get(RATIO_PEER)
        if batch <= HOST_BOUND_BATCH and ratio is not None:
            gated[f"ratio_vs_{RATIO_PEER}"] = ratio["median"]
        if peer_name == "ours":  # ours_op launches the same kernel: one device time gates both
            gated["device_us"] = graph.spread.median if graph.spread else None
    benchmark.extra_info.update(
        workload=wl.label,
        tokens=wl.total,
        max_len=wl.max_len,
        mean_len=wl.total / wl.batch,
        input_sets=len(problem.qkv_sets),
        peer_note=peer.note,
        max_abs_err=entry["max_abs_err"],
        calls_per_round=n,
        events_us=events.to_dict(),
        graph_us=graph.spread.to_dict() if graph.spread else None,
        graph_reason=graph.reason,
        roofline_us=roofline_us,
        graph_over_roofline=graph.spread.median / roofline_us if graph.spread else None,
        **({"gate": gated, "inject": inject.mode} if ours else {}),
        **{k: bench_env[k] for k in ("card", "capability", "torch", "triton", "cuda", "commit", "copy_bandwidth_gbps")},
    )


def paired_with_peer(problem: Problem, reference: torch.Tensor, calls: list, context) -> dict[str, object]:
    """``paired``: :data:`RATIO_PEER` and our ``calls`` timed in turn, the peer's per-round ratio to ours
    (``timing.paired_ratio``); ``paired_reason`` instead where the peer cannot run here."""
    peer, entry = checked_peer(RATIO_PEER, problem, reference)
    if peer is None:
        return {"paired": {}, "paired_reason": f"{RATIO_PEER}: {entry.get('reason')}"}
    warmup(peer.calls, peer.context)
    spans = paired_spans({RATIO_PEER: (peer.calls, peer.context), "ours": (calls, context)}, PAIRED_ROUNDS)
    return {"paired": {RATIO_PEER: paired_ratio(spans, RATIO_PEER, "ours")}}
