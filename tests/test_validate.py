"""``ragged-vit validate`` / ``python -m ragged_vit.validate`` on the CPU: a tiny ImageFolder of tinted scikit-image
photos and a small ViT whose answers are known, so accuracy, agreement and kept patches are checked exactly; one
process against two under ``torchrun`` (gloo); bad data; options that would do nothing.

The model (timm's ``deit_tiny_patch16_224`` with 5 blocks, 64x64 input, no class token, average pooling, 3 classes)
gets weights that make it a colour detector: the patch embedding writes each patch's mean of the three normalised
channels into features 0-2 (everything else 0), every block is the identity (attention and MLP output projections
zero), the pooled features go through ``fc_norm`` (a LayerNorm: the same increasing map for every feature of one
vector, so the largest of features 0-2 stays the largest) and the head reads class ``c`` off its channel. An image
whose pixels all have one dominant channel is classified by that channel however many of its patches are kept.
Threshold-L2 in threshold mode then keeps each image's patches of high norm (8 to 16 of them: counts vary).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ragged_vit.pipelines.apps.cli import main as cli_main
from ragged_vit.pipelines.apps.evaluate import _agree
from ragged_vit.pipelines.apps.folder import DataError, scan_image_folder, shard_range
from ragged_vit.pipelines.apps.report import CSV_FIELDS
from ragged_vit.pipelines.apps.tally import Tally
from ragged_vit.pipelines.weights import create_model

Image = pytest.importorskip("PIL.Image")
skimage_data = pytest.importorskip("skimage.data")

MODEL_ARGS = {"img_size": 64, "depth": 5, "class_token": False, "global_pool": "avg", "num_classes": 3}
CLASSES = ("blue", "green", "red")  # sorted folder names: class indices 0, 1, 2
CHANNEL = {"red": 0, "green": 1, "blue": 2}
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
THRESHOLD = "2.6"  # keeps 8 (min_keep) to 16 of the 16 patches of these images

# Expected: 24 tinted photos in their own class folders, 2 in another class's folder (wrong for every model), and one
# picture that pruning gets right and the unpruned model wrong (see _split_picture).
IMAGES, PRUNED_TOP1, UNPRUNED_TOP1 = 27, 25, 24


def _tinted(pixels: np.ndarray, colour: str) -> np.ndarray:
    """Every pixel's ``colour`` channel in [128, 255], the others in [0, 63]: that channel dominates after ImageNet
    normalisation in every pixel, so in every patch mean (and mean of patch means) too."""
    gray = pixels.astype(np.float32).mean(axis=2) if pixels.ndim == 3 else pixels.astype(np.float32)
    out = np.empty((*gray.shape, 3), dtype=np.uint8)
    for channel in range(3):
        out[..., channel] = 128 + gray / 2 if channel == CHANNEL[colour] else gray / 4
    return out


def _split_picture() -> np.ndarray:
    """71x71 (timm's eval transform for 64x64 at crop_pct 0.9 only crops it): three of the 16 patches pure red, the
    rest mild green. Red patches have the largest norms, so the pruned model (8 patches kept) averages 3 red and 5
    green patches and sees red; the unpruned model averages 3 red and 13 green and sees green."""
    pixels = np.empty((71, 71, 3), dtype=np.uint8)
    pixels[:] = (90, 160, 90)
    pixels[:20, :52] = (255, 0, 0)  # patch row 0, patch columns 0-2 of the 64x64 centre crop (offset 3 or 4)
    return pixels


def _save(pixels: np.ndarray, path: Path) -> None:
    Image.fromarray(np.ascontiguousarray(pixels)).save(path, **({"quality": 95} if path.suffix == ".jpg" else {}))


def _make_folder(root: Path) -> Path:
    photos = [getattr(skimage_data, name)() for name in PHOTOS]
    for colour in CLASSES:
        (root / colour).mkdir(parents=True)
        for i, photo in enumerate(photos):
            h, w = photo.shape[:2]
            crop = photo[(i * 13) % 40 : h - 7, (i * 29) % 60 : w]
            for flip in (False, True):
                suffix = ".png" if (i + flip) % 2 else ".jpg"
                name = f"{PHOTOS[i]}{'_flip' * flip}{suffix}"
                _save(_tinted(crop[:, ::-1] if flip else crop, colour), root / colour / name)
    _save(_tinted(photos[1][50:250, 100:300], "green"), root / "red" / "x_mislabelled.png")
    _save(_tinted(photos[2], "red"), root / "blue" / "x_mislabelled.jpg")
    _save(_split_picture(), root / "red" / "x_split.png")
    return root


def _colour_detector() -> torch.nn.Module:
    model = create_model("deit_tiny_patch16_224", **MODEL_ARGS)
    with torch.no_grad():
        weight = model.patch_embed.proj.weight
        weight.zero_()
        model.patch_embed.proj.bias.zero_()
        model.pos_embed.zero_()
        for channel in range(3):
            weight[channel, channel] = 1.0 / weight[0, 0].numel()  # the patch mean of that channel
        for block in model.blocks:
            for linear in (block.attn.proj, block.mlp.fc2):
                linear.weight.zero_()
                linear.bias.zero_()
        model.head.weight.zero_()
        model.head.bias.zero_()
        for target, colour in enumerate(CLASSES):
            model.head.weight[target, CHANNEL[colour]] = 1.0
    return model


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """The image folder and the colour detector's checkpoint."""
    root = tmp_path_factory.mktemp("validate")
    checkpoint = root / "colour.pth"
    torch.save({"model": _colour_detector().state_dict()}, checkpoint)
    return _make_folder(root / "data"), checkpoint


def _args(folder: Path, checkpoint: Path, *extra: str) -> list[str]:
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    return [
        str(folder),
        *model_args,
        "--checkpoint",
        str(checkpoint),
        "--threshold-mode",
        "threshold",
        "--threshold",
        THRESHOLD,
        "--batch-size",
        "4",
        "--device",
        "cpu",
        *extra,
    ]


def _fast(*extra: str) -> list[str]:
    return ["--workers", "0", *extra]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("ragged-vit validate: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- pure parts -----------------------------------------------------------------------------------------------------


def test_shard_range_covers_every_sample_once_in_whole_batches():
    for n in (1, 2, 7, 26, 27, 100):
        for batch in (1, 4, 64):
            for world in (1, 2, 3, 8):
                shards = [shard_range(n, batch, world, rank) for rank in range(world)]
                assert [i for s in shards for i in s] == list(range(n))  # contiguous, in order: disjoint, complete
                assert all(s.start % batch == 0 for s in shards if len(s))  # the one-process run's batches
                sizes = [len(s) for s in shards]
                assert max(sizes) - min(sizes) <= batch


def test_tally_counts_exactly():
    logits = torch.tensor(
        [[5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], [0, 5, 1, 2, 3, 4], [0, 0.5, 9, 0.2, 0.1, 1]], dtype=torch.float16
    )
    unpruned = torch.tensor(
        [[5, 4, 3, 2, 1, 0], [5, 1, 2, 3, 4, 0], [0.1, 5, 0.2, 0.3, 0.4, 0], [0, 0.5, 9, 0.2, 0.1, 1]]
    )
    targets = torch.tensor([0, 0, 5, 2])
    counts = torch.tensor([[10, 4], [12, 6], [7, 7], [11, 5]])
    tally = Tally(stages=2)
    tally.add(logits[:3], targets[:3], counts[:3], unpruned[:3])
    tally.add(logits[3:], targets[3:], counts[3:], unpruned[3:])
    assert {k: tally.count(k) for k in ("images", "top1", "top5", "unpruned_top1", "unpruned_top5", "top1_agree")} == {
        "images": 4,
        "top1": 2,  # images 0 and 3
        "top5": 3,  # and image 2 (its 5 is 2nd); image 1's 0 is its 6th
        "unpruned_top1": 3,  # images 0, 1, 3
        "unpruned_top5": 3,  # not image 2 (its 5 is 6th)
        "top1_agree": 3,  # not image 1
    }
    stage0, stage1 = tally.kept()
    assert stage0 == {"mean": 10.0, "std": pytest.approx(np.std([10, 12, 7, 11])), "min": 7, "max": 12}
    assert stage1 == {"mean": 5.5, "std": pytest.approx(np.std([4, 6, 7, 5])), "min": 4, "max": 7}


class _FakeGroup:
    """Two ranks' setup reports, as ``Distributed.all_gather_objects`` would return them."""

    started, rank = True, 0

    def __init__(self, other: tuple[str | None, tuple[int, int] | None]) -> None:
        self.other = other

    def all_gather_objects(self, mine: object) -> list[object]:
        return [mine, self.other]


def test_ranks_agree_on_setup_errors_and_on_the_samples():
    _agree(_FakeGroup((None, (27, 5))), None, (27, 5), "data")  # the same samples: nothing raised
    with pytest.raises(DataError, match=r"^rank 1: checkpoint file not found: /x.pth"):
        _agree(_FakeGroup(("checkpoint file not found: /x.pth", None)), None, (27, 5), "data")
    with pytest.raises(DataError, match="rank 1 sees other samples under data than rank 0 \\(26 vs 27 images"):
        _agree(_FakeGroup((None, (26, 5))), None, (27, 5), "data")
    with pytest.raises(FileNotFoundError, match="mine"):  # a rank's own error first
        _agree(_FakeGroup(("theirs", None)), FileNotFoundError("mine"), None, "data")


# -- whole runs -----------------------------------------------------------------------------------------------------


def _expected_kept(folder: Path, checkpoint: Path) -> list[int]:
    """The kept patches of every image, from the pipeline itself (the same transform)."""
    from ragged_vit.pipelines.apps.images import decode_image
    from ragged_vit.pipelines.apps.images import eval_transform as _transform
    from ragged_vit.pipelines.factory import build_pipeline

    pv = build_pipeline(
        "deit_tiny_patch16_224", "threshold_l2", model_kwargs=MODEL_ARGS, checkpoint=checkpoint,
        threshold_mode="threshold", threshold=float(THRESHOLD),
    )  # fmt: skip
    transform, _ = _transform(pv.model)
    images = torch.stack([transform(decode_image(p)) for p, _ in scan_image_folder(folder).samples])
    return pv.run(images).counts[:, 0].tolist()


def test_known_accuracy_agreement_kept_patches_and_outputs(data, tmp_path, capsys):
    folder, checkpoint = data
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    argv = _args(folder, checkpoint, *_fast("--compare-unpruned", "--results-json", str(out_json)))
    assert cli_main(["validate", *argv, "--results-csv", str(out_csv)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no progress bar off a terminal
    assert f"{IMAGES} images in 3 classes (sorted folder names); 64x64" in out
    assert f"top-1  {100 * PRUNED_TOP1 / IMAGES:.3f}% ({PRUNED_TOP1}/{IMAGES})" in out
    assert f"top-1 agreement {100 * (IMAGES - 1) / IMAGES:.3f}% ({IMAGES - 1}/{IMAGES})" in out
    assert "(top-5 is top-3: the model has 3 classes)" in out
    assert "Throughput in img/s (one process)" in out and "end to end" in out
    results = json.loads(out_json.read_text())
    assert results["pruned"] == {
        "images": IMAGES,
        "top1_correct": PRUNED_TOP1,
        "top5_correct": IMAGES,
        "top1": pytest.approx(100 * PRUNED_TOP1 / IMAGES),
        "top5": 100.0,
    }
    assert results["unpruned"]["top1_correct"] == UNPRUNED_TOP1
    assert results["agreement"]["top1_agree"] == IMAGES - 1
    assert results["agreement"]["top1_delta"] == pytest.approx(100 * (PRUNED_TOP1 - UNPRUNED_TOP1) / IMAGES)
    kept = _expected_kept(folder, checkpoint)
    (stage,) = results["kept_patches"]
    assert stage["mean"] == pytest.approx(np.mean(kept)) and stage["std"] == pytest.approx(np.std(kept))
    assert (stage["min"], stage["max"]) == (min(kept), max(kept)) == (8, 16)
    assert results["data"]["skipped"] == [] and results["run"]["world_size"] == 1
    assert results["pruner"]["keep_rate"] is None  # threshold mode: --threshold decides
    (rank,) = results["throughput"]["ranks"]
    assert rank["images"] == IMAGES and rank["img_per_s_model"] > 0 and rank["wall_s"] >= rank["data_wait_s"]

    assert _validate_main(_args(folder, checkpoint, *_fast("--results-csv", str(out_csv)))) == 0
    with out_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert out_csv.read_text().count("time,data_dir") == 1 and len(rows) == 2
    assert list(rows[0]) == list(CSV_FIELDS)
    assert rows[0]["top1_agreement"] != "" and rows[1]["top1_agreement"] == ""  # the second run compared nothing
    assert float(rows[1]["top1"]) == pytest.approx(100 * PRUNED_TOP1 / IMAGES)


def test_the_unpruned_model_is_labelled_unpruned(data, capsys):
    folder, checkpoint = data
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    argv = [str(folder), *model_args, "--checkpoint", str(checkpoint), "--pruner", "none", "--batch-size", "4",
            "--device", "cpu"]
    assert cli_main(["validate", *argv, *_fast()]) == 0
    out = capsys.readouterr().out
    assert f"  unpruned   top-1  {100 * UNPRUNED_TOP1 / IMAGES:.3f}%" in out and "  pruned " not in out
    assert "Kept patches: all" in out and "  unpruned, model only" in out


def test_an_unpruned_naflexvit_takes_a_backend(data, capsys):
    """A NaFlexVit runs its blocks packed without a pruner too, so ``--pruner none`` takes ``--backend`` for it (and
    says which ran); for other models that flag does nothing and stays an error."""
    folder, _ = data
    naflex = {"depth": 2, "embed_dim": 64, "num_heads": 2, "num_classes": 3}
    argv = [str(folder), "--model", "naflexvit_base_patch16_siglip",
            *(a for k, v in naflex.items() for a in ("--model-arg", f"{k}={v}")),
            "--pruner", "none", "--backend", "reference", "--batch-size", "8", "--device", "cpu"]  # fmt: skip
    assert cli_main(["validate", *argv, *_fast()]) == 0
    out = capsys.readouterr().out
    assert "none: every block packed (a NaFlexVit has no dense batch), backend reference" in out, out
    assert "  unpruned   top-1 " in out


def _validate_main(argv: list[str]) -> int:
    """``python -m ragged_vit.validate``'s entry, in this process."""
    from ragged_vit.validate import main

    return main(argv)


def test_two_ranks_under_torchrun_count_what_one_process_counts(data, tmp_path, capsys):
    folder, checkpoint = data
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert _validate_main(_args(folder, checkpoint, *_fast("--compare-unpruned", "--results-json", str(one)))) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "localhost:0", "-m", "ragged_vit.validate"]  # fmt: skip
    argv = _args(folder, checkpoint, "--workers", "1", "--compare-unpruned", "--results-json", str(two))
    result = subprocess.run([*torchrun, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Accuracy on") == 1  # rank 0 prints
    assert "2 ranks (torch.distributed, gloo)" in result.stdout and "rank 1: " in result.stdout
    single, double = json.loads(one.read_text()), json.loads(two.read_text())
    for key in ("pruned", "unpruned", "agreement", "kept_patches"):
        assert double[key] == single[key], key  # exactly: integer counts, the same batches
    ranks = double["throughput"]["ranks"]
    assert [r["images"] for r in ranks] == [12, 15]  # 7 batches of 4: 3 and 4 whole batches, nothing padded
    assert double["run"]["world_size"] == 2


# -- bad data -------------------------------------------------------------------------------------------------------


def _small_folder(root: Path, photos: int = 2) -> Path:
    for colour in CLASSES:
        (root / colour).mkdir(parents=True)
        for i in range(photos):
            _save(_tinted(getattr(skimage_data, PHOTOS[i])()[::4, ::4], colour), root / colour / f"{i}.png")
    return root


def _truncated_jpeg(path: Path) -> None:
    _save(_tinted(skimage_data.coffee(), "red"), path.with_suffix(".tmp.jpg"))
    data = path.with_suffix(".tmp.jpg").read_bytes()
    path.with_suffix(".tmp.jpg").unlink()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "case,match",
    [
        ("empty", "has no class folders"),
        ("flat", "has no class folders (layout: "),
        ("empty_class", "class folder {root}/green holds no images"),
        ("corrupt", "bad image {root}/green/9.png: not an image file Pillow can read (--skip-bad skips"),
        ("truncated", "bad image {root}/red/9.jpg: cannot decode it: image file is truncated"),
        ("map_missing", "class 'purple' (line 4 of the class map {map}) has no folder {root}/purple"),
        ("map_unlisted", "class folder {root}/red is not in the class map {map} (2 images; --skip-bad skips them)"),
        ("too_many_classes", "has 4 classes but the model has 3 outputs"),
    ],
)
def test_bad_data_is_a_one_line_error(case, match, data, tmp_path, capsys):
    _, checkpoint = data
    root = tmp_path / "data"
    extra: list[str] = []
    cmap = tmp_path / "classes.txt"
    if case == "empty":
        root.mkdir()
    elif case == "flat":
        root.mkdir()
        _save(_tinted(skimage_data.coffee()[::4, ::4], "red"), root / "a.png")
    else:
        _small_folder(root)
    if case == "empty_class":
        for f in (root / "green").iterdir():
            f.unlink()
    elif case == "corrupt":
        (root / "green" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    elif case == "truncated":
        _truncated_jpeg(root / "red" / "9.jpg")
    elif case == "map_missing":
        cmap.write_text("blue\ngreen\nred\npurple\n")
        extra = ["--class-map", str(cmap)]
    elif case == "map_unlisted":
        cmap.write_text("blue\ngreen\n")
        extra = ["--class-map", str(cmap)]
    elif case == "too_many_classes":
        (root / "yellow").mkdir()
        _save(_tinted(skimage_data.coffee()[::4, ::4], "red"), root / "yellow" / "a.png")
    assert cli_main(["validate", *_args(root, checkpoint, *_fast(*extra))]) == 2
    assert match.format(root=root, map=cmap) in _one_line_error(capsys)


def test_skip_bad_counts_and_lists_skipped_files(data, tmp_path, capsys):
    _, checkpoint = data
    root = _small_folder(tmp_path / "data", photos=3)
    (root / "green" / "9.png").write_bytes(b"not an image")
    _truncated_jpeg(root / "red" / "9.jpg")
    (root / "purple").mkdir()
    _save(_tinted(skimage_data.coffee()[::4, ::4], "red"), root / "purple" / "a.png")
    (root / "blue" / "notes.txt").write_text("not an image suffix: ignored, as torchvision does")
    cmap = tmp_path / "classes.txt"
    cmap.write_text("blue\ngreen\nred\nyellow\n")  # no folder for yellow; purple is not listed
    out_json = tmp_path / "r.json"
    argv = _args(root, checkpoint, "--workers", "1", "--skip-bad", "--class-map", str(cmap))
    argv += ["--results-json", str(out_json)]
    argv[argv.index("num_classes=3")] = "num_classes=4"  # the class map's 4 classes (the 4th output never wins)
    ckpt4 = tmp_path / "colour4.pth"
    state = torch.load(checkpoint)["model"]
    state["head.weight"] = torch.cat([state["head.weight"], torch.zeros(1, 192)])
    state["head.bias"] = torch.cat([state["head.bias"], torch.full((1,), -100.0)])
    torch.save({"model": state}, ckpt4)
    argv[argv.index(str(checkpoint))] = str(ckpt4)
    assert cli_main(["validate", *argv]) == 0
    out = capsys.readouterr().out
    results = json.loads(out_json.read_text())
    skipped = {Path(s["path"]).relative_to(root).as_posix(): s["reason"] for s in results["data"]["skipped"]}
    assert set(skipped) == {"green/9.png", "red/9.jpg", "purple/a.png"}
    assert "image file is truncated" in skipped["red/9.jpg"] and "Pillow" in skipped["green/9.png"]
    assert results["pruned"]["images"] == 9 and results["pruned"]["top1_correct"] == 9
    assert "Skipped 3 files (--skip-bad):" in out and f"  {root}/green/9.png: not an image file Pillow" in out
    assert "note: 1 classes of the class map have no folder: yellow" in out


# -- options --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--graphs"], "argument --graphs: needs a CUDA device"),
        (["--compile-blocks"], "argument --compile-blocks: needs a CUDA device"),
        (["--pruner", "none", "--compare-unpruned"], "argument --compare-unpruned: with --pruner none"),
        (["--pruner", "none", "--backend", "reference"], "argument --backend: not used with --pruner none"),
        (["--model", "naflexvit_base_patch16_siglip", "--pruner", "evit", "--fuse-token", "--graphs"],
         "argument --graphs: a NaFlexVit's native batches with a fused token"),
        (["--pruner", "evit", "--fuse-token", "--threshold-mode", "ratio"], "--threshold-mode: not an option of"),
        (["--strip-prefix", "module."], "argument --strip-prefix: applies to --checkpoint's keys"),
        (["--model-arg", "depth"], "argument --model-arg: must be KEY=VALUE"),
        (["--model-arg", "pretrained=True"], "argument --model-arg: pretrained would download weights"),
        (["--results-json", "/no/such/folder/r.json"], "argument --results-json: folder /no/such/folder does not"),
        (["--batch-size", "0"], "argument --batch-size: must be a positive integer"),
    ],
)
def test_options_that_do_nothing_or_cannot_work_are_errors(extra, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["validate", str(tmp_path), "--device", "cpu", *extra])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_help_of_the_subcommand_and_of_the_demo(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["validate", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ragged-vit validate [-h]")
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "validate DATA_DIR [options]" in " ".join(capsys.readouterr().out.split())  # the demo's epilog
