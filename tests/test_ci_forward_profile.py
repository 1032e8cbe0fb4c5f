"""``ci.forward_profile``'s argument checks (the profile itself needs a CUDA GPU: its runs are on the device)."""

from __future__ import annotations

import sys

import pytest
import torch

from ci import forward_profile


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--eager-rounds", "3"], "--eager-rounds: times the eager rows, which only --eager adds"),
        (["--eager", "--eager-rounds", "-1"], "--eager-rounds: must be >= 0"),
        (["--workloads", "tome_v2"], "--workloads:"),
        (["--tome", "-1"], "--tome: r must be >= 0"),
        (["--tome-adaptive", "-2"], "--tome-adaptive: r must be >= 0"),
        (["--eager-only"], "--eager-only: keeps the eager rows, which only --eager adds"),
        (["--eager", "--eager-only", "--compile-blocks"], "--eager-only: --compile-blocks"),
        (["--rope-outside"], "--rope-outside: changes the compiled rows, which only --compile-blocks adds"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["forward_profile", *argv])
    with pytest.raises(SystemExit) as exit_info:
        forward_profile.main()
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.interpreter
def test_rope_outside_rotates_q_and_k_before_the_op_under_compile(monkeypatch, gen):
    """``--rope-outside``'s patch: under ``torch.compile`` the backend's rotary attention is a rotation of its own,
    then the op without one; eagerly it is unchanged; both agree with the kernel's own rotation to fp32 rounding."""
    from ragged_vit.pipelines.backends import make_backend
    from ragged_vit.pipelines.backends.triton import TritonBackend
    from ragged_vit.reference.rotary import Rotary
    from ragged_vit.triton_impl import attention as ta

    monkeypatch.setattr(TritonBackend, "_attend", TritonBackend._attend)  # restored after the test
    backend, heads, head_dim = make_backend("triton"), 2, 32
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    qkv = torch.randn(19, 3 * heads * head_dim, generator=gen)
    table, positions = torch.randn(20, 2 * head_dim, generator=gen), torch.arange(19, dtype=torch.int32) - 1
    inside = backend.attend_rotary(qkv, cu, 12, heads, 0.2, Rotary(table, positions))
    forward_profile.rotate_outside_under_compile()
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    def attend(qkv):
        return backend.attend_rotary(qkv, cu, 12, heads, 0.2, Rotary(table, positions))

    torch._dynamo.reset()
    outside = torch.compile(attend, backend=keep, fullgraph=True)(qkv)
    (op,) = [n for n in graphs[0].graph.nodes if n.target is ta.ragged_attention_qkv_op]
    assert len(graphs[0].graph.nodes) > 10 and op.args[6:] == (None, None, False)  # no rotation given
    assert torch.equal(attend(qkv), inside)  # eagerly: the kernel's own rotation still
    torch.testing.assert_close(outside, inside, rtol=1e-5, atol=1e-5)
