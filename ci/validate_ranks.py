"""One rank against N under torchrun, on a generated JPEG folder (GPU machine): ``python -m ci.validate_ranks``.

Writes ``--images`` synthetic JPEGs (the benchmarks' seeded images, 224-320 px, ``--classes`` class folders) under
``--data``, then runs ``ragged-vit validate`` on DeiT-B (random weights, ``num_classes`` = the folder count, so top-1
is not trivially zero) with ``--compare-unpruned``: once as one process and once under ``torchrun --nproc-per-node
N``, for each mode (eager; ``--graphs --compile-blocks``). Checks that the counts (top-1, top-5, agreement, kept
patches per stage, images) are identical between 1 and N ranks, and prints model-only and end-to-end img/s per run.
Exits 1 on any difference. Results (the validate JSON files and a summary) go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from PIL import Image

from benchmarks.workloads import synthetic_images

MODES = {"eager": [], "graphs+compile": ["--graphs", "--compile-blocks"]}
COUNTED = ("pruned", "unpruned", "agreement", "kept_patches")  # what must be identical across rank counts


def _write_image(args: tuple[Path, int]) -> None:
    """One benchmark image (:func:`benchmarks.workloads.synthetic_images`), cropped to a random 224-320 px size."""
    path, seed = args
    torch.set_num_threads(1)  # one process per core already
    h, w = (int(v) for v in torch.randint(224, 321, (2,), generator=torch.Generator().manual_seed(seed)))
    img = synthetic_images(1, max(h, w), seed)[0, :, :h, :w]
    pixels = (img * 0.25 + 0.5).clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(path, quality=90)


def make_folder(root: Path, images: int, classes: int) -> None:
    """``images`` JPEGs spread over ``classes`` folders (skipped when the folder already holds them)."""
    if root.exists() and sum(1 for _ in root.glob("*/*.jpg")) == images:
        return
    jobs = []
    for i in range(images):
        folder = root / f"class_{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((folder / f"{i:06d}.jpg", i))
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_image, jobs, chunksize=64))


def run_validate(data: Path, ranks: int, mode: str, out: Path, extra: list[str]) -> dict:
    result_json = out / f"validate-{mode.replace('+', '_')}-{ranks}rank.json"
    argv = [str(data), "--model", extra[0], "--model-arg", f"num_classes={extra[1]}",
            "--pruner", "threshold_l2", "--keep-rate", "0.5", "--compare-unpruned", "--batch-size", "64",
            "--results-json", str(result_json), *MODES[mode], *extra[2:]]  # fmt: skip
    if ranks == 1:
        cmd = [sys.executable, "-m", "ragged_vit.validate", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "ragged_vit.validate", *argv]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"})
    (out / f"{result_json.stem}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result_json.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.validate_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/synth_val"))
    parser.add_argument("--images", type=int, default=12_000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="deit_base_patch16_224")
    parser.add_argument("--workers", type=int, default=8, help="data loader workers per rank")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    parser.add_argument("--out", type=Path, default=Path("validate_ranks"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    make_folder(args.data, args.images, args.classes)
    extra = [args.model, str(args.classes), "--workers", str(args.workers)]
    summary, ok = [], True
    print("| mode | ranks | pruned top-1 | agreement | model img/s | unpruned model img/s | end-to-end img/s "
          "| data wait share | counts identical |\n|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        one = run_validate(args.data, 1, mode, args.out, extra)
        many = run_validate(args.data, args.ranks, mode, args.out, extra)
        same = {key: one[key] == many[key] for key in COUNTED}
        ok &= all(same.values())
        for ranks, res in ((1, one), (args.ranks, many)):
            total = res["throughput"]["total"]
            summary.append({"mode": mode, "ranks": ranks, "pruned": res["pruned"], "agreement": res["agreement"],
                            "kept_patches": res["kept_patches"], "throughput": res["throughput"],
                            "identical_to_1_rank": same})  # fmt: skip
            print(f"| {mode} | {ranks} | {res['pruned']['top1_correct']}/{res['pruned']['images']} "
                  f"| {res['agreement']['top1_agree']} | {total['img_per_s_model']:,.0f} "
                  f"| {total['unpruned_img_per_s_model']:,.0f} "
                  f"| {total['img_per_s_end_to_end']:,.0f} | {total['data_wait_share']:.2f} "
                  f"| {all(same.values())} |", flush=True)  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("1 rank and", args.ranks, "ranks count the same" if ok else "ranks DIFFER", "(details:", args.out, ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
