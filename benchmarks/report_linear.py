"""Kernel benchmark report: the skinny fused linear (``ragged_vit.triton_impl.linear``) against PyTorch's unfused ops.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.report_linear --out PATH [--rows 1,50,99,197,394,788] [--layers qkv,proj,fc1,fc2]
                                       [--dtype float16] [--peers ours,ours_chained,ours_split1,torch]

ViT-B/16's four linear layers with their neighbours, at the packed row counts M of small-batch forwards:

* ``qkv``  768 -> 2304, LayerNorm first (``qkv(norm1(x))``);
* ``proj`` 768 -> 768, LayerScale and residual after (``x + ls1(proj(a))``);
* ``fc1``  768 -> 3072, LayerNorm first and GELU after (``act(fc1(norm2(x)))``);
* ``fc2``  3072 -> 768, residual after (``x + fc2(h)``).

Peers: ``ours`` (one fused call on its own: one launch, two with split-K, one more for the LayerNorm statistics of qkv
and fc1), ``ours_chained`` (as a forward chains the layers: qkv and fc1 take their statistics ``ln_stats=`` from the
epilogue of the layer before, which proj and fc2 write with ``stats_out=``), ``ours_split1`` (the same kernel without
split-K, ``LinearConfig(split_k=1)``: what the split buys), ``torch`` (``F.layer_norm``, ``F.linear`` on cuBLAS,
``F.gelu``, a multiply and an add, each its own op, as a timm block runs them). Each cell first checks every peer
against the fp32 reference (:func:`ragged_vit.reference.linear.fused_linear`, the lab's rule:
``ragged_vit.testing.linear``), then times the right ones by device time under CUDA-graph replay
(:func:`benchmarks.timing.graph_time`), cycling through enough copies of the weights that a call does not find its
weight in L2 (a forward's layers each have their own). Prints a markdown table (us per call and ours / torch) and writes
every number with its spread, the card, versions and commit as JSON to ``--out`` (rewritten after each cell). Nothing
here asserts a time. Without a GPU it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import comma_list
from benchmarks.timing import describe, environment, graph_time, l2_bytes

LAYERS = {  # name -> (K, N, fusions)
    "qkv": (768, 2304, ("ln", "bias")),
    "proj": (768, 768, ("bias", "gamma", "residual")),
    "fc1": (768, 3072, ("ln", "bias", "gelu")),
    "fc2": (3072, 768, ("bias", "residual")),
}
ROWS = (1, 50, 99, 197, 394, 788)
PEERS = ("ours", "ours_chained", "ours_split1", "torch")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report_linear", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated subset of " + ",".join(LAYERS))
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    parser.add_argument("--dtype", default="float16", choices=list(DTYPES))
    parser.add_argument("--replays", type=int, default=20, help="graph replays per peer and cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.rows = comma_list(args.rows, int)
        args.layers = comma_list(args.layers, choices=tuple(LAYERS))
        args.peers = comma_list(args.peers, choices=PEERS)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.rows or min(args.rows) < 1:
        parser.error("--rows: positive integers")
    return args


def make_problem(layer: str, rows: int, dtype: torch.dtype, copies: int, seed: int) -> list[tuple[tuple, dict]]:
    """``copies`` input sets ``(args, kwargs)`` of one cell, as the fused call takes them (``x, weight, bias`` and
    the keyword fusions); each copy has its own weight and vectors, the rows are shared."""
    depth, cols, fusions = LAYERS[layer]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=g).to("cuda", dtype)
    residual = torch.randn(rows, cols, generator=g).to("cuda", dtype)
    sets = []
    for _ in range(copies):
        weight = (torch.randn(cols, depth, generator=g) / depth**0.5).to("cuda", dtype)
        bias = (0.1 * torch.randn(cols, generator=g)).to("cuda", dtype)
        kwargs: dict[str, object] = {}
        if "ln" in fusions:
            kwargs.update(ln_weight=(1 + 0.1 * torch.randn(depth, generator=g)).to("cuda", dtype), eps=1e-6)
            kwargs["ln_bias"] = (0.1 * torch.randn(depth, generator=g)).to("cuda", dtype)
        if "gelu" in fusions:
            kwargs["activation"] = "gelu"
        if "gamma" in fusions:
            kwargs["gamma"] = (0.1 * torch.rand(cols, generator=g)).to("cuda", dtype)
        if "residual" in fusions:
            kwargs["residual"] = residual
        sets.append(((x, weight, bias), kwargs))
    return sets


def torch_unfused(x, weight, bias=None, *, ln_weight=None, ln_bias=None, eps=1e-5, activation=None, residual=None,
                  gamma=None, out=None):  # fmt: skip
    """PyTorch's ops one at a time, as a timm block runs them (``out`` ignored: each op allocates its own)."""
    h = x if ln_weight is None else F.layer_norm(x, x.shape[-1:], ln_weight, ln_bias, eps)
    y = F.linear(h, weight, bias)
    if activation is not None:
        y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if gamma is not None:
        y = y * gamma
    return y if residual is None else residual + y


def chain_kwargs(kwargs: dict, x: torch.Tensor, cols: int, config=None) -> dict:
    """``kwargs`` as a forward chains the layers: the LayerNorm's statistics given (computed here, outside the
    timed call, as the layer before writes them), or a ``stats_out`` buffer for the residual layers (its chunks
    those of ``config``, None: the table's)."""
    from ragged_vit.reference.linear import layer_norm_stats
    from ragged_vit.triton_impl.linear import empty_ln_stats

    if "ln_weight" in kwargs:
        return {**kwargs, "ln_stats": layer_norm_stats(x, 12)}
    if "residual" in kwargs:
        return {**kwargs, "stats_out": empty_ln_stats(x.shape[0], cols, x.device, config)}
    return kwargs


def peer_fn(name: str):
    from ragged_vit.triton_impl.configs import LinearConfig, linear_config
    from ragged_vit.triton_impl.linear import fused_linear

    if name in ("ours", "ours_chained"):
        return fused_linear
    if name == "ours_split1":

        def unsplit(x, *args, **kwargs):
            base = linear_config(x.device, x.shape[0])
            config = LinearConfig(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, 1)
            return fused_linear(x, *args, config=config, **kwargs)

        return unsplit
    return torch_unfused


def run_cell(layer: str, rows: int, args: argparse.Namespace, l2: int) -> dict:
    """Checks and times every requested peer on one (layer, M) cell."""
    from ragged_vit.testing.linear import linear_error

    dtype = DTYPES[args.dtype]
    depth, cols, fusions = LAYERS[layer]
    weight_bytes = depth * cols * dtype.itemsize
    copies = max(2, min(64, -(-2 * l2 // weight_bytes)))  # twice L2 of weights between two calls on one copy
    sets = make_problem(layer, rows, dtype, copies, args.seed)
    cell: dict = {"layer": layer, "rows": rows, "K": depth, "N": cols, "fusions": list(fusions), "copies": copies,
                  "weight_bytes": weight_bytes, "peers": {}}  # fmt: skip
    for name in args.peers:
        fn = peer_fn(name)
        entry: dict = {}
        cell["peers"][name] = entry
        peer_sets = [(a, chain_kwargs(k, a[0], cols)) for a, k in sets] if name == "ours_chained" else sets
        (x, weight, bias), kwargs = peer_sets[0]
        try:
            out = fn(x, weight, bias, **kwargs)
            torch.cuda.synchronize()
            checked = {k: v for k, v in kwargs.items() if k != "stats_out"}
            err, allowed = linear_error(out, x, weight, bias, **checked)
        except Exception as exc:  # a failing peer is a result to report
            entry.update(status="error", reason=describe(exc))
            continue
        entry.update(max_error=err, allowed_error=allowed)
        if not err <= allowed:
            entry.update(status="wrong", reason=f"max error {err:.3g} > allowed {allowed:.3g}")
            continue
        outs = [torch.empty(rows, cols, dtype=dtype, device="cuda") for _ in sets]
        calls = [lambda a=a, k=k, o=o, fn=fn: fn(*a, **k, out=o) for (a, k), o in zip(peer_sets, outs, strict=True)]
        result = graph_time(calls, replays=args.replays)
        if result.spread is None:
            entry.update(status="not_capturable", reason=result.reason)
            continue
        entry.update(status="ok", graph_us=result.spread.to_dict())
        entry["weight_gbps"] = weight_bytes / (result.spread.median * 1e-6) / 1e9
    base = cell["peers"].get("torch", {}).get("graph_us")
    for peer in ("ours", "ours_chained"):
        ours = cell["peers"].get(peer, {}).get("graph_us")
        cell[f"{peer}_over_torch"] = ours["median"] / base["median"] if ours and base else None
    del sets
    torch.cuda.empty_cache()
    return cell


def table(cells: list[dict], peers: list[str]) -> str:
    head = "| layer | M | " + " | ".join(f"{p}, us" for p in peers) + " | ours / torch | chained / torch |"
    lines = [head, "|" + "---|" * (len(peers) + 4)]
    for c in cells:
        times = []
        for p in peers:
            entry = c["peers"].get(p, {})
            times.append(f"{entry['graph_us']['median']:.2f}" if entry.get("graph_us") else entry.get("status", "-"))
        ratios = [f"{c[k]:.2f}x" if c.get(k) else "-" for k in ("ours_over_torch", "ours_chained_over_torch")]
        lines.append(f"| {c['layer']} | {c['rows']} | " + " | ".join(times + ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("report_linear: no GPU (torch.cuda.is_available() is False); nothing to time", file=sys.stderr)
        return 0
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 cells compare IEEE fp32 with IEEE fp32
    started = time.perf_counter()
    meta = environment()
    meta["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    l2 = l2_bytes()
    cells: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for layer in args.layers:
        for rows in args.rows:
            t0 = time.perf_counter()
            cells.append(run_cell(layer, rows, args, l2))
            meta["elapsed_s"] = time.perf_counter() - started
            args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
            print(f"[{layer:>4} M={rows:>4}] {time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)
    print(f"{meta.get('card')} ({args.dtype}, device time under CUDA-graph replay, median us per call)\n")
    print(table(cells, list(args.peers)))
    for c in cells:
        for p, entry in c["peers"].items():
            if entry.get("status") != "ok":
                print(f"- {c['layer']} M={c['rows']} {p}: {entry.get('status')}: {entry.get('reason')}")
    print(f"\n{len(cells)} cells in {meta['elapsed_s']:.0f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
