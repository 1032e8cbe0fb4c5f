"""The decision half of ``docs/porting.md``'s worked example: a deliberately simple port of Threshold-L2's ratio
decision passes the lab, and deliberately broken ones are caught with a report that says what is wrong.

The port is what a porter might write first: the pruner's own scores, then ``torch.sort`` one image at a time.
"""

from __future__ import annotations

import math

import pytest
import torch

from ragged_vit.core.selection import DecisionInput, TokenSelection
from ragged_vit.reference.pruners import ThresholdL2Pruner
from ragged_vit.reference.pruners.threshold_l2 import l2_scores
from ragged_vit.testing import ConformanceError, check_decision, decision_suite


def top_rate_per_image(pruner: ThresholdL2Pruner, inp: DecisionInput, *, later_ties=False, count=math.ceil):
    """The port: keep each image's prefix rows and its ``ceil(rate * patches)`` best patches (at least one without a
    prefix), ties to the earlier row and NaN first, as ``torch.sort(descending=True, stable=True)`` orders them."""
    scores, prefix = l2_scores(inp.x), inp.num_prefix
    keep = torch.zeros(inp.x.shape[0], dtype=torch.bool, device=inp.x.device)
    bounds = inp.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        first = min(start + prefix, end)
        keep[start:first] = True
        patches = scores[first:end]
        k = max(count(pruner.rate * patches.numel()), inp.min_patches) if patches.numel() else 0
        if later_ties:  # broken: equal scores go to the later row
            order = patches.numel() - 1 - patches.flip(0).sort(descending=True, stable=True).indices[:k]
        else:
            order = patches.sort(descending=True, stable=True).indices[:k]
        keep[first + order] = True
    kept = torch.tensor([int(keep[s:e].sum()) for s, e in zip(bounds[:-1], bounds[1:], strict=True)], dtype=torch.int32)
    length = inp.uniform_rows  # rows per image of a uniform batch, else None
    count_after = None if length is None else prefix + pruner.count_after(inp.stage, length - prefix, inp.num_patches)
    return TokenSelection(keep, kept.to(keep.device), fixed_count=count_after is not None, count=count_after)


# The port's whole test file: the lab's cases for each pruner it implements, every case a test item.
test_top_rate_per_image = decision_suite(
    top_rate_per_image, {f"rate{r}": ThresholdL2Pruner("ratio", rate=r, min_keep=0) for r in (0.5, 0.3, 1.0)}
)


def later_ties(pruner, inp):
    """Broken: equal scores go to the later row."""
    return top_rate_per_image(pruner, inp, later_ties=True)


def floor_count(pruner, inp):
    """Broken: ``floor(rate * patches)`` patches, one fewer than the pruner keeps wherever the product is not whole."""
    return top_rate_per_image(pruner, inp, count=math.floor)


def int64_counts(pruner, inp):
    """Broken: kept counts as int64 (the repack reads int32)."""
    sel = top_rate_per_image(pruner, inp)
    return TokenSelection(sel.keep, sel.kept.long(), sel.fixed_count, sel.count)


@pytest.mark.parametrize(
    "port,case,says",
    [
        (later_ties, "ties[33-65-9]-p1", "keep is the pruner's"),
        (floor_count, "ragged", "keep is the pruner's"),
        (int64_counts, "lengths", "kept is a contiguous int32 [B]"),
    ],
)
def test_the_lab_catches_broken_decisions(port, case, says):
    with pytest.raises(ConformanceError) as caught:
        check_decision(ThresholdL2Pruner("ratio", rate=0.5, min_keep=0), port)
    report = str(caught.value)
    assert report.startswith("decision (ThresholdL2Pruner(mode='ratio'"), report
    assert any(f.case.startswith(case) and says in f.rule for f in caught.value.failures), report
