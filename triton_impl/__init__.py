"""Triton kernels: sync-free token packing, bidirectional ragged attention, fused pruning decisions.

Each module mirrors the reference of the same role: ``attention`` <-> :mod:`ragged_vit.reference.attention`,
``pack`` <-> :mod:`ragged_vit.reference.packing`, ``select`` <-> :func:`ragged_vit.core.segments.segment_rank`,
``cls_attention`` <-> :mod:`ragged_vit.reference.cls_attention`, ``threshold_l2`` / ``dynamicvit`` / ``evit`` / ``ats``
<-> the pruners of the same names in :mod:`ragged_vit.reference.pruners`, ``merging`` (ToMe's matching and merge) <->
:mod:`ragged_vit.reference.merging`.
Kernels assume validated input; validation happens at the public functions.

The fused decisions register themselves for their pruner types (:mod:`ragged_vit.core.decisions`) when their
modules are imported, which importing this package does: a new fused decision is one new module plus one line here.
"""

from . import ats, dynamicvit, evit, merging, threshold_l2  # noqa: F401  (register their fused decisions)
