"""Sweeps launch configurations of the skinny fused linear on the current GPU (device time, graph replay).

Usage (GPU machine, repo root)::

    python -m ci.tune_linear [--out tune_linear.json] [--table tune_linear_table.py] [--rows 1,50,99,197,394,788]
                             [--dtypes float16,bfloat16] [--jobs 12] [--budget-s 400]

The cells: ViT-B/16's four linear layers (``benchmarks.report_linear.LAYERS``) at each row count M, as a forward
chains them (qkv and fc1 take ``ln_stats=``, proj and fc2 write ``stats_out=``: ``report_linear``'s ``ours_chained``).
The space (:func:`candidates`, pruned by M): BLOCK_M from the row count (no 16-row tiles for hundreds of rows, no
128-row tiles for a few), BLOCK_N 32 / 64 / 128 (32 only under 32-row tiles), BLOCK_K 64 / 128, 4 warps (and 8 on
tiles of 8192 outputs or more), 3 or 4 stages (3 alone where 4 would not fit shared memory), and the split rule's 1 or 2
programs per SM where that changes some layer's split of K at that M; the table's own pick is always among them.
All of them add split-K partials with a second kernel; the single launch (``LinearConfig.fixup``) enters as the twins
of the :data:`FIXUP_TWINS` best of each M (:func:`fixup_twins`), so the sweep compares both paths on the tiles that
matter without doubling the space.

Every candidate is first checked against the fp32 reference (the lab's rule, :func:`ragged_vit.testing.linear_error`)
in ``--jobs`` worker processes, which compile the kernels in parallel into Triton's cache; one that is wrong or does
not compile is reported and left out. The rest are timed in this process by device time under CUDA-graph replay
(:func:`benchmarks.timing.graph_time`), cycling through enough weight copies to miss L2, first in fp16; then the
single-launch twins of the best in fp16; the four best of each M by fp16 score (either path), and the table's pick,
are then timed in bf16. A candidate's score at one M is the geometric mean over layers (and dtypes) of its time over
the best time of that cell. Past ``--budget-s`` seconds the rest is
skipped and said so. Writes every time as JSON (``--out``) and the proposed ``_LINEAR_TABLE`` entry, one band per
M (adjacent bands with the same pick merged), as Python to ``--table``, and prints both; the entry goes into
``triton_impl/configs.py`` by hand, with the run named in ``docs/tuning.md``. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import comma_list, has_gpu
from benchmarks.report_linear import DTYPES, LAYERS, chain_kwargs, make_problem, torch_unfused
from ragged_vit.triton_impl.configs import LinearConfig, linear_config, linear_split

PROG = "python -m ci.tune_linear"
ROWS = (1, 50, 99, 197, 394, 788)
H100_SMS = 132
"""The SM count :func:`candidates` plans splits for without a GPU (its CPU test); on a GPU, the card's."""
FINALISTS = 4
"""Candidates per M timed in bf16 too (besides the table's pick): the best by fp16 score."""
FIXUP_TWINS = 8
"""Two-kernel candidates per M whose single-launch twins are timed too (in the first dtype): the best by its score."""
SMEM_BYTES = 227 * 1024
"""Shared memory a program may use on SM90: the stages' input tiles must fit."""


def _smem(config: LinearConfig, itemsize: int = 2) -> int:
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * itemsize


def candidates(rows: int, sms: int = H100_SMS) -> list[LinearConfig]:
    """The pruned configuration space at ``rows`` rows (see the module docstring), the table's pick included."""
    top = max(16, 1 << (rows - 1).bit_length())
    configs = []
    for bm in (m for m in (16, 32, 64, 128) if m <= top and 4 * m >= min(top, 128)):
        for bn in (n for n in (32, 64, 128) if n > 32 or bm <= 32):
            for bk in (64, 128):
                for warps in (4, 8) if bm * bn >= 8192 else (4,):
                    for stages in (3, 4):
                        config = LinearConfig(bm, bn, bk, warps, stages)
                        if _smem(config) <= SMEM_BYTES:
                            configs += [config, *_twice_per_sm(config, rows, sms)]
    table = table_pick(rows)
    return configs if table in configs else [table, *configs]


def _twice_per_sm(config: LinearConfig, rows: int, sms: int) -> list[LinearConfig]:
    """``config`` aiming at two programs per SM, where that splits some layer's K otherwise than one per SM."""
    twice = dataclasses.replace(config, per_sm=2)
    layers = [(n, k) for k, n, _ in LAYERS.values()]
    differs = any(linear_split(twice, rows, n, k, sms) != linear_split(config, rows, n, k, sms) for n, k in layers)
    return [twice] if differs else []


def fixup_twins(configs: Sequence[LinearConfig], rows: int, sms: int = H100_SMS) -> list[LinearConfig]:
    """The single-launch twin (``fixup=True``) of each two-kernel config that splits some layer's K at ``rows`` rows
    (where none splits, the twin is the same launch)."""
    layers = [(n, k) for k, n, _ in LAYERS.values()]
    return [dataclasses.replace(c, fixup=True) for c in configs
            if not c.fixup and any(linear_split(c, rows, n, k, sms)[0] > 1 for n, k in layers)]  # fmt: skip


def table_pick(rows: int) -> LinearConfig:
    """What ``triton_impl/configs.py`` picks now at ``rows`` rows on this machine's GPU (the interpreter's without)."""
    return linear_config(torch.device("cuda" if torch.cuda.is_available() else "cpu"), rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tune_linear.json"), help="JSON file of every time")
    parser.add_argument("--table", type=Path, default=Path("tune_linear_table.py"), help="the proposed table entry")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="float16 first, bfloat16 for the finalists")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="checking processes")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop timing after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.rows = comma_list(args.rows, int)
        args.dtypes = comma_list(args.dtypes, choices=("float16", "bfloat16"))
    except ValueError as exc:
        parser.error(str(exc))
    if not args.rows or min(args.rows) < 1:
        parser.error("--rows: positive integers")
    if args.jobs < 1:
        parser.error("--jobs: must be >= 1")
    return args


def _chained(layer: str, rows: int, dtype: torch.dtype, copies: int, seed: int,
             config: LinearConfig) -> list[tuple[tuple, dict]]:  # fmt: skip
    cols = LAYERS[layer][1]
    return [(a, chain_kwargs(k, a[0], cols, config)) for a, k in make_problem(layer, rows, dtype, copies, seed)]


def check(job: tuple[str, int, str, LinearConfig, int]) -> str | None:
    """None when the kernel under the job's config meets the lab's rule on its cell, else why not (compiling it into
    Triton's cache on the way: what the worker processes are for)."""
    from ragged_vit.testing.linear import linear_error
    from ragged_vit.triton_impl.linear import fused_linear

    layer, rows, dtype_name, config, seed = job
    try:
        ((args, kwargs),) = _chained(layer, rows, DTYPES[dtype_name], 1, seed, config)
        out = fused_linear(*args, **kwargs, config=config)
        torch.cuda.synchronize()
        err, allowed = linear_error(out, *args, **{k: v for k, v in kwargs.items() if k != "stats_out"})
    except Exception as exc:  # a config the compiler rejects is a result to report
        return f"{type(exc).__name__}: {str(exc).strip()[:160]}"
    return None if err <= allowed else f"wrong: max error {err:.3g} > allowed {allowed:.3g}"


def time_cell(layer: str, rows: int, dtype: torch.dtype, configs: Sequence[LinearConfig], seed: int,
              l2: int) -> dict[str, float]:  # fmt: skip
    """Median device time (us) of each config on one cell, and of PyTorch's unfused ops (``"torch"``)."""
    from benchmarks.timing import graph_time
    from ragged_vit.triton_impl.linear import fused_linear

    depth, cols, _ = LAYERS[layer]
    copies = max(2, min(64, -(-2 * l2 // (depth * cols * dtype.itemsize))))
    sets = make_problem(layer, rows, dtype, copies, seed)
    outs = [torch.empty(rows, cols, dtype=dtype, device="cuda") for _ in sets]
    times = {"torch": graph_time([lambda a=a, k=k: torch_unfused(*a, **k) for a, k in sets])}
    for config in configs:
        chained = [(a, chain_kwargs(k, a[0], cols, config)) for a, k in sets]
        calls = [lambda a=a, k=k, o=o, c=config: fused_linear(*a, **k, out=o, config=c)
                 for (a, k), o in zip(chained, outs, strict=True)]  # fmt: skip
        times[repr(config)] = graph_time(calls)
    return {name: r.spread.median if r.spread else math.nan for name, r in times.items()}


def scores(times: dict[str, dict[str, float]], configs: Sequence[str]) -> dict[str, float]:
    """Geometric mean over the cells ``times`` (cell -> config -> us) of each config's time over the cell's best;
    a config missing or NaN in any cell has no score."""
    best = {cell: min((t for c, t in row.items() if c != "torch" and not math.isnan(t)), default=math.nan)
            for cell, row in times.items()}  # fmt: skip
    out = {}
    for config in configs:
        ratios = [row.get(config, math.nan) / best[cell] for cell, row in times.items()]
        if ratios and not any(math.isnan(r) for r in ratios):
            out[config] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return out


def propose_table(picks: dict[int, str]) -> list[tuple[float, str]]:
    """Bands ``(largest M, config repr)`` from the pick at each measured M: each band reaches up to its M, the last
    one open-ended, adjacent bands with the same pick merged."""
    bands: list[tuple[float, str]] = []
    for rows in sorted(picks):
        if bands and bands[-1][1] == picks[rows]:
            bands[-1] = (rows, picks[rows])
        else:
            bands.append((rows, picks[rows]))
    return [*bands[:-1], (math.inf, bands[-1][1])] if bands else []


def table_source(bands: list[tuple[float, str]], note: str) -> str:
    """The ``_LINEAR_TABLE`` entry of ``bands`` as Python, for ``triton_impl/configs.py``."""
    lines = [f"# {note}", "(9, 0): ("]
    lines += [f"    ({'_OPEN' if math.isinf(m) else int(m)}, {config})," for m, config in bands]
    return "\n".join([*lines, "),"]) + "\n"


def _check_all(jobs: list, workers: int) -> list[str | None]:
    if workers == 1:
        return [check(job) for job in jobs]
    context = multiprocessing.get_context("spawn")  # a CUDA context per worker: never forked
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(check, jobs, chunksize=4))


def _measure(args: argparse.Namespace, space: dict[int, list[LinearConfig]], dtype_name: str, result: dict, l2: int,
             started: float) -> None:  # fmt: skip
    """Checks every config of ``space`` (M -> configs) on every layer in ``dtype_name``, then times those that pass,
    adding to the cells' earlier times in ``result``; past the budget a cell is listed as skipped, once."""
    jobs = [(layer, rows, dtype_name, c, args.seed) for rows in args.rows for layer in LAYERS for c in space[rows]]
    t0 = time.perf_counter()
    verdicts = _check_all(jobs, args.jobs)
    print(f"{dtype_name}: {len(jobs)} checks in {time.perf_counter() - t0:.0f} s", flush=True)
    failed = {}
    for (layer, rows, _, config, _), verdict in zip(jobs, verdicts, strict=True):
        if verdict:
            failed.setdefault((layer, rows), set()).add(config)
            result["failures"][f"{layer}/M{rows}/{dtype_name}/{config!r}"] = verdict
    for rows in (r for r in args.rows if space[r]):  # an M without twins times nothing more
        for layer in LAYERS:
            cell = f"{layer}/M{rows}/{dtype_name}"
            if time.perf_counter() - started > args.budget_s:
                result["skipped"] += [] if cell in result["skipped"] else [cell]
                continue
            ok = [c for c in space[rows] if c not in failed.get((layer, rows), ())]
            row = result["times"].setdefault(cell, {})
            row.update(time_cell(layer, rows, DTYPES[dtype_name], ok, args.seed, l2))
            best = min(((t, c) for c, t in row.items() if c != "torch" and not math.isnan(t)), default=None)
            shown = f"best {best[0]:7.2f} us ({best[0] / row['torch']:.2f}x torch) {best[1]}" if best else "none"
            print(f"{cell:>22} torch {row['torch']:7.2f} us  {shown}", flush=True)


def _ranked(result: dict, rows: int, configs: Sequence[LinearConfig]) -> list[LinearConfig]:
    """``configs`` that have a score at ``rows`` rows, best first."""
    cells = {c: t for c, t in result["times"].items() if f"/M{rows}/" in c}
    by_repr = {repr(c): c for c in configs}
    return [by_repr[c] for c, _ in sorted(scores(cells, list(by_repr)).items(), key=lambda kv: kv[1])]


def sweep(args: argparse.Namespace, sms: int, l2: int, started: float) -> dict:
    """Checks, then times, every candidate on every cell in the first dtype, then the single-launch twins of the best
    there, then the finalists in the other dtypes."""
    space = {rows: candidates(rows, sms) for rows in args.rows}
    result: dict = {"times": {}, "failures": {}, "skipped": [], "scores": {}, "picks": {}}
    first, *others = args.dtypes
    _measure(args, space, first, result, l2, started)
    twins = {rows: fixup_twins(_ranked(result, rows, space[rows])[:FIXUP_TWINS], rows, sms) for rows in args.rows}
    _measure(args, twins, first, result, l2, started)
    space = {rows: [*space[rows], *twins[rows]] for rows in args.rows}
    result["finalists"] = {
        rows: list(dict.fromkeys([*map(repr, _ranked(result, rows, space[rows])[:FINALISTS]), repr(table_pick(rows))]))
        for rows in args.rows
    }
    finalists = {rows: [c for c in space[rows] if repr(c) in result["finalists"][rows]] for rows in args.rows}
    for dtype_name in others:
        _measure(args, finalists, dtype_name, result, l2, started)
    for rows in args.rows:
        cells = {c: t for c, t in result["times"].items() if f"/M{rows}/" in c}
        ranked = sorted(scores(cells, result["finalists"][rows]).items(), key=lambda kv: kv[1])
        result["scores"][rows] = dict(ranked)
        if ranked:
            result["picks"][rows] = ranked[0][0]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not has_gpu(PROG):
        return 0
    from benchmarks.timing import environment, l2_bytes
    from ragged_vit.triton_impl.configs import sm_count

    started = time.perf_counter()
    torch.set_num_threads(1)
    meta = environment()
    meta["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = sweep(args, sm_count(torch.cuda.current_device()), l2_bytes(), started)
    meta["elapsed_s"] = time.perf_counter() - started
    bands = propose_table(result["picks"])
    note = f"{PROG} on {meta.get('card')}, {meta['elapsed_s']:.0f} s, dtypes {','.join(args.dtypes)}"
    source = table_source(bands, note)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, **result, "table": source}, indent=1, default=str))
    args.table.write_text(source)
    print("\nbest by geometric-mean (time / best of the cell) at each M, the table's pick for comparison:")
    for rows in args.rows:
        table = repr(table_pick(rows))
        scored = result["scores"].get(rows, {})
        for config, score in list(scored.items())[:3]:
            print(f"  M={rows:>4} {score:.3f} {config}")
        print(f"  M={rows:>4} {scored.get(table, math.nan):.3f} {table} (table)")
    if result["skipped"]:
        print(f"\nout of time budget ({args.budget_s:.0f} s): {len(result['skipped'])} cells not timed")
    print(f"\nproposed _LINEAR_TABLE entry ({args.table}):\n{source}\n{len(result['failures'])} failed checks; JSON: "
          f"{args.out}; {meta['elapsed_s']:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
