"""Stage breakdown of one pruned forward (the paper's Table IV): front, pack, late blocks, head.

:func:`stage_breakdown` runs forwards of a :class:`ragged_vit.pipelines.model.PrunedViT` with its ``on_step`` hook,
which is called before every step of the forward plan; :class:`Marks` records a mark whenever the region changes.
On a GPU a mark is a CUDA event on the current stream, so the regions are device-side intervals of one forward,
the paper's method; on a CPU it is the host clock. Regions, by the plan's step kinds:

* ``front`` -- FRONT: patch embedding and the dense blocks before the first stage (the input checks come before the
  first step and are counted here too);
* ``pack``  -- DECIDE and REPACK of every stage: the pruner's scoring (CLS attention for EViT/ATS) or its fused
  kernel, and the repack of the packed buffer, including the one host read of a variable-count stage;
* ``late``  -- BLOCKS, ATTENTION and MLP: the packed blocks (attention through the backend; the padded backends pad
  inside each block, so their per-layer gather is here, not in ``pack``), summed between stages;
* ``head``  -- HEAD: the CLS gather, norms and classifier.

The marks cost a few microseconds of host time each (one per region change): compare the total with the
uninstrumented forward, which is reported beside it. Not supported: the CUDA-graph runner (nothing can be timed
inside a replay), timm's own model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.timing import Spread, gc_off, summarize
from ragged_vit.pipelines.plan import Step, StepKind

REGIONS = ("front", "pack", "late", "head")
REGION_OF = {
    StepKind.FRONT: "front",
    StepKind.DECIDE: "pack",
    StepKind.REPACK: "pack",
    StepKind.BLOCKS: "late",
    StepKind.ATTENTION: "late",
    StepKind.MLP: "late",
    StepKind.HEAD: "head",
}


class Marks:
    """The region transitions of forwards: ``on_step`` (a ``PrunedViT.run`` hook) records a timestamp when the
    region changes."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.current: str | None = None
        self._marks: list[tuple[str, object]] = []

    def mark(self, region: str) -> None:
        if region == self.current:
            return
        self.current = region
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((region, event))
        else:
            self._marks.append((region, time.perf_counter()))

    def on_step(self, step: Step) -> None:
        self.mark(REGION_OF[step.kind])

    def start(self) -> None:
        self.current = None
        self._marks = []
        self.mark("front")

    def stop(self) -> dict[str, float]:
        """Ends a forward; returns microseconds per region (after synchronizing on a GPU)."""
        self.mark("end")
        if self.cuda:
            torch.cuda.synchronize()
        spent = dict.fromkeys(REGIONS, 0.0)
        for (region, a), (_, b) in zip(self._marks[:-1], self._marks[1:], strict=True):
            spent[region] += a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
        self.current = None
        return spent


def stage_breakdown(
    calls: Sequence[Callable[..., object]], device: torch.device, iters: int = 20, warmup: int = 2
) -> dict[str, Spread]:
    """Median and spread per region (and ``total``, their sum per forward) over ``iters`` instrumented forwards,
    each started on an idle device; ``calls`` are forwards of one pipeline (``PrunedViT.run`` with its images bound,
    rotated) that take the ``on_step`` hook."""
    samples: dict[str, list[float]] = {r: [] for r in (*REGIONS, "total")}
    marks = Marks(device)
    with gc_off():
        for i in range(warmup + iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks.start()
            calls[i % len(calls)](on_step=marks.on_step)
            spent = marks.stop()
            if i >= warmup:
                for region in REGIONS:
                    samples[region].append(spent[region])
                samples["total"].append(sum(spent.values()))
    return {region: summarize(values) for region, values in samples.items()}
