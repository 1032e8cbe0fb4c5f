"""Tests of ``ragged_vit.reference.attention``: ragged vs padded vs per-sequence SDPA, timm's qkv layout, strides,
isolation.

Tolerance rule: the references upcast their inputs exactly (fp16/bf16 -> fp32 loses nothing) and compute in
fp32, so the only error is fp32 rounding in two matmuls and a softmax with unit-scale logits (~1e-6). They are
compared against ``F.scaled_dot_product_attention`` in fp64 on the *same upcast inputs*, whatever the input
dtype, with ``atol = rtol = 1e-5`` (``FP32_TOL``); fp64 inputs stay fp64 and get ``atol = rtol = 1e-10``.
Two fp32 formulations that only reorder sums are compared with the same ``FP32_TOL``. Bitwise (``torch.equal``)
is asserted only where the computation for the compared rows is identical by construction (isolation).
"""

from __future__ import annotations

import pytest
import timm.layers
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_vit.core.segments import cu_seqlens_from_counts, seqlens, uniform_cu_seqlens
from ragged_vit.reference.attention import padded_attention, ragged_attention, split_qkv
from ragged_vit.reference.packing import pack, unpack

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# One batch that mixes odd lengths around block sizes (63/64/65), ViT grids (197, 577) and tiny images.
MIXED = [1, 2, 63, 64, 65, 97, 138, 197, 577]
LENGTHS = {"mixed": MIXED, "single_token": [1], "dense197": [197, 197, 197], "one577": [577]}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return FP64_TOL if dtype == torch.float64 else FP32_TOL


def random_qkv(
    gen: torch.Generator, total: int, heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))


def shuffled_cu(gen: torch.Generator, lengths: list[int]) -> torch.Tensor:
    """Offsets of ``lengths`` in a seeded random order, so long and short images sit at varied offsets."""
    lens = torch.tensor(lengths)[torch.randperm(len(lengths), generator=gen)]
    return cu_seqlens_from_counts(lens)


def sdpa_fp64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Per-sequence ``F.scaled_dot_product_attention`` in fp64 on packed ``[T, H, D]`` -> ``[T, H, D]`` fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def to_padded_heads(t: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``[T, H, D]`` -> padded ``[B, H, L, D]`` (zeros at padding) and its validity mask ``[B, L]``."""
    total, heads, head_dim = t.shape
    padded, mask = unpack(t.reshape(total, heads * head_dim), cu_seqlens)
    return padded.unflatten(2, (heads, head_dim)).transpose(1, 2), mask


def padded_via_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Runs :func:`padded_attention` on the padded view of a packed batch and packs its valid rows back."""
    (qp, mask), (kp, _), (vp, _) = (to_padded_heads(t, cu_seqlens) for t in (q, k, v))
    out = padded_attention(qp, kp, vp, key_padding_mask=mask, scale=scale)  # [B, H, L, D]
    return out.transpose(1, 2)[mask]


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_equals_padded_equals_sdpa(
    gen: torch.Generator, dtype: torch.dtype, heads: int, head_dim: int, lengths: list[int]
) -> None:
    cu = shuffled_cu(gen, lengths)
    q, k, v = random_qkv(gen, int(cu[-1]), heads, head_dim, dtype)
    want = sdpa_fp64(q, k, v, cu)

    ragged = ragged_attention(q, k, v, cu)
    padded = padded_via_packed(q, k, v, cu)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert ragged.dtype == out_dtype and padded.dtype == out_dtype
    assert ragged.shape == q.shape and padded.shape == q.shape
    torch.testing.assert_close(ragged.double(), want, **tolerance(dtype))
    torch.testing.assert_close(padded.double(), want, **tolerance(dtype))
    torch.testing.assert_close(ragged, padded, **tolerance(dtype))


@pytest.mark.parametrize("batch, length", [(1, 1), (2, 65), (3, 197)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_padded_without_mask_is_dense_sdpa(gen: torch.Generator, dtype: torch.dtype, batch: int, length: int) -> None:
    q, k, v = (torch.randn(batch, 3, length, 32, generator=gen).to(dtype) for _ in range(3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(padded_attention(q, k, v).double(), want, **FP32_TOL)


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_custom_scale_is_honoured(gen: torch.Generator, dtype: torch.dtype, scale: float) -> None:
    cu = shuffled_cu(gen, [1, 64, 97, 138])
    q, k, v = random_qkv(gen, int(cu[-1]), 2, 32, dtype)
    want = sdpa_fp64(q, k, v, cu, scale=scale)
    ragged = ragged_attention(q, k, v, cu, scale=scale)
    torch.testing.assert_close(ragged.double(), want, **FP32_TOL)
    torch.testing.assert_close(padded_via_packed(q, k, v, cu, scale=scale).double(), want, **FP32_TOL)
    # The scale must actually change the result (D ** -0.5 ~ 0.177 differs from every scale above).
    default = ragged_attention(q, k, v, cu)
    assert (default - ragged).abs().max() > 1e-3


@pytest.mark.parametrize("head_dim", [8, 32, 64])
def test_default_scale_is_inverse_sqrt_head_dim(gen: torch.Generator, head_dim: int) -> None:
    cu = shuffled_cu(gen, [1, 65, 197])
    q, k, v = random_qkv(gen, int(cu[-1]), 3, head_dim, torch.float32)
    explicit = ragged_attention(q, k, v, cu, scale=head_dim**-0.5)
    assert torch.equal(ragged_attention(q, k, v, cu), explicit)  # same float, same computation: bitwise
    assert torch.equal(padded_via_packed(q, k, v, cu), padded_via_packed(q, k, v, cu, scale=head_dim**-0.5))
    torch.testing.assert_close(explicit.double(), sdpa_fp64(q, k, v, cu), **FP32_TOL)  # SDPA default: 1/sqrt(D)


def test_key_bias_log_size_equals_repeated_keys(gen: torch.Generator) -> None:
    # Proportional attention (ToMe): a key of size s with bias log(s) weighs as s copies of that key would.
    lens, sizes = torch.tensor([3, 1, 5]), torch.tensor([1, 2, 3, 4, 1, 1, 5, 2, 1])
    cu = cu_seqlens_from_counts(lens)
    q, k, v = random_qkv(gen, int(lens.sum()), 2, 16, torch.float64)
    out = ragged_attention(q, k, v, cu, key_bias=sizes.double().log())
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        reps = sizes[start:end]
        ks, vs = (t[start:end].repeat_interleave(reps, 0) for t in (k, v))
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q[start:end], ks) * 16**-0.5, dim=-1)
        expected = torch.einsum("hqk,khd->qhd", probs, vs)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="key_bias"):
        ragged_attention(q, k, v, cu, key_bias=sizes.double()[:-1])


def test_zero_length_images_are_skipped(gen: torch.Generator) -> None:
    # Repeated offsets (empty images, as CUDA-graph buckets produce) must not change any other image's rows.
    lens = torch.tensor([0, 65, 0, 0, 1, 97, 0])
    cu = cu_seqlens_from_counts(lens)
    q, k, v = random_qkv(gen, int(lens.sum()), 2, 16, torch.float32)
    compact = cu_seqlens_from_counts(lens[lens > 0])
    assert torch.equal(ragged_attention(q, k, v, cu), ragged_attention(q, k, v, compact))


@pytest.mark.parametrize("length", [1, 65, 197])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_split_qkv_matches_timm_layout(gen: torch.Generator, length: int, heads: int, head_dim: int) -> None:
    batch, dim = 2, heads * head_dim
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # timm's init draws globally
    attn = timm.layers.Attention(dim, num_heads=heads, qkv_bias=True).eval()
    x = torch.randn(batch, length, dim, generator=gen)
    with torch.no_grad():
        qkv = attn.qkv(x)  # [B, N, 3*H*D]
    timm_q, timm_k, timm_v = qkv.reshape(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    packed = qkv.reshape(batch * length, 3 * dim)  # a dense batch is the packed layout with equal lengths
    q, k, v = split_qkv(packed, heads)
    for ours, theirs in ((q, timm_q), (k, timm_k), (v, timm_v)):
        assert ours.shape == (batch * length, heads, head_dim)
        assert torch.equal(ours.view(batch, length, heads, head_dim).transpose(1, 2), theirs)
        assert ours.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()  # a view, no copy


@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "manual_attn"])
@pytest.mark.parametrize("length", [1, 65, 197])
@pytest.mark.parametrize("heads, head_dim", [(1, 32), (3, 64)])
def test_ragged_matches_timm_attention_before_proj(
    gen: torch.Generator, heads: int, head_dim: int, length: int, fused: bool
) -> None:
    batch, dim = 3, heads * head_dim
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    attn = timm.layers.Attention(dim, num_heads=heads, qkv_bias=True).eval()
    attn.fused_attn = fused
    captured: list[torch.Tensor] = []
    attn.proj.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    x = torch.randn(batch, length, dim, generator=gen)
    with torch.no_grad():
        attn(x)
        qkv = attn.qkv(x).reshape(batch * length, 3 * dim)
    (timm_out,) = captured  # [B, N, H*D]: timm's attention output right before proj (norm is Identity)

    ours = ragged_attention(*split_qkv(qkv, heads), uniform_cu_seqlens(batch, length))  # [T, H, D]
    # Both sides are fp32 with ~1e-6 error each: FP32_TOL.
    torch.testing.assert_close(ours.reshape(batch, length, dim), timm_out, **FP32_TOL)


def strided_views(
    gen: torch.Generator, total: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-contiguous ``[T, H, D]`` views of three kinds of storage."""
    if layout == "split_qkv":
        return split_qkv(torch.randn(total, 3 * heads * head_dim, generator=gen).to(dtype), heads)
    if layout == "head_major":  # [H, T, D] storage seen as [T, H, D]
        return tuple(torch.randn(heads, total, head_dim, generator=gen).to(dtype).transpose(0, 1) for _ in range(3))
    if layout == "every_other_channel":  # inner stride 2
        return tuple(torch.randn(total, heads, 2 * head_dim, generator=gen).to(dtype)[..., ::2] for _ in range(3))
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["split_qkv", "head_major", "every_other_channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_strided_inputs_match_contiguous(gen: torch.Generator, dtype: torch.dtype, layout: str) -> None:
    cu = shuffled_cu(gen, [1, 63, 65, 197])
    q, k, v = strided_views(gen, int(cu[-1]), 3, 32, dtype, layout)
    # For dtype == float32 the split_qkv views are non-contiguous (the upcast copies bf16 ones anyway).
    if dtype == torch.float32:
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    # Same math on the same values; BLAS may pick a stride-dependent kernel, so allow last-bit differences.
    close = {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(ragged_attention(q, k, v, cu), ragged_attention(qc, kc, vc, cu), **close)

    # padded_attention on transposed storage: [B, L, H, D] memory seen as [B, H, L, D].
    (qp, mask), (kp, _), (vp, _) = (to_padded_heads(t, cu) for t in (qc, kc, vc))
    q_t, k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qp, kp, vp))
    assert not q_t.is_contiguous()
    torch.testing.assert_close(padded_attention(q_t, k_t, v_t, mask), padded_attention(qp, kp, vp, mask), **close)


@pytest.mark.parametrize("j", [0, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_ragged_isolation(gen: torch.Generator, dtype: torch.dtype, j: int) -> None:
    lens = [1, 64, 97, 2, 65, 138]
    cu = cu_seqlens_from_counts(torch.tensor(lens))
    q, k, v = random_qkv(gen, int(cu[-1]), 2, 32, dtype)
    rows = slice(int(cu[j]), int(cu[j + 1]))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[rows] = torch.randn(t[rows].shape, generator=gen).to(dtype)
    a = ragged_attention(q, k, v, cu)
    b = ragged_attention(q2, k2, v2, cu)
    assert not torch.equal(a[rows], b[rows])
    for i in range(len(lens)):
        if i != j:
            own = slice(int(cu[i]), int(cu[i + 1]))
            assert torch.equal(a[own], b[own])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    n=st.integers(1, 600),
    rate=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    heads=st.integers(1, 2),
    head_dim=st.integers(8, 16),
)
def test_hypothesis_ragged_vs_padded(seed: int, batch: int, n: int, rate: float, heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, 3 * heads * head_dim, generator=gen)  # a qkv projection output [B, N, 3*H*D]
    keep = torch.rand(batch, n, generator=gen) < rate
    keep[:, 0] = True
    tokens, cu, max_seqlen = pack(x, keep)
    q, k, v = split_qkv(tokens, heads)
    ragged = ragged_attention(q, k, v, cu)

    padded, mask = unpack(tokens, cu)  # [B, L, 3*H*D]
    assert padded.shape[1] == max_seqlen
    qp, kp, vp = (t.transpose(1, 2) for t in padded.unflatten(2, (3, heads, head_dim)).unbind(2))
    out = padded_attention(qp, kp, vp, key_padding_mask=mask).transpose(1, 2)[mask]  # [T, H, D]
    # Both fp32, sums in different orders: FP32_TOL.
    torch.testing.assert_close(ragged, out, **FP32_TOL)
    assert torch.equal(seqlens(cu), keep.sum(1))
