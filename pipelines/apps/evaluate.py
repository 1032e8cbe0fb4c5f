"""``validate``'s run: build the pipeline, run it over this rank's shard of the image folder, count, report.

**Throughput.** Model only: images over the summed time of the synchronised forwards (pruned, and unpruned on its own);
end to end: images over the wall time of the loop (data loading, host-to-device copies, every forward and the counting;
the untimed warm-up forwards excluded: on the first batch, and on as many of its images as the shard's last batch holds,
so that no kernel compilation or graph capture for that shape is timed).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from .arguments import ERRORS
from .distributed import Distributed
from .folder import DataError, ImageFolderDataset, ImageFolderIndex, Skipped, scan_image_folder, shard_range
from .images import eval_transform
from .options import Setup, ValidateOptions
from .report import append_csv, collect_results, csv_row, report_lines
from .tally import Tally


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_classes(index: ImageFolderIndex, outputs: int, mapped: bool) -> list[str]:
    """Errors for more classes than the model has outputs; notes for ImageNet synset folders taken by sorted name
    where the model has ImageNet's 1000 outputs but the folders are fewer (their indices would not be ImageNet's)."""
    if outputs <= 0:
        raise ValueError("the model has no classifier head (num_classes=0): nothing to validate")
    if len(index.classes) > outputs:
        source = f"class map {index.class_map}" if mapped else f"data folder {index.root}"
        raise DataError(
            f"{source} has {len(index.classes)} classes but the model has {outputs} outputs "
            f"(a model trained on them: --model-arg num_classes={len(index.classes)} with its --checkpoint)"
        )
    notes = []
    if not mapped and outputs == 1000 and len(index.classes) < 1000:
        from timm.data import ImageNetInfo

        synsets = set(ImageNetInfo().label_names())
        if all(name in synsets for name in index.classes):
            notes.append(
                f"the {len(index.classes)} class folders are ImageNet synsets, not all 1000: numbered by sorted name "
                "they are not ImageNet's indices; pass --class-map with the 1000 synsets in ImageNet order"
            )
    return notes


def _calibration_batch(dataset: ImageFolderDataset, count: int, skip_bad: bool) -> torch.Tensor:
    """``count`` images spread evenly over the sorted samples (the same on every rank) for a calibrated pruner."""
    n = len(dataset)
    picks = sorted({i * n // count for i in range(count)})
    images = []
    for i in picks:
        image, _, _, error = dataset[i]
        if error:
            if not skip_bad:
                raise DataError(f"bad image {dataset.samples[i][0]}: {error} (--skip-bad skips such files)")
            continue
        images.append(image)
    if not images:
        raise DataError("no readable image to calibrate the threshold on")
    return torch.stack(images)


@dataclass
class _RankTimes:
    images: int = 0
    model_s: float = 0.0
    unpruned_s: float = 0.0
    wall_s: float = 0.0
    wait_s: float = 0.0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.images, self.model_s, self.unpruned_s, self.wall_s, self.wait_s], dtype=torch.float64)


def _fingerprint(index: ImageFolderIndex) -> tuple[int, int]:
    """Sample count and a CRC of the classes and of every sample's path below the root and class: equal on every
    rank when every node sees the same data."""
    crc = zlib.crc32("\n".join(index.classes).encode())
    for path, target in index.samples:
        crc = zlib.crc32(f"{os.path.relpath(path, index.root)}\t{target}\n".encode(), crc)
    return len(index.samples), crc


def _prepare(options: ValidateOptions) -> Setup:
    """Scans the data, builds the model, pruner and pipeline (checkpoint loaded, moved, calibrated)."""
    from ..factory import build_pruner
    from ..model import PrunedViT
    from ..weights import create_model, load_checkpoint

    device, dtype = options.device, options.dtype
    index = scan_image_folder(options.data_dir, options.class_map, options.skip_bad)
    with torch.random.fork_rng():
        torch.manual_seed(options.seed)  # random weights: the same on every rank
        model = create_model(options.model, **options.model_kwargs)
        pruner = build_pruner(options.pruner, model, options.keep_rate, **options.pruner_options)
    outputs = int(getattr(model, "num_classes", 0) or 0)
    notes = index.notes + _check_classes(index, outputs, options.class_map is not None)
    if options.checkpoint is not None:
        load_checkpoint(model, pruner, options.checkpoint, strip_prefix=options.strip_prefix)
        weights = f"checkpoint {options.checkpoint}"
    else:
        weights = f"random (seed {options.seed})"
    pv = PrunedViT(model, pruner, options.backend).to(device=device, dtype=dtype)
    pv.backend.check(device, dtype)
    transform, data_config = eval_transform(model)
    dataset = ImageFolderDataset(index, transform, data_config["input_size"])
    if pruner is not None and getattr(pruner, "mode", None) == "calibrated":
        calibration = _calibration_batch(dataset, min(options.batch_size, len(dataset)), options.skip_bad)
        threshold = pv.calibrate(calibration.to(device))
        notes.append(f"threshold calibrated on {calibration.shape[0]} images spread over the data: {threshold:.4g}")
    pv.compile_blocks = options.compile_blocks
    return Setup(index, pv, dataset, data_config, notes, weights, _fingerprint(index))


def _agree(group: Distributed, error: Exception | None, fingerprint: tuple[int, int] | None, root: str) -> None:
    """Raises on every rank if any rank failed its setup (no rank is left waiting in a collective) or the ranks see
    different sample lists (a node with other data)."""
    if not group.started:
        if error is not None:
            raise error
        return
    message = None if error is None else " ".join(str(error).split())
    reports = group.all_gather_objects((message, fingerprint))
    if error is not None:
        raise error
    for rank, (other, _) in enumerate(reports):
        if other is not None:
            raise DataError(f"rank {rank}: {other}")
    seen = [fp for _, fp in reports]
    if len(set(seen)) > 1:
        rank = next(r for r, fp in enumerate(seen) if fp != seen[0])
        raise DataError(
            f"rank {rank} sees other samples under {root} than rank 0 ({seen[rank][0]} vs {seen[0][0]} images, or "
            "other names): every node needs the same data at that path"
        )


def validate(options: ValidateOptions, group: Distributed | None = None, out: TextIO | None = None) -> dict:
    """Runs the validation of ``options`` on this rank's shard and returns the results (:mod:`.report`) after
    the all-reduce, the same on every rank. Only rank 0 prints (to ``out``, stdout by default).

    Raises:
        FileNotFoundError, DataError, ValueError, TypeError: unusable data, model, checkpoint or options (the
            message names the file or option), on every rank when one rank has them. A file that cannot be decoded
            raises on every rank once all ranks have finished their shards, unless ``options.skip_bad``.
    """
    from ..graphs import GraphedPrunedViT
    from .demo import describe_pruner, progress_bar

    group = group or Distributed()
    out = out or sys.stdout
    lead = group.rank == 0

    def say(line: str = "") -> None:
        if lead:
            print(line, file=out, flush=True)

    try:
        setup, error = _prepare(options), None
    except ERRORS as e:
        setup, error = None, e
    _agree(group, error, None if setup is None else setup.fingerprint, options.data_dir)
    index, pv, dataset, data_config = setup.index, setup.pv, setup.dataset, setup.data_config
    notes, weights, model = setup.notes, setup.weights, setup.pv.model
    device, dtype = options.device, options.dtype
    skipped: list[Skipped] = list(index.skipped)
    forward = GraphedPrunedViT(pv).run if options.graphs else pv.run
    unpruned = model if options.compare_unpruned else None
    mode = " + ".join(
        name for name, on in (("CUDA graphs", options.graphs), ("compiled blocks", options.compile_blocks)) if on
    ) or "eager"

    shard = shard_range(len(dataset), options.batch_size, group.world_size, group.rank)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, shard),
        batch_size=options.batch_size,
        shuffle=False,
        num_workers=options.workers,
        pin_memory=device.type == "cuda",
        drop_last=False,
    )
    params = sum(p.numel() for p in model.parameters()) / 1e6
    kwargs = f" ({', '.join(f'{k}={v!r}' for k, v in options.model_kwargs.items())})" if options.model_kwargs else ""
    say(f"ragged-vit validate: {options.model}{kwargs}, {params:.1f}M parameters, weights: {weights}")
    if options.checkpoint is None:
        say("RANDOM WEIGHTS (no --checkpoint): accuracy is chance level; agreement, kept tokens and speed are not")
    say(f"pruner: {describe_pruner(pv, options)}")
    classes = f"class map {index.class_map}" if index.class_map else "sorted folder names"
    say(
        f"data: {index.root}: {len(dataset)} images in {len(index.classes)} classes ({classes}); "
        f"{data_config['input_size'][1]}x{data_config['input_size'][2]}, crop_pct {data_config.get('crop_pct')}, "
        f"{data_config.get('interpolation')}"
    )
    ranks = f"{group.world_size} ranks (torch.distributed, {group.backend})" if group.active else "1 process"
    workers = f"{options.workers} loader worker{'s' if options.workers != 1 else ''} per rank"
    say(f"device: {device} ({str(dtype).removeprefix('torch.')}), backend {pv.backend.name}, {mode}; "
        f"batch {options.batch_size}, {workers}; {ranks}")  # fmt: skip
    for note in notes:
        say(f"note: {note}")

    tally = Tally(pv.num_stages)
    times = _RankTimes()
    bad: list[tuple[int, str]] = []  # (sample index, reason) of undecodable files
    warm_s, first = 0.0, True
    desc = f"validate (rank 0 of {group.world_size})" if group.active else "validate"
    bar = progress_bar(lead, total=len(shard), desc=desc, unit="img", leave=False)
    with torch.no_grad(), bar:  # no_grad: graphs and compile as benchmarked
        start = time.perf_counter()
        batches = iter(loader)
        while True:
            waited = time.perf_counter()
            try:
                images, targets, indices, errors = next(batches)
            except StopIteration:
                break
            times.wait_s += time.perf_counter() - waited
            good = [i for i, error in enumerate(errors) if not error]
            if len(good) < len(errors):
                bad.extend((int(indices[i]), errors[i]) for i, error in enumerate(errors) if error)
                if not options.skip_bad:
                    break  # the other ranks finish their shards; then every rank raises (no collective left hanging)
                if not good:
                    continue
                images, targets = images[good], targets[good]
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if first:  # the warm-up also sees the shard's last, shorter batch: no compile or capture is timed
                first = False
                warm = time.perf_counter()
                tail = len(shard) % options.batch_size
                for batch in (images, images[:tail]) if 0 < tail < images.shape[0] else (images,):
                    for _ in range(options.warmup):
                        forward(batch)
                        if unpruned is not None:
                            unpruned(batch.to(dtype))
                _sync(device)
                warm_s += time.perf_counter() - warm
            _sync(device)
            tick = time.perf_counter()
            result = forward(images)
            _sync(device)
            times.model_s += time.perf_counter() - tick
            reference = None
            if unpruned is not None:
                tick = time.perf_counter()
                reference = unpruned(images.to(dtype))
                _sync(device)
                times.unpruned_s += time.perf_counter() - tick
            tally.add(result.logits, targets, result.counts, reference)
            times.images += images.shape[0]
            bar.update(images.shape[0])
            bar.set_postfix_str(f"top-1 {100 * tally.count('top1') / max(1, tally.count('images')):.2f}%")
        times.wall_s = time.perf_counter() - start - warm_s
        del batches

    everyone_bad = sorted(i for part in group.all_gather_objects(bad) for i in part)
    if everyone_bad and not options.skip_bad:
        i, reason = everyone_bad[0]
        raise DataError(f"bad image {index.samples[i][0]}: {reason} (--skip-bad skips such files and lists them)")
    skipped += [Skipped(index.samples[i][0], reason) for i, reason in everyone_bad]
    tally.all_reduce(group)
    per_rank = torch.stack(group.all_gather(times.as_tensor()))
    images_total = tally.count("images")
    if images_total + len(everyone_bad) != len(dataset):
        raise RuntimeError(
            f"counted {images_total} images and {len(everyone_bad)} bad files of {len(dataset)}: shards overlap or "
            "miss samples"
        )
    if images_total == 0:
        raise DataError(f"no image of {index.root} could be decoded ({len(everyone_bad)} skipped)")

    results = collect_results(options, setup, tally, per_rank, skipped, mode, params)
    for line in report_lines(results):
        say(line)
    if lead:
        if options.results_json is not None:
            Path(options.results_json).write_text(json.dumps(results, indent=2, default=repr) + "\n")
            say(f"results: {options.results_json}")
        if options.results_csv is not None:
            append_csv(options.results_csv, csv_row(results))
            say(f"results: one row appended to {options.results_csv}")
    return results
