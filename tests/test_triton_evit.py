"""ragged_vit.triton_impl.evit (and the CLS-attention kernels under it, ragged_vit.triton_impl.cls_attention) against
ragged_vit.reference.pruners.EViTPruner.

Tolerance rules: the kernel's scores (mean over heads of the CLS query's softmax row) agree with the reference's
``cls_attention(...).mean(-1)`` to fp32 rounding (``rtol = 1e-5``, ``atol = 1e-7``). The selection on given scores
is exact (``tests/test_triton_select.py``), so the keep masks are equal wherever no two scores at an image's cut differ
by rounding only: bit for bit on inputs without such near-ties (all-equal scores: every tie goes to the earlier row;
well-separated scores), and at most ``max(2, T / 500)`` rows apart on random inputs. The fused token, when the masks
agree: within one rounding of its dtype of the reference's (``rtol = atol / max|ref| = eps``; fp32 sums of
weights that differ in their last bits, then cast).
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.pruners import EViTPruner
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


def _compare(pruner, inp, exact):
    ref, got = pruner(inp), evit.evit_select(pruner, inp)
    assert (got.fixed_count, got.count) == (ref.fixed_count, ref.count)
    differ = int((got.keep != ref.keep).sum())
    assert differ == 0 if exact else differ <= max(2, got.keep.shape[0] // 500), differ
    assert torch.equal(got.kept.long().cpu(), ref.kept.long().cpu()) or not exact
    if ref.extra_token is not None and differ == 0:
        eps = max(torch.finfo(ref.extra_token.dtype).eps, 1e-5)
        scale = ref.extra_token.float().abs().max().item()
        torch.testing.assert_close(got.extra_token.float(), ref.extra_token.float(), rtol=eps, atol=eps * scale)
    return got


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths", [(17, 17, 17), (17, 3, 1, 9, 0)], ids=["uniform", "ragged"])
def test_scores_match_the_reference_interpreter(lengths, gen):
    qkv, cu = _case(lengths, 2, 16, "cpu", gen)
    got = cls_kernels.cls_attention_mean(qkv, cu, 2, 0.25, 17)
    torch.testing.assert_close(got, _reference_scores(qkv, cu, 2) if 0.25 == 16**-0.5 else got, rtol=1e-5, atol=1e-7)


@pytest.mark.interpreter
@pytest.mark.parametrize("fuse_token", [False, True])
@pytest.mark.parametrize("num_prefix", [1, 5])
@pytest.mark.parametrize("kind", ["flat", "separated", "random"])
@pytest.mark.parametrize("lengths", [(17, 17, 17), (17, 6, 1, 9)], ids=["uniform", "ragged"])
def test_select_matches_pruner_interpreter(lengths, kind, num_prefix, fuse_token, gen):
    qkv, cu = _case(lengths, 2, 16, "cpu", gen, kind=kind)
    torch.testing.assert_close(
        cls_kernels.cls_attention_mean(qkv, cu, 2, 0.25, 17), _reference_scores(qkv, cu, 2), rtol=1e-5, atol=1e-7
    )
    for rate in (0.5, 0.7, 1.0):
        _compare(EViTPruner(rate=rate, fuse_token=fuse_token), _inp(qkv, cu, 2, 17 - num_prefix, num_prefix),
                 exact=kind != "random")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 197), (64, 197), (16, 577)])
def test_select_matches_pruner_gpu(shape, dtype, gen):
    batch, n = shape
    heads, head_dim = 12, 64
    for kind in ("flat", "separated", "random"):
        lengths = torch.randint(1, n + 1, (batch,), generator=gen).tolist()
        for lens in (lengths, [n] * batch):
            qkv, cu = _case(lens, heads, head_dim, "cuda", gen, dtype, kind)
            scores = cls_kernels.cls_attention_mean(qkv, cu, heads, head_dim**-0.5, n)
            torch.testing.assert_close(scores, _reference_scores(qkv, cu, heads), rtol=2e-5, atol=1e-7)
            exact = kind != "random" and dtype == torch.float32
            for pruner in (EViTPruner(rate=0.7), EViTPruner(rate=0.5, fuse_token=True)):
                _compare(pruner, _inp(qkv, cu, heads, n - 1), exact)


@pytest.mark.gpu
def test_select_is_sync_free_and_capturable_gpu(gen):
    qkv, cu = _case((197, 197, 197), 12, 64, "cuda", gen, torch.float16)
    pruner = EViTPruner(rate=0.7, fuse_token=True)
    inp = _inp(qkv, cu, 12, 196)
    ref = evit.evit_select(pruner, inp)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sel = evit.evit_select(pruner, inp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sel.keep.fill_(False)
    graph.replay()
    assert torch.equal(sel.keep, ref.keep) and torch.equal(sel.kept, ref.kept)
    assert torch.equal(sel.extra_token, ref.extra_token)


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
