"""The attention-backend interface: one call that attends a packed qkv buffer, whatever the layout inside.

A backend receives exactly what :mod:`ragged_vit.pipelines.packed_block` has after the qkv projection and returns what
the output projection needs, so backends differ only in how they lay tokens out for attention and which kernel runs:

    ``attend(qkv [T, 3*H*D], cu_seqlens int32 [B+1], max_seqlen, num_heads, scale, key_bias=None) -> [T, H*D]``

``qkv`` is in timm's layout (q heads, then k heads, then v heads along the last dimension) and may be a strided
view; ``max_seqlen`` is a host int that bounds every image's length; ``key_bias`` is an optional float32 ``[T]``
added to every logit of key row ``t`` after the scale, in natural-log units (ToMe's proportional attention passes
``log(size)``); the output is in ``qkv``'s dtype. Backends are stateless and hold no weights.

Each backend declares what it can do in :attr:`AttentionBackend.capabilities` (:class:`Capabilities`: devices,
dtypes, head dims, whether a CUDA graph can capture it, whether ``torch.compile`` sees it as one op); the graph
runner, the CLI, the tests and the benchmarks read them from the registry (:data:`ragged_vit.pipelines.backends
.BACKENDS`). :meth:`AttentionBackend.check` is called once per forward, at the pipeline's entry, and raises a
``ValueError`` naming the backend when the model does not fit; ``attend`` itself then trusts its input, except that it
refuses a ``key_bias`` where the backend declares none (one check, here, before anything runs). A backend implements
:meth:`AttentionBackend._attend`. Inference only: no dropout, no causal mask.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from ...core.rotary import Rotary

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Capabilities:
    """What an attention backend can do.

    Attributes:
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        dtypes: activation dtypes it accepts.
        head_dims: the head dims it supports, or None for any.
        capturable: whether its ``attend`` can be captured in a CUDA graph (no host synchronisation, nothing built
            on the host per call).
        not_capturable_because: why not, when ``capturable`` is False.
        custom_op: whether ``torch.compile`` sees its attention as one opaque op (so compiled blocks fuse around it).
        key_bias: whether ``attend`` takes a per-key additive bias ``key_bias`` (else it raises when given one).
        rotary: whether it rotates q and k itself as it reads them (:meth:`AttentionBackend.attend_rotary`); the
            pipelines rotate them before ``attend`` for the others (:mod:`ragged_vit.reference.rotary`).
    """

    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = _FLOATS
    head_dims: tuple[int, ...] | None = None
    capturable: bool = True
    not_capturable_because: str = ""
    custom_op: bool = False
    key_bias: bool = False
    rotary: bool = False


class AttentionBackend(abc.ABC):
    """Base class of every attention backend; subclasses set ``name`` and ``capabilities`` and implement
    :meth:`_attend` (callers call :meth:`attend`)."""

    name: str = "backend"
    capabilities: Capabilities = Capabilities()

    def check(self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> None:
        """Raises ``ValueError`` if this backend cannot attend ``dtype`` activations of ``head_dim`` on ``device``."""
        caps = self.capabilities
        if device.type not in caps.devices:
            needs = " or ".join(d.upper() for d in caps.devices)
            hint = "; use backend='reference' (or 'triton' under TRITON_INTERPRET=1) on the CPU"
            hint = hint if device.type == "cpu" else ""
            raise ValueError(f"backend {self.name!r} needs a {needs} device, got {device}{hint}")
        if dtype not in caps.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in caps.dtypes)
            got = str(dtype).removeprefix("torch.")
            raise ValueError(f"backend {self.name!r} supports dtypes ({allowed}), got {got}")
        if head_dim is not None and caps.head_dims is not None and head_dim not in caps.head_dims:
            dims = caps.head_dims
            steps = {b - a for a, b in zip(dims[:-1], dims[1:], strict=True)}
            said = f"{dims[0]} to {dims[-1]} in steps of {steps.pop()}" if len(steps) == 1 else str(dims)
            raise ValueError(f"backend {self.name!r} supports head dims {said}, got {head_dim}")

    def attend(
        self,
        qkv: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        num_heads: int,
        scale: float,
        key_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bidirectional attention of each image over its own tokens.

        Args:
            qkv: ``[T, 3*H*D]`` packed projection output (timm's layout, last dimension contiguous).
            cu_seqlens: int32 ``[B+1]`` offsets; image ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
            max_seqlen: host int, an upper bound on every image's length.
            num_heads: ``H``.
            scale: softmax scale (timm's ``Attention.scale``).
            key_bias: optional float32 ``[T]`` (contiguous, finite), added to every logit of key row ``t`` after the
                scale, in natural-log units; only where ``capabilities.key_bias`` (else ``ValueError``).

        Returns:
            ``[T, H*D]`` in ``qkv``'s dtype, rows in ``qkv``'s order.
        """
        if key_bias is None:
            return self._attend(qkv, cu_seqlens, max_seqlen, num_heads, scale)
        if not self.capabilities.key_bias:
            raise ValueError(f"backend {self.name!r} does not take a key_bias (its capabilities.key_bias is False)")
        return self._attend(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias=key_bias)

    def attend_rotary(
        self,
        qkv: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        num_heads: int,
        scale: float,
        rotary: Rotary,
        key_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attend` with q and k rotated first by ``rotary`` (:class:`ragged_vit.core.rotary.Rotary`: each
        row's table row of the model's rope, prefix rows unrotated), by the backend as it reads them; only where
        ``capabilities.rotary`` (else ``ValueError``). Trusted input, as :meth:`attend`'s."""
        if not self.capabilities.rotary:
            raise ValueError(f"backend {self.name!r} does not rotate q and k (its capabilities.rotary is False)")
        if key_bias is not None and not self.capabilities.key_bias:
            raise ValueError(f"backend {self.name!r} does not take a key_bias (its capabilities.key_bias is False)")
        return self._attend(qkv, cu_seqlens, max_seqlen, num_heads, scale, key_bias=key_bias, rotary=rotary)

    @abc.abstractmethod
    def _attend(
        self, qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, scale: float
    ) -> torch.Tensor:
        """:meth:`attend` on trusted input. A backend that declares ``capabilities.key_bias`` adds a keyword
        ``key_bias: torch.Tensor | None = None``, one that declares ``capabilities.rotary`` a keyword ``rotary``; the
        others are never given them."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def aligned(qkv: torch.Tensor) -> torch.Tensor:
    """``qkv`` itself when every row starts at a 16-byte-aligned address, else an aligned copy: FlashAttention's
    kernels fault on misaligned rows (a caller's view one element in); the pipelines' projections are always aligned,
    so they never pay the copy. Under ``torch.compile`` (fake tensors have no address) ``qkv`` passes as it is."""
    if torch.compiler.is_compiling():
        return qkv
    row_bytes = qkv.stride(0) * qkv.element_size()
    if qkv.data_ptr() % 16 == 0 and (qkv.shape[0] <= 1 or row_bytes % 16 == 0):
        return qkv
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device).copy_(qkv)
