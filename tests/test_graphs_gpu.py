"""The CUDA-graph runner on a GPU: capture, replay, buckets, sync-freedom, fallback, memory, misuse.

Runs with plain ``python -m pytest tests/test_graphs_gpu.py``; skipped on CPU machines by ``conftest.py`` (the CPU
twins, in ``test_graphs.py``, check the buckets, the segment plan and the NaN padding image). DeiT-S and DeiT-B,
random weights (seeded), fp16 unless said otherwise; every runner sees batch sizes 1, 4 and 64 mixed, with fresh
images on every call. Target runtime: under 2 minutes on an H200.

Equality rules:

* fixed counts (one graph per batch size): the graph replays exactly the kernels ``PrunedViT.run`` launches, on the
  same shapes, so graphed logits and counts equal the eager pipeline's BITWISE, for all three backends (Triton,
  FA2 forward, SDPA memory-efficient forward and cuBLAS are deterministic for fixed shapes).
* variable counts (segments per token bucket): the graphs are compared BITWISE with the same runner's segments run
  eagerly (``max_graphs=0``: same capacities, same kernels). Against ``PrunedViT.run`` (exact-size buffers, so
  other GEMM shapes and, in fp16, possibly a flipped near-tie decision) they are compared in fp32 with TF32 off:
  counts exact, logits ``atol = rtol = 1e-4`` (observed on the CPU twin: <= 6e-8).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ragged_vit import PrunedViT
from ragged_vit.pipelines.backends import BACKENDS as REGISTRY
from ragged_vit.pipelines.buckets import TokenBuckets
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.model import PrunedOutput
from ragged_vit.pipelines.stages import HostCounts
from ragged_vit.pipelines.weights import create_model
from tests.helpers import no_tf32, sync_free

pytestmark = pytest.mark.gpu

SMALL, BASE = "deit_small_patch16_224", "deit_base_patch16_224"
CASES = {
    "dynamicvit": ("dynamicvit", {}),
    "evit": ("evit", {}),
    "evit_fused": ("evit", {"fuse_token": True}),
    "threshold_ratio": ("threshold_l2", {}),
    "ats": ("ats", {}),
    "threshold": ("threshold_l2", {"threshold_mode": "calibrated"}),  # a norm threshold: variable counts
}
FIXED = ["dynamicvit", "evit", "evit_fused", "threshold_ratio"]
VARIABLE = ["ats", "threshold"]
# Every backend a CUDA graph can capture (from the registry's capabilities), and those it cannot.
CAPTURABLE = [name for name, cls in REGISTRY.items() if cls.capabilities.capturable]
NOT_CAPTURABLE = [name for name in REGISTRY if name not in CAPTURABLE]
BACKENDS = CAPTURABLE
BATCHES = [1, 4, 64, 4, 1, 64]  # one runner, mixed batch sizes, a fresh batch of images every call
KEEP_RATE = 0.5


def _synthetic_images(count: int, seed: int) -> torch.Tensor:
    """Seeded images with per-image structure (smooth blobs + texture of varying strength): counts vary."""
    g = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(
        torch.randn(count, 3, 7, 7, generator=g), size=(224, 224), mode="bicubic", align_corners=False
    )
    texture = torch.randn(count, 3, 224, 224, generator=g) * torch.rand(count, generator=g)[:, None, None, None] * 1.5
    return smooth + texture


class _Lab:
    """Models and pruners built once per module, shared by the pipelines of every backend."""

    def __init__(self) -> None:
        self.models: dict = {}
        self.pruners: dict = {}
        self.images: dict = {}

    def model(self, name: str, dtype: torch.dtype) -> torch.nn.Module:
        if (name, dtype) not in self.models:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.models[(name, dtype)] = create_model(name).cuda().to(dtype).eval()
        return self.models[(name, dtype)]

    def pipeline(self, name: str, case: str, backend: str, dtype: torch.dtype = torch.float16) -> PrunedViT:
        key = (name, case, dtype)
        if key not in self.pruners:
            pruner_name, options = CASES[case]
            with torch.random.fork_rng():
                torch.manual_seed(1)
                pruner = build_pruner(pruner_name, self.model(name, dtype), KEEP_RATE, **options)
            self.pruners[key] = pruner.cuda().to(dtype)
            if case == "threshold":
                PrunedViT(self.model(name, dtype), self.pruners[key], backend).calibrate(self.batch(8, seed=99))
        return PrunedViT(self.model(name, dtype), self.pruners[key], backend, mode="eager")

    def batch(self, batch: int, seed: int) -> torch.Tensor:
        if (batch, seed) not in self.images:
            self.images[(batch, seed)] = _synthetic_images(batch, seed).cuda()
        return self.images[(batch, seed)]


@pytest.fixture(scope="module")
def lab() -> _Lab:
    return _Lab()


def _assert_bitwise(out, ref, what: str) -> None:
    assert torch.equal(out.counts, ref.counts), f"{what}: counts differ"
    diff = (out.logits.float() - ref.logits.float()).abs().max().item()
    assert torch.equal(out.logits, ref.logits), f"{what}: logits differ by up to {diff:.3e}"


# --- fixed counts: one graph per batch size ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,case,backend",
    [(SMALL, c, b) for c in FIXED for b in BACKENDS]
    + [(BASE, c, b) for c in ("dynamicvit", "evit_fused") for b in BACKENDS],
)
def test_fixed_counts_one_graph_bitwise_and_sync_free(lab, model, case, backend):
    """One graph per batch size replays its program bitwise (the same program run uncaptured: a mid-block decision
    may run beside its MLP half there, on every row), with the eager forward's counts."""
    pv = lab.pipeline(model, case, backend)
    runner = GraphedPrunedViT(pv)
    eager = GraphedPrunedViT(pv, max_graphs=0)
    assert runner.plan.fixed
    for call, batch in enumerate(BATCHES):
        images = lab.batch(batch, seed=call)
        out = runner.run(images)
        _assert_bitwise(out, eager.run(images), f"call {call} (B={batch})")
        assert torch.equal(out.counts, pv.run(images).counts)
    assert runner.counters.captures == 3 and runner.counters.replays == len(BATCHES)
    assert sorted(runner.memory_report().keys) == [(1, 224, 224), (4, 224, 224), (64, 224, 224)]  # (B, H, W)

    # Replays with new images never synchronise (images already on the device, outputs cloned on the device).
    inputs = [lab.batch(batch, seed=100 + batch) for batch in (4, 1, 64)]
    with sync_free():
        outs = [runner.run(images) for images in inputs]
    for images, out in zip(inputs, outs, strict=True):
        _assert_bitwise(out, eager.run(images), "sync-free replay")
    assert runner.counters.captures == 3


# --- variable counts: segments per token bucket ------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,case,backend",
    [(SMALL, c, b) for c in VARIABLE for b in BACKENDS] + [(BASE, "ats", "triton"), (BASE, "threshold", "fa2_varlen")],
)
def test_variable_counts_replay_the_eager_segments_bitwise(lab, model, case, backend):
    pv = lab.pipeline(model, case, backend)
    graphed = GraphedPrunedViT(pv)
    eager = GraphedPrunedViT(pv, max_graphs=0)  # the same segments, capacities and kernels, never captured
    assert not graphed.plan.fixed
    for call, batch in enumerate(BATCHES):
        images = lab.batch(batch, seed=call)
        out = graphed.run(images)
        assert bool(torch.isfinite(out.logits).all())
        _assert_bitwise(out, eager.run(images), f"call {call} (B={batch})")
    assert graphed.counters.eager_segments == 0 and eager.counters.captures == 0
    assert graphed.counters.replays == eager.counters.eager_segments  # one graph per chain of segments


@pytest.mark.parametrize("case", ["threshold_ratio", *VARIABLE])
def test_compile_blocks_in_graphs(lab, case):
    """``compile_blocks``: compiled block runs, halves and (ATS) decisions inside the graphs.

    Fixed counts: one graph replays its program's compiled kernels, bitwise (observed on an H100). Variable
    counts: not bitwise, because every new token count (each ATS stage, each bucket) recompiles and Dynamo then
    holds a static entry (used by the graph captured first) and a dynamic one (used by later eager calls of the
    same shape), whose reductions may round differently (observed on an H100: ATS outputs differed). So: the
    compiled path ran, outputs are finite, and the graphs agree with the runner's eager segments in fp16 where
    an image's counts agree, for most images.
    """
    pv = lab.pipeline(SMALL, case, "triton")
    pv.compile_blocks = True
    torch._dynamo.reset()  # compiled anew, whatever earlier tests of the process compiled
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    graphed = GraphedPrunedViT(pv)
    eager = GraphedPrunedViT(pv, max_graphs=0).run
    for call, batch in enumerate([4, 1, 4]):
        images = lab.batch(batch, seed=200 + call)
        out, ref = graphed.run(images), eager(images)
        assert bool(torch.isfinite(out.logits).all())
        if graphed.plan.fixed:
            _assert_bitwise(out, ref, f"call {call} (B={batch})")
            continue
        same = (out.counts == ref.counts).all(dim=1)
        assert same.float().mean() >= 0.5, f"call {call}: counts {out.counts.tolist()} vs {ref.counts.tolist()}"
        torch.testing.assert_close(out.logits[same].float(), ref.logits[same].float(), atol=5e-2, rtol=5e-2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # the compiled path ran


@pytest.mark.parametrize("backend", ["triton", "padded_sdpa"])
@pytest.mark.parametrize("case", VARIABLE)
def test_variable_counts_match_the_pipeline_in_fp32(lab, case, backend):
    pv = lab.pipeline(SMALL, case, backend, torch.float32)
    runner = GraphedPrunedViT(pv)
    with no_tf32():
        for call, batch in enumerate([4, 1, 4, 64]):
            images = lab.batch(batch, seed=call)
            out, ref = runner.run(images), pv.run(images)
            assert torch.equal(out.counts, ref.counts), f"call {call}: decisions differ"
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_totals_cross_bucket_boundaries(lab):
    """Low-contrast images keep few patches, high-contrast ones many: the same stage replays graphs of several
    capacities, alternately, each equal to its eager twin."""
    pv = lab.pipeline(SMALL, "threshold", "triton")
    buckets = TokenBuckets(step=64)
    graphed, eager = GraphedPrunedViT(pv, buckets), GraphedPrunedViT(pv, buckets, max_graphs=0)
    base = lab.batch(4, seed=7)
    totals = []
    for scale in (0.2, 3.0, 0.2, 1.0, 3.0):
        images = base * scale
        out = graphed.run(images)
        _assert_bitwise(out, eager.run(images), f"scale {scale}")
        totals.append(int(out.counts.sum()) + 4)
    capacities = {key[3].capacity for key in graphed.memory_report().keys if key[3].index == 1}  # (B, H, W, shape)
    assert len(capacities) >= 2, f"totals {totals} all fell into one bucket"
    assert {buckets.capacity(t, 4, 197) for t in totals} == capacities


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_free_stages_replay_bitwise(lab, backend):
    """``sync_free_rows``: ATS stages after the first take the capacity ``B * 99`` (98 samples: at most 99 rows an
    image), padding split into images of at most 99 rows, all in one graph."""
    pv = lab.pipeline(SMALL, "ats", backend)
    buckets = TokenBuckets(sync_free_rows=1024)
    graphed, eager = GraphedPrunedViT(pv, buckets), GraphedPrunedViT(pv, buckets, max_graphs=0)
    for call, batch in enumerate([4, 1, 4]):
        images = lab.batch(batch, seed=80 + call)
        out = graphed.run(images)
        assert bool(torch.isfinite(out.logits).all())
        _assert_bitwise(out, eager.run(images), f"call {call} (B={batch})")
    keys = graphed.memory_report().keys
    assert len(keys) == 2 and all(len(key) == 13 for key in keys)  # B = 1 and 4: (B, H, W) and the 10 segments
    assert all(shape.capacity <= key[0] * 99 and shape.max_seqlen == 99 for key in keys for shape in key[4:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_padding_image(lab, backend):
    """``step=1``: every capacity equals its total, so every later segment's padding image has no rows."""
    pv = lab.pipeline(SMALL, "ats", backend)
    buckets = TokenBuckets(step=1, seqlen_step=1)
    graphed, eager = GraphedPrunedViT(pv, buckets), GraphedPrunedViT(pv, buckets, max_graphs=0)
    for call, batch in enumerate([4, 1]):
        images = lab.batch(batch, seed=60 + call)
        out = graphed.run(images)
        assert bool(torch.isfinite(out.logits).all())
        _assert_bitwise(out, eager.run(images), f"call {call} (B={batch})")
    assert graphed.counters.eager_segments == 0


@pytest.mark.parametrize(
    "case,stages,buckets",
    [
        ("ats", 9, TokenBuckets()),
        ("threshold", 1, TokenBuckets()),
        ("ats", 1, TokenBuckets(sync_free_rows=4 * 197 - 1)),
        ("ats", 0, TokenBuckets(sync_free_rows=4 * 197)),
    ],
    ids=["ats", "threshold", "ats-sync-free-after-one", "ats-sync-free"],
)
def test_variable_counts_read_once_per_stage(lab, case, stages, buckets, monkeypatch):
    """One read per variable-count stage; with ``sync_free_rows`` below ``B * N`` (but above the first stage's
    capacity) one read in all; from ``B * N`` on, none. A read polls pinned host memory that a kernel writes: no
    synchronising call at all, and the values read are the stage's real total and longest image."""
    pv = lab.pipeline(SMALL, case, "fa2_varlen")
    runner = GraphedPrunedViT(pv, buckets)
    images = lab.batch(4, seed=3)
    runner.run(images)  # captures every graph these images need
    torch.cuda.synchronize()
    reads, real_read = [], HostCounts.read

    def read(counts, stage):
        reads.append((stage, real_read(counts, stage)))
        return reads[-1][1]

    monkeypatch.setattr(HostCounts, "read", read)
    syncs, out = _syncs(runner.run, images)
    assert not syncs, syncs
    assert len(reads) == stages
    rows = (out.counts + pv.plan.num_prefix).cpu()  # [B, S]: each image's rows after each stage
    for stage, (total, longest) in reads:
        assert (total, longest) == (int(rows[:, stage].sum()), int(rows[:, stage].max()))
    assert runner.counters.captures == stages + 1  # the segments between two reads are one graph


# --- the eager forward's bounded repack -------------------------------------------------------------------------


@pytest.mark.parametrize("case", VARIABLE)
def test_lean_eager_forward_matches_run_in_fp32(lab, case, monkeypatch):
    """``pv(images)`` (``PrunedViT.forward``: no selections, so buffers sized from the host's bounds) against
    ``pv.run`` (exact sizes, one read per stage) in fp32 with TF32 off: counts exact, logits ``1e-4``; ATS's forward
    reads nothing at B=4 and B=64, ``run`` at each of its nine stages (a poll of a pinned row: neither makes a
    synchronising call)."""
    pv = lab.pipeline(SMALL, case, "triton", torch.float32)
    with no_tf32():
        for call, batch in enumerate([4, 1, 64]):
            images = lab.batch(batch, seed=40 + call)
            logits, counts = pv(images, return_counts=True)
            ref = pv.run(images)
            assert torch.equal(counts, ref.counts), f"call {call} (B={batch}): decisions differ"
            torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    if case == "ats":
        reads, real = [], HostCounts.total_and_longest
        monkeypatch.setattr(HostCounts, "total_and_longest", lambda self, kept: reads.append(1) or real(self, kept))
        for batch in (4, 64):
            images = lab.batch(batch, seed=3)
            counts = [len(_syncs(pv, images)[0]), len(reads), len(_syncs(pv.run, images)[0]), len(reads)]
            assert counts == [0, 0, 0, 9], f"B={batch}"
            reads.clear()


def _syncs(forward, images: torch.Tensor) -> tuple[list[str], object]:
    """The synchronising calls of one ``forward(images)``, and its output. Matches PyTorch's per-call warning only:
    ``set_sync_debug_mode`` itself warns once per process that the mode is a prototype."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = forward(images)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)], out


# --- fallback, memory, misuse ------------------------------------------------------------------------------------


def test_eager_fallback(lab):
    """Beyond ``max_graphs`` the segments run eagerly (same results as the graphs); batch sizes outside
    ``batch_sizes`` run the pipeline's eager forward (``pv(images)``, the lean one: no selections)."""
    pv = lab.pipeline(SMALL, "ats", "triton")
    full = GraphedPrunedViT(pv)
    capped = GraphedPrunedViT(pv, max_graphs=3, batch_sizes=[4, 64])
    for call, batch in enumerate([4, 1, 64, 4]):
        images = lab.batch(batch, seed=20 + call)
        out = capped.run(images)
        if batch == 1:
            logits, counts = pv(images, return_counts=True)
            ref = PrunedOutput(logits, counts, [])
            assert out.selections == []
        else:
            ref = full.run(images)
        _assert_bitwise(out, ref, f"call {call} (B={batch})")
    assert capped.memory_report().graphs == 3
    assert capped.counters.eager_calls == 1 and capped.counters.eager_segments > 0


def test_memory_report_and_a_shared_pool(lab):
    """Two runners (two backends) share one pool; interleaved replays stay correct, since no graph output lives in
    the pool."""
    pool = torch.cuda.graph_pool_handle()
    pvs = [lab.pipeline(SMALL, "dynamicvit", backend) for backend in ("triton", "fa2_varlen")]
    runners = [GraphedPrunedViT(pv, pool=pool) for pv in pvs]
    for call, batch in enumerate([4, 64, 4, 64]):
        images = lab.batch(batch, seed=40 + call)
        for pv, runner in zip(pvs, runners, strict=True):
            _assert_bitwise(runner.run(images), pv.run(images), f"call {call}")
    reports = [runner.memory_report() for runner in runners]
    assert reports[0].pool_bytes == reports[1].pool_bytes > 0
    per_image = (3 * 224 * 224 + 1000) * 2 + 3 * 8  # fp16 images and logits, int64 counts (three stages)
    assert all(r.graphs == 2 and r.buffer_bytes == (4 + 64) * per_image for r in reports)


def test_changed_weights_are_detected(lab):
    model = copy.deepcopy(lab.model(SMALL, torch.float16))
    pruner = copy.deepcopy(lab.pipeline(SMALL, "dynamicvit", "triton").pruner)
    pv = PrunedViT(model, pruner, "triton")
    runner = GraphedPrunedViT(pv)
    images = lab.batch(4, seed=5)
    runner.run(images)
    with torch.no_grad():
        model.blocks[5].mlp.fc2.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="reset"):
        runner.run(images)
    runner.reset()
    _assert_bitwise(runner.run(images), pv.run(images), "after reset")
    model.head.weight.data = model.head.weight.data.clone()  # new storage; the captured one is kept alive
    with pytest.raises(RuntimeError, match="reset"):
        runner.run(images)
    runner.reset()
    _assert_bitwise(runner.run(images), pv.run(images), "after the second reset")


@pytest.mark.parametrize("backend", NOT_CAPTURABLE)
def test_capture_unsafe_backends_are_refused(lab, backend):
    with pytest.raises(ValueError, match="CUDA graph"):
        GraphedPrunedViT(lab.pipeline(SMALL, "dynamicvit", backend))
