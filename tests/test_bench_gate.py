"""The benchmark gate of ``python -m benchmarks.run_bench``: ratios and graph-replay device times against the card's
stored runs.

CPU: the comparison on synthetic stored runs (a regression beyond the tolerance fails, one within passes, a
quantity without a baseline says so and passes, another card's or an injected run is never a baseline) and the
command's storing and export with pytest replaced by a stub. GPU: the real quick suite on a subset, three times
against a temporary storage -- the first run stores, a clean second run passes, an injected regression fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import run_bench

REPO = Path(__file__).resolve().parents[1]
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
ATT = "test_attention[B1-p0-ours]"
E2E = "test_e2e[B1-l2_ratio-triton]"  # batch 1: the attention is a large enough share of its device time
MACHINE = "Linux-CPython-3.12-64bit"


def make_run(gates: dict[str, dict], card: str = H200, inject: str | None = None, date: str = "2026-01-01") -> dict:
    """A stored run as pytest-benchmark writes it, reduced to what the gate reads."""
    info = {"card": card, "commit": "test", "inject": inject}
    benches = [{"name": name, "extra_info": {"gate": gate}, "stats": {"median": 1e-3}} for name, gate in gates.items()]
    return {"machine_info": {"ragged_vit": info}, "datetime": date, "benchmarks": benches}


def stored(*runs: dict) -> list[tuple[str, dict]]:
    return [(f"{MACHINE}/{i + 1:04d}_quick-x.json", run) for i, run in enumerate(runs)]


BASE = make_run({ATT: {"device_us": 10.0, "ratio_vs_fa2_aten": 1.2}, E2E: {"ratio_vs_timm_eager": 1.4}})


def verdicts(rows: list[run_bench.Gated]) -> dict[tuple[str, str], run_bench.Gated]:
    return {(row.benchmark, row.key): row for row in rows}


@pytest.mark.parametrize(
    ("key", "now", "fails"),
    [
        ("device_us", 11.4, False),  # +14%: within
        ("device_us", 11.6, True),  # +16%: beyond
        ("device_us", 7.0, False),  # faster
        ("ratio_vs_fa2_aten", 1.03, False),  # -14%: within
        ("ratio_vs_fa2_aten", 1.0, True),  # -17%: beyond
        ("ratio_vs_fa2_aten", 2.0, False),  # ours got faster against the peer
    ],
)
def test_a_regression_beyond_the_tolerance_fails_one_within_passes(key: str, now: float, fails: bool) -> None:
    run = make_run({ATT: {key: now}})
    rows = run_bench.gate(run, stored(BASE), "nvidia-h200", tolerance=15.0)
    row = verdicts(rows)[(ATT, key)]
    assert row.failed is fails and row.verdict.startswith("REGRESSION") is fails, row
    assert row.baseline == BASE["benchmarks"][0]["extra_info"]["gate"][key] and row.now == now
    assert row.source == f"{MACHINE}/0001_quick-x.json"
    outcome = run_bench.decide(run, stored(BASE), "nvidia-h200", 15.0, compare=True, pytest_rc=0)
    assert (outcome.status, outcome.keep) == ((1, False) if fails else (0, True))
    table = run_bench.render(rows, 15.0)
    assert f"| {ATT} {key} |" in table
    assert ("gate: FAILED, 1 of 1 gated quantities regressed: " + f"{ATT} {key}" in table) is fails


def test_the_tolerance_is_the_option() -> None:
    run = make_run({ATT: {"device_us": 11.0}})  # +10%
    assert not run_bench.gate(run, stored(BASE), "nvidia-h200", tolerance=15.0)[0].failed
    assert run_bench.gate(run, stored(BASE), "nvidia-h200", tolerance=5.0)[0].failed
    args, _ = run_bench.parse_args(["--tolerance", "5"])
    assert args.tolerance == 5.0 and run_bench.parse_args([])[0].tolerance == run_bench.DEFAULT_TOLERANCE == 15.0
    assert run_bench.parse_args([])[0].threshold is None  # pytest-benchmark's median check is off by default


def test_a_missing_baseline_says_so_and_passes() -> None:
    run = make_run({ATT: {"device_us": 50.0, "ratio_vs_varlen_attn": 0.1}})
    old = make_run({ATT: {}})  # a run stored before the gate: no gated values
    for history in (stored(), stored(old), stored(BASE)):
        rows = verdicts(run_bench.gate(run, history, "nvidia-h200", 15.0))
        new = rows[(ATT, "ratio_vs_varlen_attn")]
        assert new.verdict == run_bench.NO_BASELINE and not new.failed and new.baseline is None
    assert rows[(ATT, "device_us")].failed  # the one with a baseline is still judged
    outcome = run_bench.decide(run, stored(old), "nvidia-h200", 15.0, compare=True, pytest_rc=0)
    assert outcome.status == 0 and outcome.keep
    assert run_bench.NO_BASELINE in run_bench.render(outcome.rows, 15.0)


def test_another_card_is_never_compared() -> None:
    run = make_run({ATT: {"device_us": 10.0}})
    h100 = make_run({ATT: {"device_us": 5.0}}, card=H100, date="2026-02-01")  # would fail if it were compared
    rows = run_bench.gate(run, stored(h100), "nvidia-h200", 15.0)
    assert [(r.verdict, r.failed) for r in rows] == [(run_bench.NO_BASELINE, False)]
    rows = verdicts(run_bench.gate(run, stored(BASE, h100), "nvidia-h200", 15.0))  # the H100 run is newer: skipped
    assert (rows[(ATT, "device_us")].baseline, rows[(ATT, "device_us")].failed) == (10.0, False)
    assert run_bench.run_slug(h100) == "nvidia-h100-80gb-hbm3"
    assert run_bench.storage_dir("nvidia-h200", True) != run_bench.storage_dir("nvidia-h100-80gb-hbm3", True)


def test_the_latest_clean_run_holding_a_quantity_is_its_baseline() -> None:
    newer = make_run({ATT: {"device_us": 20.0}}, date="2026-03-01")
    injected = make_run({ATT: {"device_us": 99.0, "ratio_vs_fa2_aten": 0.1}}, inject="slow-kernel", date="2026-04-01")
    lost = make_run({ATT: {"device_us": None}}, date="2026-05-01")  # measured and lost: no baseline value
    run = make_run({ATT: {"device_us": 21.0, "ratio_vs_fa2_aten": 1.2}})
    rows = verdicts(run_bench.gate(run, stored(BASE, newer, injected, lost), "nvidia-h200", 15.0))
    assert rows[(ATT, "device_us")].baseline == 20.0 and not rows[(ATT, "device_us")].failed
    assert rows[(ATT, "ratio_vs_fa2_aten")].baseline == 1.2  # from the older run: the newer ones lack it


def test_stored_runs_are_ordered_by_their_date(tmp_path: Path) -> None:
    for folder, name, date in (("a", "0001_x.json", "2026-03-01"), ("b", "0007_y.json", "2026-02-01")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(json.dumps(make_run({}, date=date)))
    (tmp_path / "a" / "0002_broken.json").write_text("{")
    paths = run_bench.card_runs(tmp_path)
    assert [p.name for p in paths] == ["0001_x.json", "0002_broken.json", "0007_y.json"]
    assert [label for label, _ in run_bench.load_runs(paths, tmp_path)] == ["b/0007_y.json", "a/0001_x.json"]


def test_a_value_lost_now_fails_and_one_no_longer_gated_is_noted() -> None:
    run = make_run({ATT: {"device_us": None}, E2E: {}})
    rows = verdicts(run_bench.gate(run, stored(BASE), "nvidia-h200", 15.0))
    assert rows[(ATT, "device_us")].failed and rows[(ATT, "device_us")].verdict == "REGRESSION: not measured now"
    assert not rows[(E2E, "ratio_vs_timm_eager")].failed  # its benchmark ran without it: noted, not failed
    assert (ATT, "ratio_vs_fa2_aten") in rows and not rows[(ATT, "ratio_vs_fa2_aten")].failed


def test_injected_failed_and_broken_runs_are_not_stored() -> None:
    clean = make_run({ATT: {"device_us": 10.0}})
    injected = make_run({ATT: {"device_us": 10.0}}, inject="sync")
    assert run_bench.decide(clean, stored(BASE), "nvidia-h200", 15.0, True, 0).keep
    outcome = run_bench.decide(injected, stored(BASE), "nvidia-h200", 15.0, True, 0)
    assert not outcome.keep and outcome.status == 0 and "RAGGED_BENCH_INJECT=sync" in outcome.note
    outcome = run_bench.decide(clean, stored(BASE), "nvidia-h200", 15.0, True, pytest_rc=1)
    assert not outcome.keep and outcome.status == 1
    outcome = run_bench.decide(None, stored(BASE), "nvidia-h200", 15.0, True, pytest_rc=4)
    assert not outcome.keep and outcome.status == 4
    slow = make_run({ATT: {"device_us": 30.0}})
    assert run_bench.decide(slow, stored(BASE), "nvidia-h200", 15.0, compare=False, pytest_rc=0).keep  # accepted


class FakePytest:
    """Stands in for the pytest subprocess: writes ``run`` where pytest-benchmark writes its JSON."""

    def __init__(self, run: dict, rc: int = 0) -> None:
        self.run, self.rc, self.commands = run, rc, []

    def __call__(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        self.commands.append(cmd)
        opts = dict(a.removeprefix("--").split("=", 1) for a in cmd if a.startswith("--benchmark-") and "=" in a)
        Path(opts["benchmark-json"]).write_text(json.dumps(self.run))
        return subprocess.CompletedProcess(cmd, self.rc)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """``run_bench.main`` on a CPU: a CUDA card named H200, a fixed commit, pytest replaced by :class:`FakePytest`."""
    from benchmarks import timing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "gpu_slug", lambda name=None: "nvidia-h200" if name in (None, H200) else "other")
    monkeypatch.setattr(timing, "git_commit", lambda: "abc1234")
    monkeypatch.delenv(run_bench.INJECT_ENV, raising=False)

    def main(run: dict, *args: str, rc: int = 0) -> tuple[int, FakePytest]:
        fake = FakePytest(run, rc)
        monkeypatch.setattr(run_bench.subprocess, "run", fake)
        return run_bench.main(list(args)), fake

    return main


def test_main_stores_a_passing_run_and_drops_a_failing_one(fake_gpu, tmp_path: Path, capsys) -> None:
    root, out = tmp_path / "baselines", tmp_path / "out"
    storage = root / "nvidia-h200" / "bench-quick"
    (storage / MACHINE).mkdir(parents=True)
    (storage / MACHINE / "0003_quick-old.json").write_text(json.dumps(make_run({})))  # stored before the gate
    rc, fake = fake_gpu(BASE, "--quick", "--storage-root", str(root), "--export", str(out), "-k", "B1")
    assert rc == 0
    assert [p.name for p in run_bench.card_runs(storage)] == ["0004_quick-abc1234.json", "0003_quick-old.json"]
    # What comes back from the lent machine: the stored run two folders down, the run and the gate's table on top.
    assert (out / "nvidia-h200" / "bench-quick" / "0004_quick-abc1234.json").is_file()
    assert {p.name for p in out.iterdir()} == {"nvidia-h200", "nvidia-h200-bench-quick.json",
                                                "nvidia-h200-bench-quick.gate.txt"}  # fmt: skip
    cmd = fake.commands[0]
    assert cmd[-2:] == ["-k", "B1"] and not any(a.startswith(("--benchmark-compare", "--benchmark-save")) for a in cmd)
    assert run_bench.NO_BASELINE in capsys.readouterr().out

    slower = make_run({ATT: {"device_us": 13.0, "ratio_vs_fa2_aten": 1.2}}, date="2026-02-01")
    rc, _ = fake_gpu(slower, "--quick", "--storage-root", str(root), "--export", str(out))
    text = capsys.readouterr().out
    assert rc == 1 and f"regressed: {ATT} device_us" in text and "not stored: the gate failed" in text
    assert len(run_bench.card_runs(storage)) == 2  # the failing run did not become the baseline
    assert "REGRESSION" in (out / "nvidia-h200-bench-quick.gate.txt").read_text()

    rc, _ = fake_gpu(slower, "--quick", "--storage-root", str(root), "--no-compare")  # accepted as the new baseline
    assert rc == 0 and run_bench.card_runs(storage)[1].name == "0005_quick-abc1234.json"
    rc, fake = fake_gpu(slower, "--quick", "--storage-root", str(root), "--threshold", "25")
    assert rc == 0 and "gate: passed" in capsys.readouterr().out
    assert fake.commands[0][-2:] == ["--benchmark-compare", "--benchmark-compare-fail=median:25%"]


def test_main_never_stores_an_injected_run(fake_gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    root = tmp_path / "baselines"
    monkeypatch.setenv(run_bench.INJECT_ENV, "slow-kernel")
    run = make_run({ATT: {"device_us": 10.0}}, inject="slow-kernel")
    rc, _ = fake_gpu(run, "--quick", "--storage-root", str(root))
    assert rc == 0 and run_bench.card_runs(root / "nvidia-h200" / "bench-quick") == []
    assert "not stored: RAGGED_BENCH_INJECT=slow-kernel" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------- on a GPU


def run_gate(storage_root: Path, subset: str, inject: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != run_bench.INJECT_ENV}
    env.update(RAGGED_BENCH_COMMIT="gate-test", **({run_bench.INJECT_ENV: inject} if inject else {}))
    cmd = [sys.executable, "-m", "benchmarks.run_bench", "--quick", "--storage-root", str(storage_root), "-k", subset]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)


def failed_quantities(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("gate: FAILED")]
    assert lines, out[-4000:]
    return lines[-1]


@pytest.mark.gpu
@pytest.mark.exclusive
@pytest.mark.full  # a minute of benchmark runs: the full GPU suite's, not the quick one's
def test_gate_on_the_gpu_stores_passes_clean_and_fails_injected(tmp_path: Path) -> None:
    """The quick suite's B1-p80 kernel entries of ours and one eager pipeline row: store, pass clean, fail injected.

    ``slow-kernel`` must fail the device times (the kernel's and the pipeline's); ``sync`` the launch-bound ratio
    of our kernel against FA2 (the device time, under graph replay, is not touched by it)."""
    from benchmarks.timing import gpu_slug

    storage = run_bench.storage_dir(gpu_slug(), quick=True, root=tmp_path)
    subset = "B1-p80-ours or B1-l2_ratio-triton]"
    first = run_gate(tmp_path, subset)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert run_bench.NO_BASELINE in first.stdout and len(run_bench.card_runs(storage)) == 1
    second = run_gate(tmp_path, subset)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert "gate: passed" in second.stdout and len(run_bench.card_runs(storage)) == 2

    slow = run_gate(tmp_path, subset, inject="slow-kernel")
    assert slow.returncode == 1, slow.stdout[-4000:] + slow.stderr[-4000:]
    failed = failed_quantities(slow.stdout)
    assert "test_attention[B1-p80-ours] device_us" in failed and f"{E2E} device_us" in failed
    assert "ours_op" not in failed  # the op launches the tuned kernel: not injected
    sync = run_gate(tmp_path, "B1-p80-ours", inject="sync")
    assert sync.returncode == 1, sync.stdout[-4000:] + sync.stderr[-4000:]
    failed = failed_quantities(sync.stdout)
    assert "test_attention[B1-p80-ours] ratio_vs_fa2_aten" in failed and "device_us" not in failed
    assert len(run_bench.card_runs(storage)) == 2  # injected runs are never stored
