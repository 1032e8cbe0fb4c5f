"""The benchmark suites with stored baselines per GPU: save this run, compare with the last one, fail on slowdowns.

    python -m benchmarks.run_bench [--quick | quick] [--threshold 25] [--no-compare] [--export DIR] [pytest args]

Runs ``python -m pytest benchmarks --benchmark-only`` (the kernel and end-to-end suites; ``RAGGED_BENCH_QUICK=1``
with ``--quick``) with

* ``--benchmark-storage=benchmarks/baselines/<gpu-slug>/bench-<quick|full>`` -- one directory per card model
  and mode, so a run is only ever compared with the same card and the same grid (pytest-benchmark files the runs
  under its machine id: OS, Python);
* ``--benchmark-save=<mode>-<commit>`` -- every run is stored (``NNNN_<mode>-<commit>.json``, with the card,
  torch, triton, CUDA and commit in ``machine_info.ragged_vit`` and in each benchmark's ``extra_info``);
* ``--benchmark-compare --benchmark-compare-fail=median:<threshold>%`` when a stored run exists for this card and
  machine id: the run fails if any benchmark's median is more than ``threshold`` percent slower than in the
  latest stored run. Default 25%: wall times on the lent H100/H200 machines vary by about +-20% between
  machines of one kind and between sessions (the attention suite's launch-bound cells most), so a tighter
  threshold flags noise; 25% still catches a lost CUDA graph or an extra host sync per layer (2x and more).

``--export DIR`` copies the files this run added to the storage into ``DIR`` (same relative paths), for machines
whose working tree is thrown away after the run (copy them back into the repository and commit them). Without a
GPU it says so and exits with status 0 (nothing to measure). The same command is ``nox -s bench [-- quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import BASELINES, REPO_ROOT

DEFAULT_THRESHOLD = 25.0


def storage_dir(slug: str, quick: bool, root: Path | None = None) -> Path:
    """Where the runs of one card and mode are stored."""
    return (root or BASELINES) / slug / ("bench-quick" if quick else "bench-full")


def stored_runs(storage: Path, machine_id: str) -> list[Path]:
    """The saved runs pytest-benchmark would compare with (``<machine_id>/NNNN_*.json``), oldest first."""
    return sorted((storage / machine_id).glob("[0-9][0-9][0-9][0-9]_*.json"))


def pytest_command(
    storage: Path, name: str, compare: bool, threshold: float, extra: list[str], python: str = sys.executable
) -> list[str]:
    """The pytest command line (see the module docstring)."""
    cmd = [python, "-m", "pytest", "benchmarks", "--benchmark-only", f"--benchmark-storage={storage}"]
    cmd.append(f"--benchmark-save={name}")
    if compare:
        cmd += ["--benchmark-compare", f"--benchmark-compare-fail=median:{threshold:g}%"]
    return cmd + extra


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick subset (RAGGED_BENCH_QUICK=1)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="fail above this %% slowdown")
    parser.add_argument("--no-compare", action="store_true", help="save only, do not compare")
    parser.add_argument("--export", type=Path, default=None, help="copy the saved files into this directory")
    parser.add_argument("--storage-root", type=Path, default=None, help="default benchmarks/baselines")
    args, extra = parser.parse_known_args(argv)
    if "quick" in extra:  # nox -s bench -- quick
        extra = [a for a in extra if a != "quick"]
        args.quick = True
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    import torch  # after argument parsing: --help works anywhere

    if not torch.cuda.is_available():
        print("run_bench: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 0
    from pytest_benchmark.utils import get_machine_id

    from benchmarks.timing import git_commit, gpu_slug

    slug = gpu_slug()
    storage = storage_dir(slug, args.quick, args.storage_root)
    machine_id = get_machine_id()
    before = set(stored_runs(storage, machine_id))
    compare = bool(before) and not args.no_compare
    mode = "quick" if args.quick else "full"
    name = f"{mode}-{git_commit().replace('+', '-')[:16]}"
    cmd = pytest_command(storage, name, compare, args.threshold, extra)
    env = dict(os.environ, RAGGED_BENCH_QUICK="1" if args.quick else "0")
    plan = (
        f"comparing with {sorted(before)[-1].name} (fails above +{args.threshold:g}% median)"
        if compare
        else "no stored run to compare with: saving only"
    )
    print(f"run_bench: {slug}, {mode}; storage {storage}; {plan}", file=sys.stderr, flush=True)
    rc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False).returncode
    if args.export is not None:
        root = args.storage_root or BASELINES
        for path in sorted(set(stored_runs(storage, machine_id)) - before):
            dest = args.export / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            print(f"run_bench: exported {dest}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
