"""Device time of each stage's pruning decision under CUDA-graph replay (GPU machine):
``python -m benchmarks.decision_time``.

DeiT-B 224 fp16, random seeded weights, the end-to-end benchmark's images and pruners
(:class:`benchmarks.e2e_common.Lab`). For each workload and batch size the eager Triton pipeline runs once; at every
DECIDE step ``on_step`` hands over the stage's input (:meth:`PrunedViT.decision_input`), and that stage's decision alone
(``ragged_vit.pipelines.model.decide``: the fused device decision where one is registered) is captured 20 times in a
CUDA graph and replayed (:func:`benchmarks.timing.device_us`). This is the decision's own device time, as the graph
runner pays it (where ``overlap_decisions`` runs it beside the MLP, some of it is hidden). A decision that cannot be
captured is reported with the reason. Details go to ``--out`` (JSON); a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks import bench_device, comma_list
from benchmarks.e2e_common import DEIT_B, Lab
from benchmarks.timing import device_us, environment
from benchmarks.workloads import workload_keeps
from ragged_vit.core.selection import DecisionInput
from ragged_vit.pipelines.parts import decide
from ragged_vit.pipelines.plan import Step, StepKind
from ragged_vit.pipelines.state import ForwardState

DEFAULT_WORKLOADS = (("l2_ratio", 0.5), ("l2_calibrated", 0.5), ("ats", 0.5), ("dynamicvit", 0.7), ("evit", 0.7),
                     ("evit_fused", 0.7))  # fmt: skip


def stage_inputs(lab: Lab, workload: str, keep_rate: float, batch: int) -> tuple[object, list[DecisionInput]]:
    """The pruner and every stage's decision input of one eager forward on the benchmark's first image batch."""
    pv = lab.pipeline(DEIT_B, workload, keep_rate, "triton")
    inputs: list[DecisionInput] = []

    def keep_input(step: Step, state: ForwardState) -> None:
        if step.kind is StepKind.DECIDE:
            inputs.append(pv.decision_input(step.stage, state))

    pv.run(lab.images(DEIT_B, batch)[0], on_step=keep_input)
    return pv.pruner, inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decision_time", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,64", help="comma-separated batch sizes (default 1,4,64)")
    parser.add_argument(
        "--workloads",
        default=",".join(f"{w}:{k:g}" for w, k in DEFAULT_WORKLOADS),
        help="comma-separated WORKLOAD:KEEP_RATE (default: every pruner, DynamicViT/EViT at 0.7, the others at 0.5)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the details")
    args = parser.parse_args(argv)
    try:
        batches = comma_list(args.batches, int, None)
        workloads = workload_keeps(args.workloads)
    except ValueError as exc:
        parser.error(f"--batches/--workloads: {exc}")
    picked = bench_device("cuda", "decision_time")
    if picked is None:
        return 2
    lab = Lab(*picked)
    rows = []
    for workload, keep_rate in workloads:
        for batch in batches:
            pruner, inputs = stage_inputs(lab, workload, keep_rate, batch)
            for inp in inputs:
                row = {"workload": workload, "keep_rate": keep_rate, "batch": batch, "stage": inp.stage,
                       "rows": int(inp.x.shape[0])}  # fmt: skip
                try:
                    row["us"] = device_us(lambda pruner=pruner, inp=inp: decide(pruner, inp))
                except RuntimeError as exc:
                    row["reason"] = str(exc).splitlines()[0]
                rows.append(row)
        lab.clear()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": environment(), "rows": rows}, indent=1))
    print(f"decision device time per stage (us, graph replay), {torch.cuda.get_device_name()}")
    stages = max(r["stage"] for r in rows) + 1
    print("| workload | keep | B | " + " | ".join(f"stage {i}" for i in range(stages)) + " |")
    by_cell: dict[tuple, dict[int, str]] = {}
    for r in rows:
        by_cell.setdefault((r["workload"], r["keep_rate"], r["batch"]), {})[r["stage"]] = (
            f"{r['us']:.1f}" if "us" in r else "not captured"
        )
    for (w, k, b), stages in by_cell.items():
        print(f"| {w} | {k:g} | {b} | " + " | ".join(stages.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
