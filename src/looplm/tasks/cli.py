"""``looplm task {mano,phop} export|train|eval``.

Examples::

    looplm task mano export --split eval --max-length 10 --count 2000 --seed 0 --out mano-L10-eval.jsonl
    looplm task phop export --split train --p 16 --n 256 --count 1000 --seed 1 --out phop.jsonl
    looplm task phop train configs/tasks/phop-cpu.yaml --out runs/phop-1x4 --set model_overrides.n_loops=4
    looplm task phop eval runs/phop-1x4 --count 2000

Export writes one JSON object per line: Mano ``tokens`` (strings: ``<bos> <len_ℓ> … <ans> answer``),
``length``, ``answer`` (int), ``ids``; p-hop ``sequence`` (ints ``0..3``), ``p``, ``n``, ``answer``,
``ids``. The same arguments give the same file.
"""

from __future__ import annotations

import json
import sys

__all__ = ["register"]

DEFAULT_EVAL_COUNT = {"mano": 2000, "phop": 10000}  # App. C / App. D


def export_records(
    task: str, split: str, count: int, seed: int, *, max_length: int = 10, p: int = 16, n: int = 256, alphabet: int = 4
) -> list[dict]:
    """The records ``looplm task TASK export`` writes."""
    if count < 0:
        raise ValueError(f"--count must be >= 0, got {count}")
    if task == "mano":
        from .mano import ManoVocab, generate, instance_record

        vocab = ManoVocab(max_length)
        return [instance_record(i, vocab) for i in generate(split, count, max_length, seed)]
    from .phop import PhopVocab, generate, instance_record

    vocab = PhopVocab(alphabet)
    return [instance_record(i, vocab) for i in generate(split, count, n=n, p=p, alphabet=alphabet, seed=seed)]


def _cmd_export(args) -> int:
    count = args.count if args.count is not None else DEFAULT_EVAL_COUNT[args.task]
    if count < 1:  # (export_records takes 0 for a library caller; a command that writes an empty file is a typo)
        raise ValueError(f"--count must be >= 1, got {count}: the number of instances to write")
    kw = (
        {"max_length": args.max_length}
        if args.task == "mano"
        else {"p": args.p, "n": args.n, "alphabet": args.alphabet}
    )
    records = export_records(args.task, args.split, count, args.seed, **kw)
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        for r in records:
            out.write(json.dumps(r) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out != "-":
        print(f"wrote {len(records)} {args.task} {args.split} instances to {args.out}", file=sys.stderr)
    return 0


def _cmd_train(args) -> int:
    from .train import load_task_config, train_task

    cfg = load_task_config(args.config, args.set or [], task=args.task)
    summary = train_task(cfg, args.out, quiet=args.quiet)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


def _cmd_eval(args) -> int:
    from .train import evaluate_run

    from ..eval.threshold import format_sweep

    res = evaluate_run(
        args.run,
        task=args.task,
        count=args.count,
        seed=args.seed,
        num_loops=args.loops,
        thresholds=args.thresholds,
        device=args.device,
        png=args.png,
    )
    if args.json:
        print(json.dumps(res, indent=2, ensure_ascii=False))
        return 0
    d = res["default"]
    print(
        f"{res['model']} on {d['count']} {args.task} eval samples: accuracy {d['accuracy']:.2%} "
        f"(executed loops {d['executed_loops']}" + (f", selected depth {d['iter']:.2f})" if "iter" in d else ")")
    )
    if res["rows"]:
        print(format_sweep(res["rows"], ("accuracy",)))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("task", help="synthetic reasoning tasks (Mano, p-hop): export, train, eval")
    tasks = p.add_subparsers(dest="task", required=True)
    for task in ("mano", "phop"):
        tp = tasks.add_parser(
            task, help={"mano": "Mano: prefix arithmetic over F_23 (App. C)", "phop": "p-hop induction (App. D)"}[task]
        )
        verbs = tp.add_subparsers(dest="verb", required=True)

        e = verbs.add_parser("export", help="write instances as JSONL")
        e.add_argument("--split", choices=["train", "eval"], default="eval")
        e.add_argument("--count", type=int, default=None, help=f"instances (default {DEFAULT_EVAL_COUNT[task]})")
        e.add_argument("--seed", type=int, default=0)
        e.add_argument("--out", required=True, help="output .jsonl path ('-' = stdout)")
        if task == "mano":
            e.add_argument("--max-length", type=int, default=10, help="L: maximum number of operations")
        else:
            e.add_argument("--p", type=int, default=16, help="hops")
            e.add_argument("--n", type=int, default=256, help="sequence length")
            e.add_argument("--alphabet", type=int, default=4)
        e.set_defaults(func=_cmd_export)

        t = verbs.add_parser("train", help="train N⊗R models from a task YAML (best of train.seeds)")
        t.add_argument("config", help="task run YAML (configs/tasks/...)")
        t.add_argument("--out", required=True, help="run directory")
        t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
        t.add_argument("--quiet", action="store_true")
        t.set_defaults(func=_cmd_train)

        v = verbs.add_parser("eval", help="exact-match accuracy of a trained run on the deterministic eval set")
        v.add_argument("run", help="run directory written by `looplm task ... train` (its best seed) or a seed dir")
        v.add_argument(
            "--count",
            type=int,
            default=None,
            help=f"eval instances (default: the run's, paper {DEFAULT_EVAL_COUNT[task]})",
        )
        v.add_argument("--seed", type=int, default=None, help="eval seed (default: the run's)")
        v.add_argument("--loops", type=int, nargs="*", default=None, help="forced loop counts r (fixed-loop ablation)")
        v.add_argument(
            "--thresholds", type=float, nargs="*", default=None, help="exit-gate thresholds q (exit-gate models)"
        )
        v.add_argument("--device", default="cpu")
        v.add_argument("--png", default=None, help="accuracy vs selected depth plot (Figure 1 style)")
        v.add_argument("--json", action="store_true")
        v.set_defaults(func=_cmd_eval)
