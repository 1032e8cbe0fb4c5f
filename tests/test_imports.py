"""The static import graph of the checkout: every import between the library's folders resolves to a file, points
down the layers and closes no cycle; the repository's tools import nothing from the tests.

Read from the source text (``ast``), not by importing, so it sees what an editor or an import-graph tool sees.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"core": "ragged_vit.core", "reference": "ragged_vit.reference", "triton_impl": "ragged_vit.triton_impl",
           "pipelines": "ragged_vit.pipelines", "ragged_vit": "ragged_vit"}  # fmt: skip
# Lower layers never import higher ones: the data types and validation, the references, the kernels, the engine,
# the package's face and its lab, the apps (the command line, the demo, validate), their entry points.
LAYERS = (("ragged_vit.core",), ("ragged_vit.reference",), ("ragged_vit.triton_impl",), ("ragged_vit.pipelines",),
          ("ragged_vit",), ("ragged_vit.pipelines.apps",), ("ragged_vit.__main__", "ragged_vit.validate"))  # fmt: skip


def library_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the library's folders."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = library_modules()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str) -> list[tuple[int, str, bool]]:
    """``(line, imported module, relative)`` of every import statement in module ``name`` (lazy ones included); a
    ``from X import y`` names ``X.y`` where that is a module."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    here = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
            found += [(node.lineno, t, bool(node.level)) for t in (subs or [target])]
    return [(line, target, rel) for line, target, rel in found if target.split(".")[0] == "ragged_vit"]


def layer(name: str) -> int:
    """The index in ``LAYERS`` of the longest layer name that is ``name`` or contains it."""
    matches = [(len(p), i) for i, names in enumerate(LAYERS) for p in names if name == p or name.startswith(p + ".")]
    return max(matches)[1]


def edges() -> dict[str, set[str]]:
    return {name: {target for _, target, _ in imports_of(name)} for name in MODULES}


def test_every_import_inside_the_library_is_relative_and_resolves():
    bad = []
    for name in MODULES:
        for line, target, relative in imports_of(name):
            where = f"{MODULES[name].relative_to(ROOT)}:{line}"
            if not relative:
                bad.append(f"{where}: absolute import of {target} (inside the library, imports are relative)")
            elif target not in MODULES:
                bad.append(f"{where}: {target} is no module of the checkout")
    assert not bad, "\n".join(bad)


def test_layers_are_tied_by_their_arrows():
    """Each of the four library folders imports the one below it (the graph is read, not empty)."""
    pairs = {(layer(a), layer(b)) for a, targets in edges().items() for b in targets if b in MODULES}
    assert {(1, 0), (2, 1), (3, 2)} <= pairs, sorted(pairs)


def test_imports_point_down_the_layers():
    up = [f"{MODULES[a].relative_to(ROOT)} -> {b}" for a, targets in edges().items() for b in targets
          if b in MODULES and layer(b) > layer(a)]  # fmt: skip
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(up))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node:
                continue  # a package's face naming itself
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_modules():
    graph = {a: {b for b in targets if b in MODULES and not a.startswith(b + ".")} for a, targets in edges().items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


@pytest.mark.parametrize("folder", ["ci", "benchmarks"])
def test_tools_import_nothing_from_the_tests(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []  # fmt: skip
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)
