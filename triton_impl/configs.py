"""Per-architecture tile configurations of the ragged attention kernel (no autotuning at run time).

Why a table and not ``@triton.autotune``: autotuning costs a benchmark sweep at first call, adds a
Python-side lookup to every launch, and fails under Triton's interpreter. A small table keyed by
(compute capability, head_dim) keeps dispatch to one dict lookup.

How the entries were chosen:

* SM89: the paper's values, BLOCK_M = BLOCK_N = 64, one program per (image, head). We have no SM89 card, so
  these are kept as published and are not re-tuned (``docs/tuning.md#attention-tile-table``).
* SM90: chosen by a sweep of ``python -m ci.tune_attention`` (``bash ci/gpu_suite.sh tune``): tile sizes, warps,
  stages, grid shape (``docs/tuning.md#attention-tile-table``). The best configuration depends on the sequence
  length, so the table holds bands keyed by the mean length ``T / B``.
* Anything else (and the CPU interpreter): a safe 64x64 default.

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
    """One launch configuration of ``ragged_vit.triton_impl.attention``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    grid_per_tile: bool


# (major, minor) -> head_dim -> bands of (largest mean sequence length, config), the last band open-ended.
# The mean length T / B is known on the host from the tensor shapes, so choosing a band never syncs.
_Bands = tuple[tuple[float, AttentionConfig], ...]
_OPEN = float("inf")

_SM89 = AttentionConfig(64, 64, 4, 2, False)  # the paper's values, kept as published (no SM89 card here)
# SM90 (docs/tuning.md#attention-tile-table): short sequences (a mean of at most 64 tokens) are latency-bound and
# want one program per (image, head) walking 64x64 tiles without software pipelining; longer ones want a program
# per query tile and 64x32 key tiles, three stages deep.
_SM90_SHORT = AttentionConfig(64, 64, 4, 1, False)
_SM90_LONG = AttentionConfig(64, 32, 4, 3, True)

_TABLE: dict[tuple[int, int], dict[int, _Bands]] = {
    (8, 9): {d: ((_OPEN, _SM89),) for d in (16, 32, 64, 128)},
    # 80 (ViT-H/14) and 96 run 128-wide padded tiles; their sweeps pick the same two bands, faster than the untuned
    # default below in every cell (docs/tuning.md#attention-tile-table).
    (9, 0): {d: ((64.0, _SM90_SHORT), (_OPEN, _SM90_LONG)) for d in (16, 32, 64, 80, 96, 128)},
}

# Untuned head dims (any other multiple of 8 up to 256, or any head dim off SM90): 64x64 tiles, or 32x32 past 128
# channels, where a 64-row accumulator of BLOCK_D = 256 fp32 lanes would spill registers. Correct everywhere; tune
# before relying on speed.
_DEFAULT: _Bands = ((_OPEN, AttentionConfig(64, 64, 4, 2, True)),)
_DEFAULT_WIDE: _Bands = ((_OPEN, AttentionConfig(32, 32, 4, 2, True)),)


@functools.lru_cache(maxsize=64)
def _bands(capability: tuple[int, int] | None, head_dim: int) -> _Bands:
    default = _DEFAULT if head_dim <= 128 else _DEFAULT_WIDE
    return _TABLE.get(capability, {}).get(head_dim, default) if capability else default


def attention_config(device: torch.device, head_dim: int, mean_seqlen: float = _OPEN) -> AttentionConfig:
    """The tuned configuration for ``device`` (CPU = interpreter), ``head_dim`` and the mean sequence length."""
    bands = _bands(_capability(device.index) if device.type == "cuda" else None, head_dim)
    for limit, config in bands:
        if mean_seqlen <= limit:
            return config
    return bands[-1][1]


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# --- the skinny fused linear (triton_impl/linear.py) ---------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration of ``ragged_vit.triton_impl.linear``: the output tile ``block_m x block_n``, the
    reduction step ``block_k``, ``split_k`` (0: chosen by :func:`linear_split` from K and the SM count), ``per_sm``,
    the programs per SM that the split rule aims at, and ``fixup``: with several splits, the last program of each
    output tile adds the partials (one launch) instead of a second kernel (the same bits either way)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0
    per_sm: int = 1
    fixup: bool = False


# Bands of the row count M (the packed rows of a forward), the last one open-ended. SM90: ci.tune_linear's picks
# (docs/tuning.md#linear-tile-table): the single launch at M = 1, 64-row tiles beyond.
_LinearBands = tuple[tuple[float, LinearConfig], ...]
_LINEAR_TABLE: dict[tuple[int, int], _LinearBands] = {
    (9, 0): (
        (1, LinearConfig(16, 64, 64, 4, 4, fixup=True)),
        (99, LinearConfig(64, 64, 64, 4, 4)),
        (394, LinearConfig(64, 128, 64, 4, 4)),
        (_OPEN, LinearConfig(64, 128, 64, 4, 3, per_sm=2)),
    ),
}
# Any other capability, and the CPU interpreter (where fewer, larger tiles run faster): untuned, correct everywhere.
_LINEAR_DEFAULT: _LinearBands = (
    (16, LinearConfig(16, 64, 64, 4, 2)),
    (64, LinearConfig(64, 64, 64, 4, 2)),
    (_OPEN, LinearConfig(64, 128, 64, 4, 2)),
)
LINEAR_MIN_K_BLOCKS = 2
"""Each split of K walks at least this many ``block_k`` steps, so a split's loads can still be pipelined."""
LINEAR_MAX_SPLIT = 16
"""At most this many splits of K: beyond it the fp32 partial sums cost more traffic than the spread gains."""
FUSED_BLOCK_MAX_ROWS = 0  # docs/tuning.md#fused-linear-blocks: measured slower at B 1-4, so no forward takes it
"""Forwards of at most this many rows (``B x N``) run their packed blocks as fused linears (four launches and the
attention a block: :mod:`ragged_vit.pipelines.packed_block`, the fused-linear form); the plan's rule reads it."""
LINEAR_PDL_MAX_ROWS = 0  # docs/tuning.md#fused-linear-blocks: measured slower at B 1-4, so no launch takes it
"""Fused linears of at most this many rows (M) launch with programmatic dependent launch where the GPU and Triton
allow it (:func:`ragged_vit.triton_impl.launcher.pdl_supported`): each may start while the kernel before it finishes,
and waits for it before reading anything (the same bits); a chain of them hides the launch gaps of a small forward."""
INTERPRETER_SMS = 8
"""The SM count the interpreter plans splits for: small enough that its tests take the split-K path at small N."""


def linear_config(device: torch.device, rows: int) -> LinearConfig:
    """The configuration for ``rows`` (M) packed rows on ``device`` (CPU = interpreter)."""
    capability = _capability(device.index) if device.type == "cuda" else None
    for limit, config in _LINEAR_TABLE.get(capability, _LINEAR_DEFAULT):
        if rows <= limit:
            return config
    raise AssertionError("the last band is open-ended")


@functools.lru_cache(maxsize=16)
def sm_count(index: int | None) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def linear_split(config: LinearConfig, rows: int, cols: int, depth: int, sms: int) -> tuple[int, int]:
    """``(splits, k_per_split)`` for an ``[rows, depth] @ [depth, cols]`` product: with fewer output tiles than
    ``per_sm x sms``, K is split so that about ``per_sm`` programs per SM stream their own slabs of the weight; each
    split is a multiple of ``block_k`` long, at least :data:`LINEAR_MIN_K_BLOCKS` steps, and none is empty."""
    steps = -(-depth // config.block_k)
    if config.split_k:
        wanted = config.split_k
    else:
        tiles = -(-rows // config.block_m) * -(-cols // config.block_n)
        wanted = min(
            max(1, config.per_sm * sms // max(tiles, 1)), LINEAR_MAX_SPLIT, max(1, steps // LINEAR_MIN_K_BLOCKS)
        )
    per_split = -(-steps // max(1, min(wanted, steps)))  # block_k steps per split
    return -(-steps // per_split), per_split * config.block_k
