"""Rotary position embedding (RoPE) on packed rows: the ground truth for the rotary variant of the attention kernel.

timm's RoPE ViTs (its ``Eva`` class: EVA-02, DINOv3, Perception Encoder, the ``vit_*_rope_*`` models) rotate each
head's query and key of a patch row by angles that depend on the patch's 2-D position. The model's rope module builds
one **table** row per patch position: ``[sin | cos]``, ``2*D`` values (``D`` the head dim), already laid out for the
rotation it pairs with; the attention then computes ``x * cos + rot(x) * sin`` (dtype promotion to the table's
dtype, the result cast back to ``x``'s), where ``rot`` is one of two layouts (:data:`LAYOUTS`):

* ``"interleaved"``: pairs of neighbours, ``rot(x) = [-x1, x0, -x3, x2, ...]`` (EVA-02, ``vit_*_rope_*``, PE);
* ``"half"``: the two halves, ``rot(x) = [-x[D/2:], x[:D/2]]`` (DINOv3: ``rope_rotate_half=True``).

A rotation turns each pair of lanes by one angle, so timm's tables hold each pair's sin and cos twice
(:func:`table_from_angles`). The rotation here reads them once, from the pair's **first lane** (the first half, or the
even lanes): the second lane's entries are never read, and the kernels read half the table.

A table is shared by every head and block (``[N, 2*D]``: timm's ``RotaryEmbeddingCat``, DINOv3's, MRoPE's) or is
one per head (``[H, N, 2*D]``: one block's slice of RoPE-Mixed's learned frequencies, ``[depth, H, N, 2*D]``).

On the packed layout every row carries its **position**: the index of its patch's table row, or ``-1`` (any value
outside ``[0, N)``) for a row that is not rotated: the prefix rows (class and register tokens, which timm's attention
leaves out of the rotation: its ``num_prefix_tokens``), and a token a pruner makes from several patches (EViT's fused
token). A stage that drops or reorders rows moves the positions with them (:func:`repack_positions`), so a kept patch
keeps its own rotation whatever its row.
"""

from __future__ import annotations

import torch

from ..core.rotary import POSITION_DTYPES, check_rotary
from ..core.validation import check_cu_seqlens, check_int, check_tensor

LAYOUTS = ("interleaved", "half")
"""The rotation layouts (module docstring): ``half=False`` and ``half=True`` in timm's ``apply_rot_embed_cat``."""


def rot(x: torch.Tensor, half: bool) -> torch.Tensor:
    """The partner of every element, signed: ``[-x1, x0, -x3, x2, ...]`` (interleaved) or ``[-x[D/2:], x[:D/2]]``
    (``half``), along the last dimension."""
    if half:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def table_from_angles(angles: torch.Tensor, half: bool = False) -> torch.Tensor:
    """The ``[sin | cos]`` table (``[..., 2*D]``) of ``angles [..., D/2]`` (one per pair of lanes) in the layout's lane
    order, as timm's rope modules lay it out: each value twice, side by side (interleaved) or in both halves."""
    spread = torch.cat([angles, angles], -1) if half else angles.repeat_interleave(2, -1)
    return torch.cat([spread.sin(), spread.cos()], -1)


def pair_values(values: torch.Tensor, half: bool) -> torch.Tensor:
    """Each pair's first-lane entry of ``values [..., D]`` (one half of a table row) copied to both of its lanes."""
    if half:
        first = values[..., : values.shape[-1] // 2]
        return torch.cat([first, first], -1)
    return values[..., 0::2].repeat_interleave(2, -1)


def rotate(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, half: bool = False) -> torch.Tensor:
    """Rows ``x [T, H, D]`` rotated by their positions' table rows, as timm's attention rotates them.

    Args:
        x: queries or keys ``[T, H, D]`` (any strides).
        table: ``[N, 2*D]`` (every head) or ``[H, N, 2*D]`` (one per head): ``[sin | cos]`` of each position.
        positions: int ``[T]``: each row's table row; rows outside ``[0, N)`` (``-1``) are returned unchanged.
        half: the ``"half"`` layout, else ``"interleaved"`` (:data:`LAYOUTS`).

    Returns:
        ``[T, H, D]`` in ``x``'s dtype: ``x * cos + rot(x) * sin`` computed in the promoted dtype of ``x`` and the
        table, then cast (timm's order), each pair's sin and cos read from its first lane (module docstring).
    """
    check_tensor(x, "x", ndim=3)
    total, heads, head_dim = x.shape
    check_rotary(table, positions, total, heads, head_dim, x.device)
    count = table.shape[-2]
    valid = (positions >= 0) & (positions < count)
    index = torch.where(valid, positions, 0).long()
    rows = table[index][:, None] if table.dim() == 2 else table[:, index].transpose(0, 1)  # [T, 1 or H, 2*D]
    sin, cos = (pair_values(t, half) for t in rows.chunk(2, dim=-1))
    rotated = (x * cos + rot(x, half) * sin).to(x.dtype)
    return torch.where(valid[:, None, None], rotated, x)


def rotate_qkv(
    qkv: torch.Tensor, num_heads: int, table: torch.Tensor, positions: torch.Tensor, half: bool = False
) -> torch.Tensor:
    """A new qkv projection ``[T, 3*H*D]`` (timm's layout) with its queries and keys rotated (:func:`rotate`), its
    values copied: what an attention without its own rotation is given."""
    check_tensor(qkv, "qkv", ndim=2)
    q, k, v = qkv.unflatten(1, (3, num_heads, -1)).unbind(1)
    rotated = [rotate(t, table, positions, half) for t in (q, k)]
    return torch.cat([t.flatten(1) for t in (*rotated, v)], dim=1)


def patch_positions(batch: int, tokens: int, num_prefix: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions of an unpruned batch of ``batch`` images of ``tokens`` rows each, its first ``num_prefix``
    prefix rows: int32 ``[B * tokens]``, ``-1`` for the prefix rows and ``0 .. tokens - num_prefix - 1`` for the
    patches, image after image (timm's patch order, the table's row order)."""
    check_int(batch, "batch", 1)
    check_int(num_prefix, "num_prefix", 0)
    check_int(tokens, "tokens", num_prefix)
    one = torch.arange(-num_prefix, tokens - num_prefix, dtype=torch.int32, device=device).clamp_min(-1)
    return one.repeat(batch)


def repack_positions(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, keep: torch.Tensor, extra_token: bool = False
) -> torch.Tensor:
    """The positions of the rows a repack keeps (``keep``, bool ``[T]``), in the repack's order: each image's kept
    rows, then with ``extra_token`` one ``-1`` per image (an appended token has no single position)."""
    check_tensor(positions, "positions", ndim=1, dtypes=POSITION_DTYPES)
    total = positions.shape[0]
    check_cu_seqlens(cu_seqlens, total=total, device=positions.device)
    check_tensor(keep, "keep", ndim=1, dtypes=(torch.bool,), device=positions.device)
    if keep.shape[0] != total:
        raise ValueError(f"keep must have shape ({total},) to match positions, got {tuple(keep.shape)}")
    if not extra_token:
        return positions[keep]
    batch = cu_seqlens.shape[0] - 1
    image = torch.repeat_interleave(torch.arange(batch, device=positions.device), (cu_seqlens[1:] - cu_seqlens[:-1]))
    order = image[keep] * 2  # kept rows sort before their image's appended row, and keep their own order
    rows = torch.cat([positions[keep], positions.new_full((batch,), -1)])
    keys = torch.cat([order, torch.arange(batch, device=positions.device) * 2 + 1])
    return rows[torch.sort(keys, stable=True).indices]
