"""The lowest layer, which every other subpackage stands on: shared types, the fused-decision registry, input
validation and per-image segment operations on the packed layout. It imports nothing of ragged_vit.

Modules: ``selection`` (:class:`Placement`, :class:`DecisionInput`, :class:`TokenSelection`, :class:`Pruner`),
``rotary`` (:class:`Rotary`, a RoPE model's rotation of queries and keys, and its check),
``decisions`` (fused device decisions registered per pruner type), ``validation`` (argument checks with messages
that name the argument), ``segments`` (per-image sums, softmax, ranks on ``[T, ...]`` + ``cu_seqlens``).
"""
