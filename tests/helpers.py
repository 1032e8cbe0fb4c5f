"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from benchmarks.e2e_common import no_tf32  # noqa: F401  (re-exported: the tests' one fp32 switch)
from ragged_vit import PrunedViT

#: Pruner cases of the pipeline tests: name -> (pruner, options); "evit_fused" is EViT with its fused token.
PRUNER_CASES = {
    "threshold_l2": ("threshold_l2", {}),
    "dynamicvit": ("dynamicvit", {}),
    "evit": ("evit", {}),
    "evit_fused": ("evit", {"fuse_token": True}),
    "ats": ("ats", {}),
}


def assert_fp16_within_twice(out: torch.Tensor, peer: torch.Tensor, ref: torch.Tensor, msg: object = None) -> None:
    """``out``'s largest error against ``ref`` (fp32) is at most twice ``peer``'s (PyTorch's own fp16 run of the same
    forward) plus one fp16 ulp of ``ref``'s scale."""
    out, peer, ref = out.float(), peer.float(), ref.float()
    bound = 2 * (peer - ref).abs().max().item() + torch.finfo(torch.float16).eps * ref.abs().max().item()
    assert (out - ref).abs().max().item() <= bound, msg


@contextlib.contextmanager
def sync_free() -> Iterator[None]:
    """Inside it every synchronising CUDA call raises (``torch.cuda.set_sync_debug_mode("error")``); the device is
    idle on entry, so nothing queued before counts."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager forward runs on the CPU as on CUDA (the Triton kernels under the interpreter): it packs with the
    Triton kernels, into buffers sized from the host's bounds, decides with the fused decisions registered for CUDA,
    and takes a batch as uniform wherever its size divides its rows (the offsets unread, as on a GPU)."""
    from ragged_vit.core import decisions, selection
    from ragged_vit.pipelines import model

    as_on_a_gpu = lambda cu, total: None if total % (cu.numel() - 1) else total // (cu.numel() - 1)  # noqa: E731
    monkeypatch.setattr(selection, "uniform_length", as_on_a_gpu)
    monkeypatch.setattr(model, "_packs_with_triton", lambda device: True)
    on_cuda = {(kind, "cpu"): fn for (kind, device), fn in decisions._REGISTRY.items() if device == "cuda"}
    monkeypatch.setattr(decisions, "_REGISTRY", {**decisions._REGISTRY, **on_cuda})


def tiny_pipeline(pruner_factory, backend: str = "reference") -> PrunedViT:
    """A 6-block ViT on 32x32 images (16 patches + CLS) with seeded weights, its pruner from ``pruner_factory``;
    its qkv weights are scaled up so that attention is peaked and ATS keeps a different count per image
    (near-uniform attention at random init makes it keep the same count)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=6, num_heads=2, num_classes=10)
        pruner = pruner_factory()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
    return PrunedViT(model, pruner, backend)


def tiny_images(n: int, seed: int) -> torch.Tensor:
    """Images of increasing contrast for :func:`tiny_pipeline`: the pruners keep different counts per image."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g) * torch.linspace(0.1, 3.0, n)[:, None, None, None]


def _requalified(test: Callable, quick_rows: Callable[[list[tuple]], list[bool]]) -> Callable:
    """``test`` with the parametrisations of its parametrize marks rebuilt: those ``quick_rows`` (given every
    parametrisation's values) flags false are marked ``full``."""
    param_set = type(pytest.param(None))
    marks = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize":
            names, values = mark.args[0], list(mark.args[1])
            several = (names.count(",") > 0) if isinstance(names, str) else len(names) > 1
            ids = mark.kwargs.get("ids")
            ids = ids if isinstance(ids, list | tuple) else None  # callable ids stay in the mark's kwargs
            params = [
                v if isinstance(v, param_set) else pytest.param(*(v if several else (v,)), id=ids[i] if ids else None)
                for i, v in enumerate(values)
            ]
            quick = quick_rows([p.values for p in params])
            params = [
                p if keep else pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.full))
                for p, keep in zip(params, quick, strict=True)
            ]
            kwargs = {k: v for k, v in mark.kwargs.items() if k != "ids" or ids is None}
            mark = pytest.mark.parametrize(names, params, **kwargs).mark
        marks.append(mark)
    test.pytestmark = marks
    return test


def full_beyond(test: Callable, quick: Callable[..., bool]) -> Callable:
    """``test`` (a parametrised test function, e.g. a conformance suite's) with every parametrisation for which
    ``quick(*values)`` is false marked ``full``: the quick level keeps the chosen representatives, ``--full`` runs
    all of them. ``values`` are the parameters in the order of the parametrize mark's names."""
    return _requalified(test, lambda rows: [bool(quick(*row)) for row in rows])


def rotation(rows: list[tuple], family: Callable[..., object], variant: Callable[..., tuple]) -> list[bool]:
    """One row per family, flagged true: ``family(*row)`` names a row's case family, ``variant(*row)`` is a tuple of
    its other axes (a pruner, a dtype, a head dim, a batch). Family by family (in order of appearance), the kept row
    is the variant whose axis values were kept least so far, then whose combination was, then the first: every family
    is checked, every value of every axis as early as the families allow, then the combinations in turn."""
    used: dict[tuple, int] = {}  # (axis, value) and ("combination", variant) -> times kept
    chosen = set()
    for name in dict.fromkeys(family(*row) for row in rows):
        members = [i for i, row in enumerate(rows) if family(*row) == name]

        def rank(i: int) -> tuple[int, int, int]:
            axes = variant(*rows[i])
            spread = sum(used.get((j, value), 0) for j, value in enumerate(axes))
            return spread, used.get(("combination", axes), 0), i

        pick = min(members, key=rank)
        chosen.add(pick)
        axes = variant(*rows[pick])
        for key in [*enumerate(axes), ("combination", axes)]:
            used[key] = used.get(key, 0) + 1
    return [i in chosen for i in range(len(rows))]


def one_per_family(test: Callable, family: Callable[..., object], variant: Callable[..., tuple]) -> Callable:
    """``test`` (a conformance suite's test) keeping one parametrisation per case family at the quick level (the
    :func:`rotation` of its parametrisations), the rest marked ``full``."""
    return _requalified(test, lambda rows: rotation(rows, family, variant))


def rotated(
    rows: list[tuple], family: Callable[..., object], variant: Callable[..., tuple], ids: Callable[..., str]
) -> list:
    """pytest parameters, one per row, the :func:`rotation`'s rows at the quick level and the rest marked ``full``."""
    quick = rotation(rows, family, variant)
    return [
        pytest.param(*row, id=ids(*row), marks=() if keep else (pytest.mark.full,))
        for row, keep in zip(rows, quick, strict=True)
    ]


def levels(rows: list[tuple], quick: Callable[..., bool], ids: Callable[..., str] | None = None) -> list:
    """pytest parameters, one per row (a tuple of values), each marked ``full`` where ``quick(*row)`` is false: the
    quick level runs the representatives, ``--full`` every row."""
    return [
        pytest.param(*row, id=ids(*row) if ids else None, marks=() if quick(*row) else (pytest.mark.full,))
        for row in rows
    ]
