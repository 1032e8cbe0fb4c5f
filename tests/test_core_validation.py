"""Bad input to every public reference entry point, and to the validation helpers themselves.

Each case starts from a valid call (checked by ``test_valid_baseline``) and breaks exactly one argument; the
call must raise ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape, device or value)
with a message that names that argument. A second device comes from ``meta``, which every torch build has;
the cases that need it are skipped with a reason if it is unavailable. No numerics here, so no tolerance.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ragged_vit.core.validation import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_keep_mask,
    check_max_seqlen,
    check_rate,
    check_same_device,
    check_tensor,
)
from ragged_vit.reference.attention import padded_attention, ragged_attention, split_qkv
from ragged_vit.reference.cls_attention import cls_attention
from ragged_vit.reference.packing import cls_rows, pack, repack, unpack


def _meta_available() -> bool:
    try:
        torch.empty(1, device="meta")
    except (RuntimeError, ValueError):
        return False
    return True


NEEDS_META = pytest.mark.skipif(not _meta_available(), reason="needs a second device; 'meta' is unavailable")


def cu(*offsets: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(offsets, dtype=dtype)


def ones_bool(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


# Valid calls: 2 images of lengths 2 and 3 (T = 5), C = 4, H = 2, D = 4 (padded: L = 3).
FUNCS: dict[str, Callable[..., Any]] = {
    "pack": pack,
    "unpack": unpack,
    "repack": repack,
    "cls_rows": cls_rows,
    "padded_attention": padded_attention,
    "ragged_attention": ragged_attention,
    "cls_attention": cls_attention,
    "split_qkv": split_qkv,
}
VALID: dict[str, Callable[[], dict[str, Any]]] = {
    "pack": lambda: {"x": torch.randn(2, 5, 4), "keep": ones_bool(2, 5)},
    "unpack": lambda: {"tokens": torch.randn(5, 4), "cu_seqlens": cu(0, 2, 5)},
    "repack": lambda: {
        "tokens": torch.randn(5, 4),
        "cu_seqlens": cu(0, 2, 5),
        "keep": ones_bool(5),
        "extra_token": torch.randn(2, 4),
    },
    "cls_rows": lambda: {"tokens": torch.randn(5, 4), "cu_seqlens": cu(0, 2, 5)},
    "padded_attention": lambda: {
        "q": torch.randn(2, 2, 3, 4),
        "k": torch.randn(2, 2, 3, 4),
        "v": torch.randn(2, 2, 3, 4),
        "key_padding_mask": ones_bool(2, 3),
    },
    "ragged_attention": lambda: {
        "q": torch.randn(5, 2, 4),
        "k": torch.randn(5, 2, 4),
        "v": torch.randn(5, 2, 4),
        "cu_seqlens": cu(0, 2, 5),
    },
    "cls_attention": lambda: {"q": torch.randn(5, 2, 4), "k": torch.randn(5, 2, 4), "cu_seqlens": cu(0, 2, 5)},
    "split_qkv": lambda: {"qkv": torch.randn(5, 24), "num_heads": 2},
}


def bad(func: str, arg: str, make: Callable[[], Any], exc: type[Exception], match: str, what: str, meta: bool = False):
    """One case: ``func`` called with its valid arguments except ``arg = make()``."""
    marks = [NEEDS_META] if meta else []
    return pytest.param(func, arg, make, exc, match, id=f"{func}-{arg}-{what}", marks=marks)


def no_cls_keep() -> torch.Tensor:
    keep = ones_bool(2, 5)
    keep[1, 0] = False
    return keep


def repack_keep_without_cls() -> torch.Tensor:
    keep = ones_bool(5)
    keep[2] = False  # row 2 = cu_seqlens[1]: image 1's CLS
    return keep


# Offsets that are wrong for tokens of T = 5 rows, shared by every entry point that takes cu_seqlens.
BAD_CU = [
    (lambda: [0, 2, 5], TypeError, "^cu_seqlens must be a torch.Tensor", "list"),
    (lambda: cu(0, 2, 5, dtype=torch.int64), TypeError, "^cu_seqlens must have dtype", "int64"),
    (lambda: torch.tensor([0.0, 2.0, 5.0]), TypeError, "^cu_seqlens must have dtype", "float"),
    (lambda: cu(0, 2, 5)[None], ValueError, "^cu_seqlens must have 1 dimensions", "2d"),
    (lambda: cu(0), ValueError, "^cu_seqlens must hold at least 2 offsets", "empty_batch"),
    (lambda: cu(1, 2, 5), ValueError, r"^cu_seqlens\[0\] must be 0", "first_not_0"),
    (lambda: cu(0, 4, 3, 5), ValueError, "^cu_seqlens must be non-decreasing", "non_monotone"),
    (lambda: cu(0, -1, 5), ValueError, "^cu_seqlens must be non-decreasing", "negative"),
    (lambda: cu(0, 2, 4), ValueError, r"^cu_seqlens\[-1\] must equal the packed length 5", "short_of_T"),
    (lambda: cu(0, 2, 9), ValueError, r"^cu_seqlens\[-1\] must equal the packed length 5", "past_T"),
    (lambda: cu(0, 9, 5), ValueError, "^cu_seqlens must be non-decreasing", "out_of_range_middle"),
]
CU_FUNCS = ("unpack", "repack", "cls_rows", "ragged_attention", "cls_attention")
CU_CASES = [bad(func, "cu_seqlens", make, exc, match, what) for func in CU_FUNCS for make, exc, match, what in BAD_CU]

# A tensor on a second device, one argument at a time (the others stay on the CPU).
KPM = "key_padding_mask"
META_CASES = [
    bad(func, arg, make, ValueError, match, "meta", meta=True)
    for func, arg, make, match in [
        ("pack", "keep", lambda: ones_bool(2, 5).to("meta"), "^keep must be on cpu"),
        ("repack", "keep", lambda: ones_bool(5).to("meta"), "^keep must be on cpu"),
        ("repack", "extra_token", lambda: torch.randn(2, 4, device="meta"), "^extra_token must be on cpu"),
        ("padded_attention", "k", lambda: torch.randn(2, 2, 3, 4, device="meta"), "^k is on meta but q"),
        ("padded_attention", "v", lambda: torch.randn(2, 2, 3, 4, device="meta"), "^v is on meta but q"),
        ("padded_attention", KPM, lambda: ones_bool(2, 3).to("meta"), "^key_padding_mask must be on cpu"),
        ("ragged_attention", "k", lambda: torch.randn(5, 2, 4, device="meta"), "^k is on meta but q"),
        ("ragged_attention", "q", lambda: torch.randn(5, 2, 4, device="meta"), "^k is on cpu but q is on meta"),
        ("cls_attention", "k", lambda: torch.randn(5, 2, 4, device="meta"), "^k is on meta but q"),
        ("cls_attention", "q", lambda: torch.randn(5, 2, 4, device="meta"), "^k is on cpu but q is on meta"),
    ]
    + [(func, "cu_seqlens", lambda: cu(0, 2, 5).to("meta"), "^cu_seqlens must be on cpu") for func in CU_FUNCS]
]

CASES = [
    # pack
    bad("pack", "x", lambda: torch.randn(2, 5, 4).tolist(), TypeError, "^x must be a torch.Tensor", "list"),
    bad("pack", "x", lambda: torch.randn(10, 4), ValueError, "^x must have 3 dimensions", "2d"),
    bad("pack", "x", lambda: torch.ones(2, 5, 4, dtype=torch.int64), TypeError, "^x must have dtype", "int"),
    bad("pack", "x", lambda: torch.randn(2, 5, 4, dtype=torch.float64), TypeError, "^x must have dtype", "fp64"),
    bad("pack", "x", lambda: torch.randn(0, 5, 4), ValueError, "^x must hold at least one image", "empty_batch"),
    bad("pack", "keep", lambda: [[True] * 5] * 2, TypeError, "^keep must be a torch.Tensor", "list"),
    bad("pack", "keep", lambda: torch.ones(2, 5, dtype=torch.int32), TypeError, "^keep must have dtype", "int"),
    bad("pack", "keep", lambda: ones_bool(10), ValueError, "^keep must have 2 dimensions", "1d"),
    bad("pack", "keep", lambda: ones_bool(2, 4), ValueError, r"^keep must have shape \(2, 5\)", "short"),
    bad("pack", "keep", lambda: ones_bool(3, 5), ValueError, r"^keep must have shape \(2, 5\)", "batch"),
    bad("pack", "keep", no_cls_keep, ValueError, r"^keep\[:, 0\] must be True", "no_cls"),
    # unpack
    bad("unpack", "tokens", lambda: [[0.0] * 4] * 5, TypeError, "^tokens must be a torch.Tensor", "list"),
    bad("unpack", "tokens", lambda: torch.randn(5, 2, 2), ValueError, "^tokens must have 2 dimensions", "3d"),
    bad("unpack", "max_seqlen", lambda: 2, ValueError, r"^max_seqlen must be >= .*\(3\)", "too_short"),
    bad("unpack", "max_seqlen", lambda: -1, ValueError, "^max_seqlen must be", "negative"),
    bad("unpack", "max_seqlen", lambda: 4.0, TypeError, "^max_seqlen must be a Python int", "float"),
    bad("unpack", "max_seqlen", lambda: "4", TypeError, "^max_seqlen must be a Python int", "str"),
    bad("unpack", "max_seqlen", lambda: torch.tensor(4), TypeError, "^max_seqlen must be a Python int", "tensor"),
    # repack
    bad("repack", "tokens", lambda: None, TypeError, "^tokens must be a torch.Tensor", "none"),
    bad("repack", "tokens", lambda: torch.randn(5), ValueError, "^tokens must have 2 dimensions", "1d"),
    bad("repack", "keep", lambda: [True] * 5, TypeError, "^keep must be a torch.Tensor", "list"),
    bad("repack", "keep", lambda: torch.ones(5), TypeError, "^keep must have dtype", "float"),
    bad("repack", "keep", lambda: ones_bool(5, 1), ValueError, "^keep must have 1 dimensions", "2d"),
    bad("repack", "keep", lambda: ones_bool(4), ValueError, r"^keep must have shape \(5,\)", "short"),
    bad("repack", "keep", repack_keep_without_cls, ValueError, "^keep must be True at every image's first", "no_cls"),
    bad("repack", "extra_token", lambda: [0.0] * 4, TypeError, "^extra_token must be a torch.Tensor", "list"),
    bad("repack", "extra_token", lambda: torch.randn(8), ValueError, "^extra_token must have 2 dimensions", "1d"),
    bad("repack", "extra_token", lambda: torch.randn(2, 4).half(), TypeError, "^extra_token must have dt", "fp16"),
    bad("repack", "extra_token", lambda: torch.randn(3, 4), ValueError, r"^extra_token must have shape", "batch"),
    bad("repack", "extra_token", lambda: torch.randn(2, 5), ValueError, r"^extra_token must have shape", "channels"),
    # cls_rows
    bad("cls_rows", "tokens", lambda: 5, TypeError, "^tokens must be a torch.Tensor", "int"),
    bad("cls_rows", "tokens", lambda: torch.randn(5, 2, 2), ValueError, "^tokens must have 2 dimensions", "3d"),
    bad("cls_rows", "cu_seqlens", lambda: cu(0, 2, 2, 5), ValueError, "^cu_seqlens describes an empty image", "empty"),
    # padded_attention
    bad("padded_attention", "q", lambda: [1.0], TypeError, "^q must be a torch.Tensor", "list"),
    bad("padded_attention", "k", lambda: torch.ones(2, 2, 3, 4).int(), TypeError, "^k must have dtype", "int"),
    bad("padded_attention", "v", lambda: torch.randn(2, 3, 4), ValueError, "^v must have 4 dimensions", "3d"),
    bad("padded_attention", "q", lambda: torch.randn(6, 4), ValueError, "^q must have 4 dimensions", "2d"),
    bad("padded_attention", "k", lambda: torch.randn(2, 2, 3, 8), ValueError, "^q, k, v shapes disagree", "head_dim"),
    bad("padded_attention", "v", lambda: torch.randn(2, 2, 4, 4), ValueError, "^q, k, v shapes disagree", "length"),
    bad("padded_attention", "q", lambda: torch.randn(1, 2, 3, 4), ValueError, "^q, k, v shapes disagree", "batch"),
    bad("padded_attention", KPM, lambda: [True] * 3, TypeError, "^key_padding_mask must be a torch", "list"),
    bad("padded_attention", KPM, lambda: torch.ones(2, 3), TypeError, "^key_padding_mask must have dtype", "float"),
    bad("padded_attention", KPM, lambda: ones_bool(6), ValueError, "^key_padding_mask must have 2 dim", "1d"),
    bad("padded_attention", KPM, lambda: ones_bool(2, 4), ValueError, "^key_padding_mask must have shape", "shape"),
    # ragged_attention
    bad("ragged_attention", "q", lambda: (1.0,), TypeError, "^q must be a torch.Tensor", "tuple"),
    bad("ragged_attention", "k", lambda: torch.randn(2, 5, 2, 4), ValueError, "^k must have 3 dimensions", "4d"),
    bad("ragged_attention", "v", lambda: torch.ones(5, 2, 4).long(), TypeError, "^v must have dtype", "int"),
    bad("ragged_attention", "k", lambda: torch.randn(5, 2, 8), ValueError, "^q, k, v must share one shape", "head_dim"),
    bad("ragged_attention", "v", lambda: torch.randn(6, 2, 4), ValueError, "^q, k, v must share one shape", "total"),
    # cls_attention
    bad("cls_attention", "q", lambda: None, TypeError, "^q must be a torch.Tensor", "none"),
    bad("cls_attention", "k", lambda: torch.ones(5, 2, 4, dtype=torch.int16), TypeError, "^k must have dtype", "int"),
    bad("cls_attention", "q", lambda: torch.randn(5, 8), ValueError, "^q must have 3 dimensions", "2d"),
    bad("cls_attention", "k", lambda: torch.randn(5, 1, 4), ValueError, "^q and k must share one shape", "heads"),
    # split_qkv
    bad("split_qkv", "qkv", lambda: [[0.0] * 24] * 5, TypeError, "^qkv must be a torch.Tensor", "list"),
    bad("split_qkv", "qkv", lambda: torch.randn(1, 5, 24), ValueError, "^qkv must have 2 dimensions", "3d"),
    bad("split_qkv", "qkv", lambda: torch.randn(5, 20), ValueError, "num_heads", "not_divisible"),
    bad("split_qkv", "num_heads", lambda: 5, ValueError, "num_heads", "not_divisible"),
    bad("split_qkv", "num_heads", lambda: 0, ValueError, "num_heads", "zero"),
    bad("split_qkv", "num_heads", lambda: -2, ValueError, "num_heads", "negative"),
    bad("split_qkv", "num_heads", lambda: 2.0, TypeError, "^num_heads must be a Python int", "float"),
    bad("split_qkv", "num_heads", lambda: "2", TypeError, "^num_heads must be a Python int", "str"),
    bad("split_qkv", "num_heads", lambda: True, TypeError, "^num_heads must be a Python int", "bool"),
]


@pytest.mark.parametrize("func", FUNCS)
def test_valid_baseline(func: str) -> None:
    FUNCS[func](**VALID[func]())  # the cases below each break one argument of exactly this call


@pytest.mark.parametrize("func, arg, make, exc, match", CASES + META_CASES + CU_CASES)
def test_bad_argument_is_named(func: str, arg: str, make: Callable[[], Any], exc: type[Exception], match: str) -> None:
    assert arg in inspect.signature(FUNCS[func]).parameters, f"{func} has no argument {arg}"
    kwargs = VALID[func]()
    kwargs[arg] = make()
    with pytest.raises(exc, match=match):
        FUNCS[func](**kwargs)


@pytest.mark.parametrize("func", ["unpack", "cls_rows", "ragged_attention", "cls_attention"])
def test_zero_total_is_still_checked(func: str) -> None:
    # T = 0 with offsets that claim tokens: the end check must fire even when there are no rows at all.
    kwargs = VALID[func]()
    for name in ("tokens", "q", "k", "v"):
        if name in kwargs:
            kwargs[name] = kwargs[name][:0]
    with pytest.raises(ValueError, match=r"^cu_seqlens\[-1\] must equal the packed length 0"):
        FUNCS[func](**kwargs)


# --- the validation helpers, called directly -----------------------------------------------------------------


@pytest.mark.parametrize(
    "value, kwargs, exc, match",
    [
        pytest.param([1.0], {}, TypeError, "^foo must be a torch.Tensor, got list", id="list"),
        pytest.param(None, {}, TypeError, "^foo must be a torch.Tensor, got NoneType", id="none"),
        pytest.param(
            torch.zeros(2, 3), {"ndim": 3}, ValueError, r"^foo must have 3 dimensions, got shape \(2, 3\)", id="ndim"
        ),
        pytest.param(
            torch.zeros(2, dtype=torch.int64),
            {"dtypes": FLOAT_DTYPES},
            TypeError,
            r"^foo must have dtype in \(float16, bfloat16, float32\), got int64",
            id="dtype",
        ),
        pytest.param(
            torch.zeros(2),
            {"device": torch.device("meta")},
            ValueError,
            "^foo must be on meta like the other inputs, got cpu",
            id="device",
            marks=NEEDS_META,
        ),
    ],
)
def test_check_tensor_rejects(value: object, kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        check_tensor(value, "foo", **kwargs)


def test_check_tensor_accepts_and_returns() -> None:
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert check_tensor(t, "foo", ndim=2, dtypes=iter(FLOAT_DTYPES), device=torch.device("cpu")) is t


@NEEDS_META
def test_check_same_device() -> None:
    a, b = torch.zeros(1), torch.zeros(1)
    assert check_same_device({"a": a, "b": b}) == torch.device("cpu")
    with pytest.raises(ValueError, match="^bar is on meta but foo is on cpu"):
        check_same_device({"foo": a, "baz": b, "bar": torch.zeros(1, device="meta")})


@pytest.mark.parametrize(
    "value, kwargs, exc, match",
    [
        pytest.param((0, 3), {}, TypeError, "^offsets must be a torch.Tensor", id="tuple"),
        pytest.param(cu(0, 3, dtype=torch.int64), {}, TypeError, "^offsets must have dtype in \\(int32\\)", id="int64"),
        pytest.param(cu(0), {}, ValueError, "^offsets must hold at least 2 offsets", id="empty_batch"),
        pytest.param(cu(2, 3), {}, ValueError, r"^offsets\[0\] must be 0, got 2", id="first"),
        pytest.param(cu(0, 3, 1), {}, ValueError, "^offsets must be non-decreasing", id="monotone"),
        pytest.param(cu(0, 3), {"total": 4}, ValueError, r"^offsets\[-1\] must equal the packed length 4", id="total"),
        pytest.param(cu(2, 3), {"check_values": True}, ValueError, r"^offsets\[0\] must be 0", id="forced_values"),
        pytest.param(
            cu(0, 3),
            {"device": torch.device("meta")},
            ValueError,
            "^offsets must be on meta",
            id="device",
            marks=NEEDS_META,
        ),
    ],
)
def test_check_cu_seqlens_rejects(value: object, kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        check_cu_seqlens(value, name="offsets", **kwargs)


def test_check_cu_seqlens_value_checks_are_optional() -> None:
    bad_values = cu(3, 1, 0)
    assert check_cu_seqlens(bad_values, total=7, check_values=False) is bad_values  # metadata only
    ok = cu(0, 0, 4, 4)  # zero-length images (repeated offsets) are valid
    assert check_cu_seqlens(ok, total=4) is ok
    assert check_cu_seqlens(ok) is ok  # total=None: no end check


@NEEDS_META
def test_check_cu_seqlens_skips_value_reads_off_cpu() -> None:
    # Reading values off the CPU would synchronise with the device, so by default only metadata is checked.
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    assert check_cu_seqlens(meta, total=5, device=torch.device("meta")) is meta


@pytest.mark.parametrize(
    "value, exc, match",
    [
        pytest.param(True, TypeError, "^lmax must be a Python int, got bool", id="bool"),
        pytest.param(4.0, TypeError, "^lmax must be a Python int, got float", id="float"),
        pytest.param(None, TypeError, "^lmax must be a Python int, got NoneType", id="none"),
        pytest.param(torch.tensor(4), TypeError, "^lmax must be a Python int, got Tensor", id="tensor"),
        pytest.param(0, ValueError, "^lmax must be >= 1, got 0", id="zero"),
        pytest.param(-3, ValueError, "^lmax must be >= 1, got -3", id="negative"),
    ],
)
def test_check_max_seqlen_rejects(value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        check_max_seqlen(value, name="lmax")


def test_check_max_seqlen_accepts() -> None:
    assert check_max_seqlen(1) == 1 and check_max_seqlen(577) == 577


@pytest.mark.parametrize(
    "value, exc, match",
    [
        pytest.param([[True]], TypeError, "^mask must be a torch.Tensor", id="list"),
        pytest.param(torch.ones(2, 3), TypeError, "^mask must have dtype in \\(bool\\)", id="float"),
        pytest.param(ones_bool(6), ValueError, "^mask must have 2 dimensions", id="1d"),
        pytest.param(ones_bool(3, 2), ValueError, r"^mask must have shape \(2, 3\) to match x", id="shape"),
        pytest.param(
            torch.tensor([[True, True, True], [False, True, True]]), ValueError, r"^mask\[:, 0\]", id="no_cls"
        ),
    ],
)
def test_check_keep_mask_rejects(value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        check_keep_mask(value, 2, 3, torch.device("cpu"), name="mask")


def test_check_keep_mask_accepts_empty_batch() -> None:
    empty = torch.zeros(0, 3, dtype=torch.bool)
    assert check_keep_mask(empty, 0, 3, torch.device("cpu")) is empty


@pytest.mark.parametrize(
    "value, exc, match",
    [
        pytest.param(True, TypeError, "^keep_rate must be a float in \\(0, 1\\], got bool", id="bool"),
        pytest.param("0.5", TypeError, "^keep_rate must be a float", id="str"),
        pytest.param(None, TypeError, "^keep_rate must be a float", id="none"),
        pytest.param(0, ValueError, "^keep_rate must be in \\(0, 1\\], got 0", id="zero"),
        pytest.param(-0.1, ValueError, "^keep_rate must be in", id="negative"),
        pytest.param(1.5, ValueError, "^keep_rate must be in", id="above_one"),
        pytest.param(float("nan"), ValueError, "^keep_rate must be in", id="nan"),
    ],
)
def test_check_rate_rejects(value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        check_rate(value, "keep_rate")


def test_check_rate_accepts() -> None:
    assert check_rate(1, "r") == 1.0 and isinstance(check_rate(1, "r"), float)
    assert check_rate(0.25, "r") == 0.25
