"""The benchmark suites with stored baselines per GPU: run them, gate this run against the card's stored runs, store it.

    python -m benchmarks.run_bench [--quick | quick] [--tolerance 15] [--no-compare] [--export DIR] [pytest args]

Runs ``python -m pytest benchmarks --benchmark-only`` (the kernel and end-to-end suites; ``RAGGED_BENCH_QUICK=1``
with ``--quick``; other arguments, ``-k EXPR`` say, go to pytest), with pytest-benchmark's results (wall-clock
statistics, and each benchmark's ``extra_info``: the card, torch, triton, CUDA, commit and the other clocks) written
to one JSON file, then gates that run and stores it as
``benchmarks/baselines/<gpu-slug>/bench-<quick|full>/NNNN_<mode>-<commit>.json``: one directory per card model and
mode, numbered after the runs already there (those pytest-benchmark saved under ``<machine-id>/`` before the gate
count too).

**The gate.** Wall-clock medians are stored, not gated: they move with the lent machine's host, not only with the
code (on an H200 whose host ran about twice as slow, 21 of 84 quick medians rose by more than 25% on a clean main,
while our kernel's time over FA2's at B = 1 went from 0.86 to 0.84). The gate compares what stays put across
machines of one card model, each benchmark's ``extra_info["gate"]``, written by our entries of the two suites (their
docstrings say which entry carries which):

* ``ratio_vs_<peer>`` -- a peer's time over ours (above 1: ours is faster), the median over rounds that time the two
  in turn in one process (``timing.paired_spans``): our attention kernel against ``fa2_aten`` where a call costs its
  launch more than its kernel; our pipelines against the other backend's pipeline and against the unpruned timm
  model, eager with eager and CUDA graphs with CUDA graphs. A slower host slows both sides of a pair alike, and
  a hiccup spoils single rounds, which the median ignores. Fails when it **drops** by more than the tolerance.
* ``device_us`` -- device time under CUDA-graph replay (``timing.graph_time``: the calls captured in one graph, the
  replays timed with CUDA events, divided by the calls): our attention kernel in every cell, our eager pipeline
  where it has no host synchronisation. No host in it at all. Fails when it **rises** by more than the tolerance,
  and when the baseline has one and this run measured none (the call stopped being capturable).

Each gated quantity is compared with the latest stored run of the same card and mode that holds it; runs of another
card (by the card each run names) and runs with an injected regression are never baselines, and a run that fails
the gate is not stored. Tolerance, ``--tolerance``, 15% by default: our device times under graph replay repeat
within a few percent between stored runs of one card (machines, sessions, commits that left the kernel alone), and
a same-process ratio of two peers bound by the same thing moves far less than either wall time. 15% stays clear of
that spread and well under what the gate is for: a lost CUDA graph, a synchronize per block, a kernel launched with
a bad configuration move these numbers by a factor. A 10% slowdown of one kernel can pass; time it with
``report_attention`` on one machine.

The table of every gated quantity (baseline, now, change, verdict) is printed; the exit status is 1 when a gated
quantity regressed, else pytest's own (a peer that computes wrong results fails there). A quantity without a stored
value says so and passes, so the first run after a change of the gated quantities stores their baselines.

**Storing.** A run is stored only when it passed the gate, pytest passed and nothing was injected. ``--no-compare``
stores without gating: to accept a new baseline (a new torch, an intended trade-off). ``--threshold N`` adds
pytest-benchmark's own check of the medians (``--benchmark-compare-fail=median:N%``) against the latest stored run:
off by default, meaningful only between runs on one machine in one session.

**Injected regressions**, to see the gate fail (``benchmarks/conftest.py``; the library is untouched):
``RAGGED_BENCH_INJECT=sync`` adds a ``torch.cuda.synchronize()`` after every call of our kernel in the attention
suite's timed loops and after every block's attention of our eager pipeline rows (the launch-bound ratios of
``ours`` and ``ours_op`` against ``fa2_aten`` fail); ``RAGGED_BENCH_INJECT=slow-kernel`` launches our attention
kernel with one warp per program and 16 x 16 tiles, in the attention suite's ``ours`` and in every pipeline on the
Triton backend (the device times fail, and the ratios where the kernel's time shows). Such a run is gated, never
stored.

``--export DIR`` writes this run's JSON and the gate's table into ``DIR`` (``<gpu-slug>-bench-<mode>.json`` and
``.gate.txt``, stored or not) and copies a stored run to ``DIR/<gpu-slug>/bench-<mode>/``, for machines whose
working tree is thrown away after the run: copy ``DIR/<gpu-slug>`` into ``benchmarks/baselines/`` and commit it.
Without a GPU it says so and exits with status 0 (nothing to measure). The same command is
``nox -s bench [-- quick]``; on the lent machines ``bash ci/gpu_suite.sh bench-gate``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import BASELINES, REPO_ROOT

DEFAULT_TOLERANCE = 15.0
INJECT_ENV = "RAGGED_BENCH_INJECT"
NO_BASELINE = "no baseline (passes)"
NOT_GATED = "not gated now (passes)"  # the baseline has it, this run's entry no longer reports it


def storage_dir(slug: str, quick: bool, root: Path | None = None) -> Path:
    """Where the runs of one card and mode are stored."""
    return (root or BASELINES) / slug / ("bench-quick" if quick else "bench-full")


RUN_GLOB = "[0-9][0-9][0-9][0-9]_*.json"


def stored_runs(storage: Path, machine_id: str) -> list[Path]:
    """The runs pytest-benchmark saved under one machine id (``<machine_id>/NNNN_*.json``), oldest first."""
    return sorted((storage / machine_id).glob(RUN_GLOB))


def card_runs(storage: Path) -> list[Path]:
    """Every stored run of one card and mode: ``NNNN_*.json`` (stored by this command) and the runs pytest-benchmark
    saved under machine ids (``*/NNNN_*.json``, before the gate)."""
    folders = sorted(p.name for p in storage.iterdir() if p.is_dir()) if storage.is_dir() else []
    return sorted(storage.glob(RUN_GLOB)) + [path for folder in folders for path in stored_runs(storage, folder)]


def next_run_path(storage: Path, name: str) -> Path:
    """``storage / NNNN_<name>.json``, numbered after every stored run of the card and mode."""
    numbers = [int(path.name[:4]) for path in card_runs(storage)]
    return storage / f"{max(numbers, default=0) + 1:04d}_{name}.json"


def pytest_command(
    storage: Path,
    name: str | None,
    compare: bool,
    threshold: float | None,
    extra: list[str],
    python: str = sys.executable,
    json_path: Path | None = None,
) -> list[str]:
    """The pytest command line: results into ``json_path``, and saved by pytest-benchmark into ``storage`` as
    ``<machine id>/NNNN_<name>.json`` unless ``name`` is None (``main`` stores a run itself, once gated); with
    ``compare``, pytest-benchmark's own median check at ``threshold`` percent against the latest run there."""
    cmd = [python, "-m", "pytest", "benchmarks", "--benchmark-only", f"--benchmark-storage={storage}"]
    if name is not None:
        cmd.append(f"--benchmark-save={name}")
    if json_path is not None:
        cmd.append(f"--benchmark-json={json_path}")
    if compare:
        cmd += ["--benchmark-compare", f"--benchmark-compare-fail=median:{threshold:g}%"]
    return cmd + extra


# --------------------------------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class Gated:
    """One gated quantity of this run against its baseline, and the verdict."""

    benchmark: str  # pytest-benchmark's name, e.g. test_attention[B1-p0-ours]
    key: str  # device_us or ratio_vs_<peer>
    baseline: float | None
    now: float | None
    verdict: str
    failed: bool
    source: str | None = None  # the stored run the baseline comes from

    @property
    def change(self) -> float | None:
        """``now / baseline - 1`` (None where either is missing)."""
        if self.baseline is None or self.now is None or self.baseline == 0:
            return None
        return self.now / self.baseline - 1


def higher_is_better(key: str) -> bool:
    """Ratios (peer over ours) are better higher; device times lower."""
    return key.startswith("ratio_")


def run_slug(run: dict) -> str | None:
    """The card directory name of a stored run (from its machine info), None if it names no card."""
    from benchmarks.timing import gpu_slug

    info = run.get("machine_info", {}).get("ragged_vit") or {}
    if info.get("gpu_slug"):
        return str(info["gpu_slug"])
    return gpu_slug(info["card"]) if info.get("card") else None


def run_inject(run: dict) -> str | None:
    """The injected regression a run was measured with (None for a clean run)."""
    return (run.get("machine_info", {}).get("ragged_vit") or {}).get("inject")


def gated_values(run: dict) -> dict[tuple[str, str], float | None]:
    """``(benchmark name, key) -> value`` of every ``extra_info["gate"]`` of ``run``; None: measured and lost."""
    values = {}
    for bench in run.get("benchmarks", []):
        for key, value in ((bench.get("extra_info") or {}).get("gate") or {}).items():
            values[(bench["name"], key)] = None if value is None else float(value)
    return values


def baselines(stored: list[tuple[str, dict]], slug: str) -> dict[tuple[str, str], tuple[float, str]]:
    """``(benchmark, key) -> (value, run label)``: each quantity's value in the latest stored run of card ``slug``
    that measured it. ``stored`` is ``(label, run)`` oldest first; runs of another card or with an injection are
    skipped."""
    found: dict[tuple[str, str], tuple[float, str]] = {}
    for label, run in reversed(stored):
        if run_slug(run) != slug or run_inject(run):
            continue
        for quantity, value in gated_values(run).items():
            if value is not None and quantity not in found:
                found[quantity] = (value, label)
    return found


def judge(benchmark: str, key: str, now: float | None, base: tuple[float, str] | None, tolerance: float) -> Gated:
    """The verdict on one quantity: a ratio that dropped or a device time that rose by more than ``tolerance``
    percent fails, and so does a value the baseline has and this run lost."""
    if base is None:
        return Gated(benchmark, key, None, now, NO_BASELINE, False)
    value, source = base
    if now is None:
        return Gated(benchmark, key, value, None, "REGRESSION: not measured now", True, source)
    limit = tolerance / 100
    if higher_is_better(key):
        bad, good = now < value * (1 - limit), now > value * (1 + limit)
    else:
        bad, good = now > value * (1 + limit), now < value * (1 - limit)
    verdict = "REGRESSION" if bad else "ok (improved)" if good else "ok"
    return Gated(benchmark, key, value, now, verdict, bad, source)


def gate(run: dict, stored: list[tuple[str, dict]], slug: str, tolerance: float) -> list[Gated]:
    """Every gated quantity of ``run`` judged against the stored runs of card ``slug`` (see the module docstring),
    plus a note for each quantity the baseline has for a benchmark of this run that no longer reports it."""
    base = baselines(stored, slug)
    now = gated_values(run)
    rows = [judge(bench, key, value, base.get((bench, key)), tolerance) for (bench, key), value in now.items()]
    ran = {bench["name"] for bench in run.get("benchmarks", [])}
    for (bench, key), (value, source) in base.items():
        if bench in ran and (bench, key) not in now:
            rows.append(Gated(bench, key, value, None, NOT_GATED, False, source))
    return rows


def fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}x" if higher_is_better(key) else f"{value:.2f} us"


def render(rows: list[Gated], tolerance: float) -> str:
    """The gate's table (name, baseline, now, change, verdict) and a one-line summary."""
    lines = [
        f"Gate: ratios may drop and device times rise by at most {tolerance:g}%",
        "",
        "| gated quantity | baseline | now | change | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        change = "-" if row.change is None else f"{row.change * 100:+.1f}%"
        name = f"{row.benchmark} {row.key}"
        lines.append(f"| {name} | {fmt(row.key, row.baseline)} | {fmt(row.key, row.now)} | {change} | {row.verdict} |")
    failed = [f"{row.benchmark} {row.key}" for row in rows if row.failed]
    judged = sum(row.verdict != NOT_GATED for row in rows)
    sources = sorted({row.source for row in rows if row.source})
    lines += ["", f"baselines from: {', '.join(sources) if sources else 'none stored'}"]
    if not judged:
        lines.append("gate: nothing gated in this run (no entry of ours ran)")
    elif failed:
        lines.append(f"gate: FAILED, {len(failed)} of {judged} gated quantities regressed: {', '.join(failed)}")
    else:
        lines.append(f"gate: passed ({judged} gated quantities)")
    return "\n".join(lines)


def load_runs(paths: list[Path], root: Path) -> list[tuple[str, dict]]:
    """``(path relative to root, run)`` of stored runs, oldest first by the run's date; unreadable files skipped."""
    runs = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        runs.append((str(path.relative_to(root)), run))
    return sorted(runs, key=lambda item: (str(item[1].get("datetime", "")), item[0]))


# --------------------------------------------------------------------------------------------------- the command


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick subset (RAGGED_BENCH_QUICK=1)")
    parser.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help="gate: fail on a ratio drop or device-time rise "
        "beyond this %% (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--threshold", type=float, default=None, help="also pytest-benchmark's median check at this %% slowdown "
        "(off by default: medians move with the host)",
    )  # fmt: skip
    parser.add_argument("--no-compare", action="store_true", help="store without gating (accept a new baseline)")
    parser.add_argument("--export", type=Path, default=None, help="copy the stored files, run JSON and gate here")
    parser.add_argument("--storage-root", type=Path, default=None, help="default benchmarks/baselines")
    args, extra = parser.parse_known_args(argv)
    if "quick" in extra:  # nox -s bench -- quick
        extra = [a for a in extra if a != "quick"]
        args.quick = True
    return args, extra


@dataclass(frozen=True)
class Outcome:
    """What the run came to: the gate's rows, whether the run is kept in the storage, and the exit status."""

    rows: list[Gated]
    keep: bool
    status: int
    note: str


def decide(
    run: dict | None, stored: list[tuple[str, dict]], slug: str, tolerance: float, compare: bool, pytest_rc: int
) -> Outcome:
    """Gates ``run`` (None: pytest wrote no results) and decides whether to keep it and the exit status."""
    if run is None:
        return Outcome([], False, pytest_rc or 1, f"pytest wrote no results (exit status {pytest_rc}): nothing gated")
    rows = gate(run, stored, slug, tolerance) if compare else []
    regressed = any(row.failed for row in rows)
    injected = run_inject(run)
    if regressed:
        return Outcome(rows, False, 1, "not stored: the gate failed")
    if injected:
        return Outcome(rows, False, pytest_rc, f"not stored: {INJECT_ENV}={injected} was set")
    if pytest_rc != 0:
        return Outcome(rows, False, pytest_rc, f"not stored: pytest exited with status {pytest_rc}")
    return Outcome(rows, True, 0, "stored" + ("" if compare else " without gating (--no-compare)"))


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    import torch  # after argument parsing: --help works anywhere

    if not torch.cuda.is_available():
        print("run_bench: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 0
    from benchmarks.timing import git_commit, gpu_slug

    slug = gpu_slug()
    root = args.storage_root or BASELINES
    storage = storage_dir(slug, args.quick, root)
    stored = load_runs(card_runs(storage), root)
    mode = "quick" if args.quick else "full"
    name = f"{mode}-{git_commit().replace('+', '-')[:16]}"
    legacy = args.threshold is not None and bool(stored) and not args.no_compare
    json_path = (args.export or Path(tempfile.mkdtemp(prefix="run_bench-"))) / f"{slug}-bench-{mode}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    cmd = pytest_command(storage, None, legacy, args.threshold, extra, json_path=json_path)
    env = dict(os.environ, RAGGED_BENCH_QUICK="1" if args.quick else "0")
    plan = "storing without gating" if args.no_compare else f"gating against {len(stored)} stored run(s) of this card"
    print(f"run_bench: {slug}, {mode}; storage {storage}; {plan}", file=sys.stderr, flush=True)
    pytest_rc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False).returncode
    run = json.loads(json_path.read_text()) if json_path.is_file() else None
    outcome = decide(run, stored, slug, args.tolerance, not args.no_compare, pytest_rc)
    report = render(outcome.rows, args.tolerance) if not args.no_compare else "gate: not run (--no-compare)"
    note = outcome.note
    if outcome.keep:
        path = next_run_path(storage, name)
        storage.mkdir(parents=True, exist_ok=True)
        shutil.copy2(json_path, path)
        note += f" as {path}"
        if args.export is not None:
            dest = args.export / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            note += f", exported as {dest} (copy {args.export / slug} into {root})"
    print(f"\n{report}\nrun_bench: {note}; this run's results: {json_path}", flush=True)
    if args.export is not None:
        json_path.with_suffix(".gate.txt").write_text(f"{report}\n{note}\n")
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
