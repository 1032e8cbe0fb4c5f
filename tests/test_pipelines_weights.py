"""Local checkpoints: official-style files load into a fresh pipeline (identical logits), bad files fail clearly.

Checkpoints are made here (random weights saved with ``torch.save``): nothing is downloaded. Logits after a
round trip are compared bitwise: the same weights run through the same ops.
"""

from __future__ import annotations

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
