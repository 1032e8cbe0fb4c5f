"""Pure-PyTorch ground truth (runs on CPU): pruners, packing, padded and ragged attention.

Readable before fast. Every kernel in ``triton_impl`` is tested against the function of the same role here.
"""

from reference.attention import padded_attention, ragged_attention, split_qkv
from reference.cls_attention import cls_attention
from reference.packing import cls_rows, pack, repack, unpack
from reference.segments import cu_seqlens_from_counts, segment_ids, seqlens, uniform_cu_seqlens
from reference.selection import Placement, PruneInput, Pruner, TokenSelection

__all__ = [
    "Placement",
    "PruneInput",
    "Pruner",
    "TokenSelection",
    "cls_attention",
    "cls_rows",
    "cu_seqlens_from_counts",
    "pack",
    "padded_attention",
    "ragged_attention",
    "repack",
    "segment_ids",
    "seqlens",
    "split_qkv",
    "uniform_cu_seqlens",
    "unpack",
]
