"""The pruned DeiT pipeline end to end on the CPU (deit_tiny, random weights, fp32, 2-3 images).

Tolerance rules (fp32 throughout):
* keep rate 1.0 vs timm's own forward, and backend vs backend with shared selections: the same math in a
  different summation order, so ``atol = rtol = 1e-5`` on logits of magnitude ~1 (observed: ~6e-7).
* counts and keep decisions: exact.
* isolation: the other images' logits are compared bitwise where the packed shapes stay the same (fixed-count
  pruners: every row's arithmetic is independent of the other images); with ATS the changed image changes the
  packed length T and matmul/SDPA blocking may change, so ``atol = 1e-6`` there (observed on one CPU thread:
  bitwise for reference and triton, 3.6e-7 for padded_sdpa).

Triton runs under its interpreter (tests marked ``interpreter``; skipped on CUDA machines, whose GPU twins are in
``test_pipelines_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import ResPostBlock, VisionTransformer

from ragged_vit import GraphedPrunedViT, PrunedViT, build_pipeline
from ragged_vit.core.selection import TokenSelection
from ragged_vit.pipelines.factory import build_pruner, pruner_options
from ragged_vit.pipelines.plan import MLP_OVERLAP_MAX_ROWS, StepKind
from ragged_vit.reference.pruners import make_pruner
from ragged_vit.testing.ops import count_ops
from tests.helpers import PRUNER_CASES as CASES
from tests.helpers import levels, tiny_images, tiny_pipeline

MODEL = "deit_tiny_patch16_224"
KEEP_ALL = ["threshold_l2", "dynamicvit", "evit", "evit_fused"]  # ATS samples adaptively even at 1.0
GOLDEN = {  # patches per image after each stage at keep rate 0.7 on 224x224 (196 patches); docs/pruners.md
    "threshold_l2": [138],
    "dynamicvit": [137, 96, 67],
    "evit": [138, 97, 68],
    "evit_fused": [139, 99, 71],
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}



def pipeline(case: str, keep_rate: float, backend: str = "reference", seed: int = 0) -> PrunedViT:
    """deit_tiny with seeded random weights and the pruner of ``case``; the global RNG is left untouched."""
    name, options = CASES[case]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_pipeline(MODEL, name, keep_rate, backend, **options)


def images(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 3, 224, 224, generator=gen)


def timm_forward(pv: PrunedViT, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return pv.model(x)


# --- 0% pruning reproduces timm ------------------------------------------------------------------------------


def test_no_pruner_is_timm_forward_bitwise(gen):
    pv = PrunedViT(pipeline("threshold_l2", 1.0).model, None, "reference")
    x = images(2, gen)
    out = pv.run(x)
    assert torch.equal(out.logits, timm_forward(pv, x))
    assert out.counts.shape == (2, 0) and out.selections == []


@pytest.mark.parametrize("backend", ["reference", "padded_sdpa"])
@pytest.mark.parametrize("case", KEEP_ALL)
def test_keep_rate_one_reproduces_timm(case, backend, gen):
    pv = pipeline(case, 1.0, backend)
    x = images(2, gen)
    out = pv.run(x)
    assert (out.counts == 196).all()
    torch.testing.assert_close(out.logits, timm_forward(pv, x), **FP32)


@pytest.mark.interpreter
def test_keep_rate_one_reproduces_timm_triton():
    """The tiny ViT (16 patches: the interpreter's cost grows with the rows): packed from block 1 on, 5 blocks
    through the kernel, EViT's mid-block hook."""
    pv = tiny_pipeline(lambda: make_pruner("evit", rate=1.0, blocks=(1, 3)), "triton")
    x = tiny_images(2, 3)
    out = pv.run(x)
    assert (out.counts == 16).all()
    torch.testing.assert_close(out.logits, timm_forward(pv, x), **FP32)


def test_generic_timm_vit_with_qk_norm_and_layer_scale(gen):
    """A non-DeiT timm VisionTransformer (qk_norm, LayerScale, other sizes) runs packed exactly like timm."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=2, qk_norm=True, init_values=0.1, num_classes=10
        )
    pv = PrunedViT(model, make_pruner("threshold_l2", mode="ratio", rate=1.0, block=0), "padded_sdpa")
    x = torch.randn(3, 3, 32, 32, generator=gen)
    torch.testing.assert_close(pv(x), timm_forward(pv, x), **FP32)


# --- backends agree on shared decisions; golden counts ----------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize(  # quick: ATS's variable counts (tests/test_models.py: every pruner on the tiny families)
    "case", levels([(c,) for c in CASES], lambda c: c == "ats", ids=str)
)
def test_triton_matches_reference_with_shared_selections(case, gen):
    pv = pipeline(case, 0.5)
    x = images(2, gen)
    ref = pv.run(x)
    pv.backend = "triton"
    got = pv.run(x, selections=ref.selections)
    assert torch.equal(got.counts, ref.counts)
    assert all(a is b for a, b in zip(got.selections, ref.selections, strict=True))
    torch.testing.assert_close(got.logits, ref.logits, **FP32)


@pytest.mark.parametrize("case", list(CASES))
def test_padded_sdpa_matches_reference_and_makes_the_same_decisions(case, gen):
    pv = pipeline(case, 0.5)
    x = images(3, gen)
    ref = pv.run(x)
    pv.backend = "padded_sdpa"
    replayed = pv.run(x, selections=ref.selections)
    torch.testing.assert_close(replayed.logits, ref.logits, **FP32)
    own = pv.run(x)  # its own decisions: fp32 scores differ by rounding only, no near-ties expected
    for a, b in zip(own.selections, ref.selections, strict=True):
        assert torch.equal(a.keep, b.keep)
    torch.testing.assert_close(own.logits, ref.logits, **FP32)


def test_compile_blocks_gives_the_same_logits(gen):
    """``compile_blocks`` (Inductor around the GEMMs, the attention backend opaque) changes no result beyond
    fp32 rounding; decisions are replayed so a near-tie cannot flip. One case: a compile costs ~20 s on CPU."""
    pv = pipeline("evit_fused", 0.5, "padded_sdpa")
    x = images(2, gen)
    ref = pv.run(x)
    pv.compile_blocks = True
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = pv.run(x, selections=ref.selections)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames_before  # the compiled path ran
    assert torch.equal(got.counts, ref.counts)
    torch.testing.assert_close(got.logits, ref.logits, **FP32)


@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_counts(case, gen):
    pv = pipeline(case, 0.7)
    logits, counts = pv(images(2, gen), return_counts=True)
    assert logits.shape == (2, 1000)
    assert counts.tolist() == [GOLDEN[case]] * 2


def test_ats_counts_vary_per_image(gen):
    pv = pipeline("ats", 0.7)
    ramp = torch.linspace(-2, 2, 224).expand(3, 224, 224)
    x = torch.stack([torch.randn(3, 224, 224, generator=gen), torch.zeros(3, 224, 224), ramp, ramp.mT])
    counts = pv.run(x).counts  # [4, 9]: one stage per block 3..11
    assert counts.shape == (4, 9)
    assert len(set(counts[:, -1].tolist())) > 1, counts
    assert (counts[:, 1:] <= counts[:, :-1]).all()  # each stage samples from the previous survivors
    assert ((counts >= 8) & (counts <= 138)).all()  # min_keep floor; ceil(0.7 * 196) samples at most


def test_counts_are_per_image_in_input_order(gen):
    """Variable counts come back in input order: permuting the batch permutes counts and logits."""
    pv = pipeline("ats", 0.7)
    x = images(3, gen)
    x[1] = 0.0
    out = pv.run(x)
    perm = torch.tensor([2, 0, 1])
    permuted = pv.run(x[perm])
    assert torch.equal(permuted.counts, out.counts[perm])
    torch.testing.assert_close(permuted.logits, out.logits[perm], **FP32)


# --- isolation: image j never changes image i ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,backend",
    [
        ("threshold_l2", "reference"),
        ("evit_fused", "reference"),
        ("ats", "reference"),
        ("ats", "padded_sdpa"),
        # the Triton kernels' own isolation cases run at the quick level (the conformance lab's)
        pytest.param("ats", "triton", marks=(pytest.mark.interpreter, pytest.mark.full)),
    ],
)
def test_isolation_end_to_end(case, backend, gen):
    pv = pipeline(case, 0.5, backend)
    x = images(3, gen)
    changed = x.clone()
    changed[2] = 0.0  # a flat image: ATS keeps a different number of its patches, so T changes
    a, b = pv.run(x), pv.run(changed)
    assert torch.equal(a.counts[:2], b.counts[:2])
    if case == "ats":
        assert not torch.equal(a.counts[2], b.counts[2])
        torch.testing.assert_close(a.logits[:2], b.logits[:2], atol=1e-6, rtol=0)
    else:
        assert torch.equal(a.logits[:2], b.logits[:2])
    assert not torch.allclose(a.logits[2], b.logits[2])


# --- bad input ---------------------------------------------------------------------------------------------------


def test_wrong_image_size_is_a_named_error(gen):
    pv = pipeline("threshold_l2", 0.5)
    with pytest.raises(ValueError, match=r"images must have shape \[B, 3, 224, 224\]"):
        pv(torch.randn(1, 3, 384, 384))
    with pytest.raises(ValueError, match="images must have shape"):
        pv(torch.randn(1, 1, 224, 224))
    with pytest.raises(ValueError, match="images must have 4 dimensions"):
        pv(torch.randn(3, 224, 224))
    with pytest.raises(TypeError, match="images must be a floating-point"):
        pv(torch.zeros(1, 3, 224, 224, dtype=torch.uint8))
    with pytest.raises(TypeError, match="images must be a torch.Tensor"):
        pv([[0.0]])


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"model_name": "deit_nano_patch16_224"}, ValueError, "model 'deit_nano_patch16_224' is not a timm model"),
        ({"pruner": "tome_v2"}, ValueError, "pruner must be one of"),
        ({"backend": "flash9"}, ValueError, "backend must be one of"),
        ({"keep_rate": 0.0}, ValueError, r"keep_rate must be in \(0, 1\]"),
        ({"keep_rate": 1.5}, ValueError, r"keep_rate must be in \(0, 1\]"),
        ({"keep_rate": -0.2}, ValueError, r"keep_rate must be in \(0, 1\]"),
        ({"keep_rate": "half"}, TypeError, "keep_rate must be a float"),
    ],
)
def test_bad_names_and_rates_are_named_errors(kwargs, error, match):
    args = {"model_name": MODEL, "pruner": "evit", "keep_rate": 0.7, "backend": "reference", **kwargs}
    with pytest.raises(error, match=match):
        build_pipeline(**args)


@pytest.mark.parametrize("backend", ["fa2_varlen", "nested_sdpa"])
def test_cuda_only_backends_refuse_the_cpu(backend, gen):
    pv = pipeline("threshold_l2", 0.5, backend)
    with pytest.raises(ValueError, match=f"backend '{backend}' needs a CUDA device"):
        pv(images(1, gen))


def test_selections_must_fit_the_run(gen):
    pv = pipeline("dynamicvit", 0.7)
    ref = pv.run(images(2, gen))
    with pytest.raises(ValueError, match="selections must hold one decision per stage"):
        pv.run(images(2, gen), selections=ref.selections[:2])
    with pytest.raises(ValueError, match=r"selections\[0\].keep must be a \[591\] mask"):
        pv.run(images(3, gen), selections=ref.selections)
    with pytest.raises(TypeError, match=r"selections\[1\] must be a TokenSelection"):
        pv.run(images(2, gen), selections=[ref.selections[0], "x", ref.selections[2]])
    assert isinstance(ref.selections[0], TokenSelection)


def test_unsupported_models_and_modes():
    with torch.random.fork_rng():
        tiny = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
        no_class = VisionTransformer(**tiny, class_token=False, global_pool="avg")
        with pytest.raises(ValueError, match="pruner 'evit' scores patches by the class token's attention row"):
            PrunedViT(no_class, make_pruner("evit", blocks=(1,)))
        with pytest.raises(ValueError, match="would leave images without a single row"):
            PrunedViT(no_class, make_pruner("dynamicvit", embed_dim=64, rate=0.01, blocks=(1,)))
        with pytest.raises(NotImplementedError, match=r"model.blocks\[1\] must be a timm vision_transformer.Block"):
            PrunedViT(VisionTransformer(**tiny, block_fn=ResPostBlock), make_pruner("evit", blocks=(1,)))
        model = VisionTransformer(**tiny)
    with pytest.raises(ValueError, match=r"pruner.blocks must be strictly increasing block indices in \[0, 2\)"):
        PrunedViT(model, make_pruner("evit"))
    with pytest.raises(TypeError, match="pruner must be a ragged_vit.core.selection.Pruner"):
        PrunedViT(model, "evit")
    with pytest.raises(TypeError, match="model must be a timm VisionTransformer"):
        PrunedViT(torch.nn.Linear(2, 2))
    pv = PrunedViT(model)
    pv.train()
    with pytest.raises(RuntimeError, match="inference only"):
        pv(torch.randn(1, 3, 32, 32))


def test_calibrated_threshold_keeps_about_the_rate(gen):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pv = build_pipeline(MODEL, "threshold_l2", 0.5, threshold_mode="calibrated")
    x = images(4, gen)
    threshold = pv.calibrate(x)
    assert threshold == pv.pruner.threshold
    counts = pv.run(x).counts
    assert abs(counts.float().mean().item() - 98) <= 2  # the (1 - rate) quantile over these very images
    assert build_pruner("none", pv.model, 0.5) is None


def test_pruner_options_come_from_each_pruner():
    """Each pruner maps the keep rate and its own options (``from_keep_rate``); another pruner's option is an error
    naming it, never silently ignored."""
    assert pruner_options("threshold_l2") == ("threshold_mode", "threshold")
    assert pruner_options("evit") == ("fuse_token",)
    assert pruner_options("ats") == pruner_options("dynamicvit") == pruner_options("none") == ()
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=12, num_heads=2)
    assert build_pruner("evit", model, 0.7, fuse_token=True).fuse_token
    ats = build_pruner("ats", model, 0.5)
    assert ats.sample_rate == 0.5 and ats.samples(16) == 8 and ats.samples(36) == 18  # ceil(0.5 * N) at every size
    with pytest.raises(ValueError, match=r"pruner 'threshold_l2' takes no option 'fuse_token' \(its options: "):
        build_pruner("threshold_l2", model, 0.5, fuse_token=True)
    with pytest.raises(ValueError, match="pruner 'none' takes no option 'threshold'"):
        build_pruner("none", model, 0.5, threshold=1.0)


@pytest.mark.parametrize("case", ["dynamicvit", "evit", "evit_fused", "ats"])
def test_compiled_decisions_trace_and_agree(case):
    """``compile_blocks`` on CUDA runs the pruners without a fused kernel through ``torch.compile`` (with their
    CLS-attention scores). Traced here on the CPU's Inductor: the same decisions as eager on seeded fp32 input."""
    from ragged_vit.pipelines.parts import _compiled_decision, _decision

    name, options = CASES[case]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pruner = make_pruner(name, **options, **({"embed_dim": 64} if name == "dynamicvit" else {}))
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 197, 394], dtype=torch.int32)
    x, qkv = torch.randn(394, 64, generator=g), torch.randn(394, 3 * 64, generator=g) * 3
    args = (x, cu, 0, 196, qkv, 2, 32**-0.5, 1)  # stage 0, 196 patches, 2 heads of 32 channels, one prefix row
    ref, got = _decision(pruner, *args), _compiled_decision()(pruner, *args)
    assert torch.equal(got.keep, ref.keep)
    assert (got.fixed_count, got.count) == (ref.fixed_count, ref.count)
    if ref.extra_token is not None:
        torch.testing.assert_close(got.extra_token, ref.extra_token, atol=1e-5, rtol=1e-5)


def test_forward_computes_counts_only_when_asked(gen):
    """``pv(images)`` skips the per-stage counts (host dispatches of their own in an eager forward); with
    ``return_counts`` they are ``run``'s: contiguous int64 ``[B, S]``."""
    pv = pipeline("ats", 0.7)
    x = images(2, gen)
    with torch.no_grad():
        pv(x)  # the first call builds what later calls reuse, whichever test ran before in this process
        plain, counted = count_ops(pv, x), count_ops(pv, x, return_counts=True)
    assert counted >= plain + 5, (plain, counted)  # stack, slices, subtractions, cast
    logits, counts = pv(x, return_counts=True)
    ref = pv.run(x)
    assert counts.dtype == torch.long and counts.is_contiguous() and torch.equal(counts, ref.counts)
    assert torch.equal(logits, ref.logits) and torch.equal(pv(x), ref.logits)


@pytest.mark.parametrize("fuse_token", [False, True], ids=["evit", "evit_fused"])
def test_a_mid_block_decision_runs_beside_its_mlp_half_in_small_buffers(fuse_token):
    """In CUDA graphs, a fixed-count forward's program decides each mid-block stage beside its block's MLP half (on
    every row, before the repack; the MLP step after the repack is gone) in buffers of at most ``overlap_rows`` rows;
    the logits are those of the MLP after the repack (the eager program; bit for bit on the CPU, where the graph
    runner runs its program uncaptured). Never with a fused token (it must go through the MLP), nor in a larger
    buffer, nor eagerly (nothing would run beside anything)."""
    pv = tiny_pipeline(lambda: make_pruner("evit", rate=0.6, blocks=(1, 3), fuse_token=fuse_token))
    images = tiny_images(3, 8)

    def beside(program) -> list[int]:
        return [step.stage for step in program.steps if step.kind is StepKind.DECIDE and step.beside]

    def mlps(program) -> list[int]:
        return [step.blocks[0] for step in program.steps if step.kind is StepKind.MLP]

    graphs = pv.program(pv.plan, 3, graphs=True, overlap_rows=MLP_OVERLAP_MAX_ROWS)
    assert beside(graphs) == ([] if fuse_token else [0, 1])
    assert mlps(graphs) == ([1, 3] if fuse_token else [])
    assert beside(pv.program(pv.plan, 3, overlap_rows=MLP_OVERLAP_MAX_ROWS)) == []
    first = pv.program(pv.plan, 3, graphs=True, overlap_rows=3 * 17 - 1)  # the first stage's 51 rows: after
    assert beside(first) == ([] if fuse_token else [1]) and mlps(first) == ([1, 3] if fuse_token else [1])
    serial = pv.run(images)
    out = GraphedPrunedViT(pv).run(images)
    assert torch.equal(out.logits, serial.logits) and torch.equal(out.counts, serial.counts)
