"""Setup of the benchmark suites: skipped as a whole without a CUDA GPU; every result carries its environment.

Run on the GPU machine with ``python -m pytest benchmarks --benchmark-only`` (``RAGGED_BENCH_QUICK=1`` for the
quick subset, ``RAGGED_BENCH_FIXED=1`` for equal per-image counts). The card, torch, triton, CUDA and the git
commit go into pytest-benchmark's machine info and into each benchmark's ``extra_info``.

``RAGGED_BENCH_INJECT`` makes our timed code slower on purpose, to prove that the gate of ``run_bench`` fails (the
``inject`` fixture; benchmarks only, the library is untouched; the mode is recorded in the machine info and in
every entry that it slows, and ``run_bench`` never stores such a run):

* ``sync`` -- a ``torch.cuda.synchronize()`` after every call of our kernel in the attention suite's timed loops
  (``ours``, ``ours_op``) and after every block's attention of the end-to-end suite's eager ``triton`` rows (their
  attention backend's ``attend``). Not inside the graph-replay clocks, which cannot capture a synchronize.
* ``slow-kernel`` -- our attention kernel launched with :data:`SLOW_CONFIG` (one warp per program, 16 x 16 tiles):
  the attention suite's ``ours`` through the kernel's ``config`` argument, every pipeline on the ``triton`` backend
  (eager and graphed) through a patched ``TritonBackend._attend`` for the session.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from benchmarks.timing import copy_bandwidth, environment
from ragged_vit.triton_impl.attention import ragged_attention_qkv_unchecked
from ragged_vit.triton_impl.configs import AttentionConfig

HAS_CUDA = torch.cuda.is_available()
SKIP_REASON = (
    "benchmarks need a CUDA GPU (torch.cuda.is_available() is False); "
    "run them on the GPU machine: python -m pytest benchmarks --benchmark-only"
)
_HERE = Path(__file__).resolve().parent
INJECT_ENV = "RAGGED_BENCH_INJECT"
INJECT_MODES = ("sync", "slow-kernel")
# One warp per (image, head) walking 16 x 16 tiles: a valid launch on every card, far slower than any tuned choice.
SLOW_CONFIG = AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, grid_per_tile=False)


def inject_mode() -> str | None:
    """The injected regression named by ``RAGGED_BENCH_INJECT`` (None when unset or empty); unknown names raise."""
    mode = os.environ.get(INJECT_ENV, "").strip() or None
    if mode is not None and mode not in INJECT_MODES:
        raise pytest.UsageError(f"{INJECT_ENV}={mode!r}: choose from {INJECT_MODES} (or leave it unset)")
    return mode


def pytest_configure(config: pytest.Config) -> None:
    inject_mode()  # a misspelt mode stops the run before anything is timed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["ragged_vit"] = {**environment(), "inject": inject_mode()}


@pytest.fixture(scope="session")
def bench_env() -> dict[str, object]:
    """The environment every result carries, measured once: card, versions, commit, copy bandwidth."""
    torch.set_num_threads(1)
    env = environment()
    env["copy_bandwidth_gbps"] = copy_bandwidth() / 1e9
    return env


def _synced(call: Callable[..., object]) -> Callable[..., object]:
    """``call`` followed by a device synchronize (the injected ``sync`` regression)."""

    @functools.wraps(call)
    def wrapper(*args: object, **kwargs: object) -> object:
        out = call(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    return wrapper


class Injection:
    """What ``RAGGED_BENCH_INJECT`` does to our timed code (nothing when ``mode`` is None); see the module docstring."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode

    def kernel_calls(self, calls: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
        """Our attention suite's calls (``ours``: partials of ``ragged_attention_qkv``) with the slow configuration
        under ``slow-kernel``, for every clock."""
        if self.mode != "slow-kernel":
            return list(calls)
        return [functools.partial(call, config=SLOW_CONFIG) for call in calls]

    def timed_calls(self, calls: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
        """Our calls as the wall-clock loops run them: each followed by a synchronize under ``sync``."""
        return [_synced(call) for call in calls] if self.mode == "sync" else list(calls)

    @contextlib.contextmanager
    def synced_blocks(self, pipeline: object | None) -> Iterator[None]:
        """Under ``sync``, a synchronize after every ``attend`` of ``pipeline``'s backend (once per packed block)
        inside the block; the backend is restored after it."""
        backend = getattr(pipeline, "backend", None)
        if self.mode != "sync" or backend is None:
            yield
            return
        backend.attend = _synced(backend.attend)  # an instance attribute over the class's method
        try:
            yield
        finally:
            del backend.attend


def _slow_triton_attend(
    self: object,
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_heads: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``TritonBackend._attend`` with :data:`SLOW_CONFIG` (the injected ``slow-kernel`` regression)."""
    return ragged_attention_qkv_unchecked(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias, None, SLOW_CONFIG)


@pytest.fixture(scope="session")
def inject() -> Iterator[Injection]:
    """The injected regression of this session (``RAGGED_BENCH_INJECT``); ``slow-kernel`` patches the Triton
    backend of every pipeline for the session."""
    mode = inject_mode()
    with pytest.MonkeyPatch.context() as patch:
        if mode == "slow-kernel":
            from ragged_vit.pipelines.backends.triton import TritonBackend

            patch.setattr(TritonBackend, "_attend", _slow_triton_attend)
        yield Injection(mode)
