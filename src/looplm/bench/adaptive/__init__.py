"""``looplm bench adaptive``: what per-token exit and self-speculative decoding really save (issue #23).

Every number is measured against full-depth decoding *in the same process*, on models trained here:

* ``lm`` — a looped Transformer (2 shared blocks × K = 4, d = 256) trained on a corpus with a random loop
  count per step (``configs/bench/adaptive-lm.yaml``); zero-shot exit criteria (``kl``, ``convergence``)
  and the r_d-loop self-speculative draft;
* ``phop`` — p-hop (n = 32, p = 4) on a 1⊗4 looped Transformer with the two-stage exit gate (stage 1
  by ``looplm task phop train configs/bench/adaptive-phop-gate.yaml``, stage 2 here): the ``gate``
  criterion.

Tables (``--sections``, each a list of dicts in the JSON written to ``--out``):

* ``quality`` — teacher-forced decoding of held-out text with exits: selected and executed depth, fill
  and check FLOPs, greedy agreement with full depth and ``KL(full ‖ adaptive)`` of the next-token
  distributions, per criterion threshold and KV policy; PPL;
* ``timing`` — decode-only wall (and CPU) time per generated token, adaptive vs full depth, on the same
  prompts, at batch 1 and 8, fp32 and bf16, on the fused CPU path: the wall-time ratio beside the
  executed-depth ratio and the target ``ratio <= 1.1 × executed / K``; at batch 8 under both schedules
  (``token``: rows wait for the batch's deepest; ``depth``: continuous depth batching, :mod:`looplm.decode.depth_schedule`),
  the contenders then interleaved generation by generation (rows are at different tokens), else token by token;
* ``kv_bytes`` — KV-cache bytes per token per policy;
* ``speculative`` — the draft's agreement with full depth, accepted tokens per round, speed-up of
  greedy self-speculative decoding over full depth at batch 1 and 8;
* ``task`` — p-hop accuracy vs selected / executed depth vs wall time over the gate's q (and fixed depths);
* ``scale`` — the timing protocol on larger backbones (random weights, the LM's measured exit depths
  replayed), showing where fixed per-token costs stop hiding the saving;
* ``prefill`` — per-token exit in one forward (:mod:`looplm.decode.exit_forward`: a prompt, a scored text) on
  held-out text at batch 8 against the plain forward: wall-time ratio beside the executed and computed
  ratio, PPL; and against scoring the same exits token by token (its speed-up, the largest logit difference).

``--train`` (re)trains the models into ``--runs`` (default ``runs/adaptive-bench``; trained weights stay
out of git). Plots: ``--png-dir`` (accuracy / PPL vs executed depth, annotated with the time ratio).

The package, one module per part (each imports only downward; every name of the old
``looplm.bench_adaptive`` still imports from here):

* :mod:`.models` — the models trained here (``lm``, ``phop`` and its exit gate) and the held-out text;
* :mod:`.quality` — ``quality``, ``frontier`` and ``kv_bytes``; :mod:`.prefill` — ``prefill``;
* :mod:`.timing` — ``timing`` (the contenders and how they are timed); :mod:`.scale` — ``scale``;
* :mod:`.speculative` — ``speculative``; :mod:`.task` — ``task``;
* :mod:`.report` — the markdown tables and the plots; this module — the command line.

    looplm bench adaptive --train --data /work/shared/data/tinyshakespeare.txt
    looplm bench adaptive --sections timing,speculative --clock cpu --threads 1 --json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...eval.decode_timing import FullDepth, _now, decode_timing, decoded_nll, teacher_forced_timing  # noqa: F401
from .models import LM_CONFIG, _held_out, _repo_file, gate_stage, load_lm, train_lm, train_phop  # noqa: F401
from .prefill import section_prefill
from .quality import kv_bytes_per_token, section_frontier, section_quality, teacher_forced_quality
from .report import TABLES, _md, plot_frontier, plot_task
from .scale import _scale_model, section_scale  # noqa: F401
from .speculative import _speculative_times, section_speculative  # noqa: F401
from .task import section_task
from .timing import BATCH_SCHEDULES, _at_exit, _contenders, _timed, section_timing  # noqa: F401

__all__ = ["FullDepth", "decode_timing", "register", "teacher_forced_quality", "teacher_forced_timing"]

SECTIONS = ("quality", "frontier", "timing", "kv_bytes", "speculative", "task", "scale", "prefill")


def _numbers(flag: str, text: str, kind, ok, what: str, errs: list[str]) -> list:
    """``text``'s comma-separated values as ``kind``; a message in ``errs`` for an empty list, a value that is
    not a ``kind`` or one ``ok`` refuses (``what``: the values it takes)."""
    vals = []
    for part in (p.strip() for p in text.split(",")):
        try:
            v = kind(part)
        except ValueError:
            errs.append(
                f"{flag} {text!r}: {part!r} is not {'an integer' if kind is int else 'a number'}; give {what}, comma-separated"
            )
            return []
        if not ok(v):
            errs.append(f"{flag} {text!r}: {part!r} is out of range; give {what}, comma-separated")
            return []
        vals.append(v)
    return vals


def _lm_shape(args) -> tuple[int, int]:
    """The bench LM's ``(K, max_seq_len)`` without training it: from its checkpoint where one is used (no
    ``--train``), else from ``--lm-config``."""
    from ...config import ModelConfig

    lm = Path(args.runs_dir) / "lm"
    if not args.train and lm.exists():
        from ...checkpoint_io import read_checkpoint_config

        cfg = ModelConfig.from_dict(read_checkpoint_config(lm)["model"])
    else:
        from ...train.config import load_train_config

        cfg = load_train_config(_repo_file(args.lm_config)).model_config()
    return cfg.n_loops, cfg.max_seq_len


def _check_args(args) -> None:
    """Every flag of ``bench adaptive``, one :class:`~looplm.dataclass_util.ConfigError` naming each bad one —
    before the child process is started and before any model is trained (minutes) or loaded."""
    import math

    from ...dataclass_util import ConfigError
    from ...decode.exits import KV_POLICIES, Exit
    from ...eval.cli_checks import at_least, out_dir_errors, out_file_errors

    errs = []
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        errs.append(f"--sections {args.sections!r}: unknown {bad}; choose from {list(SECTIONS)}")
    eps = "finite numbers >= 0"
    _numbers("--kl", args.kl, float, lambda v: 0 <= v < math.inf, eps, errs)
    _numbers("--convergence", args.convergence, float, lambda v: 0 <= v < math.inf, eps, errs)
    _numbers("--qs", args.qs, float, lambda v: 0 < v <= 1, "gate thresholds q in (0, 1]", errs)
    drafts = _numbers("--drafts", args.drafts, int, lambda v: v >= 1, "draft loop counts r_d >= 1", errs)
    ks = _numbers("--k", args.k, int, lambda v: v >= 1, "tokens drafted per round k >= 1", errs)
    _numbers("--widths", args.widths, int, lambda v: v >= 1, "backbone widths >= 1", errs)
    _numbers("--batches", args.batches, int, lambda v: v >= 1, "batch sizes >= 1", errs)
    bad = [x for x in args.policies.split(",") if x.strip() not in KV_POLICIES]
    if bad:
        errs.append(f"--policies {args.policies!r}: unknown {bad}; choose from {', '.join(KV_POLICIES)}")
    bad = [x for x in args.dtypes.split(",") if x.strip() not in ("fp32", "bf16")]
    if bad:
        errs.append(f"--dtypes {args.dtypes!r}: unknown {bad}; choose from fp32, bf16")
    bad = [x for x in (x.strip() for x in args.schedules.split(",")) if x not in ("token",) + BATCH_SCHEDULES]
    if bad:
        errs.append(f"--schedules {args.schedules!r}: unknown {bad}; choose from token, {', '.join(BATCH_SCHEDULES)}")
    bad = [x.strip() for x in args.scale_mixers.split(",") if x.strip() not in ("attention", "mamba2")]
    if bad:
        errs.append(f"--scale-mixers {args.scale_mixers!r}: unknown {bad}; choose from attention, mamba2")
    for e in (x for x in args.draft_exits.split(",") if x):
        try:
            crit = Exit.parse(e).criterion
        except (TypeError, ValueError) as err:
            errs.append(f"--draft-exits {e!r}: {err}")
            continue
        if crit == "replay":
            errs.append(f"--draft-exits {e!r}: a replayed depth drafts every token at one depth: give it in --drafts")
    errs += at_least(1, new=args.new, lm_steps=args.lm_steps) + at_least(0, threads=args.threads)
    errs += [m.replace("--runs:", "--timing-runs:") for m in at_least(1, runs=args.runs)]
    errs += (
        out_file_errors("--out", args.out)
        + out_dir_errors("--png-dir", args.png_dir)
        + out_dir_errors("--runs-dir", args.runs_dir)
    )
    need_lm = any(
        x in sections for x in ("quality", "frontier", "timing", "kv_bytes", "speculative", "scale", "prefill")
    )
    if need_lm and not Path(args.data).is_file():
        errs.append(
            f"--data {args.data!r}: the LM's corpus is not there (a text file; the LM trains and is scored on it)"
        )
    if "speculative" in sections and (drafts or ks):
        try:
            K, max_len = _lm_shape(args)
        except (OSError, ValueError) as err:  # (the LM's config or checkpoint cannot be read: named as it is)
            errs.append(f"--lm-config {args.lm_config!r} / --runs-dir {args.runs_dir!r}: {err}")
        else:
            bad = [r for r in drafts if r >= K]
            if bad:
                errs.append(
                    f"--drafts {args.drafts!r}: a draft runs fewer loops than the LM's K = {K}; {bad[0]} is not below it "
                    f"(give r_d in 1..{K - 1})"
                )
            new = 16 if args.quick else args.new
            most = max(max_len - 16 - new, 4)  # (the speculative section's prompts are 16 tokens)
            bad = [k for k in ks if k > most]
            if bad:
                errs.append(
                    f"--k {args.k!r}: {bad[0]} tokens per round is more than the {most} the LM has room for "
                    f"(max_seq_len {max_len} - prompt 16 - --new {new})"
                )
    if errs:
        raise ConfigError(errs, "bench adaptive arguments")


def cmd_bench_adaptive(args) -> int:
    import os
    import subprocess
    import sys

    from ...utils import cpuinfo

    _check_args(args)  # every flag, before the child process, any training (minutes) and any model

    name, flags = cpuinfo.model_name() or "unknown CPU", cpuinfo.flags()
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    cpu_description = lambda: f"{name} ({', '.join(extra) if extra else 'no avx512_bf16/amx'})"  # noqa: E731

    if sys.platform.startswith("linux") and "THP_MEM_ALLOC_ENABLE" not in os.environ and not args.same_process:
        # as `looplm bench decode`: PyTorch reads THP_MEM_ALLOC_ENABLE at its first allocation; re-run with it set
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
        child = subprocess.run([sys.executable, "-m", "looplm.cli", *sys.argv[1:], "--same-process"], env=env)
        return child.returncode
    from ... import kernels

    kernels.load("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    runs = Path(args.runs_dir)
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d.strip()] for d in args.dtypes.split(",")]
    schedules = tuple(x.strip() for x in args.schedules.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    q = args.quick
    report = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "clock": args.clock, "sections": {}}
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    log(f"bench adaptive on {report['cpu']}, {report['threads']} threads, {args.clock} clock")
    need_lm = any(s in sections for s in ("quality", "timing", "kv_bytes", "speculative", "scale", "prefill"))
    if need_lm:
        if args.train or not (runs / "lm").exists():
            log(f"training the LM ({args.lm_config}) ...")
            train_lm(runs, args.data, args.lm_steps, args.lm_config)
        lm, tok = load_lm(runs)
        held = _held_out(tok, args.data, 16 if q else 32, 96 if q else 160)
        log(
            f"LM: {lm.config.n_core} blocks x K={lm.config.n_loops}, d={lm.config.d_model}, {lm.num_params():,} parameters"
        )
    kl_grid = [float(v) for v in args.kl.split(",")]
    conv_grid = [float(v) for v in args.convergence.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    depth_pool = None
    if "quality" in sections:
        rows = section_quality(
            lm, held, [("kl", e) for e in kl_grid] + [("convergence", e) for e in conv_grid], policies
        )
        report["sections"]["quality"] = rows
        log("\n## quality (teacher-forced, held-out text)\n" + _md(rows, TABLES["quality"]))
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            for crit in ("kl", "convergence"):
                rs = [r for r in rows if r["criterion"] == crit]
                plot_frontier(
                    rs,
                    Path(args.png_dir) / f"adaptive-lm-{crit}.png",
                    "ppl",
                    f"LM, {crit} criterion: PPL vs executed loops",
                )
    if "frontier" in sections:
        settings = [("kl", e) for e in kl_grid] + [("convergence", e) for e in conv_grid]
        rows = section_frontier(lm, held[:8], settings, "copy", 2 if q else args.runs, args.clock)
        report["sections"]["frontier"] = rows
        log(
            "\n## LM frontier: PPL vs executed depth vs time (teacher-forced, batch 8, kv=copy)\n"
            + _md(rows, TABLES["frontier"])
        )
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            pts = [dict(r, kv=r["criterion"]) for r in rows]
            plot_frontier(
                pts,
                Path(args.png_dir) / "adaptive-lm-frontier.png",
                "ppl",
                "LM (2x4, d=256): PPL vs executed loops; labels: time / full depth",
            )
    if "kv_bytes" in sections:
        base = kv_bytes_per_token(lm, "copy")
        rows = [
            {"kv": kv, "bytes_per_token": kv_bytes_per_token(lm, kv), "ratio": kv_bytes_per_token(lm, kv) / base}
            for kv in ("copy", "propagate", "full", "shared")
        ]
        report["sections"]["kv_bytes"] = rows
        log("\n## KV bytes per token\n" + _md(rows, TABLES["kv_bytes"]))
    if "prefill" in sections:
        settings = [("kl", e, kv) for e in kl_grid for kv in ("copy", "propagate")] + [
            ("convergence", e, "copy") for e in conv_grid
        ]
        rows = section_prefill(lm, held[:8], settings, 2 if q else args.runs, args.clock, dtypes)
        report["sections"]["prefill"] = rows
        log(
            "\n## per-token exit in one forward (every token after the first; held-out text, batch 8)\n"
            + _md(rows, TABLES["prefill"])
        )
    if "timing" in sections or "scale" in sections:
        prompts = {B: _held_out(tok, args.data, B, 32, seed=1) for B in batches}
        settings = [("kl", e, kv) for e in [kl_grid[len(kl_grid) // 2]] for kv in ("copy", "propagate")]
        settings += [("convergence", e, "copy") for e in [conv_grid[len(conv_grid) // 2]]]
        if "timing" in sections:
            rows = section_timing(
                lm,
                prompts,
                settings,
                16 if q else args.new,
                2 if q else args.runs,
                args.clock,
                dtypes,
                schedules,
                args.compare_carry,
            )
            report["sections"]["timing"] = rows
            log("\n## timing (decode only, interleaved with full depth)\n" + _md(rows, TABLES["timing"]))
        # the LM's own exit depths at the middle kl threshold (the pool the scale section replays)
        from ...decode.token_schedule import AdaptiveDecoder

        dec = AdaptiveDecoder(
            lm, held.shape[0], held.shape[1], {"criterion": "kl", "threshold": kl_grid[len(kl_grid) // 2]}
        )
        dec.score(held, 8)
        depth_pool = torch.stack(dec.stats.selected).flatten()
    if "scale" in sections:
        rows = section_scale(
            depth_pool,
            [int(w) for w in args.widths.split(",")],
            (1, 8),
            16 if q else args.new,
            2 if q else args.runs,
            args.clock,
            dtypes,
            schedules,
            tuple(x.strip() for x in args.scale_mixers.split(",")),
        )
        report["sections"]["scale"] = rows
        log("\n## scale (random weights, the LM's exit depths replayed)\n" + _md(rows, TABLES["scale"]))
    if "speculative" in sections:
        prompts = {B: _held_out(tok, args.data, B, 16, seed=2) for B in batches}
        rows = section_speculative(
            lm,
            held,
            prompts,
            [int(r) for r in args.drafts.split(",")],
            [int(k) for k in args.k.split(",")],
            16 if q else args.new,
            2 if q else args.runs,
            args.clock,
            dtypes,
            [e for e in args.draft_exits.split(",") if e],
            args.compare_reclaim,
        )
        report["sections"]["speculative"] = rows
        log("\n## self-speculative decoding (greedy)\n" + _md(rows, TABLES["speculative"]))
        if args.compare_reclaim:
            log(
                "\n## rejected drafts' cache columns: reclaimed (default) vs kept (reclaim=False), cache columns "
                "per loop and layer\n" + _md(rows, TABLES["reclaim"])
            )
    if "task" in sections:
        from ...tasks.train import load_task_run

        if args.train or not (runs / "phop-gate2" / "model.safetensors").exists():
            log("training the p-hop exit-gate model (stage 1, stage 2) ...")
            train_phop(runs)
        m, cfg = load_task_run(runs / "phop-gate2")
        qs = [float(v) for v in args.qs.split(",")]
        rows = section_task(
            m,
            cfg,
            qs,
            policies[:2] if q else policies,
            list(range(1, m.config.n_loops)),
            8,
            2 if q else args.runs,
            args.clock,
            count=500 if q else None,
        )
        report["sections"]["task"] = rows
        log("\n## p-hop with the exit gate (teacher-forced decoding, accuracy at <ans>)\n" + _md(rows, TABLES["task"]))
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            plot_task(
                rows,
                Path(args.png_dir) / "adaptive-phop-gate.png",
                "p-hop 1⊗4 (d = 64), two-stage exit gate: accuracy vs executed loops",
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def register(sub) -> None:
    """``bench adaptive`` under ``looplm bench`` (called by :func:`looplm.bench.register`)."""
    a = sub.add_parser(
        "adaptive", help="per-token exit and self-speculative decoding vs full depth, on models trained here"
    )
    a.add_argument(
        "--runs-dir", default="runs/adaptive-bench", help="where the trained models live (trained there if missing)"
    )
    a.add_argument(
        "--train", action="store_true", help="(re)train the models first (the LM resumes from its newest checkpoint)"
    )
    a.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt", help="the LM's corpus (a text file)")
    a.add_argument("--lm-steps", type=int, default=None, help="override the LM's training steps")
    a.add_argument(
        "--lm-config",
        default=LM_CONFIG,
        help="the LM's training YAML (configs/bench/adaptive-lm-1024.yaml: the "
        "wider LM whose decode streams its weights from memory; give it its own --runs-dir)",
    )
    a.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    a.add_argument(
        "--kl",
        default="0.001,0.003,0.01,0.03,0.1",
        help="ε grid of the kl criterion (the timing section takes the middle one)",
    )
    a.add_argument(
        "--convergence",
        default="0.2,0.3,0.4,0.5,0.6",
        help="ε grid of the convergence criterion (the timing section takes the middle one; on the bench LM updates stay above 0.2 until the last loop)",
    )
    a.add_argument("--qs", default="0.3,0.5,0.7,0.9,0.95", help="q grid of the gate criterion (task)")
    a.add_argument("--policies", default="copy,propagate,shared,full", help="KV policies compared")
    a.add_argument("--drafts", default="1,2,3", help="speculative draft loop counts r_d")
    a.add_argument("--k", default="2,4", help="speculative tokens drafted per round")
    a.add_argument(
        "--draft-exits",
        default="",
        help="speculative drafts whose depth an exit criterion picks (at most "
        "max(--drafts) loops), comma-separated: kl:0.01,convergence:0.3",
    )
    a.add_argument(
        "--compare-reclaim",
        action="store_true",
        help="also time each speculative setting keeping rejected "
        "drafts' cache columns (reclaim=False) in the same alternation, and print their cache sizes",
    )
    a.add_argument(
        "--compare-carry",
        action="store_true",
        help="also time each kv=propagate setting of the timing "
        "section with its fills written at the exit (not carried into the next core pass) in the same alternation",
    )
    a.add_argument("--widths", default="512,1024", help="backbone widths of the scale section")
    a.add_argument("--scale-mixers", default="attention", help="block kinds of the scale section: attention, mamba2")
    a.add_argument(
        "--schedules",
        default="token,depth",
        help="batch schedules timed at batch 8 beside full depth "
        "(token, depth, static: the fixed-shape depth schedule, made for CUDA, static-compiled: its pass "
        "through torch.compile)",
    )
    a.add_argument("--dtypes", default="fp32,bf16")
    a.add_argument("--batches", default="1,8", help="batch sizes of the timing and speculative sections")
    a.add_argument("--new", type=int, default=48, help="decoded tokens per timing run")
    a.add_argument("--timing-runs", dest="runs", type=int, default=5, help="timing runs per setting (medians)")
    a.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--quick", action="store_true", help="fewer tokens, runs and settings (a smoke run)")
    a.add_argument("--png-dir", default=None, help="write the accuracy / PPL vs executed-depth plots here")
    a.add_argument("--out", default=None, help="write the full report (JSON) here")
    a.add_argument("--json", action="store_true")
    a.add_argument("--same-process", action="store_true", help=argparse_suppress())
    a.set_defaults(func=cmd_bench_adaptive)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
