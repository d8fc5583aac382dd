"""StateLoop Tab. 1 at CPU scale: tiny variants of Vanilla Looped, StateLoop and the five comparison
models (Hyperloop, MeSH, PonderLM, Parcae, Pause Token) trained with the same data, budget and seed.

Every model is the structure of its 1.4B preset at toy width (d 96, 4 heads of 24, SwiGLU 256, 6
physical layers, byte vocabulary + one pause id): full-backbone models loop 6 layers K=4 times,
MeSH / Parcae run 2 / 2 / 2 layers with 10 repetitions (24 layer applications, as 96 at 1.4B),
Hyperloop 1 / 4×4 / 1. Same batches (seeded windows of a byte corpus), AdamW with warmup + cosine,
same step count. Prints validation loss and PPL (bytes) on a held-out tail, parameters, training
wall time, and the median time of a training step and of a decoded token (greedy, cached, batch 1)
measured round-robin over the trained models, with ratios against Vanilla Looped from the same run. The paper's ordering at 30B tokens is not expected at this scale.

The CPU is shared while this runs: wall times are noisy; the interleaved medians are the fairer
comparison. One
thread by default: on a loaded 2-core machine two torch threads spin-wait and run ~15x slower.

    python benchmarks/bench_baselines.py [--steps 150] [--batch 8] [--seq 64] [--data PATH]
                                         [--models vanilla,stateloop,...] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

import looplm
from looplm.config import ModelConfig, preset_dict
from looplm.pause import PauseLM

from _machine import SHARED_CORPUS, cpu_info, load_bytes  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

DEFAULT_DATA = str(SHARED_CORPUS)
VOCAB = 257  # bytes + one pause id (256), for every model so the embeddings match
WIDTH = dict(d_model=96, d_ff=256, vocab_size=VOCAB, max_seq_len=1024)
MODELS = {  # name -> (1.4B preset whose structure is copied, (p, s, K, c), extra config)
    "vanilla": ("stateloop-1.4b-vanilla", (0, 6, 4, 0), {}),
    "stateloop": (
        "stateloop-1.4b",
        (0, 6, 4, 0),
        {"rule": {"name": "stateloop", "options": {"d_s": 96, "update": "ssm", "mixer": "identity"}}},
    ),
    "hyperloop": ("stateloop-1.4b-hyperloop", (1, 4, 4, 1), {}),
    "mesh": ("stateloop-1.4b-mesh", (2, 2, 10, 2), {}),
    "ponderlm": ("stateloop-1.4b-ponderlm", (0, 6, 4, 0), {}),
    "parcae": ("stateloop-1.4b-parcae", (2, 2, 10, 2), {}),
    "pause": ("stateloop-1.4b-pause", (0, 6, 4, 0), {"pause": {"n_pause": 3, "token_id": 256}}),
}


def tiny_config(name: str) -> ModelConfig:
    preset, (p, s, K, c), extra = MODELS[name]
    d = preset_dict(preset)
    d.update(WIDTH, n_prelude=p, n_core=s, n_loops=K, n_coda=c)
    d["attention"] = dict(d.get("attention") or {}, n_heads=4, n_kv_heads=4, head_dim=24)
    d.update(extra)
    return ModelConfig.from_dict(d)


def build(name: str, seed: int):
    torch.manual_seed(seed)
    cfg = tiny_config(name)
    return PauseLM(cfg) if cfg.pause is not None else looplm.LoopedLM(cfg)


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        yield torch.stack([data[i : i + seq] for i in starts.tolist()])


def train(model, train_data, args) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda t: (
            min(1.0, (t + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, args.steps) / args.steps)))
        ),
    )
    model.train()
    t0 = time.perf_counter()
    for x in batches(train_data, args.steps, args.batch, args.seq, args.seed):
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return time.perf_counter() - t0


@torch.no_grad()
def validate(model, val_data, args) -> float:
    model.eval()
    total, count = 0.0, 0
    for x in batches(val_data, args.val_batches, args.batch, args.seq, args.seed + 1):
        logits = model(x).logits[:, :-1]
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum"))
        count += x[:, 1:].numel()
    return total / count


def step_seconds(model, x) -> float:
    """One training step's forward + backward (no optimizer update) on batch ``x``."""
    model.train()
    t = time.perf_counter()
    model(x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


@torch.no_grad()
def decode_seconds_per_token(model, prompt, new_tokens: int) -> float:
    model.eval()
    t = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens)
    return (time.perf_counter() - t) / (out.shape[1] - prompt.shape[1])


def interleaved_times(models: dict, train_data, val_data, args) -> dict:
    """Median train-step and decode times, measured round-robin over the models so that every model
    sees the same mix of load on the shared machine (the training wall times above do not)."""
    x = next(batches(train_data, 1, args.batch, args.seq, args.seed + 2))
    prompt = val_data[:16][None]
    steps = {n: [] for n in models}
    decode = {n: [] for n in models}
    for _ in range(args.rounds):
        for n, m in models.items():
            steps[n].append(step_seconds(m, x))
            decode[n].append(decode_seconds_per_token(m, prompt, args.new_tokens))
    return {n: (statistics.median(steps[n]), statistics.median(decode[n])) for n in models}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if "vanilla" in names:  # the baseline of the ratios goes first
        names.remove("vanilla")
    names.insert(0, "vanilla")

    data = load_bytes(args.data, max_stdlib_chars=2_000_000)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    print(
        f"CPU: {cpu_info()}, torch {torch.__version__}, {args.threads} threads; "
        f"load average {os.getloadavg()[0]:.1f} at start (shared machine: timings are noisy)"
    )
    print(
        f"data: {args.data} ({len(data):,} bytes, 90/10 split); {args.steps} steps x {args.batch} x {args.seq} "
        f"= {args.steps * args.batch * args.seq:,} real tokens per model, AdamW lr {args.lr}, seed {args.seed}\n"
    )

    models, results = {}, {}
    for name in names:
        model = build(name, args.seed)
        secs = train(model, train_data, args)
        val = validate(model, val_data, args)
        models[name], results[name] = model, (val, secs)
        print(f"  {name:<10} trained: val loss {val:.4f}, {secs:.0f} s wall", flush=True)
    print(
        f"  timing {args.rounds} interleaved rounds (train step {args.batch} x {args.seq}; greedy decode, "
        f"batch 1, 16-token prompt, {args.new_tokens} new tokens) ...",
        flush=True,
    )
    times = interleaved_times(models, train_data, val_data, args)

    step0, dec0 = times["vanilla"]
    print()
    print(
        "| model | params | (p, s, K, c) | val loss | val PPL | train wall s | step ms (median) | x vanilla "
        "| decode ms/tok (median) | x vanilla |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, model in models.items():
        cfg, (val, secs), (step, dec) = model.config, results[name], times[name]
        psk = f"({cfg.n_prelude}, {cfg.n_core}, {cfg.n_loops}, {cfg.n_coda})"
        print(
            f"| {name} | {model.num_params():,} | {psk} | {val:.4f} | {math.exp(val):.3f} | {secs:.0f} | "
            f"{1000 * step:.0f} | {step / step0:.2f} | {1000 * dec:.2f} | {dec / dec0:.2f} |"
        )


if __name__ == "__main__":
    main()
