"""ToMe as a stage of the pipelines: token merging in every block, after the attention residual.

Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023; the rule (bipartite soft matching on the block's
keys, size-weighted merges, prefix rows protected) is :mod:`ragged_vit.reference.merging`'s, stated in
``docs/tome.md``. :class:`ToMeMerger` is that rule as a :class:`~ragged_vit.core.selection.Pruner` whose decision is
a :class:`~ragged_vit.core.selection.MergeSelection` (``merges = True``): the pipelines apply it as a size-weighted
average, carry every row's size, and add ``log(size)`` of every key to the attention logits of the later blocks
(proportional attention). One stage per merging block (``MID_BLOCK``; a block with ``r = 0`` is no stage).

* **fixed** (``r``): each image merges ``min(r, patches // 2)`` rows per block: counts known on the host, so the
  whole forward is one CUDA graph;
* **adaptive** (``threshold`` with ``r_max``): each image merges its A rows whose best similarity is at least the
  threshold, at most ``min(r_max, patches // 2)`` per block: a different count per image (variable-count stages; a
  count never grows).

The decision here is the reference's, on the device it is given; the Triton matching kernel
(:mod:`ragged_vit.triton_impl.merging`) registers as its fused decision on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragged_vit.core.segments import seqlens
from ragged_vit.core.selection import DecisionInput, MergeSelection, Placement, Pruner
from ragged_vit.core.validation import check_rate
from ragged_vit.reference.attention import split_qkv
from ragged_vit.reference.merging import check_merge_mode, decide_merges, fixed_r_counts, merge_count
from ragged_vit.reference.tome import per_block


class ToMeMerger(Pruner):
    """ToMe's merge as a pipeline stage in every block with something to merge.

    Args:
        r: fixed mode: A rows merged per image and block, one int for every block or one per block (``depth``).
        threshold: adaptive mode: the cosine similarity an A row's best match must reach to merge.
        r_max: adaptive mode's cap per image and block (an int, or one per block).
        depth: the model's blocks (``len(model.blocks)``).
    """

    name = "tome"
    placement = Placement.MID_BLOCK
    needs_keys = True
    merges = True

    def __init__(
        self,
        r: int | Sequence[int] | None = None,
        *,
        threshold: float | None = None,
        r_max: int | Sequence[int] | None = None,
        depth: int = 12,
    ) -> None:
        super().__init__()
        self.threshold = check_merge_mode(r, threshold, r_max)
        self.limits = per_block(r if self.threshold is None else r_max, "r" if self.threshold is None else "r_max",
                                depth)  # fmt: skip
        self.blocks = tuple(k for k, limit in enumerate(self.limits) if limit > 0)
        if not self.blocks:
            raise ValueError(f"{'r' if self.threshold is None else 'r_max'} must be > 0 in at least one block, got 0")
        self.fixed_count = self.threshold is None
        self.depth = depth

    @classmethod
    def from_keep_rate(
        cls,
        keep_rate: float,
        *,
        embed_dim: int,
        num_patches: int,
        depth: int = 12,
        r: int | None = None,
        threshold: float | None = None,
        r_max: int | None = None,
    ) -> ToMeMerger:
        """``r`` or ``threshold`` with ``r_max`` as given; with neither, the constant ``r`` whose mean patch count
        over the blocks (after each block's merge) is nearest ``keep_rate * num_patches`` (r=13 on DeiT-B's 196
        patches: 0.57). A keep rate of 1.0 gives ``r = 0``, which is no merger: refused."""
        if r is None and threshold is None and r_max is None:
            check_rate(keep_rate, "keep_rate")
            target = keep_rate * num_patches

            def miss(r_k: int) -> float:
                return abs(sum(fixed_r_counts(num_patches, [r_k] * depth, 0)) / depth - target)

            r = min(range(num_patches // 2 + 1), key=miss)
        return cls(r, threshold=threshold, r_max=r_max, depth=depth)

    def extra_repr(self) -> str:
        if self.threshold is None:
            return f"r={_compact(self.limits)}"
        return f"threshold={self.threshold}, r_max={_compact(self.limits)}"

    def limit(self, stage: int) -> int:
        """``r`` (fixed) or ``r_max`` (adaptive) of stage ``stage``'s block."""
        return self.limits[self.blocks[stage]]

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        if self.threshold is not None:
            return None
        return patches - merge_count(patches, self.limit(stage))

    def max_count_after(self, stage: int, patches: int, num_patches: int) -> int:
        return patches if self.threshold is not None else self.count_after(stage, patches, num_patches)

    def check_input(self, inp: object) -> DecisionInput:
        inp = super().check_input(inp)
        if inp.qkv is None:
            raise ValueError("inp.qkv is required by ToMe (it matches rows by their attention keys), got None")
        return inp

    def decide(self, inp: DecisionInput) -> MergeSelection:
        """The reference matching (:func:`ragged_vit.reference.merging.decide_merges`) on the block's keys."""
        keys = split_qkv(inp.qkv, inp.num_heads)[1]  # [T, H, D], after k_norm (the pipelines' qkv has it)
        # A non-finite key (the graph runner's padding rows hold anything) counts as a zero key: similarity 0 to
        # every row, so the map stays valid (decide_merges itself refuses them; the kernel ranks their rows last).
        keys = torch.nan_to_num(keys, nan=0.0, posinf=0.0, neginf=0.0)
        ones = torch.ones(keys.shape[0], dtype=torch.int64, device=keys.device)  # sizes: not needed to decide
        mode = {"r": self.limit(inp.stage)} if self.threshold is None else {
            "threshold": self.threshold, "r_max": self.limit(inp.stage)}  # fmt: skip
        merged = decide_merges(keys, inp.cu_seqlens, ones, inp.num_prefix, **mode)
        return MergeSelection(merged.destination, seqlens(merged.cu_seqlens).int(), merged.cu_seqlens,
                              *fixed_count(self, inp))  # fmt: skip


def fixed_count(merger: ToMeMerger, inp: DecisionInput) -> tuple[bool, int | None]:
    """``(fixed_count, count)`` of a merge decision on ``inp``: the host count (prefix rows included) in the fixed
    mode, where every image has the same rows (the batch is uniform: ``T // B`` rows each)."""
    if merger.threshold is not None:
        return False, None
    batch = inp.cu_seqlens.numel() - 1
    patches = inp.x.shape[0] // batch - inp.num_prefix
    return True, inp.num_prefix + merger.count_after(inp.stage, patches, inp.num_patches)


def _compact(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(set(values)) == 1 else str(list(values))

