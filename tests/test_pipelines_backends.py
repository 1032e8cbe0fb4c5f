"""Every attention backend through the conformance lab (:mod:`ragged_vit.testing`: its cases and its 2x rule), and
the registry: names, capabilities, and the checks a pipeline runs at its entry.

On the CPU the backends that run there (``reference``, ``padded_sdpa``, and ``triton`` under the interpreter); the
CUDA-only ones go through the same lab in ``test_pipelines_gpu.py`` and must refuse the CPU here. A backend trusts its
caller (the pipeline checks at its entry), so the lab's bad-argument case does not apply. The lab's key-bias variant
runs on every backend that declares ``Capabilities.key_bias`` (here, and full on a GPU); every other backend must
refuse a bias before it attends.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.pipelines.backends import BACKENDS, AttentionBackend, PaddedSDPABackend, make_backend
from ragged_vit.pipelines.backends.base import Capabilities, aligned
from ragged_vit.testing import ConformanceError, attention_suite, check_attention

ALL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
test_reference_backend_conforms = attention_suite(make_backend("reference").attend, dtypes=(*ALL_FLOATS, torch.float64))
test_padded_sdpa_conforms = attention_suite(make_backend("padded_sdpa").attend, dtypes=ALL_FLOATS)
test_triton_backend_conforms_interpreter = pytest.mark.interpreter(attention_suite(make_backend("triton").attend))

# The key-bias variant on the backends that declare it (fp16 only under the interpreter: the kernel's own tests run
# the rest); full on a GPU, fp16 and bf16 as test_pipelines_gpu.py runs the plain contract.
KEY_BIAS_BACKENDS = [name for name, cls in BACKENDS.items() if cls.capabilities.key_bias]
test_reference_backend_key_bias = attention_suite(
    make_backend("reference").attend, key_bias=True, dtypes=(*ALL_FLOATS, torch.float64)
)
test_padded_sdpa_key_bias = attention_suite(make_backend("padded_sdpa").attend, key_bias=True, dtypes=ALL_FLOATS)
test_triton_backend_key_bias_interpreter = pytest.mark.interpreter(
    attention_suite(make_backend("triton").attend, key_bias=True, dtypes=(torch.float16,))
)
for _name in ("padded_sdpa", "triton"):
    globals()[f"test_{_name}_backend_key_bias_gpu"] = pytest.mark.gpu(
        attention_suite(
            make_backend(_name).attend, key_bias=True, device="cuda", level_name="full",
            dtypes=(torch.float16, torch.bfloat16), head_dims=(64,),
        )
    )  # fmt: skip


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


def test_every_backend_declares_its_capabilities():
    """What the graph runner, the CLI, the tests and the benchmarks read instead of lists of names."""
    caps = {name: cls.capabilities for name, cls in BACKENDS.items()}
    for name, cap in caps.items():
        assert isinstance(cap, Capabilities) and cap.devices and cap.dtypes, name
        assert cap.capturable or cap.not_capturable_because, f"{name}: say why it cannot be captured"
    assert {n for n, c in caps.items() if not c.capturable} == {"reference", "nested_sdpa"}
    assert set(KEY_BIAS_BACKENDS) == {"reference", "padded_sdpa", "triton"}  # each has its key-bias suites above
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


@pytest.mark.parametrize("name", [n for n in BACKENDS if n not in KEY_BIAS_BACKENDS])
def test_backends_without_key_bias_refuse_one_before_attending(name, forbid_launch):
    """FA2 varlen and NestedTensor SDPA take no bias: the base class refuses one, naming the backend, before the
    backend's own code runs (so on any device)."""
    backend = make_backend(name)
    forbid_launch(type(backend), "_attend")
    check_attention(backend.attend, key_bias=False, dtypes=backend.capabilities.dtypes)
    qkv, cu = torch.randn(4, 96, dtype=torch.float16), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^backend '{name}' does not take a key_bias \(its capabilities"):
        backend.attend(qkv, cu, 4, 1, 0.25, torch.zeros(4))


def test_a_backend_dropping_its_key_bias_fails_the_variant():
    """The variant sees a backend that declares key_bias but ignores it."""

    class Dropping(PaddedSDPABackend):
        def _attend(self, qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias=None):
            return super()._attend(qkv, cu_seqlens, max_seqlen, num_heads, scale)

    with pytest.raises(ConformanceError, match=r"attention \(qkv layout, key bias\): 5 case\(s\) failed"):
        check_attention(Dropping().attend, key_bias=True, dtypes=(torch.float32,))


def test_dtype_checks_name_the_backend():
    with pytest.raises(ValueError, match=r"backend 'padded_sdpa' supports dtypes \(float16, bfloat16, float32\)"):
        make_backend("padded_sdpa").check(torch.device("cpu"), torch.float64)
    make_backend("reference").check(torch.device("cpu"), torch.float64)


@pytest.mark.interpreter
def test_triton_refuses_bf16_under_the_interpreter():
    with pytest.raises(ValueError, match="does not support bfloat16"):
        make_backend("triton").check(torch.device("cpu"), torch.bfloat16)


def test_aligned_copies_only_misaligned_rows():
    """FlashAttention's kernels fault on rows off a 16-byte address, so its backends attend an aligned copy of such a
    view; an aligned qkv (every pipeline's) is passed through without a copy."""
    store = torch.randn(5 * 28 + 8, dtype=torch.float16)
    fine = store[:120].view(5, 24)
    assert aligned(fine) is fine
    for view in (store[1:121].view(5, 24), store[: 5 * 28].view(5, 28)[:, :24]):  # one element in; 56-byte rows
        copy = aligned(view)
        assert copy.data_ptr() % 16 == 0 and copy.stride(0) * copy.element_size() % 16 == 0
        assert torch.equal(copy, view)
