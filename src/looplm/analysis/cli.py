"""``looplm analyze``: run registered analyses (:mod:`looplm.analysis`) on a checkpoint.

Examples::

    looplm analyze runs/stateloop --metrics state-shapley,state-replace-freeze --out runs/stateloop/analysis
    looplm analyze runs/stateloop --metrics state-shapley --loops 5 --data wiki.txt --batches 8 --out an/
    looplm analyze --model tiny-llama --metrics list        # list the registered analyses

Evaluation batches are the first ``--batches`` packed windows of ``--data`` (``stdlib``: its held-out
documents; or a text / jsonl / parquet path); the next ``--calib-batches`` windows are the separate
calibration sample (``options['calibration_batches']``, used by analyses that calibrate, e.g. eq. 15).
Each analysis writes ``OUT/NAME.json`` and its figures (``OUT/NAME*.png``); a summary goes to stdout.
Extra options reach every analysis with ``--option KEY=VALUE``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["register", "cmd_analyze", "token_batches"]


def token_batches(tokenizer, data: str, seq_len: int, batch_size: int, n: int) -> list:
    """The first ``n`` batches ``[batch_size, seq_len]`` of packed windows of ``data``."""
    from ..data.config import DataConfig
    from ..data.pipeline import build_stream

    if data == "stdlib":
        stream = build_stream(DataConfig(source="stdlib", seq_len=seq_len), tokenizer, split="val")
    else:
        if not Path(data).exists() and not any(ch in data for ch in "*?["):
            raise FileNotFoundError(f"--data {data!r}: no such file or directory (use a path, a glob or 'stdlib')")
        cfg = DataConfig(source="files", paths=[data], seq_len=seq_len, shuffle_buffer=0, val_every_nth=0)
        stream = build_stream(cfg, tokenizer, split="train", epochs=1)
    return [stream.next_batch(batch_size) for _ in range(n)]


def _parse_options(items: list[str]) -> dict:
    from ..dataclass_util import parse_value

    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--option {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        out[k.strip()] = parse_value(v)
    return out


# options the command line itself sets for every analysis, and its flags for them
CLI_OPTIONS = {"loops": "--loops", "calibration_batches": "--calib-batches"}


def _check_args(args, selected) -> None:
    """One error naming every bad count and every ``--option`` key none of the selected analyses
    reads, before a model is loaded."""
    from ..dataclass_util import ConfigError, _suggest

    errs = []
    for flag, value, low in (
        ("--batches", args.batches, 1),
        ("--calib-batches", args.calib_batches, 0),
        ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 2),
        ("--loops", args.loops, 1),
    ):
        if value is not None and value < low:
            errs.append(
                f"{flag}: must be >= {low}, got {value}"
                + (" (leave it out for the trained K)" if flag == "--loops" else "")
            )
    from ..eval.cli_checks import device_errors

    errs += device_errors("--device", args.device)
    known = sorted({o for a in selected for o in a.options})
    for key in _parse_options(args.option):
        if key in CLI_OPTIONS:
            errs.append(f"--option {key}: set by the command line itself (use {CLI_OPTIONS[key]})")
        elif key not in known:
            names = ", ".join(a.name for a in selected)
            errs.append(
                f"--option {key}: not read by {names}{_suggest(key, known)}; they read: {', '.join(known) or 'no options'}"
            )
    if errs:
        raise ConfigError(errs, "analyze arguments")


def cmd_analyze(args) -> int:
    import torch

    from . import load_all

    analyses = load_all()
    names = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if names == ["list"]:
        for a in sorted(analyses.values(), key=lambda a: a.name):
            print(f"{a.name:28s} {a.help}")
        return 0
    unknown = [m for m in names if m not in analyses]
    if unknown or not names:
        from ..dataclass_util import _suggest

        hints = "".join(_suggest(m, sorted(analyses)) for m in unknown)
        raise ValueError(
            f"--metrics: unknown analysis {unknown or names}{hints}; known: {sorted(analyses)} (or 'list')"
        )
    if (args.checkpoint is None) == (args.model is None):
        raise ValueError(
            "give a CHECKPOINT (a checkpoint or run directory) or --model PRESET (random weights), not both"
        )
    _check_args(args, [analyses[n] for n in names])

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.checkpoint is not None:
        from ..checkpoint_io import load_model_for_inference

        model, tok = load_model_for_inference(args.checkpoint, device=device)
        source = str(args.checkpoint)
    else:
        from ..data.tokenizers import load_tokenizer
        from ..factory import build

        torch.manual_seed(args.seed)
        model = build(args.model).to(device).eval()
        tok = load_tokenizer("byte")
        source = f"preset {args.model} (random weights)"
    seq_len = min(args.seq_len, model.config.max_seq_len)
    batches = token_batches(tok, args.data, seq_len, args.batch_size, args.batches + args.calib_batches)
    options = {
        "loops": args.loops or model.config.n_loops,
        "calibration_batches": batches[args.batches :],
        **_parse_options(args.option),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        a = analyses[name]
        t0 = time.perf_counter()
        result = a.fn(model, batches[: args.batches], dict(options))
        result = {
            "analysis": name,
            "source": source,
            "data": args.data,
            "batches": args.batches,
            "batch_size": args.batch_size,
            "seq_len": seq_len,
            "time_s": time.perf_counter() - t0,
            **result,
        }
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(result, indent=2))
        figs = a.plot(result, out_dir) if a.plot is not None else []
        print(f"{name}: {path}" + "".join(f", {f}" for f in figs) + f" ({result['time_s']:.1f} s)")
        summary = _summary(result)
        if summary:
            print("  " + summary)
    return 0


def _summary(r: dict) -> str:
    """One line for the analyses of this package; other analyses print their JSON path only."""
    if r.get("analysis") == "state-shapley" and r.get("shares") and r["shares"][0] is not None:
        parts = ", ".join(f"{n} {100 * s:.1f}%" for n, s in zip(r["reads"], r["shares"]))
        return f"baseline PPL {r['baseline_ppl']:.3f}; shares {parts}; feedback {100 * r['feedback_share']:.1f}%"
    if r.get("analysis") == "state-replace-freeze":
        rep = ", ".join(f"S{e['target']}<-S{e['source']} {e['ppl']:.3f}" for e in r["replace"])
        frz = ", ".join(f"S{e['source']} {e['ppl']:.3f}" for e in r["freeze"])
        return f"baseline PPL {r['baseline_ppl']:.3f}; replace: {rep}; freeze: {frz}"
    return ""


def register(subparsers) -> None:
    """Add ``analyze`` to the ``looplm`` command line."""
    p = subparsers.add_parser("analyze", help="run analyses (state interventions, trajectory metrics) on a checkpoint")
    p.add_argument(
        "checkpoint", nargs="?", help="checkpoint directory, or a run directory (newest complete checkpoint)"
    )
    p.add_argument("--model", default=None, help="a preset with random weights instead of a checkpoint (smoke runs)")
    p.add_argument("--metrics", required=True, help="comma-separated analyses, or 'list' to list them")
    p.add_argument("--loops", type=int, default=None, help="loop count r (default: the trained K)")
    p.add_argument("--out", default="analysis", help="output directory for JSON and PNG files")
    p.add_argument(
        "--data", default="stdlib", help="'stdlib' (held-out documents) or a text/jsonl/parquet file, glob or directory"
    )
    p.add_argument("--batches", type=int, default=4, help="evaluation batches")
    p.add_argument("--calib-batches", type=int, default=4, help="further batches for calibration (a separate sample)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="extra option for the analyses (repeatable)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights with --model")
    p.set_defaults(func=cmd_analyze)
