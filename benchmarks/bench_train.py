"""Training throughput at the SmolLM2-135M shape: looplm vs transformers, as a user meets them.

Shapes: SmolLM2-135M (30 layers, d 576, SwiGLU 1536, 9 / 3 heads, vocabulary 49,152, tied) and its
looped 10 × 3 form (same effective depth). Batch 4 × 256. bf16 autocast where the CPU has native
bf16 (AVX512-BF16 / AMX), else fp32 (``--precision`` overrides).

Contenders (each in its own process, so peak memory is its own):

* ``hf``            — ``transformers`` ``LlamaForCausalLM`` eager, a step as its Trainer does it: forward
                      with labels, backward, gradient clipping at 1.0, ``torch.optim.AdamW``. The baseline.
* ``looplm``        — the same step on ``looplm`` (chunked loss: no ``[B, T, V]`` logits).
* ``looplm-compiled`` — the same with every block compiled (:func:`looplm.parallel.compile_blocks`).
* ``looplm-train``  — ``looplm train`` itself with its default settings (AdamW, ``precision: auto``,
                      ``compile: auto``) on synthetic tokens: the tokens/s it logs (median after warm-up).

Each prints tokens/s (median of the timed steps), the ratio to ``hf`` measured in the same run, the
share of the machine's matmul ceiling (a 2048³ matmul in the same precision, measured in the same run;
model FLOPs = 6·N·tokens + attention), and the peak resident memory of its process.

    python benchmarks/bench_train.py [--steps 6] [--warmup 2] [--only hf,looplm] [--shapes flat,looped]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _machine import cpu_name, native_bf16  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

SHAPE = dict(vocab=49152, d=576, ff=1536, heads=9, kv=3, layers=30)
LAYOUTS = {"flat": (30, 1), "looped": (10, 3)}  # (physical core blocks, loops)


def matmul_ceiling(precision: str) -> float:
    """FLOP/s of a 2048³ matmul in ``precision`` (median of 5)."""
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / statistics.median(times)


def looplm_config(layout: str, seq: int) -> dict:
    core, loops = LAYOUTS[layout]
    return {
        "name": f"smollm2-135m-shape-{layout}",
        "vocab_size": SHAPE["vocab"],
        "d_model": SHAPE["d"],
        "n_core": core,
        "n_loops": loops,
        "d_ff": SHAPE["ff"],
        "attention": {"n_heads": SHAPE["heads"], "n_kv_heads": SHAPE["kv"], "rope_theta": 100000.0},
        "tie_embeddings": True,
        "max_seq_len": seq,
    }


def model_flops_per_token(model_cfg: dict, seq: int) -> float:
    """6·N (N = non-embedding matmul parameters × executed depth, plus the head) + causal attention."""
    import looplm

    m = looplm.build(model_cfg, device="meta")
    d, V = SHAPE["d"], SHAPE["vocab"]
    depth = model_cfg["n_core"] * model_cfg["n_loops"]
    per_block = sum(p.numel() for p in m.core.stack.blocks[0].parameters() if p.dim() == 2)
    n = per_block * depth + V * d
    attn = depth * 2 * 2 * (seq + 1) / 2 * SHAPE["heads"] * (d // SHAPE["heads"])  # QK^T and AV, fwd
    return 6 * n + 3 * attn


def step_loop(step, steps: int, warmup: int, tokens: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return [tokens / t for t in times]


def run_hf(args, layout: str, precision: str) -> dict:
    import transformers

    core, loops = LAYOUTS[layout]
    cfg = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab"], hidden_size=SHAPE["d"], intermediate_size=SHAPE["ff"],
        num_hidden_layers=core * loops, num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv"],
        max_position_embeddings=args.seq, rope_theta=100000.0, tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, SHAPE["vocab"], (args.batch, args.seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"tok_s": step_loop(step, args.steps, args.warmup, x.numel())}


def run_looplm(args, layout: str, precision: str, compiled: bool) -> dict:
    import looplm
    from looplm.parallel import compile_blocks

    model = looplm.build(looplm_config(layout, args.seq)).train()
    t0 = time.perf_counter()
    if compiled:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, SHAPE["vocab"], (args.batch, args.seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, labels=x, return_logits=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # includes compilation when compiled
    compile_s = time.perf_counter() - t0
    return {"tok_s": step_loop(step, args.steps, args.warmup, x.numel()), "first_step_s": compile_s}


def run_looplm_train(args, layout: str, precision: str) -> dict:
    """``looplm train`` with its default settings (AdamW here, ``precision: auto``, ``compile: auto``) on
    the byte-level tiny-Shakespeare corpus of ``../shared/data`` (or the embedded stdlib corpus); the
    tokens/s it logs (median after warm-up)."""
    import yaml

    corpus = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    data = {"source": "files", "paths": [str(corpus)]} if corpus.exists() else {"source": "stdlib"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_yaml = tmp / "model.yaml"
        model_yaml.write_text(yaml.safe_dump(looplm_config(layout, args.seq)))
        train_yaml = tmp / "train.yaml"
        train_yaml.write_text(
            yaml.safe_dump(
                {
                    "model": str(model_yaml),
                    "data": {**data, "seq_len": args.seq},
                    "optim": {"name": "adamw"},
                    "train": {"global_batch_size": args.batch, "micro_batch_size": args.batch,
                              "max_steps": args.steps + args.warmup, "precision": "auto"},
                    "eval": {"every": 0, "at_end": False},
                    "checkpoint": {"every": 0, "at_end": False},
                    "logging": {"progress_bar": False, "tensorboard": False},
                }  # fmt: skip
            )
        )
        out = tmp / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "looplm.cli", "train", str(train_yaml), "--out", str(out)],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][args.warmup :]
        return {"tok_s": tps}


def child(args) -> None:
    name, layout, precision = args.child.split(":")
    torch.manual_seed(0)
    if name == "hf":
        res = run_hf(args, layout, precision)
    elif name == "looplm":
        res = run_looplm(args, layout, precision, compiled=False)
    elif name == "looplm-compiled":
        res = run_looplm(args, layout, precision, compiled=True)
    else:
        res = run_looplm_train(args, layout, precision)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    res["peak_rss_mb"] = peak / 1024  # looplm-train runs the trainer in a child process
    print("RESULT " + json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--only", default="hf,looplm,looplm-compiled,looplm-train")
    ap.add_argument("--shapes", default="flat,looped")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    precision = args.precision if args.precision != "auto" else ("bf16" if native_bf16() else "fp32")
    ceiling = matmul_ceiling(precision)
    print(f"# CPU: {cpu_name()}  ({os.cpu_count()} cores, native bf16: {native_bf16()}, torch {torch.__version__})")
    print(f"# precision {precision}; {precision} matmul ceiling {ceiling / 1e12:.2f} TFLOP/s (2048^3, same run)")
    print(f"# batch {args.batch} x {args.seq}, {args.steps} timed steps after {args.warmup} warm-up")
    print("| shape | contender | tokens/s | vs hf | share of ceiling | peak RSS MB | first step s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for layout in args.shapes.split(","):
        flops_tok = model_flops_per_token(looplm_config(layout, args.seq), args.seq)
        base = None
        for name in args.only.split(","):
            cmd = [sys.executable, __file__, "--child", f"{name}:{layout}:{precision}"]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"| {layout} | {name} | failed: {(proc.stderr or proc.stdout).strip()[-300:]!r} | | | | |")
                continue
            res = json.loads(line[7:])
            if "error" in res or not res.get("tok_s"):
                print(f"| {layout} | {name} | failed: {res.get('error', 'no timings')[-300:]!r} | | | | |")
                continue
            tps = statistics.median(res["tok_s"])
            if name == "hf":
                base = tps
            ratio = f"{tps / base:.2f}" if base else "–"
            share = tps * flops_tok / ceiling
            first = f"{res['first_step_s']:.1f}" if "first_step_s" in res else ""
            print(f"| {layout} ({LAYOUTS[layout][0]}x{LAYOUTS[layout][1]}) | {name} | {tps:,.0f} | {ratio} | {share:.0%} | {res['peak_rss_mb']:,.0f} | {first} |")


if __name__ == "__main__":
    main()
