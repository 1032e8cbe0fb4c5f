"""Models and weights from local files only: ``timm.create_model`` without downloads, strict checkpoint loading.

:func:`create_model` builds a timm model by name with ``pretrained=False`` (random weights, no network);
:func:`load_checkpoint` reads a LOCAL checkpoint into the model and, for DynamicViT, its pruner. Official DeiT
checkpoints (``{"model": state_dict}`` with timm's key names) and DynamicViT's (the same, plus
``score_predictor.*``) load as they are; EViT and ATS have no weights of their own. Training checkpoints load too:
DeiT's and DynamicViT's ``{"model", "optimizer", "lr_scheduler", "epoch", "model_ema", "scaler", "args"}`` (``args``
an ``argparse.Namespace``) and timm's ``{"state_dict", "state_dict_ema", "args", ...}``; only the model's state dict
is used. Files are read with ``torch.load(weights_only=True)``, which runs no pickled code: besides tensors, numbers,
strings and containers it accepts only :data:`SAFE_GLOBALS` (``argparse.Namespace``, a class whose unpickling sets
attributes and nothing else). A DistributedDataParallel checkpoint (every key under ``module.``) loads with
``strip_prefix="module."``. Loading is strict: missing, unexpected or mis-shaped keys raise a ``ValueError`` that
lists them, and so does a file that is not a checkpoint (each message names the file). Nothing here ever downloads.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
from pathlib import Path

import timm
import torch
from torch import nn

from ..core.selection import Pruner

_LISTED = 8  # keys shown per error message

SAFE_GLOBALS: tuple[type, ...] = (argparse.Namespace,)
"""The classes besides torch's own defaults that checkpoints may pickle: DeiT / DynamicViT / timm training checkpoints
keep their command-line arguments as an ``argparse.Namespace`` (``args``)."""

STATE_DICT_KEYS: tuple[str, ...] = ("model", "state_dict", "model_ema", "state_dict_ema")
"""Where a checkpoint dict keeps the model's state dict, in the order they are looked up (DeiT and DynamicViT:
``model``; timm's training script: ``state_dict``; the EMA copies only where no other is present)."""


def create_model(name: str, **kwargs: object) -> nn.Module:
    """``timm.create_model(name, **kwargs)`` that never downloads: random weights, or (``pretrained=True``) timm's
    own loading of a LOCAL file given as ``pretrained_cfg_overlay=dict(file=PATH)``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: timm has no model called ``name`` (the message lists similar names), or ``pretrained=True``
            without a local file.
        FileNotFoundError: the ``pretrained_cfg_overlay`` file does not exist.
        TypeError or ValueError: timm refused one of ``kwargs`` (the message names the call).
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    if kwargs.get("pretrained"):
        overlay = kwargs.get("pretrained_cfg_overlay")
        file = overlay.get("file") if isinstance(overlay, dict) else None
        if file is None:
            raise ValueError(
                "pretrained=True would download weights: pass a local checkpoint file (checkpoint=PATH, or "
                "pretrained_cfg_overlay=dict(file=PATH))"
            )
        if not Path(file).is_file():
            raise FileNotFoundError(f"pretrained_cfg_overlay file not found: {file} (weights are never downloaded)")
    if not timm.is_model(name):
        similar = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(map(repr, similar))}?" if similar else "timm.list_models() lists them"
        raise ValueError(f"model {name!r} is not a timm model: {hint}")
    try:
        return timm.create_model(name, **{"pretrained": False, **kwargs})
    except (TypeError, ValueError, AssertionError) as e:  # timm's own check of an argument (a size, a count)
        if not kwargs:
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        kind = ValueError if isinstance(e, AssertionError) else type(e)  # timm asserts some: still a bad argument
        raise kind(f"timm.create_model({name!r}, {given}) failed: {e}") from e


def _first_sentence(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).split(". ", 1)[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read(path: Path) -> object:
    """``torch.load(path, weights_only=True)`` with :data:`SAFE_GLOBALS` allowed; any failure is a one-line
    ``ValueError`` naming the file."""
    serialization = torch.serialization
    if hasattr(serialization, "safe_globals"):  # torch >= 2.5: allowed for this load only
        allowed = serialization.safe_globals(list(SAFE_GLOBALS))
    else:  # torch 2.4: process-wide
        serialization.add_safe_globals(list(SAFE_GLOBALS))
        allowed = contextlib.nullcontext()
    try:
        with allowed:
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever the unpickler meets: the file is not a loadable checkpoint
        text = str(e)
        refused = re.search(r"GLOBAL ([\w.]+)", text)
        if refused is not None:
            allowed_names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS)
            raise ValueError(
                f"checkpoint {path} pickles {refused.group(1)}, which torch.load(weights_only=True) does not load "
                f"(no pickled code runs; besides tensors and plain containers only {allowed_names}): save a state "
                "dict (model.state_dict()) instead, or the file is corrupt"
            ) from None
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        detail = _first_sentence(reason.group(1) if reason is not None else text)
        raise ValueError(
            f"checkpoint {path} is not a readable torch.save file (corrupt or truncated?): "
            f"{type(e).__name__}{': ' + detail if detail else ''}"
        ) from None


def _state_dict_of(obj: object, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        held = f"a dict with keys {_listed(sorted(map(str, obj)))}" if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(
            f"checkpoint {path} must hold a state dict (name -> tensor), raw or under "
            f"{', '.join(map(repr, STATE_DICT_KEYS))}, got {held}"
        )
    return obj


def _strip(state: dict[str, torch.Tensor], prefix: str, path: Path) -> dict[str, torch.Tensor]:
    if not any(k.startswith(prefix) for k in state):
        raise ValueError(
            f"checkpoint {path}: no key starts with strip_prefix {prefix!r} (its keys: {_listed(list(state))})"
        )
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _check_prefix(state: dict[str, torch.Tensor], modules: list[nn.Module], path: Path) -> None:
    """Every key under one first component that no module has (DDP's ``module.``): suggest ``strip_prefix``."""
    heads = {k.split(".", 1)[0] for k in state}
    if len(heads) != 1 or not all("." in k for k in state):
        return
    (head,) = heads
    if any(head in {k.split(".", 1)[0] for k in m.state_dict()} for m in modules):
        return
    origin = " (saved from a DistributedDataParallel model)" if head == "module" else ""
    raise ValueError(
        f"checkpoint {path}: every key starts with {head + '.'!r}{origin}: pass strip_prefix={head + '.'!r} "
        f"(command line: --strip-prefix {head}.)"
    )


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LISTED])
    return shown + (f", ... ({len(keys) - _LISTED} more)" if len(keys) > _LISTED else "")


def _check_keys(module: nn.Module, state: dict[str, torch.Tensor], path: Path, what: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if shapes:
        problems.append(f"shape mismatches (checkpoint vs {what}) ({len(shapes)}): {_listed(shapes)}")
    if problems:
        hint = _architecture_hint(state) if shapes or missing else ""
        raise ValueError(f"checkpoint {path} does not fit the {what}: " + "; ".join(problems) + hint)


_WIDTHS = {192: "deit_tiny_patch16_224", 384: "deit_small_patch16_224", 768: "deit_base_patch16_224",
           1024: "vit_large_patch16_224", 1280: "vit_huge_patch14_224"}  # fmt: skip
"""A timm model of each common ViT width, for :func:`_architecture_hint`."""


def _architecture_hint(state: dict[str, torch.Tensor]) -> str:
    """What a ViT checkpoint holds (width, depth, patch, classes) and a ``--model`` / ``--model-arg`` it fits, or
    ``""`` for a checkpoint that is no timm ViT's."""
    proj, head = state.get("patch_embed.proj.weight"), state.get("head.weight")
    if proj is None or proj.dim() != 4:
        return ""
    width, patch = proj.shape[0], proj.shape[-1]
    depth = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.") and k.split(".")[1].isdigit()),
                    default=-1)  # fmt: skip
    classes = head.shape[0] if head is not None and head.dim() == 2 else None
    facts = f"width {width}, {depth} blocks, {patch}x{patch} patches" + (f", {classes} classes" if classes else "")
    model = _WIDTHS.get(width)
    other = classes and classes != 1000
    kwargs, args = (f", num_classes={classes}", f" --model-arg num_classes={classes}") if other else ("", "")
    suggestion = (f"; its width is {model!r}'s: create_model({model!r}{kwargs}) (command line: --model {model}{args}), "
                  "if depth and patch size agree" if model else "")  # fmt: skip
    return f" (the checkpoint is a ViT of {facts}{suggestion})"


def load_checkpoint(
    model: nn.Module, pruner: Pruner | None, path: str | os.PathLike, *, strip_prefix: str | None = None
) -> None:
    """Loads a local checkpoint into ``model`` and, for keys under the pruner's submodules, into ``pruner``.

    Args:
        model: the timm model (keys as in ``model.state_dict()``).
        pruner: the pruner, or None. Checkpoint keys whose first component names one of the pruner's submodules
            (DynamicViT: ``score_predictor``) are the pruner's; all others are the model's.
        path: a local ``torch.save`` file: a state dict, or a dict holding it under one of
            :data:`STATE_DICT_KEYS` (official DeiT and DynamicViT releases and training checkpoints: ``"model"``).
            Read with ``weights_only=True`` (no pickled code runs; :data:`SAFE_GLOBALS` allowed).
        strip_prefix: removed from the start of every key that has it (``"module."`` for a checkpoint saved from a
            ``DistributedDataParallel`` model); an error if no key has it.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a readable checkpoint (corrupt, or it pickles objects other than tensors,
            containers and :data:`SAFE_GLOBALS`), holds no state dict, has every key under a prefix the model does
            not have (the message suggests ``strip_prefix``), or keys are missing, unexpected or of the wrong shape
            (for the model or the pruner); nothing is loaded then.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or path, got {type(path).__name__}")
    if strip_prefix is not None and not isinstance(strip_prefix, str):
        raise TypeError(f"strip_prefix must be a str or None, got {type(strip_prefix).__name__}")
    if strip_prefix == "":
        raise ValueError("strip_prefix must not be empty (None strips nothing)")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a directory: pass the checkpoint file in it (.pth, .pt, .bin)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path} (weights are never downloaded; pass a local file)")
    state = _state_dict_of(_read(path), path)
    if strip_prefix is not None:
        state = _strip(state, strip_prefix, path)
    _check_prefix(state, [model] if pruner is None else [model, pruner], path)
    owned = {name for name, _ in pruner.named_children()} if pruner is not None else set()
    pruner_state = {k: v for k, v in state.items() if k.split(".", 1)[0] in owned}
    model_state = {k: v for k, v in state.items() if k not in pruner_state}
    _check_keys(model, model_state, path, "model")
    if pruner is not None and pruner.state_dict():
        _check_keys(pruner, pruner_state, path, f"{pruner.name} pruner")
    model.load_state_dict(model_state, strict=True)
    if pruner_state:
        pruner.load_state_dict(pruner_state, strict=True)
