"""CPU tests of the CUDA-graph runner: token buckets and the segmented forward with its padding image (nothing is
captured on a CPU: :class:`GraphedPrunedViT` runs every segment eagerly, on the same static buffers and through the same
code a graph records).

Models: a tiny timm ViT (32x32 images, 8x8 patches: N = 17 rows, six blocks, two heads of 32) so that Triton's
interpreter stays fast, plus DeiT-Tiny for the default schedules. fp32 throughout.

Tolerance rules:
* segmented vs ``PrunedViT.run``: counts exact; logits ``atol = rtol = 1e-5``. The segments run the same per-row
  and per-image arithmetic on a buffer of ``capacity`` rows instead of ``total``, and the CPU GEMM picks its kernel
  by row count (observed: bitwise when the counts coincide, else <= 6e-8); ``padded_sdpa`` also pads to a bucketed
  ``max_seqlen`` instead of the exact longest.
* padding rows are NaN (every capacity-mode repack is wrapped to fill them): any leak makes real logits NaN.
* fixed counts: the runner calls ``PrunedViT.run`` itself, so bitwise.

The GPU twins (capture, replay, sync-freedom, memory) are in ``test_graphs_gpu.py``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ragged_vit import PrunedViT, build_pipeline
from ragged_vit.pipelines import executor as executor_module
from ragged_vit.pipelines import model as model_module
from ragged_vit.pipelines.buckets import AUTO_SYNC_FREE_ROWS, TokenBuckets, padding_images
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.stages import HostCounts
from ragged_vit.reference.pruners import make_pruner
from ragged_vit.triton_impl import pack as triton_pack
from tests.helpers import as_on_cuda, levels, tiny_images, tiny_pipeline

TOKENS = 17  # the tiny ViT: 16 patches + CLS
VARIABLE = {
    "ats": lambda: make_pruner("ats", blocks=(1, 2, 3, 4, 5), num_samples=12, min_keep=2),
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, min_keep=1, block=1),
}
FIXED = {
    "none": lambda: None,
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 3)),
    "evit_fused": lambda: make_pruner("evit", rate=0.6, blocks=(1, 3), fuse_token=True),
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="ratio", rate=0.5, block=2),
}
FP32 = {"atol": 1e-5, "rtol": 1e-5}
# The Triton backend runs under the interpreter here (the costly items): at the quick level every other backend runs
# each case, Triton the cases named per test; --full: every case on every backend.



def calibrated(pv: PrunedViT) -> PrunedViT:
    if getattr(pv.pruner, "mode", None) == "calibrated":
        pv.calibrate(tiny_images(8, 99))
    return pv


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Fills the rows no image owns of every capacity-mode repack with NaN; records ``(capacity, total)``."""
    real = triton_pack.repack_unchecked
    seen: list[tuple[int, int]] = []

    def repack(*args: object, capacity: int | None = None, padding_images: int = 0, **kwargs: object):
        out, cu, bound = real(*args, capacity=capacity, padding_images=padding_images, **kwargs)
        total = int(cu[cu.numel() - 1 - padding_images])  # the real images' end; padding offsets follow
        out[total:] = float("nan")
        seen.append((out.shape[0], total))
        return out, cu, bound

    monkeypatch.setattr(triton_pack, "repack_unchecked", repack)
    return seen


def assert_same(out, ref) -> None:
    assert torch.equal(out.counts, ref.counts)
    assert bool(torch.isfinite(out.logits).all())
    torch.testing.assert_close(out.logits, ref.logits, **FP32)


# --- token buckets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,tokens", [(1, 197), (4, 197), (64, 197), (3, 17), (2, 577)])
@pytest.mark.parametrize("buckets", [TokenBuckets(), TokenBuckets(step=128), TokenBuckets(step=16, growth=1.3)])
def test_capacities_cover_every_total_with_short_padding(buckets, batch, tokens):
    caps = buckets.capacities(batch, tokens)
    assert list(caps) == sorted(set(caps)) and caps[0] >= batch and caps[-1] == batch * tokens
    assert all(b - a <= min(buckets.step, tokens) for a, b in zip(caps[:-1], caps[1:], strict=True))
    for total in range(batch, batch * tokens + 1):
        cap = buckets.capacity(total, batch, tokens)
        assert cap in caps and cap >= total
        assert cap - total < min(buckets.step, tokens)  # the padding image is shorter than an unpruned image
        smaller = [c for c in caps if c < cap]
        assert not smaller or smaller[-1] < total  # the smallest that fits


def test_linear_buckets_are_multiples_of_step():
    assert TokenBuckets(step=64).capacities(4, 197) == (64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 788)
    assert TokenBuckets(step=64).capacities(1, 197) == (64, 128, 192, 197)
    assert TokenBuckets(step=1000).capacities(2, 17) == (17, 34)  # the gap is clamped to N


@pytest.mark.parametrize("total,expected", [(1, 64), (64, 64), (65, 128), (192, 192), (193, 197), (197, 197)])
def test_bucket_boundaries(total, expected):
    assert TokenBuckets(step=64).capacity(total, 1, 197) == expected


def test_geometric_buckets_grow_by_the_ratio_until_the_step():
    caps = TokenBuckets(step=32, growth=1.5).capacities(1, 197)
    assert caps[:8] == (1, 2, 3, 5, 8, 12, 18, 27)
    gaps = [b - a for a, b in zip(caps[:-1], caps[1:], strict=True)]
    assert max(gaps) == 32 and gaps[-1] <= 32


@pytest.mark.parametrize(
    "longest,tokens,expected", [(1, 197, 32), (32, 197, 32), (33, 197, 64), (190, 197, 192), (193, 197, 197)]
)
def test_seqlen_bound(longest, tokens, expected):
    bound = TokenBuckets(seqlen_step=32).seqlen_bound(longest, tokens)
    assert bound == expected and longest <= bound <= max(tokens, longest)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"step": 0}, ValueError),
        ({"growth": 0.9}, ValueError),
        ({"growth": True}, TypeError),
        ({"seqlen_step": 0}, ValueError),
        ({"sync_free_rows": -1}, ValueError),
        ({"lagged_reads": 1}, TypeError),
        ({"lagged_reads": True, "sync_free_rows": 64}, ValueError),
    ],
)
def test_buckets_reject_bad_settings(kwargs, error):
    with pytest.raises(error):
        TokenBuckets(**kwargs)


@pytest.mark.parametrize(
    "case,rows", [("ats", AUTO_SYNC_FREE_ROWS), ("threshold_l2", 0)], ids=["several-stages", "one-stage"]
)
def test_default_buckets_skip_reads_only_for_several_variable_stages(case, rows):
    runner = GraphedPrunedViT(tiny_pipeline(VARIABLE[case]))
    assert runner.buckets == TokenBuckets(sync_free_rows=rows)
    given = TokenBuckets(step=8)
    assert GraphedPrunedViT(tiny_pipeline(VARIABLE[case]), given).buckets is given


def test_sync_free_rows_and_padding_images():
    assert TokenBuckets().rereads_after(1) and not TokenBuckets(sync_free_rows=256).rereads_after(256)
    assert TokenBuckets(sync_free_rows=256).rereads_after(257)
    # Enough N-row images to cover capacity - B rows (each image keeps at least its CLS row), at least one.
    assert padding_images(4, 4, 197) == 1 and padding_images(197, 1, 197) == 1 and padding_images(199, 1, 197) == 2
    assert padding_images(788, 4, 197) == 4
    with pytest.raises(ValueError, match="capacity"):
        padding_images(3, 4, 197)


@pytest.mark.parametrize("total", [0, 789, True])
def test_capacity_rejects_impossible_totals(total):
    with pytest.raises(ValueError, match="total"):
        TokenBuckets().capacity(total, 4, 197)


# --- the segmented forward: padding image, buckets, batch sizes ------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on the NaN padding rows
@pytest.mark.parametrize(
    "case,backend",
    levels([(c, b) for c in VARIABLE for b in ("reference", "padded_sdpa", "triton")],
           lambda c, b: b != "triton" or c == "threshold_l2", ids=lambda c, b: f"{c}-{b}"),
)  # fmt: skip
def test_segments_match_eager_with_nan_padding(case, backend, poisoned):
    pv = calibrated(tiny_pipeline(VARIABLE[case], backend))
    runner = GraphedPrunedViT(pv, TokenBuckets(step=5, seqlen_step=4))
    images = tiny_images(3, 1)
    out, ref = runner.run(images), pv.run(images)
    assert_same(out, ref)
    assert any(cap > total for cap, total in poisoned), "no padding rows: the test proves nothing"
    assert runner.counters.eager_segments == len(runner.plan.segments) and runner.counters.captures == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "padded_sdpa", "triton"])
def test_empty_padding_image(backend, poisoned):
    """``step=1``: every capacity equals its total, so the padding image has no rows at all."""
    pv = tiny_pipeline(VARIABLE["ats"], backend)
    images = tiny_images(3, 2)
    out = GraphedPrunedViT(pv, TokenBuckets(step=1, seqlen_step=1)).run(images)
    assert_same(out, pv.run(images))
    assert poisoned and all(cap == total for cap, total in poisoned)


@pytest.mark.interpreter
@pytest.mark.parametrize("buckets", [TokenBuckets(step=4, seqlen_step=4), TokenBuckets(step=8, growth=1.5)])
def test_mixed_batch_sizes_and_changing_inputs(buckets, poisoned):
    """One runner, batch sizes 1/3/2 interleaved, new images every call: every result equals the eager one and
    stays intact after later calls; the totals cross bucket boundaries."""
    pv = tiny_pipeline(VARIABLE["ats"])
    runner = GraphedPrunedViT(pv, buckets)
    results = []
    for seed, batch in enumerate([1, 3, 2, 3, 1, 2]):
        images = tiny_images(batch, 10 + seed)
        out = runner.run(images)
        assert_same(out, pv.run(images))
        results.append((out, out.logits.clone()))
    assert all(torch.equal(out.logits, kept) for out, kept in results)  # outputs are clones, not the buffers
    assert len({cap for cap, _ in poisoned}) > 3
    assert sorted(runner._buffers) == [(1, 32, 32), (2, 32, 32), (3, 32, 32)]  # by (B, H, W)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "backend,first_read",
    levels([(b, r) for b in ("reference", "padded_sdpa", "triton") for r in (True, False)],
           lambda b, r: b != "triton" or not r, ids=lambda b, r: f"{b}-{'one-read' if r else 'no-read'}"),
)  # fmt: skip
def test_stages_without_a_read_run_as_one_chain(backend, first_read, poisoned, monkeypatch):
    """``sync_free_rows``: from the first stage whose input has at most that many rows on, ATS's stages take that
    capacity, or ``B`` times ATS's own bound on an image's rows (12 samples: 13 rows) if smaller, without reading
    their totals (below ``B * N``: the first stage reads, the others do not; from ``B * N`` on: no stage reads),
    and run as one chain (one graph on a GPU), handing decisions over directly; the growing padding (NaN) spans
    several padding images of at most 13 rows; results unchanged."""
    pv = tiny_pipeline(VARIABLE["ats"], backend)
    rows = 4 * TOKENS - 1 if first_read else 4 * TOKENS
    runner = GraphedPrunedViT(pv, TokenBuckets(step=TOKENS, seqlen_step=4, sync_free_rows=rows))
    bound = 13
    assert runner.plan.row_bounds == (TOKENS, *[bound] * 5)
    chains = []
    real_chain = runner._chain

    def chain(bufs, shapes):
        chains.append(shapes)
        real_chain(bufs, shapes)

    monkeypatch.setattr(runner, "_chain", chain)
    images = tiny_images(4, 5)
    assert_same(runner.run(images), pv.run(images))
    assert [[s.index for s in c] for c in chains] == ([[0], [1, 2, 3, 4, 5]] if first_read else [list(range(6))])
    free = chains[-1][1:]  # the segments after the last read
    capacity = chains[1][0].capacity if first_read else 4 * bound
    assert all(s.capacity == capacity and s.max_seqlen == bound for s in free)
    assert all(s.pads == padding_images(capacity, 4, bound) for s in free)
    assert len(poisoned) == 5 and {cap for cap, _ in poisoned} == {capacity}  # one capacity for every stage
    assert any(cap - total > bound for cap, total in poisoned), "padding never outgrew one image"
    assert runner.counters.eager_segments == len(chains)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_chained_segments_equal_separate_ones(monkeypatch):
    """A chain hands each decision to the next segment in memory, with the next MLP half already applied to every
    row (it ran beside the decision); separate graphs pass the decision through the static buffers and run the
    MLP after the repack: the same capacities give the same logits (bit for bit on the CPU)."""
    pv = tiny_pipeline(VARIABLE["ats"], "triton")
    images = tiny_images(3, 8)
    chained = GraphedPrunedViT(pv, TokenBuckets(sync_free_rows=3 * TOKENS))
    beside = []
    real_beside = executor_module.beside

    def spy(device, side, main):
        beside.append(device)
        return real_beside(device, side, main)

    monkeypatch.setattr(executor_module, "beside", spy)  # what every runner below calls
    out = chained.run(images)
    assert len(beside) == len(pv.pruner.blocks)  # every decision of the chain
    separate = GraphedPrunedViT(pv, TokenBuckets(sync_free_rows=3 * TOKENS))
    separate._launch_chain = lambda bufs, chain: [  # noqa: E731 - one graph per segment, same shapes
        GraphedPrunedViT._launch_chain(separate, bufs, [shape]) for shape in chain
    ]
    ref = separate.run(images)
    assert chained.counters.eager_segments == 1 and separate.counters.eager_segments == len(pv.pruner.blocks) + 1
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.counts, ref.counts)
    serial = GraphedPrunedViT(pv, TokenBuckets(sync_free_rows=3 * TOKENS), overlap_decisions=False)
    beside.clear()
    out_serial = serial.run(images)
    assert not beside and serial.counters.eager_segments == 1  # one chain, MLP halves after the repacks
    assert torch.equal(out_serial.logits, ref.logits) and torch.equal(out_serial.counts, ref.counts)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "case,backend",
    levels([(c, b) for c in VARIABLE for b in ("reference", "triton")],
           lambda c, b: b != "triton" or c == "threshold_l2", ids=lambda c, b: f"{c}-{b}"),
)  # fmt: skip
def test_lagged_reads_size_each_segment_by_the_total_before(case, backend, poisoned, monkeypatch):
    """``lagged_reads``: one graph per segment; segment 1 at the plan's bound, segment ``j`` at the capacity of stage
    ``j - 2``'s total (read late), which holds stage ``j - 1``'s; padding (NaN) spread over padding images; results
    equal the eager pipeline's."""
    pv = calibrated(tiny_pipeline(VARIABLE[case], backend))
    buckets = TokenBuckets(step=4, seqlen_step=4, lagged_reads=True)
    runner = GraphedPrunedViT(pv, buckets)
    shapes, reads = [], []
    real_chain, real_read = runner._chain, HostCounts.read

    def chain(bufs, chained):
        shapes.extend(chained)
        real_chain(bufs, chained)

    def read(counts, stage):
        reads.append(real_read(counts, stage))
        return reads[-1]

    monkeypatch.setattr(runner, "_chain", chain)
    monkeypatch.setattr(HostCounts, "read", read)
    images = tiny_images(4, 9)
    out, ref = runner.run(images), pv.run(images)
    assert_same(out, ref)
    plan, stages = runner.plan, len(runner.plan.stages)
    assert [s.index for s in shapes] == list(range(stages + 1)) and len(reads) == max(stages - 1, 0)
    if stages > 1:
        assert shapes[1].capacity == 4 * plan.row_bounds[1]
        for index in range(2, stages + 1):
            total = reads[index - 2][0]
            assert shapes[index].capacity == min(buckets.capacity(total, 4, TOKENS), 4 * plan.row_bounds[index])
    kept = (ref.counts + plan.num_prefix).sum(0).tolist()  # each stage's real total
    assert all(shape.capacity >= total for shape, total in zip(shapes[1:], kept, strict=True))
    assert all(cap >= total for cap, total in poisoned)


@pytest.mark.interpreter
def test_a_stage_total_never_written_raises_instead_of_waiting():
    """The host polls each stage's row of ``stats`` until its kernel writes it; a row still unwritten once the
    stream is done (here: the CPU, where every launch has run) is an error, never an endless wait."""
    pv = tiny_pipeline(VARIABLE["ats"], "triton")
    runner = GraphedPrunedViT(pv, TokenBuckets(step=4, seqlen_step=4))  # a read at every stage
    images = tiny_images(2, 5)
    runner.run(images)
    bufs = runner._buffers[(2, *images.shape[-2:])]
    assert bufs.stats.read(0) == tuple(bufs.stats.rows[0, :2].tolist())  # written by the run
    bufs.stats.clear()
    with pytest.raises(RuntimeError, match="row 0's kept total was never written"):
        bufs.stats.read(0)


@pytest.mark.interpreter
def test_variable_stage_with_an_extra_token_is_refused():
    pruner = make_pruner("evit", rate=0.5, blocks=(1, 3), fuse_token=True)
    pruner.fixed_count = False
    with pytest.raises(NotImplementedError, match="extra token"):
        GraphedPrunedViT(tiny_pipeline(lambda: pruner)).run(tiny_images(2, 3))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_deit_tiny_ats_default_buckets(poisoned):
    """DeiT-Tiny's own ATS schedule (nine mid-block stages) with the default buckets."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pv = build_pipeline("deit_tiny_patch16_224", "ats", 0.5, "reference")
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(4))
    assert_same(GraphedPrunedViT(pv).run(images), pv.run(images))
    assert len(poisoned) == 9


# --- the eager forward's bounded repack (sized as the segments are, without graphs) -----------------------------


@pytest.fixture
def triton_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrunedViT`` packs with the Triton kernels on the CPU too (under the interpreter), and decides with the fused
    decisions, as it does on CUDA."""
    as_on_cuda(monkeypatch)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "case,sync_free_rows,backend",
    levels([(c, n, b) for c in VARIABLE for n in (0, 40, 1024) for b in ("padded_sdpa", "triton")],
           lambda c, n, b: b != "triton" or (c, n) in (("ats", 40), ("threshold_l2", 1024)),
           ids=lambda c, n, b: f"{c}-{ {0: 'reads', 40: 'first-read', 1024: 'no-read'}[n]}-{b}"),
)  # fmt: skip
def test_lean_forward_bounds_capacities_like_the_segments(case, sync_free_rows, backend, poisoned, triton_packing,
                                                           monkeypatch):  # fmt: skip
    """``PrunedViT.forward`` (no selections to record): a stage reads its own total only when nothing bounds it below
    its input's rows (no pruner bound, more than ``sync_free_rows`` rows, no earlier stage unread; Threshold-L2
    calibrated), else it takes the smaller of its input's rows and ``B`` times the plan's bound (ATS: 12 samples, 13
    rows); padding rows (NaN) never reach the real images' logits or counts, which equal ``run``'s."""
    monkeypatch.setattr(model_module, "default_sync_free_rows", lambda stages: sync_free_rows)
    pv = calibrated(tiny_pipeline(VARIABLE[case], backend))
    images = tiny_images(4, 7)
    ref = pv.run(images)
    del poisoned[:]  # run()'s own repacks: exact
    logits, counts = pv(images, return_counts=True)
    assert_same(SimpleNamespace(logits=logits, counts=counts), ref)
    totals = (ref.counts + 1).sum(0).tolist()  # each stage's real total (one CLS row per image)
    bounds, expected, rows, may_read = pv.plan.row_bounds, [], 4 * TOKENS, True
    for index, total in enumerate(totals):
        capacity = min(rows, 4 * bounds[index + 1])
        if may_read and capacity == rows > sync_free_rows:
            rows = total
        else:
            rows, may_read = capacity, False
        expected.append(rows)
    assert [(cap, total) for cap, total in poisoned] == list(zip(expected, totals, strict=True))
    assert any(cap > total for cap, total in poisoned) == (case == "ats" or sync_free_rows == 1024)


@pytest.mark.interpreter
def test_lean_forward_only_with_backends_that_take_padding_images(triton_packing, poisoned):
    """``reference`` (and ``nested_sdpa``) read the host at every call anyway: ``pv(images)`` repacks exactly."""
    pv = tiny_pipeline(VARIABLE["ats"], "reference")
    images = tiny_images(4, 7)
    logits, counts = pv(images, return_counts=True)
    assert poisoned and all(cap == total for cap, total in poisoned)
    assert torch.equal(counts, pv.run(images).counts)


@pytest.mark.interpreter
def test_lean_forward_repacks_a_variable_stage_with_an_extra_token_exactly(triton_packing, poisoned, monkeypatch):
    """A padding image cannot hold an appended token after the real rows: such a stage reads its total (exact)."""
    pruner = make_pruner("evit", rate=0.5, blocks=(1, 3), fuse_token=True)
    pruner.fixed_count = False
    decide = pruner.decide
    monkeypatch.setattr(pruner, "decide", lambda inp: dataclasses.replace(decide(inp), fixed_count=False, count=None))
    pv = tiny_pipeline(lambda: pruner, "triton")
    images = tiny_images(2, 3)
    logits, counts = pv(images, return_counts=True)
    assert poisoned and all(cap == total for cap, total in poisoned)
    ref = pv.run(images)
    assert torch.equal(counts, ref.counts) and torch.equal(logits, ref.logits)


# --- fixed counts, fallback, outputs, memory ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(FIXED))
def test_fixed_counts_run_the_pipeline_itself(case):
    pv = tiny_pipeline(FIXED[case])
    runner = GraphedPrunedViT(pv)
    assert runner.plan.fixed
    for batch, seed in [(2, 1), (1, 2), (2, 3)]:
        images = tiny_images(batch, seed)
        logits, counts = runner(images, return_counts=True)
        ref = pv.run(images)
        assert torch.equal(logits, ref.logits) and torch.equal(counts, ref.counts)
    assert runner.counters.eager_segments == 3


def test_batch_sizes_outside_the_set_run_the_pipeline():
    pv = tiny_pipeline(FIXED["dynamicvit"])
    runner = GraphedPrunedViT(pv, batch_sizes=[2])
    images = tiny_images(1, 5)
    out = runner.run(images)
    ref = pv.run(images)  # on a CPU the eager forward is run's, with no selections returned
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.counts, ref.counts) and out.selections == []
    assert runner.counters.eager_calls == 1 and not runner._buffers


def test_static_outputs_without_clone():
    runner = GraphedPrunedViT(tiny_pipeline(FIXED["evit_fused"]), clone_outputs=False)
    first = runner(tiny_images(2, 6))
    second = runner(tiny_images(2, 7))
    assert first.data_ptr() == second.data_ptr() and torch.equal(first, second)


@pytest.mark.interpreter
def test_inference_mode_and_no_grad_calls_mix():
    pv = tiny_pipeline(VARIABLE["ats"])
    runner = GraphedPrunedViT(pv)
    images = tiny_images(2, 11)
    with torch.inference_mode():
        first = runner(images)
    torch.testing.assert_close(runner(images), first, atol=0, rtol=0)


def test_memory_report_on_cpu():
    runner = GraphedPrunedViT(tiny_pipeline(FIXED["dynamicvit"]))
    runner(tiny_images(2, 8))
    report = runner.memory_report()
    expected = (2 * 3 * 32 * 32 + 2 * 10) * 4 + 2 * 2 * 8  # images, logits (fp32), counts (int64)
    assert (report.graphs, report.pool_bytes, report.buffer_bytes, report.keys) == (0, 0, expected, ())


# --- misuse ----------------------------------------------------------------------------------------------------


def _mutations():
    def weight(pv):
        with torch.no_grad():
            pv.model.blocks[4].mlp.fc1.weight.add_(1.0)

    def moved(pv):
        pv.model.head.weight.data = pv.model.head.weight.data.clone()

    def pruner_setting(pv):
        pv.pruner.rate = 0.3

    def backend(pv):
        pv.backend = "padded_sdpa"

    def train(pv):
        pv.train()

    return {f.__name__: f for f in (weight, moved, pruner_setting, backend, train)}


@pytest.mark.parametrize("mutation", list(_mutations()))
def test_changes_after_binding_are_detected(mutation):
    pv = tiny_pipeline(FIXED["evit_fused"])
    runner = GraphedPrunedViT(pv)
    images = tiny_images(2, 9)
    runner(images)
    _mutations()[mutation](pv)
    with pytest.raises(RuntimeError, match="reset|inference only"):
        runner(images)
    pv.eval()
    runner.reset()
    assert torch.equal(runner(images), pv(images))


def test_capture_unsafe_backends_are_refused():
    with pytest.raises(ValueError, match="nested_sdpa.*CUDA graph"):
        GraphedPrunedViT(tiny_pipeline(FIXED["dynamicvit"], "nested_sdpa"))


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"buckets": 64}, TypeError),
        ({"max_graphs": -1}, ValueError),
        ({"batch_sizes": [0]}, ValueError),
        ({"warmup": 0}, ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        GraphedPrunedViT(tiny_pipeline(FIXED["dynamicvit"]), **kwargs)
    with pytest.raises(TypeError, match="PrunedViT"):
        GraphedPrunedViT(torch.nn.Linear(2, 2))
