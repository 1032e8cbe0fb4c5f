"""Our Triton ragged-attention kernel (:func:`ragged_vit.triton_impl.attention.ragged_attention_qkv`), called directly.

The direct call has the lowest dispatch cost and is capturable in CUDA graphs (the custom op
``torch.ops.ragged_vit.ragged_attention_qkv`` is the same kernel for ``torch.compile``). It reads q, k, v through
strides from the qkv buffer and writes ``[T, H*D]`` for the output projection: no copy, no sync. A ``key_bias`` goes
to the kernel as it is (its constexpr switch; without one the kernel is compiled without any bias instruction), and
so does a RoPE model's rotation (``rotary``: the kernel rotates q and k as it loads them, another constexpr).

On a CPU it runs only under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before
``triton.language`` is first imported -- and importing timm imports it. A process that got the order wrong has
kernels (or Triton's own library functions) built for the wrong mode; :meth:`TritonBackend.check` detects that
and raises a clear error instead of crashing inside the interpreter.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ...core.rotary import Rotary
from ...triton_impl.attention import (
    SUPPORTED_HEAD_DIMS,
    ragged_attention_qkv_op,
    ragged_attention_qkv_unchecked,
)
from ...triton_impl.launcher import INTERPRETED
from .base import AttentionBackend, Capabilities


class TritonBackend(AttentionBackend):
    """Ragged attention straight from the packed qkv buffer (CUDA, or CPU under the interpreter)."""

    name = "triton"
    capabilities = Capabilities(head_dims=SUPPORTED_HEAD_DIMS, custom_op=True, key_bias=True, rotary=True)

    @property
    def interpreted(self) -> bool:
        """Whether the kernels were built for Triton's interpreter (CPU tensors) rather than a GPU."""
        return INTERPRETED

    def check(self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> None:
        super().check(device, dtype, head_dim)
        if device.type == "cpu":
            if not (self.interpreted and type(tl.cdiv).__name__ == "InterpretedFunction"):
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

    def _attend(
        self,
        qkv: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        num_heads: int,
        scale: float,
        key_bias: torch.Tensor | None = None,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in a compiled graph (it has a fake implementation)
            rope = (None, None, False) if rotary is None else rotary  # the kernel rotates q and k as it loads them
            return ragged_attention_qkv_op(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias, *rope)
        return ragged_attention_qkv_unchecked(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias, rotary=rotary)
