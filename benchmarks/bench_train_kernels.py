"""The CPU training kernels one by one, each against the PyTorch path it replaces, at the SmolLM2-135M
training shape (batch 4 × 256 = 1024 tokens, d 576, 9 / 3 heads of 64, SwiGLU 1536, vocabulary 49,152).

* attention forward + backward: ``CPUAttention`` (torch's flash forward + looplm's backward on MKL) vs
  ``F.scaled_dot_product_attention`` (torch's CPU flash forward and backward), bf16 and fp32;
* the chunked head's softmax cross-entropy: ``cross_entropy_rows_`` vs loss.py's PyTorch loop (one chunk
  of 1024 × 49,152 logits, each timing includes a copy of the logits);
* every product of a layer's training step: the split ``cpu_gemm`` measured fastest vs torch's matmul
  (forward ``x Wᵀ`` and input gradient ``dy W``), and the weight gradient ``dyᵀ x`` as ``mm_f32`` (MKL, fp32
  out) vs torch's bf16 matmul and a cast to fp32;
* the stacked products of ``cpu_gemm.linear_group`` (q/k/v, gate/up: forward, input and weight gradients of
  one layer) vs the same layers one by one (``TunedLinear`` each);
* the gradient norm over the model's 538 MB of fp32 gradients: ``looplm_cpu::sum_squares`` vs
  ``torch.nn.utils.get_total_norm``; and clipping: the factor folded into fused AdamW's step
  (``MultiOptimizer.step(grad_factor)``) vs ``clip_grads_with_norm_`` then the step.

Medians of alternating runs in one process; ratios are against the PyTorch path of the same row.

    python benchmarks/bench_train_kernels.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from _machine import cpu_name, native_bf16  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def timed(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each function, the functions alternating within every round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def row(what: str, base: str, base_s: float, ours: str, ours_s: float, flops: float | None = None) -> None:
    rate = f" | {flops / base_s / 1e12:.2f} → {flops / ours_s / 1e12:.2f}" if flops else " | –"
    print(f"| {what} | {base} {base_s * 1e3:.2f} | {ours} {ours_s * 1e3:.2f} | {base_s / ours_s:.2f}×{rate} |")


def main() -> None:
    from looplm import kernels

    kernels.load()  # looplm's CPU fast paths behind the model's dispatch points (built once if needed)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    from looplm.utils import cpu_malloc
    from looplm.kernels import gemm as cpu_gemm, gemv
    from looplm.layers import loss as loss_mod
    from looplm.layers.attention import CPUAttention

    cpu_malloc.keep_freed_memory()  # as looplm train does: no page faults in the timings
    print(
        f"# CPU: {cpu_name()} (native bf16: {native_bf16()}, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    if not gemv.available():
        raise SystemExit(f"# the training kernels need looplm's AVX-512 build: {gemv.unavailable_reason()}")
    print("| what | PyTorch path, ms | looplm, ms | speed-up | TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, hd = 4, 256, 9, 3, 64
    for dt in (torch.bfloat16, torch.float32):
        q = torch.randn(B, T, H, hd, generator=g).to(dt).transpose(1, 2).requires_grad_()
        k = torch.randn(B, T, Hkv, hd, generator=g).to(dt).transpose(1, 2).requires_grad_()
        v = torch.randn(B, T, Hkv, hd, generator=g).to(dt).transpose(1, 2).requires_grad_()
        go = torch.randn(B, H, T, hd, generator=g).to(dt)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(go)

        def ours():
            CPUAttention.apply(q, k, v, True).backward(go)

        t = timed({"sdpa": sdpa, "ours": ours}, args.rounds)
        row(f"attention fwd + bwd, {str(dt)[6:]}, one layer", "SDPA", t["sdpa"], "CPUAttention", t["ours"])

    V = 49152
    y = torch.randint(0, V, (1024,), generator=g)
    for dt in (torch.bfloat16, torch.float32):
        z = torch.randn(1024, V, generator=g).to(dt)
        scale = torch.tensor(1.0 / 1024)

        def loop():
            loss_mod._chunk_softmax_(z.clone(), 0, y, y != -100, scale, torch.float32, True, torch.zeros(()))

        def op():
            torch.ops.looplm_cpu.cross_entropy_rows_(z.clone(), y, scale, True)

        t = timed({"loop": loop, "op": op}, max(3, args.rounds // 4))
        row(
            f"cross-entropy + gradient, 1024 × 49,152 {str(dt)[6:]} logits",
            "loss.py loop",
            t["loop"],
            "cross_entropy_rows_",
            t["op"],
        )

    M = 1024
    for name, K, N in [
        ("q/o_proj", 576, 576),
        ("k/v_proj", 576, 192),
        ("gate/up_proj", 576, 1536),
        ("down_proj", 1536, 576),
    ]:
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        gy = torch.randn(M, N, generator=g).bfloat16()
        f = 2 * M * K * N
        for label, a, b in (
            (f"{name} forward x Wᵀ [{M}, {K}] · [{K}, {N}]", x, w.t()),
            (f"{name} input grad dy W [{M}, {N}] · [{N}, {K}]", gy, w),
        ):
            cpu_gemm.plan(a, b)  # measure the split first (kept on disk)
            t = timed({"torch": lambda a=a, b=b: a @ b, "tuned": lambda a=a, b=b: cpu_gemm.mm(a, b)}, args.rounds)
            row(f"{label} ({cpu_gemm.plan(a, b)})", "matmul", t["torch"], "cpu_gemm.mm", t["tuned"], f)
        t = timed({"torch": lambda: (gy.t() @ x).float(), "mkl": lambda: cpu_gemm.mm_f32(gy.t(), x)}, args.rounds)
        row(
            f"{name} weight grad dyᵀ x → fp32 [{N}, {M}] · [{M}, {K}]",
            "matmul + cast",
            t["torch"],
            "mm_f32",
            t["mkl"],
            f,
        )

    for name, outs in [("q/k/v", (576, 192, 192)), ("gate/up", (1536, 1536))]:
        layers = [torch.nn.Linear(576, o, bias=False) for o in outs]
        cpu_gemm.tuned_linears(torch.nn.ModuleList(layers))
        x = torch.randn(4, 256, 576, generator=g, requires_grad=True)
        gos = [torch.randn(4, 256, o, generator=g) for o in outs]

        def step(grouped, layers=layers, x=x, gos=gos):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ys = cpu_gemm.linear_group(x, layers) if grouped else [m(x) for m in layers]
            torch.autograd.backward(ys, [go.bfloat16() for go in gos])

        t = timed({"each": lambda: step(False), "stacked": lambda: step(True)}, args.rounds)
        f = 6 * 1024 * 576 * sum(outs)
        row(f"{name} forward + both gradients, one layer", "layer by layer", t["each"], "linear_group", t["stacked"], f)

    import looplm
    from looplm.train.grad_norm import clip_factor
    from looplm.train.optim import MultiOptimizer

    cfg = {
        "name": "smollm2-135m-shape",
        "vocab_size": V,
        "d_model": 576,
        "n_core": 30,
        "n_loops": 1,
        "d_ff": 1536,
        "attention": {"n_heads": 9, "n_kv_heads": 3},
        "tie_embeddings": True,
        "max_seq_len": 256,
    }
    params = list(looplm.build(cfg).parameters())
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    grads = [p.grad for p in params]
    t = timed(
        {
            "torch": lambda: torch.nn.utils.get_total_norm(grads, 2.0),
            "op": lambda: torch.ops.looplm_cpu.sum_squares(grads).sqrt(),
        },
        max(3, args.rounds // 2),
    )
    row(
        f"gradient norm over {sum(x.numel() for x in grads) * 4 / 1e6:.0f} MB of fp32 gradients",
        "get_total_norm",
        t["torch"],
        "sum_squares",
        t["op"],
    )
    opt = MultiOptimizer({"adamw": torch.optim.AdamW(params, lr=1e-9, fused=True)})
    total = torch.nn.utils.get_total_norm(grads, 2.0)

    def clip_then_step():
        torch.nn.utils.clip_grads_with_norm_(params, 1e-3, total)
        opt.step()

    t = timed(
        {"torch": clip_then_step, "folded": lambda: opt.step(grad_factor=clip_factor(float(total), total, 1e-3))},
        max(3, args.rounds // 2),
    )
    row(
        "clip + fused AdamW step, all parameters",
        "clip_grads_with_norm_ + step",
        t["torch"],
        "step(grad_factor)",
        t["folded"],
    )


if __name__ == "__main__":
    main()
