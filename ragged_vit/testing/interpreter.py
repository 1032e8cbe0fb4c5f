"""Triton's interpreter (``TRITON_INTERPRET=1``) made to sum ``tl.dot`` as a GPU does, for CPU twins of GPU tests.

The interpreter runs ``tl.dot`` as one ``np.matmul`` of the two tiles, which hands them to the BLAS numpy was built
with (OpenBLAS). Its kernels are picked per CPU, and on some (seen on AVX-512 machines) two equal rows of a tile
come out of one matmul with different last bits: each row's sum runs in another order. A GPU's MMA computes every
output element alike, so a kernel may rely on equal rows scoring equal (ToMe's exact ties between duplicate keys do);
under the interpreter on such a CPU that kernel fails its tie tests for no fault of its own.
:func:`order_interpreter_dots` replaces the interpreter's dot by one that sums every output element over ``k`` in
one order (fp32 products summed in fp32 for fp32 accumulators, as before), so equal rows give equal bits on every
CPU. Call it once, before any kernel runs (a port's ``conftest.py``, as this project's own does); 8-bit inputs keep
the interpreter's own dot. It reaches into ``triton.runtime.interpreter``, not a public API: with a Triton that no
longer has ``InterpreterBuilder.create_dot`` it raises rather than silently doing nothing.
"""

from __future__ import annotations


def order_interpreter_dots() -> None:
    """Makes the interpreter's ``tl.dot`` sum each output element over ``k`` in one order (module docstring).
    Idempotent."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot
    if getattr(plain, "_ordered", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 / int8: the interpreter's own
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        products = a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=acc) + d.data, d.dtype.scalar)

    create_dot._ordered = True
    builder.create_dot = create_dot


def numpy_xor_reductions() -> None:
    """``tl.sort``'s bitonic network (and ``tl.flip``) reduce with xor, which Triton's interpreter runs element by
    element in Python (its generic reduce, one combine call per element); numpy's xor reduction gives the same bits
    (xor is exact in any order) at a fraction of the cost. Only the interpreter's speed changes: without the
    private names this reaches, it does nothing. Idempotent."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        reduce_ops, xor = interpreter.ReduceOps, tl.standard._xor_combine
        plain = reduce_ops.apply_impl
    except (ImportError, AttributeError):
        return
    if getattr(plain, "_numpy_xor", False):
        return

    def apply_impl(self, input):
        if self.combine_fn is xor and len(input) == 1:
            data = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(data, input[0].dtype)
        return plain(self, input)

    apply_impl._numpy_xor = True
    reduce_ops.apply_impl = apply_impl
