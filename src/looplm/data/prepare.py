"""Write pre-tokenized memmap shards: ``prepare_memmap`` (the ``looplm data prepare`` command).

The layout is described in :mod:`looplm.data.memmap`, whose :class:`~looplm.data.memmap.MemmapStream`
reads it. The token stream written here is the document pipeline's: documents (shuffled by the
config's buffer for the train split), each tokenized with no BOS and followed by EOS, concatenated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .config import DataConfig
from .memmap import FORMAT_NAME, META_NAME, SHARD_PREFIX, dtype_for_vocab
from .pipeline import TokenStream, selection_for
from .sources import DocumentSource, EmptyCorpusError, file_source, make_source
from .stream import check_config, resolve_tokenizer
from .tokenizers import Tokenizer, tokenizer_fingerprint

__all__ = ["prepare_memmap"]


class _ShardWriter:
    """Appends tokens to ``<prefix>-00000.bin``, ``-00001.bin``, ... of at most ``shard_tokens`` each."""

    def __init__(self, out_dir: Path, prefix: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.prefix, self.dtype, self.shard_tokens = out_dir, prefix, dtype, shard_tokens
        self.files: list[str] = []
        self.sizes: list[int] = []
        self._fh = None
        self._pending: list[int] = []
        self.tokens = 0
        self.docs = 0

    def add(self, tokens: list[int]) -> None:
        self._pending.extend(tokens)
        self.docs += 1
        if len(self._pending) >= 1 << 20:
            self._flush()

    def _flush(self) -> None:
        arr = np.asarray(self._pending, dtype=np.int64)
        self._pending = []
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(arr.max())} does not fit {self.dtype.name}; tokenizer/vocab mismatch")
        arr = arr.astype(self.dtype)
        while arr.size:
            if self._fh is None or self.sizes[-1] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.sizes[-1]
            piece, arr = arr[:room], arr[room:]
            piece.astype(self.dtype.newbyteorder("<"), copy=False).tofile(self._fh)
            self.sizes[-1] += int(piece.size)
            self.tokens += int(piece.size)

    def _open_next(self) -> None:
        if self._fh is not None:
            self._fh.close()
        name = f"{self.prefix}-{len(self.files):05d}.bin"
        self.files.append(name)
        self.sizes.append(0)
        self._fh = open(self.out_dir / name, "wb")

    def close(self) -> dict:
        self._flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return {"files": self.files, "shard_sizes": self.sizes, "tokens": self.tokens, "docs": self.docs}


def _encode_stream(tokenizer: Tokenizer, docs: Iterable[str], chunk: int = 256) -> Iterable[list[int]]:
    """Token lists of ``docs`` (+ EOS each); uses ``encode_batch`` when the tokenizer has it."""
    eos = tokenizer.eos_id
    batch_enc = getattr(tokenizer, "encode_batch", None)
    if batch_enc is None:
        for d in docs:
            yield tokenizer.encode(d) + [eos]
        return
    buf: list[str] = []
    for d in docs:
        buf.append(d)
        if len(buf) >= chunk:
            for ids in batch_enc(buf):
                yield ids + [eos]
            buf = []
    if buf:
        for ids in batch_enc(buf):
            yield ids + [eos]


def prepare_memmap(
    cfg_or_sources: DataConfig | DocumentSource | Sequence[str],
    tokenizer: Tokenizer | str | None,
    out_dir: str | os.PathLike,
    shard_tokens: int = 1 << 28,
    *,
    seq_len: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Tokenize documents once and write memmap shards + ``meta.json`` to ``out_dir``.

    Args:
        cfg_or_sources: a :class:`DataConfig` (train split shuffled with its buffer/seed, plus its
            validation split when it has a hold-out rule), a :class:`DocumentSource`, or a list of
            file paths/globs (read in order, no validation split).
        tokenizer: a tokenizer or a spec (``None`` = ``cfg.tokenizer``, else ``"byte"``).
        shard_tokens: tokens per shard file (default 2**28: 512 MiB of uint16).
        seq_len: only recorded in the metadata (windows are cut at read time).
        overwrite: replace an existing prepared directory.

    Returns the metadata dict (also written to ``meta.json``), with ``seconds`` taken. Nothing is left in
    ``out_dir`` when it fails: the shards are moved into place only once all are written.
    """
    t0 = time.perf_counter()
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    out = Path(out_dir)
    if (out / META_NAME).exists() and not overwrite:
        raise FileExistsError(f"{out} already holds prepared data ({META_NAME}); pass overwrite=True / --overwrite")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a directory; give --out a directory path")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    # the shards are written in a temporary directory inside ``out`` and moved into place only once every
    # split is written: a failure (bad data, a full disk, Ctrl-C) leaves ``out`` as it was, and an
    # --overwrite that fails keeps the data it was to replace
    work = out / f".prepare-{os.getpid()}.tmp"
    for stale in out.glob(".prepare-*.tmp"):  # a killed prepare's (kill -9 runs no clean-up)
        if stale == work or not _alive(stale.name[len(".prepare-") : -len(".tmp")]):
            shutil.rmtree(stale, ignore_errors=True)
    work.mkdir()
    try:
        meta = _prepare(cfg_or_sources, tokenizer, work, shard_tokens, seq_len, t0)
        _move_into_place(work, out, meta)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty: nothing of anyone else's goes
        raise
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ValueError:
        return False
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _move_into_place(work: Path, out: Path, meta: dict) -> None:
    """The shards of ``work`` to ``out``, replacing the previous prepared data; ``meta.json`` last (an
    interruption in between leaves no ``meta.json``: no directory that reads as prepared but is not)."""
    (out / META_NAME).unlink(missing_ok=True)
    new = {f for info in meta["splits"].values() for f in info["files"]}
    for old in list(out.glob("tokens-*.bin")) + list(out.glob("val-*.bin")):
        if old.name not in new:
            old.unlink()
    for name in sorted(new):
        os.replace(work / name, out / name)
    tmp = work / META_NAME
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / META_NAME)


def _prepare(cfg_or_sources, tokenizer, out: Path, shard_tokens: int, seq_len: int | None, t0: float) -> dict:
    """Tokenize and write every split's shards to ``out``; returns the metadata (not written)."""
    splits: dict[str, Iterable[str]] = {}
    if isinstance(cfg_or_sources, DataConfig):
        cfg = cfg_or_sources
        check_config(cfg)
        if cfg.kind == "memmap":
            raise ValueError("the config already reads a memmap directory; give it a document source")
        tok = resolve_tokenizer(cfg, tokenizer)
        train = TokenStream(
            make_source(cfg, "train"),
            tok,
            cfg.seq_len,
            shuffle_buffer=cfg.shuffle_buffer,
            seed=cfg.seed,
            selection=selection_for(cfg, "train"),
            epochs=1,
            split="train",
        )
        splits["train"] = train.iter_documents()
        description = train.source.description
        if cfg.holdout()[0] != "none":
            val = TokenStream(
                make_source(cfg, "val"),
                tok,
                cfg.seq_len,
                shuffle_buffer=0,
                seed=cfg.seed,
                selection=selection_for(cfg, "val"),
                epochs=1,
                split="val",
            )
            splits["val"] = val.iter_documents()
        shuffle = cfg.shuffle_buffer
        seed = cfg.seed
    else:
        tok = resolve_tokenizer(DataConfig(), tokenizer)
        if isinstance(cfg_or_sources, DocumentSource):
            source = cfg_or_sources
        else:
            paths = [cfg_or_sources] if isinstance(cfg_or_sources, str) else list(cfg_or_sources)
            source = file_source(paths, DataConfig(source="files", paths=paths))
        one = TokenStream(source, tok, 2, shuffle_buffer=0, epochs=1)
        splits["train"] = one.iter_documents()
        description, shuffle, seed = source.description, 0, None

    dtype = dtype_for_vocab(tok.vocab_size)
    split_meta = {}
    for split, docs in splits.items():
        writer = _ShardWriter(out, SHARD_PREFIX[split], dtype, shard_tokens)
        for ids in _encode_stream(tok, docs):
            writer.add(ids)
        split_meta[split] = writer.close()
    if split_meta["train"]["tokens"] == 0:
        raise EmptyCorpusError(f"{description}: no documents to prepare")
    meta = {
        "format": FORMAT_NAME,
        "version": 1,
        "tokenizer": {
            "name": tok.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "fingerprint": tokenizer_fingerprint(tok),
        },
        "dtype": dtype.name,
        "byte_order": "little",
        "bos_added": False,
        "eos_after_each_document": True,
        "shuffle_buffer": shuffle,
        "seed": seed,
        "source": description,
        "seq_len_hint": seq_len,
        "shard_tokens": shard_tokens,
        "splits": split_meta,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return meta
