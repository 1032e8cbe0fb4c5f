"""Code without diaries: the library's comments and docstrings cite no commit hashes, GPU names or percentages.

The evidence behind a tuned constant (the sweep, the card, the numbers, the data file) lives in ``docs/tuning.md``;
the code keeps one line saying what the constant is and why, with a pointer to its section there. This lint scans
the comments (``tokenize``) and docstrings (``ast``: every string-literal statement, so attribute docstrings too) of
every ``.py`` file of the library folders and fails on

* a commit-hash-like token: 7 to 40 lowercase hex characters with at least one digit and one letter, not part of a
  longer word or number (``_`` separates: ``data_h100_06ff7f1.json`` cites ``06ff7f1``);
* a GPU name (a card model, ``H100``, ``A100``, ``RTX``, ..., or an architecture, ``Hopper``, ...; compute
  capabilities such as ``SM90`` are facts and pass);
* a number followed by ``%`` (a modulo such as ``T % 16`` in a docstring passes: no number before the sign).

Code (string literals that are not docstrings, hex constants) is never scanned. Two more checks keep the pointers
honest: every ``docs/tuning.md#section`` the library cites is a heading there, and every ``docs/data/`` file the
docs cite exists and is cited.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_FOLDERS = ("core", "reference", "triton_impl", "pipelines", "ragged_vit")

_HASH = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])")
_GPU = re.compile(
    r"(?<![0-9A-Za-z])(?:"
    r"G?H[12]00|H800|H20|GB?[23]00|B[12]00|A[18]00|A10G?|A30|A40|A[456]000|L40S?|L4|T4|V100|P100|P40|K80|"
    r"MI[123]\d{2}X?|RTX|GTX|Quadro|Titan|Tesla|Hopper|Ampere|Blackwell|Lovelace|Volta"
    r")(?![0-9A-Za-z])",
    re.IGNORECASE,
)
# A percentage: a digit then ``%`` (``80%``, ``3.5 %``); ``2 % 3`` (a modulo of two operands) is not one.
_PERCENT = re.compile(r"\d(?:%|\s%(?!\s*[\w(]))")
_RULES = (("commit hash", _HASH), ("GPU name", _GPU), ("percentage", _PERCENT))


def _docstring_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every string-literal statement: module, class and function docstrings and the
    attribute docstrings after assignments."""
    return [
        ((node.value.lineno, node.value.col_offset), (node.value.end_lineno, node.value.end_col_offset))
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]


def scan_source(source: str) -> list[tuple[int, str, str]]:
    """``(line, rule, text)`` for every offending match in ``source``'s comments and docstrings."""
    spans = _docstring_spans(ast.parse(source))
    pieces = []  # (first line, raw text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and any(start <= tok.start and tok.end <= end for start, end in spans)
        ):
            pieces.append((tok.start[0], tok.string))
    found = []
    for first, text in pieces:
        for offset, line in enumerate(text.splitlines()):
            for rule, pattern in _RULES:
                for match in pattern.finditer(line):
                    found.append((first + offset, rule, f"{match.group(0)!r} in {line.strip()!r}"))
    return found


def library_files() -> list[Path]:
    return sorted(p for folder in LIBRARY_FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_library_comments_and_docstrings_cite_no_hashes_gpus_or_percentages():
    files = library_files()
    assert len(files) > 20, files  # the folders are there
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {rule}: {text}"
        for path in files
        for line, rule, text in scan_source(path.read_text(encoding="utf-8"))
    ]
    assert not problems, (
        "comments and docstrings must not cite commit hashes, GPU names or percentages; move the evidence to "
        "docs/tuning.md and point there:\n" + "\n".join(problems)
    )


SAMPLE = '''"""Module doc: measured on an H100 at 8670a2b."""

X = 0xDEADBEEF1  # a hex constant in code is not scanned
Y = "abc1234f is a string literal, not a docstring: not scanned"
Z = 3 % 2  # a modulo in code


def f():
    """Tiles: ``T % 16 == 0`` is a modulo, 1024 rows a number, decade a word, fp16 a dtype, SM90 a capability."""
    return 1  # 10% faster on a RTX 4000 (data_h100_06ff7f1.json; +3.5 %)


CONSTANT = 1
"""An attribute docstring: Hopper, 2.4%."""
'''


def test_scanner_flags_each_kind_in_comments_and_docstrings_only():
    found = scan_source(SAMPLE)
    got = sorted((line, rule, text.split(" in ")[0]) for line, rule, text in found)
    assert got == sorted(
        [
            (1, "GPU name", "'H100'"),
            (1, "commit hash", "'8670a2b'"),
            (10, "percentage", "'0%'"),
            (10, "GPU name", "'RTX'"),
            (10, "GPU name", "'h100'"),
            (10, "commit hash", "'06ff7f1'"),
            (10, "percentage", "'5 %'"),
            (14, "GPU name", "'Hopper'"),
            (14, "percentage", "'4%'"),
        ]
    ), found


@pytest.mark.parametrize(
    "text",
    [
        "deadbeef",
        "1234567",
        "fp16",
        "bf16",
        "SM90",
        "sm_90a",
        "T % B",
        "(j - 1) % 2",
        "value % 16 == 0",
        "0x7f800000",
        "log2e",
        "2**-24",
        "ViT-H/14",
        "h16",
        "B64",
        "batch 64",
    ],
)
def test_scanner_passes_facts_and_words(text):
    assert scan_source(f"# {text}\n") == []
    assert scan_source(f'"""{text}"""\n') == []


def test_scanner_reports_the_file_and_line():
    # What the failure message is built from: the line of the comment inside the file.
    assert scan_source("x = 1\n\n# seen on an A100\n") == [(3, "GPU name", "'A100' in '# seen on an A100'")]


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lowercased, punctuation other than ``-`` dropped, spaces to ``-``."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in markdown.splitlines()
        if line.startswith("#")
    }


def test_every_pointer_into_tuning_md_names_a_section():
    anchors = _anchors((ROOT / "docs" / "tuning.md").read_text(encoding="utf-8"))
    cited = {
        (f"{path.relative_to(ROOT)}", anchor)
        for path in library_files()
        for anchor in re.findall(r"docs/tuning\.md#([\w-]+)", path.read_text(encoding="utf-8"))
    }
    assert cited, "the library points into docs/tuning.md"
    missing = sorted(f"{path}: #{anchor}" for path, anchor in cited if anchor not in anchors)
    assert not missing, "pointers to sections docs/tuning.md does not have:\n" + "\n".join(missing)


def test_the_docs_cite_only_data_files_that_exist_and_every_data_file_is_cited():
    """A measurement in ``docs/data/`` says what it measured only through the page that cites it: an uncited file is
    an orphan, a cited one that is gone a dead pointer."""
    cited = {
        name
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for name in re.findall(r"docs/data/[\w.-]+\w(?![\w.<*-])", page.read_text(encoding="utf-8"))  # not a pattern
    }
    assert "docs/data/tune_linear_h200.json" in cited, "the docs cite their data files"
    missing = sorted(name for name in cited if not (ROOT / name).is_file())
    assert not missing, "the docs cite data files that do not exist: " + ", ".join(missing)
    stored = {f"docs/data/{path.name}" for path in (ROOT / "docs" / "data").iterdir() if path.is_file()}
    orphans = sorted(stored - cited)
    assert not orphans, "data files no page of docs/ cites: " + ", ".join(orphans)
