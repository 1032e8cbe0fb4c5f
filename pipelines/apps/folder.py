"""``validate``'s data: an image folder in torchvision's ImageFolder layout, scanned, as a dataset, sharded.

``DATA_DIR`` has one folder per class, the images anywhere below it (suffixes
:data:`~.images.IMAGE_SUFFIXES`, any case; other files are ignored). Class ``i`` is the ``i``-th folder name in sorted
order, as ``torchvision.datasets.ImageFolder`` numbers them, unless ``--class-map FILE`` gives one class folder name per
line (line ``i``, from 0, is class ``i``: timm's class-map text file). Samples are ordered by class, then by path.
Images are decoded with Pillow (:func:`~.images.decode_image`) and transformed as timm evaluates the model
(:func:`~.images.eval_transform`).

**Bad data** ends the run with a one-line error (exit status 2) that names the folder or file: ``DATA_DIR`` without
class folders, a class folder without images, a class of the class map without a folder, a folder that is not in the
class map, an image Pillow cannot decode. With ``--skip-bad`` those files are skipped (counted, listed in the report
and the JSON file) and empty or missing classes are noted; class indices never move.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .images import IMAGE_SUFFIXES, BadImage, decode_image, image_files

LISTED_SKIPS = 10
"""Skipped files (and classes without a folder) named in the printed report (all of them go to the JSON file)."""


class DataError(ValueError):
    """Unusable data (a folder or file the message names): a one-line error with exit status 2."""


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
        loose = len(image_files(root))
        hint = f"; it holds {loose} image files directly: sort them into one folder per class" if loose else ""
        raise DataError(f"data folder {root} has no class folders (layout: {root}/<class>/<image>){hint}")
    mapped = class_map is not None
    classes = read_class_map(class_map) if mapped else folders
    index = ImageFolderIndex(root, classes, [], class_map=Path(class_map) if mapped else None)
    if mapped:
        unmapped = [name for name in folders if name not in set(classes)]
        for name in unmapped:
            files = image_files(root / name, recursive=True)
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
        files = image_files(folder, recursive=True)
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

