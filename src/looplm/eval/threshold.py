"""Exit-gate threshold sweeps and the fixed-loop ablation (Looped-Mamba App. F, G; Figure 1).

* **Threshold sweep** (Tab. 16-19): for ``q ∈ {0.2, 0.4, 0.6, 0.8, 1.0}`` every token selects
  ``z_i(q) = min{r : CDF_i(r) >= q}``; we report the mean selected depth ``Iter``, the metric (PPL of
  the selected outputs, or task accuracy) and, separately, the **executed** depth — always the full
  ``R``: output selection runs every recurrent step, so ``Iter`` is not a compute saving.
* **Fixed-loop ablation** (Tab. 12-15): force ``r = 1..R`` loops on a model trained with ``R``
  (``num_loops=r``; for an exit-gate model this puts the remaining mass on step ``r``, i.e. selects it).
* **Plot** (Figure 1 style): metric against selected depth — the threshold sweep as a line, the
  fixed depths as separate markers.
* **Real wall-clock** (:func:`decode_sweep`, on by default: ``--decode-batches``): the same ``q`` (and
  forced ``r``) decoded token by token with per-token exit that *skips* the loops (:mod:`looplm.decode.token_schedule`,
  the ``gate`` criterion, ``--kv-policy`` / ``--ssm-policy`` for the skipped loops), interleaved with
  full-depth decoding on the same tokens: the executed depth, the PPL of that decoding and the time per
  token relative to full depth (columns ``executed (decode)``, ``ms/token``, ``time / full``).

``looplm eval threshold RUN --data stdlib`` sweeps a language-model checkpoint (PPL);
``looplm task {mano,phop} eval RUN --thresholds ... --loops ... --png F`` a task run (accuracy).
Downstream benchmark scores (PIQA, BoolQ, ...) go through the lm-eval model of the ecosystem issue.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["PAPER_THRESHOLDS", "lm_metric", "sweep", "format_sweep", "plot_sweep", "register"]

PAPER_THRESHOLDS = (0.2, 0.4, 0.6, 0.8, 1.0)


def lm_metric(batches: list[torch.Tensor], precision: str = "fp32") -> Callable:
    """``metric(model, num_loops, loop_options) -> {"ppl", "loss", "tokens", "iter"?}`` over fixed token
    batches ``[B, T]`` (every position but the last predicts the next token; PPL of the model's output
    logits, i.e. of the selected iterate for an exit-gate model)."""

    @torch.no_grad()
    def metric(model, num_loops=None, loop_options=None) -> dict:
        dev = next(model.parameters()).device
        nll, n, depth = 0.0, 0, 0.0
        gate = hasattr(model.rule, "exit_summary")
        for x in batches:
            x = x.to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(x, num_loops=num_loops, loop_options=loop_options).logits
            lp = logits[:, :-1].float()
            nll += float(F.cross_entropy(lp.reshape(-1, lp.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
            n += x[:, 1:].numel()
            if gate:
                depth += float(model.rule.last_exit["selected_depth"][:, :-1].float().sum())
        res = {"loss": nll / n, "ppl": math.exp(min(nll / n, 700.0)), "tokens": n}
        if gate:
            res["iter"] = depth / n
        return res

    return metric


def task_metric(
    checkpoint, tasks: list[str], *, include_path=None, data_dir=None, limit=None, batch_size: int = 8, device=None
) -> Callable:
    """Downstream accuracy through the lm-eval model (:mod:`looplm.eval.harness`): ``metric(model,
    num_loops=r | loop_options={"exit_threshold": q})`` -> ``{"accuracy": mean acc over tasks,
    "task_scores": {task: acc}}``. Each setting re-runs the harness on ``checkpoint`` at that depth / q."""

    def metric(model, num_loops=None, loop_options=None):
        from .harness import run_harness

        q = (loop_options or {}).get("exit_threshold")
        res = run_harness(
            checkpoint,
            tasks,
            loops=num_loops,
            exit_threshold=q,
            include_path=include_path,
            data_dir=data_dir,
            limit=limit,
            batch_size=batch_size,
            device=device,
        )
        scores = {t: v["acc,none"] for t, v in res["results"].items() if "acc,none" in v}
        if not scores:
            raise ValueError(f"tasks {tasks} report no 'acc' metric; the sweep needs multiple-choice accuracy")
        return {"accuracy": sum(scores.values()) / len(scores), "task_scores": scores}

    return metric


def combine_metrics(*metrics: Callable) -> Callable:
    """One metric whose result merges those of ``metrics`` (e.g. PPL and downstream accuracy)."""

    def metric(model, **kw):
        out = {}
        for m in metrics:
            out.update(m(model, **kw))
        return out

    return metric


def sweep(model, metric: Callable, thresholds=PAPER_THRESHOLDS, fixed_loops=None) -> list[dict]:
    """Rows ``{"setting", "q" | "r", "iter", "executed_depth", <metric>...}``: thresholds first (only
    for a model with an exit gate), then forced loop counts."""
    R = model.config.n_loops
    rows = []
    if thresholds:
        if not hasattr(model.rule, "exit_summary"):
            raise ValueError(
                f"a threshold sweep needs an exit-gate model (rule exit_gate); this one uses {model.config.rule.name!r}"
            )
        for q in thresholds:
            res = metric(model, loop_options={"exit_threshold": float(q)})
            rows.append({"setting": "threshold", "q": float(q), "executed_depth": R, **res})
    for r in fixed_loops or []:
        res = metric(model, num_loops=int(r))
        res["iter"] = float(r)  # every token's output comes from step r
        rows.append({"setting": "fixed", "r": int(r), "executed_depth": int(r), **res})
    return rows


def decode_sweep(
    model,
    batch: torch.Tensor,
    rows: list[dict],
    *,
    kv: str = "copy",
    ssm: str = "freeze",
    prompt_len: int = 8,
    clock: str = "wall",
    precision: str = "fp32",
) -> list[dict]:
    """Add real decoding to the sweep's ``rows``: each threshold ``q`` (criterion ``gate``) and forced ``r``
    (``replay``) decoded token by token over ``batch [B, T]`` with per-token exit (the loops skipped), every
    setting and full depth interleaved token by token. Adds ``decode_executed_depth``, ``decode_ppl``,
    ``decode_ms_per_token`` and ``decode_time_ratio`` (vs full depth in the same run) to each row."""
    from ..decode.token_schedule import AdaptiveDecoder
    from .decode_timing import FullDepth, decoded_nll, teacher_forced_timing

    m = model.to(torch.bfloat16) if precision == "bf16" else model
    specs = {}
    for r in rows:
        if r["setting"] == "threshold":
            specs[("threshold", r["q"])] = {"criterion": "gate", "threshold": r["q"], "kv": kv, "ssm": ssm}
        else:
            specs[("fixed", r["r"])] = {
                "criterion": "replay",
                "depths": r["r"],
                "kv": kv,
                "ssm": ssm,
                "max_loops": max(model.config.n_loops, r["r"]),
            }  # (a forced r past K runs r loops)
    cont = {"full": lambda b, c: FullDepth(m, b, c)}
    cont.update({key: (lambda b, c, e=e: AdaptiveDecoder(m, b, c, e)) for key, e in specs.items()})
    res = teacher_forced_timing(m, batch, cont, prompt_len=prompt_len, clock=clock)
    for r in rows:
        got = res[("threshold", r["q"]) if r["setting"] == "threshold" else ("fixed", r["r"])]
        nll = decoded_nll(got["logits"], batch, prompt_len)
        r.update(
            decode_executed_depth=got["stats"]["executed_depth"],
            decode_ppl=math.exp(min(nll, 700.0)),
            decode_ms_per_token=got["ms_per_token"],
            decode_time_ratio=got["ratio"],
            decode_kv=kv,
            decode_ssm=ssm,
        )
    if precision == "bf16":
        model.float()
    return rows


def format_sweep(rows: list[dict], metrics=("ppl",)) -> str:
    """Markdown in the layout of Tab. 16-19 (sweep) and Tab. 12-15 (forced loops); with real decoding
    (:func:`decode_sweep`) also its executed depth, PPL and time per token relative to full depth."""
    dec = any("decode_time_ratio" in r for r in rows)
    extra = " executed (decode) | PPL (decode) | ms/token | time / full |" if dec else ""
    out = [
        "| setting | q / forced r | Iter (selected depth) | executed depth | "
        + " | ".join(m for m in metrics)
        + " |"
        + extra,
        "| --- | ---: | ---: | ---: |" + " ---: |" * len(metrics) + (" ---: | ---: | ---: | ---: |" if dec else ""),
    ]
    for r in rows:
        key = f"{r['q']:.2f}" if r["setting"] == "threshold" else str(r["r"])
        vals = " | ".join(f"{r[m]:.2%}" if m == "accuracy" else f"{r[m]:.2f}" for m in metrics)
        line = f"| {r['setting']} | {key} | {r['iter']:.2f} | {r['executed_depth']} | {vals} |"
        if dec:
            line += (
                f" {r['decode_executed_depth']:.2f} | {r['decode_ppl']:.2f} | {r['decode_ms_per_token']:.2f} |"
                f" {r['decode_time_ratio']:.3f} |"
            )
        out.append(line)
    return "\n".join(out)


def plot_sweep(rows: list[dict], path, metric: str = "ppl", title: str = "") -> None:
    """Figure 1 style: metric vs selected depth; the sweep as a line, fixed depths as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    th = sorted((r for r in rows if r["setting"] == "threshold"), key=lambda r: r["iter"])
    fx = [r for r in rows if r["setting"] == "fixed"]
    if th:
        ax.plot([r["iter"] for r in th], [r[metric] for r in th], "o-", label="exit gate (q sweep)")
        for r in th:
            ax.annotate(
                f"q={r['q']:.1f}", (r["iter"], r[metric]), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    if fx:
        ax.plot([r["iter"] for r in fx], [r[metric] for r in fx], "s", label="fixed depth r (forced)")
    ax.set_xlabel("selected depth (Iter); every row executes all R steps")
    ax.set_ylabel({"ppl": "validation PPL", "accuracy": "accuracy"}.get(metric, metric))
    if (
        metric == "ppl"
        and all(r["ppl"] > 0 for r in rows)
        and max(r["ppl"] for r in rows) / min(r["ppl"] for r in rows) > 20
    ):
        ax.set_yscale("log")
    ax.set_title(title or "selected depth vs performance", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# CLI: looplm eval threshold
# ------------------------------------------------------------------------------------------------
def _cmd_threshold(args) -> int:
    from ..checkpoint_io import load_model_for_inference, read_checkpoint_config, resolve_checkpoint
    from ..data.config import DataConfig
    from ..data.pipeline import iter_val_batches

    import sys

    from ..dataclass_util import ConfigError
    from .cli_checks import at_least, device_errors, loops_errors, out_file_errors

    # every value that needs no model, checked before the checkpoint is read
    errs = at_least(1, batches=args.batches, batch_size=args.batch_size, limit=args.limit)
    errs += at_least(0, decode_batches=args.decode_batches) + at_least(2, seq_len=args.seq_len)
    errs += [f"--thresholds: q must be in (0, 1], got {q}" for q in args.thresholds or [] if not 0 < q <= 1][:1]
    errs += device_errors("--device", args.device, allow_auto=False)
    errs += out_file_errors("--png", args.png)
    if errs:
        raise ConfigError(errs, "eval threshold arguments")
    ckpt = resolve_checkpoint(args.checkpoint)
    model, tok = load_model_for_inference(
        ckpt, device=args.device, allow_nonfinite=args.allow_nonfinite or None, allow_deep=args.allow_deep or None
    )
    R = model.config.n_loops
    gate = hasattr(model.rule, "exit_summary")
    errs = loops_errors("--loops", args.loops or [], R, args.allow_deep)
    if args.thresholds and not gate:  # the threshold q reads the exit gate's CDF: no gate, nothing to apply it to
        errs.append(
            f"--thresholds: a threshold q selects each token's exit from the learned exit gate (rule exit_gate); this "
            f"model's rule is {model.config.rule.name!r}, which has none: leave --thresholds out (the fixed-loop "
            "ablation, --loops, runs without a gate)"
        )
    limit = model.config.max_seq_len
    if args.seq_len is not None and args.seq_len > limit:
        errs.append(f"--seq-len {args.seq_len} exceeds the model's max_seq_len={limit}; give at most {limit}")
    if not gate and args.loops == []:  # (no threshold sweep without a gate, and no forced depth asked for)
        errs.append(
            "--loops: no loop count given and this model has no exit gate to sweep: nothing to evaluate; give "
            f"forced loop counts (e.g. --loops 1 2 {R}) or leave --loops out (1..{R})"
        )
    if errs:
        raise ConfigError(errs, "eval threshold arguments")
    if not gate and args.thresholds is None:
        print(
            f"note: this model's rule {model.config.rule.name!r} has no exit gate, so there is no threshold sweep (q selects "
            "an exit from the gate's distribution): only the fixed-loop ablation r = "
            f"{', '.join(map(str, args.loops)) if args.loops is not None else f'1..{R}'} is run",
            file=sys.stderr,
        )
    train_seq = read_checkpoint_config(ckpt).get("train", {}).get("data", {}).get("seq_len")
    seq_len = args.seq_len or min(train_seq or 256, limit)  # (the default fits the model: 256 at most)
    if args.data == "stdlib":
        dcfg = DataConfig(source="stdlib", seq_len=seq_len)
    else:
        dcfg = DataConfig(source="files", paths=[args.data], val_paths=[args.data], seq_len=seq_len, shuffle_buffer=0)
    batches = list(iter_val_batches(dcfg, tok, args.batches, args.batch_size))
    if not batches:
        raise ValueError(f"--data {args.data!r} gave no evaluation batch")
    fixed = args.loops if args.loops is not None else list(range(1, R + 1))
    thresholds = args.thresholds if args.thresholds is not None else (PAPER_THRESHOLDS if gate else [])
    metric, shown = lm_metric(batches, args.precision), ("ppl",)
    if args.tasks:  # downstream accuracy at every setting, through lm-eval
        tasks = task_metric(
            ckpt,
            args.tasks,
            include_path=args.include_path,
            data_dir=args.data_dir,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
        )
        metric, shown = combine_metrics(metric, tasks), ("ppl", "accuracy")
    rows = sweep(model, metric, thresholds, fixed)
    if args.decode_batches:  # the same settings decoded with the loops really skipped, timed against full depth
        decode_sweep(
            model,
            torch.cat(batches[: args.decode_batches]),
            rows,
            kv=args.kv_policy,
            ssm=args.ssm_policy,
            clock=args.clock,
            precision=args.precision,
        )
    if args.png:
        plot_sweep(rows, args.png, shown[-1], title=f"{ckpt.parent.parent.name}: R = {R}")
    print(json.dumps(rows, indent=2) if args.json else format_sweep(rows, shown))
    return 0


def register(subparsers) -> None:
    """Add ``eval threshold`` (next to ``eval ppl``) to the ``looplm`` command line."""
    from .cli import _eval_subparsers

    ev = _eval_subparsers(subparsers)
    p = ev.add_parser("threshold", help="exit-gate threshold sweep (PPL, Iter) and fixed-loop ablation of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--data", default="stdlib", help="'stdlib' (held-out documents) or text/jsonl files")
    p.add_argument(
        "--thresholds", type=float, nargs="*", default=None, help="q values (default 0.2 0.4 0.6 0.8 1.0 with a gate)"
    )
    p.add_argument("--loops", type=int, nargs="*", default=None, help="forced loop counts (default 1..R)")
    p.add_argument(
        "--allow-deep",
        action="store_true",
        help="allow forced loop counts above 64x the trained K, and a checkpoint of more than 4096 loops (refused otherwise)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="load a checkpoint whose weights hold NaN / inf (refused otherwise; or LOOPLM_ALLOW_NONFINITE=1)",
    )
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="window length (default: the training seq_len, else 256, at most the model's max_seq_len)",
    )
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--png", default=None, help="write the Figure-1-style plot here")
    p.add_argument(
        "--tasks",
        nargs="*",
        default=None,
        help="lm-eval tasks / suites scored at every setting (accuracy column; the plot shows accuracy)",
    )
    p.add_argument("--include-path", nargs="*", default=None, help="extra lm-eval task folders (with --tasks)")
    p.add_argument("--data-dir", default=None, help="local copies of the suites' datasets (with --tasks)")
    p.add_argument("--limit", type=int, default=None, help="at most this many documents per task (with --tasks)")
    p.add_argument(
        "--decode-batches",
        type=int,
        default=1,
        help="batches also decoded token by token with per-token exit that skips the loops, timed against "
        "full depth (0 = off)",
    )
    p.add_argument(
        "--kv-policy",
        choices=["copy", "propagate", "shared", "full"],
        default="copy",
        help="the decoding's KV policy for skipped loops (docs/adaptive-depth.md)",
    )
    p.add_argument("--ssm-policy", choices=["freeze", "propagate", "decay"], default="freeze")
    p.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="wall time, or the process CPU time (a loaded machine)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_threshold)
