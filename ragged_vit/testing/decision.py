"""The fused-decision contract: ``fn(pruner, inp) -> TokenSelection`` makes the pruner's own decisions.

A fused decision (:mod:`ragged_vit.core.decisions`) is a faster implementation of a pruner's :meth:`Pruner.decide`:
it takes the same :class:`~ragged_vit.core.selection.DecisionInput` and returns the same
:class:`~ragged_vit.core.selection.TokenSelection`. The ground truth is the pruner itself, run on the same input on
the same device in the same dtype. The first and the last stage of the pruner's schedule are checked in every case
(a stage changes only what a schedule counts).

What always holds, bit for bit (the pipelines trust it):

* ``keep`` is a bool ``[T]`` mask on the input's device and every image's prefix rows are kept;
* ``kept`` is a contiguous int32 ``[B]`` on that device counting ``keep``'s rows per image (the repack reads it);
* ``fixed_count`` and ``count`` are the pruner's; a fixed-count pruner's ``kept`` is the pruner's;
* ``extra_token`` is given exactly when the pruner gives one, ``[B, C]`` in the pruner's dtype;
* isolation: changing one image's inputs changes no other image's rows of ``keep``, ``kept`` or ``extra_token``.

The decisions themselves, by one of two rules:

* ``exact=True`` (a port computing the pruner's scores with the same ops: Threshold-L2, DynamicViT): ``keep`` and
  ``kept`` equal the pruner's bit for bit in every case, ties and NaN scores included;
* ``exact=False`` (a port summing the scores in another order, e.g. attention in fp32 tiles: EViT, ATS): rows whose
  scores differ by a rounding only may be decided differently, at most ``max(2, T // 500)`` of the ``T`` rows in a
  case (a wrong count moves far more); bit for bit too on the ``ties`` case, whose equal scores sum exactly in any
  order, and on the ``nan`` case of a pruner scoring ``x``.

The fused token (EViT): where an image's rows are decided alike, its ``extra_token`` is within one rounding of its
dtype of the pruner's (``rtol = eps``, ``atol = eps * max|ref|``, ``eps = max(finfo.eps, 1e-5)``).

The cases (``quick`` / ``full`` as in :func:`ragged_vit.testing.level`), each in every dtype of the device:

* ``lengths``: images of the adversarial lengths (1, 2, 63, 64, 65 at quick; 197, 577 and 1025 too at full);
* ``ragged``: random lengths (``many`` at full: 64 images of up to 197 rows);
* ``ties``: every patch of an image equal (equal scores, ``2**k`` patches: ties go to the earlier row);
* ``large``: numerically adversarial magnitudes: ``x`` times 100 (a squared norm or a variance summed in fp16
  overflows) and the attention's q and k times 4 (logits of +-50: an exp without its row's maximum subtracted
  overflows in fp16);
* ``nan``: a few rows of NaN (for a pruner scoring ``x``, NaN scores rank first, as in ``torch.sort``, by either
  rule; for one scoring by attention, where the NaN spreads is the implementation's: only what always holds is
  checked);
* ``prefix``: 5 prefix rows (a class token and four registers), and none for pruners that do not need a class token;
* ``rotary``, ``rotary_half`` (a pruner that scores by attention): a RoPE model's rotation of q and k given with them
  (``inp.rotary``, :class:`ragged_vit.core.rotary.Rotary`: interleaved pairs with one table; the half layout with a
  table per head), the prefix rows unrotated, which the scores must apply as the block's attention does;
* ``empty`` (unless ``empty_images=False``): images without a row among the others;
* ``loose_bound``: ``max_seqlen`` twice the longest image (a bound, not a length);
* ``native``: images of two sizes with their own patch counts given (``inp.image_patches``, a NaFlexVit's native
  batch) and a total the batch size divides: ragged whatever the total, so no host count (``inp.uniform_rows``);
* ``isolation``: the property above;
* ``capture`` (CUDA, with ``capturable=True``): no device-to-host sync, and a CUDA graph of it replays the decision;
* ``bad_inputs`` (with ``bad_inputs=True``, for a public entry): a wrong pruner type, not a ``DecisionInput``, a
  1-D ``x`` and int64 offsets raise ``TypeError`` / ``ValueError``.

Inputs: ``x [T, C]``; for a pruner that scores by attention (``Pruner.needs_attention``) also the block's ``qkv [T,
3*H*D]`` with ``C = H*D``, ``num_heads`` and ``scale`` (contiguous rows, as the pipelines give it). A pruner with
weights (DynamicViT) needs ``channels=`` its embedding width.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..core.rotary import Rotary
from ..core.segments import cu_seqlens_from_counts
from ..core.selection import DecisionInput, Pruner, TokenSelection, kept_counts
from ..reference.rotary import table_from_angles
from .attention import default_dtypes
from .report import Failure, bad_call_failures, level, raise_failures

FusedDecision = Callable[[Pruner, DecisionInput], TokenSelection]
QUICK_LENGTHS = (1, 2, 63, 64, 65)
ADVERSARIAL_LENGTHS = (*QUICK_LENGTHS, 197, 577, 1025)


@dataclass(frozen=True)
class DecisionCase:
    """One case: its kind, the images' lengths, prefix rows per image and dtype."""

    kind: str
    lengths: tuple[int, ...]
    dtype: torch.dtype
    num_prefix: int = 1

    @property
    def id(self) -> str:
        lengths = "-".join(map(str, self.lengths)) if len(self.lengths) <= 5 else f"{len(self.lengths)}images"
        return f"{self.kind}[{lengths}]-p{self.num_prefix}-{str(self.dtype).removeprefix('torch.')}"

    def generator(self, salt: int = 0) -> torch.Generator:
        """Fresh inputs per case, reproducible per case."""
        return torch.Generator().manual_seed(zlib.crc32(self.id.encode()) + salt)


def decision_cases(
    pruner: Pruner,
    level_name: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
    capturable: bool = False,
) -> list[DecisionCase]:
    """The cases of ``level_name`` for ``pruner`` on ``device``."""
    full = level(level_name) == "full"
    device = torch.device(device)
    dtypes = tuple(dtypes) if dtypes is not None else default_dtypes(device)
    g = torch.Generator().manual_seed(len(dtypes))
    ragged = tuple(torch.randint(1, 80, (5,), generator=g).tolist())
    attention = pruner.needs_attention
    no_prefix = () if attention else (0,)
    cases = []
    for dtype in dtypes:
        kinds = [("lengths", ADVERSARIAL_LENGTHS if full else QUICK_LENGTHS, 1), ("ragged", ragged, 1),
                 ("ties", (33, 65, 9), 1), ("large", (40, 65, 9), 1), ("nan", (40, 65, 2), 1),
                 ("loose_bound", (30, 7, 19), 1), ("native", (40, 24), 1),
                 ("isolation", (40, 70, 9), 1), *(("prefix", (5, 40, 70, 6), p) for p in (5, *no_prefix)),
                 *((("rotary", (40, 65, 9), 1), ("rotary_half", (33, 64, 7), 1)) if attention else ())]  # fmt: skip
        if empty_images:
            kinds.append(("empty", (5, 0, 64, 0), 1))
        if full:
            kinds.append(("many", tuple(torch.randint(1, 198, (64,), generator=g).tolist()), 1))
        if capturable and device.type == "cuda":
            kinds.append(("capture", (197, 150, 197), 1))
        cases += [DecisionCase(kind, lengths, dtype, prefix) for kind, lengths, prefix in kinds]
    if bad_inputs:
        cases.append(DecisionCase("bad_inputs", (4, 6), torch.float32))
    return cases


def check_decision(
    pruner: Pruner,
    fn: FusedDecision,
    level_name: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    exact: bool = True,
    channels: int | None = None,
    bad_inputs: bool = False,
    empty_images: bool = True,
    capturable: bool = False,
) -> int:
    """Runs every case of the decision contract on ``fn`` against ``pruner``; raises :class:`ConformanceError` listing
    each failed case; returns how many cases ran.

    Args:
        pruner: the ground truth, ready to decide (a calibrated Threshold-L2 is calibrated); ``fn`` gets a copy moved
            to each case's device and dtype.
        fn: the implementation under test, ``fn(pruner, inp) -> TokenSelection``.
        level_name: ``quick`` or ``full`` (default: ``$RAGGED_VIT_CONFORMANCE``, else quick).
        device, dtypes: where and in which dtypes (default: fp32 and fp16 on a CPU, fp16, bf16 and fp32 on a GPU).
        exact: the decisions' rule (module docstring): bit for bit, or up to rows whose scores round differently.
        channels: ``x``'s width; required for a pruner with weights (its embedding width), else 32 (``H*D`` of the
            attention for a pruner that scores by it).
        bad_inputs: ``fn`` validates its arguments (a public entry; a registered fused decision trusts its caller).
        empty_images: ``fn`` takes images of no rows (the pipelines never make one).
        capturable: ``fn`` makes no device-to-host sync and can be captured in a CUDA graph (CUDA only).
    """
    cases = decision_cases(
        pruner, level_name, device=device, dtypes=dtypes, bad_inputs=bad_inputs, empty_images=empty_images,
        capturable=capturable,
    )  # fmt: skip
    failures = [f for case in cases for f in run_decision_case(pruner, fn, case, device, exact, channels)]
    raise_failures(f"decision ({_describe(pruner)})", failures)
    return len(cases)


def decision_suite(
    fn: FusedDecision,
    pruners: Pruner | Sequence[Pruner] | Mapping[str, Pruner],
    *,
    device: torch.device | str = "cpu",
    exact: bool = True,
    channels: int | None = None,
    **options: object,
):
    """A pytest test function running every case of :func:`check_decision` for every pruner as its own test item
    (``options``: ``level_name``, ``dtypes``, ``bad_inputs``, ``empty_images``, ``capturable``): a port's test file is
    ``test_my_decision = decision_suite(my_fn, [MyPruner(rate=0.5), MyPruner(rate=0.7)], exact=False)``."""
    import pytest

    if isinstance(pruners, Pruner):
        pruners = [pruners]
    named = dict(pruners) if isinstance(pruners, Mapping) else {f"{p.name}{i}": p for i, p in enumerate(pruners)}
    params = [
        pytest.param(p, case, id=f"{name}-{case.id}")
        for name, p in named.items()
        for case in decision_cases(p, device=device, **options)
    ]

    @pytest.mark.parametrize("pruner,case", params)
    def test(pruner: Pruner, case: DecisionCase) -> None:
        failures = run_decision_case(pruner, fn, case, device, exact, channels)
        raise_failures(f"decision ({_describe(pruner)})", failures)

    return test


def run_decision_case(
    pruner: Pruner,
    fn: FusedDecision,
    case: DecisionCase,
    device: torch.device | str,
    exact: bool = True,
    channels: int | None = None,
) -> list[Failure]:
    """One case's failures (empty when ``fn`` passes it), at the first and the last stage of the pruner's
    schedule."""
    if not isinstance(pruner, Pruner):
        raise TypeError(f"pruner must be a Pruner, got {type(pruner).__name__}")
    device = torch.device(device)
    width = _channels(pruner, channels)
    if case.kind == "bad_inputs":
        return _bad_input_failures(pruner, fn, width, device)
    pruner = copy.deepcopy(pruner).to(device=device, dtype=case.dtype)
    g = case.generator()
    failures = []
    for stage in sorted({0, len(pruner.blocks) - 1}):
        inp = _input(pruner, case, stage, width, device, g)
        try:
            ref = pruner(inp)
            got = _capture(pruner, fn, inp) if case.kind == "capture" else fn(pruner, inp)
            failures += _compare(case, stage, inp, got, ref, exact)
            if case.kind == "isolation" and not failures:
                failures += _isolation(pruner, fn, case, stage, inp, got, g)
        except Exception as exc:  # a crash is a failed case, reported like the others
            return [*failures, Failure(_where(case, stage), "runs", f"{type(exc).__name__}: {exc}", "a TokenSelection")]
    return failures


def _channels(pruner: Pruner, channels: int | None) -> int:
    if channels is None:
        if any(True for _ in pruner.parameters()):
            raise ValueError(f"channels= (the embedding width) is required for {type(pruner).__name__}: it has weights")
        return 32
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int, got {channels!r}")
    if pruner.needs_attention and channels % 16:
        raise ValueError(f"channels must be a multiple of 16 for a pruner scoring by attention, got {channels}")
    return channels


def _input(
    pruner: Pruner, case: DecisionCase, stage: int, width: int, device: torch.device, g: torch.Generator
) -> DecisionInput:
    """A stage's input for ``case``: random rows, shaped by the case's kind."""
    lengths = torch.tensor(case.lengths)
    cu = cu_seqlens_from_counts(lengths)
    total = int(cu[-1])
    num_patches = max(max(case.lengths) - case.num_prefix, 1)
    bound = max(max(case.lengths), 1)
    if case.kind == "loose_bound":
        bound = 2 * bound + 7
    x = torch.randn(total, width, generator=g)
    qkv = torch.randn(total, 3 * width, generator=g) if pruner.needs_attention else None
    if case.kind == "ties":  # every patch equal to its image's first: equal scores, summing exactly (2**k patches)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            first = start + case.num_prefix
            x[first:end] = x[first]
            if qkv is not None:
                qkv[start:end, :width] = 0.0  # no query: every logit equal
                qkv[first:end, width:] = qkv[first, width:]
    if case.kind == "large":
        x *= 100.0
        if qkv is not None:
            qkv[:, : 2 * width] *= 4.0
    if case.kind == "nan":
        nan_rows = torch.randperm(total, generator=g)[:3]
        (x if qkv is None else qkv)[nan_rows] = float("nan")
    heads = width // 64 if width % 64 == 0 else width // 16  # DeiT's head dim where the width allows it
    rotates = case.kind.startswith("rotary") and qkv is not None
    rotary = _rotation(case, heads, width // heads, device, g) if rotates else None
    return DecisionInput(
        x.to(device, case.dtype),
        cu.to(device),
        stage,
        num_patches,
        bound,
        None if qkv is None else qkv.to(device, case.dtype),
        heads if qkv is not None else None,
        (width // heads) ** -0.5 if qkv is not None else None,
        num_prefix=case.num_prefix,
        image_patches=(lengths - case.num_prefix).to(device) if case.kind == "native" else None,
        rotary=rotary,
    )


def _rotation(case: DecisionCase, heads: int, head_dim: int, device: torch.device, g: torch.Generator) -> Rotary:
    """A ``rotary`` case's rotation: a fp32 table of random angles (one per head for ``rotary_half``), each image's
    prefix rows unrotated and its patches at their own table rows."""
    half = case.kind == "rotary_half"
    rows = max(case.lengths)
    shape = (heads, rows, head_dim // 2) if half else (rows, head_dim // 2)
    table = table_from_angles(torch.rand(shape, generator=g) * 6.3, half)
    positions = torch.cat([(torch.arange(n) - case.num_prefix).clamp_min(-1) for n in case.lengths])
    return Rotary(table.to(device), positions.to(device, torch.int32), half)


def _compare(
    case: DecisionCase, stage: int, inp: DecisionInput, got: object, ref: TokenSelection, exact: bool
) -> list[Failure]:
    where = _where(case, stage)
    if not isinstance(got, TokenSelection):
        return [Failure(where, "returns a TokenSelection", type(got).__name__, "TokenSelection")]
    total, batch = inp.x.shape[0], inp.cu_seqlens.numel() - 1
    keep, kept = got.keep, got.kept
    shape_ok = isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and keep.shape == (total,)
    if not shape_ok or keep.device != inp.x.device:
        observed = f"{getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}"
        return [Failure(where, "keep is a bool [T] mask on the input's device", observed, f"bool ({total},)")]
    kept_ok = isinstance(kept, torch.Tensor) and kept.dtype == torch.int32 and kept.shape == (batch,)
    if not kept_ok or not kept.is_contiguous() or kept.device != inp.x.device:
        observed = f"{getattr(kept, 'dtype', type(kept).__name__)} {tuple(getattr(kept, 'shape', ()))}"
        return [Failure(where, "kept is a contiguous int32 [B] on the input's device", observed, f"int32 ({batch},)")]
    failures = []
    if (got.fixed_count, got.count) != (ref.fixed_count, ref.count):
        observed = f"fixed_count={got.fixed_count}, count={got.count}"
        failures.append(
            Failure(where, "the pruner's fixed_count and count", observed, f"{ref.fixed_count}, {ref.count}")
        )
    if not torch.equal(kept, kept_counts(keep, inp.cu_seqlens)):
        failures.append(Failure(where, "kept counts keep's rows per image", str(kept.tolist()), "the mask's counts"))
    dropped = int((~keep & _prefix_rows(inp)).sum())
    if dropped:
        failures.append(Failure(where, "every prefix row is kept", f"{dropped} dropped", "0 dropped"))
    if ref.fixed_count and not torch.equal(kept.cpu(), ref.kept.cpu()):
        failures.append(Failure(where, "a fixed count is the pruner's", str(kept.tolist()), str(ref.kept.tolist())))
    if case.kind == "nan" and inp.qkv is not None:
        return failures  # NaN attention: where the NaN spreads is the kernel's; it must stay in bounds, no more
    differ = int((keep != ref.keep).sum())
    allowed = 0 if exact or case.kind in ("ties", "nan") else max(2, total // 500)
    if differ > allowed:
        rule = "keep is the pruner's" + ("" if exact else f" but for rounding near-ties (max(2, T // 500), T={total})")
        row = int((keep != ref.keep).nonzero()[0, 0])
        image = int(torch.searchsorted(inp.cu_seqlens.long(), row, right=True)) - 1
        first = f"first: image {image}, row {row - int(inp.cu_seqlens[image])}, pruner's {bool(ref.keep[row])}"
        failures.append(Failure(where, rule, f"{differ} rows decided differently ({first})", f"{allowed}"))
    return failures + _extra_token_failures(where, inp, got, ref)


def _extra_token_failures(where: str, inp: DecisionInput, got: TokenSelection, ref: TokenSelection) -> list[Failure]:
    if ref.extra_token is None or got.extra_token is None:
        if (ref.extra_token is None) != (got.extra_token is None):
            observed = "none" if got.extra_token is None else "one"
            return [Failure(where, "an extra token exactly where the pruner gives one", observed, "the pruner's")]
        return []
    token, want = got.extra_token, ref.extra_token
    if not isinstance(token, torch.Tensor) or token.shape != want.shape or token.dtype != want.dtype:
        observed = f"{getattr(token, 'dtype', type(token).__name__)} {tuple(getattr(token, 'shape', ()))}"
        return [
            Failure(where, "extra_token is [B, C] in the pruner's dtype", observed, f"{want.dtype} {tuple(want.shape)}")
        ]
    alike = _images_decided_alike(inp, got.keep, ref.keep)
    if not alike.any():
        return []
    eps = max(torch.finfo(want.dtype).eps, 1e-5)
    err = (token[alike].float() - want[alike].float()).abs()
    allowed = eps * want[alike].float().abs() + eps * want[alike].float().abs().max()
    if not bool((err <= allowed).all()):
        worst = (err - allowed).max().item()
        return [Failure(where, "extra_token within one rounding of the pruner's", f"{worst:.3g} over", "0 over")]
    return []


def _images_decided_alike(inp: DecisionInput, keep: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: images whose every row is decided as the pruner decides it."""
    return kept_counts(keep != ref, inp.cu_seqlens) == 0


def _prefix_rows(inp: DecisionInput) -> torch.Tensor:
    cu = inp.cu_seqlens.long()
    rows = torch.arange(inp.x.shape[0], device=cu.device)
    starts = cu[:-1].repeat_interleave(cu[1:] - cu[:-1])
    return rows - starts < inp.num_prefix


def _isolation(pruner, fn, case, stage, inp, got, g) -> list[Failure]:
    """Changing the middle image's rows changes no other image's decision, bit for bit."""
    bounds = inp.cu_seqlens.tolist()
    start, end = bounds[1], bounds[2]
    changed = {"x": inp.x.clone()}
    changed["x"][start:end] = torch.randn(end - start, inp.x.shape[1], generator=g).to(inp.x)
    if inp.qkv is not None:
        changed["qkv"] = inp.qkv.clone()
        changed["qkv"][start:end] = torch.randn(end - start, inp.qkv.shape[1], generator=g).to(inp.qkv)
    again = fn(pruner, replace(inp, **changed))
    rows = torch.ones(inp.x.shape[0], dtype=torch.bool, device=inp.x.device)
    rows[start:end] = False
    images = torch.ones(len(bounds) - 1, dtype=torch.bool, device=inp.x.device)
    images[1] = False
    same = torch.equal(again.keep[rows], got.keep[rows]) and torch.equal(again.kept[images], got.kept[images])
    if got.extra_token is not None:
        same = same and torch.equal(again.extra_token[images], got.extra_token[images])
    if not same:
        rule = "isolation: another image's inputs change no decision"
        return [Failure(_where(case, stage), rule, "decisions changed", "bitwise equal")]
    return []


def _capture(pruner: Pruner, fn: FusedDecision, inp: DecisionInput) -> TokenSelection:
    """``fn`` run with device-to-host syncs made errors, then captured in a CUDA graph and replayed over poisoned
    outputs: what the replay leaves is the result."""
    fn(pruner, inp)  # warm up (compile, autotune) outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(pruner, inp)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sel = fn(pruner, inp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sel.keep.fill_(True)
    sel.kept.fill_(-1)
    if sel.extra_token is not None:
        sel.extra_token.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return sel


def _bad_input_failures(pruner: Pruner, fn: FusedDecision, width: int, device: torch.device) -> list[Failure]:
    """A wrong pruner, a wrong input type, a 1-D ``x`` and int64 offsets must raise ``TypeError`` or ``ValueError``."""
    pruner = copy.deepcopy(pruner).to(device)
    case = DecisionCase("bad_inputs", (4, 6), torch.float32)
    inp = _input(pruner, case, 0, width, device, case.generator())
    calls = {
        "a pruner of another type": lambda: fn(torch.nn.Identity(), inp),
        "not a DecisionInput": lambda: fn(pruner, inp.x),
        "1-D x": lambda: fn(pruner, replace(inp, x=inp.x[:, 0])),
        "int64 cu_seqlens": lambda: fn(pruner, replace(inp, cu_seqlens=inp.cu_seqlens.long())),
    }
    return bad_call_failures((name, None, call) for name, call in calls.items())


def _where(case: DecisionCase, stage: int) -> str:
    return f"{case.id}-stage{stage}"


def _describe(pruner: Pruner) -> str:
    return f"{type(pruner).__name__}({pruner.extra_repr()})"
