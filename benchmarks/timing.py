"""Timing helpers shared by every benchmark: three clocks, one summary format, the card's facts.

A benchmark times a *peer*: a list of zero-argument callables, one per input copy (they are cycled so that the
inputs do not stay in L2), plus a context-manager factory entered once around all of its calls (an SDPA backend
choice, say: a pipeline sets it once per forward, not once per call). Three clocks, all reported in microseconds
per call as medians with their spread:

* ``wall``   -- host wall time of back-to-back calls: synchronize, N calls, synchronize, divided by N; median over
  rounds. What a Python pipeline pays per call: dispatch when the host is the bottleneck, device time when not.
* ``events`` -- CUDA events recorded around each call issued to an idle device (synchronize before each start
  event), median over calls: the paper's method. Dispatch latency up to the first kernel plus the device time.
* ``graph``  -- device time alone: K calls captured in one CUDA graph, each replay timed with events, divided by
  K. A peer that cannot be captured reports ``None`` and the reason.

Keep the host quiet while timing: one CPU thread for torch (``torch.set_num_threads(1)``), the garbage collector
off inside the timed loops. Nothing here asserts a time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

Call = Callable[[], object]
ContextFactory = Callable[[], contextlib.AbstractContextManager]

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Spread:
    """Median and spread of per-call times, in microseconds."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(samples_us: Sequence[float]) -> Spread:
    """Median, quartiles (inclusive method), min and max of ``samples_us``."""
    data = sorted(samples_us)
    if not data:
        raise ValueError("no samples to summarize")
    q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive") if len(data) > 1 else (data[0],) * 3
    return Spread(statistics.median(data), q1, q3, data[0], data[-1], len(data))


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """Keeps Python's garbage collector from pausing a timed loop."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def schedule(calls: Sequence[Call], n: int) -> list[Call]:
    """``n`` calls cycling through the input copies, precomputed so the timed loop only calls."""
    return [calls[i % len(calls)] for i in range(n)]


def warmup(calls: Sequence[Call], context: ContextFactory, n: int | None = None) -> None:
    """Runs every input copy at least once (JIT compilation, handles, allocator pools), then synchronizes."""
    with context():
        for call in schedule(calls, max(n or 0, len(calls))):
            call()
    torch.cuda.synchronize()


def _wall_once(plan: Sequence[Call]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for call in plan:
        call()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def calls_per_round(
    calls: Sequence[Call], context: ContextFactory, target_s: float = 0.02, lo: int = 20, hi: int = 2000
) -> int:
    """How many back-to-back calls fill about ``target_s`` of wall time (clamped to ``[lo, hi]``)."""
    probe = schedule(calls, 10)
    with context(), gc_off():
        per_call = _wall_once(probe) / len(probe)
    return max(lo, min(hi, round(target_s / max(per_call, 1e-7))))


def wall_time(calls: Sequence[Call], context: ContextFactory, n: int, rounds: int = 7) -> Spread:
    """Host wall time per call of ``n`` back-to-back calls and one synchronize; median over ``rounds``."""
    plan = schedule(calls, n)
    samples = []
    with context(), gc_off():
        for _ in range(rounds):
            samples.append(_wall_once(plan) / n * 1e6)
    return summarize(samples)


def event_time(calls: Sequence[Call], context: ContextFactory, iters: int = 100) -> Spread:
    """CUDA-event time of each call issued to an idle device (the paper's method), over ``iters`` calls."""
    plan = schedule(calls, iters)
    starts = [torch.cuda.Event(enable_timing=True) for _ in plan]
    ends = [torch.cuda.Event(enable_timing=True) for _ in plan]
    with context(), gc_off():
        for call, start, end in zip(plan, starts, ends, strict=True):
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)])


@dataclass(frozen=True)
class GraphResult:
    """Per-call device time under graph replay, or why the peer could not be captured."""

    spread: Spread | None
    reason: str | None = None


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters: an exception as a reported reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def graph_time(
    calls: Sequence[Call], context: ContextFactory, calls_per_graph: int | None = None, replays: int = 10
) -> GraphResult:
    """Captures ``calls_per_graph`` calls (default: one per input copy, at least 20) in one CUDA graph and times
    ``replays`` replays with events; per-call time = replay time / calls per graph."""
    k = calls_per_graph or max(20, len(calls))
    plan = schedule(calls, k)
    graph = torch.cuda.CUDAGraph()
    with context():
        # Warm up on a side stream before capture, as torch.cuda.graph's documentation asks (lazy handles and
        # workspaces must not be created during capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in plan[: len(calls)]:
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                for call in plan:
                    call()
        except Exception as exc:  # any capture failure is a result to report, not a crash
            reason = f"not capturable: {describe(exc)}"
            del graph
            torch.cuda.synchronize()  # a sticky error would surface here and stop the run, as it should
            return GraphResult(None, reason)
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    with gc_off():
        for start, end in zip(starts, ends, strict=True):
            start.record()
            graph.replay()
            end.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / k for s, e in zip(starts, ends, strict=True)]
    del graph
    return GraphResult(summarize(samples))


@dataclass(frozen=True)
class Timings:
    """The three clocks of one peer on one workload."""

    wall: Spread
    events: Spread
    graph: Spread | None
    graph_reason: str | None
    calls_per_round: int

    def to_dict(self) -> dict[str, object]:
        return {
            "wall_us": self.wall.to_dict(),
            "events_us": self.events.to_dict(),
            "graph_us": self.graph.to_dict() if self.graph else None,
            "graph_reason": self.graph_reason,
            "calls_per_round": self.calls_per_round,
        }


def measure(
    calls: Sequence[Call], context: ContextFactory, *, rounds: int = 7, event_iters: int = 100, replays: int = 10
) -> Timings:
    """Warms up, then takes all three clocks."""
    warmup(calls, context)
    n = calls_per_round(calls, context)
    wall = wall_time(calls, context, n, rounds)
    events = event_time(calls, context, event_iters)
    graph = graph_time(calls, context, replays=replays)
    return Timings(wall, events, graph.spread, graph.reason, n)


class SyncEvery:
    """Cycles through ``calls`` and synchronizes the device after every ``n``-th call.

    For pytest-benchmark: ``benchmark.pedantic(SyncEvery(calls, n), iterations=n, warmup_rounds=1, ...)`` then
    times n back-to-back calls plus one synchronize per round, and stores time per call -- the ``wall`` method.
    Its loop adds ~0.2 us per call of Python overhead compared with :func:`wall_time`. Start it on an idle device.
    """

    def __init__(self, calls: Sequence[Call], n: int) -> None:
        self._calls = list(calls)
        self._n = n
        self._i = 0

    def __call__(self) -> None:
        self._calls[self._i % len(self._calls)]()
        self._i += 1
        if self._i % self._n == 0:
            torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """The card's device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(samples)


def git_commit() -> str:
    """``HEAD`` of this checkout (``+dirty`` with uncommitted changes to tracked files); ``RAGGED_BENCH_COMMIT``
    overrides it where the copy carries no ``.git``."""
    if os.environ.get("RAGGED_BENCH_COMMIT"):
        return os.environ["RAGGED_BENCH_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def environment() -> dict[str, object]:
    """Versions and commit: what every result must carry. Works without a GPU (card fields are then None)."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "card": None,
        "capability": None,
        "sm_count": None,
        "l2_bytes": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            card=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", None),
        )
    return info


def l2_bytes(default: int = 50 << 20) -> int:
    """The current card's L2 size (H100's 50 MiB when torch does not expose it)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or default)
