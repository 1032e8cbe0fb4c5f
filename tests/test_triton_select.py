"""The rank-select kernel (:mod:`ragged_vit.triton_impl.select`) in ``count`` mode against its reference,
:func:`ragged_vit.core.segments.segment_rank`: keep the ``min(count, patches)`` best patches of every image and its
prefix rows. Masks and counts are compared exactly. (``rate`` and ``threshold`` modes: ``test_triton_threshold_l2.py``.)
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts, positions, segment_ids, segment_rank, segment_sum
from ragged_vit.triton_impl import select
from tests.helpers import rotated


def _case(lengths, device, gen, ties=False, nan_rows=0):
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    scores = torch.randn(int(cu[-1]), generator=gen)
    if ties:
        scores = torch.round(scores * 2) / 2
    if nan_rows:
        scores[torch.randperm(scores.shape[0], generator=gen)[:nan_rows]] = float("nan")
    return scores.to(device), cu.to(device)


def _check(scores, cu, count, num_prefix, bound):
    keep, kept = select.rank_keep(scores, cu, bound, count=count, num_prefix=num_prefix)
    total = scores.shape[0]
    ref = (positions(cu, total) < num_prefix) | (segment_rank(scores, cu, num_prefix) < count)
    assert torch.equal(keep.cpu(), ref.cpu()), (count, num_prefix)
    assert torch.equal(kept.long().cpu(), segment_sum(ref.long(), segment_ids(cu, total), cu.numel() - 1).cpu())


SCORES = {"distinct": (False, 0), "ties": (True, 0), "nan": (True, 4)}


@pytest.mark.interpreter
@pytest.mark.parametrize(  # quick: each kind of scores once, the prefix counts in turn
    "num_prefix,ties,nan_rows",
    rotated([(n, *SCORES[k]) for k in SCORES for n in (0, 1, 5)], lambda n, *scores: scores, lambda n, *_: (n,),
            ids=lambda n, *scores: f"{next(k for k, v in SCORES.items() if v == scores)}-p{n}"),
)  # fmt: skip
def test_count_mode_matches_segment_rank_interpreter(num_prefix, ties, nan_rows, gen):
    scores, cu = _case((0, 1, 3, 17, 70, 65), "cpu", gen, ties, nan_rows)
    for count in (0, 1, 7, 64, 100):
        _check(scores, cu, count, num_prefix, 70)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 197), (64, 197), (16, 577)])
def test_count_mode_matches_segment_rank_gpu(shape, gen):
    batch, n = shape
    for ties, nan_rows in ((False, 0), (True, 5)):
        lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
        scores, cu = _case(lengths, "cuda", gen, ties, nan_rows)
        for count, num_prefix in ((137, 1), (67, 1), (96, 5), (1, 0)):
            _check(scores, cu, count, num_prefix, n)


def test_count_must_be_a_non_negative_int(forbid_launch):
    forbid_launch(select, "_launcher")
    scores, cu = torch.rand(10), torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="count must be >= 0"):
        select.rank_keep(scores, cu, 10, count=-1)
    with pytest.raises(ValueError, match="exactly one of rate, count and threshold"):
        select.rank_keep(scores, cu, 10, count=3, rate=0.5)
