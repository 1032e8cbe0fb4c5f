"""The packed block's lean host path (``ragged_vit.pipelines.packed_block``), its key_bias plumbing, and the host-op
counter (``ragged_vit.testing.ops``).

The lean path issues the ops the modules would issue, in the same order, so it is compared *bitwise* with the module
path (forced by a hook, which the lean path must defer to) and :func:`dense_block` bitwise with timm's ``block(x)``,
on CPU fp32. Op counts are exact: both sides run on the same torch, and the lean side must issue exactly the other
side's operators minus the dropouts.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import weakref
from functools import partial

import pytest
import torch
from timm.layers import LayerNormFp32, activations
from timm.models.vision_transformer import Block, ResPostBlock
from torch import nn

from ragged_vit import PrunedViT, build_pipeline
from ragged_vit.pipelines.backends import make_backend
from ragged_vit.pipelines.backends.base import AttentionBackend, Capabilities
from ragged_vit.pipelines.executor import Run, execute
from ragged_vit.pipelines.packed_block import (
    dense_block,
    lean_block,
    packed_attention,
    packed_attention_residual,
    packed_block,
    packed_blocks,
    packed_mlp,
    packed_mlp_qkv,
    packed_qkv,
)
from ragged_vit.pipelines.plan import StepKind
from ragged_vit.pipelines.state import ForwardState
from ragged_vit.testing.ops import count_ops, op_names

DIM, HEADS = 64, 2

PLAIN = {  # Block keyword arguments of blocks the lean path must take
    "deit": {"qkv_bias": True},
    "no_bias": {"qkv_bias": False, "proj_bias": False},
    "layer_scale": {"qkv_bias": True, "init_values": 0.1},
    "gelu_tanh": {"qkv_bias": True, "act_layer": partial(nn.GELU, approximate="tanh")},
    "timm_gelu_tanh": {"act_layer": activations.GELUTanh},
    "torch_layer_norm": {"qkv_bias": True, "norm_layer": nn.LayerNorm},
    "dropout_rates": {"qkv_bias": True, "proj_drop": 0.1, "attn_drop": 0.1, "drop_path": 0.1},  # eval: identities
}
NOT_PLAIN = {  # ... and of blocks it must leave to the module path
    "qk_norm": {"qkv_bias": True, "qk_norm": True},
    "scale_attn_norm": {"scale_attn_norm": True},
    "scale_mlp_norm": {"scale_mlp_norm": True},
    "layer_norm_fp32": {"norm_layer": LayerNormFp32},
    "quick_gelu": {"act_layer": activations.QuickGELU},
}


def make_block(gen: torch.Generator, **kwargs) -> Block:
    """A timm Block with every parameter random (LayerNorm and LayerScale included), in eval mode."""
    known = inspect.signature(Block.__init__).parameters
    missing = [k for k in kwargs if k not in known]
    if missing:
        pytest.skip(f"this timm's Block has no {missing}")
    block = Block(DIM, HEADS, **kwargs).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return block


@contextlib.contextmanager
def module_path(block: nn.Module, norm: str = "norm1"):
    """Forces the module path with a no-op hook on ``block.norm1`` (or ``norm``) and checks the hook ran (so it
    did)."""
    calls = []
    handle = getattr(block, norm).register_forward_pre_hook(lambda _module, _args: calls.append(1))
    try:
        assert lean_block(block) is None
        yield
    finally:
        handle.remove()
    assert calls, "the module path did not run"


def packed_input(gen: torch.Generator, lengths=(5, 1, 9)) -> tuple[torch.Tensor, torch.Tensor, int]:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(int(cu[-1]), DIM, generator=gen), cu, max(lengths)


def all_outputs(block: nn.Module, x: torch.Tensor, cu: torch.Tensor, max_seqlen: int, backend) -> list[torch.Tensor]:
    """Every entry point on the same input: packed_block, both halves (with the qkv), packed_blocks (twice)."""
    with torch.no_grad():
        mid, qkv = packed_attention(block, x, cu, max_seqlen, backend)
        return [
            packed_block(block, x, cu, max_seqlen, backend),
            mid,
            qkv,
            packed_mlp(block, mid),
            packed_blocks([block, block], x, cu, max_seqlen, backend),
        ]


def assert_all_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"


# --- bitwise: lean path == module path == timm --------------------------------------------------------------------


@pytest.mark.parametrize("case", list(PLAIN))
def test_lean_path_is_the_module_path_bitwise(case, gen):
    block = make_block(gen, **PLAIN[case])
    backend = make_backend("reference")
    x, cu, max_seqlen = packed_input(gen)
    assert lean_block(block) is not None
    lean = all_outputs(block, x, cu, max_seqlen, backend)
    with module_path(block):
        modules = all_outputs(block, x, cu, max_seqlen, backend)
    assert_all_equal(lean, modules)


def test_layer_scale_inplace_is_bitwise_too(gen):
    block = make_block(gen, qkv_bias=True, init_values=0.1)
    block.ls1.inplace = block.ls2.inplace = True  # timm's LayerScale(inplace=True): x.mul_(gamma)
    x, cu, max_seqlen = packed_input(gen)
    backend = make_backend("reference")
    lean = all_outputs(block, x, cu, max_seqlen, backend)
    with module_path(block):
        assert_all_equal(lean, all_outputs(block, x, cu, max_seqlen, backend))


@pytest.mark.parametrize("case", list(PLAIN))
def test_dense_block_is_timm_block_bitwise(case, gen):
    block = make_block(gen, **PLAIN[case])
    x = torch.randn(2, 7, DIM, generator=gen)
    with torch.no_grad():
        assert torch.equal(dense_block(block, x), block(x))


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_other_blocks_fall_back_to_the_module_path(case, gen):
    block = make_block(gen, **NOT_PLAIN[case])
    assert lean_block(block) is None
    x, cu, max_seqlen = packed_input(gen, lengths=(6, 6))
    with torch.no_grad():
        dense = block(x.view(2, 6, DIM)).view(12, DIM)
        assert torch.equal(dense_block(block, x.view(2, 6, DIM)).view(12, DIM), dense)
        torch.testing.assert_close(packed_block(block, x, cu, max_seqlen, make_backend("reference")), dense)
    assert lean_block(ResPostBlock(DIM, HEADS).eval()) is None  # another block type


def test_unfused_timm_attention_keeps_timm_block_in_dense(gen):
    """timm's manual attention (fused_attn False) is not SDPA: dense_block then runs block(x) itself."""
    block = make_block(gen, qkv_bias=True)
    block.attn.fused_attn = False
    x = torch.randn(2, 7, DIM, generator=gen)
    with torch.no_grad():
        assert op_names(dense_block, block, x) == op_names(block, x)
        assert torch.equal(dense_block(block, x), block(x))


# --- the cache sees what changes after the first call -------------------------------------------------------------


def test_half_to_and_loaded_weights_after_first_use(gen):
    block = make_block(gen, qkv_bias=True, init_values=0.1)
    backend = make_backend("reference")
    x, cu, max_seqlen = packed_input(gen)
    first = all_outputs(block, x, cu, max_seqlen, backend)  # decided and cached here

    other = make_block(gen, qkv_bias=True, init_values=0.1)
    block.load_state_dict(other.state_dict())  # copied into the same parameters
    loaded = all_outputs(block, x, cu, max_seqlen, backend)
    assert not torch.equal(loaded[0], first[0])
    assert_all_equal(loaded, all_outputs(other, x, cu, max_seqlen, backend))

    block.load_state_dict(make_block(gen, qkv_bias=True, init_values=0.1).state_dict(), assign=True)  # new tensors
    assigned = all_outputs(block, x, cu, max_seqlen, backend)
    with module_path(block):
        assert_all_equal(assigned, all_outputs(block, x, cu, max_seqlen, backend))

    for convert, dtype in ((nn.Module.half, torch.float16), (partial(nn.Module.to, dtype=torch.bfloat16), None)):
        convert(block)
        dtype = dtype or torch.bfloat16
        assert lean_block(block) is not None
        converted = all_outputs(block, x.to(dtype), cu, max_seqlen, backend)
        assert all(t.dtype == dtype for t in converted)
        with module_path(block):
            assert_all_equal(converted, all_outputs(block, x.to(dtype), cu, max_seqlen, backend))


def test_replaced_modules_are_decided_again(gen):
    block = make_block(gen, qkv_bias=True)
    backend = make_backend("reference")
    x, cu, max_seqlen = packed_input(gen)
    all_outputs(block, x, cu, max_seqlen, backend)
    assert lean_block(block) is not None

    block.mlp.act = nn.GELU(approximate="tanh")  # still plain, another GELU
    assert lean_block(block).approximate == "tanh"
    lean = all_outputs(block, x, cu, max_seqlen, backend)
    with module_path(block):
        assert_all_equal(lean, all_outputs(block, x, cu, max_seqlen, backend))

    block.attn.q_norm = nn.LayerNorm(DIM // HEADS)  # no longer plain
    assert lean_block(block) is None
    block.attn.q_norm = nn.Identity()
    assert lean_block(block) is not None


def test_hooks_training_and_compiling_take_the_module_path(gen, monkeypatch):
    block = make_block(gen, qkv_bias=True)
    backend = make_backend("reference")
    x, cu, max_seqlen = packed_input(gen)
    all_outputs(block, x, cu, max_seqlen, backend)  # lean, cached

    seen = []
    handle = block.mlp.fc1.register_forward_hook(lambda _m, _args, out: seen.append(out.shape))
    with torch.no_grad():
        packed_block(block, x, cu, max_seqlen, backend)
    handle.remove()
    assert seen == [(x.shape[0], 4 * DIM)]

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, _args, _out: seen.append(type(m)))
    try:
        assert lean_block(block) is None
    finally:
        handle.remove()
    assert lean_block(block) is not None

    block.train()
    assert lean_block(block) is None
    block.eval()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lean_block(block) is None


def test_the_cache_keeps_no_block_alive(gen):
    block = make_block(gen)
    assert lean_block(block) is not None
    ref = weakref.ref(block)
    del block
    gc.collect()
    assert ref() is None


# --- key_bias ----------------------------------------------------------------------------------------------------


class Recording(AttentionBackend):
    """Records the keyword arguments of each attend; the output is q itself."""

    name = "recording"

    def __init__(self, key_bias: bool) -> None:
        self.capabilities = Capabilities(key_bias=key_bias)
        self.calls: list[dict] = []

    def _attend(self, qkv, cu_seqlens, max_seqlen, num_heads, scale, **kwargs):
        self.calls.append(kwargs)
        return qkv[:, : qkv.shape[1] // 3]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "modules"])
def test_key_bias_reaches_the_backend_only_when_given(lean, gen):
    block = make_block(gen, qkv_bias=True)
    x, cu, max_seqlen = packed_input(gen)
    bias = torch.rand(x.shape[0], generator=gen)
    backend = Recording(key_bias=True)
    with torch.no_grad(), contextlib.nullcontext() if lean else module_path(block):
        packed_block(block, x, cu, max_seqlen, backend)
        packed_attention(block, x, cu, max_seqlen, backend)
        assert backend.calls == [{}, {}]  # default: the call of a backend without key_bias, unchanged
        backend.calls.clear()
        packed_block(block, x, cu, max_seqlen, backend, key_bias=bias)
        packed_attention(block, x, cu, max_seqlen, backend, key_bias=bias)
        packed_blocks([block, block], x, cu, max_seqlen, backend, key_bias=bias)
        assert len(backend.calls) == 4 and all(call["key_bias"] is bias for call in backend.calls)
        with pytest.raises(ValueError, match="does not take a key_bias"):
            packed_block(block, x, cu, max_seqlen, Recording(key_bias=False), key_bias=bias)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "modules"])
def test_attention_half_split_at_its_qkv_projection_is_bitwise_the_half(lean, gen):
    """:func:`packed_qkv` then :func:`packed_attention_residual` (where a merge decision starts beside the attention
    core) are :func:`packed_attention`, bit for bit, key bias and all."""
    block = make_block(gen, qkv_bias=True, init_values=1e-2)
    x, cu, max_seqlen = packed_input(gen)
    bias = torch.rand(x.shape[0], generator=gen)
    backend = make_backend("reference")
    with torch.no_grad(), contextlib.nullcontext() if lean else module_path(block):
        whole, whole_qkv = packed_attention(block, x, cu, max_seqlen, backend, key_bias=bias)
        normed, qkv = packed_qkv(block, x)
        split = packed_attention_residual(block, x, normed, qkv, cu, max_seqlen, backend, key_bias=bias)
    assert torch.equal(qkv, whole_qkv) and torch.equal(split, whole)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "modules"])
def test_mlp_half_with_the_next_qkv_is_bitwise_the_two_calls(lean, gen):
    """:func:`packed_mlp_qkv` (an MLP half that also starts the next block's attention) is :func:`packed_mlp`, then
    :func:`packed_qkv` of the next block, bit for bit."""
    block, following = make_block(gen, qkv_bias=True, init_values=1e-2), make_block(gen, qkv_bias=True)
    x, _, _ = packed_input(gen)
    paths = [contextlib.nullcontext()] * 2 if lean else [module_path(block, "norm2"), module_path(following)]
    with torch.no_grad(), paths[0], paths[1]:
        fused = packed_mlp_qkv(block, x, following)
        mid = packed_mlp(block, x)
        apart = (mid, *packed_qkv(following, mid))
    assert len(fused) == 3 and all(torch.equal(a, b) for a, b in zip(fused, apart, strict=True))


def test_key_bias_changes_the_reference_attention(gen):
    block = make_block(gen, qkv_bias=True)
    x, cu, max_seqlen = packed_input(gen)
    backend = make_backend("reference")
    with torch.no_grad():
        plain = packed_block(block, x, cu, max_seqlen, backend)
        zero = packed_block(block, x, cu, max_seqlen, backend, key_bias=torch.zeros(x.shape[0]))
        biased = packed_block(block, x, cu, max_seqlen, backend, key_bias=torch.rand(x.shape[0], generator=gen) * 3)
    torch.testing.assert_close(zero, plain)
    assert not torch.allclose(biased, plain)
    assert torch.equal(biased[5:6], plain[5:6])  # a one-token image attends to itself whatever its bias


# --- host ops ------------------------------------------------------------------------------------------------------


def test_count_ops_counts_top_level_operators():
    x = torch.ones(3)
    ops = op_names(lambda: torch.nn.functional.linear(x, torch.eye(3)) + x)
    assert ops == ["aten::eye", "aten::linear", "aten::add"]  # aten::linear's own t and addmm are not counted
    assert count_ops(torch.add, x, x) == 1  # what aten::add calls inside is not counted again


@pytest.mark.parametrize("case", ["deit", "layer_scale"])
def test_lean_blocks_issue_timm_ops_without_dropouts(case, gen):
    """Measured (torch 2.14, timm 1.0.31, CPU): a DeiT block issues 18 top-level ops through timm's block(x) and 15
    through dense_block; on the packed buffer 13 through the modules and 10 lean (9 + the stub's one attention op);
    LayerScale adds one mul per half to each side."""
    block = make_block(gen, **PLAIN[case])
    scales = 2 if case == "layer_scale" else 0
    x, cu, max_seqlen = packed_input(gen, lengths=(7, 7))
    backend = Recording(key_bias=False)  # one op (a slice) for the attention
    with torch.no_grad():
        timm_ops = op_names(block, x.view(2, 7, DIM))
        dense_ops = op_names(dense_block, block, x.view(2, 7, DIM))
        lean_ops = op_names(packed_block, block, x, cu, max_seqlen, backend)
        with module_path(block):
            module_ops = op_names(packed_block, block, x, cu, max_seqlen, backend)
    assert timm_ops.count("aten::dropout") == module_ops.count("aten::dropout") == 3
    assert dense_ops == [op for op in timm_ops if op != "aten::dropout"]
    assert lean_ops == [op for op in module_ops if op != "aten::dropout"]
    assert len(timm_ops) >= 18 + scales and len(dense_ops) <= 15 + scales and len(lean_ops) <= 10 + scales


def test_pruned_front_runs_dense_blocks_lean_and_the_unpruned_one_timm_blocks(gen):
    """The pipeline's FRONT step (embedding + the 3 dense blocks before EViT's first stage) with a pruner: bitwise
    timm's blocks, without their 3 dropouts each (a global hook forces timm's blocks for the comparison). The unpruned
    pipeline's FRONT runs timm's own blocks: their dropouts are there."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pv = build_pipeline("deit_tiny_patch16_224", "evit", 0.7, "reference")
    images = torch.randn(2, 3, 224, 224, generator=gen)

    def front(pipeline: PrunedViT) -> torch.Tensor:
        (step,) = [s for s in pipeline.plan.steps if s.kind is StepKind.FRONT]
        state = ForwardState(images.shape[0], images)
        execute(Run(pipeline, pipeline.parts, repack=None), [step], state)
        return state.x

    assert pv.num_dense_blocks == pv.first_packed_block == 3
    with torch.no_grad():
        lean, lean_ops = front(pv), op_names(front, pv)
        handle = torch.nn.modules.module.register_module_forward_hook(lambda _m, _args, _out: None)
        try:
            timm, timm_ops = front(pv), op_names(front, pv)
        finally:
            handle.remove()
        unpruned_ops = op_names(front, PrunedViT(pv.model, None))
        embed = op_names(pv.embed, images)  # timm's embedding, its pos_drop dropout included, runs as it is
    assert torch.equal(lean, timm)
    assert lean_ops[: len(embed)] == timm_ops[: len(embed)] == unpruned_ops[: len(embed)] == embed
    timm_blocks, unpruned_blocks = timm_ops[len(embed) :], unpruned_ops[len(embed) :]
    assert timm_blocks.count("aten::dropout") == 3 * 3 and unpruned_blocks.count("aten::dropout") == 3 * 12
    assert lean_ops[len(embed) :] == [op for op in timm_blocks if op != "aten::dropout"]
