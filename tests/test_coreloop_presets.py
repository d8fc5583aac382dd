"""CoreLoop placements and the injection / history / conditioning presets of the
recurrence-effectiveness paper: exact sizes (meta device), depths, and optimizer groups."""

import json

import pytest

import looplm
from looplm.cli import main as cli_main
from looplm.config import list_presets, load_model_config
from looplm.train.optim import ADAMW_DECAY, ADAMW_NO_DECAY, MUON, MUON_NO_DECAY, plan_param_groups

from helpers import tiny_variant

BACKBONES = {  # BaseLoop -> (d, layers in the loop K = s)
    "qwen3-0.6b-baseloop-4x7": (1024, 4),
    "llama3.1-1b-baseloop-4x5": (1536, 4),
}
# the paper's extra parameters of each named variant (d = model width, K = layers in the loop)
DELTAS = {
    "inject-scalar": lambda d, K: 1,
    "inject-channel": lambda d, K: 2 * d,
    "inject-residual-channel": lambda d, K: 2 * d,
    "inject-dense": lambda d, K: 2 * d * d,
    "history-w1": lambda d, K: 1,
    "history-w2": lambda d, K: 2,
    "history-w3": lambda d, K: 3,
    "inject-scalar-history-w2": lambda d, K: 1 + 2,
    "loop-gating": lambda d, K: 8,
    "branch-gating": lambda d, K: 16 * K,
    "adaln": lambda d, K: 32 * K * d,
}
VARIANTS = [f"{b}-{v}" for b in BACKBONES for v in DELTAS]
# CoreLoop placements: (p, s, K, c) and the BaseLoop with the same physical and effective depth
CORELOOPS = {
    "qwen3-0.6b-coreloop-p1-2x13-c1": ((1, 2, 13, 1), "qwen3-0.6b-baseloop-4x7", 218.51),
    "qwen3-0.6b-coreloop-p2-2x13": ((2, 2, 13, 0), "qwen3-0.6b-baseloop-4x7", 218.51),
    "qwen3-0.6b-coreloop-2x13-c2": ((0, 2, 13, 2), "qwen3-0.6b-baseloop-4x7", 218.51),
    "qwen3-0.6b-coreloop-p2-3x8-c2": ((2, 3, 8, 2), "qwen3-0.6b-baseloop-7x4", 265.70),
    "llama3.1-1b-coreloop-p1-2x9-c1": ((1, 2, 9, 1), "llama3.1-1b-baseloop-4x5", 516.70),
    "llama3.1-1b-coreloop-p2-2x9": ((2, 2, 9, 0), "llama3.1-1b-baseloop-4x5", 516.70),
    "llama3.1-1b-coreloop-2x9-c2": ((0, 2, 9, 2), "llama3.1-1b-baseloop-4x5", 516.70),
    "llama3.1-1b-coreloop-p1-3x6-c1": ((1, 3, 6, 1), "llama3.1-1b-baseloop-5x4", 547.37),
}


def count(name):
    return looplm.build(name, device="meta").num_params()


def test_every_named_variant_and_coreloop_is_shipped():
    names = set(list_presets())
    assert set(VARIANTS) <= names and set(CORELOOPS) <= names
    shipped = {n for n in names if "-coreloop-" in n}
    assert shipped == set(CORELOOPS), "a CoreLoop preset without a size test"


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_adds_exactly_the_papers_parameters(name):
    base = next(b for b in BACKBONES if name.startswith(b + "-"))
    d, K = BACKBONES[base]
    extra = DELTAS[name[len(base) + 1 :]](d, K)
    assert count(name) - count(base) == extra
    cfg, ref = load_model_config(name), load_model_config(base)
    assert (cfg.n_prelude, cfg.n_core, cfg.n_loops, cfg.n_coda) == (ref.n_prelude, ref.n_core, ref.n_loops, ref.n_coda)


@pytest.mark.parametrize("name", sorted(CORELOOPS))
def test_coreloop_placements_hold_physical_and_effective_depth(name):
    pskc, baseloop, paper_m = CORELOOPS[name]
    cfg, ref = load_model_config(name), load_model_config(baseloop)
    assert (cfg.n_prelude, cfg.n_core, cfg.n_loops, cfg.n_coda) == pskc
    assert cfg.n_physical == ref.n_physical and cfg.effective_depth() == ref.effective_depth()
    assert cfg.effective_depth() == (28 if name.startswith("qwen") else 20)  # the paper's L_eff
    assert count(name) == count(baseloop)  # same physical blocks, so exactly the BaseLoop's size
    assert round(count(name) / 1e6, 2) == paper_m
    p, s, K, c = pskc
    assert cfg.effective_depth(K + 3) == p + s * (K + 3) + c  # inference depth p + s·r + c


def test_looplm_info_json_of_a_variant_and_a_coreloop(capsys):
    assert cli_main(["info", "qwen3-0.6b-baseloop-4x7-adaln", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rule"] == "timestep" and info["rule_params"] == 32 * 4 * 1024
    assert info["params"] - count("qwen3-0.6b-baseloop-4x7") == 32 * 4 * 1024
    assert cli_main(["info", "llama3.1-1b-coreloop-p1-3x6-c1", "--json", "--loops", "10"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["p_s_K_c"] == [1, 3, 6, 1] and info["physical_depth"] == 5 and info["effective_depth"] == 1 + 3 * 10 + 1


RULE_VARIANTS = VARIANTS + ["qwen3-0.6b-coreloop-p1-2x13-c1", "llama3.1-1b-coreloop-p1-3x6-c1"]
MATRIX_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("name", RULE_VARIANTS)
def test_optimizer_groups_of_every_parameter(name):
    """Paper, optimizer section: Muon for the matrix-valued attention and feed-forward projections;
    embeddings, head, norms and every conditioning / injection / history parameter to AdamW."""
    model = looplm.LoopedLM(tiny_variant(name, n_loops=3))
    plan = plan_param_groups(model)
    assert set(plan.group_of) == {n for n, _ in model.named_parameters()}
    for pname, group in plan.group_of.items():
        leaf = pname.split(".")[-2]
        if leaf in MATRIX_NAMES:
            assert group in (MUON, MUON_NO_DECAY), pname
        else:
            assert group in (ADAMW_DECAY, ADAMW_NO_DECAY), pname
    rule_params = [n for n in plan.group_of if n.startswith("rule.")]
    assert bool(rule_params) == (name in VARIANTS)
    assert not plan_param_groups(model, use_muon=False).names(MUON)


def test_presets_listing_shows_p_s_K_c(capsys):
    assert cli_main(["presets"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    for name, (pskc, _, _) in CORELOOPS.items():
        assert str(pskc) in lines[name]
    assert "(0, 4, 7, 0)" in lines["qwen3-0.6b-baseloop-4x7-adaln"]
