"""ragged_vit.triton_impl.attention against ragged_vit.reference.attention.

Tolerance rule (FlashAttention's): the kernel's max error against the fp32 (fp64 for the check of fp32 itself)
reference must be at most 2x the error of PyTorch's own attention run in the kernel's dtype on the same inputs,
plus a floor of a few ulps of that dtype for inputs where PyTorch happens to be exact. Outputs are poisoned with
NaN before every call, so an unwritten element fails.

CPU runs use Triton's interpreter (small batches, 1-3 heads); the ``gpu`` cases run on a CUDA card.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged_vit.reference
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl.configs import AttentionConfig

INTERP_LENGTHS = (1, 2, 63, 64, 65, 197)
GPU_LENGTHS = (1, 2, 63, 64, 65, 97, 138, 197, 577, 1025)
_FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _cu(lengths, device) -> torch.Tensor:
    return cu_seqlens_from_counts(torch.tensor(lengths)).to(device)


def _qkv(total: int, heads: int, head_dim: int, dtype, device, gen) -> torch.Tensor:
    return torch.randn(total, 3 * heads * head_dim, generator=gen).to(device=device, dtype=dtype)


def _torch_same_dtype(q, k, v, cu) -> torch.Tensor:
    """PyTorch attention in the inputs' own dtype (the error yardstick), one sequence at a time."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
    return out


def _check_close(got: torch.Tensor, q, k, v, cu) -> None:
    ref = ragged_vit.reference.ragged_attention(q.double(), k.double(), v.double(), cu.cpu().to(q.device))
    err = (got.double() - ref).abs().max().item()
    yard = (_torch_same_dtype(q, k, v, cu).double() - ref).abs().max().item()
    assert err <= 2 * yard + _FLOOR[got.dtype], f"kernel error {err:.3g} > 2 x torch {yard:.3g} + floor"


def _run_qkv(lengths, heads, head_dim, dtype, device, gen, max_seqlen=None):
    cu = _cu(lengths, device)
    qkv = _qkv(int(cu[-1]), heads, head_dim, dtype, device, gen)
    out = torch.full((qkv.shape[0], heads * head_dim), float("nan"), dtype=dtype, device=device)
    got = ta.ragged_attention_qkv(qkv, cu, max_seqlen or max(lengths), heads, out=out)
    assert got.data_ptr() == out.data_ptr()
    return qkv, cu, got


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 24, 32, 64, 80])  # 24, 80: padded to a power of two inside the kernel
def test_qkv_layout_matches_reference_interpreter(dtype, head_dim, gen):
    heads = 2
    qkv, cu, got = _run_qkv(INTERP_LENGTHS, heads, head_dim, dtype, "cpu", gen)
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    assert not got.isnan().any()
    _check_close(got.view(-1, heads, head_dim), q, k, v, cu)


@pytest.mark.interpreter
def test_strided_separate_qkv_interpreter(gen):
    """q, k, v as views into storage with padding between heads and rows (arbitrary strides)."""
    lengths, heads, head_dim = (3, 65, 1), 3, 32
    cu = _cu(lengths, "cpu")
    total = int(cu[-1])
    store = torch.randn(total, heads, 3, head_dim + 8, generator=gen)
    q, k, v = (store[:, :, i, :head_dim] for i in range(3))
    assert not q.is_contiguous()
    out = torch.full((total, heads, head_dim), float("nan"))
    got = ta.ragged_attention(q, k, v, cu, max(lengths), out=out)
    _check_close(got, q, k, v, cu)
    contiguous = ta.ragged_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, max(lengths))
    torch.testing.assert_close(got, contiguous, rtol=0, atol=0)


# Lengths with full tiles and last query/key tiles of every size class (1-16, 17-32, 33-48, 49-63 rows).
TILE_LENGTHS = (130, 5, 197, 40, 100, 20, 64, 113)
_CONFIGS = [
    AttentionConfig(64, 64, 4, 1, True),
    AttentionConfig(64, 64, 4, 1, False),
    AttentionConfig(64, 32, 4, 3, True),
    AttentionConfig(128, 64, 8, 1, False),
    AttentionConfig(32, 32, 2, 2, True),
]


def _launch_config(config, lengths, bound, dtype, device, gen, heads=1, head_dim=32):
    cu = _cu(lengths, device)
    qkv = _qkv(int(cu[-1]), heads, head_dim, dtype, device, gen)
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    out = torch.full((qkv.shape[0], heads * head_dim), float("nan"), dtype=dtype, device=device)
    ta.ragged_attention_qkv(qkv, cu, bound, heads, out=out, config=config)
    return out.view(-1, heads, head_dim), (q, k, v, cu)


@pytest.mark.interpreter
@pytest.mark.parametrize("config", _CONFIGS, ids=repr)
@pytest.mark.parametrize("bound", [197, 40, 1000])
def test_configs_and_bound_give_reference_results_interpreter(config, bound, gen):
    """Every tile shape and grid shape computes the reference result, for any max_seqlen bound
    (the grid-stride loop covers query tiles beyond an underestimated bound); fp32 IEEE dots: 2e-6."""
    out, (q, k, v, cu) = _launch_config(config, TILE_LENGTHS, bound, torch.float32, "cpu", gen)
    torch.testing.assert_close(out, ragged_vit.reference.ragged_attention(q, k, v, cu), rtol=0, atol=2e-6)


@pytest.mark.interpreter
def test_custom_scale_and_zero_length_images_interpreter(gen):
    heads, head_dim = 1, 64
    cu = _cu((5, 0, 64, 0), "cpu")
    qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float32, "cpu", gen)
    got = ta.ragged_attention_qkv(qkv, cu, 64, heads, scale=0.3)
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    ref = ragged_vit.reference.ragged_attention(q, k, v, cu, scale=0.3)
    torch.testing.assert_close(got.view_as(ref), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_isolation_interpreter(gen):
    """Changing image 1's tokens never changes image 0's or 2's output (bitwise)."""
    heads, head_dim = 2, 32
    cu = _cu((40, 70, 9), "cpu")
    qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float16, "cpu", gen)
    a = ta.ragged_attention_qkv(qkv, cu, 70, heads)
    qkv2 = qkv.clone()
    qkv2[40:110] = torch.randn(70, qkv.shape[1], generator=gen).half()
    b = ta.ragged_attention_qkv(qkv2, cu, 70, heads)
    assert torch.equal(a[:40], b[:40]) and torch.equal(a[110:], b[110:])
    assert not torch.equal(a[40:110], b[40:110])


@pytest.mark.interpreter
def test_custom_op_matches_direct_call_interpreter(gen):
    heads, head_dim = 2, 32
    cu = _cu((3, 17), "cpu")
    qkv = _qkv(20, heads, head_dim, torch.float32, "cpu", gen)
    direct = ta.ragged_attention_qkv(qkv, cu, 17, heads)
    via_op = torch.ops.ragged_vit.ragged_attention_qkv(qkv, cu, 17, heads, head_dim**-0.5)
    torch.testing.assert_close(via_op, direct, rtol=0, atol=0)
    torch.library.opcheck(
        ta.ragged_attention_qkv_op,
        (qkv, cu, 17, heads, head_dim**-0.5),
        test_utils=("test_schema", "test_faketensor"),
    )


def _bad_calls():
    qkv = torch.randn(10, 3 * 2 * 32)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    return [
        ("qkv", lambda: ta.ragged_attention_qkv(qkv.double(), cu, 10, 2)),
        ("qkv", lambda: ta.ragged_attention_qkv(qkv[None], cu, 10, 2)),
        ("qkv", lambda: ta.ragged_attention_qkv(qkv.numpy(), cu, 10, 2)),
        ("num_heads", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 0)),
        ("3 \\* num_heads", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 5)),
        ("head_dim", lambda: ta.ragged_attention_qkv(torch.randn(10, 3 * 44), cu, 10, 1)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, cu.long(), 10, 2)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, cu.float(), 10, 2)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, torch.tensor([0, 7, 4, 10], dtype=torch.int32), 10, 2)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, torch.tensor([0, 4, 12], dtype=torch.int32), 10, 2)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, torch.tensor([1, 4, 10], dtype=torch.int32), 10, 2)),
        ("cu_seqlens", lambda: ta.ragged_attention_qkv(qkv, torch.tensor([0], dtype=torch.int32), 10, 2)),
        ("max_seqlen", lambda: ta.ragged_attention_qkv(qkv, cu, 0, 2)),
        ("max_seqlen", lambda: ta.ragged_attention_qkv(qkv, cu, 10.0, 2)),
        ("scale", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, scale=-1.0)),
        ("out", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, out=torch.empty(10, 32))),
        ("out", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, out=torch.empty(10, 64, dtype=torch.float16))),
        ("T >= 1", lambda: ta.ragged_attention_qkv(qkv[:0], torch.tensor([0, 0], dtype=torch.int32), 1, 2)),
        ("k", lambda: ta.ragged_attention(qkv[:, :64].view(10, 2, 32), qkv[:, :64].view(10, 2, 32).half(),
                                          qkv[:, :64].view(10, 2, 32), cu, 10)),
        ("shape", lambda: ta.ragged_attention(torch.randn(10, 2, 32), torch.randn(10, 1, 32),
                                              torch.randn(10, 2, 32), cu, 10)),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    name, call = _bad_calls()[index]
    forbid_launch(ta, "_launch")
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 4, 32, 128])
def test_qkv_layout_matches_reference_gpu(dtype, batch, gen):
    heads, head_dim = 12, 64
    lengths = [GPU_LENGTHS[int(i)] for i in torch.randint(len(GPU_LENGTHS), (batch,), generator=gen)]
    qkv, cu, got = _run_qkv(lengths, heads, head_dim, dtype, "cuda", gen, max_seqlen=1025)
    assert not got.isnan().any()
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    _check_close(got.view(-1, heads, head_dim), q, k, v, cu)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_head_dims_gpu(head_dim, dtype, gen):
    heads = 3
    qkv, cu, got = _run_qkv(GPU_LENGTHS, heads, head_dim, dtype, "cuda", gen)
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    _check_close(got.view(-1, heads, head_dim), q, k, v, cu)


@pytest.mark.gpu
@pytest.mark.parametrize("config", _CONFIGS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_config_gpu(config, dtype, gen):
    out, (q, k, v, cu) = _launch_config(config, TILE_LENGTHS * 4, 197, dtype, "cuda", gen, heads=12, head_dim=64)
    assert not out.isnan().any()
    _check_close(out, q, k, v, cu)


@pytest.mark.gpu
def test_cached_launch_respects_specialisation_gpu(gen):
    """Repeated calls reuse the compiled kernel; a misaligned or odd-strided qkv must not reuse the aligned one."""
    heads, head_dim = 12, 64
    width = 3 * heads * head_dim
    for lengths in ((197, 5, 64), (33, 197, 1, 100)):  # a second call with another T takes the cached launch
        qkv, cu, got = _run_qkv(lengths, heads, head_dim, torch.float16, "cuda", gen, max_seqlen=197)
        again = ta.ragged_attention_qkv(qkv, cu, 197, heads)
        assert torch.equal(got, again)
        _check_close(got.view(-1, heads, head_dim), *ragged_vit.reference.split_qkv(qkv, heads), cu)
    assert ta._launcher.cache_size() >= 1  # the repeated calls went through the cached compiled launch
    store = torch.randn(qkv.shape[0], width + 1, generator=gen).half().cuda()
    odd = store[:, 1:]  # 2-byte misaligned base, row stride 2305: a different specialisation
    out = torch.full((odd.shape[0], heads * head_dim + 1), float("nan"), dtype=torch.float16, device="cuda")[:, 1:]
    got = ta.ragged_attention_qkv(odd, cu, 197, heads, out=out)
    _check_close(got.view(-1, heads, head_dim), *ragged_vit.reference.split_qkv(odd, heads), cu)


@pytest.mark.gpu
def test_strided_and_isolation_gpu(gen):
    heads, head_dim = 12, 64
    lengths = (197, 1, 99, 577, 64)
    cu = _cu(lengths, "cuda")
    total = int(cu[-1])
    store = torch.randn(total, heads, 3, head_dim + 8, generator=gen).cuda().half()
    q, k, v = (store[:, :, i, :head_dim] for i in range(3))
    a = ta.ragged_attention(q, k, v, cu, 577)
    _check_close(a, q, k, v, cu)
    store2 = store.clone()
    store2[198:297] = torch.randn(99, heads, 3, head_dim + 8, generator=gen).cuda().half()
    q2, k2, v2 = (store2[:, :, i, :head_dim] for i in range(3))
    b = ta.ragged_attention(q2, k2, v2, cu, 577)
    assert torch.equal(a[:198], b[:198]) and torch.equal(a[297:], b[297:])


@pytest.mark.gpu
def test_cuda_graph_capture_and_compile_gpu(gen):
    """The direct call captures into a CUDA graph; the custom op works under torch.compile(fullgraph=True)."""
    heads, head_dim = 12, 64
    cu = _cu((197, 50, 3), "cuda")
    qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float16, "cuda", gen)
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype, device="cuda")
    expect = ta.ragged_attention_qkv(qkv, cu, 197, heads)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ta.ragged_attention_qkv(qkv, cu, 197, heads, out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.ragged_attention_qkv(qkv, cu, 197, heads, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)

    def layer(x):
        return torch.ops.ragged_vit.ragged_attention_qkv(x * 1.0, cu, 197, heads, head_dim**-0.5) + 0.0

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(qkv), expect, rtol=0, atol=0)
