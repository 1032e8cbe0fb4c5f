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
  count never grows);
* **calibrated** (``rate`` with ``r_max``): the adaptive mode with its threshold set by
  :meth:`ragged_vit.pipelines.model.PrunedViT.calibrate`, which bisects it on the pipeline's own forward of a
  calibration batch until the mean patch rows per image and merging stage (after each stage's merge, prefix rows
  excluded: the mean of ``PrunedOutput.counts``) is ``rate * num_patches`` (the quantity :meth:`ToMeMerger.
  from_keep_rate` maps a keep rate onto in the fixed mode: r=13 on 196 patches gives 0.57). Until then
  ``threshold`` is None and a forward raises ``RuntimeError``; the mode stays ``"calibrated"`` afterwards (calibrate
  again on other images; a ``GraphedPrunedViT`` sees the new threshold and refuses to run until ``reset()``, so
  calibrate before graphing).

The decision here is the reference's, on the device it is given; the Triton matching kernel
(:mod:`ragged_vit.triton_impl.merging`) registers as its fused decision on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core.segments import seqlens
from ...core.selection import DecisionInput, MergeSelection, Placement, Pruner
from ...core.validation import check_rate
from ..attention import split_qkv
from ..merging import check_merge_mode, decide_merges, fixed_r_counts, merge_count
from ..tome import per_block


class ToMeMerger(Pruner):
    """ToMe's merge as a pipeline stage in every block with something to merge.

    Exactly one mode: ``r`` (fixed), ``threshold`` with ``r_max`` (adaptive) or ``rate`` with ``r_max`` (calibrated:
    ``threshold`` is None until :meth:`ragged_vit.pipelines.model.PrunedViT.calibrate` sets it).

    Args:
        r: fixed mode: A rows merged per image and block, one int for every block or one per block (``depth``).
        threshold: adaptive mode: the cosine similarity an A row's best match must reach to merge.
        r_max: the adaptive and calibrated modes' cap per image and block (an int, or one per block).
        rate: calibrated mode: the target in ``(0, 1]``, mean patch rows per image and merging stage over the
            unmerged patch count.
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
        rate: float | None = None,
        depth: int = 12,
    ) -> None:
        super().__init__()
        if rate is not None:
            if r is not None or threshold is not None:
                given = f"r={r!r}" if r is not None else f"threshold={threshold!r}"
                raise ValueError(f"rate sets the calibrated mode (its threshold is calibrated): not with {given}")
            if r_max is None:
                raise ValueError("r_max must be given with rate (the most A rows an image merges per block), got None")
            self.rate: float | None = check_rate(rate, "rate")
            self.threshold: float | None = None
        else:
            if r is None and threshold is None and r_max is not None:
                raise ValueError(
                    "r_max caps the adaptive or the calibrated mode: give threshold or rate with it, got "
                    f"r_max={r_max!r} alone"
                )
            self.rate = None
            self.threshold = check_merge_mode(r, threshold, r_max)
        fixed = r is not None
        self._mode = "fixed" if fixed else "adaptive" if rate is None else "calibrated"
        self.limits = per_block(r if fixed else r_max, "r" if fixed else "r_max", depth)
        self.blocks = tuple(k for k, limit in enumerate(self.limits) if limit > 0)
        if not self.blocks:
            raise ValueError(f"{'r' if fixed else 'r_max'} must be > 0 in at least one block, got 0")
        self.fixed_count = fixed
        self.depth = depth

    @property
    def mode(self) -> str:
        """``"fixed"``, ``"adaptive"`` or ``"calibrated"`` (still ``"calibrated"`` once its threshold is set)."""
        return self._mode

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
        """``r``, or ``threshold`` with ``r_max``, as given (``keep_rate`` unused); ``r_max`` alone: the calibrated
        mode at ``rate=keep_rate`` (refused if ``r_max`` merging in every block cannot get down to ``keep_rate``);
        none of them: the constant ``r`` whose mean patch count over the blocks (after each block's merge) is nearest
        ``keep_rate * num_patches`` (r=13 on DeiT-B's 196 patches: 0.57). A keep rate that maps to ``r = 0`` (1.0, and
        any above the midpoint to ``r = 1``'s) is no merger: refused, with the keep rates that merge."""
        if r is None and threshold is None and r_max is not None:
            merger = cls(r_max=r_max, rate=check_rate(keep_rate, "keep_rate"), depth=depth)
            merger.check_target(num_patches, "keep_rate")
            return merger
        if r is None and threshold is None:
            check_rate(keep_rate, "keep_rate")
            target = keep_rate * num_patches

            def miss(r_k: int) -> float:
                return abs(sum(fixed_r_counts(num_patches, [r_k] * depth, 0)) / depth - target)

            r = min(range(num_patches // 2 + 1), key=miss)
            if r == 0:  # nearer to no merge at all than to one row a block
                one = sum(fixed_r_counts(num_patches, [1] * depth, 0)) / depth / num_patches
                raise ValueError(
                    f"keep_rate={keep_rate} maps to r = 0 for tome (no merge in any block): a constant r merges at "
                    f"keep rates below {(1 + one) / 2:.4f} (r = 1 keeps {one:.4f} of the patch rows on average); "
                    "for the unpruned model use pruner 'none', or give r=, or threshold= with r_max="
                )
        return cls(r, threshold=threshold, r_max=r_max, depth=depth)

    def extra_repr(self) -> str:
        if self.mode == "fixed":
            return f"mode='fixed', r={_compact(self.limits)}"
        rate = f", rate={self.rate}" if self.mode == "calibrated" else ""
        return f"mode={self.mode!r}{rate}, threshold={self.threshold}, r_max={_compact(self.limits)}"

    def check_ready(self) -> None:
        if self.threshold is None and self.mode == "calibrated":
            raise RuntimeError(
                "ToMeMerger(mode='calibrated') has no threshold yet: call PrunedViT.calibrate(images) first"
            )

    def limit(self, stage: int) -> int:
        """``r`` (fixed) or ``r_max`` (adaptive, calibrated) of stage ``stage``'s block."""
        return self.limits[self.blocks[stage]]

    def capped_counts(self, num_patches: int) -> list[int]:
        """Patch rows of an image of ``num_patches`` after each stage when it merges its full ``r`` or ``r_max``
        every time: the fixed mode's counts, the fewest the adaptive and calibrated modes can leave."""
        counts, patches = [], num_patches
        for stage in range(len(self.blocks)):
            patches -= merge_count(patches, self.limit(stage))
            counts.append(patches)
        return counts

    def check_target(self, num_patches: int, name: str = "rate") -> float:
        """The calibrated mode's target for images of ``num_patches`` patches, ``rate * num_patches`` rows per image
        and stage; ``ValueError`` (naming the rate ``name``) if ``r_max`` merging in every stage leaves more on
        average (out of reach)."""
        if self.mode != "calibrated":
            raise ValueError(f"a target count needs mode='calibrated', this merger has mode={self.mode!r}")
        target = self.rate * num_patches
        counts = self.capped_counts(num_patches)
        fewest = sum(counts) / len(counts)
        if target < fewest:
            raise ValueError(
                f"{name}={self.rate} asks for {target:.4g} patch rows per image and stage of {num_patches}, fewer than "
                f"the {fewest:.4g} that r_max={_compact(self.limits)} leaves merging its most in every stage: raise "
                f"{name} or r_max"
            )
        return target

    def count_after(self, stage: int, patches: int, num_patches: int) -> int | None:
        if self.mode != "fixed":
            return None
        return patches - merge_count(patches, self.limit(stage))

    def max_count_after(self, stage: int, patches: int, num_patches: int) -> int:
        return patches if self.mode != "fixed" else self.count_after(stage, patches, num_patches)

    def check_input(self, inp: object) -> DecisionInput:
        inp = super().check_input(inp)
        if inp.qkv is None:
            raise ValueError("inp.qkv is required by ToMe (it matches rows by their attention keys), got None")
        if inp.rotary is not None:  # a merged row would stand for several patch positions
            raise ValueError("inp.rotary: ToMe does not merge the rows of a RoPE model (one rotation per row)")
        return inp

    def decide(self, inp: DecisionInput) -> MergeSelection:
        """The reference matching (:func:`ragged_vit.reference.merging.decide_merges`) on the block's keys."""
        keys = split_qkv(inp.qkv, inp.num_heads)[1]  # [T, H, D], after k_norm (the pipelines' qkv has it)
        # A non-finite key (the graph runner's padding rows hold anything) counts as a zero key: similarity 0 to
        # every row, so the map stays valid (decide_merges itself refuses them; the kernel ranks their rows last).
        keys = torch.nan_to_num(keys, nan=0.0, posinf=0.0, neginf=0.0)
        ones = torch.ones(keys.shape[0], dtype=torch.int64, device=keys.device)  # sizes: not needed to decide
        mode = {"r": self.limit(inp.stage)} if self.mode == "fixed" else {
            "threshold": self.threshold, "r_max": self.limit(inp.stage)}  # fmt: skip
        merged = decide_merges(keys, inp.cu_seqlens, ones, inp.num_prefix, **mode)
        return MergeSelection(merged.destination, seqlens(merged.cu_seqlens).int(), merged.cu_seqlens,
                              *fixed_count(self, inp))  # fmt: skip


def fixed_count(merger: ToMeMerger, inp: DecisionInput) -> tuple[bool, int | None]:
    """``(fixed_count, count)`` of a merge decision on ``inp``: the host count (prefix rows included) in the fixed
    mode on a uniform batch (every image ``inp.uniform_rows`` rows); none for a batch of several image sizes."""
    rows = inp.uniform_rows
    if merger.mode != "fixed" or rows is None:
        return False, None
    return True, inp.num_prefix + merger.count_after(inp.stage, rows - inp.num_prefix, inp.num_patches)


def _compact(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(set(values)) == 1 else str(list(values))

