"""``looplm bench decode``: the decoding-latency study of the StateLoop paper (Tab. 3 protocol).

Batch 1, a prefill of ``P`` tokens, then an ``N``-token greedy continuation with the per-loop caches;
latency = continuation time / ``N`` (ms/token), mean ± std over ``--runs`` runs, and the change of the
mean against Vanilla Looped at K = 4 measured in the same run. The six models of Tab. 3 are built from
their paper presets with the backbone shrunk to ``--d-model`` × ``--layers`` (heads of 64, SwiGLU
8d/3 rounded up to 64, ``d_s = d``), so each keeps its structure:

* Vanilla Looped K = 4 and K = 5 (``stateloop-1.4b-vanilla``, ``-k5``);
* Vanilla Looped + FFN (``stateloop-1.4b-vanilla-ffn``): the SwiGLU widened until the model has the
  parameters of StateLoop + Mamba-2 at this size (as the paper's 5504 → 5818);
* StateLoop, StateLoop + Attn, StateLoop + Mamba-2 (``stateloop-1.4b``, ``-attn``, ``-mamba2``).

Models are measured interleaved token by token (every model decodes token ``t`` in a rotating order
before any decodes ``t + 1``), so that a burst of load on a shared machine hits every model alike. The
backbone must be big enough that the per-operation overhead of batch-1 decoding does not dominate (at
d = 128 × 2 layers the state branch's few extra kernels read as +25–42%); 512 × 8 is the default.

On a Linux CPU the measurement runs in a child process with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU
allocator then 2 MB-aligns large tensors and advises transparent huge pages for them). Without it, two
identical Vanilla models built one after the other in one process decoded 22% apart on the
development machine (some instances' weights land on 4 kB pages, others do not: TLB misses while
streaming the weights), far more than the effect being measured; with it they agree within 0.3%.

    looplm bench decode                      # defaults: d 512, 8 layers, P 256, N 128, 5 runs
    looplm bench decode --json --threads 1   # a JSON list, one object per model
    looplm bench decode --threads 1 --clock cpu   # a shared, overloaded CPU: time the process's own CPU
    looplm bench decode --lean --dtype bf16       # the path generate takes (fused blocks and state mixers)
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

__all__ = ["DECODE_MODELS", "build_decode_models", "cpu_description", "decode_latency", "register"]

# Tab. 3 rows: key -> (the model name of Tab. 3, its paper preset)
DECODE_MODELS = {
    "vanilla-k4": ("Vanilla Looped", "stateloop-1.4b-vanilla"),
    "vanilla-k5": ("Vanilla Looped", "stateloop-1.4b-vanilla-k5"),
    "vanilla-ffn": ("Vanilla Looped + FFN", "stateloop-1.4b-vanilla-ffn"),
    "stateloop": ("StateLoop", "stateloop-1.4b"),
    "stateloop-attn": ("StateLoop + Attn", "stateloop-1.4b-attn"),
    "stateloop-mamba2": ("StateLoop + Mamba-2", "stateloop-1.4b-mamba2"),
}


def cpu_description() -> str:
    """CPU model name and whether it has native bf16 matrix instructions (AVX512-BF16 / AMX)."""
    from ..utils import cpuinfo

    name, flags = cpuinfo.model_name() or "unknown CPU", cpuinfo.flags()
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(extra) if extra else 'no avx512_bf16/amx'})"


def _overrides(name: str, d: int, layers: int, vocab: int, max_len: int) -> dict:
    from ..config import preset_dict, swiglu_hidden

    ov = {
        "d_model": d,
        "n_core": layers,
        "vocab_size": vocab,
        "max_seq_len": max_len,
        "d_ff": swiglu_hidden(d),
        "attention.n_heads": max(1, d // 64),
        "attention.head_dim": 64 if d >= 64 else d,
    }
    rule = preset_dict(name).get("rule")
    if rule and rule.get("name") == "stateloop":
        opts = {**rule.get("options", {}), "d_s": d}
        if opts.get("mixer") == "mamba2":  # 8 groups need 8 | heads: fewer groups below d = 256
            heads, g = opts.get("mamba_expand", 2) * d // opts.get("mamba_headdim", 64), opts.get("mamba_ngroups", 8)
            while g > 1 and heads % g:
                g //= 2
            opts["mamba_ngroups"] = g
        ov["rule"] = {"name": "stateloop", "options": opts}
    return ov


def build_decode_models(
    names,
    *,
    d_model: int = 512,
    layers: int = 8,
    vocab: int = 8192,
    max_len: int = 2048,
    device="cpu",
    dtype=None,
    seed: int = 0,
) -> dict:
    """``{key: model}`` of the Tab. 3 rows ``names`` (keys of :data:`DECODE_MODELS`) at the given size."""
    import torch

    from ..factory import build

    def make(key, extra=None):
        torch.manual_seed(seed)
        ov = _overrides(DECODE_MODELS[key][1], d_model, layers, vocab, max_len)
        ov.update(extra or {})
        return build(DECODE_MODELS[key][1], overrides=ov, device=device, dtype=dtype).eval()

    models = {}
    for key in names:
        if key not in DECODE_MODELS:
            raise ValueError(f"unknown model {key!r}; choose from {list(DECODE_MODELS)}")
        if key == "vanilla-ffn":  # widen the FFN to the parameter count of StateLoop + Mamba-2 at this size
            target = build(
                DECODE_MODELS["stateloop-mamba2"][1],
                device="meta",
                overrides=_overrides(DECODE_MODELS["stateloop-mamba2"][1], d_model, layers, vocab, max_len),
            ).num_params()
            base = build(
                DECODE_MODELS["vanilla-k4"][1],
                device="meta",
                overrides=_overrides(DECODE_MODELS["vanilla-k4"][1], d_model, layers, vocab, max_len),
            )
            extra_ff = round((target - base.num_params()) / (3 * d_model * layers))
            models[key] = make(key, {"d_ff": base.config.d_ff + extra_ff})
        else:
            models[key] = make(key)
    return models


def decode_latency(
    models: dict,
    *,
    prefill: int = 256,
    new_tokens: int = 128,
    runs: int = 5,
    warmup: int = 1,
    seed: int = 0,
    progress=None,
    clock: str = "wall",
    lean: bool = False,
) -> list[dict]:
    """Tab. 3 protocol on ``{key: model}``; one dict per model (the first key is the baseline).

    Each run prefills every model with the same random prompt (fresh caches), then decodes the
    ``N`` continuation tokens greedily, one token of every model in turn (a rotating order): a model's
    latency in a run is the sum of its own step times / ``N``. Interleaving at the token level makes a
    burst of load from other processes hit every model alike, which whole-run interleaving does not.

    ``lean=True`` decodes as ``generate`` does: KV slots preallocated for prompt + continuation, the products
    on looplm's decode kernels and every eligible block and state mixer on the fused ops
    (:mod:`looplm.kernels`, entered through :func:`looplm.dispatch.decode_steps`); the default is the reference forward with growing caches, the same plain
    PyTorch for every model.

    ``clock="cpu"`` times steps with the process CPU time instead of the wall clock: on an overloaded
    shared CPU the wall clock mostly measures the time other processes hold the cores; with one torch
    thread the CPU time is the step's own compute. ``step_median_ms`` (median over every step of every
    run) and its ``change_pct_step_median`` are the outlier-robust companions of the mean.
    """
    import torch

    first = next(iter(models.values()))
    device = next(first.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, first.config.vocab_size, (1, prefill), generator=g).to(device)
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.process_time
    keys = list(models)
    times = {k: [] for k in keys}
    steps = {k: [] for k in keys}
    prefills = {k: [] for k in keys}
    with torch.inference_mode(), contextlib.ExitStack() as lean_paths:
        if lean:
            from .. import dispatch, kernels

            kernels.load(device)
            for m in models.values():
                lean_paths.enter_context(dispatch.decode_steps(m, batch_size=1))
        for run in range(warmup + runs):
            n_new = new_tokens if run >= warmup else min(new_tokens, 8)
            caches, toks, spent = {}, {}, dict.fromkeys(keys, 0.0)
            for k in keys:  # prefill
                caches[k] = models[k].new_cache(1, capacity=prefill + new_tokens if lean else None)
                sync()
                t0 = now()
                toks[k] = models[k](prompt, cache=caches[k]).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
                sync()
                if run >= warmup:
                    prefills[k].append(1000 * (now() - t0))
            for t in range(n_new):
                shift = (run + t) % len(keys)
                for k in keys[shift:] + keys[:shift]:
                    t0 = now()
                    toks[k] = models[k](toks[k], cache=caches[k]).logits[:, -1].argmax(-1, keepdim=True)
                    sync()
                    dt = now() - t0
                    spent[k] += dt
                    if run >= warmup:
                        steps[k].append(1000 * dt)
            if run >= warmup:
                for k in keys:
                    times[k].append(1000 * spent[k] / n_new)
                if progress:
                    progress(run - warmup + 1, runs)
    base = statistics.mean(times[keys[0]])
    base_med = statistics.median(times[keys[0]])
    base_step = statistics.median(steps[keys[0]])
    rows = []
    for k in keys:
        t = times[k]
        mean = statistics.mean(t)
        m = models[k]
        rows.append(
            {
                "model": DECODE_MODELS.get(k, (k,))[0],
                "key": k,
                "loops": m.config.n_loops,
                "params": m.num_params(),
                "ms_per_token": mean,
                "ms_per_token_std": statistics.stdev(t) if len(t) > 1 else 0.0,
                "ms_per_token_median": statistics.median(t),
                "tokens_per_s": 1000 / mean,
                "change_pct": 100 * (mean / base - 1),
                "change_pct_median": 100 * (statistics.median(t) / base_med - 1),
                "step_median_ms": statistics.median(steps[k]),
                "change_pct_step_median": 100 * (statistics.median(steps[k]) / base_step - 1),
                "prefill_ms": statistics.mean(prefills[k]),
                "runs": t,
                "clock": clock,
                "path": "lean" if lean else "reference",
            }
        )
    return rows


def _child_argv(args) -> list[str]:
    """The ``looplm bench decode`` command line of ``args`` (for the re-run in a child process)."""
    argv = [
        "bench",
        "decode",
        "--d-model",
        str(args.d_model),
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
        "--prefill",
        str(args.prefill),
        "--new",
        str(args.new),
        "--runs",
        str(args.runs),
        "--models",
        args.models,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--clock",
        args.clock,
    ]
    return argv + (["--json"] if args.json else []) + (["--lean"] if args.lean else [])


def _check_bench_args(args) -> None:
    """One error naming every bad ``bench decode`` argument (counts, threads, device, models)."""
    import torch

    from ..dataclass_util import ConfigError

    errs = [
        f"{flag}: must be >= 1, got {v}"
        for flag, v in (
            ("--prefill", args.prefill),
            ("--new", args.new),
            ("--runs", args.runs),
            ("--d-model", args.d_model),
            ("--layers", args.layers),
            ("--vocab", args.vocab),
        )
        if v < 1
    ]
    if args.threads < 0:
        errs.append(f"--threads: must be >= 1, or 0 for torch's default, got {args.threads}")
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except (RuntimeError, ValueError):
            dev = None
            errs.append(f"--device: {args.device!r} is not a device; use auto, cpu, cuda or cuda:N")
        if dev is not None and dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0:
                errs.append(f"--device {args.device}: no CUDA device is available here; use cpu or auto")
            elif dev.index is not None and dev.index >= n:
                errs.append(f"--device {args.device}: there are {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
        elif dev is not None and dev.type != "cpu":
            errs.append(f"--device {args.device}: only cpu and cuda devices are supported")
    names = list(DECODE_MODELS) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    errs += [
        f"--models: unknown model {n!r}; choose from {', '.join(DECODE_MODELS)} (or all)"
        for n in names
        if n not in DECODE_MODELS
    ]
    if not names:
        errs.append(f"--models: no model given; choose from {', '.join(DECODE_MODELS)} (or all)")
    if errs:
        raise ConfigError(errs, "bench decode arguments")


def cmd_bench_decode(args) -> int:
    import os
    import subprocess
    import sys

    import torch

    _check_bench_args(args)  # before the child process is started or a model is built
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if (
        on_cpu
        and sys.platform.startswith("linux")
        and "THP_MEM_ALLOC_ENABLE" not in os.environ
        and not args.same_process
    ):
        # PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: re-run in a child process with it set
        # (large tensors 2 MB-aligned on transparent huge pages; see the module docstring)
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
        child = subprocess.run(
            [sys.executable, "-m", "looplm.cli", *_child_argv(args)], env=env, capture_output=True, text=True
        )
        print(child.stdout, end="")
        print(child.stderr, end="", file=sys.stderr)
        return child.returncode
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    names = list(DECODE_MODELS) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    if names[0] != "vanilla-k4":
        names = ["vanilla-k4"] + [n for n in names if n != "vanilla-k4"]  # the baseline is always measured
    models = build_decode_models(
        names,
        d_model=args.d_model,
        layers=args.layers,
        vocab=args.vocab,
        max_len=args.prefill + args.new + 1,
        device=device,
        dtype=dtype,
    )
    where = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else cpu_description()
    if not args.json:
        print(
            f"decode latency: batch 1, prefill {args.prefill}, {args.new} new tokens, {args.runs} runs, {args.dtype}, "
            f"d={args.d_model} x {args.layers} layers, vocab {args.vocab}, {torch.get_num_threads()} threads, "
            f"{args.clock} clock, {'lean' if args.lean else 'reference'} path; {where}"
        )
    progress = None if args.json else (lambda i, n: print(f"  run {i}/{n} done", flush=True))
    rows = decode_latency(
        models,
        prefill=args.prefill,
        new_tokens=args.new,
        runs=args.runs,
        progress=progress,
        clock=args.clock,
        lean=args.lean,
    )
    for r in rows:
        r["device"] = where
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'model':22s} {'K':>2s} {'params':>11s} {'ms/token':>17s} {'tok/s':>8s} {'change':>9s} {'step median':>17s}"
    )
    for r in rows:
        change = "baseline" if r["key"] == rows[0]["key"] else f"{r['change_pct']:+.2f}%"
        print(
            f"{r['model']:22s} {r['loops']:2d} {r['params']:11,d} {r['ms_per_token']:8.3f} ± {r['ms_per_token_std']:6.3f} "
            f"{r['tokens_per_s']:8.2f} {change:>9s} {r['step_median_ms']:8.3f} {r['change_pct_step_median']:+7.2f}%"
        )
    return 0


def register(sub) -> None:
    """``bench decode`` under ``looplm bench`` (called by :func:`looplm.bench.register`)."""
    d = sub.add_parser(
        "decode",
        help="batch-1 decoding latency of Vanilla Looped K=4/5, +FFN and StateLoop (identity / attention / Mamba-2)",
    )
    d.add_argument("--d-model", type=int, default=512)
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--vocab", type=int, default=8192)
    d.add_argument("--prefill", type=int, default=256, help="prompt tokens P (the paper: 1024)")
    d.add_argument("--new", type=int, default=128, help="continuation tokens N (the paper: 1024)")
    d.add_argument("--runs", type=int, default=5)
    d.add_argument(
        "--models",
        default="all",
        help=f"comma-separated subset of {','.join(DECODE_MODELS)} (vanilla-k4 is always the baseline)",
    )
    d.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    d.add_argument("--device", default="auto")
    d.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    d.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall = latency (the paper); cpu = process CPU time (an overloaded shared CPU; use with --threads 1)",
    )
    d.add_argument(
        "--lean",
        action="store_true",
        help="decode as generate does (preallocated KV, decode kernels, fused blocks and state mixers); "
        "default: the reference forward with growing caches for every model",
    )
    d.add_argument("--json", action="store_true", help="print a JSON list, one object per model")
    d.add_argument(
        "--same-process",
        action="store_true",
        help="on a Linux CPU, do not re-run in a child process with THP_MEM_ALLOC_ENABLE=1",
    )
    d.set_defaults(func=cmd_bench_decode)
