"""Attention backends behind one interface (:class:`AttentionBackend`), and a registry to build them by name.

A new backend is one new file here plus one line in :data:`BACKENDS`; tests and the CLI pick it up from there.
"""

from __future__ import annotations

from .base import AttentionBackend
from .fa2_varlen import FA2VarlenBackend
from .nested_sdpa import NestedSDPABackend
from .padded_sdpa import PaddedSDPABackend
from .reference import ReferenceBackend
from .triton import TritonBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceBackend,
    "padded_sdpa": PaddedSDPABackend,
    "fa2_varlen": FA2VarlenBackend,
    "nested_sdpa": NestedSDPABackend,
    "triton": TritonBackend,
}


def make_backend(name: str | AttentionBackend) -> AttentionBackend:
    """Builds the backend registered under ``name`` (an :class:`AttentionBackend` instance is returned as is)."""
    if isinstance(name, AttentionBackend):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend must be a backend name or an AttentionBackend, got {type(name).__name__}")
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "FA2VarlenBackend",
    "NestedSDPABackend",
    "PaddedSDPABackend",
    "ReferenceBackend",
    "TritonBackend",
    "make_backend",
]
