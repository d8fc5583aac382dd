"""CPU-scale p-hop: does an iso-parameter looped model beat its non-looped base (Looped-Mamba Tab. 2)?

Trains, from ``configs/tasks/phop-cpu.yaml`` (n = 32, p = 4, dense target, d = 64), the non-looped
base ``N⊗1``, the looped ``N⊗R`` (same parameters) and the deeper non-looped ``NR⊗1`` (same effective
depth and FLOPs), for each seed, and prints exact-match accuracy on the answer token (2,000
deterministic samples), parameters, FLOPs/token and wall time (with the ratio to the base's time,
measured in the same run).

    python benchmarks/bench_phop.py                         # 1⊗1, 1⊗4, 4⊗1, seeds 0 1, 2000 steps
    python benchmarks/bench_phop.py --steps 500 --seeds 0 --backbone mamba2
    python benchmarks/bench_phop.py --answer-only           # the paper's loss (stays near chance here)

The CPU is usually shared while this runs: wall times are noisy; compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_description() -> str:
    from looplm.utils import cpuinfo

    if cpuinfo.model_name() is None and not cpuinfo.flags():
        return platform.processor() or "unknown CPU"
    flags = cpuinfo.flags()
    return (
        f"{cpuinfo.model_name() or 'unknown CPU'} (avx512_bf16: {'avx512_bf16' in flags}, amx: {'amx_bf16' in flags}, "
        f"{os.cpu_count()} logical CPUs)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/tasks/phop-cpu.yaml"))
    ap.add_argument("--N", type=int, default=1, help="layers of the base and the looped model")
    ap.add_argument("--R", type=int, default=4, help="loops of the looped model (the deep model has N·R layers)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="override train.steps")
    ap.add_argument("--backbone", choices=["attention", "mamba2"], default="attention")
    ap.add_argument(
        "--answer-only", action="store_true", help="the paper's answer-only loss instead of the dense target"
    )
    ap.add_argument("--out", default="runs/bench_phop")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--reuse", action="store_true", help="use OUT/<model>/results.json where a finished run is there")
    args = ap.parse_args()

    import torch

    from looplm.tasks.train import load_task_config, train_task

    print(f"CPU: {cpu_description()}; torch {torch.__version__}")
    models = [(args.N, 1, "base (iso-parameter)"), (args.N, args.R, "loop"), (args.N * args.R, 1, "deep (iso-FLOPs)")]
    rows = []
    for n_layers, loops, role in models:
        ov = list(args.set) + [f"layers={n_layers}", f"loops={loops}", f"train.seeds={json.dumps(args.seeds)}"]
        if args.steps:
            ov.append(f"train.steps={args.steps}")
        if args.answer_only:
            ov.append("task.dense_target=false")
        if args.backbone == "mamba2":
            ov += [
                "model=tiny-mamba2",
                "model_overrides={d_model: 64, mamba: {d_state: 16, headdim: 16, ngroups: 1, chunk_size: 16}}",
            ]
        cfg = load_task_config(args.config, ov)
        run_dir = Path(args.out) / f"{args.backbone}-{n_layers}x{loops}"
        t0 = time.perf_counter()
        if args.reuse and (run_dir / "results.json").exists():
            res = json.loads((run_dir / "results.json").read_text())
            wall = sum(r["train_time_s"] for r in res["runs"])
        else:
            res = train_task(cfg, run_dir, quiet=True)
            wall = time.perf_counter() - t0
        rows.append(
            {
                "model": f"{n_layers}⊗{loops}",
                "role": role,
                "params": res["params"],
                "flops": res["forward_flops_per_token"],
                "acc": [r["accuracy"] for r in res["runs"]],
                "train_s": [r["train_time_s"] for r in res["runs"]],
                "wall_s": wall,
            }
        )
        print(f"  {rows[-1]['model']:>5} {role:22s} acc {rows[-1]['acc']}  ({wall:.0f} s)", flush=True)

    base_t = statistics.median(rows[0]["train_s"])
    steps = args.steps or load_task_config(args.config).train.steps
    print(
        f"\np-hop n=32 p=4, {'answer-only' if args.answer_only else 'dense'} target, {args.backbone}, d=64, {steps} steps, "
        f"seeds {args.seeds}; accuracy on 2,000 eval samples (chance 25%)"
    )
    print("| model | role | params | FLOPs/token | accuracy per seed | best | median train s | time vs base |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        t = statistics.median(r["train_s"])
        accs = ", ".join(f"{a:.2%}" for a in r["acc"])
        print(
            f"| {r['model']} | {r['role']} | {r['params']:,} | {r['flops']:,} | {accs} | {max(r['acc']):.2%} | {t:.0f} | {t / base_t:.2f}x |"
        )


if __name__ == "__main__":
    main()
