"""ragged_vit.triton_impl.pack against ragged_vit.reference.packing: packing is a copy, so every comparison is bitwise.

The contract's cases live in the conformance lab, :mod:`ragged_vit.testing.pack`, which checks the four public entry
points here with every option the kernels take (the fused extra token, ``kept=`` counts, ``count=`` and ``capacity=``
modes): every case of the lab is a test item (quick under Triton's interpreter on the CPU, full on a GPU), and the
lab's argument errors are raised with the kernels' launches forbidden. Below them, what is this kernel's own: ``kept=``
skips the counting kernel and is trusted, the CUDA-graph options (padding images, ``cu_out=`` in place), no
synchronisation with ``count=`` or ``capacity=`` on a GPU, and its own argument errors (raised before any launch).
"""

from __future__ import annotations

import pytest
import torch

import ragged_vit.reference
from ragged_vit.testing.pack import pack_cases, pack_suite, run_pack_case
from ragged_vit.testing.report import raise_failures
from ragged_vit.triton_impl import pack as tp
from tests.helpers import one_per_family, sync_free

# Every case of the lab on the checked entry points, with every option they take.
_OPTIONS = dict(extra_token=True, capacity=True, count=True, kept=True)
_FAMILY = dict(pack=tp.pack, repack=tp.repack, unpack=tp.unpack, cls_rows=tp.cls_rows, **_OPTIONS)
# Quick: each case once, the dtypes (and GPU widths) in turn; full: each case in each dtype.
test_pack_family_interpreter = pytest.mark.interpreter(
    one_per_family(
        pack_suite(**_FAMILY, device="cpu"), lambda case: (case.kind, case.lengths), lambda case: (case.dtype,)
    )
)
test_pack_family_gpu = pytest.mark.gpu(
    one_per_family(pack_suite(**_FAMILY, device="cuda", level_name="full", bad_inputs=True),
                   lambda case: (case.kind, case.lengths), lambda case: (case.channels, case.dtype))
)  # fmt: skip
# The pipelines' hot path, repack without its checks, at their width (repack goes through it: the CPU suite covers it).
test_repack_unchecked_gpu = pytest.mark.gpu(
    one_per_family(pack_suite(repack=tp.repack_unchecked, **_OPTIONS, device="cuda", channels=(768,)),
                   lambda case: (case.kind, case.lengths), lambda case: (case.dtype,))
)  # fmt: skip


def test_contract_bad_inputs_raise_before_launch(forbid_launch):
    """The lab's argument errors, on CPU tensors (the value checks included), with the kernels' launches forbidden."""
    forbid_launch(tp, "_repack", "_unpack_kernel", "total_and_longest_unchecked")
    [case] = [case for case in pack_cases(bad_inputs=True) if case.kind == "bad_inputs"]
    raise_failures("packing (pack, repack, unpack, cls_rows)", run_pack_case(case, **_FAMILY))


def _batch(batch, n, channels, dtype, device, gen, rate=0.5):
    x = torch.randn(batch, n, channels, generator=gen).to(device=device, dtype=dtype)
    keep = torch.rand(batch, n, generator=gen) < rate
    keep[:, 0] = True
    return x, keep.to(device)


def _second_stage(x, keep, gen):
    """A packed first stage, a random second-stage mask (CLS kept), its per-image counts and a fused token."""
    tokens, cu, bound = tp.pack(x, keep)
    keep2 = torch.rand(tokens.shape[0], generator=gen) < 0.6
    keep2[cu[:-1].long().cpu()] = True
    ref = ragged_vit.reference.repack(tokens.cpu(), cu.cpu(), keep2)
    kept = (ref[1][1:] - ref[1][:-1]).to(device=x.device, dtype=torch.int32)
    extra = torch.randn(x.shape[0], x.shape[-1], generator=gen).to(x)
    return tokens, cu, keep2.to(x.device), bound, kept, extra


def _reference_repack(tokens, cu, keep2, fused):
    return ragged_vit.reference.repack(tokens.cpu(), cu.cpu(), keep2.cpu(), None if fused is None else fused.cpu())


def _check_kept(x, keep, gen, forbid_launch):
    """``kept=`` skips the counting kernel: the results are those without it, exact size or capacity."""
    tokens, cu, keep2, bound, kept, extra = _second_stage(x, keep, gen)
    plain = [tp.repack(tokens, cu, keep2, bound, extra_token=fused) for fused in (None, extra)]
    forbid_launch(tp, "_count_launcher")
    for fused, without in zip((None, extra), plain, strict=True):
        got = tp.repack(tokens, cu, keep2, bound, extra_token=fused, kept=kept, check_values=True)
        assert torch.equal(got[0], without[0]) and torch.equal(got[1], without[1]) and got[2] == without[2]
        total = without[0].shape[0]
        cap = tp.repack(tokens, cu, keep2, bound, extra_token=fused, capacity=total + 5, kept=kept)
        assert torch.equal(cap[1], without[1]) and torch.equal(cap[0][:total], without[0])

    # The offsets follow the counts given, not the mask (trusted without check_values): kept is really read.
    shifted = kept + 1
    cap = tp.repack(tokens, cu, keep2, bound, capacity=3 * tokens.shape[0], kept=shifted, check_values=False)
    expected = torch.cat([torch.zeros(1, dtype=torch.int64), shifted.cpu().long().cumsum(0)]).int()
    assert torch.equal(cap[1].cpu(), expected)
    with pytest.raises(ValueError, match="kept"):
        tp.repack(tokens, cu, keep2, bound, capacity=3 * tokens.shape[0], kept=shifted, check_values=True)


def _check_padding(x, keep, gen):
    """Padding offsets after the real ones: some below capacity, the trailing ones clamped to it, exact values."""
    tokens, cu, keep2, bound, kept, extra = _second_stage(x, keep, gen)
    batch = cu.numel() - 1
    for trial, fused in enumerate((None, extra, None, extra)):
        ref = _reference_repack(tokens, cu, keep2, fused)
        total = ref[0].shape[0]
        pad_len = int(torch.randint(1, 10, (1,), generator=gen))
        below = int(torch.randint(1, 4, (1,), generator=gen))  # padding images ending below capacity
        capacity = total + below * pad_len + int(torch.randint(1, pad_len + 1, (1,), generator=gen))
        pads = below + 2 + int(torch.randint(0, 5, (1,), generator=gen))  # >= 2 clamped (the last ones empty)
        got = tp.repack(
            tokens, cu, keep2, bound, extra_token=fused, capacity=capacity, padding_images=pads, padding_len=pad_len,
            kept=kept if trial % 2 else None,
        )  # fmt: skip
        expected = ref[1].tolist() + [min(total + (i + 1) * pad_len, capacity) for i in range(pads)]
        assert sum(e < capacity for e in expected[batch + 1 :]) == below
        assert got[1].dtype == torch.int32 and got[1].tolist() == expected
        assert got[0].shape[0] == capacity and torch.equal(got[0][:total].cpu(), ref[0])
        assert got[2] == bound + (fused is not None)

    # batch=: the images of an earlier padded buffer before its padding images; their offsets and counts after the
    # real ones (garbage here) are never read, so the result is that of the sliced arguments.
    ref = _reference_repack(tokens, cu, keep2, None)
    total = ref[0].shape[0]
    noise = torch.tensor([total + 3, 2**30], dtype=torch.int32, device=cu.device)
    more_cu, more_kept = torch.cat([cu, noise]), torch.cat([kept, noise])
    for fused, kept_arg in ((None, more_kept), (extra, None)):  # kept given, or counted (for the B images only)
        got = tp.repack_unchecked(
            tokens, more_cu, keep2, bound, extra_token=fused, capacity=total + 2 * batch + 5, kept=kept_arg,
            padding_images=2, padding_len=bound, batch=batch,
        )  # fmt: skip
        want = tp.repack(
            tokens, cu, keep2, bound, extra_token=fused, capacity=total + 2 * batch + 5,
            kept=None if kept_arg is None else kept, padding_images=2, padding_len=bound,
        )  # fmt: skip
        rows = int(want[1][batch])
        assert torch.equal(got[1], want[1]) and torch.equal(got[0][:rows], want[0][:rows])

    # Default padding_len: the returned bound (max_seqlen + 1 with a fused token).
    ref = _reference_repack(tokens, cu, keep2, extra)
    total, step = ref[0].shape[0], bound + 1
    got = tp.repack(tokens, cu, keep2, bound, extra_token=extra, capacity=total + 2 * step + 1, padding_images=4)
    assert got[1].tolist() == ref[1].tolist() + [total + step, total + 2 * step] + [total + 2 * step + 1] * 2

    # Overflow (capacity below the total): every offset past the real ones is the capacity.
    small = max(1, total - 2)
    got = tp.repack(tokens, cu, keep2, bound, extra_token=extra, capacity=small, padding_images=3, padding_len=1)
    assert got[1].tolist() == ref[1].clamp(max=small).tolist() + [small] * 3


def _check_cu_out(x, keep, gen, monkeypatch):
    """``cu_out=`` is written in place and returned, whole or as an unaligned slice of a larger buffer; an unaligned
    one never reaches the compiled-handle cache (its key assumes 16-byte aligned pointers)."""
    tokens, cu, keep2, bound, kept, extra = _second_stage(x, keep, gen)
    keys = []
    launcher = tp._pack_launcher

    def recording(key, *args, **kwargs):
        keys.append(key)
        launcher(key, *args, **kwargs)

    monkeypatch.setattr(tp, "_pack_launcher", recording)
    batch, pads = cu.numel() - 1, 3
    entries = batch + 1 + pads
    capacity = tokens.shape[0] + 2
    fresh = tp.repack(tokens, cu, keep2, bound, extra_token=extra, capacity=capacity, padding_images=pads)
    rows = int(fresh[1][batch])  # the rows past the total are left unwritten
    whole = torch.full((entries,), -7, dtype=torch.int32, device=x.device)
    got = tp.repack(tokens, cu, keep2, bound, extra_token=extra, capacity=capacity, padding_images=pads, cu_out=whole)
    assert got[1] is whole and torch.equal(whole, fresh[1]) and torch.equal(got[0][:rows], fresh[0][:rows])
    assert (keys[-1] is not None) == x.is_cuda

    # A row of a graph buffer, starting 4 * (4k + 3) bytes in: not 16-byte aligned.
    row_len = 4 * -(-(entries + 1) // 4) + 2
    buf = torch.full((3, row_len), -7, dtype=torch.int32, device=x.device)
    view = buf[1, 1 : 1 + entries]
    assert view.data_ptr() % 16 != 0
    got = tp.repack(
        tokens, cu, keep2, bound, extra_token=extra, capacity=capacity, padding_images=pads, cu_out=view, kept=kept
    )
    assert got[1] is view and torch.equal(view, fresh[1]) and torch.equal(got[0][:rows], fresh[0][:rows])
    assert keys[-1] is None
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[1, 1 : 1 + entries] = False
    assert bool((buf[untouched] == -7).all())

    # pack takes the same options.
    ref = ragged_vit.reference.pack(x.cpu(), keep.cpu())
    out = torch.full((batch + 2,), -7, dtype=torch.int32, device=x.device)
    total = ref[0].shape[0]
    got = tp.pack(x, keep, capacity=total + 3, padding_images=1, padding_len=2, cu_out=out, kept=keep.sum(1).int())
    assert got[1] is out and out.tolist() == ref[1].tolist() + [total + 2]
    assert torch.equal(got[0][:total].cpu(), ref[0])


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,n,channels", [(1, 5, 8), (4, 40, 16)])
def test_repack_kept_skips_counting_interpreter(batch, n, channels, gen, forbid_launch):
    x, keep = _batch(batch, n, channels, torch.float32, "cpu", gen)
    _check_kept(x, keep, gen, forbid_launch)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,n,channels", [(1, 5, 8), (4, 40, 16)])
def test_repack_padding_offsets_interpreter(batch, n, channels, gen):
    x, keep = _batch(batch, n, channels, torch.float32, "cpu", gen)
    _check_padding(x, keep, gen)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,n,channels", [(1, 5, 8), (4, 40, 16)])
def test_repack_cu_out_in_place_interpreter(batch, n, channels, gen, monkeypatch):
    x, keep = _batch(batch, n, channels, torch.float16, "cpu", gen)
    _check_cu_out(x, keep, gen, monkeypatch)


def _bad_pack_calls():
    """This kernel's own argument errors (the contract's are the lab's, above): layouts it does not take, and its
    CUDA-graph options."""
    x = torch.randn(2, 5, 8)
    keep = torch.ones(2, 5, dtype=torch.bool)
    tokens = torch.randn(10, 8)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    ones = torch.ones(10, dtype=torch.bool)
    kept = torch.tensor([5, 5], dtype=torch.int32)
    two = torch.empty(2, dtype=torch.int32)
    return [
        ("x", lambda: tp.pack(x[..., ::2], keep)),
        ("tokens", lambda: tp.unpack(tokens.int(), cu, 5)),
        ("kept", lambda: tp.repack(tokens, cu, ones, 5, kept=[5, 5])),
        ("kept", lambda: tp.repack(tokens, cu, ones, 5, kept=kept[None])),
        ("kept", lambda: tp.repack(tokens, cu, ones, 5, kept=torch.full((4,), 5, dtype=torch.int32)[::2])),
        ("kept", lambda: tp.repack(tokens, cu, ones, 5, kept=kept.to("meta"))),
        ("kept", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, kept=kept + 1, check_values=True)),
        ("padding_images", lambda: tp.repack(tokens, cu, ones, 5, padding_images=2)),
        ("padding_images", lambda: tp.repack(tokens, cu, ones, 5, count=5, padding_images=1)),
        ("padding_images", lambda: tp.pack(x, keep, padding_images=1)),
        ("padding_images", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=-1)),
        ("padding_images", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=1.0)),
        ("padding_images", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=True)),
        ("padding_len", lambda: tp.repack(tokens, cu, ones, 5, padding_len=3)),
        ("padding_len", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=1, padding_len=0)),
        ("padding_len", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=1, padding_len=2.0)),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, cu_out=cu.long())),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, cu_out=cu.tolist())),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, cu_out=cu[None])),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, capacity=12, padding_images=1, cu_out=cu.clone())),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, cu_out=torch.zeros(6, dtype=torch.int32)[::2])),
        ("cu_out", lambda: tp.repack(tokens, cu, ones, 5, cu_out=cu.to("meta"))),
        ("cu_out", lambda: tp.pack(x, keep, cu_out=cu[:2].clone())),
        ("kept", lambda: tp.total_and_longest(kept.long(), two)),
        ("kept", lambda: tp.total_and_longest(kept[:0], two)),
        ("kept", lambda: tp.total_and_longest(torch.zeros(4, dtype=torch.int32)[::2], two)),
        ("out", lambda: tp.total_and_longest(kept, two[:1])),
        ("out", lambda: tp.total_and_longest(kept, torch.empty(2))),
        ("out", lambda: tp.total_and_longest(kept, torch.empty(4, dtype=torch.int32)[::2])),
        ("out", lambda: tp.total_and_longest(kept, torch.empty(2, dtype=torch.int32, device="meta"))),
    ]  # fmt: skip


def _check_total_and_longest(batch: int, device: str, out: torch.Tensor, gen: torch.Generator) -> None:
    """Fresh random counts (a tie for the longest among them), against the reference; ``out`` poisoned first."""
    kept = torch.randint(1, 300, (batch,), generator=gen, dtype=torch.int32)
    kept[batch // 2] = kept.max()
    out.fill_(-1)
    got = tp.total_and_longest(kept.to(device), out)
    if device == "cuda":  # the kernel writes pinned host memory too: read it once the stream is done
        torch.cuda.synchronize()
    assert got is out and out[:2].tolist() == list(ragged_vit.reference.total_and_longest(kept))
    assert out[2:].eq(-1).all()  # nothing past the two values


@pytest.mark.interpreter
@pytest.mark.parametrize("batch", [1, 5, 1100])
def test_total_and_longest_interpreter(batch, gen):
    _check_total_and_longest(batch, "cpu", torch.empty(4, dtype=torch.int32), gen)


@pytest.mark.parametrize("index", range(len(_bad_pack_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    name, call = _bad_pack_calls()[index]
    forbid_launch(tp, "_repack", "_unpack_kernel", "total_and_longest_unchecked")
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_pack_is_sync_free_with_count_or_capacity_gpu(gen):
    """With count= or capacity=, pack and repack enqueue work without waiting for the GPU."""
    x, _ = _batch(8, 197, 768, torch.float16, "cuda", gen)
    keep = torch.zeros(8, 197, dtype=torch.bool, device="cuda")
    keep[:, :99] = True
    with sync_free():
        tokens, cu, bound = tp.pack(x, keep, count=99)
        keep2 = torch.ones(tokens.shape[0], dtype=torch.bool, device="cuda")
        tp.repack(tokens, cu, keep2, bound, capacity=tokens.shape[0] + 64)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n,channels", [(1, 197, 768), (64, 197, 384), (5, 1025, 192)])
def test_repack_kept_skips_counting_gpu(batch, n, channels, gen, forbid_launch):
    x, keep = _batch(batch, n, channels, torch.float16, "cuda", gen)
    _check_kept(x, keep, gen, forbid_launch)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n,channels", [(1, 197, 768), (64, 197, 384), (5, 1025, 192)])
def test_repack_padding_offsets_gpu(batch, n, channels, gen):
    x, keep = _batch(batch, n, channels, torch.bfloat16, "cuda", gen)
    _check_padding(x, keep, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n,channels", [(1, 197, 768), (64, 197, 384), (5, 1025, 192)])
def test_repack_cu_out_in_place_gpu(batch, n, channels, gen, monkeypatch):
    """The aligned call caches the compiled kernel; the unaligned slice after it must not reuse that handle."""
    x, keep = _batch(batch, n, channels, torch.float16, "cuda", gen)
    _check_cu_out(x, keep, gen, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 1100])
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_total_and_longest_gpu(batch, where, gen):
    """On the GPU's memory, and straight into pinned host memory (the graph runner's read-back)."""
    out = torch.empty(4, dtype=torch.int32, device="cuda") if where == "device" else torch.empty(
        4, dtype=torch.int32, pin_memory=True)  # fmt: skip
    _check_total_and_longest(batch, "cuda", out, gen)
