"""Token-pruned timm ViTs end to end (pack, attend, unpack) over interchangeable attention backends, and the demo.

Modules: ``plan`` (the forward plan, built once from model and pruner), ``model`` (:class:`PrunedViT`, the eager
executor), ``graphs`` (:class:`GraphedPrunedViT`, the CUDA-graph executor) and ``buckets`` (its token budgets),
``packed_block`` (a timm block on a packed buffer), ``backends`` (one attention interface, five implementations),
``patch_embed`` (the GEMM patch embedding), ``weights`` (local checkpoints only), ``factory`` (names to a
pipeline), ``images`` / ``demo`` / ``cli`` (the command line). The public API is re-exported by :mod:`ragged_vit`.
"""
