"""``looplm train``, ``looplm plot`` and ``looplm demo`` (``looplm eval ppl`` is :mod:`looplm.eval.cli`).

Examples::

    looplm train configs/train/tiny.yaml --out runs/tiny --set optim.lr=1e-3 --max-steps 200
    torchrun --nproc_per_node 8 -m looplm.cli train configs/train/qwen3-baseloop-wsd.yaml --out runs/q
    looplm plot runs/tiny
    looplm demo

``looplm train`` resumes automatically from the newest complete checkpoint in ``OUT/ckpt`` and
appends to ``OUT/metrics.jsonl``. A second ``looplm train`` on the same ``--out`` while one runs is
refused (the run directory is locked). SIGTERM / SIGINT (preemption, Ctrl-C) finish the current step,
write its checkpoint, print one line naming it and exit with 128 + the signal number (143, 130).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

__all__ = ["register", "main", "find_config"]

DEMO_CONFIG = "configs/train/tiny.yaml"


def find_config(rel: str) -> Path:
    """Locate a shipped config (``configs/...``) from the working directory or the source tree."""
    p = Path(rel)
    if p.exists():
        return p
    repo_root = Path(__file__).resolve().parents[3]
    cand = repo_root / rel
    if cand.exists():
        return cand
    raise FileNotFoundError(f"config {rel!r} not found in the working directory nor in {repo_root}")


# ------------------------------------------------------------------------------------- train
def _train_overrides(args) -> list[str]:
    """``--set`` items plus the shortcuts ``--max-steps`` and ``--checkpoint-every`` (where the command has them)."""
    ov = list(args.set or [])
    if getattr(args, "max_steps", None) is not None:
        ov.append(f"train.max_steps={args.max_steps}")
    if getattr(args, "checkpoint_every", None) is not None:
        ov.append(f"checkpoint.every={args.checkpoint_every}")
    if getattr(args, "allow_model_change", False):
        ov.append("train.allow_model_change=true")
    return ov


def cmd_train(args) -> int:
    from .config import load_train_config
    from .distributed import is_main_process
    from .run_lock import RunDirLockedError
    from .trainer import Trainer, TrainingDivergedError, TrainingInterrupted

    cfg = load_train_config(args.config, _train_overrides(args))
    try:
        summary = Trainer(cfg, args.out, resume=not args.no_resume, quiet=args.quiet).fit()
    except (RunDirLockedError, TrainingDivergedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:  # SIGTERM / SIGINT: the checkpoint is written; one line, 128 + signal
        if is_main_process():
            print(e, file=sys.stderr, flush=True)
        return e.exit_code
    if is_main_process():
        print(json.dumps(summary, indent=2) if args.json else _format_summary(summary))
    return 0


def _format_summary(s: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "n/a"

    return (
        f"trained {s['steps'] - s['start_step']} steps (now at step {s['steps']}), {s['tokens']:,} tokens, "
        f"loss {f(s['first_loss'], '.4f')} -> {f(s['last_loss'], '.4f')}, val loss {f(s['val_loss'], '.4f')} "
        f"(ppl {f(s['val_ppl'], '.2f')}), {f(s['train_time_s'], '.1f')} s; checkpoint {s['checkpoint']}"
    )


# ------------------------------------------------------------------------------------- plot / demo
def cmd_plot(args) -> int:
    from .plot import plot_run

    try:
        path = plot_run(args.run_dir, args.out)
    except ImportError as e:  # no matplotlib: what to install, in one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def cmd_demo(args) -> int:
    from .plot import plot_run
    from .config import load_train_config
    from .metrics import read_metrics
    from .run_lock import RunDirLock, RunDirLockedError
    from .trainer import Trainer, TrainingInterrupted

    config = Path(args.config) if args.config else find_config(DEMO_CONFIG)
    cfg = load_train_config(config, _train_overrides(args))
    out = Path(args.out)
    try:
        with RunDirLock(out) as lock:  # held from the clean-up to the end of training
            if not args.resume:  # start over: remove what an earlier demo run left in --out
                import shutil

                for name in ("ckpt", "tensorboard"):
                    shutil.rmtree(out / name, ignore_errors=True)
                for name in ("metrics.jsonl", "run.json", "curves.png"):
                    (out / name).unlink(missing_ok=True)
            print(
                f"looplm demo: training {cfg.model} on the embedded '{cfg.data.source}' corpus ({config}) into {out}/",
                flush=True,
            )
            t0 = time.perf_counter()
            summary = Trainer(cfg, out, resume=args.resume, lock=lock).fit()
            wall = time.perf_counter() - t0
    except RunDirLockedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f"{e} (looplm demo --resume)", file=sys.stderr)
        return e.exit_code
    recs = [r for r in read_metrics(out) if not r.get("skipped")]
    png = plot_run(out)
    first = recs[0]["loss"] if recs else float("nan")
    last = recs[-1]["loss"] if recs else float("nan")
    val = summary["val_loss"]
    print("\n=== looplm demo summary ===")
    print(
        f"  model          {cfg.model} (K = {cfg.model_config().n_loops} loops), precision {summary['precision']} (config: {cfg.train.precision})"
    )
    print(f"  steps          {summary['steps']} ({summary['tokens']:,} tokens)")
    print(f"  train loss     {first:.4f} (step 1) -> {last:.4f} (step {recs[-1]['step'] if recs else 0})")
    if val is not None:
        print(f"  val loss       {val:.4f}  (val PPL {summary['val_ppl']:.3f} per byte-token)")
    print(f"  time           {wall:.1f} s wall ({summary['train_time_s']:.1f} s in training steps)")
    print(f"  outputs        {out}/metrics.jsonl, {png}, {summary['checkpoint']}")
    print(f"  next           looplm eval ppl {out} --data stdlib --batches 20")
    return 0


# ------------------------------------------------------------------------------------- parser
def register(subparsers) -> None:
    """Add ``train``, ``plot`` and ``demo`` to the ``looplm`` command line."""
    p = subparsers.add_parser("train", help="train a looped LM from a YAML config (resumes automatically)")
    p.add_argument("config", help="training YAML (e.g. configs/train/tiny.yaml)")
    p.add_argument("--out", required=True, help="output directory (metrics, checkpoints, run.json)")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. optim.lr=1e-3 (repeatable)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="= --set train.max_steps=N")
    p.add_argument("--checkpoint-every", type=int, default=None, help="= --set checkpoint.every=N")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in OUT/ckpt (start over)")
    p.add_argument(
        "--allow-model-change",
        action="store_true",
        help="resume a checkpoint whose model config differs from this run's (refused otherwise; the change is recorded in run.json)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("plot", help="loss / LR / throughput curves of a run -> RUN/curves.png")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output PNG (default RUN/curves.png)")
    p.set_defaults(func=cmd_plot)

    p = subparsers.add_parser("demo", help=f"train the tiny looped model of {DEMO_CONFIG} on CPU (a few minutes)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--config", default=None, help=f"training YAML (default {DEMO_CONFIG})")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument(
        "--resume", action="store_true", help="continue an earlier demo run in --out instead of starting over"
    )
    p.set_defaults(func=cmd_demo)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m looplm.train.cli``): the same as ``looplm`` itself."""
    from ..cli import main as looplm_main

    return looplm_main(argv)


if __name__ == "__main__":
    sys.exit(main())
