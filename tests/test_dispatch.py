"""looplm.dispatch: the reference model's hot points and per-module decode steps, with a provider of its own
(as a user's would be), never editing the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import looplm
from looplm import dispatch
from looplm.blocks import Block
from looplm.recurrence import RULES, RecurrenceRule, register_rule

pytestmark = pytest.mark.kernels  # live registrations (unmarked tests run under dispatch.reference_only)


def test_ops_run_their_reference_until_a_provider_registers():
    from looplm.layers.linear import linear_group

    lins = (nn.Linear(4, 3), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    assert [t.shape for t in linear_group(x, lins)] == [(2, 3), (2, 2)]
    seen = []

    def mine(x, linears):
        seen.append(len(linears))
        return dispatch.OPS["linear_group"].reference(x, linears)

    prev = dispatch.OPS["linear_group"]._registered
    try:
        dispatch.register("linear_group", mine, "test")
        out = linear_group(x, lins)
        assert seen == [2] and linear_group.provider == "test"
        assert all(torch.equal(a, b) for a, b in zip(out, (lin(x) for lin in lins)))
        with dispatch.reference_only():
            linear_group(x, lins)
            assert linear_group.provider == "reference" and seen == [2]
        assert linear_group.provider == "test"
    finally:
        if prev is None:
            dispatch.unregister("linear_group")
        else:
            dispatch.register("linear_group", *prev)


def test_a_registration_before_the_op_exists_waits_for_it():
    calls = []
    dispatch.register("test_late_op", lambda x: calls.append(x) or x + 1, "test")
    try:
        assert ("op test_late_op (its module not imported yet)", "test") in dispatch.describe()
        op = dispatch.Op("test_late_op", lambda x: x)
        with dispatch.reference_only():
            assert op(1) == 1
        assert op(1) == 2 and calls == [1] and op.provider == "test"
        with pytest.raises(ValueError, match="defined twice"):
            dispatch.Op("test_late_op", lambda x: x)
    finally:
        dispatch.OPS.pop("test_late_op", None)
        dispatch._pending.pop("test_late_op", None)


@register_rule("test-doubling")
class Doubling(RecurrenceRule):
    """``Z^{k+1} = 2·H^k`` (a toy rule: the point is its decode step, registered from outside)."""

    def next_input(self, state, lctx):
        return state["h"] if lctx.iteration == 0 else 2 * state["h"]


def test_a_new_rule_gets_a_decode_step_by_registering_one():
    """A provider registers a one-token step for a rule type; generate runs it (falling back to the rule's
    own method whenever it returns None), the tokens are the reference's, and the class is restored."""
    torch.manual_seed(0)
    model = looplm.build("tiny-llama", rule={"name": "test-doubling"}).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with dispatch.reference_only():
        ref = model.generate(ids, max_new_tokens=4)
    calls = {"fast": 0, "fallback": 0}

    def next_input(rule, prepared, state, lctx):
        if state["h"].shape[1] != 1:  # the prompt: let the reference run
            calls["fallback"] += 1
            return None
        calls["fast"] += 1
        return state["h"] if lctx.iteration == 0 else state["h"].mul(prepared)

    step = dispatch.DecodeStep("test doubling", Doubling, lambda rule, batch: 2.0, {"next_input": next_input}, "test")
    dispatch.register_decode_step(step)
    try:
        with dispatch.decode_steps(model, only=lambda s: s is step) as counts:
            assert counts == {"test doubling": 1} and type(model.rule) is step.fused_class()
            assert isinstance(model.rule, Doubling) and dispatch.plain_class(model.rule) is Doubling
            assert model.rule.state_dict().keys() == Doubling(model.config).state_dict().keys()
        assert type(model.rule) is Doubling and "_looplm_decode" not in model.rule.__dict__
        out = model.generate(ids, max_new_tokens=4)
        assert torch.equal(out, ref)
        assert calls["fast"] == 3 * model.config.n_loops and calls["fallback"] == model.config.n_loops
        # prepare() saying no: nothing switched
        dispatch.register_decode_step(
            dispatch.DecodeStep("test doubling", Doubling, lambda rule, batch: None, {"next_input": next_input})
        )
        with dispatch.decode_steps(model) as counts:
            assert "test doubling" not in counts and type(model.rule) is Doubling
        with dispatch.reference_only(), dispatch.decode_steps(model) as counts:
            assert counts == {}
    finally:
        dispatch.DECODE_STEPS.pop(Doubling, None)


def test_the_kernels_register_their_steps_and_ops():
    from looplm.kernels import loader

    rows = dict(dispatch.describe())
    if not loader.extension_available():
        pytest.skip(f"looplm's CPU extension does not run here: {loader.unavailable_reason()}")
    assert rows["op loss_chunk"] == "looplm.kernels.training" and rows["op linear_group"] == "looplm.kernels.gemm"
    assert any(k.startswith("decode step fused block") for k in rows) and any("decode_stack" in k for k in rows)
    model = looplm.build("tiny-llama", dtype=torch.bfloat16).eval()
    with dispatch.decode_steps(model, batch_size=1) as counts:
        assert counts["fused block"] == model.config.n_physical and type(model.core.stack.blocks[0]) is not Block
    assert type(model.core.stack.blocks[0]) is Block


def test_rule_is_registered_for_the_test():
    assert RULES["test-doubling"] is Doubling
