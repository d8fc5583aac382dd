"""``looplm serve`` (an OpenAI-compatible HTTP server over the engine) and ``looplm chat`` (a terminal client).

FastAPI, uvicorn and the openai client are imported when the command runs, not with this module.
``docs/serving.md`` is the guide.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["register", "load_served_model", "OPENMP_SPIN_ENV", "openmp_spin_respawn"]

# libgomp (the OpenMP runtime of torch's CPU wheels) reads these once, when torch loads. Its default is to spin a
# worker ~3 ms (300,000 spins) for the next parallel region before it sleeps, but once more libgomp threads exist
# than CPUs it cuts the spin to 1,000 (a "throttled" count), so every one of a decode step's hundreds of short
# parallel regions wakes its workers from a futex. A server has several threads that run torch (the one that
# loaded the model, the engine's), so it is throttled: on a 2-core AMD EPYC, SmolLM2-135M's batch-8 decode step
# took 45-50 ms in the server's process against 24-28 ms in a process of one torch thread. OMP_WAIT_POLICY=ACTIVE
# keeps the spin count it is given, and GOMP_SPINCOUNT=300000 is libgomp's own unthrottled one: the ~3 ms spin,
# then sleep, as a one-thread process has. (libgomp's env.c; no API changes it after load, hence the respawn.)
OPENMP_SPIN_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s!r}")
    return v


def _non_negative_float(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s!r}")
    return v


def _add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "model",
        nargs=None if required else "?",
        metavar="RUN|PRESET",
        help="a run or checkpoint directory written by `looplm train`, or a preset name / model YAML "
        "(random weights, seeded by --seed)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte' (the default for a preset), a tokenizer path or hub name; with a RUN it replaces the "
        "tokenizer the run recorded. The chat endpoint needs a Hugging Face tokenizer with a chat template",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "auto"],
        default="fp32",
        help="weights' dtype: fp32 (the default), bf16, or auto (bf16 where the CPU / GPU multiplies it natively)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seeds a random preset's weights")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a model config field; with a RUN only max_seq_len and n_loops",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="load a checkpoint whose weights hold NaN / inf (refused otherwise; or LOOPLM_ALLOW_NONFINITE=1)",
    )
    p.add_argument(
        "--allow-deep",
        action="store_true",
        help="serve a model of more than 4096 loops (refused otherwise; or LOOPLM_ALLOW_DEEP=1)",
    )
    e = p.add_argument_group("engine (docs/serving.md)")
    e.add_argument("--max-batch", type=int, default=8, help="rows decoded at once (default 8)")
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + generated tokens of one request (default and upper bound: the model's max_seq_len)",
    )
    e.add_argument(
        "--exit",
        default=None,
        metavar="CRITERION[:VALUE]",
        help="the exit criterion every row runs (kl:0.01, convergence:0.05, gate:0.8; default full depth); "
        "requests may set their own threshold with looplm.exit",
    )
    e.add_argument(
        "--exit-schedule",
        choices=["depth", "token"],
        default="depth",
        help="depth: each row at its own loop (default); token: rows that exited wait for the deepest",
    )
    e.add_argument(
        "--kv-policy",
        choices=["copy", "propagate", "shared", "full"],
        default=None,
        help="what later tokens attend to in the loops a token skipped (with --exit)",
    )
    e.add_argument("--max-waiting", type=int, default=64, help="requests queued for a row before 429 (default 64)")
    e.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="most prompt tokens prefilled per engine tick (default 256; whole prompts under --exit-prefill exit)",
    )
    e.add_argument(
        "--exit-prefill",
        choices=["full", "exit"],
        default="full",
        help="full: a prompt runs every loop (default); exit: with --exit, a prompt's tokens after the first take "
        "the exits too, whole prompts at once (as model.generate with Exit(prefill='exit'))",
    )
    e.add_argument(
        "--kv-budget",
        default=None,
        metavar="TOKENS|SIZE",
        help="KV cache requests may hold: cache tokens (4096) or memory (2GiB, 512MiB); a request counts "
        "(prompt + max_tokens) x its loop slots to be admitted; the youngest is preempted (and recomputed) "
        "when the running ones outgrow it (default: the whole cache block)",
    )


def register(subparsers) -> None:
    """Add ``serve`` and ``chat`` to the ``looplm`` command line."""
    if "serve" not in subparsers.choices:
        p = subparsers.add_parser(
            "serve",
            help="an OpenAI-compatible HTTP server (completions, chat, metrics)",
            description="Serve a looped model over HTTP with the OpenAI API (docs/serving.md).",
        )
        _add_model_args(p)
        s = p.add_argument_group("server")
        s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
        s.add_argument(
            "--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed at the start)"
        )
        s.add_argument(
            "--api-key",
            default=None,
            metavar="KEY",
            help="require 'Authorization: Bearer KEY' on /v1/*. A key on the command line shows in ps "
            "to every user of the machine: prefer the LOOPLM_API_KEY environment variable (the "
            "default; else no key)",
        )
        s.add_argument(
            "--max-body-mib",
            type=_positive_float,
            default=8.0,
            metavar="MIB",
            help="the largest request body, in MiB (default 8): a larger one is a 413, read no further",
        )
        s.add_argument(
            "--served-model-name",
            default=None,
            metavar="NAME",
            help="the model id clients name (default: the run directory's name or the preset)",
        )
        s.add_argument(
            "--grace-s",
            type=_non_negative_float,
            default=30.0,
            help="on SIGTERM / Ctrl-C, how long requests in flight may finish (default 30)",
        )
        s.add_argument(
            "--request-timeout-s",
            type=_positive_float,
            default=600.0,
            help="a request still running after this long is aborted with an error (default 600)",
        )
        s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info")
        p.set_defaults(func=cmd_serve)
    if "chat" not in subparsers.choices:
        p = subparsers.add_parser(
            "chat",
            help="chat in the terminal with a server (--url) or a model run in-process",
            description="A terminal chat client with streamed output: against a running "
            "`looplm serve` (--url), or a model served in this process.",
        )
        _add_model_args(p, required=False)
        p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
        p.add_argument(
            "--api-key",
            default=None,
            help="the server's key. On the command line it shows in ps to every user of the machine: "
            "prefer the LOOPLM_API_KEY environment variable (the default; else none)",
        )
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.7)
        p.add_argument("--system", default=None, help="a system message to start the conversation with")
        p.add_argument(
            "--completion",
            action="store_true",
            help="plain text continuation (/v1/completions) instead of chat: for models without a chat template",
        )
        p.set_defaults(func=cmd_chat)


# ------------------------------------------------------------------------------------------------ loading
def load_served_model(args):
    """``(model, tokenizer, default_name)`` for ``serve`` / ``chat``, as ``looplm generate`` loads RUN or PRESET."""
    import torch

    from ..checkpoint_io import load_model_for_inference
    from ..data.tokenizers import check_vocab, load_tokenizer
    from ..dataclass_util import refuse_empty_yaml
    from ..factory import build

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    spec = args.model
    path = Path(spec)
    if path.is_dir():
        model, tok = load_model_for_inference(
            path,
            tokenizer=args.tokenizer,
            overrides=args.set,
            allow_nonfinite=args.allow_nonfinite or None,
            allow_deep=args.allow_deep or None,
        )
        name = path.resolve().name
    else:
        refuse_empty_yaml(spec, "model config")
        from ..checkpoint_io import refuse_deep
        from ..config import load_model_config

        refuse_deep(load_model_config(spec, args.set or None).n_loops, f"model {spec!r}", allow=args.allow_deep or None)
        torch.manual_seed(args.seed)  # a random preset's weights, reproducible
        model = build(spec, overrides=args.set or None)
        tok = load_tokenizer(args.tokenizer or "byte")
        check_vocab(tok, model.config.vocab_size)
        name = path.stem if spec.endswith((".yaml", ".yml")) else spec
    if args.dtype != "fp32":
        from ..train.trainer import resolve_precision

        precision = resolve_precision(args.dtype, next(model.parameters()).device)
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    return model.eval(), tok, name


def _engine_config(args):
    """The :class:`EngineConfig` of the command line: its errors are said before a model is loaded."""
    from .engine import EngineConfig

    chunk = args.prefill_chunk
    if chunk is None:
        chunk = None if args.exit_prefill == "exit" else 256
    elif args.exit_prefill == "exit":
        raise ValueError(
            f"--prefill-chunk {chunk}: under --exit-prefill exit each prompt is prefilled whole (its exits over "
            "the whole prompt at once); leave --prefill-chunk out"
        )
    if args.exit_prefill == "exit" and args.exit is None:
        raise ValueError("--exit-prefill exit needs --exit (kl:0.01, ...): at full depth a prompt has no exit to take")
    return EngineConfig(
        max_batch=args.max_batch,
        max_model_len=args.max_model_len,
        exit=args.exit,
        exit_schedule=args.exit_schedule,
        kv_policy=args.kv_policy,
        max_waiting=args.max_waiting,
        prefill_chunk=chunk,
        prefill=args.exit_prefill,
        kv_budget=None
        if args.kv_budget is None
        else (int(args.kv_budget) if args.kv_budget.strip().isdigit() else args.kv_budget),
    )


def _engine(model, tok, cfg):
    from .engine import Engine

    return Engine(model, cfg, eos_token_id=getattr(tok, "eos_id", None))


def _need(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} needs the '{module}' package: pip install 'looplm[serve]'") from e


def _uses_libgomp() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:  # (not Linux: no libgomp to tune)
        return False


def openmp_spin_respawn(argv0: str | None = None) -> list[str] | None:
    """The command line ``looplm serve`` restarts itself with (same process, :data:`OPENMP_SPIN_ENV` added), or None
    where it runs as it is: torch's OpenMP is not libgomp, the user set either variable, or this is not the
    ``looplm`` program itself (a test or a notebook calling :func:`looplm.cli.main`: never replaced)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if any(k in os.environ for k in OPENMP_SPIN_ENV) or not _uses_libgomp():
        return None
    prog = Path(argv0)
    if not (prog.name == "looplm" or prog.parts[-2:] == ("looplm", "cli.py")):
        return None
    return [sys.executable, "-m", "looplm.cli", *sys.argv[1:]]


def cmd_serve(args) -> int:
    _need("fastapi", "looplm serve")
    _need("uvicorn", "looplm serve")
    from .app import build_app
    from .server import run_server

    if args.port < 0 or args.port > 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    cfg = _engine_config(args)
    respawn = openmp_spin_respawn()
    if respawn is not None:  # after the cheap checks, before any work: only the imports repeat (OPENMP_SPIN_ENV)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, respawn, {**os.environ, **OPENMP_SPIN_ENV})
    model, tok, name = load_served_model(args)
    engine = _engine(model, tok, cfg).start()  # (its cache allocated and the budget sized before the port opens)
    api_key = args.api_key or os.environ.get("LOOPLM_API_KEY") or None
    app = build_app(
        engine,
        tok,
        args.served_model_name or name,
        api_key=api_key,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=max(1024, int(args.max_body_mib * 2**20)),
    )
    print(
        f"looplm serve: {args.served_model_name or name}: {engine.describe()}{' (API key required)' if api_key else ''}",
        file=sys.stderr,
        flush=True,
    )
    run_server(app, host=args.host, port=args.port, grace_s=args.grace_s, log_level=args.log_level)
    return 0


# ------------------------------------------------------------------------------------------------ chat
def cmd_chat(args) -> int:
    errs = []  # (the server would refuse them at the first prompt, after a model was loaded and served)
    if args.max_tokens < 1:
        errs.append(f"--max-tokens: must be >= 1 (tokens per answer), got {args.max_tokens}")
    if not 0.0 <= args.temperature <= 2.0:
        errs.append(f"--temperature: must be in [0, 2] (0 = greedy), got {args.temperature}")
    if errs:
        from ..dataclass_util import ConfigError

        raise ConfigError(errs, "looplm chat arguments")
    openai = _need("openai", "looplm chat")
    server = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        if not args.model:
            raise ValueError("looplm chat needs a RUN or PRESET to serve in this process, or --url of a running server")
        from .app import build_app
        from .server import Server

        cfg = _engine_config(args)
        model, tok, name = load_served_model(args)
        engine = _engine(model, tok, cfg)
        server = Server(build_app(engine, tok, name), grace_s=1.0).start()
        base = server.url
    key = args.api_key or os.environ.get("LOOPLM_API_KEY") or "none"
    client = openai.OpenAI(base_url=base + ("" if base.endswith("/v1") else "/v1"), api_key=key)
    try:
        model_id = client.models.list().data[0].id
        _chat_loop(client, model_id, args)
    finally:
        if server is not None:
            server.stop()
    return 0


def _chat_loop(client, model_id: str, args) -> None:
    import openai

    history = [{"role": "system", "content": args.system}] if args.system else []
    completion = args.completion
    print(
        f"chatting with {model_id} ({'completion' if completion else 'chat'} mode); /reset clears, /quit or Ctrl-D ends",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        try:
            if not completion:
                try:
                    stream = client.chat.completions.create(
                        model=model_id,
                        messages=[*history, {"role": "user", "content": line}],
                        stream=True,
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                    )
                except openai.BadRequestError as e:
                    if "chat template" not in str(e):
                        raise
                    # this line is not lost: it is continued as plain text, and so are the next ones
                    print(
                        f"the model has no chat template: continuing {line[:40]!r} as plain text (completion mode)",
                        file=sys.stderr,
                    )
                    completion, history = True, []
                else:
                    reply = "".join(
                        _print_stream(stream, lambda ch: ch.choices[0].delta.content if ch.choices else None)
                    )
                    history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
                    continue
            stream = client.completions.create(
                model=model_id, prompt=line, stream=True, max_tokens=args.max_tokens, temperature=args.temperature
            )
            _print_stream(stream, lambda ch: ch.choices[0].text if ch.choices else None)
        except openai.APIError as e:
            print(f"error: {e}", file=sys.stderr)


def _print_stream(stream, piece) -> list[str]:
    parts = []
    for chunk in stream:
        text = piece(chunk)
        if text:
            parts.append(text)
            print(text, end="", flush=True)
    print()
    return parts
