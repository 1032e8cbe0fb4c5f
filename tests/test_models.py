"""The timm ViT family on the packed runtime: prefix tokens, poolings and block variants, built small from timm's
own model names (``docs/models.md`` lists them).

Each family, with random weights, 4 blocks of width 64, 16 patches:
* unpruned and at keep rate 1.0 the pipeline reproduces timm's forward: fp32 on the CPU, ``atol = rtol = 1e-5``
  (the same modules on the same rows; only the attention's summation order differs);
* pruned by every pruner that applies (EViT and ATS score by the class token's attention: a model without one
  refuses them at construction, with the reason): prefix rows always kept, finite logits, the counts the plan
  predicts for fixed-count pruners; the Triton backend (under the interpreter) and the graph runner agree with the
  reference backend on the same decisions (fp32, ``atol = rtol = 1e-4``: GEMMs on other row counts).

GPU twins (fp16, the kernel against timm) are at the end.
"""

from __future__ import annotations

import pytest
import timm
import torch

from ci.model_families import FAMILIES, family, images
from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines.plan import Counts
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import assert_fp16_within_twice, levels, no_tf32

PRUNERS = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 2)),
    "evit_fused": lambda: make_pruner("evit", rate=0.6, blocks=(1, 2), fuse_token=True),
    "ats": lambda: make_pruner("ats", blocks=(1, 2, 3), num_samples=10, min_keep=2),
}
KEEP_ALL = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=1.0, blocks=(1, 2)),
    "evit": lambda: make_pruner("evit", rate=1.0, blocks=(1, 2)),
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}
# Quick: every family with one pruner that applies, every pruner on two or more families, one refusal (no class
# token); full: every pair.
QUICK_PAIRS = {
    ("deit", "threshold_l2"), ("deit_distilled", "ats"), ("deit3_layerscale", "evit_fused"),
    ("reg4_avg_no_class", "dynamicvit"), ("dinov2_reg4", "evit_fused"), ("siglip_map", "threshold_l2"),
    ("clip_norm_pre", "ats"), ("qk_norm", "dynamicvit"), ("class_avg", "evit_fused"), ("avgmax", "dynamicvit"),
    ("avgmax", "ats"),
}  # fmt: skip


def has_class_token(model: torch.nn.Module) -> bool:
    return model.cls_token is not None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_unpruned_and_keep_all_reproduce_timm(name):
    model = family(name)
    x = images(model, 3, 1)
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(PrunedViT(model).run(x).logits, ref, **FP32)
    for pruner, make in KEEP_ALL.items():
        if pruner == "evit" and not has_class_token(model):
            continue
        out = PrunedViT(model, make(), "reference").run(x)
        torch.testing.assert_close(out.logits, ref, **FP32, msg=lambda m, p=pruner: f"{p}: {m}")
        assert out.counts.eq(model.patch_embed.num_patches).all(), pruner


def check_pruned_and_replayed(model, make, x: torch.Tensor, calibration: torch.Tensor):
    """``make()`` on ``model``: refused in one line without a class token where its rule needs one (then None);
    else pruned on the reference backend (prefix rows kept, the plan's fixed counts), and the Triton backend replays
    its decisions to its logits (fp32, ``atol = rtol = 1e-4``: GEMMs on other row counts). Returns ``(pv, ref)``."""
    if make().needs_attention and not has_class_token(model):
        with pytest.raises(ValueError, match="scores patches by the class token's attention row"):
            PrunedViT(model, make())
        return None
    pv = PrunedViT(model, make(), "reference")
    if pv.pruner.name == "threshold_l2":
        pv.calibrate(calibration)
    ref = pv.run(x)
    assert bool(ref.logits.isfinite().all())
    prefix = model.num_prefix_tokens
    for sel, stage in zip(ref.selections, pv.plan.stages, strict=True):
        assert bool((sel.kept >= prefix + int(prefix == 0)).all()), "prefix rows kept, at least one row"
        if stage.counts is Counts.FIXED:
            assert ref.counts[:, stage.index].eq(stage.rows_after - prefix).all()
    pv.backend = "triton"
    torch.testing.assert_close(pv.run(x, selections=ref.selections).logits, ref.logits, atol=1e-4, rtol=1e-4)
    return pv, ref


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize(
    "name,pruner",
    levels([(n, p) for n in FAMILIES for p in PRUNERS], lambda *pair: pair in QUICK_PAIRS, ids=lambda n, p: f"{n}-{p}"),
)
def test_pruned_forward_on_every_family_interpreter(name, pruner):
    model = family(name)
    x = images(model, 3, 2)
    checked = check_pruned_and_replayed(model, PRUNERS[pruner], x, images(model, 6, 3))
    if checked is None:
        return
    pv, ref = checked
    graphed = GraphedPrunedViT(pv).run(x)
    assert torch.equal(graphed.counts, pv.run(x).counts)
    torch.testing.assert_close(graphed.logits, ref.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_keep_all_fp16_against_timm_gpu(name):
    """On the GPU, fp16, the Triton kernel and the GEMM patch embedding at keep rate 1.0: the pipeline's error
    against timm in fp32 is at most 2x timm's own fp16 error (plus one fp16 ulp of the logits' scale)."""
    model = family(name).cuda()
    x = images(model, 4, 4).cuda()
    with torch.no_grad(), no_tf32():
        ref = model(x).float()
        timm16 = model.half()(x.half()).float()
    pv = PrunedViT(model, KEEP_ALL["threshold_l2"](), "triton")
    assert_fp16_within_twice(pv.run(x.half()).logits, timm16, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pruner", ["threshold_l2", "dynamicvit"])
@pytest.mark.parametrize("name", ["deit_distilled", "reg4_avg_no_class", "siglip_map", "avgmax"])
def test_graphs_capture_every_head_gpu(name, pruner):
    """The heads (distilled, average, attention pooling) run inside the captured graphs: the replayed forward equals
    the eager one bit for bit with the same (fixed) counts, and to fp16 rounding where counts vary (the graph's
    buffers hold padding rows)."""
    model = family(name).cuda().half()
    pv = PrunedViT(model, PRUNERS[pruner]().cuda().half(), "triton")
    x = images(model, 4, 5).cuda().half()
    if pruner == "threshold_l2":
        pv.calibrate(images(model, 8, 6).cuda().half())
    runner = GraphedPrunedViT(pv)
    for _ in range(2):  # capture, then replay
        graphed = runner.run(x)
    eager = pv.run(x)
    assert torch.equal(graphed.counts, eager.counts) and runner.counters.captures >= 1
    if pv.plan.fixed:
        assert torch.equal(graphed.logits, eager.logits)
    else:
        torch.testing.assert_close(graphed.logits, eager.logits, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["vit_large_patch16_224", "vit_huge_patch14_224"])  # head dims 64 and 80
def test_large_models_run_pruned_with_the_triton_kernel_gpu(model_name):
    """ViT-L/16 and ViT-H/14 (head dim 80: padded inside the kernel), random weights, fp16, pruned by Threshold-L2
    (ratio 0.5): Triton agrees with FA2 on the same decisions (within twice FA2's error against the fp32 reference
    backend, plus an fp16 ulp of the logits' scale), and the graphed forward equals the eager one bit for bit."""
    with torch.device("cuda"), torch.random.fork_rng():
        torch.manual_seed(0)
        model = timm.create_model(model_name, pretrained=False).half().eval()
    pv = PrunedViT(model, make_pruner("threshold_l2", mode="ratio", rate=0.5, block=3).cuda(), "triton")
    x = images(model, 2, 7).cuda().half()
    ours = pv.run(x)
    pv.backend = "fa2_varlen"
    fa2 = pv.run(x, selections=ours.selections).logits.float()
    pv.backend = "reference"
    ref = pv.run(x, selections=ours.selections).logits.float()
    assert_fp16_within_twice(ours.logits, fa2, ref)
    pv.backend = "triton"
    graphed = GraphedPrunedViT(pv)
    graphed.run(x)
    assert torch.equal(graphed.run(x).logits, pv.run(x).logits)
