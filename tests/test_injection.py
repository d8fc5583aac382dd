"""Initial-state injection (4 forms) and history-state injection (window w, alone and combined).

Every claim of the paper's text is checked against a hand-unrolled loop written here from the
equations (``looplm.recurrence.injection`` / ``.history`` docstrings), not against the rule itself.
"""

import pytest
import torch

import looplm
from looplm.config import ConfigError
from looplm.recurrence.injection import FORMS, InjectionAdapter

from test_rule_interface import assert_cached_equals_full, assert_padded_equals_alone

BASE = "tiny-qwen3"  # d = 64, s = 2, K = 3, QK-norm, tied embeddings
D = 64


def _pair(rule: dict, **kw):
    """(plain BaseLoop, the same model with ``rule``), identical backbone weights."""
    torch.manual_seed(0)
    base = looplm.build(BASE, **kw)
    model = looplm.build(BASE, overrides={"rule": rule}, **kw)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("rule.") for k in missing)
    return base.eval(), model.eval()


def _perturb(model, scale=0.3):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.rule.parameters():
            p.add_(scale * torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 1))


def _unroll(model, x, r, transition):
    """Logits of ``r`` loops with ``Z^ℓ = transition(ℓ, h_ℓ, h_0, [h_1..h_{ℓ-1}])`` (BaseLoop: p = c = 0)."""
    fctx = model.forward_context(x, None, None, 0)
    h0 = model.embed(x) * model.embed_multiplier
    h, states = h0, []
    for ell in range(r):
        z = transition(ell, h, h0, states[:-1] if ell else [])  # completed states other than h_0 and h_ℓ
        h = model.core(z, fctx)
        states.append(h)
    return model.lm_head(model.norm(h))


def _reference_A(form, ad: InjectionAdapter, h, h0):
    if form == "scalar":
        return h + ad.alpha * h0
    if form == "channel":
        return ad.a * h + ad.b * h0
    if form == "residual_channel":
        return (1 + ad.delta_a) * h + ad.b * h0
    return torch.cat([h, h0], -1) @ ad.proj.weight.T  # [W_h W_0] [h; h_0]


# ------------------------------------------------------------------------------------------------
# initial-state injection
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_injection_is_identity_at_init_and_adds_exactly_the_papers_parameters(form):
    base, model = _pair({"name": "injection", "options": {"form": form}})
    x = torch.randint(0, 260, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, rtol=0, atol=0)  # identity on the state
        torch.testing.assert_close(model(x, num_loops=5).logits, base(x, num_loops=5).logits, rtol=0, atol=0)
    expected = {"scalar": 1, "channel": 2 * D, "residual_channel": 2 * D, "dense": 2 * D * D}[form]
    assert model.num_params() - base.num_params() == expected == InjectionAdapter.extra_params(form, D)
    # the model's own N(0, 0.02) initialisation does not disturb the identity (looplm_init runs after it)
    torch.manual_seed(3)
    fresh = looplm.build(BASE, overrides={"rule": {"name": "injection", "options": {"form": form}}})
    A = fresh.rule.inject
    h, h0 = torch.randn(2, 3, D), torch.randn(2, 3, D)
    torch.testing.assert_close(A(h, A.precompute(h0)), h)


@pytest.mark.parametrize("form", FORMS)
def test_injection_follows_its_equation_at_every_iteration(form):
    _, model = _pair({"name": "injection", "options": {"form": form}})
    _perturb(model)
    x = torch.randint(0, 260, (2, 9))
    A = model.rule.inject
    with torch.no_grad():
        ref = _unroll(model, x, 4, lambda ell, h, h0, past: _reference_A(form, A, h, h0))
        torch.testing.assert_close(model(x, num_loops=4).logits, ref, atol=1e-5, rtol=1e-4)
    # the injection parameters get gradients through every iteration
    model.train()
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.rule.parameters())


@pytest.mark.parametrize("form", ["scalar", "dense"])
def test_injection_cached_decoding_and_padding(form):
    _, model = _pair({"name": "injection", "options": {"form": form}})
    _perturb(model)
    assert_cached_equals_full(model)
    assert_padded_equals_alone(model)
    assert_padded_equals_alone(model, num_loops=torch.tensor([2, 4]))


def test_injection_options_are_validated():
    with pytest.raises(ConfigError, match="form"):
        looplm.build(BASE, overrides={"rule": {"name": "injection", "options": {"form": "gated"}}})
    with pytest.raises(ConfigError, match="unknown option"):
        looplm.build(BASE, overrides={"rule": {"name": "injection", "options": {"alpha": 0.0}}})


# ------------------------------------------------------------------------------------------------
# history-state injection
# ------------------------------------------------------------------------------------------------


def _history_transition(beta, inject=None):
    def transition(ell, h, h0, past):
        z = h if inject is None else inject(h, h0)
        window = list(reversed(past))[: len(beta)]  # lag j = 1 is h_{ℓ-1}
        for j, hj in enumerate(window):
            z = z + beta[j] * (hj - h)  # differences against h_ℓ, never the injected input
        return z

    return transition


@pytest.mark.parametrize("w", [1, 2, 3])
def test_history_is_baseloop_at_init_and_adds_exactly_w_parameters(w):
    base, model = _pair({"name": "history", "options": {"window": w}}, n_loops=6)
    x = torch.randint(0, 260, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, rtol=0, atol=0)
    assert model.num_params() - base.num_params() == w


@pytest.mark.parametrize("w", [1, 2, 3])
def test_history_window_follows_the_equation(w):
    base, model = _pair({"name": "history", "options": {"window": w}})
    with torch.no_grad():
        model.rule.beta.copy_(torch.tensor([0.5, -0.3, 0.2][:w]))
    x = torch.randint(0, 260, (2, 8))
    with torch.no_grad():
        # m_0 = m_1 = 0: the first two transitions are plain BaseLoop even with β != 0
        torch.testing.assert_close(model(x, num_loops=2).logits, base(x, num_loops=2).logits, rtol=0, atol=0)
        assert not torch.allclose(model(x, num_loops=3).logits, base(x, num_loops=3).logits)
        for r in (3, 6):  # h_0 excluded, only the w newest completed states kept
            ref = _unroll(model, x, r, _history_transition(model.rule.beta))
            torch.testing.assert_close(model(x, num_loops=r).logits, ref, atol=1e-5, rtol=1e-4)
    # the window is really w: a reference with one more lag differs once more than w states exist
    wider = _history_transition(torch.cat([model.rule.beta.detach(), torch.tensor([0.4])]))
    with torch.no_grad():
        assert not torch.allclose(model(x, num_loops=w + 3).logits, _unroll(model, x, w + 3, wider), atol=1e-4)


def test_history_buffer_is_not_detached():
    """Gradients of a core weight equal those of the hand-unrolled loop with an attached buffer (and
    differ from a loop whose buffered states are detached)."""
    _, model = _pair({"name": "history", "options": {"window": 2}}, n_loops=5)
    model = model.double()
    with torch.no_grad():
        model.rule.beta.copy_(torch.tensor([0.6, -0.4]))
    x = torch.randint(0, 260, (2, 8))
    W = model.core.stack.blocks[0].mlp.down_proj.weight

    def grad_of(logits):
        (g,) = torch.autograd.grad(logits.pow(2).mean(), W)
        return g

    g_model = grad_of(model(x).logits)
    g_ref = grad_of(_unroll(model, x, 5, _history_transition(model.rule.beta)))
    detached = _history_transition(model.rule.beta)
    g_det = grad_of(_unroll(model, x, 5, lambda ell, h, h0, past: detached(ell, h, h0, [p.detach() for p in past])))
    torch.testing.assert_close(g_model, g_ref)
    assert not torch.allclose(g_model, g_det)


def test_injection_and_history_combine_additively():
    base, model = _pair({"name": "history", "options": {"window": 2, "inject": "scalar"}}, n_loops=5)
    x = torch.randint(0, 260, (2, 8))
    assert model.num_params() - base.num_params() == 1 + 2  # α and β_1, β_2
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, rtol=0, atol=0)  # α = β = 0
        model.rule.beta.copy_(torch.tensor([0.5, -0.3]))
        model.rule.inject.alpha.fill_(0.7)
        alpha = model.rule.inject.alpha
        ref = _unroll(model, x, 5, _history_transition(model.rule.beta, inject=lambda h, h0: h + alpha * h0))
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-4)

        # differences against the injected input instead would be a different model
        def against_injected(ell, h, h0, past):
            u = h + alpha * h0
            return u + sum(b * (p - u) for b, p in zip(model.rule.beta, reversed(past)))

        assert not torch.allclose(model(x).logits, _unroll(model, x, 5, against_injected), atol=1e-4)
    model.train()
    model(x, labels=x).loss.backward()
    assert model.rule.beta.grad.abs().min() > 0 and model.rule.inject.alpha.grad.abs() > 0
    assert_cached_equals_full(model)
    assert_padded_equals_alone(model, num_loops=torch.tensor([5, 3]))


def test_history_options_are_validated():
    for bad, msg in (({"window": 0}, "window"), ({"window": 2, "inject": "gated"}, "inject")):
        with pytest.raises(ConfigError, match=msg):
            looplm.build(BASE, overrides={"rule": {"name": "history", "options": bad}})


def test_injection_scales_are_weight_decayed_but_other_vectors_are_not():
    """The paper: regularising a favours a state scale of zero, regularising δ_a favours one — the
    injection scales are decayed; norm weights and other vectors are not."""
    import looplm
    from looplm.train.optim import ADAMW_DECAY, ADAMW_NO_DECAY, plan_param_groups

    for form, names in [("channel", ("a", "b")), ("residual_channel", ("delta_a", "b")), ("scalar", ("alpha",))]:
        model = looplm.build("tiny-llama", overrides={"rule": {"name": "injection", "options": {"form": form}}})
        plan = plan_param_groups(model, use_muon=True)
        rule_groups = {n.rsplit(".", 1)[-1]: g for n, g in plan.group_of.items() if n.startswith("rule.")}
        assert all(rule_groups[n] == ADAMW_DECAY for n in names), rule_groups
        assert plan.group_of["norm.weight"] == ADAMW_NO_DECAY
