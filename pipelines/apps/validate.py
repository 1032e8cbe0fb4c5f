"""``ragged-vit validate DATA_DIR`` / ``python -m ragged_vit.validate``: accuracy of a token-pruned timm ViT on an image
folder, its agreement with the unpruned model, kept tokens and throughput; data-parallel under ``torchrun``.

This module is the command line: the parser (static choices, so ``--help`` is answered before torch is imported), the
checks of options that would do nothing, the device (each rank's under ``torchrun``). The rest lives beside it:

* :mod:`.folder` -- the data: the ImageFolder layout, the class map, bad data and ``--skip-bad``, the shards.
* :mod:`.evaluate` -- the run: setup, the loop over this rank's shard, what its throughput counts.
* :mod:`.tally` -- the counting (exact integer counts, so N ranks count what one does).
* :mod:`.distributed` -- the ``torchrun`` job and its collectives.
* :mod:`.report` -- the results: the dictionary (``--results-json``), the printed report, the ``--results-csv`` row.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .arguments import (
    BACKEND_NAMES,
    DTYPES,
    ERRORS,
    add_model_arguments,
    add_pruner_arguments,
    check_checkpoint_flags,
    device,
    interpreter_env,
    non_negative,
    on_cpu,
    packs_unpruned,
    positive,
    pruner_arguments,
)

if TYPE_CHECKING:  # annotations only: torch is imported once the arguments are parsed
    import torch

    from .distributed import Distributed


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
    """The parser of ``ragged-vit validate`` (static choices: building it imports neither torch nor timm)."""
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
        "--backend", choices=BACKEND_NAMES, help="attention backend (default: triton on CUDA, reference on CPU)"
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
        "--dtype", default="auto", choices=("auto", *DTYPES), help="default: float32 on CPU, float16 on CUDA"
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
        help="torch.compile around the packed blocks (PrunedViT.compile_blocks; CUDA only; with --pruner none only on "
        "a NaFlexVit, whose blocks run packed)",
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



def main(argv: list[str] | None = None, prog: str = "ragged-vit validate") -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), validates; returns the exit status (2: a one-line error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)  # --help and malformed arguments end here, before torch is imported
    with interpreter_env(on_cpu(args.device)):
        return _validate_command(parser, args, argv)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, on_gpu: bool) -> dict[str, object]:
    """Options that would do nothing with the others given, or on this device, are errors (status 2); returns the
    pruner's own options."""
    options = pruner_arguments(parser, args)
    if args.pruner == "none":
        if args.keep_rate is not None:
            parser.error("argument --keep-rate: not used with --pruner none (nothing is pruned)")
        if not packs_unpruned(args.model):  # a NaFlexVit runs its blocks packed unpruned too
            for flag, value in (("--backend", args.backend), ("--compile-blocks", args.compile_blocks or None)):
                if value is not None:
                    parser.error(f"argument {flag}: not used with --pruner none (timm's own forward, nothing packed)")
        if args.compare_unpruned:
            parser.error("argument --compare-unpruned: with --pruner none the model is the unpruned one")
    if args.graphs and args.fuse_token and packs_unpruned(args.model):
        parser.error("argument --graphs: a NaFlexVit's native batches with a fused token run eagerly "
                     "(GraphedPrunedViT does not replay them)")  # fmt: skip
    if not on_gpu:
        for flag, given in (("--graphs", args.graphs), ("--compile-blocks", args.compile_blocks)):
            if given:
                parser.error(
                    f"argument {flag}: needs a CUDA device (on a CPU nothing is captured or compiled for speed)"
                )
    check_checkpoint_flags(parser, args)
    return options


def _resolve_device(parser: argparse.ArgumentParser, text: str, group: Distributed) -> torch.device:
    """``--device``; under ``torchrun`` a CUDA rank takes ``cuda:LOCAL_RANK``."""
    import torch

    try:
        resolved = device(text)
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --device: {e}")
    if group.active and resolved.type == "cuda":
        if resolved.index is not None:
            parser.error("argument --device: under torchrun each rank takes cuda:LOCAL_RANK; pass cuda or auto")
        if group.local_rank >= torch.cuda.device_count():
            parser.error(
                f"argument --device: LOCAL_RANK {group.local_rank} but only {torch.cuda.device_count()} CUDA devices"
            )
        resolved = torch.device("cuda", group.local_rank)
    return resolved


def _validate_command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """:func:`main` after parsing, in the interpreter setting of its device."""
    import torch

    from .distributed import Distributed
    from .evaluate import validate
    from .options import ValidateOptions

    group = Distributed()
    target = _resolve_device(parser, args.device, group)
    on_gpu = target.type == "cuda"
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
        device=target,
        dtype=getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float16 if on_gpu else torch.float32),
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
        command=shlex.join([*parser.prog.split(), *argv]),
    )
    try:
        group.start(target)
        validate(options, group)
        return 0
    except ERRORS as e:
        if group.rank == 0:
            print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        group.stop()


if __name__ == "__main__":
    sys.exit(main())
