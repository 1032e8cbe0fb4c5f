"""Benchmarks (not tests): kernel and pipeline timings against PyTorch peers, run on a CUDA GPU.

Nothing here asserts a time. Every result carries the card, torch, triton and git commit it was measured on.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINES = REPO_ROOT / "benchmarks" / "baselines"  # stored results, one directory per card model


def comma_list(text: str | None, kind: Callable = str, choices: Sequence[str] | None = None) -> tuple | None:
    """A comma-separated command-line option as a tuple (None when not given); names must be among ``choices``."""
    if not text:
        return None
    values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    unknown = sorted(set(values) - set(choices)) if choices else []
    if unknown:
        raise ValueError(f"unknown {unknown}; choose from {list(choices)}")
    return values


def has_gpu(prog: str) -> bool:
    """Whether a CUDA GPU is here; without one, says in one line that ``prog`` needs one (the GPU tools then exit:
    nothing to measure on this machine)."""
    import sys

    import torch

    if torch.cuda.is_available():
        return True
    print(f"{prog} needs a CUDA GPU (torch.cuda.is_available() is False): nothing to run here", file=sys.stderr)
    return False


def bench_device(name: str, prog: str):
    """``(device, dtype)`` of a benchmark run on ``name`` (fp16 on CUDA, fp32 on the CPU dry runs), or None after
    :func:`has_gpu`'s line when CUDA is asked for and there is none."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not has_gpu(prog):
        return None
    return device, torch.float16 if device.type == "cuda" else torch.float32
