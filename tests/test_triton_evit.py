"""ragged_vit.triton_impl.evit (and the CLS-attention kernels under it, ragged_vit.triton_impl.cls_attention) against
ragged_vit.reference.pruners.EViTPruner.

Tolerance rules: the kernel's scores (mean over heads of the CLS query's softmax row) agree with the reference's
``cls_attention(...).mean(-1)`` to fp32 rounding (``rtol = 1e-5``, ``atol = 1e-7``; flat, well-separated and random
scores). The selection on given scores is exact (``tests/test_triton_select.py``), so the decisions follow the
conformance lab's near-tie rule (:mod:`ragged_vit.testing.decision`, ``exact=False``): bit for bit on equal scores,
at most ``max(2, T // 500)`` rows apart on random inputs, the fused token within one rounding of its dtype.

The fused-token kernel alone (:func:`ragged_vit.triton_impl.evit.fused_token`) against a float64 sum over the dropped
patch rows (the module's rule): in its accumulator (fp32, fp64 for fp64 rows) within ``L * u * sum |score * x|``,
``L = ceil(patches / 128) + 128`` roundings per term (plus the float64 sum's own ``patches * 2**-53``), then one
rounding to the rows' dtype (``u_dtype * |exact|``, half a subnormal step near zero); bit for bit the exact sum
rounded to the dtype on dyadic inputs (every partial sum exact in any order); bit for bit run to run, replayed from a
CUDA graph as eager, and per image whatever the other images hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragged_vit.core.rotary import Rotary
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import attention_inputs, cls_attention
from ragged_vit.reference.pruners import EViTPruner
from ragged_vit.reference.rotary import table_from_angles
from ragged_vit.testing import decision_suite
from ragged_vit.triton_impl import cls_attention as cls_kernels
from ragged_vit.triton_impl import evit, select
from tests.helpers import levels, one_per_family, rotated, sync_free


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
# Quick (CPU and GPU): each case once, the pruners and dtypes in turn; full: every case for each pruner in each dtype.
test_select_conforms_interpreter = pytest.mark.interpreter(
    one_per_family(decision_suite(evit.evit_select, PRUNERS, exact=False, bad_inputs=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip
test_select_conforms_gpu = pytest.mark.gpu(
    one_per_family(decision_suite(evit.evit_select, PRUNERS, device="cuda", level_name="full", exact=False,
                                  channels=768, capturable=True),
                   lambda pruner, case: (case.kind, case.num_prefix), lambda pruner, case: (id(pruner), case.dtype))
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["flat", "separated", "random"])
@pytest.mark.parametrize("lengths", [(17, 17, 17), (17, 3, 1, 9, 0)], ids=["uniform", "ragged"])
def test_scores_match_the_reference_interpreter(lengths, kind, gen):
    qkv, cu = _case(lengths, 2, 16, "cpu", gen, kind=kind)
    torch.testing.assert_close(
        cls_kernels.cls_attention_mean(qkv, cu, 2, 0.25, 17), _reference_scores(qkv, cu, 2), rtol=1e-5, atol=1e-7
    )


@pytest.mark.interpreter
def test_scores_write_every_row_of_every_image_interpreter(gen, monkeypatch):
    """No zero-fill before the mean kernel: on NaN-poisoned buffers every row of every image is written, the rows
    of an image past ``max_seqlen`` (the tile) with 0, and an empty image costs nothing."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
    qkv, cu = _case((17, 0, 40, 5), 2, 16, "cpu", gen)
    scores = cls_kernels.cls_attention_mean(qkv, cu, 2, 0.25, 17)  # the 40-row image: rows 16 on past the tile
    assert not bool(scores.isnan().any())
    ref = _reference_scores(qkv, cu, 2)
    long = slice(int(cu[2]), int(cu[3]))  # scored on the tile's 32 rows (17 rounded up), the rest 0
    others = torch.ones_like(scores, dtype=torch.bool)
    others[long] = False
    torch.testing.assert_close(scores[others], ref[others], rtol=1e-5, atol=1e-7)
    assert bool((scores[long][:32] > 0).all()) and bool((scores[long][32:] == 0).all())


def _rotation(cu, heads, head_dim, half, per_head, gen):
    """A RoPE rotation of the rows of ``cu``: each image's first row (the class token) and its last (a fused token)
    unrotated, a row outside the table, the rest patches in order."""
    rows = 48
    shape = (heads, rows, head_dim // 2) if per_head else (rows, head_dim // 2)
    table = table_from_angles(torch.rand(shape, generator=gen) * 6.3, half)
    positions = torch.cat([torch.arange(int(n)) - 1 for n in cu.diff()]).to(torch.int32)
    positions[cu[1:].long() - 1] = -1
    positions[len(positions) // 2] = rows + 3
    return Rotary(table, positions, half)


def _rotated_scores(device, head_dim, half, per_head, dtype, gen):
    """With ``rotary`` the kernels rotate the CLS query and the keys as the attention kernel does (pairs of lanes,
    padded halves at head dim 40): EViT's scores equal the reference's (:func:`ragged_vit.reference.cls_attention.
    attention_inputs` on the same rotation) to fp32 rounding, ATS's squared values are the unrotated ones (to fp32
    rounding: the rotary variant may sum a row's squares in another order), and the rotation changes the scores (the
    check can fail)."""
    heads = 3
    qkv, cu = _case((17, 3, 1, 9, 0, 12), heads, head_dim, device, gen, dtype)
    rotary, scale = _rotation(cu.cpu(), heads, head_dim, half, per_head, gen), head_dim**-0.5
    rotary = Rotary(rotary.table.to(device), rotary.positions.to(device), half)
    inp = dataclasses.replace(_inp(qkv, cu, heads, 16), rotary=rotary)
    expected = attention_inputs(inp)[0].mean(-1)
    scores = cls_kernels.cls_attention_mean(qkv, cu, heads, scale, 17, rotary)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(scores, cls_kernels.cls_attention_mean(qkv, cu, heads, scale, 17), rtol=1e-3)
    _, squares = cls_kernels.cls_attention_logits(qkv, cu, heads, scale, 17, values=True, rotary=rotary)
    _, plain = cls_kernels.cls_attention_logits(qkv, cu, heads, scale, 17, values=True)
    torch.testing.assert_close(squares, plain, rtol=1e-5, atol=1e-7)


ROTATIONS = pytest.mark.parametrize("half,per_head", [(False, False), (True, True)], ids=["interleaved", "half-heads"])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@ROTATIONS
@pytest.mark.parametrize("head_dim", [16, 40])
def test_rotated_scores_match_the_reference_interpreter(head_dim, half, per_head, dtype, gen):
    _rotated_scores("cpu", head_dim, half, per_head, dtype, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@ROTATIONS
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotated_scores_match_the_reference_gpu(head_dim, half, per_head, dtype, gen):
    _rotated_scores("cuda", head_dim, half, per_head, dtype, gen)


GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_SHAPES = ((1, 197), (64, 197), (16, 577))


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each shape once, the dtypes in turn
    "shape,dtype", rotated([(s, d) for s in GPU_SHAPES for d in GPU_DTYPES], lambda s, d: s, lambda s, d: (d,),
                           ids=lambda s, d: f"{s[0]}x{s[1]}-{str(d)[6:]}"),
)  # fmt: skip
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


# --- the fused token alone (evit.fused_token) ------------------------------------------------------------------------
# Adversarial lengths around the kernel's 128-row tile (129, 130: a second tile of one or two patches), empty images.
TOKEN_LENGTHS = (1, 2, 0, 63, 64, 65, 129, 130, 197, 0)


def _token_case(lengths, channels, dtype, device, gen, num_prefix=1, kind="random"):
    """Rows, fp32 scores, a keep mask dropping about half the patches (prefix rows kept) and offsets. ``dyadic``:
    scores in 1/64 steps and small integer rows, so that every partial sum of the token is exact."""
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = int(cu[-1])
    if kind == "dyadic":
        x = torch.randint(-8, 9, (total, channels), generator=gen).float()
        scores = torch.randint(0, 65, (total,), generator=gen).float() / 64
    else:
        x = torch.randn(total, channels, generator=gen)
        scores = torch.rand(total, generator=gen)
    keep = torch.rand(total, generator=gen) < 0.5
    for start in cu[:-1].tolist():
        keep[start : start + num_prefix] = True
    return x.to(device, dtype), scores.to(device), keep.to(device), cu.to(device)


def _exact(x, scores, keep, cu, num_prefix):
    """float64 ``[B, C]``: each image's sum over its dropped patch rows, the sum of the terms' magnitudes, and the
    patches ``[B]`` of each image."""
    x64, s64, keep, bounds = x.double().cpu(), scores.double().cpu(), keep.cpu(), cu.tolist()
    batch, channels = len(bounds) - 1, x.shape[1]
    sums = torch.zeros(batch, channels, dtype=torch.float64)
    magnitudes = torch.zeros(batch, channels, dtype=torch.float64)
    patches = torch.zeros(batch, dtype=torch.float64)
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        first = min(start + num_prefix, end)
        rows = first + torch.nonzero(~keep[first:end]).flatten()
        terms = s64[rows, None] * x64[rows]
        sums[b], magnitudes[b], patches[b] = terms.sum(0), terms.abs().sum(0), end - first
    return sums, magnitudes, patches


def _check_token(x, scores, keep, cu, num_prefix, kind):
    """The module's rule on random inputs; bit for bit the exact sum rounded to x's dtype on dyadic ones."""
    got = evit.fused_token(x, scores, keep, cu, num_prefix=num_prefix)
    exact, magnitudes, patches = _exact(x, scores, keep, cu, num_prefix)
    assert got.dtype == x.dtype and got.shape == exact.shape and got.device == x.device
    if kind == "dyadic":
        assert torch.equal(got.cpu(), exact.to(x.dtype)), (got.cpu() - exact.to(x.dtype)).abs().max()
        return
    acc = torch.promote_types(x.dtype, torch.float32)
    roundings = torch.ceil(patches / evit._BLOCK_T) + evit._BLOCK_T
    allowed = (roundings * torch.finfo(acc).eps / 2 + patches * 2.0**-53)[:, None] * magnitudes
    if x.dtype != acc:  # one more rounding, to x's dtype
        info = torch.finfo(x.dtype)
        allowed = info.eps / 2 * exact.abs() + 2 * allowed + info.smallest_normal * info.eps / 2
    over = (got.double().cpu() - exact).abs() - allowed
    assert bool((over <= 0).all()), f"{over.max().item():.3g} over the rule"


TOKEN_DTYPES, TOKEN_CHANNELS = (torch.float32, torch.float16), (8, 72)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "num_prefix,dtype,channels",
    levels([(n, d, c) for n in (0, 1, 2) for d in TOKEN_DTYPES for c in TOKEN_CHANNELS],
           lambda n, d, c: (d, c) == (TOKEN_DTYPES[n % 2], TOKEN_CHANNELS[n % 2 if n < 2 else 1]),
           ids=lambda n, d, c: f"p{n}-{str(d)[6:]}-c{c}"),
)  # fmt: skip
def test_fused_token_matches_float64_interpreter(num_prefix, dtype, channels, gen):
    """Quick: each prefix count once, the dtypes and widths in turn."""
    for kind in ("random", "dyadic"):
        _check_token(*_token_case(TOKEN_LENGTHS, channels, dtype, "cpu", gen, num_prefix, kind), num_prefix, kind)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["random", "dyadic"])
def test_fused_token_float64_rows_interpreter(kind, gen):
    _check_token(*_token_case(TOKEN_LENGTHS, 40, torch.float64, "cpu", gen, 1, kind), 1, kind)


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each width once, the dtypes and prefix counts in turn
    "num_prefix,dtype,channels",
    rotated([(n, d, c) for n in (0, 1, 2) for d in GPU_DTYPES for c in (64, 72, 200, 768)], lambda n, d, c: c,
            lambda n, d, c: (d, n), ids=lambda n, d, c: f"p{n}-{str(d)[6:]}-c{c}"),
)  # fmt: skip
def test_fused_token_matches_float64_gpu(num_prefix, dtype, channels, gen):
    ragged = tuple(torch.randint(0, 198, (64,), generator=gen).tolist())
    for lengths in (TOKEN_LENGTHS, (197,), (197,) * 4, ragged, (577,) * 16):
        for kind in ("random", "dyadic"):
            _check_token(*_token_case(lengths, channels, dtype, "cuda", gen, num_prefix, kind), num_prefix, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "dyadic"])
def test_fused_token_float64_rows_gpu(kind, gen):
    _check_token(*_token_case(TOKEN_LENGTHS, 200, torch.float64, "cuda", gen, 1, kind), 1, kind)


def _reads_dropped_patches_only(device, gen, channels):
    """NaN in every kept row (x and score) and in the prefix rows, which are also marked dropped: nothing changes, bit
    for bit; an image that drops nothing (all kept, empty, prefix rows only) gets zeros; strided rows read alike."""
    lengths = (65, 0, 2, 130, 1, 40)
    x, scores, keep, cu = _token_case(lengths, channels, torch.float16, device, gen, num_prefix=2)
    keep[cu[3] : cu[4]] = True  # the 130-row image drops nothing
    want = evit.fused_token(x, scores, keep, cu, num_prefix=2)
    prefix = torch.zeros_like(keep)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        prefix[start : min(start + 2, end)] = True
    poisoned_x, poisoned_scores = x.clone(), scores.clone()
    poisoned_x[keep | prefix] = float("nan")
    poisoned_scores[keep | prefix] = float("nan")
    wide = torch.full((x.shape[0], channels + 24), float("nan"), dtype=x.dtype, device=device)
    wide[:, 8 : 8 + channels] = poisoned_x
    for rows in (poisoned_x, wide[:, 8 : 8 + channels]):
        got = evit.fused_token(rows, poisoned_scores, keep & ~prefix, cu, num_prefix=2)
        assert torch.equal(got, want)
    nothing = torch.tensor([False, True, True, True, True, False], device=device)  # images 1, 2, 3, 4
    assert bool((want[nothing] == 0).all()) and bool((want[~nothing] != 0).any())


@pytest.mark.interpreter
def test_fused_token_reads_dropped_patches_only_interpreter(gen):
    _reads_dropped_patches_only("cpu", gen, 40)


@pytest.mark.gpu
def test_fused_token_reads_dropped_patches_only_gpu(gen):
    _reads_dropped_patches_only("cuda", gen, 768)


def _isolated(device, gen, channels, dtype):
    """Changing the middle image's rows, scores and mask changes no other image's token, bit for bit; an image's
    token is the same bits alone as in any batch."""
    lengths = (197, 130, 65)
    x, scores, keep, cu = _token_case(lengths, channels, dtype, device, gen)
    got = evit.fused_token(x, scores, keep, cu)
    start, end = int(cu[1]), int(cu[2])
    x2, scores2, keep2 = x.clone(), scores.clone(), keep.clone()
    x2[start:end] = torch.randn(end - start, channels, generator=gen).to(x)
    scores2[start:end] = torch.rand(end - start, generator=gen).to(scores)
    keep2[start + 1 : end] = ~keep2[start + 1 : end]
    again = evit.fused_token(x2, scores2, keep2, cu)
    assert torch.equal(again[[0, 2]], got[[0, 2]]) and not torch.equal(again[1], got[1])
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = cu_seqlens_from_counts(torch.tensor([lengths[b]])).to(device)
        assert torch.equal(evit.fused_token(x[rows], scores[rows], keep[rows], alone)[0], got[b])


@pytest.mark.interpreter
def test_fused_token_isolation_interpreter(gen):
    _isolated("cpu", gen, 40, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_token_isolation_gpu(dtype, gen):
    _isolated("cuda", gen, 768, dtype)


def _poisoned_output(device, gen, channels, dtype):
    """Every element of a NaN-filled ``out`` is overwritten, with the same bits as a fresh call, run after run."""
    x, scores, keep, cu = _token_case((197, 0, 1, 150, 65), channels, dtype, device, gen)
    want = evit.fused_token(x, scores, keep, cu)
    out = torch.full_like(want, float("nan"))
    assert evit.fused_token_unchecked(x, scores, keep, cu, 1, out) is out
    assert torch.equal(out, want) and torch.equal(evit.fused_token(x, scores, keep, cu), want)
    return x, scores, keep, cu, want


@pytest.mark.interpreter
def test_fused_token_overwrites_poisoned_output_interpreter(gen):
    _poisoned_output("cpu", gen, 40, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_token_overwrites_poisoned_output_and_replays_gpu(dtype, gen):
    """And without a device-to-host sync, captured in a CUDA graph and replayed over a poisoned output: the eager
    bits."""
    x, scores, keep, cu, want = _poisoned_output("cuda", gen, 768, dtype)
    with sync_free():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            token = evit.fused_token(x, scores, keep, cu)
    token.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(token, want)


def _bad_token_calls():
    x, s, keep, cu = torch.randn(10, 8), torch.rand(10), torch.ones(10, dtype=torch.bool), torch.tensor([0, 4, 10])
    cu = cu.int()
    return [
        (lambda: evit.fused_token(x.numpy(), s, keep, cu), "x"),
        (lambda: evit.fused_token(x[:, 0], s, keep, cu), "x"),
        (lambda: evit.fused_token(x.int(), s, keep, cu), "x"),
        (lambda: evit.fused_token(x[:, :0], s, keep, cu), "x"),
        (lambda: evit.fused_token(x, s.half(), keep, cu), "scores"),
        (lambda: evit.fused_token(x, s[:9], keep, cu), "scores"),
        (lambda: evit.fused_token(x, torch.rand(20)[::2], keep, cu), "scores"),
        (lambda: evit.fused_token(x, s, keep.int(), cu), "keep"),
        (lambda: evit.fused_token(x, s, keep[:, None], cu), "keep"),
        (lambda: evit.fused_token(x, s, torch.ones(20, dtype=torch.bool)[::2], cu), "keep"),
        (lambda: evit.fused_token(x, s, keep, cu.long()), "cu_seqlens"),
        (lambda: evit.fused_token(x, s, keep, torch.tensor([0, 4, 9], dtype=torch.int32)), "cu_seqlens"),
        (lambda: evit.fused_token(x, s, keep, cu, num_prefix=-1), "num_prefix"),
        (lambda: evit.fused_token(x, s, keep, cu, num_prefix=True), "num_prefix"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_token_calls())))
def test_fused_token_bad_input_raises_before_launch(index, forbid_launch):
    forbid_launch(evit, "_fused_token_launcher")
    call, word = _bad_token_calls()[index]
    with pytest.raises((ValueError, TypeError), match=word):
        call()
