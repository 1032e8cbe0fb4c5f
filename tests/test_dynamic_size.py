"""Image sizes: timm ViTs built with ``dynamic_img_size=True`` (one size per batch, any multiple of the patch size;
``docs/models.md``), and the plan of each size.

Models: small timm ViTs (4 blocks of width 64, 16x16 patches, 64x64 by default, random weights), built from timm's
names with ``dynamic_img_size=True``: a class token whose position embedding timm resamples with the patches'
(``class``), and four registers without a class token, position embeddings on the patches only (``reg4_avg``).
Sizes: the default 64x64 (16 patches), 48x80 (15, not square) and 96x64 (24).

Tolerance rules:
* at keep rate 1.0 the pipeline reproduces timm's forward of the same model at every size: fp32 on the CPU,
  ``atol = rtol = 1e-5`` (as ``test_models.py``: the same modules on the same rows);
* pruned, one pipeline at two sizes equals, at each, the pipeline of a fixed-size twin (the same weights, built at
  that size, its position embeddings resampled once by timm's own function): the same decisions (keep masks, counts)
  and logits at ``atol = rtol = 1e-5`` (the same arithmetic; only the layout the patch embedding writes differs).
  So every pruner counts from the batch's own patch count (DynamicViT's ``int(N * rate ** (s + 1))``, ATS's default
  sample count), which the twin's own plan gives it;
* the Triton backend (under the interpreter) and the graph runner agree with the reference backend on the same
  decisions at both sizes (fp32, ``atol = rtol = 1e-4``: GEMMs on other row counts, as ``test_models.py``).

GPU twins (fp16 against timm, graphs and ``compile_blocks`` at several sizes) are at the end.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines.patch_embed import patch_embed_gemm, supports_gemm, with_gemm_patch_embed
from ragged_vit.pipelines.plan import Counts, build_plan
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import assert_fp16_within_twice, no_tf32

SMALL = dict(depth=4, embed_dim=64, num_heads=2, num_classes=10, img_size=64)
MODELS = {
    "class": ("vit_small_patch16_224", {}),
    "reg4_avg": ("vit_base_patch16_reg4_gap_256", {}),  # 4 registers, no class token, no_embed_class, avg pool
}
DEFAULT, WIDE, TALL = (64, 64), (48, 80), (96, 64)
PRUNERS = {
    "threshold_ratio": lambda: make_pruner("threshold_l2", mode="ratio", rate=0.5, block=1),
    "threshold_calibrated": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, min_keep=2, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 2)),
    "evit_fused": lambda: make_pruner("evit", rate=0.6, blocks=(1, 2), fuse_token=True),
    "ats": lambda: make_pruner("ats", blocks=(1, 2, 3), min_keep=2),  # num_samples=None: the batch's patch count
    "ats_rate": lambda: make_pruner("ats", blocks=(1, 2, 3), min_keep=2, sample_rate=0.5),  # ceil(0.5 N) samples
}
KEEP_ALL = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=1.0, blocks=(1, 2)),
    "evit": lambda: make_pruner("evit", rate=1.0, blocks=(1, 2)),
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}
# EViT and ATS need a class token (test_models.py checks the refusal of the others)
TWIN_CASES = [(n, p) for n in MODELS for p in PRUNERS if n == "class" or not PRUNERS[p]().needs_attention]


def dynamic_model(name: str, seed: int = 0, **kwargs: object) -> torch.nn.Module:
    model_name, extra = MODELS[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = timm.create_model(model_name, pretrained=False, **SMALL, **extra, dynamic_img_size=True, **kwargs)
        for block in model.blocks:  # peaked attention: the pruners keep different counts per image
            block.attn.qkv.weight.data.mul_(4.0)
    return model.eval()


def fixed_twin(name: str, model: torch.nn.Module, size: tuple[int, int]) -> torch.nn.Module:
    """``model``'s weights in a model built at ``size`` without ``dynamic_img_size``, its position embeddings
    resampled by timm's own function, with the arguments ``_pos_embed`` passes it."""
    model_name, extra = MODELS[name]
    twin = timm.create_model(model_name, pretrained=False, **{**SMALL, "img_size": size}, **extra).eval()
    state = dict(model.state_dict())
    grid = [s // p for s, p in zip(size, model.patch_embed.patch_size, strict=True)]
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    state["pos_embed"] = resample_abs_pos_embed(model.pos_embed, grid, model.patch_embed.grid_size, prefix)
    twin.load_state_dict(state)
    return twin


def images(count: int, size: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, *size, generator=g) * torch.linspace(0.2, 2.0, count)[:, None, None, None]


def patches(size: tuple[int, int]) -> int:
    return (size[0] // 16) * (size[1] // 16)


@pytest.mark.parametrize("name", list(MODELS))
def test_keep_all_reproduces_timm_at_every_size(name):
    """One pipeline per pruner, three sizes in turn (the default one last): timm's forward at each, every patch
    kept, and the plan of each size built once."""
    model = dynamic_model(name)
    pipelines = {"none": PrunedViT(model)}
    for case, make in KEEP_ALL.items():
        if make().needs_attention and model.cls_token is None:
            continue  # EViT needs a class token (test_models.py checks the refusal)
        pipelines[case] = PrunedViT(model, make(), "reference")
    for seed, size in enumerate([WIDE, TALL, DEFAULT]):
        x = images(3, size, seed)
        with torch.no_grad():
            ref = model(x)
        for case, pv in pipelines.items():
            out = pv.run(x)
            torch.testing.assert_close(out.logits, ref, **FP32, msg=lambda m, c=case, s=size: f"{c} at {s}: {m}")
            assert out.counts.eq(patches(size)).all(), (case, size)
            assert pv.plan_for(size).tokens == patches(size) + model.num_prefix_tokens
    for pv in pipelines.values():
        assert pv.plan is pv.plan_for(DEFAULT) and pv.num_patches == 16  # the default size's, as before


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name,pruner", TWIN_CASES)
def test_pruned_at_two_sizes_equals_fixed_size_twins(name, pruner):
    """One pipeline, two sizes alternating: at each, the decisions and logits of a fixed-size twin's pipeline, the
    counts its plan predicts (fixed counts) or bounds (ATS: at most the size's patches). Threshold-L2 is calibrated
    once, at the default size, and keeps that threshold at the other."""
    model = dynamic_model(name)
    pruner_module = PRUNERS[pruner]()
    pv = PrunedViT(model, pruner_module, "reference")
    if pruner == "threshold_calibrated":
        threshold = pv.calibrate(images(6, DEFAULT, 3))
    twins = {size: PrunedViT(fixed_twin(name, model, size), pruner_module, "reference") for size in (DEFAULT, TALL)}
    prefix = model.num_prefix_tokens
    for seed, size in enumerate([TALL, DEFAULT, TALL]):
        x = images(3, size, 10 + seed)
        out, twin = pv.run(x), twins[size].run(x)
        assert torch.equal(out.counts, twin.counts), (size, out.counts.tolist(), twin.counts.tolist())
        for a, b in zip(out.selections, twin.selections, strict=True):
            assert torch.equal(a.keep, b.keep)
        torch.testing.assert_close(out.logits, twin.logits, **FP32)
        plan = pv.plan_for(size)
        assert plan == twins[size].plan
        for stage in plan.stages:
            kept = out.counts[:, stage.index]
            if stage.counts is Counts.FIXED:
                assert kept.eq(stage.rows_after - prefix).all(), (size, stage)
            else:
                assert bool((kept <= stage.rows_after - prefix).all()) and bool((kept >= 1).all())
    if pruner == "dynamicvit":  # counted from each size's own patches: int(N * 0.7 ** (s + 1))
        assert [s.rows_after - prefix for s in pv.plan_for(DEFAULT).stages] == [11, 7]
        assert [s.rows_after - prefix for s in pv.plan_for(TALL).stages] == [16, 11]
    if pruner == "threshold_calibrated":
        assert pv.pruner.threshold == threshold


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize("pruner", ["dynamicvit", "ats"])
def test_triton_and_graph_runner_at_two_sizes_interpreter(pruner):
    """The Triton kernels (replaying the reference decisions) and one graph runner (fixed counts: ``PrunedViT.run``
    on its static buffers; ATS: its segments, buffers and padding images, run eagerly on a CPU) at two sizes, each
    with its own static buffers."""
    model = dynamic_model("class")
    pv = PrunedViT(model, PRUNERS[pruner](), "reference")
    refs = {size: pv.run(images(2, size, 20 + i)) for i, size in enumerate((WIDE, DEFAULT))}
    pv.backend = "triton"
    runner = GraphedPrunedViT(pv)
    for i, size in enumerate((WIDE, DEFAULT, WIDE)):
        x, ref = images(2, size, 20 + i % 2), refs[size]
        replayed = pv.run(x, selections=ref.selections)
        torch.testing.assert_close(replayed.logits, ref.logits, atol=1e-4, rtol=1e-4)
        graphed = runner.run(x)
        assert torch.equal(graphed.counts, ref.counts), size
        torch.testing.assert_close(graphed.logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert sorted(runner._buffers) == [(2, 48, 80), (2, 64, 64)]  # one set of static buffers per (B, H, W)


def test_plan_per_size_is_built_once_and_cached():
    model = dynamic_model("class")
    pruner = PRUNERS["ats"]()
    pv = PrunedViT(model, pruner)
    tall = pv.plan_for(TALL)
    assert pv.plan_for(torch.Size(TALL)) is tall and pv.plan_for(list(TALL)) is tall
    assert tall == build_plan(pruner, 4, 24 + 1, 1) and tall.steps == pv.plan.steps
    assert tall.row_bounds == (25, 25, 25, 25) and pv.plan.row_bounds == (17, 17, 17, 17)
    fixed = PrunedViT(fixed_twin("class", model, TALL), pruner)
    assert fixed.plan == tall and fixed.plan_for(TALL) is fixed.plan


@pytest.mark.parametrize(
    "shape", [(1, 3, 50, 64), (1, 3, 64, 72), (1, 3, 8, 64), (1, 3, 0, 64), (1, 1, 64, 64)], ids=str
)
def test_a_size_that_is_no_multiple_of_the_patch_is_a_one_line_error_before_any_launch(shape, monkeypatch):
    model = dynamic_model("class")
    pv = PrunedViT(model, PRUNERS["ats"](), "reference")
    runner = GraphedPrunedViT(pv)
    calibrated = PrunedViT(model, PRUNERS["threshold_calibrated"]())

    def launched(*args: object) -> None:
        raise AssertionError("the patch embedding ran on a bad size")

    monkeypatch.setattr(model.patch_embed, "forward", launched)
    allowed = r"images must have shape \[B, 3, H, W\] with H a positive multiple of 16 and W of 16 "
    for call in (pv.run, runner.run, calibrated.calibrate):
        with pytest.raises(ValueError, match=allowed + r"\(dynamic_img_size=True; 64x64 by default\)") as err:
            call(torch.zeros(shape))
        assert "\n" not in str(err.value) and str(list(shape)) in str(err.value)
    assert not runner._buffers
    if shape[1] != 3:
        return
    with pytest.raises(ValueError, match=r"image_size must be \(H, W\) of images of shape \[B, 3, H, W\] with H"):
        pv.plan_for(shape[2:])


def test_fixed_size_models_still_take_their_size_only():
    model = timm.create_model("vit_small_patch16_224", pretrained=False, **{**SMALL, "img_size": (48, 80)}).eval()
    pv = PrunedViT(model, PRUNERS["dynamicvit"]())
    assert not pv.dynamic_img_size and pv.image_size == (48, 80) and pv.num_patches == 15
    pv.run(images(1, WIDE, 0))
    with pytest.raises(ValueError, match=r"images must have shape \[B, 3, 48, 80\] for this model, got \[1, 3, 64, 64"):
        pv.run(images(1, DEFAULT, 0))
    with pytest.raises(ValueError, match=r"image_size must be \(H, W\) of images of shape \[B, 3, 48, 80\]"):
        pv.plan_for(DEFAULT)


def test_a_size_that_would_leave_no_row_is_refused_at_that_size():
    """No prefix rows: DynamicViT at rate 0.3 keeps int(16 * 0.09) = 1 patch at 64x64, int(4 * 0.09) = 0 at 32x32."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = timm.create_model(
            "vit_small_patch16_224", pretrained=False, **SMALL, class_token=False, global_pool="avg",
            dynamic_img_size=True,
        ).eval()  # fmt: skip
    pv = PrunedViT(model, make_pruner("dynamicvit", embed_dim=64, rate=0.3, blocks=(1, 2)))
    assert pv.run(images(2, DEFAULT, 0)).counts.tolist() == [[4, 1], [4, 1]]
    with pytest.raises(ValueError, match="would leave images without a single row on this model .* at 32x32"):
        pv.run(images(2, (32, 32), 0))


@pytest.mark.parametrize("size", [DEFAULT, WIDE, TALL])
def test_gemm_patch_embedding_writes_nhwc_for_dynamic_sizes(size):
    """timm's ``dynamic_img_size`` embedding outputs NHWC (``_pos_embed`` resamples, then flattens): the GEMM writes
    the same layout, at any multiple of the patch size (fp32, ``atol = rtol = 1e-5``: another summation order)."""
    model = dynamic_model("class")
    assert supports_gemm(model.patch_embed)
    x = images(2, size, 5)
    with torch.no_grad():
        got, want = patch_embed_gemm(model.patch_embed, x), model.patch_embed(x)
        assert got.shape == want.shape == (2, size[0] // 16, size[1] // 16, 64)
        torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(with_gemm_patch_embed(model)(x), model(x), atol=1e-4, rtol=1e-4)


# --- GPU twins ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_keep_all_fp16_against_timm_at_every_size_gpu(name):
    """fp16, the Triton kernel and the GEMM patch embedding (NHWC) at keep rate 1.0, three sizes through one
    pipeline: its error against timm in fp32 is at most 2x timm's own fp16 error (plus one fp16 ulp of the logits'
    scale), as ``test_models.py``."""
    model = dynamic_model(name).cuda()
    model16 = copy.deepcopy(model).half()
    pv = PrunedViT(model16, KEEP_ALL["threshold_l2"](), "triton")
    for seed, size in enumerate([DEFAULT, WIDE, TALL]):
        x = images(4, size, 30 + seed).cuda()
        with torch.no_grad(), no_tf32():
            ref = model(x).float()
            timm16 = model16(x.half()).float()
        out = pv.run(x.half())
        assert out.counts.eq(patches(size)).all()
        assert_fp16_within_twice(out.logits, timm16, ref, size)


@pytest.mark.gpu
@pytest.mark.parametrize("pruner", ["dynamicvit", "evit_fused", "threshold_calibrated", "ats"])
def test_graphs_capture_per_size_gpu(pruner):
    """One runner, two batch sizes and two image sizes interleaved: a graph (and static buffers) per ``(B, H, W)``,
    never replayed for another size; every replay equals the eager forward of its size (fixed counts: bit for bit;
    variable counts: the same counts, logits to fp16 rounding, as ``test_models.py``: padding rows in the buffers)."""
    model = dynamic_model("class").cuda().half()
    pv = PrunedViT(model, PRUNERS[pruner]().cuda().half(), "triton")
    if pruner == "threshold_calibrated":
        pv.calibrate(images(8, DEFAULT, 6).cuda().half())
    runner = GraphedPrunedViT(pv)
    calls = [(2, DEFAULT), (2, TALL), (4, TALL), (2, DEFAULT), (4, TALL), (2, TALL)]
    for i, (batch, size) in enumerate(calls):
        x = images(batch, size, 40 + i).cuda().half()
        graphed, eager = runner.run(x), pv.run(x)
        assert torch.equal(graphed.counts, eager.counts), (batch, size)
        if pv.plan.fixed:
            assert torch.equal(graphed.logits, eager.logits), (batch, size)
        else:
            torch.testing.assert_close(graphed.logits, eager.logits, atol=2e-3, rtol=2e-3)
    shapes = {key[:3] for key in runner.memory_report().keys}
    assert shapes == {(2, 64, 64), (2, 96, 64), (4, 96, 64)}
    assert runner.counters.captures >= 3 and runner.counters.replays >= len(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_compile_blocks_at_several_sizes_gpu(graphed):
    """``compile_blocks``: the compiled front (embedding, resampled position embeddings) and blocks recompile for
    new sizes (Dynamo may mark H and W dynamic); results stay those of the eager pipeline at each size, in fp32
    without TF32 (``atol = rtol = 1e-4``: Inductor's reductions round otherwise). Eager replays the decisions; the
    graph runner makes its own (DynamicViT's fused kernel on inputs equal to rounding: no near-tie expected)."""
    model = dynamic_model("class").cuda()
    pv = PrunedViT(model, PRUNERS["dynamicvit"]().cuda(), "triton")
    sizes = [DEFAULT, TALL, WIDE, DEFAULT, (32, 48), TALL]
    with no_tf32():
        refs = {size: pv.run(images(2, size, 50).cuda()) for size in set(sizes)}
        pv.compile_blocks = True
        runner = GraphedPrunedViT(pv)
        for size in sizes:
            x, ref = images(2, size, 50).cuda(), refs[size]
            out = runner.run(x) if graphed else pv.run(x, selections=ref.selections)
            assert torch.equal(out.counts, ref.counts), size
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
