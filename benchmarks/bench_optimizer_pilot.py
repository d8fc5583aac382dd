"""Optimizer pilot: AdamW vs Muon (+ AdamW for the rest) at tiny scale, over four layouts
(recurrence-effectiveness paper, optimizer section):

* non-loop 12 x 1 and 3 x 1          (p, s, K, c) = (0, 12, 1, 0), (0, 3, 1, 0)
* BaseLoop 3 x 4                      (0, 3, 4, 0)
* Huginn-style 1 + 2 x 5 + 1          (1, 2, 5, 1)

Same bytes, token budget, WSD schedule and seed for every run; prints the final validation loss and
the wall time of training (median step time too) with the AdamW run of the same layout as the
baseline of the ratio.

    python benchmarks/bench_optimizer_pilot.py --steps 200 --out runs/bench_optim
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import looplm
from looplm.train.config import OptimConfig
from looplm.train.optim import build_optimizer
from looplm.train.schedule import apply_lr, wsd_lambda

from _machine import cpu_info, load_bytes  # noqa: E402
from bench_depth_extrapolation import batches, val_loss

LAYOUTS = {
    "nonloop-12x1": (0, 12, 1, 0),
    "nonloop-3x1": (0, 3, 1, 0),
    "baseloop-3x4": (0, 3, 4, 0),
    "huginn-1+2x5+1": (1, 2, 5, 1),
}


def train(cfg, data, steps, batch, seq, optim, lr, seed):
    torch.manual_seed(seed)
    model = looplm.LoopedLM(cfg)
    opt = build_optimizer(model, OptimConfig(name=optim, lr=lr, muon_lr=lr))
    lam = wsd_lambda(steps)
    step_times = []
    model.train()
    t0 = time.perf_counter()
    for step, x in enumerate(batches(data, steps, batch, seq, seed=1234)):
        ts = time.perf_counter()
        apply_lr(opt, lam(step))
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - ts)
    return model, time.perf_counter() - t0, statistics.median(step_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument(
        "--lr", type=float, default=3e-3, help="peak LR of both groups (Muon LR matched to AdamW's update RMS)"
    )
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default="runs/bench_optim")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"CPU: {cpu_info(torch.get_num_threads())}  (shared machine: wall times are noisy, compare ratios within a layout)"
    )
    data = load_bytes(args.data)
    cut = int(0.9 * len(data))
    train_data, val = data[:cut], batches(data[cut:], args.val_batches, args.batch, args.seq, seed=99)
    rows = []
    for name in args.layouts.split(","):
        p, s, K, c = LAYOUTS[name]
        cfg = looplm.load_model_config(
            "tiny-llama",
            {
                "vocab_size": 256,
                "d_model": args.d_model,
                "n_prelude": p,
                "n_core": s,
                "n_loops": K,
                "n_coda": c,
                "d_ff": 8 * args.d_model // 3 // 8 * 8,
            },
        )
        base_time = None
        for optim in ("adamw", "muon_adamw"):
            model, secs, med = train(cfg, train_data, args.steps, args.batch, args.seq, optim, args.lr, args.seed)
            loss = val_loss(model, val)
            base_time = base_time or secs
            rows.append(
                {
                    "layout": name,
                    "pskc": [p, s, K, c],
                    "params": model.num_params(),
                    "optimizer": optim,
                    "val_loss": loss,
                    "train_s": secs,
                    "median_step_s": med,
                    "time_vs_adamw": secs / base_time,
                }
            )
            print(
                f"{name:16s} {optim:10s} val loss {loss:.4f}  train {secs:6.1f} s (median step {1e3 * med:.0f} ms, "
                f"x{secs / base_time:.2f} vs AdamW)",
                flush=True,
            )
    tokens = args.steps * args.batch * args.seq
    print(
        f"\n{args.steps} steps x {args.batch} x {args.seq} = {tokens:,} tokens per run, lr {args.lr}, WSD, seed {args.seed}"
    )
    print(
        "| layout | (p, s, K, c) | params | AdamW val loss | Muon val loss | Δ (Muon − AdamW) | AdamW s | Muon s | time ratio |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.layouts.split(","):
        a, m = [r for r in rows if r["layout"] == name]
        print(
            f"| {name} | {tuple(a['pskc'])} | {a['params']:,} | {a['val_loss']:.4f} | {m['val_loss']:.4f} | "
            f"{m['val_loss'] - a['val_loss']:+.4f} | {a['train_s']:.1f} | {m['train_s']:.1f} | {m['train_s'] / a['train_s']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_pilot.json").write_text(
        json.dumps({"args": vars(args), "cpu": cpu_info(torch.get_num_threads()), "rows": rows}, indent=2)
    )
    print(f"wrote {out / 'optimizer_pilot.json'}")


if __name__ == "__main__":
    main()
