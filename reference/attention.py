"""Bidirectional multi-head attention in fp32 math: the ground truth for ``ragged_vit.triton_impl.attention``.

Two independent formulations that check each other:

* :func:`padded_attention` — a padded batch ``[B, H, L, D]`` with a key-padding mask, in one batched matmul.
* :func:`ragged_attention` — the packed layout ``[T, H, D]`` + ``cu_seqlens``, one sequence at a time.

Both upcast to fp32 (fp64 stays fp64) and return that precision: they are references to measure error
against, not fast paths. ``scale`` defaults to ``head_dim ** -0.5``. No causal mask, no dropout.
"""

from __future__ import annotations

import torch

from ..core.validation import check_cu_seqlens, check_same_device, check_tensor

_REF_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q, k, v ``[T, H, D]`` into a packed qkv projection output ``[T, 3*H*D]`` (timm's layout).

    timm's ``Attention`` reshapes ``qkv(x)`` to ``(..., 3, H, D)``: all q heads first, then k, then v.
    """
    check_tensor(qkv, "qkv", ndim=2)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be a Python int, got {type(num_heads).__name__}")
    if num_heads < 1 or qkv.shape[1] % (3 * num_heads):
        raise ValueError(f"qkv.shape[1] ({qkv.shape[1]}) must be divisible by 3 * num_heads ({3 * num_heads})")
    q, k, v = qkv.unflatten(1, (3, num_heads, -1)).unbind(1)
    return q, k, v


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention on a padded batch.

    Args:
        q, k, v: ``[B, H, L, D]``.
        key_padding_mask: bool ``[B, L]``, True where the key is a real token; ``None`` means all real.
        scale: softmax scale; ``None`` means ``D ** -0.5``.

    Returns:
        ``[B, H, L, D]`` in fp32 (fp64 for fp64 input). Rows of padded queries are computed like any other
        row (they attend to the real keys) and are meaningless to the caller.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=4, dtypes=_REF_DTYPES)
    check_same_device({"q": q, "k": k, "v": v})
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    dt = _math_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale  # [B, H, L, L]
    if key_padding_mask is not None:
        check_tensor(key_padding_mask, "key_padding_mask", ndim=2, dtypes=(torch.bool,), device=q.device)
        if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"key_padding_mask must have shape ({k.shape[0]}, {k.shape[2]}), got {tuple(key_padding_mask.shape)}"
            )
        logits = logits.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v.to(dt))


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention on the packed layout, each image attending only to its own tokens.

    Args:
        q, k, v: ``[T, H, D]`` (any strides).
        cu_seqlens: int32 ``[B+1]`` offsets into the packed rows.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        key_bias: optional ``[T]`` float, added to every logit of key row ``t`` after the scale (natural-log units:
            ToMe's proportional attention passes ``log(size)``), the same for every head and query.

    Returns:
        ``[T, H, D]`` in fp32 (fp64 for fp64 input).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=3, dtypes=_REF_DTYPES)
    check_same_device({"q": q, "k": k, "v": v})
    if q.shape != k.shape or k.shape != v.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"q, k, v must share one shape [T, H, D], got {shapes}")
    check_cu_seqlens(cu_seqlens, total=q.shape[0], device=q.device)
    if key_bias is not None:
        check_tensor(key_bias, "key_bias", ndim=1, dtypes=_REF_DTYPES, device=q.device)
        if key_bias.shape[0] != q.shape[0]:
            raise ValueError(f"key_bias must have one value per row ({q.shape[0]}), got {key_bias.shape[0]}")
    dt = _math_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=dt, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].to(dt).transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        logits = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [H, L, L]
        if key_bias is not None:
            logits = logits + key_bias[start:end].to(dt)
        probs = torch.softmax(logits, dim=-1)
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1)
    return out
