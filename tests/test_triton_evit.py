"""ragged_vit.triton_impl.evit (and the CLS-attention kernels under it, ragged_vit.triton_impl.cls_attention) against
ragged_vit.reference.pruners.EViTPruner.

Tolerance rules: the kernel's scores (mean over heads of the CLS query's softmax row) agree with the reference's
``cls_attention(...).mean(-1)`` to fp32 rounding (``rtol = 1e-5``, ``atol = 1e-7``; flat, well-separated and random
scores). The selection on given scores is exact (``tests/test_triton_select.py``), so the decisions follow the
conformance lab's near-tie rule (:mod:`ragged_vit.testing.decision`, ``exact=False``): bit for bit on equal scores,
at most ``max(2, T // 500)`` rows apart on random inputs, the fused token within one rounding of its dtype.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.pruners import EViTPruner
from ragged_vit.testing import decision_suite
from ragged_vit.triton_impl import cls_attention as cls_kernels
from ragged_vit.triton_impl import evit, select


def _case(lengths, heads, head_dim, device, gen, dtype=torch.float32, kind="random"):
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = int(cu[-1])
    qkv = torch.randn(total, 3 * heads * head_dim, generator=gen)
    if kind == "flat":  # zero queries: every logit 0, every score equal: ties everywhere
        qkv[:, : heads * head_dim] = 0.0
    elif kind == "separated":  # keys along the query with well-separated integer weights: distinct scores
        qkv[:, : heads * head_dim] = 0.0
        qkv[cu[:-1].long().clamp(max=max(total - 1, 0)), :heads * head_dim] = 1.0
        weights = torch.randperm(total, generator=gen).float() / total * 8.0
        qkv[:, heads * head_dim : 2 * heads * head_dim] = weights[:, None]
    return qkv.to(device, dtype), cu.to(device)


def _inp(qkv, cu, heads, num_patches, num_prefix=1):
    x = qkv[:, : qkv.shape[1] // 3]
    scale = (qkv.shape[1] // (3 * heads)) ** -0.5
    return DecisionInput(x, cu, 0, num_patches, None, qkv, heads, scale, num_prefix=num_prefix)


def _reference_scores(qkv, cu, heads):
    q, k, _ = split_qkv(qkv.float(), heads)
    return cls_attention(q, k, cu, (qkv.shape[1] // (3 * heads)) ** -0.5).mean(-1)


# The conformance lab's decision cases (ragged_vit.testing.decision), near-tie rule (the scores are fp32 sums in the
# kernel's order), with and without the fused token; on a GPU at DeiT-B's width (12 heads of 64).
PRUNERS = {
    "rate0.7": EViTPruner(rate=0.7),
    "rate0.5-fused": EViTPruner(rate=0.5, fuse_token=True),
    "rate1.0-fused": EViTPruner(rate=1.0, fuse_token=True),
}
test_select_conforms_interpreter = pytest.mark.interpreter(
    decision_suite(evit.evit_select, PRUNERS, exact=False, bad_inputs=True)
)
test_select_conforms_gpu = pytest.mark.gpu(
    decision_suite(evit.evit_select, PRUNERS, device="cuda", level_name="full", exact=False, channels=768,
                   capturable=True)
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["flat", "separated", "random"])
@pytest.mark.parametrize("lengths", [(17, 17, 17), (17, 3, 1, 9, 0)], ids=["uniform", "ragged"])
def test_scores_match_the_reference_interpreter(lengths, kind, gen):
    qkv, cu = _case(lengths, 2, 16, "cpu", gen, kind=kind)
    torch.testing.assert_close(
        cls_kernels.cls_attention_mean(qkv, cu, 2, 0.25, 17), _reference_scores(qkv, cu, 2), rtol=1e-5, atol=1e-7
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 197), (64, 197), (16, 577)])
def test_scores_match_the_reference_gpu(shape, dtype, gen):
    batch, n = shape
    heads, head_dim = 12, 64
    for kind in ("flat", "separated", "random"):
        lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
        for lens in (lengths, [n] * batch):
            qkv, cu = _case(lens, heads, head_dim, "cuda", gen, dtype, kind)
            scores = cls_kernels.cls_attention_mean(qkv, cu, heads, head_dim**-0.5, n)
            torch.testing.assert_close(scores, _reference_scores(qkv, cu, heads), rtol=2e-5, atol=1e-7)


def test_bad_input_raises_before_launch(forbid_launch):
    forbid_launch(cls_kernels, "_logits_launcher", "_mean_launcher")
    forbid_launch(select, "_launcher")
    qkv, cu = torch.randn(10, 48), torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = [
        (lambda: evit.evit_select(object(), _inp(qkv, cu, 2, 9)), "pruner"),
        (lambda: evit.evit_select(EViTPruner(), DecisionInput(qkv, cu, 0, 9, cls_attn=qkv[:, :2])), "inp.qkv"),
        (lambda: evit.evit_select(EViTPruner(), _inp(qkv, cu, 5, 9)), "num_heads"),
        (lambda: evit.evit_select(EViTPruner(), _inp(qkv, cu, 2, 9, num_prefix=0)), "num_prefix"),
    ]
    for call, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            call()
