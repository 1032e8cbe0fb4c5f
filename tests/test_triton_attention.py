"""ragged_vit.triton_impl.attention against ragged_vit.reference.attention.

The contract's cases and its tolerance rule (FlashAttention's: at most 2x the error of PyTorch's own attention in the
kernel's dtype, plus a floor) live in the conformance lab, :mod:`ragged_vit.testing`, which checks both entry points
here: every case of the lab is a test item (quick under Triton's interpreter on the CPU; full on a GPU), and so is
every case of its key-bias variant (the bias on both sides of the same rule). Below them, what is this kernel's own:
its launch configurations and grid bounds, the custom op, the cached launches, CUDA graph capture, and its argument
errors (raised before any launch).
"""

from __future__ import annotations

import pytest
import torch

import ragged_vit.reference
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.testing import assert_attention_close, attention_suite
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl import configs
from ragged_vit.triton_impl.configs import AttentionConfig
from tests.helpers import levels, one_per_family, rotated

# Every case of the lab, on both entry points: under the interpreter (quick), on a GPU (full, every supported head
# dim class: powers of two, padded ones, and 8, padded to tl.dot's smallest width of 16).
_INTERP = dict(device="cpu", accepts_out=True, bad_inputs=True, head_dims=(8, 24, 32, 64, 80))
_GPU = dict(device="cuda", accepts_out=True, bad_inputs=True, level_name="full", head_dims=(8, 64, 80, 256))


def _one_per_case(test):
    """The quick level: each case once, the head dims and dtypes in turn (``--full``: every one)."""
    return one_per_family(test, lambda case: (case.kind, case.lengths), lambda case: (case.head_dim, case.dtype))


test_qkv_layout_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_INTERP))
)
test_separate_layout_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(ta.ragged_attention, layout="separate", **{**_INTERP, "head_dims": (32,)}))
)
test_qkv_layout_gpu = pytest.mark.gpu(_one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_GPU)))
test_separate_layout_gpu = pytest.mark.gpu(
    _one_per_case(attention_suite(ta.ragged_attention, layout="separate", **{**_GPU, "head_dims": (64,)}))
)
# The key-bias variant: DeiT's 64 and the padded 80 under the interpreter (the separate layout shares the kernel: fp32
# only there), every GPU dtype and head dim class on a GPU.
_INTERP_BIAS = {**_INTERP, "key_bias": True, "head_dims": (64, 80)}
_GPU_BIAS = {**_GPU, "key_bias": True}
test_qkv_layout_key_bias_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_INTERP_BIAS))
)
test_separate_layout_key_bias_interpreter = pytest.mark.interpreter(
    attention_suite(
        ta.ragged_attention, layout="separate", **{**_INTERP_BIAS, "head_dims": (32,), "dtypes": (torch.float32,)}
    )
)
test_qkv_layout_key_bias_gpu = pytest.mark.gpu(
    _one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_GPU_BIAS))
)
test_separate_layout_key_bias_gpu = pytest.mark.gpu(
    _one_per_case(attention_suite(ta.ragged_attention, layout="separate", **{**_GPU_BIAS, "head_dims": (64,)}))
)


def _cu(lengths, device) -> torch.Tensor:
    return cu_seqlens_from_counts(torch.tensor(lengths)).to(device)


def _qkv(total: int, heads: int, head_dim: int, dtype, device, gen) -> torch.Tensor:
    return torch.randn(total, 3 * heads * head_dim, generator=gen).to(device=device, dtype=dtype)


# Lengths with full tiles and last query/key tiles of every size class (1-16, 17-32, 33-48, 49-63 rows).
TILE_LENGTHS = (130, 5, 197, 40, 100, 20, 64, 113)
_CONFIGS = [
    AttentionConfig(64, 64, 4, 1, True),
    AttentionConfig(64, 64, 4, 1, False),
    AttentionConfig(64, 32, 4, 3, True),
    AttentionConfig(128, 64, 8, 1, False),
    AttentionConfig(32, 32, 2, 2, True),
]


def _launch_config(config, lengths, bound, dtype, device, gen, heads=1, head_dim=32, with_bias=False):
    cu = _cu(lengths, device)
    qkv = _qkv(int(cu[-1]), heads, head_dim, dtype, device, gen)
    bias = torch.randn(qkv.shape[0], generator=gen).to(device) if with_bias else None
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    out = torch.full((qkv.shape[0], heads * head_dim), float("nan"), dtype=dtype, device=device)
    ta.ragged_attention_qkv(qkv, cu, bound, heads, key_bias=bias, out=out, config=config)
    return out.view(-1, heads, head_dim), (q, k, v, cu, bias)


BOUNDS = (197, 40, 1000)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "config,bound",
    levels([(c, b) for c in _CONFIGS for b in BOUNDS], lambda c, b: b == BOUNDS[_CONFIGS.index(c) % len(BOUNDS)],
           ids=lambda c, b: f"{b}-{c!r}"),
)  # fmt: skip
def test_configs_and_bound_give_reference_results_interpreter(config, bound, gen):
    """Every tile shape and grid shape computes the reference result, for any max_seqlen bound
    (the grid-stride loop covers query tiles beyond an underestimated bound); fp32 IEEE dots: 2e-6. Quick: each
    configuration once, the bounds in turn."""
    out, (q, k, v, cu, _) = _launch_config(config, TILE_LENGTHS, bound, torch.float32, "cpu", gen)
    torch.testing.assert_close(out, ragged_vit.reference.ragged_attention(q, k, v, cu), rtol=0, atol=2e-6)


@pytest.mark.interpreter
def test_key_bias_on_32_key_tiles_interpreter(gen):
    """The key bias on 32-key tiles (SM90's long-sequence configuration; the lab's cases run the default 64-key ones),
    every last-tile size class, an underestimated bound; fp32 IEEE dots: 2e-6."""
    config = AttentionConfig(64, 32, 4, 3, True)
    out, (q, k, v, cu, bias) = _launch_config(config, TILE_LENGTHS, 40, torch.float32, "cpu", gen, with_bias=True)
    expect = ragged_vit.reference.ragged_attention(q, k, v, cu, key_bias=bias)
    torch.testing.assert_close(out, expect, rtol=0, atol=2e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "key_bias"])
def test_custom_op_matches_direct_call_interpreter(with_bias, gen):
    """The op is the direct call, bit for bit, with or without a key bias; its schema and fake implementation (what
    torch.compile traces) pass opcheck."""
    heads, head_dim = 2, 32
    cu = _cu((3, 17), "cpu")
    qkv = _qkv(20, heads, head_dim, torch.float32, "cpu", gen)
    bias = torch.randn(20, generator=gen) if with_bias else None
    direct = ta.ragged_attention_qkv(qkv, cu, 17, heads, key_bias=bias)
    via_op = torch.ops.ragged_vit.ragged_attention_qkv(qkv, cu, 17, heads, head_dim**-0.5, bias)
    torch.testing.assert_close(via_op, direct, rtol=0, atol=0)
    torch.library.opcheck(
        ta.ragged_attention_qkv_op,
        (qkv, cu, 17, heads, head_dim**-0.5, bias),
        test_utils=("test_schema", "test_faketensor"),
    )


def _bad_calls():
    qkv = torch.randn(10, 3 * 2 * 32)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    q = qkv[:, :64].view(10, 2, 32)
    bias = torch.zeros(10)
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
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias.half())),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias.double())),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias.numpy())),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias[:, None])),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias[:9])),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=torch.zeros(20)[::2])),
        ("key_bias", lambda: ta.ragged_attention_qkv(qkv, cu, 10, 2, key_bias=bias.to("meta"))),
        ("key_bias", lambda: ta.ragged_attention(q, q, q, cu, 10, key_bias=torch.zeros(11))),
        ("key_bias", lambda: torch.ops.ragged_vit.ragged_attention_qkv(qkv, cu, 10, 2, 0.25, bias.int())),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_before_launch(index, forbid_launch):
    name, call = _bad_calls()[index]
    forbid_launch(ta, "_launch")
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(  # quick: each configuration once, the dtypes and the bias in turn
    "config,dtype,with_bias",
    rotated([(c, d, b) for c in _CONFIGS for d in (torch.float16, torch.bfloat16) for b in (False, True)],
            lambda c, d, b: c, lambda c, d, b: (d, b),
            ids=lambda c, d, b: f"{'key_bias' if b else 'no_bias'}-{str(d)[6:]}-{c!r}"),
)  # fmt: skip
def test_every_config_gpu(config, dtype, with_bias, gen):
    out, (q, k, v, cu, bias) = _launch_config(
        config, TILE_LENGTHS * 4, 197, dtype, "cuda", gen, heads=12, head_dim=64, with_bias=with_bias
    )
    assert not out.isnan().any()
    assert_attention_close(out, q, k, v, cu, key_bias=bias)


@pytest.mark.gpu
def test_cached_launch_respects_specialisation_gpu(gen):
    """Repeated calls reuse the compiled kernel; a misaligned or odd-strided qkv must not reuse the aligned one."""
    heads, head_dim = 12, 64
    width = 3 * heads * head_dim
    for lengths in ((197, 5, 64), (33, 197, 1, 100)):  # a second call with another T takes the cached launch
        cu = _cu(lengths, "cuda")
        qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float16, "cuda", gen)
        got = ta.ragged_attention_qkv(qkv, cu, 197, heads)
        again = ta.ragged_attention_qkv(qkv, cu, 197, heads)
        assert torch.equal(got, again)
        assert_attention_close(got.view(-1, heads, head_dim), *ragged_vit.reference.split_qkv(qkv, heads), cu)
    assert ta._launcher.cache_size() >= 1  # the repeated calls went through the cached compiled launch
    store = torch.randn(qkv.shape[0], width + 1, generator=gen).half().cuda()
    odd = store[:, 1:]  # 2-byte misaligned base, row stride 2305: a different specialisation
    out = torch.full((odd.shape[0], heads * head_dim + 1), float("nan"), dtype=torch.float16, device="cuda")[:, 1:]
    got = ta.ragged_attention_qkv(odd, cu, 197, heads, out=out)
    assert_attention_close(got.view(-1, heads, head_dim), *ragged_vit.reference.split_qkv(odd, heads), cu)


@pytest.mark.gpu
def test_cached_launch_with_key_bias_gpu(gen):
    """A bias is part of the cached specialisation: repeated biased calls reuse their kernel, a call without a bias
    after them does not take the biased one (nor the reverse), and a misaligned bias takes Triton's own path."""
    heads, head_dim = 12, 64
    cu = _cu((197, 5, 64), "cuda")
    qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float16, "cuda", gen)
    q, k, v = ragged_vit.reference.split_qkv(qkv, heads)
    bias = torch.randn(qkv.shape[0], generator=gen).cuda()
    plain = ta.ragged_attention_qkv(qkv, cu, 197, heads)
    biased = ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=bias)
    assert torch.equal(ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=bias), biased)
    assert torch.equal(ta.ragged_attention_qkv(qkv, cu, 197, heads), plain)
    assert_attention_close(plain.view(-1, heads, head_dim), q, k, v, cu)
    assert_attention_close(biased.view(-1, heads, head_dim), q, k, v, cu, key_bias=bias)
    odd = torch.empty(qkv.shape[0] + 1, device="cuda")[1:].copy_(bias)  # 4 bytes past an aligned address
    got = ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=odd)
    assert_attention_close(got.view(-1, heads, head_dim), q, k, v, cu, key_bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "key_bias"])
def test_cuda_graph_capture_and_compile_gpu(with_bias, gen):
    """The direct call captures into a CUDA graph; the custom op works under torch.compile(fullgraph=True); with or
    without a key bias."""
    heads, head_dim = 12, 64
    cu = _cu((197, 50, 3), "cuda")
    qkv = _qkv(int(cu[-1]), heads, head_dim, torch.float16, "cuda", gen)
    bias = torch.randn(qkv.shape[0], generator=gen).cuda() if with_bias else None
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype, device="cuda")
    expect = ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=bias)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=bias, out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.ragged_attention_qkv(qkv, cu, 197, heads, key_bias=bias, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)

    def layer(x):
        return torch.ops.ragged_vit.ragged_attention_qkv(x * 1.0, cu, 197, heads, head_dim**-0.5, bias) + 0.0

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(qkv), expect, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128])
def test_sm90_table_has_two_bands_per_tuned_head_dim(head_dim, monkeypatch):
    """On an SM90 card every tuned head dim (80 and 96 since their sweeps, docs/kernel_tuning.md) takes the short
    band up to a mean of 64 rows per image and the long band past it; an untuned one takes the default."""
    monkeypatch.setattr(configs, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    assert configs.attention_config(cuda, head_dim, 40.0) == configs._SM90_SHORT
    assert configs.attention_config(cuda, head_dim, 64.0) == configs._SM90_SHORT
    assert configs.attention_config(cuda, head_dim, 197.0) == configs._SM90_LONG
    assert configs.attention_config(cuda, 40, 197.0) == configs._DEFAULT[0][1]  # untuned
