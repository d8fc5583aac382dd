"""Serve model directories with vLLM's offline ``LLM`` and write what it produced, as JSON.

Run by the tests as ``python serve_tiny.py JOB.json OUT.json`` (a subprocess: vLLM's engine state stays
out of pytest). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor), so one process serves every directory of the job in turn, a few seconds each.

Job: ``{"runs": [{"name", "dir", "prompts": [[ids]], "max_tokens", "alone": bool, "hf_overrides": {} | null,
"tensor_parallel_size": int, "llm_kwargs": {}, "exit_stats": bool, "extra_args": [{} | null], "refused": [{}]}]}``.
``max_tokens`` is one int, or one per prompt; ``extra_args`` (optional) gives each prompt's
``SamplingParams.extra_args``; each entry of ``refused`` (optional) is submitted alone with those ``extra_args`` after
the batch, and its result is the error it raised (``None`` if it ran). A run of more than one rank (``tensor_parallel_size``, or ``pipeline_parallel_size`` in ``llm_kwargs``)
uses vLLM's multiprocess executor (one spawned worker per rank, bound to the cores of ``VLLM_CPU_OMP_THREADS_BIND``,
e.g. ``0|1``); the others run in this process. ``llm_kwargs`` go to ``LLM`` as given, over the defaults
(``enforce_eager=True``, ...); with ``exit_stats`` the result holds the model's per-token
exit counters (``LoopLMForCausalLM.exit_stats``) after the batch (with per-request thresholds, ``row_updates``: the
batch updates their logits processor saw).
Each run's result: the greedy tokens, their logprobs and the prompt logprobs of every prompt submitted
together (one batch), and, with ``alone``, of each prompt submitted by itself; or ``error`` when the model
did not load (the plugin's refusals).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def _out(o) -> dict:
    c = o.outputs[0]
    toks = list(c.token_ids)
    prompt = list(o.prompt_token_ids)
    return {
        "tokens": toks,
        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, toks)],
        "prompt_logprobs": [None] + [pl[t].logprob for pl, t in zip(o.prompt_logprobs[1:], prompt[1:])],
    }


def _exit_stats(model) -> dict:
    out = dict(model.exit_stats)
    if getattr(model, "request_thresholds", False):  # per-request thresholds: the batch updates the processor saw
        from looplm.vllm.thresholds import installed

        out["row_updates"] = dict(installed().counts)
    return out


def main(job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    import looplm.vllm

    looplm.vllm.register()  # again (vLLM's plugin loader calls it too): must be harmless
    looplm.vllm.register()
    job = json.loads(open(job_path).read())
    results = {
        "registered": {a: a in ModelRegistry.get_supported_archs() for a in looplm.vllm.ARCHITECTURES},
        "runs": [],
    }
    for r in job["runs"]:
        res, t0 = {"name": r["name"]}, time.time()
        llm = None
        tp = r.get("tensor_parallel_size", 1)
        try:
            kw = dict(
                dtype="float32",
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=512,
                max_num_seqs=16,
                seed=0,
                tensor_parallel_size=tp,
                hf_overrides=r.get("hf_overrides"),
            )
            kw |= r.get("llm_kwargs", {})  # pipeline_parallel_size, enforce_eager, ... as given
            ranks = tp * kw.get("pipeline_parallel_size", 1)
            kw.setdefault("distributed_executor_backend", "uni" if ranks == 1 else "mp")
            llm = LLM(model=r["dir"], **kw)
            pc = llm.llm_engine.vllm_config.parallel_config
            res["tensor_parallel_size"], res["pipeline_parallel_size"] = (
                pc.tensor_parallel_size,
                pc.pipeline_parallel_size,
            )

            def params(max_tokens, extra_args=None):
                return SamplingParams(
                    temperature=0.0,
                    max_tokens=max_tokens,
                    logprobs=0,
                    prompt_logprobs=0,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args=extra_args,
                )

            n = len(r["prompts"])
            mt = r["max_tokens"] if isinstance(r["max_tokens"], list) else [r["max_tokens"]] * n
            sp = params(mt[0])
            if "extra_args" in r or isinstance(r["max_tokens"], list):
                sp = [params(m, x) for m, x in zip(mt, r.get("extra_args") or [None] * n, strict=True)]
            prompts = [{"prompt_token_ids": p} for p in r["prompts"]]
            res["together"] = [_out(o) for o in llm.generate(prompts, sp, use_tqdm=False)]
            if r.get("exit_stats"):
                res["exit_stats"] = llm.apply_model(_exit_stats)[0]
            if r.get("refused"):
                res["refused"] = []
                for x in r["refused"]:
                    try:
                        llm.generate(prompts[:1], params(mt[0], x), use_tqdm=False)
                        res["refused"].append(None)
                    except Exception as e:
                        res["refused"].append(f"{type(e).__name__}: {e}")
                if r.get("exit_stats"):
                    res["exit_stats_after_refused"] = llm.apply_model(_exit_stats)[0]
            if r.get("alone"):
                one = sp if isinstance(sp, list) else [sp] * n
                res["alone"] = [_out(llm.generate([p], s, use_tqdm=False)[0]) for p, s in zip(prompts, one)]
        except Exception as e:  # a refusal: the message is what the test checks
            res["error"] = f"{type(e).__name__}: {e}"
        res["seconds"] = round(time.time() - t0, 2)
        # code from a model directory would be imported as transformers_modules.*: none may be
        res["remote_modules"] = sorted(m for m in sys.modules if m.startswith("transformers_modules"))
        results["runs"].append(res)
        print(f"{r['name']}: {res['seconds']} s{' (refused)' if 'error' in res else ''}", file=sys.stderr, flush=True)
        del llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
