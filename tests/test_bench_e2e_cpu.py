"""CPU checks of the end-to-end benchmark: its inputs, its instrumentation, a dry run, and the report generator.

The benchmark itself needs a GPU; what can be checked without one is checked here: the synthetic ragged selections,
the paper's padded baseline (``PaddedSDPABackend(pad_to=N)``), that the stage timer leaves a forward's logits
bit-identical, that ``report_e2e`` runs end to end on a CPU (fp32, deit_tiny, the CPU-capable rows) and writes
its JSON, and that ``make_results`` turns stored JSON (synthetic fixtures in a GPU run's format) into
docs/results.md and PNG figures, deterministically. Tolerance rule: the padded attentions and the reference are
the same fp32 math in another order, so they agree to 1e-5.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

from benchmarks import default_call, make_results, naflex, report_e2e, run_bench, tables, timing
from benchmarks.e2e_common import Lab, check_logits
from benchmarks.timing import REGIONS, Marks, forward_times, gpu_slug, stage_breakdown
from benchmarks.workloads import WORKLOADS, synthetic_images, synthetic_selection, workload_kind
from ragged_vit.pipelines.backends import PaddedSDPABackend, ReferenceBackend

TINY = "deit_tiny_patch16_224"
DRY_RUN = "test_vit"  # the dry runs' model: timm's own test ViT (100 patches, 6 blocks of width 64), the same paths
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------- inputs


def test_gpu_slug() -> None:
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("  ") == "unknown"


def test_git_commit_is_this_checkouts_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy without ``.git`` inside another repository names no commit (not the other repository's HEAD)."""
    monkeypatch.delenv("RAGGED_BENCH_COMMIT", raising=False)
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("needs git on the PATH")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "outer"]):
        subprocess.run(["git", *args], cwd=tmp_path, env=env, check=True, capture_output=True)
    monkeypatch.setattr(timing, "REPO_ROOT", tmp_path.resolve())
    assert re.fullmatch(r"[0-9a-f]{40}", timing.git_commit())  # the checkout's own HEAD
    inner = tmp_path / "copy"
    inner.mkdir()
    monkeypatch.setattr(timing, "REPO_ROOT", inner.resolve())
    assert timing.git_commit() == "unknown"


def test_forward_times_back_to_back_clock() -> None:
    """The back-to-back clock is the wall time of as many calls in a row, per call (None unless asked for): calls
    that each sleep 2 ms take at least that; the calls rotate through the inputs in both loops."""
    seen: list[int] = []
    calls = [functools.partial(lambda i: (seen.append(i), time.sleep(0.002)), i) for i in range(2)]
    times = forward_times(calls, CPU, warmup=0, min_iters=4, max_iters=4, back_to_back=True)
    assert times.iters == 4 and times.events is None
    assert times.back_to_back is not None and times.back_to_back >= 2000 and times.wall.median >= 2000
    assert seen[-8:] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert forward_times(calls, CPU, warmup=0, min_iters=2, max_iters=2).back_to_back is None


@pytest.mark.parametrize("keep_rate", [0.1, 0.5, 0.9])
def test_synthetic_selection_is_ragged_around_the_rate(keep_rate: float) -> None:
    batch, patches = 64, 196
    sel = synthetic_selection(batch, patches, keep_rate, CPU, seed=3)
    keep = sel.keep.view(batch, patches + 1)
    assert keep.dtype == torch.bool and bool(keep[:, 0].all()), "every CLS row is kept"
    kept = keep[:, 1:].sum(1).float()
    assert not sel.fixed_count and sel.count is None
    assert sel.kept.dtype == torch.int32 and torch.equal(sel.kept, keep.sum(1).int()), "kept rows, CLS included"
    assert kept.min() >= 1 and kept.max() <= patches
    lo, hi = max(1, (keep_rate - 0.2) * patches - 1), min(patches, (keep_rate + 0.2) * patches + 1)
    assert bool(((kept >= lo) & (kept <= hi)).all())
    assert kept.unique().numel() > 10, "per-image counts must differ"
    assert abs(kept.mean().item() / patches - keep_rate) < 0.06
    again = synthetic_selection(batch, patches, keep_rate, CPU, seed=3)
    assert torch.equal(again.keep, sel.keep), "seeded"


def test_synthetic_selection_keeps_all_at_rate_one() -> None:
    sel = synthetic_selection(4, 196, 1.0, CPU, seed=0)
    assert bool(sel.keep.all()) and sel.fixed_count and sel.count == 197


def test_check_logits_names_what_it_compares_against() -> None:
    ref = torch.zeros(2, 5)
    assert check_logits(ref + 0.01, ref, 0.02).ok
    failed = check_logits(ref + 0.03, ref, 0.02)
    assert not failed.ok and failed.reason.endswith("vs the fp32 reference")
    failed = check_logits(ref + 0.03, ref, 0.02, against="the eager pipeline")
    assert not failed.ok and failed.reason.endswith("vs the eager pipeline")
    assert not check_logits(ref + float("nan"), ref, 0.02).ok
    assert "shape" in check_logits(ref[:1], ref, 0.02).reason


def test_workload_kinds() -> None:
    assert workload_kind("none", 1.0) == "dense"
    assert workload_kind("ats", 0.5) == "ragged" and workload_kind("l2_calibrated", 0.5) == "ragged"
    assert workload_kind("synthetic", 0.5) == "ragged" and workload_kind("synthetic", 1.0) == "fixed"
    assert {w.kind for w in WORKLOADS.values()} == {"fixed", "ragged"}


def test_rows_have_labels_in_table_order() -> None:
    assert report_e2e.ALL_ROWS == tuple(tables.ROW_LABELS) == tables.ROW_ORDER


def test_padded_full_matches_fair_padding_and_reference() -> None:
    g = torch.Generator().manual_seed(11)
    heads, dim, lengths = 3, 16, [5, 1, 9, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lengths), 3 * heads * dim, generator=g)
    scale = dim**-0.5
    ref = ReferenceBackend().attend(qkv, cu, max(lengths), heads, scale)
    fair = PaddedSDPABackend().attend(qkv, cu, max(lengths), heads, scale)
    full = PaddedSDPABackend(pad_to=33).attend(qkv, cu, max(lengths), heads, scale)
    torch.testing.assert_close(fair, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
    assert "pad_to=33" in repr(PaddedSDPABackend(pad_to=33))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="pad_to"):
            PaddedSDPABackend(pad_to=bad)


# --------------------------------------------------------------------------------------------------- stages


@pytest.fixture(scope="module")
def lab() -> Lab:
    return Lab(CPU, torch.float32)


@pytest.mark.parametrize("workload", ["l2_ratio", "ats"])
def test_stage_timer_leaves_the_forward_unchanged(lab: Lab, workload: str) -> None:
    pv = lab.pipeline(TINY, workload, 0.5, "reference")
    images = synthetic_images(2, 224, seed=5)
    plain = pv.run(images)
    marks = Marks(CPU)
    marks.start()
    timed = pv.run(images, on_step=marks.on_step)
    spent = marks.stop()
    assert torch.equal(plain.logits, timed.logits) and torch.equal(plain.counts, timed.counts)
    assert set(spent) == set(REGIONS) and all(spent[r] > 0 for r in REGIONS), spent
    # ATS prunes inside blocks 3-11: its pack time is summed over nine stages, front is embed + blocks 0-2.
    stages = stage_breakdown([functools.partial(pv.run, images)], CPU, iters=2, warmup=0)
    assert set(stages) == {*REGIONS, "total"} and all(stages[r].median > 0 for r in REGIONS)


# --------------------------------------------------------------------------------------------------- dry run


def test_report_e2e_dry_run_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = report_e2e.main(
        [
            "--device",
            "cpu",
            "--model",
            DRY_RUN,
            "--quick",
            "--part",
            "all",
            "--batches",
            "2",
            "--workloads",
            "l2_ratio,synthetic",
            "--rows",
            "timm_eager,padded,padded_full,public_compiled",
            "--out",
            str(tmp_path),
        ]  # fmt: skip
    )
    assert rc == 0
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == [f"{p}-quick.json" for p in sorted(report_e2e.QUICK_PARTS)]
    table3 = json.loads((tmp_path / "table3-quick.json").read_text())
    assert table3["part"] == "table3" and table3["meta"]["timm"] and table3["meta"]["commit"]
    rows = {(r["workload"], r["row"]): r for r in table3["rows"]}
    for key in [("none", "timm_eager"), ("l2_ratio", "padded"), ("synthetic", "padded_full")]:
        assert rows[key]["status"] == "ok", rows[key]
        assert rows[key]["img_per_s"] > 0 and rows[key]["check"]["ok"]
    public = rows[("synthetic", "public_compiled")]
    assert public["status"] == "unavailable" and "CUDA" in public["reason"], public
    assert rows[("synthetic", "padded")]["workload_kind"] == "ragged"
    assert rows[("synthetic", "padded")]["counts"]["stages"] == 1
    stages = json.loads((tmp_path / "table4-quick.json").read_text())["rows"]
    assert all(set(r["stages_us"]) == {*REGIONS, "total"} for r in stages if r["status"] == "ok")
    numerics = json.loads((tmp_path / "table6-quick.json").read_text())["rows"]
    assert numerics and all(r["vs_fp32"]["padded"]["max"] < 1e-3 for r in numerics)
    printed = capsys.readouterr().out
    assert "## table3" in printed and "padded (fair)" in printed


def test_report_e2e_keep_rate_replaces_the_parts(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--model", DRY_RUN, "--quick", "--part", "table3", "--batches", "2", "--workloads",
            "evit_fused", "--rows", "timm_eager,padded", "--keep-rate", "0.7", "--out", str(tmp_path)]  # fmt: skip
    assert report_e2e.main(argv) == 0
    rows = {r["workload"]: r for r in json.loads((tmp_path / "table3-quick.json").read_text())["rows"]}
    assert rows["none"]["keep_rate"] == 1.0 and rows["evit_fused"]["keep_rate"] == 0.7
    assert rows["evit_fused"]["status"] == "ok", rows["evit_fused"]
    for bad in (["--keep-rate", "1.5"], ["--part", "fig1", "--keep-rate", "0.7"]):
        with pytest.raises(SystemExit):
            report_e2e.parse_args(bad)


# --------------------------------------------------------------------------------------------------- report

B224, B384 = "deit_base_patch16_224", "deit_base_patch16_384"


def _spread(median_us: float) -> dict:
    return {"median": median_us, "q1": 0.95 * median_us, "q3": 1.05 * median_us, "lo": 0.9 * median_us,
            "hi": 1.2 * median_us, "n": 20}  # fmt: skip


def _row(model: str, workload: str, keep: float, batch: int, row: str, rate: float | None, **extra) -> dict:
    res = 384 if model.endswith("384") else 224
    kind = extra.pop("kind", "throughput")
    out = {
        "key": f"{model}|{workload}|k{keep:g}|B{batch}|{row}|{kind}",
        "model": model,
        "resolution": res,
        "batch": batch,
        "workload": workload,
        "workload_kind": workload_kind(workload, keep),
        "keep_rate": keep,
        "pruned_pct": round(100 * (1 - keep)),
        "row": row,
        "label": row,
        "kind": kind,
        "counts": {"stages": 1, "mean": [98.0], "min": [60], "max": [137], "keep_fraction_last": 0.5},
        "workload_desc": WORKLOADS[workload].description if workload in WORKLOADS else None,
        "check": {"ok": True, "max_abs_diff": 1e-3, "bound": 4e-3, "top1_agree": 1.0, "reason": None},
    }
    if rate is None:
        out.update(status="unavailable", reason="ragged_vit.pipelines.graphs is not importable here")
    else:
        wall = batch / rate * 1e6
        out.update(status="ok", img_per_s=rate, wall_us=_spread(wall), events_us=_spread(0.9 * wall), iters=20)
        out["graph_us"] = _spread(0.5 * wall) if workload_kind(workload, keep) != "ragged" else None
    out.update(extra)
    return out


ROW_SPEED = {  # relative img/s of each row (padded = 1)
    "timm_eager": 0.9, "timm_compiled": 2.0, "padded": 1.0, "padded_full": 0.8, "fa2_varlen": 1.6,
    "nested_sdpa": 0.1, "triton": 1.8, "triton_graphed": 3.3, "fa2_varlen_graphed": 3.0, "padded_graphed": None,
}  # fmt: skip


def _meta(quick: bool, date: str) -> dict:
    return {
        "card": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "timm": "1.0.29",
        "cuda": "13.0", "commit": "abc123", "dtype": "float16", "weights": "random (seeded)", "date": date,
        "args": {"quick": quick},
    }  # fmt: skip


def _throughput_rows(models: list[str], workloads: list[str], batches: list[int], keep: float = 0.5) -> list[dict]:
    rows = []
    for model in models:
        scale = 0.4 if model.endswith("384") else 1.0
        for b in batches:
            base = 300 * scale * min(b, 32) ** 0.8
            rows.append(_row(model, "none", 1.0, b, "timm_eager", base * ROW_SPEED["timm_eager"]))
            rows.append(_row(model, "none", 1.0, b, "timm_compiled", base * 2.0, compile_s=31.5))
            for w in workloads:
                for r, speed in ROW_SPEED.items():
                    if r.startswith("timm_"):
                        continue
                    if r == "nested_sdpa" and b > 4:
                        rows.append(
                            _row(model, w, keep, b, r, None, status="skipped", single_forward_ms=41.0, reason="slow")
                        )
                        continue
                    rows.append(_row(model, w, keep, b, r, None if speed is None else base * speed))
    return rows


def _write_fixtures(root: Path) -> Path:
    card = root / "nvidia-h200"
    e2e = card / "e2e"
    e2e.mkdir(parents=True)
    t3_quick = {"part": "table3", "quick": True, "meta": _meta(True, "2026-11-26T10:00:00+0000"),
                "rows": _throughput_rows([B224], ["l2_ratio", "ats"], [1, 4, 64])}  # fmt: skip
    t3_full = {"part": "table3", "quick": False, "meta": _meta(False, "2026-11-26T11:00:00+0000"),
               "rows": _throughput_rows([B224], ["l2_ratio", "synthetic"], [1, 4, 8, 64, 128])}  # fmt: skip
    t3_full["rows"][0]["img_per_s"] = 777.0  # B=1 timm eager: must replace the quick run's row
    fig1_rows = _throughput_rows([B224], [], [64])
    for pct in (0, 50, 90):
        keep = round(1 - pct / 100, 2)
        for w in ("l2_ratio", "synthetic"):
            for r in ("padded", "triton", "triton_graphed"):
                rate = 9000 * (1 + (3 if r != "padded" else 0.2) * pct / 100)
                fig1_rows.append(_row(B224, w, keep, 64, r, rate))
    stages = []
    for r in ("padded", "padded_full", "fa2_varlen", "triton"):
        st = {k: _spread(v) for k, v in zip(("front", "pack", "late", "head", "total"), (900, 80, 2000, 30, 3010),
                                             strict=True)}  # fmt: skip
        stages.append(_row(B224, "l2_ratio", 0.5, 8, r, 2000.0, kind="stages", stages_us=st))
    numerics = [
        _row(B224, w, 0.5, b, "padded", None, kind="numerics", status="ok",
             vs_padded={"triton": {"max": 0.002, "mean": 1e-4, "top1_agree": 1.0},
                        "fa2_varlen": {"max": 0.003, "mean": 1e-4, "top1_agree": 1.0}},
             vs_fp32={"triton": {"max": 0.004}, "padded": {"max": 0.004}})
        for w in ("l2_ratio", "ats") for b in (1, 4, 16)
    ]  # fmt: skip
    kernel_rows = [
        {"batch": 32, "pruned_pct": p, "workload_kind": "fixed", "tokens": 100, "max_vs_padded": 4e-4,
         "mean_vs_padded": 1e-5, "max_ours_vs_fp32": 3e-4, "max_padded_vs_fp32": 3e-4} for p in (0, 50, 80)
    ]  # fmt: skip
    parts = {
        "table3-quick": t3_quick,
        "table3-b1-128": t3_full,
        "fig1": {"part": "fig1", "quick": False, "meta": _meta(False, "d"), "rows": fig1_rows},
        "table4": {"part": "table4", "quick": False, "meta": _meta(False, "d"), "rows": stages},
        "table5": {"part": "table5", "quick": False, "meta": _meta(False, "d"),
                   "rows": _throughput_rows(list(tables.PAPER_TABLE_V), ["l2_ratio"], [4, 64])},
        "res384": {"part": "res384", "quick": False, "meta": _meta(False, "d"),
                   "rows": _throughput_rows([B224, B384], ["l2_ratio", "synthetic"], [1, 4, 32])},
        "table6": {"part": "table6", "quick": False, "meta": _meta(False, "d"), "rows": numerics,
                   "kernel_rows": kernel_rows},
    }  # fmt: skip
    for name, payload in parts.items():
        (e2e / f"{name}.json").write_text(json.dumps(payload))
    (e2e / "notes.json").write_text("[1, 2]")  # not a part: ignored
    (card / "attention.json").write_text(json.dumps(_kernel_fixture()))
    (card / "tome_peer.json").write_text(json.dumps(_tome_fixture()))
    (card / "default_call.json").write_text(json.dumps(_default_call_fixture()))
    for name, payload in _issue40_fixtures().items():
        (card / name).write_text(json.dumps(payload))
    return card


def _default_call_fixture() -> dict:
    """A ``benchmarks.default_call`` run: two batch sizes, one workload, the before table, a stream, eager rounds."""
    def clock(each: float, b2b: float, **extra: object) -> dict:
        return {"each_us": each, "back_to_back_us": b2b, **extra}

    def table(default: float) -> list[dict]:
        rows = []
        for batch, timm in ((1, 800.0), (64, 6400.0)):
            rows.append({"batch": batch, "timm_eager": clock(5 * timm, 4 * timm),
                         "timm_compiled": clock(timm, timm * 0.8, first_call_s=10.0)})
            for row, us in (("default", default * timm), ("graphed", 0.8 * timm)):
                rows.append({"batch": batch, "workload": "evit", "keep": 0.7, "row": row,
                             **clock(us, us * 0.9, first_call_s=4.0)})
        return rows

    stream = {"sizes": [1, 5, 5], "distinct": 2, "timm_compiled": {"first_pass_s": 9.0, "img_per_s_each": 100.0,
              "img_per_s_back_to_back": 200.0}, "evit": {"first_pass_s": 3.0, "img_per_s_each": 300.0,
              "img_per_s_back_to_back": 260.0}}  # fmt: skip
    rounds = [{"batch": 64, "round": r, "timm_eager": {"each_us": 6000.0}, "evit": {"each_us": 5000.0}} for r in (0, 1)]
    return {"commit": "abc123", "table": table(0.8), "before": {"commit": "0ld", "table": table(5.0)},
            "stream": stream, "eager_rounds": {"commit": "abc123", "rounds": rounds}}  # fmt: skip


def _issue40_fixtures() -> dict[str, dict]:
    """Issue 40's stored runs: ``benchmarks.default_call --model`` on DINOv3 at 224 (complete) and 512 (cut short
    after B = 4), a ``--smoke`` run of EVA-02 (ignored: timed on a CPU), and ``benchmarks.naflex`` split over two
    files (the later one's B = 64 rows replace the earlier one's) plus a ``--smoke`` one (ignored)."""
    env = {"card": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-11-29T10:00:00+0000"}

    def call(model: str, size: int, speedups: dict[int, dict[str, float]], **extra: object) -> dict:
        table = []
        for batch, ours in speedups.items():
            timm = 1000.0 * batch
            table.append({"batch": batch, "timm_compiled": {"each_us": timm, "back_to_back_us": timm,
                                                            "first_call_s": 30.0}})  # fmt: skip
            for w, up in ours.items():
                table.append({"batch": batch, "workload": w, "keep": dict(make_results.ROPE_WORKLOADS)[w],
                              "row": "default", "each_us": timm / up, "back_to_back_us": timm / up,
                              "first_call_s": 5.0})  # fmt: skip
        return {"environment": env, "model": model, "img_size": size, "dtype": "float16", "complete": True,
                "table": table, **extra}  # fmt: skip

    def row(name: str, batch: int, rate: float | None, status: str = "ok") -> dict:
        rates = {"img_per_s": rate, "img_per_s_back_to_back": 1.1 * rate} if rate else {}
        return {"row": name, "batch": batch, "status": status, **rates}

    model = make_results.naflex.MODEL
    b64 = [row("timm_eager", 64, 100.0), row("timm_compiled:default", 64, 150.0),
           row("timm_compiled:reduce-overhead", 64, None, "failed: raised X"),
           row("timm_compiled:max-autotune-no-cudagraphs", 64, 160.0), row("ours", 64, 264.0),
           row("ours_threshold_l2", 64, 320.0)]  # fmt: skip
    small = [row(name, b, rate * b) for b in (1, 8) for name, rate in
             (("timm_eager", 20.0), ("timm_compiled:default", 40.0), ("ours", 44.0), ("ours_threshold_l2", 60.0))]
    earlier = {**env, "date": "2026-11-28T10:00:00+0000"}
    return {
        "default_call_vit_base_patch16_dinov3_224.json": call("vit_base_patch16_dinov3", 224, {
            1: {"l2_calibrated": 1.1, "evit": 0.95}, 4: {"l2_calibrated": 1.35, "evit": 1.25},
            64: {"l2_calibrated": 1.5, "evit": 1.4}}),
        "default_call_vit_base_patch16_dinov3_512.json": call("vit_base_patch16_dinov3", 512, {
            1: {"l2_calibrated": 1.2, "evit": 1.3}, 4: {"l2_calibrated": 1.4, "evit": 1.45}}, complete=False),
        "default_call_eva02_base_patch14_224_56.json": call("eva02_base_patch14_224", 224, {
            4: {"l2_calibrated": 9.0}}, smoke=True),
        "naflex.json": {"environment": env, "model": model, "seed": 0, "smoke": False, "rows": b64},
        "naflex_b1_8.json": {"environment": earlier, "model": model, "seed": 0, "smoke": False,
                             "rows": [*small, row("ours", 64, 999.0)]},
        "naflex_smoke.json": {"environment": {**env, "card": None}, "model": model, "seed": 0, "smoke": True,
                              "rows": [row("ours", 64, 1e6), row("timm_eager", 64, 1.0)]},
    }  # fmt: skip


def _tome_fixture() -> dict:
    """A ``benchmarks.tome_peer`` run: both clocks, a failed peer row, an adaptive row at B = 64 only."""
    def ok(row: str, batch: int, alone: float, in_a_row: float) -> dict:
        return {"row": row, "label": row, "batch": batch, "status": "ok", "img_per_s": alone,
                "img_per_s_back_to_back": in_a_row}  # fmt: skip

    rows = [ok("timm_compiled", 1, 1000.0, 1100.0), ok("peer_compiled", 1, 700.0, 800.0),
            ok("ours", 1, 1500.0, 1700.0), ok("timm_compiled", 4, 4000.0, 4400.0),
            {"row": "peer_compiled", "label": "peer_compiled", "batch": 4, "status": "failed", "reason": "raised X"},
            ok("peer_sdpa_compiled", 4, 3000.0, 3100.0), ok("ours", 4, 4800.0, 5600.0),
            ok("timm_compiled", 64, 10000.0, 10100.0), ok("peer_sdpa_compiled", 64, 11000.0, 11100.0),
            ok("ours", 64, 16000.0, 16200.0), ok("ours_adaptive", 64, 15600.0, 15700.0)]  # fmt: skip
    meta = {"card": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "timm": "1.0.29",
            "cuda": "13.0", "commit": "abc123", "date": "d", "model": "deit_base_patch16_224", "r": 13,
            "dtype": "float16", "weights": "random (seeded)"}  # fmt: skip
    return {"meta": meta, "rows": rows}


def _kernel_fixture() -> dict:
    cells = []
    for b in (1, 32, 64):
        for p in (0, 50, 80):
            peers = {}
            for name, us in (("padded_sdpa", 70), ("varlen_attn", 50), ("fa2_aten", 30), ("ours", 15)):
                t = us * (1 + b / 64) * (1 - p / 200)
                peers[name] = {
                    "status": "ok",
                    "wall_us": _spread(t),
                    "events_us": _spread(t),
                    "graph_us": _spread(t / 2),
                }
            peers["nested_sdpa"] = {"status": "failed", "reason": "raised RuntimeError: no"}
            cells.append(
                {"batch": b, "pruned_pct": p, "variable": True, "tokens": b * 100, "max_len": 120, "min_len": 80,
                 "mean_len": 100.0, "roofline_us": 5.0, "peers": peers,
                 "ratios": {"ours_over_fa2_aten_graph": 0.5, "ours_over_roofline_graph": 1.4}}
            )  # fmt: skip
    peers = ["padded_sdpa", "varlen_attn", "fa2_aten", "nested_sdpa", "ours"]
    meta = {"card": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
            "commit": "abc123", "copy_bandwidth_gbps": 3900.0, "date": "d"}  # fmt: skip
    meta["args"] = {"fixed": False, "peers": peers}
    return {"meta": meta, "cells": cells}


def test_merge_prefers_full_and_later_runs() -> None:
    quick = {
        "part": "table3",
        "quick": True,
        "meta": _meta(True, "2026-11-27"),
        "rows": [_row(B224, "ats", 0.5, 1, "triton", 10.0)],
    }
    full = {
        "part": "table3",
        "quick": False,
        "meta": _meta(False, "2026-11-26"),
        "rows": [_row(B224, "ats", 0.5, 1, "triton", 20.0)],
    }
    later = copy.deepcopy(full)
    later["meta"]["date"] = "2026-11-28"
    later["rows"][0]["img_per_s"] = 30.0
    assert tables.merge_payloads([quick, full])["rows"][0]["img_per_s"] == 20.0
    merged = tables.merge_payloads([later, quick, full])
    assert merged["rows"][0]["img_per_s"] == 30.0 and len(merged["metas"]) == 3 and not merged["quick"]


def test_make_results_writes_tables_and_figures(tmp_path: Path) -> None:
    card = _write_fixtures(tmp_path / "baselines")
    out = tmp_path / "docs" / "results.md"
    targets, readme = out.parent / "targets.md", tmp_path / "README.md"
    targets.parent.mkdir(parents=True)
    targets.write_text("# Targets\n\nby hand\n\n<!-- targets:begin -->\nSTALE\n<!-- targets:end -->\n\nafter\n")
    readme.write_text("# R\n\n<!-- results:begin -->\n<!-- results:end -->\n\n## Tests\n")
    assert make_results.main(["--baselines", str(card.parent), "--out", str(out)]) == 0
    text = out.read_text()
    for heading in (
        "## NVIDIA H200", "### Tables I and II", "### Table III", "### Table IV", "### Table V",
        "### Section V-D", "### Figure 1", "### Table VI", "### The default call",
    ):  # fmt: skip
        assert heading in text, heading
    assert "not measured on this card" not in text and "docs/targets.md" in text
    assert "| evit, default | 1.25x / 1.11x (1,562) |" in text, "the default call's ratios on both clocks"
    assert "evit 3.00x / 1.30x (first pass 3 s)" in text and "B=64 evit 1.20/1.20" in text
    assert "torch 2.11.0+cu130, triton 3.6.0, timm 1.0.29" in text
    assert "**ats** (ragged" in text and "**l2_ratio** (fixed" in text and "(dense" in text
    assert "503 / 418 / 467" in text, "the paper's Table III row beside ours"
    assert "| 1 | 777 |" in text, "the full run's row replaced the quick run's"
    assert "skip (41 ms/fwd)" in text and "n/a" in text
    assert "paper: padded (fair) (RTX 4000 Ada, B=8) | 2.31 | 0.28 | 5.24 | 0.03 | 7.86" in text
    assert "4.88e-04" in text and "3.91e-03" in text, "Table VI kernel and E2E rows of the paper"
    assert "0.112" in text, "Table I of the paper"
    # ToMe: its stored run's report (both clocks)
    assert "### Token merging (ToMe) against its peer (deit_base_patch16_224, r = 13)" in text
    assert "| ours vs unpruned reduce-overhead | 1.55x | 1.27x | 1.60x |" in text, "the back-to-back table"
    assert "| ToMe peer (patched timm, explicit attention), torch.compile" in text and "failed: raised X" in text
    # docs/targets.md: the hand-written parts kept, one generated row per target and card with its data file
    tt = targets.read_text()
    assert tt.startswith("# Targets\n\nby hand\n") and tt.endswith("<!-- targets:end -->\n\nafter\n")
    assert "STALE" not in tt and "| target | card | value | verdict | date | data file |" in tt
    data = "`" + (card / "tome_peer.json").name + "`"  # outside the repository: the file's name
    tome = "ToMe r = 13 (`GraphedPrunedViT`) vs unpruned timm reduce-overhead, each forward alone"
    assert f"| {tome}: >= 1.20x / 1.30x / 1.50x at B=1 / B=4 / B=64 | NVIDIA H200 | 1.50x / 1.20x / 1.60x | " \
           f"**missed** (B=4: ours 1.20x) | d | {data} |" in tt  # fmt: skip
    assert "vs the ToMe peer's best mode (timm patched with the merge, reduce-overhead): >= 1.70x / 1.70x / 1.60x " \
           "at B=1 / B=4 / B=64 | NVIDIA H200 | 2.14x / 1.60x / 1.45x | **missed** (B=4: ours 1.60x; B=64: ours " \
           "1.45x) |" in tt  # fmt: skip
    assert "| adaptive ToMe (r = 13's mean rows) vs fixed r: >= 0.95x at B=64 | NVIDIA H200 | 0.97x | met |" in tt
    assert "default call, every pruner, vs unpruned timm reduce-overhead, each forward synchronised: >= 1.25x / " \
           "1.25x / 1.45x at B=1 / B=4 / B=64 | NVIDIA H200 | 1.25x / - / 1.25x | **missed** (B=64: evit 1.25x) " \
           "(B=4 not measured) |" in tt  # fmt: skip
    kernel = "| attention device time (graph replay) over FA2-aten, every cell: <= 0.60x | NVIDIA H200 | 0.50x (B=1 0%)"
    assert f"{kernel} | met |" in tt
    # issue 40: the RoPE models' default call and the NaFlex batch, each target on the card, measured or not
    rope = ", default call, Threshold-L2 calibrated 0.5 and EViT 0.7 (where it applies), vs unpruned timm " \
           "reduce-overhead, each forward synchronised: >= 1.30x / 1.30x at B=4 / B=64 (B=1 reported) | NVIDIA H200 |"
    assert f"| DINOv3 ViT-B/16 at 224 (`vit_base_patch16_dinov3`){rope} 1.25x / 1.40x (reported: B=1 0.95x) | " \
           "**missed** (B=4: evit 1.25x) | 2026-11-29 | `default_call_vit_base_patch16_dinov3_224.json` |" in tt
    assert f"| DINOv3 ViT-B/16 at 512 (`vit_base_patch16_dinov3`){rope} 1.40x / - (reported: B=1 1.20x) | met " \
           "(B=64 not measured) (run cut short) | 2026-11-29 | `default_call_vit_base_patch16_dinov3_512.json` |" in tt
    assert f"| EVA-02 base at 224 (`eva02_base_patch14_224`){rope} - | not measured | - | " \
           "`default_call_eva02_base_patch14_224.json` |" in tt, "a --smoke run measures nothing"
    naflex = "NaFlex ViT-B/16 (`naflexvit_base_patch16_siglip`), 64 images of 128-512 px, aspect 1:3 to 3:1, seed 0, "
    best = "vs timm NaFlexVit at its best mode (eager or torch.compile), each forward synchronised"
    assert f"| {naflex}unpruned, {best}: >= 1.50x at B=64 (B=1 / B=8 reported) | NVIDIA H200 | 1.65x (reported: " \
           "B=1 1.10x, B=8 1.10x) | met | 2026-11-29 | `nvidia-h200/naflex*.json` |" in tt
    assert f"| {naflex}with Threshold-L2 0.5, {best}: >= 2.20x at B=64 (B=1 / B=8 reported) | NVIDIA H200 | 2.00x " \
           "(reported: B=1 1.50x, B=8 1.50x) | **missed** (B=64: over timm_compiled:max-autotune-no-cudagraphs " \
           "2.00x) |" in tt
    assert "### The default call (`prune(model)(images)`) against unpruned timm `reduce-overhead`: " \
           "vit_base_patch16_dinov3 at 224 (`default_call_vit_base_patch16_dinov3_224.json`)" in text
    assert "(vit_base_patch16_dinov3 at 512 fp16, random weights)" in text and "eva02" not in text
    assert "each B=4 >= 1.3x: worst 1.250x (missed); each B=64 >= 1.3x: worst 1.400x (met)" in text
    assert "### Native-resolution batches: ours against timm `NaFlexVit` (`naflex_b1_8.json`, `naflex.json`)" in text
    assert "| ours | 44 / 48 (1.10x) | 352 / 387 (1.10x) | 264 / 290 (1.65x) |" in text
    assert "| timm_compiled:reduce-overhead | - | - | failed |" in text
    assert "**missed**" in tt and "| met |" in tt
    # README: one generated table per card, the default call's ratios to timm reduce-overhead on both clocks
    rt = readme.read_text()
    assert rt.endswith("<!-- results:end -->\n\n## Tests\n") and "**nvidia-h200** (`default_call.json`)" in rt
    assert "| B | timm `reduce-overhead`, img/s | EViT 0.7 |" in rt and "| 1 | 1,250 / 1,562 | 1.25x / 1.11x |" in rt
    figures = out.parent / "figures"
    pytest.importorskip("matplotlib")
    pngs = sorted(p.name for p in figures.glob("*.png"))
    assert pngs == [
        "nvidia-h200-res224-vs-384.png", "nvidia-h200-speedup-vs-pruning.png", "nvidia-h200-throughput-vs-batch.png",
    ]  # fmt: skip
    assert all((figures / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "](figures/nvidia-h200-speedup-vs-pruning.png)" in text
    # Deterministic: the same JSON gives the same bytes.
    first = {p: (figures / p).read_bytes() for p in pngs}
    assert make_results.main(["--baselines", str(card.parent), "--out", str(out)]) == 0
    assert out.read_text() == text and targets.read_text() == tt and readme.read_text() == rt
    assert {p: (figures / p).read_bytes() for p in pngs} == first


def test_make_results_takes_the_adaptive_rows_from_their_own_run(tmp_path: Path) -> None:
    """ToMe's fixed-r run without adaptive rows and the adaptive rows' own run (``tome_peer_adaptive.json``): the
    adaptive target is the ratio of that run's own rows and names its file; the other targets stay the first run's."""
    card = tmp_path / "nvidia-h200"
    card.mkdir()
    fixed = _tome_fixture()
    apart = {"meta": {**fixed["meta"], "date": "later"},
             "rows": [r for r in fixed["rows"] if r["batch"] == 64 and r["row"].startswith("ours")]}  # fmt: skip
    apart["rows"] = [{**r, "img_per_s": r["img_per_s"] / 2} for r in apart["rows"]]  # its own clock: ratio 0.975
    fixed["rows"] = [r for r in fixed["rows"] if r["row"] != "ours_adaptive"]
    (card / "tome_peer.json").write_text(json.dumps(fixed))
    rows = {t.target.split(":")[0]: t for t in make_results.all_targets(tmp_path, tmp_path / "data")}
    assert "adaptive ToMe (r = 13's mean rows) vs fixed r" not in rows, "not measured: no adaptive row anywhere"
    (card / make_results.TOME_ADAPTIVE_FILE).write_text(json.dumps(apart))
    rows = {t.target.split(":")[0]: t for t in make_results.all_targets(tmp_path, tmp_path / "data")}
    adaptive = rows["adaptive ToMe (r = 13's mean rows) vs fixed r"]
    assert (adaptive.value, adaptive.verdict, adaptive.date) == ("0.97x", "met", "later")
    assert adaptive.data.endswith(make_results.TOME_ADAPTIVE_FILE)
    vs_timm = rows["ToMe r = 13 (`GraphedPrunedViT`) vs unpruned timm reduce-overhead, each forward alone"]
    assert vs_timm.value == "1.50x / 1.20x / 1.60x" and vs_timm.data.endswith("tome_peer.json")
    section = make_results.card_section(card, {}, None, tmp_path / "figures", tmp_path, make_results.load_tome(card))
    assert f"#### The adaptive rows' own run (`{make_results.TOME_ADAPTIVE_FILE}`)" in section


def test_make_results_says_what_issue_40_has_not_measured(tmp_path: Path) -> None:
    """A card without issue 40's files has every one of its targets, "not measured", naming the file to store."""
    card = tmp_path / "nvidia-h200"
    card.mkdir()
    (card / "tome_peer.json").write_text(json.dumps(_tome_fixture()))
    rows = make_results.all_targets(tmp_path, tmp_path / "data")
    issue40 = [t for t in rows if t.target.startswith(("DINOv3", "EVA-02", "NaFlex"))]
    assert len(issue40) == len(make_results.ROPE_RUNS) + len(make_results.NAFLEX_BARS) == 5
    assert {(t.card, t.value, t.verdict, t.date) for t in issue40} == {("NVIDIA H200", "-", "not measured", "-")}
    assert [t.data for t in issue40] == ["default_call_vit_base_patch16_dinov3_224.json",
                                         "default_call_eva02_base_patch14_224.json",
                                         "default_call_vit_base_patch16_dinov3_512.json", "naflex.json",
                                         "naflex.json"]  # fmt: skip


def test_default_call_result_files() -> None:
    """DeiT-B 224's run keeps its name; any other model's names the model, and the size unless the name has it."""
    assert default_call.result_file() == default_call.result_file("deit_base_patch16_224", 224) == "default_call.json"
    assert default_call.result_file("vit_base_patch16_dinov3", 512) == "default_call_vit_base_patch16_dinov3_512.json"
    assert default_call.result_file("eva02_base_patch14_224", 224) == "default_call_eva02_base_patch14_224.json"
    assert default_call.result_file("deit_base_patch16_224", 384) == "default_call_deit_base_patch16_224_384.json"


def test_default_call_smoke_on_an_eva_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``benchmarks.default_call --smoke --model`` end to end on the CPU: a tiny EVA-02 (the family's layout, RoPE,
    class token), both workloads of issue 40, rows checked against the eager pipeline and written to the per-model
    file (which make_results ignores: a smoke run times nothing)."""
    card = tmp_path / "card"
    argv = ["--smoke", "--model", "eva02_base_patch14_224", "--img-size", "56", "--batches", "1,2", "--workloads",
            "l2:0.5,evit:0.7", "--out", f"{card}/"]  # fmt: skip
    assert default_call.main(argv) == 0
    payload = json.loads((card / "default_call_eva02_base_patch14_224_56.json").read_text())
    assert (payload["model"], payload["img_size"], payload["smoke"], payload["complete"]) == (
        "eva02_base_patch14_224", 56, True, True)  # fmt: skip
    model = default_call.CallLab(torch.device("cpu"), torch.float32, "eva02_base_patch14_224",
                                 {**default_call.SMOKE, "img_size": 56}).model("eva02_base_patch14_224")  # fmt: skip
    assert payload["weight_bytes"] == 4 * sum(p.numel() for p in model.parameters())  # fp32 on the CPU
    rows = [(e["batch"], e["workload"], e["keep"], e["row"]) for e in payload["table"] if "row" in e]
    assert rows == [(b, w, k, r) for b in (1, 2) for w, k in (("l2_calibrated", 0.5), ("evit", 0.7))
                    for r in ("default", "eager")]  # fmt: skip
    assert all(e["check"]["ok"] and e["each_us"] > 0 for e in payload["table"] if "row" in e)
    assert all("timm_eager" in e and "timm_compiled" not in e for e in payload["table"] if "row" not in e)
    assert {t.verdict for t in make_results.issue40_targets(card, "X")} == {"not measured"}


def test_default_call_appends_batch_sizes_over_calls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--append`` keeps the stored run's rows at the batch sizes a later call does not time, says which call timed
    which, and refuses a stored run of another model setting (one line, exit 2)."""
    out = tmp_path / "latency.json"
    run = ["--smoke", "--workloads", "evit:0.7", "--rows", "default", "--out", str(out), "--append"]
    assert default_call.main([*run, "--batches", "1,2"]) == 0
    first = json.loads(out.read_text())
    assert default_call.main([*run, "--batches", "2,3"]) == 0  # B = 2 timed again: the new rows replace the old
    payload = json.loads(out.read_text())
    assert sorted((e["batch"], e.get("row", "")) for e in payload["table"]) == [
        (1, ""), (1, "default"), (2, ""), (2, "default"), (3, ""), (3, "default")]  # fmt: skip
    assert [e for e in payload["table"] if e["batch"] == 1] == [e for e in first["table"] if e["batch"] == 1]
    assert payload["earlier"] == [{"batches": [1], "environment": first["environment"], "argv": first["argv"]}]
    assert default_call.main([*run, "--batches", "1"]) == 0  # the first call's rows are all replaced now
    assert [e["batches"] for e in json.loads(out.read_text())["earlier"]] == [[2, 3]]
    capsys.readouterr()
    assert default_call.main([*run, "--batches", "1", "--img-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks.default_call: --append: ") and "img_size" in err and err.count("\n") == 1
    assert default_call.main(["--smoke", "--append", "--batches", "1"]) == 2
    assert "--append: needs --out" in capsys.readouterr().err


def test_a_rope_row_that_failed_its_check_is_a_miss() -> None:
    """A stored RoPE run whose B = 64 EViT row failed its check: the target is missed, naming that row, though every
    timed row reaches its bar."""
    payload = _issue40_fixtures()["default_call_vit_base_patch16_dinov3_224.json"]
    for entry in payload["table"]:
        if entry.get("row") and entry["workload"] == "evit" and entry["batch"] == 4:
            entry["each_us"] = entry["each_us"] / 2  # 2.5x: every timed row over its bar
    payload["table"] = [{"batch": 64, "workload": "evit", "keep": 0.7, "row": "default", "status": "failed",
                         "check": {"ok": False}} if e.get("row") and (e["batch"], e["workload"]) == (64, "evit")
                        else e for e in payload["table"]]  # fmt: skip
    value, verdict = make_results.rope_targets(payload)
    assert value.startswith("1.35x / 1.50x") and verdict == "**missed** (B=64: evit failed its check, not timed)"
    text = default_call.render(payload)  # docs/results.md's section says so too
    assert "| check failed |" in text and "each B=64 >= 1.3x: worst 1.500x (missed, evit failed its check)" in text


def _latency_run(commit: str, b1_us: dict[str, float], b4_us: float, b64_ratio: float) -> dict:
    """A ``gpu_suite.sh issue41`` run on an H200: both timm modes, every workload of issue 41 at B = 1, 4 and 64."""
    workloads = [("l2_ratio", 0.5), ("l2_calibrated", 0.5), ("ats", 0.5), ("dynamicvit", 0.7), ("evit", 0.7),
                 ("tome", 13.0)]  # fmt: skip
    table = []
    for b, timm in ((1, 800.0), (4, 1000.0), (64, 6400.0)):
        timm_rows = {"timm_compiled": {"each_us": timm, "back_to_back_us": timm}}
        if b == 1:
            timm_rows["timm_max_autotune"] = {"each_us": 700.0, "back_to_back_us": 650.0}
        table.append({"batch": b, **timm_rows})
        for w, keep in workloads:
            us = {1: b1_us.get(w, 280.0), 4: b4_us, 64: timm / b64_ratio}[b]
            table.append({"batch": b, "workload": w, "keep": keep, "row": "default", "each_us": us,
                          "back_to_back_us": us})  # fmt: skip
    env = {"card": "NVIDIA H200", "commit": commit, "date": "2026-12-01T10:00:00+0000"}
    return {"environment": env, "model": "deit_base_patch16_224", "img_size": 224, "weight_bytes": 173_000_000,
            "complete": True, "table": table}  # fmt: skip


def test_issue41_targets_from_the_latency_run_and_today(tmp_path: Path) -> None:
    """The latency run against the card's "today": B = 1 times (L2 at most 250 us, the others 1.2x that), both timm
    modes, B = 4 img/s over today's, B = 64 same-run ratios over today's, the weight bandwidth; today's own run
    measures none of the comparisons."""
    card, data = tmp_path / "nvidia-h200", tmp_path / "data"
    card.mkdir()
    data.mkdir()
    today = {"meta": {"card": "NVIDIA H200", "commit": "0ld"}, "b4_img_per_s": {w: 4000.0 for w in
             ("l2_calibrated", "ats", "dynamicvit", "evit", "tome")}, "b64_over_timm": {w: 1.6 for w in
             ("l2_calibrated", "ats", "dynamicvit", "evit", "tome")}}  # fmt: skip
    (data / "issue41_before_h200.json").write_text(json.dumps(today))
    run = _latency_run("n3w", {"l2_ratio": 240.0, "l2_calibrated": 260.0, "tome": 310.0}, 4e6 / 6400.0, 1.55)
    (card / make_results.LATENCY_FILE).write_text(json.dumps(run))
    targets = make_results.issue41_targets(card, "NVIDIA H200", data)

    def row(*words: str) -> make_results.Target:
        (found,) = [t for t in targets if all(w in t.target for w in words)]
        return found

    l2 = row("B=1, Threshold-L2 ratio and calibrated 0.5")
    assert (l2.value, l2.verdict) == ("260.0 us (l2_calibrated)", "**missed** (B=1: l2_calibrated 260.0 us)")
    others = row("every other pruner within 1.2x", "<= 300.0 us")
    assert (others.value, others.verdict) == ("310.0 us (tome)", "**missed** (B=1: tome 310.0 us)")
    peers = row("over unpruned timm reduce-overhead and max-autotune")  # 700 / 260: max-autotune is the faster peer
    assert (peers.value, peers.verdict) == ("2.69x (l2_calibrated over timm_max_autotune)", "met")
    gains = row("B=4, every pruner, img/s over today's (0ld)")
    assert (gains.value, gains.verdict) == ("1.60x (l2_calibrated)", "met")  # 6400 / 4000 img/s
    kept = row("B=64, every pruner")
    assert kept.value.startswith("0.97x") and kept.verdict == "met"  # 1.55 / 1.6 >= 0.95
    bandwidth = row("achieved weight bandwidth")
    assert (bandwidth.value, bandwidth.verdict) == ("0.72 TB/s (15% of 4.8 TB/s)", "reported")  # 173 MB / 240 us
    latency = make_results._rel(card / make_results.LATENCY_FILE)
    assert gains.data == f"{latency}` and `{make_results._rel(data / 'issue41_before_h200.json')}"
    (card / make_results.LATENCY_FILE).write_text(json.dumps(_latency_run("0ld", {}, 1000.0, 1.6)))
    same = make_results.issue41_targets(card, "NVIDIA H200", data)
    assert [t.verdict for t in same if "today's" in t.target] == ["not measured", "not measured"]
    assert [t.verdict for t in same if "bandwidth" in t.target] == ["reported"]  # today's run measures its own latency


def test_default_call_check_counts_a_flipped_selection_as_one_image() -> None:
    """An image whose logits moved with its counts equal (EViT keeps a fixed count: a near-tie flips which rows) is
    one image that does not agree, as a flipped count is; the run passes while half the images agree."""
    ref_logits, counts = torch.randn(4, 10), torch.tensor([[5, 3]] * 4)
    ref = types.SimpleNamespace(logits=ref_logits, counts=counts)
    moved = ref_logits.clone()
    moved[1] += 1.0
    result = default_call.check((moved, counts.clone()), ref)
    assert result["ok"] and result["counts_agree"] == 1.0 and result["images_agree"] == 0.75
    assert result["max_abs_diff"] == 0.0 and result["max_abs_diff_all"] == pytest.approx(1.0)
    assert not default_call.check((ref_logits + 1.0, counts), ref)["ok"]  # every image moved: broken
    assert not default_call.check((moved[:, :1].expand(4, 10) * float("nan"), counts), ref)["ok"]


def test_naflex_timed_keeps_the_first_output_from_later_calls() -> None:
    """A forward whose output buffer the next call overwrites (a reduce-overhead graph's): the checked logits are the
    first call's."""
    buffer, calls = torch.zeros(2), []

    def forward() -> torch.Tensor:
        calls.append(1)
        return buffer.fill_(len(calls))

    result = naflex.timed(forward, torch.device("cpu"), smoke=True)
    assert len(calls) > 1 and torch.equal(result["logits"], torch.ones(2))


@pytest.mark.parametrize(("model", "size", "workload", "says"), [
    ("vit_medium_patch16_rope_reg1_gap_256", "64", "evit:0.7", "has no class token"),  # EViT needs a class token
    ("vit_small_patch16_dinov3", "64", "tome:2", "rotary position embeddings"),  # ToMe refuses RoPE models
    ("no_such_model_anywhere", "64", "l2:0.5", "is not a timm model"),
])  # fmt: skip
def test_default_call_refuses_what_does_not_apply(model: str, size: str, workload: str, says: str,
                                                  tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    argv = ["--smoke", "--model", model, "--img-size", size, "--workloads", workload, "--out", f"{tmp_path}/"]
    assert default_call.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks.default_call: ") and says in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir()), "nothing written"


def test_make_results_without_results(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    assert make_results.main(["--baselines", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert "no stored results" in out.read_text()


def test_tables_have_consistent_columns(tmp_path: Path) -> None:
    card = _write_fixtures(tmp_path)
    parts, _ = make_results.load_card(card)
    for part, payload in parts.items():
        text = tables.render_part(payload)
        for block in text.split("\n\n"):
            lines = [ln for ln in block.splitlines() if ln.startswith("|")]
            if lines:
                assert len({ln.count(" | ") for ln in lines if not ln.startswith("|---")}) == 1, (part, block)


# --------------------------------------------------------------------------------------------------- run_bench


def test_run_bench_command(tmp_path: Path) -> None:
    args, extra = run_bench.parse_args(["quick", "-k", "B1", "--threshold", "30"])
    assert args.quick and args.threshold == 30 and extra == ["-k", "B1"]
    storage = run_bench.storage_dir("nvidia-h200", quick=True, root=tmp_path)
    assert storage == tmp_path / "nvidia-h200" / "bench-quick"
    machine = "Linux-CPython-3.12-64bit"
    assert run_bench.stored_runs(storage, machine) == []
    (storage / machine).mkdir(parents=True)
    for name in ("0002_quick-b.json", "0001_quick-a.json", "other.json"):
        (storage / machine / name).write_text("{}")
    assert [p.name for p in run_bench.stored_runs(storage, machine)] == ["0001_quick-a.json", "0002_quick-b.json"]
    cmd = run_bench.pytest_command(storage, "quick-abc", True, 25.0, ["-x"], python="python")
    assert cmd[:5] == ["python", "-m", "pytest", "benchmarks", "--benchmark-only"]
    assert f"--benchmark-storage={storage}" in cmd and "--benchmark-save=quick-abc" in cmd
    assert cmd[-3:] == ["--benchmark-compare", "--benchmark-compare-fail=median:25%", "-x"]
    assert "--benchmark-compare" not in run_bench.pytest_command(storage, "n", False, 25.0, [])


@pytest.mark.parametrize("workload", ["l2_ratio", "synthetic"])
def test_public_row_replays_the_reference_decisions(lab: Lab, workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The public-API row's plumbing on the CPU (the compile itself needs CUDA): its inputs reproduce the reference
    logits when run eagerly, gathering for fixed counts and masking for ragged ones."""
    runner = report_e2e.Runner(lab, report_e2e.Settings.make(quick=True))
    seen = {}
    monkeypatch.setattr(runner, "_check_reduce_overhead", lambda task: None)
    monkeypatch.setattr(runner, "_reduce_overhead", lambda task, module, inputs, ref, bound, entry: seen.update(
        module=module, inputs=inputs, ref=ref, bound=bound, entry=entry))  # fmt: skip
    runner._prepare_public(report_e2e.Task("table3", TINY, workload, 0.5, 2, "public_compiled"))
    assert seen["module"].gather == (workload == "l2_ratio")
    assert seen["entry"]["layout"].startswith("gather" if workload == "l2_ratio" else "pad to N")
    with torch.no_grad():
        out = seen["module"](*seen["inputs"][0])
    assert (out.float() - seen["ref"]).abs().max().item() <= seen["bound"]


def test_tome_measured_before_the_published_algorithm_is_named_the_variant(tmp_path: Path) -> None:
    """ToMe timed before the published algorithm (``make_results.TOME_PUBLISHED_SINCE``) is presented as the earlier
    variant everywhere: the default call's rows as ``tome_variant`` (README column, the every-pruner targets), a
    ToMe peer run's targets and section with a note to re-measure; later runs stay ``tome``."""
    card = tmp_path / "nvidia-h200"
    card.mkdir()
    early = _latency_run("0ld", {"tome": 310.0}, 700.0, 1.5)
    early["environment"]["date"] = "2026-11-27T10:00:00+0000"
    for entry in early["table"]:  # the results section also reports first calls
        entry.get("timm_compiled", {})["first_call_s"] = 10.0
    (card / "default_call.json").write_text(json.dumps(early))
    tome = _tome_fixture()
    tome["meta"]["date"] = "2026-11-27T16:00:00+0000"
    (card / "tome_peer.json").write_text(json.dumps(tome))
    loaded = make_results.load_call(card / "default_call.json")
    assert {e["workload"] for e in loaded["table"] if "workload" in e} >= {"tome_variant", "ats"}
    assert "tome" not in {e.get("workload") for e in loaded["table"]}
    readme = make_results.readme_table(loaded, card / "default_call.json")
    assert "ToMe (earlier patch-row variant) r = 13 |" in readme.splitlines()[2]
    targets = make_results.card_targets(card, {}, None, make_results.load_tome(card), {}, tmp_path / "data")
    peer = [t for t in targets if t.target.startswith("ToMe r = 13 (`GraphedPrunedViT`)")]
    assert len(peer) == 1 and peer[0].verdict.endswith(f"({make_results.TOME_VARIANT})")
    section = make_results.card_section(card, {}, None, tmp_path / "figures", tmp_path, make_results.load_tome(card))
    assert f"**{make_results.TOME_VARIANT[0].upper()}{make_results.TOME_VARIANT[1:]}.**" in section
    late = _latency_run("n3w", {"tome": 310.0}, 700.0, 1.5)  # dated 2026-12-01: the published ToMe
    (card / "default_call.json").write_text(json.dumps(late))
    assert "tome" in {e.get("workload") for e in make_results.load_call(card / "default_call.json")["table"]}
