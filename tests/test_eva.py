"""timm's Eva ViTs (EVA-02, DINOv3, Perception Encoder, the ``vit_*_rope_*`` models) on the packed runtime, built
small from timm's own model names (``docs/models.md`` lists them).

Each family, random weights (q and k scaled up, so attention is peaked and RoPE moves the logits well past the
tolerance), 3 blocks of width 64, 16 patches:

* unpruned and at keep rate 1.0 the pipeline reproduces timm's forward: fp32 on the CPU, ``atol = rtol = 1e-5``;
* pruned, every kept patch keeps its own rotation: a fixed-count pruner's forward equals timm's blocks run on each
  image's kept rows with the rope table rows of their patches (fp32, ``atol = rtol = 1e-5``);
* every pruner whose rule applies runs (EViT and ATS need a class token), and the Triton kernel (its rotary variant,
  under the interpreter) agrees with the reference backend on the same decisions;
* the graph runner (its segments run eagerly on the CPU, on the same static buffers: the rope table of each image
  size built once, the rows' positions handed from one segment to the next) gives the eager forward's counts and
  logits (fp32, ``atol = rtol = 1e-5``), with padding rows of NaN; compiled blocks run on the packed Eva blocks;
* what is not supported yet is refused in one line: ToMe on a RoPE model, grouped-query attention, a rope module of
  another layout.

GPU twins (fp16, the kernel against timm) are at the end.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import timm
import torch
from timm.layers import pos_embed_sincos
from timm.models.eva import Eva

import ragged_vit
from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines import model as model_module
from ragged_vit.pipelines import packed_block
from ragged_vit.pipelines import parts as parts_module
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import assert_fp16_within_twice, no_tf32
from tests.test_graphs import poisoned  # noqa: F401  (the fixture: NaN in every padding row)
from tests.test_models import check_pruned_and_replayed

SMALL = dict(depth=3, embed_dim=64, num_heads=2, num_classes=10)
FAMILIES = {  # name -> (timm model, arguments, rope table, layout)
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=56, ref_feat_shape=(4, 4)), "RotaryEmbeddingCat", "interleaved"),
    "eva02_split_qkv": (  # EVA-02 B/L: q, k, v projections; SwiGLU with its inner norm
        "eva02_base_patch14_224",
        dict(img_size=56, ref_feat_shape=(4, 4)),
        "RotaryEmbeddingCat",
        "interleaved",
    ),
    "dinov3": (  # class + 4 registers, LayerScale, half layout, dynamic_img_size
        "vit_small_patch16_dinov3",
        dict(img_size=64, init_values=0.5),
        "RotaryEmbeddingDinoV3",
        "half",
    ),
    "rope_axial": (  # RoPE-Axial: timm's AttentionRope, class-token pooling
        "vit_small_patch16_rope_224",
        dict(img_size=64, init_values=0.5),
        "RotaryEmbeddingCat",
        "interleaved",
    ),
    "rope_mixed": (  # one table per block and head
        "vit_small_patch16_rope_mixed_224",
        dict(img_size=64, init_values=0.5),
        "RotaryEmbeddingMixed",
        "interleaved",
    ),
    "rope_reg1_gap": (  # no class token, 1 register, avg pool
        "vit_medium_patch16_rope_reg1_gap_256",
        dict(img_size=64, init_values=0.5, ref_feat_shape=(4, 4)),
        "RotaryEmbeddingCat",
        "interleaved",
    ),  # fmt: skip
    "pe": (  # Perception Encoder: norm_pre, an attention pool over every row, grid offset
        "vit_pe_core_tiny_patch16_384",
        dict(img_size=64, ref_feat_shape=(4, 4), attn_pool_num_heads=2),
        "RotaryEmbeddingCat",
        "interleaved",
    ),  # fmt: skip
    "post_norm": ("eva02_enormous_patch14_clip_224", dict(img_size=56), None, None),  # post-norm blocks, no RoPE
}
if hasattr(pos_embed_sincos, "RotaryEmbeddingMRope"):  # newer timm: multimodal RoPE (half layout, 'ij' grid only)
    FAMILIES["mrope"] = (
        "vit_small_patch16_rope_224",
        dict(img_size=64, init_values=0.5, rope_type="mrope", rope_grid_indexing="ij"),
        "RotaryEmbeddingMRope",
        "half",
    )
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def family(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's small model, random weights of ``seed``, its queries and keys scaled for peaked attention."""
    model_name, kwargs, _, _ = FAMILIES[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            model = timm.create_model(model_name, pretrained=False, **SMALL, **kwargs).eval()
        except TypeError as error:  # an older timm that lists the rope type but cannot build it
            pytest.skip(f"timm {timm.__version__} cannot build {name} itself: {error}")
        for block in model.blocks:
            attn = block.attn
            if attn.qkv is not None:
                attn.qkv.weight.data[: 2 * attn.qkv.weight.shape[1]].mul_(4.0)
            else:
                attn.q_proj.weight.data.mul_(4.0)
                attn.k_proj.weight.data.mul_(4.0)
        if isinstance(model.head, torch.nn.Linear):
            model.head.weight.data.normal_(0.0, 0.3)  # Eva initialises its head near zero
    return model


def half_family(name: str) -> torch.nn.Module:
    """The family's model on the GPU in fp16; skipped where timm's own fp16 forward fails (an older timm's
    RoPE-Mixed multiplies its float grid by the half frequencies)."""
    model = family(name).cuda().half()
    try:
        with torch.no_grad():
            model(images(model, 1, 0).cuda().half())
    except RuntimeError as error:
        pytest.skip(f"timm {timm.__version__} cannot run {name} in fp16 itself: {str(error).splitlines()[0]}")
    return model


def images(model: torch.nn.Module, count: int, seed: int, size: tuple[int, int] | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = size or model.patch_embed.img_size
    return torch.randn(count, 3, *size, generator=g) * torch.linspace(0.5, 2.0, count)[:, None, None, None]


def has_class_token(model: torch.nn.Module) -> bool:
    return model.cls_token is not None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_unpruned_and_keep_all_reproduce_timm(name):
    model = family(name)
    _, _, table, layout = FAMILIES[name]
    x = images(model, 3, 1)
    with torch.no_grad():
        ref = model(x)
    pv = PrunedViT(model)
    assert (pv.rope and (pv.rope.table, pv.rope.layout)) == ((table, layout) if table else None)
    torch.testing.assert_close(pv.run(x).logits, ref, **FP32)
    keep_all = [make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1)]
    if has_class_token(model):
        keep_all.append(make_pruner("evit", rate=1.0, blocks=(1, 2)))  # mid-block: a rotated qkv for its scores
    for pruner in keep_all:
        out = PrunedViT(model, pruner, "reference").run(x)
        torch.testing.assert_close(out.logits, ref, **FP32, msg=lambda m, p=pruner.name: f"{p}: {m}")
        assert out.counts.eq(model.patch_embed.num_patches).all()


def test_the_rotation_is_what_the_keep_all_check_sees(monkeypatch):
    """The families' tolerance is tight enough to see RoPE: without the packed blocks' rotation the keep-rate-1.0
    forward misses timm's by far more than it."""
    model = family("dinov3")
    x = images(model, 2, 2)
    with torch.no_grad():
        ref = model(x)
    monkeypatch.setattr(packed_block, "rotate_qkv", lambda qkv, *rotation: qkv)
    out = PrunedViT(model, make_pruner("threshold_l2", mode="ratio", rate=1.0, block=0), "reference").run(x)
    assert (out.logits - ref).abs().max().item() > 100 * FP32["atol"]


def _timm_on_kept_rows(model, image: torch.Tensor, keeps: dict[int, torch.Tensor]) -> torch.Tensor:
    """timm's blocks on one image, keeping before block ``i`` the rows ``keeps[i]`` (bool over its rows then), each
    block given the rope table rows of the patches kept (per block and head for RoPE-Mixed): the oracle."""
    prefix = model.num_prefix_tokens
    x, table = model._pos_embed(model.patch_embed(image[None]))
    x = model.norm_pre(x)
    patches = torch.arange(x.shape[1] - prefix)
    mixed = getattr(model, "rope_mixed", False)
    for i, block in enumerate(model.blocks):
        if i in keeps:
            x = x[:, keeps[i]]
            patches = patches[keeps[i][prefix:]]
        rope = table[i][:, patches] if mixed else table[patches]
        x = block(x, rope=rope)
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("name", ["dinov3", "rope_mixed", "eva02"])
def test_kept_rows_keep_their_own_rotation(name):
    """DynamicViT (two stages, fixed counts) on the packed runtime equals timm's blocks run on each image's kept rows
    with their own patches' rope rows: the positions travel with the rows through every repack."""
    model = family(name)
    pruner = make_pruner("dynamicvit", embed_dim=64, rate=0.6, blocks=(1, 2))
    x = images(model, 3, 3)
    out = PrunedViT(model, pruner, "reference").run(x)
    prefix, tokens = model.num_prefix_tokens, model.patch_embed.num_patches + model.num_prefix_tokens
    lengths = [tokens] * x.shape[0]
    expected = []
    with torch.no_grad():
        per_image = [{} for _ in lengths]
        for block, sel in zip(pruner.blocks, out.selections, strict=True):
            starts = [sum(lengths[:b]) for b in range(len(lengths))]
            for b, start in enumerate(starts):
                per_image[b][block] = sel.keep[start : start + lengths[b]]
            lengths = sel.kept.tolist()
        assert all(n == prefix + int(16 * 0.6 * 0.6) for n in lengths)
        for b in range(x.shape[0]):
            expected.append(_timm_on_kept_rows(model, x[b], per_image[b]))
    torch.testing.assert_close(out.logits, torch.cat(expected), **FP32)


def test_evit_scores_the_keys_its_block_attends_with(monkeypatch):
    """EViT on a RoPE model keeps the patches with the largest class-token attention of timm's own block, which
    attends with rotated keys: the scores of the queries and keys timm hands to its attention (spied on), at the
    first stage (dense rows, in timm's order)."""
    model = family("dinov3")
    x = images(model, 3, 9)
    spied = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        spied.append((q, k))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(x)
    assert len(spied) == len(model.blocks), "timm's Eva attention calls scaled_dot_product_attention"
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    q, k = spied[1]  # block 1: the stage's block, [B, H, N, D] each
    prefix = model.num_prefix_tokens
    attn = torch.softmax(q[:, :, :1] @ k.transpose(-1, -2) * model.blocks[1].attn.scale, dim=-1)
    scores = attn[:, :, 0, prefix:].mean(1)  # [B, patches]: the class row's attention, mean over heads
    sel = PrunedViT(model, make_pruner("evit", rate=0.5, blocks=(1,)), "reference").run(x).selections[0]
    keep = sel.keep.view(x.shape[0], -1)[:, prefix:]
    for b in range(x.shape[0]):
        top = set(scores[b].topk(int(keep[b].sum())).indices.tolist())
        assert top == set(keep[b].nonzero().flatten().tolist())


PRUNERS = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, block=1),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 2)),
    "evit_fused": lambda: make_pruner("evit", rate=0.6, blocks=(1, 2), fuse_token=True),
    "ats": lambda: make_pruner("ats", blocks=(1, 2), num_samples=10, min_keep=2),
}


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize("pruner", list(PRUNERS))
@pytest.mark.parametrize("name", ["dinov3", "rope_reg1_gap"])
def test_every_pruner_runs_and_the_kernel_rotates_as_the_reference_interpreter(name, pruner):
    """Every pruner whose rule applies (EViT and ATS score by the class token's attention row: refused without one):
    prefix rows kept, the plan's fixed counts; the Triton kernel's rotary variant replays the same decisions to the
    reference backend's logits (fp32, ``atol = rtol = 1e-4``: GEMMs on other row counts)."""
    model = family(name)
    check_pruned_and_replayed(model, PRUNERS[pruner], images(model, 3, 4), images(model, 6, 5))


def test_one_pipeline_takes_every_size_of_a_dynamic_model():
    """DINOv3 (``dynamic_img_size=True``): timm's rope table of each size, the same pipeline at two sizes."""
    model = family("dinov3")
    pv = ragged_vit.prune(model, "dynamicvit", 1.0, "reference")
    for size in ((64, 64), (48, 80)):
        x = images(model, 2, 6, size)
        with torch.no_grad():
            ref = model(x)
        torch.testing.assert_close(pv(x), ref, **FP32)


def test_what_is_not_supported_yet_is_refused_in_one_line():
    model = family("rope_axial")
    with pytest.raises(NotImplementedError, match="merges rows, and the model has rotary position embeddings"):
        ragged_vit.prune(model, "tome", 0.5, "reference")
    if "num_kv_heads" in inspect.signature(Eva.__init__).parameters:  # grouped-query attention (newer timm: Sapiens2)
        with torch.random.fork_rng():
            gqa = timm.create_model(
                "eva02_tiny_patch14_224", pretrained=False, **SMALL, num_kv_heads=1, attn_type="rope", qkv_fused=False
            )
        with pytest.raises(NotImplementedError, match=r"grouped-query attention \(1 key/value heads for 2"):
            PrunedViT(gqa)
    model.rope = timm.layers.RotaryEmbedding(32)
    with pytest.raises(NotImplementedError, match="model.rope is a RotaryEmbedding, whose rotary layout"):
        PrunedViT(model)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
def test_an_eva_model_without_rope_merges_and_runs_in_the_graph_runner_interpreter():
    """EVA-02-E's post-norm blocks, no RoPE: ToMe merges (the Triton kernels replay the reference's decisions) and the
    graph runner (its segments eagerly on the CPU, variable counts) gives the eager forward's counts and logits."""
    model = family("post_norm")
    x = images(model, 3, 10)
    pv = ragged_vit.prune(model, "tome", 0.6, "reference")
    ref = pv.run(x)
    assert bool((ref.counts < model.patch_embed.num_patches).all())
    pv.backend = "triton"
    torch.testing.assert_close(pv.run(x, selections=ref.selections).logits, ref.logits, atol=1e-4, rtol=1e-4)
    pv = PrunedViT(model, make_pruner("threshold_l2", mode="calibrated", rate=0.5, block=1), "triton")
    pv.calibrate(images(model, 6, 11))
    eager, graphed = pv.run(x), GraphedPrunedViT(pv).run(x)
    assert torch.equal(graphed.counts, eager.counts)
    torch.testing.assert_close(graphed.logits, eager.logits, atol=1e-5, rtol=1e-5)


GRAPHED = {  # the graph runner's cases: fixed counts (one graph), a variable count (two segments), a chain of bounds
    "threshold_l2_ratio": lambda: make_pruner("threshold_l2", mode="ratio", rate=0.5, block=1),
    "threshold_l2_calibrated": PRUNERS["threshold_l2"],
    "evit": lambda: make_pruner("evit", rate=0.6, blocks=(1, 2)),
    "ats": PRUNERS["ats"],
}
SIZES = {"dinov3": [(64, 64), (48, 80), (64, 64)]}  # dynamic_img_size: two sizes in one runner


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on NaN padding rows
@pytest.mark.parametrize("pruner", list(GRAPHED))
@pytest.mark.parametrize("name", ["dinov3", "eva02", "rope_axial", "rope_mixed"])
def test_the_graph_runner_equals_the_eager_forward_interpreter(name, pruner, poisoned):  # noqa: F811 (the fixture)
    """The graph runner on a RoPE model (uncaptured on the CPU: every segment eagerly, Triton's kernels under the
    interpreter) against ``PrunedViT.run``: the same counts, logits to fp32 rounding, padding rows of NaN; the rope
    table of each image size is built once (timm's ``get_embed`` is never called inside a segment) and held as a
    static buffer."""
    model = family(name)
    pv = PrunedViT(model, GRAPHED[pruner](), "triton")
    if pruner == "threshold_l2_calibrated":
        pv.calibrate(images(model, 6, 11))
    runner = GraphedPrunedViT(pv)
    built = []
    get_embed = model.rope.get_embed
    model.rope.get_embed = lambda *args, **kwargs: built.append(1) or get_embed(*args, **kwargs)
    sizes = SIZES.get(name, [tuple(model.patch_embed.img_size)] * 2)
    for call, size in enumerate(sizes):
        x = images(model, 3 - call % 2, 12 + call, size)
        out = runner.run(x)
        del model.rope.get_embed  # timm's own, for the eager reference
        ref = pv.run(x)
        model.rope.get_embed = lambda *args, **kwargs: built.append(1) or get_embed(*args, **kwargs)
        assert torch.equal(out.counts, ref.counts), (size, out.counts.tolist(), ref.counts.tolist())
        torch.testing.assert_close(out.logits, ref.logits, **FP32)
    assert len(built) == len(set(sizes)) == len(runner._tables)
    assert runner.counters.eager_segments >= len(sizes) and runner.memory_report().buffer_bytes > 0
    if pv.plan.fixed:
        assert not poisoned  # one whole-forward graph: exact buffers
    else:
        assert any(capacity > total for capacity, total in poisoned), poisoned


def test_the_modes_take_a_rope_model_as_any_vit():
    """RoPE is no reason to run eagerly: on the CPU the automatic mode names the CPU alone, and ``mode="graphs"`` and
    ``compile_blocks=True`` are accepted at construction."""
    model = family("rope_mixed")
    pv = ragged_vit.prune(model, "evit", 0.6, "reference")
    with pytest.warns(ragged_vit.EagerFallbackWarning) as said:
        pv(images(model, 2, 14))
    assert [str(w.message) for w in said] == ["PrunedViT ran eagerly: the model is on CPU: CUDA graphs need a CUDA GPU"]
    graphs = PrunedViT(model, pv.pruner, "reference", compile_blocks=True, mode="graphs")
    with pytest.raises(ValueError, match="mode='graphs' cannot capture this call: the model is on CPU"):
        graphs(images(model, 2, 14))


@pytest.mark.filterwarnings("ignore::UserWarning")  # Inductor's notes on the CPU
@pytest.mark.parametrize("backend", ["padded_sdpa", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_compiled_blocks_run_the_eva_blocks_in_and_out_of_the_graph_runner(backend, monkeypatch):
    """``compile_blocks`` on a RoPE model (RoPE-Mixed: one table per block and head): the compiled front (embedding
    without timm's table, the runner's static one given) and packed blocks, in the graph runner and eagerly, equal the
    plain forward to fp32 rounding; Dynamo traces them without a graph break (``padded_sdpa``: q and k rotated in the
    compiled region; ``triton``: the attention op given the rotation, under the interpreter); EViT's decisions are
    given the block's own qkv and its rotation, to apply as they read it (no rotated copy of the qkv). A compile costs
    ~15 s on the CPU."""
    model = family("rope_mixed")
    pv = PrunedViT(model, make_pruner("evit", rate=0.6, blocks=(1, 2), fuse_token=True), backend)
    x = images(model, 3, 13)
    ref = pv.run(x)
    given = []

    def recording(compiled: bool) -> parts_module.Parts:
        real = parts_module.parts(compiled)

        def decide(pruner, inp):
            given.append(inp.rotary)
            return real.decide(pruner, inp)

        return dataclasses.replace(real, decide=decide)

    monkeypatch.setattr(model_module, "parts", recording)
    torch._dynamo.utils.counters.clear()
    graphed = GraphedPrunedViT(pv, compile_blocks=True).run(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled path ran
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert len(given) == 2 and all(r is not None and r.table.dim() == 3 for r in given)  # two stages, per-head tables
    pv.compile_blocks = True
    eager = pv.run(x, selections=ref.selections)
    for out in (graphed, eager):
        assert torch.equal(out.counts, ref.counts)
        torch.testing.assert_close(out.logits, ref.logits, **FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("pruner", ["threshold_l2_ratio", "threshold_l2_calibrated", "evit", "ats"])
@pytest.mark.parametrize("name", ["dinov3", "rope_mixed", "eva02"])
def test_gpu_the_default_call_captures_graphs_of_a_rope_model(name, pruner):
    """``prune(model)(images)`` on CUDA, fp16, a RoPE model: CUDA graphs with compiled blocks per batch bucket (a batch
    of 3 padded to 4; DINOv3 at two image sizes), no eager fallback; the counts are the eager forward's but for a
    near-tie flipped by the compiled rounding (a few rows), and the logits of the images with equal counts agree with
    it in fp16; ``graph_memory`` lists every bucket and size."""
    model = half_family(name)
    pv = PrunedViT(model, GRAPHED[pruner]().cuda().half(), "triton")
    assert pv.mode == "auto"
    if pruner == "threshold_l2_calibrated":
        pv.calibrate(images(model, 8, 11).cuda().half())
    eager = PrunedViT(model, pv.pruner, "triton", mode="eager")
    sizes = SIZES.get(name, [tuple(model.patch_embed.img_size)] * 3)
    same_images = []
    for call, (batch, size) in enumerate(zip([1, 3, 4], sizes, strict=True)):
        x = images(model, batch, 20 + call, size).cuda().half()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ragged_vit.EagerFallbackWarning)
            logits, counts = pv(x, return_counts=True)
        assert pv.last_call == "graphs"
        ref_logits, ref_counts = eager(x, return_counts=True)
        assert logits.shape == ref_logits.shape and bool(torch.isfinite(logits).all())
        assert (counts - ref_counts).abs().max() <= 4, (counts.tolist(), ref_counts.tolist())
        same = (counts == ref_counts).all(dim=1)
        same_images += same.tolist()
        diff = (logits[same].float() - ref_logits[same].float()).abs()
        bound = 2e-2 * max(1.0, ref_logits.float().abs().max().item())
        assert diff.numel() == 0 or diff.max() < bound, (diff.max(), bound)
    assert sum(same_images) >= len(same_images) / 2, same_images
    keys = {key[:3] for key in pv.graph_memory().keys}
    assert keys == {(b, *size) for b, size in zip([1, 4, 4], sizes, strict=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("pruner", ["threshold_l2_calibrated", "ats"])
@pytest.mark.parametrize("name", ["dinov3", "rope_mixed"])
def test_gpu_captured_segments_hand_the_positions_over(name, pruner):
    """The graph runner without compiled blocks, fp16, variable counts (segments captured per capacity, the rows'
    positions handed from one graph to the next): counts equal to the eager forward's; logits within twice its fp16
    error against the reference backend on the same decisions, plus an fp16 ulp of the logits' scale."""
    model = half_family(name)
    pv = PrunedViT(model, GRAPHED[pruner]().cuda().half(), "triton", mode="eager")
    if pruner == "threshold_l2_calibrated":
        pv.calibrate(images(model, 8, 11).cuda().half())
    runner = GraphedPrunedViT(pv)
    for seed in range(3):  # new images every call: the replays read the static input
        x = images(model, 4, 30 + seed).cuda().half()
        out, ours = runner.run(x), pv.run(x)
        assert torch.equal(out.counts, ours.counts)
        triton = pv.backend  # the same instance back after: a new one would unbind the runner's graphs
        pv.backend = "reference"
        ref = pv.run(x, selections=ours.selections).logits.float()
        pv.backend = triton
        bound = 2 * (ours.logits.float() - ref).abs().max().item() + 1e-3 * ref.abs().max().item()
        assert (out.logits.float() - ref).abs().max().item() <= bound
    assert runner.counters.captures > 0 and runner.counters.replays > runner.counters.captures


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_keep_all_fp16_against_timm_gpu(name):
    """On the GPU, fp16, the Triton kernel (its rotary variant) and the GEMM patch embedding at keep rate 1.0: the
    pipeline's error against timm in fp32 is at most 2x timm's own fp16 error (plus one fp16 ulp of the logits'
    scale)."""
    half_family(name)  # skips where timm's own fp16 forward fails
    model = family(name).cuda()
    x = images(model, 4, 7).cuda()
    with torch.no_grad(), no_tf32():
        ref = model(x).float()
        timm16 = model.half()(x.half()).float()
    pv = PrunedViT(model, make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1), "triton", mode="eager")
    assert_fp16_within_twice(pv.run(x.half()).logits, timm16, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pruner", ["dynamicvit", "evit_fused", "ats"])
@pytest.mark.parametrize("name", ["dinov3", "rope_mixed"])
def test_pruned_triton_against_reference_gpu(name, pruner):
    """Pruned on the GPU (fp16; Triton's pack kernel carries the positions): the kernel's forward is within twice
    PyTorch's fp16 error (``padded_sdpa``, q and k rotated before it) of the reference backend's on the same
    decisions, plus an fp16 ulp of the logits' scale."""
    model = half_family(name)
    pv = PrunedViT(model, PRUNERS[pruner]().cuda().half(), "triton", mode="eager")
    x = images(model, 4, 8).cuda().half()
    ours = pv.run(x)
    pv.backend = "padded_sdpa"
    sdpa = pv.run(x, selections=ours.selections).logits.float()
    pv.backend = "reference"
    ref = pv.run(x, selections=ours.selections).logits.float()
    assert_fp16_within_twice(ours.logits, sdpa, ref)


def test_split_projections_run_as_one_gemm_and_a_hooked_one_as_itself(gen):
    """EVA-02 B/L's q, k and v Linears (k without a bias) give the packed qkv as one GEMM over their weights,
    the three outputs side by side; a projection with a hook runs as its module, so the hook still fires."""
    from ragged_vit.pipelines.eva import eva_qkv
    from ragged_vit.testing.ops import op_names

    attn = family("eva02_split_qkv").blocks[0].attn
    for p in (attn.q_proj, attn.v_proj):
        p.bias.data.normal_(generator=gen)
    x = torch.randn(7, attn.q_proj.in_features, generator=gen)
    with torch.no_grad():
        expected = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=1)
        torch.testing.assert_close(eva_qkv(attn, x), expected, **FP32)
        assert op_names(eva_qkv, attn, x).count("aten::linear") == 1
        seen = []
        attn.k_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        torch.testing.assert_close(eva_qkv(attn, x), expected, **FP32)
    assert seen == [torch.Size([7, attn.k_proj.out_features])]
