"""The demo behind ``python -m ragged_vit`` / ``ragged-vit``: classify real images with a pruned DeiT on every
chosen backend, check that the backends agree, and time the pruned forward against the unpruned timm model.

Three sections follow the header:

* **Predictions**: the top-1 class of each image (top-5 with ``verbose``) and its kept patches per stage, from the
  first backend.
* **Backend agreement**: the first backend prunes; the others replay its decisions (:meth:`PrunedViT.run` with
  ``selections=``), so the max |logit diff| measures layout and attention only. Beside it, the gap between the first
  backend's top-1 and top-2 logits: with random weights the logits lie close together and a top-1 match says little.
* **Speed** (img/s, pruning included, the same images at B=1 and at a large batch of the images repeated; each
  timed forward synchronised, the median of ``timed_runs`` after ``warmup``). On a GPU: unpruned timm eager and
  under ``torch.compile(mode="reduce-overhead")`` against the pruned pipeline on the first backend, eager
  (:meth:`PrunedViT.run`) and as users call it (``pv(images)``: CUDA graphs with compiled blocks), each as a ratio to
  unpruned
  ``reduce-overhead`` (the fastest an unpruned model gets from PyTorch alone); the compiled forwards' first calls
  compile and capture and are never timed, and their logits and counts are checked against the eager ones. On a
  CPU: timm eager against the pruned pipeline on the ``reference`` backend, eager (Triton's interpreter is never
  timed: its speed says nothing about a GPU's).

Weights are random unless a local checkpoint is given, and the output says so first: predictions from random
weights are meaningless, agreement and speed are not.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch

from ...core.selection import Placement
from ..factory import build_pruner
from ..model import PrunedOutput, PrunedViT
from ..weights import create_model, load_checkpoint
from .arguments import COMPILED_WARMUP
from .images import load_images, preprocess

GPU_BATCH = 64
"""The large batch on a GPU (the images repeated up to at least this many) unless ``batch_repeats`` is given."""

TOP_K_VERBOSE = 5


@dataclass
class DemoOptions:
    """Everything the demo needs; the CLI fills it from its arguments (see :mod:`ragged_vit.pipelines.apps.cli`)."""

    model: str
    pruner: str
    keep_rate: float
    backends: list[str]
    device: torch.device
    dtype: torch.dtype
    model_kwargs: dict[str, object] = field(default_factory=dict)  # timm.create_model's (--model-arg)
    images: list[str] | None = None
    checkpoint: str | None = None
    strip_prefix: str | None = None  # removed from the checkpoint's keys (load_checkpoint)
    pruner_options: dict[str, object] = field(default_factory=dict)  # the pruner's own (factory.pruner_options)
    batch_repeats: int | None = None  # the large batch = the images repeated; None: large_batch_repeats()
    timed_runs: int = 5
    warmup: int = 2
    verbose: bool = False  # top-5 instead of top-1
    seed: int = 0


def class_names(num_classes: int) -> list[str]:
    """ImageNet-1k class descriptions from timm (offline), or ``class <i>`` for other heads."""
    if num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        return [info.index_to_description(i) for i in range(num_classes)]
    return [f"class {i}" for i in range(num_classes)]


def describe_pruner(pv: PrunedViT, options: DemoOptions, backends: Sequence[str] | None = None) -> str:
    """One line: the pruner, its parameter and where its stages act (``backends``: those the command runs, None: the
    pipeline's own)."""
    pruner = pv.pruner
    if pruner is None and pv.native:
        names = list(backends) if backends is not None else [pv.backend.name]
        return f"none: every block packed (a NaFlexVit has no dense batch), backend{'s' * (len(names) > 1)} " + \
            ", ".join(names)  # fmt: skip
    if pruner is None:
        return "none: every block dense, timm's own forward (the backend is not used)"
    where = {
        Placement.BEFORE_BLOCK: "before block",
        Placement.MID_BLOCK: "inside block (after attention, before MLP)",
        Placement.AFTER_BLOCK: "after block",
    }[Placement(pruner.placement)]
    blocks = ", ".join(map(str, pruner.blocks))
    depth = len(pv.model.blocks)
    unused = getattr(pruner, "mode", None) == "threshold" or {"r", "threshold"} & set(options.pruner_options)
    rate = "" if unused else f", keep rate {options.keep_rate}"  # the keep rate, where it set the pruner
    dense = pv.first_packed_block
    layout = f"blocks 0-{dense - 1} dense, {dense}-{depth - 1} packed" if dense else "every block packed"
    return f"{pruner.name} ({pruner.extra_repr()}){rate}: {where} {blocks}; {layout}"


def large_batch_repeats(num_images: int, on_gpu: bool) -> int:
    """How often the images are repeated for the large batch by default: up to :data:`GPU_BATCH` on a GPU, once on
    a CPU."""
    return max(1, math.ceil(GPU_BATCH / num_images)) if on_gpu else 1


def top1_margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per image (float32 ``[B]``; ``inf`` with a single class)."""
    logits = logits.float()
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:-1], math.inf)
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


class _NoBar:
    """Stands in for tqdm off a terminal, or where tqdm is not installed (the ``demo`` extra)."""

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


def progress_bar(enabled: bool = True, **kwargs: object):
    """A tqdm bar on ``sys.stderr`` when ``enabled`` and it is a terminal; otherwise nothing is drawn (the demo's and
    ``validate``'s one bar)."""
    if not (enabled and sys.stderr.isatty()):
        return _NoBar(**kwargs)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(**kwargs)
    return tqdm(file=sys.stderr, **kwargs)


# -- speed -------------------------------------------------------------------------------------------------------


@dataclass
class Contender:
    """One timed forward.

    Attributes:
        name: its row in the table.
        build: makes the forward (called once, in table order; it may configure the shared pipeline).
        compiled: its first calls compile or capture: at least :data:`COMPILED_WARMUP` untimed calls, and a failure
            is reported in the table instead of raised.
        check_against: the row whose logits (and kept counts) its first outputs are compared with.
        baseline: the ratios in the table are to this row's img/s.
    """

    name: str
    build: Callable[[], Callable[[torch.Tensor], object]]
    compiled: bool = False
    check_against: str | None = None
    baseline: bool = False


@dataclass
class Measured:
    """A contender's median seconds per batch size, its first outputs, or why it failed."""

    seconds: dict[int, float] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    counts: dict[int, torch.Tensor | None] = field(default_factory=dict)
    error: str | None = None


def contenders(pv: PrunedViT, backend: str, on_gpu: bool, compile: bool = True) -> list[Contender]:
    """The forwards to time, in table order (see the module docstring); they share ``pv`` and its model.

    On a GPU (``on_gpu``): unpruned timm eager and under ``torch.compile(mode="reduce-overhead")`` (the baseline),
    the pruned pipeline on ``backend`` eager and as users call it (``pv(images)``, ``mode="auto"``: CUDA graphs with
    compiled blocks; built last). ``compile=False`` leaves ``torch.compile`` out, so that the structure runs on a
    CPU (the tests, where the default call runs eagerly). On a CPU: timm eager (the baseline) and the pruned
    pipeline eager.
    """
    model = pv.model

    def eager() -> Callable[[torch.Tensor], object]:
        pv.backend, pv.compile_blocks = backend, False
        return pv.run

    timm_eager = Contender("timm eager (unpruned)", lambda: model, baseline=not on_gpu)
    pruned_eager = Contender(f"pruned eager ({backend})", eager)
    if not on_gpu:
        return [timm_eager, pruned_eager]

    def reduce_overhead() -> Callable[[torch.Tensor], object]:
        return torch.compile(model, mode="reduce-overhead", dynamic=False) if compile else model

    def default_call() -> Callable[[torch.Tensor], object]:
        pv.backend, pv.compile_blocks, pv.mode = backend, None if compile else False, "auto"
        return lambda images: PrunedOutput(*pv(images, return_counts=True))

    timm_compiled = Contender(
        "timm reduce-overhead (unpruned)", reduce_overhead, compiled=True, check_against=timm_eager.name, baseline=True
    )
    pruned_default = Contender(
        f"pruned default call ({backend})", default_call, compiled=True, check_against=pruned_eager.name
    )
    return [timm_eager, timm_compiled, pruned_eager, pruned_default]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _outputs(out: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(out, PrunedOutput):
        return out.logits.float().clone(), out.counts.clone()
    return out.float().clone(), None


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= 100 else text[:97] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def measure(
    rows: list[Contender], batches: dict[int, torch.Tensor], warmup: int, timed_runs: int, bar: object = None
) -> dict[str, Measured]:
    """Times every row at every batch size (``batches``: size -> images on the model's device and dtype): untimed
    calls first, ``warmup`` of them (at least one, whose outputs are kept for :func:`check_lines`; at least
    :data:`COMPILED_WARMUP` for compiled rows), then ``timed_runs`` synchronised calls, of which the median counts.
    Rows are built and run in order, under ``torch.no_grad()``."""
    bar = bar or _NoBar()
    results: dict[str, Measured] = {}
    with torch.no_grad():
        for row in rows:
            _measure_row(row, results.setdefault(row.name, Measured()), batches, warmup, timed_runs, bar)
    return results


def _measure_row(
    row: Contender, result: Measured, batches: dict[int, torch.Tensor], warmup: int, timed_runs: int, bar
) -> None:
    try:
        forward = row.build()
        for size, images in batches.items():
            bar.set_postfix_str(f"{row.name}, B={size}")
            result.logits[size], result.counts[size] = _outputs(forward(images))  # the first warm-up call
            for _ in range(max(warmup, COMPILED_WARMUP if row.compiled else 1) - 1):
                forward(images)
            times = []
            for _ in range(timed_runs):
                _sync(images.device)
                start = time.perf_counter()
                forward(images)
                _sync(images.device)
                times.append(time.perf_counter() - start)
                bar.update()
            result.seconds[size] = statistics.median(times)
    except Exception as e:
        if not row.compiled:
            raise
        result.error = _describe(e)
        bar.update(timed_runs * (len(batches) - len(result.seconds)))


def _img_per_s(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def speed_lines(results: dict[str, Measured], sizes: list[int], baseline: str) -> list[str]:
    """The speed table: img/s per row and batch size, with the ratio to ``baseline``'s img/s in brackets; failed
    rows say why below it."""
    width = max(len(name) for name in results) + 2
    lines = ["  " + "forward".ljust(width) + "".join(f"{f'B={size}':>20}" for size in sizes)]
    notes = []
    for name, result in results.items():
        cells = []
        for size in sizes:
            seconds = result.seconds.get(size)
            base = results[baseline].seconds.get(size)
            if seconds is None:
                cells.append(f"{'failed' if result.error else '-':>20}")
                continue
            ratio = f"({base / seconds:.2f}x)" if base is not None else "(-)"
            cells.append(f"{_img_per_s(size / seconds):>12} {ratio:>7}")
        lines.append("  " + name.ljust(width) + "".join(cells))
        if result.error:
            notes.append(f"  {name} failed: {result.error}")
    return lines + notes


def check_lines(results: dict[str, Measured], rows: list[Contender]) -> list[str]:
    """One line per checked row: its first outputs against its reference row's, over every batch size. Where both
    have kept counts, the logits are compared on the images whose counts agree (compiled blocks may round a
    near-tie decision the other way), and the others are counted."""
    lines = []
    for row in rows:
        result, ref = results[row.name], results.get(row.check_against or "")
        sizes = [s for s in result.logits if ref is not None and s in ref.logits]
        if not sizes:
            continue
        diff, images, differ, counted = 0.0, 0, 0, False
        for size in sizes:
            logits, counts, ref_counts = result.logits[size], result.counts[size], ref.counts[size]
            same = torch.ones(size, dtype=torch.bool, device=logits.device)
            if counts is not None and ref_counts is not None:
                same, counted = (counts == ref_counts).all(dim=1).to(logits.device), True
            images, differ = images + size, differ + int((~same).sum())
            if same.any():
                diff = max(diff, (logits - ref.logits[size]).abs()[same].max().item())
        line = f"  check: {row.name} vs {row.check_against}: max |logit diff| {diff:.2e}"
        if counted:
            line += ", same kept counts" if differ == 0 else f" (same kept counts); counts differ in {differ}/{images}"
        lines.append(line)
    return lines


# -- the demo ----------------------------------------------------------------------------------------------------


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Runs the demo and prints its report to ``out`` (stdout by default); returns the exit code (0)."""
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    on_gpu = options.device.type == "cuda"
    with torch.random.fork_rng():
        torch.manual_seed(options.seed)  # reproducible random weights
        model = create_model(options.model, **options.model_kwargs)
        pruner = build_pruner(options.pruner, model, options.keep_rate, **options.pruner_options)
    if options.checkpoint is not None:
        load_checkpoint(model, pruner, options.checkpoint, strip_prefix=options.strip_prefix)
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
    say(f"pruner: {describe_pruner(pv, options, options.backends)}")
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
    top_p, top_i = probs.topk(min(TOP_K_VERBOSE if options.verbose else 1, probs.shape[-1]), dim=-1)
    names = class_names(probs.shape[-1])
    counts = base.counts.cpu()
    num_patches = pv.num_patches
    more = "" if options.verbose else "; --verbose: top-5"
    say(f"Top-{top_p.shape[1]} per image (backend {base_name}{more}); kept patches per stage out of {num_patches}:")
    for b, image in enumerate(loaded):
        kept = "/".join(str(c) for c in counts[b].tolist()) or f"{num_patches} (no pruning)"
        head = f"  [{b}] {image.name} ({image.pixels.shape[1]}x{image.pixels.shape[0]}): kept {kept}"
        if not options.verbose:
            say(f"{head}: {100 * top_p[b, 0].item():.2f}% {names[int(top_i[b, 0])]}")
            continue
        say(head)
        for p, c in zip(top_p[b].tolist(), top_i[b].tolist(), strict=True):
            say(f"        {100 * p:6.2f}%  {names[c]}")
    say()

    if len(backends) > 1:
        say(f"Backend agreement (same images; {base_name} prunes, the others replay its decisions):")
        say(f"  {'backend':<12} {'max |logit diff|':>17} {'top-1 match':>12}")
        base_logits = base.logits.float()
        for name, res in results.items():
            diff = (res.logits.float() - base_logits).abs().max().item()
            match = int((res.logits.argmax(-1) == base.logits.argmax(-1)).sum())
            say(f"  {name:<12} {diff:>17.3e} {f'{match}/{len(loaded)}':>12}")
        margins = top1_margins(base.logits).cpu()
        say(
            f"  top-1 minus top-2 logit ({base_name}): min {margins.min().item():.2e}, "
            f"median {margins.median().item():.2e}"
        )
        if options.checkpoint is None:
            say(
                "  random weights: top-1 and top-2 logits lie this close, so a top-1 match is fragile; "
                "the logit diff is the measure"
            )
        say()

    repeats = options.batch_repeats or large_batch_repeats(len(loaded), on_gpu)
    large = batch.repeat(repeats, 1, 1, 1).to(options.dtype)
    batches = {1: large[:1], large.shape[0]: large} if large.shape[0] > 1 else {1: large}
    speed_backend = base_name if on_gpu else "reference"
    rows = contenders(pv, speed_backend, on_gpu)
    runs = options.timed_runs * len(batches) * len(rows)
    with progress_bar(total=runs, desc="speed", unit="run", leave=False) as bar:
        measured = measure(rows, batches, options.warmup, options.timed_runs, bar)
    baseline = next(row.name for row in rows if row.baseline)
    say(
        f"Speed in img/s (median of {options.timed_runs} forwards after {options.warmup} warm-up, pruning included; "
        f"ratio to {baseline}):"
    )
    for line in speed_lines(measured, list(batches), baseline):
        say(line)
    for line in check_lines(measured, rows):
        say(line)
    if not on_gpu:
        say("  (CPU: reference backend, eager only; on a GPU the demo adds torch.compile and CUDA graphs)")
    return 0
