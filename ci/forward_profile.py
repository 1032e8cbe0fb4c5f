"""Where the device time of one graphed forward goes (GPU machine): ``python -m ci.forward_profile``.

DeiT-B 224 fp16 (``--model NAME [--img-size N]``: another timm ViT, a RoPE model among them), random seeded weights,
the benchmark's images. For each batch size: the unpruned timm model under
``torch.compile(mode="reduce-overhead")`` (as timm builds it, and with the pipelines' GEMM patch embedding, so that gain
is not credited to pruning) and the graphed pruned pipelines (``ragged_vit.pipelines.graphs``, Triton backend) of a few
workloads. Each is replayed under ``torch.profiler`` (CUPTI sees the kernels of graph replays); kernels are grouped by
kind (GEMM, attention, Inductor-fused, LayerNorm, elementwise, reductions, sort/scan, indexing, packing, copies). Per
forward: kernel count, summed kernel time ("busy"), CUDA-event time of back-to-back forwards ("span"; span - busy = gaps
and host waits) and the per-kind split. ``--compile-blocks`` adds the pipelines with ``compile_blocks=True``,
``--sync-free-rows R`` the runners with ``TokenBuckets(sync_free_rows=R)``, ``--serial-decisions`` the runners with
``overlap_decisions=False``, ``--eager`` timm eager and the eager pipelines (no graphs; their "host ops" column counts
the top-level aten ops per forward, the host dispatches besides the Triton launches, which the kernel count includes;
``--host-profile N`` adds cProfile's top N functions of each eager row; ``--eager-rounds K`` times timm eager and the
eager pipelines again in turn, K rounds, for ratios that pair timings of one round: the host's speed drifts;
``--eager-only`` keeps the eager rows alone, without the compiles of the graphed ones); ``--fused-blocks`` adds each
pipeline row again with its packed blocks in the fused-linear form (``+fused``: the pipeline's ``fused_block_rows``
forced past the forward's rows, whatever ``FUSED_BLOCK_MAX_ROWS`` says; ``docs/tuning.md``, "Fused-linear blocks"), and
once more with the fused linears launched with programmatic dependent launch (``+fused+pdl``: ``LINEAR_PDL_MAX_ROWS``
forced past the rows while the row is captured and replayed; on GPUs that have it).
An eager pipeline is called as a user calls it, ``pv(images)`` (:meth:`ragged_vit.pipelines.model.PrunedViT.forward`).
``--workloads`` takes ``WORKLOAD:KEEP`` (keep rate 0.5 by default); ``--tome R`` adds ToMe with a fixed ``r = R`` per
block (one graph per forward), ``--tome-adaptive R`` its adaptive merging at the same mean rows (a graph per block,
sized by each block's total). Details go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import re
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import has_gpu
from benchmarks.default_call import CallLab
from benchmarks.e2e_common import DEIT_B
from benchmarks.timing import elapsed, schedule, span_time, warmup
from benchmarks.workloads import workload_keeps
from ragged_vit.pipelines.buckets import TokenBuckets
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.model import PrunedViT
from ragged_vit.pipelines.patch_embed import with_gemm_patch_embed
from ragged_vit.reference.merging import fixed_r_counts
from ragged_vit.reference.pruners import make_pruner
from ragged_vit.triton_impl import configs as linear_configs
from ragged_vit.triton_impl.launcher import pdl_supported

KINDS = (
    ("attention", r"_ragged|flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_"),
    ("inductor", r"^triton_(poi|per|red|tem)_"),
    ("layernorm", r"layer_norm|LayerNorm"),
    ("pack", r"_pack|_count|_unpack|_cls_rows"),
    ("sort/scan", r"sort|scan|radix|topk|cub::|Cumsum|cumsum"),
    ("index", r"index|gather|scatter"),
    ("reduce", r"reduce"),
    ("elementwise", r"elementwise|gelu|GeluCUDA"),
    ("copy", r"copy|memcpy|memset|Memcpy|Memset|fill"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def profile_forward(forward, images: list[torch.Tensor], replays: int = 20) -> dict[str, object]:
    calls = [functools.partial(forward, img) for img in images]
    warmup(calls, n=6)
    span_us = span_time(calls, replays)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for call in schedule(calls, replays):
            call()
        torch.cuda.synchronize()
    per_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host_ops = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            host_ops += evt.cpu_parent is None and evt.name.startswith("aten::")
            continue
        name = evt.name
        dur = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
        k = kind_of(name)
        per_kind[k][0] += 1 / replays
        per_kind[k][1] += dur / replays
        per_name[name][0] += 1 / replays
        per_name[name][1] += dur / replays
    busy = sum(v[1] for v in per_kind.values())
    kernels = sum(v[0] for v in per_kind.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "span_us": span_us,
        "busy_us": busy,
        "kernels": kernels,
        "host_ops": host_ops / replays,
        "kinds": {k: {"count": v[0], "us": v[1]} for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": n[:160], "count": v[0], "us": v[1]} for n, v in top],
    }


def pipeline(lab: CallLab, workload: str, keep: float, images: list[torch.Tensor]) -> PrunedViT:
    """A workload's Triton pipeline on the lab's model; ``("tome", r)``: ToMe with a fixed ``r`` per block;
    ``("tome_adaptive", r)``: ToMe's calibrated mode with ``r_max = 2 r``, its threshold calibrated on ``images`` to
    the fixed ``r``'s mean patch rows per image and block (the counts vary per image; the same rows on average)."""
    if workload not in ("tome", "tome_adaptive"):
        return lab.pipeline(lab.name, workload, keep, "triton")
    model = lab.model(lab.name)
    depth, r = len(model.blocks), int(keep)
    if workload == "tome":
        return PrunedViT(model, make_pruner("tome", r=r, depth=depth), "triton", mode="eager")
    prefix, patches = model.num_prefix_tokens, model.patch_embed.num_patches
    rows = fixed_r_counts(prefix + patches, [r] * depth, prefix)  # prefix rows included
    rate = (sum(rows) / depth - prefix) / patches
    pv = PrunedViT(model, make_pruner("tome", r_max=2 * r, rate=rate, depth=depth), "triton", mode="eager")
    pv.calibrate(torch.cat(images))
    return pv


def label_of(workload: str, keep: float) -> str:
    if workload in ("tome", "tome_adaptive"):
        return f"tome {'adaptive, mean of ' if workload == 'tome_adaptive' else ''}r={keep:g}"
    return f"{workload} {keep:g}"


def eager_rounds(lab: CallLab, batch: int, images: list[torch.Tensor], args: argparse.Namespace) -> list[dict]:
    """timm eager and every workload's eager pipeline timed in turn (``--eager-rounds`` rounds of
    :func:`benchmarks.timing.span_time` each), so that each ratio to timm eager pairs two timings of one round."""
    model = lab.model(lab.name)

    def timm_eager(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    forwards = {"timm eager": timm_eager}
    forwards |= {f"{label_of(w, k)} eager": pipeline(lab, w, k, images) for w, k in args.workloads}  # pv(images)
    calls = {label: [functools.partial(f, img) for img in images] for label, f in forwards.items()}
    for row in calls.values():
        warmup(row, n=6)
    spans: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(args.eager_rounds):
        for label, row in calls.items():
            spans[label].append(span_time(row, 10))
    rows = []
    print(f"eager, {args.eager_rounds} rounds in turn, B={batch}: | pipeline | median img/s | median ratio to timm "
          "eager | min | max | ratio of the fastest rounds |")  # fmt: skip
    for label, us in spans.items():
        ratios = sorted(t / u for t, u in zip(spans["timm eager"], us, strict=True))
        # The fastest round of each: a host hiccup only ever slows a round down, so the minima are the steadiest
        # estimate of what each forward costs the host (the paired ratios show how far a round can swing).
        row = {"batch": batch, "pipeline": label, "img_per_s": batch / statistics.median(us) * 1e6,
               "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
               "ratio_fastest": min(spans["timm eager"]) / min(us)}  # fmt: skip
        rows.append(row)
        print(f"| {batch} | {label} | {row['img_per_s']:,.0f} | {row['ratio_median']:.2f}x | {row['ratio_min']:.2f}x "
              f"| {row['ratio_max']:.2f}x | {row['ratio_fastest']:.2f}x |", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEIT_B, help="a timm ViT name (random weights; default DeiT-B)")
    parser.add_argument("--img-size", type=int, default=None, help="the image size (default: the model's own)")
    parser.add_argument("--batches", default="1,4,64")
    parser.add_argument(
        "--workloads", default="l2_ratio,l2_calibrated,ats", help="WORKLOAD[:KEEP],... (keep rate 0.5 by default)"
    )
    parser.add_argument("--compile-blocks", action="store_true")
    parser.add_argument(
        "--sync-free-rows", type=int, default=0, help="also the runners with TokenBuckets(sync_free_rows=R)"
    )
    parser.add_argument("--serial-decisions", action="store_true", help="also the runners with overlap_decisions=False")
    parser.add_argument(
        "--fused-blocks", action="store_true", help="also every pipeline row with its blocks in the fused-linear form"
    )
    parser.add_argument("--eager", action="store_true", help="also timm eager and the eager pipelines (no graphs)")
    parser.add_argument(
        "--eager-only", action="store_true", help="with --eager: only timm eager and the eager pipelines (no compiles)"
    )
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N", help="with --eager: cProfile's top N functions per row"
    )
    parser.add_argument(
        "--eager-rounds",
        type=int,
        default=0,
        metavar="K",
        help="with --eager: also time timm eager and the eager pipelines in turn, K rounds, and report each "
        "pipeline's median ratio to timm eager over the rounds (host-bound timings drift: pairs from one round) "
        "and the ratio of each one's fastest round",
    )
    parser.add_argument("--tome", type=int, default=0, metavar="R", help="also ToMe with a fixed r = R per block")
    parser.add_argument(
        "--tome-adaptive",
        type=int,
        default=0,
        metavar="R",
        help="also ToMe's adaptive merging at the same mean rows as r = R (threshold calibrated on the images, "
        "r_max = 2 R; the graph runner's default buckets)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        args.workloads = workload_keeps(args.workloads)
    except ValueError as exc:
        parser.error(f"--workloads: {exc}")
    if args.eager_rounds and not args.eager:
        parser.error("--eager-rounds: times the eager rows, which only --eager adds")
    if args.eager_only and not args.eager:
        parser.error("--eager-only: keeps the eager rows, which only --eager adds")
    if args.eager_only and (args.compile_blocks or args.sync_free_rows or args.serial_decisions):
        parser.error("--eager-only: --compile-blocks, --sync-free-rows and --serial-decisions set graphed rows")
    if args.eager_rounds < 0:
        parser.error(f"--eager-rounds: must be >= 0, got {args.eager_rounds}")
    if args.tome < 0:
        parser.error(f"--tome: r must be >= 0, got {args.tome}")
    if args.tome_adaptive < 0:
        parser.error(f"--tome-adaptive: r must be >= 0, got {args.tome_adaptive}")
    if args.tome:
        args.workloads.append(("tome", args.tome))
    if args.tome_adaptive:
        args.workloads.append(("tome_adaptive", args.tome_adaptive))
    if not has_gpu("python -m ci.forward_profile"):
        return
    torch.manual_seed(0)
    options = {} if args.img_size is None else {"img_size": args.img_size}
    lab = CallLab(torch.device("cuda"), torch.float16, args.model, options)
    results = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
               "img_size": lab.image_size(args.model), "rows": []}  # fmt: skip
    print(f"{results['card']}  torch {torch.__version__}  {args.model} at {results['img_size']}")
    pdl_rows = linear_configs.LINEAR_PDL_MAX_ROWS  # the configured value: every row but +fused+pdl's runs with it
    kinds = [k for k, _ in KINDS] + ["other"]
    print("| B | pipeline | img/s | span us | busy us | kernels | host ops | " + " | ".join(kinds) + " | first call |")
    print("|---" * (8 + len(kinds)) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        images = lab.images(args.model, batch)
        # (label, workload or None for timm, keep rate, graphed, compile_blocks, sync-free rows, overlap, fused
        # linears: 0 no, 1 yes, 2 with programmatic dependent launch)
        configs: list[tuple[str, str | None, float, bool, bool, int, bool, int]] = [
            ("timm reduce-overhead", None, 1.0, True, False, 0, True, 0),
            ("timm reduce-overhead +gemm embed", None, 1.0, True, False, 0, True, 0),
        ][: 0 if args.eager_only else 2]
        if args.eager:
            configs.append(("timm eager", None, 1.0, False, False, 0, True, 0))
        for w, keep in args.workloads:
            name = label_of(w, keep)
            if args.eager:
                configs.append((name + " eager", w, keep, False, False, 0, True, 0))
            for compiled in () if args.eager_only else (False, True) if args.compile_blocks else (False,):
                for rows in sorted({0, args.sync_free_rows}):
                    label = name + (" +compile" if compiled else "") + (f" +sync-free {rows}" if rows else "")
                    configs.append((label, w, keep, True, compiled, rows, True, 0))
                if args.serial_decisions:
                    configs.append((name + (" +compile" if compiled else "") + " +serial", w, keep, True, compiled, 0,
                                    False, 0))  # fmt: skip
        if args.fused_blocks:  # each pipeline row beside its fused-linear twins, without and with PDL
            pdl = pdl_supported(torch.cuda.current_device())
            configs = [twin for c in configs for twin in ((c, (c[0] + " +fused", *c[1:7], 1),
                       *([(c[0] + " +fused+pdl", *c[1:7], 2)] if pdl else [])) if c[1] else (c,))]  # fmt: skip
        for label, workload, keep, graphed, compiled, sync_free_rows, overlap, fused in configs:
            linear_configs.LINEAR_PDL_MAX_ROWS = (1 << 30) if fused == 2 else pdl_rows  # captured and replayed with it
            if workload is None:
                model = lab.model(args.model)
                if "gemm" in label:  # the same embedding as the pipelines, so its gain is not credited to pruning
                    model = with_gemm_patch_embed(model)
                if graphed:
                    model = torch.compile(model, mode="reduce-overhead")

                def forward(x, model=model):
                    with torch.no_grad():
                        return model(x)
            else:
                pv = pipeline(lab, workload, keep, images)
                pv.compile_blocks = compiled
                if fused:
                    if pv.fused_block_refusal() is not None:
                        print(f"{label}: no fused-linear form ({pv.fused_block_refusal()})")
                        continue
                    pv.fused_block_rows = 1 << 30
                buckets = TokenBuckets(sync_free_rows=sync_free_rows) if sync_free_rows else None
                forward = GraphedPrunedViT(pv, buckets, overlap_decisions=overlap).run if graphed else pv
            first_s = elapsed([functools.partial(forward, images[0])], lab.device)
            r = profile_forward(forward, images)
            if args.host_profile and not graphed:
                host = cProfile.Profile()
                for img in images * 10:
                    host.runcall(forward, img)
                print(f"host profile of {label} at B={batch} ({10 * len(images)} forwards):")
                pstats.Stats(host).sort_stats("tottime").print_stats(args.host_profile)
            r.update(batch=batch, pipeline=label, img_per_s=batch / r["span_us"] * 1e6, first_call_s=first_s)
            results["rows"].append(r)
            none = {"count": 0, "us": 0}
            split = " | ".join(
                f"{r['kinds'].get(k, none)['count']:.0f}/{r['kinds'].get(k, none)['us']:.0f}" for k in kinds
            )
            print(
                f"| {batch} | {label} | {r['img_per_s']:,.0f} | {r['span_us']:.0f} | {r['busy_us']:.0f} "
                f"| {r['kernels']:.0f} | {r['host_ops']:.0f} | {split} | {first_s:.0f} s |",
                flush=True,
            )
            del forward
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if args.eager_rounds:
            results.setdefault("eager_rounds", []).extend(eager_rounds(lab, batch, images, args))
    linear_configs.LINEAR_PDL_MAX_ROWS = pdl_rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
