"""Token-pruned timm ViTs end to end (pack, attend, unpack) over interchangeable attention backends, and the demo.

Modules: ``plan`` (the forward plan and its programs), ``executor`` (the one loop that runs a program, and the
repack strategies), ``stages`` (prune and merge stages), ``state`` (a forward's working memory and output),
``parts`` (the plain or compiled functions the steps call), ``model`` (:class:`PrunedViT`: its modes and eager entry
points), ``graphs`` (:class:`GraphedPrunedViT`, the CUDA-graph runner) and ``buckets`` (its token budgets),
``packed_block`` (a timm block on a packed buffer), ``backends`` (one attention interface, five implementations),
``patch_embed`` (the GEMM patch embedding), ``weights`` (local checkpoints only), ``factory`` (names to a
pipeline); ``apps`` (the command line: the demo and ``validate``). The public API is re-exported by :mod:`ragged_vit`.
"""
