"""ragged_vit.pipelines.patch_embed: timm's strided-convolution patch embedding computed as one GEMM on patch rows."""

from __future__ import annotations

import pytest
import torch
from timm.layers import PatchEmbed
from torch import nn

from ragged_vit.pipelines.patch_embed import patch_embed_gemm, patch_rows, supports_gemm, with_gemm_patch_embed


@pytest.mark.parametrize(
    "img,patch,chans,dim,bias",
    [(224, 16, 3, 192, True), (64, 8, 3, 32, False), ((48, 32), (16, 8), 4, 24, True)],
)
def test_gemm_equals_timm_convolution(img, patch, chans, dim, bias, gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    pe = PatchEmbed(img_size=img, patch_size=patch, in_chans=chans, embed_dim=dim, bias=bias).eval()
    h, w = pe.img_size
    images = torch.randn(3, chans, h, w, generator=gen)
    assert supports_gemm(pe)
    with torch.no_grad():
        got, want = patch_embed_gemm(pe, images), pe(images)
    assert got.shape == want.shape == (3, pe.num_patches, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_patch_rows_order_matches_conv_weight_layout():
    images = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    rows = patch_rows(images, (2, 3))  # a 2 x 2 grid of 2x3 patches per image
    assert rows.shape == (2 * 4, 3 * 2 * 3)
    # image 1, patch (row 1, col 0): channel c, pixel (y, x) at rows[1*4 + 2][c*6 + y*3 + x]
    assert torch.equal(rows[6].reshape(3, 2, 3), images[1, :, 2:4, 0:3])


def test_unsupported_embeddings_are_refused():
    plain = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16)
    assert supports_gemm(plain)
    overlapping = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16)
    overlapping.proj = nn.Conv2d(3, 16, kernel_size=8, stride=4)
    unflattened = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16, flatten=False)
    padded = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16, dynamic_img_pad=True)
    for pe in (overlapping, unflattened, padded, nn.Identity()):
        assert not supports_gemm(pe)


def test_with_gemm_patch_embed_copies_and_matches(gen):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    fast = with_gemm_patch_embed(model)
    assert fast is not model and fast.patch_embed.proj.weight is not model.patch_embed.proj.weight
    images = torch.randn(2, 3, 64, 64, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(fast(images), model(images), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="patch_embed"):
        with_gemm_patch_embed(nn.Linear(2, 2))
