"""The GPU suite's command (ci/gpu_tests.py): what it runs, checked without a GPU."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from ci import gpu_tests


def test_the_parallel_run_leaves_the_exclusive_tests_to_the_second() -> None:
    parallel, alone = gpu_tests.commands(quick=False, jobs=8, args=[])
    assert parallel[:3] == [sys.executable, "-m", "pytest"] and "tests" in parallel and "--full" in parallel
    assert parallel[parallel.index("-n") + 1] == "8" and parallel[parallel.index("--dist") + 1] == "worksteal"
    assert parallel[parallel.index("-m", 3) + 1] == "not exclusive" and alone[alone.index("-m", 3) + 1] == "exclusive"
    assert "-n" not in alone and "--full" in alone


def test_quick_paths_and_options() -> None:
    parallel, alone = gpu_tests.commands(quick=True, jobs=3, args=["tests/test_eva.py", "-x", "-k", "gpu"])
    for cmd in (parallel, alone):
        assert "--full" not in cmd and "tests/test_eva.py" in cmd and "tests" not in cmd
        assert cmd[-3:] == ["-x", "-k", "gpu"]


@pytest.mark.parametrize(
    "argv, quick, rest",
    [
        (["quick", "--jobs", "12", "tests/test_eva.py"], True, ["tests/test_eva.py"]),
        (["--jobs", "12", "tests/test_eva.py", "tests/test_naflex.py", "-x"], False,
         ["tests/test_eva.py", "tests/test_naflex.py", "-x"]),
        ([], False, []),
    ],
)  # fmt: skip
def test_the_command_line_takes_quick_then_paths(argv, quick, rest) -> None:
    """``quick`` first (``nox -s gpu_tests -- quick``), test paths and pytest options after, in any number."""
    opts, got = gpu_tests.parse(argv)
    assert (opts.quick, got) == (quick, rest) and opts.jobs == (12 if argv else 8)


def test_the_exclusive_marker_is_registered(pytestconfig: pytest.Config) -> None:
    assert any(line.startswith(f"{gpu_tests.EXCLUSIVE}:") for line in pytestconfig.getini("markers"))


def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the suite itself is the test")
    assert gpu_tests.main([]) == 0 and "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_tests.main(["--jobs", "0"])


@pytest.mark.parametrize("tool", ["dispatch_profile", "sanitize_case", "profile_attention", "ats_kernels",
                                  "forward_profile"])  # fmt: skip
def test_the_gpu_tools_say_they_need_a_gpu(tool: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Run where there is no GPU, each says so in one line and returns, instead of a CUDA traceback."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU suite runs the tools themselves")
    module = importlib.import_module(f"ci.{tool}")
    monkeypatch.setattr(sys, "argv", [f"python -m ci.{tool}"])
    module.main()
    err = capsys.readouterr().err.strip()
    assert err == f"python -m ci.{tool} needs a CUDA GPU (torch.cuda.is_available() is False): nothing to run here"
