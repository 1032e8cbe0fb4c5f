"""Counting host dispatches: the top-level operator calls a function issues (what eager pays per op on the host).

At batch 1-4 an eager forward is bound by the host: every operator called from Python costs its binding and dispatch
(tens of microseconds each on the GPU machines: ``docs/tuning.md#host-dispatch-per-op``), whatever the kernel does.
:func:`op_names` lists the operators a call issues at the top level, as ``torch.profiler`` records them
(``aten::linear``, ``aten::dropout``, a backend's custom op, ...; the ops they call in turn, ``aten::addmm`` under
``aten::linear``, are not counted again), and :func:`count_ops` counts them: a deterministic measure to compare two ways
of computing the same thing (a timm block against the pipeline's lean block, an eager forward against timm's), on the
CPU or on CUDA. Not a timing: kernel work and Python between the ops are not in it.

The profiler must not be running already (profilers do not nest).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def _is_op(event) -> bool:
    """An operator call (``namespace::name``), not a user annotation or a runtime call (``cudaLaunchKernel``)."""
    return "::" in event.name and not getattr(event, "is_user_annotation", False)


def _top_level(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return False
        parent = parent.cpu_parent
    return True


def op_names(fn: Callable, *args, **kwargs) -> list[str]:
    """The top-level operators ``fn(*args, **kwargs)`` issues, in call order (``["aten::layer_norm", ...]``).

    ``fn`` runs once, as it is (wrap it in ``torch.no_grad()`` for inference). Only the host's calls are recorded
    (no device activity), so on CUDA nothing needs synchronising.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
    events = sorted((e for e in prof.events() if _is_op(e) and _top_level(e)), key=lambda e: e.time_range.start)
    return [e.name for e in events]


def count_ops(fn: Callable, *args, **kwargs) -> int:
    """How many top-level operators ``fn(*args, **kwargs)`` issues (:func:`op_names`)."""
    return len(op_names(fn, *args, **kwargs))
