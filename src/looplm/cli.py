"""The ``looplm`` command line.

Sub-commands are registered by the package that implements them (``register(subparsers)``), so
this file stays a table of contents.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# modules providing ``register(subparsers)``; missing optional pieces are skipped
COMMAND_MODULES = ["looplm.data.cli", "looplm.train.cli"]


def _cmd_presets(args) -> int:
    from .config import list_presets, preset_dict

    names = list_presets()
    if args.markdown:
        print(presets_markdown())
        return 0
    if args.json:
        print(json.dumps(names))
        return 0
    for n in names:
        print(f"{n:34s} {preset_dict(n).get('description', '')}")
    return 0


def presets_markdown() -> str:
    """The README's preset table: sizes computed on the meta device, next to the papers' figures."""
    from .config import list_presets, preset_dict
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
    from .info import human, model_info

    info = model_info(args.model, overrides=args.set or None, num_loops=args.loops, seq_len=args.seq_len)
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
    return 0


def _cmd_generate(args) -> int:
    import torch

    from .data.tokenizers import load_tokenizer
    from .model import build

    if args.checkpoint:
        from .train.checkpoint import load_model_for_inference

        model, tok = load_model_for_inference(args.checkpoint)
    else:
        model = build(args.model, overrides=args.set or None)
        tok = load_tokenizer(args.tokenizer)
    torch.manual_seed(args.seed)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    out = model.generate(
        ids, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_token_id=tok.eos_id, num_loops=args.loops,
    )
    print(tok.decode(out[0, ids.shape[1]:].tolist()))
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--loops", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.set_defaults(func=_cmd_generate)

    for mod in COMMAND_MODULES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("looplm"):
                continue
            raise
        m.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `looplm presets | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
