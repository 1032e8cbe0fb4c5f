"""The conformance lab: the cases and tolerance rules the project checks its kernels with, for anyone who ports one.

Each contract has a checker that takes the implementation under test as a callable, runs the lab's cases against the
pure-PyTorch ground truth (:mod:`ragged_vit.reference`) and raises one readable :class:`ConformanceError` naming every
failed case, the rule it broke, and the observed against the allowed error:

* :func:`check_attention` -- varlen attention, on the packed qkv projection (``fn(qkv, cu_seqlens, max_seqlen,
  num_heads, scale) -> [T, H*D]``, the attention backends' ``attend``) or on separate ``q, k, v`` (``fn(q, k, v,
  cu_seqlens, max_seqlen, scale) -> [T, H, D]``); with ``key_bias=True`` its key-bias variant (``fn(...,
  key_bias=[T])``, ToMe's proportional attention), with ``key_bias=False`` the check that ``fn`` refuses a bias;
  with ``rotary=True`` its rotary variant (``fn(..., rotary=Rotary(table, positions, half))``: RoPE ViTs' q and k
  rotated by each row's table position), with ``rotary=False`` the check that ``fn`` refuses one.
* :func:`check_pack` -- pack, repack, unpack and ``cls_rows``, bitwise against :mod:`ragged_vit.reference.packing`
  (the options of the sync-free Triton version declared by flags).
* :func:`check_linear` -- a ViT block's linear layer with its LayerNorm, bias, GELU, LayerScale and residual fused in
  (``fn(x, weight, bias, *, ln_weight, ln_bias, eps, activation, residual, gamma) -> [M, N]``), against
  :func:`ragged_vit.reference.linear.fused_linear`.
* :func:`check_decision` -- a fused decision (``fn(pruner, inp) -> TokenSelection``, what
  :func:`ragged_vit.core.decisions.register_decision` registers) against the pruner it implements.

The same cases parametrize a port's own pytest file (:func:`attention_suite`, :func:`pack_suite`,
:func:`linear_suite`, :func:`decision_suite`): one line registers the callable, and every case becomes a test. Two
levels: ``quick`` (small and few: seconds under Triton's interpreter on a CPU) and ``full`` (every adversarial
length, every dtype the device runs); the environment variable ``RAGGED_VIT_CONFORMANCE=full`` selects the full one.
``docs/porting.md`` states the contracts and walks through a port. Pure PyTorch; runs on CPU and GPU; imports
nothing above :mod:`ragged_vit.reference`.
"""

from .attention import (
    AttentionCase,
    assert_attention_close,
    attention_cases,
    attention_error,
    attention_suite,
    check_attention,
)
from .decision import DecisionCase, check_decision, decision_cases, decision_suite
from .linear import LinearCase, assert_linear_close, check_linear, linear_cases, linear_error, linear_suite
from .pack import PackCase, check_pack, pack_cases, pack_suite
from .report import ConformanceError, level

__all__ = [
    "AttentionCase",
    "ConformanceError",
    "DecisionCase",
    "LinearCase",
    "PackCase",
    "assert_attention_close",
    "assert_linear_close",
    "attention_cases",
    "attention_error",
    "attention_suite",
    "check_attention",
    "check_decision",
    "decision_cases",
    "decision_suite",
    "check_pack",
    "check_linear",
    "level",
    "linear_cases",
    "linear_error",
    "linear_suite",
    "pack_cases",
    "pack_suite",
]
