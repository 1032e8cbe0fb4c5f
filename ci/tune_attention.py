"""Sweeps launch configurations of the ragged attention kernel on the current GPU (device time, graph replay).

Usage (GPU machine, repo root)::

    python -m ci.tune_attention [--quick] [--heads H] [--head-dim D] [--patches P] [--out results.json]

Prints, per workload cell (by default DeiT-B geometry: H=12, D=64, 196 patches + CLS; fp16, per-image counts varying
around the pruning ratio), the device time of every configuration and of FA2 (the kernel benchmark's ``fa2_aten``
peer), the configuration ``triton_impl/configs.py`` picks now for that cell ("table"), then the configuration with the
best geometric-mean ratio to FA2 over all cells. Every configuration's output is first checked once per cell against
the fp32 reference (max abs error <= ``benchmarks.attention_peers.TOLERANCE``); one that is wrong or does not compile
(out of shared memory, say) is reported and left out of the ranking. The chosen entry goes into
``triton_impl/configs.py`` by hand, with the run's card named in ``docs/kernel_tuning.md``.

Other geometries: ``--head-dim`` takes any multiple of 8 up to 256 (the kernel's range; it pads a head dim that is not
a power of two to the next one inside, with masked lanes: 80 and 96 run 128-wide tiles), ``--heads`` the head count,
``--patches`` the unpruned patch count (every cell's per-image counts are the DeiT-B cell's, scaled by P / 196).
``configs.py`` has tuned SM90 entries for head dims 16/32/64/80/96/128; any other runs its untuned default (64x64
tiles, 4 warps, 2 stages, a program per query tile; 32x32 past 128). The sweeps behind the 80 (ViT-H/14 at 224:
H=16, 256 patches) and 96 (e.g. width 1152 at 12 heads) entries::

    python -m ci.tune_attention --quick --heads 16 --head-dim 80 --patches 256 --out tune_h16_d80.json
    python -m ci.tune_attention --quick --heads 12 --head-dim 96 --out tune_h12_d96.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
from collections.abc import Sequence

import torch

from benchmarks import has_gpu
from benchmarks.attention_peers import TOLERANCE, Problem, build_peer, reference_output
from benchmarks.timing import device_us
from benchmarks.workloads import HEAD_DIM, NUM_HEADS, NUM_PATCHES, Workload, cell_seed, grid, make_workload
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl.configs import AttentionConfig, attention_config

QUICK_CELLS = [(1, 80), (32, 50), (64, 0), (128, 0)]
PROG = "python -m ci.tune_attention"


def _configs(quick: bool) -> list[AttentionConfig]:
    """Tiles x warps x stages x grid (``quick``: a subset)."""
    configs = [AttentionConfig(32, n, 2, s, g) for n in (32, 64) for s in (1, 3) for g in (True, False)]
    for m, n, w, s, g in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3), (True, False)):
        if not (m == 128 and n == 128):
            configs.append(AttentionConfig(m, n, w, s, g))
    if quick:
        configs = [c for c in configs if c.num_stages in (1, 3) and c.num_warps == max(2, 4 * c.block_m // 64)]
    return configs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells and configurations")
    parser.add_argument("--heads", type=int, default=NUM_HEADS, help=f"attention heads H (default {NUM_HEADS})")
    parser.add_argument(
        "--head-dim", type=int, default=HEAD_DIM, help=f"head dim D, a multiple of 8 up to 256 (default {HEAD_DIM})"
    )
    parser.add_argument(
        "--patches", type=int, default=NUM_PATCHES, help=f"unpruned patches per image (default {NUM_PATCHES})"
    )
    parser.add_argument("--out", default=None, help="JSON file of every time")
    args = parser.parse_args(argv)
    if args.head_dim not in ta.SUPPORTED_HEAD_DIMS:
        parser.error(f"--head-dim: must be a multiple of 8 up to 256 (the kernel's range), got {args.head_dim}")
    if args.heads < 1:
        parser.error(f"--heads: must be >= 1, got {args.heads}")
    if args.patches < 1:
        parser.error(f"--patches: must be >= 1, got {args.patches}")
    return args


def scaled_workload(batch: int, pruned_pct: int, patches: int = NUM_PATCHES) -> Workload:
    """The seeded DeiT-B cell (:func:`benchmarks.workloads.make_workload`) with every image's kept patch count scaled
    by ``patches / 196`` (rounded, clipped to ``[1, patches]``; CLS added): the same spread around the pruning target
    for a model with another patch count (unpruned: every image has ``patches + 1`` rows)."""
    wl = make_workload(batch, pruned_pct)
    if patches == NUM_PATCHES:
        return wl
    kept = (min(patches, max(1, round((n - 1) * patches / NUM_PATCHES))) for n in wl.lengths)
    return dataclasses.replace(wl, lengths=tuple(k + 1 for k in kept))


def make_cell(
    wl: Workload, heads: int, head_dim: int, device: torch.device | str, dtype: torch.dtype = torch.float16
) -> Problem:
    """One seeded packed ``qkv [T, 3*H*D]`` of ``wl`` and its offsets, as a kernel-benchmark :class:`Problem`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(cell_seed(wl.batch, wl.pruned_pct, wl.variable) + 1)
    qkv = torch.randn((wl.total, 3 * heads * head_dim), generator=gen, device=device, dtype=dtype)
    return Problem(wl, [qkv], wl.cu_seqlens(device), num_heads=heads, head_dim=head_dim)


def config_error(
    problem: Problem, reference: torch.Tensor, max_seqlen: int, config: AttentionConfig, out: torch.Tensor | None = None
) -> float:
    """Max abs error of the kernel under ``config`` against ``reference`` (fp32 ``[T, H, D]``; NaN counts as inf)."""
    heads, head_dim = problem.num_heads, problem.head_dim
    got = ta.ragged_attention_qkv(problem.qkv_sets[0], problem.cu_seqlens, max_seqlen, heads, out=out, config=config)
    err = (got.view(-1, heads, head_dim).float() - reference).abs().max().item()
    return math.inf if math.isnan(err) else err


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not has_gpu(PROG):
        return 0
    heads, head_dim, max_seqlen = args.heads, args.head_dim, args.patches + 1  # the bound the pipelines pass
    cells = QUICK_CELLS if args.quick else grid()
    workloads = {f"B{b}_p{p}": scaled_workload(b, p, args.patches) for b, p in cells}
    device = torch.device("cuda")
    table = {cell: attention_config(device, head_dim, wl.total / wl.batch) for cell, wl in workloads.items()}
    configs = _configs(quick=args.quick)
    configs += [c for c in dict.fromkeys(table.values()) if c not in configs]  # the table's picks are always timed
    results: dict[str, dict[str, float]] = {}
    errors: dict[str, dict[str, float]] = {}
    card = torch.cuda.get_device_name()
    print(
        f"card: {card}  torch {torch.__version__}  H={heads} D={head_dim} patches={args.patches}  "
        f"configs: {len(configs)}  cells: {len(cells)}",
        flush=True,
    )
    for cell, wl in workloads.items():
        problem = make_cell(wl, heads, head_dim, device)
        reference = reference_output(problem)
        out = torch.empty(wl.total, heads * head_dim, dtype=torch.float16, device=device)
        results[cell] = {"fa2": device_us(build_peer("fa2_aten", problem).calls[0])}
        errors[cell] = {}
        for cfg in configs:
            try:
                err = errors[cell][repr(cfg)] = config_error(problem, reference, max_seqlen, cfg, out)
                if err > TOLERANCE:
                    results[cell][repr(cfg)] = float("nan")
                    print(f"  {cfg}: WRONG: max abs error {err:.3g} > {TOLERANCE} against the fp32 reference")
                    continue
                call = functools.partial(
                    ta.ragged_attention_qkv, problem.qkv_sets[0], problem.cu_seqlens, max_seqlen, heads, out=out,
                    config=cfg,
                )  # fmt: skip
                results[cell][repr(cfg)] = device_us(call)
            except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                results[cell][repr(cfg)] = float("nan")
                print(f"  {cfg}: failed: {type(exc).__name__}: {str(exc)[:120]}")
        timed = [(t, c) for c, t in results[cell].items() if c != "fa2" and not math.isnan(t)]
        fa2, now = results[cell]["fa2"], results[cell][repr(table[cell])]
        best = f"best={min(timed)[0]:7.2f}us {min(timed)[1]}" if timed else "best=none (every configuration failed)"
        print(f"{cell:>9} tokens={wl.total:6d} fa2={fa2:7.2f}us {best}  table={now:7.2f}us ({now / fa2:.3f} x FA2)")
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
        payload = {
            "card": card,
            "torch": torch.__version__,
            "geometry": {"heads": heads, "head_dim": head_dim, "patches": args.patches, "max_seqlen": max_seqlen},
            "table": {cell: repr(cfg) for cell, cfg in table.items()},
            "results": results,
            "max_abs_error": errors,
            "scores": scores,
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
