"""pytest-benchmark suite of the attention peers: the grid of ``report_attention`` as one benchmark per
(B, pruned %, peer), DeiT-B geometry, fp16.

pytest-benchmark stores and compares the ``wall`` clock (back-to-back calls, one synchronize per round, time per
call); the CUDA-event and CUDA-graph clocks, the memory roofline, the correctness error and the environment go into
``extra_info``. A peer missing from this torch is skipped with the reason; a peer that computes the wrong result
fails and is not timed. Times are never asserted.

    python -m pytest benchmarks/test_bench_attention.py --benchmark-only            # full grid
    RAGGED_BENCH_QUICK=1 python -m pytest benchmarks/test_bench_attention.py --benchmark-only   # B 1, 64 x 0, 80%
    RAGGED_BENCH_FIXED=1 ...                                                         # equal per-image counts
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.attention_peers import PEER_NAMES, Problem, cell_problem, checked_peer
from benchmarks.timing import SyncEvery, calls_per_round, event_time, gc_off, graph_time, l2_bytes, warmup
from benchmarks.workloads import attention_bytes, grid, make_workload

QUICK = os.environ.get("RAGGED_BENCH_QUICK", "") not in ("", "0")
VARIABLE = os.environ.get("RAGGED_BENCH_FIXED", "") in ("", "0")
ROUNDS = 7
EVENT_ITERS = 100
REPLAYS = 10

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
def test_attention(benchmark, bench_env: dict, cells: _Cells, batch: int, pruned: int, peer_name: str) -> None:
    problem, reference = cells.get(batch, pruned)
    wl = problem.workload
    peer, entry = checked_peer(peer_name, problem, reference)
    if entry.get("status") == "unavailable":
        pytest.skip(entry["reason"])
    if peer is None:
        pytest.fail(f"{peer_name} is wrong on {wl.label}, not timed: {entry['reason']}")

    warmup(peer.calls, peer.context)
    n = calls_per_round(peer.calls, peer.context)
    torch.cuda.synchronize()
    with peer.context(), gc_off():
        benchmark.pedantic(SyncEvery(peer.calls, n), iterations=n, rounds=ROUNDS, warmup_rounds=1)
    torch.cuda.synchronize()
    events = event_time(peer.calls, EVENT_ITERS, peer.context)
    graph = graph_time(peer.calls, replays=REPLAYS, context=peer.context)

    roofline_us = attention_bytes(wl.total) / (bench_env["copy_bandwidth_gbps"] * 1e9) * 1e6
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
        **{k: bench_env[k] for k in ("card", "capability", "torch", "triton", "cuda", "commit", "copy_bandwidth_gbps")},
    )
