"""Shared test setup.

Without a CUDA GPU the Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET`` must be set before
any module that defines kernels is imported, so it is set here, first. GPU-only tests carry ``@pytest.mark.gpu``
and are skipped with a reason on CPU machines; their CPU twins run the same kernels under the interpreter.
Long sweeps carry ``@pytest.mark.full`` and run with ``--full`` only (the GPU suite and releases); the quick level
without it keeps one representative of each case family, so every contract is still checked on every run.
"""

from __future__ import annotations

import os
import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
FULL_REASON = "long sweep: runs with --full (the GPU suite and releases)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=False, help="also run the long sweeps (tests marked full)"
    )


if not HAS_CUDA:  # tl.dot summed as a GPU sums it, whatever BLAS numpy has on this CPU; xor reductions in numpy
    from ragged_vit.testing.interpreter import numpy_xor_reductions, order_interpreter_dots  # noqa: E402

    order_interpreter_dots()
    numpy_xor_reductions()


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    """One intra-op thread on CPU-only machines: on the 2-core CI machine a second busy process makes 2-thread torch
    ~10x slower. GPU machines keep their threads (their CPU-side references are large)."""
    if HAS_CUDA:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        # Kernels compiled for the GPU cannot take the CPU tensors of the interpreter twins.
        marker, reason = "interpreter", "CPU twin for Triton's interpreter; its gpu twin runs on this machine"
    else:
        marker, reason = "gpu", "needs a CUDA GPU; its CPU twin runs under TRITON_INTERPRET=1"
    skip = pytest.mark.skip(reason=reason)
    skip_full = None if config.getoption("--full") else pytest.mark.skip(reason=FULL_REASON)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
        elif skip_full is not None and "full" in item.keywords:
            item.add_marker(skip_full)


@pytest.fixture
def device() -> str:
    """The device kernel tests run on: cuda when present, else cpu (Triton interpreter)."""
    return DEVICE


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's node id: fresh inputs per case, reproducible per case."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture
def forbid_launch(monkeypatch: pytest.MonkeyPatch):
    """Replaces named module attributes (kernel launchers) by a function that fails the test if called."""

    def forbid(module: object, *names: str) -> None:
        def launched(*args: object, **kwargs: object) -> None:
            raise AssertionError("kernel launched on invalid input")

        for name in names:
            monkeypatch.setattr(module, name, launched)

    return forbid
