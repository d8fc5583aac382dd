"""Forward+backward training throughput: looplm looped Llama vs transformers LlamaForCausalLM.

Same computation on both sides: the looped model runs ``s`` shared blocks ``K`` times, the
transformers baseline has ``s·K`` distinct blocks of the same width (same effective depth), same
batch, same loss. Prints tokens/s (median of repeats) and the ratio looplm / transformers, for fp32
and bf16 autocast, measured in one run on this machine.

    python benchmarks/bench_vs_hf.py [--d-model 512] [--core 2] [--loops 4] [--batch 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def make_models(args):
    import transformers

    import looplm

    ours = looplm.build(
        {
            "name": "bench-looped-llama",
            "vocab_size": args.vocab,
            "d_model": args.d_model,
            "n_core": args.core,
            "n_loops": args.loops,
            "d_ff": args.d_ff,
            "attention": {"n_heads": args.heads, "n_kv_heads": args.kv_heads, "rope_theta": 500000.0},
            "max_seq_len": args.seq,
        }
    )
    hf_cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_ff,
        num_hidden_layers=args.core * args.loops,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    return ours, hf


def time_steps(model, x, precision: str, steps: int, warmup: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def main():
    from looplm import kernels

    kernels.load()  # looplm's CPU fast paths behind the model's dispatch points (built once if needed)
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--core", type=int, default=2)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (ours, hf) per precision")
    ap.add_argument("--compile", action="store_true", help="also time both models under torch.compile")
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16", "both"],
        default="both",
        help="bf16 autocast is very slow on CPUs without native bf16 (AVX2-only): fp32 is then the useful one",
    )
    args = ap.parse_args()

    import transformers

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} threads={torch.get_num_threads()}"
    )
    from looplm.train.trainer import cpu_has_fast_bf16

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, native CPU bf16: {cpu_has_fast_bf16()}")
    print(
        f"model: d={args.d_model} ff={args.d_ff} heads={args.heads}/{args.kv_heads} vocab={args.vocab}; "
        f"looplm {args.core} blocks x {args.loops} loops vs transformers {args.core * args.loops} blocks; "
        f"batch {args.batch} x {args.seq}"
    )
    torch.manual_seed(0)
    ours, hf = make_models(args)
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    tokens = args.batch * args.seq
    print(f"{'precision':10s} {'looplm tok/s':>14s} {'hf tok/s':>12s} {'ratio':>7s}")
    for precision in ("fp32", "bf16") if args.precision == "both" else (args.precision,):
        ours_t, hf_t = [], []
        for _ in range(args.rounds):  # alternate to spread machine noise over both
            ours_t += time_steps(ours, x, precision, args.steps, args.warmup)
            hf_t += time_steps(hf, x, precision, args.steps, args.warmup)
        a, b = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
        print(f"{precision:10s} {a:14.0f} {b:12.0f} {a / b:7.2f}")
        if args.compile:
            c_ours, c_hf = torch.compile(ours), torch.compile(hf)
            ours_t, hf_t = [], []
            for _ in range(args.rounds):
                ours_t += time_steps(c_ours, x, precision, args.steps, args.warmup)
                hf_t += time_steps(c_hf, x, precision, args.steps, args.warmup)
            a, b = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
            print(f"{precision + '+compile':10s} {a:14.0f} {b:12.0f} {a / b:7.2f}")


if __name__ == "__main__":
    main()
