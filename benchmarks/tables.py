"""Every markdown table of the benchmarks, this card's numbers beside the paper's.

Printed by ``report_attention`` and ``report_e2e`` after a run and written into docs/results.md by
``make_results``. Input is their JSON: the kernel benchmark's ``{"meta", "cells"}``, or an end-to-end part's
``{"part", "quick", "meta", "rows", ...}`` (rows of several runs of one part merged first:
:func:`merge_payloads`). Output is deterministic: rows are sorted, numbers have fixed formats.

The paper's numbers (RTX 4000 Ada, DeiT-B, fp16, Threshold-L2 at a fixed ratio, padded SDPA padding back to 197
tokens) are those of its Tables I-VI; the numbers of its Figures 1 and 3 were lost in the text extraction and
only their summary survives (1.88x over padded at 224, 2.51x at 384).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from benchmarks.workloads import WORKLOADS

# Table I (ms, CUDA events, fixed counts): (B, pruned %) -> (padded SDPA, FA2, Triton).
PAPER_TABLE_I = {
    (32, 0): (2.067, 0.112, 0.136),
    (32, 50): (1.913, 0.050, 0.042),
    (32, 80): (1.907, 0.051, 0.024),
    (64, 0): (4.099, 0.265, 0.346),
    (64, 50): (3.839, 0.072, 0.080),
    (64, 80): (3.722, 0.060, 0.028),
}
# Table II (B = 32): pruned % -> (FA2 overhead %, Triton overhead %).
PAPER_TABLE_II = {0: (46, 18), 50: (100, 57), 80: (100, 100)}
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
# Table V (img/s): model -> (padded, FA2, Triton).
PAPER_TABLE_V = {
    "deit_tiny_patch16_224": (5363, 9629, 9769),
    "deit_small_patch16_224": (2788, 4690, 4931),
    "deit_base_patch16_224": (1042, 1786, 1778),
}
# Table VI: config -> max |diff| against the padded reference (all top-1 match).
PAPER_TABLE_VI_KERNEL = {0: 0.000488, 50: 0.000488, 80: 0.000977}
PAPER_TABLE_VI_E2E = {1: 0.001465, 4: 0.003906, 16: 0.002930}
PAPER_SPEEDUP_OVER_PADDED = {224: 1.88, 384: 2.51}

# The end-to-end rows, in table order: what a user could run. A short label for the tables, a long one for the JSON.
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
ROW_LABELS = {
    "timm_eager": "unpruned timm, eager",
    "timm_compiled": 'unpruned timm, torch.compile(mode="reduce-overhead")',
    "timm_compiled_gemm": 'unpruned timm + our GEMM patch embedding, torch.compile(mode="reduce-overhead")',
    "padded": "padded (fair): pad to the batch's longest survivor, SDPA + key mask",
    "padded_full": "padded-full (the paper's): pad back to all N tokens, SDPA + key mask",
    "fa2_varlen": "FA2 varlen (aten._flash_attention_forward)",
    "nested_sdpa": "NestedTensor SDPA (flash forced)",
    "triton": "ours: Triton ragged",
    "triton_graphed": "ours: Triton ragged + CUDA graphs (ragged_vit.pipelines.graphs)",
    "fa2_varlen_graphed": "FA2 varlen + CUDA graphs (ragged_vit.pipelines.graphs)",
    "padded_graphed": "padded (fair) + CUDA graphs (ragged_vit.pipelines.graphs)",
    "triton_graphed_compiled": "ours: Triton ragged + CUDA graphs + torch.compile of the blocks (compile_blocks)",
    "public_compiled": "public APIs only: timm blocks on gathered tokens (fixed counts) or on all N with a key mask "
    '(variable), decisions replayed, torch.compile(mode="reduce-overhead")',
}
ROW_ORDER = tuple(ROW_SHORT)
OURS = ("triton", "triton_graphed", "triton_graphed_compiled")
BEST = "best ours / reduce-overhead"
# Ratio columns: (numerator row, or "ours" for the fastest of OURS; denominator row).
RATIOS = {
    "T/Pad": ("triton", "padded"),
    "T/FA2": ("triton", "fa2_varlen"),
    "T/Pad-full": ("triton", "padded_full"),
    BEST: ("ours", "timm_compiled"),
}
MODEL_SHORT = {
    "deit_tiny_patch16_224": "DeiT-Ti 224",
    "deit_small_patch16_224": "DeiT-S 224",
    "deit_base_patch16_224": "DeiT-B 224",
    "deit_base_patch16_384": "DeiT-B 384",
}
WORKLOAD_ORDER = tuple(WORKLOADS)


# --------------------------------------------------------------------------------------------------- format


def table(head: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def titled(title: str, head: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    return title + "\n\n" + table(head, body)


def sections(blocks: list[str]) -> str:
    return "\n\n".join(blocks) if blocks else "(no rows)"


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


def fmt_us(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 1000 else f"{value:.{digits}f}"


def fmt_paper_rates(rates: tuple[int, int, int] | None) -> str:
    """The paper's padded / FA2 / Triton img/s and Triton over padded."""
    if not rates:
        return "-"
    pad, fa2, tri = rates
    return f"{pad:,} / {fa2:,} / {tri:,} ({tri / pad:.2f}x)"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# --------------------------------------------------------------------------------------------------- kernel


def kernel_median(cell: dict, peer: str, clock: str) -> float | None:
    """Median of one clock (``wall``, ``events``, ``graph``) of one peer in one cell, in microseconds."""
    entry = cell["peers"].get(peer, {})
    spread = entry.get(f"{clock}_us") if entry.get("status") == "ok" else None
    return spread["median"] if spread else None


def kernel_cells_table(cells: list[dict], peers: list[str]) -> str:
    """Every cell, every peer: wall / events / graph medians in microseconds."""
    head = ["B", "pruned %", "T (max len)"] + [f"{p} wall / ev / graph" for p in peers]
    head += ["ours / FA2-aten (graph)", "ours / roofline (graph)", "roofline us"]
    body = []
    for cell in cells:
        row = [str(cell["batch"]), str(cell["pruned_pct"]), f"{cell['tokens']} ({cell['max_len']})"]
        for p in peers:
            status = cell["peers"].get(p, {}).get("status")
            if status == "ok":
                row.append(" / ".join(fmt_us(kernel_median(cell, p, c)) for c in ("wall", "events", "graph")))
            else:
                row.append({"failed": "FAILED", "unavailable": "n/a"}.get(status, "-"))
        ratios = cell["ratios"]
        row += [fmt_us(ratios["ours_over_fa2_aten_graph"], 2), fmt_us(ratios["ours_over_roofline_graph"], 2)]
        body.append([*row, fmt_us(cell["roofline_us"], 2)])
    return table(head, body)


def paper_table_i(cells: list[dict]) -> str:
    """The paper's Table I layout (ms, CUDA events, B = 32 and 64), this card's numbers next to the paper's."""
    by_key = {(c["batch"], c["pruned_pct"]): c for c in cells}
    head = [
        "BS", "Prune", "Tok/img (mean)", "SDPA padded", "varlen_attn", "FA2-aten", "Ours",
        "paper SDPA / FA2 varlen / Ours",
    ]  # fmt: skip
    body = []
    for (batch, pruned), paper in PAPER_TABLE_I.items():
        cell = by_key.get((batch, pruned))
        if cell is None:
            continue
        ms = [kernel_median(cell, p, "events") for p in ("padded_sdpa", "varlen_attn", "fa2_aten", "ours")]
        row = [str(batch), f"{pruned}%", f"{cell['mean_len']:.0f}"]
        row += [fmt_us(m / 1e3, 3) if m is not None else "-" for m in ms]
        body.append([*row, " / ".join(f"{x:.3f}" for x in paper)])
    return table(head, body) if body else "(no B=32/64 cells: run without --quick)"


def paper_table_ii(cells: list[dict]) -> str:
    """Table II at B=32: overhead = the floor (latency at 80% pruned) over the total, CUDA events."""
    by_pct = {c["pruned_pct"]: c for c in cells if c["batch"] == 32}
    if 80 not in by_pct:
        return "(no B=32, 80% cell: run without --quick)"
    peers = ("varlen_attn", "fa2_aten", "ours")
    head = ["Prune"] + [f"{p} total ms / overhead %" for p in peers] + ["paper FA2 / Triton overhead %"]
    floors = {p: kernel_median(by_pct[80], p, "events") for p in peers}
    body = []
    for pct in (0, 50, 80):
        if pct not in by_pct:
            continue
        row = [f"{pct}%"]
        for p in peers:
            total, floor = kernel_median(by_pct[pct], p, "events"), floors[p]
            overhead = None if total is None or floor is None else min(100.0, 100 * floor / total)
            row.append("-" if overhead is None else f"{total / 1e3:.3f} / {overhead:.0f}")
        body.append([*row, "{} / {}".format(*PAPER_TABLE_II[pct])])
    return table(head, body)


def kernel_section(kernel: dict) -> str:
    """Tables I and II (and every cell with its three clocks) from ``report_attention``'s JSON."""
    meta, cells = kernel["meta"], kernel["cells"]
    peers = list(meta.get("args", {}).get("peers") or sorted({p for c in cells for p in c["peers"]}))
    mode = "fixed" if meta.get("args", {}).get("fixed") else "ragged (+-15% around the target)"
    head = (
        f"- {meta.get('card')} (SM {meta.get('capability')}), torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"CUDA {meta.get('cuda')}, commit {meta.get('commit')}, {meta.get('date')}; per-image counts **{mode}**; "
        f"copy bandwidth {meta.get('copy_bandwidth_gbps', 0):.0f} GB/s"
    )
    return "\n\n".join(
        [
            head,
            "Table I layout (ms, CUDA events per call; the paper: RTX 4000 Ada, fixed counts, FA2 = flash_attn "
            "varlen wrapper):\n\n" + paper_table_i(cells),
            "Table II layout (B = 32; overhead % = latency at 80% pruned / total, CUDA events):\n\n"
            + paper_table_ii(cells),
            "<details><summary>Every cell, three clocks (us): wall / CUDA events / graph replay</summary>\n\n"
            + kernel_cells_table(cells, peers)
            + "\n\n</details>",
        ]
    )


# --------------------------------------------------------------------------------------------------- end to end


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


def img_s(row: dict | None) -> float | None:
    return row.get("img_per_s") if row and row.get("status") == "ok" else None


def median_us(row: dict | None, clock: str) -> float | None:
    spread = row.get(f"{clock}_us") if row and row.get("status") == "ok" else None
    return spread["median"] if spread else None


def index(rows: Iterable[dict]) -> dict[tuple, dict]:
    """``(model, workload, keep_rate, batch, row) -> row``; the unpruned rows under workload ``none``."""
    return {(r["model"], r["workload"], r["keep_rate"], r["batch"], r["row"]): r for r in rows}


def key_of(model: str, workload: str, keep: float, batch: int, row: str) -> tuple:
    """The index key of a row of a pruned table: the unpruned (``timm_*``) rows are the model's own."""
    return (model, "none", 1.0, batch, row) if row.startswith("timm_") else (model, workload, keep, batch, row)


def rate(idx: dict, model: str, workload: str, keep: float, batch: int, row: str) -> float | None:
    """img/s of ``row`` in a pruned table's cell (:func:`key_of`)."""
    return img_s(idx.get(key_of(model, workload, keep, batch, row)))


def best_ours(idx: dict, model: str, workload: str, keep: float, batch: int) -> float | None:
    """The fastest of our rows: Triton eager, Triton + graphs, Triton + graphs + compile (img/s)."""
    rates = [r for r in (rate(idx, model, workload, keep, batch, row) for row in OURS) if r]
    return max(rates) if rates else None


def unpruned(idx: dict, model: str, batch: int, row: str) -> float | None:
    return img_s(idx.get((model, "none", 1.0, batch, row)))


def ratio_of(idx: dict, name: str, model: str, workload: str, keep: float, batch: int) -> float | None:
    """The ratio column ``name`` of :data:`RATIOS` in one cell."""
    over, under = RATIOS[name]
    cell = (model, workload, keep, batch)
    top = best_ours(idx, *cell) if over == "ours" else rate(idx, *cell, over)
    return ratio(top, rate(idx, *cell, under))


def header(payload: dict) -> str:
    """Card, versions, commit and dtype of every run merged into ``payload``."""
    seen = []
    for m in payload.get("metas") or [payload["meta"]]:
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


def throughput_rows(payload: dict) -> tuple[list[dict], dict, list[dict]]:
    """A part's throughput rows, their index, and the pruned ones (unpruned rows have workload ``none``)."""
    rows = [r for r in payload["rows"] if r.get("kind", "throughput") == "throughput"]
    return rows, index(rows), [r for r in rows if r["workload"] != "none"]


def rates_body(
    idx: dict,
    grp: list[dict],
    models: Iterable[str],
    cols: list[str],
    ratios: Sequence[str],
    lead: Callable[[str, int], list[str]],
    paper: Callable[[str, int], tuple | None] | None = None,
) -> list[list[str]]:
    """One line per (model, batch) of ``grp`` (one workload and keep rate): the ``lead`` cells, img/s of every row
    in ``cols``, the :data:`RATIOS` columns ``ratios``, and the paper's img/s if ``paper`` is given."""
    workload, keep = grp[0]["workload"], grp[0]["keep_rate"]
    body = []
    for model in models:
        for b in sorted({r["batch"] for r in grp if r["model"] == model}):
            cells = [*lead(model, b), *[fmt_rate(idx.get(key_of(model, workload, keep, b, c))) for c in cols]]
            cells += [fmt_x(ratio_of(idx, name, model, workload, keep, b)) for name in ratios]
            body.append(cells if paper is None else [*cells, fmt_paper_rates(paper(model, b))])
    return body


def throughput_table(payload: dict) -> str:
    """Table III layout per (model, workload): img/s vs batch size for every row, the paper's ratios."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (model, workload, keep), grp in groups(pruned, "model", "workload", "keep_rate").items():
        cols = present_rows([r for r in rows if r["model"] == model and r["workload"] in (workload, "none")])
        head = ["B", *[ROW_SHORT[c] for c in cols], "T/Pad", "T/FA2", BEST]
        paper = None
        if model == "deit_base_patch16_224" and keep == 0.5:
            head.append("paper Pad / FA2 / T (T/Pad)")
            paper = lambda _, b: PAPER_TABLE_III.get(b)
        body = rates_body(idx, grp, [model], cols, ("T/Pad", "T/FA2", BEST), lambda _, b: [str(b)], paper)
        out.append(titled(f"{MODEL_SHORT.get(model, model)}, {workload_line(grp)}", head, body))
    return sections(out)


def models_table(payload: dict) -> str:
    """Table V layout: per model and batch size, img/s of every row, T/Pad, and the paper's row."""
    rows, idx, pruned = throughput_rows(payload)
    order = list(PAPER_TABLE_V)
    out = []
    for (workload, _), grp in groups(pruned, "workload", "keep_rate").items():
        models = sorted({r["model"] for r in grp}, key=lambda m: order.index(m) if m in order else 9)
        cols = present_rows([r for r in rows if r["workload"] in (workload, "none")])
        head = ["model", "B", *[ROW_SHORT[c] for c in cols], "T/Pad", BEST, "paper Pad / FA2 / T"]
        lead = lambda m, b: [MODEL_SHORT.get(m, m), str(b)]
        body = rates_body(idx, grp, models, cols, ("T/Pad", BEST), lead, lambda m, _: PAPER_TABLE_V.get(m))
        out.append(titled(workload_line(grp), head, body))
    return sections(out)


def resolution_table(payload: dict) -> str:
    """Section V-D: 224 vs 384 at each batch size: img/s, Triton over padded (fair and full), over reduce-overhead."""
    rows, idx, pruned = throughput_rows(payload)
    note = (
        "paper (RTX 4000 Ada, Threshold-L2 fixed ratio, padded = pad back to N): Triton / padded up to "
        f"{PAPER_SPEEDUP_OVER_PADDED[224]}x at 224 and {PAPER_SPEEDUP_OVER_PADDED[384]}x at 384; per-batch "
        "numbers of its Figure 3 were lost in extraction."
    )
    out = []
    for (workload, _), grp in groups(pruned, "workload", "keep_rate").items():
        cols = present_rows([r for r in rows if r["workload"] in (workload, "none")])
        head = ["resolution", "B", *[ROW_SHORT[c] for c in cols], "T/Pad", "T/Pad-full", BEST]
        models = sorted({r["model"] for r in grp}, key=lambda m: (m.endswith("384"), m))
        resolution = {r["model"]: str(r["resolution"]) for r in grp}
        ratios = ("T/Pad", "T/Pad-full", BEST)
        body = rates_body(idx, grp, models, cols, ratios, lambda m, b, res=resolution: [res[m], str(b)])
        out.append(titled(workload_line(grp), head, body) + "\n\n" + note)
    return sections(out)


def pruning_table(payload: dict) -> str:
    """Figure 1 as a table per workload: img/s vs pruned %, and each row's speedup over unpruned timm eager."""
    rows, idx, pruned = throughput_rows(payload)
    out = []
    for (model, workload, batch), grp in groups(pruned, "model", "workload", "batch").items():
        cols = present_rows(grp)
        vs_eager = [c for c in cols if c in ("padded", "triton", "triton_graphed")]
        eager, compiled = unpruned(idx, model, batch, "timm_eager"), unpruned(idx, model, batch, "timm_compiled")
        head = ["pruned %", "kind", *[ROW_SHORT[c] for c in cols], *[f"{ROW_SHORT[c]} / timm eager" for c in vs_eager]]
        body = []
        for keep in sorted({r["keep_rate"] for r in grp}, reverse=True):
            kind = next(r["workload_kind"] for r in grp if r["keep_rate"] == keep)
            cells = [str(round(100 * (1 - keep))), kind]
            cells += [fmt_rate(idx.get((model, workload, keep, batch, c))) for c in cols]
            cells += [fmt_x(ratio(img_s(idx.get((model, workload, keep, batch, c))), eager)) for c in vs_eager]
            body.append(cells)
        ref = f"unpruned timm at B={batch}: eager {eager:,.0f} img/s" if eager else "unpruned timm eager: -"
        ref += f", reduce-overhead {compiled:,.0f} img/s" if compiled else ", reduce-overhead: -"
        out.append(titled(f"{MODEL_SHORT.get(model, model)}, B={batch}, workload **{workload}**; {ref}", head, body))
    return sections(out)


def stages_table(payload: dict) -> str:
    """Table IV layout per (workload, batch): front / pack / late / head (CUDA events, ms, medians)."""
    rows = [r for r in payload["rows"] if r.get("kind") == "stages"]
    regions = ("front", "pack", "late", "head", "total")
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
            body.append([ROW_SHORT[name], *[fmt_ms(st[k]["median"]) for k in regions], fmt_ms(median_us(r, "wall"))])
        pad, tri = by_row.get("padded", {}).get("stages_us"), by_row.get("triton", {}).get("stages_us")
        if pad and tri:
            speedups = [fmt_x(ratio(pad[k]["median"], tri[k]["median"])) for k in regions]
            body.append(["speedup padded (fair) / Triton", *speedups, "-"])
        if model == "deit_base_patch16_224" and keep == 0.5:
            for name, vals in PAPER_TABLE_IV.items():
                body.append([f"paper: {ROW_SHORT[name]} (RTX 4000 Ada, B=8)", *[f"{v:.2f}" for v in vals], "-"])
            p, t = PAPER_TABLE_IV["padded"], PAPER_TABLE_IV["triton"]
            body.append(["paper: speedup", *[f"{a / b:.2f}x" for a, b in zip(p, t, strict=True)], "-"])
        out.append(titled(f"{MODEL_SHORT.get(model, model)}, B={batch}, {workload_line(grp)}", head, body))
    return sections(out)


def numerics_table(payload: dict) -> str:
    """Table VI: max / mean |logit diff| against the padded (fair) fp16 pipeline on the same decisions."""
    head = [
        "config", "kind", "Triton vs padded: max", "mean", "top-1 agree", "FA2 vs padded: max",
        "padded-full vs padded: max", "Triton vs fp32 ref: max", "padded vs fp32 ref: max", "paper max (vs padded)",
    ]  # fmt: skip
    body = []
    for k in payload.get("kernel_rows") or []:
        paper = PAPER_TABLE_VI_KERNEL.get(k["pruned_pct"]) if k["workload_kind"] == "fixed" else None
        body.append(
            [f"kernel, B={k['batch']}, {k['pruned_pct']}% pruned", k["workload_kind"]]
            + [fmt_err(k["max_vs_padded"]), fmt_err(k["mean_vs_padded"]), "-", "-", "-"]
            + [fmt_err(k["max_ours_vs_fp32"]), fmt_err(k["max_padded_vs_fp32"]), fmt_err(paper)]
        )
    for r in (r for r in payload["rows"] if r.get("kind") == "numerics"):
        vp, vf = r.get("vs_padded") or {}, r.get("vs_fp32") or {}
        tri = vp.get("triton", {})
        agree = f"{100 * tri['top1_agree']:.0f}%" if tri.get("top1_agree") is not None else "-"
        paper = PAPER_TABLE_VI_E2E.get(r["batch"]) if r["workload"] == "l2_ratio" else None
        body.append(
            [f"E2E {MODEL_SHORT.get(r['model'], r['model'])}, B={r['batch']}, {r['workload']}", r["workload_kind"]]
            + [fmt_err(tri.get("max")), fmt_err(tri.get("mean")), agree]
            + [fmt_err(vp.get(name, {}).get("max")) for name in ("fa2_varlen", "padded_full")]
            + [fmt_err(vf.get(name, {}).get("max")) for name in ("triton", "padded")]
            + [fmt_err(paper)]
        )
    return table(head, body) if body else "(no rows)"


def clocks_table(payload: dict) -> str:
    """Every row's three clocks: wall / CUDA events / graph replay medians (ms) with the wall IQR, and checks."""
    head = ["model", "workload", "B", "row", "wall ms [IQR]", "events ms", "graph ms", "n", "max diff / bound", "note"]
    body = []
    for r in payload["rows"]:
        wall = r.get("wall_us")
        iqr = f" [{wall['q1'] / 1e3:.2f}-{wall['q3'] / 1e3:.2f}]" if wall else ""
        check = r.get("check") or {}
        diff = "-"
        if check.get("max_abs_diff") is not None:
            diff = f"{fmt_err(check.get('max_abs_diff'))} / {fmt_err(check.get('bound'))}"
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
    return header(payload) + "\n\n" + RENDERERS[payload["part"]](payload)
