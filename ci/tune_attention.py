"""Sweeps launch configurations of the ragged attention kernel on the current GPU (device time, graph replay).

Usage (GPU machine, repo root): ``python -m ci.tune_attention [--quick] [--out results.json]``.
Prints, per workload cell (DeiT-B geometry, H=12, D=64, fp16, per-image counts varying around the pruning
ratio), the device time of every configuration and of FA2 (the kernel benchmark's ``fa2_aten`` peer), then the
configuration with the best geometric-mean ratio to FA2 over all cells. The chosen entry goes into
``triton_impl/configs.py`` by hand, with the run's card named in ``docs/kernel_tuning.md``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math

import torch

from benchmarks.attention_peers import build_peer, make_problem
from benchmarks.timing import device_us
from benchmarks.workloads import HEAD_DIM, MAX_SEQLEN, NUM_HEADS, grid, make_workload
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl.configs import AttentionConfig

QUICK_CELLS = [(1, 80), (32, 50), (64, 0), (128, 0)]


def _configs(quick: bool) -> list[AttentionConfig]:
    """Tiles x warps x stages x grid (``quick``: a subset)."""
    configs = [AttentionConfig(32, n, 2, s, g) for n in (32, 64) for s in (1, 3) for g in (True, False)]
    for m, n, w, s, g in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3), (True, False)):
        if not (m == 128 and n == 128):
            configs.append(AttentionConfig(m, n, w, s, g))
    if quick:
        configs = [c for c in configs if c.num_stages in (1, 3) and c.num_warps == max(2, 4 * c.block_m // 64)]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cells and configurations")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cells = QUICK_CELLS if args.quick else grid()
    configs = _configs(quick=args.quick)
    results: dict[str, dict[str, float]] = {}
    card = torch.cuda.get_device_name()
    print(f"card: {card}  torch {torch.__version__}  configs: {len(configs)}  cells: {len(cells)}", flush=True)
    for batch, pruned in cells:
        wl = make_workload(batch, pruned)
        problem = make_problem(wl, 1, "cuda")
        qkv, cu = problem.qkv_sets[0], problem.cu_seqlens
        out = torch.empty(wl.total, NUM_HEADS * HEAD_DIM, dtype=qkv.dtype, device="cuda")
        cell = f"B{batch}_p{pruned}"
        results[cell] = {"fa2": device_us(build_peer("fa2_aten", problem).calls[0])}
        for cfg in configs:
            call = functools.partial(ta.ragged_attention_qkv, qkv, cu, MAX_SEQLEN, NUM_HEADS, out=out, config=cfg)
            try:
                results[cell][repr(cfg)] = device_us(call)
            except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                results[cell][repr(cfg)] = float("nan")
                print(f"  {cfg}: failed: {type(exc).__name__}: {str(exc)[:120]}")
        best_us, best_cfg = min((t, c) for c, t in results[cell].items() if c != "fa2" and not math.isnan(t))
        print(f"{cell:>9} tokens={wl.total:6d} fa2={results[cell]['fa2']:7.2f}us best={best_us:7.2f}us {best_cfg}")
    scores = {}
    for cfg in configs:
        ratios = [results[c][repr(cfg)] / results[c]["fa2"] for c in results]
        if not any(math.isnan(r) for r in ratios):
            scores[repr(cfg)] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    ranked = sorted(scores.items(), key=lambda kv: kv[1])
    print("\nbest configurations by geometric-mean (ours / FA2) device time:")
    for cfg, score in ranked[:8]:
        worst = max(results[c][cfg] / results[c]["fa2"] for c in results)
        print(f"  {score:.3f} (worst cell {worst:.3f})  {cfg}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "results": results, "scores": scores}, f, indent=1)


if __name__ == "__main__":
    main()
