"""The fused linear contract and its cases: a ViT block's linear layer with its LayerNorm, bias, GELU, LayerScale and
residual fused in (:func:`ragged_vit.reference.linear.fused_linear`).

The contract: ``fn(x [M, K], weight [N, K], bias=None, *, ln_weight=None, ln_bias=None, eps=..., activation=None,
residual=None, gamma=None) -> [M, N]`` in ``x``'s dtype, computing ``residual + gamma * act(LayerNorm(x) @ weight.T +
bias)`` where each part is optional (the LayerNorm is on iff ``ln_weight`` is given; ``activation`` is None, ``"gelu"``,
exact erf, or ``"gelu_tanh"``). Every row is computed from its own row of ``x`` alone. A case passes only the keyword
arguments it uses, so a port that fuses less can be checked on what it fuses (``activations=``).

Two optional arguments carry a LayerNorm's statistics between layers (``ragged_vit.reference.linear``'s layout: a
``[P, M, 2]`` float32 tensor of each row's chunk means and M2): a port that takes ``ln_stats=`` (``ln_stats=True``)
must normalise with the statistics given, in any valid chunking; a port that writes ``stats_out=`` (a buffer from its
``stats_buffer(rows, cols, device)``) must fill it with the statistics of the rows it returns, as rounded.

Every case draws fresh, seeded inputs (its own generator) and compares with the reference in float64. **The rule**: the
implementation's max error must be at most twice that of PyTorch's own unfused ops run in the implementation's dtype
on the same inputs (``F.layer_norm``, ``F.linear``, ``F.gelu``, a multiply, an add: what a timm block runs), plus a
floor of a few ulps of that dtype times the output's magnitude (``FLOOR``). The cases:

* ``rows``: the odd row counts 1, 7, 99, 197, 255 (the packed rows of a pruned batch-1 forward), each with another
  combination of the fusions, every fusion at least once and all of them together;
* ``fusion``: each fusion alone (``ln``, ``ln_weight_only``, ``bias``, ``gelu``, ``gelu_tanh``, ``gamma``,
  ``residual``) and none;
* ``strided`` / ``misaligned``: ``x`` and ``residual`` as views with padded rows, or one element off an aligned
  address;
* ``shapes``: K and N not multiples of the usual tile sizes (48, 80, 112) and (``full``) ViT-B's 768 / 2304 / 3072;
* ``isolation``: changing some rows of ``x`` (and of ``residual``) leaves every other row's output unchanged, bit for
  bit (LayerNorm statistics from the row alone, no row mixed into another); ``deterministic``: two calls, the same bits;
* numerically adversarial inputs: ``large_mean`` (LayerNorm on rows of mean 1000 and spread 1: statistics taken as
  ``E[x^2] - E[x]^2`` in fp32, or without the mean subtracted, are far off), ``flat_rows`` (rows of spread 1e-3,
  variance equal to ``eps``, and exactly constant rows: ``eps`` misplaced or dropped, or a NaN for a zero variance),
  ``gelu_tails`` (pre-activations of magnitude up to 40: a tanh written with ``exp(2u)`` overflows to NaN, an erf
  GELU must give 0 and ``y``), ``positive_sums`` (non-negative ``x`` and ``weight`` over K = 1024: sums an fp16
  accumulator cannot hold to a tenth), ``layer_scale`` (``gamma`` of 1e-5 on a residual of 100, as DeiT-III
  initialises LayerScale);
* ``ln_stats`` (with ``ln_stats``): the statistics given in uneven chunks (K = 96 in 64 + 32 columns; ``full``: ViT-B's
  fc1 in 12 chunks), and in three chunks of rows of mean 1000 (``ln_stats_large_mean``); ``stats_out`` (with
  ``stats_buffer``): the buffer, given poisoned with NaN, merges into the returned rows' mean and variance (float64
  from the output) within fp32 summation error;
* ``out`` (with ``accepts_out``): the output buffer, given poisoned with NaN, is written everywhere, and ``out`` given
  as ``residual`` itself is an in-place residual add;
* ``bad_inputs`` (with ``bad_inputs``): wrong dtypes and shapes raise ``TypeError`` / ``ValueError`` naming the
  argument.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..reference.linear import fused_linear, layer_norm_stats, merge_ln_stats
from .report import Failure, bad_call_failures, level, raise_failures

ODD_ROWS = (1, 7, 99, 197, 255)
FUSIONS = ("ln", "ln_weight_only", "bias", "gelu", "gelu_tanh", "gamma", "residual")
# The fusion sets of the ``rows`` cases, one per odd row count, in turn: every fusion once, then all of them.
ROW_FUSIONS = (("ln", "bias"), ("bias", "gelu"), ("residual",), ("ln", "gelu_tanh", "gamma", "residual"),
               ("ln", "bias", "gelu", "gamma", "residual"))  # fmt: skip
EPS = 1e-6  # timm's ViTs' LayerNorm epsilon
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NUMERIC_CASES = {  # kind -> (rows, K, N, fusions)
    "large_mean": (37, 96, 48, ("ln", "bias")),
    "flat_rows": (20, 64, 48, ("ln", "bias", "residual")),
    "gelu_tails": (33, 64, 80, ("bias", "gelu")),
    "gelu_tails_tanh": (33, 64, 80, ("bias", "gelu_tanh")),
    "positive_sums": (17, 1024, 32, ()),
    "layer_scale": (25, 64, 48, ("bias", "gamma", "residual")),
}
STATS_CASES = {  # kind -> (rows, K, N, fusions): the cases of the statistics between layers
    "ln_stats": (37, 96, 48, ("ln", "bias")),
    "ln_stats_large_mean": (20, 96, 48, ("ln",)),
    "stats_out": (33, 64, 96, ("bias", "gamma", "residual")),
}
STATS_TOLERANCE = 1e-5
"""``stats_out``'s merged mean may be off by this times the output's magnitude, its variance by this times itself
(plus the same of the magnitude squared, for flat rows): fp32 sums of the rounded output."""
VIT_B = ((768, 2304, ("ln", "bias")), (768, 768, ("bias", "gamma", "residual")), (768, 3072, ("ln", "bias", "gelu")),
         (3072, 768, ("bias", "residual")))  # fmt: skip


StatsBuffer = Callable[[int, int, torch.device], torch.Tensor]
"""``(rows, cols, device) -> [P, rows, 2]`` float32: a port's ``stats_out`` buffer for an ``[rows, cols]`` output."""


@dataclass(frozen=True)
class LinearCase:
    """One case: its kind, ``M`` rows, ``K`` in, ``N`` out, the dtype and the fusions it passes (names of
    :data:`FUSIONS`)."""

    kind: str
    rows: int
    depth: int
    cols: int
    dtype: torch.dtype
    fusions: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        fused = "+".join(self.fusions) or "plain"
        return f"{self.kind}[{self.rows}x{self.depth}->{self.cols}]-{fused}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def activation(self) -> str | None:
        return next((f for f in self.fusions if f in ("gelu", "gelu_tanh")), None)

    def generator(self, salt: int = 0) -> torch.Generator:
        """Fresh inputs per case, reproducible per case."""
        return torch.Generator().manual_seed(zlib.crc32(self.id.encode()) + salt)


def default_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """Every float dtype, on the CPU too (PyTorch's yardstick runs in each there)."""
    return (torch.float32, torch.float16, torch.bfloat16)


def linear_cases(
    level_name: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    activations: Iterable[str] = ("gelu", "gelu_tanh"),
    bad_inputs: bool = False,
    ln_stats: bool = False,
    stats_out: bool = False,
) -> list[LinearCase]:
    """The cases of ``level_name`` (``quick``/``full``) for ``device``; ``activations`` are those ``fn`` supports (the
    cases of the others are left out); with ``bad_inputs``, one more that checks the argument errors; with
    ``ln_stats`` / ``stats_out``, the cases of the statistics taken / written."""
    full = level(level_name) == "full"
    dtypes = tuple(dtypes or default_dtypes(torch.device(device)))
    shapes: list[tuple[str, int, int, int, tuple[str, ...]]] = [
        ("rows", m, 128, 64, fused) for m, fused in zip(ODD_ROWS, ROW_FUSIONS, strict=True)
    ]
    shapes += [("fusion", 33, 96, 80, (f,)) for f in ("", *FUSIONS)]
    shapes += [("strided", 19, 64, 48, ("ln", "residual")), ("misaligned", 21, 64, 48, ("ln", "bias", "residual")),
               ("shapes", 9, 48, 112, ("bias",)), ("shapes", 40, 112, 16, ("ln",)),
               ("isolation", 50, 64, 48, ("ln", "bias", "gelu", "residual")),
               ("deterministic", 99, 256, 48, ("ln",))]  # fmt: skip
    shapes += [(kind, m, k, n, fused) for kind, (m, k, n, fused) in NUMERIC_CASES.items()]
    if full:
        shapes += [("vit_b", m, k, n, fused) for m in (1, 50, 197, 255) for k, n, fused in VIT_B]
        shapes += [("rows", m, 256, 192, ROW_FUSIONS[-1]) for m in (2, 16, 17, 64, 65, 128, 129, 256, 257, 394)]
        shapes += [("shapes", 5, 8192, 16, ("ln",)), ("shapes", 3, 16, 8192, ("bias", "gelu"))]
    wanted = {"ln_stats": ln_stats, "ln_stats_large_mean": ln_stats, "stats_out": stats_out}
    shapes += [(kind, m, k, n, fused) for kind, (m, k, n, fused) in STATS_CASES.items() if wanted[kind]]
    if full:
        shapes += [("ln_stats", 197, k, n, fused) for k, n, fused in VIT_B if ln_stats and "ln" in fused]
        shapes += [("stats_out", 197, k, n, fused) for k, n, fused in VIT_B if stats_out and "residual" in fused]
    supported = set(activations)
    cases = [
        LinearCase(kind, m, k, n, dtype, tuple(f for f in fused if f))
        for dtype in dtypes
        for kind, m, k, n, fused in shapes
        if not ({"gelu", "gelu_tanh"} & set(fused)) - supported
    ]
    if bad_inputs:
        cases.append(LinearCase("bad_inputs", 4, 32, 16, torch.float32))
    return cases


def check_linear(
    fn: Callable[..., torch.Tensor],
    *,
    level_name: str | None = None,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    activations: Iterable[str] = ("gelu", "gelu_tanh"),
    accepts_out: bool = False,
    bad_inputs: bool = False,
    ln_stats: bool = False,
    stats_buffer: StatsBuffer | None = None,
) -> int:
    """Runs every case of the fused linear contract on ``fn``; raises :class:`ConformanceError` listing each failed
    case; returns how many cases ran.

    Args:
        fn: the implementation, called as the module docstring says.
        level_name: ``"quick"`` or ``"full"`` (default: ``$RAGGED_VIT_CONFORMANCE``, else quick).
        device: where the inputs live.
        dtypes, activations: restrict the cases to what ``fn`` supports.
        accepts_out: ``fn`` takes ``out=`` (then it is given a NaN-poisoned buffer to fill, and ``residual`` itself).
        bad_inputs: ``fn`` validates its arguments (a public entry).
        ln_stats: ``fn`` takes ``ln_stats=`` (the LayerNorm's statistics, chunked).
        stats_buffer: ``fn`` takes ``stats_out=``; ``stats_buffer(rows, cols, device)`` allocates one for it.
    """
    cases = linear_cases(level_name, device=device, dtypes=dtypes, activations=activations, bad_inputs=bad_inputs,
                         ln_stats=ln_stats, stats_out=stats_buffer is not None)  # fmt: skip
    failures = [f for case in cases for f in run_linear_case(fn, case, device, accepts_out, stats_buffer)]
    raise_failures("fused linear", failures)
    return len(cases)


def linear_suite(fn: Callable[..., torch.Tensor], *, device: torch.device | str = "cpu", accepts_out: bool = False,
                 stats_buffer: StatsBuffer | None = None, **options: object):  # fmt: skip
    """A pytest test function running every case of :func:`check_linear` as its own test item (``options``:
    ``level_name``, ``dtypes``, ``activations``, ``bad_inputs``, ``ln_stats``): ``test_my_linear =
    linear_suite(my_fn)``."""
    import pytest

    cases = linear_cases(device=device, stats_out=stats_buffer is not None, **options)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test(case: LinearCase) -> None:
        raise_failures("fused linear", run_linear_case(fn, case, device, accepts_out, stats_buffer))

    return test


def linear_inputs(case: LinearCase, device: torch.device | str = "cpu") -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a case's call (its fresh inputs, in its dtype, on ``device``): ``x, weight`` and the
    ``bias`` positionally, the other fusions by keyword, only those the case uses."""
    g, dtype, device = case.generator(), case.dtype, torch.device(device)
    m, k, n = case.rows, case.depth, case.cols
    x = torch.randn(m, k, generator=g)
    weight = torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g) * 0.5
    ln_weight = 1.0 + 0.3 * torch.randn(k, generator=g)
    ln_bias = 0.3 * torch.randn(k, generator=g)
    gamma = 0.5 + torch.rand(n, generator=g)
    residual = torch.randn(m, n, generator=g) * 2.0
    if case.kind.endswith("large_mean"):
        x = 1000.0 + x
    elif case.kind == "flat_rows":  # spread 1e-3 (variance = eps); every third row exactly constant
        x = 0.25 + 1e-3 * x
        x[::3] = 0.25
    elif case.kind.startswith("gelu_tails"):  # pre-activations spread over +-40
        weight = weight * 20.0
        bias = torch.linspace(-40.0, 40.0, n)
    elif case.kind == "positive_sums":
        x, weight = torch.rand(m, k, generator=g), torch.rand(n, k, generator=g)
    elif case.kind == "layer_scale":
        gamma, residual = 1e-5 * (1.0 + torch.rand(n, generator=g)), 100.0 * residual
    if case.kind in ("strided", "misaligned"):
        x, residual = _laid_out(x, case, device), _laid_out(residual, case, device)
    else:
        x, residual = x.to(device, dtype), residual.to(device, dtype)
    weight, bias, ln_weight, ln_bias, gamma = (t.to(device, dtype) for t in (weight, bias, ln_weight, ln_bias, gamma))
    fused = set(case.fusions)
    kwargs: dict[str, object] = {}
    if fused & {"ln", "ln_weight_only"}:
        kwargs.update(ln_weight=ln_weight, eps=EPS)
        if "ln" in fused:
            kwargs["ln_bias"] = ln_bias
    if case.activation:
        kwargs["activation"] = case.activation
    if "gamma" in fused:
        kwargs["gamma"] = gamma
    if "residual" in fused:
        kwargs["residual"] = residual
    if case.kind.startswith("ln_stats"):  # of the rows as the port sees them, in uneven chunks where K allows
        kwargs["ln_stats"] = layer_norm_stats(x, 3 if case.kind.endswith("large_mean") else max(2, k // 64))
    args = (x, weight, bias) if "bias" in fused else (x, weight)
    return args, kwargs


def _laid_out(values: torch.Tensor, case: LinearCase, device: torch.device) -> torch.Tensor:
    """``values`` as a view with 8 padding columns per row (``strided``) or one element off an aligned address."""
    rows, width = values.shape
    if case.kind == "strided":
        store = torch.full((rows, width + 8), float("nan"), dtype=case.dtype, device=device)
        return store[:, :width].copy_(values)
    flat = torch.empty(rows * width + 1, dtype=case.dtype, device=device)
    return flat[1:].view(rows, width).copy_(values)


def run_linear_case(
    fn: Callable[..., torch.Tensor],
    case: LinearCase,
    device: torch.device | str,
    accepts_out: bool,
    stats_buffer: StatsBuffer | None = None,
) -> list[Failure]:
    """One case's failures (empty when ``fn`` passes it)."""
    device = torch.device(device)
    if case.kind == "bad_inputs":
        return _bad_input_failures(fn, device)
    args, kwargs = linear_inputs(case, device)
    x = args[0]
    try:
        out = _call(fn, args, kwargs, accepts_out)
    except Exception as exc:  # a crash is a failed case, reported like the others
        return [Failure(case.id, "runs", f"{type(exc).__name__}: {exc}", "a result")]
    failures = _close(case, out, args, kwargs)
    if failures:
        return failures
    if case.kind == "stats_out" and stats_buffer is not None:
        return _stats_failures(fn, case, args, kwargs, accepts_out, stats_buffer(case.rows, case.cols, device))
    if case.kind == "isolation":
        changed = dict(kwargs)
        x2 = x.clone()
        x2[10:20] = torch.randn(10, x.shape[1], generator=case.generator(1)).to(x.device, x.dtype)
        if "residual" in changed:
            changed["residual"] = kwargs["residual"].clone()
            changed["residual"][15:25] = 7.0
        again = _call(fn, (x2, *args[1:]), changed, accepts_out)
        others = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        others[10:25] = False
        if not torch.equal(again[others], out[others]):
            return [Failure(case.id, "isolation: other rows' inputs change no output row", "rows changed", "bitwise")]
    if case.kind == "deterministic" and not torch.equal(_call(fn, args, kwargs, accepts_out), out):
        return [Failure(case.id, "deterministic: two calls give the same bits", "different bits", "bitwise")]
    if accepts_out and "residual" in kwargs:  # out given as residual itself: an in-place residual add
        inplace = dict(kwargs, residual=kwargs["residual"].clone())
        got = fn(*args, **inplace, out=inplace["residual"])
        if got.data_ptr() != inplace["residual"].data_ptr() or not torch.equal(got, out):
            return [Failure(case.id, "out=residual: the in-place add gives the same bits", "different", "bitwise")]
    return []


def _stats_failures(fn, case: LinearCase, args: tuple, kwargs: dict, accepts_out: bool, buffer: torch.Tensor):
    """``stats_out`` (given poisoned with NaN) merges into the returned rows' mean and variance."""
    buffer.fill_(float("nan"))
    out = _call(fn, args, {**kwargs, "stats_out": buffer}, accepts_out).double()
    if not bool(torch.isfinite(buffer).all()):
        return [Failure(case.id, "stats_out: written everywhere", "NaN left", "every chunk of every row")]
    mean, var = merge_ln_stats(buffer.double(), case.cols)
    scale = max(1.0, out.abs().max().item())
    mean_err = (mean - out.mean(-1)).abs().max().item()
    var_err = ((var - out.var(-1, unbiased=False)).abs() - STATS_TOLERANCE * out.var(-1, unbiased=False)).max().item()
    allowed = STATS_TOLERANCE * scale
    if not (mean_err <= allowed and var_err <= allowed * scale):
        observed = f"mean off by {mean_err:.3g}, variance by {var_err:.3g} past its relative tolerance"
        return [Failure(case.id, "stats_out: the returned rows' statistics", observed, f"{allowed:.3g} (x scale)")]
    return []


def _call(fn, args, kwargs, accepts_out):
    if accepts_out:
        x, weight = args[0], args[1]
        out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
        return fn(*args, **kwargs, out=out)
    return fn(*args, **kwargs)


def _close(case: LinearCase, out: torch.Tensor, args: tuple, kwargs: dict) -> list[Failure]:
    shape, dtype = (case.rows, case.cols), args[0].dtype
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
        observed = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        return [Failure(case.id, "output shape and dtype", observed, f"{shape} {dtype}")]
    if not bool(torch.isfinite(out).all()):
        return [Failure(case.id, "finite output (NaN-poisoned buffers written everywhere)", "NaN or inf", "none")]
    err, yard, allowed = _errors(out, args, kwargs)
    if not err <= allowed:
        rule = "max error <= 2 x PyTorch's unfused ops in the same dtype + floor"
        return [Failure(case.id, rule, f"{err:.3g}", f"{allowed:.3g} (2 x {yard:.3g} + floor)")]
    return []


def _errors(out: torch.Tensor, args: tuple, kwargs: dict) -> tuple[float, float, float]:
    exact = fused_linear(*(None if t is None else t.double() for t in args), **_as(kwargs, torch.float64))
    if exact.numel() == 0:
        return 0.0, 0.0, 0.0
    err = (out.double() - exact).abs().max().item()
    yard = (_unfused(*args, **kwargs).double() - exact).abs().max().item()
    floor = FLOOR[out.dtype] * max(1.0, exact.abs().max().item())
    return err, yard, 2 * yard + floor


def linear_error(out: torch.Tensor, *args: torch.Tensor, **kwargs: object) -> tuple[float, float]:
    """``(error, allowed)``: the max error of ``out`` against the float64 reference of ``fused_linear(*args,
    **kwargs)``, and what the rule allows (twice PyTorch's unfused ops' error in the inputs' dtype plus the floor)."""
    err, _, allowed = _errors(out, args, kwargs)
    return err, allowed


def assert_linear_close(out: torch.Tensor, *args: torch.Tensor, **kwargs: object) -> None:
    """Asserts the rule on one output (for a test of a kernel's own configurations)."""
    err, allowed = linear_error(out, *args, **kwargs)
    assert err <= allowed, f"max error {err:.3g} > allowed {allowed:.3g} (2 x PyTorch's unfused ops + floor)"


def _as(kwargs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _unfused(x, weight, bias=None, *, ln_weight=None, ln_bias=None, eps=1e-5, activation=None, residual=None,
             gamma=None, ln_stats=None) -> torch.Tensor:  # fmt: skip
    """PyTorch's own ops in the inputs' dtype, one at a time, as a timm block runs them: the error yardstick
    (``ln_stats`` unused: ``F.layer_norm`` takes its own)."""
    dtype = x.dtype
    h = x if ln_weight is None else F.layer_norm(x, x.shape[-1:], ln_weight.to(dtype), _to(ln_bias, dtype), eps)
    y = F.linear(h, weight, _to(bias, dtype))
    if activation is not None:
        y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if gamma is not None:
        y = y * gamma.to(dtype)
    return y if residual is None else residual + y


def _to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _bad_input_failures(fn: Callable[..., torch.Tensor], device: torch.device) -> list[Failure]:
    """Wrong dtypes and shapes must raise ``TypeError`` or ``ValueError`` naming the argument (before any launch)."""
    x = torch.randn(4, 32, device=device)
    w = torch.randn(16, 32, device=device)
    vec_n, vec_k = torch.zeros(16, device=device), torch.ones(32, device=device)
    calls = [
        ("3-D x", "x", lambda: fn(x[None], w)),
        ("float64 x", "x", lambda: fn(x.double(), w.double())),
        ("weight of another dtype", "weight", lambda: fn(x, w.half())),
        ("weight with another K", "weight", lambda: fn(x, w[:, :16])),
        ("bias of K values", "bias", lambda: fn(x, w, vec_k)),
        ("ln_weight of N values", "ln_weight", lambda: fn(x, w, ln_weight=vec_n)),
        ("ln_bias of N values", "ln_bias", lambda: fn(x, w, ln_weight=vec_k, ln_bias=vec_n)),
        ("gamma of K values", "gamma", lambda: fn(x, w, gamma=vec_k)),
        ("residual of another shape", "residual", lambda: fn(x, w, residual=x)),
        ("residual on another device", "residual", lambda: fn(x, w, residual=torch.zeros(4, 16, device="meta"))),
        ("an unknown activation", "activation", lambda: fn(x, w, activation="relu")),
    ]
    return bad_call_failures(calls)
