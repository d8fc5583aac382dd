"""lm-evaluation-harness's ``local-completions`` model against ``looplm serve``: its per-sample loglikelihoods equal
``looplm eval harness``'s model (:class:`LoopLMEvalModel`, in-process) on the same weights to 1e-4.

lm-eval scores a choice with one ``/v1/completions`` request per (context, continuation): the token ids, ``echo``,
``logprobs=1``, ``max_tokens=1``, and sums the continuation's echoed log-probabilities. The task is a six-question
multiple choice written here (no network, no ``../shared``)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

import looplm

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from looplm.data.tokenizers import ByteTokenizer  # noqa: E402
from looplm.eval.harness import LoopLMEvalModel, register_lm_eval_model  # noqa: E402
from looplm.serve import Engine, EngineConfig  # noqa: E402
from looplm.serve.app import build_app  # noqa: E402
from looplm.serve.server import Server  # noqa: E402


def _model():
    torch.manual_seed(0)
    m = looplm.build("tiny-coreloop")
    with torch.no_grad():  # a sharper random model: the choices' scores differ clearly
        m.lm_head.weight.mul_(20)
    return m.eval()


def _task(d):
    import yaml

    rows = [{"q": f"{a} plus {a} is", "choices": [f" {2 * a}", f" {2 * a + 1}", " blue"], "label": 0} for a in range(6)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "serve_mc",
        "dataset_path": "json",
        "test_split": "train",
        "metadata": {"version": 1.0},
        "dataset_kwargs": {"data_files": {"train": str(d / "mc.jsonl")}},
        "output_type": "multiple_choice",
        "doc_to_text": "{{q}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}],
    }
    (d / "serve_mc.yaml").write_text(yaml.safe_dump(task))


def test_local_completions_loglikelihoods_equal_looplm_eval_harness(tmp_path):
    from lm_eval.tasks import TaskManager

    from looplm.hf.tokenizer import byte_backend

    _task(tmp_path)
    tok_dir = tmp_path / "tok"  # the served tokenizer, as lm-eval's huggingface tokenizer backend loads it
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_backend(), eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    ).save_pretrained(str(tok_dir))
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    register_lm_eval_model()
    tok = ByteTokenizer()
    ref = lm_eval.simple_evaluate(
        model=LoopLMEvalModel(model=_model(), tokenizer=tok, batch_size=4),
        tasks=["serve_mc"],
        task_manager=tm,
        log_samples=True,
    )
    # the server runs a kl exit: it applies to generated tokens, never to the echoed prompt's scores
    engine = Engine(_model(), EngineConfig(max_batch=4, exit="kl:0.01"), eos_token_id=tok.eos_id)
    with Server(build_app(engine, tok, "tiny"), host="127.0.0.1", port=0) as server:
        args = (
            f"base_url={server.url}/v1/completions,model=tiny,tokenizer_backend=huggingface,tokenizer={tok_dir},"
            "tokenized_requests=True,num_concurrent=2,max_retries=1"
        )
        got = lm_eval.simple_evaluate(
            model="local-completions", model_args=args, tasks=["serve_mc"], task_manager=tm, log_samples=True
        )
    want = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in ref["samples"]["serve_mc"]}
    have = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in got["samples"]["serve_mc"]}
    assert sorted(have) == sorted(want) == list(range(6))
    for i in want:
        assert have[i] == pytest.approx(want[i], abs=1e-4), i
    assert got["results"]["serve_mc"]["acc,none"] == ref["results"]["serve_mc"]["acc,none"]
