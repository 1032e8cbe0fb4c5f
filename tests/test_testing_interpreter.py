"""ragged_vit.testing.interpreter: ``tl.dot`` under Triton's interpreter gives equal rows equal bits (the conftest
applies it on CPU machines)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ragged_vit.testing.interpreter import order_interpreter_dots


@triton.jit
def _dot_kernel(A, B, OUT, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    offs_m, offs_k, offs_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(B + offs_k[:, None] * N + offs_n[None, :])
    tl.store(OUT + offs_m[:, None] * N + offs_n[None, :], tl.dot(a, b))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equal_rows_dot_alike_interpreter(dtype, gen):
    """Rows 2, 37 and 63 of a 64 x 64 tile are equal: their products with the same tile are equal bit for bit, and
    every product is the float64 one to fp32 summation (the inputs as given)."""
    a, b = torch.randn(2, 64, 64, generator=gen).to(dtype)
    a[37] = a[63] = a[2]
    out = torch.full((64, 64), float("nan"))
    _dot_kernel[(1,)](a, b, out, 64, 64, 64)
    assert torch.equal(out[37], out[2]) and torch.equal(out[63], out[2])
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_ordering_is_applied_once():
    from triton.runtime.interpreter import InterpreterBuilder

    ordered = InterpreterBuilder.create_dot
    assert getattr(ordered, "_ordered", False)  # by the conftest
    order_interpreter_dots()
    assert InterpreterBuilder.create_dot is ordered
