"""The docs' code does what it says: the tested Python blocks of the README and docs/tome.md run as printed, on the
CPU; the README keeps its shape (the call first, the commands CI runs verbatim, the results tables as generated from
the stored runs, links that resolve)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOME_DOC = ROOT / "docs" / "tome.md"
CI_COMMANDS = (  # CI runs these two verbatim (.ci/run the test command): they stay exactly as printed
    "python -m pip install nox && python -m nox -s tests",
    "python -m pip install nox && python -m nox -s demo",
)


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


def test_readme_opens_with_the_call():
    """The first Python block is the default call on your own model (the tested one), within the first 50 lines."""
    lines = README.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("```python"))
    assert first < 50 and lines[first - 1] == "<!-- tested by tests/test_readme.py -->"
    block = "\n".join(lines[first : lines.index("```", first + 1)])
    assert "ragged_vit.prune(model," in block


def test_readme_keeps_the_commands_ci_runs():
    """The test and demo commands, each alone in a bash block of one marked section; .ci/run runs the first."""
    text = README.read_text()
    section = text[text.index("## Tests and demo (the commands CI runs)") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    for command in CI_COMMANDS:
        assert command in blocks, command
    assert CI_COMMANDS[0] in (ROOT / ".ci" / "run").read_text()


def test_readme_and_targets_tables_are_generated_from_the_stored_runs():
    """What lies between the README's results markers and docs/targets.md's targets markers is what
    ``python -m benchmarks.make_results`` (``nox -s results``) writes from the stored JSON today."""
    from benchmarks import BASELINES, make_results

    def between(path: Path, name: str) -> str:
        match = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", path.read_text(), re.S)
        assert match, f"{path.name} lost its {name} markers"
        return match.group(1)

    assert between(README, "results") == make_results.readme_section(BASELINES).strip(), "run nox -s results"
    targets = make_results.targets_table(make_results.all_targets(BASELINES, ROOT / "docs" / "data"))
    assert between(ROOT / "docs" / "targets.md", "targets") == targets.strip(), "run nox -s results"
    assert "**NVIDIA H100 80GB HBM3**" in between(README, "results") and "**NVIDIA H200**" in between(README, "results")


def test_readme_links_resolve():
    """Every docs/ page and repository path the README names exists."""
    text = README.read_text()
    named = set(re.findall(r"`((?:docs|benchmarks|ci|tests)/[\w./-]+\.(?:md|py|json|sh))`", text))
    assert any(p.startswith("docs/") for p in named)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
