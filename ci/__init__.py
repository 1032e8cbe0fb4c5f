"""The repository's GPU tools (not installed): the GPU suite, profiles, tuning sweeps, the model-family runs."""

from __future__ import annotations

import sys

import torch


def has_gpu(prog: str) -> bool:
    """Whether a CUDA GPU is here; without one, says in one line that ``prog`` needs one (the tool then exits 0:
    nothing to measure on this machine)."""
    if torch.cuda.is_available():
        return True
    print(f"{prog} needs a CUDA GPU (torch.cuda.is_available() is False): nothing to run here", file=sys.stderr)
    return False
