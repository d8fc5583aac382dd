"""One prepared check of looplm's CUDA paths, for the few minutes a GPU is lent (see the README).

Sections (each guarded: one failing does not stop the others; the report is flushed as it goes):

1. ``parity``   — every preset's tiny variant: CUDA fp32 (TF32 off) == the CPU fp32 reference (logits,
                  loss, every parameter gradient), cached decoding == full forward on CUDA, bf16 autocast
                  on CUDA close to fp32.
2. ``loss``     — the chunked head + cross-entropy on CUDA == the plain one (bf16), and its peak memory
                  and time at the StateLoop 1.4B head (8 × 2048 tokens, d 2048, vocabulary 50,432).
3. ``train``    — ``looplm train`` on CUDA in bf16: a run checkpointed half-way and resumed gives the same
                  losses as one straight run (exactly, or the largest difference); ``compile: auto`` on.
4. ``speed``    — ``benchmarks/bench_train.py --device cuda`` (SmolLM2-135M shape, bf16).
5. ``decode``   — ``benchmarks/bench_decode.py --device cuda`` (bf16, batch 1 and 8; eager and compiled).
6. ``adaptive`` — per-token exit on the device: the token / depth / static schedules' greedy tokens against
                  the CPU reference, host synchronisations per core pass (the static schedule under
                  ``set_sync_debug_mode('error')``), decode time per token of each against full depth.
7. ``forward``  — per-token exit in one forward (``looplm.decode.exit_forward``) on the device: its logits and
                  exits against the CPU reference (fp32, TF32 off) for attention / hybrid / Mamba-2 cores,
                  ``prefill='exit'`` generation == the CPU's, and its time against the plain forward (bf16,
                  d = 1024 / 2048, batch 8 × 512 tokens, exit depths replayed from 1..4).

Measured on an H200 (2026-11-30): parity ~80 s, loss ~5 s, train ~55 s, speed ~75 s per shape,
decode ~120 s (adaptive, forward: not run on a GPU yet; 296 s and 34 s on the 2-core CPU dry run); the default
budget (560 s) fits one device call.

    PYTHONPATH=src python benchmarks/check_cuda.py --out DIR [--only parity,loss,train,speed,decode,adaptive,forward]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from _machine import sync  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_variant: the presets' structure at toy widths


DEV = "cuda"  # --device cpu: a dry run of the script's own logic on a machine without a GPU


class Report:
    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "w")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def max_rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max |a − b| over max |b| (or ``scale``); equal entries count 0 (PauseLM's −inf pause logit)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    diff = torch.where(a == b, 0.0, a - b).abs().max()
    ref = scale if scale is not None else b[torch.isfinite(b)].abs().max().clamp(min=1e-12)
    return float(diff / ref)


def section_parity(rep: Report) -> None:
    import looplm
    from helpers import tiny_variant

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rep(
        "| preset (tiny variant) | logits rel | loss rel | worst grad (rel. to the largest) | cached == full | bf16 loss rel | verdict |"
    )
    rep("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    bad = 0
    for name in looplm.list_presets():
        try:
            torch.manual_seed(0)
            cfg = tiny_variant(name)
            cpu = looplm.build(cfg).train()
            gpu = looplm.build(cfg, device=DEV).train()
            gpu.load_state_dict(cpu.state_dict())
            x = torch.randint(0, cfg.vocab_size, (2, 14))  # 14 tokens: room for the Pause preset's pauses
            oc = cpu(x, labels=x)
            og = gpu(x.to(DEV), labels=x.to(DEV))
            oc.loss.backward()
            og.loss.backward()
            lr_ = max_rel(og.logits, oc.logits)
            ls_ = max_rel(og.loss, oc.loss)
            # relative to the largest gradient of the model: a parameter whose gradient is zero at init up
            # to rounding (e.g. Hyperloop's W_pre, |g| ~ 1e-10) has no meaningful relative error of its own
            pairs = [(p.grad, q.grad) for p, q in zip(cpu.parameters(), gpu.parameters()) if p.grad is not None]
            gscale = max(float(g.abs().max()) for g, _ in pairs)
            gr = max(max_rel(q, g, gscale) for g, q in pairs)
            gpu.eval()
            with torch.no_grad():
                xg = x.to(DEV)
                full = gpu(xg).logits
                cache = gpu.new_cache(2)
                parts = [gpu(xg[:, :6], cache=cache).logits]
                parts += [gpu(xg[:, t : t + 1], cache=cache).logits for t in range(6, 14)]
                cached = max_rel(torch.cat(parts, 1), full)
                with torch.autocast(DEV, dtype=torch.bfloat16):
                    lb = gpu(xg, labels=xg, return_logits=False).loss
                bf = max_rel(lb, og.loss)
            ok = lr_ < 1e-4 and ls_ < 1e-5 and gr < 1e-3 and cached < 1e-4 and bf < 5e-2
            bad += not ok
            rep(f"| {name} | {lr_:.1e} | {ls_:.1e} | {gr:.1e} | {cached:.1e} | {bf:.1e} | {'ok' if ok else 'CHECK'} |")
        except Exception as e:  # report and go on
            bad += 1
            rep(f"| {name} | error: {type(e).__name__}: {str(e)[:150]} | | | | | FAIL |")
    rep(f"\nparity: {bad} preset(s) outside tolerance (logits 1e-4, loss 1e-5, grads 1e-3, cached 1e-4, bf16 5e-2)")


def _wide_lm(d: int):
    """A random bf16 looped Transformer at width ``d`` on the device: 2 blocks x 4 loops, 32k vocabulary."""
    import looplm

    torch.manual_seed(0)
    return looplm.build(
        "tiny-llama",
        overrides={
            "d_model": d,
            "n_core": 2,
            "n_loops": 4,
            "d_ff": 3 * d,
            "vocab_size": 32000,
            "max_seq_len": 1024,
            "attention.n_heads": d // 64,
            "attention.n_kv_heads": d // 64,
            "attention.head_dim": 64,
        },
        dtype=torch.bfloat16,
        device=DEV,
    ).eval()


def _alternate(runs: dict, rounds: int = 3) -> tuple[dict, dict]:
    """Each of ``runs`` (name -> call) once per round, the order reversed every other round, after one warm-up
    round: ``({name: [seconds per round]}, {name: its last result})``."""
    times, last = {k: [] for k in runs}, {}
    for it in range(rounds + 1):  # 0 warms up
        for k in list(runs) if it % 2 else list(runs)[::-1]:
            sync(DEV)
            t0 = time.perf_counter()
            last[k] = runs[k]()
            sync(DEV)
            if it:
                times[k].append(time.perf_counter() - t0)
    return times, last


def section_adaptive(rep: Report) -> None:
    """Adaptive depth on the device: (a) greedy tokens of the three batch schedules against the CPU
    reference (replayed depths, the kl criterion); (b) host synchronisations per core pass — the static
    schedule's passes under ``torch.cuda.set_sync_debug_mode('error')`` (any synchronisation raises) and the
    dispatch-level host-read count of both depth schedules; (c) time per token, bf16, random weights at
    d = 1024 / 2048 (2 blocks × 4 loops), batch 8 and 32, exit depths drawn from 1..4 (executed / K ≈ 0.62):
    full depth against the token, depth and static schedules, alternated, medians of 3 runs."""
    import statistics
    import warnings

    import looplm
    from host_reads import HostReads
    from looplm import dispatch
    from looplm.decode.depth_schedule import DepthBatchedDecoder
    from looplm.decode.static_schedule import StaticDepthDecoder

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    greedy = lambda x: x.max(-1).indices  # noqa: E731
    rep("(a) greedy tokens on the device == the CPU reference's (token schedule), fp32\n")
    rep("| model | exit | token | depth | static |")
    rep("| --- | --- | ---: | ---: | ---: |")
    for name in ("tiny-llama", "tiny-coreloop", "tiny-qwen3", "tiny-hybrid"):
        torch.manual_seed(0)
        cpu = looplm.build(name).eval()
        dev = looplm.build(name, device=DEV).eval()
        dev.load_state_dict(cpu.state_dict())
        K = cpu.config.n_loops
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 250, (4, 6), generator=g)
        depths = torch.randint(1, K + 1, (4, 12), generator=g)
        for label, spec in (
            ("replay copy", {"criterion": "replay", "depths": depths, "kv": "copy"}),
            ("replay propagate", {"criterion": "replay", "depths": depths, "kv": "propagate"}),
            ("kl 0.5 copy", {"criterion": "kl", "threshold": 0.5, "kv": "copy"}),
        ):
            with dispatch.reference_only():
                ref = cpu.generate(ids, 12, exit=spec)
            agree = []
            for s in ("token", "depth", "static"):
                try:
                    agree.append(
                        f"{float((dev.generate(ids.to(DEV), 12, exit={**spec, 'schedule': s}).cpu() == ref).float().mean()):.3f}"
                    )
                except ValueError as e:  # e.g. kl with coda layers under the static schedule
                    agree.append("refused: " + str(e).split(";")[0][6:60])
            rep(f"| {name} | {label} | " + " | ".join(agree) + " |")

    rep("\n(b) host synchronisations per core pass (tiny-llama, batch 4, kl 0.5)\n")
    torch.manual_seed(0)
    m = looplm.build("tiny-llama", device=DEV).eval()
    ids = torch.randint(0, 250, (4, 6), device=DEV)
    spec = {"criterion": "kl", "threshold": 0.5}
    st = StaticDepthDecoder(m, 4, 22, {**spec, "schedule": "static"})
    tick, reads, err = st._tick, [], None

    def strict(*a, **k):
        with HostReads() as r:
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                tick(*a, **k)
            finally:
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        reads.extend(r.reads)

    st._tick = strict
    try:
        st.run(ids, 16, None, greedy, None, 0)
    except RuntimeError as e:
        err = str(e).splitlines()[0][:200]
    rep(
        f"- static: {st.stats.core_calls} passes, host reads seen by the dispatch mode: {len(reads)}; "
        f"set_sync_debug_mode('error'): {'raised: ' + err if err else 'no synchronisation' if DEV == 'cuda' else '(CUDA only)'}"
    )
    dyn = DepthBatchedDecoder(m, 4, 22, {**spec, "schedule": "depth"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostReads() as r:
                dyn.run(ids, 16, None, greedy, None, 0)
        finally:
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(x.message) for x in w)
    rep(
        f"- depth: {dyn.stats.core_calls} passes, host reads {len(r.reads)} (prompt included), CUDA synchronisation "
        f"warnings {syncs}: {len(r.reads) / max(dyn.stats.core_calls, 1):.1f} reads per pass"
    )
    if DEV == "cuda":  # one pass captured as a CUDA graph, replayed for the others: the eager passes' tokens
        for spec_g in (
            spec,
            {"criterion": "replay", "depths": torch.randint(1, 4, (4, 20), device=DEV), "kv": "propagate"},
        ):
            try:
                eager = StaticDepthDecoder(m, 4, 22, {**spec_g, "schedule": "static"}).run(
                    ids, 16, None, greedy, None, 0
                )
                graphed = StaticDepthDecoder(m, 4, 22, {**spec_g, "schedule": "static"}, cuda_graphs=True)
                same = torch.equal(graphed.run(ids, 16, None, greedy, None, 0), eager)
                rep(
                    f"- static with cuda_graphs ({spec_g['criterion']}): {graphed.passes} passes, tokens == eager: {same}"
                )
            except Exception as e:
                rep(f"- static with cuda_graphs ({spec_g['criterion']}): error {type(e).__name__}: {str(e)[:300]}")
    try:  # the pass through torch.compile (exit compile=True): the eager passes' tokens
        eager = StaticDepthDecoder(m, 4, 22, {**spec, "schedule": "static"}).run(ids, 16, None, greedy, None, 0)
        t0 = time.perf_counter()
        comp = StaticDepthDecoder(m, 4, 22, {**spec, "schedule": "static", "compile": True})
        same = torch.equal(comp.run(ids, 16, None, greedy, None, 0), eager)
        rep(
            f"- static with compile=True ({spec['criterion']}): tokens == eager: {same}, first run (compiling) {time.perf_counter() - t0:.1f} s"
        )
    except Exception as e:
        rep(f"- static with compile=True: error {type(e).__name__}: {str(e)[:300]}")

    rep("\n(c) decode time per token, bf16, random weights, exit depths drawn from 1..4\n")
    rep(
        "| d_model | batch | full ms/token | token ×full | depth ×full | static ×full | static + graphs ×full | static compiled ×full | executed / K | static passes / step |"
    )
    rep("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in (1024, 2048):
        m = _wide_lm(d)
        for B in (8, 32):
            g = torch.Generator().manual_seed(2)
            ids = torch.randint(0, 32000, (B, 32), generator=g).to(DEV)
            new = 64
            depths = torch.randint(1, 5, (B, new + 8), generator=g)
            ex = {"criterion": "replay", "depths": depths.to(DEV), "kv": "copy"}
            runs = {"full": lambda: m.generate(ids, new)}
            for s in ("token", "depth", "static"):
                runs[s] = lambda s=s: m.generate(ids, new, exit={**ex, "schedule": s}, return_stats=True)

            def graphed():
                dec = StaticDepthDecoder(m, B, 32 + new, {**ex, "schedule": "static"}, cuda_graphs=True)
                return dec.run(ids, new, None, greedy, None, 0), dec.stats

            if DEV == "cuda":
                runs["graphs"] = graphed
            if d == 1024:  # (a compilation per model and batch: d = 1024 only, to keep the script short)
                runs["compiled"] = lambda: m.generate(
                    ids, new, exit={**ex, "schedule": "static", "compile": True}, return_stats=True
                )
            times, last = _alternate(runs)
            stats = {k: r[1] for k, r in last.items() if k != "full"}
            full = statistics.median(times["full"])
            ratio = {k: statistics.median(times[k]) / full for k in runs}
            summ = stats["static"].summary()
            gr = f"{ratio['graphs']:.3f}" if "graphs" in ratio else "(CUDA only)"
            co = f"{ratio['compiled']:.3f}" if "compiled" in ratio else "(d = 1024 only)"
            rep(
                f"| {d} | {B} | {1e3 * full / new:.2f} | {ratio['token']:.3f} | {ratio['depth']:.3f} | {ratio['static']:.3f} | "
                f"{gr} | {co} | {summ['executed_ratio']:.3f} | {summ['batch_depth']:.2f} |"
            )


def section_forward(rep: Report) -> None:
    """Per-token exit in one forward on the device: (a) logits and exits against the CPU reference (fp32, TF32
    off; kl, replay per position, copy / propagate), and ``prefill='exit'`` greedy generation == the CPU's;
    (b) time against the plain forward, bf16, random weights at d = 1024 / 2048 (2 blocks × 4 loops), batch 8
    × 512 tokens, depths replayed from 1..4 per position (executed / K ≈ 0.62), alternated, medians of 3."""
    import statistics

    import looplm
    from looplm import dispatch
    from looplm.decode.exit_forward import adaptive_forward

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rep("(a) the device against the CPU reference, fp32\n")
    rep("| model | exit | exits equal | max rel. logit diff | prefill='exit' tokens == CPU |")
    rep("| --- | --- | ---: | ---: | ---: |")
    for name in (
        "tiny-llama",
        "tiny-qwen3",
        "tiny-hybrid",
        "tiny-mamba2",
        "tiny-coreloop",
    ):  # (coreloop: kl through a coda)
        torch.manual_seed(0)
        cpu = looplm.build(name, n_loops=5).eval()
        dev = looplm.build(name, n_loops=5, device=DEV).eval()
        dev.load_state_dict(cpu.state_dict())
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 250, (4, 24), generator=g)
        for label, spec in (
            ("kl 0.003 copy", {"criterion": "kl", "threshold": 0.003, "kv": "copy"}),
            ("kl 0.003 propagate", {"criterion": "kl", "threshold": 0.003, "kv": "propagate"}),
            ("replay copy", {"criterion": "replay", "depths": torch.randint(1, 6, (4, 24), generator=g)}),
        ):
            with dispatch.reference_only():
                ref = adaptive_forward(cpu, ids, spec)
                ref_gen = (
                    cpu.generate(ids, 8, exit={**spec, "prefill": "exit"}) if spec["criterion"] != "replay" else None
                )
            dspec = {**spec, "depths": spec["depths"].to(DEV)} if "depths" in spec else spec
            got = adaptive_forward(dev, ids.to(DEV), dspec)
            gen = (
                "-"
                if ref_gen is None
                else f"{float((dev.generate(ids.to(DEV), 8, exit={**dspec, 'prefill': 'exit'}).cpu() == ref_gen).float().mean()):.3f}"
            )
            rep(
                f"| {name} | {label} | {float((got.depth.cpu() == ref.depth).float().mean()):.3f} | "
                f"{max_rel(got.logits, ref.logits):.1e} | {gen} |"
            )

    rep("\n(b) time against the plain forward, bf16, batch 8 x 512 tokens, depths replayed from 1..4\n")
    rep("| d_model | full ms | exit ms | time / full | executed / K | computed / K |")
    rep("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in (1024, 2048):
        m = _wide_lm(d)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 32000, (8, 512), generator=g).to(DEV)
        spec = {"criterion": "replay", "depths": torch.randint(1, 5, (8, 512), generator=g).to(DEV)}
        runs = {"full": lambda: m(ids).logits, "exit": lambda: adaptive_forward(m, ids, spec)}
        with torch.inference_mode():
            times, last = _alternate(runs)
        out = last["exit"]
        full, ex = statistics.median(times["full"]), statistics.median(times["exit"])
        rep(
            f"| {d} | {1e3 * full:.1f} | {1e3 * ex:.1f} | {ex / full:.3f} | {out.stats['executed_ratio']:.3f} | "
            f"{out.stats['computed_ratio']:.3f} |"
        )


def section_loss(rep: Report) -> None:
    from looplm.layers.loss import linear_cross_entropy, linear_cross_entropy_reference

    torch.manual_seed(0)
    h = torch.randn(300, 64, device=DEV, requires_grad=True)
    W = (0.2 * torch.randn(1000, 64, device=DEV)).requires_grad_()
    y = torch.randint(0, 1000, (300,), device=DEV)
    y[::7] = -100
    grads = []
    for fn in (linear_cross_entropy_reference, lambda a, b, c: linear_cross_entropy(a, b, c, chunk_size=128)):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = fn(h, W, y)
        loss.backward()
        grads.append((loss.detach(), h.grad.clone(), W.grad.clone()))
        h.grad = W.grad = None
    (l0, h0, w0), (l1, h1, w1) = grads
    rep(
        f"chunked vs plain on CUDA (bf16): loss rel {max_rel(l1, l0):.1e}, grad_h rel {max_rel(h1, h0):.1e}, "
        f"grad_W rel {max_rel(w1, w0):.1e}"
    )

    N, d, V = (8 * 2048 if DEV == "cuda" else 512), 2048, 50432  # StateLoop 1.4B micro-batch and head
    rep("\n| StateLoop 1.4B head, 8 x 2048 tokens, bf16 autocast | peak extra memory MB | fwd+bwd ms |")
    rep("| --- | ---: | ---: |")
    for label, fn in [
        ("plain F.linear + F.cross_entropy", linear_cross_entropy_reference),
        ("chunked, 1024 tokens", lambda a, b, c: linear_cross_entropy(a, b, c, chunk_size=1024)),
        ("chunked, 4096 tokens", lambda a, b, c: linear_cross_entropy(a, b, c, chunk_size=4096)),
    ]:
        hh = (0.5 * torch.randn(N, d, device=DEV)).requires_grad_()
        WW = (0.02 * torch.randn(V, d, device=DEV)).requires_grad_()
        yy = torch.randint(0, V, (N,), device=DEV)
        times = []
        peak = float("nan")
        for _ in range(4 if DEV == "cuda" else 1):
            sync(DEV)
            if DEV == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            with torch.autocast(DEV, dtype=torch.bfloat16):
                loss = fn(hh, WW, yy)
            loss.backward()
            sync(DEV)
            times.append(time.perf_counter() - t)
            if DEV == "cuda":
                peak = torch.cuda.max_memory_allocated() - base
            hh.grad = WW.grad = None
        rep(f"| {label} | {peak / 2**20:,.0f} | {sorted(times)[len(times) // 2] * 1e3:.1f} |")
        del hh, WW, yy


def run_cli(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def report_failure(rep: Report, p: subprocess.CompletedProcess) -> bool:
    """Report a failed command's output tail; whether it failed."""
    if p.returncode != 0:
        rep("```\n" + (p.stderr or p.stdout)[-1500:] + "\n```")
    return p.returncode != 0


def section_train(rep: Report) -> None:
    import shutil

    from looplm.train.metrics import read_metrics

    def metrics(d: Path) -> list[dict]:
        return read_metrics(d) if (d / "metrics.jsonl").exists() else []

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = [
            "-m",
            "looplm.cli",
            "train",
            str(ROOT / "configs/train/tiny.yaml"),
            "--quiet",
            "--max-steps",
            "40",
            "--checkpoint-every",
            "20",
            "--set",
            "train.precision=bf16",
            "--set",
            "eval.every=0",
            "--set",
            "eval.at_end=false",
            "--set",
            "train.compile=false",
            "--set",
            "logging.tensorboard=false",
            "--set",
            "checkpoint.keep_last=2",
        ]
        t = time.perf_counter()
        p = run_cli([*base, "--out", str(tmp / "a")], 240)
        rep(f"straight 40 steps (bf16, CUDA): rc {p.returncode} in {time.perf_counter() - t:.0f} s")
        if report_failure(rep, p):
            return
        # the resumed twin: the same run directory with only the step-20 checkpoint left
        shutil.copytree(tmp / "a", tmp / "b")
        steps = sorted((tmp / "b" / "ckpt").glob("step_*"))
        for d in steps[1:]:
            shutil.rmtree(d)
        p = run_cli([*base, "--out", str(tmp / "b")], 240)
        rep(f"resumed from {steps[0].name}: rc {p.returncode}")
        if report_failure(rep, p):
            return
        la = {r["step"]: r["loss"] for r in metrics(tmp / "a")}
        lb = {r["step"]: r["loss"] for r in metrics(tmp / "b")}
        later = [s for s in sorted(la) if s > 20 and s in lb]
        diffs = [abs(la[s] - lb[s]) for s in later]
        rep(
            f"loss {la[min(la)]:.3f} -> {la[max(la)]:.3f}; straight vs resumed at steps 21-40: "
            f"{sum(d == 0 for d in diffs)}/{len(diffs)} identical, max |diff| {max(diffs) if diffs else float('nan'):.2e}"
        )
        t = time.perf_counter()
        p = run_cli(
            [
                "-m",
                "looplm.cli",
                "train",
                str(ROOT / "configs/train/tiny.yaml"),
                "--quiet",
                "--out",
                str(tmp / "c"),
                "--max-steps",
                "200",
                "--checkpoint-every",
                "1000",
                "--set",
                "eval.every=0",
                "--set",
                "eval.at_end=false",
                "--set",
                "logging.tensorboard=false",
            ],
            300,
        )
        rows = metrics(tmp / "c")
        comp = [r["compile_step_s"] for r in rows if "compile_step_s" in r]
        tps = sorted(r["tokens_per_s"] for r in rows[10:] if r.get("tokens_per_s"))
        rep(
            f"defaults (precision auto, compile auto), 200 steps: rc {p.returncode} in {time.perf_counter() - t:.0f} s; "
            f"first step {comp[0] if comp else 'n/a'} s (compiled: {bool(comp)}); median "
            f"{tps[len(tps) // 2] if tps else 0:,.0f} tokens/s; loss {rows[0]['loss'] if rows else float('nan'):.3f} -> "
            f"{rows[-1]['loss'] if rows else float('nan'):.3f}"
        )
        report_failure(rep, p)


def section_bench(rep: Report, args: list[str], timeout: int) -> None:
    t = time.perf_counter()
    try:
        p = run_cli(args, timeout)
        rep(p.stdout.strip())
        report_failure(rep, p)
    except subprocess.TimeoutExpired as e:
        rep(
            f"timed out after {timeout} s; partial output:\n{(e.stdout or b'').decode()[-3000:] if isinstance(e.stdout, bytes) else e.stdout}"
        )
    rep(f"({time.perf_counter() - t:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="parity,loss,train,speed,decode,adaptive,forward")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole check (benchmarks get the rest)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEV
    DEV = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out / "cuda_report.md")
    import transformers

    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "dry run on CPU"
    rep(
        f"# looplm CUDA check — {gpu}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    start = time.perf_counter()
    for name in args.only.split(","):
        rep(f"\n## {name}\n")
        t = time.perf_counter()
        left = int(args.budget - (t - start))
        if left < 30:
            rep(f"skipped: {left} s of the budget left")
            continue
        try:
            if name == "parity":
                section_parity(rep)
            elif name == "loss":
                section_loss(rep)
            elif name == "train":
                section_train(rep)
            elif name == "adaptive":
                section_adaptive(rep)
            elif name == "forward":
                section_forward(rep)
            elif name == "decode":
                section_bench(
                    rep,
                    [
                        str(HERE / "bench_decode.py"),
                        "--device",
                        DEV,
                        "--dtypes",
                        "bf16",
                        "--batches",
                        "1,8",
                        "--new",
                        "64",
                        "--rounds",
                        "2",
                    ],
                    min(150, left),
                )
            elif name == "speed":
                section_bench(
                    rep,
                    [
                        str(HERE / "bench_train.py"),
                        "--device",
                        DEV,
                        "--batch",
                        "16",
                        "--seq",
                        "1024",
                        "--steps",
                        "8",
                        "--warmup",
                        "3",
                        "--only",
                        "hf,looplm,looplm-compiled",
                    ],
                    left,
                )
        except Exception:
            rep("```\n" + traceback.format_exc()[-2000:] + "\n```")
        rep(f"\n({name}: {time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
