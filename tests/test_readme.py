"""The docs' code does what it says: the tested Python blocks of the README and docs/tome.md run as printed, on the
CPU."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOME_DOC = ROOT / "docs" / "tome.md"


def _run_tested_block(path: Path) -> dict[str, object]:
    """Runs the Python block of ``path`` marked as tested (seeded); returns its namespace."""
    match = re.search(r"<!-- tested by tests/test_readme.py -->\n```python\n(.*?)```", path.read_text(), re.S)
    assert match, f"{path.name} lost its tested block"
    namespace: dict[str, object] = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        exec(compile(match.group(1), str(path), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_readme_prune_block_runs_as_printed():
    namespace = _run_tested_block(README)
    model, pv = namespace["model"], namespace["pv"]
    logits, counts = namespace["logits"], namespace["counts"]
    assert pv.model is model and logits.shape == (2, 10)
    assert counts.tolist() == [[138, 97, 68]] * 2  # what the comment says: EViT at 0.7
    assert all(p is q for p, q in zip(pv.model.parameters(), model.parameters(), strict=True))


def test_tome_doc_block_runs_as_printed():
    """docs/tome.md's three modes: the fixed counts its comment prints, ragged adaptive counts, and the calibrated
    threshold at r = 13's mean rows (0.57 of the patches) on the images it was calibrated on."""
    namespace = _run_tested_block(TOME_DOC)
    images, fixed, adaptive, calibrated = (namespace[k] for k in ("images", "fixed", "adaptive", "calibrated"))
    _, counts = fixed(images, return_counts=True)
    assert counts.tolist() == [[183 - 13 * k for k in range(12)]] * 2
    _, counts = adaptive(images, return_counts=True)
    assert (counts[:, -1] < 196).all() and counts[0].tolist() != counts[1].tolist()  # merged, ragged
    _, counts = calibrated(images, return_counts=True)
    assert calibrated.pruner.threshold == namespace["threshold"]
    assert abs(counts.double().mean().item() - 0.57 * 196) <= 1.0
