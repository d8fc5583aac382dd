"""Exit gate (Looped-Mamba App. B): gate math, both stages' objectives, threshold selection, decoding."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.config import ConfigError
from looplm.recurrence import LoopContext
from looplm.recurrence.exit_gate import ExitGate


def _gate_model(base="tiny-mamba2", **opts):
    torch.manual_seed(0)
    return looplm.build(base, overrides={"rule": {"name": "exit_gate", "options": opts}, "n_loops": 4})


# ------------------------------------------------------------------------------------------------
# hand-built cases: the rule driven directly, gate logit = channel 0 of h, readout = channels 1..2
# ------------------------------------------------------------------------------------------------


def _hand_rule(stage=1, **kw):
    rule = ExitGate(SimpleNamespace(d_model=4), stage=stage, **kw)  # the rule reads only d_model
    with torch.no_grad():
        rule.gate.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        rule.gate.bias.zero_()
    return rule


def _run(rule, hs, targets=None, q=None):
    """Drive begin/step/finish over iterates ``hs`` (list of [1, T, 4]); readout = channels 1..2 as logits."""
    lctx = LoopContext(
        num_loops=len(hs),
        train_loops=len(hs),
        targets=targets,
        loop_options={} if q is None else {"exit_threshold": q},
        readout_fn=lambda h, ctx: h[..., 1:3],
    )
    state = rule.begin(torch.zeros_like(hs[0]), lctx)
    for k, h in enumerate(hs):
        lctx.iteration = k
        state = rule.step(state, h, lctx)
    return rule.finish(state, lctx), rule.aux_loss(state, lctx), state


def _h(gate_logit, l1, l2):
    return torch.tensor([[[gate_logit, l1, l2, 0.0]]])


def test_gate_math_and_threshold_selection_by_hand():
    # λ = σ(0) = 0.5 at steps 1, 2; step 3 takes the remainder: π = (0.5, 0.25, 0.25), CDF = (0.5, 0.75, 1)
    hs = [_h(0.0, 0, 0), _h(0.0, 1, 1), _h(5.0, 2, 2)]  # step 3's own gate value must be ignored
    rule = _hand_rule()
    for q, z in [(0.0, 1), (0.2, 1), (0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (1.0, 3)]:
        y, aux, state = _run(rule, hs, q=q)
        assert int(rule.last_exit["selected_depth"]) == z, q
        assert torch.equal(y, hs[z - 1])  # output selection: h^(z) reaches the head
        assert aux is None  # no targets, no loss
    assert float(state["S"].detach()) == 0.0  # all mass assigned
    torch.testing.assert_close(rule.last_exit["expected_step"], torch.tensor([[1 * 0.5 + 2 * 0.25 + 3 * 0.25]]))
    H = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    torch.testing.assert_close(rule.last_exit["entropy"], torch.tensor([[H]]))
    s = rule.exit_summary()
    assert s["executed_depth"] == 3.0 and s["iter"] == 3.0  # the last forward ran q = 1.0


def test_stage1_objective_by_hand():
    beta = 0.25
    hs = [_h(math.log(0.2 / 0.8), 0.0, 2.0), _h(math.log(0.5 / 0.5), 1.0, 0.0), _h(0.0, 3.0, 0.0)]  # λ1 = 0.2, λ2 = 0.5
    target = torch.tensor([[0]])
    rule = _hand_rule(stage=1, beta=beta)
    _, aux, _ = _run(rule, hs, targets=target)
    pi = [0.2, 0.8 * 0.5, 0.8 * 0.5]
    ell = [-torch.log_softmax(h[0, 0, 1:3], 0)[0].item() for h in hs]  # CE of each readout, target 0
    H = -sum(p * math.log(p) for p in pi)
    expect = sum(p * e for p, e in zip(pi, ell)) - beta * H
    assert aux.item() == pytest.approx(expect, rel=1e-5)
    assert rule.lm_loss_weight == 0.0
    # ignored targets do not count in M
    _, aux2, _ = _run(rule, [torch.cat([h, h], 1) for h in hs], targets=torch.tensor([[0, -100]]))
    assert aux2.item() == pytest.approx(expect, rel=1e-5)


def test_stage2_improvement_targets_and_bce_by_hand():
    kappa, gamma = 50.0, 0.005

    # losses ℓ = CE([a, 0], target 0): choose logits so that ℓ1 > ℓ2 by 1.0 and ℓ2 ≈ ℓ3 (improvement < γ)
    def logit_for(loss):  # CE([x, 0], 0) = log(1 + e^{-x}) = loss
        return -math.log(math.expm1(loss))

    losses = [2.0, 1.0, 0.999]
    g = [0.3, -0.7, 9.0]
    hs = [_h(gi, logit_for(li), 0.0) for gi, li in zip(g, losses)]
    rule = _hand_rule(stage=2, kappa=kappa, gamma=gamma)
    _, aux, _ = _run(rule, hs, targets=torch.tensor([[0]]))
    terms = []
    for r in range(2):  # non-final steps only
        improve = max(0.0, losses[r] - losses[r + 1])
        w = 1 / (1 + math.exp(-kappa * (improve - gamma)))
        cont = 1 / (1 + math.exp(g[r]))  # 1 − λ
        terms.append(-(w * math.log(cont) + (1 - w) * math.log(1 - cont)))
    assert aux.item() == pytest.approx(sum(terms) / 2, rel=1e-4)
    # the targets are detached: the loss reaches the gate only
    hs = [h.clone().requires_grad_(True) for h in hs]
    _, aux, _ = _run(rule, hs, targets=torch.tensor([[0]]))
    aux.backward()
    assert rule.gate.weight.grad is not None
    assert all(h.grad is None or torch.all(h.grad[..., 1:] == 0) for h in hs)


# ------------------------------------------------------------------------------------------------
# the rule in real models
# ------------------------------------------------------------------------------------------------


def test_gate_parameters_and_init():
    base = looplm.build("tiny-mamba2", n_loops=4)
    m = _gate_model()
    assert m.num_params() - base.num_params() == m.config.d_model + 1  # one linear gate d -> 1
    assert torch.all(m.rule.gate.bias == -2.0)  # App. E.5
    assert getattr(m.rule.gate.weight, "_no_muon", False)
    with pytest.raises(ConfigError, match="stage"):
        looplm.build("tiny-mamba2", overrides={"rule": {"name": "exit_gate", "options": {"stage": 3}}})
    with pytest.raises(ConfigError, match="threshold"):
        looplm.build("tiny-mamba2", overrides={"rule": {"name": "exit_gate", "options": {"threshold": 1.5}}})
    with pytest.raises(ValueError, match="exit_threshold"):
        m(torch.zeros(1, 3, dtype=torch.long), loop_options={"exit_threshold": -0.1})


@pytest.mark.parametrize("base", ["tiny-hybrid"])  # Mamba-2 and attention blocks
def test_selection_matches_a_reference_from_the_iterates(base):
    m = _gate_model(base).eval()
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)  # spread the exit distribution
        m.rule.gate.bias.fill_(0.0)
    x = torch.randint(0, m.config.vocab_size, (2, 8))
    fctx = m.forward_context(x, None, None, 0)
    with torch.no_grad():
        its = m(x, output_iterations=True).iterations  # H^1..H^R (all run)
        lam = torch.stack([torch.sigmoid(m.rule.gate(h).squeeze(-1)) for h in its])  # [R, B, T]
        lam[-1] = 1.0
        S = torch.cumprod(1 - lam, 0)
        pi = lam * torch.cat([torch.ones_like(S[:1]), S[:-1]])
        torch.testing.assert_close(pi.sum(0), torch.ones_like(pi[0]))
        torch.testing.assert_close(torch.cumsum(pi, 0), 1 - S)
        # CDF(r) = Σ_{j<=r} π^(j) = 1 − S^(r)
        iters = []
        for q in (0.2, 0.4, 0.6, 0.8, 1.0):
            out = m(x, loop_options={"exit_threshold": q})
            # CDF(r) >= q ⟺ S^(r) <= 1 − q, the survival in float64: exact at q = 1 (S = 0 only at R), where
            # float32's 1 − S saturates (this very draw reaches 1.0 at step 3 for two tokens)
            S64 = torch.cumprod(1 - lam.double(), 0)
            z = torch.where(S64 <= 1 - q, torch.arange(1, 5)[:, None, None], 99).min(0).values  # [B, T]
            assert torch.equal(m.rule.last_exit["selected_depth"], z)
            ref_h = torch.stack(its)[z - 1, torch.arange(2)[:, None], torch.arange(8)]  # [B, T, d]
            ref = m.lm_head(m.norm(m.coda(ref_h, fctx)))
            torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-4)
            s = m.rule.exit_summary()
            assert s["executed_depth"] == 4.0 and out.executed_loops == 4  # all R steps ran, whatever q
            iters.append(s["iter"])
        assert iters == sorted(iters) and iters[0] < iters[-1] <= 4.0  # smaller q selects earlier steps
        torch.testing.assert_close(
            torch.tensor(m.rule.exit_summary()["expected_step"]),
            (torch.arange(1, 5)[:, None, None] * pi).sum(0).mean(),
            atol=1e-5,
            rtol=1e-5,
        )


def _assert_cached_equals_full(model, q, T=11, split=5):
    x = torch.randint(0, model.config.vocab_size, (2, T))
    opts = {"exit_threshold": q}
    with torch.no_grad():
        full = model(x, loop_options=opts).logits
        full_depth = model.rule.last_exit["selected_depth"]
        cache = model.new_cache(2)
        parts, depths = [], []
        for a, b in [(0, split), (split, split + 2)] + [(t, t + 1) for t in range(split + 2, T)]:
            parts.append(model(x[:, a:b], cache=cache, loop_options=opts).logits)
            depths.append(model.rule.last_exit["selected_depth"])
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=3e-5, rtol=1e-4)
    assert torch.equal(torch.cat(depths, 1), full_depth)


@pytest.mark.parametrize("base", ["tiny-hybrid", "tiny-llama"])
def test_cached_decoding_and_padding_equal_the_full_forward(base):
    m = _gate_model(base).eval()
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)
        m.rule.gate.bias.fill_(0.0)
    for q in (0.5, 1.0):
        _assert_cached_equals_full(m, q)
    V = m.config.vocab_size
    a, b = torch.randint(0, V, (1, 9)), torch.randint(0, V, (1, 5))
    ids, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 4:], mask[1, 4:] = b[0], 1
    opts = {"exit_threshold": 0.5}
    with torch.no_grad():
        batch = m(ids, attention_mask=mask, loop_options=opts).logits
        d_batch = m.rule.last_exit["selected_depth"]
        real = m.rule.last_exit["real"]
        alone_a = m(a, loop_options=opts).logits
        d_a = m.rule.last_exit["selected_depth"]
        alone_b = m(b, loop_options=opts).logits
        d_b = m.rule.last_exit["selected_depth"]
    torch.testing.assert_close(batch[0], alone_a[0], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(batch[1, 4:], alone_b[0], atol=3e-5, rtol=1e-4)
    assert torch.equal(d_batch[0], d_a[0]) and torch.equal(d_batch[1, 4:], d_b[0])
    assert real[1, :4].sum() == 0  # padding is left out of the Iter mean
    # per-row depth: a row at r loops puts its remainder on step r, like the row alone at r loops
    with torch.no_grad():
        out = m(ids, attention_mask=mask, num_loops=torch.tensor([2, 4]), loop_options=opts).logits
        torch.testing.assert_close(out[0], m(a, num_loops=2, loop_options=opts).logits[0], atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(out[1, 4:], m(b, num_loops=4, loop_options=opts).logits[0], atol=3e-5, rtol=1e-4)


def test_fixed_depth_equals_selection_at_that_depth():
    """num_loops=r (the fixed-loop ablation) == threshold 1.0 with r loops == the r-th iterate through the head."""
    m = _gate_model().eval()
    x = torch.randint(0, m.config.vocab_size, (2, 8))
    with torch.no_grad():
        its = m(x, output_iterations=True).iterations
        for r in range(1, 5):
            out = m(x, num_loops=r)
            torch.testing.assert_close(out.logits, m.lm_head(m.norm(its[r - 1])), atol=1e-5, rtol=1e-4)
            assert m.rule.exit_summary()["iter"] == r == m.rule.exit_summary()["executed_depth"]


@pytest.mark.parametrize("stage", [1, 2])
def test_training_losses_reach_the_right_parameters(stage):
    m = _gate_model(stage=stage)
    x = torch.randint(0, m.config.vocab_size, (2, 10))
    out = m(x, labels=x)
    torch.testing.assert_close(out.loss, out.aux_loss)  # lm_loss_weight 0: the objective is the stage's own
    out.loss.backward()
    assert m.rule.gate.weight.grad.abs().sum() > 0 and m.rule.gate.bias.grad.abs().sum() > 0
    backbone_grad = m.core.stack.blocks[0].mixer.in_proj.weight.grad
    if stage == 1:
        assert backbone_grad is not None and backbone_grad.abs().sum() > 0  # Σ π ℓ trains the backbone too
        assert m.lm_head.weight.grad.abs().sum() > 0
    else:
        assert backbone_grad is None or backbone_grad.abs().sum() == 0  # the targets are detached
        assert m.lm_head.weight.grad is None or m.lm_head.weight.grad.abs().sum() == 0


def test_stage1_loss_equals_a_reference_from_readouts():
    m = _gate_model(base="tiny-coreloop", stage=1, beta=0.25)
    x = torch.randint(0, m.config.vocab_size, (2, 9))
    out = m(x, labels=x, output_iterations=True)
    fctx = m.forward_context(x, None, None, 0)
    tgt = F.pad(x[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        ells, lams = [], []
        for h in out.iterations:
            logits = m.lm_head(m.norm(m.coda(h, fctx)))
            ells.append(
                F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="none").view(2, 9)
            )
            lams.append(torch.sigmoid(m.rule.gate(h).squeeze(-1)))
        lams[-1] = torch.ones_like(lams[-1])
        S, total = torch.ones(2, 9), torch.zeros(2, 9)
        for ell, lam in zip(ells, lams):
            pi = lam * S
            S = S * (1 - lam)
            total += pi * ell + 0.25 * pi * torch.log(pi + 1e-10)
        valid = tgt != -100
    torch.testing.assert_close(out.aux_loss, total[valid].mean(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# the two training stages through `looplm train`
# ------------------------------------------------------------------------------------------------
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_stage_yamls_follow_tables_10_and_11():
    from looplm.train import load_train_config

    s1 = load_train_config(REPO / "configs/train/looped-mamba-exit-stage1.yaml")
    s2 = load_train_config(REPO / "configs/train/looped-mamba-exit-stage2.yaml")
    for c, stage in ((s1, 1), (s2, 2)):
        rule = c.model_config().rule
        assert rule.name == "exit_gate" and rule.options["stage"] == stage and rule.options["bias_init"] == -2.0
        assert c.optim.name == "adamw" and c.optim.lr == 1.5e-4 and tuple(c.optim.betas) == (0.9, 0.95)
        assert c.optim.weight_decay == 0.1 and c.schedule.name == "cosine" and c.train.init_from
    assert s1.model_config().rule.options["beta"] == 0.25
    assert s1.train.grad_clip == 0.6 and s1.schedule.warmup_fraction == 0.002 and s1.train.max_steps == 2500
    assert s1.optim.lr * s1.schedule.min_ratio == pytest.approx(8.0e-5) and not s1.train.freeze
    o2 = s2.model_config().rule.options
    assert o2["kappa"] == 50 and o2["gamma"] == 0.005
    assert s2.train.grad_clip == 1.0 and s2.schedule.warmup_fraction == 0.01 and s2.train.max_steps == 600
    assert s2.optim.lr * s2.schedule.min_ratio == pytest.approx(1.5e-5)
    m = looplm.build(s2.model_config(), device="meta")
    from looplm.train.optim import freeze_parameters

    frozen = freeze_parameters(m, s2.train.freeze)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert (
        trainable == ["rule.gate.weight", "rule.gate.bias"] and "lm_head.weight" in frozen and "embed.weight" in frozen
    )


def test_two_stages_from_a_fixed_loop_checkpoint(tmp_path, capsys):
    """pretrain (vanilla) -> stage 1 (init_from, gate added) -> stage 2 (frozen backbone): the frozen
    tensors are bit-identical after stage-2 updates and the optimizer holds state for the gate only."""
    from safetensors.torch import load_file

    from looplm.checkpoint_io import resolve_checkpoint
    from looplm.train import Trainer, load_train_config
    from test_train_resume import read_metrics, write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80)

    def cfg(stage=None, **train):
        rule = {} if stage is None else {"rule": {"name": "exit_gate", "options": {"stage": stage}}}
        return load_train_config(
            {
                "model": "tiny-mamba2",
                "model_overrides": {"n_loops": 3, **rule},
                "data": {
                    "source": "files",
                    "paths": [str(corpus)],
                    "split_mode": "lines",
                    "seq_len": 16,
                    "shuffle_buffer": 10,
                    "val_every_nth": 0,
                },
                "optim": {"name": "adamw", "lr": 1e-2},
                "train": {
                    "global_batch_size": 4,
                    "micro_batch_size": 4,
                    "max_steps": 2,
                    "precision": "fp32",
                    "cpu_threads": 1,
                    **train,
                },
                "eval": {"every": 0, "at_end": False},
                "checkpoint": {"every": 0, "at_end": True},
                "logging": {"progress_bar": False, "tensorboard": False},
            }
        )

    def weights(run):
        return load_file(str(resolve_checkpoint(run) / "model.safetensors"))

    Trainer(cfg(), tmp_path / "pre", quiet=True).fit()
    tr1 = Trainer(cfg(stage=1, init_from=str(tmp_path / "pre")), tmp_path / "s1", quiet=True)
    tr1._setup()  # weights loaded from the fixed-loop run, the new gate keeps its init
    pre = weights(tmp_path / "pre")
    assert all(torch.equal(tr1.model.state_dict()[k], v) for k, v in pre.items())
    assert torch.all(tr1.model.rule.gate.bias == -2.0)
    Trainer(cfg(stage=1, init_from=str(tmp_path / "pre")), tmp_path / "s1", quiet=True).fit()
    rec = read_metrics(tmp_path / "s1")[-1]
    assert 0 < rec["exit_entropy"] <= math.log(3) + 1e-6 and 1 <= rec["expected_exit_step"] <= 3
    s1 = weights(tmp_path / "s1")
    assert not torch.equal(
        s1["core.stack.blocks.0.mixer.in_proj.weight"], pre["core.stack.blocks.0.mixer.in_proj.weight"]
    )

    tr2 = Trainer(cfg(stage=2, init_from=str(tmp_path / "s1"), freeze=["*", "!rule.*"]), tmp_path / "s2", quiet=True)
    tr2.fit()
    s2 = weights(tmp_path / "s2")
    for k, v in s1.items():
        if k.startswith("rule."):
            assert not torch.equal(s2[k], v), k  # the gate trained
        else:
            assert torch.equal(s2[k], v), k  # frozen: bit-identical
    state_params = {id(p) for opt in tr2.optimizer for p in opt.state}
    names = {n for n, p in tr2.model.named_parameters() if id(p) in state_params}
    assert names == {"rule.gate.weight", "rule.gate.bias"}  # no optimizer state for frozen parameters
    with pytest.raises(ValueError, match="match no parameter"):
        Trainer(cfg(stage=2, freeze=["backbone.*"]), tmp_path / "bad", quiet=True)._setup()

    # `looplm eval threshold` on the stage-2 checkpoint: table + Figure-1-style PNG
    from looplm.cli import main

    png = tmp_path / "sweep.png"
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "threshold",
                str(tmp_path / "s2"),
                "--data",
                str(corpus),
                "--batches",
                "1",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--png",
                str(png),
                "--json",
            ]
        )
        == 0
    )
    import json as _json

    rows = _json.loads(capsys.readouterr().out)
    assert [r.get("q") for r in rows[:5]] == [0.2, 0.4, 0.6, 0.8, 1.0] and [r.get("r") for r in rows[5:]] == [1, 2, 3]
    assert all(r["executed_depth"] == 3 for r in rows[:5]) and png.stat().st_size > 1000

    # downstream accuracy at every setting through the lm-eval model (a local multiple-choice task)
    from test_harness import _write_tasks

    tasks = _write_tasks(tmp_path / "tasks")
    assert (
        main(
            [
                "eval",
                "threshold",
                str(tmp_path / "s2"),
                "--data",
                str(corpus),
                "--batches",
                "1",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--thresholds",
                "0.5",
                "--loops",
                "1",
                "--tasks",
                "local_mc",
                "--include-path",
                str(tasks),
                "--limit",
                "4",
                "--json",
            ]
        )
        == 0
    )
    rows = _json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in rows] == ["threshold", "fixed"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and set(r["task_scores"]) == {"local_mc"} for r in rows)


def test_sweep_rows_table_and_plot(tmp_path):
    from looplm.eval.threshold import format_sweep, lm_metric, plot_sweep, sweep

    m = _gate_model().eval()  # bias −2: λ ≈ 0.12, so q = 1.0 selects the last step for every token
    batches = [torch.randint(0, m.config.vocab_size, (2, 10)) for _ in range(2)]
    rows = sweep(m, lm_metric(batches), thresholds=(0.2, 0.6, 1.0), fixed_loops=[1, 4])
    th, fx = rows[:3], rows[3:]
    assert [r["iter"] for r in th] == sorted(r["iter"] for r in th) and th[-1]["iter"] == 4.0
    assert all(r["executed_depth"] == 4 for r in th) and [r["executed_depth"] for r in fx] == [1, 4]
    assert th[-1]["ppl"] == pytest.approx(fx[-1]["ppl"], rel=1e-6)  # q = 1 == forced r = R
    with torch.no_grad():  # the metric is the token PPL of the output logits
        nll = sum(
            F.cross_entropy(m(x, num_loops=1).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            for x in batches
        )
    assert fx[0]["ppl"] == pytest.approx(math.exp(float(nll) / 36), rel=1e-5)
    table = format_sweep(rows, ("ppl",))
    assert "| threshold | 0.60 |" in table and "| fixed | 1 | 1.00 | 1 |" in table
    plot_sweep(rows, tmp_path / "f.png", "ppl")
    assert (tmp_path / "f.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="exit-gate"):
        sweep(looplm.build("tiny-mamba2"), lm_metric(batches), thresholds=(0.5,))
