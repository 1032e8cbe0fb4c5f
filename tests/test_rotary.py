"""Rotary position embedding (RoPE) on packed rows: the reference against timm, the positions a repack moves (reference
and Triton pack kernel), and the attention kernel's rotary variant against the reference through the lab's rotary case
family (quick under Triton's interpreter, full on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

from ragged_vit.core.rotary import Rotary
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.pipelines.backends import make_backend
from ragged_vit.reference import packing as ref_packing
from ragged_vit.reference.rotary import (
    patch_positions,
    repack_positions,
    rotate,
    rotate_qkv,
    table_from_angles,
)
from ragged_vit.testing import attention_cases, attention_suite
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl import pack as tp
from tests.helpers import one_per_family


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
def test_rotate_is_timms_rotation_with_prefix_rows_unrotated(half, per_head, dtype, gen):
    """Bit for bit timm's ``apply_rot_embed_cat`` on the patch rows (the table a timm rope module gives), the prefix
    rows unchanged, as timm's Eva attention leaves its ``num_prefix_tokens`` rows."""
    batch, heads, tokens, prefix, dim = 2, 3, 11, 5, 8
    x = torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype)
    angles = torch.randn(*((heads, tokens - prefix) if per_head else (6,)), dim // 2, generator=gen)
    table = table_from_angles(angles, half)
    expected = torch.cat([x[:, :, :prefix], apply_rot_embed_cat(x[:, :, prefix:], table, half=half).to(dtype)], 2)
    rows = x.transpose(1, 2).flatten(0, 1)  # packed [B*N, H, D]
    out = rotate(rows, table, patch_positions(batch, tokens, prefix), half)
    assert torch.equal(out.unflatten(0, (batch, tokens)).transpose(1, 2), expected)


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
def test_rotate_reads_each_pairs_angle_from_its_first_lane(half, gen):
    """A pair turns by one angle: the second lane's sin and cos (timm's copies) are never read, so garbage there
    changes nothing, and the first lanes' values are what rotate both lanes."""
    x, positions = torch.randn(5, 2, 8, generator=gen), torch.arange(5, dtype=torch.int32)
    table = table_from_angles(torch.rand(5, 4, generator=gen) * 6.3, half)
    lanes = torch.arange(8)
    second = lanes >= 4 if half else lanes % 2 == 1
    garbage = table.clone()
    garbage[:, torch.cat([second, second])] = torch.randn(5, 8, generator=gen)
    assert torch.equal(rotate(x, garbage, positions, half), rotate(x, table, positions, half))


def test_rotate_leaves_positions_outside_the_table_unrotated_and_checks_its_arguments(gen):
    x = torch.randn(4, 2, 8, generator=gen)
    table = torch.randn(3, 16, generator=gen)
    out = rotate(x, table, torch.tensor([-1, 3, -7, 0], dtype=torch.int32))
    assert torch.equal(out[:3], x[:3]) and not torch.equal(out[3], x[3])
    qkv = torch.randn(4, 3 * 16, generator=gen)
    pos = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    q, k, v = rotate_qkv(qkv, 2, table, pos).unflatten(1, (3, 2, 8)).unbind(1)
    assert torch.equal(v.flatten(1), qkv[:, 32:])
    assert torch.equal(q, rotate(qkv[:, :16].unflatten(1, (2, 8)), table, pos))
    with pytest.raises(ValueError, match=r"rotary table must be \[N, 16\]"):
        rotate(x, table[:, :12], pos)
    with pytest.raises(TypeError, match="rotary positions"):
        rotate(x, table, pos.float())
    with pytest.raises(ValueError, match="one index per row"):
        rotate(x, table, pos[:3])


def test_repack_positions_follow_the_kept_rows_and_an_appended_token_is_unrotated(gen):
    """The positions a repack keeps are the reference repack of the rows themselves (positions as a one-column float
    buffer), an appended token's ``-1``."""
    cu = cu_seqlens_from_counts(torch.tensor([7, 1, 12]))
    positions = patch_positions(1, 20, 1)
    keep = torch.rand(20, generator=gen) < 0.5
    keep[cu[:-1].long()] = True
    as_rows = positions.float()[:, None]
    assert torch.equal(repack_positions(positions, cu, keep), ref_packing.repack(as_rows, cu, keep)[0][:, 0].int())
    fused = ref_packing.repack(as_rows, cu, keep, torch.full((3, 1), -1.0))[0][:, 0].int()
    assert torch.equal(repack_positions(positions, cu, keep, extra_token=True), fused)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["count", "capacity_extra"])
def test_triton_repack_carries_positions_with_the_rows(mode, gen):
    """The pack kernel copies each kept row's position with it (HAS_POS), ``-1`` for an appended token, as the
    reference; its rows are the reference repack's, bit for bit."""
    lengths, channels = [9, 3, 20], 16
    cu = cu_seqlens_from_counts(torch.tensor(lengths))
    total = sum(lengths)
    x = torch.randn(total, channels, generator=gen)
    positions = torch.randint(-1, 50, (total,), generator=gen, dtype=torch.int32)
    score = torch.rand(total, generator=gen)
    score[cu[:-1].long()] = 2.0  # every image keeps its first row
    keep = torch.zeros(total, dtype=torch.bool)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        keep[s + score[s:e].topk(min(3, e - s)).indices] = True
    kept = torch.tensor([3, 3, 3], dtype=torch.int32)
    extra = torch.randn(3, channels, generator=gen) if mode == "capacity_extra" else None
    rows = 12 if extra is None else 16
    moved = torch.full((rows,), -99, dtype=torch.int32)
    out, new_cu, _ = tp.repack_unchecked(
        x, cu, keep, max(lengths), count=3 if extra is None else None, capacity=None if extra is None else rows,
        extra_token=extra, kept=kept, positions=positions, positions_out=moved,
    )  # fmt: skip
    ref_x, ref_cu, _ = ref_packing.repack(x, cu, keep, extra)
    assert torch.equal(new_cu, ref_cu) and torch.equal(out[: ref_x.shape[0]], ref_x)
    expected = repack_positions(positions, cu, keep, extra_token=extra is not None)
    assert torch.equal(moved[: expected.shape[0]], expected)


# The attention kernel's rotary variant: every case of the lab's rotary family (both layouts, shared and per-head
# tables, prefix rows, pruned positions, positions outside the table), under the interpreter at the head dims 64 and
# 128 (each case once, the head dims and dtypes in turn), and on a GPU the lab's full level at the head dims 64, 80 and
# 128 in every dtype (each case once at the quick level, the whole product with --full).
_INTERP_ROPE = dict(device="cpu", accepts_out=True, bad_inputs=True, rotary=True)
_GPU_ROPE = dict(device="cuda", accepts_out=True, bad_inputs=True, rotary=True, level_name="full")


def _one_per_case(test):
    return one_per_family(test, lambda case: (case.kind, case.rope), lambda case: (case.head_dim, case.dtype))


test_qkv_layout_rotary_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_INTERP_ROPE, head_dims=(64, 128)))
)
test_separate_layout_rotary_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(ta.ragged_attention, layout="separate", **_INTERP_ROPE, head_dims=(40,)))
)
test_qkv_layout_rotary_gpu = pytest.mark.gpu(
    _one_per_case(attention_suite(ta.ragged_attention_qkv, layout="qkv", **_GPU_ROPE, head_dims=(64, 80, 128)))
)
test_separate_layout_rotary_gpu = pytest.mark.gpu(
    _one_per_case(attention_suite(ta.ragged_attention, layout="separate", **_GPU_ROPE, head_dims=(64,)))
)


def _rotary_op(qkv, cu_seqlens, max_seqlen, num_heads, scale, rotary, out=None):
    """The custom op (what ``torch.compile`` calls), the rotation given as its three arguments."""
    scale = (qkv.shape[1] // (3 * num_heads)) ** -0.5 if scale is None else scale
    return ta.ragged_attention_qkv_op(qkv, cu_seqlens, max_seqlen, num_heads, scale, None, *rotary)


# The op takes the rotation too (a compiled RoPE block hands it to the kernel instead of rotating q and k before it).
test_custom_op_rotary_interpreter = pytest.mark.interpreter(
    _one_per_case(attention_suite(_rotary_op, layout="qkv", device="cpu", rotary=True, head_dims=(64,)))
)


@pytest.mark.interpreter
def test_the_triton_backend_under_compile_rotates_in_the_kernel(gen):
    """Under ``torch.compile`` the Triton backend's rotary attention is the custom op alone, given the rotation (no
    rotation of q and k around it in the graph), and equals the backend's direct call bit for bit; the op's schema
    and fake implementation pass opcheck with a rotation."""
    backend, heads, head_dim = make_backend("triton"), 2, 64
    cu = cu_seqlens_from_counts(torch.tensor([9, 1, 14]))
    qkv = torch.randn(24, 3 * heads * head_dim, generator=gen)
    table = torch.randn(12, 2 * head_dim, generator=gen)
    positions = torch.tensor([-1, *range(8), -1, -1, *range(11), 30, 0], dtype=torch.int32)
    rot = Rotary(table, positions, True)

    def attend(qkv, table, positions):
        return backend.attend_rotary(qkv, cu, 14, heads, head_dim**-0.5, Rotary(table, positions, True))

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=keep, fullgraph=True)(qkv, table, positions)
    (graph,) = graphs
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == [ta.ragged_attention_qkv_op], calls
    assert torch.equal(compiled, backend.attend_rotary(qkv, cu, 14, heads, head_dim**-0.5, rot))
    args = (qkv, cu, 14, heads, head_dim**-0.5, None, table, positions, True)
    torch.library.opcheck(ta.ragged_attention_qkv_op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="rope_table and rope_positions come together"):
        ta.ragged_attention_qkv_op(qkv, cu, 14, heads, head_dim**-0.5, None, table, None, True)


# A backend that does not rotate refuses a rotation (the pipelines rotate q and k before its attend instead).
test_backend_without_rotation_refuses_one = attention_suite(make_backend("padded_sdpa").attend, rotary=False)


def test_the_lab_rotary_family_catches_a_kernel_that_ignores_the_rotation():
    """Sanity of the family: attention on unrotated q and k fails its lengths case (the rotation changes the result
    beyond the rule)."""
    from ragged_vit.reference.attention import ragged_attention, split_qkv
    from ragged_vit.testing.attention import run_attention_case

    def ignores_rotation(qkv, cu, bound, heads, scale, rotary=None):
        q, k, v = split_qkv(qkv, heads)
        return ragged_attention(q, k, v, cu, scale=scale).flatten(1).to(qkv.dtype)

    def rotates(qkv, cu, bound, heads, scale, rotary=None):
        return ignores_rotation(rotate_qkv(qkv, heads, *rotary), cu, bound, heads, scale)

    case = next(c for c in attention_cases(rotary=True, dtypes=(torch.float32,)) if c.kind == "pruned")
    assert run_attention_case(ignores_rotation, case, "qkv", "cpu", False)
    assert not run_attention_case(rotates, case, "qkv", "cpu", False)


@pytest.mark.interpreter
def test_rotary_entries_check_their_rotation_before_any_launch(gen):
    qkv = torch.randn(6, 3 * 2 * 16, generator=gen)
    cu = cu_seqlens_from_counts(torch.tensor([2, 4]))
    table = torch.randn(4, 32, generator=gen)
    with pytest.raises(TypeError, match="rotary must be"):
        ta.ragged_attention_qkv(qkv, cu, 4, 2, rotary=(table, torch.zeros(6, dtype=torch.int32), False))
    with pytest.raises(ValueError, match="rotary table must have a contiguous last dimension"):
        strided = torch.randn(4, 64, generator=gen)[:, ::2]
        ta.ragged_attention_qkv(qkv, cu, 4, 2, rotary=Rotary(strided, torch.zeros(6, dtype=torch.int32)))
