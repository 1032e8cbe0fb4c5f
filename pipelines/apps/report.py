"""``validate``'s results: the dictionary (also the ``--results-json`` file), the printed report and the
``--results-csv`` row.

Throughput in total: model only is the sum of the ranks' rates; end to end is all images over the slowest rank's wall
time. The share of the wall time spent waiting for the next batch says whether data loading bounds it.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import torch

from .folder import LISTED_SKIPS, Skipped
from .options import Setup, ValidateOptions
from .tally import TOP_K, Tally

DATA_BOUND_SHARE = 0.2
"""End to end counts as bound by data loading when the loop waits for batches this share of its wall time or more."""

CSV_FIELDS: tuple[str, ...] = (
    "time",
    "data_dir",
    "model",
    "weights",
    "pruner",
    "keep_rate",
    "pruner_options",
    "backend",
    "mode",
    "device",
    "dtype",
    "batch_size",
    "world_size",
    "images",
    "skipped",
    "top1",
    "top5",
    "unpruned_top1",
    "unpruned_top5",
    "top1_agreement",
    "top1_delta",
    "kept_mean",
    "img_per_s_model",
    "img_per_s_end_to_end",
    "unpruned_img_per_s_model",
    "ragged_vit",
)
"""The columns of ``--results-csv`` (percentages for accuracies, ``/``-joined per-stage means for kept patches)."""


def _rate(images: float, seconds: float) -> float | None:
    return images / seconds if seconds > 0 else None


def _accuracy(tally: Tally, prefix: str) -> dict[str, float | int]:
    n = tally.count("images")
    top1, top5 = tally.count(prefix + "top1"), tally.count(prefix + "top5")
    return {"images": n, "top1_correct": top1, "top5_correct": top5, "top1": 100 * top1 / n, "top5": 100 * top5 / n}


def collect_results(
    options: ValidateOptions,
    setup: Setup,
    tally: Tally,
    per_rank: torch.Tensor,
    skipped: list[Skipped],
    mode: str,
    params: float,
) -> dict:
    """The results of a run (all ranks' counts in ``tally``, each rank's times in a row of ``per_rank``)."""
    import timm
    import triton

    from ... import __version__

    index, pv, data_config = setup.index, setup.pv, setup.data_config
    device = options.device
    unused = options.pruner == "none" or options.pruner_options.get("threshold_mode") == "threshold"
    keep_rate = None if unused else options.keep_rate
    pruned = _accuracy(tally, "")
    unpruned = agreement = None
    if options.compare_unpruned:
        unpruned = _accuracy(tally, "unpruned_")
        agree = tally.count("top1_agree")
        agreement = {
            "top1_agree": agree,
            "top1_agreement": 100 * agree / pruned["images"],
            "top1_delta": pruned["top1"] - unpruned["top1"],
            "top5_delta": pruned["top5"] - unpruned["top5"],
        }
    stages = []
    for stage, stats in zip(pv.plan.stages, tally.kept(), strict=True):
        stages.append({"stage": stage.index, "block": stage.block, "placement": stage.placement.value, **stats})
    ranks = []
    for rank, (images, model_s, unpruned_s, wall_s, wait_s) in enumerate(per_rank.tolist()):
        ranks.append(
            {
                "rank": rank,
                "images": int(images),
                "model_s": model_s,
                "unpruned_model_s": unpruned_s if options.compare_unpruned else None,
                "wall_s": wall_s,
                "data_wait_s": wait_s,
                "img_per_s_model": _rate(images, model_s),
                "unpruned_img_per_s_model": _rate(images, unpruned_s) if options.compare_unpruned else None,
                "img_per_s_end_to_end": _rate(images, wall_s),
            }
        )
    total_wall = max(r["wall_s"] for r in ranks)
    total = {
        "img_per_s_model": sum(r["img_per_s_model"] or 0.0 for r in ranks),
        "unpruned_img_per_s_model": sum(r["unpruned_img_per_s_model"] or 0.0 for r in ranks)
        if options.compare_unpruned
        else None,
        "img_per_s_end_to_end": _rate(pruned["images"], total_wall),
        "wall_s": total_wall,
        "data_wait_share": sum(r["data_wait_s"] for r in ranks) / max(1e-12, sum(r["wall_s"] for r in ranks)),
    }
    return {
        "command": options.command,
        "versions": {
            "ragged_vit": __version__,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "timm": timm.__version__,
        },
        "data": {
            "dir": str(index.root.resolve()),
            "class_map": str(index.class_map) if index.class_map else None,
            "classes": len(index.classes),
            "images": len(index.samples),
            "skipped": [{"path": s.path, "reason": s.reason} for s in skipped],
            "notes": setup.notes,
            "transform": {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items()},
        },
        "model": {
            "name": options.model,
            "kwargs": options.model_kwargs,
            "params_m": params,
            "weights": setup.weights,
            "num_classes": pv.model.num_classes,
            "num_patches": pv.num_patches,
        },
        "pruner": {"name": options.pruner, "keep_rate": keep_rate, "options": options.pruner_options},
        "run": {
            "backend": pv.backend.name,
            "mode": mode,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(options.dtype).removeprefix("torch."),
            "batch_size": options.batch_size,
            "workers": options.workers,
            "warmup": options.warmup,
            "world_size": len(ranks),
        },
        "pruned": pruned,
        "unpruned": unpruned,
        "agreement": agreement,
        "kept_patches": stages,
        "throughput": {"total": total, "ranks": ranks},
    }


def _img_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _placement(value: str) -> str:
    return {"before_block": "before block", "mid_block": "inside block", "after_block": "after block"}[value]


def report_lines(results: dict) -> list[str]:
    """The printed report of :func:`collect_results`'s results."""
    pruned, unpruned, agreement = results["pruned"], results["unpruned"], results["agreement"]
    n = pruned["images"]
    classes = results["model"]["num_classes"]
    top_k = f" (top-5 is top-{classes}: the model has {classes} classes)" if classes < TOP_K else ""
    lines = ["", f"Accuracy on {n} images{top_k}:"]

    def row(name: str, acc: dict) -> str:
        return (
            f"  {name:<10} top-1 {acc['top1']:7.3f}% ({acc['top1_correct']}/{n})   "
            f"top-5 {acc['top5']:7.3f}% ({acc['top5_correct']}/{n})"
        )

    label = "pruned" if results["kept_patches"] else "unpruned"  # --pruner none: the model as it is
    lines.append(row(label, pruned))
    if unpruned is not None:
        lines.append(row("unpruned", unpruned))
        lines.append(
            f"  top-1 agreement {agreement['top1_agreement']:.3f}% ({agreement['top1_agree']}/{n}); "
            f"pruned minus unpruned: top-1 {agreement['top1_delta']:+.3f}, top-5 {agreement['top5_delta']:+.3f} points"
        )
    stages = results["kept_patches"]
    if stages:
        lines.append(f"Kept patches per stage (of {results['model']['num_patches']}; over the images):")
        for s in stages:
            lines.append(
                f"  stage {s['stage']} ({_placement(s['placement'])} {s['block']}): mean {s['mean']:.2f}, "
                f"std {s['std']:.2f}, min {s['min']}, max {s['max']}"
            )
    else:
        lines.append(f"Kept patches: all {results['model']['num_patches']} (no pruning)")
    total, ranks = results["throughput"]["total"], results["throughput"]["ranks"]
    world = len(ranks)
    lines.append(f"Throughput in img/s ({'sum of ' + str(world) + ' ranks' if world > 1 else 'one process'}):")
    lines.append(f"  {label + ', model only':<24}{_img_s(total['img_per_s_model']):>10}  (synchronised forwards)")
    if unpruned is not None:
        lines.append(f"  unpruned, model only    {_img_s(total['unpruned_img_per_s_model']):>10}  (timm eager)")
    both = ", both forwards" if unpruned is not None else ""
    slowest = " of the slowest rank" if world > 1 else ""
    lines.append(
        f"  end to end              {_img_s(total['img_per_s_end_to_end']):>10}  "
        f"(wall time{slowest} {total['wall_s']:.2f} s: data loading{both} and counting)"
    )
    share = total["data_wait_share"]
    workers = results["run"]["workers"]
    if share >= DATA_BOUND_SHARE:
        lines.append(
            f"  end to end is bound by data loading: {100 * share:.0f}% of the wall time waiting for batches "
            f"({workers} loader worker{'s' if workers != 1 else ''} per rank: more --workers or faster storage "
            "would help)"
        )
    else:
        lines.append(f"  data loading kept up: {100 * share:.0f}% of the wall time waiting for batches")
    if world > 1:
        for r in ranks:
            lines.append(
                f"  rank {r['rank']}: {r['images']} images, model only {_img_s(r['img_per_s_model'])}, "
                f"end to end {_img_s(r['img_per_s_end_to_end'])}, waiting {r['data_wait_s']:.2f} of {r['wall_s']:.2f} s"
            )
    skipped = results["data"]["skipped"]
    if skipped:
        lines.append(f"Skipped {len(skipped)} file{'s' if len(skipped) != 1 else ''} (--skip-bad):")
        for s in skipped[:LISTED_SKIPS]:
            lines.append(f"  {s['path']}: {s['reason']}")
        if len(skipped) > LISTED_SKIPS:
            lines.append(f"  ... {len(skipped) - LISTED_SKIPS} more (all in --results-json)")
    return lines


def csv_row(results: dict) -> dict[str, object]:
    """One row of :data:`CSV_FIELDS` from :func:`collect_results`'s results."""
    unpruned, agreement, total = results["unpruned"], results["agreement"], results["throughput"]["total"]
    kept = "/".join(f"{s['mean']:.2f}" for s in results["kept_patches"])
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data_dir": results["data"]["dir"],
        "model": results["model"]["name"],
        "weights": results["model"]["weights"],
        "pruner": results["pruner"]["name"],
        "keep_rate": results["pruner"]["keep_rate"],
        "pruner_options": json.dumps(results["pruner"]["options"], sort_keys=True, default=repr),
        "backend": results["run"]["backend"],
        "mode": results["run"]["mode"],
        "device": results["run"]["device_name"],
        "dtype": results["run"]["dtype"],
        "batch_size": results["run"]["batch_size"],
        "world_size": results["run"]["world_size"],
        "images": results["pruned"]["images"],
        "skipped": len(results["data"]["skipped"]),
        "top1": results["pruned"]["top1"],
        "top5": results["pruned"]["top5"],
        "unpruned_top1": unpruned["top1"] if unpruned else "",
        "unpruned_top5": unpruned["top5"] if unpruned else "",
        "top1_agreement": agreement["top1_agreement"] if agreement else "",
        "top1_delta": agreement["top1_delta"] if agreement else "",
        "kept_mean": kept,
        "img_per_s_model": total["img_per_s_model"],
        "img_per_s_end_to_end": total["img_per_s_end_to_end"],
        "unpruned_img_per_s_model": total["unpruned_img_per_s_model"] if unpruned else "",
        "ragged_vit": results["versions"]["ragged_vit"],
    }


def _csv_header(path: Path) -> list[str] | None:
    """The header of an existing, non-empty CSV file (None for a new or empty one)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def append_csv(path: str | os.PathLike, row: dict[str, object]) -> None:
    """Appends ``row`` to the CSV file ``path``, writing the header first if the file is new or empty."""
    path = Path(path)
    new = _csv_header(path) is None
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)

