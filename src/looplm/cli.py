"""The ``looplm`` command line.

Sub-commands are registered by the package that implements them (``register(subparsers)``), so
this file stays a table of contents. A command's module is imported only when that command runs
(or for ``--help``): ``looplm generate`` and ``looplm eval`` never import the training code.

Errors a user can fix (bad configs, data, checkpoints) print ``error: ...`` and exit non-zero,
without a traceback; warnings print as ``warning: ...``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import importlib
import json
import sys
import warnings

from .checkpoint_io import CheckpointError

# sub-command -> the module whose ``register(subparsers)`` adds it; missing optional pieces are skipped
COMMAND_MODULES = {
    "data": "looplm.data.cli",
    "tokenizer": "looplm.data.cli",
    "eval": ("looplm.eval.cli", "looplm.eval.threshold", "looplm.eval.harness_cli"),  # a tuple: several modules add sub-commands
    "train": "looplm.train.cli",
    "plot": "looplm.train.cli",
    "demo": "looplm.train.cli",
    "task": "looplm.tasks.cli",
    "grid": "looplm.tasks.grid",
    "analyze": "looplm.analysis.cli",
    "bench": "looplm.bench",
    "export": "looplm.hf.cli",
    "import": "looplm.hf.cli",
    "kernels": "looplm.kernels.cli",
}


def _cmd_presets(args) -> int:
    from .config import ModelConfig, list_presets, preset_dict

    names = list_presets()
    if args.markdown:
        print(presets_markdown())
        return 0
    if args.json:
        print(json.dumps(names))
        return 0
    for n in names:
        d = preset_dict(n)
        pskc = tuple(d.get(k, ModelConfig.__dataclass_fields__[k].default) for k in ("n_prelude", "n_core", "n_loops", "n_coda"))
        print(f"{n:44s} {str(pskc):15s} {d.get('description', '')}")
    return 0


def presets_markdown() -> str:
    """The README's preset table: sizes computed on the meta device, next to the papers' figures."""
    from .config import list_presets
    from .info import model_info

    rows = ["| preset | parameters | paper | (p, s, K, c) | effective depth | mixers |", "| --- | ---: | ---: | --- | ---: | --- |"]
    for n in list_presets():
        info = model_info(n)
        ref = preset_dict_reference(n)
        mixers = ", ".join(f"{v} {k}" for k, v in info["mixers"].items() if v)
        p, s, K, c = info["p_s_K_c"]
        rows.append(f"| `{n}` | {info['params']:,} | {ref} | ({p}, {s}, {K}, {c}) | {info['effective_depth']} | {mixers} |")
    return "\n".join(rows)


def preset_dict_reference(name: str) -> str:
    from .config import PRESET_DIR

    import yaml

    path = next(PRESET_DIR.rglob(f"{name}.yaml"))
    ref = (yaml.safe_load(path.read_text()) or {}).get("reference") or {}
    if "params" in ref:
        return f"{ref['params']:,}"
    if "params_nominal" in ref:
        return f"≈{ref['params_nominal']} (nominal)"
    return str(ref.get("params_rounded", ""))


def _cmd_info(args) -> int:
    from .dataclass_util import refuse_empty_yaml
    from .info import human, model_info

    refuse_empty_yaml(args.model, "model config")
    spec, retrofit = args.model, []
    if Path(args.model).is_dir():  # a run or checkpoint directory: its model, and how it was initialised
        from .checkpoint_io import read_checkpoint_config
        from .hf.retrofit import retrofit_summary

        ck = read_checkpoint_config(args.model)
        spec, retrofit = ck["model"], retrofit_summary(ck)
        imp = ck.get("import") or {}
        if imp.get("imported_kind"):  # `looplm import hf`: where the weights came from, in which format
            retrofit = [f"imported from  {imp.get('imported_from')} ({imp['imported_kind']})", *retrofit]
    info = model_info(spec, overrides=args.set or None, num_loops=args.loops, seq_len=args.seq_len)
    if retrofit:
        info["retrofit"] = retrofit
    from .kernels import status
    from .kernels.cli import status_line

    kst = status()
    info["cpu_kernels"] = kst.to_dict()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    p, s, K, c = info["p_s_K_c"]
    print(f"{info['name']}: {info['description']}")
    print(f"  parameters          {info['params']:>16,d}  ({human(info['params'])})")
    print(f"    embedding         {info['embedding_params']:>16,d}")
    print(f"    non-embedding     {info['non_embedding_params']:>16,d}")
    print(f"    recurrence rule   {info['rule_params']:>16,d}  ({info['rule']})")
    print(f"  (p, s, K, c)        ({p}, {s}, {K}, {c})")
    print(f"  physical depth      {info['physical_depth']}")
    print(f"  effective depth     {info['effective_depth']}  (r = {info['num_loops']} loops)")
    print(f"  mixers              {info['mixers']['attention']} attention, {info['mixers']['mamba2']} Mamba-2")
    print(f"  forward FLOPs/token {human(info['forward_flops_per_token'])}  (context {info['seq_len_for_flops']})")
    for line in info.get("retrofit", []):
        print(f"  {line}")
    print(f"  CPU kernels         {status_line(kst)}")
    return 0


def _cmd_generate(args) -> int:
    import torch

    from .checkpoint_io import load_model_for_inference
    from .data.tokenizers import check_vocab, load_tokenizer
    from .dataclass_util import refuse_empty_yaml
    from .factory import build

    if args.checkpoint:
        # --tokenizer replaces the recorded tokenizer (a warning if it differs); --set takes inference-time fields only
        model, tok = load_model_for_inference(args.checkpoint, tokenizer=args.tokenizer, overrides=args.set)
    else:
        refuse_empty_yaml(args.model, "model config")
        torch.manual_seed(args.seed)  # a random preset's weights, reproducible (the sampling seed is set again below)
        model = build(args.model, overrides=args.set or None)
        tok = load_tokenizer(args.tokenizer or "byte")
        check_vocab(tok, model.config.vocab_size)
    if args.dtype != "fp32":
        from .train.trainer import resolve_precision

        precision = resolve_precision(args.dtype, next(model.parameters()).device)
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    if args.compile and not _compiles_the_static_pass(args):
        from .parallel import compile_blocks

        compile_blocks(model)  # per block, ~10 s; where looplm's CPU kernels run, the fused one-token step of plain attention blocks bypasses it
    torch.manual_seed(args.seed)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    adaptive = _adaptive_args(args, model)  # checked before any decoding
    out = model.generate(
        ids, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_token_id=tok.eos_id, num_loops=args.loops, return_stats=args.stats, **adaptive,
    )
    if args.stats:
        out, stats = out
        print(json.dumps(stats.summary()), file=sys.stderr)
    print(tok.decode(out[0, ids.shape[1]:].tolist()))
    return 0


def _adaptive_args(args, model) -> dict:
    """``exit=`` / ``speculative=`` for ``generate`` from ``looplm generate``'s options."""
    from .decode.generate import adaptive_options

    return adaptive_options(model, exit=args.exit, speculative=args.speculative, draft_k=args.draft_k, kv=args.kv_policy,
                            ssm=args.ssm_policy, min_loops=args.min_loops, max_loops=args.max_loops,
                            schedule=args.exit_schedule, draft_exit=args.draft_exit, prefill=args.exit_prefill,
                            compile=True if _compiles_the_static_pass(args) else None)  # fmt: skip


def _compiles_the_static_pass(args) -> bool:
    """``--compile`` with ``--exit ... --exit-schedule static``: the static schedule's whole pass is compiled
    (exit ``compile=True``), not each block."""
    return bool(args.compile and args.exit is not None and args.exit_schedule == "static")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``looplm`` parser. ``command``: the sub-command about to run, so that only its module is
    imported (a built-in command imports none); ``None`` or an unknown name registers them all."""
    ap = argparse.ArgumentParser(prog="looplm", description="Looped (recurrent-depth) language models.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list the model presets")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="a table with sizes and the papers' figures")
    p.set_defaults(func=_cmd_presets)

    p = sub.add_parser("info", help="parameters, depths and FLOPs of a preset or YAML config (meta device)")
    p.add_argument("model", help="preset name or model YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--loops", type=int, default=None, help="loop count r for depth/FLOPs (default: K)")
    p.add_argument("--seq-len", type=int, default=None, help="context length for attention FLOPs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("generate", help="decode from a checkpoint or a (random) preset")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--checkpoint", help="run dir or checkpoint dir written by `looplm train`")
    g.add_argument("--model", help="preset name or YAML (random weights)")
    p.add_argument("--tokenizer", default=None,
                   help="'byte' (default with --model), a tokenizer path or hub name; with --checkpoint it replaces "
                        "the tokenizer the run recorded (with a warning if it differs)")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--loops", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seeds a random preset's weights (no --checkpoint) and the sampling")
    p.add_argument("--compile", action="store_true",
                   help="compile every block first (torch.compile); pays for long generations where the fused CPU "
                        "decode step does not run (GPUs, modulated blocks, CPUs without a C++ compiler); with "
                        "--exit-schedule static, the static schedule's whole pass is compiled instead")
    p.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="fp32",
                   help="weights' dtype for decoding: fp32 (as trained; the default), bf16, or auto = bf16 on CUDA "
                        "and on CPUs with native bf16 (where bf16 decodes 1.5-2x faster than fp32), else fp32")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a model config field; with --checkpoint only max_seq_len and n_loops")
    a = p.add_argument_group("adaptive depth (docs/adaptive-depth.md)")
    a.add_argument("--exit", default=None, metavar="CRITERION[:VALUE]",
                   help="per-token early exit that skips the loops: gate:Q (learned exit gate, q in (0, 1]), kl:EPS "
                        "(KL of successive iterates' next-token distributions), convergence:EPS (relative update norm), replay:R")
    a.add_argument("--kv-policy", choices=["copy", "propagate", "shared", "full"], default=None,
                   help="what later tokens attend to in the loops a token skipped (default copy)")
    a.add_argument("--ssm-policy", choices=["freeze", "propagate", "decay"], default=None,
                   help="what a Mamba-2 state does in the loops a token skipped (default freeze)")
    a.add_argument("--min-loops", type=int, default=None, help="no exit before this many loops (default 1)")
    a.add_argument("--max-loops", type=int, default=None, help="every token exits here (default the trained K)")
    a.add_argument("--exit-schedule", choices=["token", "depth", "static"], default=None,
                   help="how a batch's rows share the core passes: token (rows that exited wait for the deepest, the "
                        "default), depth (continuous depth batching: each pass runs every row at its own loop) or "
                        "static (the same at fixed shapes with no host reads per pass, for CUDA)")
    a.add_argument("--exit-prefill", choices=["full", "exit"], default=None,
                   help="the prompt: full (every loop, the default) or exit (its tokens after the first take the exits "
                        "too, in one parallel forward)")
    a.add_argument("--speculative", type=int, default=None, metavar="R_D",
                   help="lossless self-speculative decoding: draft with R_D < K loops, verify with all K")
    a.add_argument("--draft-k", type=int, default=4, help="tokens drafted per speculative round")
    a.add_argument("--draft-exit", default=None, metavar="CRIT",
                   help="speculative draft depth per token by an exit criterion (kl:EPS, convergence:EPS, gate:Q), at most R_D loops")
    a.add_argument("--stats", action="store_true", help="print the selected / executed depth (or acceptance) summary on stderr")
    p.set_defaults(func=_cmd_generate)

    if command in COMMAND_MODULES:
        modules = _as_list(COMMAND_MODULES[command])
    elif command in sub.choices:  # a built-in command
        modules = []
    else:  # --help, or a misspelt command: list them all
        modules = list(dict.fromkeys(m for v in COMMAND_MODULES.values() for m in _as_list(v)))
    for mod in modules:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("looplm"):
                continue
            raise
        m.register(sub)
    return ap


def _as_list(modules) -> list[str]:
    return [modules] if isinstance(modules, str) else list(modules)


def _command_of(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
    formatwarning, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        return int(args.func(args) or 0)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside training (training itself stops at a step, with a checkpoint)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `looplm presets | head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError) as e:  # bad configs, data, tokenizers (ValueError); missing / unreadable files
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning


if __name__ == "__main__":
    sys.exit(main())
