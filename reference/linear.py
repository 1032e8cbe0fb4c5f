"""A ViT block's linear layers with their neighbours fused: LayerNorm, matmul, bias, GELU, LayerScale and residual.

One op covers the four linear layers of a timm ViT block (``fc1(norm2(x))`` with GELU, ``qkv(norm1(x))``,
``x + ls1(proj(a))`` and ``x + ls2(fc2(h))``)::

    h = LayerNorm(x; ln_weight, ln_bias, eps)   if ln_weight is given, else x
    y = h @ weight.T (+ bias)                   weight as nn.Linear stores it: [N, K]
    y = gelu(y)                                 activation "gelu" (exact, erf) or "gelu_tanh" (tanh approximation)
    y = gamma * y                               if gamma is given (LayerScale)
    y = residual + y                            if residual is given

This is the ground truth of :func:`ragged_vit.triton_impl.linear.fused_linear`: every step in float32 (float64 inputs
stay float64), from the inputs' own values, with no rounding in between. Readable before fast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "gelu", "gelu_tanh")


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused op of the module docstring on ``x [M, K]``, ``weight [N, K]``; returns ``[M, N]`` in float32 (float64
    when ``x`` is float64). ``ln_bias`` needs ``ln_weight`` (the LayerNorm is on iff ``ln_weight`` is given);
    ``bias``, ``ln_weight``, ``ln_bias`` and ``gamma`` are vectors of ``N``, ``K``, ``K`` and ``N`` values,
    ``residual`` is ``[M, N]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if ln_bias is not None and ln_weight is None:
        raise ValueError("ln_bias needs ln_weight: the LayerNorm is on iff ln_weight is given")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    h = up(x)
    if ln_weight is not None:
        mean = h.mean(-1, keepdim=True)
        centred = h - mean
        var = centred.square().mean(-1, keepdim=True)  # biased, as nn.LayerNorm
        h = centred * torch.rsqrt(var + eps) * up(ln_weight)
        if ln_bias is not None:
            h = h + up(ln_bias)
    y = h @ up(weight).T
    if bias is not None:
        y = y + up(bias)
    if activation == "gelu":
        y = 0.5 * y * (1.0 + torch.erf(y * (1.0 / math.sqrt(2.0))))
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if gamma is not None:
        y = up(gamma) * y
    if residual is not None:
        y = up(residual) + y
    return y
