"""The README's code does what it says: its tested Python block runs as printed, on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _tested_block() -> str:
    text = README.read_text()
    match = re.search(r"<!-- tested by tests/test_readme.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its tested block"
    return match.group(1)


def test_readme_prune_block_runs_as_printed():
    namespace: dict[str, object] = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        exec(compile(_tested_block(), str(README), "exec"), namespace)  # noqa: S102 - our own README
    model, pv = namespace["model"], namespace["pv"]
    logits, counts = namespace["logits"], namespace["counts"]
    assert pv.model is model and logits.shape == (2, 10)
    assert counts.tolist() == [[138, 97, 68]] * 2  # what the comment says: EViT at 0.7
    assert all(p is q for p, q in zip(pv.model.parameters(), model.parameters(), strict=True))
