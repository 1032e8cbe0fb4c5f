"""The pruned DeiT pipeline on a CUDA GPU: every model x pruner x backend x batch (1, 4, 64) x dtype (fp16, bf16).

Runs with plain ``python -m pytest tests/test_pipelines_gpu.py`` (no nox, nothing to install); skipped on CPU
machines by ``conftest.py``. Random weights (seeded) unless ``RAGGED_VIT_DEIT_B_CHECKPOINT`` names a local official
DeiT-B-224 checkpoint (timm keys, no predictors), which then replaces DeiT-B-224's weights and makes its top-1 checks
strict. Target runtime: well under 3 minutes on an H100. Without ``--full`` (the quick GPU level), each model and
pruner runs once with the backends, batches and dtypes in turn, and each conformance case once per backend.

Every low-precision run replays the pruning decisions of one fp32 reference run (reference backend, TF32 off) on
the same images, so backends differ only in layout, precision and attention. Tolerance rules:

* backend vs fp32 reference: ``err <= 2 * floor + eps(dtype) * max|logits|``, where ``floor`` is the error of
  the same pipeline in the same dtype with exact (fp32-math) attention, i.e. the reference backend run in that
  dtype: a backend may at most double the rounding error its dtype causes anyway (docs/measuring.md's kernel rule,
  applied end to end).
* top-1: identical to the fp32 reference for every image whose top-1/top-2 logit margin exceeds twice the
  measured error (random weights give near-ties that no precision decides); with a real checkpoint, every image.
* DeiT-B fp16, triton vs padded_sdpa: max |logit diff| <= 0.004 (the paper's claim), top-1 as above.
* isolation: another image's change moves an image's logits by at most ``4 * eps(dtype) * max|logits|`` (cuBLAS
  may pick other GEMM kernels when the packed length T changes; a leak across images moves them by ~1e-1).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from ragged_vit import PrunedViT
from ragged_vit.pipelines.backends import BACKENDS as REGISTRY
from ragged_vit.pipelines.backends import make_backend
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.pipelines.model import PrunedOutput
from ragged_vit.pipelines.weights import create_model, load_checkpoint
from ragged_vit.testing import attention_suite
from tests.helpers import PRUNER_CASES as CASES
from tests.helpers import no_tf32, one_per_family, rotated, sync_free

pytestmark = pytest.mark.gpu

MODELS = ["deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224", "deit_base_patch16_384"]
FIXED_COUNT = ["threshold_l2", "dynamicvit", "evit", "evit_fused"]
BACKENDS = [name for name in REGISTRY if name != "reference"]  # every registered backend but the ground truth
BATCHES = [1, 4, 64]
DTYPES = [torch.float16, torch.bfloat16]
KEEP_RATE = 0.5
CHECKPOINT = os.environ.get("RAGGED_VIT_DEIT_B_CHECKPOINT")


def _synthetic_images(count: int, size: int) -> torch.Tensor:
    """Seeded images with per-image structure (smooth blobs + texture of varying strength): ATS counts vary."""
    g = torch.Generator().manual_seed(1234)
    smooth = torch.nn.functional.interpolate(
        torch.randn(count, 3, 7, 7, generator=g), size=(size, size), mode="bicubic", align_corners=False
    )
    texture = torch.randn(count, 3, size, size, generator=g) * torch.linspace(0.0, 1.5, count)[:, None, None, None]
    return smooth + texture


class _Lab:
    """Builds models, pruners and fp32 reference runs once per module and shares them between test cases."""

    def __init__(self) -> None:
        self.models: dict = {}
        self.pruners: dict = {}
        self.images: dict = {}
        self.refs: dict = {}
        self.floors: dict = {}

    def model(self, name: str, dtype: torch.dtype) -> torch.nn.Module:
        key = (name, dtype)
        if key not in self.models:
            if dtype == torch.float32:
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    model = create_model(name)
                if CHECKPOINT and name == "deit_base_patch16_224":
                    load_checkpoint(model, None, CHECKPOINT)
                self.models[key] = model.cuda().eval()
            else:
                self.models[key] = copy.deepcopy(self.model(name, torch.float32)).to(dtype)
        return self.models[key]

    def pipeline(
        self, name: str, case: str, dtype: torch.dtype, backend: str = "reference", keep_rate: float = KEEP_RATE
    ) -> PrunedViT:
        key = (name, case, dtype, keep_rate)
        if key not in self.pruners:
            if dtype == torch.float32:
                pruner_name, options = CASES[case]
                with torch.random.fork_rng():
                    torch.manual_seed(1)
                    pruner = build_pruner(pruner_name, self.model(name, dtype), keep_rate, **options)
                self.pruners[key] = pruner.cuda() if pruner is not None else None
            else:
                self.pruners[key] = copy.deepcopy(
                    self.pipeline(name, case, torch.float32, keep_rate=keep_rate).pruner
                ).to(dtype)
        return PrunedViT(self.model(name, dtype), self.pruners[key], backend)

    def batch(self, name: str, batch: int) -> torch.Tensor:
        size = self.model(name, torch.float32).patch_embed.img_size[0]
        if size not in self.images:
            self.images[size] = _synthetic_images(max(BATCHES), size).cuda()
        return self.images[size][:batch]

    def reference(self, name: str, case: str, batch: int) -> PrunedOutput:
        key = (name, case, batch)
        if key not in self.refs:
            pv = self.pipeline(name, case, torch.float32)
            with no_tf32():
                self.refs[key] = pv.run(self.batch(name, batch))
        return self.refs[key]

    def floor(self, name: str, case: str, batch: int, dtype: torch.dtype) -> float:
        key = (name, case, batch, dtype)
        if key not in self.floors:
            ref = self.reference(name, case, batch)
            out = self.pipeline(name, case, dtype).run(self.batch(name, batch), selections=ref.selections)
            self.floors[key] = _max_diff(out.logits, ref.logits)
        return self.floors[key]


@pytest.fixture(scope="module")
def lab() -> _Lab:
    return _Lab()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _assert_top1(logits: torch.Tensor, ref: torch.Tensor, err: float, model: str) -> None:
    """Top-1 equal wherever the reference margin exceeds 2 * err (every image when ``model`` has real weights)."""
    top2 = ref.float().topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * err
    if CHECKPOINT and model == "deit_base_patch16_224":
        decided = torch.ones_like(decided)
    same = logits.argmax(-1) == ref.argmax(-1)
    assert bool(same[decided].all()), f"top-1 differs at images {(~same & decided).nonzero().flatten().tolist()}"


@pytest.mark.parametrize(
    "model,case,backend,batch,dtype",
    rotated([(m, c, b, n, d) for m in MODELS for c in CASES for b in BACKENDS for n in BATCHES for d in DTYPES],
            lambda m, c, *_: (m, c), lambda m, c, *variant: variant,
            ids=lambda m, c, b, n, d: f"{m}-{c}-{b}-{n}-{'fp16' if d == torch.float16 else 'bf16'}"),
)  # fmt: skip
def test_backend_matches_fp32_reference(lab, model, case, backend, batch, dtype):
    ref = lab.reference(model, case, batch)
    out = lab.pipeline(model, case, dtype, backend).run(lab.batch(model, batch), selections=ref.selections)
    assert out.logits.dtype == dtype and out.logits.shape == ref.logits.shape
    assert bool(torch.isfinite(out.logits).all())
    assert torch.equal(out.counts, ref.counts)
    err = _max_diff(out.logits, ref.logits)
    floor = lab.floor(model, case, batch, dtype)
    bound = 2 * floor + torch.finfo(dtype).eps * ref.logits.abs().max().item()
    assert err <= bound, f"{backend} {dtype}: max |logit diff| {err:.3e} > {bound:.3e} (floor {floor:.3e})"
    _assert_top1(out.logits, ref.logits, err, model)


@pytest.mark.parametrize(
    "case,batch",
    rotated([(c, n) for c in CASES for n in BATCHES], lambda c, n: c, lambda c, n: (n,), ids=lambda c, n: f"{c}-{n}"),
)
def test_deit_b_fp16_triton_vs_padded_sdpa(lab, case, batch):
    model = "deit_base_patch16_224"
    ref = lab.reference(model, case, batch)
    images = lab.batch(model, batch)
    padded = lab.pipeline(model, case, torch.float16, "padded_sdpa").run(images, selections=ref.selections)
    ours = lab.pipeline(model, case, torch.float16, "triton").run(images, selections=ref.selections)
    diff = _max_diff(ours.logits, padded.logits)
    assert diff <= 0.004, f"max |logit diff| {diff:.4f} > 0.004"
    _assert_top1(ours.logits, padded.logits, max(diff, 1e-6), model)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_keep_rate_one_reproduces_timm(lab, backend):
    """0% pruning: the packed pipeline equals timm's own forward up to the dtype's own noise."""
    model_name = "deit_small_patch16_224"
    images = lab.batch(model_name, 4)
    with no_tf32(), torch.no_grad():
        expected = lab.model(model_name, torch.float32)(images)
    for dtype in DTYPES:
        with torch.no_grad():
            timm_low = lab.model(model_name, dtype)(images.to(dtype))
        floor = _max_diff(timm_low, expected)
        for case in FIXED_COUNT:
            out = lab.pipeline(model_name, case, dtype, backend, keep_rate=1.0).run(images)
            assert bool((out.counts == 196).all())
            err = _max_diff(out.logits, expected)
            bound = 2 * floor + torch.finfo(dtype).eps * expected.abs().max().item()
            assert err <= bound, f"{case} {dtype}: {err:.3e} > {bound:.3e} (timm's own {dtype} error {floor:.3e})"
    with no_tf32():
        out = lab.pipeline(model_name, "evit", torch.float32, "reference", keep_rate=1.0).run(images)
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["padded_sdpa", "triton"])
def test_golden_counts_on_cuda(lab, backend):
    golden = {"threshold_l2": [138], "dynamicvit": [137, 96, 67], "evit": [138, 97, 68], "evit_fused": [139, 99, 71]}
    images = lab.batch("deit_small_patch16_224", 4)
    for case, counts in golden.items():
        out = lab.pipeline("deit_small_patch16_224", case, torch.float16, backend, keep_rate=0.7).run(images)
        assert out.counts.tolist() == [counts] * 4, case


@pytest.mark.parametrize("backend", ["fa2_varlen", "triton"])
@pytest.mark.parametrize("case", FIXED_COUNT)
def test_fixed_count_forward_never_syncs(lab, case, backend):
    """Fixed-count pruners: packing takes the count from the host, so the whole forward (pruners included) runs
    without a device-to-host synchronisation."""
    pv = lab.pipeline("deit_small_patch16_224", case, torch.float16, backend)
    images = lab.batch("deit_small_patch16_224", 4)
    pv.run(images)  # warm-up: compile kernels, create handles
    with sync_free():
        out = pv.run(images)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out.logits).all())


@pytest.mark.parametrize(
    "case,backend,dtype",
    [(c, b, torch.float16) for c in ("dynamicvit", "evit_fused") for b in BACKENDS]
    # ATS changes T with the changed image; in fp16 a GEMM kernel switch could flip a near-tie sampling decision of
    # another image, so ATS runs in fp32 (TF32 off), on the backends that take fp32.
    + [("ats", b, torch.float32) for b in ("padded_sdpa", "triton")],
)
def test_isolation_on_cuda(lab, case, backend, dtype):
    model = "deit_small_patch16_224"
    pv = lab.pipeline(model, case, dtype, backend)
    images = lab.batch(model, 4)
    changed = images.clone()
    changed[3] = 0.0  # a flat image: ATS keeps a different number of its patches, so T changes
    with no_tf32():
        a, b = pv.run(images), pv.run(changed)
    assert torch.equal(a.counts[:3], b.counts[:3])
    scale = a.logits[:3].abs().max().item()
    assert _max_diff(a.logits[:3], b.logits[:3]) <= 4 * torch.finfo(dtype).eps * scale
    assert _max_diff(a.logits[3], b.logits[3]) > 0


# Each backend alone through the conformance lab's full cases (its 2x rule; docs/porting.md), fp16 and bf16 (the quick
# GPU level: each case once, the dtypes in turn). A backend trusts its caller; NestedTensor construction needs every
# image non-empty (the pipelines never make one).
for _name in BACKENDS:
    globals()[f"test_{_name}_backend_conforms"] = one_per_family(
        attention_suite(make_backend(_name).attend, device="cuda", level_name="full", dtypes=DTYPES, head_dims=(64,),
                        empty_images=_name != "nested_sdpa"),
        lambda case: (case.kind, case.lengths), lambda case: (case.dtype,),
    )  # fmt: skip


def test_cli_on_cuda(tmp_path, capsys):
    image_lib = pytest.importorskip("PIL.Image")
    from ragged_vit.pipelines.apps.cli import main

    pixels = (_synthetic_images(2, 256).clamp(-2, 2) * 60 + 128).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, p in enumerate(pixels):
        image_lib.fromarray(p).save(tmp_path / f"img{i}.png")
    argv = [
        "--device",
        "cuda",
        "--model",
        "deit_small_patch16_224",
        "--images",
        str(tmp_path),
        "--backends",
        "padded_sdpa,fa2_varlen,nested_sdpa,triton,reference",
        "--batch-repeats",
        "4",
        "--timed-runs",
        "2",
        "--warmup",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "device: cuda" in out and "float16" in out
    for name in ("fa2_varlen", "nested_sdpa", "triton", "reference"):
        assert name in out.split("Backend agreement", 1)[1]
