"""The model families of ``tests/test_models.py``: keep-rate-1.0 difference against timm; ``--speed``: GPU throughput.

Run from the repository root (``docs/models.md`` has both tables).

``python -m ci.model_families [--families a,b]`` (CPU: fp32 only; on a GPU also fp16 with the Triton kernel). For
each family (random weights, 4 blocks of width 64): max |logit diff| of the unpruned pipeline and of the pipeline at
keep rate 1.0 (Threshold-L2 ratio) against timm's own forward of the same model, in fp32, and on a GPU in fp16
against timm in fp32, beside timm's own fp16 error (the tests allow twice that).

``python -m ci.model_families --speed [--families a,b] [--batch 64] [--out FILE.json] [--max-minutes M]`` (CUDA
GPU): one row per family, its FULL-SIZE timm model (:data:`SPEED_MODELS`: random seeded weights, fp16, 1000
classes; ``vit_base_patch14_reg4_dinov2`` is built at ``img_size=224``, 256 patches, so that its token count stays
ViT-B-like instead of 1369 at its native 518), plus ViT-L/16 (``vit_large``) and ViT-H/14 (``vit_huge``, head dim
80: the kernel pads it to 128 inside). Per row, throughput (img/s) at batch ``--batch`` of

* (a) the unpruned timm model under ``torch.compile(mode="reduce-overhead")`` (timm's own patch embedding), and
* (b) the pruned pipeline: ``ragged_vit.prune(model, "threshold_l2", 0.5, "triton", threshold_mode="ratio")``
  (the top ``ceil(0.5 * patches)`` patches after a quarter of the depth, block 3 of 12: works on every family,
  fixed counts, so the whole forward is ONE CUDA graph) with ``compile_blocks=True`` (and the default GEMM patch
  embedding), replayed by ``GraphedPrunedViT``,

and their ratio b / a. Before it is timed, each output is checked: finite logits of shape ``[B, 1000]``, and for (b)
every image's kept count equal to the plan's. The timing is ``report_e2e``'s (``benchmarks.timing.forward_times``:
warm-up, then forwards one at a time, synchronised; throughput = B / median wall time; CUDA-event medians too), with
few iterations: compilation dominates the run. Between families the model, graphs and compiled code are freed
(``torch._dynamo.reset()``, ``torch.cuda.empty_cache()``). Progress, with elapsed seconds, goes to stderr per
family; the JSON (``--out``) is rewritten after every family (a cut run keeps its rows); the markdown table (card and
versions first) is printed last. ``--dry-run`` prints what would run (models built on the meta device), CPU too.

Run time (estimated, not measured): compiling dominates. The e2e report's compiled ViT-B rows took 5-15 s each with
Inductor's cache warm (H100/H200); a fresh machine compiles slower, and ViT-L/H compile one graph over 20/28 packed
blocks (and timm's 24/32) per row. The twelve rows are therefore meant for two device calls (:data:`SPEED_SPLIT`),
each the big model first, then five ViT-B rows (those share compiled kernels through Inductor's cache)::

    python -m ci.model_families --speed --out speed-1.json \
        --families vit_large,deit,deit_distilled,deit3_layerscale,reg4_avg_no_class,dinov2_reg4
    python -m ci.model_families --speed --out speed-2.json \
        --families vit_huge,siglip_map,clip_norm_pre,qk_norm,class_avg,avgmax

``--max-minutes`` (default 7) skips, and records as skipped, the families not started in time, so a call ends with
its table inside 10 minutes; rerun the skipped ones with ``--families``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import timm
import torch

from benchmarks import comma_list
from benchmarks.e2e_common import no_tf32
from benchmarks.report_e2e import cudagraph_skips
from benchmarks.timing import describe, elapsed, environment, forward_times
from benchmarks.workloads import synthetic_images
from ragged_vit import GraphedPrunedViT, PrunedViT, prune
from ragged_vit.reference.pruners import make_pruner

# The small models of the families (tests/test_models.py runs them; docs/models.md lists them).
SMALL = dict(depth=4, embed_dim=64, num_heads=2, num_classes=10)
FAMILIES = {
    "deit": ("deit_tiny_patch16_224", dict(img_size=64)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=64)),  # 2 prefix tokens, two heads
    "deit3_layerscale": ("deit3_small_patch16_224", dict(img_size=64)),  # LayerScale, no_embed_class
    "reg4_avg_no_class": ("vit_base_patch16_reg4_gap_256", dict(img_size=64)),  # 4 registers, no class, avg
    "dinov2_reg4": ("vit_small_patch14_reg4_dinov2", dict(img_size=56)),  # class + 4 registers, LayerScale
    "siglip_map": ("vit_base_patch16_siglip_224", dict(img_size=64)),  # no prefix, attention pooling
    "clip_norm_pre": ("vit_base_patch16_clip_224", dict(img_size=64)),  # norm_pre
    "qk_norm": ("vit_small_patch16_224", dict(img_size=64, qk_norm=True)),
    "class_avg": ("vit_small_patch16_224", dict(img_size=64, global_pool="avg")),  # avg with a class token, fc_norm
    "avgmax": ("vit_small_patch16_224", dict(img_size=64, class_token=False, global_pool="avgmax")),
}


def family(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's small model (``SMALL``), random weights of ``seed``, its qkv scaled for peaked attention."""
    model_name, kwargs = FAMILIES[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = timm.create_model(model_name, pretrained=False, **SMALL, **kwargs).eval()
        for block in model.blocks:  # peaked attention: the pruners keep different counts per image
            block.attn.qkv.weight.data.mul_(4.0)
    return model


def images(model: torch.nn.Module, count: int, seed: int) -> torch.Tensor:
    """``count`` random images at the model's size, each at its own scale (0.2 to 2)."""
    g = torch.Generator().manual_seed(seed)
    size = model.patch_embed.img_size
    return torch.randn(count, 3, *size, generator=g) * torch.linspace(0.2, 2.0, count)[:, None, None, None]


PROG = "python -m ci.model_families"


@dataclass(frozen=True)
class SpeedModel:
    """The full-size timm model of a speed row: its name, ``timm.create_model`` arguments and what they change."""

    model: str
    kwargs: dict[str, object] = field(default_factory=dict)
    note: str = ""


# One per family of tests/test_models.FAMILIES (same keys, the same structure at full size), then the extra rows.
SPEED_MODELS: dict[str, SpeedModel] = {
    "deit": SpeedModel("deit_base_patch16_224"),
    "deit_distilled": SpeedModel("deit_base_distilled_patch16_224"),
    "deit3_layerscale": SpeedModel("deit3_base_patch16_224"),
    "reg4_avg_no_class": SpeedModel("vit_base_patch16_reg4_gap_256", note="its own 256x256: 256 patches"),
    "dinov2_reg4": SpeedModel("vit_base_patch14_reg4_dinov2", {"img_size": 224}, "img_size=224 (native 518)"),
    "siglip_map": SpeedModel("vit_base_patch16_siglip_224"),
    "clip_norm_pre": SpeedModel("vit_base_patch16_clip_224"),
    "qk_norm": SpeedModel("vit_base_patch16_224", {"qk_norm": True}, "qk_norm=True"),
    "class_avg": SpeedModel("vit_base_patch16_224", {"global_pool": "avg"}, "global_pool='avg'"),
    "avgmax": SpeedModel(
        "vit_base_patch16_224", {"class_token": False, "global_pool": "avgmax"}, "no class token, 'avgmax'"
    ),
    "vit_large": SpeedModel("vit_large_patch16_224", note="ViT-L/16"),
    "vit_huge": SpeedModel("vit_huge_patch14_224", note="ViT-H/14, head dim 80"),
}
EXTRA_SPEED = ("vit_large", "vit_huge")  # speed rows only: no small test family
SPEED_SPLIT = (  # the two device calls of the module docstring: the big model first, then five ViT-B rows
    ("vit_large", "deit", "deit_distilled", "deit3_layerscale", "reg4_avg_no_class", "dinov2_reg4"),
    ("vit_huge", "siglip_map", "clip_norm_pre", "qk_norm", "class_avg", "avgmax"),
)
SPEED_KEEP = 0.5  # Threshold-L2 ratio keep rate (after a quarter of the depth: block 3 of 12)
NUM_CLASSES = 1000
INPUT_SETS = 3  # input batches the timed loops rotate through (as report_e2e)
TIMING = dict(warmup=3, target_s=0.25, min_iters=10, max_iters=30)  # report_e2e --quick's, at most 30 forwards
DEFAULT_MINUTES = 7.0


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block): ``python -m ci.model_families: error: --families: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--speed", action="store_true", help="the GPU speed table of the full-size models")
    parser.add_argument(
        "--families",
        default=None,
        help="comma-separated subset (default: all): " + ",".join(SPEED_MODELS) + " (the last two with --speed only)",
    )
    parser.add_argument("--batch", type=int, default=None, help="--speed: batch size (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="--speed: JSON file of the rows")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help=f"--speed: families not started after this many minutes are skipped (default {DEFAULT_MINUTES}; 0: none)",
    )
    parser.add_argument("--dry-run", action="store_true", help="--speed: print what would run (no GPU needed)")
    args = parser.parse_args(argv)
    if not args.speed:
        used = [f"--{n.replace('_', '-')}" for n in ("batch", "out", "max_minutes") if getattr(args, n) is not None]
        used += ["--dry-run"] if args.dry_run else []
        if used:
            parser.error(f"{', '.join(used)}: only with --speed")
    try:
        args.families = resolve_families(args.families, args.speed)
    except ValueError as exc:
        parser.error(f"--families: {exc}")
    if args.batch is None:
        args.batch = 64
    elif args.batch < 1:
        parser.error(f"--batch: must be >= 1, got {args.batch}")
    if args.max_minutes is None:
        args.max_minutes = DEFAULT_MINUTES
    elif args.max_minutes < 0:
        parser.error(f"--max-minutes: must be >= 0, got {args.max_minutes}")
    return args


def resolve_families(text: str | None, speed: bool) -> tuple[str, ...]:
    """The families named in ``text`` (comma-separated, in the order given, each once), or all of them: the test
    families, and with ``speed`` the extra speed rows too. An unknown name raises ``ValueError`` listing the choices."""
    choices = tuple(SPEED_MODELS) if speed else tuple(FAMILIES)
    extra = [] if speed or not text else [n for n in EXTRA_SPEED if n in text.replace(" ", "").split(",")]
    if extra:
        raise ValueError(f"{', '.join(extra)}: speed rows only (no small test family): add --speed")
    names = comma_list(text, str, choices)
    if names is None:
        return choices
    return tuple(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------------- keep rate 1.0


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def accuracy_table(names: Sequence[str]) -> None:
    """The keep-rate-1.0 table of the module docstring, one row per test family."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    head = "| family | timm model | prefix | pool | fp32 unpruned | fp32 keep 1.0 |"
    head += " fp16 keep 1.0 (Triton) | timm fp16 |" if cuda else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in names:
        model_name = FAMILIES[name][0]
        model = family(name).to(device)
        x = images(model, 4, 4).to(device)
        keep_all = make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1)
        with torch.no_grad(), no_tf32():
            ref = model(x)
            unpruned = PrunedViT(model).run(x).logits
            kept = PrunedViT(model, keep_all, "reference").run(x).logits
            cells = [f"{_diff(unpruned, ref):.1e}", f"{_diff(kept, ref):.1e}"]
            if cuda:
                half = PrunedViT(model.half(), keep_all.half(), "triton").run(x.half()).logits
                cells += [f"{_diff(half, ref):.1e}", f"{_diff(model(x.half()), ref):.1e}"]
        print(f"| {name} | `{model_name}` | {model.num_prefix_tokens} | {_pool(model)} | " + " | ".join(cells) + " |")


def _pool(model: torch.nn.Module) -> str:
    return "map" if getattr(model, "attn_pool", None) is not None else model.global_pool


# --------------------------------------------------------------------------------------------------- speed


def speed_model(name: str, device: torch.device | str, seed: int = 0) -> torch.nn.Module:
    """The full-size model of speed row ``name`` on ``device`` (``"meta"``: shapes only), random seeded weights,
    :data:`NUM_CLASSES` classes, eval mode; never downloads."""
    spec = SPEED_MODELS[name]
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = timm.create_model(spec.model, pretrained=False, num_classes=NUM_CLASSES, **spec.kwargs)
    return model.eval()


def pruned_pipeline(model: torch.nn.Module) -> PrunedViT:
    """Speed row (b)'s pipeline: Threshold-L2 ratio at :data:`SPEED_KEEP` after a quarter of the depth, Triton, compiled
    blocks."""
    pv = prune(model, "threshold_l2", SPEED_KEEP, "triton", threshold_mode="ratio")
    pv.compile_blocks = True
    return pv


def geometry(name: str, model: torch.nn.Module, pv: PrunedViT) -> dict[str, object]:
    """What a speed row runs: model, image size, tokens, heads, and the patches every image keeps."""
    attn = model.blocks[0].attn
    prefix = model.num_prefix_tokens
    spec = SPEED_MODELS[name]
    return {
        "family": name,
        "model": spec.model,
        "kwargs": dict(spec.kwargs),
        "note": spec.note,
        "image_size": int(model.patch_embed.img_size[0]),
        "patches": int(model.patch_embed.num_patches),
        "prefix": prefix,
        "tokens": pv.plan.tokens,
        "pool": _pool(model),
        "depth": len(model.blocks),
        "width": model.embed_dim,
        "heads": attn.num_heads,
        "head_dim": attn.head_dim,
        "kept_patches": [stage.rows_after - prefix for stage in pv.plan.stages],
    }


def planned(name: str) -> dict[str, object]:
    """The geometry of speed row ``name``, from its model built on the meta device (no weights, no GPU)."""
    model = speed_model(name, "meta")
    return geometry(name, model, pruned_pipeline(model))


def check_output(logits: torch.Tensor, batch: int, counts: torch.Tensor | None = None, kept: int | None = None):
    """None if ``logits`` are finite ``[batch, NUM_CLASSES]`` (and every image's ``counts`` equal ``kept``), else
    the reason."""
    if tuple(logits.shape) != (batch, NUM_CLASSES):
        return f"logits have shape {tuple(logits.shape)}, expected {(batch, NUM_CLASSES)}"
    if not bool(logits.isfinite().all()):
        return f"{int((~logits.isfinite()).sum())} non-finite logits"
    if counts is not None and not bool(counts.eq(kept).all()):
        return f"kept counts {sorted(set(counts.flatten().tolist()))}, expected {kept} for every image"
    return None


def _first(fn: Callable, img: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """Seconds of the first call (compilation, capture), its logits (fp32 copy) and counts (if any)."""
    box = []

    def call() -> None:
        out = fn(img)
        counts = getattr(out, "counts", None)
        box.append((getattr(out, "logits", out).float().clone(), None if counts is None else counts.clone()))

    with torch.no_grad():
        seconds = elapsed([call])
    return seconds, *box[0]


def _timed(calls: Sequence[Callable], batch: int) -> dict[str, object]:
    times = forward_times(calls, torch.device("cuda"), context=torch.no_grad, **TIMING)
    return {
        "status": "ok",
        "wall_us": times.wall.to_dict(),
        "events_us": times.events.to_dict() if times.events else None,
        "iters": times.iters,
        "img_per_s": batch / (times.wall.median * 1e-6),
    }


def _free() -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled code and reduce-overhead's CUDA-graph pool
    torch.cuda.empty_cache()


def timm_compiled(model: torch.nn.Module, imgs: Sequence[torch.Tensor]) -> dict[str, object]:
    """Row (a): the unpruned model under ``torch.compile(mode="reduce-overhead")``, checked, then timed."""
    batch = imgs[0].shape[0]
    skips = cudagraph_skips()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    firsts = [_first(compiled, img) for img in imgs]  # compile; record the CUDA graph; first replays
    entry: dict[str, object] = {
        "compile_s": round(firsts[0][0], 2),
        "first_calls_s": [round(f[0], 3) for f in firsts],
        "cudagraph_skips": cudagraph_skips() - skips,  # > 0: it ran without CUDA graphs
    }
    reason = check_output(firsts[0][1], batch)
    if reason:
        return {**entry, "status": "failed", "reason": reason}
    return {**entry, **_timed([functools.partial(compiled, img) for img in imgs], batch)}


def pruned_graphed(pv: PrunedViT, imgs: Sequence[torch.Tensor]) -> dict[str, object]:
    """Row (b): the pruned pipeline replayed by ``GraphedPrunedViT`` (compiled blocks), checked, then timed."""
    batch = imgs[0].shape[0]
    kept = pv.plan.stages[0].rows_after - pv.plan.num_prefix
    runner = GraphedPrunedViT(pv)
    try:
        capture_s, logits, counts = _first(runner.run, imgs[0])  # compiles the blocks, captures the graph
        entry: dict[str, object] = {"capture_s": round(capture_s, 2), "graphs": runner.counters.captures}
        reason = check_output(logits, batch, counts, kept)
        if reason:
            return {**entry, "status": "failed", "reason": reason}
        return {**entry, **_timed([functools.partial(runner.run, img) for img in imgs], batch)}
    finally:
        runner.reset()


def speed_row(name: str, batch: int, log: Callable[[str], None]) -> dict[str, object]:
    """Builds, checks and times both rows of family ``name``; a failing half is reported, not raised."""
    model = speed_model(name, "cuda").half()
    pv = pruned_pipeline(model)
    row = geometry(name, model, pv)
    size = row["image_size"]
    imgs = [synthetic_images(batch, size, 1000 * i + batch).to("cuda", torch.float16) for i in range(INPUT_SETS)]
    torch.cuda.reset_peak_memory_stats()
    halves = {"timm_compiled": lambda: timm_compiled(model, imgs), "pruned_graphed": lambda: pruned_graphed(pv, imgs)}
    for key, run in halves.items():
        log(f"{name}: {key} ...")
        try:
            row[key] = run()
        except Exception as exc:  # one broken row must not end a run on a lent machine: report it, go on
            traceback.print_exc(file=sys.stderr)
            row[key] = {"status": "failed", "reason": f"raised {describe(exc)}"}
            torch.cuda.synchronize()  # a sticky CUDA error surfaces here and ends the run, as it should
        _free()
        done = row[key]
        log(f"{name}: {key} " + (f"{done['img_per_s']:.0f} img/s" if done["status"] == "ok" else done["reason"]))
    row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    a, b = row["timm_compiled"], row["pruned_graphed"]
    if a["status"] == b["status"] == "ok":
        row["ratio"] = b["img_per_s"] / a["img_per_s"]
    return row


def _rate(half: dict | None, row: dict) -> str:
    if not half:
        return str(row.get("status", "-"))  # skipped (--max-minutes), or "-" in a dry run
    return f"{half['img_per_s']:.0f}" if half.get("status") == "ok" else str(half.get("status"))


def speed_table(meta: dict[str, object], rows: Sequence[dict[str, object]]) -> str:
    """The markdown table (card and versions first) of speed rows (dry-run rows have no times: ``-``)."""
    lines = [
        f"card: {meta.get('card') or 'none'}, torch {meta['torch']}, triton {meta['triton']}, timm {meta['timm']}, "
        f"CUDA {meta.get('cuda')}, commit {meta.get('commit')}; batch {meta['batch']}, fp16, random weights; "
        f"pruned: Threshold-L2 ratio keep {SPEED_KEEP} after a quarter of the depth, Triton, GraphedPrunedViT + "
        "compile_blocks",
        "",
        "| family | timm model | image | tokens | heads x dim | depth | kept patches "
        "| timm reduce-overhead (img/s) | pruned graphed (img/s) | pruned / timm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        model = f"`{r['model']}`" + (f" ({r['note']})" if r["note"] else "")
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(
            f"| {r['family']} | {model} | {r['image_size']} | {r['tokens']} | {r['heads']} x {r['head_dim']} "
            f"| {r['depth']} | {', '.join(map(str, r['kept_patches']))} | {_rate(r.get('timm_compiled'), r)} "
            f"| {_rate(r.get('pruned_graphed'), r)} | {ratio} |"
        )
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    """Writes ``payload`` atomically (a partial file never replaces a complete one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)


def speed(args: argparse.Namespace) -> int:
    meta = {**environment(), "timm": timm.__version__, "batch": args.batch, "keep_rate": SPEED_KEEP}
    if args.dry_run:
        print(speed_table(meta, [planned(name) for name in args.families]))
        return 0
    if not torch.cuda.is_available():
        print(f"{PROG} --speed needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run shows the plan",
              file=sys.stderr)  # fmt: skip
        return 2
    meta.update(dtype="float16", timing=TIMING, input_sets=INPUT_SETS, families=list(args.families))
    payload: dict[str, object] = {"meta": meta, "rows": []}
    started = time.perf_counter()
    deadline = started + 60 * args.max_minutes if args.max_minutes > 0 else math.inf

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    log(f"{len(args.families)} families on {meta['card']}, B={args.batch}" + (f" -> {args.out}" if args.out else ""))
    torch.set_num_threads(1)  # the host side must not compete with itself (docs/measuring.md)
    for name in args.families:
        t0 = time.perf_counter()
        if t0 > deadline:
            row = {**planned(name), "status": "skipped"}
            row["reason"] = f"time budget (--max-minutes {args.max_minutes:g}) used up before this family started"
            log(f"{name}: skipped (--max-minutes)")
        else:
            row = speed_row(name, args.batch, log)
        row["elapsed_s"] = round(time.perf_counter() - t0, 1)
        payload["rows"].append(row)
        meta["elapsed_s"] = round(time.perf_counter() - started, 1)
        if args.out:
            write_json(args.out, payload)
        _free()
    print(speed_table(meta, payload["rows"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.speed:
        return speed(args)
    accuracy_table(args.families)
    return 0


if __name__ == "__main__":
    sys.exit(main())
