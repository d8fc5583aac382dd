"""The recurrence-rule interface carries the designs the papers need next, without touching the driver.

The rules below are deliberately small test doubles written from the papers' equations (the library's
own StateLoop / injection / history / timestep rules are separate work). They check that the
interface gives each design what it needs:

* StateLoop (eqs. 1-10): H^0 = T(E), a per-token state updated from each output, a feedback read
  into the next input, a separate final readout; parameter count of the 1.4B model (Tab. 1).
* initial-state injection + history injection: h0 and past iteration states.
* timestep conditioning: (t, Δt) per iteration and hooks inside each block's branches.
* a token-axis mixer inside a rule: its own decoding cache slot per iteration.
"""

import math

import pytest
import torch
from torch import nn

import looplm
from looplm.blocks import BranchModulation
from looplm.layers.attention import Attention, KVCache
from looplm.recurrence import RULES, RecurrenceRule, register_rule


@pytest.fixture(autouse=True)
def _rules():
    before = dict(RULES)
    register_rule("test-stateloop")(StateLoopDouble)
    register_rule("test-inject-history")(InjectHistoryDouble)
    register_rule("test-adaln")(AdaLNDouble)
    yield
    RULES.clear()
    RULES.update(before)


class StateLoopDouble(RecurrenceRule):
    """StateLoop with the selective-SSM update and identity (or causal-attention) mixing."""

    def __init__(self, cfg, *, d_state: int = 0, attn_mixer: bool = False):
        super().__init__(cfg)
        d, ds = cfg.d_model, d_state or cfg.d_model
        self.norm_h = nn.RMSNorm(d, eps=cfg.norm_eps)  # RMSNorm_h (eq. 2)
        self.W_u = nn.Linear(d, ds, bias=False)  # eq. 5
        self.W_delta = nn.Linear(d, ds, bias=False)  # eq. 6
        self.b_delta = nn.Parameter(torch.full((ds,), math.log(math.expm1(0.3))))
        self.A_log = nn.Parameter(torch.log(torch.logspace(math.log10(0.01), math.log10(4), ds)))
        self.norm_s = nn.RMSNorm(ds, eps=cfg.norm_eps)  # RMSNorm_s (eq. 3)
        self.W_sz = nn.Linear(ds, d, bias=False)  # feedback (eq. 4)
        self.W_out = nn.Linear(ds, d, bias=False)  # readout (eq. 10)
        self.mixer_norm = nn.RMSNorm(ds, eps=cfg.norm_eps) if attn_mixer else None
        self.mixer = Attention(ds, cfg.attention.n_heads, cfg.attention.n_heads, ds // cfg.attention.n_heads) if attn_mixer else None

    def looplm_init(self):
        nn.init.zeros_(self.W_delta.weight)

    def begin(self, h0, ctx):
        return {"h": h0, "S": torch.zeros(*h0.shape[:-1], self.W_u.out_features, dtype=h0.dtype, device=h0.device), "first": True}

    def next_input(self, state, ctx):
        if state["first"]:
            return state["h"]  # H^0 = T(E)
        return state["h"] + self.W_sz(self.norm_s(state["S"]))  # Z^{k+1} = H^k + N^{k+1} W_sz^T

    def step(self, state, h, ctx):
        U = self.norm_h(h)
        P = self.W_u(U)
        delta = nn.functional.softplus(self.W_delta(U) + self.b_delta)
        g = torch.exp(-torch.exp(self.A_log) * delta)
        S = g * state["S"] + (1 - g) * P  # eq. 6
        if self.mixer is not None:
            slot = ctx.cache_slot(ctx.iteration, KVCache)
            S = S + self.mixer(self.mixer_norm(S), ctx.forward.rope, ctx.forward.attn_mask, ctx.forward.is_causal, slot)
        return {"h": h, "S": S, "first": False}

    def finish(self, state, ctx):
        return state["h"] + self.W_out(self.norm_s(state["S"]))  # eq. 10


class InjectHistoryDouble(RecurrenceRule):
    """Scalar injection h + α·h0 with history h_ℓ + Σ_j β_j (h_{ℓ-j} − h_ℓ) over a window w."""

    def __init__(self, cfg, *, window: int = 2):
        super().__init__(cfg)
        self.alpha = nn.Parameter(torch.zeros(()))
        self.beta = nn.Parameter(torch.zeros(window))

    def begin(self, h0, ctx):
        return {"h": h0, "h0": h0, "past": []}

    def next_input(self, state, ctx):
        h = state["h"]
        hist = sum(b * (p - h) for b, p in zip(self.beta, reversed(state["past"])))
        return h + self.alpha * state["h0"] + hist

    def step(self, state, h, ctx):
        past = state["past"] + ([state["h"]] if ctx.iteration > 0 else [])  # window excludes h_ℓ and h_0
        return {**state, "h": h, "past": past[-len(self.beta):]}


class AdaLNDouble(RecurrenceRule):
    """AdaLN timestep conditioning: per layer and branch a norm scale 1 + Wψ and a gate 1 + W'ψ."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.W = nn.Parameter(torch.zeros(cfg.n_core, 4, cfg.d_model, 8))

    @staticmethod
    def psi(t, dt):
        return torch.tensor([t, dt, math.sin(math.pi * t), math.cos(math.pi * t), t * t, math.sqrt(t), 1.0, t * dt])

    def block_modulation(self, ctx):
        T = ctx.train_loops
        v = 1 + self.W @ self.psi(ctx.iteration / T, 1 / T).to(self.W)  # [s, 4, d]
        return [BranchModulation(*v[j]) for j in range(v.shape[0])]


def _tiny(rule, **opts):
    return looplm.build("tiny-llama", overrides={"rule": {"name": rule, "options": opts}})


def test_stateloop_parameter_count_of_the_paper():
    m = looplm.build("stateloop-1.4b-vanilla", device="meta", overrides={"rule": {"name": "test-stateloop"}})
    assert round(m.num_params() / 1e6, 2) == 1437.71  # StateLoop Tab. 1
    m = looplm.build("stateloop-1.4b-vanilla", device="meta", overrides={"rule": {"name": "test-stateloop", "options": {"attn_mixer": True}}})
    assert round(m.num_params() / 1e6, 2) == 1454.49  # StateLoop + Attn, Tab. 1
    m = looplm.build("stateloop-410m-vanilla-k7", device="meta", overrides={"rule": {"name": "test-stateloop"}})
    assert round(m.num_params() / 1e6, 2) == 411.10  # Tab. 4


@pytest.mark.parametrize("attn_mixer", [False, True])
def test_stateloop_double_trains_and_decodes_with_rule_cache_slots(attn_mixer):
    model = _tiny("test-stateloop", attn_mixer=attn_mixer)
    x = torch.randint(0, 260, (2, 10))
    model(x, labels=x).loss.backward()
    assert model.rule.W_sz.weight.grad is not None and model.rule.W_out.weight.grad is not None
    model.eval()
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2)
        parts = [model(x[:, :6], cache=cache).logits] + [model(x[:, t : t + 1], cache=cache).logits for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-5, rtol=1e-4)
    assert sum(1 for k in cache.slots if k[0] == "rule") == (3 if attn_mixer else 0)


def test_injection_and_history_recover_baseloop_at_init_and_get_gradients():
    base = looplm.build("tiny-llama")
    inj = _tiny("test-inject-history", window=2)
    inj.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 260, (2, 10))
    torch.testing.assert_close(inj(x).logits, base(x).logits)  # α = β = 0 recovers BaseLoop exactly
    assert inj.num_params() - base.num_params() == 1 + 2  # adds exactly 1 + w parameters
    inj(x, labels=x).loss.backward()
    assert inj.rule.alpha.grad is not None and inj.rule.beta.grad.abs().sum() > 0


def test_timestep_modulation_reaches_every_block_branch():
    base = looplm.build("tiny-llama")
    ada = _tiny("test-adaln")
    ada.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 260, (2, 10))
    torch.testing.assert_close(ada(x).logits, base(x).logits)  # zero init = unconditioned BaseLoop
    assert ada.rule.W.numel() == 32 * ada.config.n_core * ada.config.d_model  # 32Kd (K = layers in the paper)
    ada(x, labels=x).loss.backward()
    assert (ada.rule.W.grad.abs().sum(dim=(0, 2, 3)) > 0).all()  # all four vectors (2 branches x scale/gate) used
