"""Triton kernels: sync-free token packing and bidirectional ragged attention.

Each module mirrors the reference of the same role: ``attention`` <-> ``ragged_vit.reference.attention``, ``pack`` <->
``ragged_vit.reference.packing``. Kernels assume validated input; validation happens at the public functions.
"""
