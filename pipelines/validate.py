"""``ragged-vit validate DATA_DIR`` / ``python -m ragged_vit.validate``: accuracy of a token-pruned timm ViT on an image
folder, its agreement with the unpruned model, kept tokens and throughput; data-parallel under ``torchrun``.

**Data.** ``DATA_DIR`` has torchvision's ImageFolder layout: one folder per class, the images anywhere below it
(suffixes :data:`IMAGE_SUFFIXES`, any case; other files are ignored). Class ``i`` is the ``i``-th folder name in sorted
order, as ``torchvision.datasets.ImageFolder`` numbers them, unless ``--class-map FILE`` gives one class folder name per
line (line ``i``, from 0, is class ``i``: timm's class-map text file). Samples are ordered by class, then by path.
Images are decoded with Pillow and transformed as timm evaluates the model (``timm.data.resolve_data_config`` and
``create_transform`` from its pretrained config; the model's own input size wins where ``img_size`` was changed).

**Bad data** ends the run with a one-line error (exit status 2) that names the folder or file: ``DATA_DIR`` without
class folders, a class folder without images, a class of the class map without a folder, a folder that is not in the
class map, an image Pillow cannot decode. With ``--skip-bad`` those files are skipped (counted, listed in the report
and the JSON file) and empty or missing classes are noted; class indices never move.

**Counting.** Top-1 and top-5 (top-k with k = min(5, classes)) of the pruned model; with ``--compare-unpruned`` the
same for timm's own forward of the same model on the same batches (eager), the top-1 agreement of the two and the
accuracy deltas; the kept patches of every stage: mean, population std, min and max over the images. Everything is
an integer count (kept sums and sums of squares too), so results are exact and do not depend on the order in which
ranks add them up.

**Data-parallel.** Under ``torchrun`` (``WORLD_SIZE > 1``) each rank joins ``torch.distributed`` (NCCL on CUDA, each
rank on ``cuda:LOCAL_RANK``; gloo on the CPU) and takes a contiguous run of whole batches of the sorted sample list
(:func:`shard_range`): no sample is duplicated or dropped, shard sizes differ by at most one batch, and every batch a
rank runs is a batch of the one-process run, so even the rounding of its logits is the same. The counts are
all-reduced (sums, and max for the per-stage min and max): accuracy on N ranks equals one rank's exactly. Rank 0 prints
and writes the results; throughput is reported per rank and in total.

**Throughput.** Model only: images over the summed time of the synchronised forwards (pruned, and unpruned on its own);
end to end: images over the wall time of the loop (data loading, host-to-device copies, every forward and the counting;
the untimed warm-up forwards excluded: on the first batch, and on as many of its images as the shard's last batch holds,
so that no kernel compilation or graph capture for that shape is timed). The share of the wall time spent waiting for
the next batch says whether data loading bounds it. In total: model only is the sum of the ranks' rates; end to end is
all images over the slowest rank's wall time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from .images import IMAGE_SUFFIXES

TOP_K = 5
DATA_BOUND_SHARE = 0.2
"""End to end counts as bound by data loading when the loop waits for batches this share of its wall time or more."""

LISTED_SKIPS = 10
"""Skipped files named in the printed report (all of them go to the JSON file)."""

CSV_FIELDS: tuple[str, ...] = (
    "time",
    "data_dir",
    "model",
    "weights",
    "pruner",
    "keep_rate",
    "pruner_options",
    "backend",
    "mode",
    "device",
    "dtype",
    "batch_size",
    "world_size",
    "images",
    "skipped",
    "top1",
    "top5",
    "unpruned_top1",
    "unpruned_top5",
    "top1_agreement",
    "top1_delta",
    "kept_mean",
    "img_per_s_model",
    "img_per_s_end_to_end",
    "unpruned_img_per_s_model",
    "ragged_vit",
)
"""The columns of ``--results-csv`` (percentages for accuracies, ``/``-joined per-stage means for kept patches)."""


class DataError(ValueError):
    """Unusable data (a folder or file the message names): a one-line error with exit status 2."""


class BadImage(DataError):
    """A file Pillow cannot decode: its ``path`` and the ``reason``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"bad image {path}: {reason}")
        self.path, self.reason = path, reason


# -- the image folder ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    """A file left out of the run (``--skip-bad``) and why."""

    path: str
    reason: str


@dataclass
class ImageFolderIndex:
    """The samples of an image folder.

    Attributes:
        root: the folder.
        classes: class ``i``'s folder name at index ``i``.
        samples: ``(path, class index)`` ordered by class, then path.
        skipped: files left out while scanning (``--skip-bad``: folders not in the class map).
        notes: what ``--skip-bad`` let pass besides files (empty class folders, classes without a folder).
        class_map: the class-map file the classes come from, if any.
    """

    root: Path
    classes: list[str]
    samples: list[tuple[str, int]]
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    class_map: Path | None = None


def read_class_map(path: str | os.PathLike) -> list[str]:
    """The class folder names of a class-map text file, one per line (line ``i`` from 0 is class ``i``); blank lines
    at the end are ignored, blank or repeated names elsewhere are errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"class map file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"class map {path} is not a readable text file: {' '.join(str(e).split())}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    names = [line.strip() for line in lines]
    seen: dict[str, int] = {}
    for number, name in enumerate(names, start=1):
        if not name:
            raise DataError(f"class map {path}: line {number} is blank (one class folder name per line)")
        if name in seen:
            raise DataError(f"class map {path}: line {number} repeats {name!r} of line {seen[name]}")
        seen[name] = number
    if not names:
        raise DataError(f"class map {path} names no class")
    return names


def _image_files(folder: Path) -> list[str]:
    """The image files below ``folder``, in torchvision's order (walked with links followed, sorted by directory,
    then by name)."""
    files = []
    for directory, _, names in sorted(os.walk(folder, followlinks=True)):
        files.extend(os.path.join(directory, n) for n in sorted(names) if n.lower().endswith(IMAGE_SUFFIXES))
    return files


def scan_image_folder(
    root: str | os.PathLike, class_map: str | os.PathLike | None = None, skip_bad: bool = False
) -> ImageFolderIndex:
    """The samples of the ImageFolder tree ``root`` (module docstring), classes from sorted folder names or from
    ``class_map`` (:func:`read_class_map`).

    Raises:
        FileNotFoundError: ``root`` or ``class_map`` does not exist.
        DataError: ``root`` has no class folder or no image at all; and without ``skip_bad``: a class folder without
            images, a class of the class map without a folder, a folder not in the class map.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data folder not found: {root}")
    folders = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not folders:
        loose = len([p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES])
        hint = f"; it holds {loose} image files directly: sort them into one folder per class" if loose else ""
        raise DataError(f"data folder {root} has no class folders (layout: {root}/<class>/<image>){hint}")
    mapped = class_map is not None
    classes = read_class_map(class_map) if mapped else folders
    index = ImageFolderIndex(root, classes, [], class_map=Path(class_map) if mapped else None)
    if mapped:
        unmapped = [name for name in folders if name not in set(classes)]
        for name in unmapped:
            files = _image_files(root / name)
            if not skip_bad:
                raise DataError(
                    f"class folder {root / name} is not in the class map {class_map} ({len(files)} images; "
                    "--skip-bad skips them)"
                )
            index.skipped.extend(Skipped(f, "its class folder is not in the class map") for f in files)
            index.notes.append(f"folder {root / name} is not in the class map: its {len(files)} images skipped")
        present = set(folders)
        absent = [(i, name) for i, name in enumerate(classes) if name not in present]
        if absent and not skip_bad:
            i, name = absent[0]
            more = f" (and {len(absent) - 1} more classes)" if len(absent) > 1 else ""
            raise DataError(
                f"class {name!r} (line {i + 1} of the class map {class_map}) has no folder {root / name}{more}"
            )
        if absent:
            shown = ", ".join(name for _, name in absent[:LISTED_SKIPS])
            more = f", ... ({len(absent) - LISTED_SKIPS} more)" if len(absent) > LISTED_SKIPS else ""
            index.notes.append(f"{len(absent)} classes of the class map have no folder: {shown}{more}")
    for target, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        files = _image_files(folder)
        if not files:
            if not skip_bad:
                raise DataError(
                    f"class folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}; --skip-bad lets it pass)"
                )
            index.notes.append(f"class folder {folder} holds no images")
        index.samples.extend((f, target) for f in files)
    if not index.samples:
        raise DataError(f"data folder {root} holds no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return index


def decode_image(path: str):
    """The image at ``path`` as an RGB Pillow image; a file Pillow cannot decode raises :class:`BadImage`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise BadImage(path, "not an image file Pillow can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated, broken, too large
        raise BadImage(path, f"cannot decode it: {' '.join(str(e).split()) or type(e).__name__}") from None


class ImageFolderDataset(torch.utils.data.Dataset):
    """The samples of an :class:`ImageFolderIndex`, each ``(image [3, H, W], target, index, error)``: a file that
    cannot be decoded gives zeros and the reason (the loop decides what to do), any other file ``""``."""

    def __init__(self, index: ImageFolderIndex, transform, input_size: tuple[int, int, int]) -> None:
        self.samples = index.samples
        self.transform = transform
        self.input_size = tuple(input_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int, str]:
        path, target = self.samples[i]
        try:
            image = self.transform(decode_image(path))
        except BadImage as e:
            return torch.zeros(self.input_size), target, i, e.reason
        return image, target, i, ""


def shard_range(num_samples: int, batch_size: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s samples: a contiguous run of whole batches of the ``num_samples`` (``ceil(num_samples /
    batch_size)`` batches split as evenly as whole batches allow; the last batch may be partial, a rank may get
    none). Over all ranks the ranges are disjoint and cover every sample once: no padding, nothing dropped."""
    batches = math.ceil(num_samples / batch_size)
    first, last = rank * batches // world_size, (rank + 1) * batches // world_size
    return range(min(first * batch_size, num_samples), min(last * batch_size, num_samples))


# -- counting -----------------------------------------------------------------------------------------------------

_SUMS = ("images", "top1", "top5", "unpruned_top1", "unpruned_top5", "top1_agree")
_LOW = -(2**62)


class Tally:
    """Integer counts of one rank (or, after :meth:`all_reduce`, of all ranks): images, correct top-1 and top-5
    (pruned and unpruned), top-1 agreement, and per stage the kept patches' sum, sum of squares, min and max."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.sums = torch.zeros(len(_SUMS) + 2 * stages, dtype=torch.int64)  # the counts, kept sums, kept squares
        self.maxes = torch.full((2 * stages,), _LOW, dtype=torch.int64)  # per stage: max, then -min

    def add(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        counts: torch.Tensor,
        unpruned_logits: torch.Tensor | None = None,
    ) -> None:
        """Adds one batch: ``logits [B, classes]``, ``targets [B]``, kept ``counts [B, stages]`` (and the unpruned
        model's logits of the same images)."""
        targets = targets.to(logits.device)
        k = min(TOP_K, logits.shape[-1])
        top = logits.float().topk(k, dim=-1).indices
        values = [torch.tensor(logits.shape[0], device=logits.device), *_hits(top, targets)]
        if unpruned_logits is not None:
            ref = unpruned_logits.float().topk(k, dim=-1).indices
            values += [*_hits(ref, targets), (ref[:, 0] == top[:, 0]).sum()]
        else:
            values += [torch.zeros((), dtype=torch.int64, device=logits.device)] * 3
        counts = counts.to(device=logits.device, dtype=torch.int64)
        sums = torch.cat([torch.stack(values).long(), counts.sum(0), counts.pow(2).sum(0)])
        maxes = torch.cat([counts.max(0).values, -counts.min(0).values]) if counts.shape[1] else self.maxes[:0]
        sums, maxes = sums.cpu(), maxes.cpu()
        self.sums += sums
        self.maxes = torch.maximum(self.maxes, maxes)

    def all_reduce(self, group: Distributed) -> None:
        """Sums and maxima over all ranks (every rank ends with the totals)."""
        self.sums = group.all_reduce(self.sums, "sum")
        self.maxes = group.all_reduce(self.maxes, "max")

    def count(self, name: str) -> int:
        return int(self.sums[_SUMS.index(name)])

    def kept(self) -> list[dict[str, float | int | None]]:
        """Per stage: mean, population std, min and max of the kept patches (None without images)."""
        n, s = self.count("images"), self.stages
        stats = []
        for i in range(s):
            total, squares = int(self.sums[len(_SUMS) + i]), int(self.sums[len(_SUMS) + s + i])
            if n == 0:
                stats.append({"mean": None, "std": None, "min": None, "max": None})
                continue
            mean = total / n
            variance = max(0.0, (squares * n - total * total) / (n * n))  # exact integers until the division
            stats.append(
                {"mean": mean, "std": math.sqrt(variance), "min": -int(self.maxes[s + i]), "max": int(self.maxes[i])}
            )
        return stats


def _hits(top: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (top[:, 0] == targets).sum(), (top == targets[:, None]).any(dim=-1).sum()


# -- torch.distributed --------------------------------------------------------------------------------------------


class Distributed:
    """This process's place in a ``torchrun`` job (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or a job of one."""

    def __init__(self) -> None:
        env = os.environ
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.rank = int(env.get("RANK", "0")) if self.world_size > 1 else 0
        self.local_rank = int(env.get("LOCAL_RANK", "0")) if self.world_size > 1 else 0
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1")) if self.world_size > 1 else 1
        self.comm_device = torch.device("cpu")
        self.backend = ""
        self.started = False

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def start(self, device: torch.device) -> None:
        """Joins the process group: NCCL when ``device`` is CUDA (collectives on it), gloo otherwise."""
        if not self.active:
            return
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.backend, self.comm_device = "nccl", device
            dist.init_process_group("nccl", device_id=device)  # bound to this rank's GPU from the start
        else:
            self.backend = "gloo"
            dist.init_process_group("gloo")
        self.started = True

    def stop(self) -> None:
        if self.started:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.started = False

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if not self.started:
            return tensor
        import torch.distributed as dist

        out = tensor.to(self.comm_device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order."""
        if not self.started:
            return [tensor]
        import torch.distributed as dist

        mine = tensor.to(self.comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [t.cpu() for t in out]

    def all_gather_objects(self, obj: object) -> list[object]:
        if not self.started:
            return [obj]
        import torch.distributed as dist

        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


# -- options ------------------------------------------------------------------------------------------------------


@dataclass
class ValidateOptions:
    """Everything a validation run needs; the CLI fills it (:func:`main`)."""

    data_dir: str
    model: str
    pruner: str
    keep_rate: float
    backend: str
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    workers: int
    model_kwargs: dict[str, object] = field(default_factory=dict)
    pruner_options: dict[str, object] = field(default_factory=dict)
    class_map: str | None = None
    checkpoint: str | None = None
    strip_prefix: str | None = None
    seed: int = 0
    graphs: bool = False
    compile_blocks: bool = False
    compare_unpruned: bool = False
    warmup: int = 0
    skip_bad: bool = False
    results_json: str | None = None
    results_csv: str | None = None
    command: str = ""


# -- the run ------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _transform(model: torch.nn.Module):
    """timm's eval transform from the model's pretrained config, at the model's own input size."""
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({}, model=model)
    size = (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)
    config["input_size"] = tuple(int(s) for s in size)
    return create_transform(**config), config


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


def _rate(images: float, seconds: float) -> float | None:
    return images / seconds if seconds > 0 else None


@dataclass
class _Setup:
    """What the run needs, built the same on every rank before the loop (:func:`_prepare`)."""

    index: ImageFolderIndex
    pv: object  # PrunedViT
    dataset: ImageFolderDataset
    data_config: dict
    notes: list[str]
    weights: str
    fingerprint: tuple[int, int]


def _fingerprint(index: ImageFolderIndex) -> tuple[int, int]:
    """Sample count and a CRC of the classes and of every sample's path below the root and class: equal on every
    rank when every node sees the same data."""
    crc = zlib.crc32("\n".join(index.classes).encode())
    for path, target in index.samples:
        crc = zlib.crc32(f"{os.path.relpath(path, index.root)}\t{target}\n".encode(), crc)
    return len(index.samples), crc


def _prepare(options: ValidateOptions) -> _Setup:
    """Scans the data, builds the model, pruner and pipeline (checkpoint loaded, moved, calibrated)."""
    from .factory import build_pruner
    from .model import PrunedViT
    from .weights import create_model, load_checkpoint

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
    transform, data_config = _transform(model)
    dataset = ImageFolderDataset(index, transform, data_config["input_size"])
    if pruner is not None and getattr(pruner, "mode", None) == "calibrated":
        calibration = _calibration_batch(dataset, min(options.batch_size, len(dataset)), options.skip_bad)
        threshold = pv.calibrate(calibration.to(device))
        notes.append(f"threshold calibrated on {calibration.shape[0]} images spread over the data: {threshold:.4g}")
    pv.compile_blocks = options.compile_blocks
    return _Setup(index, pv, dataset, data_config, notes, weights, _fingerprint(index))


_ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError)
"""What :func:`main` reports as a one-line error (exit status 2)."""


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
    """Runs the validation of ``options`` on this rank's shard and returns the results (module docstring) after
    the all-reduce, the same on every rank. Only rank 0 prints (to ``out``, stdout by default).

    Raises:
        FileNotFoundError, DataError, ValueError, TypeError: unusable data, model, checkpoint or options (the
            message names the file or option), on every rank when one rank has them. A file that cannot be decoded
            raises on every rank once all ranks have finished their shards, unless ``options.skip_bad``.
    """
    from .demo import describe_pruner, progress_bar
    from .graphs import GraphedPrunedViT

    group = group or Distributed()
    out = out or sys.stdout
    lead = group.rank == 0

    def say(line: str = "") -> None:
        if lead:
            print(line, file=out, flush=True)

    try:
        setup, error = _prepare(options), None
    except _ERRORS as e:
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

    results = _results(options, index, pv, tally, per_rank, skipped, notes, weights, mode, params, data_config)
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


def _accuracy(tally: Tally, prefix: str) -> dict[str, float | int]:
    n = tally.count("images")
    top1, top5 = tally.count(prefix + "top1"), tally.count(prefix + "top5")
    return {"images": n, "top1_correct": top1, "top5_correct": top5, "top1": 100 * top1 / n, "top5": 100 * top5 / n}


def _results(options, index, pv, tally, per_rank, skipped, notes, weights, mode, params, data_config) -> dict:
    import timm
    import triton

    from .. import __version__

    device = options.device
    unused = options.pruner == "none" or options.pruner_options.get("threshold_mode") == "threshold"
    keep_rate = None if unused else options.keep_rate
    pruned = _accuracy(tally, "")
    unpruned = agreement = None
    if options.compare_unpruned:
        unpruned = _accuracy(tally, "unpruned_")
        agree = tally.count("top1_agree")
        agreement = {
            "top1_agree": agree,
            "top1_agreement": 100 * agree / pruned["images"],
            "top1_delta": pruned["top1"] - unpruned["top1"],
            "top5_delta": pruned["top5"] - unpruned["top5"],
        }
    stages = []
    for stage, stats in zip(pv.plan.stages, tally.kept(), strict=True):
        stages.append({"stage": stage.index, "block": stage.block, "placement": stage.placement.value, **stats})
    ranks = []
    for rank, (images, model_s, unpruned_s, wall_s, wait_s) in enumerate(per_rank.tolist()):
        ranks.append(
            {
                "rank": rank,
                "images": int(images),
                "model_s": model_s,
                "unpruned_model_s": unpruned_s if options.compare_unpruned else None,
                "wall_s": wall_s,
                "data_wait_s": wait_s,
                "img_per_s_model": _rate(images, model_s),
                "unpruned_img_per_s_model": _rate(images, unpruned_s) if options.compare_unpruned else None,
                "img_per_s_end_to_end": _rate(images, wall_s),
            }
        )
    total_wall = max(r["wall_s"] for r in ranks)
    total = {
        "img_per_s_model": sum(r["img_per_s_model"] or 0.0 for r in ranks),
        "unpruned_img_per_s_model": sum(r["unpruned_img_per_s_model"] or 0.0 for r in ranks)
        if options.compare_unpruned
        else None,
        "img_per_s_end_to_end": _rate(pruned["images"], total_wall),
        "wall_s": total_wall,
        "data_wait_share": sum(r["data_wait_s"] for r in ranks) / max(1e-12, sum(r["wall_s"] for r in ranks)),
    }
    return {
        "command": options.command,
        "versions": {
            "ragged_vit": __version__,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "timm": timm.__version__,
        },
        "data": {
            "dir": str(index.root.resolve()),
            "class_map": str(index.class_map) if index.class_map else None,
            "classes": len(index.classes),
            "images": len(index.samples),
            "skipped": [{"path": s.path, "reason": s.reason} for s in skipped],
            "notes": notes,
            "transform": {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items()},
        },
        "model": {
            "name": options.model,
            "kwargs": options.model_kwargs,
            "params_m": params,
            "weights": weights,
            "num_classes": pv.model.num_classes,
            "num_patches": pv.num_patches,
        },
        "pruner": {"name": options.pruner, "keep_rate": keep_rate, "options": options.pruner_options},
        "run": {
            "backend": pv.backend.name,
            "mode": mode,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(options.dtype).removeprefix("torch."),
            "batch_size": options.batch_size,
            "workers": options.workers,
            "warmup": options.warmup,
            "world_size": len(ranks),
        },
        "pruned": pruned,
        "unpruned": unpruned,
        "agreement": agreement,
        "kept_patches": stages,
        "throughput": {"total": total, "ranks": ranks},
    }


def _img_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _placement(value: str) -> str:
    return {"before_block": "before block", "mid_block": "inside block", "after_block": "after block"}[value]


def report_lines(results: dict) -> list[str]:
    """The printed report of :func:`validate`'s results."""
    pruned, unpruned, agreement = results["pruned"], results["unpruned"], results["agreement"]
    n = pruned["images"]
    classes = results["model"]["num_classes"]
    top_k = f" (top-5 is top-{classes}: the model has {classes} classes)" if classes < TOP_K else ""
    lines = ["", f"Accuracy on {n} images{top_k}:"]

    def row(name: str, acc: dict) -> str:
        return (
            f"  {name:<10} top-1 {acc['top1']:7.3f}% ({acc['top1_correct']}/{n})   "
            f"top-5 {acc['top5']:7.3f}% ({acc['top5_correct']}/{n})"
        )

    label = "pruned" if results["kept_patches"] else "unpruned"  # --pruner none: the model as it is
    lines.append(row(label, pruned))
    if unpruned is not None:
        lines.append(row("unpruned", unpruned))
        lines.append(
            f"  top-1 agreement {agreement['top1_agreement']:.3f}% ({agreement['top1_agree']}/{n}); "
            f"pruned minus unpruned: top-1 {agreement['top1_delta']:+.3f}, top-5 {agreement['top5_delta']:+.3f} points"
        )
    stages = results["kept_patches"]
    if stages:
        lines.append(f"Kept patches per stage (of {results['model']['num_patches']}; over the images):")
        for s in stages:
            lines.append(
                f"  stage {s['stage']} ({_placement(s['placement'])} {s['block']}): mean {s['mean']:.2f}, "
                f"std {s['std']:.2f}, min {s['min']}, max {s['max']}"
            )
    else:
        lines.append(f"Kept patches: all {results['model']['num_patches']} (no pruning)")
    total, ranks = results["throughput"]["total"], results["throughput"]["ranks"]
    world = len(ranks)
    lines.append(f"Throughput in img/s ({'sum of ' + str(world) + ' ranks' if world > 1 else 'one process'}):")
    lines.append(f"  {label + ', model only':<24}{_img_s(total['img_per_s_model']):>10}  (synchronised forwards)")
    if unpruned is not None:
        lines.append(f"  unpruned, model only    {_img_s(total['unpruned_img_per_s_model']):>10}  (timm eager)")
    both = ", both forwards" if unpruned is not None else ""
    slowest = " of the slowest rank" if world > 1 else ""
    lines.append(
        f"  end to end              {_img_s(total['img_per_s_end_to_end']):>10}  "
        f"(wall time{slowest} {total['wall_s']:.2f} s: data loading{both} and counting)"
    )
    share = total["data_wait_share"]
    workers = results["run"]["workers"]
    if share >= DATA_BOUND_SHARE:
        lines.append(
            f"  end to end is bound by data loading: {100 * share:.0f}% of the wall time waiting for batches "
            f"({workers} loader worker{'s' if workers != 1 else ''} per rank: more --workers or faster storage "
            "would help)"
        )
    else:
        lines.append(f"  data loading kept up: {100 * share:.0f}% of the wall time waiting for batches")
    if world > 1:
        for r in ranks:
            lines.append(
                f"  rank {r['rank']}: {r['images']} images, model only {_img_s(r['img_per_s_model'])}, "
                f"end to end {_img_s(r['img_per_s_end_to_end'])}, waiting {r['data_wait_s']:.2f} of {r['wall_s']:.2f} s"
            )
    skipped = results["data"]["skipped"]
    if skipped:
        lines.append(f"Skipped {len(skipped)} file{'s' if len(skipped) != 1 else ''} (--skip-bad):")
        for s in skipped[:LISTED_SKIPS]:
            lines.append(f"  {s['path']}: {s['reason']}")
        if len(skipped) > LISTED_SKIPS:
            lines.append(f"  ... {len(skipped) - LISTED_SKIPS} more (all in --results-json)")
    return lines


def csv_row(results: dict) -> dict[str, object]:
    """One row of :data:`CSV_FIELDS` from :func:`validate`'s results."""
    unpruned, agreement, total = results["unpruned"], results["agreement"], results["throughput"]["total"]
    kept = "/".join(f"{s['mean']:.2f}" for s in results["kept_patches"])
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data_dir": results["data"]["dir"],
        "model": results["model"]["name"],
        "weights": results["model"]["weights"],
        "pruner": results["pruner"]["name"],
        "keep_rate": results["pruner"]["keep_rate"],
        "pruner_options": json.dumps(results["pruner"]["options"], sort_keys=True, default=repr),
        "backend": results["run"]["backend"],
        "mode": results["run"]["mode"],
        "device": results["run"]["device_name"],
        "dtype": results["run"]["dtype"],
        "batch_size": results["run"]["batch_size"],
        "world_size": results["run"]["world_size"],
        "images": results["pruned"]["images"],
        "skipped": len(results["data"]["skipped"]),
        "top1": results["pruned"]["top1"],
        "top5": results["pruned"]["top5"],
        "unpruned_top1": unpruned["top1"] if unpruned else "",
        "unpruned_top5": unpruned["top5"] if unpruned else "",
        "top1_agreement": agreement["top1_agreement"] if agreement else "",
        "top1_delta": agreement["top1_delta"] if agreement else "",
        "kept_mean": kept,
        "img_per_s_model": total["img_per_s_model"],
        "img_per_s_end_to_end": total["img_per_s_end_to_end"],
        "unpruned_img_per_s_model": total["unpruned_img_per_s_model"] if unpruned else "",
        "ragged_vit": results["versions"]["ragged_vit"],
    }


def _csv_header(path: Path) -> list[str] | None:
    """The header of an existing, non-empty CSV file (None for a new or empty one)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def append_csv(path: str | os.PathLike, row: dict[str, object]) -> None:
    """Appends ``row`` to the CSV file ``path``, writing the header first if the file is new or empty."""
    path = Path(path)
    new = _csv_header(path) is None
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)


# -- the command line ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that stays silent on ranks other than 0 (under torchrun every rank parses the same arguments)."""

    def _print_message(self, message: str, file: TextIO | None = None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)


def _path_to_write(what: str):
    def parse(text: str) -> str:
        parent = Path(text).expanduser().resolve().parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"folder {parent} does not exist (the {what} file goes there)")
        if Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
        return text

    return parse


def build_parser(prog: str = "ragged-vit validate") -> argparse.ArgumentParser:
    """The parser of ``ragged-vit validate`` (its pruner choices come from the registry, which imports timm)."""
    from .backends import BACKENDS
    from .cli import _DTYPES, _int_at_least, add_model_arguments, add_pruner_arguments

    positive, non_negative = _int_at_least(1, "positive"), _int_at_least(0, "non-negative")
    parser = _Parser(
        prog=prog,
        description="Accuracy (top-1, top-5) of a token-pruned timm ViT on an ImageFolder tree, agreement with the "
        "unpruned model, kept tokens per stage and throughput; data-parallel under torchrun "
        "(torchrun --nproc-per-node N -m ragged_vit.validate DATA_DIR ...).",
    )
    parser.add_argument("data_dir", metavar="DATA_DIR", help="image folder: DATA_DIR/<class>/<image> (torchvision)")
    parser.add_argument(
        "--class-map",
        metavar="FILE",
        help="text file, one class folder name per line: line i (from 0) is class i (default: sorted folder names)",
    )
    add_model_arguments(parser)
    add_pruner_arguments(parser, calibrated_on="images spread over DATA_DIR, the same on every rank")
    parser.add_argument(
        "--backend", choices=tuple(BACKENDS), help="attention backend (default: triton on CUDA, reference on CPU)"
    )
    parser.add_argument("--checkpoint", help="local checkpoint file (DeiT / DynamicViT releases, training checkpoints)")
    parser.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="remove PREFIX from the checkpoint's keys (module. for a DistributedDataParallel checkpoint)",
    )
    parser.add_argument("--seed", type=int, help="seed of the random weights (default 0; not with --checkpoint)")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda or cuda:N (default auto; under torchrun each rank takes cuda:LOCAL_RANK)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", *_DTYPES), help="default: float32 on CPU, float16 on CUDA"
    )
    parser.add_argument("--batch-size", type=positive, help="images per forward (default 64 on CUDA, 16 on CPU)")
    parser.add_argument(
        "--workers", type=non_negative, help="data loader worker processes per rank (default: min(4, CPUs per rank))"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="run the pruned forward as GraphedPrunedViT (CUDA graphs; CUDA only)"
    )
    parser.add_argument(
        "--compile-blocks",
        action="store_true",
        help="torch.compile around the packed blocks (PrunedViT.compile_blocks; CUDA only, not with --pruner none)",
    )
    parser.add_argument(
        "--compare-unpruned",
        action="store_true",
        help="also run timm's unpruned forward on the same batches: its accuracy, top-1 agreement, the delta",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        help="untimed forwards on the first batch (default 0 on CPU; on CUDA 1, or 3 with --graphs/--compile-blocks)",
    )
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip files Pillow cannot decode and folders not in the class map (listed), let empty classes pass",
    )
    parser.add_argument("--results-json", type=_path_to_write("JSON"), metavar="PATH", help="write the results here")
    parser.add_argument(
        "--results-csv",
        type=_path_to_write("CSV"),
        metavar="PATH",
        help="append one row of results (header written if the file is new)",
    )
    parser.add_argument("--threads", type=positive, help="CPU threads for torch (default: torch's own choice)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, on_gpu: bool) -> dict[str, object]:
    """Options that would do nothing with the others given, or on this device, are errors (status 2); returns the
    pruner's own options."""
    from .cli import pruner_arguments

    options = pruner_arguments(parser, args)
    if args.pruner == "none":
        for flag, value in (
            ("--keep-rate", args.keep_rate),
            ("--backend", args.backend),
            ("--compile-blocks", args.compile_blocks or None),
        ):
            if value is not None:
                parser.error(f"argument {flag}: not used with --pruner none (timm's own forward, nothing packed)")
        if args.compare_unpruned:
            parser.error("argument --compare-unpruned: with --pruner none the model is the unpruned one")
    if not on_gpu:
        for flag, on in (("--graphs", args.graphs), ("--compile-blocks", args.compile_blocks)):
            if on:
                parser.error(
                    f"argument {flag}: needs a CUDA device (on a CPU nothing is captured or compiled for speed)"
                )
    if args.seed is not None and args.checkpoint is not None:
        parser.error("argument --seed: seeds the random weights, which --checkpoint replaces")
    if args.strip_prefix is not None and args.checkpoint is None:
        parser.error("argument --strip-prefix: applies to --checkpoint's keys, and no --checkpoint is given")
    return options


def _resolve_device(parser: argparse.ArgumentParser, text: str, group: Distributed) -> torch.device:
    from .cli import _device

    try:
        device = _device(text)
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --device: {e}")
    if group.active and device.type == "cuda":
        if device.index is not None:
            parser.error("argument --device: under torchrun each rank takes cuda:LOCAL_RANK; pass cuda or auto")
        if group.local_rank >= torch.cuda.device_count():
            parser.error(
                f"argument --device: LOCAL_RANK {group.local_rank} but only {torch.cuda.device_count()} CUDA devices"
            )
        device = torch.device("cuda", group.local_rank)
    return device


def _early_device(argv: list[str]) -> str:
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--device", default="auto")
    return early.parse_known_args(argv)[0].device


def main(argv: list[str] | None = None, prog: str = "ragged-vit validate") -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), validates; returns the exit status (2: a one-line error)."""
    from .cli import interpreter_env

    argv = sys.argv[1:] if argv is None else list(argv)
    early = _early_device(argv)
    with interpreter_env(early == "cpu" or (early == "auto" and not torch.cuda.is_available())):
        return _validate_command(argv, prog)


def _validate_command(argv: list[str], prog: str) -> int:
    """:func:`main` in the interpreter setting of its device."""

    group = Distributed()
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    device = _resolve_device(parser, args.device, group)
    on_gpu = device.type == "cuda"
    pruner_options = _check_args(parser, args, on_gpu)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    accelerated = args.graphs or args.compile_blocks
    cpus = (os.cpu_count() or 1) // max(1, group.local_world_size)
    options = ValidateOptions(
        data_dir=args.data_dir,
        model=args.model or ("deit_base_patch16_224" if on_gpu else "deit_tiny_patch16_224"),
        pruner=args.pruner,
        keep_rate=0.5 if args.keep_rate is None else args.keep_rate,
        backend=args.backend or ("triton" if on_gpu else "reference"),
        device=device,
        dtype=(
            getattr(torch, args.dtype)
            if args.dtype != "auto"
            else (torch.float16 if on_gpu else torch.float32)
        ),
        batch_size=args.batch_size or (64 if on_gpu else 16),
        workers=args.workers if args.workers is not None else min(4, cpus),
        model_kwargs=dict(args.model_arg),
        pruner_options=pruner_options,
        class_map=args.class_map,
        checkpoint=args.checkpoint,
        strip_prefix=args.strip_prefix,
        seed=args.seed or 0,
        graphs=args.graphs,
        compile_blocks=args.compile_blocks,
        compare_unpruned=args.compare_unpruned,
        warmup=args.warmup if args.warmup is not None else ((3 if accelerated else 1) if on_gpu else 0),
        skip_bad=args.skip_bad,
        results_json=args.results_json,
        results_csv=args.results_csv,
        command=shlex.join([*prog.split(), *argv]),
    )
    try:
        group.start(device)
        validate(options, group)
        return 0
    except _ERRORS as e:
        if group.rank == 0:
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        group.stop()


if __name__ == "__main__":
    sys.exit(main())
