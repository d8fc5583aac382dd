"""Peak training memory vs loop count K, with and without per-loop activation checkpointing.

Every setting runs one forward + backward of a small looped Llama-style model in a *fresh*
subprocess, so measurements do not contaminate each other:

* CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (peak resident memory) minus the resident
  memory just before the step (model, gradients and allocator warm-up already there), i.e. the
  memory the step itself needed (activations kept for backward + temporaries). The children run
  with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set at once;
  with glibc's default dynamic threshold, heap fragmentation inflates the peak RSS.
* CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated()`` minus the allocation before the step.

Usage::

    python benchmarks/bench_train_memory.py                 # K = 1 2 4 8, CPU
    python benchmarks/bench_train_memory.py --device cuda --batch 16 --seq-len 2048 --d-model 512

Target: with checkpointing, K=8 needs at most 1.5x the memory of K=1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    import resource

    import torch

    import looplm
    from looplm.parallel import apply_activation_checkpointing

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = looplm.build(
        "tiny-llama",
        n_loops=args.loops,
        d_model=args.d_model,
        d_ff=args.d_model * 11 // 4,
        max_seq_len=args.seq_len,
        overrides={"attention.n_heads": 4, "attention.n_kv_heads": 2},
    ).to(dev)
    if args.checkpointing:
        apply_activation_checkpointing(model)
    # warm-up on a tiny input: allocates .grad and the allocator's bookkeeping, not activations
    w = torch.randint(0, 256, (1, 8), device=dev)
    model(w, labels=w).loss.backward()
    x = torch.randint(0, 256, (args.batch, args.seq_len), device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    loss = model(x, labels=x).loss
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        json.dumps(
            {"step_bytes": peak - before, "before_bytes": before, "peak_bytes": peak, "params": model.num_params()}
        )
    )


def main() -> None:
    from looplm import kernels

    kernels.load()  # looplm's CPU fast paths behind the model's dispatch points (built once if needed)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.loops = args.loops[0]
        child(args)
        return

    # glibc: serve every allocation >= 64 KiB with its own mmap, returned to the OS on free. Otherwise
    # heap fragmentation (not live tensors) dominates the peak RSS and grows with the number of loops.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    results = {}
    for ckpt in (False, True):
        for k in args.loops:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--loops",
                str(k),
                "--batch",
                str(args.batch),
                "--seq-len",
                str(args.seq_len),
                "--d-model",
                str(args.d_model),
                "--device",
                args.device,
            ]
            if ckpt:
                cmd.append("--checkpointing")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            results[(ckpt, k)] = json.loads(out.stdout.strip().splitlines()[-1])
    MiB = 2**20
    params = results[(False, args.loops[0])]["params"]
    print(
        f"tiny-llama-style looped model, d_model={args.d_model}, {params:,} params; batch {args.batch} x {args.seq_len} "
        f"tokens, fp32, {args.device}; memory of one forward+backward (peak minus memory before the step)"
    )
    print()
    print("| K | no checkpointing (MiB) | ratio to K=1 | per-loop checkpointing (MiB) | ratio to K=1 |")
    print("|---|---|---|---|---|")
    base = {c: results[(c, args.loops[0])]["step_bytes"] for c in (False, True)}
    for k in args.loops:
        a, b = results[(False, k)]["step_bytes"], results[(True, k)]["step_bytes"]
        print(f"| {k} | {a / MiB:.1f} | {a / base[False]:.2f} | {b / MiB:.1f} | {b / base[True]:.2f} |")
    k_max = args.loops[-1]
    ratio = results[(True, k_max)]["step_bytes"] / base[True]
    verdict = "meets" if ratio <= 1.5 else "misses"
    print(
        f"\nwith checkpointing K={k_max} uses {ratio:.2f}x the memory of K={args.loops[0]} ({verdict} the <= 1.5x target)"
    )


if __name__ == "__main__":
    main()
