"""Native resolution: timm's ``NaFlexVit`` on a batch of images of different sizes, packed ragged from the input on
(``ragged_vit.pipelines.naflex``; ``docs/models.md``).

Models: timm's NaFlex names with 4 blocks of width 64, 2 heads, 16x16 patches and a 4x4 position-embedding grid,
random weights scaled up (attention is peaked, so a wrong position embedding or a leak across images moves the
logits well past the tolerance). Images: four sizes, 48 to 128 px, aspect ratios 1:2 to 2:1, none at the grid's size.

Tolerance rules (fp32 on the CPU):
* at keep rate 1.0 the pipeline reproduces timm's forward of the same images, which pads them to the longest and
  masks its attention (the patch dict of timm's collator): ``atol = rtol = 1e-5`` per image;
* pruned, a batch equals each of its images run alone (the same decisions: each image counts from its own patches),
  logits at ``atol = rtol = 1e-5`` and counts exactly;
* the Triton backend (under the interpreter) replays the reference backend's decisions, ``atol = rtol = 1e-4``.

RoPE families (``rope_type``: axial, DINOv3's, RoPE-Mixed, MRoPE): the same rules, on models whose blocks move the
logits (no LayerScale, or LayerScale 0.5: a wrong rope table row moves them by 0.3 or more), built where this timm
can build them and skipped with the reason where it cannot.
"""

from __future__ import annotations

import itertools
import json

import pytest
import timm
import torch
from timm.models.naflexvit import NaFlexVitCfg

import ragged_vit
from benchmarks.naflex import patch_dict  # timm's padded NaFlex input of a list of images
from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines import graphs, naflex
from ragged_vit.reference.pruners import PRUNERS
from ragged_vit.testing.ops import op_names
from tests.helpers import as_on_cuda, assert_fp16_within_twice, no_tf32, sync_free

SMALL = dict(embed_dim=64, depth=4, num_heads=2, num_classes=10, pos_embed_grid_size=(4, 4))
FAMILIES = {
    "map": ("naflexvit_base_patch16_siglip", {}),  # no prefix rows, attention pool, bilinear
    "reg4_avg": ("naflexvit_base_patch16_gap", {}),  # 4 registers, LayerScale, fc_norm
    "map_reg1": ("naflexvit_base_patch16_map", {}),
    "par_learned": ("naflexvit_base_patch16_par_gap", {}),  # aspect-preserving resample, then cropped
    "par_factorized": ("naflexvit_base_patch16_parfac_gap", {}),
    "class_token": ("naflexvit_base_patch16_gap", dict(class_token=True, reg_tokens=0, global_pool="token")),
    "eva_blocks": ("naflexvit_base_patch16_gap", dict(swiglu_mlp=True, qkv_fused=False, attn_type="eva")),
}
ROPE_FAMILIES = {  # a batch of several grids: their tables concatenated, each row's position offset by its grid's
    "rope_axial": ("naflexvit_base_patch16_siglip", dict(rope_type="axial")),  # no prefix rows, RoPE-Axial
    "rope_axial_reg4": ("naflexvit_base_patch16_gap", dict(rope_type="axial", init_values=0.5)),  # 4 unrotated rows
    "rope_eva_class": (  # EvaAttention, a class token
        "naflexvit_base_patch16_gap",
        dict(rope_type="axial", attn_type="eva", init_values=0.5, class_token=True, reg_tokens=0, global_pool="token"),
    ),
    "rope_dinov3": ("naflexvit_base_patch16_gap", dict(rope_type="dinov3", rope_rotate_half=True, init_values=0.5)),
    "rope_mixed": ("naflexvit_base_patch16_siglip", dict(rope_type="mixed")),  # one table per block and head
    "rope_mrope": ("naflexvit_base_patch16_siglip", dict(rope_type="mrope", rope_mrope_section=(4, 6, 6))),
}
FAMILIES.update(ROPE_FAMILIES)
SIZES = ((96, 48), (64, 128), (80, 80), (112, 64))


def naflex_model(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    name, options = FAMILIES[family]
    missing = {*options, *overrides} - set(NaFlexVitCfg.__dataclass_fields__) - {"num_classes"}
    if missing:
        pytest.skip(f"this timm's NaFlexVitCfg has no {sorted(missing)}")
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, **SMALL, **{**options, **overrides}).eval()
    except (TypeError, ValueError, AssertionError, ImportError) as error:  # an older timm's rope
        if "rope_type" not in options:
            raise
        pytest.skip(f"timm {timm.__version__} cannot build {family}: {error}")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    return model


def images(sizes=SIZES, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=g) for h, w in sizes]


def pipeline(model, name: str, keep_rate: float = 1.0, backend: str = "reference") -> PrunedViT:
    return ragged_vit.prune(model, name, keep_rate, backend, mode="eager")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ROPE_FAMILIES])
def test_keep_all_equals_timm_padded_and_masked(family):
    """Unpruned, Threshold-L2 and DynamicViT at 1.0 (and EViT with a class token): timm's logits, per image; the
    patch dict gives the same."""
    model = naflex_model(family)
    batch = images()
    with torch.no_grad():
        expected = model(patch_dict(batch))
    pruners = ["none", "threshold_l2", "dynamicvit"] + (["evit"] if family == "class_token" else [])
    for name in pruners:
        pv = pipeline(model, name)
        logits, counts = pv(batch, return_counts=True)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=f"{family} {name}")
        if name != "none":
            assert counts[:, 0].tolist() == [h * w // 256 for h, w in SIZES]
            assert pv.first_packed_block == 0 < pv.num_dense_blocks  # every block packed, the first stage later
    torch.testing.assert_close(pv(patch_dict(batch)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["map", "reg4_avg", "par_learned", "par_factorized"])
def test_position_rows_are_each_grids_resampled_table(family, monkeypatch):
    """Every row's position embedding, computed for the whole batch at once, is its image's resampled table
    (``ragged_vit.reference.native``, one per grid) at its place, from an image list and from a patch dict
    (its rows out of order), also in chunks of the weights and with bicubic antialiased tables."""
    from ragged_vit.reference.native import resample_factorized, resample_grid

    model = naflex_model(family)
    embeds = model.embeds
    if embeds.pos_embed_type == "learned":
        embeds.pos_embed_interp_mode = "bicubic" if family == "reg4_avg" else embeds.pos_embed_interp_mode
    sizes = (*SIZES, (16, 208), (96, 48))  # a long strip, a repeated grid
    square = getattr(embeds, "pos_embed_ar_preserving", False)

    def table(grid):
        if embeds.pos_embed_type == "factorized":
            return resample_factorized(embeds.pos_embed_y[0], embeds.pos_embed_x[0], grid, square=square)
        return resample_grid(embeds.pos_embed[0], grid, square=square, mode=embeds.pos_embed_interp_mode,
                             antialias=getattr(embeds, "pos_embed_antialias", True))  # fmt: skip

    batch = naflex.native_batch(model, images(sizes), torch.device("cpu"), torch.float32)
    want = torch.cat([table(grid) for grid in batch.grids])
    torch.testing.assert_close(naflex.position_rows(embeds, batch, torch.float32), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(naflex, "POSITION_CHUNK_BYTES", 4 * 16 * 7)  # 7 rows at a time
    torch.testing.assert_close(naflex.position_rows(embeds, batch, torch.float32), want, rtol=1e-5, atol=1e-5)
    shuffled = patch_dict(images(sizes))
    order = torch.randperm(shuffled["patches"].shape[1], generator=torch.Generator().manual_seed(0))
    shuffled = {key: value[:, order] for key, value in shuffled.items()}
    batch = naflex.native_batch(model, shuffled, torch.device("cpu"), torch.float32)
    starts = torch.tensor([0, *(h * w for h, w in batch.grids)]).cumsum(0)[:-1].tolist()
    want = torch.cat([table(grid) for grid in batch.grids])[naflex.table_rows(batch, starts)]
    torch.testing.assert_close(naflex.position_rows(embeds, batch, torch.float32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "copies", "most"), [("map", 1, 11), ("reg4_avg", 1, 22), ("rope_axial_reg4", 2, 35)]
)
def test_the_native_front_sends_the_hosts_integers_in_one_copy(family, copies, most):
    """A native batch's front builds what the host knows (counts, offsets, the prefix rows' rows and the patch rows'
    shifts; a RoPE model's table rows) from one host tensor each (``aten::lift_fresh``: a tensor made from Python
    values), not op by op on the device: at most ``most`` top-level ops for three images (13, 32 and 60 when it did;
    ``docs/tuning.md#host-integers-without-a-wait``); the offsets are the images' own."""
    model = naflex_model(family)
    pv = PrunedViT(model, None, "triton", mode="eager")
    batch = naflex.native_batch(model, images()[:3], torch.device("cpu"), torch.float32)
    with torch.no_grad():
        state = naflex.native_front(pv, pv.parts, batch, ())  # its grids' rows and tables kept: none made below
        names = op_names(naflex.native_front, pv, pv.parts, batch, ())
    assert names.count("aten::lift_fresh") == copies and len(names) <= most, names
    prefix = model.num_prefix_tokens
    assert state.cu_seqlens.tolist() == [0, *itertools.accumulate(c + prefix for c in batch.counts)]


def test_grid_cache_keeps_each_grids_rows_until_the_table_changes(monkeypatch):
    """A pipeline's position rows per patch grid: what :func:`position_rows` gives each grid alone (to rounding), the
    grids a batch brings that are not kept resampled together once (a batch of known sizes resamples nothing), the
    least recently used grid dropped past ``GRID_CACHE_GRIDS`` but never one of the last batch, all of them rebuilt
    after an in-place write to the table."""
    model = naflex_model("map")
    pv = pipeline(model, "none")
    resampled = []
    monkeypatch.setattr(naflex, "position_rows", lambda e, b, d, f=naflex.position_rows: resampled.append(b.grids) or
                        f(e, b, d))  # fmt: skip
    batch = pv.check_images(images())
    want = torch.cat([naflex.position_rows(model.embeds, pv.check_images([im]), torch.float32) for im in images()])
    resampled.clear()
    torch.testing.assert_close(pv.grid_cache.positions(model.embeds, batch, torch.float32), want, rtol=1e-6, atol=1e-6)
    assert resampled == [tuple(dict.fromkeys(batch.grids))]  # one resampling of the batch's grids
    resampled.clear()
    pv.grid_cache.positions(model.embeds, pv.check_images(images(SIZES[::-1], 3)), torch.float32)
    assert resampled == []  # every grid known
    monkeypatch.setattr(naflex, "GRID_CACHE_GRIDS", 2)
    pv.grid_cache.positions(model.embeds, batch, torch.float32)
    assert resampled == [] and len(pv.grid_cache._positions.items) == 4  # a batch of more grids keeps all of them
    pv.grid_cache.positions(model.embeds, pv.check_images(images(SIZES[:1], 4)), torch.float32)
    grid = [(h // 16, w // 16) for h, w in SIZES]
    assert list(pv.grid_cache._positions.items) == [grid[3], grid[0]]  # the two used last
    with torch.no_grad():
        model.embeds.pos_embed.mul_(2.0)  # an in-place write: every grid resampled again
    resampled.clear()
    twice = pv.grid_cache.positions(model.embeds, batch, torch.float32)
    assert resampled == [tuple(dict.fromkeys(batch.grids))]
    torch.testing.assert_close(twice, 2 * want, rtol=1e-6, atol=1e-6)
    logits = pv(images())  # the forward reads the rows of the doubled table
    torch.testing.assert_close(logits, model(patch_dict(images())), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["rope_axial", "rope_mixed"])
def test_grid_cache_keeps_each_grids_rope_table_until_the_rope_changes(family, monkeypatch):
    """A RoPE model's table per patch grid: built once per grid (``rope.get_embed``), built anew after an in-place
    write to the rope's parameters or buffers; the forward equals timm's on each image before and after."""
    model = naflex_model(family)
    pv = pipeline(model, "none")
    built = []
    get_embed = model.rope.get_embed
    monkeypatch.setattr(model.rope, "get_embed", lambda shape: built.append(shape) or get_embed(shape=shape))
    for _ in range(2):
        logits = pv(images())
    assert sorted(built) == sorted({(h // 16, w // 16) for h, w in SIZES})  # once per grid over both calls
    tensors = [*model.rope.parameters(), *model.rope.buffers()]
    with torch.no_grad():
        tensors[0].mul_(1.5)  # the rope's state changes in place: every table built anew
    built.clear()
    changed = pv(images())
    assert len(built) == len(SIZES)
    with torch.no_grad():
        alone = torch.cat([model(image[None]) for image in images()])
    torch.testing.assert_close(changed, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, logits)


def test_runs_of_one_size_and_a_tensor_patchify_as_each_image_alone():
    """Consecutive images of one size are patchified together, a ``[B, C, H, W]`` tensor at once: the same rows, in
    order, as each image alone (with ``dynamic_img_pad`` too)."""

    cpu = torch.device("cpu")
    cases = (({}, ((64, 32), (64, 32), (32, 48), (64, 32))), (dict(dynamic_img_pad=True), ((40, 50),) * 3))
    for options, sizes in cases:
        model = naflex_model("map", **options)
        batch = images(sizes)
        alone = [naflex.native_batch(model, [image], cpu, torch.float32) for image in batch]
        together = naflex.native_batch(model, batch, cpu, torch.float32)
        assert torch.equal(together.rows, torch.cat([a.rows for a in alone]))
        assert together.grids == tuple(a.grids[0] for a in alone)
        assert together.counts == tuple(a.counts[0] for a in alone)
        if len(set(sizes)) == 1:
            stacked = naflex.native_batch(model, torch.stack(batch), cpu, torch.float32)
            assert torch.equal(stacked.rows, together.rows) and stacked.grids == together.grids


def test_conv_embedding_and_dynamic_padding_equal_timm_per_image():
    """A convolutional patch embedding (no patch dict in timm: each image alone through timm), and
    ``dynamic_img_pad`` (sizes that are no multiple of the patch, zero-padded at the bottom and right)."""
    for options, sizes in ((dict(embed_proj_type="conv"), SIZES), (dict(dynamic_img_pad=True), ((90, 40), (50, 128)))):
        model = naflex_model("map", **options)
        batch = images(sizes)
        with torch.no_grad():
            expected = torch.cat([model(image[None]) for image in batch])
        torch.testing.assert_close(pipeline(model, "none")(batch), expected, atol=1e-5, rtol=1e-5, msg=str(options))


@pytest.mark.parametrize(
    ("family", "name", "keep_rate"),
    [("map", "threshold_l2", 0.5), ("map", "dynamicvit", 0.7), ("reg4_avg", "tome", 0.6),
     ("class_token", "evit", 0.6), ("class_token", "ats", None)],
)  # fmt: skip
def test_pruned_batch_equals_each_image_alone(family, name, keep_rate):
    model = naflex_model(family)
    if name == "ats":
        pv = PrunedViT(model, PRUNERS["ats"](blocks=(1, 2, 3), num_samples=12, min_keep=2), mode="eager")
    else:
        pv = pipeline(model, name, keep_rate)
    batch = images()
    logits, counts = pv(batch, return_counts=True)
    alone = [pv([image], return_counts=True) for image in batch]
    torch.testing.assert_close(logits, torch.cat([a[0] for a in alone]), atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, torch.cat([a[1] for a in alone]))
    patches = torch.tensor([h * w // 256 for h, w in SIZES])
    assert bool((counts[:, -1] < patches).all()), counts
    if name == "dynamicvit":  # int(N_b * 0.7 ** (s + 1)), each image from its own N_b
        assert counts.tolist() == [[int(n * 0.7 ** (s + 1)) for s in range(3)] for n in patches.tolist()]


def test_calibrated_threshold_on_a_native_batch():
    pv = PrunedViT(naflex_model("map"), PRUNERS["threshold_l2"](mode="calibrated", rate=0.5, block=1), mode="eager")
    threshold = pv.calibrate(images())
    assert threshold == pv.pruner.threshold and pv(images()).shape == (4, 10)


def check_triton_replays_reference_decisions(family: str, name: str, device: str = "cpu") -> None:
    """The Triton backend, given the reference backend's decisions, gives its logits (1e-4, fp32) and counts."""
    pv = pipeline(naflex_model(family).to(device), name, 0.6)
    batch = [image.to(device) for image in images(SIZES[:3])]
    with no_tf32():
        ref = pv.run(batch)
        pv.backend = "triton"
        replayed = pv.run(batch, selections=ref.selections)
    torch.testing.assert_close(replayed.logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(replayed.counts, ref.counts)


REPLAYED = [("map", "dynamicvit"), ("class_token", "evit")]
ROPE_REPLAYED = ["rope_axial_reg4", "rope_dinov3", "rope_mixed", "rope_mrope"]


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize(("family", "name"), REPLAYED)
def test_triton_replays_reference_decisions_interpreter(family, name):
    check_triton_replays_reference_decisions(family, name)


BAD_IMAGES = {
    "empty": ([], "images must hold at least one image"),
    "channels": ([torch.randn(3, 32, 32), torch.randn(1, 32, 32)], r"images\[1\] must have 3 channels"),
    "not_a_multiple": ([torch.randn(3, 32, 40)], r"images\[0\] must have a height that is a positive multiple of 16"),
    "dtypes": ([torch.randn(3, 32, 32), torch.randn(3, 32, 32).double()], r"images\[1\] has dtype torch.float64"),
    "devices": ([torch.randn(3, 32, 32), torch.empty(3, 32, 32, device="meta")], r"images\[1\] must be on the model"),
    "rank": ([torch.randn(1, 3, 32, 32)], r"images\[0\] must have 3 dimensions"),
    "dict_keys": ({"patches": torch.randn(1, 4, 768)}, r"images \(a patch dict\) must have the keys"),
    "dict_5d": ({**patch_dict(images(SIZES[:1])), "patches": torch.randn(1, 24, 16, 16, 3)}, r"images\['patches'\]"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_input_is_a_one_line_error_before_any_launch(case, monkeypatch):
    model = naflex_model("map")
    pv = pipeline(model, "threshold_l2", 0.5)

    def launched(*args: object) -> None:
        raise AssertionError("the patch embedding ran on bad input")

    monkeypatch.setattr(model.embeds.proj, "forward", launched)
    batch, message = BAD_IMAGES[case]
    with pytest.raises(ValueError, match=message) as error:
        pv(batch)
    assert "\n" not in str(error.value)


def test_what_cannot_apply_is_refused_in_one_line():
    with pytest.raises(ValueError, match="has no class token"):
        pipeline(naflex_model("map"), "evit", 0.7)
    with pytest.raises(NotImplementedError, match=r"ATSPruner\(num_samples=K\)"):
        pipeline(naflex_model("class_token"), "ats", 0.5)
    with pytest.raises(NotImplementedError, match="pos_embed_use_grid_sample"):
        PrunedViT(naflex_model("map", pos_embed_use_grid_sample=True))
    with pytest.raises(ValueError, match="native batches run eagerly here: pruner 'evit' appends a token"):
        PrunedViT(naflex_model("class_token"), PRUNERS["evit"](rate=0.7, blocks=(1, 2), fuse_token=True),
                  mode="graphs")(images())  # fmt: skip


@pytest.mark.parametrize("family", ["map", "reg4_avg", "class_token", "eva_blocks"])
def test_graph_runner_runs_unpruned_native_batches_on_static_buffers(family):
    """The graph runner on native batches (no pruner, no RoPE): a key's first call runs the eager forward and keeps
    only the key; from its second, the front eagerly, the blocks and head on the static buffers of ``("native", B,
    capacity, max_seqlen)``. Every call equals the eager forward whatever the buffers' rows held before (NaN) and
    whichever mix of sizes came before it."""
    model = naflex_model(family)
    pv = pipeline(model, "none")
    runner = GraphedPrunedViT(pv)
    mixes = [SIZES, ((64, 64),), SIZES[:2], SIZES, ((48, 48), (48, 48))]
    for seed, sizes in enumerate(mixes):
        batch = images(sizes, seed)
        for _ in range(2):
            for bufs in runner._native.values():
                bufs.x.fill_(float("nan"))  # the padding rows of this call hold NaN
            out = runner.run(batch)
            torch.testing.assert_close(out.logits, pv.run(batch).logits, atol=1e-5, rtol=1e-5, msg=f"{sizes}")
            assert out.counts.shape == (len(sizes), 0)
    keys = sorted(runner._native)
    assert all(key[0] == "native" and key[2] % runner.buckets.step == 0 for key in keys)
    assert {key[1] for key in keys} == {1, 2, 4} and not runner._seen  # every key met twice
    counters = runner.counters  # each key's first call eager, the others on the static buffers (the CPU captures none)
    assert (counters.eager_calls, counters.eager_segments) == (len(keys), 2 * len(mixes) - len(keys))


def test_graph_runner_keeps_the_native_keys_used_last(monkeypatch):
    """A stream of native keys: a key's first call keeps nothing but the key (the last ``NATIVE_SEEN_KEYS``), its
    second allocates its static buffers, kept for the ``NATIVE_KEYS`` keys used last (the oldest dropped, graph and
    buffers); every call equals the eager forward."""
    monkeypatch.setattr(graphs, "NATIVE_KEYS", 2)
    monkeypatch.setattr(graphs, "NATIVE_SEEN_KEYS", 2)
    pv = pipeline(naflex_model("map"), "none")
    runner = GraphedPrunedViT(pv)
    batches = {b: images(((64, 64),) * b, b) for b in range(1, 6)}  # one key per batch size

    def call(b: int) -> tuple[list[int], list[int]]:
        torch.testing.assert_close(runner.run(batches[b]).logits, pv.run(batches[b]).logits, atol=1e-5, rtol=1e-5)
        return [key[1] for key in runner._native], [key[1] for key in runner._seen]

    assert [call(b) for b in (1, 1, 2, 2, 3)] == [([], [1]), ([1], []), ([1], [2]), ([1, 2], []), ([1, 2], [3])]
    assert call(3) == ([2, 3], [])  # key 1's buffers dropped
    assert [call(b) for b in (1, 4, 5, 1)] == [([2, 3], [1]), ([2, 3], [1, 4]), ([2, 3], [4, 5]), ([2, 3], [5, 1])]
    assert runner.counters.eager_calls == 7 and runner.counters.eager_segments == 3


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["map", "rope_dinov3"])
def test_graph_runner_native_batches_with_triton_interpreter(family):
    """The same with the Triton kernel (under the interpreter) on the static buffers: the eager reference's logits."""
    model = naflex_model(family)
    runner = GraphedPrunedViT(pipeline(model, "none", backend="triton"))
    for seed, sizes in enumerate([SIZES, SIZES[1:3]]):
        batch = images(sizes, seed)
        torch.testing.assert_close(runner.run(batch).logits, pipeline(model, "none").run(batch).logits, atol=1e-4,
                                   rtol=1e-4)  # fmt: skip


GRAPHED_PRUNERS = {  # pruners whose native batches replay from graphs: (family, name, keep rate or a pruner)
    "dynamicvit": ("map", "dynamicvit", 0.7),
    "evit": ("class_token", "evit", 0.7),
    "l2_ratio": ("reg4_avg", "threshold_l2", 0.5),
    "l2_calibrated": ("map", lambda: PRUNERS["threshold_l2"](mode="calibrated", rate=0.5, block=1), None),
    "ats_samples": ("class_token", lambda: PRUNERS["ats"](num_samples=12, blocks=(1, 2, 3)), None),
    "tome": ("reg4_avg", "tome", 0.5),
    "tome_adaptive": ("class_token", lambda: PRUNERS["tome"](threshold=0.3, r_max=4, depth=4), None),
}


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize("case", list(GRAPHED_PRUNERS))
def test_graph_runner_runs_pruned_native_batches(case, monkeypatch):
    """A pruned native batch through the graph runner as on CUDA (``as_on_cuda``: its first call the eager forward,
    then the static buffers, the fused decisions): every stage repacks into the key's static buffer (at most the
    previous one's rows or B images of the stage's bound), the rows past the real total as padding images whose
    patches count 0, with no host read; the logits and counts equal the CPU's eager forward (the same pipeline, the
    reference decisions), whatever the static rows held (NaN) and whichever mix came before."""
    family, name, keep = GRAPHED_PRUNERS[case]
    model = naflex_model(family)
    if keep is None:
        pv = PrunedViT(model, name(), "triton", mode="eager")
    else:
        pv = pipeline(model, name, keep, "triton")
    if getattr(pv.pruner, "mode", None) == "calibrated":
        pv.calibrate(images())
    runner = GraphedPrunedViT(pv)
    mixes = [SIZES, SIZES[1:3], ((64, 64), (64, 64))]
    refs = [pv.run(images(sizes, seed)) for seed, sizes in enumerate(mixes)]
    as_on_cuda(monkeypatch)
    for (seed, sizes), ref in zip(enumerate(mixes), refs, strict=True):
        batch = images(sizes, seed)
        for _ in range(2):  # the key's first call: the eager forward; its second: the static buffers
            for bufs in runner._native.values():
                bufs.x.fill_(float("nan"))
            out = runner.run(batch)
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5, msg=f"{sizes}")
            assert torch.equal(out.counts, ref.counts), (sizes, out.counts, ref.counts)
    keys = len(runner._native)  # (two mixes may share a key: its buffers then held the other mix's rows)
    assert (runner.counters.eager_calls, runner.counters.eager_segments) == (keys, 2 * len(mixes) - keys)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
def test_graph_runner_runs_pruned_native_batches_past_the_rule_eagerly(monkeypatch):
    """A pruned native batch of more than ``NATIVE_GRAPH_MAX_ROWS`` rows runs the eager forward, which sizes its
    buffers exactly (every pruner's eager forward: ``test_eager_native_batches_as_on_cuda``)."""
    family, name, keep = GRAPHED_PRUNERS["l2_ratio"]
    pv = pipeline(naflex_model(family), name, keep, "triton")
    runner = GraphedPrunedViT(pv)
    monkeypatch.setattr(graphs, "NATIVE_GRAPH_MAX_ROWS", 512)
    many = images(SIZES * 6, 9)
    out, ref = runner.run(many), pv.run(many)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.counts, ref.counts) and runner.counters.eager_calls == 1
    assert (runner.counters.eager_segments, runner.counters.captures) == (0, 0)


def test_graph_runner_refuses_appended_tokens_in_native_batches():
    pv = PrunedViT(naflex_model("class_token"), PRUNERS["evit"](rate=0.7, blocks=(1, 2), fuse_token=True))
    with pytest.raises(ValueError, match="cannot replay this NaFlexVit's native batches: .*appends a token"):
        GraphedPrunedViT(pv).run(images())


@pytest.mark.parametrize("family", list(ROPE_FAMILIES))
def test_graph_runner_runs_unpruned_rope_native_batches(family):
    """A RoPE model's native batches through the graph runner: the batch's grids' tables and each row's position in
    them copied into the key's static table (``capacity`` rows) and positions; every call equals the eager forward,
    whatever mix came before (stale positions of padding rows stay inside the table)."""
    model = naflex_model(family)
    pv = pipeline(model, "none")
    runner = GraphedPrunedViT(pv)
    for seed, sizes in enumerate([SIZES, SIZES[:1], SIZES[2:], SIZES[::-1], SIZES[1:2]]):
        batch = images(sizes, seed)
        for _ in range(2):  # the key's first call: the eager forward; its second: the static buffers
            torch.testing.assert_close(runner.run(batch).logits, pv.run(batch).logits, atol=1e-5, rtol=1e-5,
                                       msg=f"{sizes}")  # fmt: skip
    assert runner._native and runner.counters.eager_segments == 10 - runner.counters.eager_calls
    for key, bufs in runner._native.items():
        assert bufs.rotary is not None and bufs.rotary.table.shape[-2] == key[2]  # capacity rows


@pytest.mark.parametrize("family", list(ROPE_FAMILIES))
def test_rope_keep_all_equals_timm_and_each_image_alone(family):
    """Unpruned, Threshold-L2 and DynamicViT at 1.0: timm's padded and masked forward per image, and timm's forward of
    each image alone (its own grid's table); the patch dict gives the same."""
    model = naflex_model(family)
    batch = images()
    with torch.no_grad():
        expected = torch.cat([model(image[None]) for image in batch])
        try:
            padded = model(patch_dict(batch))
        except TypeError as error:  # timm 1.0.29's RoPE-Mixed padded forward fails in timm itself
            padded, failure = None, f"timm {timm.__version__} cannot run its own padded forward of {family}: {error}"
    if padded is not None:
        torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
    for name in ("none", "threshold_l2", "dynamicvit"):
        pv = pipeline(model, name)
        torch.testing.assert_close(pv(batch), expected, atol=1e-5, rtol=1e-5, msg=f"{family} {name}")
    torch.testing.assert_close(pv(patch_dict(batch)), expected, atol=1e-5, rtol=1e-5)
    if padded is None:
        pytest.skip(f"{failure} (each image alone agrees)")


def test_rope_coordinate_augmentations_are_off_in_eval():
    """The rope's train-time coordinate shift, jitter and rescale change nothing in eval mode, the runtime's."""
    model = naflex_model("rope_axial_reg4", rope_shift_coords=1.0, rope_jitter_coords=1.5, rope_rescale_coords=1.5)
    batch = images()
    with torch.no_grad():
        expected = model(patch_dict(batch))
    torch.testing.assert_close(pipeline(model, "dynamicvit")(batch), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(ROPE_FAMILIES))
@pytest.mark.parametrize(("name", "keep_rate"), [("threshold_l2", 0.5), ("dynamicvit", 0.7)])
def test_rope_pruned_batch_equals_each_image_alone(family, name, keep_rate):
    """Pruned, every kept patch keeps its own grid's rotation: the batch equals each image run alone."""
    pv = pipeline(naflex_model(family), name, keep_rate)
    batch = images()
    logits, counts = pv(batch, return_counts=True)
    alone = [pv([image], return_counts=True) for image in batch]
    torch.testing.assert_close(logits, torch.cat([a[0] for a in alone]), atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, torch.cat([a[1] for a in alone]))
    assert bool((counts[:, -1] < torch.tensor([h * w // 256 for h, w in SIZES])).all()), counts


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize("family", ROPE_REPLAYED)
def test_rope_triton_replays_reference_decisions_interpreter(family):
    """The Triton kernel's rotary variant (q and k rotated as it loads them) on the concatenated table."""
    check_triton_replays_reference_decisions(family, "dynamicvit")


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on padding rows
@pytest.mark.parametrize("case", list(GRAPHED_PRUNERS))
def test_eager_native_batches_as_on_cuda(case, monkeypatch):
    """The eager forward of native batches as it runs on CUDA: Triton packing into bounded buffers, the fused (Triton)
    decisions registered for CUDA, and the offsets never read to check ``T // B`` (so two sizes whose rows the batch
    size divides are still two sizes, each image counted alone: ``DecisionInput.uniform_rows``, ToMe's fixed merge
    too). Its counts and logits are those of the CPU's reference packing and decisions, for four sizes and, where the
    pruner's counts are fixed (a host count is possible), two sizes whose rows 2 divides and one size twice."""
    family, name, keep = GRAPHED_PRUNERS[case]
    model = naflex_model(family)
    pv = PrunedViT(model, name(), "triton", mode="eager") if keep is None else pipeline(model, name, keep, "triton")
    if getattr(pv.pruner, "mode", None) == "calibrated":
        pv.calibrate(images())
    mixes = [SIZES, SIZES[:2], ((64, 64), (64, 64))] if pv.pruner.fixed_count else [SIZES]
    prefix = pv.model.num_prefix_tokens
    assert sum((h // 16) * (w // 16) + prefix for h, w in SIZES[:2]) % 2 == 0  # B divides T of two sizes
    refs = [pv.run(images(sizes, seed)) for seed, sizes in enumerate(mixes)]  # the CPU's own packing
    as_on_cuda(monkeypatch)  # Triton packing into bounded buffers, the fused decisions, T // B unread
    for (seed, sizes), ref in zip(enumerate(mixes), refs, strict=True):
        logits, counts = pv(images(sizes, seed), return_counts=True)
        assert torch.equal(counts, ref.counts), (sizes, counts.tolist(), ref.counts.tolist())
        torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5, msg=f"{sizes}")


def test_rope_what_cannot_apply_is_refused_in_one_line():
    """A merging pruner, a rope module of another table layout."""
    with pytest.raises(NotImplementedError, match="merges rows") as error:
        pipeline(naflex_model("rope_axial"), "tome", 0.6)
    assert "\n" not in str(error.value)
    model = naflex_model("rope_axial")
    model.rope = timm.layers.RotaryEmbedding(32)  # sin and cos as two tables: not the runtime's layout
    with pytest.raises(NotImplementedError, match="whose rotary layout the packed runtime does not take") as error:
        PrunedViT(model)
    assert "\n" not in str(error.value)


def test_rope_grouped_query_attention_is_refused_in_one_line():
    with pytest.raises(NotImplementedError, match="grouped-query attention") as error:
        PrunedViT(naflex_model("rope_axial", num_kv_heads=1, qkv_fused=False))
    assert "\n" not in str(error.value)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["map", "reg4_avg", "class_token"])
def test_keep_all_fp16_against_timm_gpu(family):
    """fp16 with the Triton kernel against timm's fp32 forward of the padded batch: within twice timm's own fp16
    error (the tolerance of ``test_models.py``'s GPU twin)."""
    model = naflex_model(family).cuda()
    batch = [image.cuda() for image in images()]
    with torch.no_grad():
        expected = model(patch_dict(batch))
        timm_half = model.half()(patch_dict([image.half() for image in batch])).float()
    logits = pipeline(model, "threshold_l2", 1.0, "triton")([image.half() for image in batch]).float()
    assert (logits - expected).abs().max() <= 2 * (timm_half - expected).abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["map", "reg4_avg", "rope_axial_reg4", "rope_dinov3"])
def test_default_call_replays_unpruned_native_batches_gpu(family):
    """The default call on CUDA: an unpruned native batch runs eagerly on its key's first call, is captured on the
    second and replayed after (the front eagerly, the blocks and head from the graph); every call's logits within
    twice timm's own fp16 error of timm's fp32 forward of each image alone, and a call's outputs are the caller's
    (later calls leave them)."""
    model = naflex_model(family).cuda()
    batches = [[image.cuda() for image in images(sizes, seed)] for seed, sizes in enumerate((SIZES, SIZES[:2]))]
    with torch.no_grad(), no_tf32():
        expected = [torch.cat([model(image[None]) for image in batch]) for batch in batches]
        timm_half = [torch.cat([model.half()(image[None].half()) for image in batch]) for batch in batches]
    pv = ragged_vit.prune(model, "none")  # the default call: mode auto, Triton, compiled blocks in the graphs
    outs = []
    for _ in range(3):
        for i, batch in enumerate(batches):
            out = pv([image.half() for image in batch])
            outs.append((i, out, out.clone()))
    counters = pv._runner.counters  # per mix: eager, then captured and replayed, then replayed
    assert pv.last_call == "graphs" and (counters.eager_calls, counters.captures, counters.replays) == (2, 2, 4)
    for i, out, copy in outs:
        assert_fp16_within_twice(out, timm_half[i], expected[i])
        assert torch.equal(out, copy)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dynamicvit", "evit", "l2_calibrated", "tome"])
def test_default_call_replays_pruned_native_batches_gpu(case):
    """The default call on a pruned native batch (CUDA, fp16): eager on a key's first call, then captured and
    replayed; the counts are the eager forward's, and so are the logits within fp16 and compiled rounding (the rules
    of ``test_modes.py``'s default-call twin: an image whose decision flipped near a tie is left out)."""
    family, name, keep = GRAPHED_PRUNERS[case]
    model = naflex_model(family).cuda().half()
    pv = ragged_vit.prune(model, name, keep) if keep is not None else PrunedViT(model, name(), "triton")
    if getattr(pv.pruner, "mode", None) == "calibrated":
        pv.calibrate([image.cuda().half() for image in images()])
    eager = PrunedViT(model, pv.pruner, "triton", mode="eager")
    batches = [[image.cuda().half() for image in images(sizes, seed)] for seed, sizes in enumerate((SIZES, SIZES[:2]))]
    same_images = []
    for _ in range(3):
        for batch in batches:
            logits, counts = pv(batch, return_counts=True)
            ref_logits, ref_counts = eager(batch, return_counts=True)
            if case != "l2_calibrated":  # each image's count from its own patches: no score near a threshold
                assert torch.equal(counts, ref_counts), (counts.tolist(), ref_counts.tolist())
            assert (counts - ref_counts).abs().max() <= 8, (counts.tolist(), ref_counts.tolist())
            same = (counts == ref_counts).all(dim=1)
            same_images += same.tolist()
            diff = (logits[same].float() - ref_logits[same].float()).abs()
            assert diff.numel() == 0 or (diff.mean() < 2e-2 and diff.max() < 0.25), (diff.mean(), diff.max())
    counters = pv._runner.counters
    assert pv.last_call == "graphs" and (counters.eager_calls, counters.captures, counters.replays) == (2, 2, 4)
    assert sum(same_images) >= len(same_images) / 2, same_images


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["map", "reg4_avg", "rope_dinov3", "l2_ratio"])
def test_a_replayed_native_call_never_waits_for_the_device_gpu(case):
    """Once a native batch's key replays, the default call queues its work without waiting for the device (no
    synchronising copy: its host integers reach the device through pinned memory), so that back-to-back calls
    overlap: under ``torch.cuda.set_sync_debug_mode("error")`` a replayed call raises nothing, and its outputs are
    the ones of the call before it (the same images)."""
    family, name, keep = GRAPHED_PRUNERS[case] if case in GRAPHED_PRUNERS else (case, "none", None)
    model = naflex_model(family).cuda().half()
    pv = ragged_vit.prune(model, name, keep) if keep is not None else ragged_vit.prune(model, name)
    batch = [image.cuda().half() for image in images()]
    for _ in range(3):  # eager, captured, replayed
        logits, counts = pv(batch, return_counts=True)
    with sync_free():
        again = pv(batch, return_counts=True)
    assert pv.last_call == "graphs" and pv._runner.counters.replays == 3
    assert torch.equal(again[0], logits) and torch.equal(again[1], counts)


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "name"), [*REPLAYED, *((f, "dynamicvit") for f in ROPE_REPLAYED)])
def test_triton_replays_reference_decisions_gpu(family, name):
    """The interpreter twins' check on the GPU (fp32): the compiled kernels, the rotary variant among them."""
    check_triton_replays_reference_decisions(family, name, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["rope_axial_reg4", "rope_dinov3", "rope_eva_class", "rope_mixed", "rope_mrope"])
def test_rope_fp16_against_timm_each_image_gpu(family):
    """RoPE NaFlex in fp16, unpruned and with DynamicViT given the reference backend's fp32 decisions: the Triton
    forward against the fp32 reference within twice timm's own fp16 error on each image alone (the unpruned logits)
    or the reference backend's fp16 error (pruned), plus an fp16 ulp of the logits' scale."""
    model = naflex_model(family).cuda()
    batch = [image.cuda() for image in images()]
    with torch.no_grad(), no_tf32():
        expected = torch.cat([model(image[None]) for image in batch])
        try:
            timm_half = torch.cat([model.half()(image[None].half()) for image in batch])
        except (RuntimeError, TypeError) as error:
            pytest.skip(f"timm {timm.__version__} cannot run {family} in fp16 itself: {str(error).splitlines()[0]}")
        model.float()
        ref = pipeline(model, "dynamicvit", 0.7).run(batch)
    model.half()
    half = [image.half() for image in batch]
    assert_fp16_within_twice(pipeline(model, "none", backend="triton")(half), timm_half, expected)
    pv = pipeline(model, "dynamicvit", 0.7, "triton")
    pruned = pv.run(half, selections=ref.selections)
    pv.backend = "reference"
    peer = pv.run(half, selections=ref.selections)
    assert_fp16_within_twice(pruned.logits, peer.logits, ref.logits)


def test_benchmark_smoke(tmp_path):
    """``python -m benchmarks.naflex --smoke``: every row runs on the CPU, the unpruned ones agree with timm's."""
    from benchmarks import naflex

    out = tmp_path / "naflex.json"
    assert naflex.main(["--smoke", "--batches", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["row"]) for r in rows] == [
        (b, row) for b in (1, 3) for row in ("timm_eager", "ours", "ours_threshold_l2")
    ]
    assert all(r["status"] == "ok" and r["img_per_s"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows if r["row"] != "ours_threshold_l2")
