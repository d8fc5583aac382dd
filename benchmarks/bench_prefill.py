"""fp32 prompt products on a CPU: torch's GEMM (MKL, the baseline) against oneDNN and looplm's fp32 GEMV kernel.

Why: MKL picks its code path by CPU vendor, and off Intel CPUs its fp32 GEMM ran a prefill at half oneDNN's
speed (``looplm/kernels/onednn.py``), which made looplm serve's fp32 time to first token twice vLLM's.

Two parts, each printing ratios against MKL measured in the same run (contenders alternate, medians):

* ``--rows``: single products at the shapes of SmolLM2-135M (576 x 576, 1536 x 576, 576 x 1536, the 49,152 x 576
  head) and of the d = 1024 LM (4096 x 1024, 1024 x 4096), for 1-384 rows of x; weights cycled through a 64 MB
  pool so they stream from memory as in a model. Contenders: MKL (``F.linear``), oneDNN
  (``torch.ops.mkldnn._linear_pointwise``) and looplm's fp32 GEMV kernel (1-8 rows).
* the model (default): ``generate``'s time to first token (prefill + one token) on SmolLM2-135M's shape (random
  weights) in fp32, prompts of ``--prompt`` tokens at batch 1 and 8, with ``LOOPLM_FP32_GEMM=mkl`` against
  ``onednn`` (the setting is read per product, so both run in one process).

    python benchmarks/bench_prefill.py [--rows] [--prompt 48] [--batches 1,8] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from _machine import cpu_info  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from looplm.kernels import gemv, onednn

SHAPES = {  # name: (N, K)
    "smollm2 q/o 576x576": (576, 576),
    "smollm2 gate/up 1536x576": (1536, 576),
    "smollm2 down 576x1536": (576, 1536),
    "smollm2 head 49152x576": (49152, 576),
    "d1024 up 4096x1024": (4096, 1024),
    "d1024 down 1024x4096": (1024, 4096),
}
ROWS = (1, 2, 4, 8, 9, 16, 48, 384)


def _median_ms(fns: dict, rounds: int, inner: int) -> dict[str, float]:
    """Each contender's median time of one call, in ms: the contenders alternate within every round."""
    for f in fns.values():
        f()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[name].append((time.perf_counter() - t) / inner * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_rows(rounds: int) -> None:
    print("| product | rows | MKL ms (baseline) | oneDNN ms | × MKL | fp32 GEMV kernel ms | × MKL |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (N, K) in SHAPES.items():
        pool = [torch.randn(N, K) * 0.02 for _ in range(max(1, int(64e6 // (N * K * 4))))]
        it = iter(range(10**12))

        def w():
            return pool[next(it) % len(pool)]

        for rows in ROWS:
            if N * K * rows > 49152 * 576 * 48:  # the head is only ever asked for a few rows
                continue
            x = torch.randn(rows, K)
            fns = {
                "mkl": lambda: F.linear(x, w()),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w(), None, "none", [], ""),
            }
            if rows <= 8 and gemv.available():
                fns["gemv"] = lambda: gemv.gemv_fp32(x, w())
            inner = max(1, int(2e8 // (N * K * max(rows, 8))))
            t = _median_ms(fns, rounds, inner)
            g = f"{t['gemv']:.3f} | {t['mkl'] / t['gemv']:.2f}" if "gemv" in t else "– | –"
            print(f"| {name} | {rows} | {t['mkl']:.3f} | {t['onednn']:.3f} | {t['mkl'] / t['onednn']:.2f} | {g} |")


def bench_model(prompt: int, batches: list[int], rounds: int) -> None:
    import looplm

    cfg = {
        "name": "smollm2-shape",
        "vocab_size": 49152,
        "d_model": 576,
        "n_core": 30,
        "n_loops": 1,
        "d_ff": 1536,
        "attention": {"n_heads": 9, "n_kv_heads": 3, "rope_theta": 100000.0},
        "tie_embeddings": True,
        "max_seq_len": 2048,
    }
    torch.manual_seed(0)
    model = looplm.build(cfg, dtype=torch.float32).eval()
    print("| batch × prompt | MKL ms (baseline) | oneDNN ms | × MKL | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for batch in batches:
        ids = torch.randint(0, 49152, (batch, prompt))
        outs = {}

        def first_token(setting):
            os.environ[onednn.ENV] = setting
            with torch.no_grad():
                outs[setting] = model.generate(ids, max_new_tokens=1)

        t = _median_ms({"mkl": lambda: first_token("mkl"), "onednn": lambda: first_token("onednn")}, rounds, 1)
        same = torch.equal(outs["mkl"], outs["onednn"])
        print(f"| {batch} × {prompt} | {t['mkl']:.1f} | {t['onednn']:.1f} | {t['mkl'] / t['onednn']:.2f} | {same} |")
    os.environ.pop(onednn.ENV, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", action="store_true", help="single products at 1-384 rows instead of the model")
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN: nothing to compare")
    gemv.available()  # load the kernels before the first timing
    print(f"# {cpu_info(torch.get_num_threads())}; torch {torch.__version__}; fp32")
    print(f"# LOOPLM_FP32_GEMM=auto picks {'oneDNN' if onednn.prefers_onednn() else 'MKL'} here\n")
    if a.rows:
        bench_rows(a.rounds)
    else:
        bench_model(a.prompt, [int(b) for b in a.batches.split(",")], a.rounds)


if __name__ == "__main__":
    main()
