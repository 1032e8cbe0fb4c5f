"""End-to-end benchmark report: the paper's Tables III-VI, Figure 1 and Section V-D on this card, every backend.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.report_e2e --quick --out DIR            # < 4 min on an H200: table6, table4, table3, fig1
    python -m benchmarks.report_e2e --part table3 --batches 1,4,8,16 --tag b1-16 --out DIR
    python -m benchmarks.report_e2e --part res384 --out DIR      # one part per device call (each < 8 min)

``--batches``, ``--workloads``, ``--rows`` select subsets; ``--no-compile`` / ``--compile-batches`` limit the
torch.compile rows (tens of seconds of compilation each); ``--max-minutes`` skips, and records as skipped, the rows
not started in time. Within a part the torch.compile rows run last, so a run cut short loses those first.

Parts (one JSON each, ``DIR/<part>[-<tag>].json``; DIR defaults to ``benchmarks/baselines/<gpu-slug>/e2e``):

* ``table3`` -- throughput (img/s) vs batch size, DeiT-B 224, 50% pruning, every workload
  (``benchmarks.workloads.WORKLOADS``: fixed and ragged) x every row: unpruned timm eager and under
  ``torch.compile(mode="reduce-overhead")`` (compiled once per batch size, compile time reported), padded (fair),
  padded-full (the paper's), FA2 varlen, NestedTensor SDPA (timed at B <= 4 only, otherwise one forward is
  reported as too slow), Triton, and the CUDA-graph rows of ``ragged_vit.pipelines.graphs`` when it exists.
* ``table4`` -- stage breakdown (front / pack / late blocks / head, CUDA events in one forward), B = 8 (the
  paper's, by its Table III) and 64.
* ``table5`` -- DeiT-T/S/B at 224, B = 4 and 64.
* ``res384`` -- DeiT-B at 224 and 384 side by side (Section V-D), B = 1, 4, 32.
* ``fig1``   -- throughput vs pruning ratio 0..90%, B = 64 (Figure 1).
* ``table6`` -- numerics: max / mean |logit diff| of Triton and FA2 against the padded (fair) pipeline, fp16,
  same decisions, B = 1, 4, 16 (64), and the paper's kernel rows (B = 32, 0/50/80% pruned).

Method (``docs/measuring.md``): fp16, ``torch.no_grad``, three input batches rotated, every pipeline checked
against the fp32 reference (``benchmarks.e2e_common``) before it is timed with ``benchmarks.timing.forward_times``
(and ``graph_time`` where it has no host synchronisation); throughput = B / median wall time per forward. Each JSON
is rewritten after every row (an interrupted run keeps its rows) and holds the card, the versions, the commit and
the workload descriptions. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from tqdm import tqdm

from benchmarks import BASELINES, bench_device, comma_list, tables
from benchmarks.attention_peers import build_peer, make_problem, reference_output
from benchmarks.e2e_common import (
    CHECKPOINT_ENV,
    DEIT_B,
    DEIT_B_384,
    DEIT_S,
    DEIT_T,
    Lab,
    Reference,
    check_logits,
    error_bound,
    forward_calls,
    logit_diff,
    logits_of,
)
from benchmarks.public_peer import PublicPrunedViT, dense_plan
from benchmarks.tables import ROW_LABELS
from benchmarks.timing import (
    describe,
    elapsed,
    environment,
    forward_times,
    gpu_slug,
    graph_time,
    stage_breakdown,
)
from benchmarks.workloads import WORKLOADS, make_workload, workload_kind
from ragged_vit.pipelines.backends import AttentionBackend, PaddedSDPABackend, make_backend
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.model import PrunedViT
from ragged_vit.pipelines.patch_embed import with_gemm_patch_embed

# Cheap parts first, compilation last: what a cut-short run loses is the torch.compile rows.
PARTS = ("table6", "table4", "table3", "fig1", "table5", "res384")
QUICK_PARTS = ("table6", "table4", "table3", "fig1")
QUICK_MINUTES, FULL_MINUTES = 3.75, 9.0  # default --max-minutes: rows not started by then are skipped
NESTED_MAX_BATCH = 4  # NestedTensor SDPA costs milliseconds per call: timed only up to this batch size
UNPRUNED_FIG1 = ("timm_eager", "timm_compiled")
# The rows (labels: benchmarks.tables.ROW_LABELS), by how they are built.
UNPRUNED_ROWS = ("timm_eager", "timm_compiled", "timm_compiled_gemm")
EAGER_ROWS = ("padded", "padded_full", "fa2_varlen", "nested_sdpa", "triton")
GRAPHED_ROWS = ("triton_graphed", "fa2_varlen_graphed", "padded_graphed", "triton_graphed_compiled")
PUBLIC_ROWS = ("public_compiled",)  # benchmarks.public_peer
COMPILED_ROWS = ("timm_compiled", "timm_compiled_gemm", "triton_graphed_compiled", "public_compiled")  # slow to build
ALL_ROWS = (*UNPRUNED_ROWS, *EAGER_ROWS, *GRAPHED_ROWS, *PUBLIC_ROWS)


class Unavailable(RuntimeError):
    """A row that cannot run on this checkout or torch (reported with the reason, not timed)."""


def backend_for(row: str, num_tokens: int) -> AttentionBackend:
    """The attention backend of an eager (or graphed) pruned row; ``num_tokens`` is the unpruned N (CLS included)."""
    base = row.removesuffix("_compiled").removesuffix("_graphed")
    if base == "padded":
        return PaddedSDPABackend()
    if base == "padded_full":
        return PaddedSDPABackend(pad_to=num_tokens)
    return make_backend(base)


@dataclass(frozen=True)
class Task:
    """One row to measure: a pipeline (or the unpruned model) on one workload and batch size."""

    part: str
    model: str
    workload: str  # a key of WORKLOADS, or "none" for the unpruned rows
    keep_rate: float
    batch: int
    row: str  # a key of ROW_LABELS
    kind: str = "throughput"  # "throughput" | "stages" | "numerics"

    @property
    def key(self) -> str:
        return f"{self.model}|{self.workload}|k{self.keep_rate:g}|B{self.batch}|{self.row}|{self.kind}"


@dataclass(frozen=True)
class Settings:
    """Iteration counts and switches of one run."""

    quick: bool
    warmup: int
    target_s: float
    min_iters: int
    max_iters: int
    stage_iters: int
    graph_calls: int = 2
    graph_replays: int = 5
    compile: bool = True
    compile_batches: tuple[int, ...] | None = None  # None: compile at every batch size of the part
    deadline: float | None = None  # time.perf_counter() after which no row starts (skipped with the reason)

    @classmethod
    def make(cls, quick: bool, **switches: object) -> Settings:
        """The quick or full iteration counts (``forward_times``' warm-up and iteration rules) with ``switches``."""
        if quick:
            return cls(quick, warmup=3, target_s=0.25, min_iters=10, max_iters=40, stage_iters=10, **switches)
        return cls(quick, warmup=5, target_s=0.6, min_iters=20, max_iters=120, stage_iters=30, **switches)


# --------------------------------------------------------------------------------------------------- plans


def plan_part(part: str, quick: bool, batches: tuple[int, ...] | None, workloads: tuple[str, ...] | None) -> list[Task]:
    """The rows of one part, grouped so that each (model, workload, keep rate, batch) is contiguous."""
    tasks: list[Task] = []

    def pick(default: tuple, override: tuple | None) -> tuple:
        return default if override is None else override

    def add(model: str, workload_list: tuple[str, ...], keep: float, b: int, rows: tuple[str, ...], kind: str) -> None:
        if kind == "throughput" and any(r.startswith("timm_") for r in rows):
            tasks.extend(Task(part, model, "none", 1.0, b, r, kind) for r in rows if r.startswith("timm_"))
        for w in workload_list:
            tasks.extend(Task(part, model, w, keep, b, r, kind) for r in rows if not r.startswith("timm_"))

    if part == "table3":
        bs = pick((1, 4, 64) if quick else (1, 4, 8, 16, 32, 64, 128), batches)
        # Quick: the paper's fixed ratio, the calibrated threshold (strongly ragged even with random weights) and
        # ATS (ragged by design; near-uniform counts with random weights, which give it flat scores).
        ws = pick(("l2_ratio", "l2_calibrated", "ats") if quick else tuple(WORKLOADS), workloads)
        for b in bs:
            add(DEIT_B, ws, 0.5, b, ALL_ROWS, "throughput")
    elif part == "table4":
        bs = pick((8,) if quick else (8, 64), batches)
        ws = pick(("l2_ratio",) if quick else ("l2_ratio", "ats", "synthetic"), workloads)
        for b in bs:
            add(DEIT_B, ws, 0.5, b, EAGER_ROWS, "stages")
    elif part == "fig1":
        pcts = (0, 50, 90) if quick else tuple(range(0, 100, 10))
        bs = pick((64,), batches)
        ws = pick(("l2_ratio",) if quick else ("l2_ratio", "synthetic"), workloads)
        rows = ("padded", "triton") if quick else ("padded", "padded_full", "fa2_varlen", "triton", "triton_graphed")
        for b in bs:
            add(DEIT_B, (), 1.0, b, UNPRUNED_FIG1, "throughput")
            for p in pcts:
                add(DEIT_B, ws, round(1 - p / 100, 2), b, rows, "throughput")
    elif part == "table6":
        bs = pick((1, 4, 16) if quick else (1, 4, 16, 64), batches)
        ws = pick(("l2_ratio", "l2_calibrated", "ats", "synthetic") if quick else tuple(WORKLOADS), workloads)
        for b in bs:
            add(DEIT_B, ws, 0.5, b, ("padded",), "numerics")
    elif part == "table5":
        bs = pick((4, 64), batches)
        ws = pick(("l2_ratio", "synthetic"), workloads)
        for model in (DEIT_T, DEIT_S, DEIT_B):
            for b in bs:
                add(model, ws, 0.5, b, ALL_ROWS, "throughput")
    elif part == "res384":
        bs = pick((1, 4, 32), batches)
        ws = pick(("l2_ratio", "synthetic"), workloads)
        for model in (DEIT_B, DEIT_B_384):
            for b in bs:
                add(model, ws, 0.5, b, ALL_ROWS, "throughput")
    else:
        raise ValueError(f"unknown part {part!r}; choose from {PARTS}")
    # torch.compile rows (tens of seconds each) last within the part; grouping by batch is kept for the rest.
    return [t for t in tasks if t.row not in COMPILED_ROWS] + [t for t in tasks if t.row in COMPILED_ROWS]


# --------------------------------------------------------------------------------------------------- rows


@dataclass
class Prepared:
    """A checked row ready to time: one forward per input batch, or the reason it is not timed (in ``entry``)."""

    entry: dict
    calls: list | None = None  # None: not timed (failed check); see entry["status"] / entry["reason"]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    capturable: bool = False  # no host synchronisation inside: the graph-replay clock applies
    pipeline: PrunedViT | None = None  # the eager pruned pipeline (stage breakdown)
    cleanup: Callable[[], None] = lambda: None


class Runner:
    """Checks and measures tasks; caches the unpruned rows per (model, batch) so that parts run together share them.

    :meth:`prepare` builds and checks a row (raising :class:`Unavailable` when it cannot exist here);
    :meth:`run` prepares and times it and never raises: a row that breaks is reported as failed.
    """

    def __init__(self, lab: Lab, settings: Settings) -> None:
        self.lab = lab
        self.s = settings
        self._unpruned: dict[tuple[str, int, str], dict] = {}

    def describe_task(self, task: Task) -> dict:
        return {
            "key": task.key,
            "model": task.model,
            "resolution": self.lab.image_size(task.model),
            "batch": task.batch,
            "workload": task.workload,
            "workload_kind": workload_kind(task.workload, task.keep_rate),
            "keep_rate": task.keep_rate,
            "pruned_pct": round(100 * (1 - task.keep_rate)),
            "row": task.row,
            "label": ROW_LABELS[task.row],
            "kind": task.kind,
        }

    def run(self, task: Task) -> dict:
        row = self.describe_task(task)
        cache_key = (task.model, task.batch, task.row)
        if self.s.deadline is not None and time.perf_counter() > self.s.deadline and cache_key not in self._unpruned:
            row.update(status="skipped", reason="time budget (--max-minutes) used up before this row started")
            return row
        try:
            if task.workload == "none" and cache_key in self._unpruned:
                row.update(self._unpruned[cache_key], shared=True)
            elif task.kind == "numerics":
                row.update(self._numerics_row(task))
            else:
                row.update(self._measure(task))
                if task.workload == "none":
                    self._unpruned[cache_key] = {k: v for k, v in row.items() if k not in self.describe_task(task)}
        except Unavailable as exc:
            row.update(status="unavailable", reason=str(exc))
        except Exception as exc:  # one broken row must not end a run on a lent machine: report it, go on
            traceback.print_exc(file=sys.stderr)
            row.update(status="failed", reason=f"raised {describe(exc)}")
            if self.lab.device.type == "cuda":
                torch.cuda.synchronize()  # a sticky CUDA error surfaces here and ends the run, as it should
                torch.cuda.empty_cache()
        if row.get("status") == "ok" and row.get("wall_us"):
            row["img_per_s"] = task.batch / (row["wall_us"]["median"] * 1e-6)
        return row

    def _measure(self, task: Task) -> dict:
        prep = self.prepare(task)
        entry = prep.entry
        try:
            if prep.calls is None:
                return entry
            if task.kind == "stages" and prep.pipeline is not None:
                stages = stage_breakdown(prep.calls, self.lab.device, iters=self.s.stage_iters)
                entry["stages_us"] = {k: v.to_dict() for k, v in stages.items()}
            if task.row == "nested_sdpa" and task.batch > NESTED_MAX_BATCH:
                single = elapsed(prep.calls[:1], self.lab.device)
                entry.update(
                    status="skipped",
                    single_forward_ms=single * 1e3,
                    reason=f"too slow: one forward took {single * 1e3:.1f} ms (timed only at B <= {NESTED_MAX_BATCH})",
                )
                return entry
            entry.update(self.time(prep))
            return entry
        finally:
            prep.cleanup()

    def prepare(self, task: Task) -> Prepared:
        """Builds the row's pipeline and checks it against the fp32 reference (see the module docstring)."""
        if task.workload == "none":
            return self._prepare_unpruned(task)
        if task.row == "public_compiled":
            return self._prepare_public(task)
        if task.row in GRAPHED_ROWS:
            return self._prepare_graphed(task)
        return self._prepare_pruned(task)

    # -- unpruned -------------------------------------------------------------------------------------------

    def _prepare_unpruned(self, task: Task) -> Prepared:
        lab = self.lab
        ref = lab.reference(task.model, "none", 1.0, task.batch)
        model = lab.model(task.model)
        eager = self._forward(model, ref.images[0])
        bound = error_bound(ref.logits, (eager - ref.logits).abs().max().item(), lab.dtype)
        entry: dict = {"counts": ref.counts}
        if task.row == "timm_eager":
            entry["check"] = check_logits(eager, ref.logits, bound).to_dict()
            calls = [functools.partial(model, img) for img in ref.images]
            return Prepared(entry, calls, context=torch.no_grad, capturable=True)
        self._check_reduce_overhead(task)
        if task.row == "timm_compiled_gemm":  # pruning's own share: the same embedding as the pipelines
            model = with_gemm_patch_embed(model)
        return self._reduce_overhead(task, model, [(img,) for img in ref.images], ref.logits, bound, entry)

    def _check_reduce_overhead(self, task: Task) -> None:
        self._check_compile_allowed(task)
        if self.lab.device.type != "cuda":
            raise Unavailable('mode="reduce-overhead" needs CUDA graphs (a CUDA device)')

    def _reduce_overhead(
        self,
        task: Task,
        module: torch.nn.Module,
        inputs: list[tuple],
        ref_logits: torch.Tensor,
        bound: float,
        entry: dict,
    ) -> Prepared:
        """``module`` under ``torch.compile(mode="reduce-overhead")``, one forward per input set (``inputs[i]``:
        its arguments), checked on the first against ``ref_logits`` (callers check first that it may run)."""
        device = self.lab.device

        def cleanup() -> None:
            torch._dynamo.reset()  # frees the compiled graphs and their CUDA-graph pool
            torch.cuda.empty_cache()

        cleanup()
        skips_before = cudagraph_skips()
        try:
            compiled = torch.compile(module, mode="reduce-overhead", dynamic=False)
            with torch.no_grad():  # compile; record the CUDA graph; first replays
                firsts = [round(elapsed([functools.partial(compiled, *args)], device), 3) for args in inputs]
            entry.update(compile_s=firsts[0], first_calls_s=firsts)
            entry["cudagraph_skips"] = cudagraph_skips() - skips_before  # > 0: it ran without CUDA graphs
            built = f"{task.row} {task.model} B={task.batch}: {firsts[0]:.1f} s"
            print(f"\n  compiled {built}", file=sys.stderr, flush=True)
            check = check_logits(self._forward(compiled, *inputs[0]), ref_logits, bound)
        except Exception as exc:  # a compile failure is a result
            cleanup()
            entry.update(status="failed", reason=f"torch.compile failed: {describe(exc)}")
            return Prepared(entry)
        entry["check"] = check.to_dict()
        if not check.ok:
            cleanup()
            entry.update(status="failed", reason=check.reason)
            return Prepared(entry)
        entry["graph_reason"] = "reduce-overhead replays CUDA graphs itself"
        calls = [functools.partial(compiled, *args) for args in inputs]
        return Prepared(entry, calls, context=torch.no_grad, cleanup=cleanup)

    def _check_compile_allowed(self, task: Task) -> None:
        if not self.s.compile:
            raise Unavailable("torch.compile rows switched off (--no-compile)")
        if self.s.compile_batches is not None and task.batch not in self.s.compile_batches:
            raise Unavailable(f"not compiled at B={task.batch} (--compile-batches)")

    @staticmethod
    def _forward(fn: Callable, images: torch.Tensor, *args: object) -> torch.Tensor:
        with torch.no_grad():
            return logits_of(fn(images, *args)).float().clone()

    # -- pruned ---------------------------------------------------------------------------------------------

    def _checked_pipeline(self, task: Task) -> tuple[PrunedViT, Reference, dict, float]:
        """The eager pipeline of the row's backend, checked on the reference's decisions: (pv, ref, entry, bound)."""
        lab = self.lab
        spec = WORKLOADS[task.workload]
        ref = lab.reference(task.model, task.workload, task.keep_rate, task.batch)
        backend = backend_for(task.row, lab.num_patches(task.model) + 1)
        entry: dict = {"counts": ref.counts, "workload_desc": spec.description, "backend": repr(backend)}
        pv = lab.pipeline(task.model, task.workload, task.keep_rate, backend)
        try:
            pv.backend.check(lab.device, lab.dtype)
        except ValueError as exc:
            raise Unavailable(str(exc)) from exc
        bound = error_bound(ref.logits, ref.floor, lab.dtype)
        entry["floor"] = ref.floor
        try:
            out = self._forward(pv.run, ref.images[0], ref.selections[0])
        except Exception as exc:
            entry.update(status="failed", reason=f"raised {describe(exc)}")
            return pv, ref, entry, bound
        check = check_logits(out, ref.logits, bound)
        entry["check"] = check.to_dict()
        if not check.ok:
            entry.update(status="failed", reason=check.reason)
        return pv, ref, entry, bound

    def _prepare_pruned(self, task: Task) -> Prepared:
        pv, ref, entry, _ = self._checked_pipeline(task)
        if entry.get("status") == "failed":
            return Prepared(entry)
        caps = pv.backend.capabilities
        capturable = workload_kind(task.workload, task.keep_rate) == "fixed" and caps.capturable
        if not capturable:
            entry["graph_reason"] = (
                f"not captured: {caps.not_capturable_because}"
                if not caps.capturable
                else "not captured: a variable-count stage reads its total on the host (one sync per stage)"
            )
        calls = forward_calls(pv, ref, WORKLOADS[task.workload].replayed)
        return Prepared(entry, calls, capturable=capturable, pipeline=pv)

    def _prepare_public(self, task: Task) -> Prepared:
        """The public-API peer (:mod:`benchmarks.public_peer`) on the reference's decisions, replayed."""
        self._check_reduce_overhead(task)
        lab = self.lab
        ref = lab.reference(task.model, task.workload, task.keep_rate, task.batch)
        tokens = lab.num_patches(task.model) + 1
        gather = workload_kind(task.workload, task.keep_rate) == "fixed"
        pv = lab.pipeline(task.model, task.workload, task.keep_rate, backend_for("padded", tokens))
        try:
            plans = [dense_plan(sels, task.batch, tokens, gather) for sels in ref.selections]
        except ValueError as exc:
            raise Unavailable(str(exc)) from exc
        entry: dict = {
            "counts": ref.counts,
            "workload_desc": WORKLOADS[task.workload].description,
            "layout": "gather (fixed counts)" if gather else "pad to N + key mask (variable counts)",
        }
        peer = PublicPrunedViT(pv.model, pv.pruner, gather)
        inputs = [(img, *plans[i % len(plans)]) for i, img in enumerate(ref.images)]  # images[0]'s decisions
        bound = error_bound(ref.logits, ref.floor, lab.dtype)
        return self._reduce_overhead(task, peer, inputs, ref.logits, bound, entry)

    def _prepare_graphed(self, task: Task) -> Prepared:
        if self.lab.device.type != "cuda":
            raise Unavailable("CUDA graphs need a CUDA device")
        compiled = task.row.endswith("_compiled")
        if compiled:
            self._check_compile_allowed(task)
        pv, ref, entry, bound = self._checked_pipeline(task)
        if entry.get("status") == "failed":
            return Prepared(entry)
        if compiled:
            # Compile as a fresh process would: earlier rows' shapes would otherwise have made Dynamo recompile the
            # blocks for dynamic shapes, and which entry the eager call and the capture then pick changes the
            # rounding (an fp16 near-tie decision flipped in EViT 0.5 at B = 64 after the other rows, not alone).
            torch._dynamo.reset()
        pv.compile_blocks = compiled
        # The graphed runner makes its own decisions: compare with the eager pipeline's own decisions.
        own = self._forward(pv.run, ref.images[0])
        runner = GraphedPrunedViT(pv)
        forward, note, outs = runner.run, "GraphedPrunedViT(pipeline).run(images)", []
        try:  # the first forward captures the graphs
            capture_s = elapsed([lambda: outs.append(self._forward(forward, ref.images[0]))], self.lab.device)
        except Exception as exc:
            raise Unavailable(f"graphed forward raised {describe(exc)} ({note})") from exc
        entry.update(capture_s=round(capture_s, 3), graphed_api=note)
        vs = "eager pipeline, same backend, own decisions"
        check = check_logits(outs[0], own, bound, against=f"the {vs}")
        entry["check"] = {**check.to_dict(), "vs": vs}
        if not check.ok:
            entry.update(status="failed", reason=check.reason)
            return Prepared(entry)
        entry["graph_reason"] = "the runner replays CUDA graphs itself"
        calls = [functools.partial(forward, img) for img in ref.images]

        def cleanup() -> None:  # drop the graphs now: their pools would otherwise hold memory until collected
            runner.reset()
            if compiled:
                torch._dynamo.reset()
            torch.cuda.empty_cache()

        return Prepared(entry, calls, context=torch.no_grad, cleanup=cleanup)

    # -- numerics (Table VI) --------------------------------------------------------------------------------

    def _numerics_row(self, task: Task) -> dict:
        lab = self.lab
        ref = lab.reference(task.model, task.workload, task.keep_rate, task.batch)
        n = lab.num_patches(task.model) + 1
        outs: dict[str, torch.Tensor | str] = {}
        for name in ("padded", "padded_full", "fa2_varlen", "triton"):
            pv = lab.pipeline(task.model, task.workload, task.keep_rate, backend_for(name, n))
            try:
                pv.backend.check(lab.device, lab.dtype)
                outs[name] = self._forward(pv.run, ref.images[0], ref.selections[0])
            except Exception as exc:
                outs[name] = f"unavailable: {describe(exc)}"
        entry: dict = {
            "counts": ref.counts,
            "workload_desc": WORKLOADS[task.workload].description,
            "floor": ref.floor,
            "status": "ok",
            "vs_padded": {},
            "vs_fp32": {},
        }
        base = outs["padded"]
        for name, out in outs.items():
            if isinstance(out, str):
                entry["vs_fp32"][name] = {"reason": out}
                continue
            entry["vs_fp32"][name] = logit_diff(out, ref.logits)
            if name != "padded" and not isinstance(base, str):
                entry["vs_padded"][name] = logit_diff(out, base)
        if isinstance(base, str):
            entry.update(status="failed", reason=f"padded pipeline {base}")
        return entry

    # -- clocks ---------------------------------------------------------------------------------------------

    def time(self, prep: Prepared) -> dict:
        """Per-forward wall and event clocks; graph replay too where the row is capturable."""
        s, device = self.s, self.lab.device
        times = forward_times(
            prep.calls,
            device,
            context=prep.context,
            warmup=s.warmup,
            target_s=s.target_s,
            min_iters=s.min_iters,
            max_iters=s.max_iters,
        )
        entry: dict = {
            "status": "ok",
            "wall_us": times.wall.to_dict(),
            "events_us": times.events.to_dict() if times.events else None,
            "iters": times.iters,
            "graph_us": None,
        }
        if prep.capturable and device.type == "cuda":
            graph = graph_time(prep.calls, s.graph_calls, s.graph_replays, prep.context)
            entry["graph_us"] = graph.spread.to_dict() if graph.spread else None
            if graph.reason:
                entry["graph_reason"] = graph.reason
        return entry


def cudagraph_skips() -> int:
    """Inductor's count of graphs that reduce-overhead ran without CUDA graphs (0 where torch does not count)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"].get("cudagraph_skips", 0))


def kernel_numerics(device: torch.device) -> list[dict]:
    """The paper's kernel rows of Table VI: ours vs padded SDPA, B = 32, 0/50/80% pruned, fp16, fixed counts
    (the paper's) and variable counts; plus each against the fp32 reference."""
    rows = []
    for variable in (False, True):
        for pruned in (0, 50, 80):
            wl = make_workload(32, pruned, variable=variable)
            problem = make_problem(wl, 1, device, torch.float16)
            ref = reference_output(problem)
            ours = build_peer("ours", problem).calls[0]().reshape(ref.shape).float()
            padded = build_peer("padded_sdpa", problem).calls[0]().reshape(ref.shape).float()
            diff = (ours - padded).abs()
            rows.append(
                {
                    "batch": 32,
                    "pruned_pct": pruned,
                    "workload_kind": "ragged" if variable and pruned else "fixed",
                    "tokens": wl.total,
                    "max_vs_padded": diff.max().item(),
                    "mean_vs_padded": diff.mean().item(),
                    "max_ours_vs_fp32": (ours - ref).abs().max().item(),
                    "max_padded_vs_fp32": (padded - ref).abs().max().item(),
                }
            )
    return rows


# --------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report_e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory (default benchmarks/baselines/<gpu>/e2e)")
    parser.add_argument("--quick", action="store_true", help="the quick subset (< 4 min on an H200)")
    parser.add_argument(
        "--part", default="all", choices=(*PARTS, "all"), help="one part (default: all, or the quick ones)"
    )
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (overrides the part's)")
    parser.add_argument("--workloads", default=None, help="comma-separated workloads: " + ",".join(WORKLOADS))
    parser.add_argument("--rows", default=None, help="comma-separated subset of rows: " + ",".join(ALL_ROWS))
    parser.add_argument(
        "--keep-rate",
        type=float,
        default=None,
        help="the pruned rows' keep rate in (0, 1) instead of the part's 0.5 (not with fig1, which sweeps it)",
    )
    parser.add_argument("--tag", default=None, help="file-name suffix: DIR/<part>-<tag>.json (default: quick)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--compile-batches", default=None, help="compile only at these batch sizes (1,64)")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help=f"rows not started after this many minutes are skipped (default {QUICK_MINUTES} with --quick, "
        f"{FULL_MINUTES} without; 0: no limit)",
    )
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the CPU tests' dry run
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # replaces every model (CPU tests)
    args = parser.parse_args(argv)
    args.parts = (args.part,) if args.part != "all" else QUICK_PARTS if args.quick else PARTS
    for name, kind, choices in (
        ("batches", int, None), ("compile_batches", int, None), ("workloads", str, WORKLOADS), ("rows", str, ALL_ROWS)
    ):  # fmt: skip
        try:
            setattr(args, name, comma_list(getattr(args, name), kind, choices))
        except ValueError as exc:
            parser.error(f"--{name.replace('_', '-')}: {exc}")
    if args.keep_rate is not None:
        if not 0 < args.keep_rate < 1:
            parser.error(f"--keep-rate: must be in (0, 1), got {args.keep_rate}")
        if "fig1" in args.parts:
            parser.error("--keep-rate: fig1 sweeps the keep rate itself; pick another --part")
    if args.tag is None and args.quick:
        args.tag = "quick"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    picked = bench_device(args.device, "report_e2e")
    if picked is None:
        return 2
    device, dtype = picked
    out_dir = args.out or BASELINES / gpu_slug() / "e2e"
    minutes = args.max_minutes if args.max_minutes is not None else (QUICK_MINUTES if args.quick else FULL_MINUTES)
    settings = Settings.make(
        args.quick,
        compile=not args.no_compile,
        compile_batches=args.compile_batches,
        deadline=time.perf_counter() + 60 * minutes if minutes > 0 else None,
    )
    if device.type == "cpu":  # the CPU tests' dry run: every path once; a CPU time means nothing here
        settings = dataclasses.replace(settings, warmup=1, target_s=0.0, min_iters=1, max_iters=1, stage_iters=1)
    lab = Lab(device, dtype)
    runner = Runner(lab, settings)
    checkpoint = os.environ.get(CHECKPOINT_ENV)
    weights = f"checkpoint {checkpoint} (DeiT-B-224 only)" if checkpoint else "random (seeded)"
    env = {**environment(), "timm": timm.__version__, "weights": weights}
    started = time.perf_counter()
    plans = {p: plan_part(p, args.quick, args.batches, args.workloads) for p in args.parts}
    if args.rows:  # Table VI compares fixed backends: not filtered
        plans = {p: [t for t in ts if t.kind == "numerics" or t.row in args.rows] for p, ts in plans.items()}
    if args.keep_rate is not None:  # the unpruned rows (workload "none") keep everything
        plans = {
            p: [t if t.workload == "none" else dataclasses.replace(t, keep_rate=args.keep_rate) for t in ts]
            for p, ts in plans.items()
        }
    if args.model:
        plans = {p: [dataclasses.replace(t, model=args.model) for t in ts] for p, ts in plans.items()}
    total = sum(len(ts) for ts in plans.values())
    print(
        f"report_e2e on {env['card'] or 'cpu'}: parts {', '.join(args.parts)}, {total} rows -> {out_dir}",
        file=sys.stderr,
    )
    written = []
    bar = tqdm(total=total, desc="e2e", unit="row", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    with torch_threads(1), bar:
        for part, tasks in plans.items():
            path = out_dir / (f"{part}-{args.tag}.json" if args.tag else f"{part}.json")
            payload = {
                "part": part,
                "quick": args.quick,
                "meta": {
                    **env,
                    "dtype": str(dtype).removeprefix("torch."),
                    "settings": {k: v for k, v in settings.__dict__.items() if k != "deadline"},
                    "args": {k: v for k, v in vars(args).items() if k != "out"},
                    "workloads": {name: spec.description for name, spec in WORKLOADS.items()},
                    "rows": ROW_LABELS,
                },
                "rows": [],
            }
            if part == "table6" and device.type == "cuda":
                payload["kernel_rows"] = kernel_numerics(device)
            for task in tasks:
                bar.set_postfix_str(f"{part} B={task.batch} {task.workload} {task.row}")
                t0 = time.perf_counter()
                row = runner.run(task)
                row["elapsed_s"] = round(time.perf_counter() - t0, 2)
                payload["rows"].append(row)
                payload["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
                write_json(path, payload)
                bar.update()
            written.append((part, path, payload))
            lab.clear()
    for part, path, payload in written:
        print(f"\n## {part} ({path})\n")
        print(tables.render_part(payload))
    print(f"\n{total} rows in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


def write_json(path: Path, payload: dict) -> None:
    """Writes ``payload`` atomically (a partial file never replaces a complete one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``n`` CPU threads for torch while timing (the host side must not compete with itself)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


if __name__ == "__main__":
    sys.exit(main())
