"""Every attention backend against the reference backend on packed qkv buffers with odd lengths.

Lengths follow FlashAttention's test habit (1, 63, 65, 97, 197): a lone CLS, tiles just under and over 64, the
unpruned DeiT length. Tolerance: fp32 ``atol = rtol = 1e-5`` (same math, another summation order); in a low
precision dtype the backend's error against fp32 math must be at most 2x that of the reference backend run in that
dtype (fp32 math rounded once to the dtype), plus one ulp of the output scale. The CUDA-only backends are covered
by ``test_pipelines_gpu.py``; here they must refuse the CPU.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.pipelines.backends import BACKENDS, AttentionBackend, make_backend
from ragged_vit.pipelines.backends.base import Capabilities

LENGTHS = [1, 63, 65, 97, 197]


def _qkv(lengths, heads, head_dim, gen, dtype=torch.float32):
    total = sum(lengths)
    qkv = torch.randn(total, 3 * heads * head_dim, generator=gen).to(dtype)
    return qkv, cu_seqlens_from_counts(torch.tensor(lengths))


def _reference(qkv, cu, heads, scale):
    return make_backend("reference").attend(qkv.float(), cu, int((cu[1:] - cu[:-1]).max()), heads, scale)


def test_registry_builds_every_backend_by_name():
    for name, cls in BACKENDS.items():
        backend = make_backend(name)
        assert isinstance(backend, cls) and isinstance(backend, AttentionBackend) and backend.name == name
    instance = make_backend("padded_sdpa")
    assert make_backend(instance) is instance
    with pytest.raises(ValueError, match="backend must be one of reference, padded_sdpa, fa2_varlen"):
        make_backend("flash")
    with pytest.raises(TypeError, match="backend must be a backend name"):
        make_backend(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_sdpa_matches_reference(dtype, gen):
    heads, head_dim = 3, 64
    qkv, cu = _qkv(LENGTHS, heads, head_dim, gen, dtype)
    scale = 0.11
    got = make_backend("padded_sdpa").attend(qkv, cu, max(LENGTHS), heads, scale)
    assert got.dtype == dtype and got.shape == (sum(LENGTHS), heads * head_dim)
    ref = _reference(qkv, cu, heads, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        floor = (ref.to(dtype).float() - ref).abs().max()
        assert (got.float() - ref).abs().max() <= 2 * floor + torch.finfo(dtype).eps * ref.abs().max()


def test_padded_sdpa_accepts_a_loose_bound(gen):
    qkv, cu = _qkv([5, 9], 2, 16, gen)
    tight = make_backend("padded_sdpa").attend(qkv, cu, 9, 2, 0.25)
    loose = make_backend("padded_sdpa").attend(qkv, cu, 40, 2, 0.25)
    torch.testing.assert_close(loose, tight, atol=1e-6, rtol=1e-6)


def test_reference_backend_returns_the_input_dtype(gen):
    qkv, cu = _qkv([3, 4], 2, 16, gen, torch.float16)
    out = make_backend("reference").attend(qkv, cu, 4, 2, 0.25)
    assert out.dtype == torch.float16 and out.shape == (7, 32)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(dtype, gen):
    heads, head_dim = 2, 64
    lengths = [1, 65, 97]
    qkv, cu = _qkv(lengths, heads, head_dim, gen, dtype)
    backend = make_backend("triton")
    backend.check(qkv.device, dtype)
    got = backend.attend(qkv, cu, max(lengths), heads, head_dim**-0.5)
    ref = _reference(qkv, cu, heads, head_dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        floor = (ref.to(dtype).float() - ref).abs().max()
        assert (got.float() - ref).abs().max() <= 2 * floor + torch.finfo(dtype).eps * ref.abs().max()


def test_every_backend_declares_its_capabilities():
    """What the graph runner, the CLI, the tests and the benchmarks read instead of lists of names."""
    caps = {name: cls.capabilities for name, cls in BACKENDS.items()}
    for name, cap in caps.items():
        assert isinstance(cap, Capabilities) and cap.devices and cap.dtypes, name
        assert cap.capturable or cap.not_capturable_because, f"{name}: say why it cannot be captured"
        assert not cap.key_bias, f"{name}: no backend takes a key bias yet"
    assert {n for n, c in caps.items() if not c.capturable} == {"reference", "nested_sdpa"}
    assert {n for n, c in caps.items() if c.custom_op} == {"triton", "fa2_varlen"}
    assert {n for n, c in caps.items() if c.devices == ("cuda",)} == {"fa2_varlen", "nested_sdpa"}


@pytest.mark.parametrize("name,head_dim", [("triton", 84), ("triton", 264), ("fa2_varlen", 264)])
def test_head_dim_checks_name_the_backend(name, head_dim):
    device = torch.device("cuda" if name == "fa2_varlen" else "cpu")
    with pytest.raises(ValueError, match=rf"backend '{name}' supports head dims .*got {head_dim}"):
        make_backend(name).check(device, torch.float16, head_dim)


@pytest.mark.parametrize("name", [n for n, cls in BACKENDS.items() if cls.capabilities.devices == ("cuda",)])
def test_cuda_only_backends_refuse_the_cpu(name):
    with pytest.raises(ValueError, match=f"backend '{name}' needs a CUDA device, got cpu"):
        make_backend(name).check(torch.device("cpu"), torch.float16)


def test_dtype_checks_name_the_backend():
    with pytest.raises(ValueError, match=r"backend 'padded_sdpa' supports dtypes \(float16, bfloat16, float32\)"):
        make_backend("padded_sdpa").check(torch.device("cpu"), torch.float64)
    make_backend("reference").check(torch.device("cpu"), torch.float64)


@pytest.mark.interpreter
def test_triton_refuses_bf16_under_the_interpreter():
    with pytest.raises(ValueError, match="does not support bfloat16"):
        make_backend("triton").check(torch.device("cpu"), torch.bfloat16)
