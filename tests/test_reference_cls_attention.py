"""Tests of ``ragged_vit.reference.cls_attention``: the CLS query's attention row per image and head, on the packed
layout.

Tolerance rule: ``cls_attention`` upcasts its inputs exactly and computes in fp32 (fp64 stays fp64); it is
compared with row 0 of the dense per-image ``softmax(q k^T * scale)`` computed in fp64 from the same upcast
inputs, with ``atol = rtol = 1e-5`` for fp32 math (``FP32_TOL``: probabilities <= 1, fp32 rounding ~1e-7) and
``atol = rtol = 1e-10`` for fp64 inputs. Per-head sums are checked against 1 with the same tolerances.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.cls_attention import cls_attention

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LENGTHS = {"mixed": [1, 2, 63, 64, 65, 97, 138, 197, 577], "single_token": [1], "dense197": [197, 197]}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return FP64_TOL if dtype == torch.float64 else FP32_TOL


def random_qk(
    gen: torch.Generator, total: int, heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))


def dense_row0(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Row 0 of each image's full fp64 attention matrix, laid out packed: ``[T, H]``."""
    out = torch.empty(q.shape[:2], dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            qs, ks = (t[start:end].double().transpose(0, 1) for t in (q, k))  # [H, L, D]
            probs = torch.softmax(qs @ ks.transpose(-1, -2) * scale, dim=-1)  # [H, L, L]
            out[start:end] = probs[:, 0, :].transpose(0, 1)
    return out


def per_image_sums(probs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` -> ``[B, H]`` sums over each image's rows (fp64)."""
    bounds = cu_seqlens.tolist()
    return torch.stack([probs[s:e].double().sum(0) for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cls_attention_is_row0_of_dense_softmax(
    gen: torch.Generator, dtype: torch.dtype, heads: int, head_dim: int, lengths: list[int]
) -> None:
    lens = torch.tensor(lengths)[torch.randperm(len(lengths), generator=gen)]
    cu = cu_seqlens_from_counts(lens)
    q, k = random_qk(gen, int(cu[-1]), heads, head_dim, dtype)
    got = cls_attention(q, k, cu)
    assert got.shape == (int(cu[-1]), heads)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), dense_row0(q, k, cu, head_dim**-0.5), **tolerance(dtype))
    sums = per_image_sums(got, cu)
    torch.testing.assert_close(sums, torch.ones_like(sums), **tolerance(dtype))


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
def test_cls_attention_custom_scale(gen: torch.Generator, scale: float) -> None:
    cu = cu_seqlens_from_counts(torch.tensor([65, 1, 197]))
    q, k = random_qk(gen, int(cu[-1]), 2, 32, torch.float32)
    got = cls_attention(q, k, cu, scale=scale)
    torch.testing.assert_close(got.double(), dense_row0(q, k, cu, scale), **FP32_TOL)
    assert (got - cls_attention(q, k, cu)).abs().max() > 1e-4  # the scale is not ignored


def test_cls_attention_zero_length_images(gen: torch.Generator) -> None:
    # Empty images (repeated offsets) own no rows and must not disturb the others.
    lens = torch.tensor([0, 65, 0, 1, 97, 0])
    cu = cu_seqlens_from_counts(lens)
    q, k = random_qk(gen, int(lens.sum()), 2, 16, torch.float32)
    got = cls_attention(q, k, cu)
    torch.testing.assert_close(got, cls_attention(q, k, cu_seqlens_from_counts(lens[lens > 0])), atol=0, rtol=0)
    torch.testing.assert_close(got.double(), dense_row0(q, k, cu, 16**-0.5), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cls_attention_strided_inputs(gen: torch.Generator, dtype: torch.dtype) -> None:
    cu = cu_seqlens_from_counts(torch.tensor([1, 63, 197, 65]))
    qkv = torch.randn(int(cu[-1]), 3 * 3 * 32, generator=gen).to(dtype)
    q, k, _ = split_qkv(qkv, 3)  # non-contiguous views into the qkv buffer
    got = cls_attention(q, k, cu)
    # Same values, same math; only the memory layout differs: equal up to last-bit BLAS/vectorisation effects.
    torch.testing.assert_close(got, cls_attention(q.contiguous(), k.contiguous(), cu), atol=1e-7, rtol=1e-6)
    head_major = (torch.randn(3, int(cu[-1]), 32, generator=gen).to(dtype) for _ in range(2))
    q_t, k_t = (t.transpose(0, 1) for t in head_major)
    torch.testing.assert_close(
        cls_attention(q_t, k_t, cu), cls_attention(q_t.contiguous(), k_t.contiguous(), cu), atol=1e-7, rtol=1e-6
    )


@pytest.mark.parametrize("j", [0, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_cls_attention_isolation(gen: torch.Generator, dtype: torch.dtype, j: int) -> None:
    lens = [97, 1, 64, 65, 2, 138]
    cu = cu_seqlens_from_counts(torch.tensor(lens))
    q, k = random_qk(gen, int(cu[-1]), 3, 32, dtype)
    rows = slice(int(cu[j]), int(cu[j + 1]))
    q2, k2 = q.clone(), k.clone()
    for t in (q2, k2):
        t[rows] = torch.randn(t[rows].shape, generator=gen).to(dtype)
    a, b = cls_attention(q, k, cu), cls_attention(q2, k2, cu)
    for i in range(len(lens)):
        if i != j:
            own = slice(int(cu[i]), int(cu[i + 1]))
            assert torch.equal(a[own], b[own])  # bitwise: no value of image j enters image i's row
