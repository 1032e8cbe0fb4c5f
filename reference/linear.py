"""A ViT block's linear layers with their neighbours fused: LayerNorm, matmul, bias, GELU, LayerScale and residual.

One op covers the four linear layers of a timm ViT block (``fc1(norm2(x))`` with GELU, ``qkv(norm1(x))``,
``x + ls1(proj(a))`` and ``x + ls2(fc2(h))``)::

    h = LayerNorm(x; ln_weight, ln_bias, eps)   if ln_weight is given, else x
    y = h @ weight.T (+ bias)                   weight as nn.Linear stores it: [N, K]
    y = gelu(y)                                 activation "gelu" (exact, erf) or "gelu_tanh" (tanh approximation)
    y = gamma * y                               if gamma is given (LayerScale)
    y = residual + y                            if residual is given

The LayerNorm's statistics may come in precomputed (``ln_stats``), as the fused linear that wrote ``x`` (the residual
stream after proj or fc2) produces them in its epilogue: a ``[P, M, 2]`` float32 tensor holding, for each row and each
of P column chunks, the chunk's mean and its sum of squared deviations from that mean (M2). Chunk ``p`` covers columns
``[p W, min((p + 1) W, K))`` with ``W`` the least power of two ``>= ceil(K / P)`` (:func:`stats_chunk_width`: a
producer's power-of-two output tile), so the chunks may be uneven; they merge by Chan's update into the row's mean and
variance, and ``eps`` is added by the LayerNorm that uses them (:func:`layer_norm_stats`, :func:`merge_ln_stats`).

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
    ln_stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused op of the module docstring on ``x [M, K]``, ``weight [N, K]``; returns ``[M, N]`` in float32 (float64
    when ``x`` is float64). ``ln_bias`` needs ``ln_weight`` (the LayerNorm is on iff ``ln_weight`` is given);
    ``bias``, ``ln_weight``, ``ln_bias`` and ``gamma`` are vectors of ``N``, ``K``, ``K`` and ``N`` values,
    ``residual`` is ``[M, N]``; ``ln_stats`` (with ``ln_weight``) the rows' chunked statistics, used as given."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if ln_bias is not None and ln_weight is None:
        raise ValueError("ln_bias needs ln_weight: the LayerNorm is on iff ln_weight is given")
    if ln_stats is not None and ln_weight is None:
        raise ValueError("ln_stats needs ln_weight: they are the statistics of its LayerNorm")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    h = up(x)
    if ln_weight is not None:
        if ln_stats is None:
            mean = h.mean(-1, keepdim=True)
            var = (h - mean).square().mean(-1, keepdim=True)  # biased, as nn.LayerNorm
        else:
            mean, var = (t.to(dtype)[:, None] for t in merge_ln_stats(ln_stats, h.shape[-1]))
        h = (h - mean) * torch.rsqrt(var + eps) * up(ln_weight)
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


def stats_chunk_width(depth: int, chunks: int) -> int:
    """The width ``W`` of each of ``chunks`` column chunks of ``depth`` columns (the last may be shorter): the least
    power of two ``>= ceil(depth / chunks)``; raises ``ValueError`` where a chunk would be empty."""
    width = 1 << (-(-depth // chunks) - 1).bit_length() if depth > 0 and chunks > 0 else 0
    if width == 0 or (chunks - 1) * width >= depth:
        raise ValueError(f"{chunks} chunks of a power-of-two width cannot cover {depth} columns without an empty one")
    return width


def layer_norm_stats(x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """``[chunks, M, 2]`` float32 (float64 for float64 ``x``): each chunk's mean and sum of squared deviations from
    it (M2), for the rows of ``x [M, K]`` (the ``ln_stats`` of the module docstring)."""
    width = stats_chunk_width(x.shape[-1], chunks)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    parts = []
    for part in x.to(dtype).split(width, dim=-1):
        mean = part.mean(-1)
        parts.append(torch.stack((mean, (part - mean[:, None]).square().sum(-1)), -1))
    return torch.stack(parts)


def merge_ln_stats(stats: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mean and biased variance over ``depth`` columns from its chunked ``stats`` ``[P, M, 2]``, merged
    chunk by chunk in order with Chan's update (in the stats' dtype)."""
    width = stats_chunk_width(depth, stats.shape[0])
    mean, m2, seen = stats[0, :, 0], stats[0, :, 1], min(width, depth)
    for p in range(1, stats.shape[0]):
        count = min(width, depth - p * width)
        delta = stats[p, :, 0] - mean
        mean = mean + delta * (count / (seen + count))
        m2 = m2 + stats[p, :, 1] + delta * delta * (seen * count / (seen + count))
        seen += count
    return mean, m2 / depth
