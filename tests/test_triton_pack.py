"""triton_impl.pack against reference.packing: packing is a copy, so every comparison is bitwise.

CPU runs use Triton's interpreter (small batches); the ``gpu`` cases run larger batches on a CUDA card.
"""

from __future__ import annotations

import pytest
import torch

import reference
from triton_impl import pack as tp


def _batch(batch, n, channels, dtype, device, gen, rate=0.5):
    x = torch.randn(batch, n, channels, generator=gen).to(device=device, dtype=dtype)
    keep = torch.rand(batch, n, generator=gen) < rate
    keep[:, 0] = True
    return x, keep.to(device)


def _assert_same_pack(got, ref, bound_at_least):
    tokens, cu, bound = got
    assert torch.equal(tokens, ref[0])
    assert torch.equal(cu, ref[1])
    assert bound >= ref[2] and bound >= bound_at_least


def _check_pack_family(x, keep, gen):
    """pack, repack (with and without a fused token), capacity and count modes, unpack, cls_rows."""
    batch, n, channels = x.shape
    ref = reference.pack(x.cpu(), keep.cpu())
    got = tp.pack(x, keep)
    _assert_same_pack((got[0].cpu(), got[1].cpu(), got[2]), ref, ref[2])
    tokens, cu, bound = got

    keep2 = torch.rand(tokens.shape[0], generator=gen) < 0.6
    keep2[ref[1][:-1].long()] = True
    extra = torch.randn(batch, channels, generator=gen).to(x)
    for fused in (None, extra):
        ref2 = reference.repack(ref[0], ref[1], keep2, None if fused is None else fused.cpu())
        got2 = tp.repack(tokens, cu, keep2.to(x.device), bound, extra_token=fused)
        _assert_same_pack((got2[0].cpu(), got2[1].cpu(), got2[2]), ref2, ref2[2])

        # Capacity mode: a larger buffer, the same valid rows and offsets, tail rows untouched by the kernel.
        cap = tp.repack(tokens, cu, keep2.to(x.device), bound, extra_token=fused, capacity=ref2[0].shape[0] + 7)
        assert torch.equal(cap[1].cpu(), ref2[1])
        assert torch.equal(cap[0][: ref2[0].shape[0]].cpu(), ref2[0])

    # Capacity too small: offsets are clamped into the buffer, nothing is written outside it.
    small = tp.repack(tokens, cu, keep2.to(x.device), bound, capacity=3)
    assert small[0].shape[0] == 3 and int(small[1].max()) <= 3

    padded, mask = tp.unpack(tokens, cu, bound + 2, fill=-1.0)
    ref_padded, ref_mask = reference.unpack(ref[0], ref[1], bound + 2, fill=-1.0)
    assert torch.equal(padded.cpu(), ref_padded) and torch.equal(mask.cpu(), ref_mask)
    assert torch.equal(tp.cls_rows(tokens, cu).cpu(), reference.cls_rows(ref[0], ref[1]))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,n,channels", [(1, 5, 8), (3, 70, 96), (2, 197, 192)])
def test_pack_family_matches_reference_interpreter(batch, n, channels, dtype, gen):
    x, keep = _batch(batch, n, channels, dtype, "cpu", gen)
    _check_pack_family(x, keep, gen)


@pytest.mark.interpreter
def test_fixed_count_needs_no_total_interpreter(gen):
    x, _ = _batch(3, 20, 16, torch.float32, "cpu", gen)
    keep = torch.zeros(3, 20, dtype=torch.bool)
    for b in range(3):
        keep[b, torch.randperm(19, generator=gen)[:6] + 1] = True
    keep[:, 0] = True
    got = tp.pack(x, keep, count=7)
    ref = reference.pack(x, keep)
    assert got[2] == 7
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="count"):
        tp.pack(x, keep, count=8)


@pytest.mark.interpreter
def test_pack_isolation_interpreter(gen):
    x, keep = _batch(3, 30, 16, torch.float32, "cpu", gen)
    a = tp.pack(x, keep)
    x2 = x.clone()
    x2[1] = torch.randn(30, 16, generator=gen)
    b = tp.pack(x2, keep)
    cu = a[1].tolist()
    for i in (0, 2):
        assert torch.equal(a[0][cu[i] : cu[i + 1]], b[0][cu[i] : cu[i + 1]])


def _bad_pack_calls():
    x = torch.randn(2, 5, 8)
    keep = torch.ones(2, 5, dtype=torch.bool)
    tokens = torch.randn(10, 8)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    no_cls = keep.clone()
    no_cls[1, 0] = False
    return [
        ("x", lambda: tp.pack(x.long(), keep)),
        ("x", lambda: tp.pack(x[0], keep)),
        ("x", lambda: tp.pack(x[:0], keep[:0])),
        ("x", lambda: tp.pack(x[..., ::2], keep)),
        ("keep", lambda: tp.pack(x, keep.int())),
        ("keep", lambda: tp.pack(x, keep[:, :4])),
        ("keep", lambda: tp.pack(x, no_cls)),
        ("count", lambda: tp.pack(x, keep, count=0)),
        ("count or capacity", lambda: tp.pack(x, keep, count=5, capacity=10)),
        ("extra_token", lambda: tp.pack(x, keep, extra_token=torch.randn(3, 8))),
        ("extra_token", lambda: tp.pack(x, keep, extra_token=torch.randn(2, 8).half())),
        ("cu_seqlens", lambda: tp.repack(tokens, cu.long(), torch.ones(10, dtype=torch.bool), 5)),
        ("cu_seqlens", lambda: tp.repack(tokens, torch.tensor([0, 6, 5, 10], dtype=torch.int32),
                                         torch.ones(10, dtype=torch.bool), 6)),
        ("keep", lambda: tp.repack(tokens, cu, torch.ones(9, dtype=torch.bool), 5)),
        ("keep", lambda: tp.repack(tokens, cu, torch.arange(10) != 5, 5)),
        ("max_seqlen", lambda: tp.repack(tokens, cu, torch.ones(10, dtype=torch.bool), 4)),
        ("max_seqlen", lambda: tp.unpack(tokens, cu, 0)),
        ("tokens", lambda: tp.unpack(tokens.int(), cu, 5)),
        ("cu_seqlens", lambda: tp.cls_rows(tokens, torch.tensor([0, 5, 11], dtype=torch.int32))),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_pack_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    name, call = _bad_pack_calls()[index]
    forbid_launch(tp, "_repack", "_unpack_kernel")
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,n,channels", [(1, 197, 768), (64, 197, 384), (128, 577, 768), (5, 1025, 192)])
def test_pack_family_matches_reference_gpu(batch, n, channels, dtype, gen):
    x, keep = _batch(batch, n, channels, dtype, "cuda", gen)
    _check_pack_family(x, keep, gen)


@pytest.mark.gpu
def test_pack_is_sync_free_with_count_or_capacity_gpu(gen):
    """With count= or capacity=, pack and repack enqueue work without waiting for the GPU."""
    x, _ = _batch(8, 197, 768, torch.float16, "cuda", gen)
    keep = torch.zeros(8, 197, dtype=torch.bool, device="cuda")
    keep[:, :99] = True
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, cu, bound = tp.pack(x, keep, count=99)
        keep2 = torch.ones(tokens.shape[0], dtype=torch.bool, device="cuda")
        tp.repack(tokens, cu, keep2, bound, capacity=tokens.shape[0] + 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
