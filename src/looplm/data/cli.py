"""Command-line pieces of the data layer: ``looplm data prepare`` and ``looplm tokenizer train``.

``register(subparsers)`` adds both commands to an ``argparse`` sub-parser set; each parsed
namespace gets ``func`` = its handler (``handler(args) -> int`` exit code). Run standalone with
``python -m looplm.data.cli ...``.

Examples::

    looplm data prepare --stdlib --out data/stdlib-byte
    looplm data prepare --tokenizer tok/ --out data/mine --seq-len 1024 'corpus/*.jsonl'
    looplm tokenizer train --vocab-size 4096 --out tok/ corpus/*.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable

from .config import DataConfig
from .sources import file_source, resolve_files, stdlib_source
from .tokenizers import load_tokenizer, train_bpe


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUTS",
        help="files, globs, directories (.txt/.md/.jsonl/.parquet) or one 'hf:org/name'",
    )
    p.add_argument(
        "--stdlib",
        action="store_true",
        help="use the built-in corpus of Python standard-library docstrings instead of INPUTS",
    )
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column with the text (default: text)")
    p.add_argument(
        "--missing-text",
        default="error",
        choices=["error", "skip"],
        help="rows without the text field: stop with an error (default) or skip them with a warning",
    )
    p.add_argument(
        "--split-mode",
        default="document",
        choices=["document", "blank_lines", "lines"],
        help=".txt files: one document per file (default), per blank-line paragraph, or per line",
    )
    p.add_argument("--max-docs", type=int, default=None, help="read at most this many documents")


def register(subparsers) -> None:
    """Add the ``data`` (``prepare``) and ``tokenizer`` (``train``) commands to ``subparsers``."""
    data = subparsers.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", metavar="{prepare}")
    data_sub.required = True
    prep = data_sub.add_parser(
        "prepare",
        help="tokenize documents once into memmap shards (for data.source: memmap)",
        description="Tokenize documents (no BOS, EOS after each) into tokens-*.bin shards + meta.json. "
        "The train split is shuffled with the document buffer; every --val-every-nth "
        "document goes to val-*.bin.",
    )
    _add_input_args(prep)
    prep.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, a tokenizer dir or hub name")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="report how many windows of this length the data gives (recorded in meta.json)",
    )
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    prep.add_argument("--shuffle-buffer", type=int, default=10000, help="documents in the shuffle buffer (0 = none)")
    prep.add_argument("--seed", type=int, default=42)
    prep.add_argument(
        "--val-every-nth",
        type=int,
        default=None,
        help="hold out every N-th document for validation (default 50; 0 = no val split)",
    )
    prep.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    prep.set_defaults(func=cmd_data_prepare)

    tok = subparsers.add_parser("tokenizer", help="train tokenizers")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="{train}")
    tok_sub.required = True
    train = tok_sub.add_parser(
        "train",
        help="train a byte-level BPE tokenizer",
        description="Train a byte-level BPE (tokenizers library) and save tokenizer.json + "
        "looplm_tokenizer.json to --out. EOS is <|endoftext|>, pad is <|pad|>.",
    )
    _add_input_args(train)
    train.add_argument("--vocab-size", type=int, required=True, help="total vocabulary (>= 258)")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merge")
    train.set_defaults(func=cmd_tokenizer_train)


def _check_inputs(args) -> None:
    if args.stdlib and args.inputs:
        raise SystemExit("error: give either INPUTS or --stdlib, not both")
    if not args.stdlib and not args.inputs:
        raise SystemExit("error: no input: give files/globs/directories, 'hf:org/name', or --stdlib")


def _data_config(args, **extra) -> DataConfig:
    from looplm.dataclass_util import from_dict

    d = {"source": "stdlib"} if args.stdlib else {"source": "files", "paths": list(args.inputs)}
    d.update(
        text_field=args.text_field,
        missing_text=args.missing_text,
        split_mode=args.split_mode,
        max_docs=args.max_docs,
        **extra,
    )
    return from_dict(DataConfig, d, what="data options")


def _documents(args) -> Iterable[str]:
    cfg = _data_config(args)
    src = stdlib_source(cfg.max_docs) if args.stdlib else file_source(cfg.paths, cfg, cfg.max_docs)
    return (d for d in src if d.strip())


def cmd_data_prepare(args) -> int:
    """Handler of ``looplm data prepare``: write memmap shards and print a summary."""
    from .prepare import prepare_memmap

    _check_inputs(args)
    extra = {"shuffle_buffer": args.shuffle_buffer, "seed": args.seed, "tokenizer": args.tokenizer}
    if args.seq_len is not None:
        extra["seq_len"] = args.seq_len
    if args.val_every_nth is not None:
        extra["val_every_nth"] = args.val_every_nth
    try:
        cfg = _data_config(args, **extra)
        tok = load_tokenizer(cfg.tokenizer)
        meta = prepare_memmap(
            cfg, tok, args.out, shard_tokens=args.shard_tokens, seq_len=args.seq_len, overwrite=args.overwrite
        )
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, ImportError) as e:
        raise SystemExit(f"error: {e}") from e
    print(
        f"prepared {args.out} in {meta['seconds']:.1f}s  (tokenizer {tok.name}, vocab {tok.vocab_size}, "
        f"dtype {meta['dtype']})"
    )
    for split, info in meta["splits"].items():
        line = f"  {split:5s}: {info['docs']:,} docs, {info['tokens']:,} tokens in {len(info['files'])} shard(s)"
        if args.seq_len:
            line += f", {info['tokens'] // args.seq_len:,} windows of {args.seq_len}"
        print(line)
    return 0


def cmd_tokenizer_train(args) -> int:
    """Handler of ``looplm tokenizer train``: train a byte-level BPE, print size and compression."""
    _check_inputs(args)
    if not 0 <= args.min_frequency < 2**32:  # (train_bpe says it too, after the documents are read)
        raise SystemExit(f"error: --min-frequency must be in [0, 2**32), got {args.min_frequency}")
    t0 = time.perf_counter()
    try:
        if not args.stdlib and not any(i.startswith("hf:") for i in args.inputs):
            resolve_files(args.inputs)  # fail early with "no files match ..."
        docs = list(_documents(args))
        if not docs:
            raise ValueError("the inputs contain no non-empty documents")
        tok = train_bpe(None, args.vocab_size, args.out, texts=docs, min_frequency=args.min_frequency)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        raise SystemExit(f"error: {e}") from e
    seconds = time.perf_counter() - t0
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(docs))
    print(f"trained byte-level BPE in {seconds:.1f}s on {len(docs):,} docs ({n_bytes:,} bytes) -> {args.out}")
    print(f"  vocab size: {tok.vocab_size} (eos {tok.eos_token!r} = {tok.eos_id}, pad = {tok.pad_id})")
    print(f"  compression: {n_bytes / max(n_tokens, 1):.2f} bytes/token ({n_tokens:,} tokens)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m looplm.data.cli {data,tokenizer} ...``."""
    parser = argparse.ArgumentParser(prog="looplm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
