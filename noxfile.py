"""Sessions: tests (CPU, what CI runs), gpu_tests, bench, results, demo, lint.

The GPU machine has no nox and no network: there, run ``bash ci/gpu_suite.sh`` (or plain
``python -m pytest tests``) with its preinstalled torch/triton/timm. The GPU sessions below are for a GPU
workstation with network access; on a machine without a GPU they say so and stop.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "virtualenv"  # pip, which sees the local wheel folders (uv would not)
nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

CPU_ENV = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


def _has_cuda(session: nox.Session) -> bool:
    out = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True)
    return out.strip().endswith("True")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test lab: reference, Triton kernels under the interpreter, pipelines on deit_tiny."""
    session.install("-e", ".[dev,demo]")
    session.run("python", "-m", "pytest", "tests", "-q", *session.posargs, env=CPU_ENV)


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """Every test on a CUDA GPU (GPU-marked cases run, interpreter twins are skipped), the long sweeps too (pytest's
    --full), in parallel workers on the one GPU, then the timed tests alone (ci/gpu_tests.py); `nox -s gpu_tests --
    quick` leaves the long sweeps out. Other arguments go to pytest."""
    session.install("-e", ".[dev,demo]")
    if not _has_cuda(session):
        session.skip("no CUDA GPU on this machine: the GPU suite needs one (see README, 'On a GPU')")
    session.run("python", "-m", "ci.gpu_tests", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark suites gated against the stored runs of this GPU; `nox -s bench -- quick` for the subset.

    Runs `python -m benchmarks.run_bench`: gates the run on our entries' same-run ratios to their peers and their
    device times under CUDA-graph replay (not on wall-clock medians), fails when one regressed beyond 15%
    (`--tolerance N`), and stores a passing run under benchmarks/baselines/<gpu>/bench-<quick|full>/. Other
    arguments go to pytest.
    """
    session.install("-e", ".[dev,demo]")
    if not _has_cuda(session):
        session.skip("no CUDA GPU on this machine: benchmarks measure GPU kernels")
    session.run("python", "-m", "benchmarks.run_bench", *session.posargs)


@nox.session
def results(session: nox.Session) -> None:
    """Regenerates docs/results.md and docs/figures/ from the stored JSON (no GPU needed)."""
    session.install("-e", ".[dev]")
    session.run("python", "-m", "benchmarks.make_results", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Classifies scikit-image's sample photos with a pruned DeiT on every available backend."""
    session.install("-e", ".[demo]")
    session.run("python", "-m", "ragged_vit", *session.posargs, env={"OMP_NUM_THREADS": "2"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
