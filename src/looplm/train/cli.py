"""``looplm train``, ``looplm eval ppl``, ``looplm plot`` and ``looplm demo``.

Examples::

    looplm train configs/train/tiny.yaml --out runs/tiny --set optim.lr=1e-3 --max-steps 200
    torchrun --nproc_per_node 8 -m looplm.cli train configs/train/qwen3-baseloop-wsd.yaml --out runs/q
    looplm eval ppl runs/tiny --data stdlib --batches 20
    looplm eval ppl runs/tiny/ckpt/step_000200 --data wiki.test.txt
    looplm plot runs/tiny
    looplm demo

``looplm train`` resumes automatically from the newest complete checkpoint in ``OUT/ckpt`` and
appends to ``OUT/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
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
    ov = list(args.set or [])
    if args.max_steps is not None:
        ov.append(f"train.max_steps={args.max_steps}")
    if args.checkpoint_every is not None:
        ov.append(f"checkpoint.every={args.checkpoint_every}")
    return ov


def _is_main_process() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


def cmd_train(args) -> int:
    from .checkpoint import CheckpointError
    from .config import load_train_config
    from .trainer import Trainer, TrainingDivergedError

    cfg = load_train_config(args.config, _train_overrides(args))
    try:
        summary = Trainer(cfg, args.out, resume=not args.no_resume, quiet=args.quiet).fit()
    except (CheckpointError, TrainingDivergedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if _is_main_process():
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


# ------------------------------------------------------------------------------------- eval ppl
def _documents_for(spec: str, tokenizer_spec: str, seq_len: int, max_docs: int | None, text_field: str):
    """Documents of ``--data``: ``stdlib`` (its held-out validation documents) or files."""
    from ..data.config import DataConfig
    from ..data.pipeline import build_stream

    if spec == "stdlib":
        cfg = DataConfig(source="stdlib", tokenizer=tokenizer_spec, seq_len=seq_len, max_docs=None)
        stream = build_stream(cfg, tokenizer_spec, split="val")
    else:
        if not Path(spec).exists() and not any(ch in spec for ch in "*?["):
            raise FileNotFoundError(f"--data {spec!r}: no such file or directory (use a path, a glob or 'stdlib')")
        cfg = DataConfig(source="files", paths=[spec], tokenizer=tokenizer_spec, seq_len=seq_len, shuffle_buffer=0,
                         val_every_nth=0, text_field=text_field)
        stream = build_stream(cfg, tokenizer_spec, split="train", epochs=1)
    docs = stream.iter_documents()
    if max_docs is not None:
        import itertools

        docs = itertools.islice(docs, max_docs)
    return docs


def cmd_eval_ppl(args) -> int:
    import torch

    from ..eval.ppl import evaluate_documents
    from .checkpoint import CheckpointError, load_model_for_inference, read_checkpoint_config, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model, tok = load_model_for_inference(ckpt, device=device)
        cfg = read_checkpoint_config(ckpt)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    train_seq = cfg.get("train", {}).get("data", {}).get("seq_len")
    seq_len = args.seq_len or train_seq or model.config.max_seq_len
    if seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}")
    tok_spec = cfg.get("tokenizer") or "byte"
    docs = _documents_for(args.data, tok_spec, seq_len, args.max_docs, args.text_field)
    t0 = time.perf_counter()
    res = evaluate_documents(model, tok, docs, seq_len=seq_len, batch_size=args.batch_size, max_batches=args.batches,
                             device=device, precision=args.precision, num_loops=args.loops)
    if res.documents == 0:
        raise ValueError(f"--data {args.data!r}: no document was evaluated (empty data, or --batches too small for one document)")
    out = {"checkpoint": str(ckpt), "data": args.data, "seq_len": seq_len, "num_loops": args.loops or model.config.n_loops,
           **res.to_dict(), "time_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{ckpt} on {args.data}: {res.documents} docs, {res.tokens:,} tokens, {res.words:,} words | "
            f"token PPL {res.token_ppl:.3f} | word PPL {res.word_ppl:.3f} | bits/byte {res.bits_per_byte:.4f} "
            f"| loss {res.loss:.4f} (r = {out['num_loops']} loops)"
        )
    return 0


# ------------------------------------------------------------------------------------- plot / demo
def cmd_plot(args) -> int:
    from ..plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def cmd_demo(args) -> int:
    from ..plot import plot_run
    from .config import load_train_config
    from .metrics import read_metrics
    from .trainer import Trainer

    config = Path(args.config) if args.config else find_config(DEMO_CONFIG)
    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    cfg = load_train_config(config, overrides)
    out = Path(args.out)
    if not args.resume:  # start over: remove what an earlier demo run left in --out
        import shutil

        for name in ("ckpt", "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("metrics.jsonl", "run.json", "curves.png"):
            (out / name).unlink(missing_ok=True)
    print(f"looplm demo: training {cfg.model} on the embedded '{cfg.data.source}' corpus ({config}) into {out}/", flush=True)
    t0 = time.perf_counter()
    summary = Trainer(cfg, out, resume=args.resume).fit()
    wall = time.perf_counter() - t0
    recs = [r for r in read_metrics(out) if not r.get("skipped")]
    png = plot_run(out)
    first = recs[0]["loss"] if recs else float("nan")
    last = recs[-1]["loss"] if recs else float("nan")
    val = summary["val_loss"]
    print("\n=== looplm demo summary ===")
    print(f"  model          {cfg.model} (K = {cfg.model_config().n_loops} loops), precision {summary['precision']} (config: {cfg.train.precision})")
    print(f"  steps          {summary['steps']} ({summary['tokens']:,} tokens)")
    print(f"  train loss     {first:.4f} (step 1) -> {last:.4f} (step {recs[-1]['step'] if recs else 0})")
    if val is not None:
        print(f"  val loss       {val:.4f}  (val PPL {summary['val_ppl']:.3f} per byte-token)")
    print(f"  time           {wall:.1f} s wall ({summary['train_time_s']:.1f} s in training steps)")
    print(f"  outputs        {out}/metrics.jsonl, {png}, {summary['checkpoint']}")
    print(f"  next           looplm eval ppl {out} --data stdlib --batches 20")
    return 0


# ------------------------------------------------------------------------------------- parser
def _eval_subparsers(subparsers):
    """The ``eval`` command's sub-command table (created here, or reused if another module made it)."""
    existing = subparsers.choices.get("eval")
    if existing is not None:
        for action in existing._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
        raise RuntimeError("an `eval` command without sub-commands is already registered; cannot add `eval ppl`")
    p = subparsers.add_parser("eval", help="evaluate a checkpoint (perplexity, ...)")
    return p.add_subparsers(dest="eval_command", required=True)


def register(subparsers) -> None:
    """Add ``train``, ``eval ppl``, ``plot`` and ``demo`` to the ``looplm`` command line."""
    p = subparsers.add_parser("train", help="train a looped LM from a YAML config (resumes automatically)")
    p.add_argument("config", help="training YAML (e.g. configs/train/tiny.yaml)")
    p.add_argument("--out", required=True, help="output directory (metrics, checkpoints, run.json)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. optim.lr=1e-3 (repeatable)")
    p.add_argument("--max-steps", type=int, default=None, help="= --set train.max_steps=N")
    p.add_argument("--checkpoint-every", type=int, default=None, help="= --set checkpoint.every=N")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in OUT/ckpt (start over)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.set_defaults(func=cmd_train)

    ev = _eval_subparsers(subparsers)
    p = ev.add_parser("ppl", help="token PPL, word PPL (WikiText style) and bits/byte of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest complete checkpoint)")
    p.add_argument("--data", required=True, help="'stdlib' (its held-out documents) or a text/jsonl/parquet file, glob or directory")
    p.add_argument("--batches", type=int, default=None, help="stop after N batches of windows (default: all documents)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--loops", type=int, default=None, help="loop count r (default: the trained K)")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--text-field", default="text", help="jsonl/parquet field holding the text")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval_ppl)

    p = subparsers.add_parser("plot", help="loss / LR / throughput curves of a run -> RUN/curves.png")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output PNG (default RUN/curves.png)")
    p.set_defaults(func=cmd_plot)

    p = subparsers.add_parser("demo", help=f"train the tiny looped model of {DEMO_CONFIG} on CPU (a few minutes)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--config", default=None, help=f"training YAML (default {DEMO_CONFIG})")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true", help="continue an earlier demo run in --out instead of starting over")
    p.set_defaults(func=cmd_demo)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m looplm.train.cli``): the same as ``looplm`` itself."""
    from ..cli import main as looplm_main

    return looplm_main(argv)


if __name__ == "__main__":
    sys.exit(main())
