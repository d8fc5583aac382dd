"""Parameter grouping (Muon for hidden matrices, AdamW for the rest) and the combined optimizer."""

import pytest
import torch
from torch import nn

import looplm
from looplm.train.config import OptimConfig
from looplm.train.optim import (
    ADAMW_DECAY,
    ADAMW_NO_DECAY,
    MUON,
    MUON_NO_DECAY,
    MultiOptimizer,
    build_optimizer,
    plan_param_groups,
)


def _groups(model, **kw):
    plan = plan_param_groups(model, **kw)
    return {g: set(plan.names(g)) for g in (MUON, MUON_NO_DECAY, ADAMW_DECAY, ADAMW_NO_DECAY)}


def test_muon_gets_exactly_the_hidden_matrices_llama():
    model = looplm.build("tiny-llama")
    g = _groups(model)
    hidden = {
        n
        for n, p in model.named_parameters()
        if p.ndim == 2
        and any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    }
    assert hidden and g[MUON] == hidden
    assert g[MUON_NO_DECAY] == set()
    assert g[ADAMW_DECAY] == {"embed.weight", "lm_head.weight"}  # embedding and head: AdamW, decayed
    norms = {n for n, _ in model.named_parameters() if "norm" in n}
    assert g[ADAMW_NO_DECAY] == norms  # norms: AdamW, no decay
    assert set().union(*g.values()) == {n for n, _ in model.named_parameters()}


def test_no_decay_marks_and_vectors_mamba2():
    model = looplm.build("tiny-mamba2")
    g = _groups(model)
    params = dict(model.named_parameters())
    for n, p in params.items():
        if getattr(p, "_no_weight_decay", False) or p.ndim < 2:
            assert n in g[ADAMW_NO_DECAY], n  # A_log, D, dt_bias, conv bias, norm weights
        if n.endswith(("in_proj.weight", "out_proj.weight")):
            assert n in g[MUON], n
    assert any(n.endswith("A_log") for n in g[ADAMW_NO_DECAY])
    assert not any("conv1d.weight" in n for n in g[MUON])  # 3-D conv kernel: AdamW


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.emb.weight._no_muon = True
        self.lin = nn.Linear(4, 4)  # weight -> Muon, bias -> AdamW no decay
        self.ln = nn.LayerNorm(4)
        self.gate = nn.Parameter(torch.zeros(4, 4))
        self.gate._no_weight_decay = True  # 2-D but marked: Muon without decay
        self.scale = nn.Parameter(torch.ones(()))


def test_toy_module_marks_and_adamw_only_mode():
    m = _Toy()
    g = _groups(m)
    assert g[MUON] == {"lin.weight"}
    assert g[MUON_NO_DECAY] == {"gate"}
    assert g[ADAMW_DECAY] == {"emb.weight"}
    assert g[ADAMW_NO_DECAY] == {"lin.bias", "ln.weight", "ln.bias", "scale"}
    g = _groups(m, use_muon=False)
    assert not g[MUON] and not g[MUON_NO_DECAY]
    assert g[ADAMW_DECAY] == {"emb.weight", "lin.weight"} and "gate" in g[ADAMW_NO_DECAY]


def test_build_optimizer_hyperparameters():
    m = _Toy()
    opt = build_optimizer(m, OptimConfig(lr=1e-3, muon_lr=2e-2, weight_decay=0.1))
    assert isinstance(opt, MultiOptimizer) and set(opt.optimizers) == {"muon", "adamw"}
    muon, adamw = opt.optimizers["muon"], opt.optimizers["adamw"]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    mg = muon.param_groups
    assert [g["weight_decay"] for g in mg] == [0.1, 0.0]
    assert all(g["momentum"] == 0.95 and g["nesterov"] and g["ns_steps"] == 5 and g["peak_lr"] == 2e-2 for g in mg)
    ag = adamw.param_groups
    assert [g["weight_decay"] for g in ag] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["peak_lr"] == 1e-3 for g in ag)
    n_opt = sum(len(g["params"]) for g in opt.param_groups)
    assert n_opt == len(list(m.parameters()))  # every parameter exactly once
    adam_only = build_optimizer(m, OptimConfig(name="adamw"))
    assert set(adam_only.optimizers) == {"adamw"}


def test_multi_optimizer_step_and_state_roundtrip():
    torch.manual_seed(0)
    m = _Toy()
    opt = build_optimizer(m, OptimConfig())
    x = torch.randint(0, 10, (3,))

    def loss_fn(mod):
        h = mod.ln(mod.lin(mod.emb(x)) @ mod.gate.T + mod.scale)
        return h.pow(2).mean() + mod.lin.weight.sum()

    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    loss_fn(m).backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    assert not torch.equal(before["lin.weight"], m.lin.weight)
    state = opt.state_dict()
    assert set(state) == {"muon", "adamw"}
    m2 = _Toy()
    m2.load_state_dict(m.state_dict())
    opt2 = build_optimizer(m2, OptimConfig())
    opt2.load_state_dict(state)
    for mod, o in ((m, opt), (m2, opt2)):
        loss_fn(mod).backward()
        o.step()
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(KeyError, match="no entry"):
        opt2.load_state_dict({"adamw": state["adamw"]})


def test_adamw_is_fused_by_default_and_matches_the_loop_implementation():
    """``fused: null`` picks AdamW's fused kernel for plain CPU tensors; it steps like the per-tensor
    loop to fp32 rounding, and asking for both fused and foreach is refused naming the fields."""
    torch.manual_seed(0)
    m = _Toy()
    m2 = _Toy()
    m2.load_state_dict(m.state_dict())
    fused = build_optimizer(m, OptimConfig(name="adamw")).optimizers["adamw"]
    loop = build_optimizer(m2, OptimConfig(name="adamw", fused=False, foreach=False)).optimizers["adamw"]
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]
    for _ in range(3):
        for mod, o in ((m, fused), (m2, loop)):
            o.zero_grad()
            sum(p.square().sum() for p in mod.parameters()).backward()
            o.step()
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
    assert not build_optimizer(m, OptimConfig(name="adamw", foreach=True)).optimizers["adamw"].defaults["fused"]
    from looplm.train.config import load_train_config

    with pytest.raises(Exception, match="fused / foreach"):
        load_train_config({"optim": {"fused": True, "foreach": True}})
