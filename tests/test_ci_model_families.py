"""The CPU side of two GPU scripts: ``python -m ci.model_families --speed`` (argument handling, the family list, the
full-size models it would build, its checks and table, its refusal without CUDA) and ``python -m ci.tune_attention``'s
geometry options (head dims 80/96: the kernel under the interpreter, with the sweep's own correctness check)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.attention_peers import TOLERANCE, reference_output
from benchmarks.workloads import NUM_PATCHES, make_workload
from ci import model_families as mf
from ci import tune_attention as tune
from ci.model_families import FAMILIES, family
from ragged_vit.triton_impl.configs import AttentionConfig


def _error_line(capsys, argv, parse=mf.parse_args) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# --------------------------------------------------------------------------------------------------- model_families


def test_family_lists_and_defaults():
    plain = mf.parse_args([])
    assert not plain.speed and plain.families == tuple(FAMILIES)
    speed = mf.parse_args(["--speed"])
    assert speed.families == (*FAMILIES, "vit_large", "vit_huge")
    assert (speed.batch, speed.max_minutes, speed.out, speed.dry_run) == (64, mf.DEFAULT_MINUTES, None, False)
    picked = mf.parse_args(["--speed", "--families", " vit_huge,deit,vit_huge ", "--batch", "8"])
    assert picked.families == ("vit_huge", "deit") and picked.batch == 8
    assert mf.parse_args(["--families", "avgmax,deit"]).families == ("avgmax", "deit")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--speed", "--families", "deit,bogus"], ["--families", "bogus", "deit_distilled"]),
        (["--families", "vit_huge"], ["--families", "vit_huge", "--speed"]),
        (["--batch", "8"], ["--batch", "--speed"]),
        (["--dry-run"], ["--dry-run", "--speed"]),
        (["--speed", "--batch", "0"], ["--batch", ">= 1"]),
        (["--speed", "--max-minutes", "-1"], ["--max-minutes"]),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv, words):
    err = _error_line(capsys, argv)
    assert err.count("\n") == 1 and err.startswith(f"{mf.PROG}: error: "), err
    for word in words:
        assert word in err, (word, err)


def test_speed_without_cuda_exits_with_a_message(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mf.main(["--speed", "--families", "deit"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "--speed needs a CUDA GPU" in err and "--dry-run" in err


def test_every_family_has_one_speed_model_and_the_split_covers_them():
    assert list(mf.SPEED_MODELS) == [*FAMILIES, *mf.EXTRA_SPEED]
    first, second = mf.SPEED_SPLIT
    assert sorted([*first, *second]) == sorted(mf.SPEED_MODELS) and len(first) == len(second)
    for part in mf.SPEED_SPLIT:  # the module docstring gives the two commands
        assert f"--families {','.join(part)}\n" in mf.__doc__


def _structure(model: torch.nn.Module) -> dict[str, object]:
    block = model.blocks[0]
    return {
        "prefix": model.num_prefix_tokens,
        "class_token": model.cls_token is not None,
        "registers": getattr(model, "num_reg_tokens", 0),
        "pool": mf._pool(model),
        "no_embed_class": model.no_embed_class,
        "norm_pre": type(model.norm_pre).__name__,
        "fc_norm": type(model.fc_norm).__name__,
        "qk_norm": type(block.attn.q_norm).__name__,
        "layer_scale": type(block.ls1).__name__,
        "block": type(block).__name__,
    }


@pytest.mark.parametrize("name", list(FAMILIES))
def test_full_size_model_has_its_test_familys_structure(name):
    """The speed row's full-size model is the same family as the small model the tests check against timm: prefix
    rows, pooling, LayerScale, qk_norm, norm_pre, fc_norm (built on the meta device: no weights)."""
    big = mf.speed_model(name, "meta")
    assert _structure(big) == _structure(family(name))
    assert big.embed_dim == 768 and len(big.blocks) == 12 and big.num_classes == mf.NUM_CLASSES


def test_dry_run_plans_every_row(capsys):
    rows = {name: mf.planned(name) for name in mf.SPEED_MODELS}
    for name, row in rows.items():
        patches = row["patches"]
        assert row["tokens"] == patches + row["prefix"]
        assert row["kept_patches"] == [math.ceil(mf.SPEED_KEEP * patches)], name
        assert (row["heads"], row["head_dim"]) == {"vit_large": (16, 64), "vit_huge": (16, 80)}.get(name, (12, 64))
    assert rows["dinov2_reg4"]["image_size"] == 224 and rows["dinov2_reg4"]["tokens"] == 256 + 5
    assert rows["vit_huge"]["depth"] == 32 and rows["vit_huge"]["tokens"] == 257
    assert mf.main(["--speed", "--dry-run", "--families", "vit_huge,deit"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| vit_huge |") or line.startswith("| deit |")]
    assert len(lines) == 2 and "| 16 x 80 | 32 | 128 |" in lines[0] and "| 12 x 64 | 12 | 98 |" in lines[1]
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"  # this machine's, whichever it is
    assert out.startswith(f"card: {card}, torch {torch.__version__}, ")


def test_output_checks():
    good = torch.zeros(4, mf.NUM_CLASSES)
    assert mf.check_output(good, 4) is None
    assert "shape" in mf.check_output(good, 3)
    bad = good.clone()
    bad[1, 7] = float("nan")
    assert "1 non-finite" in mf.check_output(bad, 4)
    counts = torch.tensor([[98], [98], [97], [98]])
    assert mf.check_output(good, 4, torch.full((4, 1), 98), 98) is None
    assert "[97, 98]" in mf.check_output(good, 4, counts, 98)


def test_speed_table_rows():
    meta = {"card": "X", "torch": "t", "triton": "tr", "timm": "ti", "cuda": "c", "commit": "abc", "batch": 64}
    ok = {"status": "ok", "img_per_s": 1000.0}
    row = {**mf.planned("deit"), "timm_compiled": ok, "pruned_graphed": {**ok, "img_per_s": 1500.0}, "ratio": 1.5}
    skipped = {**mf.planned("vit_huge"), "status": "skipped"}
    failed = {**mf.planned("avgmax"), "timm_compiled": ok, "pruned_graphed": {"status": "failed", "reason": "x"}}
    lines = mf.speed_table(meta, [row, skipped, failed]).splitlines()
    assert lines[0].startswith("card: X, torch t, triton tr, timm ti")
    assert lines[-3].endswith("| 1000 | 1500 | 1.50x |")
    assert lines[-2].endswith("| skipped | skipped | - |")
    assert lines[-1].endswith("| 1000 | failed | - |")


# --------------------------------------------------------------------------------------------------- tune_attention


def test_tune_geometry_arguments(capsys):
    args = tune.parse_args([])
    assert (args.heads, args.head_dim, args.patches) == (12, 64, NUM_PATCHES)
    args = tune.parse_args(["--heads", "16", "--head-dim", "80", "--patches", "256", "--quick"])
    assert (args.heads, args.head_dim, args.patches, args.quick) == (16, 80, 256, True)
    for bad in (["--head-dim", "81"], ["--head-dim", "264"], ["--heads", "0"], ["--patches", "0"]):
        err = _error_line(capsys, bad, tune.parse_args)
        assert bad[0] in err


def test_tune_scaled_workloads():
    for batch, pruned in [(1, 80), (32, 50), (64, 0)]:
        assert tune.scaled_workload(batch, pruned) == make_workload(batch, pruned)
        wl = tune.scaled_workload(batch, pruned, 256)
        base = make_workload(batch, pruned)
        assert (wl.batch, wl.pruned_pct, wl.variable) == (base.batch, base.pruned_pct, base.variable)
        assert all(2 <= n <= 257 for n in wl.lengths)
        assert [n - 1 for n in wl.lengths] == [round((n - 1) * 256 / 196) for n in base.lengths]
    assert set(tune.scaled_workload(8, 0, 256).lengths) == {257}


@pytest.mark.interpreter
@pytest.mark.parametrize("heads, head_dim", [(2, 80), (1, 96)])
def test_tune_cell_check_at_head_dims_80_and_96_interpreter(heads, head_dim):
    """The sweep's correctness check on a small cell at ViT-H/14's padded head dim and at 96: the kernel is within the
    sweep's tolerance of the fp32 reference under the untuned default and under another tile shape."""
    wl = tune.scaled_workload(2, 80, 64)  # two images of ~14 rows
    problem = tune.make_cell(wl, heads, head_dim, "cpu", torch.float32)
    assert problem.qkv_sets[0].shape == (wl.total, 3 * heads * head_dim) and problem.head_dim == head_dim
    reference = reference_output(problem)
    for config in (tune.attention_config(torch.device("cpu"), head_dim), AttentionConfig(32, 32, 2, 1, False)):
        assert tune.config_error(problem, reference, 65, config) <= TOLERANCE / 100
    wrong = reference.clone()
    wrong[0, 0, -1] += 1.0  # the last lane: one of the padded head dim's real ones
    assert tune.config_error(problem, wrong, 65, AttentionConfig(32, 32, 2, 1, False)) >= 0.5
