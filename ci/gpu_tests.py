"""The GPU test suite in one command: every test in parallel pytest-xdist workers sharing the one GPU, then the tests
that time the GPU (marked ``exclusive``) alone on it.

    python -m ci.gpu_tests [quick] [--jobs N] [--log-dir DIR] [pytest args or test paths]

``quick`` leaves out the long sweeps (pytest's ``--full``). The workers steal tests from each other (``--dist
worksteal``): most of the suite's time is Triton compiling each kernel variant on the host, which spreads over the
cores while the GPU stays mostly idle. Each worker gets its share of the cores for the CPU-side references. The same
command is ``nox -s gpu_tests [-- quick]``; on the lent machines ``bash ci/gpu_suite.sh tests``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import has_gpu

REPO = Path(__file__).resolve().parents[1]
EXCLUSIVE = "exclusive"  # the marker of tests that time the GPU: run after the parallel step, alone


def commands(quick: bool, jobs: int, args: list[str]) -> list[list[str]]:
    """The two pytest runs: everything else in ``jobs`` workers, then the exclusive tests in this process."""
    given = [a for a in args if not a.startswith("-") and (REPO / a.split("::")[0]).exists()]  # test paths
    options = [a for a in args if a not in given]
    base = [sys.executable, "-m", "pytest", *(given or ["tests"]), "-q", "-p", "no:cacheprovider"]
    base += [] if quick else ["--full"]
    parallel = [*base, "-n", str(jobs), "--dist", "worksteal", "-m", f"not {EXCLUSIVE}", "--durations=25"]
    return [[*parallel, *options], [*base, "-m", EXCLUSIVE, *options]]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options, ``quick`` (a first word, as ``nox -s gpu_tests -- quick`` passes it) among them, and the rest:
    pytest's arguments and test paths."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [quick] [options] ...")
    parser.add_argument("--jobs", type=int, default=8, help="pytest-xdist workers on the one GPU (default 8)")
    parser.add_argument("--log-dir", type=Path, help="write each run's output to gpu_tests_<i>.log here")
    opts, rest = parser.parse_known_args(argv)
    if opts.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {opts.jobs}")
    opts.quick = rest[:1] == ["quick"]  # leave out the long sweeps (--full)
    return opts, rest[opts.quick :]


def main(argv: list[str] | None = None) -> int:
    opts, rest = parse(argv)
    if not has_gpu("python -m ci.gpu_tests (the CPU suite is `nox -s tests`)"):
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // opts.jobs))}
    env.pop("TRITON_INTERPRET", None)
    start, codes = time.monotonic(), []
    for i, cmd in enumerate(commands(opts.quick, opts.jobs, rest)):
        if opts.log_dir is None:
            codes.append(subprocess.run(cmd, cwd=REPO, env=env).returncode)
            continue
        opts.log_dir.mkdir(parents=True, exist_ok=True)
        log = opts.log_dir / f"gpu_tests_{i}.log"
        with log.open("w") as out:
            codes.append(subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode)
        lines = log.read_text().splitlines()
        print(*[line for line in lines if line.startswith(("FAILED", "ERROR"))][:30], *lines[-1:], sep="\n")
    codes[1] = 0 if codes[1] == 5 else codes[1]  # pytest's 5: no test selected (no exclusive test among the paths)
    level = "quick" if opts.quick else "full"
    print(f"gpu tests ({level}): rc {codes}, {opts.jobs} workers, wall {time.monotonic() - start:.0f} s")
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
