"""Setup of the benchmark suites: skipped as a whole without a CUDA GPU; every result carries its environment.

Run on the GPU machine with ``python -m pytest benchmarks --benchmark-only`` (``RAGGED_BENCH_QUICK=1`` for the
quick subset, ``RAGGED_BENCH_FIXED=1`` for equal per-image counts). The card, torch, triton, CUDA and the git
commit go into pytest-benchmark's machine info and into each benchmark's ``extra_info``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.timing import copy_bandwidth, environment

HAS_CUDA = torch.cuda.is_available()
SKIP_REASON = (
    "benchmarks need a CUDA GPU (torch.cuda.is_available() is False); "
    "run them on the GPU machine: python -m pytest benchmarks --benchmark-only"
)
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["ragged_vit"] = environment()


@pytest.fixture(scope="session")
def bench_env() -> dict[str, object]:
    """The environment every result carries, measured once: card, versions, commit, copy bandwidth."""
    torch.set_num_threads(1)
    env = environment()
    env["copy_bandwidth_gbps"] = copy_bandwidth() / 1e9
    return env
