"""Writes docs/results.md, docs/figures/*.png, docs/targets.md's table and the README's results tables from the
stored benchmark JSON: one command, no GPU.

    python -m benchmarks.make_results [--baselines benchmarks/baselines] [--out docs/results.md] [--figures DIR]
        [--data docs/data] [--targets docs/targets.md] [--readme README.md]

Reads every card directory of ``benchmarks/baselines/`` (its README says what is stored there): ``e2e/*.json``,
the parts ``report_e2e`` wrote (several files of one part are merged: a full run's row replaces a quick run's, a
later run's an earlier one's), ``attention.json``, the kernel benchmark ``report_attention`` wrote,
``tome_peer.json``, token merging against its peer (``benchmarks.tome_peer``), ``default_call.json``, the call
users make (``benchmarks.default_call``), ``default_call_<model>*.json``, the same call on the RoPE models of issue
40, and ``naflex*.json``, native-resolution batches against timm's NaFlexVit (``benchmarks.naflex``; several files
of one card are merged, a later run's row replacing an earlier one's); and the files of ``docs/data/`` that measure
a target (:data:`DATA_TARGETS`). Issue 40's targets get a row on every card, "not measured" until their file is
stored. Writes:

* ``docs/results.md``: the paper's tables beside ours (``benchmarks.tables``), the default call's and ToMe's
  reports, and matplotlib figures (throughput vs batch size, speedup vs pruning ratio, 224 vs 384);
* ``docs/targets.md``, between its ``<!-- targets:begin -->`` / ``<!-- targets:end -->`` markers: one row per
  target and card (target and bar, card, value, verdict, date, data file); the rest of that file (the targets'
  definitions) is written by hand;
* ``README.md``, between its ``<!-- results:begin -->`` / ``<!-- results:end -->`` markers: one table per card of
  the default call's ratios to unpruned timm ``torch.compile(mode="reduce-overhead")``.

A file without its markers is left alone (and said so). The output depends only on the JSON: sorted inputs, fixed
number formats, PNGs without timestamps, so regenerating it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import BASELINES, REPO_ROOT, default_call, naflex, tome_peer
from benchmarks import tables as T
from benchmarks.workloads import WORKLOADS

TOME_TITLE = "Token merging (ToMe) against its peer"
TOME_METHOD = (
    "`python -m benchmarks.tome_peer` (`docs/tome.md`): ours (`GraphedPrunedViT`, Triton, `compile_blocks`) against "
    "the unpruned timm model and ToMe as its users run it (timm's blocks patched with the merge and the `log(size)` "
    "bias, explicit attention or SDPA with a float mask), each checked against the fp32 reference ToMe forward first; "
    "img/s with each forward timed alone (the targets' clock) and, where stored, back to back."
)
PART_TITLES = {  # in document order
    "table3": "Table III -- throughput vs batch size (DeiT-B 224, 50% pruning)",
    "table4": "Table IV -- stage breakdown (CUDA events in one forward, ms)",
    "table5": "Table V -- model sizes (DeiT-Ti / S / B at 224, 50% pruning)",
    "res384": "Section V-D -- 224 vs 384 (DeiT-B, 50% pruning)",
    "fig1": "Figure 1 -- throughput vs pruning ratio (DeiT-B 224, B = 64)",
    "table6": "Table VI -- numerical equivalence (fp16, same decisions)",
}
DEIT_B = "deit_base_patch16_224"
TOME_FILE = "tome_peer.json"  # python -m benchmarks.tome_peer's default output, in the card's directory
TOME_ADAPTIVE_FILE = "tome_peer_adaptive.json"  # the adaptive rows' own run (gpu_suite.sh tome-adaptive), if apart
TOME_PUBLISHED_SINCE = "2026-11-28T02:53"  # ToMe follows its paper from then on (docs/tome.md); earlier runs: a variant
TOME_VARIANT = "measured with the earlier patch-row variant, not the published ToMe: to re-measure"
DEFAULT_CALL_FILE = "default_call.json"  # python -m benchmarks.default_call's output, in the card's directory
DEFAULT_CALL_TITLE = "The default call (`prune(model)(images)`) against unpruned timm `reduce-overhead`"
MODEL_CALLS = "default_call_*.json"  # benchmarks.default_call --model's outputs (default_call.result_file)
NAFLEX_FILES = "naflex*.json"  # python -m benchmarks.naflex's outputs, in the card's directory
NAFLEX_TITLE = "Native-resolution batches: ours against timm `NaFlexVit`"


# --------------------------------------------------------------------------------------------------- inputs


def load_card(card_dir: Path) -> tuple[dict[str, dict], dict | None]:
    """The merged e2e parts of one card directory and its kernel benchmark (None if absent)."""
    by_part: dict[str, list[dict]] = {}
    for path in sorted((card_dir / "e2e").glob("*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and payload.get("part") in T.RENDERERS:
            by_part.setdefault(payload["part"], []).append(payload)
    kernel_path = card_dir / "attention.json"
    kernel = json.loads(kernel_path.read_text()) if kernel_path.exists() else None
    return {part: T.merge_payloads(payloads) for part, payloads in by_part.items()}, kernel


def load_call(path: Path) -> dict:
    """A stored ``benchmarks.default_call`` run; ToMe rows timed before the published ToMe (each part by its own
    date, :data:`TOME_PUBLISHED_SINCE`) renamed ``tome_variant``, so no table or target presents them as it."""
    payload = json.loads(path.read_text())
    date = (payload.get("environment") or {}).get("date") or ""

    def variant(environment: dict | None) -> bool:
        return _tome_variant((environment or {}).get("date") or date)

    def renamed(rows: list[dict]) -> list[dict]:
        return [{**r, "workload": "tome_variant"} if r.get("workload") == "tome" else r for r in rows]

    def rekeyed(entry: dict) -> dict:
        return {("tome_variant" if k == "tome" else k): v for k, v in entry.items()}

    if variant(payload.get("environment")):
        payload["table"] = renamed(payload.get("table", []))
    if isinstance(payload.get("stream"), dict) and variant(payload.get("stream_environment")):
        payload["stream"] = rekeyed(payload["stream"])
    if isinstance(payload.get("before"), dict) and variant(payload["before"].get("environment")):
        payload["before"]["table"] = renamed(payload["before"].get("table", []))
    if isinstance(payload.get("eager_rounds"), dict) and variant(payload["eager_rounds"].get("environment")):
        payload["eager_rounds"]["rounds"] = [rekeyed(r) for r in payload["eager_rounds"].get("rounds", [])]
    return payload


def load_tome(card_dir: Path) -> dict | None:
    """The card's stored ``benchmarks.tome_peer`` run (None if absent). When the adaptive rows ran apart (one call
    cannot hold both runs), that run is the payload's ``"adaptive_run"``: adaptive over fixed ``r`` is a same-run
    ratio of its own rows."""
    path, apart = card_dir / TOME_FILE, card_dir / TOME_ADAPTIVE_FILE
    if not path.exists():
        return None
    tome = json.loads(path.read_text())
    if apart.exists():
        tome["adaptive_run"] = json.loads(apart.read_text())
    return tome


def card_dirs(baselines: Path) -> list[Path]:
    """Card directories holding e2e parts, a kernel benchmark or a ToMe run, sorted by name."""
    if not baselines.is_dir():
        return []
    stored = ("attention.json", TOME_FILE, DEFAULT_CALL_FILE)
    return sorted(
        d for d in baselines.iterdir() if d.is_dir() and ((d / "e2e").is_dir() or any((d / f).exists() for f in stored)
                                                          or any(d.glob(MODEL_CALLS)) or any(d.glob(NAFLEX_FILES)))
    )  # fmt: skip


def _measured(payload: dict) -> bool:
    """A run on a GPU, not a ``--smoke`` run (those check the plumbing on a CPU and time nothing worth storing)."""
    env = payload.get("environment", {})
    return not payload.get("smoke") and "--smoke" not in (payload.get("argv") or []) and bool(env.get("card"))


def load_model_calls(card_dir: Path) -> dict[tuple[str, int], tuple[Path, dict]]:
    """The card's ``benchmarks.default_call --model`` runs by ``(model, image size)``: the latest of each."""
    runs: dict[tuple[str, int], tuple[Path, dict]] = {}
    for path in sorted(card_dir.glob(MODEL_CALLS)):
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict) or "model" not in payload or not _measured(payload):
            continue
        key = (payload["model"], payload.get("img_size"))
        if key not in runs or _date(payload["environment"]) >= _date(runs[key][1]["environment"]):
            runs[key] = (path, payload)
    return runs


def load_naflex(card_dir: Path) -> tuple[list[Path], dict] | None:
    """The card's ``benchmarks.naflex`` runs of issue 40's batch (the default model and seed, not ``--smoke``),
    merged: ``(files, payload)`` whose rows are one per ``(batch, row)``, a later run's replacing an earlier one's;
    None without any."""
    runs = []
    for path in sorted(card_dir.glob(NAFLEX_FILES)):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and payload.get("model") == naflex.MODEL and payload.get("seed", 0) == 0 \
                and _measured(payload):  # fmt: skip
            runs.append((_date(payload["environment"]), path, payload))
    if not runs:
        return None
    runs.sort(key=lambda r: (r[0], r[1].name))
    rows = {(r["batch"], r["row"]): r for _, _, payload in runs for r in payload["rows"]}
    latest = runs[-1][2]
    return [path for _, path, _ in runs], {**latest, "rows": [rows[k] for k in sorted(rows)]}


# --------------------------------------------------------------------------------------------------- targets


Cells = list[tuple[str, float]]
"""``[(label, bar)]``: the cells of a target (e.g. ``("B=1", 1.25)``), each with its bar."""
Values = dict[str, list[tuple[str, float | None]]]
"""``{cell label: [(name, measured value or None)]}``: what each cell measured (e.g. per workload)."""


@dataclass
class Target:
    """One target measured on one card: its generated row of docs/targets.md."""

    target: str
    card: str
    value: str
    verdict: str
    date: str
    data: str


def _x(v: float, unit: str, bar: float | None = None) -> str:
    """``v`` as ``1.23x`` or ``12.3 us``; a third digit where two would read as the bar itself."""
    digits = 2 if unit == "x" else 1
    while bar is not None and v != bar and round(v, digits) == round(bar, digits) and digits < 4:
        digits += 1
    return f"{v:.{digits}f}x" if unit == "x" else f"{v:.{digits}f} {unit}"


MAX_NAMED = 4  # misses named per cell; beyond, a count and the worst


def judge(cells: Cells, values: Values, at_most: bool = False, unit: str = "x") -> tuple[str, str]:
    """``(value, verdict)`` of a target: the worst measured value of each cell (one cell: with its name), and
    "met" when every measured value of every cell reaches its bar (``at_most``: stays under it), else
    "**missed**" naming the cells and values that do not; cells without any value are "not measured"."""
    worst_cells, misses, unmeasured = [], [], []
    for label, bar in cells:
        have = [(name, v) for name, v in values.get(label, []) if v is not None]
        if not have:
            worst_cells.append("-")
            unmeasured.append(label)
            continue
        name, worst = (max if at_most else min)(have, key=lambda nv: nv[1])
        named = len(cells) == 1 and len(have) > 1 and name
        worst_cells.append(_x(worst, unit, bar) + (f" ({name})" if named else ""))
        bad = [(n, v) for n, v in have if (v > bar if at_most else v < bar)]
        if len(bad) > MAX_NAMED:
            shown = f"{len(bad)} of {len(have)}, worst {name} {_x(worst, unit, bar)}".replace("worst  ", "worst ")
        else:
            shown = ", ".join(f"{n} {_x(v, unit, bar)}".strip() for n, v in bad)
        if bad:
            misses.append((f"{label}: " if label else "") + shown)
    if len(unmeasured) == len(cells):
        return "-", "not measured"
    verdict = "**missed** (" + "; ".join(misses) + ")" if misses else "met"
    if unmeasured:
        verdict += f" ({', '.join(unmeasured)} not measured)"
    return " / ".join(worst_cells), verdict


def _bars(cells: Cells, at_most: bool = False, unit: str = "x") -> str:
    """``">= 1.25x / 1.25x / 1.45x at B=1 / B=4 / B=64"`` (the bars of a target's cells)."""
    sign = "<=" if at_most else ">="
    bars = " / ".join(_x(bar, unit) for _, bar in cells)
    labels = " / ".join(label for label, _ in cells if label)
    return f"{sign} {bars}" + (f" at {labels}" if labels else "")


def _date(meta: dict | None) -> str:
    date = (meta or {}).get("date") or ""
    return date[:10] if date else "-"


def _rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name


E2E_FILES = {"table3": "table3*.json", "fig1": "fig1*.json", "res384": "res384*.json", "table6": "table6*.json"}
RAGGED = ("l2_calibrated", "ats", "synthetic")
E2E_TARGETS = {  # docs/targets.md's list: 50% pruning, DeiT-B 224, ours = the faster of Triton eager and graphed
    "vs_compiled": ((1, 1.0), (4, 1.3), (64, 1.45)),
    "vs_padded": ((1, 4.0), (4, 4.0), (64, 2.5)),
    "vs_public": ((1, 3.0), (4, 3.0)),
    "vs_fa2": ((1, 1.0), (4, 1.0), (64, 1.1)),
}


def e2e_targets(parts: dict[str, dict], kernel: dict | None) -> list[tuple[str, str, str, str]]:
    """``(target, value, verdict, part)`` of the end-to-end and kernel targets of one card (part: the e2e part the
    values come from, or "attention" for the kernel benchmark)."""
    out: list[tuple[str, str, str, str]] = []

    def add(target: str, cells: Cells, values: Values, part: str, **kw: object) -> None:
        value, verdict = judge(cells, values, **kw)
        if verdict != "not measured":
            out.append((f"{target}: {_bars(cells, **kw)}", value, verdict, part))

    def b_cells(key: str) -> Cells:
        return [(f"B={b}", need) for b, need in E2E_TARGETS[key]]

    if t3 := parts.get("table3"):
        idx = T.index(t3["rows"])
        ragged = [w for w in RAGGED if any(k[1] == w for k in idx)]

        def rate(w: str, b: int, *rows: str) -> float | None:
            """The fastest of ``rows`` at 50% pruning (a ``timm_*`` row: the unpruned model's)."""
            rates = [r for r in (T.rate(idx, DEIT_B, w, 0.5, b, row) for row in rows) if r]
            return max(rates) if rates else None

        def ours_over(key: str, *rows: str) -> Values:
            return {f"B={b}": [(w, T.ratio(T.best_ours(idx, DEIT_B, w, 0.5, b), rate(w, b, *rows))) for w in ragged]
                    for b, _ in E2E_TARGETS[key]}  # fmt: skip

        head = "50% ragged (Threshold-L2 calibrated, ATS, synthetic), ours"
        add(f"{head} vs unpruned timm reduce-overhead", b_cells("vs_compiled"), ours_over("vs_compiled",
            "timm_compiled"), "table3")  # fmt: skip
        add(f"{head} vs timm reduce-overhead with our GEMM patch embedding (pruning's own share)",
            b_cells("vs_compiled"), ours_over("vs_compiled", "timm_compiled_gemm"), "table3")  # fmt: skip
        add(f"{head} vs padded (fair) SDPA, eager", b_cells("vs_padded"), ours_over("vs_padded", "padded"), "table3")
        add(f"{head} vs the best public-API pipeline (padded, padded-full, NestedTensor; under reduce-overhead where "
            "measured)", b_cells("vs_public"), ours_over("vs_public", "padded", "padded_full", "nested_sdpa",
            "public_compiled"), "table3")  # fmt: skip
        fa2: Values = {}
        for b, _ in E2E_TARGETS["vs_fa2"]:
            fa2[f"B={b}"] = []
            for w in ragged:
                fa2[f"B={b}"].append((f"{w} graphed", T.ratio(rate(w, b, "triton_graphed"),
                                                              rate(w, b, "fa2_varlen_graphed"))))  # fmt: skip
                fa2[f"B={b}"].append((f"{w} eager", T.ratio(rate(w, b, "triton"), rate(w, b, "fa2_varlen"))))
        add("50% ragged, Triton vs FA2-aten in the same pipeline (graphed and eager)", b_cells("vs_fa2"), fa2, "table3")
    if f1 := parts.get("fig1"):
        idx1 = T.index(f1["rows"])
        values = [(w, T.ratio(T.best_ours(idx1, DEIT_B, w, 0.1, 64), T.best_ours(idx1, DEIT_B, w, 1.0, 64)))
                  for w in ("l2_ratio", "synthetic")]  # fmt: skip
        add("90% vs 0% pruning at B=64, ours (l2_ratio, synthetic)", [("", 3.0)], {"": values}, "fig1")
    if r384 := parts.get("res384"):
        idx, m = T.index(r384["rows"]), "deit_base_patch16_384"
        values = [(w, T.ratio(T.best_ours(idx, m, w, 0.5, 1), T.rate(idx, m, w, 0.5, 1, "padded")))
                  for w in ("synthetic",)]  # fmt: skip
        add("384x384 at B=1, ours vs padded (fair), ragged (synthetic)", [("", 3.0)], {"": values}, "res384")
    if t6 := parts.get("table6"):
        tri = [r["vs_padded"].get("triton", {}) for r in t6["rows"] if r.get("vs_padded")]
        worst = max((d["max"] for d in tri if "max" in d), default=None)
        agree = min((d["top1_agree"] for d in tri if "top1_agree" in d), default=None)
        if worst is not None:
            value = f"max {worst:.2e}, top-1 agreement {100 * agree:.1f}%"
            margins = [m for d in tri for m in d.get("disagree_ref_margins", [])]
            if margins:  # random weights: say whether the flips are near-ties of the reference itself
                value += f" (flipped images: the padded reference's own top-1/top-2 margin <= {max(margins):.1e})"
            met = worst <= 0.004 and agree == 1.0
            out.append(("numerics vs the padded fp16 pipeline: max abs logit diff <= 0.004, 100% top-1", value,
                        "met" if met else "**missed**", "table6"))  # fmt: skip
    if kernel:
        cells = kernel["cells"]
        fa2 = [(f"B={c['batch']} {c['pruned_pct']}%", c["ratios"].get("ours_over_fa2_aten_graph")) for c in cells]
        roof = [(f"B={c['batch']} {c['pruned_pct']}%", c["ratios"].get("ours_over_roofline_graph"))
                for c in cells if c["batch"] >= 64]  # fmt: skip
        add("attention device time (graph replay) over FA2-aten, every cell", [("", 0.6)],
            {"": fa2}, "attention", at_most=True)  # fmt: skip
        add("attention device time over the memory roofline at B >= 64, every cell", [("", 1.5)],
            {"": roof}, "attention", at_most=True)  # fmt: skip
    return out


# ToMe's targets, fixed r = 13 on DeiT-B: ours over unpruned timm reduce-overhead and over the peer's best mode per
# batch size, and the adaptive mode over fixed r
TOME_TARGETS = {"vs_timm": ((1, 1.2), (4, 1.3), (64, 1.5)), "vs_peer": ((1, 1.7), (4, 1.7), (64, 1.6)),
                "adaptive": ((64, 0.95),)}  # fmt: skip
TOME_LABELS = {"vs_timm": "ToMe r = 13 (`GraphedPrunedViT`) vs unpruned timm reduce-overhead, each forward alone",
               "vs_peer": "ToMe r = 13 vs the ToMe peer's best mode (timm patched with the merge, reduce-overhead)",
               "adaptive": "adaptive ToMe (r = 13's mean rows) vs fixed r"}  # fmt: skip


def tome_targets(tome: dict) -> list[tuple[str, str, str, dict]]:
    """``(target, value, verdict, run)`` of ToMe's targets from a stored ``benchmarks.tome_peer`` run (each forward
    alone: the targets' clock); ``run``: the payload measured (the adaptive target's own run if it ran apart,
    :func:`load_tome`)."""
    out = []
    for key, bars in TOME_TARGETS.items():
        run = tome.get("adaptive_run", tome) if key == "adaptive" else tome
        if run["meta"].get("model") != DEIT_B or run["meta"].get("r") != 13:
            continue
        cells = [(f"B={b}", need) for b, need in bars]
        values: Values = {}
        for b, _ in bars:
            up = tome_peer.speedups(run["rows"], b)
            name = tome_peer.ADAPTIVE_NAMES[up.adaptive_row] if key == "adaptive" and up.adaptive_row else "ours"
            values[f"B={b}"] = [(name, getattr(up, key))]
        value, verdict = judge(cells, values)
        if verdict != "not measured":
            verdict += f" ({TOME_VARIANT})" if _tome_variant(run["meta"].get("date")) else ""
            out.append((f"{TOME_LABELS[key]}: {_bars(cells)}", value, verdict, run))
    return out


def _tome_variant(date: str | None) -> bool:
    """Whether ToMe timed at ``date`` (a run's ISO date) predates the published ToMe (:data:`TOME_PUBLISHED_SINCE`)."""
    return (date or "") < TOME_PUBLISHED_SINCE


WORKLOAD_NAMES = {"l2_calibrated": "Threshold-L2 calibrated", "ats": "ATS", "dynamicvit": "DynamicViT",
                  "evit": "EViT", "tome": "ToMe", "tome_variant": "ToMe (earlier patch-row variant)"}  # fmt: skip
PRUNER_TARGETS = {  # each pruner at its keep rate, the default call over unpruned timm reduce-overhead
    ("l2_calibrated", "ats"): ((1, 1.3), (4, 1.4), (64, 1.6)),
    ("dynamicvit", "evit"): ((1, 1.15), (4, 1.25), (64, 1.45)),
}
GRAPHED_NO_SLOWDOWN = 0.97  # the graphed path against the stored before run, back to back (its spread: 1-3%)
STREAM_TARGET = 1.3
EAGER_TARGETS = {"each_round": ((16, 1.0), (64, 1.3)), "median": ((1, 1.0), (4, 1.0), (64, 1.0))}


def default_call_targets(payload: dict) -> list[tuple[str, str, str, str]]:
    """``(target, value, verdict, date)`` of the default call's targets from a stored ``benchmarks.default_call``
    run: ratios over unpruned timm in the same process."""
    base, rows = default_call._split(payload.get("table", []))
    workloads = list(dict.fromkeys(key[1] for key in rows))
    date = _date(payload.get("environment"))
    out: list[tuple[str, str, str, str]] = []

    def add(target: str, cells: Cells, values: Values, when: str = date) -> None:
        value, verdict = judge(cells, values)
        if verdict != "not measured":
            out.append((f"{target}: {_bars(cells)}", value, verdict, when))

    def over_timm(workload: str, b: int, clock: str) -> float | None:
        timm = base.get(b, {}).get("timm_compiled")
        return default_call._ratio(timm, rows.get((b, workload, "default")), clock) if timm else None

    clocks = {"each": "each forward synchronised", "back_to_back": "back to back"}
    for clock, bars in default_call.TARGETS.items():
        cells = [(f"B={b}", need) for b, need in bars]
        values = {f"B={b}": [(w, over_timm(w, b, f"{clock}_us")) for w in workloads] for b, _ in bars}
        add(f"default call, every pruner, vs unpruned timm reduce-overhead, {clocks[clock]}", cells, values)
    for names, bars in PRUNER_TARGETS.items():
        cells = [(f"B={b}", need) for b, need in bars]
        values = {f"B={b}": [(w, over_timm(w, b, "each_us")) for w in names if w in workloads] for b, _ in bars}
        keep = {rows[k]["keep"] for k in rows if k[1] in names}
        rate = f" at {'/'.join(f'{k:g}' for k in sorted(keep))}" if keep else ""
        add(f"default call, {' and '.join(WORKLOAD_NAMES[w] for w in names)}{rate}, vs unpruned timm "
            "reduce-overhead, each forward synchronised", cells, values)  # fmt: skip
    firsts: Values = {}
    for b in sorted(base):
        timm_s = base[b].get("timm_compiled", {}).get("first_call_s")
        firsts[f"B={b}"] = [(w, T.ratio(timm_s, rows.get((b, w, "default"), {}).get("first_call_s")))
                            for w in workloads]  # fmt: skip
    add("first call of a new batch size, timm reduce-overhead's seconds over ours (compile and capture)",
        [(label, 1.0) for label in firsts], firsts)  # fmt: skip
    if before := payload.get("before"):
        _, old = default_call._split(before["table"])
        cells, values = [], {}
        for b in sorted(base):
            label = f"B={b}"
            cells.append((label, GRAPHED_NO_SLOWDOWN))
            values[label] = []
            for w in workloads:
                a, n = old.get((b, w, "graphed"), {}), rows.get((b, w, "graphed"), {})
                values[label].append((w, T.ratio(a.get("back_to_back_us"), n.get("back_to_back_us"))))
        add("no slowdown of the graphed path (`GraphedPrunedViT` + `compile_blocks`) against the stored run before, "
            "back to back", cells, values)  # fmt: skip
    if stream := payload.get("stream"):
        t = stream["timm_compiled"]
        values = {"": [(f"{w} {c}", T.ratio(stream[w][f"img_per_s_{c}"], t[f"img_per_s_{c}"]))
                       for w in workloads if w in stream for c in ("each", "back_to_back")]}  # fmt: skip
        when = _date(payload.get("stream_environment") or payload.get("environment"))
        add(
            f"a stream of {len(stream['sizes'])} batches of sizes from 1-64 after a first pass, default call vs timm "
            "reduce-overhead with torch.compile's defaults, both clocks",
            [("", STREAM_TARGET)],
            values,
            when,
        )
    if eager := payload.get("eager_rounds"):
        when = _date(eager.get("environment") or payload.get("stream_environment") or payload.get("environment"))
        by: dict[tuple[int, str], list[float]] = {}
        for r in eager["rounds"]:
            for w in workloads:
                if w in r:
                    by.setdefault((r["batch"], w), []).append(r["timm_eager"]["each_us"] / r[w]["each_us"])
        for key, label in (("each_round", "in every round"), ("median", "median of the rounds")):
            bars = [(b, need) for b, need in EAGER_TARGETS[key] if any(k[0] == b for k in by)]
            pick = min if key == "each_round" else statistics.median
            values = {f"B={b}": [(w, pick(by[b, w])) for w in workloads if (b, w) in by] for b, _ in bars}
            add(f'eager (`mode="eager"`), every pruner, vs unpruned timm eager, {label}',
                [(f"B={b}", need) for b, need in bars], values, when)  # fmt: skip
    return out


DECISION_TIME_BAR = 15.0  # us per stage at B <= 4


def decision_time_targets(payload: dict) -> list[tuple[str, str, str]]:
    """``(target, value, verdict)``: one pruning decision per stage under graph replay (``benchmarks.decision_time``),
    the slowest stage of each workload at B = 1 and 4."""
    values: Values = {}
    for b in (1, 4):
        slowest: dict[str, float] = {}
        for r in payload.get("rows", []):
            if r["batch"] == b:
                slowest[r["workload"]] = max(slowest.get(r["workload"], 0.0), r["us"])
        if slowest:
            values[f"B={b}"] = sorted(slowest.items())
    cells = [(label, DECISION_TIME_BAR) for label in values]
    if not cells:
        return []
    value, verdict = judge(cells, values, at_most=True, unit="us")
    return [(f"one pruning decision, slowest stage, graph replay: {_bars(cells, at_most=True, unit='us')}", value,
             verdict)]  # fmt: skip


DATA_TARGETS = {"decision_time_*.json": decision_time_targets}  # docs/data files that measure a target

ROPE_RUNS = (  # issue 40's RoPE models: (what the target says, timm model, image size)
    ("DINOv3 ViT-B/16 at 224", "vit_base_patch16_dinov3", 224),
    ("EVA-02 base at 224", "eva02_base_patch14_224", 224),
    ("DINOv3 ViT-B/16 at 512", "vit_base_patch16_dinov3", 512),
)
ROPE_WORKLOADS = (("l2_calibrated", 0.5), ("evit", 0.7))  # each where it applies (EViT: a class token)
NAFLEX_BARS = (  # issue 40's NaFlex targets at B = 64: (what runs, our row, bar over timm's best mode)
    ("unpruned", "ours", 1.5),
    ("with Threshold-L2 0.5", "ours_threshold_l2", 2.2),
)
NAFLEX_BATCH, NAFLEX_REPORTED = 64, (1, 8)


def _reported(values: Values, labels: Sequence[str]) -> str:
    """``" (reported: B=1 1.05x, B=8 1.32x)"``: the worst measured value of cells that have no bar."""
    shown = []
    for label in labels:
        have = [v for _, v in values.get(label, []) if v is not None]
        if have:
            shown.append(f"{label} {_x(min(have), 'x')}")
    return f" (reported: {', '.join(shown)})" if shown else ""


def rope_target(label: str, model: str) -> str:
    """The text of one RoPE model's target row (the same on every card, measured or not)."""
    bars = _bars([(f"B={b}", need) for b, need in default_call.ROPE_TARGETS["each"]])
    reported = " / ".join(f"B={b}" for b in default_call.ROPE_REPORTED)
    return (f"{label} (`{model}`), default call, Threshold-L2 calibrated 0.5 and EViT 0.7 (where it applies), vs "
            f"unpruned timm reduce-overhead, each forward synchronised: {bars} ({reported} reported)")  # fmt: skip


def rope_targets(payload: dict) -> tuple[str, str]:
    """``(value, verdict)`` of a RoPE model's target from its stored ``benchmarks.default_call --model`` run."""
    base, rows = default_call._split(payload.get("table", []))
    values: Values = {}
    for b in sorted(base):
        timm = base[b].get("timm_compiled")
        values[f"B={b}"] = [(w, default_call._ratio(timm, rows.get((b, w, "default")), "each_us") if timm else None)
                            for w, keep in ROPE_WORKLOADS if rows.get((b, w, "default"), {}).get("keep") == keep]
    cells = [(f"B={b}", need) for b, need in default_call.ROPE_TARGETS["each"]]
    value, verdict = judge(cells, values)
    value += _reported(values, [f"B={b}" for b in default_call.ROPE_REPORTED])
    failed = "; ".join(f"B={b}: {w} failed its check, not timed" for (b, w, row), r in sorted(rows.items())
                       if row == "default" and r.get("status") == "failed" and (w, r.get("keep")) in ROPE_WORKLOADS)
    if failed:  # a row that did not pass its check is not met, whatever the other rows of the cell
        verdict = f"**missed** ({failed})" if verdict == "met" else f"{verdict} ({failed})"
    if not payload.get("complete", True):
        verdict += " (run cut short)"
    return value, verdict


def naflex_target(label: str, bar: float) -> str:
    reported = " / ".join(f"B={b}" for b in NAFLEX_REPORTED)
    return (f"NaFlex ViT-B/16 (`{naflex.MODEL}`), 64 images of 128-512 px, aspect 1:3 to 3:1, seed 0, {label}, vs "
            f"timm NaFlexVit at its best mode (eager or torch.compile), each forward synchronised: "
            f"{_bars([(f'B={NAFLEX_BATCH}', bar)])} ({reported} reported)")  # fmt: skip


def naflex_speedups(rows: list[dict], row: str) -> Values:
    """``{"B=b": [("over <timm's best row>", ours over it)]}``: ``row``'s img/s over timm's fastest row (eager or
    a compile mode) at each batch size."""
    out: Values = {}
    for b in sorted({r["batch"] for r in rows}):
        timm = [r for r in rows if r["batch"] == b and r["row"].startswith("timm") and r.get("img_per_s")]
        ours = next((r for r in rows if r["batch"] == b and r["row"] == row and r.get("img_per_s")), None)
        if timm and ours:
            best = max(timm, key=lambda r: r["img_per_s"])
            out[f"B={b}"] = [(f"over {best['row']}", ours["img_per_s"] / best["img_per_s"])]
    return out


def issue40_targets(card_dir: Path, card: str) -> list[Target]:
    """Issue 40's targets on one card: the RoPE models' default call and the NaFlex batch, "not measured" (with the
    file that would measure it) where nothing is stored."""
    out = []
    calls = load_model_calls(card_dir)
    for label, model, size in ROPE_RUNS:
        target = rope_target(label, model)
        if (model, size) in calls:
            path, payload = calls[model, size]
            value, verdict = rope_targets(payload)
            out.append(Target(target, card, value, verdict, _date(payload["environment"]), _rel(path)))
        else:
            data = _rel(card_dir / default_call.result_file(model, size))
            out.append(Target(target, card, "-", "not measured", "-", data))
    stored = load_naflex(card_dir)
    for label, row, bar in NAFLEX_BARS:
        target = naflex_target(label, bar)
        if stored is None:
            out.append(Target(target, card, "-", "not measured", "-", _rel(card_dir / "naflex.json")))
            continue
        files, payload = stored
        values = naflex_speedups(payload["rows"], row)
        value, verdict = judge([(f"B={NAFLEX_BATCH}", bar)], values)
        value += _reported(values, [f"B={b}" for b in NAFLEX_REPORTED])
        data = _rel(files[0]) if len(files) == 1 else _rel(card_dir) + "/" + NAFLEX_FILES
        out.append(Target(target, card, value, verdict, _date(payload["environment"]), data))
    return out


LATENCY_FILE = "default_call_latency.json"  # gpu_suite.sh issue41: every workload of issue 41, both timm modes
ISSUE41_BARS = {"NVIDIA H200": 250.0, "NVIDIA H100 80GB HBM3": 300.0}  # B = 1 us per forward, Threshold-L2 0.5
PEAK_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}  # bytes/s of HBM, the weight-read floor's
ISSUE41_L2 = ("l2_ratio", "l2_calibrated")  # at keep 0.5
ISSUE41_OTHERS = (("ats", 0.5), ("dynamicvit", 0.7), ("evit", 0.7), ("tome", 13.0))
ISSUE41_OTHER_FACTOR, ISSUE41_B4_GAIN, ISSUE41_PEER_BAR, ISSUE41_KEEP_BAND = 1.2, 1.5, 2.5, 0.95


def issue41_before(data_dir: Path | None, card: str) -> tuple[Path, dict] | None:
    """The card's "today" of issue 41 (``docs/data/issue41_before_<card>.json``: its default call before the issue's
    kernels)."""
    for path in sorted(data_dir.glob("issue41_before_*.json")) if data_dir and data_dir.is_dir() else []:
        payload = json.loads(path.read_text())
        if payload.get("meta", {}).get("card") == card:
            return path, payload
    return None


def issue41_targets(card_dir: Path, card: str, data_dir: Path | None) -> list[Target]:
    """Issue 41's targets on one card from its default call on DeiT-B 224 fp16 (:data:`LATENCY_FILE`, the run with the
    issue's workloads and peers; else ``default_call.json``) and its "today" (:func:`issue41_before`): a row each,
    "not measured" where the run lacks the rows a target needs."""
    path = card_dir / LATENCY_FILE if (card_dir / LATENCY_FILE).exists() else card_dir / DEFAULT_CALL_FILE
    payload = load_call(path) if path.exists() else {"table": []}
    base, rows = default_call._split(payload.get("table", []))
    date, data = _date(payload.get("environment")), _rel(path)
    before = issue41_before(data_dir, card)
    bar = ISSUE41_BARS.get(card)
    out = []

    def each_us(b: int, workload: str, keep: float) -> float | None:
        entry = rows.get((b, workload, "default"))
        return entry.get("each_us") if entry and entry.get("keep") == keep else None

    def add(target: str, cells: Cells, values: Values, at_most: bool = False, unit: str = "x", where: str = data):
        value, verdict = judge(cells, values, at_most, unit)
        out.append(Target(f"{target}: {_bars(cells, at_most, unit)}", card, value, verdict,
                          date if verdict != "not measured" else "-", where))  # fmt: skip

    head = "DeiT-B 224 fp16, default call (graphed)"
    if bar is not None:
        l2 = {"B=1": [(w, each_us(1, w, 0.5)) for w in ISSUE41_L2]}
        add(f"{head}, B=1, Threshold-L2 ratio and calibrated 0.5, us per forward (each forward synchronised)",
            [("B=1", bar)], l2, at_most=True, unit="us")  # fmt: skip
        others = {"B=1": [(w, each_us(1, w, k)) for w, k in (*ISSUE41_OTHERS, ("tome_variant", 13.0))]}  # (load_call)
        add(f"{head}, B=1, every other pruner within {ISSUE41_OTHER_FACTOR:g}x of the Threshold-L2 bar, us per "
            "forward", [("B=1", ISSUE41_OTHER_FACTOR * bar)], others, at_most=True, unit="us")  # fmt: skip
    peers = {"B=1": [(f"{w} over {row}", default_call._ratio(base[1][row], rows.get((1, w, "default")), "each_us"))
                     for w in ISSUE41_L2 for row in default_call.TIMM_MODES if row in base.get(1, {})]}
    add(f"{head}, B=1, Threshold-L2 0.5 over unpruned timm reduce-overhead and max-autotune, each forward "
        "synchronised", [("B=1", ISSUE41_PEER_BAR)], peers)  # fmt: skip
    commit = str(payload.get("environment", {}).get("commit", "")).split(" ")[0]
    if before is not None:
        before_path, today = before
        where = f"{data}` and `{_rel(before_path)}"  # (the table puts the backticks around it)
        since = commit != today["meta"]["commit"]  # the stored run is today's: nothing measured since
        gains = {"B=4": [(w, T.ratio(4e6 / us, today["b4_img_per_s"].get(w)) if (us := each_us(4, w, k)) else None)
                         for w, k in (("l2_calibrated", 0.5), *ISSUE41_OTHERS) if since]}  # fmt: skip
        add(f"{head}, B=4, every pruner, img/s over today's ({today['meta']['commit']})", [("B=4", ISSUE41_B4_GAIN)],
            gains, where=where)  # fmt: skip
        kept = {"B=64": [(w, T.ratio(default_call._ratio(base[64]["timm_compiled"], rows.get((64, w, "default")),
                                                         "each_us"), today["b64_over_timm"].get(w)))
                         for w, _ in (("l2_calibrated", 0.5), *ISSUE41_OTHERS)
                         if since and "timm_compiled" in base.get(64, {})]}  # fmt: skip
        add(f"{head}, B=64, every pruner, ratio to unpruned timm reduce-overhead (same run) over today's",
            [("B=64", ISSUE41_KEEP_BAND)], kept, where=where)  # fmt: skip
    peak, weights = PEAK_BANDWIDTH.get(card), payload.get("weight_bytes")
    fastest = min((us for w in ISSUE41_L2 if (us := each_us(1, w, 0.5))), default=None)
    measured = bool(peak and weights and fastest)
    achieved = weights / (fastest * 1e-6) if measured else 0.0
    value = f"{achieved / 1e12:.2f} TB/s ({100 * achieved / peak:.0f}% of {peak / 1e12:g} TB/s)" if measured else "-"
    out.append(Target(f"{head}, B=1, Threshold-L2 0.5, achieved weight bandwidth (weight bytes / forward time), "
                      "beside the card's peak", card, value, "reported" if measured else "not measured",
                      date if measured else "-", data))  # fmt: skip
    return out


def card_targets(card_dir: Path, parts: dict[str, dict], kernel: dict | None, tome: dict | None,
                 files: dict[str, list[Path]], data_dir: Path | None = None) -> list[Target]:  # fmt: skip
    """Every target measured on one card's stored files (``files``: the e2e files of each part; ``data_dir``: the
    ``docs/data`` files some targets compare with)."""
    metas = [p["meta"] for p in parts.values()] + [x["meta"] for x in (kernel, tome) if x]
    card = next((m.get("card") for m in metas if m.get("card")), None) or card_dir.name
    out = []
    call_path = card_dir / DEFAULT_CALL_FILE
    if call_path.exists():
        call = load_call(call_path)
        card = call.get("environment", {}).get("card") or card
        for target, value, verdict, date in default_call_targets(call):
            out.append(Target(target, card, value, verdict, date, _rel(call_path)))
    if tome:
        for target, value, verdict, run in tome_targets(tome):
            name = TOME_FILE if run is tome else TOME_ADAPTIVE_FILE
            out.append(Target(target, card, value, verdict, _date(run["meta"]), _rel(card_dir / name)))
    if not any(m.get("card") for m in metas) and not call_path.exists():  # a card with issue 40's files alone
        stored = [p for _, p in load_model_calls(card_dir).values()] + [(load_naflex(card_dir) or ([], {}))[1]]
        card = next((p["environment"]["card"] for p in stored if p.get("environment", {}).get("card")), card)
    for target, value, verdict, part in e2e_targets(parts, kernel):
        if part == "attention":
            date, data = _date(kernel["meta"]), _rel(card_dir / "attention.json")
        else:
            date = max((_date(m) for m in parts[part].get("metas", [parts[part]["meta"]])), default="-")
            names = files.get(part, [])
            data = _rel(names[0]) if len(names) == 1 else _rel(card_dir / "e2e") + "/" + E2E_FILES[part]
        out.append(Target(target, card, value, verdict, date, data))
    return out + issue40_targets(card_dir, card) + issue41_targets(card_dir, card, data_dir)


def data_targets(data_dir: Path) -> list[Target]:
    """The targets measured by the files of ``docs/data/`` that :data:`DATA_TARGETS` names."""
    out = []
    for pattern, measure in DATA_TARGETS.items():
        for path in sorted(data_dir.glob(pattern)) if data_dir.is_dir() else []:
            payload = json.loads(path.read_text())
            meta = payload.get("meta", {})
            for target, value, verdict in measure(payload):
                out.append(Target(target, meta.get("card", "?"), value, verdict, _date(meta), _rel(path)))
    return out


def targets_table(targets: list[Target]) -> str:
    """docs/targets.md's generated table: one row per target and card."""
    head = ["target", "card", "value", "verdict", "date", "data file"]
    body = [[t.target, t.card, t.value, t.verdict, t.date, f"`{t.data}`"] for t in targets]
    return T.table(head, body) if body else "(no stored results yet: see `benchmarks/baselines/README.md`)"


# --------------------------------------------------------------------------------------------------- figures


STYLE = {  # color and line style of each row's curve
    "timm_eager": ("k", ":"),
    "timm_compiled": ("k", "--"),
    "padded": ("tab:red", "-"),
    "padded_full": ("tab:red", ":"),
    "fa2_varlen": ("tab:blue", "-"),
    "nested_sdpa": ("tab:purple", "-"),
    "triton": ("tab:green", "-"),
    "triton_graphed": ("tab:green", "--"),
    "fa2_varlen_graphed": ("tab:blue", "--"),
    "padded_graphed": ("tab:red", "--"),
    "triton_graphed_compiled": ("tab:olive", "-."),
    "timm_compiled_gemm": ("0.4", "--"),
    "public_compiled": ("tab:orange", "-."),
}


def panels(nrows: int, ncols: int, width: float, height: float):
    """A figure of ``nrows x ncols`` panels (matplotlib without a display, deterministic output)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "ragged-vit", "font.size": 9})
    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def save_figure(fig, path: Path, title: str, **layout: object) -> bool:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout(**layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return True


def _curve(ax, name: str, pts: list[tuple[float, float]]) -> None:
    """One row's curve, if it has points."""
    if pts:
        color, ls = STYLE[name]
        ax.plot(*zip(*pts, strict=True), color=color, ls=ls, marker="o", ms=3, label=T.ROW_SHORT[name])


def _axes(ax, title: str, xlabel: str, ylabel: str, log2x: bool = False) -> None:
    ax.set_title(title)
    if log2x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def throughput_figure(payload: dict, slug: str, path: Path) -> bool:
    """img/s vs batch size per workload (one panel each), the paper's three curves in grey for reference."""
    rows, idx, _ = T.throughput_rows(payload)
    workloads = [w for w in T.WORKLOAD_ORDER if any(r["workload"] == w and r["model"] == DEIT_B for r in rows)]
    if not workloads:
        return False
    cols = min(3, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = panels(nrows, cols, 4.2, 3.4)
    for ax, w in zip(axes.flat, workloads, strict=False):
        batches = sorted({r["batch"] for r in rows if r["workload"] == w and r["model"] == DEIT_B})
        for name in T.ROW_ORDER:
            _curve(ax, name, [(b, y) for b in batches if (y := T.rate(idx, DEIT_B, w, 0.5, b, name))])
        paper_b = [b for b in sorted(T.PAPER_TABLE_III) if b in batches] or sorted(T.PAPER_TABLE_III)
        for i, name in enumerate(("paper padded", "paper FA2", "paper Triton")):
            ys = [T.PAPER_TABLE_III[b][i] for b in paper_b]
            ax.plot(paper_b, ys, color="0.7", ls=("-", "--", ":")[i], lw=1, label=name)
        kind = next(r["workload_kind"] for r in rows if r["workload"] == w)
        _axes(ax, f"{w} ({kind})", "batch size", "img/s", log2x=True)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(workloads) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    title = f"DeiT-B 224, 50% pruning, fp16 -- {slug} (grey: the paper, RTX 4000 Ada)"
    return save_figure(fig, path, title, rect=(0, 0.08 + 0.02 * nrows, 1, 0.95))


def pruning_figure(payload: dict, slug: str, path: Path) -> bool:
    """Speedup over the unpruned timm model under ``reduce-overhead`` (the user's real alternative, as the README's
    headline) vs pruned % per workload; unpruned timm eager as a horizontal line. Without a ``reduce-overhead`` row,
    the baseline is timm eager (the axis says which)."""
    rows, idx, _ = T.throughput_rows(payload)
    batch = 64
    workloads = [w for w in T.WORKLOAD_ORDER if any(r["workload"] == w for r in rows)]
    eager = T.unpruned(idx, DEIT_B, batch, "timm_eager")
    compiled = T.unpruned(idx, DEIT_B, batch, "timm_compiled")
    base, base_name = (compiled, "timm reduce-overhead") if compiled else (eager, "timm eager")
    if not workloads or not base:
        return False
    fig, axes = panels(1, len(workloads), 4.6, 3.6)
    for ax, w in zip(axes.flat, workloads, strict=True):
        keeps = sorted({r["keep_rate"] for r in rows if r["workload"] == w}, reverse=True)
        for name in T.ROW_ORDER:
            rates = [(round(100 * (1 - k)), T.img_s(idx.get((DEIT_B, w, k, batch, name)))) for k in keeps]
            _curve(ax, name, [(pct, y / base) for pct, y in rates if y])
        ax.axhline(1.0, color="k", ls="--", lw=1, label=f"{base_name} (unpruned)")
        if compiled and eager:
            ax.axhline(eager / compiled, color="k", ls=":", lw=1, label="timm eager (unpruned)")
        _axes(ax, f"{w} ({WORKLOADS[w].kind})", "pruned %", f"speedup over unpruned {base_name}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, f"DeiT-B 224, B={batch}, fp16 -- {slug}")


def resolution_figure(payload: dict, slug: str, path: Path) -> bool:
    """Triton / padded (fair) and / padded-full at 224 and 384 vs batch size, per workload."""
    rows, idx, _ = T.throughput_rows(payload)
    workloads = [w for w in T.WORKLOAD_ORDER if any(r["workload"] == w for r in rows)]
    models = [m for m in (DEIT_B, "deit_base_patch16_384") if any(r["model"] == m for r in rows)]
    if not workloads or not models:
        return False
    fig, axes = panels(1, len(workloads), 4.6, 3.4)
    for ax, w in zip(axes.flat, workloads, strict=True):
        for m, color in zip(models, ("tab:green", "tab:orange"), strict=False):
            batches = sorted({r["batch"] for r in rows if r["workload"] == w and r["model"] == m})
            for base, ls in (("padded", "-"), ("padded_full", ":")):
                pts = [
                    (b, v)
                    for b in batches
                    if (v := T.ratio(T.best_ours(idx, m, w, 0.5, b), T.rate(idx, m, w, 0.5, b, base)))
                ]
                if pts:
                    label = f"{T.MODEL_SHORT.get(m, m)}: ours / {T.ROW_SHORT[base]}"
                    ax.plot(*zip(*pts, strict=True), color=color, ls=ls, marker="o", ms=3, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        _axes(ax, w, "batch size", "speedup", log2x=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, f"224 vs 384, 50% pruning, fp16 -- {slug}")


FIGURES = {
    "table3": ("throughput-vs-batch", throughput_figure),
    "fig1": ("speedup-vs-pruning", pruning_figure),
    "res384": ("res224-vs-384", resolution_figure),
}


# --------------------------------------------------------------------------------------------------- document


INTRO = """# Results: the paper's tables on our GPUs

Generated by `python -m benchmarks.make_results` from the JSON under `benchmarks/baselines/<gpu>/` (do not edit by
hand; regenerate). Measured with `python -m benchmarks.report_e2e` (end to end) and
`python -m benchmarks.report_attention` (kernel); the paper's numbers (RTX 4000 Ada, SM89) stand beside ours. Each
target with its value and verdict: `docs/targets.md` (generated from the same files).

**Method.** fp16, `torch.no_grad`, images already on the GPU, three input batches rotated; after a warm-up each
forward is timed alone (synchronize, host clock and CUDA events around it); medians (the JSON keeps quartiles,
min/max and counts). Throughput = batch size / median wall time per forward. The JSON also holds CUDA events
and, where a pipeline has no host synchronisation, its device-only time under CUDA-graph replay. One torch thread.
Every pipeline is checked against the fp32 reference pipeline on the same pruning decisions before it is timed
(max |logit diff| <= 2x its dtype's own error + 16 eps); a failing pipeline is listed as FAILED, not timed.
Weights are random (seeded) unless a run says otherwise: speed does not depend on them, top-1 agreement does.

**Rows.** *timm eager* / *timm reduce-overhead*: the UNPRUNED timm model, eager and under
`torch.compile(mode="reduce-overhead")` (compiled once per batch size) -- what a
user would run instead. The pruned pipeline (dense blocks, pruning, packed blocks) with each attention backend:
*padded (fair)* pads to the batch's longest survivor (SDPA + key mask), *padded-full (paper's)* pads back to all N
tokens as the paper's baseline did, *FA2 varlen* (`aten._flash_attention_forward`, no wrapper), *NestedTensor* (flash
forced; timed at B <= 4 only, beyond that one forward's time is shown), *Triton (ours)*; *+ graphs*: the same pipelines
under the CUDA-graph runner `ragged_vit.pipelines.graphs`. T/Pad and T/FA2 are Triton eager over padded (fair) and FA2
varlen; *best ours* is the faster of Triton eager and Triton + graphs.

**Workloads** (the kind, fixed or ragged, is given with every table): *l2_ratio* Threshold-L2 top-k after block
3 (equal counts, the paper's setting); *l2_calibrated* Threshold-L2 with a calibrated norm threshold (ragged);
*dynamicvit*, *evit* three fixed-count stages; *ats* nine variable-count stages (ragged); *synthetic* drawn masks
with a per-image keep rate U(k-0.2, k+0.2), replayed (ragged, no scoring cost). The paper measured near-uniform
counts only.
"""


def part_files(card_dir: Path) -> dict[str, list[Path]]:
    """The e2e files of each part in one card directory (what :func:`load_card` merged)."""
    out: dict[str, list[Path]] = {}
    for path in sorted((card_dir / "e2e").glob("*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and payload.get("part") in T.RENDERERS:
            out.setdefault(payload["part"], []).append(path)
    return out


def card_section(
    card_dir: Path, parts: dict[str, dict], kernel: dict | None, figures: Path, doc_dir: Path, tome: dict | None = None
) -> str:
    slug = card_dir.name
    metas = [p["meta"] for p in parts.values()] + [x["meta"] for x in (kernel, tome) if x]
    card = next((m.get("card") for m in metas if m.get("card")), None)
    out = [f"## {card or slug} (`benchmarks/baselines/{slug}/`)"]
    missing = (
        f"(not measured: `python -m benchmarks.report_attention --out benchmarks/baselines/{slug}/attention.json`)"
    )
    out.append("### Tables I and II -- attention kernel\n\n" + (T.kernel_section(kernel) if kernel else missing))
    for part, title in PART_TITLES.items():
        payload = parts.get(part)
        if payload is None:
            out.append(f"### {title}\n\n(not measured on this card: `python -m benchmarks.report_e2e --part {part}`)")
            continue
        body = [f"### {title}", T.header(payload), T.RENDERERS[part](payload)]
        if part in FIGURES:
            name, draw = FIGURES[part]
            path = figures / f"{slug}-{name}.png"
            try:
                if draw(payload, slug, path):
                    body.append(
                        f"![{title} on {slug}]({Path(os.path.relpath(path.resolve(), doc_dir.resolve())).as_posix()})"
                    )
            except ImportError as exc:  # the tables do not need matplotlib
                body.append(f"(figure not drawn: {exc})")
        out.append("\n\n".join(body))
    call_path = card_dir / DEFAULT_CALL_FILE
    if call_path.exists():
        out.append(f"### {DEFAULT_CALL_TITLE}\n\n" + default_call.render(load_call(call_path)))
    else:
        out.append(f"### {DEFAULT_CALL_TITLE}\n\n(not measured on this card: `python -m benchmarks.default_call`)")
    for (model, size), (path, payload) in sorted(load_model_calls(card_dir).items()):
        out.append(f"### {DEFAULT_CALL_TITLE}: {model} at {size} (`{path.name}`)\n\n" + default_call.render(payload))
    if (stored := load_naflex(card_dir)) is not None:
        files, payload = stored
        out.append(f"### {NAFLEX_TITLE} (`{'`, `'.join(f.name for f in files)}`)\n\n" + naflex_section(payload))
    if tome is None:
        out.append(f"### {TOME_TITLE}\n\n(not measured on this card: `python -m benchmarks.tome_peer`)")
    else:
        m = tome["meta"]
        title = f"{TOME_TITLE} ({m.get('model')}, r = {m.get('r')})"
        variant = [f"**{TOME_VARIANT[0].upper()}{TOME_VARIANT[1:]}.**"] if _tome_variant(m.get("date")) else []
        out.append("\n\n".join([f"### {title}", T.header(tome), *variant, TOME_METHOD, tome_peer.render(tome)]))
        if (apart := tome.get("adaptive_run")) is not None:
            out.append("\n\n".join([f"#### The adaptive rows' own run (`{TOME_ADAPTIVE_FILE}`)", T.header(apart),
                                     tome_peer.render(apart)]))  # fmt: skip
    return "\n\n".join(out)


NAFLEX_METHOD = (
    "`python -m benchmarks.naflex` ({model}, {dtype}, random weights): the first B of 64 images with sizes drawn "
    "from 128-512 px and aspect ratios 1:3 to 3:1 (seed {seed}); timm padded and masked (the collator's dict made "
    "before timing), eager and under each `torch.compile` mode; ours on the list of images, the default call "
    "(`ragged_vit.prune(model, \"none\")`, and with Threshold-L2 0.5). img/s each forward synchronised / back to "
    "back; in brackets, over timm's best row at that batch size (each forward synchronised)."
)


def naflex_section(payload: dict) -> str:
    """The stored ``benchmarks.naflex`` rows: img/s on both clocks per batch size, ours over timm's best mode."""
    rows = payload["rows"]
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["row"] for r in rows))
    best = {b: max((r["img_per_s"] for r in rows if r["batch"] == b and r["row"].startswith("timm")
                    and r.get("img_per_s")), default=None) for b in batches}  # fmt: skip
    body = []
    for name in names:
        cells = [name]
        for b in batches:
            r = next((r for r in rows if r["batch"] == b and r["row"] == name), None)
            if r is None or not r.get("img_per_s"):
                cells.append("-" if r is None else str(r.get("status", "-")).split(":")[0])
                continue
            ratio = f" ({r['img_per_s'] / best[b]:.2f}x)" if best[b] and name.startswith("ours") else ""
            cells.append(f"{r['img_per_s']:,.0f} / {r['img_per_s_back_to_back']:,.0f}{ratio}")
        body.append(cells)
    method = NAFLEX_METHOD.format(model=payload.get("model"), dtype=payload.get("dtype", "float16"),
                                  seed=payload.get("seed", 0))  # fmt: skip
    env = payload.get("environment", {})
    about = (f"{env.get('card')}, torch {env.get('torch')}, triton {env.get('triton')}, commit {env.get('commit')}, "
             f"{env.get('date')} (the latest run).")  # fmt: skip
    checks, firsts = [], []
    for name in names:
        of = {r["batch"]: r for r in rows if r["row"] == name}
        diffs = [f"B={b} {of[b]['max_abs_diff']:.1e}" for b in batches if of.get(b, {}).get("max_abs_diff") is not None]
        if diffs and name != "timm_eager":
            checks.append(f"{name} {', '.join(diffs)}")
        seconds = [f"{of[b]['first_call_s']:g}" if "first_call_s" in of.get(b, {}) else "-" for b in batches]
        firsts.append(f"{name} {' / '.join(seconds)}")
    lines = [f"- Max \\|logit diff\\| against timm eager (the unpruned rows): {'; '.join(checks)}.",
             f"- First call, s ({' / '.join(f'B={b}' for b in batches)}): {'; '.join(firsts)}."]  # fmt: skip
    return "\n\n".join([method + " " + about, T.table(["row", *(f"B={b}" for b in batches)], body), "\n".join(lines)])


# --------------------------------------------------------------------------------------------------- README


README_ROWS = ("l2_calibrated", "ats", "dynamicvit", "evit", "tome", "tome_variant")


def readme_table(payload: dict, path: Path) -> str:
    """One card's README table from a stored ``benchmarks.default_call`` run: the default call of each pruner over
    unpruned timm ``torch.compile(mode="reduce-overhead")`` in the same process, each forward synchronised / back to
    back, with timm's own img/s."""
    base, rows = default_call._split(payload.get("table", []))
    batches = [b for b in sorted(base) if "timm_compiled" in base[b]]
    order = {w: i for i, w in enumerate(README_ROWS)}
    workloads = sorted(dict.fromkeys(k[1] for k in rows if k[2] == "default"), key=lambda w: order.get(w, 99))
    env = payload.get("environment", {})

    def name(w: str) -> str:
        keep = next((rows[k]["keep"] for k in rows if k[1] == w), None)
        shown = WORKLOAD_NAMES.get(w, w)
        return f"{shown} r = {keep:g}" if w.startswith("tome") else f"{shown} {keep:g}" if keep is not None else shown

    head = ["B", "timm `reduce-overhead`, img/s", *(name(w) for w in workloads)]
    body = []
    for b in batches:
        t = base[b]["timm_compiled"]
        cells = [str(b), f"{b * 1e6 / t['each_us']:,.0f} / {b * 1e6 / t['back_to_back_us']:,.0f}"]
        for w in workloads:
            entry = rows.get((b, w, "default"))
            each, b2b = default_call._ratio(t, entry, "each_us"), default_call._ratio(t, entry, "back_to_back_us")
            cells.append("-" if each is None or b2b is None else f"{each:.2f}x / {b2b:.2f}x")
        body.append(cells)
    about = [", ".join(f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k)), _date(env), f"`{_rel(path)}`"]
    caption = f"**{env.get('card') or path.parent.name}** ({'; '.join(a for a in about if a and a != '-')})"
    return caption + "\n\n" + T.table(head, body)


def readme_section(baselines: Path) -> str:
    """What ``nox -s results`` writes between the README's results markers: one table per card."""
    tables = [readme_table(load_call(p), p)
              for d in card_dirs(baselines) if (p := d / DEFAULT_CALL_FILE).exists()]  # fmt: skip
    if not tables:
        return "(no stored run of `python -m benchmarks.default_call` yet)"
    intro = (
        "The call users make (`prune(model, ...)(images)`), DeiT-B 224 fp16, random weights, over the unpruned timm "
        'model under `torch.compile(mode="reduce-overhead")` in the same process: each forward synchronised / back '
        "to back (`python -m benchmarks.default_call`; generated by `nox -s results`)."
    )
    return "\n\n".join([intro, *tables])


def replace_between(text: str, name: str, body: str) -> str | None:
    """``text`` with what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by ``body``;
    None when the markers are absent."""
    pattern = re.compile(rf"(<!-- {name}:begin -->).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda m: f"{m.group(1)}\n{body.strip()}\n{m.group(2)}", text, count=1)


def write_between(path: Path, name: str, body: str) -> bool:
    """Replaces the generated part of ``path`` (between its ``name`` markers); False if it has none."""
    if not path.exists():
        return False
    text = path.read_text()
    new = replace_between(text, name, body)
    if new is None:
        return False
    if new != text:
        path.write_text(new)
    return True


# --------------------------------------------------------------------------------------------------- outputs


def build(baselines: Path, out: Path, figures: Path) -> str:
    """Renders docs/results.md (and writes the figures); returns the markdown."""
    sections = [INTRO.strip()]
    dirs = card_dirs(baselines)
    if not dirs:
        inside = baselines.resolve().is_relative_to(REPO_ROOT)
        where = Path(os.path.relpath(baselines.resolve(), REPO_ROOT) if inside else baselines.name).as_posix()
        sections.append(f"(no stored results under `{where}` yet: see `benchmarks/baselines/README.md`)")
    for d in dirs:
        parts, kernel = load_card(d)
        sections.append(card_section(d, parts, kernel, figures, out.parent, load_tome(d)))
    return "\n\n".join(sections) + "\n"


def all_targets(baselines: Path, data_dir: Path) -> list[Target]:
    """Every target of every card's stored files and of the ``docs/data`` files that measure one, sorted by
    target, then card."""
    targets = []
    for d in card_dirs(baselines):
        parts, kernel = load_card(d)
        targets += card_targets(d, parts, kernel, load_tome(d), part_files(d), data_dir)
    targets += data_targets(data_dir)
    order = {t.target: i for i, t in enumerate(targets)}
    return sorted(targets, key=lambda t: (order[t.target], t.card))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.make_results", description=__doc__.split("\n")[0])
    parser.add_argument("--baselines", type=Path, default=BASELINES)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "results.md")
    parser.add_argument("--figures", type=Path, default=None, help="default: figures/ beside --out")
    parser.add_argument("--data", type=Path, default=None, help="docs/data (stored one-off runs); default: data/ "
                        "beside --out")  # fmt: skip
    parser.add_argument("--targets", type=Path, default=None, help="default: targets.md beside --out")
    parser.add_argument("--readme", type=Path, default=None, help="default: README.md above --out's folder")
    args = parser.parse_args(argv)
    figures = args.figures or args.out.parent / "figures"
    text = build(args.baselines, args.out, figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines) and figures under {figures}", file=sys.stderr)
    targets_md = args.targets or args.out.parent / "targets.md"
    table = targets_table(all_targets(args.baselines, args.data or args.out.parent / "data"))
    for path, name, body in ((targets_md, "targets", table),
                             (args.readme or args.out.parent.parent / "README.md", "results",
                              readme_section(args.baselines))):  # fmt: skip
        done = write_between(path, name, body)
        print(f"{'wrote' if done else 'skipped (no file or no markers)'} {path}'s {name} table", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
