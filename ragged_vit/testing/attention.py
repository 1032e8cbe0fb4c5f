"""The varlen attention contract and its cases (FlashAttention's habit: odd lengths, a 2x-the-dtype's-error rule).

The contract, layout ``"qkv"``: ``fn(qkv [T, 3*H*D], cu_seqlens int32 [B+1], max_seqlen, num_heads, scale) ->
[T, H*D]`` in ``qkv``'s dtype, where ``qkv`` is timm's projection output (q heads, then k heads, then v heads; the
last dimension contiguous, rows possibly strided), image ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]`` and
attends to its own rows only (bidirectional, no mask), and ``max_seqlen`` is only an upper bound on every image's
length. Layout ``"separate"``: ``fn(q, k, v [T, H, D], cu_seqlens, max_seqlen, scale) -> [T, H, D]``, any strides.

Every case draws fresh, seeded inputs (its own generator) and compares with :func:`ragged_vit.reference
.ragged_attention` in float64. **The rule**: the implementation's max error must be at most twice the error of
PyTorch's own attention (``scaled_dot_product_attention``, one image at a time) run in the implementation's dtype on
the same inputs, plus a floor of a few ulps of that dtype (``FLOOR``) for inputs where PyTorch happens to be exact.
The cases:

* ``lengths``: the adversarial lengths 1, 2, 63, 64, 65, 197 (``full``: also 577 and 1025), in one ragged batch and
  (``full``) each alone: a lone class token, tiles just under and over 64, DeiT's 197, 384px DeiT's 577, one over
  1024;
* ``ragged``: random lengths; ``many`` (``full``): 128 images of the adversarial lengths;
* ``empty`` (unless ``empty_images=False``): images without a single row among the others;
* ``strided`` / ``misaligned``: inputs that are views with padded rows, or start one element past an aligned address;
* ``loose_bound``: ``max_seqlen`` twice the longest image (the result stays within the rule);
* ``scale``: a softmax scale other than ``D ** -0.5``;
* ``isolation``: changing one image's inputs leaves every other image's output unchanged, bit for bit;
* ``out`` (with ``accepts_out``): the output buffer, given poisoned with NaN, is written everywhere;
* ``bad_inputs`` (with ``bad_inputs``): a wrong dtype or shape raises ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.reference.attention import ragged_attention, split_qkv
from ragged_vit.testing.report import Failure, bad_call_failures, level, raise_failures

QUICK_LENGTHS = (1, 2, 63, 64, 65, 197)
ADVERSARIAL_LENGTHS = (*QUICK_LENGTHS, 577, 1025)
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LAYOUTS = ("qkv", "separate")


@dataclass(frozen=True)
class AttentionCase:
    """One case: its kind, the images' lengths, heads, head dim and dtype."""

    kind: str
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def id(self) -> str:
        lengths = "-".join(map(str, self.lengths)) if len(self.lengths) <= 4 else f"{len(self.lengths)}images"
        return f"{self.kind}[{lengths}]-h{self.heads}d{self.head_dim}-{str(self.dtype).removeprefix('torch.')}"

    def generator(self, salt: int = 0) -> torch.Generator:
        """Fresh inputs per case, reproducible per case."""
        return torch.Generator().manual_seed(zlib.crc32(self.id.encode()) + salt)


def default_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes a device checks: fp32 and fp16 under Triton's CPU interpreter (it stores bf16 wrongly), all three
    on a GPU."""
    if device.type == "cpu":
        return (torch.float32, torch.float16)
    return (torch.float16, torch.bfloat16, torch.float32)


def attention_cases(
    level_name: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    head_dims: Iterable[int] | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
) -> list[AttentionCase]:
    """The cases of ``level_name`` (``quick``/``full``; see :func:`ragged_vit.testing.level`) for ``device``; with
    ``bad_inputs``, one more that checks the argument errors."""
    full = level(level_name) == "full"
    device = torch.device(device)
    dtypes = tuple(dtypes or default_dtypes(device))
    head_dims = tuple(head_dims or ((32, 64) if full else (32,)))
    heads = 3 if full else 2
    lengths = ADVERSARIAL_LENGTHS if full else QUICK_LENGTHS
    g = torch.Generator().manual_seed(0)
    ragged = tuple(int(n) for n in torch.randint(1, 198, (16 if full else 5,), generator=g))
    many = tuple(ADVERSARIAL_LENGTHS[int(i)] for i in torch.randint(len(ADVERSARIAL_LENGTHS), (128,), generator=g))
    cases = []
    for dtype in dtypes:
        for head_dim in head_dims:
            shapes = [("lengths", lengths), ("ragged", ragged), ("strided", (3, 65, 1)), ("misaligned", (40, 7)),
                      ("loose_bound", (70, 5, 33)), ("scale", (5, 64)), ("isolation", (40, 70, 9))]  # fmt: skip
            if empty_images:
                shapes.append(("empty", (5, 0, 64, 0)))
            if full:
                shapes += [("lengths", (n,)) for n in ADVERSARIAL_LENGTHS] + [("many", many)]
            cases += [AttentionCase(kind, tuple(lens), heads, head_dim, dtype) for kind, lens in shapes]
    if bad_inputs:
        cases.append(AttentionCase("bad_inputs", (4, 6), 2, 32, torch.float32))
    return cases


def check_attention(
    fn: Callable[..., torch.Tensor],
    *,
    layout: str = "qkv",
    level_name: str | None = None,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    head_dims: Iterable[int] | None = None,
    accepts_out: bool = False,
    bad_inputs: bool = False,
    empty_images: bool = True,
) -> int:
    """Runs every case of the attention contract on ``fn``; raises :class:`ConformanceError` listing each failed
    case; returns how many cases ran.

    Args:
        fn: the implementation, called as the module docstring says for ``layout``.
        layout: ``"qkv"`` or ``"separate"``.
        level_name: ``"quick"`` or ``"full"`` (default: ``$RAGGED_VIT_CONFORMANCE``, else quick).
        device: where the inputs live.
        dtypes, head_dims: restrict the cases to what ``fn`` supports.
        accepts_out: ``fn`` takes ``out=`` (then it is given a NaN-poisoned buffer to fill).
        bad_inputs: ``fn`` validates its arguments (a public entry; an attention backend trusts its caller).
        empty_images: ``fn`` takes images of no rows (the pipelines never make one).
    """
    cases = attention_cases(
        level_name, device=device, dtypes=dtypes, head_dims=head_dims, bad_inputs=bad_inputs, empty_images=empty_images
    )
    failures = [f for case in cases for f in run_attention_case(fn, case, layout, device, accepts_out)]
    raise_failures(f"attention ({layout} layout)", failures)
    return len(cases)


def attention_suite(
    fn: Callable[..., torch.Tensor],
    *,
    layout: str = "qkv",
    device: torch.device | str = "cpu",
    accepts_out: bool = False,
    **options: object,
):
    """A pytest test function running every case of :func:`check_attention` as its own test item (``options``:
    ``level_name``, ``dtypes``, ``head_dims``, ``bad_inputs``, ``empty_images``): a port's test file is
    ``test_my_attention = attention_suite(my_fn, layout="qkv", device="cuda")``."""
    import pytest

    cases = attention_cases(device=device, **options)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test(case: AttentionCase) -> None:
        raise_failures(f"attention ({layout} layout)", run_attention_case(fn, case, layout, device, accepts_out))

    return test


def run_attention_case(
    fn: Callable[..., torch.Tensor], case: AttentionCase, layout: str, device: torch.device | str, accepts_out: bool
) -> list[Failure]:
    """One case's failures (empty when ``fn`` passes it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = torch.device(device)
    if case.kind == "bad_inputs":
        return _bad_input_failures(fn, layout, device)
    g = case.generator()
    cu = cu_seqlens_from_counts(torch.tensor(case.lengths)).to(device)
    total, width = int(cu[-1]), case.heads * case.head_dim
    qkv = _qkv(total, width, case, device, g)
    scale = 0.3 if case.kind == "scale" else case.head_dim**-0.5
    bound = max(max(case.lengths), 1)
    if case.kind == "loose_bound":
        bound = 2 * bound + 7
    try:
        out = _call(fn, layout, qkv, cu, bound, case, scale, accepts_out)
    except Exception as exc:  # a crash is a failed case, reported like the others
        return [Failure(case.id, "runs", f"{type(exc).__name__}: {exc}", "a result")]
    failures = _close(case, out, qkv, cu, scale)
    if case.kind == "isolation" and not failures:
        failures = _isolation(fn, layout, case, qkv, cu, bound, scale, out, accepts_out, g)
    return failures


def _qkv(total: int, width: int, case: AttentionCase, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """The qkv projection ``[T, 3*H*D]`` of a case: a plain tensor, a view with padded rows, or one element off an
    aligned address."""
    values = torch.randn(total, 3 * width, generator=g)
    if case.kind == "strided":
        store = torch.randn(total, 3 * width + 8, generator=g)
        store[:, : 3 * width] = values
        return store.to(device, case.dtype)[:, : 3 * width]
    if case.kind == "misaligned":
        flat = torch.empty(total * 3 * width + 1, dtype=case.dtype, device=device)
        view = flat[1:].view(total, 3 * width)
        view.copy_(values)
        return view
    return values.to(device, case.dtype)


def _call(fn, layout, qkv, cu, bound, case, scale, accepts_out):
    total, width = qkv.shape[0], case.heads * case.head_dim
    if layout == "qkv":
        kwargs = {"out": _poisoned((total, width), qkv)} if accepts_out else {}
        return fn(qkv, cu, bound, case.heads, scale, **kwargs).reshape(total, case.heads, case.head_dim)
    q, k, v = split_qkv(qkv, case.heads)  # [T, H, D] views with the qkv row stride
    kwargs = {"out": _poisoned((total, case.heads, case.head_dim), qkv)} if accepts_out else {}
    return fn(q, k, v, cu, bound, scale, **kwargs)


def _poisoned(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _close(case: AttentionCase, out: torch.Tensor, qkv: torch.Tensor, cu: torch.Tensor, scale: float) -> list[Failure]:
    shape = (qkv.shape[0], case.heads, case.head_dim)
    if tuple(out.shape) != shape or out.dtype != qkv.dtype:
        return [Failure(case.id, "output shape and dtype", f"{tuple(out.shape)} {out.dtype}", f"{shape} {qkv.dtype}")]
    if not bool(torch.isfinite(out).all()):
        return [Failure(case.id, "finite output (NaN-poisoned buffers written everywhere)", "NaN or inf", "none")]
    err, yard = attention_error(out, *split_qkv(qkv, case.heads), cu, scale)
    allowed = 2 * yard + FLOOR[qkv.dtype]
    if not err <= allowed:
        rule = "max error <= 2 x PyTorch's in the same dtype + floor"
        return [Failure(case.id, rule, f"{err:.3g}", f"{allowed:.3g} (2 x {yard:.3g} + {FLOOR[qkv.dtype]:g})")]
    return []


def attention_error(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None = None
) -> tuple[float, float]:
    """``(error, yardstick)``: the max error of ``out [T, H, D]`` against the float64 reference, and that of PyTorch's
    own attention in ``q``'s dtype; the rule allows ``2 * yardstick + FLOOR[dtype]`` (see the module docstring)."""
    if out.numel() == 0:
        return 0.0, 0.0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = ragged_attention(q.double(), k.double(), v.double(), cu, scale=scale)
    err = (out.reshape(ref.shape).double() - ref).abs().max().item()
    return err, (_torch_in_dtype(q, k, v, cu, scale).double() - ref).abs().max().item()


def assert_attention_close(out, q, k, v, cu, scale: float | None = None) -> None:
    """Asserts the rule on one output (for a test of a kernel's own configurations)."""
    err, yard = attention_error(out, q, k, v, cu, scale)
    allowed = 2 * yard + FLOOR[q.dtype]
    assert err <= allowed, f"max error {err:.3g} > 2 x PyTorch's {yard:.3g} + floor {FLOOR[q.dtype]:g}"


def _torch_in_dtype(q, k, v, cu, scale) -> torch.Tensor:
    """PyTorch's attention in the inputs' own dtype, one image at a time: the error yardstick."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def _isolation(fn, layout, case, qkv, cu, bound, scale, out, accepts_out, g) -> list[Failure]:
    """Changing the middle image's rows must leave the others' outputs unchanged, bit for bit."""
    bounds = cu.tolist()
    start, end = bounds[1], bounds[2]
    changed = qkv.clone()
    changed[start:end] = torch.randn(end - start, qkv.shape[1], generator=g).to(qkv.device, qkv.dtype)
    again = _call(fn, layout, changed, cu, bound, case, scale, accepts_out)
    others = torch.ones(qkv.shape[0], dtype=torch.bool, device=qkv.device)
    others[start:end] = False
    if not torch.equal(again[others], out[others]):
        rule = "isolation: another image's inputs change no output"
        return [Failure(case.id, rule, "outputs changed", "bitwise equal")]
    return []


def _bad_input_failures(fn, layout, device) -> list[Failure]:
    """Wrong dtypes and shapes must raise ``TypeError`` or ``ValueError`` (checked before any launch, by contract)."""
    device = torch.device(device)
    qkv = torch.randn(10, 3 * 2 * 32, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    q, k, v = split_qkv(qkv, 2)
    calls = {
        "qkv": {
            "int64 cu_seqlens": lambda: fn(qkv, cu.long(), 10, 2, 0.25),
            "3-D qkv": lambda: fn(qkv[None], cu, 10, 2, 0.25),
            "heads not dividing the width": lambda: fn(qkv, cu, 10, 5, 0.25),
            "max_seqlen 0": lambda: fn(qkv, cu, 0, 2, 0.25),
        },
        "separate": {
            "int64 cu_seqlens": lambda: fn(q, k, v, cu.long(), 10, 0.25),
            "k of another dtype": lambda: fn(q, k.double(), v, cu, 10, 0.25),
            "k of another shape": lambda: fn(q, k[:, :1], v, cu, 10, 0.25),
            "max_seqlen 0": lambda: fn(q, k, v, cu, 0, 0.25),
        },
    }[layout]
    return bad_call_failures((name, None, call) for name, call in calls.items())
