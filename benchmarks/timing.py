"""Every clock of the benchmarks and of the ci/ tools, and the facts of the card a result was measured on.

The method -- warm-up, rotated input copies, one torch thread, the garbage collector off inside timed loops,
medians with quartiles -- is docs/measuring.md's. A clock times a *peer*: a list of zero-argument callables, one
per input copy (cycled so that the inputs do not stay in L2), plus a context-manager factory entered once around
all of its calls (an SDPA backend choice, say). Times are in microseconds per call:

* :func:`wall_time`  -- synchronize, N back-to-back calls, synchronize, divided by N; median over rounds.
* :func:`event_time` -- CUDA events around each call issued to an idle device: the paper's method.
* :func:`graph_time` -- device time alone: K calls captured in one CUDA graph, each replay timed with events.
* :func:`span_time`  -- CUDA events around N back-to-back calls: device time plus the gaps between launches.
* :func:`paired_spans` -- :func:`span_time` of several peers in turn, round by round; :func:`paired_ratio` of two.
* :func:`graphed_calls` -- a peer's calls captured one per CUDA graph, replayed as its calls (a graphed peer).
* :func:`forward_times` -- ``report_e2e``'s per-forward clock: host clock and CUDA events around each forward.
* :func:`stage_breakdown` -- the paper's Table IV: the regions of one pruned forward, marked by CUDA events.
* :func:`elapsed` -- seconds from an idle device to an idle device (first calls, sizing the rounds).

Nothing here asserts a time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton

from benchmarks import REPO_ROOT
from ragged_vit.pipelines.plan import Step, StepKind

if TYPE_CHECKING:  # (only a type: the before/after runs import these clocks beside older checkouts)
    from ragged_vit.pipelines.state import ForwardState

Call = Callable[..., object]
ContextFactory = Callable[[], contextlib.AbstractContextManager]
CUDA = torch.device("cuda")


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


def sync(device: torch.device) -> None:
    """Waits for ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters: an exception as a reported reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# --------------------------------------------------------------------------------------------------- clocks


def schedule(calls: Sequence[Call], n: int) -> list[Call]:
    """``n`` calls cycling through the input copies, precomputed so the timed loop only calls."""
    return [calls[i % len(calls)] for i in range(n)]


def warmup(calls: Sequence[Call], context: ContextFactory = contextlib.nullcontext, n: int = 0) -> None:
    """Runs every input copy at least once, ``n`` calls at least (JIT compilation, handles, allocator pools), then
    synchronizes."""
    with context():
        for call in schedule(calls, max(n, len(calls))):
            call()
    torch.cuda.synchronize()


def elapsed(plan: Sequence[Call], device: torch.device = CUDA) -> float:
    """Seconds of the calls of ``plan`` back to back, from an idle device to an idle device (a single first call:
    its compilation or capture)."""
    sync(device)
    t0 = time.perf_counter()
    for call in plan:
        call()
    sync(device)
    return time.perf_counter() - t0


def calls_per_round(
    calls: Sequence[Call],
    context: ContextFactory = contextlib.nullcontext,
    *,
    target_s: float = 0.02,
    lo: int = 20,
    hi: int = 2000,
) -> int:
    """How many back-to-back calls fill about ``target_s`` of wall time (``lo`` to ``hi``)."""
    probe = schedule(calls, 10)
    with context(), gc_off():
        per_call = elapsed(probe) / len(probe)
    return max(lo, min(hi, round(target_s / max(per_call, 1e-7))))


def wall_time(
    calls: Sequence[Call], n: int, rounds: int = 7, context: ContextFactory = contextlib.nullcontext
) -> Spread:
    """Host wall time per call of ``n`` back-to-back calls and one synchronize; median over ``rounds``."""
    plan = schedule(calls, n)
    with context(), gc_off():
        return summarize([elapsed(plan) / n * 1e6 for _ in range(rounds)])


def event_time(calls: Sequence[Call], iters: int = 100, context: ContextFactory = contextlib.nullcontext) -> Spread:
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


def span_time(calls: Sequence[Call], n: int, context: ContextFactory = contextlib.nullcontext) -> float:
    """CUDA-event time of ``n`` back-to-back calls divided by ``n`` (one event pair around all of them)."""
    plan = schedule(calls, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with context(), gc_off():
        start.record()
        for call in plan:
            call()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def paired_spans(
    peers: Mapping[str, tuple[Sequence[Call], ContextFactory]], rounds: int = 21, target_s: float = 0.01
) -> dict[str, list[float]]:
    """:func:`span_time` of every peer (``name -> (calls, context)``, warmed up) in turn, ``rounds`` times: one
    span per peer and round, each of about ``target_s`` (2 calls at least) and started on an idle device.

    The spans of one round lie milliseconds apart, so a ratio of two peers *within a round* compares them on one
    state of the host and the card: a host that is slower as a whole slows both (the ratio of two host-bound peers
    stays), and a hiccup spoils one round of one pair, which the median of the rounds' ratios ignores.
    """
    sizes = {name: calls_per_round(calls, context, target_s=target_s, lo=2) for name, (calls, context) in peers.items()}
    spans: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(rounds):
        for name, (calls, context) in peers.items():
            spans[name].append(span_time(calls, sizes[name], context))
    return spans


def paired_ratio(spans: Mapping[str, Sequence[float]], peer: str, row: str) -> dict[str, float]:
    """``peer / row`` of :func:`paired_spans`, round by round (above 1: ``row`` is the faster): the spread of the
    per-round ratios (``median`` is the paired estimate) and ``fastest``, the ratio of the two fastest rounds."""
    ratios = [p / r for p, r in zip(spans[peer], spans[row], strict=True)]
    return {**summarize(ratios).to_dict(), "fastest": min(spans[peer]) / min(spans[row])}


def warm_up_on_side_stream(calls: Sequence[Call]) -> None:
    """Runs ``calls`` once on a side stream and waits for them: the warm-up before a capture that
    ``torch.cuda.graph``'s documentation asks for (lazy handles and workspaces must not be created during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def graphed_calls(calls: Sequence[Call], context: ContextFactory = contextlib.nullcontext) -> list[Call]:
    """Each call captured in a CUDA graph of its own (inside ``context``, after a warm-up on a side stream, as
    ``torch.cuda.graph`` asks) and returned as that graph's replay: the peer run as one graph launch per call.
    The graphs (and their memory pools) live as long as the returned calls; their outputs are not kept."""
    replays: list[Call] = []
    with context():
        warm_up_on_side_stream(calls)
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            replays.append(graph.replay)
    torch.cuda.synchronize()
    return replays


@dataclass(frozen=True)
class GraphResult:
    """Per-call device time under graph replay, or why the peer could not be captured."""

    spread: Spread | None
    reason: str | None = None


def graph_time(
    calls: Sequence[Call],
    calls_per_graph: int | None = None,
    replays: int = 10,
    context: ContextFactory = contextlib.nullcontext,
) -> GraphResult:
    """Captures ``calls_per_graph`` calls (default: one per input copy, at least 20) in one CUDA graph and times
    ``replays`` replays with events; per-call time = replay time / calls per graph."""
    k = calls_per_graph or max(20, len(calls))
    plan = schedule(calls, k)
    graph = torch.cuda.CUDAGraph()
    with context():
        warm_up_on_side_stream(plan[: len(calls)])
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


def device_us(call: Call, calls_per_graph: int = 20, replays: int = 20) -> float:
    """Median device time of ``call()`` under graph replay (:func:`graph_time`); raises if it cannot be captured."""
    result = graph_time([call], calls_per_graph, replays)
    if result.spread is None:
        raise RuntimeError(result.reason)
    return result.spread.median


def measure(
    calls: Sequence[Call], context: ContextFactory, *, rounds: int = 7, event_iters: int = 100, replays: int = 10
) -> dict[str, object]:
    """Warms up, then takes the wall, event and graph clocks (``*_us`` spreads as dicts, ``graph_reason``)."""
    warmup(calls, context)
    n = calls_per_round(calls, context)
    wall = wall_time(calls, n, rounds, context)
    events = event_time(calls, event_iters, context)
    graph = graph_time(calls, replays=replays, context=context)
    return {
        "wall_us": wall.to_dict(),
        "events_us": events.to_dict(),
        "graph_us": graph.spread.to_dict() if graph.spread else None,
        "graph_reason": graph.reason,
        "calls_per_round": n,
    }


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


# --------------------------------------------------------------------------------------------------- forwards


@dataclass(frozen=True)
class ForwardTimes:
    """Per-forward clocks of one row: host wall time with a synchronize around every forward, and the CUDA-event
    time of the same forwards (None on a CPU), in microseconds; with ``back_to_back``, also the host wall time of as
    many forwards in a row (one synchronize before and after them all) per forward (else None)."""

    wall: Spread
    events: Spread | None
    iters: int
    back_to_back: float | None = None


def forward_times(
    calls: Sequence[Call],
    device: torch.device,
    *,
    context: ContextFactory = contextlib.nullcontext,
    warmup: int = 3,
    target_s: float = 0.3,
    min_iters: int = 10,
    max_iters: int = 60,
    back_to_back: bool = False,
) -> ForwardTimes:
    """Warms up, then times ``iters`` forwards one at a time, rotating through ``calls`` (one per input batch).

    Each forward: synchronize, host clock, start event, forward, end event, synchronize, host clock. The number of
    forwards fills about ``target_s`` (clamped to ``[min_iters, max_iters]``), sized from the warm-up. A forward
    timed alone also pays what runs before its first kernel (the host's work, a graph's launch); ``back_to_back``
    then times ``iters`` forwards in a row, where each one's host work overlaps the device work before it (the
    throughput of a stream of batches).
    """
    cuda = device.type == "cuda"
    with context(), gc_off():
        warm = schedule(calls, max(warmup, len(calls)))
        per_call = elapsed(warm, device) / len(warm)
        iters = max(min_iters, min(max_iters, round(target_s / max(per_call, 1e-6))))
        walls: list[float] = []
        pairs = []
        for call in schedule(calls, iters):
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            sync(device)
            t0 = time.perf_counter()
            if start is not None:
                start.record()
            call()
            if end is not None:
                end.record()
            sync(device)
            walls.append((time.perf_counter() - t0) * 1e6)
            pairs.append((start, end))
        in_a_row = elapsed(schedule(calls, iters), device) * 1e6 / iters if back_to_back else None
    events = summarize([s.elapsed_time(e) * 1e3 for s, e in pairs]) if cuda else None
    return ForwardTimes(summarize(walls), events, iters, in_a_row)


# Table IV's regions of a pruned forward, by the plan's step kinds. front: patch embedding and the dense blocks
# before the first stage (with the input checks); pack: every stage's decision and repack (with the one host read
# of a variable-count stage); late: the packed blocks (the padded backends pad inside each block, so their per-layer
# gather is here); head: CLS gather, norms, classifier.
REGIONS = ("front", "pack", "late", "head")
REGION_OF = {
    StepKind.FRONT: "front",
    StepKind.DECIDE: "pack",
    StepKind.REPACK: "pack",
    StepKind.BLOCKS: "late",
    StepKind.ATTENTION: "late",
    StepKind.MLP: "late",
    StepKind.HEAD: "head",
}


class Marks:
    """The region transitions of forwards: ``on_step`` (a ``PrunedViT.run`` hook, called before every step of the
    plan) records a CUDA event (on a CPU: the host clock) whenever the region changes."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.current: str | None = None
        self._marks: list[tuple[str, object]] = []

    def mark(self, region: str) -> None:
        if region == self.current:
            return
        self.current = region
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((region, event))
        else:
            self._marks.append((region, time.perf_counter()))

    def on_step(self, step: Step, state: ForwardState) -> None:
        self.mark(REGION_OF[step.kind])

    def start(self) -> None:
        self.current = None
        self._marks = []
        self.mark("front")

    def stop(self) -> dict[str, float]:
        """Ends a forward; returns microseconds per region (after synchronizing on a GPU)."""
        self.mark("end")
        if self.cuda:
            torch.cuda.synchronize()
        spent = dict.fromkeys(REGIONS, 0.0)
        for (region, a), (_, b) in zip(self._marks[:-1], self._marks[1:], strict=True):
            spent[region] += a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
        self.current = None
        return spent


def stage_breakdown(calls: Sequence[Call], device: torch.device, iters: int = 20, warmup: int = 2) -> dict[str, Spread]:
    """Median and spread per region (and ``total``, their sum per forward) over ``iters`` instrumented forwards,
    each started on an idle device; ``calls`` are forwards of one pipeline (``PrunedViT.run`` with its images bound,
    rotated) that take the ``on_step`` hook. The marks cost a few microseconds of host time each: compare the total
    with the uninstrumented forward. Not for the CUDA-graph runner (nothing can be timed inside a replay)."""
    samples: dict[str, list[float]] = {r: [] for r in (*REGIONS, "total")}
    marks = Marks(device)
    with gc_off():
        for i in range(warmup + iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks.start()
            calls[i % len(calls)](on_step=marks.on_step)
            spent = marks.stop()
            if i >= warmup:
                for region in REGIONS:
                    samples[region].append(spent[region])
                samples["total"].append(sum(spent.values()))
    return {region: summarize(values) for region, values in samples.items()}


# --------------------------------------------------------------------------------------------------- the card


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

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != REPO_ROOT:
            return "unknown"  # a copy without .git inside another repository: that one's HEAD is not ours
        sha, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def gpu_slug(name: str | None = None) -> str:
    """A directory name for a card (``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``), ``"cpu"`` without."""
    if name is None:
        name = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown"


def environment() -> dict[str, object]:
    """Versions, commit, date and card: what every result must carry. Without a GPU the card fields are None."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "card": None,
        "capability": None,
        "sm_count": None,
        "l2_bytes": None,
        "gpu_slug": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            card=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", None),
            gpu_slug=gpu_slug(props.name),
        )
    return info


def l2_bytes(default: int = 50 << 20) -> int:
    """The current card's L2 size (H100's 50 MiB when torch does not expose it)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or default)
