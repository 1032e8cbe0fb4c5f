"""Images for the apps: the suffixes and the Pillow decoder the demo and ``validate`` share, timm's eval transform,
and the demo's sources.

Preprocessing is timm's own eval transform (``timm.data.resolve_data_config`` and ``create_transform`` from the
model's ``pretrained_cfg``, at the model's own input size, where ``img_size`` was changed): resize, center crop,
normalise with the model's mean and std. Grayscale images are repeated to three channels; an alpha channel is dropped.

The demo's sources: a path to an image file (read with Pillow), a path to a folder (its image files, sorted by name),
or the name of a scikit-image sample that ships with the package (``chelsea``, ``astronaut``, ``coffee``, ``rocket``,
``camera``, ...; samples that need a download are refused offline by scikit-image itself). scikit-image is an
optional dependency (the ``demo`` extra): without it only files and folders work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SAMPLE_IMAGES: tuple[str, ...] = ("chelsea", "astronaut", "coffee", "rocket")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".gif", ".tif", ".tiff", ".webp")
"""The image files the demo's ``--images`` and ``validate``'s class folders take (compared in lower case):
``torchvision.datasets.ImageFolder``'s suffixes and GIF, all read by Pillow."""


def image_files(folder: str | os.PathLike, recursive: bool = False) -> list[str]:
    """The image files (:data:`IMAGE_SUFFIXES`) in ``folder``, or anywhere below it with ``recursive`` (walked with
    links followed), in torchvision's order: sorted by directory, then by name."""
    walk = os.walk(folder, followlinks=True)
    directories = sorted(walk) if recursive else [next(walk, (str(folder), [], []))]
    return [
        os.path.join(directory, name)
        for directory, _, names in directories
        for name in sorted(names)
        if name.lower().endswith(IMAGE_SUFFIXES)
    ]


class BadImage(ValueError):
    """A file Pillow cannot decode: its ``path``, the ``reason`` and, where Pillow read it but failed, the ``detail``
    (what Pillow said)."""

    def __init__(self, path: str | os.PathLike, reason: str, detail: str | None = None) -> None:
        super().__init__(f"bad image {path}: {reason}")
        self.path, self.reason, self.detail = str(path), reason, detail


def decode_image(path: str | os.PathLike):
    """The image at ``path`` as an RGB Pillow image; a file Pillow cannot decode raises :class:`BadImage`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise BadImage(path, "not an image file Pillow can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated, broken, too large
        detail = " ".join(str(e).split()) or type(e).__name__
        raise BadImage(path, f"cannot decode it: {detail}", detail) from None


def eval_transform(model: torch.nn.Module):
    """timm's eval transform from the model's pretrained config, at the model's own input size, and the config."""
    from timm.data import create_transform, resolve_data_config

    from ..model import input_shape

    config = resolve_data_config({}, model=model)
    config["input_size"] = tuple(int(s) for s in input_shape(model))
    return create_transform(**config), config


@dataclass
class LoadedImage:
    """One source image: a display name and its ``uint8 [H, W, 3]`` pixels."""

    name: str
    pixels: np.ndarray


def _to_rgb(pixels: np.ndarray, name: str) -> np.ndarray:
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[:, :, None], 3, axis=2)
    if pixels.ndim != 3 or pixels.shape[2] not in (3, 4):
        raise ValueError(f"image {name} must be grayscale, RGB or RGBA, got array shape {pixels.shape}")
    pixels = pixels[:, :, :3]
    if pixels.dtype == np.bool_:
        return pixels.astype(np.uint8) * 255
    if pixels.dtype.kind in "ui" and pixels.dtype != np.uint8:
        pixels = pixels.astype(np.float64) / np.iinfo(pixels.dtype).max
    if pixels.dtype.kind == "f":
        pixels = np.clip(pixels * (255.0 if pixels.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    return pixels


def _read_file(path: Path) -> LoadedImage:
    try:
        return LoadedImage(path.name, np.asarray(decode_image(path)))
    except BadImage as e:
        if e.detail is None:
            raise ValueError(f"images: {path} is {e.reason}") from None
        raise ValueError(f"images: cannot read {path}: {e.detail}") from None


def _skimage_data():
    try:
        import skimage.data
    except ImportError:
        return None
    return skimage.data


def _read_sample(data, name: str) -> LoadedImage:
    return LoadedImage(name, _to_rgb(getattr(data, name)(), name))


def load_images(sources: list[str] | None = None) -> list[LoadedImage]:
    """Loads ``sources`` (files, folders, scikit-image sample names); None means :data:`SAMPLE_IMAGES`.

    Raises:
        FileNotFoundError: a source is neither an existing path nor a scikit-image sample, or a folder holds no
            image files.
        ValueError: a file (given, or in a folder with an image suffix) is not an image Pillow can read; the
            message names it.
    """
    data = _skimage_data()
    images: list[LoadedImage] = []
    for source in SAMPLE_IMAGES if sources is None else sources:
        path = Path(os.path.expanduser(source))
        if path.is_dir():
            files = image_files(path)
            if not files:
                nested = any(p.is_dir() for p in path.iterdir())
                where = " (its subfolders are not searched: `ragged-vit validate` reads a class-folder tree)"
                raise FileNotFoundError(
                    f"images: folder {path} holds no image files ({', '.join(IMAGE_SUFFIXES)}){where if nested else ''}"
                )
            images.extend(_read_file(Path(f)) for f in files)
        elif path.is_file():
            images.append(_read_file(path))
        elif (
            data is not None
            and source.isidentifier()
            and callable(getattr(data, source, None))
            and source != "download_all"
        ):
            images.append(_read_sample(data, source))
        else:
            hint = "" if data is not None else " (scikit-image is not installed: pip install 'ragged-vit[demo]')"
            raise FileNotFoundError(
                f"images: {source!r} is neither a file, a folder nor a scikit-image sample "
                f"(e.g. {', '.join(SAMPLE_IMAGES)}){hint}"
            )
    if not images:
        raise ValueError("images: no image given")
    return images


def preprocess(images: list[LoadedImage], model: torch.nn.Module) -> torch.Tensor:
    """The images through :func:`eval_transform` -> float32 ``[B, 3, H, W]`` on the CPU."""
    from PIL import Image

    transform, _ = eval_transform(model)
    return torch.stack([transform(Image.fromarray(np.ascontiguousarray(image.pixels))) for image in images])
