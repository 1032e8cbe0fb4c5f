"""Kernel benchmark report: the paper's Tables I and II on this card, for every peer, with three clocks.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.report_attention --out PATH [--quick] [--fixed] [--peers ours,fa2_aten]

Runs the grid B in {1, 4, 32, 64, 128} x pruned {0, 50, 80}% (``--quick``: B in {1, 64} x {0, 80}%) with
per-image token counts that vary around the target ratio (``--fixed``: the paper's equal counts), DeiT-B
geometry (H=12, D=64), fp16. For each cell every peer of ``benchmarks.attention_peers`` is checked against the
fp32 reference and, if right, timed with the three clocks of ``benchmarks.timing`` (wall, CUDA events, CUDA-graph
replay). Prints markdown tables (all clocks per cell; Table I and II in the paper's layout) and writes every
number with its spread, the card, versions and commit as JSON to ``--out`` (rewritten after each cell, so an
interrupted run keeps what it measured). Iteration counts are sized for a few minutes at most on an H100 for the
full grid and well under one minute with ``--quick``. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import comma_list, has_gpu
from benchmarks.attention_peers import PEER_NAMES, cell_problem, checked_peer
from benchmarks.tables import kernel_median, kernel_section
from benchmarks.timing import copy_bandwidth, environment, l2_bytes, measure
from benchmarks.workloads import attention_bytes, grid, make_workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    parser.add_argument("--quick", action="store_true", help="B in {1, 64} x pruned {0, 80}%% only")
    parser.add_argument("--fixed", action="store_true", help="equal per-image counts (the paper's setting)")
    parser.add_argument(
        "--peers", default=",".join(PEER_NAMES), help="comma-separated subset of " + ",".join(PEER_NAMES)
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.peers = comma_list(args.peers, choices=PEER_NAMES)
    except ValueError as exc:
        parser.error(f"--peers: {exc}")
    return args


def run_cell(batch: int, pruned: int, args: argparse.Namespace, bandwidth: float, l2: int) -> dict:
    """Checks and times every requested peer on one (B, pruned %) cell."""
    wl = make_workload(batch, pruned, variable=not args.fixed, seed=args.seed)
    problem, reference = cell_problem(wl, l2, seed=args.seed)
    roofline_us = attention_bytes(wl.total) / bandwidth * 1e6
    cell: dict = {
        "batch": batch,
        "pruned_pct": pruned,
        "variable": wl.variable,
        "tokens": wl.total,
        "max_len": wl.max_len,
        "min_len": wl.min_len,
        "mean_len": wl.total / wl.batch,
        "lengths": list(wl.lengths),
        "input_sets": len(problem.qkv_sets),
        "roofline_us": roofline_us,
        "peers": {},
    }
    for name in args.peers:
        peer, entry = checked_peer(name, problem, reference)
        cell["peers"][name] = entry
        if peer is None:
            continue
        entry.update(status="ok", **measure(peer.calls, peer.context))
        if entry["graph_us"] is not None:
            entry["graph_over_roofline"] = entry["graph_us"]["median"] / roofline_us
        del peer
    cell["ratios"] = _ratios(cell)
    del problem, reference
    torch.cuda.empty_cache()
    return cell


def _ratios(cell: dict) -> dict[str, float | None]:
    ours, fa2 = kernel_median(cell, "ours", "graph"), kernel_median(cell, "fa2_aten", "graph")
    return {
        "ours_over_fa2_aten_graph": ours / fa2 if ours and fa2 else None,
        "ours_over_roofline_graph": ours / cell["roofline_us"] if ours else None,
    }


def notes(cells: list[dict], peers: list[str]) -> str:
    """Failures, capture refusals and the widest relative spread of each clock."""
    out = []
    seen: set[tuple[str, str]] = set()
    for cell in cells:
        for p in peers:
            entry = cell["peers"].get(p, {})
            for key in ("reason", "graph_reason"):
                reason = entry.get(key)
                if reason and (p, reason) not in seen:
                    seen.add((p, reason))
                    out.append(f"- {p} (first at B={cell['batch']}, {cell['pruned_pct']}%): {reason}")
    for p in peers:
        widest = []
        for clock in ("wall", "events", "graph"):
            rel = [
                (s["q3"] - s["q1"]) / s["median"]
                for c in cells
                if (s := c["peers"].get(p, {}).get(f"{clock}_us")) and s["median"] > 0
            ]
            widest.append(f"{clock} {100 * max(rel):.0f}%" if rel else f"{clock} -")
        out.append(f"- widest IQR / median of {p}: " + ", ".join(widest))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not has_gpu("report_attention"):
        return 2
    torch.set_num_threads(1)
    started = time.perf_counter()
    bandwidth = copy_bandwidth()
    meta = environment()
    meta.update(
        copy_bandwidth_gbps=bandwidth / 1e9,
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    l2 = l2_bytes()
    cells: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch, pruned in grid(args.quick):
        t0 = time.perf_counter()
        cells.append(run_cell(batch, pruned, args, bandwidth, l2))
        meta["elapsed_s"] = time.perf_counter() - started
        args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
        print(f"[B={batch:>3} pruned={pruned:>2}%] {time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)
    print(kernel_section({"meta": meta, "cells": cells}) + "\n\nNotes:\n" + notes(cells, args.peers))
    print(f"\n{len(cells)} cells in {meta['elapsed_s']:.0f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
