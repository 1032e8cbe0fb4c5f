"""``python -m ragged_vit`` / ``ragged-vit``: classify real images with a token-pruned DeiT on several backends,
and time it against the unpruned timm model (:mod:`ragged_vit.pipelines.apps.demo`).

Examples::

    python -m ragged_vit                                   # CPU: deit_tiny, 4 scikit-image photos, reference+triton
    python -m ragged_vit --pruner evit --keep-rate 0.7 --fuse-token --verbose
    python -m ragged_vit --model deit_base_patch16_224 --checkpoint deit_base.pth --images ~/photos
    python -m ragged_vit --checkpoint ddp_run/checkpoint.pth --strip-prefix module.
    python -m ragged_vit --device cuda --backends triton,padded_sdpa,fa2_varlen,nested_sdpa --batch-repeats 16
    python -m ragged_vit validate ~/imagenet/val --checkpoint deit_base.pth --compare-unpruned   # the subcommand

``--version`` alone is answered before anything else is imported, and ``--help`` before torch is: the parser's
choices are static name lists (:mod:`.arguments`). Parsing imports torch to read the device; on a CPU the Triton
kernels run under Triton's interpreter, which :func:`~.arguments.interpreter_env` switches on for the run only, before
timm is imported. Errors in the arguments (unknown names, keep rate outside (0, 1], missing files, a backend that
cannot run on the device, an option the pruner does not take, an option that does nothing with the others given) and
unusable inputs (an image or checkpoint file that cannot be read, a model that is not a timm ViT) exit with status 2
and a one-line message.
"""

from __future__ import annotations

import argparse
import sys

from .arguments import (
    BACKEND_NAMES,
    COMPILED_WARMUP,
    DTYPES,
    ERRORS,
    PROG,
    add_model_arguments,
    add_pruner_arguments,
    check_checkpoint_flags,
    device,
    interpreter_env,
    non_negative,
    packs_unpruned,
    positive,
    pruner_arguments,
)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser (static choices: building it imports neither torch nor timm)."""
    from ... import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Classify images with a token-pruned timm DeiT through ragged (packed) attention backends; "
        "print top-1 predictions, kept tokens, backend agreement and speed against the unpruned timm model.",
        epilog=f"Accuracy on an image folder (ImageFolder layout), also under torchrun: {PROG} validate DATA_DIR "
        f"[options] ({PROG} validate --help).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_model_arguments(parser)
    add_pruner_arguments(parser, calibrated_on="the given images")
    parser.add_argument(
        "--backends",
        help="comma-separated list from: "
        + ", ".join(BACKEND_NAMES)
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
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="activation dtype (default: float32 on CPU, float16 on CUDA)",
    )
    parser.add_argument(
        "--batch-repeats",
        type=positive,
        help="the large timed batch = the images repeated this many times (default: up to 64 images on CUDA, "
        "once on CPU); B=1 is timed too",
    )
    parser.add_argument(
        "--timed-runs", type=positive, help="timed forwards per row and batch (default 5 on CPU, 20 on CUDA)"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        help=f"untimed forwards first (default 2 on CPU, 3 on CUDA; compiled rows at least {COMPILED_WARMUP})",
    )
    parser.add_argument("--seed", type=int, help="seed of the random weights (default 0; not with --checkpoint)")
    parser.add_argument("-v", "--verbose", action="store_true", help="top-5 predictions per image (default top-1)")
    parser.add_argument(
        "--threads",
        type=positive,
        help="CPU threads for torch (default: torch's own choice; 1 "
        "is much faster when another process keeps a core busy)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs the demo; returns the exit status. ``validate ...`` runs the
    ``validate`` subcommand instead (:mod:`ragged_vit.pipelines.apps.validate`)."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words == ["--version"]:  # answered before torch is imported
        from ... import __version__

        print(f"{PROG} {__version__}")
        return 0
    if words[:1] == ["validate"]:
        from .validate import main as validate

        return validate(words[1:], prog=f"{PROG} validate")
    parser = build_parser()
    args = parser.parse_args(words)  # --help and malformed arguments end here, before timm is imported
    with interpreter_env(args.device.type == "cpu"):
        return _demo(parser, args)


def _backends(parser: argparse.ArgumentParser, args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """``--backends`` (or the device's default) as a list of known names, each once."""
    defaults = "triton,fa2_varlen,padded_sdpa" if on_gpu else "reference,triton"
    if args.pruner == "none" and not packs_unpruned(args.model):  # no packed block: one backend, which is not used
        defaults = defaults.split(",", 1)[0]
    backends = [b.strip() for b in (args.backends or defaults).split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKEND_NAMES]
    if unknown or not backends:
        parser.error(
            f"argument --backends: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
            f"known: {', '.join(BACKEND_NAMES)}"
        )
    if len(set(backends)) != len(backends):
        parser.error(f"argument --backends: each backend once, got {','.join(backends)}")
    return backends


def _check_unused(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An option that would do nothing with the others given is an error (``parser.error``: status 2)."""
    if args.pruner == "none":
        if args.keep_rate is not None:
            parser.error("argument --keep-rate: not used with --pruner none (nothing is pruned)")
        if args.backends is not None and not packs_unpruned(args.model):
            parser.error("argument --backends: not used with --pruner none (timm's own forward, nothing packed)")
    check_checkpoint_flags(parser, args)


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The demo command (:func:`main` without the subcommand), in the interpreter setting of its device."""
    import torch

    on_gpu = args.device.type == "cuda"
    backends = _backends(parser, args, on_gpu)
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
        device=args.device,
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
    except ERRORS as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
