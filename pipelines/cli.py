"""``python -m ragged_vit`` / ``ragged-vit``: classify real images with a token-pruned DeiT on several backends,
and time it against the unpruned timm model (:mod:`ragged_vit.pipelines.demo`).

Examples::

    python -m ragged_vit                                   # CPU: deit_tiny, 4 scikit-image photos, reference+triton
    python -m ragged_vit --pruner evit --keep-rate 0.7 --fuse-token --verbose
    python -m ragged_vit --model deit_base_patch16_224 --checkpoint deit_base.pth --images ~/photos
    python -m ragged_vit --checkpoint ddp_run/checkpoint.pth --strip-prefix module.
    python -m ragged_vit --device cuda --backends triton,padded_sdpa,fa2_varlen,nested_sdpa --batch-repeats 16
    python -m ragged_vit validate ~/imagenet/val --checkpoint deit_base.pth --compare-unpruned   # the subcommand

``--version`` alone is answered before anything else is imported. The device is read first, with only argparse, os
and torch imported: on a CPU the Triton kernels run under Triton's
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before timm (which imports ``triton.language``) is
imported; :func:`interpreter_env` switches it on for the run only (a caller that runs ``main`` in its own process
keeps compiled kernels afterwards: Inductor's, on its GPU). Then the registries are imported and give the parser its
choices: the attention backends (:data:`ragged_vit.pipelines.backends.BACKENDS`) and the pruners
(:data:`ragged_vit.reference.pruners.PRUNERS`). Errors in the arguments (unknown names, keep rate outside (0, 1],
missing files, a backend that cannot run on the device, an option the pruner does not take, an option that does
nothing with the others given) and unusable inputs (an image or checkpoint file that cannot be read, a model that is
not a timm ViT) exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported once the arguments ask for more than --version
    import torch

_PROG = "ragged-vit"
_DTYPES = ("float32", "float16", "bfloat16")  # torch's names (torch is imported once the device is read)


def _keep_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _int_at_least(minimum: int, what: str):
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


_positive, _non_negative = _int_at_least(1, "positive"), _int_at_least(0, "non-negative")


def _device(text: str) -> torch.device:
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text} requested but CUDA is not available")
    return device


def _device_of(argv: list[str] | None) -> torch.device | None:
    """The ``--device`` of ``argv`` (None if it is malformed: the full parser then reports it)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--device", default="auto")
    try:
        return _device(early.parse_known_args(argv)[0].device)
    except argparse.ArgumentTypeError:
        return None


def add_pruner_arguments(parser: argparse.ArgumentParser, calibrated_on: str) -> None:
    """--pruner, --keep-rate, --threshold-mode, --threshold, --fuse-token, --r and --r-max (the CLI's and
    validate's)."""
    from .factory import PRUNER_NAMES

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
    parser.add_argument("--r", type=_positive, help="tome: rows merged per image and block (default: by --keep-rate)")
    parser.add_argument(
        "--r-max",
        type=_positive,
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


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser; its backend and pruner choices come from the registries (which import timm and triton)."""
    from .. import __version__
    from .backends import BACKENDS
    from .demo import COMPILED_WARMUP

    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Classify images with a token-pruned timm DeiT through ragged (packed) attention backends; "
        "print top-1 predictions, kept tokens, backend agreement and speed against the unpruned timm model.",
        epilog=f"Accuracy on an image folder (ImageFolder layout), also under torchrun: {_PROG} validate DATA_DIR "
        f"[options] ({_PROG} validate --help).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_model_arguments(parser)
    add_pruner_arguments(parser, calibrated_on="the given images")
    parser.add_argument(
        "--backends",
        help="comma-separated list from: "
        + ", ".join(BACKENDS)
        + " (default: reference,triton on CPU; triton,fa2_varlen,padded_sdpa on CUDA); "
        "the first one prunes, the others replay its decisions; on CUDA the first one is timed",
    )
    parser.add_argument(
        "--images",
        nargs="+",
        help="image files, folders or scikit-image sample names (default: chelsea astronaut coffee rocket)",
    )
    parser.add_argument(
        "--checkpoint",
        help="local checkpoint file (DeiT / DynamicViT releases or training checkpoints); random weights without it",
    )
    parser.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="remove PREFIX from the checkpoint's keys (module. for a DistributedDataParallel checkpoint)",
    )
    parser.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *_DTYPES),
        help="activation dtype (default: float32 on CPU, float16 on CUDA)",
    )
    parser.add_argument(
        "--batch-repeats",
        type=_positive,
        help="the large timed batch = the images repeated this many times (default: up to 64 images on CUDA, "
        "once on CPU); B=1 is timed too",
    )
    parser.add_argument(
        "--timed-runs", type=_positive, help="timed forwards per row and batch (default 5 on CPU, 20 on CUDA)"
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        help=f"untimed forwards first (default 2 on CPU, 3 on CUDA; compiled rows at least {COMPILED_WARMUP})",
    )
    parser.add_argument("--seed", type=int, help="seed of the random weights (default 0; not with --checkpoint)")
    parser.add_argument("-v", "--verbose", action="store_true", help="top-5 predictions per image (default top-1)")
    parser.add_argument(
        "--threads",
        type=_positive,
        help="CPU threads for torch (default: torch's own choice; 1 "
        "is much faster when another process keeps a core busy)",
    )
    return parser


_PRUNER_FLAGS = {
    "threshold_mode": "--threshold-mode", "threshold": "--threshold", "fuse_token": "--fuse-token", "r": "--r",
    "r_max": "--r-max",
}  # fmt: skip


def pruner_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, object]:
    """The pruner's own options given (``add_pruner_arguments``' flags), checked: a flag the pruner does not take, or
    that would do nothing with the others given, is an error (``parser.error``: status 2)."""
    from .factory import pruner_options

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


def _check_unused(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An option that would do nothing with the others given is an error (``parser.error``: status 2)."""
    if args.pruner == "none":
        for flag, value in (("--keep-rate", args.keep_rate), ("--backends", args.backends)):
            if value is not None:
                parser.error(f"argument {flag}: not used with --pruner none (timm's own forward, nothing packed)")
    if args.seed is not None and args.checkpoint is not None:
        parser.error("argument --seed: seeds the random weights, which --checkpoint replaces")
    if args.strip_prefix is not None and args.checkpoint is None:
        parser.error("argument --strip-prefix: applies to --checkpoint's keys, and no --checkpoint is given")


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs the demo; returns the exit status. ``validate ...`` runs the
    ``validate`` subcommand instead (:mod:`ragged_vit.pipelines.validate`)."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words == ["--version"]:  # answered before torch is imported
        from .. import __version__

        print(f"{_PROG} {__version__}")
        return 0
    if words[:1] == ["validate"]:
        from .validate import main as validate

        return validate(words[1:], prog=f"{_PROG} validate")
    device = _device_of(argv)
    with interpreter_env(device is not None and device.type == "cpu"):
        return _demo(argv)


@contextlib.contextmanager
def interpreter_env(cpu: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for a CPU run, unless the variable is set (before timm imports triton.language: see
    the module docstring), then the variable as it was: the flag is read whenever a ``@triton.jit`` kernel is
    defined, so a caller running the CLI in its own process would otherwise get its later kernels (Inductor's, on a
    GPU) built for the interpreter."""
    before = os.environ.get("TRITON_INTERPRET")
    if cpu and before is None:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)


def _demo(argv: list[str] | None) -> int:
    """The demo command (:func:`main` without the subcommand), in the interpreter setting of its device."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device
    on_gpu = device.type == "cuda"

    from .backends import BACKENDS

    defaults = "triton,fa2_varlen,padded_sdpa" if on_gpu else "reference,triton"
    if args.pruner == "none":  # no packed block: one backend, which is not used
        defaults = defaults.split(",", 1)[0]
    backends = (args.backends or defaults).split(",")
    backends = [b.strip() for b in backends if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        parser.error(
            f"argument --backends: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
            f"known: {', '.join(BACKENDS)}"
        )
    if len(set(backends)) != len(backends):
        parser.error(f"argument --backends: each backend once, got {','.join(backends)}")
    options = pruner_arguments(parser, args)
    _check_unused(parser, args)

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from .demo import DemoOptions, run_demo

    demo = DemoOptions(
        model=args.model or ("deit_base_patch16_224" if on_gpu else "deit_tiny_patch16_224"),
        model_kwargs=dict(args.model_arg),
        pruner=args.pruner,
        keep_rate=0.5 if args.keep_rate is None else args.keep_rate,
        backends=backends,
        device=device,
        dtype=getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float16 if on_gpu else torch.float32),
        images=args.images,
        checkpoint=args.checkpoint,
        strip_prefix=args.strip_prefix,
        pruner_options=options,
        batch_repeats=args.batch_repeats,
        timed_runs=args.timed_runs or (20 if on_gpu else 5),
        warmup=args.warmup if args.warmup is not None else (3 if on_gpu else 2),
        verbose=args.verbose,
        seed=args.seed or 0,
    )
    try:
        with torch.no_grad():  # not inference_mode: torch.compile and CUDA graphs are used as the benchmarks use them
            return run_demo(demo)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
