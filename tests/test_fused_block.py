"""The fused-linear form of the packed blocks (``ragged_vit.pipelines.packed_block.fused_blocks``): four fused linears
and the attention a block, the LayerNorm statistics of the residual stream handed from one linear to the next.

CPU, under Triton's interpreter: a small DeiT-like ViT (4 blocks of 64 channels, LayerScale, random weights) with
each kind of stage (Threshold-L2 before a block, DynamicViT, EViT and ToMe inside blocks), the form forced through the
program's ``fused_block_rows``: the logits equal the unfused Triton forward's (fp32, 1e-4) with the same counts; the
statistics are computed from the rows at the first fused step and after every repack, never carried across one (a
mutant that carries them is caught); the program shows the form and leaves the decision's and the merge's fusions
alone; the blocks without the form are refused. One compiled case (the custom ops in an Inductor graph). GPU: fp16
against the unfused forward and the reference backend, eager and graphed.
"""

from __future__ import annotations

import functools

import pytest
import torch
from timm.layers import SwiGLUPacked
from timm.models.vision_transformer import Block, VisionTransformer

from ragged_vit import PrunedViT
from ragged_vit.pipelines import packed_block
from ragged_vit.pipelines.packed_block import fused_refusal
from ragged_vit.pipelines.plan import StepKind
from ragged_vit.pipelines.state import ForwardState
from ragged_vit.reference.pruners import make_pruner
from ragged_vit.triton_impl import configs
from ragged_vit.triton_impl.linear import fused_linear, fused_linear_op

DEPTH, DIM, BATCH = 4, 64, 3
TOKENS = 17  # 16 patches of 8x8 on 32x32 images, and the class token
PRUNERS = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=DIM, rate=0.7, blocks=(1, 2)),
    "evit": lambda: make_pruner("evit", rate=0.6, blocks=(1, 2), fuse_token=True),
    "tome": lambda: make_pruner("tome", r=3, depth=DEPTH),
}
FP32 = {"atol": 1e-4, "rtol": 1e-4}
PACKED = (StepKind.BLOCKS, StepKind.ATTENTION, StepKind.MLP)


def model(**kwargs: object) -> VisionTransformer:
    """The small DeiT-like ViT, seeded; its qkv weights scaled up so that attention is peaked (the pruners keep
    different counts per image)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=DIM, depth=DEPTH, num_heads=2, num_classes=10,
                                init_values=0.5, **kwargs)  # fmt: skip
    with torch.no_grad():
        for block in vit.blocks:
            block.attn.qkv.weight.mul_(4.0)
    return vit.eval()


def images(device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    contrast = torch.linspace(0.2, 3.0, BATCH)[:, None, None, None]
    return (torch.randn(BATCH, 3, 32, 32, generator=g) * contrast).to(device)


def pipeline(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "triton") -> PrunedViT:
    pv = PrunedViT(model(), PRUNERS[name](), backend, mode="eager").to(device, dtype)
    if name == "threshold_l2":
        pv.calibrate(images(device).to(dtype))
    return pv


def forced(pv: PrunedViT) -> PrunedViT:
    """``pv`` with the fused-linear form forced: its programs built with a row limit every forward is under."""
    pv.fused_block_rows = 1 << 30
    return pv


def linear_steps(pv: PrunedViT, batch: int = BATCH, triton: bool = False) -> list:
    return [s for s in pv.program(pv.plan, batch, triton=triton).steps if s.linear]


@pytest.fixture
def stats_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every fused linear with a LayerNorm the blocks run: ``(rows, whether it was given their statistics)``,
    checking that given statistics cover exactly its rows."""
    calls, real = [], packed_block.fused_linear_unchecked

    def spy(x, weight, bias=None, **kwargs):
        stats = kwargs.get("ln_stats")
        if kwargs.get("ln_weight") is not None:
            calls.append((x.shape[0], stats is not None))
            assert stats is None or stats.shape[1] == x.shape[0]
        return real(x, weight, bias, **kwargs)

    monkeypatch.setattr(packed_block, "fused_linear_unchecked", spy)
    return calls


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(PRUNERS))
def test_fused_form_equals_the_unfused_triton_forward(name, stats_calls):
    """Logits within 1e-4 (fp32) and equal counts; the forward ran fused linears where the program said, and computed
    the rows' statistics only where no fused linear had left them: at the first fused step and after every repack."""
    pv = pipeline(name)
    x = images()
    unfused = pv.run(x)
    assert not linear_steps(pv) and not stats_calls
    fused = forced(pv).run(x)
    torch.testing.assert_close(fused.logits, unfused.logits, **FP32)
    assert torch.equal(fused.counts, unfused.counts)
    steps = pv.program(pv.plan, BATCH, triton=False).steps
    assert [s.kind for s in steps if s.linear] == [s.kind for s in steps if s.kind in PACKED]
    repacks = sum(s.kind is StepKind.REPACK for s in steps)
    computed = [rows for rows, given in stats_calls if not given]
    assert len(computed) == repacks + (steps[1].kind in PACKED)  # each repack, and a fused step right after FRONT
    norms = sum(2 * len(s.blocks) if s.kind is StepKind.BLOCKS else 1 for s in steps if s.linear)  # norm1, norm2
    assert len(stats_calls) == norms


def test_statistics_carried_across_a_repack_are_caught(monkeypatch, device):
    """A mutant that keeps the residual stream's statistics across a repack (EViT: proj's, for norm2 after the
    decision) changes the logits beyond the tolerance of the test above: the rows moved."""
    pv = forced(pipeline("evit", device))
    x = images(device)
    good = pv.run(x)
    monkeypatch.setattr(ForwardState, "x_stats", lambda self: None if self.stats is None else self.stats[1])
    stale = pv.run(x, selections=good.selections)
    assert not torch.allclose(stale.logits, good.logits, **FP32)


def test_the_plan_shows_the_form_by_its_rule(monkeypatch):
    """The rule: the forward's rows ``B x N`` at most ``fused_block_rows`` (by default the tuned
    ``FUSED_BLOCK_MAX_ROWS``); every packed step then runs fused but those another fusion holds (a ToMe merge's
    ``branch`` with Triton repacks), and no fused MLP prepares the next qkv (its statistics do)."""
    for limit in (BATCH * TOKENS - 1, BATCH * TOKENS):
        monkeypatch.setattr(configs, "FUSED_BLOCK_MAX_ROWS", limit)
        assert bool(linear_steps(pipeline("evit"))) == (limit == BATCH * TOKENS)
    pv = pipeline("evit")
    program = pv.program(pv.plan, BATCH, triton=False, fused_block_rows=BATCH * TOKENS)
    assert "linear" in repr(program.steps) and all(s.linear for s in program.steps if s.kind in PACKED)
    assert not any(s.prepare for s in program.steps)
    assert not any(s.linear for s in pv.program(pv.plan, BATCH, fused_block_rows=BATCH * TOKENS - 1).steps)
    tome = pipeline("tome")
    steps = tome.program(tome.plan, BATCH, triton=True, fused_block_rows=BATCH * TOKENS).steps
    forms = {(s.kind, s.linear) for s in steps if s.kind in PACKED}
    assert forms == {(StepKind.ATTENTION, False), (StepKind.MLP, True)}
    assert all(s.branch for s in steps if s.kind is StepKind.ATTENTION)


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"qk_norm": True}, "not a plain timm Block"),
        ({"mlp_layer": SwiGLUPacked, "act_layer": torch.nn.SiLU}, "not a plain timm Block"),
        ({"norm_layer": functools.partial(torch.nn.LayerNorm, elementwise_affine=False)}, "has no weight"),
        ({"mlp_ratio": 1.1}, "multiples of 16"),
    ],
    ids=["qk_norm", "swiglu", "no_affine", "odd_width"],
)
def test_blocks_without_the_form_are_refused(kwargs, why):
    """Blocks the fused linears cannot run keep the unfused form: the pipeline says why and its programs have no
    fused step, whatever the rows."""
    block = Block(DIM, 2, qkv_bias=True, **kwargs)
    assert why in fused_refusal(block)
    pv = PrunedViT(model(**kwargs), PRUNERS["evit"](), "triton", mode="eager")
    assert why in pv.fused_block_refusal() and not linear_steps(forced(pv))


def test_hooks_and_other_backends_are_refused():
    pv = pipeline("evit", backend="reference")
    assert "backend 'reference'" in pv.fused_block_refusal() and not linear_steps(forced(pv))
    block = Block(DIM, 2)
    assert fused_refusal(block) is None
    block.mlp.fc1.register_forward_hook(lambda *args: None)
    assert "hooks" in fused_refusal(block)


def test_the_custom_op_is_the_fused_linear(device):
    """``torch.ops.ragged_vit.fused_linear``: the direct call's output and statistics, and fake shapes for compiles."""
    g = torch.Generator().manual_seed(0)
    x, w, residual = torch.randn(5, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(5, 48, generator=g)
    ln_w, bias, gamma = torch.rand(32, generator=g), torch.randn(48, generator=g), torch.rand(48, generator=g)
    x, w, residual, ln_w, bias, gamma = (t.to(device) for t in (x, w, residual, ln_w, bias, gamma))
    y, stats = fused_linear_op(x, w, bias, ln_w, None, 1e-6, "gelu", residual, gamma, None, True)
    direct_stats = torch.empty_like(stats)
    direct = fused_linear(x, w, bias, ln_weight=ln_w, eps=1e-6, activation="gelu", residual=residual, gamma=gamma,
                          stats_out=direct_stats)  # fmt: skip
    assert torch.equal(y, direct) and torch.equal(stats, direct_stats)
    assert fused_linear_op(x, w, None, None, None, 1e-5, None, None, None, None, False)[1].shape == (0, 5, 2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fy, fs = fused_linear_op(mode.from_tensor(x), mode.from_tensor(w), None, None, None, 1e-5, None, None, None,
                                 None, True)  # fmt: skip
    assert fy.shape == y.shape and fs.shape == stats.shape and fs.dtype == torch.float32


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::UserWarning")  # Inductor's notes on the CPU
def test_compiled_fused_blocks_hold_the_custom_ops():
    """``compile_blocks`` with the fused form: Dynamo traces the fused linears and the attention as custom ops without
    a graph break, and the logits equal the plain fused forward's. One case (Threshold-L2: one BLOCKS step)."""
    pv = forced(pipeline("threshold_l2"))
    x = images()
    plain = pv.run(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    pv.compile_blocks = True
    compiled = pv.run(x, selections=plain.selections)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled path ran
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(compiled.logits, plain.logits, **FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PRUNERS))
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_fused_form_fp16_against_unfused_and_reference(name, compiled):
    """fp16 on CUDA, the decisions of the unfused forward replayed: the fused form (eager, and graphed with or without
    compiled blocks) against the unfused Triton forward and the reference backend."""
    x = images("cuda").half()
    pv = pipeline(name, "cuda", torch.float16)
    unfused = pv.run(x)
    reference = pipeline(name, "cuda", torch.float16, backend="reference").run(x, selections=unfused.selections)
    pv.compile_blocks = compiled
    fused = forced(pv).run(x, selections=unfused.selections)
    for other in (unfused, reference):
        torch.testing.assert_close(fused.logits, other.logits, atol=2e-2, rtol=2e-2)
    pv.mode = "graphs"
    logits, counts = pv(x, return_counts=True)
    same = (counts == unfused.counts).all(1)  # a decision of its own may flip a near-tie of fp16 scores
    assert same.any()
    torch.testing.assert_close(logits[same], unfused.logits[same], atol=2e-2, rtol=2e-2)
    assert any(s.linear for s in pv.program(pv.plan, BATCH, graphs=True).steps)
