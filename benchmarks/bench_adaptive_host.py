"""Per-token exit against full depth on a trained LM where the host work around the core shows: the depth
schedule at batch 8 and the token schedule at batch 1, kl ε = 0.01, kv = copy, each interleaved with full
depth in the same process, and (``--queue Q``) the depth schedule with request refill over 8·Q prompts through 8
rows against full depth in Q batches of 8 (``looplm.eval.decode_timing``), time per token as a ratio to full depth beside
the target 1.1 × executed / K. Run it on two checkouts to compare host-side changes (ratios, not times: the
machine is shared).

    python benchmarks/bench_adaptive_host.py --runs-dir RUNS    # RUNS/lm: `looplm bench adaptive --lm-config
                                                               # configs/bench/adaptive-lm-1024.yaml` trains it
    python benchmarks/bench_adaptive_host.py --runs-dir RUNS --dtypes bf16 --runs 6 --clock cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from _machine import cpu_info

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-dir", required=True, help="the folder whose lm/ holds the trained LM")
    ap.add_argument("--data", default=str(DATA), help="the LM's corpus (held-out prompts are read from it)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--new", type=int, default=32, help="tokens per row")
    ap.add_argument(
        "--clock", default="cpu", choices=["cpu", "wall"], help="cpu: process time (a shared machine's steal left out)"
    )
    ap.add_argument(
        "--queue", type=int, default=4, help="request refill: batches of 8 prompts queued (0: skip that row)"
    )
    a = ap.parse_args(argv)
    from looplm import kernels
    from looplm.decode.token_schedule import AdaptiveDecoder
    from looplm.bench.adaptive import _held_out, load_lm
    from looplm.decode.depth_schedule import DepthBatchedDecoder
    from looplm.eval.decode_timing import FullDepth, decode_timing, generation_timing, queue_timing

    kernels.load("cpu")
    torch.set_num_threads(1)
    lm, tok = load_lm(Path(a.runs_dir))
    print(
        f"# {cpu_info(1)}; LM d = {lm.config.d_model}, K = {lm.config.n_loops}; {a.clock} clock, {a.runs} runs, medians"
    )
    print("| dtype | batch | schedule | time / full | executed / K | target | per-run ratios |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    spec = {"criterion": "kl", "threshold": 0.01, "kv": "copy"}
    for name in a.dtypes.split(","):
        m = lm.to({"bf16": torch.bfloat16, "fp32": torch.float32}[name])
        rows = ((8, "depth"), (1, "token")) + (((8, "refill"),) if a.queue else ())
        for B, sched in rows:
            prompts = _held_out(tok, a.data, B * (a.queue if sched == "refill" else 1), 32, seed=1)
            full = lambda b, c: FullDepth(m, b, c)  # noqa: E731
            if sched == "refill":  # the queue through 8 rows against full depth in batches of 8
                mk = lambda b, c, n: DepthBatchedDecoder(  # noqa: E731
                    m, b, c, {**spec, "schedule": "depth", "max_batch": b}, prompts=n
                )
                res = queue_timing(m, prompts, B, a.new, mk, runs=a.runs, clock=a.clock)
            elif sched == "depth":
                cont = {"full": full, "depth": lambda b, c: DepthBatchedDecoder(m, b, c, {**spec, "schedule": "depth"})}
                res = generation_timing(m, prompts, a.new, cont, runs=a.runs, clock=a.clock)
            else:
                cont = {"full": full, "token": lambda b, c: AdaptiveDecoder(m, b, c, spec)}
                res = decode_timing(m, prompts, a.new, cont, runs=a.runs, clock=a.clock)
            r = res[sched]
            ex = r["stats"]["executed_ratio"]
            ratios = ", ".join(f"{x:.3f}" for x in r["ratios"])
            print(f"| {name} | {B} | {sched} | {r['ratio']:.3f} | {ex:.3f} | {1.1 * ex:.3f} | {ratios} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
