"""The attention-backend interface: one call that attends a packed qkv buffer, whatever the layout inside.

A backend receives exactly what :mod:`ragged_vit.pipelines.packed_block` has after the qkv projection and returns what
the output projection needs, so backends differ only in how they lay tokens out for attention and which kernel runs:

    ``attend(qkv [T, 3*H*D], cu_seqlens int32 [B+1], max_seqlen, num_heads, scale) -> [T, H*D]``

``qkv`` is in timm's layout (q heads, then k heads, then v heads along the last dimension) and may be a strided
view; ``max_seqlen`` is a host int that bounds every image's length (the pipeline passes the exact longest);
the output is in ``qkv``'s dtype. Backends are stateless and hold no weights. Each declares the devices and
dtypes it runs on; :meth:`AttentionBackend.check` is called once per forward, at the pipeline's entry, and raises
a ``ValueError`` naming the backend when they do not fit. Inference only: no dropout, no causal mask.
"""

from __future__ import annotations

import abc

import torch


class AttentionBackend(abc.ABC):
    """Base class of every attention backend; subclasses set the class attributes and implement :meth:`attend`.

    Attributes:
        name: the registry name (``make_backend(name)``).
        cuda_only: True when the backend runs only on CUDA tensors.
        dtypes: the activation dtypes it accepts.
    """

    name: str = "backend"
    cuda_only: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raises ``ValueError`` if this backend cannot attend ``dtype`` activations on ``device``."""
        if self.cuda_only and device.type != "cuda":
            raise ValueError(
                f"backend {self.name!r} needs a CUDA device, got {device}; "
                "use backend='reference' (or 'triton' under TRITON_INTERPRET=1) on the CPU"
            )
        if dtype not in self.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            got = str(dtype).removeprefix("torch.")
            raise ValueError(f"backend {self.name!r} supports dtypes ({allowed}), got {got}")

    @abc.abstractmethod
    def attend(
        self, qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, scale: float
    ) -> torch.Tensor:
        """Bidirectional attention of each image over its own tokens.

        Args:
            qkv: ``[T, 3*H*D]`` packed projection output (timm's layout, last dimension contiguous).
            cu_seqlens: int32 ``[B+1]`` offsets; image ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
            max_seqlen: host int, an upper bound on every image's length.
            num_heads: ``H``.
            scale: softmax scale (timm's ``Attention.scale``).

        Returns:
            ``[T, H*D]`` in ``qkv``'s dtype, rows in ``qkv``'s order.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
