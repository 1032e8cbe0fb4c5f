"""The forward plan (:mod:`ragged_vit.pipelines.plan`): steps, stages, host knowledge of counts, segments.

Pure host logic: exact comparisons. The plan is built once per pipeline and both executors read it
(``test_pipelines.py`` runs the eager one, ``test_graphs.py`` the graph one, against each other).
"""

from __future__ import annotations

import pytest
from timm.models.vision_transformer import VisionTransformer

from ragged_vit import PrunedViT
from ragged_vit.core.selection import Placement
from ragged_vit.pipelines.plan import Counts, Step, StepKind, build_plan
from ragged_vit.reference.pruners import make_pruner

F, B, A, M, D, R, H = (StepKind.FRONT, StepKind.BLOCKS, StepKind.ATTENTION, StepKind.MLP, StepKind.DECIDE,
                       StepKind.REPACK, StepKind.HEAD)  # fmt: skip


def steps(plan) -> list[tuple]:
    return [(s.kind, s.stage if s.kind in (D, R) else s.blocks) for s in plan.steps]


def stage(index: int) -> list[tuple]:
    return [(D, index), (R, index)]


@pytest.mark.parametrize(
    "pruner,expected",
    [
        (None, [(F, tuple(range(12))), (H, ())]),
        (
            make_pruner("threshold_l2", mode="ratio", rate=0.5, block=3),
            [(F, (0, 1, 2, 3)), *stage(0), (B, tuple(range(4, 12))), (H, ())],
        ),
        (
            make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(3, 6, 9)),
            [(F, (0, 1, 2)), *stage(0), (B, (3, 4, 5)), *stage(1), (B, (6, 7, 8)), *stage(2), (B, (9, 10, 11)),
             (H, ())],  # fmt: skip
        ),
        (
            make_pruner("evit", rate=0.6, blocks=(3, 6, 9)),
            [(F, (0, 1, 2)), (A, (3,)), *stage(0), (M, (3,)), (B, (4, 5)), (A, (6,)), *stage(1), (M, (6,)),
             (B, (7, 8)), (A, (9,)), *stage(2), (M, (9,)), (B, (10, 11)), (H, ())],
        ),  # fmt: skip
        (make_pruner("threshold_l2", mode="ratio", rate=0.5, block=11), [(F, tuple(range(12))), *stage(0), (H, ())]),
    ],
    ids=["none", "threshold", "dynamicvit", "evit", "after-last-block"],
)
def test_steps_group_stage_free_blocks(pruner, expected):
    """Runs of consecutive stage-free blocks form one step (one compiled region with ``compile_blocks``)."""
    plan = build_plan(pruner, 12, 197)
    assert steps(plan) == expected
    assert plan == PrunedViT(VisionTransformer(img_size=224, depth=12, embed_dim=64, num_heads=2), pruner).plan


@pytest.mark.parametrize("blocks", [(0,), (2, 3), (1, 5, 11), tuple(range(12))])
@pytest.mark.parametrize("placement", ["before_block", "mid_block", "after_block"])
def test_every_block_runs_once_in_order_and_every_stage_decides_then_repacks(blocks, placement):
    pruner = make_pruner("ats", blocks=blocks)
    pruner.placement = placement
    plan = build_plan(pruner, 12, 197)
    halves, decided = [], []
    for step in plan.steps:
        if step.kind in (F, B):
            halves += [(kind, k) for k in step.blocks for kind in ("attention", "mlp")]
        elif step.kind in (A, M):
            halves.append((step.kind.value, *step.blocks))
        elif step.kind in (D, R):
            decided.append((step.kind, step.stage))
    assert halves == [(kind, k) for k in range(12) for kind in ("attention", "mlp")]
    assert decided == [pair for s in range(len(blocks)) for pair in stage(s)]
    assert plan.steps[0].kind is F and plan.steps[-1].kind is H
    assert [s.block for s in plan.stages] == list(blocks)
    assert all(s.placement is Placement(placement) for s in plan.stages)
    assert [s.mlp_beside for s in plan.stages] == [b if placement == "mid_block" else None for b in blocks]


@pytest.mark.parametrize(
    "name,kwargs,counts",
    [
        ("dynamicvit", {"embed_dim": 192, "rate": 0.7}, (138, 97, 68)),  # golden 137/96/67 patches + CLS
        ("evit", {"rate": 0.7, "fuse_token": True}, (140, 100, 72)),  # golden 139/99/71 + CLS
        ("evit", {"rate": 0.7}, (139, 98, 69)),
        ("threshold_l2", {"mode": "ratio", "rate": 0.7}, (139,)),
    ],
)
def test_fixed_count_pruners_are_one_segment(name, kwargs, counts):
    plan = build_plan(make_pruner(name, **kwargs), 12, 197)
    assert plan.fixed and plan.segments == (plan.steps,)
    assert tuple(s.rows_after for s in plan.stages) == counts
    assert all(s.counts is Counts.FIXED for s in plan.stages)
    assert tuple(s.rows_before for s in plan.stages) == (197, *counts[:-1])


@pytest.mark.parametrize(
    "name,kwargs,beside",
    [
        ("evit", {"rate": 0.7}, (3, 6, 9)),
        ("evit", {"rate": 0.7, "fuse_token": True}, (None, None, None)),  # the fused token must go through the MLP
        ("tome", {"r": 8}, (None,) * 12),  # a merge averages rows
        ("dynamicvit", {"embed_dim": 192, "rate": 0.7}, (None, None, None)),  # between blocks: no MLP half follows
    ],
)
def test_the_mlp_half_runs_beside_a_decision_only_where_it_commutes_with_the_repack(name, kwargs, beside):
    """The stage objects say whether their repack commutes with the MLP half after it; the plan records it."""
    model = VisionTransformer(img_size=224, depth=12, embed_dim=192, num_heads=2)
    assert tuple(s.mlp_beside for s in PrunedViT(model, make_pruner(name, **kwargs)).plan.stages) == beside


def test_unpruned_model_is_one_segment():
    plan = build_plan(None, 12, 197)
    assert plan.fixed and plan.stages == () and plan.dense_blocks == 12 and plan.row_bounds == (197,)


def test_ats_cuts_before_every_repack():
    plan = build_plan(make_pruner("ats"), 12, 197)
    assert not plan.fixed and plan.dense_blocks == 3 and len(plan.segments) == 10
    assert plan.segments[0] == (Step(F, (0, 1, 2)), Step(A, (3,)), Step(D, stage=0))
    for j in range(1, 9):
        assert plan.segments[j] == (Step(R, stage=j - 1), Step(M, (2 + j,)), Step(A, (3 + j,)), Step(D, stage=j))
    assert plan.segments[9] == (Step(R, stage=8), Step(M, (11,)), Step(H))
    assert sum(plan.segments, ()) == plan.steps


def test_row_bounds_and_counts_follow_the_pruner():
    """Bounds on an image's rows per segment: ATS keeps at most its samples (+ CLS) or its floor; no bound for
    Threshold-L2's threshold mode."""
    ats = build_plan(make_pruner("ats", num_samples=98), 12, 197)
    assert ats.row_bounds == (197, *[99] * 9) and {s.counts for s in ats.stages} == {Counts.BOUNDED}
    assert build_plan(make_pruner("ats", num_samples=4, min_keep=8), 12, 197).row_bounds == (197, *[9] * 9)
    every = build_plan(make_pruner("ats"), 12, 197)  # 196 samples: no bound
    assert every.row_bounds == (197,) * 10 and {s.counts for s in every.stages} == {Counts.VARIABLE}
    threshold = build_plan(make_pruner("threshold_l2", threshold=1.0), 12, 197)
    assert threshold.row_bounds == (197, 197) and threshold.stages[0].counts is Counts.VARIABLE


def test_threshold_after_block_3_cuts_once():
    plan = build_plan(make_pruner("threshold_l2", threshold=1.0), 12, 197)
    assert plan.dense_blocks == 4
    assert plan.segments == ((Step(F, (0, 1, 2, 3)), Step(D, stage=0)), (Step(R, stage=0), Step(B, tuple(range(4, 12))),
                                                                          Step(H)))  # fmt: skip


def test_variable_before_block_stages_and_a_last_block_stage():
    pruner = make_pruner("dynamicvit", embed_dim=64, blocks=(3, 6, 9))
    pruner.fixed_count = False  # as if its counts were decided on the device
    plan = build_plan(pruner, 12, 197)
    assert [tuple(s.kind for s in seg) for seg in plan.segments] == [(F, D), (R, B, D), (R, B, D), (R, B, H)]
    last = build_plan(make_pruner("threshold_l2", threshold=1.0, block=11), 12, 197)
    assert last.dense_blocks == 12 and last.segments == ((Step(F, tuple(range(12))), Step(D, stage=0)),
                                                         (Step(R, stage=0), Step(H)))  # fmt: skip


def test_stage_at_names_the_stage_of_a_step():
    plan = build_plan(make_pruner("evit", rate=0.6, blocks=(3, 6, 9)), 12, 197)
    assert plan.stage_at(Step(R, stage=2)) is plan.stages[2]
    with pytest.raises(ValueError, match="serves no stage"):
        plan.stage_at(Step(H))
