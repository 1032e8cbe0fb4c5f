"""Benchmarks (not tests): kernel and pipeline timings against PyTorch peers, run on a CUDA GPU.

Nothing here asserts a time. Every result carries the card, torch, triton and git commit it was measured on.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINES = REPO_ROOT / "benchmarks" / "baselines"  # stored results, one directory per card model
