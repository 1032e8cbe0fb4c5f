"""The rotation of a RoPE ViT's queries and keys as a type, and its check: what the reference
(:mod:`ragged_vit.reference.rotary`), the kernels and a decision's input (:class:`ragged_vit.core.selection.
DecisionInput`) pass around."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .validation import check_tensor

POSITION_DTYPES = (torch.int32, torch.int64)


class Rotary(NamedTuple):
    """The rotation an attention applies to its queries and keys as it reads them (``rotary=`` of the attention
    entries): ``table`` ``[N, 2*D]`` or ``[H, N, 2*D]`` (``[sin | cos]`` per position), ``positions`` int ``[T]`` (each
    row's table row; outside ``[0, N)``: unrotated), ``half`` (the layout)."""

    table: torch.Tensor
    positions: torch.Tensor
    half: bool = False


def check_rotary(
    table: torch.Tensor, positions: torch.Tensor, total: int, heads: int, head_dim: int, device: torch.device
) -> None:
    """Raises ``TypeError``/``ValueError`` naming ``rotary`` unless ``table`` (``[N, 2*D]`` or ``[H, N, 2*D]``,
    floating point) and ``positions`` (int32/int64 ``[T]``) fit rows of ``heads`` heads of ``head_dim``."""
    check_tensor(table, "rotary table", dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                 device=device)  # fmt: skip
    check_tensor(positions, "rotary positions", ndim=1, dtypes=POSITION_DTYPES, device=device)
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}")
    if table.dim() not in (2, 3) or table.shape[-1] != 2 * head_dim or (table.dim() == 3 and table.shape[0] != heads):
        raise ValueError(
            f"rotary table must be [N, {2 * head_dim}] or [{heads}, N, {2 * head_dim}] ([sin | cos] per position), "
            f"got {tuple(table.shape)}"
        )
    if positions.shape[0] != total:
        raise ValueError(f"rotary positions must hold one index per row ({total}), got {positions.shape[0]}")
