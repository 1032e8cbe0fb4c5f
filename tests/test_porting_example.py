"""The worked examples of ``docs/porting.md``: deliberately simple ports of the varlen attention and pack contracts
pass the lab, and deliberately broken ones are caught with a report that says what is wrong.

The ports are what a porter might write first: ``F.scaled_dot_product_attention`` one image at a time, and boolean
indexing for pack.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragged_vit.testing import ConformanceError, attention_suite, check_attention, check_pack, pack_cases, pack_suite


def sdpa_per_image(qkv, cu_seqlens, max_seqlen, num_heads, scale):
    """The port: the contract's ``qkv`` layout, PyTorch's SDPA on each image's rows."""
    total, width = qkv.shape
    q, k, v = qkv.unflatten(1, (3, num_heads, width // (3 * num_heads))).unbind(1)  # [T, H, D] each
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        rows = slice(start, end)
        qs, ks, vs = (t[rows].transpose(0, 1) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out.flatten(1)


# The whole test file of a port: one line; every case of the lab becomes a test item.
test_sdpa_per_image = attention_suite(sdpa_per_image, layout="qkv")


def wrong_scale(qkv, cu_seqlens, max_seqlen, num_heads, scale):
    """Broken: ignores the given scale (always ``D ** -0.5``)."""
    return sdpa_per_image(qkv, cu_seqlens, max_seqlen, num_heads, (qkv.shape[1] // (3 * num_heads)) ** -0.5)


def off_by_one(qkv, cu_seqlens, max_seqlen, num_heads, scale):
    """Broken: every image but the first starts one row late (reads its neighbour's last row)."""
    shifted = cu_seqlens.clone()
    shifted[1:-1] += 1
    shifted = torch.minimum(shifted, cu_seqlens[-1])
    return sdpa_per_image(qkv, shifted, max_seqlen, num_heads, scale)


@pytest.mark.parametrize(
    "port,case,says",
    [
        (wrong_scale, "scale[5-64]", "max error <= 2 x PyTorch's in the same dtype + floor"),
        (off_by_one, "isolation[40-70-9]", "max error"),
        (off_by_one, "ragged[5images]", "max error"),
    ],
)
def test_the_lab_catches_broken_ports(port, case, says):
    with pytest.raises(ConformanceError) as caught:
        check_attention(port)
    report = str(caught.value)
    assert report.startswith("attention (qkv layout): ")
    failed = {f.case.split("-h")[0] for f in caught.value.failures}
    assert case in failed, report
    assert says in report
    if port is wrong_scale:  # only the case with another scale fails: the report points at the cause
        assert failed == {"scale[5-64]"}, report


# A port of pack (docs/porting.md): boolean indexing walks the batch image after image, in order.
def pack_by_indexing(x, keep):
    """The port: the kept rows by boolean indexing; the dense width ``N`` bounds every image (no count is read)."""
    cu_seqlens = torch.zeros(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    cu_seqlens[1:] = keep.sum(1).cumsum(0)
    return x[keep], cu_seqlens, x.shape[1]


test_pack_by_indexing = pack_suite(pack=pack_by_indexing)


def drops_last_row(x, keep):
    """Broken: loses the batch's last kept row (an end bound one too small)."""
    tokens, cu_seqlens, bound = pack_by_indexing(x, keep)
    cu_seqlens[-1] -= 1
    return tokens[:-1], cu_seqlens, bound


def starts_late(x, keep):
    """Broken: an off-by-one in the offsets, every image but the first starts one row late."""
    tokens, cu_seqlens, bound = pack_by_indexing(x, keep)
    cu_seqlens[1:-1] += 1
    return tokens, cu_seqlens, bound


@pytest.mark.parametrize(
    "port,fails,says",
    [
        (drops_last_row, lambda case: True,
         "pack: tokens shape, dtype and device: observed (391, 24) torch.float32 on cpu, allowed (392"),
        (starts_late, lambda case: len(case.lengths) > 1,  # a lone image has no offset to get wrong
         "pack: cu_seqlens equal to the reference's: observed cu_seqlens[1] = 2, allowed 1"),
    ],
)  # fmt: skip
def test_the_lab_catches_broken_packs(port, fails, says):
    with pytest.raises(ConformanceError) as caught:
        check_pack(pack=port)
    report = str(caught.value)
    assert report.startswith("packing (pack): ")
    assert f"lengths[1-2-63-64-65-197]-c24-float32: {says}" in report, report
    failed = {f.case for f in caught.value.failures}
    assert failed == {case.id for case in pack_cases(empty_images=False) if fails(case)}, report
