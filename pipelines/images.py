"""Real images for the demo: scikit-image's bundled photos or the user's files, preprocessed as timm does for eval.

Preprocessing follows the model's ``pretrained_cfg`` (timm's eval transform): resize the shorter side to
``floor(size / crop_pct)`` with antialiased bicubic interpolation, center-crop to the input size, scale to
``[0, 1]`` and normalise with the model's mean and std (ImageNet's for DeiT). Plain torch ops, no torchvision.
Grayscale images are repeated to three channels; an alpha channel is dropped.

Sources: a path to an image file (read with Pillow), a path to a folder (its image files, sorted by name), or the
name of a scikit-image sample that ships with the package (``chelsea``, ``astronaut``, ``coffee``, ``rocket``,
``camera``, ...; samples that need a download are refused offline by scikit-image itself). scikit-image is an
optional dependency (the ``demo`` extra): without it only files and folders work.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_IMAGES: tuple[str, ...] = ("chelsea", "astronaut", "coffee", "rocket")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".gif", ".tif", ".tiff", ".webp")
"""The image files the demo's ``--images`` and ``validate``'s class folders take (compared in lower case):
``torchvision.datasets.ImageFolder``'s suffixes and GIF, all read by Pillow."""


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
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return LoadedImage(path.name, np.asarray(image.convert("RGB")))
    except UnidentifiedImageError:
        raise ValueError(f"images: {path} is not an image file Pillow can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated, broken, too large
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"images: cannot read {path}: {reason}") from None


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
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                nested = any(p.is_dir() for p in path.iterdir())
                where = " (its subfolders are not searched: `ragged-vit validate` reads a class-folder tree)"
                raise FileNotFoundError(
                    f"images: folder {path} holds no image files ({', '.join(IMAGE_SUFFIXES)}){where if nested else ''}"
                )
            images.extend(_read_file(p) for p in files)
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
    """Resize + center crop + normalise, per the model's eval config -> float32 ``[B, 3, H, W]`` on the CPU."""
    cfg = model.pretrained_cfg
    height, width = tuple(model.patch_embed.img_size)
    crop_pct = float(cfg.get("crop_pct") or 1.0)
    mode = "bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic"
    mean = torch.tensor(cfg.get("mean", (0.485, 0.456, 0.406)))[:, None, None]
    std = torch.tensor(cfg.get("std", (0.229, 0.224, 0.225)))[:, None, None]
    short = math.floor(min(height, width) / crop_pct)
    out = []
    for image in images:
        x = torch.from_numpy(np.array(image.pixels)).permute(2, 0, 1).float()[None] / 255.0
        h, w = x.shape[-2:]
        ratio = short / min(h, w)
        size = (max(height, round(h * ratio)), max(width, round(w * ratio)))
        x = F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True).clamp_(0.0, 1.0)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        out.append((x[0, :, top : top + height, left : left + width] - mean) / std)
    return torch.stack(out)
