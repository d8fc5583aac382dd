"""``looplm eval harness``: the command line of :mod:`looplm.eval.harness` (kept apart so that other
``looplm eval`` commands do not import lm-eval).

Examples::

    looplm eval harness runs/demo --tasks looplm_mamba7 --data-dir ../shared/data/eval --limit 200
    looplm eval harness runs/demo --tasks my_task --include-path tasks/ --loops 6 --output-json out.json
    looplm eval harness --write-tasks suites/ --data-dir ../shared/data/eval
"""

from __future__ import annotations

__all__ = ["register", "cmd_eval_harness"]

# the suites of looplm.eval.harness.SUITES (listed here for --help without importing lm-eval)
SUITE_NAMES = (
    "looplm_stateloop8_0shot",
    "looplm_stateloop8_5shot",
    "looplm_mamba7",
    "looplm_knowledge",
    "looplm_reasoning",
    "looplm_bbh14",
)


def _print_results(out: dict) -> None:
    from lm_eval.utils import make_table

    print(make_table(out))
    if out.get("groups"):
        print(make_table(out, "groups"))
    if out.get("looplm_tables"):
        print(out["looplm_tables"])
    if out.get("adaptive_depth"):
        a = out["adaptive_depth"]
        print(
            f"adaptive depth of the scored tokens ({a['tokens']:,}): selected {a['selected_depth']:.2f}, executed "
            f"{a['executed_depth']:.2f} of {a['max_loops']} loops (executed / K {a['executed_ratio']:.3f}; the core ran "
            f"{a['computed_ratio']:.3f} of full depth's positions, padding of the packs included)"
        )


def cmd_eval_harness(args) -> int:
    from .harness import run_harness, write_task_configs

    if args.write_tasks:
        suites = write_task_configs(args.write_tasks, args.data_dir)
        print(
            f"wrote {sum(len(m) for m in suites.values())} task and {len(suites)} group configs to {args.write_tasks} "
            f"(lm_eval --include_path {args.write_tasks} --tasks {','.join(suites)}); paths in them are relative "
            "to that folder"
        )
        if not args.checkpoint:
            return 0
    if not args.checkpoint or not args.tasks:
        raise ValueError("looplm eval harness needs CHECKPOINT and --tasks (or only --write-tasks DIR)")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    from .cli_checks import device_errors, out_file_errors

    # (before the tasks are loaded and the model scored)
    errs = out_file_errors("--output-json", args.output_json) + device_errors("--device", args.device or "auto")
    if errs:
        raise ValueError(errs[0])
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    out = run_harness(
        args.checkpoint,
        tasks,
        loops=args.loops,
        exit_threshold=args.exit_threshold,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        include_path=args.include_path,
        data_dir=args.data_dir,
        output_json=args.output_json,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        max_length=args.max_length,
        seed=args.seed,
        log_samples=args.log_samples,
        prefix_token_id=args.prefix_token_id,
        exit=args.exit,
        kv_policy=args.kv_policy,
        ssm_policy=args.ssm_policy,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        allow_deep=args.allow_deep,
    )
    _print_results(out)
    return 0


def register(subparsers) -> None:
    """Add ``eval harness`` to the ``looplm`` command line."""
    from .cli import _eval_subparsers

    ev = _eval_subparsers(subparsers)
    if "harness" in ev.choices:
        return
    p = ev.add_parser("harness", help="lm-evaluation-harness tasks and the papers' suites on a checkpoint")
    p.add_argument("checkpoint", nargs="?", help="checkpoint or run directory, or a `looplm export hf` directory")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks / groups, or suites: " + ", ".join(SUITE_NAMES))
    p.add_argument("--loops", type=int, default=None, help="loop count r (default: the trained K)")
    p.add_argument(
        "--allow-deep",
        action="store_true",
        help="allow --loops / --max-loops above 64x the trained K (refused otherwise)",
    )
    p.add_argument("--exit-threshold", type=float, default=None, help="exit threshold q (exit-gate rules)")
    p.add_argument(
        "--exit",
        default=None,
        metavar="CRITERION[:VALUE]",
        help="per-token exit for every request (docs/adaptive-depth.md): kl:EPS, convergence:EPS, gate:Q, replay:R; "
        "scored texts take it in one forward per batch, generations through generate",
    )
    p.add_argument(
        "--kv-policy",
        choices=["copy", "propagate", "shared", "full"],
        default=None,
        help="what later tokens attend to in the loops a token skipped (default copy)",
    )
    p.add_argument("--ssm-policy", choices=["freeze", "propagate", "decay"], default=None)
    p.add_argument("--min-loops", type=int, default=None)
    p.add_argument("--max-loops", type=int, default=None)
    p.add_argument("--num-fewshot", type=int, default=None, help="override every task's shots (default: the suite's)")
    p.add_argument("--limit", type=float, default=None, help="at most N documents per task (a fraction if < 1)")
    p.add_argument(
        "--include-path", action="append", default=None, help="a folder of extra lm-eval task YAMLs (repeatable)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="local task data (DIR/<task>/ as saved by datasets.save_to_disk); suites and plain task names "
        "with a local copy (arc_easy, ...) read it instead of the hub",
    )
    p.add_argument("--output-json", default=None, help="write the results (and the suites' tables) here")
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="also write every scored document (lm-eval's samples) as OUTPUT_samples_<task>.jsonl next to --output-json",
    )
    p.add_argument(
        "--prefix-token-id",
        type=int,
        default=None,
        help="token an empty context and each document's first token are conditioned on (default: BOS, else EOS, as lm-eval's hf model)",
    )
    p.add_argument(
        "--write-tasks",
        default=None,
        metavar="DIR",
        help="write the suites' task YAMLs to DIR (for lm_eval --include_path)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None, help="context window (default: the training seq_len)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (tiny models on a busy CPU: 1 is often several times faster)",
    )
    p.set_defaults(func=cmd_eval_harness)
