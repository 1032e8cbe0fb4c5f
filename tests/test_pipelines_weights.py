"""Local checkpoints: official-style files load into a fresh pipeline (identical logits), bad files fail clearly.

Checkpoints are made here (random weights saved with ``torch.save``): nothing is downloaded. Logits after a
round trip are compared bitwise: the same weights run through the same ops.
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from ragged_vit import build_pipeline, create_model, load_checkpoint
from ragged_vit.pipelines.factory import build_pruner

MODEL = "deit_tiny_patch16_224"



def _seeded_pipeline(pruner: str, seed: int, **kwargs):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_pipeline(MODEL, pruner, 0.7, **kwargs)


def _official_style(pv) -> dict:
    """``{"model": state_dict}`` as DeiT and DynamicViT release them: timm keys plus ``score_predictor.*``."""
    state = dict(pv.model.state_dict())
    if pv.pruner is not None:
        state.update(pv.pruner.state_dict())
    return {"model": state, "epoch": 299}


@pytest.mark.parametrize("pruner", ["dynamicvit", "evit"])
@pytest.mark.parametrize("wrapped", [True, False])
def test_checkpoint_round_trip_gives_identical_logits(pruner, wrapped, tmp_path, gen):
    source = _seeded_pipeline(pruner, seed=1)
    ckpt = _official_style(source)
    path = tmp_path / "ckpt.pth"
    torch.save(ckpt if wrapped else ckpt["model"], path)
    loaded = _seeded_pipeline(pruner, seed=2, checkpoint=path)
    fresh = _seeded_pipeline(pruner, seed=2)
    x = torch.randn(2, 3, 224, 224, generator=gen)
    expected = source(x)
    assert torch.equal(loaded(x), expected)
    assert not torch.allclose(fresh(x), expected)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "deit.pth"
    model = create_model(MODEL)
    with pytest.raises(FileNotFoundError, match=f"checkpoint file not found: {path}"):
        load_checkpoint(model, None, path)
    with pytest.raises(FileNotFoundError, match="checkpoint file not found"):
        build_pipeline(MODEL, "evit", 0.7, checkpoint=str(path))
    with pytest.raises(ValueError, match=f"checkpoint {tmp_path} is a directory: pass the checkpoint file in it"):
        load_checkpoint(model, None, tmp_path)


def test_a_model_name_typo_suggests_the_close_names():
    with pytest.raises(ValueError, match=r"'deit_tinyy_patch16_224' is not a timm model: did you mean "
                                         r"'deit_tiny_patch16_224'"):
        create_model("deit_tinyy_patch16_224")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(img_size="abc"), TypeError, r"timm.create_model\('deit_tiny_patch16_224', img_size='abc'\) failed: "),
        (dict(foo=1), TypeError, r"\(\'deit_tiny_patch16_224', foo=1\) failed: .*unexpected keyword argument 'foo'"),
        (dict(embed_dim=100, num_heads=3), ValueError, r"embed_dim=100, num_heads=3\) failed: "),  # timm asserts
    ],
)
def test_an_argument_timm_refuses_is_named_with_the_call(kwargs, error, match):
    with pytest.raises(error, match=match):
        create_model("deit_tiny_patch16_224", **kwargs)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    model = create_model(MODEL)
    state = dict(model.state_dict())
    del state["blocks.5.attn.qkv.weight"]
    state["blocks.12.mlp.fc1.weight"] = torch.zeros(3)
    path = tmp_path / "bad.pth"
    torch.save({"model": state}, path)
    before = model.blocks[5].attn.proj.weight.clone()
    with pytest.raises(
        ValueError,
        match=r"missing keys \(1\): blocks.5.attn.qkv.weight.*"
        r"unexpected keys \(1\): blocks.12.mlp.fc1.weight",
    ):
        load_checkpoint(model, None, path)
    assert torch.equal(model.blocks[5].attn.proj.weight, before)  # nothing loaded


def test_wrong_model_size_lists_shape_mismatches(tmp_path):
    path = tmp_path / "small.pth"
    torch.save({"model": create_model("deit_small_patch16_224").state_dict()}, path)
    with pytest.raises(ValueError, match=r"shape mismatches .*cls_token \(1, 1, 384\) vs \(1, 1, 192\)"):
        load_checkpoint(create_model(MODEL), None, path)


def test_predictor_keys_must_match_the_pruner(tmp_path):
    dyn = _seeded_pipeline("dynamicvit", seed=0)
    path = tmp_path / "dynamicvit.pth"
    torch.save(_official_style(dyn), path)
    model = create_model(MODEL)
    with pytest.raises(ValueError, match=r"unexpected keys \(\d+\): score_predictor.0"):
        load_checkpoint(model, build_pruner("evit", model, 0.7), path)
    plain = tmp_path / "deit.pth"
    torch.save({"model": model.state_dict()}, plain)
    with pytest.raises(ValueError, match=r"does not fit the dynamicvit pruner: missing keys .*score_predictor"):
        load_checkpoint(model, build_pruner("dynamicvit", model, 0.7), plain)


def test_not_a_state_dict(tmp_path):
    path = tmp_path / "list.pth"
    torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match="must hold a state dict"):
        load_checkpoint(create_model(MODEL), None, path)


def test_create_model_never_downloads():
    with pytest.raises(ValueError, match="pretrained=True would download"):
        create_model(MODEL, pretrained=True)
    with pytest.raises(TypeError, match="model name must be a str"):
        create_model(None)


def test_timm_arguments_and_local_pretrained_files(tmp_path):
    """``model_kwargs`` reach ``timm.create_model``; a local file through timm's own ``pretrained_cfg_overlay`` loads
    without a download; timm arguments given as pruner options get a clear error."""
    pv = build_pipeline(MODEL, "evit", 0.7, model_kwargs=dict(num_classes=10, img_size=160))
    assert pv.model.num_classes == 10 and pv.image_size == (160, 160) and pv.num_patches == 100
    with pytest.raises(ValueError, match=r"takes no option 'num_classes' .*go in model_kwargs"):
        build_pipeline(MODEL, "evit", 0.7, num_classes=10)
    with pytest.raises(TypeError, match="model_kwargs must be a dict"):
        build_pipeline(MODEL, "evit", 0.7, model_kwargs=[("num_classes", 10)])
    source = create_model(MODEL)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    loaded = create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    pairs = zip(source.state_dict().values(), loaded.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(FileNotFoundError, match="pretrained_cfg_overlay file not found"):
        create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "none.pth")))


_UNPICKLED: list[str] = []


def _record(text: str) -> str:
    _UNPICKLED.append(text)
    return text


class _RunsCodeWhenUnpickled:
    """Unpickling it calls ``_record``: what ``weights_only=True`` must refuse."""

    def __reduce__(self):
        return _record, ("code ran",)


def _training_checkpoint(pv, style: str) -> dict:
    """A training checkpoint as DeiT and DynamicViT save it (``model`` ... ``args``), or timm's train.py."""
    state = _official_style(pv)["model"]
    optimizer = torch.optim.AdamW(pv.parameters(), lr=1e-3)
    pv.model.head(torch.zeros(1, pv.model.embed_dim)).sum().backward()
    optimizer.step()  # per-parameter state: exp_avg tensors, step
    optimizer.zero_grad(set_to_none=True)
    args = argparse.Namespace(
        model=MODEL,
        lr=5e-4,
        epochs=300,
        drop_path=0.1,
        output_dir="out",
        dist_url="env://",
        betas=None,
        distributed=True,
        base_keep_rate=0.7,
        input_size=224,
    )
    ema = {k: v + 1 for k, v in state.items()}  # differs: the loader must pick the model's own weights
    if style == "deit":
        return {
            "model": state,
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": {"base_values": [5e-4]},
            "epoch": 299,
            "model_ema": ema,
            "scaler": {"scale": 65536.0, "_growth_tracker": 7},
            "args": args,
        }
    return {
        "epoch": 299,
        "arch": MODEL,
        "state_dict": state,
        "optimizer": optimizer.state_dict(),
        "version": 2,
        "args": args,
        "state_dict_ema": ema,
        "metric": 81.2,
    }


@pytest.mark.parametrize("pruner", ["dynamicvit", "evit"])
@pytest.mark.parametrize("style", ["deit", "timm"])
def test_training_checkpoints_load_their_model_weights_safely(pruner, style, tmp_path, gen):
    """``args`` (an argparse.Namespace) next to the model, optimizer, scheduler, scaler and EMA state: the model's
    weights load under ``weights_only=True`` (Namespace allow-listed), the EMA copy is left alone."""
    source = _seeded_pipeline(pruner, seed=1)
    path = tmp_path / "checkpoint.pth"
    torch.save(_training_checkpoint(source, style), path)
    loaded = _seeded_pipeline(pruner, seed=2, checkpoint=path)
    x = torch.randn(2, 3, 224, 224, generator=gen)
    assert torch.equal(loaded(x), source(x))


def test_ema_only_checkpoint_loads_the_ema(tmp_path, gen):
    source = _seeded_pipeline("evit", seed=1)
    path = tmp_path / "ema.pth"
    torch.save({"model_ema": source.model.state_dict(), "args": argparse.Namespace(model_ema=True)}, path)
    loaded = _seeded_pipeline("evit", seed=2, checkpoint=path)
    x = torch.randn(1, 3, 224, 224, generator=gen)
    assert torch.equal(loaded(x), source(x))


def test_pickled_code_is_refused_and_never_runs(tmp_path):
    model = create_model(MODEL)
    path = tmp_path / "evil.pth"
    torch.save({"model": model.state_dict(), "args": _RunsCodeWhenUnpickled()}, path)
    refused = rf"checkpoint {re.escape(str(path))} pickles \S*_record, which torch.load\(weights_only=True\)"
    with pytest.raises(ValueError, match=refused):
        load_checkpoint(model, None, path)
    assert _UNPICKLED == []
    whole = tmp_path / "whole_model.pth"
    torch.save(model, whole)
    with pytest.raises(ValueError, match=r"pickles timm.models.vision_transformer.VisionTransformer.*model.state_dict"):
        load_checkpoint(model, None, whole)


@pytest.mark.parametrize("kind", ["empty", "text", "random", "truncated"])
def test_corrupt_files_name_the_file(kind, tmp_path):
    model = create_model(MODEL)
    path = tmp_path / f"{kind}.pth"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("model weights, honest\n")
    elif kind == "random":
        path.write_bytes(bytes(range(256)) * 8)
    else:
        torch.save({"model": model.state_dict()}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = model.cls_token.clone()
    unreadable = rf"checkpoint {re.escape(str(path))} is not a readable torch.save file"
    with pytest.raises(ValueError, match=unreadable) as info:
        load_checkpoint(model, None, path)
    assert "\n" not in str(info.value)
    assert torch.equal(model.cls_token, before)


def test_ddp_prefix_is_suggested_and_stripped(tmp_path, gen):
    source = _seeded_pipeline("dynamicvit", seed=1)
    path = tmp_path / "ddp.pth"
    torch.save({"model": {f"module.{k}": v for k, v in _official_style(source)["model"].items()}}, path)
    suggestion = r"every key starts with 'module.' .*DistributedDataParallel.*strip_prefix='module.' \(command line"
    with pytest.raises(ValueError, match=suggestion):
        _seeded_pipeline("dynamicvit", seed=2, checkpoint=path)
    loaded = _seeded_pipeline("dynamicvit", seed=2)
    load_checkpoint(loaded.model, loaded.pruner, path, strip_prefix="module.")
    x = torch.randn(2, 3, 224, 224, generator=gen)
    assert torch.equal(loaded(x), source(x))
    built = _seeded_pipeline("dynamicvit", seed=2, checkpoint=path, strip_prefix="module.")  # the factory passes it on
    assert torch.equal(built(x), source(x))
    with pytest.raises(ValueError, match="strip_prefix applies to a checkpoint"):
        _seeded_pipeline("dynamicvit", seed=2, strip_prefix="module.")
    plain = tmp_path / "plain.pth"
    torch.save(source.model.state_dict(), plain)
    with pytest.raises(ValueError, match=rf"{re.escape(str(plain))}: no key starts with strip_prefix 'module.'"):
        load_checkpoint(create_model(MODEL), None, plain, strip_prefix="module.")
    with pytest.raises(ValueError, match="strip_prefix must not be empty"):
        load_checkpoint(create_model(MODEL), None, plain, strip_prefix="")
    with pytest.raises(TypeError, match="strip_prefix must be a str or None"):
        load_checkpoint(create_model(MODEL), None, plain, strip_prefix=1)


def test_a_checkpoint_of_another_head_or_width_says_what_it_fits(tmp_path):
    """The mismatch error says what the checkpoint holds and the model it fits; the demo's ``--model-arg`` builds
    that model (``validate`` has the same flag)."""
    path = tmp_path / "two_classes.pth"
    torch.save(create_model(MODEL, num_classes=2).state_dict(), path)
    with pytest.raises(ValueError, match=r"head.weight \(2, 192\) vs \(1000, 192\).*the checkpoint is a ViT of width "
                                         r"192, 12 blocks, 16x16 patches, 2 classes; its width is "
                                         r"'deit_tiny_patch16_224'.s: create_model\('deit_tiny_patch16_224', "
                                         r"num_classes=2\) \(command line: --model deit_tiny_patch16_224 "
                                         r"--model-arg num_classes=2\)"):
        load_checkpoint(create_model(MODEL), None, path)
    load_checkpoint(create_model(MODEL, num_classes=2), None, path)  # what the message says fits
