"""The trainer's fast paths: `train.compile` (blocks compiled once, same losses), the chunked loss,
and the rule's auxiliary loss in the metrics."""

import pytest
import torch
from torch import nn

import looplm.parallel
from looplm.recurrence import RULES, RecurrenceRule, register_rule
from looplm.train import Trainer
from looplm.train.trainer import COMPILE_AUTO_MIN_STEPS, resolve_compile
from test_train_loop import corpus, tiny  # noqa: F401  (fixture)


def test_compile_auto_is_on_only_where_it_pays(monkeypatch):
    import looplm.train.trainer as trainer

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    long, short = COMPILE_AUTO_MIN_STEPS, COMPILE_AUTO_MIN_STEPS - 1
    assert resolve_compile(True, cpu, "fp32", 1) and not resolve_compile(False, cuda, "bf16", 10_000)
    assert resolve_compile("auto", cuda, "bf16", long) and not resolve_compile("auto", cuda, "bf16", short)
    monkeypatch.setattr(trainer, "cpu_has_fast_bf16", lambda: True)
    assert resolve_compile("auto", cpu, "bf16", long) and not resolve_compile("auto", cpu, "fp32", long)
    monkeypatch.setattr(trainer, "cpu_has_fast_bf16", lambda: False)
    assert not resolve_compile("auto", cpu, "bf16", long)


def _run(cfg, out):
    tr = Trainer(cfg, out, quiet=True)
    tr._setup()
    return [tr._train_step(i) for i in range(3)], tr


def test_compiled_training_matches_eager(corpus, tmp_path, monkeypatch):  # noqa: F811
    real = looplm.parallel.compile_blocks
    # the trainer's plumbing with dynamo's eager backend (inductor would only add minutes of C++ builds here)
    monkeypatch.setattr(looplm.parallel, "compile_blocks", lambda model: real(model, backend="eager"))
    torch._dynamo.reset()
    eager, _ = _run(tiny(corpus, "train.compile=false"), tmp_path / "a")
    compiled, tr = _run(tiny(corpus, "train.compile=true"), tmp_path / "b")
    assert tr.compiled and all(b._compiled_call_impl is not None for b in tr.model.core.stack.blocks)
    assert "compile_step_s" in compiled[0] and "compile_step_s" not in compiled[1]
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


class AuxDouble(RecurrenceRule):
    """A rule with an auxiliary loss: 0.1 · mean square of the final state."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.g = nn.Parameter(torch.ones(()))

    def step(self, state, h, lctx):
        return {"h": self.g * h}

    def aux_loss(self, state, lctx):
        return 0.1 * state["h"].pow(2).mean()


def test_aux_loss_is_trained_and_logged_and_validation_is_the_plain_loss(corpus, tmp_path):  # noqa: F811
    before = dict(RULES)
    register_rule("test-aux")(AuxDouble)
    try:
        cfg = tiny(corpus, "model_overrides.rule.name=test-aux")
        tr = Trainer(cfg, tmp_path / "r", quiet=True)
        tr._setup()
        rec = tr._train_step(0)
        assert rec["aux_loss"] > 0 and rec["loss"] > rec["aux_loss"]
        x = tr.stream.next_batch(2)
        with torch.no_grad():
            out = tr.model(x, labels=x)
        torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
        # validation measures the next-token loss alone: a huge auxiliary term must not reach val_loss
        tr.model.rule.aux_loss = lambda state, lctx: torch.tensor(100.0)
        val = tr.evaluate()
        assert val["val_loss"] < 10.0  # ln(260) = 5.56 for an untrained byte-level model
    finally:
        RULES.clear()
        RULES.update(before)


def test_per_sequence_depth_sampling(corpus, tmp_path):  # noqa: F811
    """Parcae-style per-sequence depths: each row draws its own loop count (Poisson, clipped), seeded per
    step; the step equals a forward with the same [B] num_loops by hand."""
    sets = [
        "train.random_loops.per_sequence=true",
        "train.random_loops.distribution=poisson",
        "train.random_loops.mean=2.5",
        "train.random_loops.min=1",
        "train.random_loops.max=5",
    ]
    cfg = tiny(corpus, *sets, "model_overrides.rule.name=parcae")
    tr = Trainer(cfg, tmp_path / "r", quiet=True)
    tr._setup()
    loops, m = tr._loop_counts(0)
    assert loops.shape == (8,) and int(loops.min()) >= 1 and int(loops.max()) <= 5 and m is None
    assert torch.equal(loops, tr._loop_counts(0)[0]) and not torch.equal(loops, tr._loop_counts(1)[0])
    batch = tr.stream.next_batch(8)
    tr2 = Trainer(cfg, tmp_path / "r2", quiet=True)
    tr2._setup()
    with torch.no_grad():
        expected = tr2.model(batch, labels=batch, num_loops=loops).loss
    rec = tr2._train_step(0)
    assert rec["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert rec["num_loops_mean"] == pytest.approx(float(loops.float().mean()))
    with pytest.raises(Exception, match="poisson distribution needs a mean"):
        tiny(corpus, "train.random_loops.distribution=poisson")


def _failing_compile(monkeypatch):
    """Blocks 'compiled' with a backend that fails like a corrupt inductor cache entry, at the first call."""
    import looplm.train.trainer as trainer

    def backend(gm, example_inputs):
        raise ImportError("/tmp/torchinductor_root/xy/cxyz.so: invalid ELF header")

    real = looplm.parallel.compile_blocks
    monkeypatch.setattr(looplm.parallel, "compile_blocks", lambda model: real(model, backend=backend))
    monkeypatch.setattr(trainer, "resolve_compile", lambda *a: True)  # "auto" decides to compile (a long run)
    torch._dynamo.reset()


def test_compile_auto_falls_back_to_eager_when_compiling_fails(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    eager, _ = _run(tiny(corpus, "train.compile=false"), tmp_path / "a")
    _failing_compile(monkeypatch)
    tr = Trainer(tiny(corpus, "train.compile=auto"), tmp_path / "b")
    tr._setup()
    assert tr.compiled
    records = [tr._first_compiled_step(0)] + [tr._train_step(i) for i in (1, 2)]  # was: a crash at step 1
    assert not tr.compiled and all(b._compiled_call_impl is None for b in tr.model.core.stack.blocks)
    assert [r["loss"] for r in records] == [r["loss"] for r in eager]  # the failed attempt left no trace
    assert [r["batch_hash"] for r in records] == [r["batch_hash"] for r in eager] and tr.tokens == 3 * 8 * 32
    err = capsys.readouterr().err
    assert err.count("warning: train.compile=auto: compiling the blocks failed at the first step") == 1
    assert "invalid ELF header" in err and "TORCHINDUCTOR_CACHE_DIR" in err


def test_compile_true_keeps_the_failure_with_a_note(corpus, tmp_path, monkeypatch):  # noqa: F811
    _failing_compile(monkeypatch)
    tr = Trainer(tiny(corpus, "train.compile=true"), tmp_path / "c", quiet=True)
    tr._setup()
    with pytest.raises(Exception, match="invalid ELF header") as ei:
        tr._first_compiled_step(0)
    assert any("train.compile=auto would train eagerly instead" in n for n in getattr(ei.value, "__notes__", []))
