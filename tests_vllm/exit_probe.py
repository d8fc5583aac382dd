"""Per-token exit inside vLLM on a d = 1024 LM: the decode step's time at full depth and at forced depths.

``python tests_vllm/exit_probe.py [BATCH PROMPT_LEN NEW]`` (default 8 64 32; in ``.venv-vllm``; docs/vllm.md#exits)
serves a random model of the bench LM's architecture (``configs/bench/adaptive-lm-1024.yaml``: 2 shared blocks x
K = 4 loops, d = 1024, 16 heads of 64, d_ff 2816, byte vocabulary) with vLLM's offline ``LLM`` through the plugin,
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), once per setting of ``SETTINGS``:
full depth, the exit path with no exit (its overhead), and every decode token exiting after loop 3 or 2. Random
weights give a criterion's depths no meaning, so the depth is forced (``convergence`` at a huge ε, ``min_loops``).
Through ``LLM.apply_model`` hooks it times each decode step's forward and the vLLM ``Attention`` calls in it (the
KV write and paged attention of every slot, which the exited tokens still run), and reads the model's exit
counters (decode tokens, the core loops they ran). It also prints what the forward context offers the model.
Not a test (pytest does not collect it).
"""

from __future__ import annotations

import os
import sys
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
SETTINGS = [
    ("full depth", None),
    ("exit path, ε = 0", {"criterion": "convergence", "threshold": 0.0}),
    ("exit after loop 3", {"criterion": "convergence", "threshold": 1e9, "min_loops": 3}),
    ("exit after loop 2", {"criterion": "convergence", "threshold": 1e9}),
]


def _stats(model) -> dict:
    return {"steps": model._exit_probe["steps"], "context": model._exit_probe["context"], **model.exit_stats}


def _reset(model) -> None:
    model._exit_probe["steps"].clear()
    model.exit_stats.update(decode_tokens=0, executed_loops=0, forwards=0)


def main(batch: int = 8, prompt_len: int = 64, new: int = 32) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    import torch

    import looplm
    from looplm.hf.export import export_hf

    torch.manual_seed(0)
    model = looplm.build(looplm.load_model_config("tiny-llama", LM1024)).float().eval()
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (prompt_len,), generator=g).tolist()} for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    K = LM1024["n_loops"]
    print(f"batch {batch}, prompt {prompt_len}, {new} new tokens each; K = {K}")
    print("| setting | tokens/s | ms per decode step | of it attention | loops per decode token |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, Path(tmp) / "lm1024", tokenizer="byte", overwrite=True)
        del model
        for name, ex in SETTINGS:
            llm = LLM(
                model=str(Path(tmp) / "lm1024"),
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
            llm.apply_model(_install)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)
            llm.apply_model(_reset)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            st = llm.apply_model(_stats)[0]
            dec = [s for s in st["steps"] if s["requests"] == s["tokens"] == batch]
            fwd = sum(s["seconds"] for s in dec)
            att = sum(s["attention_seconds"] for s in dec)
            loops = st["executed_loops"] / st["decode_tokens"] if st["decode_tokens"] else float(K)
            print(
                f"| {name} | {batch * new / wall:.1f} | {1e3 * fwd / len(dec):.1f} | {100 * att / fwd:.0f} % | "
                f"{loops:.2f} |",
                flush=True,
            )
            del llm
            gc.collect()
            destroy_model_parallel()
            destroy_distributed_environment()
    print(f"forward context: {st['context']}")


if __name__ == "__main__":  # python tests_vllm/exit_probe.py [BATCH PROMPT_LEN NEW]
    main(*(int(a) for a in sys.argv[1:4]))
