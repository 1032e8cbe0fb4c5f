"""Input checks shared by every public entry point (reference, kernels, pipelines).

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape, device or
value) with a message that names the argument and says what was expected. Checks that only read tensor
metadata never synchronise with the GPU; the value checks of ``cu_seqlens`` read its contents and therefore
run only where that is free (CPU tensors) or where the caller asks for them (``check_values=True``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(
    value: object,
    name: str,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Checks that ``value`` is a tensor with the given rank, dtype and device; returns it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).removeprefix('torch.')}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {value.device}")
    return value


def check_same_device(named: dict[str, torch.Tensor]) -> torch.device:
    """Checks that all tensors live on one device; returns it."""
    items = list(named.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}: use one device")
    return first.device


def check_cu_seqlens(
    cu_seqlens: object,
    *,
    total: int | None = None,
    device: torch.device | None = None,
    name: str = "cu_seqlens",
    check_values: bool | None = None,
) -> torch.Tensor:
    """Checks a ``cu_seqlens`` vector: int32, 1-D, at least two entries (one sequence).

    Args:
        cu_seqlens: int32 ``[B+1]`` offsets, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == total``.
        total: the packed length ``T`` the offsets must end at (value check).
        device: the device the offsets must be on.
        name: the argument name used in error messages.
        check_values: read the values (monotone, range). ``None`` means: only when the tensor is on the CPU,
            where reading it costs no GPU synchronisation.
    """
    cu = check_tensor(cu_seqlens, name, ndim=1, dtypes=(torch.int32,), device=device)
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least 2 offsets (one sequence), got {cu.numel()}: empty batch")
    if check_values is None:
        check_values = cu.device.type == "cpu"
    if check_values:
        values = cu.detach().cpu()
        if int(values[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(values[0])}")
        if bool((values[1:] < values[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing, got {values.tolist()}")
        if total is not None and int(values[-1]) != total:
            raise ValueError(f"{name}[-1] must equal the packed length {total}, got {int(values[-1])}")
    return cu


def check_max_seqlen(max_seqlen: object, name: str = "max_seqlen") -> int:
    """Checks that ``max_seqlen`` is a positive Python int (an upper bound on every sequence length)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{name} must be a Python int, got {type(max_seqlen).__name__}")
    if max_seqlen < 1:
        raise ValueError(f"{name} must be >= 1, got {max_seqlen}")
    return max_seqlen


def check_keep_mask(keep: object, batch: int, tokens: int, device: torch.device, name: str = "keep") -> torch.Tensor:
    """Checks a bool keep mask ``[B, N]`` whose CLS column (index 0) is all True."""
    keep = check_tensor(keep, name, ndim=2, dtypes=(torch.bool,), device=device)
    if tuple(keep.shape) != (batch, tokens):
        raise ValueError(f"{name} must have shape ({batch}, {tokens}) to match x, got {tuple(keep.shape)}")
    if keep.device.type == "cpu" and batch > 0 and not bool(keep[:, 0].all()):
        raise ValueError(f"{name}[:, 0] must be True: the CLS token (index 0) is always kept")
    return keep


def check_rate(rate: object, name: str) -> float:
    """Checks a keep rate in (0, 1]."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"{name} must be a float in (0, 1], got {type(rate).__name__}")
    if not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {rate}")
    return float(rate)


def check_int(value: object, name: str, minimum: int) -> int:
    """Checks that ``value`` is a Python int (not a bool) ``>= minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_blocks(blocks: object, name: str = "blocks") -> tuple[int, ...]:
    """Checks a stage schedule: a non-empty, strictly increasing sequence of timm block indices; returns a tuple."""
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise TypeError(f"{name} must be a tuple of block indices, got {type(blocks).__name__}")
    blocks = tuple(blocks)
    if not blocks:
        raise ValueError(f"{name} must name at least one block, got ()")
    for i, b in enumerate(blocks):
        check_int(b, f"{name}[{i}]", 0)
    if any(b >= c for b, c in zip(blocks[:-1], blocks[1:], strict=True)):
        raise ValueError(f"{name} must be strictly increasing, got {blocks}")
    return blocks
