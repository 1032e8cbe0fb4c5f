"""Markdown tables of the end-to-end benchmark, this card's numbers beside the paper's (pure Python, no GPU).

Used by ``report_e2e`` (printed after a run) and ``make_results`` (docs/results.md). Input: a part's payload as
``report_e2e`` writes it (``{"part", "quick", "meta", "rows", ...}``); rows of several runs of one part may be
merged first (:func:`merge_payloads`). Output is deterministic: rows are sorted, numbers have fixed formats.

The paper's numbers (RTX 4000 Ada, DeiT-B, fp16, Threshold-L2 at a fixed ratio, padded SDPA padding back to 197
tokens) are those of its Tables III-VI; the numbers of its Figures 1 and 3 were lost in the text extraction and
only their summary survives (1.88x over padded at 224, 2.51x at 384).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Table III (img/s, 50% pruning): B -> (padded, FA2, Triton).
PAPER_TABLE_III = {
    1: (503, 418, 467),
    4: (1040, 1436, 1560),
    8: (1048, 1723, 1750),
    16: (1014, 1718, 1726),
    32: (968, 1741, 1743),
    64: (935, 1763, 1758),
    128: (928, 1742, 1746),
}
# Table IV (ms; front, pack/gather, late blocks, head, total); B = 8 by its Table III.
PAPER_TABLE_IV = {"padded": (2.31, 0.28, 5.24, 0.03, 7.86), "triton": (2.31, 0.08, 2.07, 0.04, 4.50)}
# Table V (img/s): model -> (label, padded, FA2, Triton).
PAPER_TABLE_V = {
    "deit_tiny_patch16_224": ("DeiT-Ti", 5363, 9629, 9769),
    "deit_small_patch16_224": ("DeiT-S", 2788, 4690, 4931),
    "deit_base_patch16_224": ("DeiT-B", 1042, 1786, 1778),
}
# Table VI: config -> max |diff| against the padded reference (all top-1 match).
PAPER_TABLE_VI_KERNEL = {0: 0.000488, 50: 0.000488, 80: 0.000977}
PAPER_TABLE_VI_E2E = {1: 0.001465, 4: 0.003906, 16: 0.002930}
PAPER_SPEEDUP_OVER_PADDED = {224: 1.88, 384: 2.51}

ROW_SHORT = {
    "timm_eager": "timm eager",
    "timm_compiled": "timm reduce-overhead",
    "timm_compiled_gemm": "timm reduce-overhead, GEMM embed",
    "padded": "padded (fair)",
    "padded_full": "padded-full (paper's)",
    "fa2_varlen": "FA2 varlen",
    "nested_sdpa": "NestedTensor",
    "triton": "Triton (ours)",
    "triton_graphed": "Triton + graphs",
    "fa2_varlen_graphed": "FA2 + graphs",
    "padded_graphed": "padded + graphs",
    "triton_graphed_compiled": "Triton + graphs + compile",
    "public_compiled": "public APIs + reduce-overhead",
}
ROW_ORDER = tuple(ROW_SHORT)
OURS = ("triton", "triton_graphed", "triton_graphed_compiled")
MODEL_SHORT = {
    "deit_tiny_patch16_224": "DeiT-Ti 224",
    "deit_small_patch16_224": "DeiT-S 224",
    "deit_base_patch16_224": "DeiT-B 224",
    "deit_base_patch16_384": "DeiT-B 384",
}
WORKLOAD_ORDER = ("l2_ratio", "l2_calibrated", "dynamicvit", "evit", "ats", "synthetic")


# --------------------------------------------------------------------------------------------------- data


def merge_payloads(payloads: Sequence[dict]) -> dict:
    """One payload per part from several runs: rows keyed by ``key``; a full run's row replaces a quick run's, a
    later run's replaces an earlier one's. ``metas`` lists every run's meta (oldest first)."""
    if not payloads:
        raise ValueError("no payloads to merge")
    ordered = sorted(payloads, key=lambda p: (not p.get("quick", False), p["meta"].get("date", "")))
    rows: dict[str, dict] = {}
    kernel_rows: list = []
    for p in ordered:
        for row in p["rows"]:
            rows[row["key"]] = row
        kernel_rows = p.get("kernel_rows") or kernel_rows
    merged = {
        "part": ordered[0]["part"],
        "quick": all(p.get("quick", False) for p in ordered),
        "meta": ordered[-1]["meta"],
        "metas": [p["meta"] for p in ordered],
        "rows": sorted(rows.values(), key=_row_sort_key),
    }
    if kernel_rows:
        merged["kernel_rows"] = kernel_rows
    return merged


def _row_sort_key(row: dict) -> tuple:
    workload = row["workload"]
    w = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else -1
    r = ROW_ORDER.index(row["row"]) if row["row"] in ROW_ORDER else len(ROW_ORDER)
    return (row["model"], row["resolution"], -row["keep_rate"], w, row["batch"], r, row.get("kind", ""))


def ok(row: dict | None) -> bool:
    return bool(row) and row.get("status") == "ok"


def img_s(row: dict | None) -> float | None:
    return row.get("img_per_s") if ok(row) else None


def median_us(row: dict | None, clock: str) -> float | None:
    spread = row.get(f"{clock}_us") if ok(row) else None
    return spread["median"] if spread else None


def index(rows: Iterable[dict]) -> dict[tuple, dict]:
    """``(model, workload, keep_rate, batch, row) -> row``; the unpruned rows under workload ``none``."""
    return {(r["model"], r["workload"], r["keep_rate"], r["batch"], r["row"]): r for r in rows}


def best_ours(idx: dict, model: str, workload: str, keep: float, batch: int) -> float | None:
    """The fastest of our rows: Triton eager, Triton + graphs, Triton + graphs + compile (img/s)."""
    rates = [img_s(idx.get((model, workload, keep, batch, r))) for r in OURS]
    rates = [r for r in rates if r]
    return max(rates) if rates else None


def unpruned(idx: dict, model: str, batch: int, row: str) -> float | None:
    return img_s(idx.get((model, "none", 1.0, batch, row)))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# --------------------------------------------------------------------------------------------------- format


def fmt_rate(row: dict | None) -> str:
    if not row:
        return "-"
    status = row.get("status")
    if status == "ok":
        return f"{row['img_per_s']:,.0f}"
    if status == "skipped" and row.get("single_forward_ms") is not None:
        return f"skip ({row['single_forward_ms']:.0f} ms/fwd)"
    return {"failed": "FAILED", "unavailable": "n/a", "skipped": "skip"}.get(status, "-")


def fmt_x(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def fmt_ms(us: float | None) -> str:
    return f"{us / 1e3:.2f}" if us is not None else "-"


def fmt_err(value: float | None) -> str:
    return f"{value:.2e}" if value is not None else "-"


def table(head: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def header(payload: dict) -> str:
    """Card, versions, commit and dtype of every run merged into ``payload``."""
    metas = payload.get("metas") or [payload["meta"]]
    seen = []
    for m in metas:
        line = (
            f"{m.get('card')} (SM {m.get('capability')}), torch {m.get('torch')}, triton {m.get('triton')}, "
            f"timm {m.get('timm')}, CUDA {m.get('cuda')}, commit {m.get('commit')}, {m.get('dtype', 'float16')}, "
            f"weights {m.get('weights')}, {'quick' if m.get('args', {}).get('quick') else 'full'} run {m.get('date')}"
        )
        if line not in seen:
            seen.append(line)
    return "\n".join(f"- {line}" for line in seen)


def workload_line(rows: list[dict]) -> str:
    """``name (kind)``: description; kept patches per stage, mean [min-max] of the checked batch."""
    r = rows[0]
    if r["workload"] == "none":
        return "unpruned"
    counts = r.get("counts") or {}
    kept = ""
    if counts.get("stages"):
        stages = [f"{m:g} [{lo}-{hi}]" for m, lo, hi in zip(counts["mean"], counts["min"], counts["max"], strict=True)]
        shown = stages if len(stages) <= 3 else [*stages[:2], "...", stages[-1]]
        kept = f"; kept patches per stage at B={r['batch']}: " + ", ".join(shown)
    desc = r.get("workload_desc") or ""
    return f"**{r['workload']}** ({r['workload_kind']}, keep rate {r['keep_rate']:g}): {desc}{kept}"


def present_rows(rows: Iterable[dict], candidates: Sequence[str] = ROW_ORDER) -> list[str]:
    have = {r["row"] for r in rows}
    return [c for c in candidates if c in have]


def groups(rows: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[f] for f in fields), []).append(r)
    return out


# --------------------------------------------------------------------------------------------------- parts


def throughput_rows(payload: dict) -> tuple[list[dict], dict, list[dict]]:
    """A part's throughput rows, their index, and the pruned ones (unpruned rows have workload ``none``)."""
    rows = [r for r in payload["rows"] if r.get("kind", "throughput") == "throughput"]
    return rows, index(rows), [r for r in rows if r["workload"] != "none"]


def throughput_table(payload: dict, paper: bool = True) -> str:
    """Table III layout per (model, workload): img/s vs batch size for every row, the paper's ratios."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (model, workload, keep), grp in groups(pruned, "model", "workload", "keep_rate").items():
        cols = present_rows(rows_for(rows, model, workload, keep))
        batches = sorted({r["batch"] for r in grp})
        head = ["B", *[ROW_SHORT[c] for c in cols], "T/Pad", "T/FA2", "best ours / reduce-overhead"]
        show_paper = paper and model == "deit_base_patch16_224" and keep == 0.5
        if show_paper:
            head += ["paper Pad / FA2 / T (T/Pad)"]
        body = []
        for b in batches:
            cells = [str(b)] + [fmt_rate(idx.get(key_of(model, workload, keep, b, c))) for c in cols]
            t = img_s(idx.get((model, workload, keep, b, "triton")))
            cells += [
                fmt_x(ratio(t, img_s(idx.get((model, workload, keep, b, "padded"))))),
                fmt_x(ratio(t, img_s(idx.get((model, workload, keep, b, "fa2_varlen"))))),
                fmt_x(ratio(best_ours(idx, model, workload, keep, b), unpruned(idx, model, b, "timm_compiled"))),
            ]
            if show_paper:
                p = PAPER_TABLE_III.get(b)
                cells.append(f"{p[0]:,} / {p[1]:,} / {p[2]:,} ({p[2] / p[0]:.2f}x)" if p else "-")
            body.append(cells)
        title = f"{MODEL_SHORT.get(model, model)}, {workload_line(grp)}"
        out.append(title + "\n\n" + table(head, body))
    return "\n\n".join(out) if out else "(no rows)"


def rows_for(rows: list[dict], model: str, workload: str, keep: float) -> list[dict]:
    """The rows of one group plus the unpruned rows of the same model (columns of one table)."""
    return [r for r in rows if r["model"] == model and r["workload"] in (workload, "none")]


def key_of(model: str, workload: str, keep: float, batch: int, row: str) -> tuple:
    return (model, "none", 1.0, batch, row) if row.startswith("timm_") else (model, workload, keep, batch, row)


def clocks_table(payload: dict) -> str:
    """Every row's three clocks: wall / CUDA events / graph replay medians (ms) with the wall IQR, and checks."""
    head = ["model", "workload", "B", "row", "wall ms [IQR]", "events ms", "graph ms", "n", "max diff / bound", "note"]
    body = []
    for r in payload["rows"]:
        wall = r.get("wall_us")
        iqr = f" [{wall['q1'] / 1e3:.2f}-{wall['q3'] / 1e3:.2f}]" if wall else ""
        check = r.get("check") or {}
        diff = (
            f"{fmt_err(check.get('max_abs_diff'))} / {fmt_err(check.get('bound'))}"
            if check.get("max_abs_diff") is not None
            else "-"
        )
        note = r.get("reason") or r.get("graph_reason") or ""
        if r.get("compile_s") is not None:
            note = f"compile {r['compile_s']:.1f} s; " + note
        body.append(
            [
                MODEL_SHORT.get(r["model"], r["model"]),
                f"{r['workload']} ({r['workload_kind']}, k={r['keep_rate']:g})",
                str(r["batch"]),
                ROW_SHORT.get(r["row"], r["row"]),
                (fmt_ms(median_us(r, "wall")) + iqr) if wall else r.get("status", "-"),
                fmt_ms(median_us(r, "events")),
                fmt_ms(median_us(r, "graph")),
                str(r.get("iters", "-")),
                diff,
                note.replace("|", "/")[:140],
            ]
        )
    return table(head, body)


def stages_table(payload: dict) -> str:
    """Table IV layout per (workload, batch): front / pack / late / head (CUDA events, ms, medians)."""
    rows = [r for r in payload["rows"] if r.get("kind") == "stages"]
    out = []
    for (model, _, keep, batch), grp in groups(rows, "model", "workload", "keep_rate", "batch").items():
        head = ["pipeline", "front", "pack", "late blocks", "head", "total (sum)", "forward wall (uninstrumented)"]
        body = []
        by_row = {r["row"]: r for r in grp}
        for name in present_rows(grp):
            r = by_row[name]
            st = r.get("stages_us")
            if not st:
                body.append([ROW_SHORT[name], *(["-"] * 5), fmt_rate(r)])
                continue
            cells = [fmt_ms(st[k]["median"]) for k in ("front", "pack", "late", "head", "total")]
            body.append([ROW_SHORT[name], *cells, fmt_ms(median_us(r, "wall"))])
        pad, tri = by_row.get("padded", {}).get("stages_us"), by_row.get("triton", {}).get("stages_us")
        if pad and tri:
            sp = [fmt_x(ratio(pad[k]["median"], tri[k]["median"])) for k in ("front", "pack", "late", "head", "total")]
            body.append(["speedup padded (fair) / Triton", *sp, "-"])
        if model == "deit_base_patch16_224" and keep == 0.5:
            for name, vals in PAPER_TABLE_IV.items():
                body.append([f"paper: {ROW_SHORT[name]} (RTX 4000 Ada, B=8)", *[f"{v:.2f}" for v in vals], "-"])
            p, t = PAPER_TABLE_IV["padded"], PAPER_TABLE_IV["triton"]
            body.append(["paper: speedup", *[f"{a / b:.2f}x" for a, b in zip(p, t, strict=True)], "-"])
        title = f"{MODEL_SHORT.get(model, model)}, B={batch}, {workload_line(grp)}"
        out.append(title + "\n\n" + table(head, body))
    return "\n\n".join(out) if out else "(no rows)"


def pruning_table(payload: dict) -> str:
    """Figure 1 as a table per workload: img/s vs pruned %, and each row's speedup over unpruned timm eager."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (model, workload, batch), grp in groups(pruned, "model", "workload", "batch").items():
        cols = present_rows(grp)
        eager, compiled = unpruned(idx, model, batch, "timm_eager"), unpruned(idx, model, batch, "timm_compiled")
        head = ["pruned %", "kind", *[ROW_SHORT[c] for c in cols]]
        head += [f"{ROW_SHORT[c]} / timm eager" for c in cols if c in ("padded", "triton", "triton_graphed")]
        body = []
        for keep in sorted({r["keep_rate"] for r in grp}, reverse=True):
            kind = next(r["workload_kind"] for r in grp if r["keep_rate"] == keep)
            cells = [str(round(100 * (1 - keep))), kind]
            cells += [fmt_rate(idx.get((model, workload, keep, batch, c))) for c in cols]
            cells += [
                fmt_x(ratio(img_s(idx.get((model, workload, keep, batch, c))), eager))
                for c in cols
                if c in ("padded", "triton", "triton_graphed")
            ]
            body.append(cells)
        ref = f"unpruned timm at B={batch}: eager {eager:,.0f} img/s" if eager else "unpruned timm eager: -"
        ref += f", reduce-overhead {compiled:,.0f} img/s" if compiled else ", reduce-overhead: -"
        title = f"{MODEL_SHORT.get(model, model)}, B={batch}, workload **{workload}**; {ref}"
        out.append(title + "\n\n" + table(head, body))
    return "\n\n".join(out) if out else "(no rows)"


def models_table(payload: dict) -> str:
    """Table V layout: per model and batch size, img/s of every row, T/Pad, and the paper's row."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (workload, keep), grp in groups(pruned, "workload", "keep_rate").items():
        models = sorted(
            {r["model"] for r in grp}, key=lambda m: list(PAPER_TABLE_V).index(m) if m in PAPER_TABLE_V else 9
        )
        cols = present_rows([r for r in rows if r["workload"] in (workload, "none")])
        head = [
            "model",
            "B",
            *[ROW_SHORT[c] for c in cols],
            "T/Pad",
            "best ours / reduce-overhead",
            "paper Pad / FA2 / T",
        ]
        body = []
        for model in models:
            for b in sorted({r["batch"] for r in grp if r["model"] == model}):
                cells = [MODEL_SHORT.get(model, model), str(b)]
                cells += [fmt_rate(idx.get(key_of(model, workload, keep, b, c))) for c in cols]
                t = img_s(idx.get((model, workload, keep, b, "triton")))
                cells.append(fmt_x(ratio(t, img_s(idx.get((model, workload, keep, b, "padded"))))))
                cells.append(
                    fmt_x(ratio(best_ours(idx, model, workload, keep, b), unpruned(idx, model, b, "timm_compiled")))
                )
                p = PAPER_TABLE_V.get(model)
                cells.append(f"{p[1]:,} / {p[2]:,} / {p[3]:,} ({p[3] / p[1]:.2f}x)" if p else "-")
                body.append(cells)
        out.append(workload_line(grp) + "\n\n" + table(head, body))
    return "\n\n".join(out) if out else "(no rows)"


def resolution_table(payload: dict) -> str:
    """Section V-D: 224 vs 384 at each batch size: img/s, Triton over padded (fair and full), over reduce-overhead."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (workload, keep), grp in groups(pruned, "workload", "keep_rate").items():
        cols = present_rows([r for r in rows if r["workload"] in (workload, "none")])
        head = ["resolution", "B", *[ROW_SHORT[c] for c in cols], "T/Pad", "T/Pad-full", "best ours / reduce-overhead"]
        body = []
        for model in sorted({r["model"] for r in grp}, key=lambda m: (m.endswith("384"), m)):
            for b in sorted({r["batch"] for r in grp if r["model"] == model}):
                res = next(r["resolution"] for r in grp if r["model"] == model)
                cells = [str(res), str(b)] + [fmt_rate(idx.get(key_of(model, workload, keep, b, c))) for c in cols]
                t = img_s(idx.get((model, workload, keep, b, "triton")))
                cells += [
                    fmt_x(ratio(t, img_s(idx.get((model, workload, keep, b, "padded"))))),
                    fmt_x(ratio(t, img_s(idx.get((model, workload, keep, b, "padded_full"))))),
                    fmt_x(ratio(best_ours(idx, model, workload, keep, b), unpruned(idx, model, b, "timm_compiled"))),
                ]
                body.append(cells)
        note = (
            "paper (RTX 4000 Ada, Threshold-L2 fixed ratio, padded = pad back to N): Triton / padded up to "
            f"{PAPER_SPEEDUP_OVER_PADDED[224]}x at 224 and {PAPER_SPEEDUP_OVER_PADDED[384]}x at 384; per-batch "
            "numbers of its Figure 3 were lost in extraction."
        )
        out.append(workload_line(grp) + "\n\n" + table(head, body) + "\n\n" + note)
    return "\n\n".join(out) if out else "(no rows)"


def numerics_table(payload: dict) -> str:
    """Table VI: max / mean |logit diff| against the padded (fair) fp16 pipeline on the same decisions."""
    rows = [r for r in payload["rows"] if r.get("kind") == "numerics"]
    head = [
        "config",
        "kind",
        "Triton vs padded: max",
        "mean",
        "top-1 agree",
        "FA2 vs padded: max",
        "padded-full vs padded: max",
        "Triton vs fp32 ref: max",
        "padded vs fp32 ref: max",
        "paper max (vs padded)",
    ]
    body = []
    for k in payload.get("kernel_rows") or []:
        body.append(
            [
                f"kernel, B={k['batch']}, {k['pruned_pct']}% pruned",
                k["workload_kind"],
                fmt_err(k["max_vs_padded"]),
                fmt_err(k["mean_vs_padded"]),
                "-",
                "-",
                "-",
                fmt_err(k["max_ours_vs_fp32"]),
                fmt_err(k["max_padded_vs_fp32"]),
                fmt_err(PAPER_TABLE_VI_KERNEL.get(k["pruned_pct"])) if k["workload_kind"] == "fixed" else "-",
            ]
        )
    for r in rows:
        vp, vf = r.get("vs_padded") or {}, r.get("vs_fp32") or {}
        tri = vp.get("triton", {})
        paper = PAPER_TABLE_VI_E2E.get(r["batch"]) if r["workload"] == "l2_ratio" else None
        body.append(
            [
                f"E2E {MODEL_SHORT.get(r['model'], r['model'])}, B={r['batch']}, {r['workload']}",
                r["workload_kind"],
                fmt_err(tri.get("max")),
                fmt_err(tri.get("mean")),
                f"{100 * tri['top1_agree']:.0f}%" if tri.get("top1_agree") is not None else "-",
                fmt_err(vp.get("fa2_varlen", {}).get("max")),
                fmt_err(vp.get("padded_full", {}).get("max")),
                fmt_err(vf.get("triton", {}).get("max")),
                fmt_err(vf.get("padded", {}).get("max")),
                fmt_err(paper),
            ]
        )
    return table(head, body) if body else "(no rows)"


RENDERERS = {
    "table3": throughput_table,
    "table4": stages_table,
    "fig1": pruning_table,
    "table5": models_table,
    "res384": resolution_table,
    "table6": numerics_table,
}


def render_part(payload: dict) -> str:
    """The part's main table(s) under its card/versions header."""
    part = payload["part"]
    return header(payload) + "\n\n" + RENDERERS[part](payload)
