"""Chunk size of the pure-PyTorch Mamba-2 scan: forward+backward time of one Mamba2Mixer per chunk size.

One mixer (mamba_ssm defaults: expand 2, d_state 128, headdim 64, ngroups 1), one input, and for each
chunk size the time of ``mixer(x)`` + ``backward`` - in fp32 and under bf16 autocast. Chunk sizes are
interleaved inside every repeat (so load from other processes spreads over all of them); the table shows
the median and the minimum wall time, the median process CPU time (all threads), and both wall times as a
ratio to chunk 64. On a shared machine the minimum is the more robust of the two.

    python benchmarks/bench_mamba2_chunk.py [--d-model 768] [--chunks 16,32,64,128,256]
        [--fp32-shapes 1x2048,2x1024] [--bf16-shapes 1x1024] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from looplm.layers.mamba2 import Mamba2Mixer, ssd_chunked


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x2048,2x1024' -> [(1, 2048), (2, 1024)] (batch x seqlen); '' -> []."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def fwd_bwd(mixer: Mamba2Mixer, x: torch.Tensor, bf16: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = mixer(x)
    y.float().square().mean().backward()


def bench(mixer, x, chunks, bf16, repeats, warmup):
    wall = {c: [] for c in chunks}
    cpu = {c: [] for c in chunks}
    for r in range(warmup + repeats):
        for c in chunks:
            mixer.chunk_size = c
            mixer.zero_grad(set_to_none=True)
            x.grad = None
            t0, c0 = time.perf_counter(), time.process_time()
            fwd_bwd(mixer, x, bf16)
            t1, c1 = time.perf_counter(), time.process_time()
            if r >= warmup:
                wall[c].append(t1 - t0)
                cpu[c].append(c1 - c0)
    return {c: (statistics.median(wall[c]), min(wall[c]), statistics.median(cpu[c])) for c in chunks}


def cpu_name() -> str:
    from looplm.utils import cpuinfo

    return cpuinfo.model_name() or platform.processor() or platform.machine()


def bench_scan(mixer, batch, seqlen, chunks, repeats, warmup):
    """The scan alone (ssd_chunked forward+backward at the mixer's shapes): the part chunk size changes."""
    g = torch.Generator().manual_seed(0)
    H, P, G, N = mixer.nheads, mixer.headdim, mixer.ngroups, mixer.d_state
    x = torch.randn(batch, seqlen, H, P, generator=g).requires_grad_()
    dt = (torch.rand(batch, seqlen, H, generator=g) * 0.1).requires_grad_()
    A = -torch.exp(mixer.A_log.detach()).requires_grad_()
    B = torch.randn(batch, seqlen, G, N, generator=g).requires_grad_()
    C = torch.randn(batch, seqlen, G, N, generator=g).requires_grad_()
    wall = {c: [] for c in chunks}
    for r in range(warmup + repeats):
        for c in chunks:
            t0 = time.perf_counter()
            y, _ = ssd_chunked(x, dt, A, B, C, c, D=mixer.D)
            y.square().mean().backward()
            if r >= warmup:
                wall[c].append(time.perf_counter() - t0)
    return {c: (statistics.median(wall[c]), min(wall[c])) for c in chunks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--chunks", default="16,32,64,128,256")
    ap.add_argument("--fp32-shapes", default="1x2048,2x1024", help="batch x seqlen, comma separated")
    ap.add_argument("--bf16-shapes", default="1x1024", help="bf16 autocast shapes ('' to skip)")
    ap.add_argument("--scan-shapes", default="1x2048,2x1024", help="scan-only (fp32) shapes ('' to skip)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    ref = 64 if 64 in chunks else chunks[0]

    print(f"machine: {platform.platform()} | {cpu_name()}")
    print(f"cpus: os.cpu_count()={os.cpu_count()}, torch threads={torch.get_num_threads()}")
    print(f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"load average at start: {os.getloadavg()}")
    print(
        f"Mamba2Mixer(d_model={args.d_model}, expand=2, d_state=128, headdim=64, ngroups=1); "
        f"forward+backward; median of {args.repeats} (after {args.warmup} warm-up)\n"
    )

    torch.manual_seed(0)
    mixer = Mamba2Mixer(args.d_model)
    header = (
        f"{'dtype':<6} {'B x T':>9} {'chunk':>6} {'median ms':>10} {'min ms':>8} {'cpu s':>7} "
        f"{'median / chunk ' + str(ref):>18} {'min / chunk ' + str(ref):>15}"
    )
    print(header)
    print("-" * len(header))
    runs = [("fp32", s) for s in parse_shapes(args.fp32_shapes)] + [("bf16", s) for s in parse_shapes(args.bf16_shapes)]
    for dtype, (batch, seqlen) in runs:
        x = torch.randn(batch, seqlen, args.d_model, requires_grad=True)
        res = bench(mixer, x, chunks, dtype == "bf16", args.repeats, args.warmup)
        for c in chunks:
            med, lo, cp = res[c]
            print(
                f"{dtype:<6} {f'{batch}x{seqlen}':>9} {c:>6} {med * 1e3:>10.0f} {lo * 1e3:>8.0f} {cp:>7.2f} "
                f"{med / res[ref][0]:>18.2f} {lo / res[ref][1]:>15.2f}"
            )
        best = min(chunks, key=lambda c: res[c][0])
        print(f"{'':<6} {'':>9} fastest (median): chunk {best}", flush=True)
    if args.scan_shapes:
        print(
            f"\nscan only: ssd_chunked forward+backward, fp32 (H={mixer.nheads}, P={mixer.headdim}, N={mixer.d_state})"
        )
        header = f"{'B x T':>9} {'chunk':>6} {'median ms':>10} {'min ms':>8} {'median / chunk ' + str(ref):>18}"
        print(header)
        print("-" * len(header))
        for batch, seqlen in parse_shapes(args.scan_shapes):
            res = bench_scan(mixer, batch, seqlen, chunks, max(args.repeats, 5), args.warmup)
            for c in chunks:
                med, lo = res[c]
                print(f"{f'{batch}x{seqlen}':>9} {c:>6} {med * 1e3:>10.0f} {lo * 1e3:>8.0f} {med / res[ref][0]:>18.2f}")
            print(f"{'':>9} fastest (median): chunk {min(chunks, key=lambda c: res[c][0])}", flush=True)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
