"""The call users make, against their real alternative: ``PrunedViT(model, pruner, "triton")(images)`` (what
``ragged_vit.prune(model, ...)`` returns) against the unpruned timm model under ``torch.compile(mode=
"reduce-overhead")``, in one process on one card.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.default_call --out default_call.json                       # B = 1, 4, 64, every workload
    python -m benchmarks.default_call --stream 200 --first-calls --eager-rounds 3   # the other targets
    python -m benchmarks.default_call --model vit_base_patch16_dinov3 --img-size 224 --workloads l2:0.5,evit:0.7 \
        --rows timm_compiled,default --out DIR/                  # issue 40: DIR/default_call_<model>_<size>.json
    python -m benchmarks.default_call --smoke --model eva02_base_patch14_224 --img-size 56   # any machine, CPU

DeiT-B 224 fp16 by default (``--model``: any timm model ``ragged_vit.prune`` takes, at ``--img-size``), random
seeded weights (``pretrained=False``: nothing is downloaded; ``--checkpoint PATH`` loads a local file), each
workload at its keep rate (Threshold-L2 calibrated 0.5, ATS 0.5, DynamicViT 0.7, EViT 0.7, ToMe ``r = 13``; ``l2``
names Threshold-L2 calibrated). A workload whose pruner does not apply to the model (EViT and ATS need a class
token, ToMe refuses RoPE models) is refused in one line before anything is timed. ``--out DIR/`` (a directory)
writes :func:`result_file`'s name in it: ``default_call.json`` for DeiT-B 224, ``default_call_<model>[_<size>].json``
for any other model, which is where ``benchmarks.make_results`` looks for them; the file is rewritten after every
batch size, so a run cut short keeps what it measured (``"complete": false``). ``--smoke``: a tiny model of the same
family on the CPU (fp32, reference backend, one timed forward, rows ``default`` and ``eager``): the plumbing, not a
timing. Rows:

* ``timm_eager``; ``timm_compiled``: ``torch.compile(model, mode="reduce-overhead", dynamic=False)``, compiled anew
  for each batch size (a fresh Dynamo): the best a user gets from one line; ``timm_max_autotune``: the same with
  ``mode="max-autotune"`` (Inductor's GEMM search, CUDA graphs too; minutes of compiling per batch size, so only when
  ``--rows`` names it);
* ``default``: the pipeline as constructed, called: ``mode="auto"`` (CUDA graphs per batch bucket, compiled
  blocks), or, run against an older checkout, whatever its default call did;
* ``eager``: ``mode="eager"`` (skipped where the checkout has no modes);
* ``graphed``: the expert path, ``GraphedPrunedViT(PrunedViT(..., compile_blocks=True))`` (the same in every
  checkout: the before/after of the graphed path).

Each row is checked before it is timed (its counts against the eager pipeline's; its logits on the images whose
counts agree, to fp16 with compiled rounding), then timed with :func:`benchmarks.timing.forward_times`: each
forward synchronised (median), and as many back to back. ``--first-calls``: the seconds until the first logits of
each new batch size (ours: its bucket's compilation and capture; timm: its compilation and graph recording).
``--stream N``: N batches, sizes drawn from 1-64 (seed 0), after a first pass over the distinct sizes: ours against
timm under ``torch.compile``'s defaults (``dynamic=None``: it recompiles with dynamic shapes at the second size and
records a CUDA graph per size), total seconds each forward synchronised and back to back. ``--eager-rounds R``: timm
eager and ``mode="eager"`` in turn, R rounds, B = 1, 4, 16, 64. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import random
import sys
import time
from pathlib import Path

import torch

import ragged_vit
from benchmarks import comma_list
from benchmarks.e2e_common import DEIT_B, Lab
from benchmarks.timing import elapsed, environment, forward_times, sync
from benchmarks.workloads import WORKLOADS
from ragged_vit import GraphedPrunedViT, PrunedViT
from ragged_vit.pipelines.weights import create_model, load_checkpoint

DEFAULT_WORKLOADS = (("l2_calibrated", 0.5), ("ats", 0.5), ("dynamicvit", 0.7), ("evit", 0.7), ("tome", 13))
ALIASES = {"l2": "l2_calibrated"}  # --workloads shorthands
DEFAULT_ROWS = ("timm_compiled", "default", "eager", "graphed")
ROWS = (*DEFAULT_ROWS, "timm_max_autotune")
TIMM_MODES = {"timm_compiled": "reduce-overhead", "timm_max_autotune": "max-autotune"}  # timm's rows: compile modes
SMOKE_ROWS = ("default", "eager")  # what runs on the CPU: timm_compiled and graphed compile for CUDA
SMOKE = dict(depth=3, embed_dim=64, num_heads=2, num_classes=10)  # --smoke's model overrides (the family's layout)
HAS_MODES = "mode" in inspect.signature(PrunedViT).parameters  # False against checkouts before the modes


class CallLab(Lab):
    """The lab of one model: ``name`` built with ``options`` (an image size, the smoke model's overrides) and an
    optional local checkpoint, its pipelines on ``backend``."""

    def __init__(self, device: torch.device, dtype: torch.dtype, name: str = DEIT_B, options: dict | None = None,
                 checkpoint: Path | None = None, backend: str = "triton") -> None:  # fmt: skip
        super().__init__(device, dtype)
        self.name, self.options, self.checkpoint, self.backend = name, dict(options or {}), checkpoint, backend

    def model(self, name: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
        key = (name, torch.float32)
        if key not in self._models and name == self.name and (self.options or self.checkpoint):
            with torch.random.fork_rng(devices=[]):  # the same seeded draw as the lab's own models
                torch.manual_seed(self.seed)
                model = create_model(name, **self.options)
            if self.checkpoint is not None:
                load_checkpoint(model, None, self.checkpoint)
            self._models[key] = model.to(self.device).eval()
        return super().model(name, dtype)


def pipeline(lab: CallLab, workload: str, keep: float, **kwargs: object) -> PrunedViT:
    """The workload's pipeline on the lab's model (shared; pruners cached by the lab; ToMe: a fixed ``r = keep``)."""
    model = lab.model(lab.name)
    if workload == "tome":
        merger = ragged_vit.build_pruner("tome", model, r=int(keep)).to(lab.device, lab.dtype)
        return PrunedViT(model, merger, lab.backend, **kwargs)
    return PrunedViT(model, lab.pruner(lab.name, workload, keep), lab.backend, **kwargs)


def result_file(model: str = DEIT_B, img_size: int | None = None) -> str:
    """The stored name of a run: ``default_call.json`` for DeiT-B 224 (issue 36's run), else
    ``default_call_<model>.json``, with ``_<img_size>`` unless the model's name already ends with it."""
    if model == DEIT_B and img_size in (None, 224):
        return "default_call.json"
    suffix = "" if img_size is None or model.endswith(f"_{img_size}") else f"_{img_size}"
    return f"default_call_{model}{suffix}.json"


def refusal(lab: CallLab, workload: str, keep: float) -> str | None:
    """Why ``workload`` does not apply to the lab's model (None where it does): its pipeline built and run on one
    image, eagerly, so that the model's checks (a class token, RoPE) speak before anything is compiled or timed."""
    try:
        with torch.no_grad():
            pipeline(lab, workload, keep, mode="eager").run(lab.images(lab.name, 1)[0])
    except (ValueError, NotImplementedError) as exc:
        return " ".join(str(exc).split())
    return None


def row_forward(lab: Lab, workload: str, keep: float, row: str):
    """``(forward, cleanup)`` of one pruned row."""
    if row == "default":
        pv = pipeline(lab, workload, keep)
        return pv, getattr(pv, "reset_graphs", lambda: None)
    if row == "eager":
        return pipeline(lab, workload, keep, mode="eager"), lambda: None
    runner = GraphedPrunedViT(pipeline(lab, workload, keep, compile_blocks=True))
    return runner, runner.reset


AGREE = 0.25  # max |logit diff| of an image that took the eager pipeline's decisions (fp16 rounding moves less)


def check(out: tuple[torch.Tensor, torch.Tensor], ref: object) -> dict[str, object]:
    """Each image against the eager pipeline: it agrees when its counts are equal and its logits within
    :data:`AGREE`. Compiled blocks round differently and may flip a decision near a tie: a count, or with a fixed
    count (EViT) which rows are kept, which only the logits show. At least half the images must agree (a broken
    pipeline moves every image's logits by O(1)); ``max_abs_diff`` is over those that do, ``max_abs_diff_all`` over
    all."""
    logits, counts = out
    diffs = (logits.float() - ref.logits.float()).abs().amax(dim=1)
    same = (counts == ref.counts).all(dim=1)
    agree = same & (diffs < AGREE)
    ok = bool(torch.isfinite(logits).all()) and agree.float().mean().item() >= 0.5
    return {"ok": ok, "counts_agree": same.float().mean().item(), "images_agree": agree.float().mean().item(),
            "max_abs_diff": diffs[agree].max().item() if bool(agree.any()) else None,
            "max_abs_diff_all": diffs.max().item()}  # fmt: skip


TIMING = dict(warmup=3, target_s=0.4, min_iters=15, max_iters=80)
SMOKE_TIMING = dict(warmup=1, target_s=0.0, min_iters=1, max_iters=1)  # --smoke: one forward, the plumbing only


def timed(calls: list, device: torch.device) -> dict[str, float]:
    limits = TIMING if device.type == "cuda" else SMOKE_TIMING
    times = forward_times(calls, device, back_to_back=True, **limits)
    return {"each_us": times.wall.median, "each_q1": times.wall.q1, "each_q3": times.wall.q3,
            "back_to_back_us": times.back_to_back, "iters": times.iters}  # fmt: skip


def first_call(forward, images: torch.Tensor, device: torch.device) -> tuple[float, object]:
    out = []
    seconds = elapsed([lambda: out.append(forward(images))], device)
    return seconds, out[0]


def timm_compiled(model: torch.nn.Module, images: list[torch.Tensor], device: torch.device,
                  mode: str = "reduce-overhead") -> dict[str, object]:  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, dynamic=False)
    seconds, logits = first_call(compiled, images[0], device)
    ref = model(images[0])
    entry = {"first_call_s": round(seconds, 3), "max_abs_diff": (logits.float() - ref.float()).abs().max().item()}
    return {**entry, **timed([functools.partial(compiled, img) for img in images], device)}


def ours(lab: Lab, workload: str, keep: float, row: str, images: list[torch.Tensor]) -> dict[str, object]:
    """One pruned row, checked then timed; its first call compiles what earlier rows of the process did not."""
    forward, cleanup = row_forward(lab, workload, keep, row)
    try:
        seconds, _ = first_call(functools.partial(forward, return_counts=True), images[0], lab.device)
        ref = pipeline(lab, workload, keep).run(images[0]) if not HAS_MODES else \
            pipeline(lab, workload, keep, mode="eager").run(images[0])  # fmt: skip
        entry = {"first_call_s": round(seconds, 3), "check": check(forward(images[0], return_counts=True), ref)}
        if not entry["check"]["ok"]:
            return {**entry, "status": "failed"}
        return {**entry, **timed([functools.partial(forward, img) for img in images], lab.device)}
    finally:
        cleanup()


def main_table(lab: CallLab, workloads, batches, rows, save=lambda results: None) -> list[dict]:
    """Every row at every batch size; ``save(results)`` after each batch size (a run cut short keeps those)."""
    results = []
    model = lab.model(lab.name)
    for batch in batches:
        images = lab.images(lab.name, batch)
        with torch.no_grad():
            base = {"batch": batch, "timm_eager": timed([functools.partial(model, img) for img in images], lab.device)}
            for row in (r for r in rows if r in TIMM_MODES):
                base[row] = timm_compiled(model, images, lab.device, TIMM_MODES[row])
            results.append(base)
            for workload, keep in workloads:
                for row in rows:
                    if row in TIMM_MODES or (row == "eager" and not HAS_MODES):
                        continue
                    entry = ours(lab, workload, keep, row, images)
                    results.append({"batch": batch, "workload": workload, "keep": keep, "row": row, **entry})
                    print(json.dumps(results[-1]), flush=True)
        save(results)
    return results


def stream(lab: CallLab, workloads, n: int) -> dict[str, object]:
    """``n`` batches, sizes from 1-64 (seed 0), after a first pass over the distinct sizes."""
    sizes = random.Random(0).choices(range(1, 65), k=n)
    pool = lab.images(lab.name, 64)[0]
    batches = [pool[:b] for b in sizes]
    out = {"sizes": sizes, "distinct": len(set(sizes))}

    def clocks(forward) -> dict[str, float]:
        first = elapsed([functools.partial(forward, pool[:b]) for b in sorted(set(sizes))], lab.device)
        each = 0.0
        for images in batches:
            sync(lab.device)
            t0 = time.perf_counter()
            forward(images)
            sync(lab.device)
            each += time.perf_counter() - t0
        in_a_row = elapsed([functools.partial(forward, images) for images in batches], lab.device)
        return {"first_pass_s": round(first, 2), "each_s": each, "back_to_back_s": in_a_row,
                "img_per_s_each": sum(sizes) / each, "img_per_s_back_to_back": sum(sizes) / in_a_row}  # fmt: skip

    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(lab.model(lab.name), mode="reduce-overhead")  # torch's defaults: dynamic=None
        out["timm_compiled"] = clocks(compiled)
        for workload, keep in workloads:
            torch._dynamo.reset()
            forward, cleanup = row_forward(lab, workload, keep, "default")
            out[workload] = clocks(forward)
            cleanup()
            print(json.dumps({workload: out[workload]}), flush=True)
    return out


def eager_rounds(lab: CallLab, workloads, rounds: int, batches=(1, 4, 16, 64)) -> list[dict]:
    """timm eager and every workload's ``mode="eager"`` pipeline in turn, ``rounds`` times."""
    model, results = lab.model(lab.name), []
    with torch.no_grad():
        for batch in batches:
            images = lab.images(lab.name, batch)
            pvs = {w: pipeline(lab, w, k, mode="eager") for w, k in workloads}
            for r in range(rounds):
                row = {"batch": batch, "round": r, "timm_eager": timed([functools.partial(model, i) for i in images],
                                                                        lab.device)}  # fmt: skip
                for w, pv in pvs.items():
                    row[w] = timed([functools.partial(pv, img) for img in images], lab.device)
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters as the forward reads them (the weight-read floor's numerator)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parse_workloads(text: str) -> list[tuple[str, float]]:
    """``WORKLOAD:KEEP,...`` (``tome:R``: ToMe with a fixed ``r = R``; :data:`ALIASES` resolved)."""
    workloads = []
    for item in text.split(","):
        name, _, keep = item.partition(":")
        name = ALIASES.get(name, name)
        if name != "tome" and name not in WORKLOADS:
            raise ValueError(f"--workloads: unknown workload {name!r}")
        workloads.append((name, float(keep) if keep else 0.5))
    return workloads


SAME_RUN_KEYS = ("model", "img_size", "dtype", "weights", "smoke")
"""What an appended run (``--append``) must share with the stored one whose rows it keeps."""


def earlier_rows(out: Path | None, payload: dict, batches: list[int]) -> tuple[list[dict], list[dict]]:
    """``--append``: the rows of the run stored at ``out`` at batch sizes not in ``batches``, and where they came from
    (``earlier``: one entry per earlier run, its batch sizes, environment and arguments). Nothing stored: none.
    Raises ``ValueError`` (one line) for no ``--out`` or a stored run of another model, size, dtype or weights."""
    if out is None:
        raise ValueError("needs --out, the run to add to")
    if not out.exists():
        return [], []
    stored = json.loads(out.read_text())
    for key in SAME_RUN_KEYS:
        if stored.get(key) != payload[key]:
            raise ValueError(f"{out} holds a run with {key} {stored.get(key)!r}, this one has {payload[key]!r}")
    kept = [entry for entry in stored.get("table", []) if entry["batch"] not in batches]
    left = {entry["batch"] for entry in kept}
    runs = [*stored.get("earlier", []), {"batches": None, "environment": stored.get("environment", {}),
                                         "argv": stored.get("argv", [])}]  # fmt: skip
    earlier = []
    for run in runs:  # the stored run's own rows (batches None): those not from a run before it
        before = {b for r in earlier for b in r["batches"]}
        mine = left - before if run["batches"] is None else left & set(run["batches"])
        if mine:
            earlier.append({**run, "batches": sorted(mine)})
    return kept, earlier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.default_call", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEIT_B, help="a timm model name (random weights unless --checkpoint)")
    parser.add_argument("--img-size", type=int, default=None, help="the image size (default: the model's own)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a local checkpoint file for the model")
    parser.add_argument("--batches", default="1,4,64")
    parser.add_argument("--workloads", default=",".join(f"{w}:{k:g}" for w, k in DEFAULT_WORKLOADS),
                        help="WORKLOAD:KEEP,... (tome:R is ToMe with a fixed r = R; l2 is l2_calibrated)")  # fmt: skip
    parser.add_argument("--rows", default=None, help=f"comma-separated, of {', '.join(ROWS)}; none: '' (default: "
                        f"{','.join(DEFAULT_ROWS)}; --smoke: {','.join(SMOKE_ROWS)})")  # fmt: skip
    parser.add_argument("--stream", type=int, default=0, help="also a stream of this many batches of sizes 1-64")
    parser.add_argument("--eager-rounds", type=int, default=0, help="also timm eager vs mode='eager', R rounds")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the family on the CPU, fp32, one timed "
                        "forward per row (rows default and eager)")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON file for the results, or a directory (ending "
                        "in / or existing) to write result_file()'s name in")  # fmt: skip
    parser.add_argument("--append", action="store_true", help="keep the rows of --out's earlier run (same model, "
                        "size, dtype and weights) at the batch sizes this run does not time: one run over several "
                        "calls")  # fmt: skip
    args = parser.parse_args(argv)
    prog = "benchmarks.default_call"
    if not args.smoke and not torch.cuda.is_available():
        print(f"{prog} needs a CUDA GPU (torch.cuda.is_available() is False; --smoke runs on the CPU)", file=sys.stderr)
        return 2
    try:
        batches = comma_list(args.batches, int, None)
        allowed = SMOKE_ROWS if args.smoke else ROWS
        rows = (comma_list(args.rows, str, allowed) or ()) if args.rows is not None else \
            SMOKE_ROWS if args.smoke else DEFAULT_ROWS  # fmt: skip
        workloads = parse_workloads(args.workloads)
        if (args.stream or args.eager_rounds) and args.smoke:
            raise ValueError("--stream and --eager-rounds time CUDA graphs and compiled models: not with --smoke")
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    options = {**(SMOKE if args.smoke else {}), **({"img_size": args.img_size} if args.img_size else {})}
    device, dtype = (torch.device("cpu"), torch.float32) if args.smoke else (torch.device("cuda"), torch.float16)
    torch.backends.cuda.matmul.allow_tf32 = False
    lab = CallLab(device, dtype, args.model, options, args.checkpoint, "reference" if args.smoke else "triton")
    try:
        img_size = lab.image_size(args.model)
    except (ValueError, FileNotFoundError) as exc:  # no such timm model, or no such checkpoint
        print(f"{prog}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for workload, keep in workloads:
        if (why := refusal(lab, workload, keep)) is not None:
            print(f"{prog}: workload {workload!r} does not apply to {args.model}: {why}", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else None  # (Path drops a trailing "/": the raw text says "a directory")
    if out is not None and (out.is_dir() or args.out.endswith("/")):
        out = out / result_file(args.model, img_size)
    weights = str(args.checkpoint) if args.checkpoint else "random (seeded)"
    payload: dict[str, object] = {
        "environment": environment(), "modes": HAS_MODES, "argv": sys.argv[1:] if argv is None else list(argv),
        "model": args.model, "img_size": img_size, "dtype": str(dtype).removeprefix("torch."), "weights": weights,
        "weight_bytes": weight_bytes(lab.model(args.model)), "smoke": args.smoke, "complete": False,
    }  # fmt: skip
    kept: list[dict] = []
    if args.append:
        try:
            kept, payload["earlier"] = earlier_rows(out, payload, batches)
        except ValueError as exc:
            print(f"{prog}: --append: {exc}", file=sys.stderr)
            return 2

    def save(table: list[dict]) -> None:
        payload["table"] = [*kept, *table]
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(payload, indent=1, default=str) + "\n")

    table = main_table(lab, workloads, batches, rows, save) if rows else []
    save(table)
    if args.stream:
        payload["stream"] = stream(lab, workloads, args.stream)
    if args.eager_rounds:
        payload["eager_rounds"] = eager_rounds(lab, workloads, args.eager_rounds)
    payload["complete"] = True
    save(table)
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    print(summary(payload))
    return 0


TARGETS = {"each": ((1, 1.25), (4, 1.25), (64, 1.45)), "back_to_back": ((1, 1.1), (4, 1.15), (64, 1.45))}
"""Issue 36's bars for the default call over timm ``reduce-overhead``: each forward synchronised, and back to back."""
ROPE_TARGETS = {"each": ((4, 1.3), (64, 1.3))}
"""Issue 40's bars for the Eva models (DINOv3 and EVA-02 base, Threshold-L2 0.5 and EViT 0.7), each forward
synchronised; B = 1 is reported, not judged."""
ROPE_REPORTED = (1,)  # the batch sizes issue 40 reports without a bar


def about(payload: dict) -> str:
    """``"DeiT-B 224 fp16"`` (runs before the model was stored), or the stored ``model img_size dtype``."""
    model = payload.get("model", DEIT_B)
    if model == DEIT_B and payload.get("img_size", 224) == 224:
        return f"DeiT-B 224 {payload.get('dtype', 'fp16').replace('float', 'fp')}"
    return f"{model} at {payload.get('img_size')} {payload.get('dtype', 'float16').replace('float', 'fp')}"


def _split(table: list[dict]) -> tuple[dict, dict]:
    """``(timm rows by batch, pruned rows by (batch, workload, row))`` of a stored table."""
    base, rows = {}, {}
    for entry in table:
        if "row" in entry:
            rows[entry["batch"], entry["workload"], entry["row"]] = entry
        else:
            base[entry["batch"]] = entry
    return base, rows


def _ratio(timm: dict, entry: dict | None, clock: str) -> float | None:
    if entry is None or clock not in entry or clock not in timm:
        return None
    return timm[clock] / entry[clock]


def render(payload: dict) -> str:
    """Markdown of a stored run (``docs/results.md``): ratios to timm ``reduce-overhead`` on both clocks, the
    graphed path before/after, first calls, the stream and the eager rounds."""
    base, rows = _split(payload["table"])
    batches = sorted(base)
    workloads = list(dict.fromkeys(key[1] for key in rows))
    head = "| row | " + " | ".join(f"B={b}" for b in batches) + " |\n|---|" + "---|" * len(batches)
    commit = payload.get("commit") or payload.get("environment", {}).get("commit", "?")
    weights = payload.get("weights", "random (seeded)").split(" (")[0]
    out = [f"Commit {commit}. `python -m benchmarks.default_call` ({about(payload)}, {weights} weights): ours over "
           "unpruned timm `torch.compile(mode=\"reduce-overhead\")` in the same process, each forward synchronised "
           "/ back to back (img/s of each forward alone in brackets)."]  # fmt: skip
    for run in payload.get("earlier", []):  # rows kept from earlier calls (--append)
        env = run.get("environment", {})
        out[0] += (f" B={', '.join(map(str, run['batches']))}: from an earlier call, commit {env.get('commit', '?')}, "
                   f"{str(env.get('date', '?'))[:10]}.")  # fmt: skip
    table = [head]
    timm = [base[b]["timm_compiled"] for b in batches]
    for row, mode in TIMM_MODES.items():  # timm's rows: img/s on both clocks
        entries = [base[b].get(row) for b in batches]
        if any(entries):
            speeds = [f"{b * 1e6 / t['each_us']:,.0f} / {b * 1e6 / t['back_to_back_us']:,.0f}" if t else "-"
                      for b, t in zip(batches, entries, strict=True)]  # fmt: skip
            table.append(f"| timm `{mode}`, img/s | " + " | ".join(speeds) + " |")
    for workload in workloads:
        for row in ("default", "eager", "graphed"):
            cells = []
            for b, t in zip(batches, timm, strict=True):
                entry = rows.get((b, workload, row))
                each, b2b = _ratio(t, entry, "each_us"), _ratio(t, entry, "back_to_back_us")
                failed = entry is not None and entry.get("status") == "failed"
                cells.append("check failed" if failed else "-" if each is None else
                             f"{each:.2f}x / {b2b:.2f}x ({b * 1e6 / entry['each_us']:,.0f})")  # fmt: skip
            if any(c != "-" for c in cells):
                table.append(f"| {workload}, {row} | " + " | ".join(cells) + " |")
    out.append("\n".join(table))
    met = []
    for clock, bars in (TARGETS if payload.get("model", DEIT_B) == DEIT_B else ROPE_TARGETS).items():
        for b, bar in bars:
            if b not in base:
                continue
            values = [_ratio(base[b]["timm_compiled"], rows.get((b, w, "default")), f"{clock}_us") for w in workloads]
            values = [v for v in values if v is not None]
            failed = [w for w in workloads if rows.get((b, w, "default"), {}).get("status") == "failed"]
            if values:
                worst = min(values)
                verdict = "met" if worst >= bar and not failed else "missed"
                verdict += f", {' and '.join(failed)} failed its check" if failed else ""
                met.append(f"{clock.replace('_', ' ')} B={b} >= {bar}x: worst {worst:.3f}x ({verdict})")
    out.append("Targets of the default call: " + "; ".join(met) + ".")
    before = payload.get("before")
    if before:
        _, old = _split(before["table"])
        lines = ["| graphed path, back to back (us) | " + " | ".join(f"B={b}" for b in batches) + " |",
                 "|---|" + "---|" * len(batches)]  # fmt: skip
        for workload in workloads:
            cells = []
            for b in batches:
                a, n = old.get((b, workload, "graphed")), rows.get((b, workload, "graphed"))
                ok = a and n and "back_to_back_us" in a and "back_to_back_us" in n
                cells.append(f"{a['back_to_back_us']:.0f} -> {n['back_to_back_us']:.0f} "
                             f"({a['back_to_back_us'] / n['back_to_back_us']:.3f}x)" if ok else "-")  # fmt: skip
            lines.append(f"| {workload} | " + " | ".join(cells) + " |")
        olds = [b * 1e6 / old[b, w, "default"]["each_us"] for b in batches for w in workloads
                if "each_us" in old.get((b, w, "default"), {})]  # fmt: skip
        ran = f": the default call then ran eagerly ({min(olds):,.0f}-{max(olds):,.0f} img/s over these cells)" \
            if olds else ""  # fmt: skip
        out.append(f"Before ({before['commit']}, {before.get('note', '')}){ran}. The graphed path against it:")
        out.append("\n".join(lines))
    firsts = []
    for b in batches:
        ours = [rows.get((b, w, "default"), {}).get("first_call_s") for w in workloads]
        ours = [s for s in ours if s is not None]
        timm_s = base[b]["timm_compiled"]["first_call_s"]
        if not ours:
            continue
        firsts.append(f"B={b}: ours {min(ours):.1f}-{max(ours):.1f} s, timm {timm_s:.1f} s")
    out.append("First calls (until the first logits of a new batch size; ours compile what earlier rows of the "
               "process did not): " + "; ".join(firsts) + ".")  # fmt: skip
    stream = payload.get("stream")
    if stream:
        t = stream["timm_compiled"]
        cells = []
        for w in workloads:
            if w in stream:
                o = stream[w]
                cells.append(f"{w} {o['img_per_s_each'] / t['img_per_s_each']:.2f}x / "
                             f"{o['img_per_s_back_to_back'] / t['img_per_s_back_to_back']:.2f}x "
                             f"(first pass {o['first_pass_s']:.0f} s)")  # fmt: skip
        out.append(f"A stream of {len(stream['sizes'])} batches, {stream['distinct']} distinct sizes from 1-64, after "
                   f"a first pass over them: timm (torch.compile's defaults: dynamic shapes from the second size, a "
                   f"CUDA graph per size) {t['img_per_s_each']:,.0f} / {t['img_per_s_back_to_back']:,.0f} img/s "
                   f"(first pass {t['first_pass_s']:.0f} s); ours over it: " + "; ".join(cells) + ".")  # fmt: skip
    eager = payload.get("eager_rounds")
    if eager:
        by = {}
        for r in eager["rounds"]:
            for w in workloads:
                if w in r:
                    by.setdefault((r["batch"], w), []).append(r["timm_eager"]["each_us"] / r[w]["each_us"])
        cells = [f"B={b} {w} {'/'.join(f'{v:.2f}' for v in vs)}" for (b, w), vs in sorted(by.items())]
        out.append("`mode=\"eager\"` over timm eager, each round (" + eager.get("commit", "") + "): "
                   + "; ".join(cells) + ".")  # fmt: skip
    return "\n\n".join(out)


def summary(payload: dict) -> str:
    """The ratios to timm ``reduce-overhead`` (each forward synchronised / back to back), one line a row."""
    lines, base = [], {}
    for entry in payload["table"]:
        if "row" not in entry:
            base[entry["batch"]] = entry
            continue
        timm = base[entry["batch"]].get("timm_compiled", {})
        if entry.get("status") == "failed" or "each_us" not in entry or "each_us" not in timm:
            lines.append(f"B={entry['batch']} {entry['workload']} {entry['row']}: {entry.get('check')}")
            continue
        lines.append(
            f"B={entry['batch']:>3} {entry['workload']:>13} {entry['row']:>8}: "
            f"{timm['each_us'] / entry['each_us']:.2f}x / {timm['back_to_back_us'] / entry['back_to_back_us']:.2f}x "
            f"timm reduce-overhead ({entry['batch'] * 1e6 / entry['each_us']:,.0f} img/s; first call "
            f"{entry['first_call_s']} s vs timm {timm['first_call_s']} s)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
