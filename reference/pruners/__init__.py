"""The reference pruners (and ToMe's merger) on the packed layout, and a registry to build them by name.

Adding a pruner is one new file here plus one line in :data:`PRUNERS`; tests and pipelines pick it up from there.
"""

from __future__ import annotations

from ...core.selection import Pruner
from .ats import ATSPruner
from .dynamicvit import DynamicViTPruner, PredictorLG
from .evit import EViTPruner
from .threshold_l2 import ThresholdL2Pruner
from .tome import ToMeMerger

PRUNERS: dict[str, type[Pruner]] = {
    "threshold_l2": ThresholdL2Pruner,
    "dynamicvit": DynamicViTPruner,
    "evit": EViTPruner,
    "ats": ATSPruner,
    "tome": ToMeMerger,
}


def make_pruner(name: str, **kwargs: object) -> Pruner:
    """Builds the pruner registered under ``name`` with ``kwargs`` (see each class for its arguments)."""
    if name not in PRUNERS:
        raise ValueError(f"name must be a registered pruner, got {name!r}; known: {', '.join(PRUNERS)}")
    return PRUNERS[name](**kwargs)


__all__ = [
    "PRUNERS",
    "ATSPruner",
    "DynamicViTPruner",
    "EViTPruner",
    "PredictorLG",
    "ThresholdL2Pruner",
    "ToMeMerger",
    "make_pruner",
]
