"""Tests of ``ragged_vit.reference.packing``: pack, unpack, repack and cls_rows on the varlen layout.

Packing only moves values (gather/scatter), so every comparison here is bitwise (``torch.equal``): no
tolerance applies. Inputs are seeded per test case through the ``gen`` fixture (hypothesis tests draw a seed).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_vit.core.segments import cu_seqlens_from_counts, seqlens
from ragged_vit.reference.packing import cls_rows, pack, repack, unpack

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (B, N): a single image, odd ViT lengths (197 = 14*14+1, 577 = 24*24+1), a one-token batch.
SHAPES = [(1, 1), (1, 197), (3, 65), (4, 197), (2, 577), (5, 1)]
KEEP_RATES = [0.0, 0.3, 0.7, 1.0]  # 0.0: only the CLS token survives


def random_keep(gen: torch.Generator, batch: int, n: int, rate: float) -> torch.Tensor:
    """A bool keep mask ``[B, N]`` keeping each token with probability ``rate``, CLS (column 0) always."""
    keep = torch.rand(batch, n, generator=gen) < rate
    keep[:, 0] = True
    return keep


def random_tokens(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def random_packed_keep(gen: torch.Generator, cu_seqlens: torch.Tensor, rate: float) -> torch.Tensor:
    """A bool keep mask ``[T]`` over packed rows that keeps the first row (CLS) of every non-empty image."""
    total = int(cu_seqlens[-1])
    keep = torch.rand(total, generator=gen) < rate
    starts = cu_seqlens[:-1].long()[seqlens(cu_seqlens) > 0]
    keep[starts] = True
    return keep


@pytest.mark.parametrize("rate", KEEP_RATES)
@pytest.mark.parametrize("batch, n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unpack_round_trip(gen: torch.Generator, dtype: torch.dtype, batch: int, n: int, rate: float) -> None:
    x = random_tokens(gen, (batch, n, 24), dtype)
    keep = random_keep(gen, batch, n, rate)
    tokens, cu, max_seqlen = pack(x, keep)

    counts = keep.sum(1)
    assert tokens.dtype == dtype and tokens.shape == (int(counts.sum()), 24)
    assert cu.dtype == torch.int32 and cu.shape == (batch + 1,)
    assert int(cu[0]) == 0
    assert torch.equal(seqlens(cu), counts)
    assert isinstance(max_seqlen, int) and max_seqlen == int(counts.max())
    # CLS rows land at cu_seqlens[b].
    assert torch.equal(tokens[cu[:-1].long()], x[:, 0])

    padded, mask = unpack(tokens, cu)
    assert padded.shape == (batch, max_seqlen, 24) and padded.dtype == dtype
    assert torch.equal(mask.sum(1), counts)
    restored = torch.zeros_like(x)
    restored[keep] = padded[mask]
    assert torch.equal(restored, torch.where(keep[..., None], x, torch.zeros_like(x)))
    assert bool((padded[~mask] == 0).all())


@pytest.mark.parametrize("batch, n", SHAPES)
def test_pack_keeps_original_order(gen: torch.Generator, batch: int, n: int) -> None:
    # Each token carries its own position (exact in fp32): within an image the packed positions must be the
    # kept positions, ascending.
    positions = torch.arange(n, dtype=torch.float32).expand(batch, n)[..., None]  # [B, N, 1]
    keep = random_keep(gen, batch, n, 0.5)
    tokens, cu, _ = pack(positions, keep)
    for b in range(batch):
        got = tokens[int(cu[b]) : int(cu[b + 1]), 0].long()
        assert torch.equal(got, keep[b].nonzero().flatten())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_is_identity_on_a_full_mask(gen: torch.Generator, dtype: torch.dtype) -> None:
    x = random_tokens(gen, (3, 197, 16), dtype)
    tokens, cu, max_seqlen = pack(x, torch.ones(3, 197, dtype=torch.bool))
    assert torch.equal(tokens, x.reshape(-1, 16))
    assert cu.tolist() == [0, 197, 394, 591] and max_seqlen == 197


@pytest.mark.parametrize("extra", [0, 1, 40])
@pytest.mark.parametrize("fill", [0.0, -3.5, float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_pads_with_fill(gen: torch.Generator, dtype: torch.dtype, fill: float, extra: int) -> None:
    x = random_tokens(gen, (4, 65, 8), dtype)
    keep = random_keep(gen, 4, 65, 0.5)
    tokens, cu, max_seqlen = pack(x, keep)
    padded, mask = unpack(tokens, cu, max_seqlen=max_seqlen + extra, fill=fill)
    assert padded.shape == (4, max_seqlen + extra, 8)
    assert torch.equal(mask, torch.arange(max_seqlen + extra)[None, :] < seqlens(cu)[:, None])
    assert torch.equal(padded[mask], tokens)
    pad = padded[~mask].float()
    expected = torch.full_like(pad, fill)
    assert torch.equal(pad.isnan(), expected.isnan())
    assert torch.equal(pad.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("batch, n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cls_rows(gen: torch.Generator, dtype: torch.dtype, batch: int, n: int) -> None:
    x = random_tokens(gen, (batch, n, 12), dtype)
    tokens, cu, _ = pack(x, random_keep(gen, batch, n, 0.4))
    rows = cls_rows(tokens, cu)
    assert rows.shape == (batch, 12)
    assert torch.equal(rows, x[:, 0])


@pytest.mark.parametrize("rate2", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("rate1", [0.3, 1.0])
@pytest.mark.parametrize("batch, n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repack_equals_pack_with_composed_mask(
    gen: torch.Generator, dtype: torch.dtype, batch: int, n: int, rate1: float, rate2: float
) -> None:
    x = random_tokens(gen, (batch, n, 16), dtype)
    m1 = random_keep(gen, batch, n, rate1)
    tokens, cu, _ = pack(x, m1)
    keep2 = random_packed_keep(gen, cu, rate2)
    m2 = torch.zeros_like(m1)
    m2[m1] = keep2  # keep2 lifted back to the padded grid: the second stage's verdict on each original token

    got = repack(tokens, cu, keep2)
    want = pack(x, m1 & m2)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert got[2] == want[2]


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("batch, n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repack_appends_extra_token(gen: torch.Generator, dtype: torch.dtype, batch: int, n: int, rate: float) -> None:
    x = random_tokens(gen, (batch, n, 16), dtype)
    tokens, cu, _ = pack(x, random_keep(gen, batch, n, 0.6))
    keep = random_packed_keep(gen, cu, rate)
    extra = random_tokens(gen, (batch, 16), dtype)

    plain, plain_cu, plain_max = repack(tokens, cu, keep)
    out, out_cu, out_max = repack(tokens, cu, keep, extra_token=extra)
    assert out.dtype == dtype and out_cu.dtype == torch.int32
    assert torch.equal(seqlens(out_cu), seqlens(plain_cu) + 1)
    assert out_max == plain_max + 1
    assert out.shape == (plain.shape[0] + batch, 16)
    for b in range(batch):
        start, end = int(out_cu[b]), int(out_cu[b + 1])
        assert torch.equal(out[start : end - 1], plain[int(plain_cu[b]) : int(plain_cu[b + 1])])
        assert torch.equal(out[end - 1], extra[b])


# Zero-length images (repeated offsets) are how CUDA-graph buckets pad a batch up to a fixed size.
ZERO_LENGTH_CASES = [[0, 3, 0, 5, 0, 0, 2], [0], [0, 0, 4], [7, 0], [1, 0, 1]]


@pytest.mark.parametrize("extra", [False, True], ids=["plain", "extra_token"])
@pytest.mark.parametrize("lengths", ZERO_LENGTH_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repack_zero_length_images(gen: torch.Generator, dtype: torch.dtype, lengths: list[int], extra: bool) -> None:
    lens = torch.tensor(lengths)
    cu = cu_seqlens_from_counts(lens)
    tokens = random_tokens(gen, (int(lens.sum()), 8), dtype)
    keep = random_packed_keep(gen, cu, 0.5)
    extra_token = random_tokens(gen, (len(lengths), 8), dtype) if extra else None

    out, out_cu, out_max = repack(tokens, cu, keep, extra_token=extra_token)
    kept = torch.zeros(len(lengths), dtype=torch.long)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        kept[b] = int(keep[start:end].sum())
    new_lens = kept + 1 if extra else kept
    assert torch.equal(seqlens(out_cu), new_lens)
    assert out_max == int(new_lens.max())
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        rows = out[int(out_cu[b]) : int(out_cu[b + 1])]
        want = tokens[start:end][keep[start:end]]
        if extra:
            want = torch.cat([want, extra_token[b : b + 1]])  # an empty image gets just its extra token
        assert torch.equal(rows, want)


@pytest.mark.parametrize("lengths", ZERO_LENGTH_CASES, ids=str)
def test_unpack_zero_length_images(gen: torch.Generator, lengths: list[int]) -> None:
    lens = torch.tensor(lengths)
    cu = cu_seqlens_from_counts(lens)
    tokens = random_tokens(gen, (int(lens.sum()), 4), torch.float32)
    padded, mask = unpack(tokens, cu, max_seqlen=int(lens.max()) + 1, fill=-1.0)
    assert torch.equal(mask.sum(1), lens)
    assert torch.equal(padded[mask], tokens)
    assert bool((padded[~mask] == -1.0).all())


@pytest.mark.parametrize("change_mask", [False, True], ids=["values", "values_and_mask"])
@pytest.mark.parametrize("j", [0, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_isolation(gen: torch.Generator, dtype: torch.dtype, j: int, change_mask: bool) -> None:
    batch, n = 5, 97
    x = random_tokens(gen, (batch, n, 16), dtype)
    keep = random_keep(gen, batch, n, 0.5)
    x2, keep2 = x.clone(), keep.clone()
    x2[j] = random_tokens(gen, (n, 16), dtype)
    if change_mask:
        keep2[j] = random_keep(gen, 1, n, 0.5)[0]
    a, cu_a, _ = pack(x, keep)
    b, cu_b, _ = pack(x2, keep2)
    for i in range(batch):
        if i != j:
            assert torch.equal(a[int(cu_a[i]) : int(cu_a[i + 1])], b[int(cu_b[i]) : int(cu_b[i + 1])])


@pytest.mark.parametrize("change_mask", [False, True], ids=["values", "values_and_mask"])
@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repack_isolation(gen: torch.Generator, dtype: torch.dtype, j: int, change_mask: bool) -> None:
    lens = torch.tensor([40, 1, 65, 12])
    cu = cu_seqlens_from_counts(lens)
    tokens = random_tokens(gen, (int(lens.sum()), 16), dtype)
    keep = random_packed_keep(gen, cu, 0.5)
    extra = random_tokens(gen, (4, 16), dtype)
    rows = slice(int(cu[j]), int(cu[j + 1]))
    tokens2, keep2, extra2 = tokens.clone(), keep.clone(), extra.clone()
    tokens2[rows] = random_tokens(gen, (int(lens[j]), 16), dtype)
    extra2[j] = random_tokens(gen, (16,), dtype)
    if change_mask:
        keep2[rows] = torch.rand(int(lens[j]), generator=gen) < 0.5
        keep2[int(cu[j])] = True
    for extra_a, extra_b in ((None, None), (extra, extra2)):
        a, cu_a, _ = repack(tokens, cu, keep, extra_token=extra_a)
        b, cu_b, _ = repack(tokens2, cu, keep2, extra_token=extra_b)
        for i in range(4):
            if i != j:
                assert torch.equal(a[int(cu_a[i]) : int(cu_a[i + 1])], b[int(cu_b[i]) : int(cu_b[i + 1])])


@st.composite
def packing_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """A random batch ``x [B, N, C]`` (B in 1..6, N in 1..600) and a keep mask that keeps CLS."""
    batch = draw(st.integers(1, 6))
    n = draw(st.integers(1, 600))
    rate = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = random_tokens(gen, (batch, n, 4), dtype)
    return x, random_keep(gen, batch, n, rate), gen


@settings(max_examples=25, deadline=None)
@given(case=packing_cases(), rate2=st.sampled_from([0.0, 0.5, 1.0]), with_extra=st.booleans())
def test_hypothesis_pack_unpack_repack(
    case: tuple[torch.Tensor, torch.Tensor, torch.Generator], rate2: float, with_extra: bool
) -> None:
    x, keep, gen = case
    tokens, cu, max_seqlen = pack(x, keep)
    assert max_seqlen == int(keep.sum(1).max())
    assert torch.equal(cls_rows(tokens, cu), x[:, 0])

    padded, mask = unpack(tokens, cu)
    restored = torch.zeros_like(x)
    restored[keep] = padded[mask]
    assert torch.equal(restored[keep], x[keep])

    keep2 = random_packed_keep(gen, cu, rate2)
    m2 = torch.zeros_like(keep)
    m2[keep] = keep2
    got, got_cu, got_max = repack(tokens, cu, keep2)
    want, want_cu, want_max = pack(x, keep & m2)
    assert torch.equal(got, want) and torch.equal(got_cu, want_cu) and got_max == want_max

    if with_extra:
        extra = random_tokens(gen, (x.shape[0], x.shape[2]), x.dtype)
        out, out_cu, out_max = repack(tokens, cu, keep2, extra_token=extra)
        assert torch.equal(seqlens(out_cu), seqlens(want_cu) + 1) and out_max == want_max + 1
        assert torch.equal(out[out_cu[1:].long() - 1], extra)
        body = torch.ones(out.shape[0], dtype=torch.bool)
        body[out_cu[1:].long() - 1] = False
        assert torch.equal(out[body], want)
