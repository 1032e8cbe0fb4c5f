"""Native-resolution batches: timm's NaFlexVit (padded and masked) against ours (packed ragged), images of many sizes.

    python -m benchmarks.naflex --out naflex.json                  # on a GPU: ViT-B/16 NaFlex, B = 1, 8, 64, fp16
    python -m benchmarks.naflex --smoke --out smoke.json           # any machine: a tiny model on the CPU, quickly

Images: 64 with a fixed seed (``--seed``), the longer side drawn uniformly from 128-512 px and the aspect ratio
log-uniformly from 1:3 to 3:1, both sides rounded to multiples of 16; a batch of B is the first B of them. Random
weights (``pretrained=False``: nothing is downloaded). Rows, each checked then timed:

* ``timm_eager``: ``model(patch_dict)``, the padded dict timm's NaFlex collator makes (made before timing: the
  collator's work is not timed), attention masked;
* ``timm_compiled:<mode>``: the same under ``torch.compile(model, mode=<mode>)`` for each of ``--compile-modes``
  (a failure is recorded, not raised); the best of them is timm's best mode;
* ``ours``: ``ragged_vit.prune(model, "none")``, the default call, on the list of images (its patchify is timed);
* ``ours_threshold_l2``: ``ragged_vit.prune(model, "threshold_l2", 0.5)`` on the list;
* ``ours_compile_blocks``: ``ours`` with ``compile_blocks=True`` (a native batch runs eagerly: its blocks compiled,
  dynamic shapes from the second size on), whether compiled blocks should be a native batch's default.

Clocks: :func:`benchmarks.timing.forward_times` (each forward synchronised, and back to back). The unpruned rows'
logits are compared with timm's eager ones (``max_abs_diff``). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from pathlib import Path

import timm
import torch

import ragged_vit
from benchmarks.timing import describe, elapsed, environment, forward_times

MODEL = "naflexvit_base_patch16_siglip"
SMOKE = dict(embed_dim=64, depth=2, num_heads=2, pos_embed_grid_size=(4, 4))  # the --smoke model's overrides
PATCH = 16


def image_sizes(count: int, seed: int, longest: tuple[int, int] = (128, 512)) -> list[tuple[int, int]]:
    """``count`` sizes ``(H, W)``: the longer side uniform in ``longest``, the aspect log-uniform in 1:3 to 3:1,
    both sides rounded to multiples of :data:`PATCH` (at least one patch)."""
    g = torch.Generator().manual_seed(seed)
    sizes = []
    for _ in range(count):
        side = longest[0] + (longest[1] - longest[0]) * torch.rand((), generator=g).item()
        aspect = math.exp((2 * torch.rand((), generator=g).item() - 1) * math.log(3.0))
        height, width = (side / aspect, side) if aspect >= 1 else (side, side * aspect)
        sizes.append(tuple(max(PATCH, round(v / PATCH) * PATCH) for v in (height, width)))
    return sizes


def patch_dict(images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's padded NaFlex input: each image's patches (timm's patchify), (y, x) coordinates and validity."""
    from timm.models.naflexvit import batch_patchify

    rows, coords = [], []
    for image in images:
        flat, (h, w) = batch_patchify(image[None], (PATCH, PATCH))
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(flat[0])
        coords.append(torch.stack([ys.flatten(), xs.flatten()], 1).to(image.device))
    length, device = max(r.shape[0] for r in rows), images[0].device
    patches = rows[0].new_zeros(len(images), length, rows[0].shape[1])
    coord = torch.zeros(len(images), length, 2, dtype=torch.long, device=device)
    valid = torch.zeros(len(images), length, dtype=torch.bool, device=device)
    for i, (r, c) in enumerate(zip(rows, coords, strict=True)):
        patches[i, : len(r)], coord[i, : len(r)], valid[i, : len(r)] = r, c, True
    return dict(patches=patches, patch_coord=coord, patch_valid=valid)


def timed(forward, device: torch.device, smoke: bool) -> dict[str, object]:
    """The first call's seconds, then both clocks of :func:`forward_times` (one forward each in ``smoke``)."""
    out = []
    seconds = elapsed([lambda: out.append(forward())], device)
    first = out[0].clone()  # before the next call: a reduce-overhead graph's output is overwritten by its replays
    limits = dict(warmup=1, target_s=0.0, min_iters=1, max_iters=1) if smoke else dict(target_s=0.5, max_iters=80)
    times = forward_times([forward], device, back_to_back=True, **limits)
    return {"first_call_s": round(seconds, 3), "each_us": times.wall.median, "each_q1": times.wall.q1,
            "each_q3": times.wall.q3, "back_to_back_us": times.back_to_back, "iters": times.iters,
            "logits": first}  # fmt: skip


def rows_at(model, images: list[torch.Tensor], args, device: torch.device) -> list[dict[str, object]]:
    """Every row at one batch (:data:`images`), each checked against timm's eager logits."""
    batch, backend = len(images), "reference" if args.smoke else "triton"
    inputs = patch_dict(images)
    peers = {"timm_eager": functools.partial(model, inputs)}
    for mode in [] if args.smoke else args.compile_modes.split(","):
        torch._dynamo.reset()
        peers[f"timm_compiled:{mode}"] = functools.partial(torch.compile(model, mode=mode), inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default call says once that a native batch runs eagerly
        peers["ours"] = functools.partial(ragged_vit.prune(model, "none", backend=backend), images)
        if not args.smoke:  # (Inductor on the CPU would time the compiler, not the runtime)
            compiled = ragged_vit.prune(model, "none", backend=backend)
            compiled.compile_blocks = True
            peers["ours_compile_blocks"] = functools.partial(compiled, images)
        pruned = ragged_vit.prune(model, "threshold_l2", 0.5, backend)
        peers["ours_threshold_l2"] = functools.partial(pruned, images)
    rows, reference = [], None
    for row, forward in peers.items():
        entry: dict[str, object] = {"row": row, "batch": batch}
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = timed(forward, device, args.smoke)
        except Exception as exc:  # a peer that cannot run here (a compile mode) is recorded, not raised
            rows.append({**entry, "status": f"failed: {describe(exc)}"})
            continue
        logits = result.pop("logits").float()
        reference = logits if reference is None else reference
        if row != "ours_threshold_l2":
            entry["max_abs_diff"] = (logits - reference).abs().max().item()
        entry["img_per_s"] = batch / result["each_us"] * 1e6
        entry["img_per_s_back_to_back"] = batch / result["back_to_back_us"] * 1e6
        rows.append({**entry, **result, "status": "ok"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.naflex", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL, help="a timm NaFlexVit name (random weights)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-modes", default="default,reduce-overhead,max-autotune-no-cudagraphs")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, fp32, one timed forward")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        print(f"benchmarks.naflex: --batches must be positive integers, got {args.batches!r}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.naflex needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.float16
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(args.seed)
    options = SMOKE if args.smoke else {}
    model = timm.create_model(args.model, pretrained=False, **options).eval().to(device, dtype)
    sizes = image_sizes(max(batches), args.seed, (32, 64) if args.smoke else (128, 512))
    g = torch.Generator().manual_seed(args.seed)
    images = [torch.randn(3, h, w, generator=g).to(device, dtype) for h, w in sizes]
    table = []
    for batch in batches:  # each batch's rows are written and printed when done: a run cut short keeps them
        done = rows_at(model, images[:batch], args, device)
        table += done
        payload = {"environment": environment(), "argv": sys.argv[1:] if argv is None else argv, "model": args.model,
                   "seed": args.seed, "smoke": args.smoke, "dtype": str(dtype).removeprefix("torch."), "sizes": sizes,
                   "rows": table}  # fmt: skip
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        for entry in done:
            rate, head = entry.get("img_per_s"), f"B={entry['batch']:<3} {entry['row']:<44} "
            if rate is None:
                print(head + entry["status"], flush=True)
            else:
                rates = f"{rate:10.1f} img/s each, {entry['img_per_s_back_to_back']:10.1f} back to back"
                print(head + rates, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
