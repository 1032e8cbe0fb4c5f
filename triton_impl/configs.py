"""Per-architecture tile configurations of the ragged attention kernel (no autotuning at run time).

Why a table and not ``@triton.autotune``: autotuning costs a benchmark sweep at first call, adds a
Python-side lookup to every launch, and fails under Triton's interpreter. A small table keyed by
(compute capability, head_dim) keeps dispatch to one dict lookup.

How the entries were chosen:

* SM89 (Ada, RTX 4000 Ada): the paper's values, BLOCK_M = BLOCK_N = 64, one program per (image, head). We have
  no SM89 card, so these are kept as published and are not re-tuned.
* SM90 (H100/H200): measured with ``ci/gpu_suite.py --tune`` on our cards; see ``docs/kernel_tuning.md``
  for the sweep (tile sizes, warps, stages, grid shape) and the chosen winners.
* Anything else (and the CPU interpreter): the SM90 choice for fp16/bf16, a safe 64x64 default.

``grid_per_tile`` picks the grid: True launches ``(ceil(max_seqlen / BLOCK_M), B * H)`` programs (one per
query tile); False launches ``(1, B * H)`` and each program loops over its image's query tiles. The kernel is
the same in both cases (a grid-stride loop over query tiles), so correctness never depends on the choice or
on the ``max_seqlen`` bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """One launch configuration of ``triton_impl.attention``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    grid_per_tile: bool


# (major, minor) -> head_dim -> config. head_dim is the padded power of two the kernel runs with.
_TABLE: dict[tuple[int, int], dict[int, AttentionConfig]] = {
    (8, 9): {
        32: AttentionConfig(64, 64, 4, 2, False),
        64: AttentionConfig(64, 64, 4, 2, False),
        128: AttentionConfig(64, 64, 4, 2, False),
    },
    (9, 0): {
        32: AttentionConfig(64, 64, 4, 2, True),
        64: AttentionConfig(64, 64, 4, 2, True),
        128: AttentionConfig(64, 64, 4, 2, True),
    },
}

_DEFAULT = AttentionConfig(64, 64, 4, 2, True)


@functools.lru_cache(maxsize=64)
def _lookup(capability: tuple[int, int] | None, head_dim: int) -> AttentionConfig:
    return _TABLE.get(capability, {}).get(head_dim, _DEFAULT) if capability else _DEFAULT


def attention_config(device: torch.device, head_dim: int) -> AttentionConfig:
    """The tuned configuration for ``device`` (CPU = interpreter) and ``head_dim``."""
    if device.type != "cuda":
        return _lookup(None, head_dim)
    return _lookup(_capability(device.index), head_dim)


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def override(capability: tuple[int, int], head_dim: int, config: AttentionConfig) -> None:
    """Replaces one table entry (used by the tuning sweep; not needed in normal use)."""
    _TABLE.setdefault(capability, {})[head_dim] = config
    _lookup.cache_clear()
