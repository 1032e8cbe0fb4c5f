"""timm's ``NaFlexVit`` on the packed runtime: a batch of images of different sizes (native resolution), packed ragged
from the input on, with no padding.

timm's NaFlexVit pads a batch of images of different sizes to its longest and masks the attention (its collator
makes the patch dict ``patches``, ``patch_coord``, ``patch_valid``). Here every image keeps its own grid from the
start:

* **input** (:func:`native_batch`): a list of ``[C, H, W]`` images, each at its own size (height and width multiples
  of the patch size, or padded at the bottom and right as timm pads with ``dynamic_img_pad``); a ``[B, C, H, W]``
  tensor (one size); or NaFlex's patch dict, whose valid rows are taken with their coordinates. Checked before
  anything runs, each error one line naming the argument;
* **embedding** (:func:`native_front`): every image's patch rows through the model's own projection (one GEMM for
  the batch; a convolution as a GEMM on patch rows), its position embeddings resampled to its own grid by NaFlex's
  rule (:func:`position_rows`: the learned ``[gh, gw]`` table interpolated to ``h x w``, or to the square of the
  longer side then cropped with ``pos_embed_ar_preserving``; factorized tables per axis, linearly; each grid's rows
  kept by the pipeline, :class:`GridCache`), the prefix rows (class, register tokens) first in each image,
  ``norm_pre``; ``cu_seqlens`` from each image's own token count;
* **rotary position embeddings** (``rope_type``: ``axial``, ``dinov3``, ``mixed``, ``mrope``; :func:`native_rotary`):
  timm builds one rope table per grid size (``rope.get_embed(shape=grid)``); the batch's distinct grids' tables are
  concatenated into one, each patch row's position is its place in its grid's table plus that table's start (prefix
  rows ``-1``, unrotated), and the runtime rotates as for an Eva model (:mod:`ragged_vit.pipelines.eva`), every
  repack moving the positions with the rows;
* **blocks**: every block runs packed (there is no dense batch to run timm's own blocks on), pruning stages as on
  any ViT; each stage counts from each image's own patches (``ForwardState.image_patches``: DynamicViT's
  ``int(N_b * rate ** (s + 1))``);
* **head**: the pooling of each image's rows (:mod:`ragged_vit.pipelines.heads`: ``map``, ``avg``, ``token``...).

NaFlex's Eva-style blocks (SwiGLU, split or gated attention) run as timm's Eva blocks do on the packed runtime. The
rope's training-time coordinate augmentations (``rope_shift_coords``, ``rope_jitter_coords``,
``rope_rescale_coords``) are off in eval mode, the only mode the runtime runs. Refused, each with one line: a rope
module whose table layout the runtime does not take (:func:`ragged_vit.pipelines.eva.rope_spec`), a merging pruner
(ToMe) on a RoPE model, ``pos_embed_use_grid_sample``, grouped-query attention (``num_kv_heads``), patch dicts of
variable patch size (5-D ``patches``) or with an ``attn_mask``, ATS with a sample count relative to the image
(``ATSPruner(num_samples=K)`` runs), CUDA graphs for a native batch whose pruner appends a token (it runs
eagerly; the others replay their blocks, stages and head: :mod:`ragged_vit.pipelines.graphs`, Native batches).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models.naflexvit import NaFlexVit
from torch import nn

from ..core.segments import cu_seqlens_from_counts, host_ints
from ..core.segments import positions as places_in_images
from ..core.selection import Pruner
from ..core.validation import check_tensor
from ..reference.native import axis_weights
from .eva import RopeSpec, RotaryRows, rope_spec, rotary_at
from .patch_embed import patch_rows
from .state import ForwardState

POSITION_EMBEDDINGS = ("learned", "factorized", "none")
PATCH_KEYS = ("patches", "patch_coord", "patch_valid")


def is_naflex(model: object) -> bool:
    """Whether ``model`` is a timm ``NaFlexVit`` (or subclass)."""
    return isinstance(model, NaFlexVit)


def check_naflex(model: NaFlexVit) -> RopeSpec | None:
    """Raises ``NotImplementedError`` (one line) for what the packed runtime does not take in a ``NaFlexVit``; returns
    its rope (:func:`ragged_vit.pipelines.eva.rope_spec`, None without one). Its blocks are checked as packed blocks
    (grouped-query attention refused there)."""
    embeds = model.embeds
    spec = rope_spec(model)
    if getattr(embeds, "pos_embed_use_grid_sample", False):
        raise NotImplementedError("a NaFlexVit with pos_embed_use_grid_sample=True is not supported (use False)")
    if embeds.pos_embed_type not in POSITION_EMBEDDINGS:
        raise NotImplementedError(
            f"model.embeds.pos_embed_type must be one of {POSITION_EMBEDDINGS}, got {embeds.pos_embed_type!r}"
        )
    if embeds.pos_embed_grid_size is None:
        raise NotImplementedError(
            "a NaFlexVit without a position-embedding grid (pos_embed_grid_size) is not supported"
        )
    return spec


def check_native_pruner(pruner: Pruner | None) -> None:
    """Raises ``NotImplementedError`` for a pruner whose counts a batch of several image sizes cannot follow: ATS
    with a sample count relative to the unpruned image (the same absolute count, ``num_samples``, runs)."""
    if pruner is not None and pruner.name == "ats" and getattr(pruner, "num_samples", None) is None:
        raise NotImplementedError(
            "ats on a NaFlexVit counts its samples from each image's own patches, which it does not do yet: build "
            "ATSPruner(num_samples=K) for the same K at every size"
        )


def native_refusal(pipeline) -> str | None:
    """Why a pipeline's native batches cannot replay from CUDA graphs (:mod:`ragged_vit.pipelines.graphs`, Native
    batches), or None: a pruner that appends a token (at a stage of per-image counts, a buffer with padding images has
    no room for it)."""
    pruner = pipeline.pruner
    if pruner is not None and pruner.appends_token:
        return f"pruner {pruner.name!r} appends a token (fuse_token), which native batches do only eagerly"
    return None


def native_image_size(model: NaFlexVit) -> tuple[int, int]:
    """The image size of the model's position-embedding grid (``pos_embed_grid_size`` times the patch size)."""
    (gh, gw), (p, q) = model.embeds.pos_embed_grid_size, model.embeds.patch_size
    return gh * p, gw * q


@dataclass(frozen=True, eq=False)
class NativeBatch:
    """A checked batch of images of their own sizes, as patch rows.

    Attributes:
        rows: ``[T_p, K]``: every image's patch rows, image after image, in the model's dtype and patch layout.
        grids: each image's patch grid ``(h, w)``.
        counts: each image's patches (``h * w`` for images; the valid rows of a patch dict).
        index: int64 ``[T_p]``: each row's place ``y * w + x`` in its image's grid (a patch dict's coordinates);
            None: row-major, as images are patchified.
    """

    rows: torch.Tensor
    grids: tuple[tuple[int, int], ...]
    counts: tuple[int, ...]
    index: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.grids)

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def max_patches(self) -> int:
        return max(self.counts)


def native_batch(model: NaFlexVit, images: object, device: torch.device, dtype: torch.dtype) -> NativeBatch:
    """Checks ``images`` (a list of ``[C, H, W]`` images, a ``[B, C, H, W]`` tensor, or NaFlex's patch dict) for
    ``model`` on ``device``; returns its patch rows cast to ``dtype``. Raises a one-line error naming the argument."""
    if isinstance(images, NativeBatch):
        return images
    if isinstance(images, dict):
        return _patch_dict(model, images, device, dtype)
    whole = None  # a [B, C, H, W] tensor: patchified at once
    if isinstance(images, torch.Tensor):
        whole = check_tensor(images, "images", ndim=4)
        images = list(whole.unbind(0))
        if not images:
            raise ValueError("images must hold at least one image, got batch size 0")
    elif not isinstance(images, (list, tuple)):
        raise TypeError(
            "images must be a list of [C, H, W] tensors, a [B, C, H, W] tensor or NaFlex's patch dict, got "
            f"{type(images).__name__}"
        )
    if not images:
        raise ValueError("images must hold at least one image, got an empty list")
    embeds = model.embeds
    (p, q), pad = embeds.patch_size, embeds.dynamic_img_pad
    channels_last = isinstance(embeds.proj, nn.Linear) and getattr(embeds, "channels_last", True)
    first, rows, grids = images[0], [], []
    for i, image in enumerate(images):
        name = f"images[{i}]"
        check_tensor(image, name, ndim=3)
        if not image.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {image.dtype}")
        channels, height, width = image.shape
        if channels != model.in_chans:
            raise ValueError(f"{name} must have {model.in_chans} channels, got shape {list(image.shape)}")
        if height == 0 or width == 0 or (not pad and (height % p or width % q)):
            raise ValueError(
                f"{name} must have a height that is a positive multiple of {p} and a width of {q}"
                f"{'' if not pad else ' (any positive size with dynamic_img_pad)'}, got shape {list(image.shape)}"
            )
        if image.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {image.dtype}, images[0] has {first.dtype}: give one dtype")
        if image.device != device:
            raise ValueError(f"{name} must be on the model's device {device}, got {image.device}")
    # Consecutive images of one size are patchified together (a few ops per size, not per image).
    runs = [whole] if whole is not None else [
        run[0][None] if len(run) == 1 else torch.stack(run)
        for run in (list(group) for _, group in itertools.groupby(images, key=lambda image: image.shape))
    ]  # fmt: skip
    for run in runs:
        run = run if run.dtype == dtype else run.to(dtype)  # (no cast op where none is needed)
        if pad:  # zeros at the bottom and right, as timm's dynamic_img_pad
            run = F.pad(run, (0, -run.shape[-1] % q, 0, -run.shape[-2] % p))
        grids += [(run.shape[-2] // p, run.shape[-1] // q)] * run.shape[0]
        rows.append(patch_rows(run, (p, q), channels_last))
    return NativeBatch(torch.cat(rows) if len(rows) > 1 else rows[0], tuple(grids), tuple(h * w for h, w in grids))


def _patch_dict(model: NaFlexVit, images: dict, device: torch.device, dtype: torch.dtype) -> NativeBatch:
    """A NaFlex patch dict (``patches [B, N, p*q*C]``, ``patch_coord [B, N, 2]`` (y, x), ``patch_valid [B, N]``):
    each image's valid rows, with their places in its grid (``max(coord) + 1`` per axis)."""
    missing = [key for key in PATCH_KEYS if key not in images]
    if missing:
        raise ValueError(f"images (a patch dict) must have the keys {PATCH_KEYS}, missing {missing}")
    if images.get("attn_mask") is not None:
        raise ValueError("images['attn_mask'] is not supported: the packed runtime attends within each image")
    embeds = model.embeds
    if not isinstance(embeds.proj, nn.Linear):
        raise ValueError("images as a patch dict needs a linear patch embedding (embed_proj_type='linear')")
    patches = check_tensor(images["patches"], "images['patches']", ndim=3)
    batch, length, width = patches.shape
    (p, q), channels = embeds.patch_size, model.in_chans
    if not patches.is_floating_point() or width != p * q * channels:
        raise ValueError(
            f"images['patches'] must be float [B, N, {p * q * channels}] (patches of {p}x{q}x{channels}), got "
            f"{patches.dtype} {list(patches.shape)}"
        )
    coord = check_tensor(images["patch_coord"], "images['patch_coord']", ndim=3)
    valid = check_tensor(images["patch_valid"], "images['patch_valid']", ndim=2)
    if tuple(coord.shape) != (batch, length, 2) or coord.is_floating_point():
        raise ValueError(f"images['patch_coord'] must be integer [{batch}, {length}, 2], got {list(coord.shape)}")
    if tuple(valid.shape) != (batch, length) or valid.dtype != torch.bool:
        raise ValueError(f"images['patch_valid'] must be bool [{batch}, {length}], got {valid.dtype}")
    for key, value in zip(PATCH_KEYS, (patches, coord, valid), strict=True):
        if value.device != device:
            raise ValueError(f"images[{key!r}] must be on the model's device {device}, got {value.device}")
    if batch == 0:
        raise ValueError("images['patches'] must hold at least one image, got batch size 0")
    counts = valid.sum(1).tolist()
    if min(counts) == 0:
        raise ValueError(f"images['patch_valid'] must mark at least one patch of every image, got counts {counts}")
    coord = coord[valid].long()  # [T_p, 2], image after image
    if bool((coord < 0).any()):
        raise ValueError("images['patch_coord'] must be non-negative (y, x) patch coordinates")
    size = images["patch_coord"].long().masked_fill(~valid[..., None], -1).amax(1) + 1  # [B, 2]: (h, w)
    grids = tuple(tuple(g) for g in size.tolist())
    image = torch.repeat_interleave(torch.arange(batch, device=device), valid.sum(1))
    index = coord[:, 0] * size[image, 1] + coord[:, 1]
    return NativeBatch(patches[valid].to(dtype), grids, tuple(counts), index)


POSITION_CHUNK_BYTES = 64 << 20  # the fp32 mixing weights of a learned table are built at most this much at once


def position_rows(embeds: nn.Module, batch: NativeBatch, dtype: torch.dtype) -> torch.Tensor | None:
    """``[T_p, C]``: each patch row's position embedding as NaFlexVit resamples its table to the row's image grid
    (:mod:`ragged_vit.reference.native`: a learned ``[gh, gw, C]`` table interpolated to ``h x w``, or to the square of
    the longer side and cropped, with ``pos_embed_ar_preserving``; a factorized one per axis, linearly), for every row
    of the batch at once: a row's embedding mixes the table by its two axes' interpolation weights
    (:func:`ragged_vit.reference.native.axis_weights`), in fp32 as the resampling is, then ``dtype``: a few launches
    for the batch, whatever its sizes, instead of one resampling per grid size. None without position embeddings."""
    kind = embeds.pos_embed_type
    if kind == "none":
        return None
    square = getattr(embeds, "pos_embed_ar_preserving", False)
    device, patches = batch.device, batch.rows.shape[0]
    lengths = [(max(h, w),) * 2 if square else (h, w) for h, w in batch.grids]  # each image's resampled axes
    # Per image: patches, grid width, and where its two axes' weights start in the stacked weights of lengths 1, 2, ..
    per_image = torch.tensor([batch.counts, [w for _, w in batch.grids], [ly * (ly - 1) // 2 for ly, _ in lengths],
                              [lx * (lx - 1) // 2 for _, lx in lengths]])  # fmt: skip
    if batch.index is None:  # an image list: every row's place is known on the host, its weight rows copied once
        place = places_in_images(cu_seqlens_from_counts(per_image[0]), patches)
        rows_y, rows_x = _weight_rows(place, *per_image, patches).to(device)
    else:  # a patch dict: the places are on the device
        rows_y, rows_x = _weight_rows(batch.index, *per_image.to(device), patches)
    longest = max(max(pair) for pair in lengths)
    if kind == "factorized":
        along_y, along_x = embeds.pos_embed_y[0], embeds.pos_embed_x[0]  # [Ly, C], [Lx, C]
        wy = _stacked_weights(along_y.shape[0], longest, "linear", False, False, device)[rows_y]
        wx = _stacked_weights(along_x.shape[0], longest, "linear", False, False, device)[rows_x]
        return (wy @ along_y.float() + wx @ along_x.float()).to(dtype)
    table = embeds.pos_embed[0]  # [gh, gw, C]
    (gh, gw, channels), mode = table.shape, embeds.pos_embed_interp_mode
    options = (mode, getattr(embeds, "pos_embed_align_corners", False), getattr(embeds, "pos_embed_antialias", True))
    stacked_y = _stacked_weights(gh, longest, *options, device)
    stacked_x = _stacked_weights(gw, longest, *options, device)
    flat = table.reshape(gh * gw, channels).float()
    step = max(1, POSITION_CHUNK_BYTES // (4 * gh * gw))
    chunks = [(stacked_y[rows_y[a : a + step], :, None] * stacked_x[rows_x[a : a + step], None, :]).flatten(1) @ flat
              for a in range(0, patches, step)]  # each row's [gh, gw] mixing weights times the table  # fmt: skip
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks)).to(dtype)


GRID_CACHE_GRIDS = 32
"""Grids whose position rows and rope tables a :class:`GridCache` keeps at the least (the most recently used, and
always every grid of the last batch; ViT-B's position rows at 32x32 patches: 1.5 MiB in fp16)."""


class _PerGrid:
    """Tensors by patch grid: the last batch's grids and the :data:`GRID_CACHE_GRIDS` used last, dropped together when
    ``key`` changes."""

    def __init__(self) -> None:
        self.items: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()
        self.key: tuple = ()

    def get(self, key: tuple, grids: Sequence[tuple[int, int]], make) -> list[torch.Tensor]:
        """The tensor of each of ``grids`` (``make(missing)``: one for each grid not kept, built together), all built
        anew when ``key`` changed."""
        if key != self.key:
            self.items.clear()
            self.key = key
        distinct = list(dict.fromkeys(grids))
        missing = [grid for grid in distinct if grid not in self.items]
        if missing:
            self.items.update(zip(missing, make(missing), strict=True))
        for grid in distinct:
            self.items.move_to_end(grid)
        while len(self.items) > max(GRID_CACHE_GRIDS, len(distinct)):  # a batch of many grids keeps them all
            self.items.popitem(last=False)
        return [self.items[grid] for grid in grids]


def _state(tensors) -> tuple:
    """What identifies tensors' values without reading them: storage, in-place writes, dtype."""
    return tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)


class GridCache:
    """What a native batch's front builds per patch grid, kept by its pipeline for the last batch's grids and the
    :data:`GRID_CACHE_GRIDS` used last, built anew when what it is made from changes (storage, in-place writes,
    dtype): each grid's position-embedding rows ``[h * w, C]`` (:func:`position_rows` of the grids a batch brings
    that are not kept, all in one resampling) and a RoPE model's table (timm's ``rope.get_embed(shape=grid)``). A
    batch of sizes met before resamples and rotates nothing on the host."""

    def __init__(self) -> None:
        self._positions, self._ropes = _PerGrid(), _PerGrid()

    def positions(self, embeds: nn.Module, batch: NativeBatch, dtype: torch.dtype) -> torch.Tensor | None:
        """``[T_p, C]``: :func:`position_rows` of an image list (row-major patches); None without position rows."""
        tables = _tables_of(embeds)
        if not tables:
            return None

        def make(grids: list[tuple[int, int]]) -> list[torch.Tensor]:  # every missing grid in one resampling
            sizes = tuple(h * w for h, w in grids)
            empty = batch.rows.new_empty((sum(sizes), 0))  # (the resampling reads the grids, not the rows)
            rows = position_rows(embeds, NativeBatch(empty, tuple(grids), sizes), dtype)
            return [part.clone() for part in rows.split(sizes)] if len(grids) > 1 else [rows]  # (no view keeps all)

        parts = self._positions.get((*_state(tables), dtype), batch.grids, make)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rope_tables(self, rope: nn.Module, grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """timm's rope table of each of ``grids``."""
        key = _state([*rope.parameters(), *rope.buffers()])
        return self._ropes.get(key, grids, lambda missing: [rope.get_embed(shape=grid) for grid in missing])


def _tables_of(embeds: nn.Module) -> list[torch.Tensor]:
    """The position-embedding tables the resampling reads (none without position embeddings)."""
    kind = embeds.pos_embed_type
    if kind == "none":
        return []
    return [embeds.pos_embed_y, embeds.pos_embed_x] if kind == "factorized" else [embeds.pos_embed]


def _weight_rows(place, counts, widths, first_y, first_x, patches: int) -> torch.Tensor:
    """int64 ``[2, T_p]``: each patch row's row in the stacked weights of its two axes (:func:`_stacked_weights`),
    from its ``place`` ``y * w + x`` in its grid and its image's count, width and first weight rows."""
    width = torch.repeat_interleave(widths, counts, output_size=patches)
    y = place // width
    return torch.stack([y, place - y * width]) + torch.repeat_interleave(torch.stack([first_y, first_x]), counts,
                                                                         dim=1, output_size=patches)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _stacked_weights(
    source: int, longest: int, mode: str, align_corners: bool, antialias: bool, device: torch.device
) -> torch.Tensor:
    """:func:`ragged_vit.reference.native.axis_weights` of every length ``1..L`` stacked (length ``l``'s from row
    ``l * (l - 1) / 2``) on ``device``, ``L`` being ``longest`` rounded up to a multiple of 32 (few variants)."""
    top = -(-longest // 32) * 32
    stacked = [axis_weights(source, length, mode, align_corners, antialias) for length in range(1, top + 1)]
    return torch.cat(stacked).to(device, torch.float32)


def table_rows(batch: NativeBatch, starts: Sequence[int]) -> torch.Tensor:
    """int64 ``[T_p]``: each patch row's row in a table holding image ``b``'s grid from row ``starts[b]`` on (its
    place ``y * w + x`` in its grid added); the host's integers in one copy."""
    device, patches, images = batch.device, batch.rows.shape[0], len(batch)
    if batch.index is not None:  # a patch dict: each row's place is on the device
        shifts, places = list(starts), batch.index
    else:  # rows in order: row r of image b, from row first[b] of the batch, is at place r - first[b]
        first = itertools.accumulate(batch.counts, initial=0)
        shifts, places = [s - f for s, f in zip(starts, first, strict=False)], torch.arange(patches, device=device)
    shift, counts = host_ints([*shifts, *batch.counts], device).split([images, images])
    return places + torch.repeat_interleave(shift, counts, output_size=patches)


def native_rotary(pipeline, batch: NativeBatch, patch_slots: torch.Tensor | None, total: int) -> RotaryRows:
    """The rotation of a native batch's ``total`` packed rows: timm's rope table of each distinct grid
    (``rope.get_embed(shape=grid)``, the one its forward gives an image of that grid; kept by the pipeline's
    :class:`GridCache`), concatenated along the positions; each patch row (at row ``patch_slots`` of the buffer, None:
    rows in order) at its place in its grid's table, every other row ``-1`` (unrotated)."""
    rope, grids = pipeline.model.rope, list(dict.fromkeys(batch.grids))
    tables = pipeline.grid_cache.rope_tables(rope, grids)
    for (h, w), table in zip(grids, tables, strict=True):
        if table.shape[-2] != h * w:
            raise NotImplementedError(
                f"model.rope ({type(rope).__name__}) gives a table of {table.shape[-2]} positions for a {h}x{w} grid: "
                "a rope of a fixed feature shape does not follow each image's grid"
            )
    offsets = dict(zip(grids, itertools.accumulate((h * w for h, w in grids), initial=0), strict=False))
    patches = table_rows(batch, [offsets[grid] for grid in batch.grids]).to(torch.int32)
    if patch_slots is None:
        positions = patches
    else:
        positions = patches.new_full((total,), -1).index_copy_(0, patch_slots, patches)
    return rotary_at(pipeline.rope, torch.cat(tables, dim=-2), pipeline._rope_blocks, positions)


def embed_rows(embeds: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The patch embedding of patch rows ``[T_p, K]`` -> ``[T_p, C]``: the model's input norm and Linear, or its
    convolution as a GEMM on (channel, y, x) rows; then its norm."""
    proj = embeds.proj
    if isinstance(proj, nn.Linear):
        norm_input = getattr(embeds, "norm_input", None)
        x = proj(rows if norm_input is None else norm_input(rows))
    else:
        x = F.linear(rows, proj.weight.reshape(proj.out_channels, -1), proj.bias)
    return embeds.norm(x)


def prefix_tokens(embeds: nn.Module) -> torch.Tensor | None:
    """``[P, C]``: the class token then the register tokens (None without any)."""
    tokens = [t[0] for t in (embeds.cls_token, embeds.reg_token) if t is not None]
    return torch.cat(tokens) if tokens else None


def native_front(pipeline, parts, batch: NativeBatch, blocks: Sequence[int]) -> ForwardState:
    """FRONT for a native batch: the packed buffer ``[T, C]`` (each image's prefix rows, then its patches with their
    resampled position embeddings, ``norm_pre``) and its offsets, then ``blocks`` run packed."""
    model = pipeline.model
    embeds, prefix, device = model.embeds, model.num_prefix_tokens, batch.device
    x = embed_rows(embeds, batch.rows)
    if batch.index is not None:  # a patch dict's places are on the device: resampled per call
        positions = position_rows(embeds, batch, x.dtype)
    else:
        positions = pipeline.grid_cache.positions(embeds, batch, x.dtype)
    if positions is not None:
        x = x + positions
    images, patches = len(batch), x.shape[0]
    # What the host knows, in one copy (a few host ops less per call): each image's patches and offsets, and with
    # prefix rows each prefix row's row and how far each image's patch rows move for the prefix rows up to its own.
    offsets = list(itertools.accumulate((count + prefix for count in batch.counts), initial=0))
    values, sizes = [*batch.counts, *offsets], [images, images + 1]
    if prefix:
        values += [start + j for start in offsets[:-1] for j in range(prefix)]  # the prefix rows' rows
        values += [prefix * (b + 1) for b in range(images)]  # each image's patch rows' shift
        sizes += [images * prefix, images]
    ints = host_ints(values, device).split(sizes)
    counts, cu = ints[0], ints[1].to(torch.int32)
    slots = None  # each patch row's row in the buffer (None: in order, no prefix rows)
    if prefix:
        rows = x.new_empty(patches + images * prefix, x.shape[1])
        slots = torch.arange(patches, device=device) + torch.repeat_interleave(ints[3], counts, output_size=patches)
        rows.index_copy_(0, slots, x)
        rows.index_copy_(0, ints[2], prefix_tokens(embeds).to(x.dtype).repeat(images, 1))
        x = rows
    x = model.norm_pre(embeds.pos_drop(x))
    ragged = len(set(batch.counts)) > 1
    state = ForwardState(images, x, cu, batch.max_patches + prefix, batch.max_patches,
                         image_patches=counts if ragged else None)  # fmt: skip
    if pipeline.rope is not None:
        state.rotary = native_rotary(pipeline, batch, slots, x.shape[0])
    if blocks:
        group = [model.blocks[k] for k in blocks]
        state.x = parts.blocks(group, state.x, cu, state.max_seqlen, pipeline.backend, rotary=state.rotary)
    return state
