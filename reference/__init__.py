"""Pure-PyTorch ground truth (runs on CPU): pruners, packing, padded and ragged attention, the CLS attention row, rotary
position embeddings on packed rows, native-resolution position tables, the fused linear.

Readable before fast. Every kernel in :mod:`ragged_vit.triton_impl` is tested against the function of the same role
here. The types these functions share (pruner interface, selections) and the per-image segment operations live one
layer down, in :mod:`ragged_vit.core`.
"""

from ..core.rotary import Rotary
from .attention import padded_attention, ragged_attention, split_qkv
from .cls_attention import cls_attention
from .packing import cls_rows, pack, repack, total_and_longest, unpack
from .rotary import rotate, rotate_qkv

__all__ = [
    "Rotary",
    "cls_attention",
    "cls_rows",
    "pack",
    "padded_attention",
    "ragged_attention",
    "repack",
    "rotate",
    "rotate_qkv",
    "split_qkv",
    "total_and_longest",
    "unpack",
]
