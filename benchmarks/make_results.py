"""Writes docs/results.md and docs/figures/*.png from the stored benchmark JSON: one command, no GPU.

    python -m benchmarks.make_results [--baselines benchmarks/baselines] [--out docs/results.md] [--figures DIR]

Reads every card directory of ``benchmarks/baselines/`` (its README says what is stored there): ``e2e/*.json``,
the parts ``report_e2e`` wrote (several files of one part are merged: a full run's row replaces a quick run's, a
later run's an earlier one's), ``attention.json``, the kernel benchmark ``report_attention`` wrote, and
``tome_peer.json``, token merging against its peer (``benchmarks.tome_peer``'s report and targets). Writes the
paper's tables beside ours (``benchmarks.tables``), the targets of ``docs/targets.md`` with their measured values,
and matplotlib figures (throughput vs batch size, speedup vs pruning ratio, 224 vs 384). The output depends only on
the JSON: sorted inputs, fixed number formats, PNGs without timestamps, so regenerating it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import BASELINES, REPO_ROOT, default_call, tome_peer
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
DEFAULT_CALL_FILE = "default_call.json"  # python -m benchmarks.default_call's output, in the card's directory
DEFAULT_CALL_TITLE = "The default call (`prune(model)(images)`) against unpruned timm `reduce-overhead`"
# ToMe's targets (docs/targets.md), fixed r = 13 on DeiT-B: ours over unpruned timm reduce-overhead and over the peer's
# best mode per batch size, and the adaptive mode over fixed r
TOME_TARGETS = {"vs_timm": ((1, 1.2), (4, 1.3), (64, 1.5)), "vs_peer": ((1, 1.7), (4, 1.7), (64, 1.6)),
                "adaptive": ((64, 0.95),)}  # fmt: skip


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


def load_tome(card_dir: Path) -> dict | None:
    """The card's stored ``benchmarks.tome_peer`` run (None if absent)."""
    path = card_dir / TOME_FILE
    return json.loads(path.read_text()) if path.exists() else None


def card_dirs(baselines: Path) -> list[Path]:
    """Card directories holding e2e parts, a kernel benchmark or a ToMe run, sorted by name."""
    if not baselines.is_dir():
        return []
    stored = ("attention.json", TOME_FILE, DEFAULT_CALL_FILE)
    return sorted(
        d for d in baselines.iterdir() if d.is_dir() and ((d / "e2e").is_dir() or any((d / f).exists() for f in stored))
    )


# --------------------------------------------------------------------------------------------------- targets


def _fmt_list(values: list[tuple[str, float | None]]) -> str:
    shown = [f"{name} {v:.2f}x" for name, v in values if v is not None]
    return ", ".join(shown) if shown else "-"


def _verdict(values: list[float | None], threshold: float) -> str:
    have = [v for v in values if v is not None]
    if not have:
        return "not measured"
    return "met" if min(have) >= threshold else "**missed**"


def _worst(values: list[float], limit: float, shown: str) -> tuple[str, str]:
    """``(measured, verdict)`` of a ceiling every value must stay under."""
    if not values:
        return "-", "not measured"
    return shown.format(max(values), len(values)), "met" if max(values) <= limit else "**missed**"


def targets_section(parts: dict[str, dict], kernel: dict | None, tome: dict | None = None) -> str:
    """The targets of docs/targets.md with this card's numbers (ours: the fastest of our rows; ToMe's from its
    stored run, by its targets' clock: each forward alone)."""
    lines: list[list[str]] = []

    def add(target: str, values: list[tuple[str, float | None]], need: float) -> None:
        """One row: every measured value must reach ``need`` for the target to be met."""
        verdict = _verdict([v for _, v in values], need)
        partial = [name for name, v in values if v is not None and v >= need]
        if verdict != "met" and partial:  # say which workloads reach the bar when not all do
            verdict += f" (met by {', '.join(partial)})"
        lines.append([target, _fmt_list(values), verdict])

    t3 = parts.get("table3")
    idx3 = T.index(t3["rows"]) if t3 else {}
    ragged = [w for w in ("l2_calibrated", "ats", "synthetic") if any(k[1] == w for k in idx3)]

    def rate(w: str, b: int, *rows: str) -> float | None:
        """The fastest of ``rows`` at 50% pruning (a ``timm_*`` row: the unpruned model's)."""
        rates = [r for r in (T.rate(idx3, DEIT_B, w, 0.5, b, row) for row in rows) if r]
        return max(rates) if rates else None

    def ours_over(b: int, *rows: str) -> list[tuple[str, float | None]]:
        return [(w, T.ratio(T.best_ours(idx3, DEIT_B, w, 0.5, b), rate(w, b, *rows))) for w in ragged]

    for b, need in ((1, 1.0), (4, 1.3), (64, 1.45)):
        add(f"50% ragged vs unpruned timm reduce-overhead, B={b}: >= {need}x", ours_over(b, "timm_compiled"), need)
    for b, need in ((1, 1.0), (4, 1.3), (64, 1.45)):
        values = ours_over(b, "timm_compiled_gemm")
        if any(v is not None for _, v in values):
            target = "(pruning's own share) the same, against timm reduce-overhead with our GEMM patch embedding"
            add(f"{target}, B={b}", values, need)
    for b, need in ((1, 4.0), (4, 4.0), (64, 2.5)):
        add(f"vs padded (fair) SDPA eager, B={b}: >= {need}x", ours_over(b, "padded"), need)
    for b in (1, 4):
        measured = any(idx3.get((DEIT_B, w, 0.5, b, "public_compiled")) for w in ragged)
        under_ro = "public APIs under reduce-overhead included" if measured else "under reduce-overhead: not measured"
        target = f"vs best public-API pipeline measured (padded, padded-full, NestedTensor eager; {under_ro})"
        add(f"{target}, B={b}: >= 3x", ours_over(b, "padded", "padded_full", "nested_sdpa", "public_compiled"), 3.0)
    for b, need in ((1, 1.0), (4, 1.0), (64, 1.1)):
        values = []
        for w in ragged:
            values.append((f"{w} graphed", T.ratio(rate(w, b, "triton_graphed"), rate(w, b, "fa2_varlen_graphed"))))
            values.append((f"{w} eager", T.ratio(rate(w, b, "triton"), rate(w, b, "fa2_varlen"))))
        add(f"Triton vs FA2-aten, same pipeline (graphed where measured), B={b}: >= {need}x", values, need)
    if f1 := parts.get("fig1"):
        idx1 = T.index(f1["rows"])
        speedups = [
            T.ratio(T.best_ours(idx1, DEIT_B, w, 0.1, 64), T.best_ours(idx1, DEIT_B, w, 1.0, 64))
            for w in ("l2_ratio", "synthetic")
        ]
        add("90% vs 0% pruning at B=64 (ours): >= 3x", list(zip(("l2_ratio", "synthetic"), speedups, strict=True)), 3.0)
    if r384 := parts.get("res384"):
        idx, m = T.index(r384["rows"]), "deit_base_patch16_384"
        values = [
            (w, T.ratio(T.best_ours(idx, m, w, 0.5, 1), T.rate(idx, m, w, 0.5, 1, "padded")))
            for w in ("synthetic", "l2_ratio")
        ]
        target = "384x384 at B=1, ours vs padded (fair): >= 3x (ragged)"
        lines.append([target, _fmt_list(values), _verdict([values[0][1]], 3.0)])
    if t6 := parts.get("table6"):
        tri = [r["vs_padded"].get("triton", {}) for r in t6["rows"] if r.get("vs_padded")]
        worst = max((d["max"] for d in tri if "max" in d), default=None)
        agree = min((d["top1_agree"] for d in tri if "top1_agree" in d), default=None)
        measured = f"max {worst:.2e}, top-1 agreement {100 * agree:.1f}%" if worst is not None else "-"
        margins = [m for d in tri for m in d.get("disagree_ref_margins", [])]
        if margins:  # random weights: say whether the flips are near-ties of the reference itself
            measured += f" (flipped images: the padded reference's own top-1/top-2 margin <= {max(margins):.1e})"
        met = worst is not None and worst <= 0.004 and agree == 1.0
        verdict = "met" if met else ("not measured" if worst is None else "**missed**")
        lines.append(["numerics vs padded fp16 pipeline: max abs logit diff <= 0.004, 100% top-1", measured, verdict])
    if tome and tome["meta"].get("model") == DEIT_B and tome["meta"].get("r") == 13:
        labels = {"vs_timm": "ToMe r = 13 vs unpruned timm reduce-overhead", "vs_peer": "ToMe r = 13 vs the ToMe "
                  "peer's best mode", "adaptive": "adaptive ToMe (r = 13's mean rows) vs fixed r"}  # fmt: skip
        for key, cells in TOME_TARGETS.items():
            for b, need in cells:
                up = tome_peer.speedups(tome["rows"], b)
                name = tome_peer.ADAPTIVE_NAMES[up.adaptive_row] if key == "adaptive" and up.adaptive_row else "ours"
                add(f"{labels[key]}, B={b}: >= {need}x", [(name, getattr(up, key))], need)
    if kernel:
        cells = kernel["cells"]
        fa2 = [v for c in cells if (v := c["ratios"].get("ours_over_fa2_aten_graph")) is not None]
        roof = [v for c in cells if c["batch"] >= 64 and (v := c["ratios"].get("ours_over_roofline_graph")) is not None]
        lines.append(
            [
                "attention device time (graph) <= 0.6x FA2-aten in every cell",
                *_worst(fa2, 0.6, "worst {:.2f}x over {} cells"),
            ]
        )
        lines.append(["attention device time <= 1.5x memory roofline at B >= 64", *_worst(roof, 1.5, "worst {:.2f}x")])
    return T.table(["target (docs/targets.md)", "measured", "verdict"], lines)


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
`python -m benchmarks.report_attention` (kernel); the paper's numbers (RTX 4000 Ada, SM89) stand beside ours.

**Method.** fp16, `torch.no_grad`, images already on the GPU, three input batches rotated; after a warm-up each
forward is timed alone (synchronize, host clock and CUDA events around it); medians (the JSON keeps quartiles,
min/max and counts). Throughput = batch size / median wall time per forward. Where a pipeline has no host
synchronisation its device-only time under CUDA-graph replay is in the clocks table too. One torch thread.
Every pipeline is checked against the fp32 reference pipeline on the same pruning decisions before it is timed
(max |logit diff| <= 2x its dtype's own error + 16 eps); a failing pipeline is listed as FAILED, not timed.
Weights are random (seeded) unless a run says otherwise: speed does not depend on them, top-1 agreement does.

**Rows.** *timm eager* / *timm reduce-overhead*: the UNPRUNED timm model, eager and under
`torch.compile(mode="reduce-overhead")` (compiled once per batch size; compile time in the clocks table) -- what a
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


def card_section(
    card_dir: Path, parts: dict[str, dict], kernel: dict | None, figures: Path, doc_dir: Path, tome: dict | None = None
) -> str:
    slug = card_dir.name
    metas = [p["meta"] for p in parts.values()] + [x["meta"] for x in (kernel, tome) if x]
    card = next((m.get("card") for m in metas if m.get("card")), None)
    out = [f"## {card or slug} (`benchmarks/baselines/{slug}/`)",
           "### Targets\n\n" + targets_section(parts, kernel, tome)]  # fmt: skip
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
        if part != "table6":
            body.append(
                "<details><summary>Clocks of every row: wall / CUDA events / graph replay (ms), checks</summary>\n\n"
                + T.clocks_table(payload)
                + "\n\n</details>"
            )
        out.append("\n\n".join(body))
    call_path = card_dir / DEFAULT_CALL_FILE
    if call_path.exists():
        out.append(f"### {DEFAULT_CALL_TITLE}\n\n" + default_call.render(json.loads(call_path.read_text())))
    else:
        out.append(f"### {DEFAULT_CALL_TITLE}\n\n(not measured on this card: `python -m benchmarks.default_call`)")
    if tome is None:
        out.append(f"### {TOME_TITLE}\n\n(not measured on this card: `python -m benchmarks.tome_peer`)")
    else:
        m = tome["meta"]
        title = f"{TOME_TITLE} ({m.get('model')}, r = {m.get('r')})"
        out.append("\n\n".join([f"### {title}", T.header(tome), TOME_METHOD, tome_peer.render(tome)]))
    return "\n\n".join(out)


def build(baselines: Path, out: Path, figures: Path) -> str:
    """Renders the document (and writes the figures); returns the markdown."""
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.make_results", description=__doc__.split("\n")[0])
    parser.add_argument("--baselines", type=Path, default=BASELINES)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "results.md")
    parser.add_argument("--figures", type=Path, default=None, help="default: figures/ beside --out")
    args = parser.parse_args(argv)
    figures = args.figures or args.out.parent / "figures"
    text = build(args.baselines, args.out, figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines) and figures under {figures}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
