"""The end-to-end benchmark's lab: models, pruners, pipelines, fp32 reference runs, checks and result files.

Shared by ``report_e2e`` (the paper's Tables III-VI, Figure 1 and Section V-D on this card), the pytest-benchmark
suite ``test_bench_e2e`` and ``ci/forward_profile.py``. Everything device-specific goes through ``device``, so the
same code runs (slowly, fp32, reference backend only) on a CPU, which is how the CPU tests exercise it.

The timed forward of a pruner workload (``benchmarks.workloads.WORKLOADS``) is ``PrunedViT.run(images)``: the
pipeline makes its own decisions, as a user's forward does. Before timing, every pipeline replays the decisions of
one fp32 reference run (reference backend, TF32 off) and is checked against its logits: ``max |diff| <= 2 * floor
+ 16 eps(dtype) max |ref|``, where ``floor`` is the error of the reference backend in the benchmark's dtype (a
looser form of tests/test_pipelines_gpu.py's rule: here it only keeps broken pipelines out of the tables).

Weights are random (seeded) unless ``RAGGED_VIT_DEIT_B_CHECKPOINT`` names a local DeiT-B-224 checkpoint: speed
does not depend on the weights, top-1 agreement does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from benchmarks.timing import REPO_ROOT, Spread, environment
from benchmarks.workloads import WORKLOADS, synthetic_images, synthetic_selection
from ragged_vit.core.selection import TokenSelection
from ragged_vit.pipelines.backends import AttentionBackend, PaddedSDPABackend, make_backend
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.pipelines.model import PrunedOutput, PrunedViT
from ragged_vit.pipelines.weights import create_model, load_checkpoint

Call = Callable[[], object]

DEIT_B = "deit_base_patch16_224"
DEIT_B_384 = "deit_base_patch16_384"
DEIT_S = "deit_small_patch16_224"
DEIT_T = "deit_tiny_patch16_224"
CHECKPOINT_ENV = "RAGGED_VIT_DEIT_B_CHECKPOINT"
BASELINES = REPO_ROOT / "benchmarks" / "baselines"
INPUT_SETS = 3  # input batches the timed loops rotate through


# The rows (labels: benchmarks.tables.ROW_LABELS), by how report_e2e builds them.
UNPRUNED_ROWS = ("timm_eager", "timm_compiled", "timm_compiled_gemm")
EAGER_ROWS = ("padded", "padded_full", "fa2_varlen", "nested_sdpa", "triton")
GRAPHED_ROWS = ("triton_graphed", "fa2_varlen_graphed", "padded_graphed", "triton_graphed_compiled")
PUBLIC_ROWS = ("public_compiled",)  # benchmarks.public_peer
COMPILED_ROWS = ("timm_compiled", "timm_compiled_gemm", "triton_graphed_compiled", "public_compiled")  # slow to build
ALL_ROWS = (*UNPRUNED_ROWS, *EAGER_ROWS, *GRAPHED_ROWS, *PUBLIC_ROWS)


def backend_for(row: str, num_tokens: int) -> AttentionBackend:
    """The attention backend of an eager (or graphed) pruned row; ``num_tokens`` is the unpruned N (CLS included)."""
    base = row.removesuffix("_compiled").removesuffix("_graphed")
    if base == "padded":
        return PaddedSDPABackend()
    if base == "padded_full":
        return PaddedSDPABackend(pad_to=num_tokens)
    return make_backend(base)


# --------------------------------------------------------------------------------------------------- devices


class no_tf32(contextlib.ContextDecorator):
    """fp32 on the GPU must mean fp32: cuDNN convolutions (the patch embedding) and matmuls default to TF32."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *_: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


def run_environment() -> dict[str, object]:
    """:func:`benchmarks.timing.environment` plus timm and the weights in use."""
    import timm

    checkpoint = os.environ.get(CHECKPOINT_ENV)
    weights = f"checkpoint {checkpoint} (DeiT-B-224 only)" if checkpoint else "random (seeded)"
    return {**environment(), "timm": timm.__version__, "weights": weights}


# --------------------------------------------------------------------------------------------------- pipelines


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
        """A pruned pipeline in the benchmark dtype (a light wrapper: models and pruners are shared)."""
        return PrunedViT(self.model(name), self.pruner(name, workload, keep_rate), backend)

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
    """One zero-argument forward per input batch: the pipeline's own decisions, or the drawn masks replayed."""
    if replayed:
        return [functools.partial(pv.run, img, sels) for img, sels in zip(ref.images, ref.selections, strict=True)]
    return [functools.partial(pv.run, img) for img in ref.images]


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
        return {
            "ok": self.ok,
            "max_abs_diff": self.max_abs_diff,
            "bound": self.bound,
            "top1_agree": self.top1_agree,
            "reason": self.reason,
        }


def error_bound(ref: torch.Tensor, floor: float, dtype: torch.dtype) -> float:
    """``2 * floor + 16 * eps(dtype) * max |ref|``: about twice the dtype's own rounding error.

    A sanity check that keeps broken pipelines out of the tables (a wrong mask or scale moves logits by O(1));
    the strict equivalence rules are tests/test_pipelines_gpu.py's. The eps term keeps fp32 (floor ~ 0) usable.
    """
    return 2 * floor + 16 * torch.finfo(dtype).eps * ref.abs().max().item()


def check_logits(out: torch.Tensor, ref: torch.Tensor, bound: float) -> Check:
    """Compares logits; NaN or a shape mismatch fails."""
    if out.shape != ref.shape:
        return Check(False, None, bound, None, f"logits have shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    err = (out.float() - ref.float()).abs().max().item()
    top1 = (out.float().argmax(-1) == ref.float().argmax(-1)).float().mean().item()
    if not err <= bound:  # NaN fails too
        return Check(False, err, bound, top1, f"max |logit diff| {err:.3g} > bound {bound:.3g} vs the fp32 reference")
    return Check(True, err, bound, top1)


def logits_of(out: object) -> torch.Tensor:
    """Logits of a forward's result (a :class:`PrunedOutput`, anything with ``.logits``, or logits)."""
    return out.logits if isinstance(out, PrunedOutput) else getattr(out, "logits", out)


# --------------------------------------------------------------------------------------------------- graphs


class Unavailable(RuntimeError):
    """A row that cannot run on this checkout or torch (reported with the reason, not timed)."""


# --------------------------------------------------------------------------------------------------- files


def json_default(obj: object) -> object:
    if isinstance(obj, Spread):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def write_json(path: Path, payload: dict) -> None:
    """Writes ``payload`` atomically (a partial file never replaces a complete one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=json_default) + "\n")
    tmp.replace(path)


def progress(total: int, desc: str) -> tqdm:
    """A tqdm bar on stderr."""
    return tqdm(total=total, desc=desc, unit="row", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """One CPU thread for torch while timing (the host side must not compete with itself)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
