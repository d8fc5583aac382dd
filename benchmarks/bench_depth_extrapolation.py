"""Depth extrapolation at small scale: does conditioning make deeper / shallower inference degrade
more gracefully (recurrence-effectiveness paper)?

Trains tiny BaseLoop models (Llama-style, ``s`` blocks x ``K`` loops) with and without each
injection / history / timestep-conditioning variant on the same bytes of text, with the same token
budget, optimizer (Muon + AdamW, WSD) and seed, then evaluates the validation loss at inference depth
``r = 1 .. 2K`` (both grids for conditioned models). Prints a table and writes JSON (and a PNG).

    python benchmarks/bench_depth_extrapolation.py --steps 300 --out runs/bench_depth
    python benchmarks/bench_depth_extrapolation.py --variants baseloop,loop-gating --steps 50   # quick

Data: ``--data`` (default ``../shared/data/tinyshakespeare.txt`` next to the checkout, when present, else the embedded
stdlib-docstring corpus), bytes as tokens, 90 % / 10 % split by position. Timings are noisy on
shared CPUs; the numbers that matter here are losses, which are deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import looplm
from looplm.train.config import OptimConfig
from looplm.train.optim import build_optimizer
from looplm.train.schedule import apply_lr, wsd_lambda

from _machine import cpu_info, load_bytes  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

VARIANTS = {
    "baseloop": {"name": "vanilla"},
    "inject-scalar": {"name": "injection", "options": {"form": "scalar"}},
    "inject-channel": {"name": "injection", "options": {"form": "channel"}},
    "inject-residual-channel": {"name": "injection", "options": {"form": "residual_channel"}},
    "inject-dense": {"name": "injection", "options": {"form": "dense"}},
    "history-w2": {"name": "history", "options": {"window": 2}},
    "inject-scalar-history-w2": {"name": "history", "options": {"window": 2, "inject": "scalar"}},
    "loop-gating": {"name": "timestep", "options": {"gating": "loop"}},
    "branch-gating": {"name": "timestep", "options": {"gating": "branch"}},
    "adaln": {"name": "timestep", "options": {"gating": "adaln"}},
}


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (n, batch), generator=g)
    return [torch.stack([data[s : s + seq] for s in row.tolist()]) for row in starts]


def train_tiny(
    cfg, train_data, *, steps: int, batch: int, seq: int, optim: str = "muon_adamw", lr: float = 3e-3, seed: int = 0
) -> tuple[looplm.LoopedLM, float]:
    """Train a fresh ``LoopedLM(cfg)`` for ``steps`` steps (WSD, clip 1.0); returns (model, seconds)."""
    torch.manual_seed(seed)
    model = looplm.LoopedLM(cfg)
    opt = build_optimizer(model, OptimConfig(name=optim, lr=lr, muon_lr=lr))
    lam = wsd_lambda(steps)
    data = batches(train_data, steps, batch, seq, seed=1234)  # the same token stream for every model
    t0 = time.perf_counter()
    model.train()
    for step, x in enumerate(data):
        apply_lr(opt, lam(step))
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, time.perf_counter() - t0


@torch.no_grad()
def val_loss(model, val: list[torch.Tensor], num_loops: int | None = None, grid: str | None = None) -> float:
    model.eval()
    opts = {"grid": grid} if grid else None
    losses = [float(model(x, labels=x, num_loops=num_loops, loop_options=opts).loss) for x in val]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-core", type=int, default=2)
    ap.add_argument("--loops", type=int, default=3, help="training loop count K")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default="runs/bench_depth")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_info(torch.get_num_threads())}  (shared machine: timings are noisy; losses are deterministic)")

    data = load_bytes(args.data)
    cut = int(0.9 * len(data))
    train_data, val = data[:cut], batches(data[cut:], args.val_batches, args.batch, args.seq, seed=99)
    K = args.loops
    depths = list(range(1, 2 * K + 1))
    results = {}
    for name in args.variants.split(","):
        cfg = looplm.load_model_config(
            "tiny-llama",
            {
                "vocab_size": 256,
                "d_model": args.d_model,
                "n_core": args.n_core,
                "n_loops": K,
                "d_ff": 8 * args.d_model // 3 // 8 * 8,
                "rule": VARIANTS[name],
            },
        )
        model, secs = train_tiny(
            cfg, train_data, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed
        )
        grids = ["prefix", "rescaled"] if VARIANTS[name]["name"] == "timestep" else [None]
        curves = {}
        for g in grids:
            rs = [r for r in depths if not (g == "prefix" and r > K)]
            curves[g or "-"] = {r: val_loss(model, val, r, g) for r in rs}
        results[name] = {"params": model.num_params(), "train_s": secs, "curves": curves}
        first = next(iter(curves.values()))
        print(
            f"{name:26s} params {model.num_params():>8,d}  train {secs:6.1f} s  val loss at K: {first[K]:.4f}",
            flush=True,
        )

    # table: loss at each r; degradation = loss(r) - loss(K) averaged over r != K
    print(
        f"\nvalidation loss (nats/byte) at inference depth r; K = {K}, {args.steps} steps x {args.batch} x {args.seq} tokens"
    )
    head = "| variant | grid | " + " | ".join(f"r={r}" for r in depths) + " | mean Δ r<K | mean Δ r>K |"
    print(head)
    print("| --- | --- | " + " | ".join("---:" for _ in depths) + " | ---: | ---: |")
    for name, res in results.items():
        for g, c in res["curves"].items():
            cells = [f"{c[r]:.3f}" if r in c else "" for r in depths]
            below = [c[r] - c[K] for r in depths if r < K and r in c]
            above = [c[r] - c[K] for r in depths if r > K and r in c]
            fmt = lambda xs: f"{sum(xs) / len(xs):+.3f}" if xs else ""  # noqa: E731
            print(f"| {name} | {g} | " + " | ".join(cells) + f" | {fmt(below)} | {fmt(above)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth_extrapolation.json").write_text(
        json.dumps({"args": vars(args), "cpu": cpu_info(torch.get_num_threads()), "results": results}, indent=2)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, res in results.items():
            for g, c in res["curves"].items():
                ax.plot(list(c), [math.exp(v) for v in c.values()], marker=".", label=f"{name} {g if g != '-' else ''}")
        ax.axvline(K, color="gray", ls="--", lw=0.8)
        ax.set(xlabel="inference loops r", ylabel="validation PPL (bytes)", yscale="log")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "depth_extrapolation.png", dpi=120)
    except ImportError:
        pass
    print(f"wrote {out / 'depth_extrapolation.json'}")


if __name__ == "__main__":
    main()
