"""Token packing on the GPU without host synchronisation: pack, repack, unpack, CLS rows.

Mirrors ``ragged_vit.reference.packing`` (same layout, same results) with two Triton kernels per (re)pack:

1. ``_count_kernel`` (one program per image) counts kept rows.
2. ``_pack_kernel`` (one program per (image, row block)) derives its image's output offset from the counts,
   ranks its kept rows with a cumulative sum, writes ``cu_seqlens`` and copies rows with wide coalesced loads
   over channel blocks that divide ``C`` exactly (768 -> 3 x 256: no masked lanes).

How many rows the output has decides whether the host must wait:

* ``count=k`` (fixed-count pruners: DynamicViT, EViT, Threshold-L2 ratio): ``T = B * k`` is known on the host;
  no synchronisation at all. The counts are not read back: a wrong ``count`` is caught only with
  ``check_values=True``.
* ``capacity=R`` (CUDA graphs, variable-count pruners): the buffer has ``R`` rows whatever the real total; rows
  beyond the total are left unwritten and ``cu_seqlens`` stays valid (offsets clamped to ``R``). No
  synchronisation; read ``cu_seqlens[-1]`` yourself when you need the total (e.g. to pick a bucket) and compare it
  with ``R`` to detect overflow.
* neither: exactly one device-to-host read (the total), documented and unavoidable for an exact-size buffer.

``max_seqlen`` returned is an upper bound (the input bound, or ``count``), never read from the device.

Options for the CUDA-graph runner (``ragged_vit.pipelines.graphs``), which saves small kernels per pruning stage:

* ``kept=`` int32 ``[B]``: the rows each image keeps, as a decision kernel already reports them; skips
  ``_count_kernel``. Trusted as given: checked against ``keep`` only with ``check_values=True``.
* ``padding_images=P`` (capacity mode only): ``cu_seqlens`` gets ``P`` more offsets,
  ``min(total + (i + 1) * padding_len, capacity)``, describing padding images of at most ``padding_len`` rows
  over the rows ``[total, capacity)`` that no image owns (``total``: the real rows written), so attention sees
  ``T == cu_seqlens[-1]`` when ``P * padding_len >= capacity - total``. Written by ``_pack_kernel`` itself.
* ``cu_out=``: a preallocated int32 ``[B+1+P]`` (any contiguous slice, alignment not required) written in place.

Not supported: padding with ``count=`` or an exact-size buffer (there every row belongs to an image).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.segments import segment_ids, segment_sum
from ..core.validation import FLOAT_DTYPES, check_cu_seqlens, check_int, check_max_seqlen, check_tensor
from .launcher import CompiledLauncher, aligned, cdiv, next_power_of_2

# Rows per program of the repack: 8 or 16 rows (2 or 4 warps) were no faster than 32 in 4 warps
# (docs/tuning.md#repack-rows-per-program)
_BLOCK_R = 32


@triton.jit
def _source_rows(b, SRC_CU, dense_len, DENSE: tl.constexpr):
    """First row and length of image ``b`` in the input: ``b * N`` and ``N`` for a dense batch."""
    if DENSE:
        start = b * dense_len
        length = dense_len
    else:
        start = tl.load(SRC_CU + b)
        length = tl.load(SRC_CU + b + 1) - start
    return start, length


@triton.jit(do_not_specialize=["dense_len"])
def _count_kernel(KEEP, SRC_CU, COUNTS, dense_len, LEN_PAD: tl.constexpr, DENSE: tl.constexpr):
    b = tl.program_id(0)
    src_start, length = _source_rows(b, SRC_CU, dense_len, DENSE)
    offs = tl.arange(0, LEN_PAD)
    k = tl.load(KEEP + src_start + offs, mask=offs < length, other=0).to(tl.int32)
    tl.store(COUNTS + b, tl.sum(k, 0))


@triton.jit(do_not_specialize=["dense_len", "batch", "capacity", "num_pads", "pad_len"])
def _pack_kernel(
    X, KEEP, SRC_CU, COUNTS, EXTRA, OUT, CU_OUT,
    POS, POS_OUT,  # int32 [T] and [rows]: each row's rotary position, moved with it (HAS_POS), or None
    dense_len, batch, capacity, stride_xt, stride_et, num_pads, pad_len,
    CHANNELS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LEN_PAD: tl.constexpr,
    B_PAD: tl.constexpr,
    DENSE: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    PADS_PAD: tl.constexpr,
    HAS_POS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    r = tl.program_id(1)
    src_start, length = _source_rows(b, SRC_CU, dense_len, DENSE)

    # Output offset of image b: kept rows of the images before it (+1 each for an extra token).
    offs_b = tl.arange(0, B_PAD)
    counts = tl.load(COUNTS + offs_b, mask=offs_b < batch, other=0)
    count_b = tl.sum(tl.where(offs_b == b, counts, 0), 0)
    offset = tl.sum(tl.where(offs_b < b, counts, 0), 0) + b * HAS_EXTRA
    if r == 0:
        end = offset + count_b + HAS_EXTRA
        tl.store(CU_OUT + b + 1, tl.minimum(end, capacity))
        if b == 0:
            tl.store(CU_OUT, 0)
        if PADS_PAD > 0:
            if b == batch - 1:
                # The last image's end is the real total: padding images of pad_len rows from there on, clamped
                # to capacity (int64: total + num_pads * pad_len may pass int32 before the clamp).
                offs_p = tl.arange(0, PADS_PAD)
                pad_ends = end.to(tl.int64) + (offs_p + 1).to(tl.int64) * pad_len
                tl.store(
                    CU_OUT + batch + 1 + offs_p, tl.minimum(pad_ends, capacity).to(tl.int32), mask=offs_p < num_pads
                )

    # Rank of each kept row inside its image: kept rows before this block + running count inside it.
    row0 = r * BLOCK_R
    offs = tl.arange(0, LEN_PAD)
    k_all = tl.load(KEEP + src_start + offs, mask=offs < length, other=0).to(tl.int32)
    before = tl.sum(tl.where(offs < row0, k_all, 0), 0)
    rows = row0 + tl.arange(0, BLOCK_R)
    k = tl.load(KEEP + src_start + rows, mask=rows < length, other=0).to(tl.int32)
    dest = offset + before + tl.cumsum(k, 0) - 1
    write = (k != 0) & (dest < capacity)

    offs_c = tl.arange(0, BLOCK_C)
    src = X + (src_start + rows).to(tl.int64)[:, None] * stride_xt
    dst = OUT + dest.to(tl.int64)[:, None] * CHANNELS
    for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
        vals = tl.load(src + c0 + offs_c[None, :], mask=write[:, None])
        tl.store(dst + c0 + offs_c[None, :], vals, mask=write[:, None])
    if HAS_POS:
        tl.store(POS_OUT + dest, tl.load(POS + src_start + rows, mask=write), mask=write)

    if HAS_EXTRA:
        extra_row = offset + count_b
        if (r == 0) & (extra_row < capacity):
            for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
                extra_vals = tl.load(EXTRA + b.to(tl.int64) * stride_et + c0 + offs_c)
                tl.store(OUT + extra_row.to(tl.int64) * CHANNELS + c0 + offs_c, extra_vals)
            if HAS_POS:
                tl.store(POS_OUT + extra_row, -1)  # a token made of several patches has no single position


@triton.jit
def _unpack_kernel(
    TOKENS, CU, OUT, fill, total_rows, stride_tt, padded_len,
    CHANNELS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    r = tl.program_id(1)
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total_rows)
    length = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total_rows) - start
    rows = r * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = rows < padded_len
    valid = rows < length
    offs_c = tl.arange(0, BLOCK_C)
    src = TOKENS + (start + rows).to(tl.int64)[:, None] * stride_tt
    dst = OUT + (b.to(tl.int64) * padded_len + rows)[:, None] * CHANNELS
    for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
        vals = tl.load(src + c0 + offs_c[None, :], mask=valid[:, None], other=fill)
        tl.store(dst + c0 + offs_c[None, :], vals, mask=inside[:, None])


@triton.jit
def store_total_and_longest(KEPT, OUT, batch, BLOCK_B: tl.constexpr):
    """The sum and the max of ``KEPT[:batch]``, stored as ``OUT[0]`` then ``OUT[1]`` by the calling program (``OUT``
    may be pinned host memory: a host polling it sees each value once it lands); shared with the merge kernel
    (``ragged_vit.triton_impl.merging``), which writes a merging stage's pair in its own launch."""
    offs = tl.arange(0, BLOCK_B)
    total = tl.zeros([BLOCK_B], dtype=tl.int32)
    longest = tl.zeros([BLOCK_B], dtype=tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        k = tl.load(KEPT + b0 + offs, mask=b0 + offs < batch, other=0)
        total += k
        longest = tl.maximum(longest, k)
    tl.store(OUT, tl.sum(total, axis=0))
    tl.store(OUT + 1, tl.max(longest, axis=0))


@triton.jit(do_not_specialize=["batch"])
def _total_longest_kernel(KEPT, OUT, batch, BLOCK_B: tl.constexpr):
    store_total_and_longest(KEPT, OUT, batch, BLOCK_B)  # one program


_count_launcher = CompiledLauncher(_count_kernel)
_pack_launcher = CompiledLauncher(_pack_kernel)
_total_longest_launcher = CompiledLauncher(_total_longest_kernel)


def _channel_block(channels: int) -> int:
    """Largest power of two <= 256 dividing ``channels``: full-width loads with no masked lanes."""
    block = 256
    while channels % block:
        block //= 2
    return block


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")


def _check_mode(count: int | None, capacity: int | None) -> None:
    if count is not None and capacity is not None:
        raise ValueError("give count or capacity, not both")
    for name, val in (("count", count), ("capacity", capacity)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")


def _repack(
    x: torch.Tensor,
    keep: torch.Tensor,
    src_cu: torch.Tensor | None,
    batch: int,
    max_len: int,
    extra_token: torch.Tensor | None,
    count: int | None,
    capacity: int | None,
    *,
    kept: torch.Tensor | None = None,
    padding_images: int = 0,
    padding_len: int | None = None,
    cu_out: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    channels = x.shape[-1]
    dense = src_cu is None
    has_extra = extra_token is not None
    len_pad = next_power_of_2(max_len)
    counts = torch.empty(batch, dtype=torch.int32, device=x.device) if kept is None else kept
    if cu_out is None:
        cu_out = torch.empty(batch + 1 + padding_images, dtype=torch.int32, device=x.device)
    device = x.get_device()
    # cu_out may be a slice of a larger buffer: an unaligned one takes Triton's own (specialising) path.
    pointers = [x, keep, counts, cu_out] + [t for t in (src_cu, extra_token) if t is not None]
    is_aligned = aligned(*pointers)
    if kept is None:
        _count_launcher(
            (dense, len_pad) if is_aligned else None, device, (batch, 1),
            (keep, src_cu, counts, max_len, len_pad, dense), num_warps=4, num_stages=1,
        )  # fmt: skip
    if count is not None:
        rows, bound = batch * count, count
    elif capacity is not None:
        rows, bound = capacity, max_len + has_extra
    else:
        rows, bound = int(counts.sum()) + batch * has_extra, max_len + has_extra  # the one documented sync
    # Clamping the step to capacity changes no offset (total + step >= capacity either way) and keeps it an i32.
    pad_len = min(bound if padding_len is None else padding_len, rows)
    pads_pad = next_power_of_2(padding_images) if padding_images else 0
    out = x.new_empty((rows, channels))
    stride_x, stride_e = x.stride(-2), extra_token.stride(0) if has_extra else 0
    block_c, b_pad = _channel_block(channels), next_power_of_2(batch)
    has_pos = positions is not None
    if has_pos:
        is_aligned = is_aligned and aligned(positions, positions_out)
    key = (x.dtype, channels, len_pad, b_pad, dense, has_extra, pads_pad, stride_x % 16, stride_e % 16, has_pos)
    _pack_launcher(
        key if is_aligned else None, device, (batch, cdiv(max_len, _BLOCK_R)),
        (x, keep, src_cu, counts, extra_token, out, cu_out, positions, positions_out, max_len, batch, rows, stride_x,
         stride_e, padding_images, pad_len, channels, block_c, _BLOCK_R, len_pad, b_pad, dense, has_extra, pads_pad,
         has_pos),
        num_warps=4, num_stages=1,
    )  # fmt: skip
    return out, cu_out, bound


def _check_extra(extra_token: torch.Tensor | None, batch: int, like: torch.Tensor) -> None:
    if extra_token is None:
        return
    check_tensor(extra_token, "extra_token", ndim=2, dtypes=(like.dtype,), device=like.device)
    if tuple(extra_token.shape) != (batch, like.shape[-1]):
        raise ValueError(f"extra_token must have shape ({batch}, {like.shape[-1]}), got {tuple(extra_token.shape)}")
    _check_rows(extra_token, "extra_token")


def _check_cls_kept(keep_at_cls: torch.Tensor, name: str) -> None:
    if not bool(keep_at_cls.all()):
        raise ValueError(f"{name} must be True at every image's CLS row")


def _check_graph_options(
    kept: torch.Tensor | None,
    padding_images: int,
    padding_len: int | None,
    cu_out: torch.Tensor | None,
    capacity: int | None,
    batch: int,
    device: torch.device,
) -> None:
    """Metadata checks of ``kept``, ``padding_images``, ``padding_len`` and ``cu_out`` (no device read)."""
    if kept is not None:
        check_tensor(kept, "kept", ndim=1, dtypes=(torch.int32,), device=device)
        if kept.shape[0] != batch:
            raise ValueError(f"kept must have shape ({batch},), one count per image, got {tuple(kept.shape)}")
        if not kept.is_contiguous():
            raise ValueError(f"kept must be contiguous, got stride {kept.stride()}")
    check_int(padding_images, "padding_images", 0)
    if padding_len is not None:
        check_int(padding_len, "padding_len", 1)
    if (padding_images or padding_len is not None) and capacity is None:
        raise ValueError(
            f"padding_images={padding_images} / padding_len={padding_len} need capacity=: the padding images cover "
            "the buffer rows past the total"
        )
    if cu_out is not None:
        entries = batch + 1 + padding_images
        check_tensor(cu_out, "cu_out", ndim=1, dtypes=(torch.int32,), device=device)
        if cu_out.shape[0] != entries:
            raise ValueError(f"cu_out must have shape ({entries},) (B + 1 + padding_images), got {tuple(cu_out.shape)}")
        if not cu_out.is_contiguous():
            raise ValueError(f"cu_out must be contiguous, got stride {cu_out.stride()}")


def _check_kept_values(kept: torch.Tensor | None, counts: torch.Tensor) -> None:
    if kept is not None and not torch.equal(kept.long(), counts.long()):
        raise ValueError(f"kept={kept.tolist()} does not match the kept rows per image of keep {counts.tolist()}")


def pack(
    x: torch.Tensor,
    keep: torch.Tensor,
    *,
    count: int | None = None,
    capacity: int | None = None,
    extra_token: torch.Tensor | None = None,
    check_values: bool | None = None,
    kept: torch.Tensor | None = None,
    padding_images: int = 0,
    padding_len: int | None = None,
    cu_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Packs the kept tokens of a dense batch: ``x [B, N, C]``, ``keep`` bool ``[B, N]``.

    Args:
        count: rows kept per image, known on the host (fixed-count pruners): no sync.
        capacity: output rows to allocate (CUDA graphs): no sync, see the module docstring.
        extra_token: optional ``[B, C]`` appended after each image's kept rows.
        check_values: read ``keep`` to check CLS is kept (and ``count``, ``kept``); default only on CPU.
        kept, padding_images, padding_len, cu_out: as in :func:`repack`.

    Returns:
        ``tokens [T, C]``, ``cu_seqlens`` int32 ``[B+1+padding_images]``, ``max_seqlen`` (an upper bound, host int).
    """
    check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES)
    batch, n, _ = x.shape
    if batch == 0:
        raise ValueError("x must hold at least one image, got batch size 0")
    check_tensor(keep, "keep", ndim=2, dtypes=(torch.bool,), device=x.device)
    if tuple(keep.shape) != (batch, n):
        raise ValueError(f"keep must have shape ({batch}, {n}) to match x, got {tuple(keep.shape)}")
    if not keep.is_contiguous():
        raise ValueError("keep must be contiguous")
    _check_rows(x, "x")
    if x.stride(0) != n * x.stride(1):
        raise ValueError(f"x must have rows laid out image after image (stride(0) == N * stride(1)), got {x.stride()}")
    _check_mode(count, capacity)
    _check_extra(extra_token, batch, x)
    _check_graph_options(kept, padding_images, padding_len, cu_out, capacity, batch, x.device)
    if check_values if check_values is not None else x.device.type == "cpu":
        _check_cls_kept(keep[:, 0], "keep[:, 0]")
        if count is not None and not bool((keep.sum(1) + (extra_token is not None) == count).all()):
            raise ValueError(f"count={count} does not match the kept rows per image {keep.sum(1).tolist()}")
        _check_kept_values(kept, keep.sum(1))
    return _repack(
        x, keep, None, batch, n, extra_token, count, capacity,
        kept=kept, padding_images=padding_images, padding_len=padding_len, cu_out=cu_out,
    )  # fmt: skip


def repack(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    keep: torch.Tensor,
    max_seqlen: int,
    *,
    count: int | None = None,
    capacity: int | None = None,
    extra_token: torch.Tensor | None = None,
    check_values: bool | None = None,
    kept: torch.Tensor | None = None,
    padding_images: int = 0,
    padding_len: int | None = None,
    cu_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prunes an already packed buffer, ragged to ragged (no detour through padding).

    Args:
        tokens: ``[T, C]`` packed rows; ``cu_seqlens`` int32 ``[B+1]``; ``keep`` bool ``[T]``.
        max_seqlen: upper bound on the input lengths (e.g. the ``max_seqlen`` returned by :func:`pack`).
        count, capacity, extra_token: as in :func:`pack`.
        check_values: read ``keep`` (and ``cu_seqlens``, ``kept``, ``count``) to check them; default only on CPU.
        kept: int32 ``[B]``, the rows each image keeps (CLS included, an extra token excluded), e.g.
            ``TokenSelection.kept``: skips the counting kernel; checked against ``keep`` only with ``check_values``.
        padding_images: with ``capacity`` only: append this many offsets to ``cu_seqlens``,
            ``min(total + (i + 1) * padding_len, capacity)``, padding images over the rows no image owns.
        padding_len: rows per padding image (at most); defaults to the returned ``max_seqlen`` bound.
        cu_out: int32 contiguous ``[B+1+padding_images]`` to write ``cu_seqlens`` into (and return), e.g. a row
            of a preallocated graph buffer; need not be 16-byte aligned.

    Returns:
        ``tokens [T', C]``, ``cu_seqlens`` int32 ``[B+1+padding_images]``, ``max_seqlen`` (an upper bound).
    """
    check_tensor(tokens, "tokens", ndim=2, dtypes=FLOAT_DTYPES)
    total = tokens.shape[0]
    check_cu_seqlens(cu_seqlens, total=total, device=tokens.device, check_values=check_values)
    check_max_seqlen(max_seqlen)
    check_tensor(keep, "keep", ndim=1, dtypes=(torch.bool,), device=tokens.device)
    if keep.shape[0] != total:
        raise ValueError(f"keep must have shape ({total},) to match tokens, got {tuple(keep.shape)}")
    _check_rows(tokens, "tokens")
    _check_mode(count, capacity)
    batch = cu_seqlens.shape[0] - 1
    _check_extra(extra_token, batch, tokens)
    _check_graph_options(kept, padding_images, padding_len, cu_out, capacity, batch, tokens.device)
    if check_values if check_values is not None else tokens.device.type == "cpu":
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        if int(lens.max()) > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence {int(lens.max())}")
        _check_cls_kept(keep[cu_seqlens[:-1].long()[lens > 0]], "keep")
        counts = segment_sum(keep.long(), segment_ids(cu_seqlens, total), batch)
        _check_kept_values(kept, counts)
        if count is not None and not bool((counts + (extra_token is not None) == count).all()):
            raise ValueError(f"count={count} does not match the kept rows per image {counts.tolist()}")
    return repack_unchecked(
        tokens, cu_seqlens, keep, max_seqlen, count=count, capacity=capacity, extra_token=extra_token,
        kept=kept, padding_images=padding_images, padding_len=padding_len, cu_out=cu_out,
    )  # fmt: skip


def repack_unchecked(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    keep: torch.Tensor,
    max_seqlen: int,
    *,
    count: int | None = None,
    capacity: int | None = None,
    extra_token: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    padding_images: int = 0,
    padding_len: int | None = None,
    cu_out: torch.Tensor | None = None,
    batch: int | None = None,
    positions: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`repack` without its checks, for callers that built (and so validated) every argument themselves:
    the pipelines' hot path. Wrong arguments here give wrong results, not errors.

    ``batch``: repack the first ``batch`` images of ``cu_seqlens`` only (default: all of them); the entries of
    ``cu_seqlens`` and ``kept`` after theirs (an earlier buffer's padding images) are not read, so a caller passes
    them whole instead of slicing them (one host op less each).

    ``positions`` (int32 ``[T]``, contiguous) with ``positions_out`` (int32, the output's rows: ``B * count`` or
    ``capacity``): each row's rotary position is copied with the row by the same kernel (a RoPE model's
    :class:`ragged_vit.pipelines.eva.RotaryRows`), ``-1`` for an appended ``extra_token``; rows past the real total
    are not written, as in the output."""
    return _repack(
        tokens, keep, cu_seqlens, cu_seqlens.shape[0] - 1 if batch is None else batch, max_seqlen, extra_token,
        count, capacity, kept=kept, padding_images=padding_images, padding_len=padding_len, cu_out=cu_out,
        positions=positions, positions_out=positions_out,
    )  # fmt: skip


def unpack(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, fill: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatters packed rows back to ``[B, max_seqlen, C]`` (``fill`` at padding) and returns the validity mask.

    ``max_seqlen`` is the padded length; rows of images longer than it are dropped (give an upper bound).
    """
    check_tensor(tokens, "tokens", ndim=2, dtypes=FLOAT_DTYPES)
    total, channels = tokens.shape
    check_cu_seqlens(cu_seqlens, total=total, device=tokens.device)
    check_max_seqlen(max_seqlen)
    _check_rows(tokens, "tokens")
    batch = cu_seqlens.shape[0] - 1
    out = tokens.new_empty((batch, max_seqlen, channels))
    _unpack_kernel[(batch, cdiv(max_seqlen, _BLOCK_R))](
        tokens, cu_seqlens, out, fill, total, tokens.stride(0), max_seqlen,
        CHANNELS=channels, BLOCK_C=_channel_block(channels), BLOCK_R=_BLOCK_R,
    )  # fmt: skip
    lens = (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    mask = torch.arange(max_seqlen, device=tokens.device, dtype=torch.int32)[None, :] < lens
    return out, mask


def total_and_longest(kept: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes the rows of the images all told and the longest image's rows, ``kept.sum()`` and ``kept.max()``, to
    ``out[0]`` and ``out[1]`` in one launch, and returns ``out``: the two integers the graph runner reads back after
    a variable-count stage (``ragged_vit.pipelines.graphs``), written straight into pinned host memory, so the host
    sees them without a copy or a wait for the rest of the stream.

    Args:
        kept: int32 ``[B]`` (B >= 1, contiguous): the rows each image keeps (each ``>= 0``).
        out: int32, at least 2 elements, contiguous: on ``kept``'s device, or pinned host memory when ``kept`` is
            on a GPU.
    """
    check_tensor(kept, "kept", ndim=1, dtypes=(torch.int32,))
    check_tensor(out, "out", ndim=1, dtypes=(torch.int32,))
    if kept.shape[0] == 0:
        raise ValueError("kept must hold at least one image's count, got an empty tensor")
    if out.shape[0] < 2:
        raise ValueError(f"out must have at least 2 elements, got {out.shape[0]}")
    for t, name in ((kept, "kept"), (out, "out")):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.device != kept.device and not (kept.is_cuda and out.device.type == "cpu" and out.is_pinned()):
        raise ValueError(
            f"out must be on kept's device ({kept.device}) or in pinned host memory, got a tensor on {out.device}"
        )
    return total_and_longest_unchecked(kept, out)


def total_and_longest_unchecked(kept: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`total_and_longest` without its checks (the graph runner's hot path)."""
    batch = kept.shape[0]
    block = min(next_power_of_2(batch), 1024)
    ok = aligned(kept) and out.data_ptr() % 16 == 0  # out may be pinned host memory: its address only
    _total_longest_launcher(
        (block,) if ok else None, kept.get_device(), (1,), (kept, out, batch, block), num_warps=4, num_stages=1
    )
    return out


def cls_rows(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each image's first (CLS) row: ``[T, C]`` -> ``[B, C]``; one gather, no sync."""
    check_tensor(tokens, "tokens", ndim=2, dtypes=FLOAT_DTYPES)
    check_cu_seqlens(cu_seqlens, total=tokens.shape[0], device=tokens.device)
    return tokens.index_select(0, cu_seqlens[:-1])
