"""looplm's decode kernels (``looplm/kernels/gemv.py``) against torch's matmul, one linear layer at a time.

For each weight shape and number of activation rows: the time of ``y = x · Wᵀ`` with torch
(``F.linear``: oneDNN for bf16, MKL for fp32) and with the kernel ``gemv.linear`` would pick (bf16: one
row on AVX512-BF16, 2-16 rows on AMX; fp32: 3-8 rows), the bytes of W read per second, and the ratio.
Weights cycle through a pool of 1.2 GB, so each call reads W from memory as a decode step does (the
VM's last-level cache can be hundreds of MB). Rows where ``gemv.linear`` keeps ``F.linear`` print "–"
for the kernel (its dispatch says torch wins there). The last table times every linear of one
SmolLM2-135M decode step back to back (the 30 layers' 7 projections and the tied head).

    python benchmarks/bench_gemv.py [--rows 1,2,4,8,16] [--dtypes bf16,fp32]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from _machine import cpu_info  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from looplm.kernels import gemv

SHAPES = [  # (N, K): SmolLM2-135M's k/v, q/o, gate/up, down, tied head; a 2048-wide model; Qwen3's head
    (192, 576),
    (576, 576),
    (1536, 576),
    (576, 1536),
    (49152, 576),
    (2048, 2048),
    (8192, 2048),
    (2048, 8192),
    (151936, 1024),
]
POOL_BYTES = 1.2e9
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def per_call(fn, ws, x, reps: int = 3) -> float:
    """Seconds per call, the best of ``reps`` passes over the weight pool."""
    for w in ws[:2]:
        fn(x, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in ws:
            fn(x, w)
        best = min(best, (time.perf_counter() - t) / len(ws))
    return best


def kernel_fn(x2d: torch.Tensor):
    """The kernel ``gemv.linear`` dispatches to for this input, or None where it keeps F.linear."""
    if not gemv.uses_kernel(x2d, torch.empty(1, x2d.shape[-1], dtype=x2d.dtype)):
        return None
    op = torch.ops.looplm_cpu.gemv_bf16 if x2d.dtype == torch.bfloat16 else torch.ops.looplm_cpu.gemv_fp32
    return lambda x, w: op(x, w)


def decode_step_table(dtypes) -> None:
    d, ff, V, layers = 576, 1536, 49152, 30
    print("\n| dtype | rows | one decode step's 211 products, torch ms | looplm kernels ms | ratio | GB/s (looplm) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for dt in dtypes:
        g = torch.Generator().manual_seed(0)
        mats = [
            [
                torch.randn(n, k, generator=g).to(dt)
                for n, k in [(d, d), (192, d), (192, d), (d, d), (ff, d), (ff, d), (d, ff)]
            ]
            for _ in range(layers)
        ]
        head = torch.randn(V, d, generator=g).to(dt)
        nbytes = sum(w.numel() for ws in mats for w in ws) * dt.itemsize + head.numel() * dt.itemsize
        for rows in (1, 8):
            x, x2 = torch.randn(rows, 1, d).to(dt), torch.randn(rows, 1, ff).to(dt)

            def step(lin):
                for ws in mats:
                    for w in ws[:6]:
                        lin(x, w)
                    lin(x2, ws[6])
                lin(x, head)

            times = {}
            for name, lin in (("torch", F.linear), ("looplm", gemv.linear)) * 2:
                step(lin)
                t = time.perf_counter()
                for _ in range(5):
                    step(lin)
                times[name] = min(times.get(name, float("inf")), (time.perf_counter() - t) / 5)
            a, b = times["torch"], times["looplm"]
            print(f"| {NAMES[dt]} | {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {nbytes / b / 1e9:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--dtypes", default="bf16,fp32")
    args = ap.parse_args()
    dtypes = [torch.bfloat16 if d == "bf16" else torch.float32 for d in args.dtypes.split(",")]
    print(f"# {cpu_info()}, torch {torch.__version__}, {os.cpu_count()} cores")
    if not gemv.available():
        print(f"# looplm's kernels are not available here: {gemv.unavailable_reason()}")
        return
    print(f"# AMX for 2-16 bf16 rows: {'yes' if gemv.amx() else 'no'}; weights from a {POOL_BYTES / 1e9:.1f} GB pool")
    print("| dtype | W [N, K] | rows | torch µs | torch GB/s | looplm µs | looplm GB/s | looplm vs torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        for n, k in SHAPES:
            nbytes = n * k * dt.itemsize
            ws = [torch.randn(n, k, generator=g).to(dt) for _ in range(max(3, int(POOL_BYTES // nbytes)))]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=g).to(dt)
                a = per_call(F.linear, ws, x)
                fn = kernel_fn(x)
                if fn is None:
                    print(f"| {NAMES[dt]} | [{n}, {k}] | {rows} | {a * 1e6:.0f} | {nbytes / a / 1e9:.1f} | – | – | – |")
                    continue
                b = per_call(fn, ws, x)
                print(
                    f"| {NAMES[dt]} | [{n}, {k}] | {rows} | {a * 1e6:.0f} | {nbytes / a / 1e9:.1f} | {b * 1e6:.0f} "
                    f"| {nbytes / b / 1e9:.1f} | {a / b:.2f}x |"
                )
            del ws
    decode_step_table(dtypes)


if __name__ == "__main__":
    main()
