"""``validate``'s counting: top-1 and top-5 (top-k with k = min(5, classes)) of the pruned model; with
``--compare-unpruned`` the same for timm's own forward of the same model on the same batches, and the top-1
agreement of the two; the kept patches of every stage. Everything is an integer count (kept sums and sums of squares
too), so results are exact and do not depend on the order in which ranks add them up.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .distributed import Distributed

TOP_K = 5

_SUMS = ("images", "top1", "top5", "unpruned_top1", "unpruned_top5", "top1_agree")
_LOW = -(2**62)


class Tally:
    """Integer counts of one rank (or, after :meth:`all_reduce`, of all ranks): images, correct top-1 and top-5
    (pruned and unpruned), top-1 agreement, and per stage the kept patches' sum, sum of squares, min and max."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.sums = torch.zeros(len(_SUMS) + 2 * stages, dtype=torch.int64)  # the counts, kept sums, kept squares
        self.maxes = torch.full((2 * stages,), _LOW, dtype=torch.int64)  # per stage: max, then -min

    def add(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        counts: torch.Tensor,
        unpruned_logits: torch.Tensor | None = None,
    ) -> None:
        """Adds one batch: ``logits [B, classes]``, ``targets [B]``, kept ``counts [B, stages]`` (and the unpruned
        model's logits of the same images)."""
        targets = targets.to(logits.device)
        k = min(TOP_K, logits.shape[-1])
        top = logits.float().topk(k, dim=-1).indices
        values = [torch.tensor(logits.shape[0], device=logits.device), *_hits(top, targets)]
        if unpruned_logits is not None:
            ref = unpruned_logits.float().topk(k, dim=-1).indices
            values += [*_hits(ref, targets), (ref[:, 0] == top[:, 0]).sum()]
        else:
            values += [torch.zeros((), dtype=torch.int64, device=logits.device)] * 3
        counts = counts.to(device=logits.device, dtype=torch.int64)
        sums = torch.cat([torch.stack(values).long(), counts.sum(0), counts.pow(2).sum(0)])
        maxes = torch.cat([counts.max(0).values, -counts.min(0).values]) if counts.shape[1] else self.maxes[:0]
        sums, maxes = sums.cpu(), maxes.cpu()
        self.sums += sums
        self.maxes = torch.maximum(self.maxes, maxes)

    def all_reduce(self, group: Distributed) -> None:
        """Sums and maxima over all ranks (every rank ends with the totals)."""
        self.sums = group.all_reduce(self.sums, "sum")
        self.maxes = group.all_reduce(self.maxes, "max")

    def count(self, name: str) -> int:
        return int(self.sums[_SUMS.index(name)])

    def kept(self) -> list[dict[str, float | int | None]]:
        """Per stage: mean, population std, min and max of the kept patches (None without images)."""
        n, s = self.count("images"), self.stages
        stats = []
        for i in range(s):
            total, squares = int(self.sums[len(_SUMS) + i]), int(self.sums[len(_SUMS) + s + i])
            if n == 0:
                stats.append({"mean": None, "std": None, "min": None, "max": None})
                continue
            mean = total / n
            variance = max(0.0, (squares * n - total * total) / (n * n))  # exact integers until the division
            stats.append(
                {"mean": mean, "std": math.sqrt(variance), "min": -int(self.maxes[s + i]), "max": int(self.maxes[i])}
            )
        return stats


def _hits(top: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (top[:, 0] == targets).sum(), (top == targets[:, None]).any(dim=-1).sum()

