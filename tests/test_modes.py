"""How a pipeline's call runs (``PrunedViT(mode=...)``): the automatic switch between CUDA graphs and eager, the
batch buckets the graphs are captured for, caller-owned outputs, re-capture after a change, the memory listing.

CPU twins: on the CPU the automatic mode runs eagerly and says why once; the graph runner's batch buckets, its
re-binding and its outputs run uncaptured (the segments eagerly, packing under Triton's interpreter). GPU cases
(``gpu``): the default call captures, pads to its bucket, keeps the caller's outputs, re-captures after new weights,
falls back above the largest bucket, and the eager mode makes no synchronising call for any pruner.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import timm
import torch

import ragged_vit
from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines.model import BATCH_BUCKETS, EagerFallbackWarning
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import sync_free, tiny_images, tiny_pipeline

ATS = lambda: make_pruner("ats", blocks=(1, 2, 3, 4, 5), num_samples=12, min_keep=2)  # noqa: E731 - variable counts
EVIT = lambda: make_pruner("evit", rate=0.6, blocks=(1, 3), fuse_token=True)  # noqa: E731 - fixed counts
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _caught(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, EagerFallbackWarning)]


# --- the automatic mode on the CPU ---------------------------------------------------------------------------------


def test_auto_mode_on_the_cpu_runs_eagerly_and_says_why_once():
    pv = tiny_pipeline(EVIT)
    assert pv.mode == "auto" and pv.compile_blocks is None
    images = tiny_images(3, 1)
    said = _caught(lambda: pv(images))
    assert said == ["PrunedViT ran eagerly: the model is on CPU: CUDA graphs need a CUDA GPU"]
    assert pv.last_call == "eager: the model is on CPU: CUDA graphs need a CUDA GPU"
    assert _caught(lambda: pv(images)) == []  # once per reason and pipeline
    logits, counts = pv(images, return_counts=True)
    ref = pv.run(images)
    assert torch.equal(logits, ref.logits) and torch.equal(counts, ref.counts)
    assert pv.graph_memory() is None


def test_the_eager_mode_says_nothing_and_the_graphs_mode_refuses_what_it_cannot_capture():
    eager = tiny_pipeline(EVIT)
    eager.mode = "eager"
    assert _caught(lambda: eager(tiny_images(2, 2))) == [] and eager.last_call is None
    graphs = PrunedViT(eager.model, eager.pruner, "reference", mode="graphs")
    with pytest.raises(ValueError, match="mode='graphs' cannot capture this call: the model is on CPU"):
        graphs(tiny_images(2, 2))
    selections = eager.run(tiny_images(2, 2)).selections
    auto = PrunedViT(eager.model, eager.pruner, "reference")
    assert _caught(lambda: auto(tiny_images(2, 2), selections=selections)) == [
        "PrunedViT ran eagerly: selections are replayed eagerly (CUDA graphs make their own decisions on the device)"
    ]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"mode": "fast"}, ValueError, "mode must be one of 'auto', 'eager', 'graphs', got 'fast'"),
        ({"compile_blocks": "yes"}, TypeError, "compile_blocks must be a bool or None, got str"),
    ],
)
def test_bad_modes_are_named_errors(kwargs, error, match):
    model = tiny_pipeline(lambda: None).model
    with pytest.raises(error, match=match):
        PrunedViT(model, None, **kwargs)
    if "mode" in kwargs:
        with pytest.raises(error, match=match):
            ragged_vit.prune(model, "evit", 0.7, "reference", **kwargs)


def test_prune_and_build_pipeline_take_the_mode():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=3)
    assert ragged_vit.prune(model, "evit", 0.7).mode == "auto"
    assert ragged_vit.prune(model, "evit", 0.7, mode="eager").mode == "eager"
    pv = ragged_vit.build_pipeline("deit_tiny_patch16_224", "evit", 0.7, mode="graphs",
                                   model_kwargs={"num_classes": 3})  # fmt: skip
    assert pv.mode == "graphs" and "mode='graphs'" in repr(pv)


def test_copies_and_pickles_leave_the_graphs_behind():
    pv = tiny_pipeline(EVIT)
    pv._runner = GraphedPrunedViT(pv)  # what the graph modes make on CUDA
    pv._runner(tiny_images(2, 3))
    clone = copy.deepcopy(pv)
    assert clone._runner is None and pv._runner is not None
    again = pickle.loads(pickle.dumps(pv))
    assert again._runner is None
    images = tiny_images(2, 4)
    assert torch.equal(clone(images), pv(images)) and torch.equal(again(images), pv(images))


# --- the graph runner's batch buckets, re-binding and outputs (uncaptured on the CPU) -------------------------------


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on unwritten padding rows
@pytest.mark.parametrize("case", ["ats", "evit_fused"])
def test_batch_buckets_pad_to_the_next_size_and_return_the_real_images(case):
    """A batch is padded to the smallest bucket that holds it (the padding images hold zeros, or earlier images);
    the real images' logits and counts are those of an unpadded forward; a batch above the largest bucket runs the
    pipeline's eager forward. The outputs are the caller's own: later calls of the same bucket leave them alone."""
    pv = tiny_pipeline(ATS if case == "ats" else EVIT, "triton")
    runner = GraphedPrunedViT(pv, batch_buckets=(2, 4))
    assert [runner.bucket(b) for b in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    outs = []
    for batch, seed in ((1, 5), (3, 6), (4, 7), (3, 8), (5, 9)):
        images = tiny_images(batch, seed)
        out = runner.run(images)
        ref = pv.run(images)
        assert out.logits.shape == (batch, 10) and torch.equal(out.counts, ref.counts)
        torch.testing.assert_close(out.logits, ref.logits, **FP32)
        outs.append((out, out.logits.clone(), out.counts.clone()))
    assert all(torch.equal(out.logits, logits) and torch.equal(out.counts, counts) for out, logits, counts in outs)
    assert sorted(runner._buffers) == [(2, 32, 32), (4, 32, 32)] and runner.counters.eager_calls == 1


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on unwritten padding rows
def test_a_call_without_counts_returns_the_same_logits_and_no_counts():
    """``pv(images)`` returns the logits only, so the runner copies no counts out: the same logits as with the counts,
    and an empty ``[B, 0]`` counts tensor, from a padded bucket and from the eager forward above the largest."""
    pv = tiny_pipeline(ATS, "triton")
    runner = GraphedPrunedViT(pv, batch_buckets=(2,))
    for batch in (1, 3):  # bucket 2; above it: the eager forward
        images = tiny_images(batch, 11)
        full, bare = runner.run_checked(images), runner.run_checked(images, counts=False)
        assert torch.equal(bare.logits, full.logits) and full.counts.shape == (batch, pv.num_stages)
        assert bare.counts.shape == (batch, 0) and bare.counts.dtype == full.counts.dtype


@pytest.mark.interpreter
def test_rebind_captures_anew_after_a_change():
    """With ``rebind`` a changed pipeline (new weights, a new pruner setting) is re-bound at the next call, which
    then reflects the change; without it the call raises (``test_graphs.py``)."""
    pv = tiny_pipeline(EVIT)
    runner = GraphedPrunedViT(pv, rebind=True)
    images = tiny_images(2, 10)
    before = runner(images)
    with torch.no_grad():
        pv.model.head.weight.mul_(2.0)
    after = runner(images)
    torch.testing.assert_close(after, pv.run(images).logits, atol=0, rtol=0)
    assert not torch.equal(after, before)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"batch_buckets": [4, 2]}, ValueError, "batch_buckets must be increasing batch sizes"),
        ({"batch_buckets": []}, ValueError, "batch_buckets must be increasing batch sizes"),
        ({"batch_buckets": [0, 2]}, ValueError, r"batch_buckets\[i\]"),
        ({"batch_buckets": [2], "batch_sizes": [2]}, ValueError, "give one"),
        ({"compile_blocks": 1}, TypeError, "compile_blocks must be a bool or None"),
    ],
)
def test_bad_bucket_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GraphedPrunedViT(tiny_pipeline(EVIT), **kwargs)


# --- GPU: the default call ------------------------------------------------------------------------------------------

WORKLOADS = {
    "threshold_l2": ("threshold_l2", 0.5, {"threshold_mode": "ratio"}),
    "ats": ("ats", 0.5, {}),
    "dynamicvit": ("dynamicvit", 0.7, {}),
    "evit": ("evit", 0.7, {}),
    "evit_fused": ("evit", 0.7, {"fuse_token": True}),
    "tome": ("tome", 0.57, {}),
    "tome_adaptive": ("tome", 0.6, {"threshold": 0.5, "r_max": 16}),
}


def _small(seed: int = 0) -> torch.nn.Module:
    """DeiT-Small, random seeded weights, fp16 on the GPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=100)
    return model.cuda().half().eval()


def _images(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 224, 224, generator=g) * 1.5).cuda().half()


def _pruned(name: str, mode: str = "auto", model: torch.nn.Module | None = None) -> PrunedViT:
    pruner, keep, options = WORKLOADS[name]
    return ragged_vit.prune(model if model is not None else _small(), pruner, keep, mode=mode, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ats", "evit_fused", "tome"])
def test_gpu_the_default_call_captures_pads_and_keeps_the_callers_outputs(name):
    """``prune(model)(images)`` on CUDA: graphs with compiled blocks per batch bucket, a batch of 3 padded to 4; the
    counts are the eager forward's and the logits agree with it in fp16 (compiled blocks round differently); the
    outputs of an earlier call survive later calls of the same bucket; ``graph_memory`` lists the buckets."""
    pv = _pruned(name)
    eager = PrunedViT(pv.model, pv.pruner, "triton", mode="eager")
    kept, same_images = [], []
    for call, batch in enumerate([1, 3, 4, 3]):
        images = _images(batch, seed=call)
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)
            logits, counts = pv(images, return_counts=True)
        assert pv.last_call == "graphs"
        ref_logits, ref_counts = eager(images, return_counts=True)
        assert logits.shape == ref_logits.shape and bool(torch.isfinite(logits).all())
        # compiled rounding may flip a decision near a tie (ATS's CDF samples most often): a few rows, no more
        assert (counts - ref_counts).abs().max() <= 8, (counts.tolist(), ref_counts.tolist())
        same = (counts == ref_counts).all(dim=1)
        same_images += same.tolist()
        diff = (logits[same].float() - ref_logits[same].float()).abs()  # a broken pipeline moves logits by O(1)
        assert diff.numel() == 0 or (diff.mean() < 2e-2 and diff.max() < 0.25), (diff.mean(), diff.max())
        kept.append((logits, logits.clone()))
    assert sum(same_images) >= len(same_images) / 2, same_images
    assert all(torch.equal(a, b) for a, b in kept)
    keys = {key[:3] for key in pv.graph_memory().keys}
    assert keys == {(1, 224, 224), (4, 224, 224)}
    assert pv.graph_memory().buffer_bytes > 0


@pytest.mark.gpu
def test_gpu_the_default_call_falls_back_above_the_largest_bucket_and_recaptures_new_weights():
    pv = _pruned("evit")
    big = _images(BATCH_BUCKETS[-1] + 1, seed=1)
    with pytest.warns(EagerFallbackWarning, match="above the largest graph bucket"):
        logits = pv(big)
    assert pv.last_call.startswith("eager: a batch of 257 images") and logits.shape == (257, 100)
    images = _images(2, seed=2)
    before = pv(images)
    with torch.no_grad():
        pv.model.head.weight.mul_(-1.0)
    after = pv(images)
    torch.testing.assert_close(after.float(), -before.float() + 2 * pv.model.head.bias.float(), atol=2e-2, rtol=2e-2)
    with torch.enable_grad():  # the forward is inference only: grad mode changes nothing
        assert not pv(images).requires_grad and pv.last_call == "graphs"


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*WORKLOADS, "threshold_calibrated"])
def test_gpu_the_eager_mode_makes_no_synchronising_call(name):
    """``mode="eager"`` on CUDA: no synchronising CUDA call inside any pruner's forward (sync debug mode raises on
    one); a stage whose total no host bound holds reads it by polling a pinned row a kernel writes."""
    if name == "threshold_calibrated":
        pv = ragged_vit.prune(_small(), "threshold_l2", 0.5, mode="eager", threshold_mode="calibrated")
        pv.calibrate(_images(8, seed=99))
    else:
        pv = _pruned(name, "eager")
    for batch in (1, 4, 64):
        images = _images(batch, seed=batch)
        pv(images)  # warm-up: kernels compiled, handles created
        with sync_free():
            logits = pv(images)
        assert bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_gpu_a_replayed_default_call_makes_no_synchronising_call(name):
    """The default call on CUDA, once its bucket's graph is captured: no synchronising CUDA call (sync debug mode
    raises on one), so that back-to-back calls overlap the host's work with the device's; the logits are the ones of
    the call before (the same images)."""
    pv = _pruned(name)
    images = _images(4, seed=4)
    for _ in range(3):  # eager, captured, replayed
        logits = pv(images)
    with sync_free():
        again = pv(images)
    assert pv.last_call == "graphs" and torch.equal(again, logits)
