"""The registry of fused decisions: device implementations of a pruner's decision, looked up by pruner type.

A pruner's ``forward`` (its :meth:`~ragged_vit.core.selection.Pruner.decide`) is the ground truth. A faster
implementation of the same decision (a Triton kernel, say) registers itself for the pruner's type and a device
type; the pipelines ask :func:`fused_decision` at every stage and fall back to the pruner itself where nothing is
registered. Adding a fused decision for a pruner is one new module that registers it (and one line importing that
module where its package collects its kernels, e.g. ``ragged_vit/triton_impl/__init__.py``): no pipeline code.

A fused decision takes the same :class:`~ragged_vit.core.selection.DecisionInput` and returns the same
:class:`~ragged_vit.core.selection.TokenSelection` as the pruner (kept counts on the device included), validated
input assumed (the pipeline built it). It must make the pruner's decisions: its module says where they may differ
(e.g. fp32 rounding), and its tests compare it with the pruner. The lookup is by exact type, so a subclass that
changes a rule never inherits a kernel written for its parent's rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .selection import DecisionInput, Pruner, TokenSelection

FusedDecision = Callable[[Pruner, DecisionInput], TokenSelection]
"""``fn(pruner, inp) -> TokenSelection``: the pruner's decision on validated input, on a device."""

_REGISTRY: dict[tuple[type[Pruner], str], FusedDecision] = {}


def register_decision(pruner_type: type[Pruner], device_type: str = "cuda") -> Callable[[FusedDecision], FusedDecision]:
    """Decorator: registers ``fn`` as the fused decision of ``pruner_type`` on devices of ``device_type``.

    Raises ``ValueError`` if one is registered already (two kernels for one decision would be ambiguous).
    """
    if not (isinstance(pruner_type, type) and issubclass(pruner_type, Pruner)):
        raise TypeError(f"pruner_type must be a Pruner subclass, got {pruner_type!r}")

    def register(fn: FusedDecision) -> FusedDecision:
        key = (pruner_type, device_type)
        if key in _REGISTRY and _REGISTRY[key] is not fn:
            raise ValueError(f"a fused decision for {pruner_type.__name__} on {device_type!r} is already registered")
        _REGISTRY[key] = fn
        return fn

    return register


def fused_decision(pruner: Pruner, device: torch.device) -> FusedDecision | None:
    """The fused decision registered for ``type(pruner)`` on ``device``'s type, or None."""
    return _REGISTRY.get((type(pruner), device.type))


def registered_decisions() -> dict[tuple[str, str], str]:
    """``{(pruner class name, device type): implementation's qualified name}``, for documentation and tests."""
    return {(t.__name__, d): f"{fn.__module__}.{fn.__qualname__}" for (t, d), fn in _REGISTRY.items()}
