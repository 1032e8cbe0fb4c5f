"""Low-overhead repeated launches of a compiled Triton kernel.

``kernel[grid](...)`` binds and specialises every argument on every call, which costs the host several times
what launching the already compiled kernel through its own ``run`` does (``python -m ci.dispatch_profile``;
``docs/tuning.md#compiled-launcher``). :class:`CompiledLauncher` keeps the compiled kernel per caller-supplied key
and launches it directly.

The key must capture everything Triton specialises on for the arguments that vary: dtypes, 16-byte alignment of
every pointer, and for integers ``== 1`` / ``% 16 == 0`` (pass ``do_not_specialize`` for the integers that the
key leaves out). The first call with a key, every call with ``key=None``, calls under the interpreter and calls
while Triton launch hooks (profilers) are installed all go through Triton's normal path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Sequence

import torch
import triton.language as tl

try:
    from triton import knobs as _knobs
except ImportError:  # triton < 3.4 has no knobs module: always take Triton's own path
    _knobs = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Whether this process builds its kernels for Triton's interpreter (CPU tensors): decided when the kernel modules
are first imported, as Triton itself decides it."""
# The raw handle of the current stream without building a torch.cuda.Stream object (what Inductor's generated
# launchers use); the public API is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is on a GPU at a 16-byte aligned address: a launch key's precondition (an unaligned
    pointer takes Triton's own, specialising path)."""
    return all(t.is_cuda and t.data_ptr() % 16 == 0 for t in tensors)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers (``b > 0``), as ``triton.cdiv``. In the Triton versions we run (3.6 on the
    GPU machines, 3.8 here) ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: every host call
    goes through their wrapper (an import and two comprehensions, far slower than the arithmetic), and a launch
    path sizes its grid and tiles with a few of them per launch (``docs/tuning.md#host-grid-helpers``)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 that is ``>= n`` for a host integer ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``
    (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def scratch(lengths: Sequence[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat buffers of ``lengths`` elements of ``dtype`` (at most 16 bytes each), views of ONE allocation (one host op
    instead of one per buffer, at every stage of an eager forward), each at a multiple of 16 bytes from its start, so
    each is as :func:`aligned` as the allocation. Their contents are as allocated."""
    align = 16 // dtype.itemsize
    sizes = [part for n in lengths for part in (n, -n % align)]  # each buffer, then its padding
    return list(torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes)[::2])


try:  # programmatic dependent launch: a compile option of Triton's CUDA backend, and the kernels' instructions
    from triton.backends.nvidia.compiler import CUDAOptions

    _KNOWS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
except (ImportError, AttributeError):
    _KNOWS_PDL = False


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` may be launched with programmatic dependent launch (PDL: a
    launch may start while the kernel before it in the stream runs, and waits for it with ``gdc_wait``): a GPU of
    compute capability 9.0 or newer and a Triton that has the ``launch_pdl`` option; never under the interpreter."""
    return _KNOWS_PDL and not INTERPRETED and torch.cuda.get_device_capability(device_index)[0] >= 9


def int_spec(value: int) -> tuple[bool, bool]:
    """What Triton specialises a (specialised) integer argument on: ``== 1`` and ``% 16 == 0``."""
    return value == 1, value % 16 == 0


def _installed(hook: object) -> bool:
    # Newer Triton keeps an always-present HookChain whose ``calls`` list is empty when nothing is installed.
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


def _hooks_installed() -> bool:
    if _knobs is None:
        return True
    runtime = _knobs.runtime
    return _installed(runtime.launch_enter_hook) or _installed(runtime.launch_exit_hook)


class CompiledLauncher:
    """Launches one ``@triton.jit`` kernel, reusing its compiled handle per specialisation key.

    Args:
        kernel: the ``@triton.jit`` function.
    """

    def __init__(self, kernel) -> None:
        self._kernel = kernel
        self._compiled: dict[Hashable, object] = {}

    def __call__(
        self,
        key: Hashable | None,
        device: int,
        grid: tuple[int, ...],
        args: Sequence[object],
        *,
        num_warps: int,
        num_stages: int,
        **options: object,
    ) -> None:
        """Launches ``kernel[grid](*args)`` (a grid of 1 to 3 dimensions) on CUDA device ``device`` (the current
        one, as Triton requires); ``args`` holds every parameter, constexprs included, in signature order;
        ``options`` are further compile options (e.g. ``enable_fp_fusion=False``, ``launch_pdl=True``), the same
        for every call with one key (they are compiled into the handle kept for it)."""
        compiled = self._compiled.get((device, key)) if key is not None else None
        if compiled is not None and not _hooks_installed():
            stream = _raw_stream(device) if _raw_stream else torch.cuda.current_stream(device).cuda_stream
            gx, gy, gz = (*grid, 1, 1)[:3]
            compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
            return
        if INTERPRETED:
            options = {}  # the interpreter computes in numpy: no compile options, no FMA contraction
        compiled = self._kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **options)
        if key is not None and not INTERPRETED and hasattr(compiled, "packed_metadata"):
            self._compiled[(device, key)] = compiled  # a compiled handle belongs to one device

    def cache_size(self) -> int:
        """Number of cached compiled specialisations (for tests)."""
        return len(self._compiled)
