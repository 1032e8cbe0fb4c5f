"""CPU checks of the kernel benchmark's inputs: the workload generator and the padded peer's gather indices.

The benchmark itself needs a GPU; what it is fed and how its padded baseline pads and unpads can be checked here.
Tolerance rule: the padded formulation and the packed one are the same fp32 math, so they agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_peers import (
    BuiltPeer,
    build_ours,
    build_ours_op,
    build_padded_sdpa,
    check_peer,
    make_problem,
    padding_indices,
    reference_output,
)
from benchmarks.workloads import (
    JITTER,
    MAX_SEQLEN,
    NUM_PATCHES,
    attention_bytes,
    grid,
    make_qkv_sets,
    make_workload,
    sets_to_rotate,
    workload_keeps,
)
from ragged_vit.reference.attention import padded_attention, ragged_attention, split_qkv
from ragged_vit.reference.packing import unpack

FP32_TOL = 1e-5


@pytest.mark.parametrize("variable", [True, False])
@pytest.mark.parametrize(("batch", "pruned"), grid())
def test_workload_counts(batch: int, pruned: int, variable: bool) -> None:
    wl = make_workload(batch, pruned, variable=variable)
    assert len(wl.lengths) == batch
    assert all(2 <= n <= MAX_SEQLEN for n in wl.lengths)  # >= 1 patch + CLS
    target = NUM_PATCHES * (1 - pruned / 100)
    if pruned == 0 or not variable:
        assert set(wl.lengths) == {round(target) + 1}  # 197 / 99 / 40, the paper's counts
    else:
        lo, hi = target * (1 - JITTER), target * (1 + JITTER)
        assert all(lo - 0.5 <= n - 1 <= hi + 0.5 for n in wl.lengths)
        if batch >= 32:
            assert len(set(wl.lengths)) > 5  # truly ragged
    assert make_workload(batch, pruned, variable=variable) == wl  # seeded
    cu = wl.cu_seqlens()
    assert cu.dtype == torch.int32 and cu[0] == 0 and int(cu[-1]) == wl.total
    assert torch.diff(cu).tolist() == list(wl.lengths)
    assert wl.max_len == max(wl.lengths) and wl.min_len == min(wl.lengths)


def test_workload_seeds_differ() -> None:
    assert make_workload(64, 50, seed=0).lengths != make_workload(64, 50, seed=1).lengths
    assert make_workload(64, 50).lengths != make_workload(64, 80).lengths


def test_qkv_sets_are_independent_and_reproducible() -> None:
    wl = make_workload(4, 50)
    sets = make_qkv_sets(wl, 3, "cpu", torch.float16)
    assert all(s.shape == (wl.total, 3 * 12 * 64) and s.dtype == torch.float16 for s in sets)
    assert all(s.float().std() > 0.5 for s in sets)  # random normal, never zeros
    assert not torch.equal(sets[0], sets[1])
    assert all(torch.equal(a, b) for a, b in zip(sets, make_qkv_sets(wl, 3, "cpu", torch.float16), strict=True))


def test_sets_to_rotate() -> None:
    l2 = 50 << 20
    assert sets_to_rotate(attention_bytes(128 * 197), l2) == 4  # big cells: the floor
    assert sets_to_rotate(attention_bytes(40), l2) == 256  # tiny cells: the cap
    mid = sets_to_rotate(attention_bytes(32 * 99), l2)
    assert mid * attention_bytes(32 * 99) >= 2.5 * l2


@pytest.mark.parametrize("lengths", [[5], [1, 7, 3], [4, 4, 4], [197, 2, 60, 197], [1, 1]])
def test_padding_indices_round_trip(lengths: list[int]) -> None:
    total = sum(lengths)
    packed = torch.arange(1, total + 1, dtype=torch.float32)[:, None] * torch.tensor([[1.0, -1.0]])  # [T, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    idx = padding_indices(lengths)
    assert idx.max_len == max(lengths)
    assert idx.pad_index.dtype == torch.int64 and idx.unpad_index.dtype == torch.int64
    padded = packed[idx.pad_index].view(len(lengths), idx.max_len, 2)
    expected, mask = unpack(packed, cu)  # the reference scatter
    assert torch.equal(idx.key_mask, mask)
    assert torch.equal(padded[mask], expected[mask])
    for b, n in enumerate(lengths):  # padding slots read a real row of their own image
        assert torch.equal(padded[b, n:], packed[int(cu[b])].expand(idx.max_len - n, 2))
    assert torch.equal(padded.reshape(-1, 2)[idx.unpad_index], packed)


def test_padding_indices_reject_bad_lengths() -> None:
    with pytest.raises(ValueError, match="positive"):
        padding_indices([3, 0])
    with pytest.raises(ValueError, match="non-empty"):
        padding_indices([])


@pytest.mark.parametrize("lengths", [[7, 1, 33, 20], [17]])
def test_padded_gather_matches_ragged_reference(lengths: list[int]) -> None:
    """Padding with the peer's indices, masked attention, and gathering back equals packed attention."""
    g = torch.Generator().manual_seed(sum(lengths))
    heads, dim = 3, 16
    total = sum(lengths)
    qkv = torch.randn(total, 3 * heads * dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    idx = padding_indices(lengths)
    batch, length = len(lengths), idx.max_len
    x = qkv[idx.pad_index].view(batch, length, 3, heads, dim)
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D]
    o = padded_attention(q, k, v, key_padding_mask=idx.key_mask)
    got = o.transpose(1, 2).reshape(batch * length, heads, dim)[idx.unpad_index]
    want = ragged_attention(*split_qkv(qkv, heads), cu)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize(("batch", "pruned", "variable"), [(3, 50, True), (2, 80, False), (1, 0, True)])
def test_padded_sdpa_peer_on_cpu(batch: int, pruned: int, variable: bool) -> None:
    """The benchmark's padded peer itself (SDPA + additive mask, or the no-padding path), in fp32 on the CPU."""
    problem = make_problem(make_workload(batch, pruned, variable=variable), 2, "cpu", torch.float32)
    peer = build_padded_sdpa(problem)
    for i in range(2):
        check = check_peer(peer, problem, reference_output(problem, i), set_index=i, tol=FP32_TOL)
        assert check.ok, check.reason
    if variable and batch > 1:
        assert "mask" in peer.note
    else:
        assert "no padding" in peer.note


@pytest.mark.interpreter
def test_our_peers_on_cpu() -> None:
    """The benchmark's own peers (the direct call into a preallocated ``out`` and the custom op) as the suite calls
    them, under Triton's interpreter: a signature change they miss fails here, not on the GPU machine."""
    problem = make_problem(make_workload(2, 50, variable=True), 2, "cpu", torch.float32)
    for build in (build_ours, build_ours_op):
        peer = build(problem)
        for i in range(2):
            check = check_peer(peer, problem, reference_output(problem, i), set_index=i, tol=FP32_TOL)
            assert check.ok, (peer.name, check.reason)


def test_check_peer_flags_wrong_and_raising_peers() -> None:
    problem = make_problem(make_workload(2, 80), 1, "cpu", torch.float32)
    ref = reference_output(problem)
    shape = (problem.total, 12 * 64)

    def boom() -> torch.Tensor:
        raise RuntimeError("no kernel image")

    cases = {
        "zeros": lambda: torch.zeros(shape),
        "nan": lambda: torch.full(shape, float("nan")),
        "short": lambda: torch.zeros(3, 5),
        "raises": boom,
    }
    for name, call in cases.items():
        check = check_peer(BuiltPeer(name, [call]), problem, ref)
        assert not check.ok and check.reason, name


def test_workload_keeps_parses_deciding_workloads_only() -> None:
    assert workload_keeps("evit:0.7,ats") == [("evit", 0.7), ("ats", 0.5)]
    assert workload_keeps("dynamicvit", default_keep=0.7) == [("dynamicvit", 0.7)]
    for bad in ("foo:0.5", "evit:1.5", "evit:0", "synthetic", "evit:x"):
        with pytest.raises(ValueError):
            workload_keeps(bad)
