"""bf16 agreement of the serving engine: greedy tokens of ``looplm.serve.Engine`` in bf16 against the fp32
reference (``model.generate`` of each prompt alone, fp32), at full depth and under per-token exit.

In fp32 the engine's greedy output equals ``generate`` alone token for token (``tests/test_serve_engine.py``);
bf16 rounds every product, so a sequence may take another token where two candidates are close, and after that
the two continuations differ. This script measures how often, on a trained model: per setting, the share of
requests whose whole output is identical, the share of tokens that agree before the first difference (the
common prefix over all tokens), and the first-difference position; and, to separate rounding from batching,
whether each bf16 request equals bf16 ``generate`` of its prompt alone (the last column). Prompts are held-out speeches of the
corpus the bench LM was trained on; the engine runs them all at once through ``--max-batch`` rows.

    python benchmarks/check_serve_bf16.py --runs-dir RUNS          # RUNS/lm: the d = 1024 bench LM
    python benchmarks/check_serve_bf16.py --model tiny-coreloop     # a random preset (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
from pathlib import Path

import torch

from _machine import SHARED_CORPUS, cpu_info, native_bf16


def _engine_tokens(model, prompts, new, exit, max_batch):
    from looplm.serve import Engine, EngineConfig, FinishEvent, SamplingParams, TokenEvent

    eng = Engine(model, EngineConfig(max_batch=max_batch, exit=exit)).start()
    try:
        outs = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def cb(ev, i):
            if isinstance(ev, TokenEvent):
                outs[i].append(ev.token_id)
            elif isinstance(ev, FinishEvent):
                done[i].set()

        for i, p in enumerate(prompts):
            eng.submit(p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), lambda ev, i=i: cb(ev, i))
        for d in done:
            if not d.wait(600):
                raise SystemExit("the engine did not finish in 600 s")
        return outs
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--runs-dir", help="the folder whose lm/ holds the trained bench LM")
    src.add_argument("--model", help="a preset with random weights (a smoke run)")
    ap.add_argument("--data", default=str(SHARED_CORPUS), help="the LM's corpus (held-out prompts)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--exits", default="none,kl:0.01", help="comma-separated: 'none' (full depth) and exit specs")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    bad = [
        f"--{k.replace('_', '-')} {v} (give an int >= 1)"
        for k, v in (("prompts", a.prompts), ("prompt_len", a.prompt_len), ("new", a.new), ("max_batch", a.max_batch))
        if v < 1
    ]
    if bad:
        ap.error("; ".join(bad))
    if a.threads:
        torch.set_num_threads(a.threads)
    if not native_bf16():
        print("note: this CPU has no native bf16 (AVX512-BF16 / AMX): bf16 runs emulated, slowly", file=sys.stderr)
    import looplm

    if a.runs_dir:
        from looplm.bench.adaptive.models import _held_out, load_lm

        model, tok = load_lm(Path(a.runs_dir))
        prompts = _held_out(tok, a.data, a.prompts, a.prompt_len).tolist()
        what = f"{a.runs_dir}/lm"
    else:
        torch.manual_seed(0)
        model = looplm.build(a.model).eval()
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, min(250, model.config.vocab_size), (a.prompts, a.prompt_len), generator=g).tolist()
        what = f"{a.model} (random weights)"
    model = model.float().eval()
    exits = [e.strip() for e in a.exits.split(",") if e.strip()]
    print(
        f"# serve bf16 agreement — {what}, K={model.config.n_loops}, {a.prompts} prompts × {a.prompt_len} tokens, "
        f"{a.new} new, max_batch {a.max_batch}"
    )
    print(f"# {cpu_info(torch.get_num_threads())}, torch {torch.__version__}, {datetime.date.today()}")
    print()
    print(
        "| setting | identical outputs | tokens agreeing (common prefix) | first difference (median position) | engine fp32 = generate fp32 | engine bf16 = generate bf16 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for ex in exits:
        spec = None if ex == "none" else ex
        with torch.no_grad():
            refs = [model.generate(torch.tensor([p]), a.new, exit=spec)[0, len(p) :].tolist() for p in prompts]
        fp32 = _engine_tokens(model, prompts, a.new, spec, a.max_batch)
        bf = _engine_tokens(model.to(torch.bfloat16), prompts, a.new, spec, a.max_batch)
        with torch.no_grad():  # the same rounding alone: does a bf16 request depend on its batch?
            bf_alone = [model.generate(torch.tensor([p]), a.new, exit=spec)[0, len(p) :].tolist() for p in prompts]
        model = model.float()
        same = sum(o == r for o, r in zip(bf, refs))
        firsts = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(r)) for o, r in zip(bf, refs)]
        diffs = sorted(f for f in firsts if f < a.new)
        med = "—" if not diffs else str(diffs[len(diffs) // 2])
        exact = sum(o == r for o, r in zip(fp32, refs))
        exact_bf = sum(o == r for o, r in zip(bf, bf_alone))
        print(
            f"| {'full depth' if spec is None else spec} | {same}/{len(prompts)} | {sum(firsts) / (a.new * len(prompts)):.1%} | "
            f"{med} | {exact}/{len(prompts)} | {exact_bf}/{len(prompts)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
