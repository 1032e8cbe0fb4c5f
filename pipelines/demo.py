"""The demo behind ``python -m ragged_vit`` / ``ragged-vit``: classify real images with a pruned DeiT on every
chosen backend, and report predictions, kept tokens, backend agreement and throughput.

The first backend prunes; the others replay its decisions (:meth:`PrunedViT.run` with ``selections=``), so the
agreement table measures layout and attention only. Throughput runs the full pipeline (pruners included) on the
images repeated ``batch_repeats`` times and reports the median of ``timed_runs`` runs after ``warmup`` runs.
Weights are random unless a local checkpoint is given, and the output says so first: predictions from random
weights are meaningless, timings and agreement are not.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from ragged_vit.core.selection import Placement
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.pipelines.images import load_images, preprocess
from ragged_vit.pipelines.model import PrunedViT
from ragged_vit.pipelines.weights import create_model, load_checkpoint


@dataclass
class DemoOptions:
    """Everything the demo needs; the CLI fills it from its arguments (see ``ragged_vit.pipelines.cli``)."""

    model: str
    pruner: str
    keep_rate: float
    backends: list[str]
    device: torch.device
    dtype: torch.dtype
    images: list[str] | None = None
    checkpoint: str | None = None
    pruner_options: dict[str, object] = field(default_factory=dict)  # the pruner's own (factory.pruner_options)
    batch_repeats: int = 1
    timed_runs: int = 3
    warmup: int = 1
    top_k: int = 5
    seed: int = 0


def class_names(num_classes: int) -> list[str]:
    """ImageNet-1k class descriptions from timm (offline), or ``class <i>`` for other heads."""
    if num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        return [info.index_to_description(i) for i in range(num_classes)]
    return [f"class {i}" for i in range(num_classes)]


def describe_pruner(pv: PrunedViT, options: DemoOptions) -> str:
    """One line: the pruner, its parameter and where its stages act."""
    pruner = pv.pruner
    if pruner is None:
        return "none: every block dense, timm's own forward (the backend is not used)"
    where = {
        Placement.BEFORE_BLOCK: "before block",
        Placement.MID_BLOCK: "inside block (after attention, before MLP)",
        Placement.AFTER_BLOCK: "after block",
    }[Placement(pruner.placement)]
    blocks = ", ".join(map(str, pruner.blocks))
    depth = len(pv.model.blocks)
    rate = "" if getattr(pruner, "mode", None) == "threshold" else f", keep rate {options.keep_rate}"
    return (
        f"{pruner.name} ({pruner.extra_repr()}){rate}: {where} {blocks}; "
        f"blocks 0-{pv.num_dense_blocks - 1} dense, {pv.num_dense_blocks}-{depth - 1} packed"
    )


class _NoBar:
    """Stands in for tqdm where it is not installed (it is an optional dependency: the ``demo`` extra)."""

    def __init__(self, **_: object) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


def _progress_bar(**kwargs: object):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(**kwargs)
    return tqdm(**kwargs)


def _timed(pv: PrunedViT, batch: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    pv.run(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Runs the demo and prints its report to ``out`` (stdout by default); returns the exit code (0)."""
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    with torch.random.fork_rng():
        torch.manual_seed(options.seed)  # reproducible random weights
        model = create_model(options.model)
        pruner = build_pruner(options.pruner, model, options.keep_rate, **options.pruner_options)
    if options.checkpoint is not None:
        load_checkpoint(model, pruner, options.checkpoint)
        weights = f"weights from checkpoint {options.checkpoint}"
    else:
        weights = "RANDOM WEIGHTS (no --checkpoint given): predictions are meaningless, agreement and speed are not"
    pv = PrunedViT(model, pruner, options.backends[0]).to(device=options.device, dtype=options.dtype)
    backends = {}
    for name in options.backends:
        pv.backend = name
        pv.backend.check(options.device, options.dtype)
        backends[name] = pv.backend
    loaded = load_images(options.images)
    batch = preprocess(loaded, model).to(options.device)
    if pruner is not None and getattr(pruner, "mode", None) == "calibrated":
        pv.calibrate(batch)

    params = sum(p.numel() for p in model.parameters()) / 1e6
    height, width = pv.image_size
    say(f"ragged-vit demo: {options.model} ({params:.1f}M parameters), {weights}")
    say(f"pruner: {describe_pruner(pv, options)}")
    interp = " (Triton interpreter)" if options.device.type == "cpu" and "triton" in backends else ""
    say(
        f"device: {options.device} ({str(options.dtype).removeprefix('torch.')}), "
        f"backends: {', '.join(backends)}{interp}"
    )
    say(f"images: {len(loaded)} at {height}x{width}: {', '.join(i.name for i in loaded)}")
    say()

    results = {}
    for i, (name, backend) in enumerate(backends.items()):
        pv.backend = backend
        first = next(iter(results.values()), None)
        results[name] = pv.run(batch, selections=None if i == 0 else first.selections)
    base_name, base = next(iter(results.items()))
    probs = base.logits.float().softmax(dim=-1).cpu()
    top_p, top_i = probs.topk(min(options.top_k, probs.shape[-1]), dim=-1)
    names = class_names(probs.shape[-1])
    counts = base.counts.cpu()
    num_patches = model.patch_embed.num_patches
    say(f"Top-{top_p.shape[1]} per image (backend {base_name}); kept patches per stage out of {num_patches}:")
    for b, image in enumerate(loaded):
        kept = "/".join(str(c) for c in counts[b].tolist()) or f"{num_patches} (no pruning)"
        say(f"  [{b}] {image.name} ({image.pixels.shape[1]}x{image.pixels.shape[0]}): kept {kept}")
        for p, c in zip(top_p[b].tolist(), top_i[b].tolist(), strict=True):
            say(f"        {100 * p:6.2f}%  {names[c]}")
    say()

    say(f"Backend agreement (same pruning decisions, vs {base_name}):")
    say(f"  {'backend':<12} {'max |logit diff|':>17} {'top-1 match':>12}")
    base_logits = base.logits.float()
    for name, res in results.items():
        diff = (res.logits.float() - base_logits).abs().max().item()
        match = int((res.logits.argmax(-1) == base.logits.argmax(-1)).sum())
        say(f"  {name:<12} {diff:>17.3e} {f'{match}/{len(loaded)}':>12}")
    say()

    timed_batch = batch.repeat(options.batch_repeats, 1, 1, 1)
    runs = options.warmup + options.timed_runs
    medians = {}
    with _progress_bar(total=runs * len(backends), desc="throughput", unit="run", file=sys.stderr, leave=False) as bar:
        for name, backend in backends.items():
            pv.backend = backend
            times = []
            for r in range(runs):
                bar.set_postfix_str(name)
                elapsed = _timed(pv, timed_batch, options.device)
                if r >= options.warmup:
                    times.append(elapsed)
                bar.update()
            medians[name] = statistics.median(times)
    say(
        f"Throughput (batch {timed_batch.shape[0]}, median of {options.timed_runs} runs after {options.warmup} "
        f"warm-up, pruning included):"
    )
    say(f"  {'backend':<12} {'ms/batch':>10} {'img/s':>10}")
    for name, seconds in medians.items():
        say(f"  {name:<12} {1e3 * seconds:>10.1f} {timed_batch.shape[0] / seconds:>10.1f}")
    if interp:
        say("  (triton runs under Triton's CPU interpreter here: its CPU timing says nothing about GPU speed)")
    return 0
