"""The CLI (``python -m ragged_vit`` / ``ragged-vit``) and its image loading, on the CPU with tiny settings.

In-process runs call ``ragged_vit.pipelines.apps.cli.main([...])``; one subprocess run checks the console entry from a
fresh interpreter, where the CLI itself must switch Triton's interpreter on before timm is imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from ragged_vit.pipelines.apps.cli import main
from ragged_vit.pipelines.apps.images import load_images, preprocess
from ragged_vit.pipelines.weights import create_model

FAST = ["--device", "cpu", "--timed-runs", "1", "--warmup", "0"]



def _imagenet_names() -> set[str]:
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return {info.index_to_description(i) for i in range(1000)}


def _top5_blocks(text: str) -> list[list[str]]:
    """The class names printed under each image of the top-5 section."""
    blocks: list[list[str]] = []
    section = text.split("Top-5 per image", 1)[1].split("Backend agreement", 1)[0]
    for line in section.splitlines()[1:]:
        if line.startswith("  ["):
            blocks.append([])
        elif line.strip():
            blocks[-1].append(line.split("%", 1)[1].strip())
    return blocks


def _top1_lines(text: str) -> list[tuple[str, str]]:
    """``(kept, class name)`` of each image in the (default) top-1 section."""
    section = text.split("Top-1 per image", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in section.splitlines()[1:] if line.startswith("  [")]
    return [(line.split(": kept ", 1)[1].split(":", 1)[0], line.split("% ", 1)[1]) for line in lines]


@pytest.mark.interpreter
def test_cli_runs_reference_and_triton(capsys):
    pytest.importorskip("skimage")
    argv = ["--images", "chelsea", "astronaut", "--backends", "reference,triton", "--verbose", *FAST]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "RANDOM WEIGHTS" in out
    assert "images: 2 at 224x224: chelsea, astronaut" in out
    blocks = _top5_blocks(out)
    names = _imagenet_names()
    assert len(blocks) == 2 and all(len(b) == 5 and set(b) <= names for b in blocks)
    assert out.count("kept 98") == 2  # threshold_l2, keep rate 0.5: ceil(0.5 * 196)
    agreement = out.split("Backend agreement", 1)[1].split("Speed", 1)[0]
    assert "2/2" in agreement.split("triton", 1)[1].splitlines()[0]
    assert "top-1 minus top-2 logit (reference): min " in agreement
    assert len([line for line in agreement.splitlines() if "random weights" in line]) == 1
    speed = out.split("Speed in img/s", 1)[1]
    assert "ratio to timm eager (unpruned)" in speed and "img/s" in out
    rows = [line.split("  ")[1] for line in speed.splitlines()[2:4]]
    assert rows == ["timm eager (unpruned)", "pruned eager (reference)"]
    assert "B=1" in speed and "B=2" in speed and "(1.00x)" in speed
    assert "triton" not in speed  # the interpreter is never timed
    assert err == ""  # no progress bar off a terminal


def test_cli_with_files_folder_and_checkpoint(tmp_path, capsys):
    image_lib = pytest.importorskip("PIL.Image")
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    image_lib.fromarray(rng.integers(0, 255, (180, 260, 3), dtype=np.uint8)).save(folder / "a.png")
    image_lib.fromarray(rng.integers(0, 255, (300, 200), dtype=np.uint8)).save(folder / "b.jpg")
    (folder / "notes.txt").write_text("not an image")
    ckpt = tmp_path / "deit_tiny.pth"
    torch.save({"model": create_model("deit_tiny_patch16_224").state_dict()}, ckpt)
    argv = [
        "--images",
        str(folder),
        "--backends",
        "reference,padded_sdpa",
        "--pruner",
        "evit",
        "--keep-rate",
        "0.7",
        "--fuse-token",
        "--checkpoint",
        str(ckpt),
        *FAST,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"weights from checkpoint {ckpt}" in out and "RANDOM" not in out
    assert "images: 2 at 224x224: a.png, b.jpg" in out
    assert out.count("kept 139/99/71") == 2
    top1 = _top1_lines(out)  # top-1 only without --verbose
    assert len(top1) == 2 and all(kept == "139/99/71" and name in _imagenet_names() for kept, name in top1)
    assert "Top-5" not in out
    assert "random weights" not in out  # the one-line caveat is about random weights only


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--keep-rate", "0"], r"argument --keep-rate: must be in \(0, 1\]"),
        (["--keep-rate", "1.01"], r"argument --keep-rate: must be in \(0, 1\]"),
        (["--backends", "reference,flash"], "argument --backends: unknown 'flash'"),
        (["--pruner", "tome_v2"], "argument --pruner: invalid choice"),
        (["--batch-repeats", "0"], "argument --batch-repeats: must be a positive integer"),
        (["--warmup", "-1"], "argument --warmup: must be a non-negative integer"),
        (["--pruner", "threshold_l2", "--fuse-token"], "argument --fuse-token: not an option of --pruner threshold_l2"),
        (["--pruner", "evit", "--threshold-mode", "ratio"], "--threshold-mode: not an option of --pruner evit"),
        (["--pruner", "ats", "--threshold", "3"], "argument --threshold: not an option of --pruner ats"),
        (["--device", "cuda:x"], "argument --device:"),
        # options that would do nothing with the others given
        (["--threshold-mode", "threshold"], "argument --threshold-mode: threshold needs --threshold VALUE"),
        (["--threshold", "3"], "argument --threshold: used only with --threshold-mode threshold"),
        (["--threshold-mode", "calibrated", "--threshold", "3"], "argument --threshold: used only with"),
        (
            ["--threshold-mode", "threshold", "--threshold", "3", "--keep-rate", "0.7"],
            "argument --keep-rate: not used with --threshold-mode threshold",
        ),
        (["--pruner", "none", "--keep-rate", "0.7"], "argument --keep-rate: not used with --pruner none"),
        (["--pruner", "none", "--backends", "reference"], "argument --backends: not used with --pruner none"),
        (["--pruner", "none", "--fuse-token"], "argument --fuse-token: not an option of --pruner none"),
        (["--seed", "1", "--checkpoint", "deit.pth"], "argument --seed: seeds the random weights, which --checkpoint"),
        (["--strip-prefix", "module."], "argument --strip-prefix: applies to --checkpoint's keys"),
    ],
)
def test_cli_rejects_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match.replace("\\", "") in capsys.readouterr().err or pytest.fail(match)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model", "deit_nano_patch16_224"], "model 'deit_nano_patch16_224' is not a timm model"),
        (["--images", "/no/such/photo.jpg"], "images: '/no/such/photo.jpg' is neither a file"),
        (["--checkpoint", "/no/such/deit.pth"], "checkpoint file not found: /no/such/deit.pth"),
        (["--backends", "fa2_varlen"], "backend 'fa2_varlen' needs a CUDA device"),
        (["--model", "resnet18"], "model must be a timm VisionTransformer, Eva or NaFlexVit, got ResNet"),
        (["--model-arg", "img_size=abc"], "timm.create_model('deit_tiny_patch16_224', img_size='abc') failed: "),
    ],
)
def test_cli_reports_errors_in_one_line(argv, match, capsys):
    backends = [] if "--backends" in argv else ["--backends", "reference"]
    assert main([*argv, *backends, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ragged-vit: error: ") and match in err


NAFLEX_SMALL = ["--model", "naflexvit_base_patch16_siglip", *(a for kv in ("depth=4", "embed_dim=64", "num_heads=2")
                                                                for a in ("--model-arg", kv))]  # fmt: skip


@pytest.mark.interpreter
def test_cli_runs_a_naflex_model_every_block_packed(capsys):
    """A NaFlexVit in the demo: the images at its position-embedding grid's size, every block packed (no dense batch),
    the backends agreeing."""
    pytest.importorskip("skimage")
    argv = [*NAFLEX_SMALL, "--images", "chelsea", "--pruner", "dynamicvit", "--backends", "reference,triton", *FAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "images: 1 at 256x256: chelsea" in out and "every block packed" in out and "out of 256" in out, out
    assert "1/1" in out.split("Backend agreement", 1)[1].split("triton", 1)[1].splitlines()[0]


def test_cli_runs_a_naflex_model_unpruned(capsys):
    """A NaFlexVit without a pruner still runs every block packed (on the backend given), and the demo says so."""
    pytest.importorskip("skimage")
    assert main([*NAFLEX_SMALL, "--images", "chelsea", "--pruner", "none", "--backends", "reference", *FAST]) == 0
    assert "none: every block packed (a NaFlexVit has no dense batch), backend reference" in capsys.readouterr().out


@pytest.mark.interpreter
def test_cli_compares_backends_on_an_unpruned_naflex_model(capsys):
    """``--pruner none`` takes ``--backends`` for a NaFlexVit (its blocks run packed), and they agree."""
    pytest.importorskip("skimage")
    argv = [*NAFLEX_SMALL, "--images", "chelsea", "--pruner", "none", "--backends", "reference,triton", *FAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "none: every block packed (a NaFlexVit has no dense batch), backends reference, triton" in out, out
    assert "1/1" in out.split("Backend agreement", 1)[1].split("triton", 1)[1].splitlines()[0]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("ragged-vit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_names_unreadable_images(tmp_path, capsys):
    image_lib = pytest.importorskip("PIL.Image")
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    assert main(["--images", str(notes), "--backends", "reference", *FAST]) == 2
    assert f"images: {notes} is not an image file Pillow can read" in _one_line_error(capsys)
    folder = tmp_path / "photos"
    folder.mkdir()
    image_lib.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(folder / "a.png")
    (folder / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))  # a PNG signature, then nothing readable
    assert main(["--images", str(folder), "--backends", "reference", *FAST]) == 2
    assert str(folder / "b.png") in _one_line_error(capsys)


def test_cli_checkpoints_training_ddp_and_corrupt(tmp_path, capsys):
    state = create_model("deit_tiny_patch16_224").state_dict()
    run = ["--images", "chelsea", "--backends", "reference", *FAST]
    training = tmp_path / "checkpoint.pth"
    args = argparse.Namespace(model="deit_tiny_patch16_224", lr=5e-4, epochs=300)
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "epoch": 7, "args": args}, training)
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(training.read_bytes()[:1000])
    ddp = tmp_path / "ddp.pth"
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, ddp)
    if importlib.util.find_spec("skimage") is not None:
        assert main(["--checkpoint", str(training), *run]) == 0
        assert f"weights from checkpoint {training}" in capsys.readouterr().out
        assert main(["--checkpoint", str(ddp), "--strip-prefix", "module.", *run]) == 0
        assert f"weights from checkpoint {ddp}" in capsys.readouterr().out
    assert main(["--checkpoint", str(corrupt), *run]) == 2
    assert f"checkpoint {corrupt} is not a readable torch.save file" in _one_line_error(capsys)
    assert main(["--checkpoint", str(ddp), *run]) == 2
    assert "every key starts with 'module.'" in _one_line_error(capsys)  # and says: --strip-prefix module.
    assert main(["--checkpoint", str(training), "--strip-prefix", "module.", *run]) == 2
    assert "no key starts with strip_prefix 'module.'" in _one_line_error(capsys)
    assert main(["--checkpoint", str(tmp_path), *run]) == 2
    assert f"checkpoint {tmp_path} is a directory" in _one_line_error(capsys)
    two = tmp_path / "two_classes.pth"
    torch.save(create_model("deit_tiny_patch16_224", num_classes=2).state_dict(), two)
    assert main(["--checkpoint", str(two), *run]) == 2
    assert "(command line: --model deit_tiny_patch16_224 --model-arg num_classes=2)" in _one_line_error(capsys)
    if importlib.util.find_spec("skimage") is not None:
        assert main(["--checkpoint", str(two), "--model-arg", "num_classes=2", *run]) == 0
        out = capsys.readouterr().out  # 2 classes: named "class <i>", not ImageNet's
        assert f"weights from checkpoint {two}" in out and re.search(r": [0-9.]+% class [01]$", out, re.M), out


@pytest.mark.interpreter
def test_console_entry_in_a_fresh_process(tmp_path):
    pytest.importorskip("skimage")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)  # the installed package, not the checkout's folders
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragged_vit",
            "--images",
            "coffee",
            "--pruner",
            "dynamicvit",
            "--keep-rate",
            "0.7",
            *FAST,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "backends: reference, triton (Triton interpreter)" in result.stdout
    assert "kept 137/96/67" in result.stdout


def test_load_images_sources_and_errors(tmp_path):
    image_lib = pytest.importorskip("PIL.Image")
    rgba = np.zeros((40, 50, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    image_lib.fromarray(rgba).save(tmp_path / "x.png")
    (loaded,) = load_images([str(tmp_path / "x.png")])
    assert loaded.pixels.shape == (40, 50, 3) and loaded.pixels.dtype == np.uint8 and loaded.name == "x.png"
    with pytest.raises(FileNotFoundError, match=r"holds no image files \(\.jpg, .*\.webp\)$"):
        (tmp_path / "empty").mkdir()
        load_images([str(tmp_path / "empty")])
    (tmp_path / "classes" / "cat").mkdir(parents=True)
    image_lib.fromarray(rgba).save(tmp_path / "classes" / "cat" / "x.png")
    with pytest.raises(FileNotFoundError, match="its subfolders are not searched: `ragged-vit validate` reads a"):
        load_images([str(tmp_path / "classes")])
    with pytest.raises(FileNotFoundError, match="is neither a file, a folder nor a scikit-image sample"):
        load_images(["not_a_sample_name"])


def test_preprocess_matches_the_model_config():
    pytest.importorskip("skimage")
    model = create_model("deit_tiny_patch16_224")
    images = load_images(["chelsea", "camera", "horse"])  # RGB, grayscale uint8, boolean
    assert all(i.pixels.shape[2] == 3 and i.pixels.dtype == np.uint8 for i in images)
    assert images[2].pixels.max() == 255
    x = preprocess(images, model)
    assert x.shape == (3, 3, 224, 224) and x.dtype == torch.float32
    mean = torch.tensor(model.pretrained_cfg["mean"])[:, None, None]
    std = torch.tensor(model.pretrained_cfg["std"])[:, None, None]
    pixels = x * std + mean
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    torch.testing.assert_close(pixels[1, 0], pixels[1, 1], atol=1e-5, rtol=0)  # gray: equal channels
    torch.testing.assert_close(pixels[1, 1], pixels[1, 2], atol=1e-5, rtol=0)


def test_version(capsys):
    """``--version`` alone is answered before torch is imported (a fresh process); with other arguments, by the
    parser."""
    import ragged_vit

    code = (
        "import sys; from ragged_vit.pipelines.apps.cli import main; main(['--version']); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == [f"ragged-vit {ragged_vit.__version__}", "False"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--verbose", "--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ragged-vit {ragged_vit.__version__}"


@pytest.mark.parametrize("command", ["demo", "validate"])
@pytest.mark.parametrize("before", [None, "0"])
def test_cpu_run_sets_triton_interpret_for_its_own_run_only(monkeypatch, command, before):
    """A CPU run switches Triton's interpreter on while it runs, unless the caller set the variable, and leaves it
    as it was: a process that runs the CLI in-process and then compiles GPU kernels (Inductor's) must get compiled
    ones (the GPU suite does exactly that)."""
    from ragged_vit.pipelines.apps import cli, validate

    if before is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    seen = []
    body = "_demo" if command == "demo" else "_validate_command"
    monkeypatch.setattr(cli if command == "demo" else validate, body,
                        lambda *args: seen.append(os.environ.get("TRITON_INTERPRET")) or 3)  # fmt: skip
    argv = ["--device", "cpu"] if command == "demo" else ["validate", "data", "--device", "cpu"]
    assert main(argv) == 3
    assert seen == ["1" if before is None else before]
    assert os.environ.get("TRITON_INTERPRET") == before


def test_static_choices_name_the_registries():
    """The parsers' choices are static name lists (``--help`` imports no registry): the registries' names."""
    from ragged_vit import BACKENDS, PRUNERS
    from ragged_vit.pipelines.apps.arguments import BACKEND_NAMES, PRUNER_NAMES
    from ragged_vit.pipelines.factory import PRUNER_NAMES as FACTORY_NAMES

    assert BACKEND_NAMES == tuple(BACKENDS)
    assert PRUNER_NAMES == (*PRUNERS, "none") == FACTORY_NAMES


@pytest.mark.parametrize(
    "command,usage",
    [
        (["ragged_vit", "--help"], "usage: ragged-vit [-h]"),
        (["ragged_vit", "validate", "--help"], "usage: ragged-vit validate [-h]"),
        (["ragged_vit.validate", "--help"], "usage: ragged-vit validate [-h]"),
    ],
)
def test_help_in_a_fresh_process_imports_neither_torch_nor_timm(command, usage, tmp_path):
    """``--help`` is answered before torch, timm or triton is imported (``-X importtime`` lists every import)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *command], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(usage)
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines() if line.startswith("import ")
    }
    assert {"argparse", "ragged_vit"} <= imported  # the listing is there
    assert not imported & {"torch", "timm", "triton", "torchvision"}, sorted(imported & {"torch", "timm", "triton"})
