"""``looplm eval ppl``: token PPL, word PPL (WikiText style) and bits/byte of a checkpoint.

Examples::

    looplm eval ppl runs/tiny --data stdlib --batches 20
    looplm eval ppl runs/tiny/ckpt/step_000200 --data wiki.test.txt
    looplm eval ppl runs/tiny --data stdlib --loops 1..2K --out runs/tiny/depth   # depth sweep (eval/depth.py)

The checkpoint is read with :mod:`looplm.checkpoint_io`: evaluating never imports the training code.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

__all__ = ["register", "cmd_eval_ppl"]


def _documents_for(spec: str, tokenizer, seq_len: int, max_docs: int | None, text_field: str, missing_text: str):
    """Documents of ``--data``: ``stdlib`` (its held-out validation documents) or files."""
    from ..data.config import DataConfig
    from ..data.pipeline import build_stream

    if spec == "stdlib":
        cfg = DataConfig(source="stdlib", seq_len=seq_len, max_docs=None)
        stream = build_stream(cfg, tokenizer, split="val")
    else:
        if not Path(spec).exists() and not any(ch in spec for ch in "*?["):
            raise FileNotFoundError(f"--data {spec!r}: no such file or directory (use a path, a glob or 'stdlib')")
        cfg = DataConfig(
            source="files",
            paths=[spec],
            seq_len=seq_len,
            shuffle_buffer=0,
            val_every_nth=0,
            text_field=text_field,
            missing_text=missing_text,
        )
        stream = build_stream(cfg, tokenizer, split="train", epochs=1)
    docs = stream.iter_documents()
    return docs if max_docs is None else itertools.islice(docs, max_docs)


def cmd_eval_ppl(args) -> int:
    import torch

    from ..checkpoint_io import load_model_for_inference, read_checkpoint_config, resolve_checkpoint
    from ..dataclass_util import ConfigError
    from .cli_checks import at_least, device_errors, out_dir_errors
    from .ppl import evaluate_documents

    # every value that needs no model, checked before the checkpoint is read
    errs = at_least(1, batch_size=args.batch_size, batches=args.batches, max_docs=args.max_docs)
    errs += at_least(2, seq_len=args.seq_len)  # (a window of one token predicts nothing)
    errs += device_errors("--device", args.device) + out_dir_errors("--out", args.out)
    if args.kv_policy is not None and args.exit is None:  # (was ignored without a word)
        errs.append(
            f"--kv-policy {args.kv_policy}: an option of --exit (what later tokens read in the loops a token "
            "skipped); give --exit too, or leave it out"
        )
    if errs:
        raise ConfigError(errs, "eval ppl arguments")
    ckpt = resolve_checkpoint(args.checkpoint)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model_for_inference(
        ckpt, device=device, allow_nonfinite=args.allow_nonfinite or None, allow_deep=args.allow_deep or None
    )
    cfg = read_checkpoint_config(ckpt)
    train_seq = cfg.get("train", {}).get("data", {}).get("seq_len")
    seq_len = args.seq_len or train_seq or model.config.max_seq_len
    if seq_len > model.config.max_seq_len:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}; "
            f"give at most {model.config.max_seq_len}"
        )
    from .depth import parse_loops, run_depth_sweep

    loops = parse_loops(args.loops, model.config.n_loops, args.allow_deep) if args.loops is not None else None
    exit = None
    if args.exit is not None:  # (checked before any document is scored)
        if loops is not None and (len(loops) > 1 or args.out or args.grid != "both"):
            raise ValueError(
                f"--exit takes each token's depth (at most one --loops R); a depth sweep (--loops {args.loops}, "
                "--out, --grid) cannot be combined with it"
            )
        from ..decode.generate import adaptive_options

        exit = adaptive_options(
            model, exit=args.exit, kv=args.kv_policy, max_loops=loops[0] if loops else None, allow_deep=args.allow_deep
        )["exit"]
    docs = _documents_for(args.data, tok, seq_len, args.max_docs, args.text_field, args.missing_text)
    if loops is not None and (len(loops) > 1 or args.out or args.grid != "both"):  # a depth sweep (eval/depth.py)
        return run_depth_sweep(args, model, tok, docs, loops, seq_len, device, ckpt)
    num_loops = loops[0] if loops else None
    t0 = time.perf_counter()
    res = evaluate_documents(
        model,
        tok,
        docs,
        seq_len=seq_len,
        batch_size=args.batch_size,
        max_batches=args.batches,
        device=device,
        precision=args.precision,
        num_loops=num_loops,
        exit=exit,
    )
    if res.documents == 0:
        raise ValueError(
            f"--data {args.data!r}: no document was evaluated (empty data, or --batches too small for one document)"
        )
    out = {
        "checkpoint": str(ckpt),
        "data": args.data,
        "seq_len": seq_len,
        "num_loops": num_loops or model.config.n_loops,
        **res.to_dict(),
        "time_s": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{ckpt} on {args.data}: {res.documents} docs, {res.tokens:,} tokens, {res.words:,} words | "
            f"token PPL {res.token_ppl:.3f} | word PPL {res.word_ppl:.3f} | bits/byte {res.bits_per_byte:.4f} "
            f"| loss {res.loss:.4f} (r = {out['num_loops']} loops)"
        )
        if res.depth:
            d = res.depth
            print(
                f"  exit {args.exit}: selected {d['selected_depth']:.2f}, executed {d['executed_depth']:.2f} of {d['max_loops']} loops "
                f"(executed / K {d['executed_ratio']:.3f}; the core ran {d['computed_ratio']:.3f} of full depth's positions)"
            )
    return 0


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
    """Add ``eval ppl`` to the ``looplm`` command line."""
    ev = _eval_subparsers(subparsers)
    p = ev.add_parser("ppl", help="token PPL, word PPL (WikiText style) and bits/byte of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest complete checkpoint)")
    p.add_argument(
        "--data",
        required=True,
        help="'stdlib' (its held-out documents) or a text/jsonl/parquet file, glob or directory",
    )
    p.add_argument("--batches", type=int, default=None, help="stop after N batches of windows (default: all documents)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument(
        "--loops",
        default=None,
        help="loop count r (default: the trained K), or a depth sweep: a..b, a list 1,2,4, or 1..2K (K = trained loops)",
    )
    p.add_argument(
        "--allow-deep",
        action="store_true",
        help="allow loop counts above 64x the trained K, and a checkpoint of more than 4096 loops (refused otherwise)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="load a checkpoint whose weights hold NaN / inf (refused otherwise; or LOOPLM_ALLOW_NONFINITE=1)",
    )
    p.add_argument(
        "--grid",
        choices=["both", "prefix", "rescaled"],
        default="both",
        help="timestep-conditioned models: conditioning grid(s) of the depth sweep (prefix needs r <= K)",
    )
    p.add_argument("--out", default=None, help="depth sweep: write depth.json and depth.png to this directory")
    p.add_argument(
        "--exit",
        default=None,
        metavar="CRITERION[:VALUE]",
        help="per-token exit (kl:EPS, convergence:EPS, gate:Q, replay:R; docs/adaptive-depth.md): each window's "
        "tokens after the first take it in one forward, as decoding would; prints the executed depth",
    )
    p.add_argument(
        "--kv-policy",
        choices=["copy", "propagate", "full"],
        default=None,
        help="with --exit: what later tokens read in the loops a token skipped (default copy)",
    )
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--text-field", default="text", help="jsonl/parquet field holding the text")
    p.add_argument(
        "--missing-text",
        choices=["error", "skip"],
        default="error",
        help="rows without the text field: stop with an error (default) or skip them with a warning",
    )
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval_ppl)
