"""ragged-vit: dispatch-aware ragged attention for token-pruned Vision Transformers.

One import package. Its subpackages, from the bottom of the import graph up:

* :mod:`ragged_vit.core` -- the shared types (:class:`~ragged_vit.core.selection.Pruner`,
  :class:`~ragged_vit.core.selection.DecisionInput`, :class:`~ragged_vit.core.selection.TokenSelection`,
  placement), the fused-decision registry, input validation and per-image segment operations.
* :mod:`ragged_vit.reference` -- the pure-PyTorch ground truth (runs on CPU): pruners, packing, attention.
* :mod:`ragged_vit.triton_impl` -- the Triton kernels, each beside its reference.
* :mod:`ragged_vit.pipelines` -- timm ViTs end to end: the forward plan and the one executor that runs it, eagerly
  or from CUDA graphs (the default call's fast path),
  attention backends, checkpoints, the CLI.

The public API below is imported lazily: importing timm imports ``triton.language``, and Triton's interpreter
(``TRITON_INTERPRET=1``, how the Triton kernels run on a CPU) must be switched on before that happens.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "PrunedViT": "ragged_vit.pipelines.model",
    "PrunedOutput": "ragged_vit.pipelines.state",
    "EagerFallbackWarning": "ragged_vit.pipelines.model",
    "GraphedPrunedViT": "ragged_vit.pipelines.graphs",
    "TokenBuckets": "ragged_vit.pipelines.buckets",
    "BACKENDS": "ragged_vit.pipelines.backends",
    "AttentionBackend": "ragged_vit.pipelines.backends",
    "make_backend": "ragged_vit.pipelines.backends",
    "PRUNERS": "ragged_vit.reference.pruners",
    "PRUNER_NAMES": "ragged_vit.pipelines.factory",
    "build_pruner": "ragged_vit.pipelines.factory",
    "build_pipeline": "ragged_vit.pipelines.factory",
    "prune": "ragged_vit.pipelines.factory",
    "create_model": "ragged_vit.pipelines.weights",
    "load_checkpoint": "ragged_vit.pipelines.weights",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ragged_vit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
