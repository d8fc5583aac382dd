"""The lm-eval model and `looplm eval harness`, offline, on small local tasks built here."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")

import looplm
from looplm.cli import main as cli_main
from looplm.data.tokenizers import ByteTokenizer
from looplm.eval.harness import SUITES, LoopLMEvalModel, register_lm_eval_model, run_harness, write_task_configs
from looplm.hf.importer import write_checkpoint

TOK = ByteTokenizer()


class _Req:  # the part of lm-eval's Instance the model reads
    def __init__(self, *args):
        self.args = args


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = looplm.build("tiny-coreloop", max_seq_len=128)
    with torch.no_grad():  # a sharper random model: argmax differences are decisive
        m.lm_head.weight.mul_(20)
    return m.eval()


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("h") / "ckpt", model, TOK)


@torch.no_grad()
def _logp(model, ctx: list[int], cont: list[int], **kw) -> float:
    ids = torch.tensor([ctx + cont])
    lp = F.log_softmax(model(ids, **kw).logits[0].float(), -1)
    return sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def test_loglikelihood_matches_model_and_batches(model):
    reqs = [("The cat sat on", " the mat"), ("A", "b"), ("Once upon a time there was", " a loop"), ("", "hello")]
    one = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=1)
    many = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=3)
    a = one.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
    b = many.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
    for (c, x), (s1, g1), (s2, g2) in zip(reqs, a, b):
        ctx = TOK.encode(c) if c else [TOK.bos_id]  # an empty context is conditioned on BOS (lm-eval's hf rule)
        want = _logp(model, ctx, TOK.encode(x))
        assert math.isclose(s1, want, rel_tol=1e-5, abs_tol=1e-4)
        assert math.isclose(s2, want, rel_tol=1e-5, abs_tol=1e-4)  # right-padded batch == alone
        assert g1 == g2


def test_continuation_longer_than_the_window_is_scored_whole(model):
    ctx, cont = TOK.encode("ab"), TOK.encode(" a continuation much longer than the sixteen-token window")
    got = LoopLMEvalModel(model=model, tokenizer=TOK, max_length=16)._loglikelihood_tokens([(None, ctx, cont)])[0][0]
    seq, want, pos = ctx + cont, 0.0, len(ctx)
    while pos < len(seq):  # pieces of <= 16 predicted tokens, each read with the 16 tokens before its end
        end = min(pos + 16, len(seq))
        window = seq[max(0, end - 17) : end]
        want += _logp(model, window[: len(window) - (end - pos)], window[len(window) - (end - pos) :])
        pos = end
    assert math.isclose(got, want, rel_tol=1e-5)


def test_loops_and_exit_threshold_reach_the_model(model):
    req = [_Req("loop me", " deeper")]
    K = model.config.n_loops
    deep = LoopLMEvalModel(model=model, tokenizer=TOK, loops=2 * K).loglikelihood(req, disable_tqdm=True)[0][0]
    assert math.isclose(deep, _logp(model, TOK.encode("loop me"), TOK.encode(" deeper"), num_loops=2 * K), rel_tol=1e-5)
    base = LoopLMEvalModel(model=model, tokenizer=TOK).loglikelihood(req, disable_tqdm=True)[0][0]
    assert not math.isclose(deep, base, rel_tol=1e-6)
    torch.manual_seed(0)
    gated = looplm.build("tiny-llama", overrides={"rule.name": "exit_gate", "n_loops": 4}).eval()
    with torch.no_grad():
        for p in gated.rule.parameters():
            p.normal_(0, 1.0)
    got = LoopLMEvalModel(model=gated, tokenizer=TOK, exit_threshold=0.3).loglikelihood(req, disable_tqdm=True)[0][0]
    want = _logp(gated, TOK.encode("loop me"), TOK.encode(" deeper"), loop_options={"exit_threshold": 0.3})
    assert math.isclose(got, want, rel_tol=1e-5)


def test_loglikelihood_with_exit_scores_each_token_at_its_own_depth(model):
    """``exit=`` reaches the scored tokens: each takes the exits as decoding the text token by token would
    (looplm.decode.exit_forward, position 0 at full depth), batched or alone; the depths are counted."""
    from looplm.decode.exit_forward import adaptive_forward

    reqs = [("The cat sat on", " the mat"), ("Once upon a time there was", " a loop"), ("A", "b")]
    one = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=1, exit="convergence:1.0")
    many = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=3, exit="convergence:1.0")
    a = one.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
    b = many.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
    full = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=3).loglikelihood(
        [_Req(*r) for r in reqs], disable_tqdm=True
    )
    for (c, x), (s1, _), (s2, _), (sf, _) in zip(reqs, a, b, full):
        ctx, cont = TOK.encode(c), TOK.encode(x)
        out = adaptive_forward(model, torch.tensor([ctx + cont[:-1]]), "convergence:1.0", full_depth_prefix=1)
        lp = F.log_softmax(out.logits[0].float(), -1)
        want = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        assert math.isclose(s1, want, rel_tol=1e-5, abs_tol=1e-4) and math.isclose(s2, want, rel_tol=1e-5, abs_tol=1e-4)
        if len(ctx) > 1:  # (a continuation read at position 0 only: the full-depth prefix)
            assert not math.isclose(s1, sf, rel_tol=1e-4)  # not the full-depth score
    st = many.depth_stats
    assert st["max_loops"] == model.config.n_loops and 1 < st["selected_depth"] < model.config.n_loops
    assert st["tokens"] == sum(
        len(TOK.encode(c + x)) - 1 for c, x in reqs
    )  # the inputs read (the last token is only a target)
    assert st["executed_ratio"] == pytest.approx(st["executed_depth"] / model.config.n_loops)
    with pytest.raises(ValueError, match="prefill='exit': kv policy 'shared'"):
        LoopLMEvalModel(
            model=model, tokenizer=TOK, exit="kl:0.01", kv_policy="shared", exit_prefill="exit"
        )  # at construction
    # kl through the coda (tiny-coreloop has one): every loop read out over the packed tokens, the scores as decoding's
    kl = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=3, exit="kl:0.01")
    got = kl.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
    for (c, x), (s, _) in zip(reqs, got):
        ctx, cont = TOK.encode(c), TOK.encode(x)
        lp = F.log_softmax(
            adaptive_forward(model, torch.tensor([ctx + cont[:-1]]), "kl:0.01", full_depth_prefix=1).logits[0].float(),
            -1,
        )
        assert math.isclose(
            s, sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)), rel_tol=1e-5, abs_tol=1e-4
        )


def test_loglikelihood_rolling_windows(model):
    text = "a rolling perplexity document that is longer than one window of the model"
    lm = LoopLMEvalModel(model=model, tokenizer=TOK, max_length=16)
    got = lm.loglikelihood_rolling([_Req(text)], disable_tqdm=True)[0]
    ids = TOK.encode(text)
    # each token predicted once: the first from BOS (lm-eval's hf rule), the others from at most 16 tokens before them
    want = 0.0
    for start in range(0, len(ids), 16):
        end = min(start + 16, len(ids))
        window = ([TOK.bos_id] + ids)[max(0, end - 16) : end + 1]
        n = end - start
        want += _logp(model, window[:-n], window[-n:])
    assert math.isclose(got, want, rel_tol=1e-5)
    short = LoopLMEvalModel(model=model, tokenizer=TOK).loglikelihood_rolling([_Req("short text")], disable_tqdm=True)[
        0
    ]
    assert math.isclose(short, _logp(model, [TOK.bos_id], TOK.encode("short text")), rel_tol=1e-5)
    # prefix_token_id= chooses another (lm-eval's hf model argument of that name)
    eos = LoopLMEvalModel(model=model, tokenizer=TOK, prefix_token_id=TOK.eos_id)
    assert math.isclose(
        eos.loglikelihood_rolling([_Req("short text")], disable_tqdm=True)[0],
        _logp(model, [TOK.eos_id], TOK.encode("short text")),
        rel_tol=1e-5,
    )


def test_generate_until_honours_until_and_max_gen_toks(model):
    prompts = ["Q: what loops?\nA:", "x", "The model said"]
    lm1 = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=1)
    lm3 = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=3)
    free = lm1.generate_until([_Req(p, {"until": [], "max_gen_toks": 12}) for p in prompts])
    for p, text in zip(prompts, free):  # greedy, exactly looplm's own decoding
        ids = torch.tensor([TOK.encode(p)])
        ref = model.generate(ids, max_new_tokens=12, eos_token_id=TOK.eos_id)[0, ids.shape[1] :].tolist()
        assert text == TOK.decode(ref[: ref.index(TOK.eos_id)] if TOK.eos_id in ref else ref)
    # stop at a string that occurs in the free continuation: the text is cut just before it
    stops = [t[3:5] if len(t) >= 5 else "\x00" for t in free]
    reqs = [_Req(p, {"until": [s], "max_gen_toks": 12}) for p, s in zip(prompts, stops)]
    cut1, cut3 = lm1.generate_until(reqs), lm3.generate_until(reqs)
    assert cut1 == cut3  # a left-padded batch == each alone
    for t, s, c in zip(free, stops, cut1):
        assert c == t.split(s)[0] and s not in c
    three = model.generate(torch.tensor([TOK.encode("abc")]), max_new_tokens=3)[0, 3:].tolist()  # max_gen_toks
    assert lm1.generate_until([_Req("abc", {"until": ["\x00"], "max_gen_toks": 3})])[0] == TOK.decode(
        three[: three.index(TOK.eos_id)] if TOK.eos_id in three else three
    )


# ------------------------------------------------------------------------------- lm-eval end to end
def _write_tasks(d: Path) -> Path:
    """Three tiny local tasks (absolute data paths): multiple choice, rolling PPL, generate-until."""
    import yaml

    d.mkdir(parents=True, exist_ok=True)
    mc = [{"q": f"{a} plus {a} is", "choices": [f" {2 * a}", f" {2 * a + 1}", " blue"], "label": 0} for a in range(6)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (d / "ppl.jsonl").write_text(
        "".join(json.dumps({"text": f"document number {i} of the tiny corpus"}) + "\n" for i in range(3))
    )
    (d / "gen.jsonl").write_text("".join(json.dumps({"q": f"say {w}", "a": w}) + "\n" for w in ("yes", "no", "loop")))
    common = {"dataset_path": "json", "test_split": "train", "metadata": {"version": 1.0}}
    tasks = {
        "local_mc": {
            **common,
            "dataset_kwargs": {"data_files": {"train": str(d / "mc.jsonl")}},
            "output_type": "multiple_choice",
            "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc"}],
        },
        "local_ppl": {
            **common,
            "dataset_kwargs": {"data_files": {"train": str(d / "ppl.jsonl")}},
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
        },
        "local_gen": {
            **common,
            "dataset_kwargs": {"data_files": {"train": str(d / "gen.jsonl")}},
            "output_type": "generate_until",
            "doc_to_text": "{{q}}:",
            "doc_to_target": "{{a}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 5, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for name, cfg in tasks.items():
        (d / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **cfg}))
    return d


def test_simple_evaluate_on_local_tasks(model, tmp_path):
    from lm_eval.tasks import TaskManager

    register_lm_eval_model()
    tasks = _write_tasks(tmp_path / "tasks")
    lm = LoopLMEvalModel(model=model, tokenizer=TOK, batch_size=4)
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["local_mc", "local_ppl", "local_gen"], task_manager=tm, log_samples=False
    )["results"]
    # accuracy = how often the labelled choice has the highest log-likelihood, computed by hand
    hits = []
    for line in (tasks / "mc.jsonl").read_text().splitlines():
        r = json.loads(line)
        scores = [_logp(model, TOK.encode(r["q"]), TOK.encode(c)) for c in r["choices"]]
        hits.append(max(range(3), key=scores.__getitem__) == r["label"])
    assert math.isclose(res["local_mc"]["acc,none"], sum(hits) / len(hits))
    # word perplexity = exp(-sum log p / words), each document conditioned on BOS
    lp = words = 0
    for line in (tasks / "ppl.jsonl").read_text().splitlines():
        t = json.loads(line)["text"]
        lp += _logp(model, [TOK.bos_id], TOK.encode(t))
        words += len(t.split())
    assert math.isclose(res["local_ppl"]["word_perplexity,none"], math.exp(-lp / words), rel_tol=1e-4)
    assert 0 <= res["local_gen"]["exact_match,none"] <= 1
    # the registered name works through lm-eval's own model lookup
    from lm_eval.api.registry import get_model

    assert get_model("looplm") is LoopLMEvalModel


def test_cli_eval_harness_offline(ckpt, tmp_path):
    tasks = _write_tasks(tmp_path / "tasks")
    out = tmp_path / "res.json"
    rc = cli_main(
        [
            "eval",
            "harness",
            str(ckpt),
            "--tasks",
            "local_mc,local_gen",
            "--include-path",
            str(tasks),
            "--limit",
            "4",
            "--loops",
            "5",
            "--output-json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"local_mc", "local_gen"} and res["config"]["loops"] == 5
    assert res["n-samples"]["local_mc"]["effective"] == 4
    # the same model as a Hugging Face export gives the same scores
    from looplm.hf.export import export_hf

    export_hf(ckpt, tmp_path / "hf")
    out2 = tmp_path / "res2.json"
    assert (
        cli_main(
            [
                "eval",
                "harness",
                str(tmp_path / "hf"),
                "--tasks",
                "local_mc",
                "--include-path",
                str(tasks),
                "--limit",
                "4",
                "--loops",
                "5",
                "--output-json",
                str(out2),
            ]
        )
        == 0
    )
    assert json.loads(out2.read_text())["results"]["local_mc"]["acc,none"] == res["results"]["local_mc"]["acc,none"]
    # --exit: the scored and generated requests at adaptive depth, the scored tokens' depths in the results
    out3 = tmp_path / "res3.json"
    assert (
        cli_main(
            [
                "eval",
                "harness",
                str(ckpt),
                "--tasks",
                "local_mc,local_gen",
                "--include-path",
                str(tasks),
                "--limit",
                "4",
                "--exit",
                "convergence:1.0",
                "--output-json",
                str(out3),
            ]
        )
        == 0
    )
    res3 = json.loads(out3.read_text())
    assert res3["config"]["exit"]["criterion"] == "convergence" and res3["config"]["exit"]["threshold"] == 1.0
    d = res3["adaptive_depth"]
    assert d["tokens"] > 0 and 1 <= d["selected_depth"] < d["max_loops"] == 3 and d["executed_ratio"] < 1


def _fake_eval_dir(root: Path) -> Path:
    """Two of the real tasks' local layouts (datasets.save_to_disk), with made-up rows."""
    from datasets import Dataset

    Dataset.from_list(
        [{"goal": f"How to loop {i}?", "sol1": "Run it again.", "sol2": "Stop.", "label": i % 2} for i in range(8)]
    ).save_to_disk(str(root / "piqa"))
    Dataset.from_list(
        [{"question": f"What is {i}?", "answer": bool(i % 2), "passage": "A passage."} for i in range(8)]
    ).save_to_disk(str(root / "boolq"))
    return root


def test_suites_on_local_data_dir(ckpt, tmp_path):
    data = _fake_eval_dir(tmp_path / "eval")
    written = write_task_configs(tmp_path / "cfg", data_dir=data)
    assert [st.task for _, st in written["looplm_mamba7"]] == ["piqa", "boolq"]  # only tasks with a local copy
    assert "looplm_stateloop8_0shot" in written and len(written["looplm_stateloop8_0shot"]) == 1
    # two suites sharing 5-shot PIQA run together (each suite has its own copy of the task)
    out = run_harness(
        ckpt, ["looplm_mamba7", "looplm_stateloop8_5shot"], data_dir=data, limit=4, output_json=tmp_path / "r.json"
    )
    assert "looplm_stateloop8_5shot_piqa_local" in out["results"]
    groups = out["groups"]["looplm_mamba7"]
    piqa = out["results"]["looplm_mamba7_piqa_local"]["acc,none"]
    boolq = out["results"]["looplm_mamba7_boolq_local"]["acc,none"]
    assert math.isclose(groups["acc,none"], (piqa + boolq) / 2)  # unweighted mean
    assert out["n-shot"]["looplm_mamba7_piqa_local"] == 5
    table = out["looplm_tables"]
    assert "| Model | PIQA | BoolQ | WinoGrande" in table and f"{100 * (piqa + boolq) / 2:.2f} |" in table
    assert json.loads((tmp_path / "r.json").read_text())["looplm_tables"] == table


def test_suite_definitions_match_the_papers():
    from looplm.eval.harness_cli import SUITE_NAMES

    assert tuple(SUITES) == SUITE_NAMES  # the CLI's list (kept free of lm-eval imports) is current
    sl = SUITES["looplm_stateloop8_0shot"][2]
    assert [t.task for t in sl] == [
        "lambada_openai",
        "arc_easy",
        "arc_challenge",
        "winogrande",
        "piqa",
        "hellaswag",
        "sciq",
        "race",
    ]
    assert {t.shots for t in SUITES["looplm_stateloop8_5shot"][2]} == {5}
    shots = {t.task: t.shots for t in SUITES["looplm_mamba7"][2]}
    assert shots == {
        "piqa": 5,
        "boolq": 5,
        "winogrande": 5,
        "openbookqa": 5,
        "hellaswag": 10,
        "arc_challenge": 25,
        "arc_easy": 8,
    }
    assert len(SUITES["looplm_bbh14"][2]) == 14 and len(SUITES["looplm_knowledge"][2]) == 3
    assert len(SUITES["looplm_reasoning"][2]) == 8 and "piqa" in {t.task for t in SUITES["looplm_knowledge"][2]}


def test_unknown_task_is_reported(ckpt, tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        run_harness(ckpt, ["no_such_task_xyz"], data_dir=_fake_eval_dir(tmp_path / "e"), include_defaults=False)


def test_bad_arguments_are_refused_before_any_work(ckpt, model, capsys):
    import time

    t0 = time.perf_counter()
    rc = cli_main(
        [
            "eval",
            "harness",
            str(ckpt),
            "--tasks",
            "no_such_task",
            "--max-length",
            "0",
            "--limit",
            "-3",
            "--batch-size",
            "0",
            "--num-fewshot",
            "-1",
            "--exit-threshold",
            "nan",
        ]
    )
    assert rc == 2 and time.perf_counter() - t0 < 5  # --max-length 0 looped until MemoryError
    err = capsys.readouterr().err
    assert "invalid eval harness arguments (5 problem(s))" in err
    for flag in ("--max-length", "--limit", "--batch-size", "--num-fewshot", "--exit-threshold"):
        assert flag in err
    # lm-eval's model_args arrive as strings; the model's own window and exit gate are checked too
    from looplm.dataclass_util import ConfigError

    with pytest.raises(ConfigError, match="max_length .* integer >= 1"):
        LoopLMEvalModel(model=model, tokenizer=TOK, max_length="0")
    with pytest.raises(ConfigError, match="at most the model's max_seq_len=128, got 4096"):
        LoopLMEvalModel(model=model, tokenizer=TOK, max_length=4096)  # was silently cut to 128
    with pytest.raises(ValueError, match="this model has no exit gate"):
        LoopLMEvalModel(model=model, tokenizer=TOK, exit_threshold="0.5")
    one = LoopLMEvalModel(model=model, tokenizer=TOK, max_length="1")  # the smallest window still advances
    assert len(one._loglikelihood_tokens([(None, [1, 2, 3], [4, 5])])) == 1


# ------------------------------------------------------------------------------- lm-eval's conventions
def test_unknown_model_arguments_are_refused_before_loading(tmp_path):
    register_lm_eval_model()
    from lm_eval.api.registry import get_model

    with pytest.raises(ValueError, match=r"unknown argument\(s\) loop=6 \(did you mean 'loops'"):
        get_model("looplm").create_from_arg_string(f"pretrained={tmp_path / 'nowhere'},loop=6", {"batch_size": 2})
    with pytest.raises(ValueError, match="prefix_token_id must be a token id"):
        LoopLMEvalModel(model=looplm.build("tiny-llama"), tokenizer=TOK, prefix_token_id=10**6)


def test_rolling_loglikelihood_equals_lm_evals_own_hf_model_on_the_export(ckpt, tmp_path):
    """lm-eval's `hf` model on the export and looplm's on the checkpoint: the same prefix token, the same
    windows, the same numbers (perplexity tasks compare across the two)."""
    pytest.importorskip("accelerate")  # lm-eval's hf model needs it
    from lm_eval.models.huggingface import HFLM

    from looplm.hf.export import export_hf

    out = export_hf(ckpt, tmp_path / "hf")
    docs = [
        _Req(f"document {i}: " + "the looped model reads this line again and again. " * (1 + 2 * i)) for i in range(3)
    ]
    ours = LoopLMEvalModel(str(ckpt), max_length=48, batch_size=2)
    theirs = HFLM(pretrained=str(out), trust_remote_code=True, max_length=48, batch_size=2, device="cpu")
    assert ours.prefix_token_id == theirs.prefix_token_id == TOK.bos_id
    a = ours.loglikelihood_rolling(docs, disable_tqdm=True)
    b = theirs.loglikelihood_rolling(docs, disable_tqdm=True)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-4)
    assert max(len(TOK.encode(d.args[0])) for d in docs) > 48  # several windows


def test_plain_task_name_reads_the_local_copy_and_samples_are_logged(ckpt, tmp_path):
    data = _fake_eval_dir(tmp_path / "eval")
    out = tmp_path / "res.json"
    rc = cli_main(
        [
            "eval",
            "harness",
            str(ckpt),
            "--tasks",
            "piqa",
            "--data-dir",
            str(data),
            "--output-json",
            str(out),
            "--log-samples",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["n-samples"]["piqa"]["original"] == 8  # the local copy (lm-eval's piqa has 1,838), offline
    lines = (tmp_path / "res_samples_piqa.jsonl").read_text().splitlines()
    assert len(lines) == 8 and {"doc", "resps", "acc"} <= set(json.loads(lines[0]))
    assert res["samples_files"]["piqa"].endswith("res_samples_piqa.jsonl")
    with pytest.raises(ValueError, match="needs output_json"):
        run_harness(ckpt, ["piqa"], data_dir=data, log_samples=True)


def test_written_task_yamls_name_nothing_of_this_environment(ckpt, tmp_path):
    """--write-tasks: lm-eval's config inlined (functions by importable name), data paths relative to the
    folder: copied elsewhere with its data, lm-eval runs it."""
    import shutil

    from lm_eval.tasks import TaskManager

    data = _fake_eval_dir(tmp_path / "a" / "eval")
    write_task_configs(tmp_path / "a" / "tasks", data_dir=data)
    texts = {f.name: f.read_text() for f in (tmp_path / "a" / "tasks").glob("*.yaml")}
    assert "piqa.yaml" in texts and "looplm_mamba7_boolq_local.yaml" in texts
    import lm_eval

    for name, t in texts.items():
        assert str(tmp_path) not in t and str(Path(lm_eval.__file__).parent) not in t and "include:" not in t, name
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "a", moved)
    shutil.rmtree(tmp_path / "a")
    register_lm_eval_model()
    res = lm_eval.simple_evaluate(
        model="looplm",
        model_args=f"pretrained={ckpt}",
        tasks=["looplm_mamba7"],
        limit=3,
        task_manager=TaskManager(include_path=str(moved / "tasks"), include_defaults=False),
    )
    assert res["n-samples"]["looplm_mamba7_piqa_local"]["original"] == 8
    assert "acc,none" in res["results"]["looplm_mamba7_boolq_local"]
    # without data: every suite task, hellaswag's process_docs named by its importable module in lm-eval
    write_task_configs(tmp_path / "nodata")
    hs = (tmp_path / "nodata" / "looplm_stateloop8_0shot_hellaswag.yaml").read_text()
    assert "process_docs: !function 'lm_eval.tasks.hellaswag.utils.process_docs'" in hs
    tm = TaskManager(include_path=str(tmp_path / "nodata"), include_defaults=False)
    assert tm.match_tasks(["looplm_stateloop8_0shot"]) and tm.match_tasks(["looplm_stateloop8_0shot_hellaswag"])
