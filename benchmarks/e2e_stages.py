"""Stage breakdown of one pruned forward (the paper's Table IV): front, pack, late blocks, head.

:func:`stage_timer` instruments a :class:`ragged_vit.pipelines.model.PrunedViT` from the outside, without changing what
it computes: inside the context, ``ragged_vit.pipelines.model._repack`` and ``ragged_vit.pipelines.model.packed_block``
(module globals that ``PrunedViT.run`` looks up at call time) and the pipeline's ``_prune_input`` / ``_head`` methods
(instance attributes shadowing the class's) are wrapped so that entering a region records a mark. On a GPU a mark is a
CUDA event on the current stream, so the regions are device-side intervals of one forward, the paper's method; on a CPU
it is the host clock. Regions:

* ``front`` -- input checks, patch embedding and the dense blocks before the first stage;
* ``pack``  -- each pruning stage: the pruner's scoring (CLS attention for EViT/ATS) and the repack of the
  packed buffer, including the one host read of a variable-count stage; summed over stages;
* ``late``  -- the packed blocks (attention through the backend; the padded backends pad inside each block,
  so their per-layer gather is here, not in ``pack``), summed between stages;
* ``head``  -- after the last block: the CLS gather, norms and classifier.

The marks cost a few microseconds of host time each (about 2 + 2 per stage + blocks): compare the total with the
uninstrumented forward, which is reported beside it. Not supported: pipelines that are not ``PrunedViT`` (the
CUDA-graph runner, timm's own model).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

import ragged_vit.pipelines.model as pm
from benchmarks.timing import Spread, gc_off, summarize
from ragged_vit.pipelines.model import PrunedViT

REGIONS = ("front", "pack", "late", "head")


class Marks:
    """The region transitions of forwards: ``mark(region)`` records a timestamp when the region changes."""

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


@contextlib.contextmanager
def stage_timer(pv: PrunedViT, device: torch.device) -> Iterator[Marks]:
    """Instruments ``pv`` (see the module docstring); yields the :class:`Marks` to ``start``/``stop`` per forward."""
    marks = Marks(device)
    last_block = pv.model.blocks[-1]
    repack, packed_block = pm._repack, pm.packed_block
    prune_input, head = pv._prune_input, pv._head

    def repack_marked(*args, **kwargs):
        marks.mark("pack")
        out = repack(*args, **kwargs)
        marks.mark("late")  # the next block; a following stage or the head marks itself
        return out

    def block_marked(block, *args, **kwargs):
        marks.mark("late")
        out = packed_block(block, *args, **kwargs)
        if block is last_block:
            marks.mark("head")
        return out

    def prune_input_marked(*args, **kwargs):
        marks.mark("pack")
        return prune_input(*args, **kwargs)

    def head_marked(*args, **kwargs):
        marks.mark("head")
        return head(*args, **kwargs)

    pm._repack, pm.packed_block = repack_marked, block_marked
    pv._prune_input, pv._head = prune_input_marked, head_marked
    try:
        yield marks
    finally:
        pm._repack, pm.packed_block = repack, packed_block
        del pv._prune_input, pv._head  # the class's methods again


def stage_breakdown(
    pv: PrunedViT, calls: list, device: torch.device, iters: int = 20, warmup: int = 2
) -> dict[str, Spread]:
    """Median and spread per region (and ``total``, their sum per forward) over ``iters`` instrumented forwards,
    each started on an idle device; ``calls`` are zero-argument forwards of ``pv`` (rotated)."""
    samples: dict[str, list[float]] = {r: [] for r in (*REGIONS, "total")}
    with stage_timer(pv, device) as marks, gc_off():
        for i in range(warmup + iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks.start()
            calls[i % len(calls)]()
            spent = marks.stop()
            if i >= warmup:
                for region in REGIONS:
                    samples[region].append(spent[region])
                samples["total"].append(sum(spent.values()))
    return {region: summarize(values) for region, values in samples.items()}
