"""The packing contract and its cases: pack, repack, unpack and cls_rows only copy rows, so every check is bitwise.

The contract (ground truth: :mod:`ragged_vit.reference.packing`); an implementation gives any of the four callables:

* ``pack(x [B, N, C], keep bool [B, N]) -> (tokens [T, C], cu_seqlens int32 [B+1], max_seqlen)``: the rows where
  ``keep`` is True, image after image, each image's rows in their original order; ``keep[:, 0]`` (the class token) is
  always True. The reference's signature.
* ``repack(tokens [T, C], cu_seqlens int32 [B+1], keep bool [T], max_seqlen) -> (tokens [T', C], cu_seqlens,
  max_seqlen)``: the same, ragged to ragged, on a packed buffer; every non-empty image keeps its first row, and the
  input ``max_seqlen`` is an upper bound on the input images' lengths (it sizes a kernel's grid; the reference needs
  none: ``lambda t, cu, keep, bound, **options: reference.repack(t, cu, keep, **options)``).
* ``unpack(tokens [T, C], cu_seqlens, max_seqlen, fill) -> (padded [B, max_seqlen, C], mask bool [B, max_seqlen])``:
  image ``b``'s rows at ``padded[b, :length]``, ``fill`` elsewhere (the reference's signature, ``max_seqlen`` given).
* ``cls_rows(tokens [T, C], cu_seqlens) -> [B, C]``: every image's first row (no image is empty).

Outputs have the input's dtype and device; ``tokens``, ``cu_seqlens``, ``padded`` and ``mask`` equal the reference's
bit for bit; the returned ``max_seqlen`` is a host int and an upper bound: at least the longest output image (the
reference returns exactly that). No callable may change its inputs. Keyword options that ``pack`` and ``repack``
take, each declared by a flag of :func:`check_pack`:

* ``extra_token=`` ``[B, C]`` (flag ``extra_token``): one more row per image after its kept rows (EViT's fused
  token), as :func:`ragged_vit.reference.repack`'s ``extra_token``.
* ``kept=`` int32 ``[B]`` (flag ``kept``): the rows each image keeps, the class token included and the extra token
  excluded, as a decision reports them (``TokenSelection.kept``); the implementation may trust it.
* ``count=k`` (flag ``count``): every image keeps exactly ``k`` rows, the extra token included, so ``T' = B * k`` is
  known on the host; given only where the case's masks keep as many rows in every image.
* ``capacity=R`` (flag ``capacity``): a buffer of exactly ``R`` rows whatever the total ``T'``. With ``R >= T'`` its
  first ``T'`` rows and ``cu_seqlens`` are the reference's (the rows after them are anything); with ``R < T'``,
  ``cu_seqlens`` is the reference's clamped to ``R`` (its rows are not checked) and nothing may be written outside
  the buffer, which only a memory checker sees (``ci/sanitize_case.py``).

Each case calls ``pack`` and ``repack`` without options, then once per size mode (the exact size, ``count=``,
``capacity=`` above and below the total) with every per-image option declared (the extra token, ``kept=``), as the
pipelines call them; ``quick`` gives ``count=`` in the ``fixed_count`` case and ``capacity=`` in the ``capacity``
case only, ``full`` in every case, and each option alone too. ``lengths`` are the images' lengths in the packed
buffer that ``repack``, ``unpack`` and ``cls_rows`` take; ``pack`` takes a dense batch of ``max(lengths)`` tokens per
image of which image ``b`` keeps ``lengths[b]`` (its class token and others at random). The cases, in every dtype
(fp32 and fp16 on a CPU, where Triton's interpreter stores bf16 wrongly; fp16, bf16 and fp32 on a GPU) and channel
count (24; ``full``: 192 and 768):

* ``lengths``: the adversarial lengths 1, 2, 63, 64, 65, 197 (``full``: also 577 and 1025) in one batch, and 197
  (``full``: each) alone; ``ragged``: random lengths, ``repack`` keeping about half of each image; ``many``
  (``full``): 128 images of the adversarial lengths;
* ``cls_only`` / ``all``: masks keeping nothing but the class token, or everything; ``single_row``: images of one
  token; ``fixed_count``: every image keeps 7 rows; ``capacity``: the buffers above and below the total;
* ``strided`` / ``misaligned``: the float inputs are views with padded rows, or every input starts one element past
  an aligned address; ``odd_channels``: 7 channels;
* ``loose_bound``: a ``max_seqlen`` (of ``repack`` and ``unpack``) twice the longest image;
* ``empty`` (unless ``empty_images=False``; ``repack`` and ``unpack``): images without a single row among the others;
* ``isolation``: changing one image's tokens, masks and extra token leaves every other image's rows unchanged, bit
  for bit;
* ``bad_inputs`` (with ``bad_inputs``): wrong dtypes, shapes and option values raise ``TypeError`` / ``ValueError``
  naming the argument; the value checks (a class token dropped, decreasing offsets, a bound below the longest image,
  counts that are not the mask's) only on a CPU, where reading values costs no synchronisation.
"""

from __future__ import annotations

import bisect
import dataclasses
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.segments import cu_seqlens_from_counts, positions, segment_rank, seqlens, uniform_cu_seqlens
from ..reference import packing as reference
from .attention import ADVERSARIAL_LENGTHS, QUICK_LENGTHS, default_dtypes
from .report import Failure, bad_call_failures, level, raise_failures

OPS = ("pack", "repack", "unpack", "cls_rows")
FILL = -1.0  # unpack's fill value in every case
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class PackCase:
    """One case: its kind, the packed images' lengths, the channel count and the dtype."""

    kind: str
    lengths: tuple[int, ...]
    channels: int
    dtype: torch.dtype
    level_name: str = "quick"  # full: every size mode in every case, each option alone too

    @property
    def id(self) -> str:
        lengths = "-".join(map(str, self.lengths)) if len(self.lengths) <= 6 else f"{len(self.lengths)}images"
        return f"{self.kind}[{lengths}]-c{self.channels}-{str(self.dtype).removeprefix('torch.')}"

    def generator(self, salt: int = 0) -> torch.Generator:
        """Fresh inputs per case, reproducible per case."""
        return torch.Generator().manual_seed(zlib.crc32(self.id.encode()) + salt)


@dataclass(frozen=True)
class _Family:
    """The implementation under test: the callables given and the options their pack and repack take."""

    pack: Callable | None = None
    repack: Callable | None = None
    unpack: Callable | None = None
    cls_rows: Callable | None = None
    extra_token: bool = False
    capacity: bool = False
    count: bool = False
    kept: bool = False

    def __post_init__(self) -> None:
        if not self.given:
            raise ValueError(f"give at least one of {', '.join(f'{op}=' for op in OPS)} (the callables to check)")

    @property
    def given(self) -> tuple[str, ...]:
        return tuple(op for op in OPS if getattr(self, op) is not None)

    @property
    def contract(self) -> str:
        return f"packing ({', '.join(self.given)})"


def pack_cases(
    level_name: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    channels: Iterable[int] | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
) -> list[PackCase]:
    """The cases of ``level_name`` (``quick``/``full``; see :func:`ragged_vit.testing.level`) for ``device``, in each
    of ``dtypes`` and ``channels`` (default 24; ``full``: 192 and 768); with ``bad_inputs``, one more that checks
    the argument errors."""
    level_name = level(level_name)
    full = level_name == "full"
    dtypes = tuple(dtypes or default_dtypes(torch.device(device)))
    channels = tuple(channels or ((192, 768) if full else (24,)))
    lengths = ADVERSARIAL_LENGTHS if full else QUICK_LENGTHS
    g = torch.Generator().manual_seed(0)
    ragged = tuple(int(n) for n in torch.randint(1, 198, (16 if full else 5,), generator=g))
    many = tuple(ADVERSARIAL_LENGTHS[int(i)] for i in torch.randint(len(ADVERSARIAL_LENGTHS), (128,), generator=g))
    shapes = [("lengths", lengths), ("ragged", ragged), ("cls_only", (3, 33, 1, 20)), ("all", (3, 33, 1, 20)),
              ("single_row", (1, 1, 1)), ("fixed_count", (20, 20, 20)), ("capacity", (33, 64, 2)),
              ("strided", (3, 65, 1)), ("misaligned", (40, 7)), ("loose_bound", (40, 5, 33)),
              ("isolation", (40, 70, 9))]  # fmt: skip
    if empty_images:
        shapes.append(("empty", (5, 0, 64, 0)))
    alone = ADVERSARIAL_LENGTHS if full else QUICK_LENGTHS[-1:]
    shapes += [("lengths", (n,)) for n in alone] + [("many", many)] * full
    cases = []
    for dtype in dtypes:
        for width in channels:
            cases += [PackCase(kind, tuple(lens), width, dtype, level_name) for kind, lens in shapes]
        cases.append(PackCase("odd_channels", (5, 33, 2), 7, dtype, level_name))
    if bad_inputs:
        cases.append(PackCase("bad_inputs", (5, 5), 8, torch.float32))
    return cases


def check_pack(
    *,
    pack: Callable | None = None,
    repack: Callable | None = None,
    unpack: Callable | None = None,
    cls_rows: Callable | None = None,
    extra_token: bool = False,
    capacity: bool = False,
    count: bool = False,
    kept: bool = False,
    level_name: str | None = None,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    channels: Iterable[int] | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
) -> int:
    """Runs every case of the packing contract on the callables given; raises :class:`ConformanceError` listing each
    failed case; returns how many cases ran.

    Args:
        pack, repack, unpack, cls_rows: the implementation, each callable optional (at least one), called as the
            module docstring says; a port whose ``pack`` takes other options than its ``repack`` checks them in two
            calls.
        extra_token, capacity, count, kept: ``pack`` and ``repack`` take that keyword argument (the module docstring
            says what each means); their cases include it.
        level_name: ``"quick"`` or ``"full"`` (default: ``$RAGGED_VIT_CONFORMANCE``, else quick).
        device: where the inputs live.
        dtypes, channels: restrict the cases to what the implementation supports.
        bad_inputs: the callables validate their arguments (public entry points; a hot-path entry trusts its caller).
        empty_images: ``repack`` and ``unpack`` take images of no rows (the pipelines never make one).
    """
    family = _Family(pack, repack, unpack, cls_rows, extra_token, capacity, count, kept)
    cases = _cases(family, level_name, device, dtypes, channels, bad_inputs, empty_images)
    failures = [f for case in cases for f in _run(family, case, torch.device(device))]
    raise_failures(family.contract, failures)
    return len(cases)


def pack_suite(
    *,
    pack: Callable | None = None,
    repack: Callable | None = None,
    unpack: Callable | None = None,
    cls_rows: Callable | None = None,
    extra_token: bool = False,
    capacity: bool = False,
    count: bool = False,
    kept: bool = False,
    device: torch.device | str = "cpu",
    **options: object,
):
    """A pytest test function running every case of :func:`check_pack` as its own test item (``options``:
    ``level_name``, ``dtypes``, ``channels``, ``bad_inputs``, ``empty_images``): a port's test file is
    ``test_my_pack = pack_suite(pack=my_pack, repack=my_repack, device="cuda")``."""
    import pytest

    family = _Family(pack, repack, unpack, cls_rows, extra_token, capacity, count, kept)
    cases = _cases(family, device=device, **options)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test(case: PackCase) -> None:
        raise_failures(family.contract, _run(family, case, torch.device(device)))

    return test


def run_pack_case(case: PackCase, *, device: torch.device | str = "cpu", **implementation: object) -> list[Failure]:
    """One case's failures (empty when the implementation passes it); ``implementation``: the callables and option
    flags of :func:`check_pack`."""
    return _run(_Family(**implementation), case, torch.device(device))


def _cases(
    family: _Family,
    level_name: str | None = None,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    channels: Iterable[int] | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
) -> list[PackCase]:
    """The cases for ``family``: images without rows only where a callable that takes them is given."""
    empty_images = empty_images and (family.repack is not None or family.unpack is not None)
    return pack_cases(
        level_name, device=device, dtypes=dtypes, channels=channels, bad_inputs=bad_inputs, empty_images=empty_images
    )


# ------------------------------------------------------------------------------------------------------ the inputs


@dataclass
class _Inputs:
    """A case's inputs on its device: the dense batch for pack, the packed buffer for the others."""

    x: torch.Tensor  # [B, N, C]
    keep_dense: torch.Tensor  # bool [B, N]
    tokens: torch.Tensor  # [T, C]
    cu: torch.Tensor  # int32 [B+1]
    keep: torch.Tensor  # bool [T], repack's mask
    extra: torch.Tensor  # [B, C]
    bound: int  # the max_seqlen repack and unpack get

    TENSORS: ClassVar[tuple[str, ...]] = ("x", "keep_dense", "tokens", "cu", "keep", "extra")

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]


def _inputs(case: PackCase, device: torch.device, g: torch.Generator) -> _Inputs:
    lengths = torch.tensor(case.lengths)
    batch, width = len(case.lengths), max(max(case.lengths), 1)
    dense_take = {"cls_only": torch.ones_like(lengths), "all": torch.full_like(lengths, width),
                  "fixed_count": torch.full_like(lengths, 7)}.get(case.kind, lengths)  # fmt: skip
    packed_take = {"cls_only": lengths.clamp(max=1), "all": lengths, "fixed_count": torch.full_like(lengths, 7)}
    keep_dense = _keep_rows(uniform_cu_seqlens(batch, width), dense_take, g).view(batch, width)
    cu = cu_seqlens_from_counts(lengths)
    keep = _keep_rows(cu, packed_take.get(case.kind), g)
    bound = 2 * width + 7 if case.kind == "loose_bound" else width
    return _Inputs(
        x=_floats((batch, width, case.channels), case, device, g),
        keep_dense=_placed(keep_dense, case, device),
        tokens=_floats((int(lengths.sum()), case.channels), case, device, g),
        cu=_placed(cu, case, device),
        keep=_placed(keep, case, device),
        extra=_floats((batch, case.channels), case, device, g),
        bound=bound,
    )


def _keep_rows(cu: torch.Tensor, take: torch.Tensor | None, g: torch.Generator) -> torch.Tensor:
    """bool ``[T]``: each non-empty image's first row and ``take[b] - 1`` others at random (``take`` None: each other
    row with probability 1/2)."""
    total = int(cu[-1])
    scores = torch.rand(total, generator=g)
    first = positions(cu, total) == 0
    if take is None:
        return first | (scores < 0.5)
    image = torch.repeat_interleave(take, seqlens(cu), output_size=total)
    return first | (segment_rank(scores, cu) < image - 1)


def _floats(shape: tuple[int, ...], case: PackCase, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Random rows ``[..., C]``: plain, a view with padded rows (``strided``), or one element off (``misaligned``)."""
    values = torch.randn(shape, generator=g)
    if case.kind == "strided":
        store = torch.randn(*shape[:-1], shape[-1] + 8, generator=g)
        store[..., : shape[-1]] = values
        return store.to(device, case.dtype)[..., : shape[-1]]
    return _placed(values.to(case.dtype), case, device)


def _placed(values: torch.Tensor, case: PackCase, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``; in the ``misaligned`` case, a view one element past an aligned address."""
    if case.kind != "misaligned":
        return values.to(device)
    flat = torch.zeros(values.numel() + 1, dtype=values.dtype, device=device)
    view = flat[1:].view(values.shape)
    view.copy_(values)
    return view


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was cut from (its padding and leading element included), else ``t``."""
    return t if t._base is None else t._base


# ------------------------------------------------------------------------------------------------------- the checks


def _run(family: _Family, case: PackCase, device: torch.device) -> list[Failure]:
    if case.kind == "bad_inputs":
        return _bad_input_failures(family, device)
    g = case.generator()
    inputs = _inputs(case, device, g)
    before = [_storage(t).clone() for t in inputs.tensors()]
    non_empty = min(case.lengths) > 0
    failures = []
    if family.pack is not None and non_empty:
        args = (inputs.x, inputs.keep_dense)
        failures += _stage_failures(family, "pack", case, args, lambda extra: _reference_pack(*args, extra), inputs)
    if family.repack is not None:
        args = (inputs.tokens, inputs.cu, inputs.keep, inputs.bound)
        want = lambda extra: reference.repack(*args[:3], extra)  # noqa: E731
        failures += _stage_failures(family, "repack", case, args, want, inputs)
    if family.unpack is not None:
        failures += _unpack_failures(family.unpack, case, inputs)
    if family.cls_rows is not None and non_empty:
        failures += _cls_rows_failures(family.cls_rows, case, inputs)
    if not all(_bitwise_equal(_storage(t), old) for t, old in zip(inputs.tensors(), before, strict=True)):
        rule = "inputs left unchanged (a view's padding and leading element too)"
        failures.append(Failure(case.id, rule, "changed", "unchanged"))
    if case.kind == "isolation" and not failures:
        failures = _isolation_failures(family, case, inputs, g)
    return failures


def _reference_pack(x: torch.Tensor, keep: torch.Tensor, extra: torch.Tensor | None) -> tuple:
    """The reference pack, with ``extra`` appended after each image's kept rows (as repack does)."""
    if extra is None:
        return reference.pack(x, keep)
    batch, width, channels = x.shape
    flat_cu = uniform_cu_seqlens(batch, width, x.device)
    return reference.repack(x.reshape(-1, channels), flat_cu, keep.reshape(-1), extra)


def _stage_failures(
    family: _Family, op: str, case: PackCase, args: tuple, want_of: Callable, inputs: _Inputs
) -> list[Failure]:
    """``pack`` or ``repack`` in each call of :func:`_calls` against the reference."""
    fn = getattr(family, op)
    wants = {fused: want_of(inputs.extra if fused else None) for fused in {False, family.extra_token}}
    lens = seqlens(wants[False][1])  # the rows each image keeps (an extra token excluded)
    kept = _placed(lens.int().cpu(), case, inputs.x.device)
    failures = []
    for fused, options in _calls(family, case, lens):
        want = wants[fused]
        total = want[0].shape[0]
        kwargs: dict[str, object] = {"extra_token": inputs.extra} if fused else {}
        if "kept" in options:
            kwargs["kept"] = kept
        if "count" in options:
            kwargs["count"] = int(lens[0]) + fused  # the extra token counts
        if "capacity" in options:
            kwargs["capacity"] = total + 7 if options["capacity"] == "above" else max(1, total // 2)
        label = f"{op}({', '.join(_option(k, v) for k, v in kwargs.items())})" if kwargs else op
        try:
            got = fn(*args, **kwargs)
        except Exception as exc:  # a crash is a failed case, reported like the others
            failures.append(Failure(case.id, f"{label} runs", f"{type(exc).__name__}: {exc}", "a result"))
            continue
        failures += _packed_failures(case, label, got, want, kwargs.get("capacity"))
    return failures


def _calls(family: _Family, case: PackCase, lens: torch.Tensor) -> list[tuple[bool, dict[str, object]]]:
    """``(with the extra token, options)`` of every call: none, then each size mode (the exact size; ``count=`` where
    every image keeps as many rows; ``capacity=`` above and below the total) with every per-image option declared
    (the extra token, ``kept=``), as the pipelines call it. ``quick`` gives ``count=`` in the ``fixed_count`` case
    and ``capacity=`` in the ``capacity`` case only; ``full`` gives them in every case, and each option alone too."""
    full = case.level_name == "full"
    per_image = {"kept": True} if family.kept else {}
    sizes: list[dict[str, object]] = [{}]
    if family.count and bool((lens == lens[0]).all()) and (full or case.kind == "fixed_count"):
        sizes.append({"count": True})
    if family.capacity and (full or case.kind == "capacity"):
        sizes += [{"capacity": "above"}, {"capacity": "below"}]
    calls = [(False, {})]
    calls += [(family.extra_token, {**per_image, **size}) for size in sizes if family.extra_token or per_image or size]
    if full:
        alone = [(True, {})] * family.extra_token + [(False, per_image)] * bool(per_image)
        calls += [call for call in alone + [(False, size) for size in sizes[1:]] if call not in calls]
    return calls


def _option(name: str, value: object) -> str:
    return f"{name}=" if isinstance(value, torch.Tensor) else f"{name}={value}"


def _packed_failures(case: PackCase, label: str, got: object, want: tuple, capacity: int | None) -> list[Failure]:
    """``(tokens, cu_seqlens, max_seqlen)`` against the reference's, bit for bit; with ``capacity``, a buffer of that
    many rows (its first ``T'`` rows the reference's when they fit, else the offsets clamped)."""
    if not (isinstance(got, tuple) and len(got) == 3):
        return [Failure(case.id, f"{label} returns (tokens, cu_seqlens, max_seqlen)", type(got).__name__, "a 3-tuple")]
    tokens, cu, bound = got
    want_tokens, want_cu, want_max = want
    total = want_tokens.shape[0]
    failures = _like(case, f"{label}: tokens", tokens, (total if capacity is None else capacity, want_tokens.shape[1]),
                     want_tokens)  # fmt: skip
    failures += _like(case, f"{label}: cu_seqlens", cu, tuple(want_cu.shape), want_cu)
    if failures:
        return failures
    overflow = capacity is not None and capacity < total
    expected_cu = want_cu.clamp(max=capacity) if overflow else want_cu
    if not torch.equal(cu, expected_cu):
        rule = f"{label}: cu_seqlens equal to the reference's" + (" clamped to the capacity" if overflow else "")
        i = int((cu != expected_cu).nonzero()[0, 0])
        failures.append(Failure(case.id, rule, f"cu_seqlens[{i}] = {int(cu[i])}", str(int(expected_cu[i]))))
    if not overflow and not _bitwise_equal(tokens[:total], want_tokens):
        rule = f"{label}: tokens bitwise equal to the reference's" + ("" if capacity is None else " (first T' rows)")
        failures.append(Failure(case.id, rule, _row_difference(tokens[:total], want_tokens, want_cu), "none"))
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < want_max:
        rule = f"{label}: max_seqlen a host int >= the longest image"
        failures.append(Failure(case.id, rule, repr(bound), f"an int >= {want_max}"))
    return failures


def _unpack_failures(unpack: Callable, case: PackCase, inputs: _Inputs) -> list[Failure]:
    want_padded, want_mask = reference.unpack(inputs.tokens, inputs.cu, inputs.bound, fill=FILL)
    try:
        got = unpack(inputs.tokens, inputs.cu, inputs.bound, fill=FILL)
    except Exception as exc:  # a crash is a failed case, reported like the others
        return [Failure(case.id, "unpack runs", f"{type(exc).__name__}: {exc}", "a result")]
    if not (isinstance(got, tuple) and len(got) == 2):
        return [Failure(case.id, "unpack returns (padded, mask)", type(got).__name__, "a 2-tuple")]
    padded, mask = got
    failures = _like(case, "unpack: padded", padded, tuple(want_padded.shape), want_padded)
    failures += _like(case, "unpack: mask", mask, tuple(want_mask.shape), want_mask)
    if failures:
        return failures
    if not torch.equal(mask, want_mask):
        failures.append(Failure(case.id, "unpack: mask equal to the reference's", "differs", "equal"))
    if not _bitwise_equal(padded, want_padded):
        rule = f"unpack: padded bitwise equal to the reference's (fill {FILL})"
        first = (_bits(padded) != _bits(want_padded)).any(-1).nonzero()[0].tolist()
        failures.append(Failure(case.id, rule, f"image {first[0]} differs from position {first[1]}", "none"))
    return failures


def _cls_rows_failures(cls_rows: Callable, case: PackCase, inputs: _Inputs) -> list[Failure]:
    want = reference.cls_rows(inputs.tokens, inputs.cu)
    try:
        got = cls_rows(inputs.tokens, inputs.cu)
    except Exception as exc:  # a crash is a failed case, reported like the others
        return [Failure(case.id, "cls_rows runs", f"{type(exc).__name__}: {exc}", "a result")]
    failures = _like(case, "cls_rows", got, tuple(want.shape), want)
    if not failures and not _bitwise_equal(got, want):
        rule = "cls_rows bitwise equal to the reference's"
        failures.append(Failure(case.id, rule, _row_difference(got, want), "none"))
    return failures


def _like(case: PackCase, what: str, got: object, shape: tuple[int, ...], want: torch.Tensor) -> list[Failure]:
    """A tensor of ``shape`` with ``want``'s dtype, on its device."""
    allowed = f"{shape} {want.dtype} on {want.device}"
    if not isinstance(got, torch.Tensor):
        return [Failure(case.id, f"{what} shape, dtype and device", type(got).__name__, allowed)]
    if tuple(got.shape) != shape or got.dtype != want.dtype or got.device != want.device:
        observed = f"{tuple(got.shape)} {got.dtype} on {got.device}"
        return [Failure(case.id, f"{what} shape, dtype and device", observed, allowed)]
    return []


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers (NaN payloads and signed zeros compare as they are stored)."""
    return t.view(_INTS[t.element_size()]) if t.is_floating_point() else t


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _row_difference(got: torch.Tensor, want: torch.Tensor, cu: torch.Tensor | None = None) -> str:
    """How many rows (first dimension) differ, and the first of them (with its image when ``cu`` is given)."""
    bad = (_bits(got) != _bits(want)).flatten(1).any(1).nonzero().flatten().tolist()
    where = f"row {bad[0]}"
    if cu is not None:
        where += f" (image {bisect.bisect_right(cu.tolist(), bad[0]) - 1})"
    return f"{len(bad)} of {got.shape[0]} rows differ, the first {where}"


def _isolation_failures(family: _Family, case: PackCase, inputs: _Inputs, g: torch.Generator) -> list[Failure]:
    """Changing the middle image's tokens, masks and extra token leaves every other image's rows as they were (as
    the reference's, which the case's first calls matched), bit for bit, in every callable's output; pack and repack
    get the extra token where declared."""
    j = 1
    start, end = inputs.cu.tolist()[j : j + 2]
    changed = dataclasses.replace(inputs, **{name: getattr(inputs, name).clone() for name in _Inputs.TENSORS})
    changed.x[j] = torch.randn(changed.x.shape[1:], generator=g).to(changed.x)
    changed.keep_dense[j, 1:] = (torch.rand(changed.keep_dense.shape[1] - 1, generator=g) < 0.5).to(inputs.x.device)
    changed.tokens[start:end] = torch.randn(end - start, case.channels, generator=g).to(changed.tokens)
    changed.keep[start + 1 : end] = (torch.rand(end - start - 1, generator=g) < 0.5).to(inputs.x.device)
    changed.extra[j] = torch.randn(case.channels, generator=g).to(changed.extra)
    failures = []
    for op in family.given:
        before = _per_image(_REFERENCE, op, inputs, family.extra_token)
        try:
            after = _per_image(family, op, changed, family.extra_token)
        except Exception as exc:  # a crash is a failed case, reported like the others
            failures.append(Failure(case.id, f"{op} runs", f"{type(exc).__name__}: {exc}", "a result"))
            continue
        moved = [i for i in range(len(case.lengths)) if i != j and not _bitwise_equal(before[i], after[i])]
        if moved:
            rule = f"{op}: isolation: another image's tokens and masks change no row of this one"
            failures.append(Failure(case.id, rule, f"the rows of image(s) {moved} changed", "bitwise equal"))
    return failures


def _per_image(family: _Family, op: str, inputs: _Inputs, fused: bool) -> list[torch.Tensor]:
    """Each image's rows in ``op``'s output on ``inputs`` (pack and repack with the extra token when ``fused``)."""
    options = {"extra_token": inputs.extra} if fused else {}
    if op == "unpack":
        return list(family.unpack(inputs.tokens, inputs.cu, inputs.bound, fill=FILL)[0])
    if op == "cls_rows":
        return list(family.cls_rows(inputs.tokens, inputs.cu))
    if op == "pack":
        tokens, cu, _ = family.pack(inputs.x, inputs.keep_dense, **options)
    else:
        tokens, cu, _ = family.repack(inputs.tokens, inputs.cu, inputs.keep, inputs.bound, **options)
    bounds = cu.tolist()
    return [tokens[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


_REFERENCE = _Family(
    pack=lambda x, keep, extra_token=None: _reference_pack(x, keep, extra_token),
    repack=lambda tokens, cu, keep, bound, extra_token=None: reference.repack(tokens, cu, keep, extra_token),
    unpack=reference.unpack,
    cls_rows=reference.cls_rows,
)


# --------------------------------------------------------------------------------------------------- bad arguments


def _bad_input_failures(family: _Family, device: torch.device) -> list[Failure]:
    """Wrong dtypes, shapes and options raise ``TypeError`` or ``ValueError`` naming the argument (before any launch,
    by contract: a test of a kernel can forbid its launches around this case); value checks only on a CPU."""
    calls = _bad_calls(family, device)
    return bad_call_failures((f"{op}: {what}", argument, call) for op, argument, what, call in calls)


def _bad_calls(family: _Family, device: torch.device) -> list[tuple[str, str, str, Callable[[], object]]]:
    """``(callable, the argument its error names, what is wrong, the call)`` for the callables and options given."""
    on_cpu = device.type == "cpu"
    x = torch.randn(2, 5, 8, device=device)
    keep_dense = torch.ones(2, 5, dtype=torch.bool, device=device)
    no_cls = keep_dense.clone()
    no_cls[1, 0] = False
    tokens = torch.randn(10, 8, device=device)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=device)
    keep = torch.ones(10, dtype=torch.bool, device=device)
    calls = []
    if family.pack is not None:
        pack = family.pack
        calls += [
            ("pack", "x", "int64 x", lambda: pack(x.long(), keep_dense)),
            ("pack", "x", "2-D x", lambda: pack(x[0], keep_dense)),
            ("pack", "x", "no image", lambda: pack(x[:0], keep_dense[:0])),
            ("pack", "keep", "int32 keep", lambda: pack(x, keep_dense.int())),
            ("pack", "keep", "keep of another shape", lambda: pack(x, keep_dense[:, :4])),
        ]
        if on_cpu:
            calls.append(("pack", "keep", "class token dropped", lambda: pack(x, no_cls)))
        if family.count and on_cpu:
            calls.append(("pack", "count", "count not the rows kept", lambda: pack(x, keep_dense, count=4)))
        calls += _bad_options(family, "pack", lambda **options: pack(x, keep_dense, **options), device)
    if family.repack is not None:
        repack = family.repack
        calls += [
            ("repack", "cu_seqlens", "int64 cu_seqlens", lambda: repack(tokens, cu.long(), keep, 5)),
            ("repack", "keep", "keep of another length", lambda: repack(tokens, cu, keep[:9], 5)),
            ("repack", "max_seqlen", "max_seqlen 0", lambda: repack(tokens, cu, keep, 0)),
        ]
        if on_cpu:
            decreasing = torch.tensor([0, 6, 5, 10], dtype=torch.int32)
            calls += [
                ("repack", "cu_seqlens", "decreasing cu_seqlens", lambda: repack(tokens, decreasing, keep, 6)),
                ("repack", "keep", "class token dropped", lambda: repack(tokens, cu, torch.arange(10) != 5, 5)),
                ("repack", "max_seqlen", "max_seqlen below the longest image", lambda: repack(tokens, cu, keep, 4)),
            ]
        if family.count and on_cpu:
            calls.append(("repack", "count", "count not the rows kept", lambda: repack(tokens, cu, keep, 5, count=4)))
        calls += _bad_options(family, "repack", lambda **options: repack(tokens, cu, keep, 5, **options), device)
    if family.unpack is not None:
        unpack = family.unpack
        calls += [
            ("unpack", "max_seqlen", "max_seqlen 0", lambda: unpack(tokens, cu, 0, fill=FILL)),
            ("unpack", "tokens", "1-D tokens", lambda: unpack(tokens[:, 0], cu, 5, fill=FILL)),
        ]
    if family.cls_rows is not None and on_cpu:
        past_end = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)
        calls.append(("cls_rows", "cu_seqlens", "cu_seqlens past the rows", lambda: family.cls_rows(tokens, past_end)))
    return calls


def _bad_options(family: _Family, op: str, call: Callable, device: torch.device) -> list[tuple]:
    """The bad option values of ``pack`` or ``repack`` (2 images of 5 rows, all kept), for the options declared."""
    kept = torch.tensor([5, 5], dtype=torch.int32, device=device)
    extra = torch.randn(3, 8, device=device)
    calls = []
    if family.extra_token:
        calls += [
            (op, "extra_token", "extra_token of another batch", lambda: call(extra_token=extra)),
            (op, "extra_token", "fp16 extra_token", lambda: call(extra_token=extra[:2].half())),
        ]
    if family.count:
        calls.append((op, "count", "count 0", lambda: call(count=0)))
    if family.count and family.capacity:
        calls.append((op, "count", "count and capacity", lambda: call(count=5, capacity=10)))
    if family.capacity:
        calls.append((op, "capacity", "capacity 0", lambda: call(capacity=0)))
    if family.kept:
        calls += [
            (op, "kept", "int64 kept", lambda: call(kept=kept.long())),
            (op, "kept", "kept of another batch", lambda: call(kept=kept[:1])),
        ]
        if device.type == "cpu":
            calls.append((op, "kept", "kept not the rows kept", lambda: call(kept=kept - 1)))
    return calls
