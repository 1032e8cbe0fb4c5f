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

from benchmarks.attention_peers import (
    PEER_NAMES,
    PeerUnavailable,
    build_peer,
    check_peer,
    make_problem,
    reference_output,
)
from benchmarks.timing import copy_bandwidth, environment, l2_bytes, measure
from benchmarks.workloads import HEAD_DIM, NUM_HEADS, attention_bytes, grid, make_workload, sets_to_rotate

# The paper's Table I (RTX 4000 Ada, fixed counts, CUDA events, ms): (B, pruned %) -> (padded SDPA, FA2, Triton).
PAPER_TABLE_I = {
    (32, 0): (2.067, 0.112, 0.136),
    (32, 50): (1.913, 0.050, 0.042),
    (32, 80): (1.907, 0.051, 0.024),
    (64, 0): (4.099, 0.265, 0.346),
    (64, 50): (3.839, 0.072, 0.080),
    (64, 80): (3.722, 0.060, 0.028),
}
# The paper's Table II (BS=32): pruned % -> (FA2 overhead %, Triton overhead %).
PAPER_TABLE_II = {0: (46, 18), 50: (100, 57), 80: (100, 100)}


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
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(args.peers) - set(PEER_NAMES))
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {list(PEER_NAMES)}")
    return args


def run_cell(batch: int, pruned: int, args: argparse.Namespace, bandwidth: float, l2: int) -> dict:
    """Checks and times every requested peer on one (B, pruned %) cell."""
    wl = make_workload(batch, pruned, variable=not args.fixed, seed=args.seed)
    n_sets = sets_to_rotate(attention_bytes(wl.total), l2)  # one copy = qkv + output = the q, k, v, o bytes
    problem = make_problem(wl, n_sets, "cuda", torch.float16, seed=args.seed)
    reference = reference_output(problem)
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
        "input_sets": n_sets,
        "roofline_us": roofline_us,
        "peers": {},
    }
    for name in args.peers:
        entry: dict = {}
        cell["peers"][name] = entry
        try:
            peer = build_peer(name, problem)
        except PeerUnavailable as exc:
            entry.update(status="unavailable", reason=str(exc))
            continue
        entry["note"] = peer.note
        check = check_peer(peer, problem, reference)
        entry["max_abs_err"] = check.max_abs_err
        if not check.ok:
            entry.update(status="failed", reason=check.reason)
            continue
        entry.update(status="ok", **measure(peer.calls, peer.context))
        if entry["graph_us"] is not None:
            entry["graph_over_roofline"] = entry["graph_us"]["median"] / roofline_us
        del peer
    cell["ratios"] = _ratios(cell)
    del problem, reference
    torch.cuda.empty_cache()
    return cell


def _median(cell: dict, peer: str, clock: str) -> float | None:
    entry = cell["peers"].get(peer, {})
    value = entry.get(f"{clock}_us") if entry.get("status") == "ok" else None
    return value["median"] if value else None


def _ratios(cell: dict) -> dict[str, float | None]:
    ours, fa2 = _median(cell, "ours", "graph"), _median(cell, "fa2_aten", "graph")
    return {
        "ours_over_fa2_aten_graph": ours / fa2 if ours and fa2 else None,
        "ours_over_roofline_graph": ours / cell["roofline_us"] if ours else None,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 1000 else f"{value:.{digits}f}"


def main_table(cells: list[dict], peers: list[str]) -> str:
    """Every cell, every peer: wall / events / graph medians in microseconds."""
    head = ["B", "pruned %", "T (max len)"] + [f"{p} wall / ev / graph" for p in peers]
    head += ["ours / FA2-aten (graph)", "ours / roofline (graph)", "roofline us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        row = [str(cell["batch"]), str(cell["pruned_pct"]), f"{cell['tokens']} ({cell['max_len']})"]
        for p in peers:
            entry = cell["peers"].get(p, {})
            status = entry.get("status")
            if status == "ok":
                clocks = [_median(cell, p, c) for c in ("wall", "events", "graph")]
                row.append(" / ".join(_fmt(c) for c in clocks))
            else:
                row.append({"failed": "FAILED", "unavailable": "n/a"}.get(status, "-"))
        ratios = cell["ratios"]
        row += [
            _fmt(ratios["ours_over_fa2_aten_graph"], 2),
            _fmt(ratios["ours_over_roofline_graph"], 2),
            _fmt(cell["roofline_us"], 2),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def paper_table_i(cells: list[dict]) -> str:
    """The paper's Table I layout (ms, CUDA events, B = 32 and 64), this card's numbers next to the paper's."""
    by_key = {(c["batch"], c["pruned_pct"]): c for c in cells}
    head = [
        "BS", "Prune", "Tok/img (mean)", "SDPA padded", "varlen_attn", "FA2-aten", "Ours",
        "paper SDPA / FA2 varlen / Ours",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, paper in PAPER_TABLE_I.items():
        cell = by_key.get(key)
        if cell is None:
            continue
        ms = [_median(cell, p, "events") for p in ("padded_sdpa", "varlen_attn", "fa2_aten", "ours")]
        row = [str(key[0]), f"{key[1]}%", f"{cell['mean_len']:.0f}"]
        row += [_fmt(m / 1e3, 3) if m is not None else "-" for m in ms]
        row.append(" / ".join(f"{x:.3f}" for x in paper))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) if len(lines) > 2 else "(no B=32/64 cells: run without --quick)"


def paper_table_ii(cells: list[dict]) -> str:
    """Table II at B=32: overhead = the floor (latency at 80% pruned) over the total, CUDA events."""
    by_pct = {c["pruned_pct"]: c for c in cells if c["batch"] == 32}
    if 80 not in by_pct:
        return "(no B=32, 80% cell: run without --quick)"
    peers = ("varlen_attn", "fa2_aten", "ours")
    head = ["Prune"] + [f"{p} total ms / overhead %" for p in peers] + ["paper FA2 / Triton overhead %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    floors = {p: _median(by_pct[80], p, "events") for p in peers}
    for pct in (0, 50, 80):
        if pct not in by_pct:
            continue
        row = [f"{pct}%"]
        for p in peers:
            total, floor = _median(by_pct[pct], p, "events"), floors[p]
            if total is None or floor is None:
                row.append("-")
            else:
                row.append(f"{total / 1e3:.3f} / {min(100.0, 100 * floor / total):.0f}")
        row.append("{} / {}".format(*PAPER_TABLE_II[pct]))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


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


def render(meta: dict, cells: list[dict], peers: list[str]) -> str:
    mode = "fixed" if meta["args"]["fixed"] else "variable (+-15%)"
    header = (
        f"Attention kernel benchmark -- {meta['card']} (SM {meta['capability']}), torch {meta['torch']}, "
        f"triton {meta['triton']}, CUDA {meta['cuda']}, commit {meta['commit']}\n"
        f"DeiT-B H={NUM_HEADS} D={HEAD_DIM} fp16, per-image counts {mode}; copy bandwidth "
        f"{meta['copy_bandwidth_gbps']:.0f} GB/s (read+write); times in us unless marked; medians. "
        "wall = back-to-back calls / host clock; ev = CUDA events per call on an idle device (paper's method); "
        "graph = CUDA-graph replay per call (device only). roofline = q,k,v,o bytes / copy bandwidth."
    )
    return "\n\n".join(
        [
            header,
            main_table(cells, peers),
            "Table I layout (ms, CUDA events; paper: RTX 4000 Ada, fixed counts):\n\n" + paper_table_i(cells),
            "Table II layout (B=32; overhead % = latency at 80% pruned / total, CUDA events):\n\n"
            + paper_table_ii(cells),
            "Notes:\n" + notes(cells, peers),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("report_attention needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
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
    print(render(meta, cells, args.peers))
    print(f"\n{len(cells)} cells in {meta['elapsed_s']:.0f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
