"""The recurrence-rule seam carries every design the papers need, without touching the driver.

The rules below are deliberately small test doubles written from the papers' equations (the library's
own rules live in ``looplm.recurrence``). Each exercises one capability of the seam and, where it
matters, checks cached decoding == full forward and a left-padded batch == each row alone:

* StateLoop (eqs. 1-10): a per-token state, feedback, a separate final readout; token mixers over the
  state owned by the rule (identity, causal attention at the state width with its own RoPE dim,
  Mamba-2) with their own per-iteration decoding slots; the paper's parameter counts (Tab. 1, 4).
* initial-state injection + history injection: ``h0`` and past iterates.
* timestep conditioning: ``(t, Δt)`` per iteration, scales / shifts / gates inside each block branch,
  per token (a modulation computed from the state).
* a rule reading the token embeddings ``E`` and the core input ``Z^k`` (Parcae-style injection).
* an auxiliary loss from readouts of intermediate iterates (PonderLM / exit-gate style).
* per-sequence loop counts; halting; a rule owning a block's residual streams (hyper-connections).
* the cache-slot protocol.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import looplm
from looplm.blocks import BlockModulation, BranchModulation
from looplm.cache import LoopCache, TensorSlot
from looplm.layers.attention import Attention, KVCache
from looplm.layers.mamba2 import Mamba2Mixer
from looplm.recurrence import RULES, RecurrenceRule, register_rule

from helpers import assert_cached_equals_full, assert_padded_equals_alone

# ------------------------------------------------------------------------------------------------
# test doubles
# ------------------------------------------------------------------------------------------------


class StateLoopDouble(RecurrenceRule):
    """StateLoop with the selective-SSM update and an identity / causal-attention / Mamba-2 mixer X."""

    def __init__(self, cfg, *, d_state: int = 0, mixer: str = "identity"):
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
        self.mixer_kind = mixer
        if mixer == "attention":
            H = cfg.attention.n_heads
            self.rope_dims = (ds // H,)  # the mixer's own head dim needs its own rotary tables
            self.mixer = Attention(ds, H, H, ds // H, rotary_dim=ds // H)
        elif mixer == "mamba2":
            self.mixer = Mamba2Mixer(ds, expand=2, d_state=8, headdim=16, ngroups=2, chunk_size=8)
        if mixer != "identity":
            self.mixer_norm = nn.RMSNorm(ds, eps=cfg.norm_eps)

    def looplm_init(self):
        nn.init.zeros_(self.W_delta.weight)

    def begin(self, h0, lctx):
        return {"h": h0, "S": h0.new_zeros(*h0.shape[:-1], self.W_u.out_features), "first": True}

    def next_input(self, state, lctx):
        if state["first"]:
            return state["h"]  # H^0 = T(E)
        return state["h"] + self.W_sz(self.norm_s(state["S"]))  # Z^{k+1} = H^k + N^{k+1} W_sz^T

    def step(self, state, h, lctx):
        U = self.norm_h(h)
        P = self.W_u(U)
        delta = F.softplus(self.W_delta(U) + self.b_delta)
        g = torch.exp(-torch.exp(self.A_log) * delta)
        S = g * state["S"] + (1 - g) * P  # eq. 6
        if self.mixer_kind != "identity":  # the one mixer interface: (u, fctx, cache), own slot per iteration
            slot = lctx.cache_slot(("mix", lctx.iteration), lambda: self.mixer.new_cache(h.shape[0]))
            S = S + self.mixer(self.mixer_norm(S), lctx.fctx, slot)
        return {"h": h, "S": S, "first": False}

    def finish(self, state, lctx):
        return state["h"] + self.W_out(self.norm_s(state["S"]))  # eq. 10


class InjectHistoryDouble(RecurrenceRule):
    """Scalar injection h + α·h0 with history h_ℓ + Σ_j β_j (h_{ℓ-j} − h_ℓ) over a window w."""

    def __init__(self, cfg, *, window: int = 2):
        super().__init__(cfg)
        self.alpha = nn.Parameter(torch.zeros(()))
        self.beta = nn.Parameter(torch.zeros(window))

    def begin(self, h0, lctx):
        return {"h": h0, "h0": h0, "past": []}

    def next_input(self, state, lctx):
        h = state["h"]
        hist = sum(b * (p - h) for b, p in zip(self.beta, reversed(state["past"])))
        return h + self.alpha * state["h0"] + hist

    def step(self, state, h, lctx):
        past = state["past"] + ([state["h"]] if lctx.iteration > 0 else [])  # window excludes h_ℓ and h_0
        return {**state, "h": h, "past": past[-len(self.beta) :]}


def psi(t: float, dt: float) -> torch.Tensor:
    return torch.tensor([t, dt, math.sin(math.pi * t), math.cos(math.pi * t), t * t, math.sqrt(t), 1.0, t * dt])


class AdaLNDouble(RecurrenceRule):
    """AdaLN timestep conditioning: per layer and branch a norm scale 1 + Wψ and a gate 1 + W'ψ,
    plus (option) a per-token shift computed from the current state."""

    def __init__(self, cfg, *, token_shift: bool = False):
        super().__init__(cfg)
        self.W = nn.Parameter(torch.zeros(cfg.n_core, 4, cfg.d_model, 8))
        self.shift = nn.Linear(cfg.d_model, cfg.d_model, bias=False) if token_shift else None

    def looplm_init(self):
        if self.shift is not None:
            nn.init.zeros_(self.shift.weight)

    def block_modulation(self, state, lctx):
        T = lctx.train_loops
        v = 1 + self.W @ psi(lctx.iteration / T, 1 / T).to(self.W)  # [s, 4, d]
        shift = self.shift(state["h"]) if self.shift is not None else None  # [B, T, d]: per token
        return [
            BlockModulation(
                mixer=BranchModulation(scale=v[j, 0], gate=v[j, 1], shift=shift),
                mlp=BranchModulation(scale=v[j, 2], gate=v[j, 3]),
            )
            for j in range(v.shape[0])
        ]


class EmbedInjectDouble(RecurrenceRule):
    """Reads the token embeddings E and the core input Z^k: Z^{k+1} = H^k + a·E + b·Z^k (Parcae-like)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.a = nn.Parameter(torch.full((cfg.d_model,), 0.5))
        self.b = nn.Parameter(torch.full((cfg.d_model,), 0.25))
        self.seen = {"Z": []}

    def step(self, state, h, lctx):
        self.seen["E"] = lctx.embeddings
        self.seen["Z"].append(lctx.core_input)
        return {"h": h + self.a * lctx.embeddings + self.b * lctx.core_input}


class ReadoutLossDouble(RecurrenceRule):
    """Auxiliary loss: mean next-token loss of every intermediate iterate, read out through coda + head."""

    lm_loss_weight = 0.5

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mix = nn.Parameter(torch.tensor(0.1))

    def begin(self, h0, lctx):
        return {"h": h0, "losses": [], "logits": []}

    def step(self, state, h, lctx):
        logits = lctx.readout(h)  # [B, T, V]
        # PonderLM-style feedback: expected embedding under the iterate's own distribution
        fb = logits.softmax(-1) @ lctx.embed_weight * lctx.embed_multiplier  # [B, T, d]
        new = {"h": h + self.mix * fb, "losses": list(state["losses"]), "logits": state["logits"] + [logits]}
        if lctx.targets is not None and not lctx.is_last:
            new["losses"].append(
                F.cross_entropy(logits.flatten(0, 1).float(), lctx.targets.flatten(), ignore_index=-100)
            )
        return new

    def aux_loss(self, state, lctx):
        return torch.stack(state["losses"]).mean() if state["losses"] else None


class HaltDouble(RecurrenceRule):
    """Every token halts once the iteration reaches ``halt_at``."""

    def __init__(self, cfg, *, halt_at: int = 1):
        super().__init__(cfg)
        self.halt_at = halt_at

    def halted(self, state, lctx):
        return torch.full(state["h"].shape[:2], lctx.iteration + 1 >= self.halt_at, device=state["h"].device)


class StreamsDouble(RecurrenceRule):
    """Hyper-connections: n residual streams [B, T, n, d] carried across iterations; every branch reads
    its input as a weighted sum of the streams and writes its output back with per-stream weights."""

    def __init__(self, cfg, *, n: int = 2, identity: bool = False):
        super().__init__(cfg)
        self.n = n
        self.read_w = nn.Parameter(torch.zeros(cfg.n_loops, cfg.n_core, 2, n))  # loop-specific
        self.write_w = nn.Parameter(torch.zeros(cfg.n_loops, cfg.n_core, 2, n))
        self.identity = identity

    def looplm_init(self):
        with torch.no_grad():
            self.read_w.zero_()
            self.write_w.zero_()
            self.read_w[..., 0] = 1.0
            self.write_w[..., 0] = 1.0
            if not self.identity:
                self.read_w.add_(0.3 * torch.randn_like(self.read_w))
                self.write_w.add_(0.3 * torch.randn_like(self.write_w))

    def begin(self, h0, lctx):
        return {"streams": h0.unsqueeze(2).expand(*h0.shape[:2], self.n, h0.shape[-1]).contiguous()}

    def next_input(self, state, lctx):
        return state["streams"]  # the core's residual carrier: [B, T, n, d]

    def block_modulation(self, state, lctx):
        k = min(lctx.iteration, self.read_w.shape[0] - 1)

        def branch(j, b):
            r, w = self.read_w[k, j, b], self.write_w[k, j, b]
            return BranchModulation(
                read=lambda s: torch.einsum("btnd,n->btd", s, r),
                write=lambda s, y: s + w[:, None] * y.unsqueeze(2),
            )

        return [BlockModulation(mixer=branch(j, 0), mlp=branch(j, 1)) for j in range(self.read_w.shape[1])]

    def step(self, state, h, lctx):
        return {"streams": h}

    def finish(self, state, lctx):
        return state["streams"][:, :, 0]


class BareTensorSlotDouble(RecurrenceRule):
    """Breaks the cache-slot protocol on purpose: a plain tensor as a slot."""

    def step(self, state, h, lctx):
        lctx.cache_slot("bad", lambda: torch.zeros(1))
        return {"h": h}


DOUBLES = {
    "test-stateloop": StateLoopDouble,
    "test-inject-history": InjectHistoryDouble,
    "test-adaln": AdaLNDouble,
    "test-embed-inject": EmbedInjectDouble,
    "test-readout-loss": ReadoutLossDouble,
    "test-halt": HaltDouble,
    "test-streams": StreamsDouble,
    "test-bare-slot": BareTensorSlotDouble,
}


@pytest.fixture(autouse=True)
def _rules():
    before = dict(RULES)
    for name, cls in DOUBLES.items():
        register_rule(name)(cls)
    yield
    RULES.clear()
    RULES.update(before)


def _tiny(rule, base="tiny-llama", **opts):
    torch.manual_seed(0)
    return looplm.build(base, overrides={"rule": {"name": rule, "options": opts}})


# ------------------------------------------------------------------------------------------------
# StateLoop, injection, timestep conditioning (the designs the seam was first built for)
# ------------------------------------------------------------------------------------------------


def test_stateloop_parameter_count_of_the_paper():
    m = looplm.build("stateloop-1.4b-vanilla", device="meta", overrides={"rule": {"name": "test-stateloop"}})
    assert round(m.num_params() / 1e6, 2) == 1437.71  # StateLoop Tab. 1
    m = looplm.build(
        "stateloop-1.4b-vanilla",
        device="meta",
        overrides={"rule": {"name": "test-stateloop", "options": {"mixer": "attention"}}},
    )
    assert round(m.num_params() / 1e6, 2) == 1454.49  # StateLoop + Attn, Tab. 1
    assert "64" in m.rotary  # the mixer's declared head dim gets rotary tables (here the backbone's too)
    m = looplm.build("stateloop-410m-vanilla-k7", device="meta", overrides={"rule": {"name": "test-stateloop"}})
    assert round(m.num_params() / 1e6, 2) == 411.10  # Tab. 4


@pytest.mark.parametrize("mixer", ["identity", "attention", "mamba2"])
def test_stateloop_double_trains_and_decodes_with_rule_cache_slots(mixer):
    model = _tiny("test-stateloop", mixer=mixer, d_state=32)
    if mixer == "attention":
        assert sorted(model.rotary) == ["16", "8"]  # backbone head dim 16, the state mixer's head dim 8
    x = torch.randint(0, 260, (2, 10))
    model(x, labels=x).loss.backward()
    assert model.rule.W_sz.weight.grad is not None and model.rule.W_out.weight.grad is not None
    cache = assert_cached_equals_full(model)
    n_rule_slots = sum(1 for k in cache.slots if k[0] == "rule")
    assert n_rule_slots == (0 if mixer == "identity" else model.config.n_loops)
    assert_padded_equals_alone(model)


def test_injection_and_history_recover_baseloop_at_init_and_get_gradients():
    base = looplm.build("tiny-llama")
    inj = _tiny("test-inject-history", window=2)
    inj.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 260, (2, 10))
    torch.testing.assert_close(inj(x).logits, base(x).logits)  # α = β = 0 recovers BaseLoop exactly
    assert inj.num_params() - base.num_params() == 1 + 2  # adds exactly 1 + w parameters
    inj(x, labels=x).loss.backward()
    assert inj.rule.alpha.grad is not None and inj.rule.beta.grad.abs().sum() > 0
    with torch.no_grad():
        inj.rule.alpha.fill_(0.3)
        inj.rule.beta.copy_(torch.tensor([0.2, -0.1]))
    assert_cached_equals_full(inj)


@pytest.mark.parametrize("token_shift", [False, True])
def test_timestep_modulation_scales_shifts_and_gates_every_branch(token_shift):
    base = looplm.build("tiny-llama")
    ada = _tiny("test-adaln", token_shift=token_shift)
    ada.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 260, (2, 10))
    torch.testing.assert_close(ada(x).logits, base(x).logits)  # zero init = unconditioned BaseLoop
    assert ada.rule.W.numel() == 32 * ada.config.n_core * ada.config.d_model  # 32Kd (K = layers in the paper)
    ada(x, labels=x).loss.backward()
    assert (ada.rule.W.grad.abs().sum(dim=(0, 2, 3)) > 0).all()  # all four vectors (2 branches x scale/gate) used
    if token_shift:
        assert ada.rule.shift.weight.grad.abs().sum() > 0  # the per-token shift reaches the loss
    with torch.no_grad():
        ada.rule.W.normal_(0, 0.1)
        if token_shift:
            ada.rule.shift.weight.normal_(0, 0.1)
        assert not torch.allclose(ada(x).logits, base(x).logits)
    assert_cached_equals_full(ada)
    assert_padded_equals_alone(ada)


# ------------------------------------------------------------------------------------------------
# the widened seam
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["tiny-llama", "tiny-coreloop"])
def test_rule_reads_embeddings_and_core_input(base):
    model = _tiny("test-embed-inject", base=base)
    x = torch.randint(0, 260, (2, 7))
    model.eval()
    with torch.no_grad():
        out = model(x, output_iterations=True)
        E = model.embed(x) * model.embed_multiplier
        torch.testing.assert_close(model.rule.seen["E"], E)  # E is taken before the prelude
        Z = model.rule.seen["Z"]  # Z^k as the driver set it before each step
        assert len(Z) == model.config.n_loops
        torch.testing.assert_close(Z[0], model.prelude(E, model.forward_context(x, None, None, 0)))
        for k in range(1, len(Z)):  # Z^k = H^{k-1} + a·E + b·Z^{k-1}
            torch.testing.assert_close(Z[k], out.iterations[k - 1] + model.rule.a * E + model.rule.b * Z[k - 1])
    assert_cached_equals_full(model)
    assert_padded_equals_alone(model)


def test_auxiliary_loss_from_intermediate_readouts():
    model = _tiny("test-readout-loss", base="tiny-coreloop")
    x = torch.randint(0, 260, (2, 9))
    out = model(x, labels=x, output_iterations=True)
    # recompute the intermediate losses by hand through coda -> norm -> head
    model_fctx = model.forward_context(x, None, None, 0)
    targets = F.pad(x[:, 1:], (0, 1), value=-100)
    ref = []
    for h in out.iterations[:-1]:
        logits = model.lm_head(model.norm(model.coda(h, model_fctx)))
        ref.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100))
    torch.testing.assert_close(out.aux_loss, torch.stack(ref).mean())
    lm = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, 0.5 * lm + out.aux_loss)  # lm_loss_weight · CE + aux
    out.loss.backward()
    assert model.rule.mix.grad is not None and model.rule.mix.grad != 0
    assert model(x).aux_loss is None  # no labels, no loss
    cache = assert_cached_equals_full(model)
    assert ("readout", 0, model.config.n_prelude + model.config.n_core) in cache.slots  # coda slots per readout


def test_per_sequence_loop_counts_equal_each_row_alone_at_its_depth():
    for name, opts in [("vanilla", {}), ("test-stateloop", {"mixer": "attention", "d_state": 32})]:
        model = _tiny(name, base="tiny-coreloop", **opts)
        assert_padded_equals_alone(model, num_loops=torch.tensor([2, 5]))
        assert_padded_equals_alone(model, num_loops=torch.tensor([4, 1]))
    model = _tiny("vanilla").eval()
    x = torch.randint(0, 260, (3, 6))
    loops = torch.tensor([1, 3, 2])
    with torch.no_grad():
        out = model(x, num_loops=loops, output_iterations=True)
        for i in range(3):
            torch.testing.assert_close(
                out.logits[i], model(x[i : i + 1], num_loops=int(loops[i])).logits[0], atol=2e-5, rtol=1e-4
            )
            assert torch.equal(out.iterations[-1][i], out.iterations[int(loops[i]) - 1][i])  # done rows pass through
        # cached decoding at per-row depths == full forward at per-row depths
        full = model(x, num_loops=loops).logits
        cache = model.new_cache(3, num_loops=3)
        parts = [model(x[:, :4], cache=cache, num_loops=loops).logits]
        parts += [model(x[:, t : t + 1], cache=cache, num_loops=loops).logits for t in range(4, 6)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-5, rtol=1e-4)
    # generate with per-row depth == each row alone
    gen = model.generate(x, max_new_tokens=4, num_loops=loops)
    for i in range(3):
        assert torch.equal(gen[i], model.generate(x[i : i + 1], max_new_tokens=4, num_loops=int(loops[i]))[0])


def test_halting_stops_the_loop_only_without_a_cache():
    model = _tiny("test-halt", halt_at=2).eval()
    x = torch.randint(0, 260, (2, 6))
    with torch.no_grad():
        out = model(x)
        assert out.executed_loops == 2
        torch.testing.assert_close(out.logits, model(x, num_loops=2).logits)  # what ran is the 2-loop model
        cache = model.new_cache(2)
        assert model(x, cache=cache).executed_loops == 3  # decoding keeps every iteration's slots complete
    assert _tiny("vanilla")(x).executed_loops == 3


def test_rule_owning_residual_streams():
    base = looplm.build("tiny-llama")
    ident = _tiny("test-streams", identity=True)
    ident.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 260, (2, 8))
    torch.testing.assert_close(ident(x).logits, base(x).logits)  # read/write through stream 0 only = plain blocks
    model = _tiny("test-streams", n=3)
    assert not torch.allclose(model(x).logits, base(x).logits)
    model(x, labels=x).loss.backward()
    assert model.rule.read_w.grad.abs().sum() > 0 and model.rule.write_w.grad.abs().sum() > 0
    assert_cached_equals_full(model)
    assert_padded_equals_alone(model)


def test_cache_slot_protocol():
    model = _tiny("test-bare-slot").eval()
    x = torch.randint(0, 260, (2, 4))
    with torch.no_grad():
        model(x)  # no cache: no slot asked
        with pytest.raises(TypeError, match="cache-slot protocol.*TensorSlot"):
            model(x, cache=model.new_cache(2))
    # reorder / select rows and crop reach every slot kind
    cache = LoopCache(1, 3)
    kv = cache.slot("kv", KVCache)
    kv.update(torch.arange(3.0)[:, None, None, None].expand(3, 1, 4, 2), torch.zeros(3, 1, 4, 2))
    ts = cache.slot("t", TensorSlot)
    ts.append(torch.arange(3.0)[:, None, None].expand(3, 4, 5))
    mamba = Mamba2Mixer(32, d_state=8, headdim=16, ngroups=1)
    ms = cache.slot("m", lambda: mamba.new_cache(3))
    with torch.no_grad():
        mamba(torch.randn(3, 4, 32), None, ms)
    cache.seqlen = 4
    before = ms.ssm_state.clone()
    cache.index_select(torch.tensor([2, 0]))
    assert (
        cache.batch_size == 2 and kv.k[:, 0, 0, 0].tolist() == [2.0, 0.0] and ts.value[:, 0, 0].tolist() == [2.0, 0.0]
    )
    torch.testing.assert_close(ms.ssm_state, before[[2, 0]])
    with pytest.raises(ValueError, match="Mamba-2 state"):
        cache.crop(2)
    del cache.slots["m"]
    cache.crop(2)
    assert kv.seqlen == 2 and ts.seqlen == 2 and cache.seqlen == 2


def test_loop_count_errors_are_clear():
    model = _tiny("vanilla")
    x = torch.randint(0, 260, (2, 4))
    with pytest.raises(TypeError, match="num_loops must be a positive int"):
        model(x, num_loops=2.5)
    with pytest.raises(ValueError, match=r"shape \[batch\] = \[2\]"):
        model(x, num_loops=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=">= 1"):
        model(x, num_loops=torch.tensor([0, 2]))
    assert model(x, num_loops=torch.tensor(2)).logits.shape == (2, 4, 260)
