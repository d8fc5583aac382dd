"""StateLoop's comparison models (Tab. 1): Hyperloop, MeSH, PonderLM, Parcae and Pause Token.

For every design: the paper's parameter count (meta device), a tiny variant that trains (every rule
parameter gets a gradient), cached decoding == the full forward, a left-padded batch == each row
alone (also at per-row depth), and the property its paper states.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.pause import PauseLM, insert_pauses

from functools import partial

import helpers
from helpers import tiny_variant

# the comparison rules' decoding checks keep the 5e-5 tolerance they were written with
assert_cached_equals_full = partial(helpers.assert_cached_equals_full, atol=5e-5)
assert_padded_equals_alone = partial(helpers.assert_padded_equals_alone, atol=5e-5)

RULE_PRESETS = {
    "hyperloop": dict(n_prelude=1, n_core=2, n_coda=1, n_loops=3),
    "mesh": dict(n_prelude=1, n_core=1, n_coda=1, n_loops=4),
    "parcae": dict(n_prelude=1, n_core=1, n_coda=1, n_loops=4),
    "ponderlm": dict(n_core=2, n_loops=3),
}
PAPER_M = {  # StateLoop Tab. 1, rounded to 0.01M
    "stateloop-1.4b-hyperloop": 1421.32,
    "stateloop-1.4b-mesh": 1421.51,
    "stateloop-1.4b-ponderlm": 1420.92,
    "stateloop-1.4b-parcae": 1429.32,
    "stateloop-1.4b-pause": 1420.92,
}


def tiny(name, **extra):
    torch.manual_seed(0)
    return looplm.LoopedLM(tiny_variant(f"stateloop-1.4b-{name}", **{**RULE_PRESETS.get(name, {}), **extra}))


def core_inputs(model, x, **kw):
    """Every core input ``Z^k`` of one forward (a pre-hook on the shared core) and the output."""
    seen = []
    hook = model.core.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        out = model(x, output_iterations=True, **kw)
    finally:
        hook.remove()
    return seen, out


# ------------------------------------------------------------------------------------------------
# shared checks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PAPER_M))
def test_paper_sizes(name):
    assert round(looplm.build(name, device="meta").num_params() / 1e6, 2) == PAPER_M[name]


@pytest.mark.parametrize("name", sorted(RULE_PRESETS))
def test_tiny_variant_trains_decodes_and_pads(name):
    model = tiny(name)
    x = torch.randint(0, model.config.vocab_size, (2, 10))
    out = model(x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for pname, p in model.rule.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: rule parameter {pname} gets no gradient"
    with torch.no_grad():  # away from the (partly zero / identity) initialisation
        for p in model.rule.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert_cached_equals_full(model)
    assert_padded_equals_alone(model)
    assert_padded_equals_alone(model, num_loops=torch.tensor([1, model.config.n_loops + 1]))  # also past K
    # greedy generation of a padded batch == each prompt alone
    with torch.no_grad():
        gen = model.generate(x[:, :4], max_new_tokens=3)
        assert torch.equal(gen[1], model.generate(x[1:, :4], max_new_tokens=3)[0])


# ------------------------------------------------------------------------------------------------
# Parcae: the state transition's spectral norm is below 1 by construction
# ------------------------------------------------------------------------------------------------


def test_parcae_spectral_norm_stays_below_one_after_optimizer_steps():
    from looplm.recurrence.parcae import sample_sequence_depths

    model = tiny("parcae")
    rule = model.rule
    assert rule.spectral_norm() == pytest.approx(5**-0.5, rel=1e-5)  # Parcae's init: Ā = sqrt(1/5)
    # push hard in the direction that grows Ā: an objective rewarding a large transition, huge steps
    opt = torch.optim.AdamW(rule.parameters(), lr=5.0)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    before = (rule.A_log.detach().clone(), rule.dt_bias.detach().clone())
    for _ in range(6):
        opt.zero_grad()
        a_bar, _ = rule.transition()
        (model(x, labels=x).loss - 100 * a_bar.sum()).backward()
        opt.step()
        assert rule.spectral_norm() <= 1.0
        assert torch.linalg.matrix_norm(torch.diag(rule.transition()[0]), ord=2) <= 1.0
    assert not torch.equal(rule.A_log, before[0]) and not torch.equal(rule.dt_bias, before[1])
    with torch.no_grad():  # any parameter values at all
        rule.A_log.uniform_(-30, 30)
        rule.dt_bias.uniform_(-30, 30)
    a_bar, delta = rule.transition()
    assert float(a_bar.max()) <= 1.0 and float(a_bar.min()) >= 0.0 and bool((delta >= 0).all())
    # per-sequence depths, Parcae style, through the driver's [B] num_loops
    depths = sample_sequence_depths(2, 3.0, generator=torch.Generator().manual_seed(1))
    assert depths.shape == (2,) and int(depths.min()) >= 1
    assert_padded_equals_alone(model, num_loops=depths)


def test_parcae_injection_is_the_discretised_system():
    model = tiny("parcae").eval()
    rule = model.rule
    with torch.no_grad():
        rule.A_log.normal_(0, 0.5)
        rule.dt_bias.normal_(0, 0.5)
        rule.B.add_(0.1 * torch.randn_like(rule.B))
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        Z, out = core_inputs(model, x)
        fctx = model.forward_context(x, None, None, 0)
        e = rule.prelude_norm(model.prelude(model.embed(x) * model.embed_multiplier, fctx))
        a_bar, delta = rule.transition()
        inject = delta * (e @ rule.B.T)  # B̄ e
        torch.testing.assert_close(Z[0], inject)  # h_0 = 0
        for k in range(1, len(Z)):
            torch.testing.assert_close(Z[k], a_bar * out.iterations[k - 1] + inject)
        y = model.lm_head(model.norm(model.coda(rule.C(out.iterations[-1]), fctx)))
        torch.testing.assert_close(out.logits, y)  # the coda reads C h_r


# ------------------------------------------------------------------------------------------------
# PonderLM: the feedback is the expected embedding under the model's own distribution
# ------------------------------------------------------------------------------------------------


def test_ponderlm_feedback_is_the_expected_embedding():
    model = tiny("ponderlm").eval()
    assert model.config.n_prelude == model.config.n_coda == 0  # the whole backbone is looped
    x = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        Z, out = core_inputs(model, x)
        E = model.embed(x) * model.embed_multiplier
        torch.testing.assert_close(Z[0], E)
        W = model.embed.weight * model.embed_multiplier
        for k in range(1, len(Z)):
            p = model.lm_head(model.norm(out.iterations[k - 1])).softmax(-1)  # the model's own distribution
            torch.testing.assert_close(Z[k] - Z[k - 1], p @ W, atol=1e-5, rtol=1e-4)
        # the prediction is the last pass read out through the same head
        torch.testing.assert_close(out.logits, model.lm_head(model.norm(out.iterations[-1])))
    # with the feedback's weights changed, the output changes (the feedback is used)
    cfg = model.config.replace(**{"rule.options": {"temperature": 0.25}})
    other = looplm.LoopedLM(cfg)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(other.eval()(x).logits, out.logits)


# ------------------------------------------------------------------------------------------------
# Hyperloop: n streams with loop-level hyper-connections; zero connections = the vanilla loop
# ------------------------------------------------------------------------------------------------


def test_hyperloop_reduces_to_the_vanilla_loop_and_counts_its_parameters():
    model = tiny("hyperloop")
    cfg = model.config
    d, K, n = cfg.d_model, cfg.n_loops, cfg.rule.options["n_streams"]
    assert sum(p.numel() for p in model.rule.parameters()) == K * (3 * n * n * d + d)
    vanilla = looplm.LoopedLM(cfg.replace(**{"rule": {"name": "vanilla"}}))
    vanilla.load_state_dict(model.state_dict(), strict=False)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert not torch.allclose(model(x).logits, vanilla(x).logits)  # random connections: 4 distinct streams
        for W in [*model.rule.W_pre, *model.rule.W_post, *model.rule.W_res]:
            W.weight.zero_()
        torch.testing.assert_close(model(x).logits, vanilla(x).logits)  # uniform read, unit write/retain
        model.rule.loop_embed.normal_()
        assert not torch.allclose(model(x).logits, vanilla(x).logits)  # the loop embedding enters Z^k


# ------------------------------------------------------------------------------------------------
# MeSH: reads and writes through the slot buffer
# ------------------------------------------------------------------------------------------------


def test_mesh_buffer_is_a_highway_of_every_write():
    # one slot: every router weight is 1, so Z^k = h0 + Σ_{j<k} H^j and the coda reads the whole sum
    model = tiny("mesh", rule={"name": "mesh", "options": {"n_slots": 1}}).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        Z, out = core_inputs(model, x)
        fctx = model.forward_context(x, None, None, 0)
        acc = model.prelude(model.embed(x) * model.embed_multiplier, fctx)
        for k, z in enumerate(Z):
            torch.testing.assert_close(z, acc)
            acc = acc + out.iterations[k]
        torch.testing.assert_close(out.logits, model.lm_head(model.norm(model.coda(acc, fctx))))
    # several slots: the routers choose, and iteration-specific routers make the reads differ
    model = tiny("mesh").eval()
    S = model.rule.n_slots
    assert sum(p.numel() for p in model.rule.parameters()) == 2 * (model.config.n_loops + 1) * S * model.config.d_model
    with torch.no_grad():
        Z, out = core_inputs(model, x)
        M0 = model.rule.begin(model.prelude(model.embed(x) * model.embed_multiplier, fctx), None)["M"]
        assert M0.shape == (2, 7, S, model.config.d_model)
        h0 = model.prelude(model.embed(x) * model.embed_multiplier, fctx)
        torch.testing.assert_close(M0.sum(-2), h0)  # the write weights are a distribution over slots


# ------------------------------------------------------------------------------------------------
# Pause Token: pauses in the sequence, loss on real tokens, generate never returns a pause
# ------------------------------------------------------------------------------------------------


def tiny_pause(**extra):
    torch.manual_seed(0)
    return PauseLM(tiny_variant("stateloop-1.4b-pause", n_core=2, n_loops=2, max_seq_len=96, **extra))


def test_insert_pauses_layout_labels_and_mask():
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    x, labels, m = insert_pauses(ids, 2, 99, labels=ids, attention_mask=mask)
    assert x.tolist() == [[5, 99, 99, 6, 99, 99, 7, 99, 99], [0, 99, 99, 8, 99, 99, 9, 99, 99]]
    assert labels[0].tolist() == [5, -100, -100, 6, -100, -100, 7, -100, -100]
    assert m[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]  # left padding stays left padding
    # with the model's one-position shift, exactly the last pause before each next token is trained
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)[0]
    trained = (targets != -100).nonzero().flatten().tolist()
    assert trained == [2, 5] and targets[trained].tolist() == [6, 7]


def test_pause_loss_is_on_real_tokens_only():
    model = tiny_pause()
    n, P, V = model.n_pause, model.pause_id, model.config.vocab_size
    assert (n, P) == (3, V - 1)
    x = torch.randint(0, V - 1, (2, 7))
    out = model(x, labels=x)
    assert out.logits.shape == (2, 7, V)
    # by hand: the backbone on the paused sequence, logits at the last pause of each token
    ids, _, _ = insert_pauses(x, n, P)
    full = looplm.LoopedLM.forward(model, ids).logits  # [B, 4T, V]
    pred = full[:, 3::4].clone()
    pred[..., P] = float("-inf")
    torch.testing.assert_close(out.logits, pred)
    ref = F.cross_entropy(pred[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(out.lm_loss, ref)  # what validation and perplexity read
    # what the model outputs at pause-internal positions and at real-token positions is not trained:
    # the loss's gradient w.r.t. the head's input is zero there
    hidden = {}
    h = model.norm.register_forward_hook(lambda mod, a, o: hidden.setdefault("h", o) if o.requires_grad else None)
    try:
        out = model(x, labels=x)
        hidden["h"].retain_grad()
        out.loss.backward()
    finally:
        h.remove()
    g = hidden["h"].grad.abs().sum(-1)  # [B, 4T]
    trained = torch.zeros_like(g, dtype=torch.bool)
    trained[:, 3:-4:4] = True  # the last pause of tokens 0 … T-2
    assert bool((g[~trained] == 0).all()) and bool((g[trained] > 0).all())
    assert model.embed.weight.grad[P].abs().sum() > 0  # the pause embedding is learned


def test_pause_generate_feeds_pauses_and_never_returns_one():
    model = tiny_pause().eval()
    P, V = model.pause_id, model.config.vocab_size

    def favour_pause(mod, args, out):  # the head prefers the pause everywhere
        out = out.clone()
        out[..., P] += 100.0
        return out

    model.lm_head.register_forward_hook(favour_pause)
    with torch.no_grad():
        x = torch.randint(0, V - 1, (2, 5))
        ids, _, _ = insert_pauses(x, model.n_pause, P)
        assert int(looplm.LoopedLM.forward(model, ids).logits[:, -1].argmax(-1).eq(P).sum()) > 0  # unmasked: it would
        greedy = model.generate(x, max_new_tokens=6)
        sampled = model.generate(
            x, max_new_tokens=6, do_sample=True, temperature=3.0, generator=torch.Generator().manual_seed(0)
        )
        assert not bool((greedy == P).any()) and not bool((sampled == P).any())
        # cached decoding (pauses fed through the cache) == recomputing the full paused sequence
        assert torch.equal(greedy, model.generate(x, max_new_tokens=6, use_cache=False))
        cache = model.new_cache(2)
        model(x, cache=cache)
        assert cache.seqlen == x.shape[1] * (1 + model.n_pause)
        # a left-padded batch == each prompt alone
        mask = torch.ones_like(x)
        mask[1, :2] = 0
        padded = model.generate(x, max_new_tokens=4, attention_mask=mask)
        assert torch.equal(padded[1, 2:], model.generate(x[1:, 2:], max_new_tokens=4)[0])
    with pytest.raises(ValueError, match="pause id"):
        model(torch.full((1, 3), P))
    with pytest.raises(ValueError, match="real tokens fit"):
        model(torch.zeros(1, model.max_real_tokens + 1, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# `looplm train` runs a few steps of every tiny variant through the CLI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*sorted(RULE_PRESETS), "pause"])
def test_looplm_train_cli_runs_each_tiny_variant(name, tmp_path, capsys, monkeypatch):
    import json
    from pathlib import Path

    import yaml

    from looplm.dataclass_util import to_dict
    from looplm.train.cli import main

    extra = dict(RULE_PRESETS.get(name, {"n_core": 1, "n_loops": 2}), vocab_size=261, max_seq_len=64)  # byte ids < 259
    cfg = tiny_variant(f"stateloop-1.4b-{name}", **extra)
    assert isinstance(looplm.build(cfg), PauseLM) == (name == "pause")  # `pause:` in a config builds a PauseLM
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    out = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml"
    sets = [
        "data.seq_len=16",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "eval.every=0",
        "eval.batches=1",
        "checkpoint.every=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "train.precision=fp32",
        f"model={tmp_path / 'model.yaml'}",
    ]
    argv = ["train", str(config), "--out", str(out), "--max-steps", "2", "--quiet", "--no-resume"]
    rc = main(argv + [a for s in sets for a in ("--set", s)])
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs if "loss" in r)
    assert recs[-1]["tokens"] == 2 * 2 * 16  # budgets count real tokens (the pause model reads 4x as many positions)


def test_info_counts_the_pause_positions_in_flops():
    from looplm.info import model_info

    pause, vanilla = model_info("stateloop-1.4b-pause"), model_info("stateloop-1.4b-vanilla")
    assert pause["positions_per_token"] == 4 and pause["params"] == vanilla["params"]
    # 4 positions per real token, each attending over a 4x longer context: more than 4x the FLOPs
    assert 4.0 < pause["forward_flops_per_token"] / vanilla["forward_flops_per_token"] < 6.0
