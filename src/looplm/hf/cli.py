"""``looplm export hf`` and ``looplm import hf``.

Examples::

    looplm export hf runs/demo hf/demo --loops 4       # a run dir (newest checkpoint) -> transformers dir
    looplm import hf hf/demo runs/imported              # an export round-trips exactly
    looplm import hf ~/models/SmolLM2-135M runs/smol    # Llama / Qwen3 / Mamba-2 (or a .gguf file)
    looplm import hf ~/models/Ouro-1.4B runs/ouro       # Ouro / Huginn checkpoints in their own format
    looplm export hf runs/ouro out/ouro --format original   # back into Ouro's format
"""

from __future__ import annotations

__all__ = ["register"]


def cmd_export_hf(args) -> int:
    from ..checkpoint_io import looplm_contents, resolve_checkpoint
    from .weights import refuse_overlap

    held = looplm_contents(args.out)
    if held is not None:  # --overwrite empties nothing, but writes export files over a checkpoint's own
        raise FileExistsError(
            f"{args.out!r} holds a looplm {'training run' if held == 'run' else held}; an export into it would "
            "overwrite its model.safetensors and config.json (even with --overwrite): pick another directory"
        )
    refuse_overlap(resolve_checkpoint(args.checkpoint), args.out, "export")  # nor inside the checkpoint it reads
    if args.format == "original":
        if args.loops is not None or args.exit_threshold is not None:
            raise ValueError(
                "--loops / --exit-threshold are looplm-export options; the original format keeps the "
                "model's own total_ut_steps / mean_recurrence and early_exit_threshold"
            )
        from .public import export_original

        out = export_original(
            args.checkpoint, args.out, dtype=args.dtype, reference_code=args.reference_code, overwrite=args.overwrite
        )
        print(f"exported {args.checkpoint} -> {out} (original format: {out / 'config.json'})")
        if args.reference_code:
            print(f"  load with: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
        else:
            print("  add the original modelling files (--reference-code DIR) to load it with trust_remote_code")
        return 0
    if args.reference_code:
        raise ValueError("--reference-code goes with --format original")
    from .export import export_hf

    out = export_hf(
        args.checkpoint,
        args.out,
        num_loops=args.loops,
        exit_threshold=args.exit_threshold,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} -> {out}")
    print(
        f"  load with: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)"
        "  (torch + transformers; looplm not needed)"
    )
    return 0


def cmd_import_hf(args) -> int:
    from ..dataclass_util import parse_value, split_override
    from .importer import import_hf

    overrides = {k: parse_value(v) for k, v in map(split_override, args.set or [])}
    out = import_hf(
        args.source,
        args.out,
        gguf_file=args.gguf_file,
        overwrite=args.overwrite,
        dtype=args.dtype,
        allow_nonfinite=args.allow_nonfinite,
        allow_deep=args.allow_deep,
        allow_large=args.allow_large,
        **overrides,
    )
    print(f"imported {args.source} -> {out}")
    print(f"  try: looplm generate --checkpoint {out} --prompt 'Hello'")
    return 0


def _subparsers(subparsers, name: str, help_: str):
    existing = subparsers.choices.get(name)
    if existing is not None:
        for action in existing._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                return action
    p = subparsers.add_parser(name, help=help_)
    return p.add_subparsers(dest=f"{name}_command", required=True)


def register(subparsers) -> None:
    """Add ``export hf`` and ``import hf`` to the ``looplm`` command line."""
    ex = _subparsers(subparsers, "export", "export a checkpoint to another format (hf)")
    if "hf" not in ex.choices:
        p = ex.add_parser(
            "hf", help="a checkpoint as a Hugging Face model directory (remote code, tokenizer, safetensors)"
        )
        p.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest complete checkpoint)")
        p.add_argument("out", help="output directory (must be empty unless --overwrite)")
        p.add_argument(
            "--loops", type=int, default=None, help="default loop count r in the exported config (default: trained K)"
        )
        p.add_argument("--exit-threshold", type=float, default=None, help="default exit threshold q (exit-gate rules)")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights")
        p.add_argument(
            "--format",
            choices=["looplm", "original"],
            default="looplm",
            help="looplm: remote-code export of any model (default); original: an Ouro, Huginn or Nanbeige model in "
            "its own format (config.json fields and tensor names of its release)",
        )
        p.add_argument(
            "--reference-code",
            default=None,
            metavar="DIR",
            help="with --format original: copy the original modelling files from DIR (auto_map)",
        )
        p.add_argument("--overwrite", action="store_true")
        p.set_defaults(func=cmd_export_hf)
    im = _subparsers(subparsers, "import", "import a checkpoint from another format (hf)")
    if "hf" not in im.choices:
        p = im.add_parser(
            "hf",
            help="a Hugging Face directory (looplm export, Llama, Qwen3, Mamba-2, Ouro, Huginn, Nanbeige, GGUF) as a looplm checkpoint",
        )
        p.add_argument("source", help="model directory (config.json + safetensors), or a .gguf file")
        p.add_argument("out", help="output checkpoint directory")
        p.add_argument("--gguf-file", default=None, help="the GGUF file inside SOURCE to load (needs the gguf package)")
        p.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="change the imported config before the weights are copied (e.g. n_loops=2)",
        )
        p.add_argument(
            "--dtype",
            choices=["float32", "bfloat16", "float16"],
            default=None,
            help="dtype of the imported weights (default: float32)",
        )
        p.add_argument("--overwrite", action="store_true")
        p.add_argument(
            "--allow-nonfinite",
            action="store_true",
            help="import weights holding NaN / inf (refused otherwise; for studying broken checkpoints)",
        )
        p.add_argument(
            "--allow-deep",
            action="store_true",
            help="import a loop count above 4096 (total_ut_steps, mean_recurrence, n_loops); refused otherwise",
        )
        p.add_argument(
            "--allow-large",
            action="store_true",
            help="import a model whose parameters exceed this machine's available memory (or LOOPLM_ALLOW_LARGE=1)",
        )
        p.set_defaults(func=cmd_import_hf)
