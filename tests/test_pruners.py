"""Tests of ``ragged_vit.reference.pruners``: counts, CLS, per-image isolation, packed == dense, and each method's
definition.

Keep decisions are compared bitwise (``torch.equal``): every pruner scores in fp32 and breaks ties by row order,
so the same scores give the same mask. The per-image oracles (a Python loop over images, in the dense formulation
of each paper) sum in other orders, so they run on continuous random scores, where a last-bit difference does not
reorder a top-k. The fused token is a weighted sum: ``rtol=1e-5, atol=1e-5`` against an fp64 loop. Inputs and
module weights are drawn from the per-test ``gen`` fixture.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from ragged_vit.core.segments import cu_seqlens_from_counts, seqlens, uniform_cu_seqlens
from ragged_vit.core.selection import DecisionInput, Placement, Pruner
from ragged_vit.pipelines.factory import build_pruner
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.packing import pack, repack
from ragged_vit.reference.pruners import (
    PRUNERS,
    ATSPruner,
    DynamicViTPruner,
    EViTPruner,
    ThresholdL2Pruner,
    make_pruner,
)

C, H = 32, 4  # small channels for the behaviour tests; the golden counts use DeiT-S (384, 6)
NUM_PATCHES = 196
# Ragged lengths (CLS included): full, odd, a single patch, CLS only.
LENGTHS = [197, 60, 2, 131, 1]

PrunerFactory = Callable[[int], Pruner]
FACTORIES: dict[str, PrunerFactory] = {
    "threshold": lambda c: ThresholdL2Pruner("threshold", threshold=math.sqrt(c)),
    "ratio": lambda c: ThresholdL2Pruner("ratio", rate=0.4),
    "calibrated": lambda c: ThresholdL2Pruner("calibrated", rate=0.3),
    "dynamicvit": lambda c: DynamicViTPruner(c),
    "evit": lambda c: EViTPruner(),
    "evit_fused": lambda c: EViTPruner(fuse_token=True),
    "ats": lambda c: ATSPruner(),
}


def build(name: str, gen: torch.Generator, channels: int = C) -> Pruner:
    """Builds a pruner with weights drawn from ``gen``; a calibrated one is calibrated on a fresh batch."""
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        pruner = FACTORIES[name](channels)
    if isinstance(pruner, ThresholdL2Pruner) and pruner.mode == "calibrated":
        pruner.calibrate(torch.randn(4, 197, channels, generator=gen))
    return pruner


def packed_input(
    gen: torch.Generator, lengths: list[int], channels: int = C, heads: int = H, stage: int = 0
) -> DecisionInput:
    """A random packed stage input with CLS attention from random q, k and random values."""
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = int(cu[-1])
    x = torch.randn(total, channels, generator=gen) * (1 + torch.rand(total, 1, generator=gen))
    return with_attention(gen, DecisionInput(x, cu, stage, NUM_PATCHES), heads)


def with_attention(gen: torch.Generator, inp: DecisionInput, heads: int) -> DecisionInput:
    """``inp`` with fresh ``cls_attn`` (via :func:`cls_attention` on random q, k) and ``v`` for its rows."""
    total, channels = inp.x.shape
    q, k = torch.randn(2, total, heads, channels // heads, generator=gen).unbind(0)
    v = torch.randn(total, channels, generator=gen)
    return DecisionInput(
        inp.x, inp.cu_seqlens, inp.stage, inp.num_patches, cls_attn=cls_attention(q, k, inp.cu_seqlens), v=v
    )


def image_rows(cu: torch.Tensor, b: int) -> slice:
    return slice(int(cu[b]), int(cu[b + 1]))


# --- counts -----------------------------------------------------------------------------------------------------

GOLDEN = {
    "dynamicvit": [137, 96, 67],
    "evit": [138, 97, 68],
    "evit_fused": [139, 99, 71],  # the fused token counted as a patch
}


@pytest.mark.parametrize("batch", [2, 3, 4])
@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_counts_deit_s(gen: torch.Generator, name: str, batch: int) -> None:
    pruner = build(name, gen, channels=384)
    inp = packed_input(gen, [197] * batch, channels=384, heads=6)
    x, cu = inp.x, inp.cu_seqlens
    for stage, expected in enumerate(GOLDEN[name]):
        current = x.shape[0] // batch
        inp = with_attention(gen, DecisionInput(x, cu, stage, NUM_PATCHES), heads=6)
        sel = pruner(inp)
        x, cu, max_seqlen = repack(x, cu, sel.keep, sel.extra_token)
        assert seqlens(cu).tolist() == [expected + 1] * batch
        assert sel.fixed_count and sel.count == expected + 1 == max_seqlen
        assert pruner.count_after(stage, current - 1, NUM_PATCHES) == expected  # counts patches, not the CLS row


@pytest.mark.parametrize("rate", [0.5, 0.7, 0.999, 1.0])
def test_evit_fuses_only_when_it_drops(gen: torch.Generator, rate: float) -> None:
    pruner = EViTPruner(rate=rate, fuse_token=True)
    sel = pruner(packed_input(gen, [197, 197]))
    kept = math.ceil(rate * 196)
    assert (sel.extra_token is not None) == (kept < 196)
    assert sel.count == 1 + pruner.count_after(0, 196, NUM_PATCHES) == 1 + kept + int(kept < 196)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_cls_always_kept(gen: torch.Generator, name: str) -> None:
    pruner = build(name, gen)
    inp = packed_input(gen, LENGTHS)
    sel = pruner(inp)
    assert sel.keep.dtype == torch.bool and sel.keep.shape == (inp.x.shape[0],)
    assert bool(sel.keep[inp.cu_seqlens[:-1].long()[torch.tensor(LENGTHS) > 0]].all())
    assert not sel.fixed_count and sel.count is None  # a ragged batch is never reported as fixed


@pytest.mark.parametrize("name", list(FACTORIES))
def test_isolation_between_images(gen: torch.Generator, name: str) -> None:
    """Redrawing image j's tokens (features, q, k, values) leaves every other image's mask bitwise unchanged."""
    pruner = build(name, gen)
    lengths = [197, 60, 131, 2, 197]
    base = packed_input(gen, lengths)
    cu = base.cu_seqlens
    keep = pruner(base).keep
    for j in range(len(lengths)):
        other = packed_input(gen, lengths)
        rows = image_rows(cu, j)
        mixed = {}
        for field in ("x", "cls_attn", "v"):
            t = getattr(base, field).clone()
            t[rows] = getattr(other, field)[rows]
            mixed[field] = t
        changed = pruner(DecisionInput(cu_seqlens=cu, stage=0, num_patches=NUM_PATCHES, **mixed)).keep
        outside = torch.ones_like(keep)
        outside[rows] = False
        assert torch.equal(changed[outside], keep[outside]), f"image {j} changed another image's decision"


@pytest.mark.parametrize("name", list(FACTORIES))
def test_dense_select_equals_packed_forward(gen: torch.Generator, name: str) -> None:
    pruner = build(name, gen)
    batch, n = 3, 197
    inp = packed_input(gen, [n] * batch)
    dense = {f: getattr(inp, f).view(batch, n, -1) for f in ("x", "cls_attn", "v")}
    x_dense = dense.pop("x")
    sel_dense = pruner.select(x_dense, **dense)
    tokens, cu, _ = pack(x_dense, torch.ones(batch, n, dtype=torch.bool))
    sel = pruner(DecisionInput(tokens, cu, 0, NUM_PATCHES, cls_attn=inp.cls_attn, v=inp.v))
    assert sel_dense.keep.shape == (batch, n)
    assert torch.equal(sel_dense.keep.flatten(), sel.keep)
    assert (sel_dense.fixed_count, sel_dense.count) == (sel.fixed_count, sel.count)
    assert (sel.extra_token is None) == (sel_dense.extra_token is None)
    if sel.extra_token is not None:
        assert torch.equal(sel_dense.extra_token, sel.extra_token)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_kept_rows_stay_in_original_order(gen: torch.Generator, name: str) -> None:
    pruner = build(name, gen)
    inp = packed_input(gen, [197, 60, 131])
    sel = pruner(inp)
    tokens, cu, _ = repack(inp.x, inp.cu_seqlens, sel.keep)
    assert torch.equal(tokens, inp.x[sel.keep])
    if sel.extra_token is not None:
        fused, fused_cu, _ = repack(inp.x, inp.cu_seqlens, sel.keep, sel.extra_token)
        last = fused_cu[1:].long() - 1
        body = torch.ones(fused.shape[0], dtype=torch.bool)
        body[last] = False
        assert torch.equal(fused[body], tokens) and torch.equal(fused[last], sel.extra_token)


# --- each method against its own definition ---------------------------------------------------------------------


def test_evit_matches_per_image_top_k(gen: torch.Generator) -> None:
    lengths = [197, 60, 131]
    inp = packed_input(gen, lengths)
    keep = EViTPruner(rate=0.7).forward(inp).keep
    for b, n in enumerate(lengths):
        rows = image_rows(inp.cu_seqlens, b)
        score = inp.cls_attn[rows].mean(-1)[1:]
        expected = torch.zeros(n, dtype=torch.bool)
        expected[0] = True
        expected[1 + torch.topk(score, math.ceil(0.7 * (n - 1))).indices] = True
        assert torch.equal(keep[rows], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_evit_fused_token_is_weighted_sum_of_dropped(gen: torch.Generator, dtype: torch.dtype) -> None:
    inp = packed_input(gen, [197, 197, 197])
    inp = DecisionInput(inp.x.to(dtype), inp.cu_seqlens, 0, NUM_PATCHES, cls_attn=inp.cls_attn, v=inp.v)
    sel = EViTPruner(rate=0.7, fuse_token=True)(inp)
    assert sel.extra_token.dtype == dtype and sel.extra_token.shape == (3, C)
    for b in range(3):
        rows = image_rows(inp.cu_seqlens, b)
        attn, x, keep = inp.cls_attn[rows].double().mean(-1), inp.x[rows].double(), sel.keep[rows]
        expected = sum(attn[j] * x[j] for j in range(1, 197) if not keep[j])
        torch.testing.assert_close(sel.extra_token[b].double(), expected.to(dtype).double(), rtol=1e-5, atol=1e-5)


def official_dynamicvit_keep(pruner: DynamicViTPruner, x: torch.Tensor, stage: int, num_patches: int) -> torch.Tensor:
    """One image ``[N, C]``, dense, as the official inference path writes it (policy-weighted global mean)."""
    predictor = pruner.score_predictor[stage]
    spatial = x[None, 1:]  # [1, N-1, C]
    policy = torch.ones(1, spatial.shape[1], 1)
    z = predictor.in_conv(spatial)
    half = z.shape[-1] // 2
    glob = (z[..., half:] * policy).sum(1, keepdim=True) / policy.sum(1, keepdim=True)
    score = predictor.out_conv(torch.cat([z[..., :half], glob.expand_as(z[..., half:])], -1))[0, :, 0]
    top = torch.argsort(score, descending=True)[: int(num_patches * pruner.rate ** (stage + 1))]
    keep = torch.zeros(x.shape[0], dtype=torch.bool)
    keep[0] = True
    keep[1 + top] = True
    return keep


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_dynamicvit_matches_official_formulation(gen: torch.Generator, stage: int) -> None:
    pruner = build("dynamicvit", gen)
    lengths = [197, 150, 139]
    inp = packed_input(gen, lengths, stage=stage)
    with torch.no_grad():
        keep = pruner(inp).keep
        for b in range(len(lengths)):
            rows = image_rows(inp.cu_seqlens, b)
            assert torch.equal(keep[rows], official_dynamicvit_keep(pruner, inp.x[rows], stage, NUM_PATCHES))


def test_dynamicvit_state_dict_matches_official_keys(gen: torch.Generator) -> None:
    c = 384
    shapes = {
        "in_conv.0.weight": (c,), "in_conv.0.bias": (c,),
        "in_conv.1.weight": (c, c), "in_conv.1.bias": (c,),
        "out_conv.0.weight": (c // 2, c), "out_conv.0.bias": (c // 2,),
        "out_conv.2.weight": (c // 4, c // 2), "out_conv.2.bias": (c // 4,),
        "out_conv.4.weight": (2, c // 4), "out_conv.4.bias": (2,),
    }  # fmt: skip
    expected = {f"score_predictor.{p}.{key}": shape for p in range(3) for key, shape in shapes.items()}
    source, target = build("dynamicvit", gen, c), build("dynamicvit", gen, c)
    state = source.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    target.load_state_dict(state, strict=True)
    inp = packed_input(gen, [197, 197], channels=c, heads=6)
    with torch.no_grad():
        assert torch.equal(source(inp).keep, target(inp).keep)


def ats_oracle(score: torch.Tensor, num_samples: int, min_keep: int) -> torch.Tensor:
    """ATS's sampling for one image's normalised patch scores ``[n]``, literally: returns kept patch indices."""
    n = score.numel()
    ascending, order = torch.sort(score, stable=True)
    cdf = torch.cumsum(ascending, 0)
    span = cdf[-1] - cdf[0]
    cdf = (cdf - cdf[0]) / span if span > 0 else torch.ones(n)
    start = cdf[cdf > 0].min() if bool((cdf > 0).any()) else torch.tensor(1.0)
    last = max(num_samples - 1, 1)
    ramp = (torch.arange(num_samples, dtype=torch.float64) / last).float()  # s / (S - 1), rounded once
    targets = start + (1.0 - start) * ramp
    nearest = torch.argmin((targets[:, None] - cdf[None, :]).abs(), dim=1)  # the first on ties
    kept = set(order[nearest].tolist())
    for j in torch.argsort(score, descending=True, stable=True).tolist():
        if len(kept) >= min(min_keep, n):
            break
        kept.add(j)
    return torch.tensor(sorted(kept))


def ats_scores(inp: DecisionInput, rows: slice) -> torch.Tensor:
    raw = (inp.cls_attn[rows].sum(-1) * inp.v[rows].norm(dim=-1))[1:]
    return raw / raw.sum() if raw.sum() > 0 else raw


@pytest.mark.parametrize("num_samples", [None, 40, 3])  # 3: the floor tops up every image
def test_ats_matches_per_image_oracle(gen: torch.Generator, num_samples: int | None) -> None:
    lengths = [197, 60, 2, 131]
    inp = packed_input(gen, lengths)
    # Sharpen image 3's attention so that its scores are peaked.
    rows = image_rows(inp.cu_seqlens, 3)
    inp.cls_attn[rows] = torch.softmax(torch.log(inp.cls_attn[rows]) * 6, dim=0)
    keep = ATSPruner(num_samples=num_samples).forward(inp).keep
    for b in range(len(lengths)):
        rows = image_rows(inp.cu_seqlens, b)
        kept = ats_oracle(ats_scores(inp, rows), num_samples or NUM_PATCHES, 8)
        assert keep[rows][0] and torch.equal(torch.nonzero(keep[rows][1:]).flatten(), kept), f"image {b}"


def test_ats_counts_vary_per_image_and_respect_the_floor(gen: torch.Generator) -> None:
    lengths = [197, 197, 197, 6, 2]
    inp = packed_input(gen, lengths)
    cu = inp.cu_seqlens
    flat, peaked, zero = (image_rows(cu, b) for b in range(3))
    inp.cls_attn[flat] = 1.0 / 197
    inp.v[flat] = torch.ones(C)
    logits = torch.full((197, H), -20.0)
    logits[1:4] = 0.0  # all heads look at three patches
    inp.cls_attn[peaked] = torch.softmax(logits, dim=0)
    inp.v[zero] = 0.0  # every score zero: no NaN, the floor alone decides
    sel = ATSPruner(min_keep=8)(inp)
    counts = [int(sel.keep[image_rows(cu, b)].sum()) - 1 for b in range(len(lengths))]
    assert counts[0] > 150, counts  # flat scores keep most patches
    assert counts[1] == 8, counts  # a few sampled (three big scores, two tiny), topped up by the floor
    assert counts[2] == 8 and counts[3] == 5 and counts[4] == 1, counts
    assert sel.keep[zero][1:9].all()  # zero scores tie: the floor takes the first patches
    for b in range(len(lengths)):
        rows = image_rows(cu, b)
        assert torch.equal(torch.nonzero(sel.keep[rows][1:]).flatten(), ats_oracle(ats_scores(inp, rows), 196, 8))
    assert not sel.fixed_count and sel.count is None


@pytest.mark.parametrize("num_samples,min_keep", [(40, 8), (3, 8), (196, 8), (12, 0)])
def test_ats_max_count_after_bounds_every_image(gen: torch.Generator, num_samples: int, min_keep: int) -> None:
    """The host bound the graph runner sizes buffers with: never exceeded (flat scores keep the most patches,
    one per target), and reached where the image has enough patches."""
    lengths = [197, 197, 60, 5, 1]
    inp = packed_input(gen, lengths)
    flat = image_rows(inp.cu_seqlens, 0)
    inp.cls_attn[flat] = 1.0 / 197
    inp.v[flat] = torch.ones(C)
    pruner = ATSPruner(num_samples=num_samples, min_keep=min_keep)
    sel = pruner(inp)
    for b, length in enumerate(lengths):
        kept = int(sel.keep[image_rows(inp.cu_seqlens, b)].sum())
        bound = 1 + pruner.max_count_after(0, length - 1, NUM_PATCHES)  # patches, plus the CLS row
        assert kept <= bound == 1 + min(length - 1, max(num_samples, min_keep)), (b, kept, bound)
    assert int(sel.keep[flat].sum()) == 1 + pruner.max_count_after(0, 196, NUM_PATCHES) or num_samples == 196
    assert ATSPruner().max_count_after(0, 196, NUM_PATCHES) == 196  # one target per patch: no bound
    ratio = ThresholdL2Pruner("ratio", rate=0.5)  # the base class: the fixed count, else no bound
    assert ratio.max_count_after(0, 196, NUM_PATCHES) == math.ceil(0.5 * 196)
    assert ThresholdL2Pruner("threshold", threshold=1.0).max_count_after(0, 149, NUM_PATCHES) == 149


def test_threshold_counts_vary_and_respect_the_floor(gen: torch.Generator) -> None:
    lengths = [197, 197, 60, 5]
    inp = packed_input(gen, lengths)
    cu = inp.cu_seqlens
    for b, scale in enumerate([0.5, 1.0, 1.5, 1.0]):
        inp.x[image_rows(cu, b)] *= scale
    for threshold, floor in [(math.sqrt(C), 8), (1e9, 8), (1e9, 0), (0.0, 8)]:
        sel = ThresholdL2Pruner("threshold", threshold=threshold, min_keep=floor)(inp)
        for b, n in enumerate(lengths):
            rows = image_rows(cu, b)
            norm = inp.x[rows].norm(dim=-1)[1:]
            passing = int((norm >= threshold).sum())
            assert int(sel.keep[rows].sum()) - 1 == max(passing, min(floor, n - 1))
            assert sel.keep[rows][1:][norm >= threshold].all()
    sel = ThresholdL2Pruner("threshold", threshold=math.sqrt(C))(inp)
    counts = [int(sel.keep[image_rows(cu, b)].sum()) for b in range(3)]
    assert len(set(counts)) == 3 and not sel.fixed_count


@pytest.mark.parametrize("rate", [0.3, 0.5, 0.9])
def test_threshold_calibrated_keeps_rate_on_average(gen: torch.Generator, rate: float) -> None:
    x = torch.randn(8, 197, C, generator=gen) * (0.5 + torch.rand(8, 1, 1, generator=gen))
    pruner = ThresholdL2Pruner("calibrated", rate=rate, min_keep=0)  # the floor would raise dim images' share
    tau = pruner.calibrate(x)
    tokens, cu, _ = pack(x, torch.ones(8, 197, dtype=torch.bool))
    assert ThresholdL2Pruner("calibrated", rate=rate).calibrate(DecisionInput(tokens, cu, 0, NUM_PATCHES)) == tau
    keep = pruner.select(x).keep
    assert keep[:, 0].all()
    assert abs(float(keep[:, 1:].float().mean()) - rate) < 0.01
    assert len(set(keep.sum(1).tolist())) > 1  # variable per image


@pytest.mark.parametrize("rate", [0.25, 0.7, 1.0])
def test_threshold_ratio_is_fixed(gen: torch.Generator, rate: float) -> None:
    pruner = ThresholdL2Pruner("ratio", rate=rate)
    assert pruner.fixed_count
    sel = pruner(packed_input(gen, [197] * 3))
    kept = 1 + math.ceil(rate * 196)
    assert sel.keep.view(3, 197).sum(1).tolist() == [kept] * 3
    assert sel.fixed_count and sel.count == kept == 1 + pruner.count_after(0, 196, NUM_PATCHES)
    inp = packed_input(gen, [197, 60, 2])
    sel = pruner(inp)  # ragged: each image keeps its own share, reported as variable
    assert [int(sel.keep[image_rows(inp.cu_seqlens, b)].sum()) for b in range(3)] == [
        1 + math.ceil(rate * (n - 1)) for n in (197, 60, 2)
    ]
    assert not sel.fixed_count and sel.count is None


# --- interface and arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, placement, blocks, fixed, attention",
    [
        ("threshold_l2", Placement.AFTER_BLOCK, (3,), False, False),
        ("dynamicvit", Placement.BEFORE_BLOCK, (3, 6, 9), True, False),
        ("evit", Placement.MID_BLOCK, (3, 6, 9), True, True),
        ("ats", Placement.MID_BLOCK, tuple(range(3, 12)), False, True),
    ],
)
def test_registry_and_class_attributes(
    name: str, placement: Placement, blocks: tuple[int, ...], fixed: bool, attention: bool
) -> None:
    cls = PRUNERS[name]
    assert issubclass(cls, Pruner)
    assert (cls.name, cls.placement, cls.blocks, cls.fixed_count, cls.needs_attention) == (
        name, placement, blocks, fixed, attention,
    )  # fmt: skip
    kwargs = {"threshold_l2": {"threshold": 1.0}, "dynamicvit": {"embed_dim": C}}.get(name, {})
    assert isinstance(make_pruner(name, **kwargs), cls)


BAD_ARGUMENTS = [
    ("name", lambda: make_pruner("tome_v2"), ValueError),
    ("mode", lambda: ThresholdL2Pruner("top"), ValueError),
    ("threshold", lambda: ThresholdL2Pruner("threshold"), ValueError),
    ("threshold", lambda: ThresholdL2Pruner("threshold", threshold="5"), TypeError),
    ("threshold", lambda: ThresholdL2Pruner("ratio", rate=0.5, threshold=1.0), ValueError),
    ("rate", lambda: ThresholdL2Pruner("ratio"), ValueError),
    ("rate", lambda: ThresholdL2Pruner("calibrated", rate=0.0), ValueError),
    ("rate", lambda: ThresholdL2Pruner("ratio", rate=1.5), ValueError),
    ("rate", lambda: ThresholdL2Pruner("ratio", rate="0.5"), TypeError),
    ("rate", lambda: ThresholdL2Pruner("threshold", threshold=1.0, rate=0.5), ValueError),
    ("min_keep", lambda: ThresholdL2Pruner("threshold", threshold=1.0, min_keep=-1), ValueError),
    ("min_keep", lambda: ThresholdL2Pruner("threshold", threshold=1.0, min_keep=2.5), TypeError),
    ("block", lambda: ThresholdL2Pruner("threshold", threshold=1.0, block=-1), ValueError),
    ("embed_dim", lambda: DynamicViTPruner(0), ValueError),
    ("embed_dim", lambda: DynamicViTPruner(384.0), TypeError),
    ("rate", lambda: DynamicViTPruner(C, rate=-0.1), ValueError),
    ("blocks", lambda: DynamicViTPruner(C, blocks=()), ValueError),
    ("blocks", lambda: DynamicViTPruner(C, blocks=(6, 3)), ValueError),
    ("rate", lambda: EViTPruner(rate=1.2), ValueError),
    ("blocks", lambda: EViTPruner(blocks=3), TypeError),
    ("fuse_token", lambda: EViTPruner(fuse_token="yes"), TypeError),
    ("blocks", lambda: ATSPruner(blocks=(3, 3)), ValueError),
    ("num_samples", lambda: ATSPruner(num_samples=0), ValueError),
    ("sample_rate", lambda: ATSPruner(sample_rate=0.0), ValueError),
    ("exclude each other", lambda: ATSPruner(num_samples=4, sample_rate=0.5), ValueError),
    ("min_keep", lambda: ATSPruner(min_keep=True), TypeError),
]


@pytest.mark.parametrize("arg, make, error", BAD_ARGUMENTS, ids=[f"{i}-{a[0]}" for i, a in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_name_the_argument(arg: str, make: Callable[[], object], error: type[Exception]) -> None:
    with pytest.raises(error, match=arg):
        make()


def test_unknown_name_lists_known_pruners() -> None:
    with pytest.raises(ValueError, match="'tome_v2'.*threshold_l2, dynamicvit, evit, ats, tome"):
        make_pruner("tome_v2")


def _strip(inp: DecisionInput, **changes: object) -> DecisionInput:
    fields = {"x": inp.x, "cu_seqlens": inp.cu_seqlens, "stage": 0, "num_patches": NUM_PATCHES, **changes}
    return DecisionInput(**fields)


# (argument named in the message, pruner, how to spoil a valid input, error)
BAD_INPUTS = [
    ("inp.cls_attn", "evit", lambda inp: _strip(inp), ValueError),
    ("inp.v", "ats", lambda inp: _strip(inp, cls_attn=inp.cls_attn), ValueError),
    ("inp.cls_attn", "ats", lambda inp: _strip(inp, cls_attn=inp.cls_attn[1:], v=inp.v), ValueError),
    ("inp.num_patches", "ats", lambda inp: _strip(inp, cls_attn=inp.cls_attn, v=inp.v, num_patches=100), ValueError),
    ("inp.stage", "dynamicvit", lambda inp: _strip(inp, stage=3), ValueError),
    ("inp.x", "threshold", lambda inp: _strip(inp, x=inp.x[None]), ValueError),
    ("inp.cu_seqlens", "ratio", lambda inp: _strip(inp, cu_seqlens=inp.cu_seqlens.long()), TypeError),
    ("inp must be a DecisionInput", "evit", lambda inp: inp.x, TypeError),
]


@pytest.mark.parametrize("arg, name, spoil, error", BAD_INPUTS, ids=[f"{a[1]}-{a[0]}" for a in BAD_INPUTS])
def test_bad_inputs_name_the_argument(
    gen: torch.Generator, arg: str, name: str, spoil: Callable[[DecisionInput], object], error: type[Exception]
) -> None:
    pruner = build(name, gen)
    with pytest.raises(error, match=arg):
        pruner(spoil(packed_input(gen, [197, 60])))


def test_uncalibrated_use_is_an_error(gen: torch.Generator) -> None:
    with pytest.raises(RuntimeError, match="calibrate"):
        ThresholdL2Pruner("calibrated", rate=0.5)(packed_input(gen, [197, 60]))


def test_calibrate_needs_calibrated_mode(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="mode"):
        ThresholdL2Pruner("ratio", rate=0.5).calibrate(torch.randn(2, 197, C, generator=gen))


@pytest.mark.parametrize("name", ["ratio", "dynamicvit", "evit", "evit_fused"])
def test_uniform_batch_reports_its_host_count(gen: torch.Generator, name: str) -> None:
    """A dense batch viewed as packed is uniform: a fixed-count pruner reports count_after as its count."""
    pruner = build(name, gen)
    cu = uniform_cu_seqlens(2, 197)
    inp = with_attention(gen, DecisionInput(torch.randn(394, C, generator=gen), cu, 1, NUM_PATCHES), H)
    sel = pruner(inp)
    assert sel.fixed_count and sel.count == 1 + pruner.count_after(1, 196, NUM_PATCHES)
    fused = int(sel.extra_token is not None)
    assert (sel.keep.view(2, 197).sum(1) + fused).tolist() == [sel.count] * 2


@pytest.mark.parametrize(
    "depth,expected",
    [
        (12, {"dynamicvit": (3, 6, 9), "evit": (3, 6, 9), "ats": tuple(range(3, 12)), "threshold_l2": (3,)}),
        (24, {"dynamicvit": (6, 12, 18), "evit": (6, 12, 18), "ats": (6, 8, 10, 12, 14, 16, 18, 20, 22),
              "threshold_l2": (6,)}),  # fmt: skip
        (32, {"dynamicvit": (8, 16, 24), "evit": (8, 16, 24), "threshold_l2": (8,)}),
        (4, {"dynamicvit": (1, 2, 3), "evit": (1, 2, 3), "ats": (1, 2, 3), "threshold_l2": (1,)}),
        (3, {"dynamicvit": (0, 1, 2), "evit": (0, 1, 2), "ats": (0, 1, 2), "threshold_l2": (0,)}),
    ],
)
def test_schedules_keep_the_papers_fractions_of_the_depth(depth: int, expected: dict) -> None:
    """Built for a model (``build_pruner``), a schedule's blocks are the 12-block ones at the same fractions of the
    depth: ``floor(b * depth / 12)``, 3/6/9 exactly at 12; ATS's coinciding stages merge."""
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=depth, num_heads=2)
    for name, blocks in expected.items():
        assert build_pruner(name, model, 0.7).blocks == blocks, name


@pytest.mark.parametrize("name", ["dynamicvit", "evit"])
def test_a_depth_that_cannot_hold_three_compounding_stages_is_refused(name: str) -> None:
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
    with pytest.raises(ValueError, match=rf"{name}'s 3 stages \(blocks \(3, 6, 9\) of 12\) cannot be placed in 2 "
                                         rf"blocks: .* fall on blocks \(0, 1, 1\); build the pruner with blocks="):
        build_pruner(name, model, 0.7)
    assert build_pruner("ats", model, 0.7).blocks == (0, 1)  # a range: coinciding stages merge


@pytest.mark.parametrize("keep_rate", [1.0, 0.99])
def test_tome_keep_rate_without_a_merge_says_which_keep_rates_merge(keep_rate: float) -> None:
    model = VisionTransformer(img_size=224, patch_size=16, embed_dim=64, depth=12, num_heads=2)
    with pytest.raises(ValueError, match=rf"keep_rate={keep_rate} maps to r = 0 for tome .* keep rates below 0\.98"
                                         r".*use pruner 'none', or give r=, or threshold= with r_max="):
        build_pruner("tome", model, keep_rate)
    assert build_pruner("tome", model, 0.98).limits == (1,) * 12
