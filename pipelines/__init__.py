"""Token-pruned timm ViTs end to end (pack, attend, unpack) over interchangeable attention backends, and the demo.

Modules: ``backends`` (one attention interface, five implementations), ``packed_block`` (a timm block on a
packed buffer), ``model`` (:class:`PrunedViT`), ``weights`` (local checkpoints only), ``factory`` (names to a
pipeline), ``images`` (demo images and preprocessing), ``demo`` / ``__main__`` (the CLI).

Attributes are imported lazily: importing timm imports ``triton.language``, and Triton's interpreter
(``TRITON_INTERPRET=1``, the only way to run the Triton backend on a CPU) must be switched on before that. The CLI
(``python -m pipelines``) imports this package first and decides afterwards.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PrunedViT": "pipelines.model",
    "PrunedOutput": "pipelines.model",
    "BACKENDS": "pipelines.backends",
    "AttentionBackend": "pipelines.backends",
    "make_backend": "pipelines.backends",
    "create_model": "pipelines.weights",
    "load_checkpoint": "pipelines.weights",
    "PRUNER_NAMES": "pipelines.factory",
    "build_pruner": "pipelines.factory",
    "build_pipeline": "pipelines.factory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
