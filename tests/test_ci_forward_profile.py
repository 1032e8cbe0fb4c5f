"""``ci.forward_profile``'s argument checks (the profile itself needs a CUDA GPU: its runs are on the device)."""

from __future__ import annotations

import sys

import pytest

from ci import forward_profile


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--eager-rounds", "3"], "--eager-rounds: times the eager rows, which only --eager adds"),
        (["--eager", "--eager-rounds", "-1"], "--eager-rounds: must be >= 0"),
        (["--workloads", "tome_v2"], "--workloads:"),
        (["--tome", "-1"], "--tome: r must be >= 0"),
        (["--tome-adaptive", "-2"], "--tome-adaptive: r must be >= 0"),
        (["--eager-only"], "--eager-only: keeps the eager rows, which only --eager adds"),
        (["--eager", "--eager-only", "--compile-blocks"], "--eager-only: --compile-blocks"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["forward_profile", *argv])
    with pytest.raises(SystemExit) as exit_info:
        forward_profile.main()
    assert exit_info.value.code == 2 and match in capsys.readouterr().err
