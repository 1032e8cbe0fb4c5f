"""Synthetic attention workloads in DeiT-B geometry for the kernel benchmark (the paper's Tables I and II).

A workload is a batch of ``B`` images of 196 patches + CLS from which ``pruned_pct`` percent of the patches were
dropped. With ``variable=True`` (the default, and the case the paper never measured) each image keeps its own
count, drawn uniformly within +-15% of ``196 * (1 - pruned)`` and clipped to ``[1, 196]``; with ``variable=False``
every image keeps ``round(196 * (1 - pruned))`` patches (the paper's 197 / 99 / 40 tokens). ``pruned_pct = 0``
keeps every token in both modes: there is nothing to vary. Counts are seeded per (B, pruned, mode), so every
run and every peer sees the same batch.

Inputs are packed like the pipeline's: one ``qkv [T, 3*H*D]`` buffer (the ``Attention.qkv`` output of the kept
tokens), random normal (never zeros), plus int32 ``cu_seqlens [B+1]``. Several independent copies are drawn so
the timing loops can rotate among them and the inputs do not stay resident in L2.

Not covered: other resolutions (577 tokens), other models, bf16. Those are parameters, not new code.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

NUM_PATCHES = 196  # 224 / 16 squared
NUM_HEADS = 12  # DeiT-B
HEAD_DIM = 64
MAX_SEQLEN = NUM_PATCHES + 1  # the bound our kernel is given: the unpruned length
JITTER = 0.15  # relative half-width of the per-image count distribution

BATCHES = (1, 4, 32, 64, 128)
PRUNED_PCTS = (0, 50, 80)
QUICK_BATCHES = (1, 64)
QUICK_PRUNED_PCTS = (0, 80)


@dataclass(frozen=True)
class Workload:
    """One benchmark cell: per-image token counts (CLS included) of a pruned batch."""

    batch: int
    pruned_pct: int
    variable: bool
    lengths: tuple[int, ...]  # [B], each in [2, 197]

    @property
    def total(self) -> int:
        """``T``, the packed token count."""
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        """The true longest image (what peers that need an exact max are given)."""
        return max(self.lengths)

    @property
    def min_len(self) -> int:
        return min(self.lengths)

    @property
    def label(self) -> str:
        mode = "var" if self.variable else "fixed"
        return f"B{self.batch}-p{self.pruned_pct}-{mode}"

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 ``[B+1]`` offsets with a leading 0."""
        offsets = [0]
        for n in self.lengths:
            offsets.append(offsets[-1] + n)
        return torch.tensor(offsets, dtype=torch.int32, device=device)


def cell_seed(batch: int, pruned_pct: int, variable: bool, seed: int = 0) -> int:
    """A stable per-cell seed (``hash()`` of a str is salted per process, crc32 is not)."""
    return zlib.crc32(f"attention-bench/{batch}/{pruned_pct}/{int(variable)}/{seed}".encode())


def kept_patches(batch: int, pruned_pct: int, variable: bool, rng: random.Random) -> list[int]:
    """Per-image kept patch counts (CLS excluded), each in ``[1, 196]``."""
    if not 0 <= pruned_pct < 100:
        raise ValueError(f"pruned_pct must be in [0, 100), got {pruned_pct}")
    target = NUM_PATCHES * (1 - pruned_pct / 100)
    if pruned_pct == 0 or not variable:
        return [min(NUM_PATCHES, max(1, round(target)))] * batch
    draws = (target * rng.uniform(1 - JITTER, 1 + JITTER) for _ in range(batch))
    return [min(NUM_PATCHES, max(1, round(x))) for x in draws]


def make_workload(batch: int, pruned_pct: int, variable: bool = True, seed: int = 0) -> Workload:
    """The seeded workload of one cell."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rng = random.Random(cell_seed(batch, pruned_pct, variable, seed))
    lengths = tuple(k + 1 for k in kept_patches(batch, pruned_pct, variable, rng))
    return Workload(batch=batch, pruned_pct=pruned_pct, variable=variable, lengths=lengths)


def grid(quick: bool = False) -> list[tuple[int, int]]:
    """The (B, pruned %) cells, batch-major: the full grid or the quick subset."""
    batches, pcts = (QUICK_BATCHES, QUICK_PRUNED_PCTS) if quick else (BATCHES, PRUNED_PCTS)
    return [(b, p) for b in batches for p in pcts]


def make_qkv_sets(
    workload: Workload,
    n_sets: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``n_sets`` independent packed ``qkv [T, 3*H*D]`` buffers drawn from N(0, 1)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(cell_seed(workload.batch, workload.pruned_pct, workload.variable, seed) + 1)
    shape = (workload.total, 3 * NUM_HEADS * HEAD_DIM)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(n_sets)]


def attention_bytes(total: int, num_heads: int = NUM_HEADS, head_dim: int = HEAD_DIM, itemsize: int = 2) -> int:
    """The fewest bytes one attention call must move: read q, k, v and write o once, ``T*H*D`` each."""
    return 4 * total * num_heads * head_dim * itemsize


def sets_to_rotate(set_bytes: int, l2_bytes: int, lo: int = 4, hi: int = 256) -> int:
    """How many input copies to cycle through so that what one call touches is evicted before its next use.

    Enough copies to cover 2.5x the L2 (clamped to ``[lo, hi]``; the tiniest cells stop at ``hi``).
    """
    need = -(-int(2.5 * l2_bytes) // max(1, set_bytes))
    return max(lo, min(hi, need))
