"""Timestep conditioning: Loop Gating, Branch Gating, AdaLN; prefix and rescaled inference grids.

References are computed here from the module docstring's equations: ψ is evaluated by hand and the
gates / scales are applied either to the loop update directly (Loop Gating) or through the blocks'
modulation hooks with values computed here (Branch Gating, AdaLN).
"""

import math

import pytest
import torch

import looplm
from looplm.blocks import BlockModulation, BranchModulation
from looplm.config import ConfigError
from looplm.recurrence.timestep import TimestepConditioning, psi

from test_rule_interface import assert_cached_equals_full, assert_padded_equals_alone

BASE = "tiny-llama"  # d = 64, s = 2, K = 3
D, S, K = 64, 2, 3
GATINGS = ["loop", "branch", "adaln"]


def _pair(gating, **kw):
    torch.manual_seed(0)
    base = looplm.build(BASE, **kw)
    model = looplm.build(BASE, overrides={"rule": {"name": "timestep", "options": {"gating": gating}}}, **kw)
    model.load_state_dict(base.state_dict(), strict=False)
    return base.eval(), model.eval()


def _perturb(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.rule.parameters():
            p.normal_(0, 0.3)


def _psi_by_hand(t: float, dt: float) -> torch.Tensor:
    return torch.tensor(
        [
            1.0,
            t,
            t * t,
            math.sin(math.pi * t),
            math.cos(math.pi * t),
            math.sin(2 * math.pi * t),
            math.cos(2 * math.pi * t),
            dt,
        ]
    )


def _reference(model, x, r, T):
    """Logits of ``r`` loops on the grid ``t_ℓ = ℓ / T``, ``Δt = 1 / T`` (p = c = 0)."""
    rule, fctx = model.rule, model.forward_context(x, None, None, 0)
    h = model.embed(x) * model.embed_multiplier
    for ell in range(r):
        f = _psi_by_hand(ell / T, 1 / T)
        if rule.gating == "loop":
            g = 1 + rule.q @ f
            h = h + g * (model.core(h, fctx) - h)
        elif rule.gating == "branch":
            mods = [
                BlockModulation(
                    mixer=BranchModulation(gate=1 + rule.q[k, 0] @ f), mlp=BranchModulation(gate=1 + rule.q[k, 1] @ f)
                )
                for k in range(S)
            ]
            h = model.core(h, fctx, mods=mods)
        else:
            v = [[[1 + rule.W[k, b, j] @ f for j in range(2)] for b in range(2)] for k in range(S)]  # scale, gate
            mods = [
                BlockModulation(
                    mixer=BranchModulation(scale=v[k][0][0], gate=v[k][0][1]),
                    mlp=BranchModulation(scale=v[k][1][0], gate=v[k][1][1]),
                )
                for k in range(S)
            ]
            h = model.core(h, fctx, mods=mods)
    return model.lm_head(model.norm(h))


def test_psi_features():
    f = psi(torch.tensor([0.0, 0.25, 0.5]), torch.tensor([0.25, 0.25, 0.125]))
    assert f.shape == (3, 8)
    for i, (t, dt) in enumerate([(0.0, 0.25), (0.25, 0.25), (0.5, 0.125)]):
        torch.testing.assert_close(f[i], _psi_by_hand(t, dt))
    assert not torch.allclose(f[1], psi(torch.tensor(0.25), torch.tensor(0.5)))  # the step size is a feature


@pytest.mark.parametrize("gating", GATINGS)
def test_zero_init_recovers_the_unconditioned_model_exactly(gating):
    base, model = _pair(gating)
    x = torch.randint(0, 260, (2, 9))
    with torch.no_grad():
        for r, grid in ((K, None), (2, "prefix"), (2, "rescaled"), (6, "rescaled")):
            opts = {"grid": grid} if grid else None
            torch.testing.assert_close(
                model(x, num_loops=r, loop_options=opts).logits, base(x, num_loops=r).logits, rtol=0, atol=0
            )
    expected = {"loop": 8, "branch": 16 * S, "adaln": 32 * S * D}[gating]  # 8, 16K, 32Kd
    assert model.num_params() - base.num_params() == expected == TimestepConditioning.extra_params(gating, S, D)


@pytest.mark.parametrize("gating", GATINGS)
def test_conditioned_update_follows_the_equations(gating):
    _, model = _pair(gating)
    _perturb(model)
    x = torch.randint(0, 260, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, _reference(model, x, K, K), atol=1e-5, rtol=1e-4)  # training grid
        torch.testing.assert_close(
            model(x, num_loops=2, loop_options={"grid": "prefix"}).logits,
            _reference(model, x, 2, K),
            atol=1e-5,
            rtol=1e-4,
        )
        torch.testing.assert_close(
            model(x, num_loops=2, loop_options={"grid": "rescaled"}).logits,
            _reference(model, x, 2, 2),
            atol=1e-5,
            rtol=1e-4,
        )
        torch.testing.assert_close(
            model(x, num_loops=5, loop_options={"grid": "rescaled"}).logits,
            _reference(model, x, 5, 5),
            atol=1e-5,
            rtol=1e-4,
        )
    # every conditioning parameter reaches the loss (all four AdaLN vectors of every layer)
    model.train()
    model(x, labels=x).loss.backward()
    g = next(model.rule.parameters()).grad
    assert g is not None
    if gating == "adaln":
        assert (g.abs().sum(dim=(-1, -2)) > 0).all()  # [layer, branch, scale/gate]
    elif gating == "branch":
        assert (g.abs().sum(dim=-1) > 0).all()  # [layer, branch]
    else:
        assert g.abs().sum() > 0


@pytest.mark.parametrize("gating", GATINGS)
def test_prefix_and_rescaled_grids(gating):
    _, model = _pair(gating)
    _perturb(model)
    x = torch.randint(0, 260, (2, 9))
    with torch.no_grad():
        full = model(x, output_iterations=True).iterations  # training grid T = K
        pre = model(x, num_loops=2, loop_options={"grid": "prefix"}, output_iterations=True).iterations
        for a, b in zip(pre, full[:2]):  # prefix inference = the first r steps of the training trajectory
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        resc = model(x, num_loops=2, loop_options={"grid": "rescaled"})
        assert not torch.allclose(resc.logits, model(x, num_loops=2, loop_options={"grid": "prefix"}).logits)
        # auto: prefix up to K, rescaled beyond
        torch.testing.assert_close(
            model(x, num_loops=2).logits, model(x, num_loops=2, loop_options={"grid": "prefix"}).logits, rtol=0, atol=0
        )
        torch.testing.assert_close(
            model(x, num_loops=6).logits,
            model(x, num_loops=6, loop_options={"grid": "rescaled"}).logits,
            rtol=0,
            atol=0,
        )
        # rescaled at r = the same weights trained (and conditioned) at K = r
        deep = looplm.build(BASE, n_loops=6, overrides={"rule": {"name": "timestep", "options": {"gating": gating}}})
        deep.load_state_dict(model.state_dict())
        torch.testing.assert_close(
            deep.eval()(x).logits, model(x, num_loops=6, loop_options={"grid": "rescaled"}).logits, rtol=0, atol=0
        )
        with pytest.raises(ValueError, match="prefix inference"):
            model(x, num_loops=K + 1, loop_options={"grid": "prefix"})
        with pytest.raises(ValueError, match="grid"):
            model(x, loop_options={"grid": "cosine"})


@pytest.mark.parametrize("gating", GATINGS)
def test_conditioned_decoding_and_per_sequence_depth(gating):
    _, model = _pair(gating)
    _perturb(model)
    assert_cached_equals_full(model)
    # per-sequence depths: each row on its own grid (auto: prefix for r <= K, rescaled beyond)
    assert_padded_equals_alone(model, num_loops=torch.tensor([2, 5]))
    assert_padded_equals_alone(model, num_loops=torch.tensor([6, 4]))


def test_rescaled_decoding_beyond_the_training_depth():
    _, model = _pair("adaln")
    _perturb(model)
    x = torch.randint(0, 260, (2, 9))
    opts = {"grid": "rescaled"}
    with torch.no_grad():
        full = model(x, num_loops=5, loop_options=opts).logits
        cache = model.new_cache(2, num_loops=5)
        parts = [model(x[:, :4], cache=cache, loop_options=opts).logits]
        parts += [model(x[:, t : t + 1], cache=cache, loop_options=opts).logits for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=3e-5, rtol=1e-4)


def test_timestep_options_are_validated():
    with pytest.raises(ConfigError, match="gating"):
        looplm.build(BASE, overrides={"rule": {"name": "timestep", "options": {"gating": "film"}}})
    with pytest.raises(ConfigError, match="grid"):
        looplm.build(BASE, overrides={"rule": {"name": "timestep", "options": {"grid": "sometimes"}}})


# ------------------------------------------------------------------------------------------------
# depth extrapolation (looplm.eval.depth, `looplm eval ppl --loops`)
# ------------------------------------------------------------------------------------------------


def test_parse_loops():
    from looplm.eval.depth import parse_loops

    assert parse_loops("1..2K", train_loops=3) == [1, 2, 3, 4, 5, 6]
    assert parse_loops("1..3,8,2") == [1, 2, 3, 8]
    assert parse_loops(5) == [5]
    for bad in ("0", "4..2", "x", "1..K"):
        with pytest.raises(ValueError, match="--loops"):
            parse_loops(bad)


def test_depth_sweep_cli_for_a_conditioned_checkpoint(tmp_path, capsys):
    import json

    from looplm.cli import main
    from looplm.dataclass_util import to_dict
    from looplm.info import forward_flops_per_token
    from looplm.train.checkpoint import save_checkpoint

    _, model = _pair("loop")
    _perturb(model)
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", 1, model, None, {"step": 1}, {"model": to_dict(model.config), "tokenizer": "byte"})
    text = tmp_path / "t.txt"
    text.write_text("the loop runs again and again\nanother line of text for the model\n")
    rc = main(
        [
            "eval",
            "ppl",
            str(run),
            "--data",
            str(text),
            "--seq-len",
            "16",
            "--loops",
            "1..2K",
            "--out",
            str(tmp_path / "d"),
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(w["r"], w["grid"]) for w in rows] == [
        (1, "prefix"),
        (1, "rescaled"),
        (2, "prefix"),
        (2, "rescaled"),
        (3, "prefix"),
        (3, "rescaled"),
        (4, "rescaled"),
        (5, "rescaled"),
        (6, "rescaled"),
    ]
    by = {(w["r"], w["grid"]): w for w in rows}
    assert by[(K, "prefix")]["token_ppl"] == pytest.approx(by[(K, "rescaled")]["token_ppl"])  # same grid T = K at r = K
    assert by[(2, "prefix")]["token_ppl"] != pytest.approx(by[(2, "rescaled")]["token_ppl"])
    per_loop = {
        by[(r + 1, "rescaled")]["flops_per_token"] - by[(r, "rescaled")]["flops_per_token"] for r in range(1, 6)
    }
    assert len(per_loop) == 1 and per_loop.pop() > 0  # executed FLOPs grow by one core pass per loop
    assert by[(4, "rescaled")]["flops_per_token"] == forward_flops_per_token(model, 4, 16)
    assert (tmp_path / "d" / "depth.json").exists() and (tmp_path / "d" / "depth.png").stat().st_size > 1000
    # the single-r form is unchanged, and its PPL is the sweep's (auto grid: prefix for r <= K)
    assert main(["eval", "ppl", str(run), "--data", str(text), "--seq-len", "16", "--loops", "2", "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["num_loops"] == 2 and single["token_ppl"] == pytest.approx(by[(2, "prefix")]["token_ppl"])
