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
* numerically adversarial inputs: ``large_logits`` (one image's logits reach +60 and another's all lie near -60:
  an exp without its image's own maximum subtracted overflows in fp16 and bf16, and one stabilised by the maximum
  of the whole batch underflows to 0 / 0), ``dominant_key`` (one key per image +30 above the others: a one-hot
  softmax), ``equal_keys`` (every key of an image equal: the mean of its values), and in fp32 ``tiny`` and
  ``huge`` magnitudes (inputs scaled by 1e-18 and 1e12: logits that underflow to 0, and that reach 1e25);
  ``tiles`` (``full``): lengths at the usual tile sizes and one past them (16, 17, 32, 33, 128, 129);
* ``out`` (with ``accepts_out``): the output buffer, given poisoned with NaN, is written everywhere;
* ``bad_inputs`` (with ``bad_inputs``): a wrong dtype or shape raises ``TypeError`` / ``ValueError``.

**The key-bias variant** (``key_bias=True``): ``fn`` also takes ``key_bias=``, a float32 ``[T]`` (contiguous, finite)
added to every logit of key row ``t`` after the scale, in natural-log units, the same for every head and query (ToMe's
proportional attention passes ``log(size)``); padding and other images' keys stay excluded. Every case of the variant
passes one, and the rule is the same with the bias on both sides: the float64 reference with the bias against
PyTorch's attention with the bias as a float mask in the implementation's dtype (what a user would pass). The bias
values are representable in that dtype, so the yardstick measures the dtype's attention error, not the rounding of
the bias. Its cases: a normal bias on the odd lengths 1, 63, 65, 197 (``full``: every adversarial length), the log
of integer sizes 1..16 on misaligned inputs (the bias one element off an aligned address too) and on images without
rows, a large bias on a loose bound (distinct multiples of 64 within each image, up to ``64 * N / 2`` in magnitude:
each softmax is one-hot, and an exp that leaves the bias out of its running max overflows), isolation (another
image's inputs and bias change no output), and (``full``) random lengths, strided inputs, another scale and 128
images; with ``bad_inputs``, a bias of an integer dtype, 2-D, one row short or on another device raises an error naming
``key_bias``. ``key_bias=False`` checks the opposite: an implementation that takes no bias raises
``TypeError``/``ValueError`` naming ``key_bias`` when given one (before any launch, by contract: the lab sees only
the error).

**The rotary variant** (``rotary=True``): ``fn`` also takes ``rotary=``, a :class:`ragged_vit.core.rotary.Rotary`
(``table`` ``[N, 2*D]`` or ``[H, N, 2*D]`` of ``[sin | cos]`` per position, last dimension contiguous; ``positions``
int32 ``[T]``, contiguous; ``half``, the layout) and rotates each row's query and key by its position's table row
before attending, as :func:`ragged_vit.reference.rotary.rotate` does (RoPE ViTs: timm's Eva models); a position outside
``[0, N)`` (``-1``: prefix rows, a token fused from several patches) leaves its row unrotated. The rule: the float64
reference on q and k rotated in float64 against PyTorch's attention on q and k rotated in the implementation's dtype
(the table's math, then rounded to the dtype, as timm rotates them). Its cases: both layouts on the odd lengths 1, 63,
65, 197 (``full``: every adversarial length), a table per head, images with 0, 1 and 2 unrotated prefix rows each (in
every case), the positions a pruned forward leaves (a sorted subset of the table, an unrotated fused token last),
positions outside the table, misaligned inputs with a table in the inputs' dtype, a loose bound, images without rows,
isolation, and (``full``) random lengths, strided inputs, another scale and 128 images; with ``bad_inputs``, a table of
the wrong width, float positions, positions one row short and a table on another device raise an error naming
``rotary``. ``rotary=False``: an implementation without a rotation raises ``TypeError``/``ValueError`` naming
``rotary`` when given one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.rotary import Rotary
from ..core.segments import cu_seqlens_from_counts
from ..reference.attention import ragged_attention, split_qkv
from ..reference.rotary import rotate, table_from_angles
from .report import Failure, bad_call_failures, level, raise_failures

QUICK_LENGTHS = (1, 2, 63, 64, 65, 197)
TILE_LENGTHS = (16, 17, 32, 33, 128, 129)
NUMERIC_CASES = {  # kind -> (lengths, dtypes it runs in: None = every dtype of the device)
    "large_logits": ((33, 64, 5), None),
    "dominant_key": ((40, 7, 65), None),
    "equal_keys": ((9, 64), None),
    "tiny": ((40, 7), (torch.float32,)),
    "huge": ((40, 7), (torch.float32,)),
}
ADVERSARIAL_LENGTHS = (*QUICK_LENGTHS, 577, 1025)
BIAS_LENGTHS = (1, 63, 65, 197)
ROPES = ("interleaved", "half", "interleaved-per_head", "half-per_head")  # a rotary case's layout and table
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LAYOUTS = ("qkv", "separate")


@dataclass(frozen=True)
class AttentionCase:
    """One case: its kind, the images' lengths, heads, head dim and dtype, the key bias it passes (``"normal"``,
    ``"log_size"``, ``"large"``; ``""`` for none) and the rotation (one of :data:`ROPES`; ``""`` for none)."""

    kind: str
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    dtype: torch.dtype
    bias: str = ""
    rope: str = ""

    @property
    def id(self) -> str:
        lengths = "-".join(map(str, self.lengths)) if len(self.lengths) <= 4 else f"{len(self.lengths)}images"
        extra = (f"-bias_{self.bias}" if self.bias else "") + (f"-rope_{self.rope}" if self.rope else "")
        return f"{self.kind}[{lengths}]{extra}-h{self.heads}d{self.head_dim}-{str(self.dtype).removeprefix('torch.')}"

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
    key_bias: bool | None = None,
    rotary: bool | None = None,
) -> list[AttentionCase]:
    """The cases of ``level_name`` (``quick``/``full``; see :func:`ragged_vit.testing.level`) for ``device``; with
    ``bad_inputs``, one more that checks the argument errors. ``key_bias``: None for the plain contract, True for its
    key-bias variant, False for the one case that checks a key bias is refused; ``rotary`` likewise for the rotary
    variant (see the module docstring; not both)."""
    if key_bias is not None and rotary is not None:
        raise ValueError("key_bias and rotary choose two variants of the contract: give one")
    full = level(level_name) == "full"
    device = torch.device(device)
    dtypes = tuple(dtypes or default_dtypes(device))
    head_dims = tuple(head_dims or ((32, 64) if full else (32,)))
    if key_bias is False:
        return [AttentionCase("key_bias_refused", (4, 6), 2, head_dims[0], dtypes[0], "normal")]
    if rotary is False:
        return [AttentionCase("rotary_refused", (4, 6), 2, head_dims[0], dtypes[0], rope="interleaved")]
    heads = 3 if full else 2
    lengths = ADVERSARIAL_LENGTHS if full else QUICK_LENGTHS
    g = torch.Generator().manual_seed(0)
    ragged = tuple(int(n) for n in torch.randint(1, 198, (16 if full else 5,), generator=g))
    many = tuple(ADVERSARIAL_LENGTHS[int(i)] for i in torch.randint(len(ADVERSARIAL_LENGTHS), (128,), generator=g))
    if rotary:
        return _rotary_cases(full, dtypes, head_dims, heads, lengths, ragged, many, bad_inputs, empty_images)
    if key_bias:
        shapes = [("lengths", lengths if full else BIAS_LENGTHS, "normal"), ("misaligned", (40, 7), "log_size"),
                  ("loose_bound", (70, 5, 33), "large"), ("isolation", (40, 70, 9), "normal")]  # fmt: skip
        if empty_images:
            shapes.append(("empty", (5, 0, 64, 0), "log_size"))
        if full:
            shapes += [("ragged", ragged, "log_size"), ("strided", (3, 65, 1), "large"), ("scale", (5, 64), "normal"),
                       ("many", many, "log_size")]  # fmt: skip
    else:
        shapes = [("lengths", lengths, ""), ("ragged", ragged, ""), ("strided", (3, 65, 1), ""),
                  ("misaligned", (40, 7), ""), ("loose_bound", (70, 5, 33), ""), ("scale", (5, 64), ""),
                  ("isolation", (40, 70, 9), "")]  # fmt: skip
        if empty_images:
            shapes.append(("empty", (5, 0, 64, 0), ""))
        if full:
            shapes += [("lengths", (n,), "") for n in ADVERSARIAL_LENGTHS] + [("many", many, "")]
    cases = [
        AttentionCase(kind, tuple(lens), heads, head_dim, dtype, bias)
        for dtype in dtypes
        for head_dim in head_dims
        for kind, lens, bias in shapes
    ]
    if not key_bias:
        if full:
            cases += [AttentionCase("tiles", TILE_LENGTHS, heads, d, dtype) for dtype in dtypes for d in head_dims]
        cases += [
            AttentionCase(kind, lens, heads, head_dim, dtype)
            for kind, (lens, only) in NUMERIC_CASES.items()
            for dtype in dtypes
            if only is None or dtype in only
            for head_dim in head_dims
        ]
    if bad_inputs:
        cases.append(AttentionCase("bad_inputs", (4, 6), 2, 32, torch.float32, "normal" if key_bias else ""))
    return cases


def _rotary_cases(full, dtypes, head_dims, heads, lengths, ragged, many, bad_inputs, empty_images):
    """The rotary variant's cases (module docstring)."""
    shapes = [("lengths", lengths if full else BIAS_LENGTHS, "interleaved"), ("lengths", BIAS_LENGTHS, "half"),
              ("per_head", (40, 7, 33), "half-per_head"), ("pruned", (50, 17), "interleaved"),
              ("out_of_range", (20, 9), "half"), ("misaligned", (40, 7), "interleaved-per_head"),
              ("loose_bound", (70, 5, 33), "half"), ("isolation", (40, 70, 9), "interleaved")]  # fmt: skip
    if empty_images:
        shapes.append(("empty", (5, 0, 64, 0), "half"))
    if full:
        shapes += [("ragged", ragged, "half"), ("strided", (3, 65, 1), "interleaved"),
                   ("scale", (5, 64), "half-per_head"), ("many", many, "interleaved")]  # fmt: skip
    cases = [
        AttentionCase(kind, tuple(lens), heads, head_dim, dtype, rope=rope)
        for dtype in dtypes
        for head_dim in head_dims
        for kind, lens, rope in shapes
    ]
    if bad_inputs:
        cases.append(AttentionCase("bad_inputs", (4, 6), 2, 32, torch.float32, rope="interleaved"))
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
    key_bias: bool | None = None,
    rotary: bool | None = None,
) -> int:
    """Runs every case of the attention contract (or of its key-bias or rotary variant) on ``fn``; raises
    :class:`ConformanceError` listing each failed case; returns how many cases ran.

    Args:
        fn: the implementation, called as the module docstring says for ``layout``.
        layout: ``"qkv"`` or ``"separate"``.
        level_name: ``"quick"`` or ``"full"`` (default: ``$RAGGED_VIT_CONFORMANCE``, else quick).
        device: where the inputs live.
        dtypes, head_dims: restrict the cases to what ``fn`` supports.
        accepts_out: ``fn`` takes ``out=`` (then it is given a NaN-poisoned buffer to fill).
        bad_inputs: ``fn`` validates its arguments (a public entry; an attention backend trusts its caller).
        empty_images: ``fn`` takes images of no rows (the pipelines never make one).
        key_bias: None (the default) checks the plain contract (``fn`` is never given a ``key_bias``); True checks the
            key-bias variant (every case passes ``key_bias=``); False checks that ``fn`` refuses a ``key_bias``.
        rotary: the same for the rotary variant (``rotary=``: RoPE of q and k); not with ``key_bias``.
    """
    cases = attention_cases(
        level_name, device=device, dtypes=dtypes, head_dims=head_dims, bad_inputs=bad_inputs,
        empty_images=empty_images, key_bias=key_bias, rotary=rotary,
    )  # fmt: skip
    failures = [f for case in cases for f in run_attention_case(fn, case, layout, device, accepts_out)]
    raise_failures(_contract(layout, key_bias, rotary), failures)
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
    ``level_name``, ``dtypes``, ``head_dims``, ``bad_inputs``, ``empty_images``, ``key_bias``, ``rotary``): a port's
    test file is ``test_my_attention = attention_suite(my_fn, layout="qkv", device="cuda")``."""
    import pytest

    cases = attention_cases(device=device, **options)
    contract = _contract(layout, options.get("key_bias"), options.get("rotary"))

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test(case: AttentionCase) -> None:
        raise_failures(contract, run_attention_case(fn, case, layout, device, accepts_out))

    return test


def _contract(layout: str, key_bias: bool | None, rotary: bool | None = None) -> str:
    said = {None: "", True: ", key bias", False: ", no key bias"}[key_bias]
    said += {None: "", True: ", rotary", False: ", no rotary"}[rotary]
    return f"attention ({layout} layout{said})"


def run_attention_case(
    fn: Callable[..., torch.Tensor], case: AttentionCase, layout: str, device: torch.device | str, accepts_out: bool
) -> list[Failure]:
    """One case's failures (empty when ``fn`` passes it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = torch.device(device)
    if case.kind == "bad_inputs":
        if case.rope:
            return _bad_rotary_failures(fn, layout, device)
        return _bad_input_failures(fn, layout, device, bool(case.bias))
    g = case.generator()
    cu = cu_seqlens_from_counts(torch.tensor(case.lengths)).to(device)
    total, width = int(cu[-1]), case.heads * case.head_dim
    qkv = _qkv(total, width, case, device, g)
    scale = 0.3 if case.kind == "scale" else case.head_dim**-0.5
    bound = max(max(case.lengths), 1)
    if case.kind == "loose_bound":
        bound = 2 * bound + 7
    key_bias = _key_bias(case, device, g) if case.bias else None
    rotary = _rotary(case, device, g) if case.rope else None
    if case.kind in ("key_bias_refused", "rotary_refused"):
        name = "key_bias" if case.bias else "rotary"

        def given() -> torch.Tensor:
            return _call(fn, layout, qkv, cu, bound, case, scale, accepts_out, key_bias, rotary)

        return bad_call_failures([(f"a {name} given to an implementation that takes none", name, given)])
    try:
        out = _call(fn, layout, qkv, cu, bound, case, scale, accepts_out, key_bias, rotary)
    except Exception as exc:  # a crash is a failed case, reported like the others
        return [Failure(case.id, "runs", f"{type(exc).__name__}: {exc}", "a result")]
    failures = _close(case, out, qkv, cu, scale, key_bias, rotary)
    if case.kind == "isolation" and not failures:
        failures = _isolation(fn, layout, case, qkv, cu, bound, scale, key_bias, out, accepts_out, g, rotary)
    return failures


def _qkv(total: int, width: int, case: AttentionCase, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """The qkv projection ``[T, 3*H*D]`` of a case: a plain tensor, a view with padded rows, or one element off an
    aligned address; the numerically adversarial cases' values (module docstring)."""
    values = torch.randn(total, 3 * width, generator=g)
    if case.kind in NUMERIC_CASES:
        return _adversarial(values, case).to(device, case.dtype)
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


def _adversarial(values: torch.Tensor, case: AttentionCase) -> torch.Tensor:
    """The numerically adversarial qkv values of ``case`` (``values``: fresh normal ones, ``[T, 3*H*D]``), exactly
    representable in its dtype where it matters (the logits are what the case is about)."""
    heads, dim = case.heads, case.head_dim
    q, k, v = (t.reshape(-1, heads, dim) for t in values.split(heads * dim, dim=1))
    cu = cu_seqlens_from_counts(torch.tensor(case.lengths)).tolist()
    scale = dim**-0.5
    if case.kind in ("tiny", "huge"):
        factor = 1e-18 if case.kind == "tiny" else 1e12
        q, k = q * factor, k * factor
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if e == s:
            continue
        if case.kind == "large_logits" and b == 0:  # logits spread up to +60
            logits = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * scale
            q[s:e] *= 60.0 / logits.abs().amax().clamp_min(1e-6)
        elif case.kind == "large_logits" and b == 1:  # every logit near -60: q and k point apart
            u = torch.randn(heads, dim)
            u = u / u.norm(dim=-1, keepdim=True) * (60.0 / scale) ** 0.5
            q[s:e] = u + 0.1 * q[s:e]
            k[s:e] = -u + 0.1 * k[s:e]
        elif case.kind == "dominant_key":  # queries share a direction; the image's first key's logit is ~30 along it
            u = torch.randn(heads, dim)
            u = u / u.norm(dim=-1, keepdim=True) * dim**0.5
            q[s:e] = u + 0.3 * q[s:e]
            k[s] = u * (30.0 / (scale * dim))
        elif case.kind == "equal_keys":
            k[s:e] = k[s]
    return torch.cat([t.reshape(-1, heads * dim) for t in (q, k, v)], dim=1)


def _key_bias(case: AttentionCase, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """A case's key bias, float32 ``[T]`` with values representable in the case's dtype (see the module docstring); one
    element off an aligned address in the ``misaligned`` case."""
    total = sum(case.lengths)
    if case.bias == "normal":
        values = torch.randn(total, generator=g)
    elif case.bias == "log_size":
        values = torch.randint(1, 17, (total,), generator=g).float().log()
    else:  # "large": distinct multiples of 64 in each image, centred on 0 (in bf16 too, for images up to 512 rows)
        values = 64.0 * torch.cat([torch.randperm(n, generator=g) - n // 2 for n in case.lengths]).float()
    values = values.to(case.dtype).float()
    if case.kind == "misaligned":
        return torch.empty(total + 1, dtype=torch.float32, device=device)[1:].copy_(values)
    return values.to(device)


def _rotary(case: AttentionCase, device: torch.device, g: torch.Generator) -> Rotary:
    """A case's rotation: a table of ``[sin | cos]`` of random angles (fp32; in the case's dtype and one element off
    an aligned address in the ``misaligned`` case), one per head for ``*-per_head``, and positions with image ``b``'s
    first ``b % 3`` rows unrotated (``-1``), its patches in order (``pruned``: a sorted subset of the table, the last
    row a fused token, ``-1``; ``out_of_range``: a third of the rows outside the table)."""
    half = case.rope.startswith("half")
    rows = max(case.lengths) + 9
    shape = (case.heads, rows, case.head_dim // 2) if case.rope.endswith("per_head") else (rows, case.head_dim // 2)
    table = table_from_angles(torch.rand(shape, generator=g) * 6.3, half)
    pieces = []
    for b, n in enumerate(case.lengths):
        prefix = min(b % 3, n)
        if case.kind == "pruned":
            patches = torch.randperm(rows, generator=g)[: n - prefix].sort().values
            if n - prefix > 1:
                patches[-1] = -1
        else:
            patches = torch.arange(n - prefix)
        pieces += [torch.full((prefix,), -1), patches]
    positions = torch.cat(pieces).to(torch.int32)
    if case.kind == "out_of_range":
        far = torch.randint(0, 3, positions.shape, generator=g) == 0
        outside = torch.where(positions % 2 == 0, positions + rows, positions - 3 * rows)  # past the end or below -1
        positions = torch.where(far, outside, positions)
    if case.kind == "misaligned":
        flat = torch.empty(table.numel() + 1, dtype=case.dtype, device=device)
        table = flat[1:].view(table.shape).copy_(table)
        return Rotary(table, positions.to(device), half)
    return Rotary(table.to(device), positions.to(device), half)


def _call(fn, layout, qkv, cu, bound, case, scale, accepts_out, key_bias=None, rotary=None):
    total, width = qkv.shape[0], case.heads * case.head_dim
    kwargs = {} if key_bias is None else {"key_bias": key_bias}  # the plain contract never names it
    if rotary is not None:
        kwargs["rotary"] = rotary
    if layout == "qkv":
        if accepts_out:
            kwargs["out"] = _poisoned((total, width), qkv)
        return fn(qkv, cu, bound, case.heads, scale, **kwargs).reshape(total, case.heads, case.head_dim)
    q, k, v = split_qkv(qkv, case.heads)  # [T, H, D] views with the qkv row stride
    if accepts_out:
        kwargs["out"] = _poisoned((total, case.heads, case.head_dim), qkv)
    return fn(q, k, v, cu, bound, scale, **kwargs)


def _poisoned(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _close(
    case: AttentionCase,
    out: torch.Tensor,
    qkv: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    key_bias: torch.Tensor | None = None,
    rotary: Rotary | None = None,
) -> list[Failure]:
    shape = (qkv.shape[0], case.heads, case.head_dim)
    if tuple(out.shape) != shape or out.dtype != qkv.dtype:
        return [Failure(case.id, "output shape and dtype", f"{tuple(out.shape)} {out.dtype}", f"{shape} {qkv.dtype}")]
    if not bool(torch.isfinite(out).all()):
        return [Failure(case.id, "finite output (NaN-poisoned buffers written everywhere)", "NaN or inf", "none")]
    err, yard = attention_error(out, *split_qkv(qkv, case.heads), cu, scale, key_bias, rotary)
    allowed = 2 * yard + FLOOR[qkv.dtype]
    if not err <= allowed:
        rule = "max error <= 2 x PyTorch's in the same dtype + floor"
        return [Failure(case.id, rule, f"{err:.3g}", f"{allowed:.3g} (2 x {yard:.3g} + {FLOOR[qkv.dtype]:g})")]
    return []


def attention_error(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    rotary: Rotary | None = None,
) -> tuple[float, float]:
    """``(error, yardstick)``: the max error of ``out [T, H, D]`` against the float64 reference, and that of PyTorch's
    own attention in ``q``'s dtype; the rule allows ``2 * yardstick + FLOOR[dtype]`` (see the module docstring). A
    ``key_bias [T]`` goes to both: to the reference in float64, to PyTorch as a float mask in ``q``'s dtype. A
    ``rotary`` rotates q and k for both: in float64 for the reference, as timm does in ``q``'s dtype for PyTorch."""
    if out.numel() == 0:
        return 0.0, 0.0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    exact_bias = None if key_bias is None else key_bias.double()
    q64, k64 = q.double(), k.double()
    if rotary is not None:
        table, positions, half = rotary
        q64, k64 = (rotate(t, table.double(), positions, half) for t in (q64, k64))
        q, k = (rotate(t, table, positions, half) for t in (q, k))
    ref = ragged_attention(q64, k64, v.double(), cu, scale=scale, key_bias=exact_bias)
    err = (out.reshape(ref.shape).double() - ref).abs().max().item()
    return err, (_torch_in_dtype(q, k, v, cu, scale, key_bias).double() - ref).abs().max().item()


def assert_attention_close(
    out, q, k, v, cu, scale: float | None = None, key_bias: torch.Tensor | None = None, rotary: Rotary | None = None
) -> None:
    """Asserts the rule on one output (for a test of a kernel's own configurations)."""
    err, yard = attention_error(out, q, k, v, cu, scale, key_bias, rotary)
    allowed = 2 * yard + FLOOR[q.dtype]
    assert err <= allowed, f"max error {err:.3g} > 2 x PyTorch's {yard:.3g} + floor {FLOOR[q.dtype]:g}"


def _torch_in_dtype(q, k, v, cu, scale, key_bias) -> torch.Tensor:
    """PyTorch's attention in the inputs' own dtype, one image at a time (a key bias as a float mask in that dtype):
    the error yardstick."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            mask = None if key_bias is None else key_bias[s:e].to(q.dtype)  # [L]: the same for every head and query
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def _isolation(fn, layout, case, qkv, cu, bound, scale, key_bias, out, accepts_out, g, rotary=None) -> list[Failure]:
    """Changing the middle image's rows (and its key bias) must leave the others' outputs unchanged, bit for bit."""
    bounds = cu.tolist()
    start, end = bounds[1], bounds[2]
    changed = qkv.clone()
    changed[start:end] = torch.randn(end - start, qkv.shape[1], generator=g).to(qkv.device, qkv.dtype)
    if key_bias is not None:
        key_bias = key_bias.clone()
        key_bias[start:end] = torch.randn(end - start, generator=g).to(case.dtype).float().to(key_bias.device)
    again = _call(fn, layout, changed, cu, bound, case, scale, accepts_out, key_bias, rotary)
    others = torch.ones(qkv.shape[0], dtype=torch.bool, device=qkv.device)
    others[start:end] = False
    if not torch.equal(again[others], out[others]):
        rule = "isolation: another image's inputs change no output"
        return [Failure(case.id, rule, "outputs changed", "bitwise equal")]
    return []


def _bad_rotary_failures(fn, layout, device) -> list[Failure]:
    """Wrong rotations (on other inputs that are right) must raise ``TypeError`` or ``ValueError`` naming ``rotary``."""
    qkv = torch.randn(10, 3 * 2 * 32, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    q, k, v = split_qkv(qkv, 2)
    call = {"qkv": lambda rot: fn(qkv, cu, 10, 2, 0.25, rotary=rot),
            "separate": lambda rot: fn(q, k, v, cu, 10, 0.25, rotary=rot)}[layout]  # fmt: skip
    table = torch.zeros(12, 64, device=device)
    positions = torch.zeros(10, dtype=torch.int32, device=device)
    rotations = {
        "a rotary table of the wrong width": Rotary(table[:, :48], positions),
        "float rotary positions": Rotary(table, positions.float()),
        "rotary positions one row short": Rotary(table, positions[:-1]),
        "a rotary table on another device": Rotary(table.to("meta"), positions),
    }
    return bad_call_failures((name, "rotary", lambda r=r: call(r)) for name, r in rotations.items())


def _bad_input_failures(fn, layout, device, key_bias: bool) -> list[Failure]:
    """Wrong dtypes and shapes must raise ``TypeError`` or ``ValueError`` (checked before any launch, by contract); in
    the key-bias variant, wrong biases (on other inputs that are right) must, naming ``key_bias``."""
    device = torch.device(device)
    qkv = torch.randn(10, 3 * 2 * 32, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    q, k, v = split_qkv(qkv, 2)
    if key_bias:
        call = {"qkv": lambda bias: fn(qkv, cu, 10, 2, 0.25, key_bias=bias),
                "separate": lambda bias: fn(q, k, v, cu, 10, 0.25, key_bias=bias)}[layout]  # fmt: skip
        bias = torch.zeros(10, dtype=torch.float32, device=device)
        biases = {
            "an int32 key_bias": bias.int(),
            "a 2-D key_bias": bias[:, None],
            "a key_bias one row short": bias[:-1],
            "a key_bias on another device": bias.to("meta"),
        }
        return bad_call_failures((name, "key_bias", lambda b=b: call(b)) for name, b in biases.items())
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
