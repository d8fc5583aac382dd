"""Per-token exit inside vLLM on a d = 1024 LM: the decode step's time and loops at full depth and with exits.

Two modes (in ``.venv-vllm``; docs/vllm.md#exits). Not a test (pytest does not collect it).

* ``python tests_vllm/exit_probe.py [--batch 8 --prompt-len 64 --new 32]`` serves a *random* model of the bench
  LM's architecture (``configs/bench/adaptive-lm-1024.yaml``: 2 shared blocks x K = 4 loops, d = 1024, 16 heads of
  64, d_ff 2816, byte vocabulary). Random weights give a criterion's depths no meaning, so the depth is forced
  (``convergence`` at a huge ε, ``min_loops``): full depth, the exit path with no exit (its overhead), and every
  decode token exiting after loop 3 or 2 (``FORCED``).
* ``python tests_vllm/exit_probe.py --hf-dir RUNS/serve-bench/hf --data ../shared/data/tinyshakespeare.txt
  --settings none,kl:0.01,kl:0.05 --looplm-dir RUNS/serve-bench/lm`` serves the *trained* LM (its Hugging Face export) on held-out prompts of the
  corpus (``looplm.bench.serve.held_out_prompts``, as ``looplm bench serve`` picks them) at full depth and at
  each criterion, and prints beside vLLM's loops per decode token those of looplm's own ``generate(exit=...)``
  on the same prompts (each alone, in this process: the reference the plugin's exits follow).

vLLM's offline ``LLM`` runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), once
per setting. Through ``LLM.apply_model`` hooks it times each decode step's forward and the vLLM ``Attention``
calls in it (the KV write and paged attention of every slot, which the exited tokens still run), and reads the
model's exit counters (decode tokens, the core loops they ran). It also prints what the forward context offers
the model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

LM1024 = {
    "d_model": 1024,
    "n_core": 2,
    "n_loops": 4,
    "d_ff": 2816,
    "max_seq_len": 512,
    "attention.n_heads": 16,
    "attention.n_kv_heads": 16,
    "attention.head_dim": 64,
}


def _install(model):
    """Time the forward and every Attention slot's call; count core passes; note the forward context."""
    from vllm.forward_context import get_forward_context

    st = model._exit_probe = {"steps": [], "context": None}
    cur = {}

    def pre_attn(mod, args):
        cur["t_attn0"] = time.perf_counter()

    def post_attn(mod, args, out):
        cur["attn"] += time.perf_counter() - cur["t_attn0"]

    for a in model.attn_slots:
        a.register_forward_pre_hook(pre_attn)
        a.register_forward_hook(post_attn)

    def pre_core(mod, args):
        cur["core_blocks"] += 1

    for b in model.core.stack.blocks:
        b.register_forward_pre_hook(pre_core)

    def pre(mod, args, kwargs):
        cur.update(t0=time.perf_counter(), attn=0.0, core_blocks=0)  # (with exits: core block calls, any rows)

    def post(mod, args, kwargs, out):
        n = int(out.shape[0])
        fc = get_forward_context()
        md = fc.attn_metadata
        qsl = None
        if isinstance(md, dict) and md:
            first = next(iter(md.values()))
            qsl = getattr(first, "query_start_loc", None)
            if st["context"] is None and qsl is not None:
                names = list(md)
                st["context"] = {
                    "metadata_type": type(first).__name__,
                    "metadata_fields": sorted(first.__dataclass_fields__),
                    "layers_with_metadata": len(names),
                    "one_object_for_every_slot": all(md[k] is first for k in names),
                    "slot_mapping_layers": len(fc.slot_mapping),
                    "one_slot_mapping_for_every_slot": all(
                        fc.slot_mapping[k] is fc.slot_mapping[names[0]] for k in names
                    ),
                }
        reqs = None if qsl is None else int(qsl.numel() - 1)
        st["steps"].append(
            {
                "tokens": n,
                "requests": reqs,
                "seconds": time.perf_counter() - cur["t0"],
                "attention_seconds": cur["attn"],
                "loops": cur["core_blocks"] / len(model.core.stack.blocks),
            }
        )

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


# (name, looplm_exit): full depth; the exit path with no exit (ε = 0: its overhead); every decode token exiting
# after loop 2 or 3 of 4 (ε huge: the criterion holds from loop 2 on, min_loops 3 holds it back one loop)
FORCED = [
    ("full depth", None),
    ("exit path, ε = 0", {"criterion": "convergence", "threshold": 0.0}),
    ("exit after loop 3", {"criterion": "convergence", "threshold": 1e9, "min_loops": 3}),
    ("exit after loop 2", {"criterion": "convergence", "threshold": 1e9}),
]


def _settings(spec: str) -> list[tuple[str, dict | None]]:
    """``none,kl:0.01,convergence:0.05`` -> ``[(name, looplm_exit)]`` (``none``: full depth)."""
    out = []
    for item in spec.split(","):
        if item == "none":
            out.append(("full depth", None))
            continue
        crit, _, t = item.partition(":")
        if crit not in ("kl", "convergence", "gate") or not t:
            raise SystemExit(f"--settings: {item!r} is not none or CRITERION:THRESHOLD (kl, convergence, gate)")
        out.append((item, {"criterion": crit, "threshold": float(t)}))
    return out


def _stats(model) -> dict:
    return {"steps": model._exit_probe["steps"], "context": model._exit_probe["context"], **model.exit_stats}


def _reset(model) -> None:
    model._exit_probe["steps"].clear()
    model.exit_stats.update(decode_tokens=0, executed_loops=0, forwards=0)


def _looplm_loops(looplm_dir: str | None, prompts: list[list[int]], new: int, ex: dict | None) -> float | None:
    """looplm's own loops per decode token on ``prompts`` (each alone): ``generate(exit=...)`` of the run or
    checkpoint ``looplm_dir`` (the weights the export holds)."""
    if ex is None or looplm_dir is None:
        return None
    import torch

    from looplm.checkpoint_io import load_model_for_inference
    from looplm.decode.exits import Exit

    model, _ = load_model_for_inference(looplm_dir)
    model = model.float().eval()
    loops = steps = 0
    with torch.no_grad():
        for p in prompts:
            _, st = model.generate(torch.tensor([p]), max_new_tokens=new, exit=Exit(**ex), return_stats=True)
            loops += int(sum(int(e.sum()) for e in st.executed))  # one entry per decode step (the prompt's excluded)
            steps += len(st.executed)
    return loops / steps


def main(batch, prompt_len, new, hf_dir=None, data=None, settings=None, looplm_dir=None) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    import torch

    import looplm
    from looplm.hf.export import export_hf

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    if hf_dir is None:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (prompt_len,), generator=g).tolist() for _ in range(batch)]
        runs, K = FORCED if settings is None else _settings(settings), LM1024["n_loops"]
    else:
        from looplm.bench.serve import held_out_prompts
        from looplm.data.tokenizers import load_tokenizer

        tok = load_tokenizer("byte")
        prompts = [tok.encode(t) for t in held_out_prompts(tok, data, batch, prompt_len)]
        runs, K = _settings(settings or "none,kl:0.01"), None
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    print(f"batch {batch}, prompt {prompt_len}, {new} new tokens each; {hf_dir or 'random LM1024 weights'}")
    print("| setting | tokens/s | ms per decode step | of it attention | loops per decode token | looplm generate's |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        if hf_dir is None:
            model = looplm.build(looplm.load_model_config("tiny-llama", LM1024)).float().eval()
            export_hf(model, Path(tmp) / "lm1024", tokenizer="byte", overwrite=True)
            del model
            served = Path(tmp) / "lm1024"
        else:
            served = Path(hf_dir)
        for name, ex in runs:
            llm = LLM(
                model=str(served),
                dtype="float32",
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=512,
                max_num_seqs=batch,
                seed=0,
                distributed_executor_backend="uni",
                enable_prefix_caching=False,
                enable_chunked_prefill=False,
                hf_overrides=None if ex is None else {"looplm_exit": ex},
            )
            if K is None:
                K = llm.apply_model(lambda m: m.spec.num_loops)[0]
            llm.apply_model(_install)
            warm = [{"prompt_token_ids": prompts[0]}]
            llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)
            llm.apply_model(_reset)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            st = llm.apply_model(_stats)[0]
            dec = [s for s in st["steps"] if s["requests"] == s["tokens"] == batch]
            fwd = sum(s["seconds"] for s in dec)
            att = sum(s["attention_seconds"] for s in dec)
            loops = st["executed_loops"] / st["decode_tokens"] if st["decode_tokens"] else float(K)
            ref = _looplm_loops(looplm_dir, prompts, new, ex)
            print(
                f"| {name} | {batch * new / wall:.1f} | {1e3 * fwd / len(dec):.1f} | {100 * att / fwd:.0f} % | "
                f"{loops:.2f} | {'–' if ref is None else f'{ref:.2f}'} |",
                flush=True,
            )
            del llm
            gc.collect()
            destroy_model_parallel()
            destroy_distributed_environment()
    print(f"forward context: {st['context']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hf-dir", help="a trained LM's Hugging Face export (default: random LM1024 weights)")
    ap.add_argument("--data", help="the corpus whose held-out documents are the prompts (with --hf-dir)")
    ap.add_argument("--settings", help="none,kl:0.01,... (default: forced depths; with --hf-dir none,kl:0.01)")
    ap.add_argument("--looplm-dir", help="the same LM's looplm run or checkpoint: looplm generate's loops beside")
    a = ap.parse_args()
    main(a.batch, a.prompt_len, a.new, a.hf_dir, a.data, a.settings, a.looplm_dir)
