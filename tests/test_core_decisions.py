"""The decision interface (:mod:`ragged_vit.core.selection`) and the fused-decision registry
(:mod:`ragged_vit.core.decisions`): what a stage's decision sees and returns, and how the pipelines find a fused
implementation without naming it.

Decisions are masks and counts: every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from ragged_vit.core.decisions import fused_decision, register_decision, registered_decisions
from ragged_vit.core.rotary import Rotary
from ragged_vit.core.selection import DecisionInput, Pruner, TokenSelection, check_decision_input, kept_counts
from ragged_vit.pipelines.parts import decide
from ragged_vit.pipelines.plan import StepKind
from ragged_vit.reference.pruners import ATSPruner, EViTPruner, ThresholdL2Pruner, make_pruner
from tests.helpers import tiny_images, tiny_pipeline


def test_kernels_register_their_decisions_for_their_pruners():
    import ragged_vit.triton_impl  # noqa: F401  (its import registers the fused decisions)

    registered = registered_decisions()
    assert registered[("ThresholdL2Pruner", "cuda")].startswith("ragged_vit.triton_impl.threshold_l2.")
    assert registered[("ATSPruner", "cuda")].startswith("ragged_vit.triton_impl.ats.")
    assert registered[("DynamicViTPruner", "cuda")].startswith("ragged_vit.triton_impl.dynamicvit.")
    assert registered[("EViTPruner", "cuda")].startswith("ragged_vit.triton_impl.evit.")
    assert fused_decision(ThresholdL2Pruner("ratio", rate=0.5), torch.device("cuda")) is not None
    assert fused_decision(ThresholdL2Pruner("ratio", rate=0.5), torch.device("cpu")) is None  # the pruner decides


def test_lookup_is_by_exact_type():
    """A subclass may change a rule, so it never inherits its parent's kernel."""

    class Stricter(ATSPruner):
        pass

    assert fused_decision(ATSPruner(), torch.device("cuda")) is not None
    assert fused_decision(Stricter(), torch.device("cuda")) is None


def test_registration_errors():
    with pytest.raises(TypeError, match="pruner_type must be a Pruner subclass"):
        register_decision(torch.nn.Linear)
    with pytest.raises(ValueError, match="already registered"):
        register_decision(ATSPruner)(lambda pruner, inp: None)


class _CountingEViT(EViTPruner):
    """An EViT whose 'fused' CPU decision below is the reference itself, counted: a stand-in for a new kernel."""


_CALLS: list[int] = []


@register_decision(_CountingEViT, device_type="cpu")
def _counting_decision(pruner: _CountingEViT, inp: DecisionInput) -> TokenSelection:
    _CALLS.append(inp.stage)
    assert inp.qkv is not None and inp.max_seqlen is not None  # what a MID_BLOCK stage's kernel reads
    return pruner.decide(inp)


def test_pipeline_uses_a_registered_decision_without_naming_it():
    """Registering a decision for a pruner type is all it takes: the pipeline's DECIDE step looks it up."""
    _CALLS.clear()
    pv = tiny_pipeline(lambda: _CountingEViT(rate=0.5, blocks=(1, 3)))
    images = tiny_images(3, 4)
    out = pv.run(images)
    assert _CALLS == [0, 1]
    ref = tiny_pipeline(lambda: EViTPruner(rate=0.5, blocks=(1, 3))).run(images)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.counts, ref.counts)
    assert all(torch.equal(a.keep, b.keep) for a, b in zip(out.selections, ref.selections, strict=True))


TINY_PRUNERS = {
    "threshold_l2": lambda: make_pruner("threshold_l2", mode="calibrated", rate=0.5, block=1),
    "evit_fused": lambda: make_pruner("evit", rate=0.5, blocks=(1, 3), fuse_token=True),
    "ats": lambda: make_pruner("ats", blocks=(1, 2, 3, 4, 5), num_samples=12, min_keep=2),
    "dynamicvit": lambda: make_pruner("dynamicvit", embed_dim=64, rate=0.7, blocks=(1, 3)),
}


@pytest.mark.parametrize("case", list(TINY_PRUNERS))
def test_every_reference_decision_counts_its_rows(case):
    """Every stage's selection carries int32 kept counts equal to its mask's (the repack trusts them); ``on_step``
    sees the plan's steps in order."""
    pv = tiny_pipeline(TINY_PRUNERS[case])
    if case == "threshold_l2":
        pv.calibrate(tiny_images(8, 99))
    steps: list[StepKind] = []
    out = pv.run(tiny_images(3, 5), on_step=lambda step, state: steps.append(step.kind))
    assert steps == [step.kind for step in pv.plan.steps]
    for sel in out.selections:
        assert sel.kept.dtype == torch.int32 and sel.kept.is_contiguous()
    for sel, cu in zip(out.selections, _offsets_before(out), strict=True):
        assert torch.equal(sel.kept, kept_counts(sel.keep, cu))


def _offsets_before(out) -> list[torch.Tensor]:
    """The offsets each stage decided on, from the counts after the previous stage (CLS included)."""
    batch = out.counts.shape[0]
    rows = [torch.full((batch,), 17)] + [c + 1 for c in out.counts.unbind(1)[:-1]]
    return [torch.cat([torch.zeros(1, dtype=torch.int64), r.cumsum(0)]).int() for r in rows]


def test_qkv_or_cls_attention_give_the_same_decision(gen):
    """The pipelines give a MID_BLOCK decision its block's qkv projection; tests may give the CLS attention and
    values directly. The reference derives one from the other, so both decide alike."""
    from ragged_vit.reference.attention import split_qkv
    from ragged_vit.reference.cls_attention import cls_attention

    heads, head_dim = 2, 8
    cu = torch.tensor([0, 17, 30, 31], dtype=torch.int32)
    qkv = torch.randn(31, 3 * heads * head_dim, generator=gen) * 3
    x = torch.randn(31, heads * head_dim, generator=gen)
    q, k, v = split_qkv(qkv, heads)
    given = DecisionInput(x, cu, 0, 16, cls_attn=cls_attention(q, k, cu, 0.3), v=v.flatten(1))
    derived = DecisionInput(x, cu, 0, 16, qkv=qkv, num_heads=heads, scale=0.3)
    for pruner in (EViTPruner(rate=0.5), ATSPruner(num_samples=6, min_keep=1)):
        a, b = pruner(given), pruner(derived)
        assert torch.equal(a.keep, b.keep) and torch.equal(a.kept, b.kept)
        c = decide(pruner, derived)
        assert torch.equal(c.keep, a.keep)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"qkv": "qkv"}, "inp.qkv must be a torch.Tensor"),
        ({"qkv": torch.zeros(30, 48), "num_heads": 2, "scale": 0.3}, r"inp.qkv must have shape \[31, 3\*H\*D\]"),
        ({"qkv": torch.zeros(31, 50), "num_heads": 2, "scale": 0.3}, r"inp.qkv must have shape"),
        ({"qkv": torch.zeros(31, 48), "num_heads": 0, "scale": 0.3}, "inp.num_heads"),
        ({"qkv": torch.zeros(31, 48), "num_heads": 2}, "inp.scale"),
        ({"max_seqlen": 0}, "inp.max_seqlen"),
        ({"rotary": Rotary(torch.zeros(4, 16), torch.zeros(31, dtype=torch.int32))}, "give inp.qkv too"),
        ({"qkv": torch.zeros(31, 48), "num_heads": 2, "scale": 0.3, "rotary": (1, 2)}, "inp.rotary must be"),
        ({"qkv": torch.zeros(31, 48), "num_heads": 2, "scale": 0.3,
          "rotary": Rotary(torch.zeros(4, 12), torch.zeros(31, dtype=torch.int32))}, r"rotary table must be \[N, 16\]"),
        ({"qkv": torch.zeros(31, 48), "num_heads": 2, "scale": 0.3,
          "rotary": Rotary(torch.zeros(4, 16), torch.zeros(30, dtype=torch.int32))}, "one index per row"),
    ],
)
def test_bad_decision_inputs_name_the_field(changes, match):
    cu = torch.tensor([0, 17, 30, 31], dtype=torch.int32)
    inp = DecisionInput(torch.zeros(31, 16), cu, 0, 16, **changes)
    with pytest.raises((TypeError, ValueError), match=match):
        check_decision_input(inp, attention=True)


def test_pruner_base_is_abstract_about_keep_rates():
    with pytest.raises(NotImplementedError, match="keep rate"):
        Pruner.from_keep_rate(0.5, embed_dim=8, num_patches=16)


def test_tome_refuses_a_rotation():
    """A merged row would stand for several patch positions, which one rotation cannot: ToMe names ``inp.rotary``."""
    cu = torch.tensor([0, 17, 30, 31], dtype=torch.int32)
    rotary = Rotary(torch.zeros(16, 16), torch.full((31,), -1, dtype=torch.int32))
    inp = DecisionInput(torch.zeros(31, 16), cu, 0, 16, qkv=torch.zeros(31, 48), num_heads=2, scale=0.3, rotary=rotary)
    with pytest.raises(ValueError, match="inp.rotary: ToMe does not merge"):
        make_pruner("tome", r=3, depth=4)(inp)
