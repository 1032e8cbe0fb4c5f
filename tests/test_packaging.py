"""One import package: ``ragged_vit`` and its subpackages, never the generic top-level names of the folders.

The folders ``core/``, ``reference/``, ``triton_impl/`` and ``pipelines/`` sit at the repository top and install as
``ragged_vit.core``, ``ragged_vit.reference``, ... (pyproject's ``package-dir``). A user's project with folders of
those names must not shadow ours, so no module of the project may import them by their bare names.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ragged_vit

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"ragged_vit": "ragged_vit", "core": "ragged_vit.core", "reference": "ragged_vit.reference",
           "triton_impl": "ragged_vit.triton_impl", "pipelines": "ragged_vit.pipelines"}  # fmt: skip
BARE_IMPORT = re.compile(r"^\s*(?:from|import)\s+(core|reference|triton_impl|pipelines)\b", re.M)


def _python_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout:  # a copy may carry a stale index: files that are gone are skipped
        return [path for path in (REPO / f for f in tracked.stdout.split()) if path.is_file()]
    return [p for p in REPO.rglob("*.py") if ".nox" not in p.parts and "venv" not in p.parts]


def test_no_module_imports_the_bare_folder_names():
    offenders = [
        f"{path.relative_to(REPO)}: {m.group(0).strip()}"
        for path in _python_files()
        for m in BARE_IMPORT.finditer(path.read_text())
    ]
    assert not offenders, "import through ragged_vit.<subpackage> instead:\n" + "\n".join(offenders)


def test_every_subpackage_is_installed():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {folder: config["package-dir"][name] for folder, name in FOLDERS.items()} == {f: f for f in FOLDERS}
    found = {
        ".".join([FOLDERS[init.relative_to(REPO).parts[0]], *init.relative_to(REPO).parts[1:-1]])
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert found == set(config["packages"])


def test_public_api_from_a_project_with_its_own_pipelines_and_reference(tmp_path):
    """A user's project folder with its own ``pipelines/``, ``reference/``, ``core/`` and ``triton_impl/`` packages
    (which fail on import) runs the public API: a pruned forward of a tiny ViT on the CPU."""
    for name in ("pipelines", "reference", "core", "triton_impl"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user project’s own {name}')\n")
    script = textwrap.dedent(
        """
        import json

        import torch
        import ragged_vit
        from ragged_vit import PrunedViT, build_pruner
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=12, num_heads=2, num_classes=5)
        pv = PrunedViT(model, build_pruner("evit", model, 0.5), "reference")
        logits, counts = pv(torch.randn(2, 3, 32, 32), return_counts=True)
        print(json.dumps([ragged_vit.__version__, list(logits.shape), counts.tolist()]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    version, shape, counts = json.loads(out.stdout)
    assert version == ragged_vit.__version__
    assert shape == [2, 5]
    assert counts == [[8, 4, 2]] * 2  # EViT at 0.5 in blocks 3, 6, 9: half of the 16, 8, 4 patches


LAYERS = ["core", "reference", "triton_impl", "pipelines"]  # bottom up: each imports only itself and those below
# The conformance lab is the ground truth's companion: pure PyTorch, it stands on core and reference only.
ALLOWED = {folder: {f"ragged_vit.{layer}" for layer in LAYERS[: rank + 1]} for rank, folder in enumerate(LAYERS)}
ALLOWED["ragged_vit/testing"] = {"ragged_vit.core", "ragged_vit.reference", "ragged_vit.testing"}


def test_dependencies_point_down_the_layers():
    import ast

    offenders = []
    for folder, allowed in ALLOWED.items():
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                for name in names:
                    top = ".".join(name.split(".")[:2])
                    if name.startswith("ragged_vit.") and top not in allowed:
                        offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, "\n".join(offenders)
