"""Our Triton ragged-attention kernel (:func:`ragged_vit.triton_impl.attention.ragged_attention_qkv`), called directly.

The direct call has the lowest dispatch cost and is capturable in CUDA graphs (the custom op
``torch.ops.ragged_vit.ragged_attention_qkv`` is the same kernel for ``torch.compile``). It reads q, k, v through
strides from the qkv buffer and writes ``[T, H*D]`` for the output projection: no copy, no sync.

On a CPU it runs only under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before
``triton.language`` is first imported -- and importing timm imports it. A process that got the order wrong has
kernels (or Triton's own library functions) built for the wrong mode; :meth:`TritonBackend.check` detects that
and raises a clear error instead of crashing inside the interpreter.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ragged_vit.pipelines.backends.base import AttentionBackend
from ragged_vit.triton_impl import attention as _kernels


def _is_interpreted(fn: object) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


class TritonBackend(AttentionBackend):
    """Ragged attention straight from the packed qkv buffer (CUDA, or CPU under the interpreter)."""

    name = "triton"

    @property
    def interpreted(self) -> bool:
        """Whether the kernel was built for Triton's interpreter (CPU tensors) rather than a GPU."""
        return _is_interpreted(_kernels._ragged_attention_kernel)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        super().check(device, dtype)
        if device.type == "cpu":
            if not (self.interpreted and _is_interpreted(tl.cdiv)):
                raise ValueError(
                    "backend 'triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before triton (or timm, which imports it) is first imported"
                )
            if dtype == torch.bfloat16:
                raise ValueError(
                    "backend 'triton' under the interpreter does not support bfloat16 (the "
                    "interpreter stores it as uint16); use float32 or float16 on the CPU"
                )
        elif self.interpreted:
            raise ValueError(f"backend 'triton' was built for the interpreter (TRITON_INTERPRET=1), got {device}")

    def attend(
        self, qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, scale: float
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in a compiled graph (it has a fake implementation)
            return torch.ops.ragged_vit.ragged_attention_qkv(qkv, cu_seqlens, max_seqlen, num_heads, scale)
        return _kernels.ragged_attention_qkv(qkv, cu_seqlens, max_seqlen, num_heads, scale)
