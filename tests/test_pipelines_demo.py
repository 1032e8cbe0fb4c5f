"""The demo's pure parts on the CPU: the speed rows (the GPU's four run here with torch.compile left out and the graph
runner's CPU path), the table and its ratios, the checks, top-1 margins, batch sizes and the progress bar."""

from __future__ import annotations

import io
import math
import sys

import pytest
import torch

from ragged_vit import build_pipeline
from ragged_vit.pipelines.apps import demo
from ragged_vit.pipelines.apps.demo import Contender, Measured, check_lines, contenders, measure, speed_lines


@pytest.fixture(scope="module")
def pipeline():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_pipeline("deit_tiny_patch16_224", "threshold_l2", 0.5, "reference", model_kwargs=dict(depth=6))


def test_gpu_rows_run_on_the_cpu_without_compile(pipeline, gen):
    rows = contenders(pipeline, "reference", on_gpu=True, compile=False)
    names = [row.name for row in rows]
    assert names == [
        "timm eager (unpruned)",
        "timm reduce-overhead (unpruned)",
        "pruned eager (reference)",
        "pruned default call (reference)",
    ]
    assert [row.name for row in rows if row.baseline] == ["timm reduce-overhead (unpruned)"]
    assert [row.compiled for row in rows] == [False, True, False, True]
    images = torch.randn(3, 3, 224, 224, generator=gen)
    batches = {1: images[:1], 3: images}
    results = measure(rows, batches, warmup=0, timed_runs=2)
    assert all(r.error is None and set(r.seconds) == {1, 3} and all(t > 0 for t in r.seconds.values())
               for r in results.values())  # fmt: skip
    eager, graphed = results["pruned eager (reference)"], results["pruned default call (reference)"]
    assert eager.counts[3].tolist() == [[98]] * 3 and torch.equal(graphed.counts[3], eager.counts[3])
    torch.testing.assert_close(graphed.logits[3], eager.logits[3], atol=1e-5, rtol=0)
    assert results["timm eager (unpruned)"].counts[1] is None
    checks = check_lines(results, rows)
    assert len(checks) == 2
    assert checks[0] == "  check: timm reduce-overhead (unpruned) vs timm eager (unpruned): max |logit diff| 0.00e+00"
    assert "pruned default call (reference) vs pruned eager (reference)" in checks[1]
    assert checks[1].endswith(", same kept counts")
    table = speed_lines(results, [1, 3], "timm reduce-overhead (unpruned)")
    assert table[0].split() == ["forward", "B=1", "B=3"] and len(table) == 5
    assert "(1.00x)" in table[2] and table[2].count("(") == 3  # the baseline's own row (and its name's bracket)


def test_cpu_rows_time_the_reference_backend_against_timm_eager(pipeline):
    rows = contenders(pipeline, "reference", on_gpu=False)
    assert [(row.name, row.baseline, row.compiled) for row in rows] == [
        ("timm eager (unpruned)", True, False),
        ("pruned eager (reference)", False, False),
    ]


def _measured(img_per_s: dict[int, float]) -> Measured:
    return Measured(seconds={b: b / v for b, v in img_per_s.items()})


def test_speed_table_ratios_and_failures():
    results = {
        "timm eager (unpruned)": _measured({1: 341.0, 64: 9365.0}),
        "timm reduce-overhead (unpruned)": _measured({1: 1294.0, 64: 10014.0}),
        "pruned default call (triton)": Measured(error="RuntimeError: no graph"),
        "pruned eager (triton)": _measured({1: 500.0, 64: 15021.0}),
    }
    lines = speed_lines(results, [1, 64], "timm reduce-overhead (unpruned)")
    table = {line[2:].split("  ")[0]: line for line in lines[1:5]}
    assert table["timm eager (unpruned)"].split()[-4:] == ["341", "(0.26x)", "9,365", "(0.94x)"]
    assert table["timm reduce-overhead (unpruned)"].split()[-4:] == ["1,294", "(1.00x)", "10,014", "(1.00x)"]
    assert table["pruned eager (triton)"].split()[-4:] == ["500", "(0.39x)", "15,021", "(1.50x)"]
    assert table["pruned default call (triton)"].split()[-2:] == ["failed", "failed"]
    assert lines[5] == "  pruned default call (triton) failed: RuntimeError: no graph"
    slow = speed_lines({"a": _measured({1: 2.5}), "b": _measured({1: 5.0})}, [1], "a")
    assert slow[2].split()[-2:] == ["5.0", "(2.00x)"]


def test_compiled_rows_report_failures_and_eager_rows_raise(gen):
    images = {1: torch.randn(1, 4, generator=gen)}

    def broken():
        raise RuntimeError("inductor\nfailed")

    bar = demo._NoBar()
    results = measure([Contender("compiled", broken, compiled=True)], images, warmup=0, timed_runs=1, bar=bar)
    assert results["compiled"].error == "RuntimeError: inductor failed" and not results["compiled"].seconds
    with pytest.raises(RuntimeError, match="inductor"):
        measure([Contender("eager", broken)], images, warmup=0, timed_runs=1)


def test_warmup_counts_the_first_call_and_compiled_rows_get_at_least_three(gen):
    calls = {"eager": 0, "compiled": 0}

    def counting(name):
        def forward(x):
            calls[name] += 1
            return x

        return lambda: forward

    rows = [Contender("eager", counting("eager")), Contender("compiled", counting("compiled"), compiled=True)]
    measure(rows, {1: torch.zeros(1, 2)}, warmup=0, timed_runs=4)
    assert calls == {"eager": 1 + 4, "compiled": demo.COMPILED_WARMUP + 4}
    calls.update(eager=0, compiled=0)
    measure(rows, {1: torch.zeros(1, 2), 2: torch.zeros(2, 2)}, warmup=5, timed_runs=1)
    assert calls == {"eager": 2 * (5 + 1), "compiled": 2 * (5 + 1)}


def test_top1_margins_and_batch_sizes():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]], dtype=torch.float16)
    assert demo.top1_margins(logits).tolist() == [0.5, 0.0]
    assert demo.top1_margins(torch.zeros(2, 1)).tolist() == [math.inf, math.inf]
    assert demo.large_batch_repeats(4, on_gpu=True) == 16  # 64 images
    assert demo.large_batch_repeats(5, on_gpu=True) == 13  # 65: at least 64
    assert demo.large_batch_repeats(100, on_gpu=True) == 1
    assert demo.large_batch_repeats(4, on_gpu=False) == 1


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(demo.progress_bar(total=3), demo._NoBar)
    tqdm = pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with demo.progress_bar(total=3, desc="speed") as bar:
        assert isinstance(bar, tqdm.tqdm)
        bar.update()
    assert "speed" in sys.stderr.getvalue()


def test_checks_compare_logits_where_the_kept_counts_agree():
    rows = [Contender("eager", lambda: None), Contender("graphed", lambda: None, check_against="eager")]
    logits = torch.zeros(3, 5)
    moved = logits.clone()
    moved[0] += 0.25  # its own decision: not compared
    moved[2, 1] = 1e-3
    results = {
        "eager": Measured(logits={3: logits}, counts={3: torch.tensor([[98], [98], [98]])}),
        "graphed": Measured(logits={3: moved}, counts={3: torch.tensor([[97], [98], [98]])}),
    }
    assert check_lines(results, rows) == [
        "  check: graphed vs eager: max |logit diff| 1.00e-03 (same kept counts); counts differ in 1/3"
    ]
    results["graphed"].counts[3] = results["eager"].counts[3]
    assert check_lines(results, rows) == ["  check: graphed vs eager: max |logit diff| 2.50e-01, same kept counts"]
    results["graphed"] = Measured(error="RuntimeError: x")  # failed before its first output: no check line
    assert check_lines(results, rows) == []
