"""Stage schedules at any depth: the papers place their stages for 12-block ViTs (DeiT); a model of another depth
gets them at the same fractions of its depth.

Block ``b`` of a 12-block schedule becomes block ``floor(b * depth / 12)``: 3, 6, 9 stay 3, 6, 9 at depth 12, become
6, 12, 18 at 24 (ViT-L), 8, 16, 24 at 32 (ViT-H) and 1, 2, 3 at 4.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.validation import check_int

BASE_DEPTH = 12
"""The depth the published schedules are written for."""


def at_depth(blocks: Sequence[int], depth: int, *, merge: bool, name: str) -> tuple[int, ...]:
    """The blocks of a schedule published for :data:`BASE_DEPTH` blocks, at the same fractions of ``depth`` blocks.

    ``merge``: stages that land on one block become one (a schedule over a range of blocks, as ATS's blocks 3-11);
    else two stages on one block raise ``ValueError`` naming ``name`` (stages whose keep rates compound, as
    DynamicViT's and EViT's: fewer stages would be another method).
    """
    check_int(depth, "depth", 1)
    scaled = [b * depth // BASE_DEPTH for b in blocks]
    if merge:
        return tuple(sorted(set(scaled)))
    if len(set(scaled)) != len(scaled):
        raise ValueError(
            f"{name}'s {len(scaled)} stages (blocks {tuple(blocks)} of {BASE_DEPTH}) cannot be placed in {depth} "
            f"blocks: at the same fractions of the depth they fall on blocks {tuple(scaled)}; build the pruner with "
            f"blocks= of your own (ragged_vit.PRUNERS[{name!r}](blocks=...), then PrunedViT(model, pruner))"
        )
    return tuple(scaled)
