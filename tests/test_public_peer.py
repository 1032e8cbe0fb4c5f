"""benchmarks.public_peer: the public-API pruned forward equals the reference pipeline on the same decisions."""

from __future__ import annotations

import pytest
import torch

from benchmarks.public_peer import PublicPrunedViT, dense_plan
from ragged_vit import PrunedViT
from ragged_vit.core.selection import TokenSelection
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import tiny_images, tiny_pipeline

PRUNERS = {
    "threshold_l2_ratio": (lambda: make_pruner("threshold_l2", mode="ratio", rate=0.5, block=1), True),
    "dynamicvit": (lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 3)), True),
    "evit": (lambda: make_pruner("evit", rate=0.6, blocks=(1, 3)), True),
    "ats": (lambda: make_pruner("ats", blocks=(1, 2, 3, 4, 5), num_samples=12, min_keep=2), False),
    "threshold_l2_calibrated": (
        lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, min_keep=1, block=1),
        False,
    ),
}


def _pipeline(factory) -> PrunedViT:
    pv = tiny_pipeline(factory).eval()
    if getattr(pv.pruner, "mode", None) == "calibrated":
        pv.calibrate(tiny_images(8, 9))
    return pv


@pytest.mark.parametrize("name", list(PRUNERS))
def test_public_peer_matches_the_pipeline_on_its_decisions(name):
    factory, gather = PRUNERS[name]
    pv = _pipeline(factory)
    images = tiny_images(4, 3)
    with torch.no_grad():
        ref = pv.run(images)
        plan = dense_plan(ref.selections, 4, 17, gather)
        logits = PublicPrunedViT(pv.model, pv.pruner, gather)(images, *plan)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    if not gather:  # the key masks keep exactly the counted patches (and CLS)
        assert torch.equal(torch.stack([m.sum(1) - 1 for m in plan], 1), ref.counts)
    if name == "ats":
        assert len(set(ref.counts[:, -1].tolist())) > 1, "the images should keep different counts"


def test_dense_plan_refuses_what_it_cannot_express():
    keep = torch.tensor([True, True, False, True, True, True])
    kept = torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="extra token"):
        dense_plan([TokenSelection(keep, kept, True, 2, extra_token=torch.zeros(2, 4))], 2, 3, True)
    with pytest.raises(ValueError, match="different counts"):
        dense_plan([TokenSelection(keep, kept)], 2, 3, True)
    with pytest.raises(ValueError, match="rows"):
        dense_plan([TokenSelection(keep, kept)], 2, 4, False)
    with pytest.raises(ValueError, match="none"):
        dense_plan([], 2, 3, False)
