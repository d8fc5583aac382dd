"""Small-scale evidence for StateLoop: Vanilla Looped vs StateLoop (persistent and reset state) trained on
the same data, budget and seed, validation loss at K ∈ {3, 5, 7} (StateLoop paper, Fig. 2 / Tab. 4 at toy
scale). A benchmark, not a test: it reports what it measures, whichever way it falls.

Setup: character-level (byte) tiny Shakespeare, a LLaMA-style backbone of ``--layers`` × ``--d-model``
(heads of 32, SwiGLU 8d/3), E = √d·Embed(x), AdamW + cosine (the paper's optimizer / schedule kind),
``--steps`` updates of ``--batch`` × ``--seq-len`` tokens, every 10th line-block held out for validation.
StateLoop uses ``d_s = d``, the selective-SSM update and identity mixing; ``reset`` is eq. 14.

    python benchmarks/bench_stateloop_evidence.py                       # d 128, 2 layers, 300 steps, K 3 5 7
    python benchmarks/bench_stateloop_evidence.py --steps 600 --ks 3 7 --models vanilla stateloop

The report also prints how far the gates moved from their initialisation (mean |Δ − 0.3| of the SSM step
size on validation tokens), to tell "the state is not used yet" from "the state does not help".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import SHARED_CORPUS  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from looplm.bench import cpu_description  # noqa: E402
from looplm.config import swiglu_hidden  # noqa: E402
from looplm.train import Trainer, load_train_config  # noqa: E402

DATA = SHARED_CORPUS

RULES = {
    "vanilla": {"name": "vanilla"},
    "stateloop": {"name": "stateloop", "options": {"update": "ssm", "mixer": "identity"}},
    "reset": {"name": "stateloop", "options": {"update": "ssm", "mixer": "identity", "reset": True}},
}


def run(model: str, K: int, args, out: Path) -> dict:
    d = args.d_model
    cfg = load_train_config(
        {
            "model": "tiny-stateloop",
            "model_overrides": {
                "d_model": d,
                "n_core": args.layers,
                "n_loops": K,
                "d_ff": swiglu_hidden(d),
                "attention": {"n_heads": max(1, d // 32), "n_kv_heads": max(1, d // 32)},
                "rule": RULES[model],
                "max_seq_len": args.seq_len,
            },
            "data": {
                "source": "files",
                "paths": [str(args.data)],
                "split_mode": "blank_lines",
                "seq_len": args.seq_len,
                "shuffle_buffer": 1000,
                "val_every_nth": 10,
                "tokenizer": "byte",
                "seed": args.seed,
            },
            "optim": {"name": "adamw", "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
            "schedule": {"name": "cosine", "warmup_fraction": 0.05, "min_ratio": 0.1},
            "train": {
                "global_batch_size": args.batch,
                "micro_batch_size": args.batch,
                "max_steps": args.steps,
                "precision": "fp32",
                "seed": args.seed,
                "cpu_threads": args.threads,
            },
            "eval": {"every": 0, "batches": args.val_batches, "at_end": True},
            "checkpoint": {"every": 0, "at_end": False},
            "logging": {"progress_bar": False, "tensorboard": False, "log_every": 10**9},
        }
    )
    tr = Trainer(cfg, out / f"{model}-k{K}", quiet=True)
    t0 = time.perf_counter()
    summary = tr.fit()
    wall = time.perf_counter() - t0
    row = {"model": model, "K": K, "val_loss": summary["val_loss"], "wall_s": wall, "params": tr.model.num_params()}
    rule = tr.model.rule
    if hasattr(rule, "update") and hasattr(rule.update, "b_delta"):
        with torch.no_grad():
            delta0 = torch.nn.functional.softplus(rule.update.b_delta)
            row["delta_bias_moved"] = float((delta0 - 0.3).abs().mean())
            row["W_delta_norm"] = float(rule.update.W_delta.weight.norm())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--models", nargs="+", default=["vanilla", "stateloop", "reset"], choices=list(RULES))
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"{args.data}: not found (pass --data)")
    print(
        f"StateLoop evidence: {args.data.name}, d={args.d_model} x {args.layers} layers, {args.steps} steps x "
        f"{args.batch} x {args.seq_len} tokens, AdamW lr {args.lr}, seed {args.seed}, {args.threads} thread(s); "
        f"{cpu_description()} (shared machine: wall times are noisy)"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for K in args.ks:
            for m in args.models:
                r = run(m, K, args, Path(tmp))
                rows.append(r)
                extra = (
                    f"  |softplus(b_Δ) − 0.3| {r['delta_bias_moved']:.4f}  ‖W_Δ‖ {r['W_delta_norm']:.3f}"
                    if "delta_bias_moved" in r
                    else ""
                )
                print(
                    f"K={K} {m:10s} params {r['params']:9,d}  val loss {r['val_loss']:.4f} (ppl {math.exp(r['val_loss']):.3f})  "
                    f"wall {r['wall_s']:6.1f} s{extra}",
                    flush=True,
                )
    print("\nK  " + "  ".join(f"{m:>10s}" for m in args.models) + "   stateloop - vanilla")
    for K in args.ks:
        by = {r["model"]: r["val_loss"] for r in rows if r["K"] == K}
        diff = f"{by['stateloop'] - by['vanilla']:+.4f}" if {"stateloop", "vanilla"} <= set(by) else ""
        print(f"{K:<2d} " + "  ".join(f"{by.get(m, float('nan')):10.4f}" for m in args.models) + f"   {diff}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
