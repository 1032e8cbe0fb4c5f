"""ToMe's merge stage in the pipelines: ``PrunedViT`` and ``GraphedPrunedViT`` with :class:`ToMeMerger`, against the
reference ToMe forward (:func:`ragged_vit.reference.tome.tome_forward`).

Tolerance rules (CPU, fp32):
* reference backend: the pipeline runs the reference's own decision, merge and attention, so logits equal the
  reference forward's bit for bit, and the counts exactly;
* Triton backend (interpreter): its attention sums in another order than the reference's (``atol = rtol = 1e-5``);
  the decisions are the reference's, so the counts are exact;
* ``GraphedPrunedViT``: fixed ``r`` runs ``PrunedViT.run`` itself (bitwise); adaptive merges run segments on
  capacity buffers, the merge through the Triton kernel (fp32 sums in row order against the reference's float64):
  ``atol = rtol = 1e-5``, counts exact, and the rows no image owns are NaN (any leak makes a logit NaN).

GPU twins (``gpu``): fp32 against the reference forward, graph == eager, the fused matching's counts.
"""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch

from ragged_vit import PrunedViT, build_pipeline
from ragged_vit.core.selection import MergeSelection
from ragged_vit.pipelines import model as model_module
from ragged_vit.pipelines import parts as parts_module
from ragged_vit.pipelines import stages as stages_module
from ragged_vit.pipelines.apps.arguments import pruner_arguments
from ragged_vit.pipelines.apps.cli import build_parser
from ragged_vit.pipelines.apps.cli import main as cli_main
from ragged_vit.pipelines.buckets import TokenBuckets
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.plan import OVERLAP_MAX_IMAGES, Program
from ragged_vit.reference.merging import fixed_r_counts
from ragged_vit.reference.pruners import ToMeMerger, make_pruner
from ragged_vit.reference.tome import bisect_threshold, tome_forward
from ragged_vit.triton_impl import merging as triton_merging
from tests.helpers import no_tf32

AFTER = OVERLAP_MAX_IMAGES + 1  # the least batch whose decisions run after their attention, not beside it

DEPTH = 4
MODES = {"fixed": {"r": 5}, "adaptive": {"threshold": 0.3, "r_max": 6}, "schedule": {"r": [8, 0, 3, 9]}}
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def small_model(pool: str = "token", seed: int = 0, **kwargs: object) -> torch.nn.Module:
    """DeiT-shaped, 4 blocks of width 64, 96x96 images (36 patches): counts vary per image in the adaptive mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=DEPTH, embed_dim=64, num_heads=2,
                                 img_size=96, num_classes=10, global_pool=pool, **kwargs).eval()  # fmt: skip


def images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 96, 96, generator=g) * torch.linspace(0.3, 2.0, n)[:, None, None, None]


def merger(mode: str) -> ToMeMerger:
    return make_pruner("tome", depth=DEPTH, **MODES[mode])


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Fills the rows no image owns of every capacity-mode merge with NaN; records ``(capacity, total)``."""
    real = triton_merging.merge_rows_unchecked
    seen: list[tuple[int, int]] = []

    def merge(x, sizes, sources, offsets, merged_cu, out, out_sizes, log_sizes=None, **offsets_out):
        rows, new_sizes = real(x, sizes, sources, offsets, merged_cu, out, out_sizes, log_sizes, **offsets_out)
        total = int(merged_cu[-1])
        rows[total:] = float("nan")
        new_sizes[total:] = -3
        if log_sizes is not None:
            log_sizes[total:] = float("nan")
        seen.append((rows.shape[0], total))
        return rows, new_sizes

    monkeypatch.setattr(triton_merging, "merge_rows_unchecked", merge)
    return seen


# --- the merger as a pruner --------------------------------------------------------------------------------------


def test_merger_schedule_and_counts():
    fixed = merger("schedule")
    assert fixed.blocks == (0, 2, 3) and fixed.fixed_count and fixed.merges and fixed.needs_keys
    assert [fixed.count_after(s, p, 36) for s, p in enumerate((36, 28, 25))] == [28, 25, 16]
    adaptive = merger("adaptive")
    assert adaptive.blocks == (0, 1, 2, 3) and not adaptive.fixed_count
    assert adaptive.count_after(0, 36, 36) is None and adaptive.max_count_after(1, 30, 36) == 30
    assert repr(fixed) == "ToMeMerger(mode='fixed', r=[8, 0, 3, 9])"
    assert "mode='adaptive', threshold=0.3, r_max=6" in repr(adaptive)
    assert (fixed.mode, adaptive.mode) == ("fixed", "adaptive")


def test_calibrated_merger_waits_for_its_threshold():
    calibrated = ToMeMerger(r_max=[6, 0, 6, 6], rate=0.8, depth=DEPTH)
    assert calibrated.mode == "calibrated" and calibrated.rate == 0.8 and calibrated.threshold is None
    assert calibrated.blocks == (0, 2, 3) and not calibrated.fixed_count and calibrated.merges
    assert calibrated.count_after(0, 36, 36) is None and calibrated.max_count_after(1, 30, 36) == 30
    assert calibrated.capped_counts(36) == [30, 24, 18]  # r_max merged in every stage: the fewest rows
    assert "mode='calibrated', rate=0.8, threshold=None, r_max=[6, 0, 6, 6]" in repr(calibrated)
    with pytest.raises(RuntimeError, match=r"no threshold yet: call PrunedViT\.calibrate\(images\) first"):
        calibrated.check_ready()
    pv = PrunedViT(small_model(), calibrated, "reference")
    assert pv.plan.stages[0].counts.value == "variable"
    with pytest.raises(RuntimeError, match="call PrunedViT.calibrate"):
        pv.run(images(1, 0))
    calibrated.threshold = 0.4  # what calibrate() sets: the mode stays, the merger decides as the adaptive one
    calibrated.check_ready()
    assert calibrated.mode == "calibrated" and "threshold=0.4" in repr(calibrated)
    adaptive = ToMeMerger(threshold=0.4, r_max=[6, 0, 6, 6], depth=DEPTH)
    x = images(3, 8)
    out, ref = pv.run(x), PrunedViT(small_model(), adaptive, "reference").run(x)
    assert torch.equal(out.counts, ref.counts) and torch.equal(out.logits, ref.logits)


def test_from_keep_rate_picks_the_nearest_constant_r():
    # DeiT-B: r=13 leaves 196 - 13 * (1..12) patches after the blocks, mean 111.5 = 0.569 of 196
    assert ToMeMerger.from_keep_rate(0.57, embed_dim=768, num_patches=196).limits == (13,) * 12
    assert ToMeMerger.from_keep_rate(0.5, embed_dim=768, num_patches=196, depth=4, r=7).limits == (7,) * 4
    with pytest.raises(ValueError, match="keep_rate=1.0 maps to r = 0 for tome"):
        ToMeMerger.from_keep_rate(1.0, embed_dim=768, num_patches=196)


def test_from_keep_rate_with_r_max_alone_is_calibrated():
    merger = ToMeMerger.from_keep_rate(0.57, embed_dim=768, num_patches=196, r_max=26)
    assert merger.mode == "calibrated" and merger.rate == 0.57 and merger.limits == (26,) * 12
    assert merger.threshold is None and merger.check_target(196) == 0.57 * 196
    # r_max=4 on 196 patches leaves at least mean(196 - 4 * (1..12)) = 170 rows: 0.5 is out of its reach
    with pytest.raises(ValueError, match=r"keep_rate=0\.5 asks for 98 patch rows.*fewer than the 170.*raise keep_rate"):
        ToMeMerger.from_keep_rate(0.5, embed_dim=768, num_patches=196, r_max=4)
    assert ToMeMerger.from_keep_rate(0.87, embed_dim=768, num_patches=196, r_max=4).rate == 0.87  # 170.5 rows
    with pytest.raises(ValueError, match="keep_rate must be in"):
        ToMeMerger.from_keep_rate(0.0, embed_dim=768, num_patches=196, r_max=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"r": 0}, ValueError, "r must be > 0 in at least one block"),
        ({"r": -1}, ValueError, "r must be"),
        ({"r": 4, "threshold": 0.5}, ValueError, "exclude each other"),
        ({"threshold": 0.5}, ValueError, "r_max must be given"),
        ({"r": [1, 2]}, ValueError, "r must hold one value per block"),
        ({"threshold": "high", "r_max": 2}, TypeError, "threshold must be a float"),
        ({"r_max": 4}, ValueError, "r_max caps the adaptive or the calibrated mode: give threshold or rate"),
        ({"r": 4, "r_max": 4}, ValueError, "r_max caps the adaptive mode"),
        ({"rate": 0.5, "r": 4, "r_max": 6}, ValueError, "rate sets the calibrated mode .*: not with r=4"),
        ({"rate": 0.5, "threshold": 0.3, "r_max": 6}, ValueError, "rate sets the calibrated mode .*: not with thresh"),
        ({"rate": 0.5}, ValueError, "r_max must be given with rate"),
        ({"rate": 1.5, "r_max": 6}, ValueError, r"rate must be in \(0, 1\]"),
        ({"rate": "half", "r_max": 6}, TypeError, "rate must be a float"),
        ({"rate": 0.5, "r_max": 0}, ValueError, "r_max must be > 0 in at least one block"),
    ],
)
def test_merger_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ToMeMerger(depth=DEPTH, **kwargs)


# --- eager pipeline against the reference forward -------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, AFTER])  # 1: the decision beside the attention core (OVERLAP_MAX_IMAGES)
@pytest.mark.parametrize("pool", ["token", "avg"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pipeline_equals_the_reference_forward(mode, pool, batch):
    model, x = small_model(pool), images(batch, 1)
    out = PrunedViT(model, merger(mode), "reference").run(x)
    ref = tome_forward(model, x, **MODES[mode])
    assert torch.equal(out.logits, ref.logits)
    merging = list(merger(mode).blocks)
    assert torch.equal(out.counts, ref.counts.t()[:, merging] - 1)  # prefix rows excluded, merging blocks only
    assert all(isinstance(sel, MergeSelection) for sel in out.selections)
    if mode != "adaptive":
        assert out.counts[0].tolist() == [fixed_r_counts(37, MODES[mode]["r"] if mode == "schedule" else [5] * DEPTH)[
            b] - 1 for b in merging]  # fmt: skip
    elif batch > 1:
        assert len(set(map(tuple, out.counts.tolist()))) > 1, "equal counts: the adaptive case proves little"


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the block of every :func:`packed_mlp_qkv` call of the pipelines' plain parts (an MLP half preparing
    the next block's qkv)."""
    real, calls = parts_module.parts(False), []

    def spy(block, x, following, normed=None):
        calls.append(following)
        return real.mlp_qkv(block, x, following, normed)

    monkeypatch.setattr(model_module, "parts", lambda compiled: dataclasses.replace(real, mlp_qkv=spy))
    return calls


@pytest.mark.parametrize("batch", [1, AFTER])  # 1: the next attention beside its decision
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_each_mlp_half_prepares_the_next_attention(mode, batch, fused_calls, monkeypatch):
    """Every merging block's MLP half also computes the next block's ``norm1`` and qkv (one compiled call under
    ``compile_blocks``: the residual add and the LayerNorm in one kernel), which that block's attention step takes:
    the logits and counts are those of the steps run apart (the program without ``prepare``), bit for bit."""
    pv, x = PrunedViT(small_model(), merger(mode), "reference"), images(batch, 7)
    out = pv.run(x)
    assert fused_calls == list(pv.model.blocks[1:])
    program = pv.program(pv.plan, batch, triton=False)
    apart = Program(tuple(dataclasses.replace(step, prepare=False) for step in program.steps), program.segments)
    monkeypatch.setattr(PrunedViT, "program", lambda *args, **kwargs: apart)
    apart = pv.run(x)
    assert len(fused_calls) == DEPTH - 1  # none more
    assert torch.equal(out.logits, apart.logits) and torch.equal(out.counts, apart.counts)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_triton_backend_and_replayed_merges(mode):
    model, x = small_model("avg"), images(3, 2)
    ref = PrunedViT(model, merger(mode), "reference").run(x)
    pv = PrunedViT(model, merger(mode), "triton")
    out = pv.run(x)
    assert torch.equal(out.counts, ref.counts)
    torch.testing.assert_close(out.logits, ref.logits, **FP32)
    again = pv.run(x, selections=out.selections)
    assert torch.equal(again.logits, out.logits)


def test_replayed_source_lists_are_checked():
    """A replayed merge's source lists: both or neither, int32 of the stage's rows (and one more offset)."""
    pv = PrunedViT(small_model(), merger("fixed"), "reference")
    x = images(2, 5)
    sels = pv.run(x).selections
    rows = sels[0].destination.shape[0]
    good = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows + 1, dtype=torch.int32)
    for sources, offsets in ((good[0], None), (good[0].long(), good[1]), (good[0], good[1][:-1])):
        bad = [dataclasses.replace(sels[0], sources=sources, source_offsets=offsets), *sels[1:]]
        with pytest.raises(ValueError, match=r"selections\[0\]\.sources and \.source_offsets must both be None"):
            pv.run(x, selections=bad)


def test_isolation_bitwise():
    """Image 1 changed (and with it the adaptive counts and the packed length): image 0's logits and counts stay."""
    pv = PrunedViT(small_model(), merger("adaptive"), "reference")
    a, b = images(2, 3), images(2, 4)
    b[0] = a[0]
    out_a, out_b = pv.run(a), pv.run(b)
    assert not torch.equal(out_a.counts[1], out_b.counts[1])
    assert torch.equal(out_a.logits[0], out_b.logits[0]) and torch.equal(out_a.counts[0], out_b.counts[0])


def test_merging_needs_token_or_avg_pooling_and_a_biased_backend():
    with pytest.raises(ValueError, match="'max'.*'token' and 'avg'"):
        PrunedViT(small_model("max"), merger("fixed"))
    pv = PrunedViT(small_model(), merger("fixed"), "reference")
    pv.backend.capabilities = type(pv.backend.capabilities)(key_bias=False)  # this instance only
    with pytest.raises(ValueError, match="backend 'reference' takes no key_bias"):
        pv.run(images(1, 0))


def test_replay_refuses_keep_masks():
    pv = PrunedViT(small_model(), merger("fixed"), "reference")
    keep = PrunedViT(small_model(), make_pruner("evit", rate=0.5, blocks=(0, 1, 2, 3)), "reference").run(images(1, 0))
    with pytest.raises(TypeError, match=r"selections\[0\] must be a MergeSelection"):
        pv.run(images(1, 0), selections=keep.selections)


def test_build_pipeline_and_prune_take_tome():
    pv = build_pipeline("deit_tiny_patch16_224", pruner="tome", keep_rate=0.57, backend="reference")
    assert pv.pruner.limits == (13,) * 12 and pv.num_stages == 12
    pv = build_pipeline("deit_tiny_patch16_224", pruner="tome", backend="reference", threshold=0.8, r_max=16)
    assert pv.pruner.threshold == 0.8 and pv.plan.stages[0].counts.value == "variable"
    pv = build_pipeline("deit_tiny_patch16_224", pruner="tome", keep_rate=0.57, backend="reference", r_max=26)
    assert pv.pruner.mode == "calibrated" and pv.pruner.rate == 0.57 and pv.pruner.limits == (26,) * 12
    assert pv.pruner.threshold is None and pv.plan.stages[0].counts.value == "variable"


# --- calibrated mode: PrunedViT.calibrate ---------------------------------------------------------------------


def calibrated_pipeline(rate: float, r_max: int | list[int] = 6, pool: str = "token") -> PrunedViT:
    return PrunedViT(small_model(pool), ToMeMerger(r_max=r_max, rate=rate, depth=DEPTH), "reference")


@pytest.mark.parametrize("rate", [0.65, 0.8])
def test_calibrate_hits_the_mean_count_deciding_per_image(rate):
    pv, x = calibrated_pipeline(rate), images(8, 11)
    target = rate * 36  # patch rows per image and stage (r_max=6 merging everywhere leaves 21 = 0.58 of 36)
    threshold = pv.calibrate(x)
    assert threshold == pv.pruner.threshold and -2 < threshold < 2 and pv.pruner.mode == "calibrated"
    out = pv.run(x)
    assert abs(out.counts.double().mean().item() - target) <= 1.0
    assert len(set(map(tuple, out.counts.tolist()))) > 1, "equal counts: the calibration decides per image"
    ref = tome_forward(pv.model, x, threshold=threshold, r_max=6)  # the adaptive mode at that threshold
    assert torch.equal(out.counts, ref.counts.t() - 1) and torch.equal(out.logits, ref.logits)


def test_calibrate_ends_need_no_forward():
    x = images(2, 12)
    for rate, r_max, threshold, counts in [(1.0, 6, 2.0, [36] * 4), (0.75, [9, 0, 0, 0], -2.0, [27])]:
        pv = calibrated_pipeline(rate, r_max)  # every patch kept / r_max merged in every stage: known on the host
        forwards = []
        real_run = pv.run
        pv.run = lambda *a, real_run=real_run, forwards=forwards, **k: forwards.append(1) or real_run(*a, **k)
        assert pv.calibrate(x) == threshold and forwards == []
        assert pv.run(x).counts.tolist() == [counts] * 2


def test_bisection_stops_at_an_exact_hit_and_keeps_the_best():
    calls = []

    def step(t: float) -> float:  # rows above the target: 0 at 0.5 exactly
        calls.append(t)
        return 0.0 if t == 0.5 else 1.0 if t > 0.5 else -1.0

    assert bisect_threshold(step, -4.0, 5.0) == 0.5 and calls == [0.0, 1.0, 0.5]
    calls.clear()
    best = bisect_threshold(lambda t: calls.append(t) or t - 0.3, -2.3, 1.7)
    assert len(calls) == 30 and abs(best - 0.3) <= 4 / 2**30
    calls.clear()
    assert bisect_threshold(lambda t: calls.append(t) or 3.0, -0.5, 7.0) == -2.0  # no mid beats an end
    assert len(calls) == 30


def test_calibrate_errors_and_keeps_the_old_threshold():
    out_of_reach = r"rate=0\.5 asks for 18 patch rows per image and stage of 36, fewer than the 21 that r_max=6"
    with pytest.raises(ValueError, match=out_of_reach):
        calibrated_pipeline(0.5).calibrate(images(2, 0))
    with pytest.raises(ValueError, match=r"calibrate\(\) needs a merger in the calibrated mode .* has mode='adaptive'"):
        PrunedViT(small_model(), merger("adaptive"), "reference").calibrate(images(2, 0))
    pv = calibrated_pipeline(0.8)
    pv.pruner.threshold = 0.25
    with pytest.raises(ValueError, match="images must have shape"):
        pv.calibrate(torch.zeros(2, 3, 64, 64))
    assert pv.pruner.threshold == 0.25
    tried = []
    real_run = pv.run

    def interrupted(*args: object, **kwargs: object):
        tried.append(pv.pruner.threshold)
        if len(tried) == 3:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    pv.run = interrupted  # this instance only
    with pytest.raises(KeyboardInterrupt):
        pv.calibrate(images(2, 0))
    assert tried[0] == 0.0 and abs(tried[1]) == 1.0 and pv.pruner.threshold == 0.25  # the old one is back


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on the NaN padding rows
def test_graphed_calibrated_merger_needs_reset_after_recalibrating():
    pv = PrunedViT(small_model(), ToMeMerger(r_max=6, rate=0.75, depth=DEPTH), "triton")
    twin = PrunedViT(pv.model, pv.pruner, "reference")  # the same model and merger: calibrates without interpreting
    runner = GraphedPrunedViT(pv, TokenBuckets(step=6, seqlen_step=4, sync_free_rows=0))
    x = images(2, 13)
    with pytest.raises(RuntimeError, match="call PrunedViT.calibrate"):
        runner.run(x)
    first = twin.calibrate(images(4, 14))
    out, ref = runner.run(x), pv.run(x)
    assert torch.equal(out.counts, ref.counts)
    torch.testing.assert_close(out.logits, ref.logits, **FP32)
    assert twin.calibrate(images(4, 15)) != first and pv.pruner.threshold != first
    with pytest.raises(RuntimeError, match="call reset"):
        runner.run(x)
    runner.reset()
    assert torch.equal(runner.run(x).counts, pv.run(x).counts)


# --- graphs (segments run eagerly on a CPU) ------------------------------------------------------------------------


@pytest.mark.interpreter
def test_graphed_fixed_r_runs_the_pipeline_itself():
    pv = PrunedViT(small_model(), merger("fixed"), "triton")
    x = images(2, 5)
    out, ref = GraphedPrunedViT(pv).run(x), pv.run(x)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.counts, ref.counts)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on the NaN padding rows
@pytest.mark.parametrize(  # quick: no-reads in test_graphed_merges_take_the_residual_add_and_norm2 (the same runner)
    "reads",
    [
        pytest.param({"sync_free_rows": 0}, id="reads"),
        pytest.param({"sync_free_rows": 10_000}, id="no-reads", marks=pytest.mark.full),
        pytest.param({"lagged_reads": True}, id="lagged"),
    ],
)
def test_graphed_adaptive_merges_match_eager_with_nan_padding(reads, poisoned, fused_calls):
    pv = PrunedViT(small_model("avg"), merger("adaptive"), "triton")
    runner = GraphedPrunedViT(pv, TokenBuckets(step=6, seqlen_step=4, **reads))
    x = images(3, 6)
    out = runner.run(x)
    assert fused_calls == list(pv.model.blocks[1:])  # inside the segments too: each MLP prepares the next qkv
    ref = pv.run(x)
    assert torch.equal(out.counts, ref.counts)
    assert bool(torch.isfinite(out.logits).all())
    torch.testing.assert_close(out.logits, ref.logits, **FP32)
    assert any(cap > total for cap, total in poisoned), "no padding rows: the test proves nothing"


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on unwritten padding rows
@pytest.mark.parametrize(
    "sync_free_rows, norm_rows", [(0, 1024), (10_000, 1024), (10_000, 10)], ids=["reads", "no-reads", "large"]
)
def test_graphed_merges_take_the_residual_add_and_norm2(sync_free_rows, norm_rows, monkeypatch):
    """In the graph runner the merge kernel takes each plain block's attention residual add, and writes the block's
    ``norm2`` of the merged rows for its MLP when the merge stays inside one graph (a merge into the static buffers
    before a read leaves that LayerNorm to the next graph's MLP) and its buffer has at most ``MERGE_NORM_MAX_ROWS``
    rows; a block whose ``norm2`` has a hook runs its module path, unfused. The logits are the eager forward's (the
    CPU's reference merge, unfused) to fp32 rounding."""
    monkeypatch.setattr(stages_module, "MERGE_NORM_MAX_ROWS", norm_rows)
    calls = []
    real = triton_merging.merge_rows_unchecked

    def merge(*args, **kwargs):
        calls.append(("residual" in kwargs, "normed" in kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_merging, "merge_rows_unchecked", merge)
    pv = PrunedViT(small_model("avg"), merger("adaptive"), "triton")
    hooked = []
    pv.model.blocks[2].norm2.register_forward_pre_hook(lambda _module, _args: hooked.append(1))
    runner = GraphedPrunedViT(pv, TokenBuckets(step=6, seqlen_step=4, sync_free_rows=sync_free_rows))
    x = images(3, 8)
    out = runner.run(x)
    fused = (True, sync_free_rows > 0 and norm_rows > 3 * 37)  # with reads every merge goes into static buffers
    assert calls == [fused, fused, (False, False), fused] and hooked
    ref = pv.run(x)
    assert torch.equal(out.counts, ref.counts)
    torch.testing.assert_close(out.logits, ref.logits, **FP32)


# --- CLI ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--r", "4", "--threshold", "0.5"], "argument --threshold: tome merges a fixed --r or by --threshold"),
        (["--r", "4", "--r-max", "4"], "argument --r-max: caps tome's adaptive or calibrated mode, not a fixed --r"),
        (["--threshold", "0.5"], "argument --threshold: tome's adaptive mode needs --r-max too"),
        (["--keep-rate", "0.5", "--r", "4"], "argument --keep-rate: not used with --r or --threshold"),
        (["--keep-rate", "0.5", "--threshold", "0.4", "--r-max", "4"], "argument --keep-rate: not used with --r or"),
        (["--threshold-mode", "ratio"], "argument --threshold-mode: not an option of --pruner tome"),
        (["--r", "0"], "argument --r: must be a positive integer"),
    ],
)
def test_cli_tome_flag_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--device", "cpu", "--pruner", "tome", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, options",
    [
        (["--r-max", "8"], {"r_max": 8}),  # calibrated at the default keep rate
        (["--r-max", "8", "--keep-rate", "0.7"], {"r_max": 8}),
        (["--threshold", "0.4", "--r-max", "8"], {"threshold": 0.4, "r_max": 8}),
        (["--r", "8"], {"r": 8}),
    ],
)
def test_cli_tome_modes_parse(argv, options):
    parser = build_parser()
    args = parser.parse_args(["--device", "cpu", "--pruner", "tome", *argv])
    assert pruner_arguments(parser, args) == options


def test_cli_calibrated_tome_runs_the_demo(capsys):
    pytest.importorskip("skimage")
    argv = ["--pruner", "tome", "--r-max", "16", "--keep-rate", "0.7", "--images", "chelsea", "--backends",
            "reference", "--device", "cpu", "--timed-runs", "1", "--warmup", "0"]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("pruner: tome"))
    assert "mode='calibrated', rate=0.7, threshold=" in line and "threshold=None" not in line
    kept = [int(k) for k in out.split("Top-1 per image", 1)[1].split(": kept ", 1)[1].split(":", 1)[0].split("/")]
    assert len(kept) == 12 and abs(sum(kept) / 12 - 0.7 * 196) <= 1.0  # one image: its own mean is the target


def test_cli_r_is_an_option_of_tome_only(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--device", "cpu", "--pruner", "evit", "--r", "4"])
    assert "argument --r: not an option of --pruner evit" in capsys.readouterr().err


# --- GPU twins ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_gpu_fp32_equals_the_reference_forward(mode, batch):
    model, x = small_model("avg").cuda(), images(batch, 7).cuda()
    with torch.no_grad(), no_tf32():
        ref = tome_forward(model, x, **MODES[mode])
        out = PrunedViT(model, merger(mode), "triton").run(x)
    assert torch.equal(out.counts, ref.counts.t()[:, list(merger(mode).blocks)] - 1)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_rows", [1024, 0], ids=["norm-in-merge", "norm-in-mlp"])
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
@pytest.mark.parametrize("batch", [1, AFTER])
def test_gpu_compiled_graphs_equal_the_reference_forward(batch, mode, norm_rows, monkeypatch):
    """``compile_blocks`` inside the graph runner, fp32, against the reference forward: every fused path (the next
    block's qkv in the MLP's compiled call; the residual add in the merge, ``norm2`` there or, in buffers of more than
    ``MERGE_NORM_MAX_ROWS`` rows, in the MLP), with the decision beside the attention core (B = 1) or after it."""
    monkeypatch.setattr(stages_module, "MERGE_NORM_MAX_ROWS", norm_rows)
    model, x = small_model("avg").cuda(), images(batch, 9).cuda()
    with torch.no_grad(), no_tf32():
        ref = tome_forward(model, x, **MODES[mode])
        out = GraphedPrunedViT(PrunedViT(model, merger(mode), "triton", compile_blocks=True)).run(x)
    assert torch.equal(out.counts, ref.counts.t()[:, list(merger(mode).blocks)] - 1)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fixed", "adaptive", "adaptive-lagged"])
@pytest.mark.parametrize("batch", [1, AFTER])
def test_gpu_graph_equals_eager(mode, batch):
    """Graphs against eager, fresh images every call; the lagged reads wait on events, not on the stream."""
    pv = PrunedViT(small_model("token").cuda().half(), merger(mode.split("-")[0]), "triton")
    runner = GraphedPrunedViT(pv, TokenBuckets(step=16, lagged_reads=mode.endswith("lagged")))
    for seed in range(3):  # new images every call: the replays read the static input
        x = images(batch, 20 + seed).cuda().half()
        out, ref = runner.run(x), pv.run(x)
        assert torch.equal(out.counts, ref.counts)
        if mode == "fixed":
            assert torch.equal(out.logits, ref.logits)
        else:  # capacity buffers: the GEMMs may pick other kernels for other row counts
            torch.testing.assert_close(out.logits, ref.logits, atol=2e-3, rtol=2e-3)
    assert runner.counters.captures >= 1 and runner.counters.replays >= 3
