"""The command-line pieces the demo (:mod:`.cli`) and ``validate`` (:mod:`.validate`) share.

Nothing here imports torch, timm or triton at import time, so that ``--help`` is answered at once: the parsers take
their choices from :data:`BACKEND_NAMES` and :data:`PRUNER_NAMES`, which the tests keep equal to the registries
(:data:`ragged_vit.pipelines.backends.BACKENDS`, :data:`ragged_vit.PRUNERS` and ``"none"``). torch is imported when a
``--device`` is read; timm (which imports ``triton.language``) only inside :func:`interpreter_env`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported once a device is read
    import torch

PROG = "ragged-vit"
DTYPES = ("float32", "float16", "bfloat16")  # torch's names
BACKEND_NAMES = ("reference", "padded_sdpa", "fa2_varlen", "nested_sdpa", "triton")
"""The attention backends, in the registry's order (:data:`ragged_vit.pipelines.backends.BACKENDS`)."""
PRUNER_NAMES = ("threshold_l2", "dynamicvit", "evit", "ats", "tome", "none")
"""The pruners, in the registry's order, and ``none`` (:data:`ragged_vit.pipelines.factory.PRUNER_NAMES`)."""

COMPILED_WARMUP = 3
"""Untimed calls at least before the demo times a compiled or graphed forward: compilation, CUDA-graph recording, a
replay."""

ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError)
"""What a command reports as a one-line error with exit status 2 (unusable data, model, checkpoint or options)."""


def _keep_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def int_at_least(minimum: int, what: str):
    """An argparse type: an int ``>= minimum``, else the error ``must be a <what> integer``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {value}")
        return value

    return parse


positive, non_negative = int_at_least(1, "positive"), int_at_least(0, "non-negative")


def device(text: str) -> torch.device:
    """An argparse type: ``auto`` (CUDA if available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text} requested but CUDA is not available")
    return parsed


def on_cpu(text: str) -> bool:
    """Whether ``--device text`` runs on the CPU (False for a device that does not parse: the command reports it)."""
    try:
        return device(text).type == "cpu"
    except argparse.ArgumentTypeError:
        return False


@contextlib.contextmanager
def interpreter_env(cpu: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for a CPU run, unless the variable is set, then the variable as it was.

    On a CPU the Triton kernels run under Triton's interpreter, which must be switched on before timm (which imports
    ``triton.language``) is imported. The flag is read whenever a ``@triton.jit`` kernel is defined, so a caller
    running a command in its own process would otherwise get its later kernels (Inductor's, on a GPU) built for the
    interpreter.
    """
    before = os.environ.get("TRITON_INTERPRET")
    if cpu and before is None:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)


def add_pruner_arguments(parser: argparse.ArgumentParser, calibrated_on: str) -> None:
    """--pruner, --keep-rate, --threshold-mode, --threshold, --fuse-token, --r and --r-max (the CLI's and
    validate's)."""
    parser.add_argument("--pruner", default="threshold_l2", choices=PRUNER_NAMES, help="pruning method")
    parser.add_argument("--keep-rate", type=_keep_rate, help="keep rate in (0, 1] (default 0.5)")
    parser.add_argument(
        "--threshold-mode",
        choices=("ratio", "calibrated", "threshold"),
        help=f"threshold_l2 mode (default ratio; calibrated: on {calibrated_on})",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        help="threshold_l2: the norm to keep (--threshold-mode threshold); tome: the similarity to merge (--r-max)",
    )
    parser.add_argument("--fuse-token", action="store_true", default=None, help="evit: fuse dropped tokens into one")
    parser.add_argument("--r", type=positive, help="tome: rows merged per image and block (default: by --keep-rate)")
    parser.add_argument(
        "--r-max",
        type=positive,
        help="tome: the most rows merged per image and block; with --threshold: adaptive; alone: calibrated (the "
        f"threshold set on {calibrated_on} for a mean of --keep-rate of the patches per image and block)",
    )


def _model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``: a ``timm.create_model`` argument, VALUE a Python literal or a bare word."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE with a timm.create_model argument name, got {text!r}")
    if key == "pretrained":
        raise argparse.ArgumentTypeError("pretrained would download weights: pass a local file with --checkpoint")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word: a string (global_pool=avg)
    return key, parsed


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--model-arg``, shared by the demo and ``validate``."""
    parser.add_argument(
        "--model", help="timm model name (default: deit_tiny_patch16_224 on CPU, deit_base_patch16_224 on CUDA)"
    )
    parser.add_argument(
        "--model-arg",
        type=_model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="timm.create_model argument, repeatable (num_classes=100, img_size=384, global_pool=avg); "
        "VALUE is a Python literal or a bare word",
    )


_PRUNER_FLAGS = {
    "threshold_mode": "--threshold-mode", "threshold": "--threshold", "fuse_token": "--fuse-token", "r": "--r",
    "r_max": "--r-max",
}  # fmt: skip


def pruner_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, object]:
    """The pruner's own options given (``add_pruner_arguments``' flags), checked: a flag the pruner does not take, or
    that would do nothing with the others given, is an error (``parser.error``: status 2). Imports timm: call it
    inside :func:`interpreter_env`."""
    from ..factory import pruner_options

    options = {name: getattr(args, name) for name in _PRUNER_FLAGS if getattr(args, name) is not None}
    for name in sorted(set(options) - set(pruner_options(args.pruner))):
        parser.error(f"argument {_PRUNER_FLAGS[name]}: not an option of --pruner {args.pruner}")
    threshold_mode = args.threshold_mode == "threshold"
    if args.pruner == "threshold_l2" and threshold_mode and args.threshold is None:
        parser.error("argument --threshold-mode: threshold needs --threshold VALUE (the norm to keep)")
    if args.pruner == "tome":
        _check_tome(parser, args)
    elif args.threshold is not None and not threshold_mode:
        parser.error("argument --threshold: used only with --threshold-mode threshold")
    if args.keep_rate is not None and threshold_mode:
        parser.error("argument --keep-rate: not used with --threshold-mode threshold (--threshold decides)")
    return options


def _check_tome(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """tome's modes: ``--r`` (fixed), ``--threshold`` with ``--r-max`` (adaptive), ``--r-max`` alone (calibrated: the
    threshold is calibrated to the keep rate), or none of them (``r`` from the keep rate)."""
    if args.r is not None and args.threshold is not None:
        parser.error("argument --threshold: tome merges a fixed --r or by --threshold (adaptive), not both")
    if args.r is not None and args.r_max is not None:
        parser.error("argument --r-max: caps tome's adaptive or calibrated mode, not a fixed --r")
    if args.threshold is not None and args.r_max is None:
        parser.error("argument --threshold: tome's adaptive mode needs --r-max too")
    if args.keep_rate is not None and (args.r is not None or args.threshold is not None):
        parser.error("argument --keep-rate: not used with --r or --threshold (they set tome's merges)")


def packs_unpruned(model: str | None) -> bool:
    """Whether timm's model ``model`` runs its blocks packed without a pruner, so that an attention backend applies
    with ``--pruner none``: a NaFlexVit (a native batch has no dense batch for timm's blocks). Imports timm (call it
    inside :func:`interpreter_env`)."""
    from timm.models import is_model_in_modules

    return model is not None and is_model_in_modules(model, ["naflexvit"])


def check_checkpoint_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--seed`` with ``--checkpoint``, or ``--strip-prefix`` without it, would do nothing: an error (status 2)."""
    if args.seed is not None and args.checkpoint is not None:
        parser.error("argument --seed: seeds the random weights, which --checkpoint replaces")
    if args.strip_prefix is not None and args.checkpoint is None:
        parser.error("argument --strip-prefix: applies to --checkpoint's keys, and no --checkpoint is given")
