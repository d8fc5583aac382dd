"""Mano and p-hop: exact formats, determinism, chain-first verification, packing, dense targets, CLI export."""

import json
import random

import pytest
import torch

from looplm.tasks import mano, phop
from looplm.tasks.cli import export_records

# ------------------------------------------------------------------------------------------------
# Mano
# ------------------------------------------------------------------------------------------------


def _reference_value(tokens):
    """Independent evaluator: right-to-left stack evaluation of a prefix expression over F_23."""
    stack = []
    for t in reversed(tokens):
        if t in ("+", "-", "*"):
            a, b = stack.pop(), stack.pop()
            stack.append({"+": a + b, "-": a - b, "*": a * b}[t] % 23)
        else:
            stack.append(int(t))
    assert len(stack) == 1
    return stack[0]


def test_mano_vocabulary_matches_appendix_c():
    v = mano.ManoVocab(24)
    assert v.size == 23 + 3 + 4 + 25  # numbers, operators, <bos> <ans> <eos> <pad>, <len_0..24>
    assert v.itos[:23] == [str(i) for i in range(23)]
    assert {"+", "-", "*", "<bos>", "<ans>", "<eos>", "<pad>", "<len_0>", "<len_24>"} <= set(v.itos)
    assert "<len_25>" not in v.stoi


@pytest.mark.parametrize("L", [1, 3, 10])
def test_mano_instances_are_well_formed_and_answers_correct(L):
    v = mano.ManoVocab(L)
    train = mano.generate("train", 200, L, seed=5)
    assert {i.length for i in train} == set(range(1, L + 1)) or L == 1  # ℓ ~ U{1..L}
    for inst in train + mano.generate("eval", 50, L, seed=5):
        t = inst.tokens
        assert t[0] == "<bos>" and t[1] == f"<len_{inst.length}>" and t[-2] == "<ans>" and t[-1] == str(inst.answer)
        expr = t[2:-2]
        assert sum(x in mano.OPS for x in expr) == inst.length and len(expr) == 2 * inst.length + 1
        assert _reference_value(expr) == inst.answer == mano.evaluate_prefix(expr)
        assert v.decode(v.encode(t)) == t
    assert all(i.length == L for i in mano.generate("eval", 50, L, seed=5))  # evaluation: ℓ = L only


def test_mano_example_of_the_paper():
    # "<bos> <len_3> - * a b + c d <ans> ans" with a,b,c,d = 5, 7, 20, 9: (5*7) - (20+9) = 35 - 29 = 6
    assert mano.evaluate_prefix(["-", "*", "5", "7", "+", "20", "9"]) == 6
    assert mano.evaluate_prefix(["-", "3", "5"]) == 21  # subtraction wraps mod 23


def test_mano_eval_set_is_deterministic_and_seeded():
    a = [i.tokens for i in mano.generate("eval", 30, 10, seed=0)]
    assert a == [i.tokens for i in mano.generate("eval", 30, 10, seed=0)]
    assert a != [i.tokens for i in mano.generate("eval", 30, 10, seed=1)]
    assert a != [i.tokens for i in mano.generate("train", 30, 10, seed=0)]


@pytest.mark.parametrize("loss_on", ["all", "answer"])
def test_mano_packing(loss_on):
    s = mano.ManoStream(max_length=6, seq_len=128, seed=3, loss_on=loss_on)
    ids, labels = s.next_batch(4)
    assert ids.shape == labels.shape == (4, 128)
    v = s.vocab
    for row, lab in zip(ids.tolist(), labels.tolist()):
        bos = [i for i, t in enumerate(row) if t == v.bos]
        assert len(bos) >= 2 and bos[0] == 0  # several whole instances per chunk
        real = [t for t in row if t != v.pad]
        assert row[len(real) :] == [v.pad] * (128 - len(real))  # padding only at the tail
        starts = bos + [len(real)]
        for a, b in zip(starts, starts[1:]):  # every packed instance is whole and correct
            toks = v.decode(row[a:b])
            assert toks[-2] == "<ans>" and _reference_value(toks[2:-2]) == int(toks[-1])
        assert all(lab[i] == -100 for i in range(len(real), 128))  # padding is never a target
        if loss_on == "answer":
            targets = [i for i, t in enumerate(lab) if t != -100]
            assert targets == [i for i in range(1, len(real)) if row[i - 1] == v.ans]
            assert all(lab[i] == row[i] for i in targets)
        else:
            assert lab[0] == -100 and lab[1 : len(real)] == row[1 : len(real)]
    with pytest.raises(ValueError, match="cannot hold"):
        mano.ManoStream(max_length=60, seq_len=64)


def test_mano_eval_batch_points_at_ans():
    v = mano.ManoVocab(4)
    insts = mano.generate("eval", 5, 4, seed=0)
    ids, pos, ans = mano.eval_batch(insts, v)
    assert (ids[torch.arange(5), pos] == v.ans).all()
    assert [v.itos[a] for a in ans.tolist()] == [str(i.answer) for i in insts]


# ------------------------------------------------------------------------------------------------
# p-hop
# ------------------------------------------------------------------------------------------------


def _brute_hop(seq, p):
    """Sanford et al.'s find with 1-based positions, written independently: find(i) = max{j <= i : v_{j-1} = v_i}."""
    v = [None] + list(seq)  # 1-based
    i = len(seq)
    for _ in range(p):
        js = [j for j in range(2, i + 1) if v[j - 1] == v[i]]
        if not js:
            return None
        i = max(js)
    return v[i]


def test_hop_semantics_by_hand():
    # v = a b c a d b (0-based symbols); 1 hop from the last b -> previous b at position 1 -> token c
    seq = [0, 1, 2, 0, 3, 1]
    assert phop.hop_trace(seq, 1) == [5, 2] and phop.hop_answer(seq, 1) == 2
    # 2 hops: from c (pos 2) -> no earlier c -> undefined
    assert phop.hop_answer(seq, 2) is None
    seq = [0, 1, 0, 1, 0]
    assert phop.hop_trace(seq, 2) == [4, 3, 2]


@pytest.mark.parametrize("n,p", [(32, 4), (64, 8), (256, 16), (256, 32)])
def test_phop_chain_first_instances_verify(n, p):
    insts = phop.generate("eval", 40, n=n, p=p, seed=1)
    v = phop.PhopVocab(4)
    for inst in insts:
        assert len(inst.sequence) == n and set(inst.sequence) <= {0, 1, 2, 3}
        assert inst.chain[0] == n - 1 and len(inst.chain) == p + 1
        assert all(a > b for a, b in zip(inst.chain, inst.chain[1:]))  # p genuine hops, never standing still
        assert phop.hop_trace(inst.sequence, p) == inst.chain
        assert _brute_hop(inst.sequence, p) == inst.answer
        ids = v.encode(inst)
        assert (
            len(ids) == 1 + n + 3
            and ids[0] == v.bos
            and ids[-3] == v.ans
            and ids[-2] == inst.answer
            and ids[-1] == v.eos
        )
    if n == 256:
        assert len(v.encode(insts[0])) == 260 <= 272  # App. D: 1 + 256 + 3 in a 272 context


def test_phop_eval_set_is_deterministic_and_answers_are_balanced():
    a = phop.generate("eval", 400, n=64, p=8, seed=0)
    assert [i.sequence for i in a] == [i.sequence for i in phop.generate("eval", 400, n=64, p=8, seed=0)]
    assert [i.sequence for i in a] != [i.sequence for i in phop.generate("train", 400, n=64, p=8, seed=0)]
    counts = [sum(i.answer == s for i in a) for s in range(4)]
    assert min(counts) > 60  # no symbol is a free lunch (chance stays ~25%)


def test_phop_verification_rejects_a_broken_chain(monkeypatch):
    # a construction whose fill breaks the chain must be redrawn, never returned
    calls = {"n": 0}
    real = phop.hop_trace

    def flaky(seq, p, start=None, prev=None):
        calls["n"] += 1
        return None if calls["n"] == 1 else real(seq, p, start, prev)

    monkeypatch.setattr(phop, "hop_trace", flaky)
    inst = phop.make_instance(random.Random(0), 32, 4)
    assert calls["n"] >= 2 and real(inst.sequence, 4) == inst.chain


@pytest.mark.parametrize("dense", [False, True])
def test_phop_labels_answer_only_and_dense(dense):
    s = phop.PhopStream(n=32, p=3, seq_len=40, seed=0, dense_target=dense)
    ids, labels = s.next_batch(3)
    assert ids.shape == labels.shape == (3, 40)
    for row, lab in zip(ids.tolist(), labels.tolist()):
        seq = row[1:33]
        assert row[33] == s.vocab.ans and lab[34] == row[34] == _brute_hop(seq, 3)
        assert row[36:] == [s.vocab.pad] * 4 and all(x == -100 for x in lab[35:])
        targets = {j for j, x in enumerate(lab) if x != -100}
        if not dense:
            assert targets == {34}
        else:
            for t in range(32):  # the target after v_t is hop_p of the prefix v_1..v_t
                expect = _brute_hop(seq[: t + 1], 3)
                assert lab[t + 2] == (-100 if expect is None else expect)
            assert len(targets) > 5


def test_phop_eval_batch():
    insts = phop.generate("eval", 4, n=16, p=2, seed=0)
    ids, pos, ans = phop.eval_batch(insts, phop.PhopVocab(4))
    assert ids.shape == (4, 18) and (ids[:, -1] == 5).all() and (pos == 17).all()
    assert ans.tolist() == [i.answer for i in insts]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="split"):
        phop.generate("test", 1)
    with pytest.raises(ValueError, match="p="):
        phop.make_instance(random.Random(0), 8, 8)
    with pytest.raises(ValueError, match="L must be"):
        mano.ManoVocab(0)


# ------------------------------------------------------------------------------------------------
# export (the interface other tools rely on)
# ------------------------------------------------------------------------------------------------


def test_export_cli_writes_the_documented_fields(tmp_path):
    from looplm.cli import main

    f1, f2 = tmp_path / "m1.jsonl", tmp_path / "m2.jsonl"
    for f in (f1, f2):
        assert (
            main(
                [
                    "task",
                    "mano",
                    "export",
                    "--max-length",
                    "5",
                    "--split",
                    "eval",
                    "--count",
                    "7",
                    "--seed",
                    "3",
                    "--out",
                    str(f),
                ]
            )
            == 0
        )
    assert f1.read_bytes() == f2.read_bytes()  # same seed, same file
    rows = [json.loads(line) for line in f1.read_text().splitlines()]
    assert len(rows) == 7
    v = mano.ManoVocab(5)
    for r in rows:
        assert set(r) >= {"tokens", "length", "answer", "ids"} and isinstance(r["answer"], int)
        assert r["tokens"][:2] == ["<bos>", "<len_5>"] and r["tokens"][-2:] == ["<ans>", str(r["answer"])]
        assert r["ids"] == v.encode(r["tokens"])
    f3 = tmp_path / "p.jsonl"
    assert (
        main(["task", "phop", "export", "--p", "4", "--n", "32", "--split", "train", "--count", "5", "--out", str(f3)])
        == 0
    )
    for r in map(json.loads, f3.read_text().splitlines()):
        assert r["p"] == 4 and len(r["sequence"]) == 32 and r["answer"] == _brute_hop(r["sequence"], 4)
        assert r["ids"][1:33] == r["sequence"]
    assert export_records("phop", "eval", 3, 9, p=4, n=32) == export_records("phop", "eval", 3, 9, p=4, n=32)


# ------------------------------------------------------------------------------------------------
# task runs: configs, training, evaluation
# ------------------------------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

from looplm.config import ConfigError  # noqa: E402
from looplm.tasks.train import evaluate_run, load_task_config, task_accuracy, train_task  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _tiny_run(**over):
    data = {
        "task": {"name": "phop", "n": 12, "p": 2, "dense_target": True, "eval_count": 40},
        "model": "tiny-llama",
        "layers": 1,
        "loops": 2,
        "optim": {"name": "adamw", "lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "train": {
            "steps": 3,
            "batch_size": 8,
            "micro_batch_size": 4,
            "seeds": [0, 1],
            "precision": "fp32",
            "cpu_threads": 1,
            "eval_every": 2,
            "eval_during": 10,
        },
    }
    return load_task_config(data, [f"{k}={v}" for k, v in over.items()])


def test_paper_task_configs_follow_appendices_c_and_d():
    for L, lr, steps in [(10, 5e-4, 80_000), (16, 1e-4, 110_000), (24, 5e-5, 200_000)]:
        c = load_task_config(REPO / f"configs/tasks/mano-L{L}.yaml")
        m = c.model_config()
        assert c.task.name == "mano" and c.task.max_length == L and c.task.context == 1024 and c.task.count == 2000
        assert m.d_model == 1024 and m.mixer == "mamba2" and m.d_ff == 0 and m.vocab_size == 31 + L
        assert c.optim.lr == lr and c.train.steps == steps and c.train.batch_size == 128
        assert tuple(c.optim.betas) == (0.9, 0.98) and c.optim.eps == 1e-6 and c.optim.weight_decay == 0.1
        assert c.schedule.warmup_steps == 1000 and c.schedule.min_ratio == 0.1 and c.train.grad_clip == 1.0
        assert c.train.precision == "bf16" and len(c.train.seeds) == 3
    for p in (16, 32):
        c = load_task_config(REPO / f"configs/tasks/phop-p{p}.yaml")
        assert c.task.p == p and c.task.n == 256 and c.task.context == 272 and c.task.count == 10_000
        assert not c.task.dense_target and c.model_config().d_model == 256 and c.model_config().vocab_size == 8
        assert c.optim.lr == 2e-4 and c.optim.lr * c.schedule.min_ratio == pytest.approx(2e-5)
        assert c.schedule.warmup_steps == 2000 and c.optim.weight_decay == 0.1
    cpu = load_task_config(REPO / "configs/tasks/phop-cpu.yaml")
    assert cpu.task.dense_target and (cpu.task.n, cpu.task.p) == (32, 4) and cpu.model_config().d_model == 64
    assert cpu.train.batch_size == 64 and cpu.optim.lr == 2e-3 and cpu.train.steps == 2000
    load_task_config(REPO / "configs/tasks/mano-cpu.yaml").model_config()
    gate = load_task_config(
        REPO / "configs/bench/adaptive-phop-gate.yaml", task="phop"
    )  # `looplm bench adaptive`'s task model
    assert (gate.task.n, gate.task.p) == (32, 4) and gate.model_config().n_loops == 4


def test_task_config_builds_n_x_r_on_any_backbone_and_reports_errors():
    c = load_task_config(
        {
            "task": {"name": "mano", "max_length": 5, "seq_len": 64},
            "model": "tiny-mamba2",
            "layers": 3,
            "loops": 2,
            "blocks_per_layer": 2,
        }
    )
    m = c.model_config()
    assert (m.n_core, m.n_loops, m.vocab_size, m.max_seq_len) == (6, 2, 36, 64) and c.label == "3⊗2"
    c = load_task_config({"task": {"name": "phop", "n": 20, "p": 3}, "model": "tiny-hybrid", "layers": 3, "loops": 4})
    assert c.model_config().n_core == 3 and c.task.context == 24
    with pytest.raises(ConfigError) as e:
        load_task_config({"task": {"name": "sudoku", "seq_len": 2}, "layers": 0, "train": {"seeds": []}, "bogus": 1})
    msg = str(e.value)
    for part in ("sudoku", "layers", "seeds", "bogus"):
        assert part in msg
    with pytest.raises(ConfigError, match="for 'phop'"):
        load_task_config({"task": {"name": "phop"}}, task="mano")


def test_train_and_eval_a_tiny_run(tmp_path):
    cfg = _tiny_run()
    res = train_task(cfg, tmp_path / "run", quiet=True)
    assert [r["seed"] for r in res["runs"]] == [0, 1] and res["model"] == "1⊗2"
    assert res["best_accuracy"] == max(r["accuracy"] for r in res["runs"])  # best-of-n seeds
    assert (
        res["runs"][0]["accuracy"] != res["runs"][1]["accuracy"]
        or res["runs"][0]["final_loss"] != res["runs"][1]["final_loss"]
    )
    lines = (tmp_path / "run" / "seed_0" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and "eval_accuracy" in json.loads(lines[1])
    assert json.loads((tmp_path / "run" / "results.json").read_text())["best_seed"] == res["best_seed"]
    # eval of the saved best seed reproduces the training-time accuracy; the fixed-loop ablation runs r = 1..3
    ev = evaluate_run(tmp_path / "run", task="phop", num_loops=[1, 2, 3])
    assert ev["default"]["accuracy"] == res["best_accuracy"]
    assert [f["r"] for f in ev["fixed_loops"]] == [1, 2, 3] and ev["fixed_loops"][1]["accuracy"] == res["best_accuracy"]
    with pytest.raises(ValueError, match="exit-gate"):
        evaluate_run(tmp_path / "run", thresholds=[0.5])
    from looplm.cli import main

    png = tmp_path / "acc.png"
    assert main(["task", "phop", "eval", str(tmp_path / "run" / "seed_1"), "--loops", "1", "2", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="phop"):
        evaluate_run(tmp_path / "run", task="mano")


def test_accuracy_is_exact_match_at_the_answer_position():
    from looplm.tasks.train import build_task_model

    cfg = _tiny_run()
    ids, pos, ans = cfg.task.eval_set(20)
    model = build_task_model(cfg)

    class Oracle(torch.nn.Module):  # logits that put the answer at the answer position only
        config = model.config
        rule = model.rule

        def forward(self, x, num_loops=None, loop_options=None):
            logits = torch.zeros(*x.shape, 8)
            for r in range(x.shape[0]):
                row = int(torch.nonzero((ids == x[r]).all(1))[0])
                logits[r, pos[row], ans[row]] = 1.0
                logits[r, pos[row] - 1, (ans[row] + 1) % 4] = 5.0  # a wrong answer one position early is ignored
            return type("O", (), {"logits": logits})()

    oracle = Oracle()
    oracle.dummy = torch.nn.Parameter(torch.zeros(1))
    assert task_accuracy(oracle, (ids, pos, ans), batch_size=7)["accuracy"] == 1.0
    assert task_accuracy(oracle, (ids, pos, (ans + 1) % 4), batch_size=7)["accuracy"] == 0.0


def test_exit_gate_task_model_reports_iter(tmp_path):
    cfg = _tiny_run(
        **{"model_overrides": "{rule: {name: exit_gate, options: {stage: 1}}}", "train.seeds": "[0]", "train.steps": 2}
    )
    train_task(cfg, tmp_path / "g", quiet=True)
    ev = evaluate_run(tmp_path / "g", thresholds=[0.0, 1.0], num_loops=[1])
    t0, t1 = ev["thresholds"]
    assert t0["iter"] == 1.0 and t1["iter"] == 2.0  # q = 0 picks step 1, q = 1 the last step
    assert t0["executed_loops"] == t1["executed_loops"] == 2  # selection never changes what ran
    assert ev["fixed_loops"][0]["executed_loops"] == 1
