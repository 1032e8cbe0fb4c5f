"""The end-to-end benchmark's lab: models, pruners, pipelines, fp32 reference runs and the checks against them.

Shared by ``report_e2e`` (the paper's Tables III-VI, Figure 1 and Section V-D on this card), its pytest-benchmark
twin ``test_bench_e2e`` and ``ci/forward_profile.py``. Everything device-specific goes through ``device``, so the
same code runs (slowly, fp32, reference backend only) on a CPU, which is how the CPU tests exercise it.

Before it is timed, every pipeline replays the decisions of one fp32 reference run (reference backend, TF32 off)
and is checked against its logits: ``max |diff| <= 2 * floor + 16 eps(dtype) max |ref|``, where ``floor`` is the
error of the reference backend in the benchmark's dtype (a looser form of tests/test_pipelines_gpu.py's rule:
here it only keeps broken pipelines out of the tables). Weights are random (seeded) unless
``RAGGED_VIT_DEIT_B_CHECKPOINT`` names a local DeiT-B-224 checkpoint: speed does not depend on the weights, top-1
agreement does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from benchmarks.workloads import WORKLOADS, synthetic_images, synthetic_selection
from ragged_vit.core.selection import TokenSelection
from ragged_vit.pipelines.backends import AttentionBackend
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.pipelines.model import PrunedViT
from ragged_vit.pipelines.weights import create_model, load_checkpoint

Call = Callable[[], object]

DEIT_B = "deit_base_patch16_224"
DEIT_B_384 = "deit_base_patch16_384"
DEIT_S = "deit_small_patch16_224"
DEIT_T = "deit_tiny_patch16_224"
CHECKPOINT_ENV = "RAGGED_VIT_DEIT_B_CHECKPOINT"
INPUT_SETS = 3  # input batches the timed loops rotate through


class no_tf32(contextlib.ContextDecorator):
    """fp32 on the GPU must mean fp32: cuDNN convolutions (the patch embedding) and matmuls default to TF32."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *_: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


@dataclass
class Reference:
    """The input batches of one (model, workload, keep rate, batch), the fp32 reference run on the first one (its
    decisions, logits and counts) and the floor."""

    images: list[torch.Tensor]  # INPUT_SETS batches, benchmark dtype, on the device
    selections: list[list[TokenSelection]]  # one TokenSelection per stage, of images[0] (of each batch if drawn)
    logits: torch.Tensor  # fp32 [B, classes] of images[0]
    floor: float  # max |logit diff| of the reference backend in the benchmark dtype against `logits`
    counts: dict[str, object] = field(default_factory=dict)  # kept patches per stage (images[0])


def count_summary(counts: torch.Tensor, num_patches: int) -> dict[str, object]:
    """Per-stage mean / min / max kept patches (CLS excluded) of ``counts [B, S]`` and the mean keep fraction."""
    c = counts.detach().float().cpu()
    if c.numel() == 0:
        return {"stages": 0, "mean": [], "min": [], "max": [], "keep_fraction_last": 1.0}
    return {
        "stages": c.shape[1],
        "mean": [round(float(x), 2) for x in c.mean(0)],
        "min": [int(x) for x in c.min(0).values],
        "max": [int(x) for x in c.max(0).values],
        "keep_fraction_last": round(float(c[:, -1].mean()) / num_patches, 4),
    }


class Lab:
    """Builds and caches models (one fp32 master per name, seeded, and its low-precision copy), pruners,
    pipelines and reference runs on one device."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self._models: dict[tuple[str, torch.dtype], nn.Module] = {}
        self._pruners: dict[tuple, nn.Module | None] = {}
        self._refs: dict[tuple, Reference] = {}

    def model(self, name: str, dtype: torch.dtype | None = None) -> nn.Module:
        dtype = dtype or self.dtype
        key = (name, dtype)
        if key not in self._models:
            if dtype == torch.float32:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed)
                    model = create_model(name)
                if os.environ.get(CHECKPOINT_ENV) and name == DEIT_B:
                    load_checkpoint(model, None, os.environ[CHECKPOINT_ENV])
                self._models[key] = model.to(self.device).eval()
            else:
                self._models[key] = copy.deepcopy(self.model(name, torch.float32)).to(dtype).eval()
        return self._models[key]

    def num_patches(self, name: str) -> int:
        return self.model(name, torch.float32).patch_embed.num_patches

    def image_size(self, name: str) -> int:
        return int(self.model(name, torch.float32).patch_embed.img_size[0])

    def pruner(self, name: str, workload: str, keep_rate: float, dtype: torch.dtype | None = None) -> nn.Module:
        dtype = dtype or self.dtype
        key = (name, workload, keep_rate, dtype)
        if key not in self._pruners:
            if dtype == torch.float32:
                spec = WORKLOADS[workload]
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed + 1)
                    pruner = build_pruner(spec.pruner, self.model(name, torch.float32), keep_rate, **dict(spec.options))
                pruner = pruner.to(self.device)
                if dict(spec.options).get("threshold_mode") == "calibrated":
                    calib = synthetic_images(32, self.image_size(name), self.seed + 99).to(self.device)
                    with no_tf32():
                        PrunedViT(self.model(name, torch.float32), pruner, "reference").calibrate(calib)
                self._pruners[key] = pruner
            else:
                self._pruners[key] = copy.deepcopy(self.pruner(name, workload, keep_rate, torch.float32)).to(dtype)
        return self._pruners[key]

    def pipeline(self, name: str, workload: str, keep_rate: float, backend: str | AttentionBackend) -> PrunedViT:
        """A pruned pipeline in the benchmark dtype (a light wrapper: models and pruners are shared), eager: the rows
        that time CUDA graphs wrap it in their runner themselves."""
        return PrunedViT(self.model(name), self.pruner(name, workload, keep_rate), backend, mode="eager")

    def images(self, name: str, batch: int) -> list[torch.Tensor]:
        size = self.image_size(name)
        return [
            synthetic_images(batch, size, self.seed + 1000 * i + batch).to(self.device, self.dtype)
            for i in range(INPUT_SETS)
        ]

    def reference(self, name: str, workload: str, keep_rate: float, batch: int) -> Reference:
        """The fp32 reference run (cached for the last key only: references of large batches are large)."""
        key = (name, workload, keep_rate, batch)
        if key in self._refs:
            return self._refs[key]
        self._refs.clear()
        images = self.images(name, batch)
        num_patches = self.num_patches(name)
        if workload == "none":
            with no_tf32(), torch.no_grad():
                logits = self.model(name, torch.float32)(images[0].float()).float()
            ref = Reference(images, [], logits, 0.0, count_summary(torch.zeros(batch, 0), num_patches))
        else:
            spec = WORKLOADS[workload]
            fp32 = PrunedViT(self.model(name, torch.float32), self.pruner(name, workload, keep_rate, torch.float32))
            if spec.replayed:  # one drawn selection per input batch
                selections = [
                    [synthetic_selection(batch, num_patches, keep_rate, self.device, self.seed + 7919 * i + batch)]
                    for i in range(len(images))
                ]
            with no_tf32():
                out = fp32.run(images[0].float(), selections=selections[0] if spec.replayed else None)
            logits, counts = out.logits.float(), out.counts
            if not spec.replayed:  # the pipeline's own decisions on images[0] (the others decide in their forward)
                selections = [out.selections]
            low = self.pipeline(name, workload, keep_rate, "reference").run(images[0], selections=selections[0])
            floor = (low.logits.float() - logits).abs().max().item()
            ref = Reference(images, selections, logits, floor, count_summary(counts, num_patches))
        self._refs[key] = ref
        return ref

    def clear(self) -> None:
        """Drops references and models (between parts, to free device memory)."""
        self._refs.clear()
        self._pruners.clear()
        self._models.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def forward_calls(pv: PrunedViT, ref: Reference, replayed: bool) -> list[Call]:
    """One zero-argument forward per input batch: the drawn masks replayed (``pv.run``), or the pipeline's own
    decisions as a user calls it (``pv(images)``: logits only, so no selections to record and no host read where a
    bound suffices, :meth:`PrunedViT.forward`)."""
    if replayed:
        return [functools.partial(pv.run, img, sels) for img, sels in zip(ref.images, ref.selections, strict=True)]
    return [functools.partial(pv, img) for img in ref.images]


# --------------------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """A pipeline's logits against the fp32 reference on the same decisions."""

    ok: bool
    max_abs_diff: float | None
    bound: float | None
    top1_agree: float | None
    reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def error_bound(ref: torch.Tensor, floor: float, dtype: torch.dtype) -> float:
    """``2 * floor + 16 * eps(dtype) * max |ref|``: about twice the dtype's own rounding error.

    A sanity check that keeps broken pipelines out of the tables (a wrong mask or scale moves logits by O(1));
    the strict equivalence rules are tests/test_pipelines_gpu.py's. The eps term keeps fp32 (floor ~ 0) usable.
    """
    return 2 * floor + 16 * torch.finfo(dtype).eps * ref.abs().max().item()


def logit_diff(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max / mean |logit diff| and top-1 agreement; for every disagreement, the reference's own margin between
    its top-1 and top-2 logits (random weights give near-ties that any rounding flips: a margin below the
    logit noise is a tie, not an error)."""
    out, ref = out.float(), ref.float()
    d = (out - ref).abs()
    agree = out.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(min(2, ref.shape[-1]), dim=-1).values
    margins = (top2[:, 0] - top2[:, -1])[~agree]
    return {
        "max": d.max().item(),
        "mean": d.mean().item(),
        "top1_agree": agree.float().mean().item(),
        "disagree_ref_margins": [round(m, 6) for m in margins.tolist()],
    }


def check_logits(out: torch.Tensor, ref: torch.Tensor, bound: float, against: str = "the fp32 reference") -> Check:
    """Compares logits with ``ref`` (``against`` names it in the reason); NaN or a shape mismatch fails."""
    if out.shape != ref.shape:
        return Check(False, None, bound, None, f"logits have shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    diff = logit_diff(out, ref)
    err, top1 = diff["max"], diff["top1_agree"]
    if not err <= bound:  # NaN fails too
        return Check(False, err, bound, top1, f"max |logit diff| {err:.3g} > bound {bound:.3g} vs {against}")
    return Check(True, err, bound, top1)


def logits_of(out: object) -> torch.Tensor:
    """Logits of a forward's result (a ``PrunedOutput`` or anything else with ``.logits``, or logits)."""
    return getattr(out, "logits", out)
