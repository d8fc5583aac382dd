"""Training throughput at the SmolLM2-135M shape: looplm vs transformers, as a user meets them.

Shapes: SmolLM2-135M (30 layers, d 576, SwiGLU 1536, 9 / 3 heads, vocabulary 49,152, tied) and its
looped 10 × 3 form (same effective depth). Batch 4 × 256. bf16 autocast where the CPU has native
bf16 (AVX512-BF16 / AMX), else fp32 (``--precision`` overrides).

Contenders (each in its own process, so peak memory is its own):

* ``hf``            — ``transformers`` ``LlamaForCausalLM`` eager, a step as its Trainer does it: forward
                      with labels, backward, gradient clipping at 1.0, ``torch.optim.AdamW`` with
                      ``fused=True`` (the Trainer's default optimizer, ``adamw_torch_fused``, since
                      torch 2.8). The baseline.
* ``hf-malloc``     — the same ``hf`` step in a process whose glibc keeps freed memory
                      (:func:`looplm.utils.cpu_malloc.keep_freed_memory`, what ``looplm train`` does on a CPU):
                      how much of looplm's lead is the allocator (CPU only).
* ``looplm``        — the same step on ``looplm`` (chunked loss: no ``[B, T, V]`` logits; fused AdamW;
                      the Linear layers switched to TunedLinear where ``train.cpu_gemm: auto`` would —
                      as ``looplm train`` builds it).
* ``looplm-compiled`` — the same with every block compiled (:func:`looplm.parallel.compile_blocks`).
* ``looplm-train``  — ``looplm train`` itself with its default settings (AdamW, ``precision: auto`` or
                      the one ``--precision`` names, ``compile: auto``) configured as a long run (so
                      ``auto`` decides as for a real one) and stopped after the timed updates: the
                      tokens/s it logs (median after warm-up).

Each prints tokens/s (median of the timed steps), the ratio to ``hf`` measured in the same run, the
share of the machine's matmul ceiling (a 2048³ matmul in the same precision, measured in the same run;
model FLOPs = 6·N·tokens + attention), and the peak resident memory of its process.

    python benchmarks/bench_train.py [--steps 6] [--warmup 2] [--rounds 3] [--only hf,looplm] [--shapes flat,looped]
                                     [--device cuda --batch 16 --seq 1024]
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

from _machine import SHARED_CORPUS, cpu_name, native_bf16, sync  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

SHAPE = dict(vocab=49152, d=576, ff=1536, heads=9, kv=3, layers=30)
LAYOUTS = {"flat": (30, 1), "looped": (10, 3)}  # (physical core blocks, loops)


def matmul_ceiling(precision: str, device: str = "cpu") -> float:
    """FLOP/s of an n³ matmul in ``precision`` (median of 5; n = 2048 on CPU, 8192 on CUDA)."""
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    n = 8192 if device == "cuda" else 2048
    a, b = torch.randn(n, n, dtype=dt, device=device), torch.randn(n, n, dtype=dt, device=device)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


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


def step_loop(step, steps: int, warmup: int, tokens: int, device: str = "cpu") -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return [tokens / t for t in times]


def run_hf(args, layout: str, precision: str) -> dict:
    import transformers

    core, loops = LAYOUTS[layout]
    cfg = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["d"],
        intermediate_size=SHAPE["ff"],
        num_hidden_layers=core * loops,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv"],
        max_position_embeddings=args.seq,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, SHAPE["vocab"], (args.batch, args.seq), device=args.device)

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"tok_s": step_loop(step, args.steps, args.warmup, x.numel(), args.device)}


def run_looplm(args, layout: str, precision: str, compiled: bool) -> dict:
    import looplm
    from looplm.parallel import compile_blocks

    from looplm.kernels.gemm import tuned_linears
    from looplm.train.trainer import resolve_cpu_gemm

    model = looplm.build(looplm_config(layout, args.seq), device=args.device).train()
    if resolve_cpu_gemm("auto", torch.device(args.device), precision, fsdp=False):
        tuned_linears(model)  # as looplm train does (train.cpu_gemm: auto)
    t0 = time.perf_counter()
    if compiled:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, SHAPE["vocab"], (args.batch, args.seq), device=args.device)

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, labels=x, return_logits=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # includes compilation when compiled
    sync(args.device)
    compile_s = time.perf_counter() - t0
    return {"tok_s": step_loop(step, args.steps, args.warmup, x.numel(), args.device), "first_step_s": compile_s}


def run_looplm_train(args, layout: str, precision: str) -> dict:
    """``looplm train`` with its default settings (AdamW here, ``precision: auto`` unless ``--precision`` says
    otherwise, ``compile: auto``) on
    the byte-level tiny-Shakespeare corpus of ``../shared/data`` (or the embedded stdlib corpus); the
    tokens/s it logs (median after warm-up).

    The run is configured as a long one (``max_steps`` = 1000, so ``compile: auto`` decides as it does
    for a real run) and stopped once ``warmup + steps`` updates are logged; the first update, which
    includes compilation when it is on, is never timed."""
    import yaml

    from looplm.train.metrics import read_metrics
    from looplm.train.trainer import COMPILE_AUTO_MIN_STEPS

    data = {"source": "files", "paths": [str(SHARED_CORPUS)]} if SHARED_CORPUS.exists() else {"source": "stdlib"}
    want = args.warmup + args.steps + 1
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
                    "train": {
                        "global_batch_size": args.batch,
                        "micro_batch_size": args.batch,
                        "max_steps": max(1000, COMPILE_AUTO_MIN_STEPS),
                        "precision": args.precision,
                    },
                    "eval": {"every": 0, "at_end": False},
                    "checkpoint": {"every": 0, "at_end": False},
                    "logging": {"progress_bar": False, "tensorboard": False},
                }
            )
        )
        out = tmp / "run"
        log = open(tmp / "log.txt", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "looplm.cli", "train", str(train_yaml), "--out", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        rows: list[dict] = []
        while proc.poll() is None and len(rows) < want:
            time.sleep(1.0)
            if (out / "metrics.jsonl").exists():
                rows = read_metrics(out)  # a torn last line (the trainer is writing) is skipped
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        elif proc.returncode != 0:
            log.close()
            return {"error": (tmp / "log.txt").read_text()[-2000:]}
        log.close()
        tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1 + args.warmup : want]
        compiled = "compile: the first step" in (tmp / "log.txt").read_text()
        first = [r["compile_step_s"] for r in rows if "compile_step_s" in r]
        res = {"tok_s": tps, "compiled": compiled}
        if first:
            res["first_step_s"] = first[0]
        return res


def ratio_to(runs: dict[str, list[dict]], name: str, base: str) -> str:
    """The median over rounds of ``name``'s tokens/s over ``base``'s in the same round ("–" if none)."""
    ratios = [r["tps"] / h["tps"] for r, h in zip(runs[name], runs.get(base, [])) if "tps" in r and "tps" in h]
    return f"{statistics.median(ratios):.2f}" if ratios else "–"


def child(args) -> None:
    name, layout, precision = args.child.split(":")
    torch.manual_seed(0)
    if name in ("hf", "hf-malloc"):
        if name == "hf-malloc":
            from looplm.utils import cpu_malloc

            if not cpu_malloc.keep_freed_memory():
                print("RESULT " + json.dumps({"error": "hf-malloc needs glibc (Linux)"}))
                return
        res = run_hf(args, layout, precision)
    elif name == "looplm":
        res = run_looplm(args, layout, precision, compiled=False)
    elif name == "looplm-compiled":
        res = run_looplm(args, layout, precision, compiled=True)
    else:
        res = run_looplm_train(args, layout, precision)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    res["peak_rss_mb"] = peak / 1024  # looplm-train runs the trainer in a child process
    if args.device == "cuda":
        res["peak_rss_mb"] = torch.cuda.max_memory_allocated() / 2**20  # the GPU's peak instead
    print("RESULT " + json.dumps(res))


def main() -> None:
    from looplm import kernels

    kernels.load()  # looplm's CPU fast paths behind the model's dispatch points (built once if needed)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--only", default="hf,hf-malloc,looplm,looplm-compiled,looplm-train")
    ap.add_argument("--shapes", default="flat,looped")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then the GPU's)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every contender, alternating (noisy machines)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    fast_bf16 = args.device == "cuda" or native_bf16()
    precision = args.precision if args.precision != "auto" else ("bf16" if fast_bf16 else "fp32")
    print(f"# CPU: {cpu_name()}  ({os.cpu_count()} cores, native bf16: {native_bf16()}, torch {torch.__version__})")
    if args.device == "cuda":
        print(f"# GPU: {torch.cuda.get_device_name()} (peak memory column: torch.cuda.max_memory_allocated)")
    print(
        f"# batch {args.batch} x {args.seq}, {args.steps} timed steps after {args.warmup} warm-up; {args.rounds} "
        "round(s), contenders alternating within each; a ratio is the median over rounds of the ratio to hf "
        "in the same round"
    )
    names = args.only.split(",")
    if args.device == "cuda" and "hf-malloc" in names:
        names.remove("hf-malloc")  # the CPU allocator does not matter to a CUDA step
    for layout in args.shapes.split(","):
        flops_tok = model_flops_per_token(looplm_config(layout, args.seq), args.seq)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        ceilings = []
        for _ in range(args.rounds):
            ceilings.append(matmul_ceiling(precision, args.device))
            for name in names:
                cmd = [sys.executable, __file__, "--child", f"{name}:{layout}:{precision}"]
                cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
                cmd += ["--warmup", str(args.warmup), "--device", args.device, "--precision", args.precision]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                res = json.loads(line[7:]) if line else {"error": (proc.stderr or proc.stdout).strip()}
                if "error" not in res and not res.get("tok_s"):
                    res["error"] = "no timings"
                if "error" not in res:
                    res["tps"] = statistics.median(res["tok_s"])
                runs[name].append(res)
        ceiling = statistics.median(ceilings)
        print(f"\n# {layout}: {precision} matmul ceiling {ceiling / 1e12:.2f} TFLOP/s (median of the rounds)")
        vs_malloc = "hf-malloc" in names
        print(
            f"| shape | contender | tokens/s | vs hf |{' vs hf-malloc |' if vs_malloc else ''} share of ceiling | peak memory MB | first step s |"
        )
        print(f"| --- | --- | ---: | ---: |{' ---: |' if vs_malloc else ''} ---: | ---: | ---: |")
        shape = f"{layout} ({LAYOUTS[layout][0]}x{LAYOUTS[layout][1]})"
        for name in names:
            good = [r for r in runs[name] if "error" not in r]
            if not good:
                print(
                    f"| {shape} | {name} | failed: {runs[name][0]['error'][-300:]!r} | | | | |{' |' if vs_malloc else ''}"
                )
                continue
            tps = statistics.median(r["tps"] for r in good)
            ratio = ratio_to(runs, name, "hf") + (f" | {ratio_to(runs, name, 'hf-malloc')}" if vs_malloc else "")
            first = [r["first_step_s"] for r in good if "first_step_s" in r]
            first_s = f"{statistics.median(first):.1f}" if first else ""
            peak = max(r["peak_rss_mb"] for r in good)
            label = f"{name} (compiled: {'yes' if good[0]['compiled'] else 'no'})" if "compiled" in good[0] else name
            print(
                f"| {shape} | {label} | {tps:,.0f} | {ratio} | {tps * flops_tok / ceiling:.0%} | {peak:,.0f} | {first_s} |"
            )


if __name__ == "__main__":
    main()
