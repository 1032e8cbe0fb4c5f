"""What the benchmarks run on: the kernel benchmark's packed batches and the end-to-end benchmark's workloads.

**Kernel** (the paper's Tables I and II, DeiT-B geometry): a :class:`Workload` is a batch of ``B`` images of 196
patches + CLS from which ``pruned_pct`` percent of the patches were dropped. With ``variable=True`` (the default,
and the case the paper never measured) each image keeps its own count, drawn uniformly within +-15% of
``196 * (1 - pruned)`` and clipped to ``[1, 196]``; with ``variable=False`` every image keeps
``round(196 * (1 - pruned))`` patches (the paper's 197 / 99 / 40 tokens). ``pruned_pct = 0`` keeps every token in
both modes. Counts are seeded per (B, pruned, mode), so every run and every peer sees the same batch. Inputs are
packed like the pipeline's: one ``qkv [T, 3*H*D]`` buffer of the kept tokens, random normal (never zeros), plus
int32 ``cu_seqlens [B+1]``; several independent copies are drawn so that the timed loops can rotate among them
and the inputs do not stay resident in L2.

**End to end** (Tables III-VI, Figure 1): :data:`WORKLOADS`, the pruning that produces the per-image counts, each
described in its ``description`` and of kind ``fixed`` (every image keeps the same count) or ``ragged``.
Threshold-L2 calibrated sets its threshold on a seeded calibration batch; ATS's ``ceil(k * 196)`` CDF samples
are an upper bound (fewer patches survive where the scores are peaked); ``synthetic`` draws its keep masks
(:func:`synthetic_selection`) and replays them with ``PrunedViT.run(images, selections)``, so the timed forward
has no scoring cost. Images (:func:`synthetic_images`) are seeded smooth blobs plus texture of per-image strength,
so that ATS and the calibrated threshold keep different counts per image; never zeros.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

from ragged_vit.core.selection import TokenSelection

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


# --------------------------------------------------------------------------------------------------- end to end

SYNTHETIC_SPREAD = 0.2  # half-width of the per-image keep-rate distribution of the synthetic workload


@dataclass(frozen=True)
class WorkloadSpec:
    """How one workload prunes (see the module docstring)."""

    name: str
    pruner: str
    kind: str  # "fixed" | "ragged"
    options: tuple[tuple[str, object], ...]
    description: str
    replayed: bool = False  # the masks are drawn and replayed, not computed by the pruner


WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec(
            "l2_ratio",
            "threshold_l2",
            "fixed",
            (("threshold_mode", "ratio"),),
            "Threshold-L2 ratio, after block 3: top ceil(k*196) patches, equal counts (the paper's setting)",
        ),
        WorkloadSpec(
            "l2_calibrated",
            "threshold_l2",
            "ragged",
            (("threshold_mode", "calibrated"),),
            "Threshold-L2 calibrated, after block 3: norm threshold keeping k on average; per-image counts vary",
        ),
        WorkloadSpec(
            "dynamicvit",
            "dynamicvit",
            "fixed",
            (),
            "DynamicViT before blocks 3/6/9: int(196*k^s) patches, equal counts (random predictor weights)",
        ),
        WorkloadSpec(
            "evit", "evit", "fixed", (), "EViT in blocks 3/6/9: ceil(k*current) patches, equal counts, no fused token"
        ),
        WorkloadSpec(
            "evit_fused",
            "evit",
            "fixed",
            (("fuse_token", True),),
            "EViT in blocks 3/6/9 with the fused token: ceil(k*current) patches plus one fused token, equal counts",
        ),
        WorkloadSpec(
            "ats",
            "ats",
            "ragged",
            (),
            "ATS in blocks 3-11: ceil(k*196) CDF samples (upper bound), per-image counts vary, 9 stages",
        ),
        WorkloadSpec(
            "synthetic",
            "threshold_l2",
            "ragged",
            (("threshold_mode", "ratio"),),
            f"drawn masks after block 3: per-image keep rate U(k-{SYNTHETIC_SPREAD}, k+{SYNTHETIC_SPREAD}), replayed",
            replayed=True,
        ),
    )
}


def workload_kind(workload: str, keep_rate: float) -> str:
    """``dense`` for the unpruned rows, ``fixed`` when nothing is pruned (every image keeps all), else the spec's."""
    if workload == "none":
        return "dense"
    return "fixed" if keep_rate >= 1.0 else WORKLOADS[workload].kind


def workload_keeps(text: str, default_keep: float = 0.5) -> list[tuple[str, float]]:
    """``WORKLOAD[:KEEP],...`` -> ``[(workload, keep rate)]`` of the workloads whose pruner decides (not the replayed
    one), each keep rate in (0, 1] (``default_keep`` where none is given); ``ValueError`` naming the bad item."""
    pairs = []
    for item in text.split(","):
        name, _, keep = item.partition(":")
        rate = float(keep) if keep else default_keep  # ValueError for a KEEP that is no number
        if name not in WORKLOADS or WORKLOADS[name].replayed or not 0 < rate <= 1:
            deciding = ", ".join(w for w, spec in WORKLOADS.items() if not spec.replayed)
            raise ValueError(f"{item!r}: WORKLOAD must be a deciding workload ({deciding}), KEEP in (0, 1]")
        pairs.append((name, rate))
    return pairs


def synthetic_images(count: int, size: int, seed: int) -> torch.Tensor:
    """``[count, 3, size, size]`` fp32 CPU images: smooth blobs + texture whose strength grows over the batch."""
    g = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(
        torch.randn(count, 3, 7, 7, generator=g), size=(size, size), mode="bicubic", align_corners=False
    )
    strength = torch.linspace(0.0, 1.5, count) if count > 1 else torch.tensor([0.75])
    return smooth + torch.randn(count, 3, size, size, generator=g) * strength[:, None, None, None]


def synthetic_selection(
    batch: int, num_patches: int, keep_rate: float, device: torch.device, seed: int, spread: float = SYNTHETIC_SPREAD
) -> TokenSelection:
    """A one-stage :class:`TokenSelection` over an unpruned packed batch ``[B * (num_patches + 1)]``: image ``b``
    keeps its CLS row and ``round(num_patches * r_b)`` random patches, ``r_b ~ U(k - spread, k + spread)``
    (clipped to [1, num_patches] patches; every image keeps all at ``k = 1``)."""
    g = torch.Generator().manual_seed(seed)
    n = num_patches + 1
    if keep_rate >= 1.0:
        counts = torch.full((batch,), num_patches, dtype=torch.long)
    else:
        rates = keep_rate + spread * (2 * torch.rand(batch, generator=g, dtype=torch.float64) - 1)
        counts = (rates * num_patches).round().long().clamp(1, num_patches)
    order = torch.rand(batch, num_patches, generator=g).argsort(dim=1)  # a random permutation per image
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(num_patches).expand(batch, -1))
    keep = torch.ones(batch, n, dtype=torch.bool)
    keep[:, 1:] = rank < counts[:, None]
    # Like a variable-count pruner (Threshold-L2 calibrated), the selection says "variable" even where the draws
    # happen to be equal (B = 1): the pipeline then reads the total back, as it would for such a pruner.
    fixed = keep_rate >= 1.0
    keep = keep.reshape(-1).to(device)
    return TokenSelection(keep, counts.add(1).to(device, torch.int32), fixed_count=fixed, count=n if fixed else None)
