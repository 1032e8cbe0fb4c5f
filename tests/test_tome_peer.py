"""benchmarks.tome_peer: the patched-timm ToMe peer makes the reference's merges, and its benchmark runs on a CPU.

Tolerance rules: logits against ``tome_forward`` and (``r=0``) against timm's own forward: fp32,
``atol = rtol = 1e-5`` (the same modules and merges; the attention and the similarities are summed in another
order, the merge in fp32 instead of float64); sources, counts and sizes: exact. Models are 4-block, width-64 timm
models with seeded random weights, as in tests/test_reference_tome.py. The benchmark's CPU dry run uses timm's
``test_vit`` at 64x64 (16 patches) with 3 blocks, registered here as :data:`DRY_RUN_MODEL`, and ``r = 4``: small
enough for our pipeline's Triton kernels under the interpreter (the sync-free rows run every stage at the full
``B * N`` rows); its checks against ``tome_forward`` (fixed ``r`` and the calibrated threshold) are bounded by ``1e-4``
(max |diff|) with the same top-1, and the calibrated counts land within one row per image and block of the target
(``calibrate_threshold``'s promise on its own images).
"""

from __future__ import annotations

import json

import pytest
import timm
import torch
from timm.models import register_model
from timm.models.vision_transformer import Block, VisionTransformer

from benchmarks import tome_peer
from benchmarks.tome_peer import ATTENTIONS, markdown_table, patch_tome, run_patched
from ragged_vit.reference.merging import fixed_r_counts
from ragged_vit.reference.tome import tome_forward

SMALL = dict(depth=4, embed_dim=64, num_heads=2, num_classes=10)
FAMILIES = {
    "deit": ("deit_tiny_patch16_224", dict(img_size=64)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=64)),  # 2 prefix rows, two heads
    "class_avg": ("vit_small_patch16_224", dict(img_size=64, global_pool="avg")),  # size-weighted avg pooling
    "dinov2_reg4": ("vit_small_patch14_reg4_dinov2", dict(img_size=56)),  # class + 4 registers, LayerScale
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}
DRY_RUN_MODEL, DRY_RUN_R = "tome_peer_dry_run_vit", 4


@register_model
def tome_peer_dry_run_vit(pretrained: bool = False, **kwargs: object) -> VisionTransformer:
    """The benchmark's CPU dry run model: timm's ``test_vit`` (width 64, 2 heads) at 64x64 (16 patches), 3 blocks."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("pretrained_cfg", "pretrained_cfg_overlay")}
    return timm.create_model("test_vit", pretrained=False, img_size=64, depth=3, **kwargs)


def family(name: str) -> VisionTransformer:
    model_name, kwargs = FAMILIES[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return timm.create_model(model_name, pretrained=False, **SMALL, **kwargs).eval()


def images(model: torch.nn.Module, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = model.patch_embed.img_size
    return torch.randn(count, 3, *size, generator=g) * torch.linspace(0.2, 3.0, count)[:, None, None, None]


def rows_per_block(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[int], tuple]:
    """The rows each patched block hands on (forward hooks), and :func:`run_patched`'s outputs with sources."""
    seen: list[int] = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: seen.append(out[0].shape[1])) for b in model.blocks]
    try:
        with torch.no_grad():
            out = run_patched(model, x, trace_source=True)
    finally:
        for h in hooks:
            h.remove()
    return seen, out


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("r", [2, [3, 0, 4, 2], 100])  # 100: capped at half the patch rows in every block
def test_peer_makes_the_reference_merges(name, r, attention):
    model = family(name)
    x = images(model, 4, 1)
    ref = tome_forward(model, x, r)
    peer = patch_tome(model, r, attention=attention)
    counts, (logits, sizes, sources) = rows_per_block(peer, x)
    prefix = model.num_prefix_tokens
    n = model.patch_embed.num_patches + prefix
    schedule = r if isinstance(r, list) else [r] * len(model.blocks)
    assert counts == fixed_r_counts(n, schedule, prefix) == ref.counts[:, 0].tolist()
    assert torch.equal(sources, ref.sources)  # every patch ended in the reference's row
    held = torch.zeros_like(sizes).scatter_add_(1, sources, torch.ones_like(sources, dtype=sizes.dtype))
    assert torch.equal(sizes[:, prefix:], held[:, prefix:]), "a row's size is the patches it holds"
    assert bool((sizes[:, :prefix] == 1).all())
    torch.testing.assert_close(logits, ref.logits, **FP32)
    torch.testing.assert_close(peer(x), logits, atol=0, rtol=0)  # model(images) is run_patched's logits


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_r0_is_timm(name, attention):
    model = family(name)
    x = images(model, 3, 2)
    with torch.no_grad():
        torch.testing.assert_close(patch_tome(model, 0, attention=attention)(x), model(x), **FP32)


def test_patch_leaves_timm_and_the_original_alone():
    model = family("deit")
    x = images(model, 2, 3)
    block_forward, model_forward = Block.forward, VisionTransformer.forward
    with torch.no_grad():
        before = model(x)
        peer = patch_tome(model, 3)
        assert peer is not model and "forward" not in vars(model) and "forward" not in vars(model.blocks[0])
        torch.testing.assert_close(model(x), before, atol=0, rtol=0)
        assert Block.forward is block_forward and VisionTransformer.forward is model_forward
        assert type(peer) is type(model) and type(peer.blocks[0]) is Block  # instances patched, not classes
        fresh = family("deit")
        torch.testing.assert_close(fresh(x), before, atol=0, rtol=0)  # a new timm model is unpatched
        same = patch_tome(model, 3, inplace=True)
        assert same is model and "forward" in vars(model.blocks[0])
        torch.testing.assert_close(model(x), peer(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="one value per block"):
        patch_tome(fresh, [1, 2])
    with pytest.raises(ValueError, match="attention must be one of"):
        patch_tome(fresh, 1, attention="flash")
    with pytest.raises(ValueError, match="eval mode"):
        patch_tome(fresh.train(), 1)


def test_peer_traces_as_one_graph():
    """Compile-friendly: no host reads or data-dependent shapes, so Dynamo captures the whole forward."""
    model = family("deit")
    x = images(model, 3, 4)
    peer = patch_tome(model, 3)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(peer, backend="aot_eager", fullgraph=True, dynamic=False)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), peer(x), **FP32)
    finally:
        torch._dynamo.reset()


def test_markdown_table_ratios():
    def ok(row, batch, rate):
        return {"row": row, "batch": batch, "status": "ok", "img_per_s": rate}

    rows = [
        ok("timm_compiled", 1, 100.0),
        ok("peer_eager", 1, 150.0),
        ok("peer_compiled", 1, 200.0),
        ok("peer_sdpa_eager", 1, 120.0),
        ok("ours", 1, 300.0),
        ok("timm_compiled", 8, 400.0),
        ok("peer_eager", 8, 500.0),
        {"row": "peer_compiled", "batch": 8, "status": "does not compile", "reason": "X: y"},
        ok("peer_sdpa_compiled", 8, 1000.0),
        ok("ours", 8, 250.0),
        ok("ours_adaptive", 1, 240.0),
        ok("ours_adaptive_sync_free", 1, 270.0),
        ok("ours_adaptive", 8, 240.0),
        {"row": "ours_adaptive_sync_free", "batch": 8, "status": "failed", "reason": "raised X: y"},
        ok("ours_adaptive", 16, 100.0),  # no fixed r at this batch
    ]
    lines = markdown_table(rows, [1, 8, 16]).splitlines()
    assert lines[-3] == "| ours vs unpruned reduce-overhead | 3.00x | 0.62x | - |"
    assert lines[-2] == "| ours vs the peer's best mode | 1.50x | 0.25x | - |"  # best: explicit compiled; SDPA compiled
    assert lines[-1] == "| adaptive / fixed (the faster adaptive row) | 0.90x (sync-free) | 0.96x (reads) | - |"
    assert "| ours adaptive (sync-free) | 270 | failed: raised X: y | - |" in lines
    assert "does not compile: X: y" in "\n".join(lines)
    assert lines[0].startswith("| row | B=1 img/s, each forward alone |")


def test_markdown_table_by_the_back_to_back_clock():
    """The second table ranks and divides by the back-to-back rates: the peer's best mode is the fastest there."""
    def ok(row, alone, in_a_row):
        return {"row": row, "batch": 4, "status": "ok", "img_per_s": alone, "img_per_s_back_to_back": in_a_row}

    rows = [ok("timm_compiled", 100.0, 192.0), ok("peer_compiled", 90.0, 100.0), ok("peer_sdpa_compiled", 80.0, 160.0),
            ok("ours", 120.0, 240.0)]  # fmt: skip
    alone = markdown_table(rows, [4]).splitlines()
    in_a_row = markdown_table(rows, [4], "img_per_s_back_to_back").splitlines()
    assert in_a_row[0] == "| row | B=4 img/s, back to back |"
    assert "| ours vs unpruned reduce-overhead | 1.20x |" in alone
    assert "| ours vs the peer's best mode | 1.33x |" in alone  # the explicit peer, slower back to back
    assert "| ours vs unpruned reduce-overhead | 1.25x |" in in_a_row
    assert "| ours vs the peer's best mode | 1.50x |" in in_a_row  # the SDPA peer, slower alone


def dry_run(tmp_path, name: str, *argv: str) -> list[dict]:
    """``tome_peer.main`` on the CPU (fp32, one input batch, one timed forward) on :data:`DRY_RUN_MODEL` (the Triton
    kernels run under the interpreter) with ``r = 4``, at B=2; its JSON rows."""
    out = tmp_path / f"{name}.json"
    base = ["--device", "cpu", "--model", DRY_RUN_MODEL, "--r", str(DRY_RUN_R), "--quick", "--batches", "2",
            "--out", str(out)]  # fmt: skip
    assert tome_peer.main([*base, *argv]) == 0
    return json.loads(out.read_text())["rows"]


@pytest.mark.interpreter  # our rows run the Triton kernels on the CPU; the GPU run is ci/gpu_suite.sh's tome-peer step
@pytest.mark.parametrize(
    "sync_free_alone",
    [pytest.param(False, id="one-run"), pytest.param(True, id="sync-free-alone", marks=pytest.mark.full)],
)
def test_main_dry_run_on_cpu(sync_free_alone, tmp_path, capsys):
    """Every row runs or says why; the adaptive rows' statistics hold together. ``sync-free-alone``: the sync-free
    adaptive row runs alone in a second run, which makes our fixed-r logits itself (no ``ours`` row): the same as
    the first run's. (Without it, the default buckets' adaptive row runs the same sync-free segments here.)"""
    sync_free = "ours_adaptive_sync_free"
    first = [r for r in tome_peer.ROWS if r != sync_free]
    rows = {e["row"]: e for e in dry_run(tmp_path, "all", "--adaptive-batches", "2", "--rows", ",".join(first))}
    printed = capsys.readouterr().out
    if sync_free_alone:
        rows |= {e["row"]: e for e in dry_run(tmp_path, "sync_free", "--adaptive-batches", "2", "--rows", sync_free)}
    adaptive = [r for r in tome_peer.ADAPTIVE_ROWS if r in rows]
    assert set(rows) == set(tome_peer.ROWS) - ({sync_free} - set(adaptive))
    for row in ("timm_eager", "peer_eager", "peer_sdpa_eager", "ours", *adaptive):
        assert rows[row]["status"] == "ok" and rows[row]["img_per_s"] > 0 and rows[row]["img_per_s_back_to_back"] > 0
    for row in ("peer_eager", "peer_sdpa_eager"):
        check = rows[row]["check"]
        assert check["same_merges"] == 1.0 and check["max"] < 1e-4 and check["finite"]
    for row in ("ours", *adaptive):  # fp32 against tome_forward fp32 (fixed r, or the same threshold)
        check = rows[row]["check"]
        assert check["max"] < 1e-4 and check["top1_agree"] == 1.0 and check["finite"]
    for row in ("timm_compiled", "peer_compiled", "peer_sdpa_compiled"):  # CUDA-only rows say why
        assert rows[row]["status"] == "unavailable" and rows[row]["reason"]

    model = timm.create_model(DRY_RUN_MODEL, pretrained=False)
    depth, n = len(model.blocks), model.patch_embed.num_patches + 1
    fixed = fixed_r_counts(n, [DRY_RUN_R] * depth)
    target = sum(fixed) / depth
    fewest = fixed_r_counts(n, [2 * DRY_RUN_R] * depth)  # every image merging r_max = 2 r everywhere
    for row in adaptive:
        e = rows[row]
        cal, c, vs = e["calibration"], e["counts"], e["vs_fixed"]
        assert cal["r_max"] == 2 * DRY_RUN_R and cal["images"] == c["images"] == 2
        assert cal["target_rows"] == c["target_rows"] == target
        assert abs(cal["reference_mean_rows"] - target) <= 1  # calibrate_threshold: within a row on its images
        assert abs(c["mean_rows"] - target) <= 1  # our pipeline at that threshold on the same images
        assert c["mean_vs_fixed"] == pytest.approx(c["mean_rows"] / target, abs=1e-4)
        assert sum(c["mean"]) / depth + 1 == pytest.approx(c["mean_rows"], abs=0.01)  # per block vs over blocks
        assert c["stages"] == depth and c["fixed_r"] == [k - 1 for k in fixed]
        for k in range(depth):
            assert fewest[k] - 1 <= c["min"][k] <= c["mean"][k] <= c["max"][k] <= n - 1
            assert 0 <= c["std"][k] <= (c["max"][k] - c["min"][k]) / 2 + 1e-9
        assert c["max"] == sorted(c["max"], reverse=True) and c["min"] == sorted(c["min"], reverse=True)  # no growth
        assert 0 < vs["mean"] <= vs["max"] and 0 <= vs["top1_agree"] <= 1  # another merge schedule: other logits
        # B * N = 34 rows: the default buckets skip reads below 1024 too; the lagged row reads (late) every stage
        assert e["host_reads_per_forward"] == (depth if row == "ours_adaptive_lagged" else 0)
    assert rows["ours_adaptive"]["buckets"]["sync_free_rows"] == 1024
    assert rows["ours_adaptive_lagged"]["buckets"]["lagged_reads"]
    # The lagged row repacks into other capacities: the same merges.
    a, lagged = rows["ours_adaptive"], rows["ours_adaptive_lagged"]
    assert a["counts"] == lagged["counts"] and a["calibration"]["threshold"] == lagged["calibration"]["threshold"]
    if sync_free_alone:
        # The first two adaptive rows run the same segments here, against the fixed-r logits of the first run's
        # ``ours`` row and of the second run's own fixed-r pipeline: bit for bit the same results.
        b = rows[sync_free]
        assert b["buckets"]["sync_free_rows"] == 2 * n
        assert a["counts"] == b["counts"] and a["vs_fixed"] == b["vs_fixed"] and a["check"] == b["check"]
        assert a["calibration"]["threshold"] == b["calibration"]["threshold"]

    lines = printed.rstrip().splitlines()
    assert lines[-2].startswith("| ours vs the peer's best mode |")
    assert lines[-1].startswith("| adaptive / fixed (the faster adaptive row) | ")
    assert any(lines[-1].endswith(f"x ({name}) |") for name in tome_peer.ADAPTIVE_NAMES.values())  # the faster one
    assert sum("ours adaptive (reads), B=2: threshold" in line for line in lines) == 1


def test_adaptive_rows_only_at_adaptive_batches(tmp_path):
    """``--adaptive-batches`` (default 64) picks the batch sizes of the adaptive rows: none at B=2 here."""
    assert tome_peer.parse_args([]).adaptive_batches == (64,)
    assert dry_run(tmp_path, "none", "--rows", ",".join(tome_peer.ADAPTIVE_ROWS)) == []
