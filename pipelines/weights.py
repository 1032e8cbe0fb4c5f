"""Models and weights from local files only: ``timm.create_model`` without downloads, strict checkpoint loading.

:func:`create_model` builds a timm model by name with ``pretrained=False`` (random weights, no network);
:func:`load_checkpoint` reads a LOCAL checkpoint into the model and, for DynamicViT, its pruner. Official DeiT
checkpoints (``{"model": state_dict}`` with timm's key names) and DynamicViT's (the same, plus
``score_predictor.*``) load as they are; EViT and ATS have no weights of their own. Loading is strict: missing,
unexpected or mis-shaped keys raise a ``ValueError`` that lists them. Nothing here ever downloads.
"""

from __future__ import annotations

import os
from pathlib import Path

import timm
import torch
from torch import nn

from ragged_vit.core.selection import Pruner

_LISTED = 8  # keys shown per error message


def create_model(name: str, **kwargs: object) -> nn.Module:
    """``timm.create_model(name, **kwargs)`` that never downloads: random weights, or (``pretrained=True``) timm's
    own loading of a LOCAL file given as ``pretrained_cfg_overlay=dict(file=PATH)``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: timm has no model called ``name`` (the message lists similar names), or ``pretrained=True``
            without a local file.
        FileNotFoundError: the ``pretrained_cfg_overlay`` file does not exist.
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
        family = name.split("_")[0] + "*"
        similar = timm.list_models(family)[:12] or timm.list_models("deit*")
        raise ValueError(f"model {name!r} is not a timm model; similar names: {', '.join(similar)}")
    return timm.create_model(name, **{"pretrained": False, **kwargs})


def _state_dict_of(obj: object, path: Path) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ValueError(
            f"checkpoint {path} must hold a state dict (name -> tensor), raw or under 'model', got {type(obj).__name__}"
        )
    return obj


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
        raise ValueError(f"checkpoint {path} does not fit the {what}: " + "; ".join(problems))


def load_checkpoint(model: nn.Module, pruner: Pruner | None, path: str | os.PathLike) -> None:
    """Loads a local checkpoint into ``model`` and, for keys under the pruner's submodules, into ``pruner``.

    Args:
        model: the timm model (keys as in ``model.state_dict()``).
        pruner: the pruner, or None. Checkpoint keys whose first component names one of the pruner's submodules
            (DynamicViT: ``score_predictor``) are the pruner's; all others are the model's.
        path: a local ``torch.save`` file: a state dict, or a dict holding it under ``"model"`` (official DeiT,
            DynamicViT) or ``"state_dict"``. Read with ``weights_only=True`` (no code is unpickled).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file holds no state dict, or keys are missing, unexpected or of the wrong shape (for the
            model or the pruner); nothing is loaded then.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or path, got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path} (weights are never downloaded; pass a local file)")
    state = _state_dict_of(torch.load(path, map_location="cpu", weights_only=True), path)
    owned = {name for name, _ in pruner.named_children()} if pruner is not None else set()
    pruner_state = {k: v for k, v in state.items() if k.split(".", 1)[0] in owned}
    model_state = {k: v for k, v in state.items() if k not in pruner_state}
    _check_keys(model, model_state, path, "model")
    if pruner is not None and pruner.state_dict():
        _check_keys(pruner, pruner_state, path, f"{pruner.name} pruner")
    model.load_state_dict(model_state, strict=True)
    if pruner_state:
        pruner.load_state_dict(pruner_state, strict=True)
