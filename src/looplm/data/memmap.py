"""Pre-tokenized memmap shards: ``prepare_memmap`` writes them, ``MemmapStream`` samples them.

Layout of a prepared directory::

    meta.json            tokenizer (name, vocab_size, eos_id), dtype, per-split files/tokens/docs
    tokens-00000.bin     training tokens, raw little-endian uint16 (vocab <= 65536) or uint32
    tokens-00001.bin     ... (a new shard every ``shard_tokens`` tokens)
    val-00000.bin        held-out tokens (when the config has a validation rule)

The token stream is the same as the document pipeline's: documents (shuffled by the config's
shuffle buffer for the train split), each tokenized with no BOS and followed by EOS, concatenated.
Shards are pieces of one long array; a document may continue in the next shard.

:class:`MemmapStream` cuts the whole array into non-overlapping windows of ``seq_len`` tokens
(``seq_len`` is chosen at read time; the tail shorter than a window is dropped). Each epoch visits
every window exactly once, in a permutation seeded by ``(seed, epoch)``. Its state is just
``(epoch, position)``: seeded and exactly resumable.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from .config import DataConfig
from .pipeline import (
    STATE_VERSION,
    StreamExhausted,
    TokenStream,
    _BatchStream,
    _resolve_tokenizer,
    check_config,
    selection_for,
)
from .sources import DocumentSource, EmptyCorpusError, file_source, make_source
from .tokenizers import Tokenizer

META_NAME = "meta.json"
FORMAT_NAME = "looplm-memmap"
_PREFIX = {"train": "tokens", "val": "val"}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


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

    Returns the metadata dict (also written to ``meta.json``), with ``seconds`` taken.
    """
    t0 = time.perf_counter()
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    out = Path(out_dir)
    if (out / META_NAME).exists() and not overwrite:
        raise FileExistsError(f"{out} already holds prepared data ({META_NAME}); pass overwrite=True / --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("tokens-*.bin")) + list(out.glob("val-*.bin")):
        old.unlink()

    splits: dict[str, Iterable[str]] = {}
    if isinstance(cfg_or_sources, DataConfig):
        cfg = cfg_or_sources
        check_config(cfg)
        if cfg.kind == "memmap":
            raise ValueError("the config already reads a memmap directory; give it a document source")
        tok = _resolve_tokenizer(cfg, tokenizer)
        train = TokenStream(make_source(cfg, "train"), tok, cfg.seq_len, shuffle_buffer=cfg.shuffle_buffer,
                            seed=cfg.seed, selection=selection_for(cfg, "train"), epochs=1, split="train")
        splits["train"] = train.iter_documents()
        description = train.source.description
        if cfg.holdout()[0] != "none":
            val = TokenStream(make_source(cfg, "val"), tok, cfg.seq_len, shuffle_buffer=0, seed=cfg.seed,
                              selection=selection_for(cfg, "val"), epochs=1, split="val")
            splits["val"] = val.iter_documents()
        shuffle = cfg.shuffle_buffer
        seed = cfg.seed
    else:
        tok = _resolve_tokenizer(DataConfig(), tokenizer)
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
        writer = _ShardWriter(out, _PREFIX[split], dtype, shard_tokens)
        for ids in _encode_stream(tok, docs):
            writer.add(ids)
        split_meta[split] = writer.close()
    if split_meta["train"]["tokens"] == 0:
        raise EmptyCorpusError(f"{description}: no documents to prepare")
    meta = {
        "format": FORMAT_NAME,
        "version": 1,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "bos_id": tok.bos_id},
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
    (out / META_NAME).write_text(json.dumps(meta, indent=2))
    return meta


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared directory (clear error if it is not one)."""
    p = Path(path) / META_NAME
    if not p.is_file():
        raise FileNotFoundError(
            f"{path} is not a prepared memmap directory (no {META_NAME}); create it with "
            "'looplm data prepare --out DIR ...'"
        )
    meta = json.loads(p.read_text())
    if meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{p} is not a looplm memmap description (format={meta.get('format')!r})")
    return meta


class _TokenArray:
    """The shards of one split seen as one long read-only array."""

    def __init__(self, directory: Path, files: list[str], dtype: np.dtype):
        self.parts = []
        for name in files:
            f = directory / name
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {META_NAME} is missing; re-run 'looplm data prepare'")
            if f.stat().st_size:
                self.parts.append(np.memmap(f, dtype=dtype.newbyteorder("<"), mode="r"))
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.size = int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64 (may span shards)."""
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < length:
            part = self.parts[k]
            lo = start + done - int(self.offsets[k])
            n = min(length - done, len(part) - lo)
            out[done:done + n] = part[lo:lo + n]
            done += n
            k += 1
        return out


class MemmapStream(_BatchStream):
    """Batches of non-overlapping ``seq_len`` windows of a prepared directory.

    Args:
        path: the prepared directory.
        seq_len: window length.
        seed: permutation seed; epoch ``e`` visits windows in ``default_rng([seed, e]).permutation``.
        split: ``"train"`` or ``"val"`` files of the directory.
        tokenizer: if given, must match the tokenizer the data was prepared with.
        shuffle: ``False`` = windows in order (validation).
        epochs: ``None`` = forever, ``1`` = one pass.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, *, seed: int = 42, split: str = "train",
                 tokenizer: Tokenizer | None = None, shuffle: bool = True, epochs: int | None = None):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        if split not in self.meta["splits"]:
            raise ValueError(
                f"{self.path} has no {split!r} split (it has {sorted(self.meta['splits'])}); prepare it "
                "with a validation rule (data.val_every_nth / val_first_n) or set data.val_paths"
            )
        tmeta = self.meta["tokenizer"]
        mismatch = tokenizer is not None and (
            tokenizer.vocab_size != tmeta["vocab_size"] or tokenizer.eos_id != tmeta["eos_id"]
        )
        if mismatch:
            raise ValueError(
                f"{self.path} was prepared with tokenizer {tmeta['name']!r} (vocab_size "
                f"{tmeta['vocab_size']}, eos {tmeta['eos_id']}) but the run uses {tokenizer.name!r} "
                f"(vocab_size {tokenizer.vocab_size}, eos {tokenizer.eos_id}); set data.tokenizer to "
                "match or re-prepare"
            )
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.split = split
        self.shuffle = shuffle
        self.epochs = epochs
        info = self.meta["splits"][split]
        self.tokens = _TokenArray(self.path, info["files"], np.dtype(self.meta["dtype"]))
        self.n_windows = self.tokens.size // self.seq_len
        if self.n_windows == 0:
            raise EmptyCorpusError(
                f"{self.path} ({split}) has {self.tokens.size} tokens, fewer than one window of "
                f"seq_len={self.seq_len}"
            )
        self.epoch = 0
        self.position = 0  # windows consumed in this epoch
        self._perm: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._perm[1]

    def next_batch(self, n: int, allow_partial: bool = False) -> torch.Tensor:
        """The next ``n`` windows as ``torch.long`` ``[n, seq_len]`` (``n`` = global batch size)."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        epoch, pos, windows = self.epoch, self.position, []
        while len(windows) < n:
            if pos == self.n_windows:
                if self.epochs is not None and epoch + 1 >= self.epochs:
                    break
                epoch, pos = epoch + 1, 0
            take = min(n - len(windows), self.n_windows - pos)
            windows.extend(self._order(epoch)[pos:pos + take].tolist())
            pos += take
        if len(windows) < n and (not windows or not allow_partial):
            raise StreamExhausted(
                f"the {self.split!r} memmap stream of {self.path} ended ({len(windows)} windows left, {n} asked)"
            )
        self.epoch, self.position = epoch, pos
        rows = np.stack([self.tokens.read(w * self.seq_len, self.seq_len) for w in windows])
        return torch.from_numpy(rows)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "memmap", "split": self.split, "seq_len": self.seq_len,
                "seed": self.seed, "shuffle": self.shuffle, "n_windows": self.n_windows,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "memmap":
            raise ValueError(
                f"this is a {state.get('kind')!r} data state, but the stream reads memmap shards; "
                "resume with the same data.source"
            )
        mine = {k: v for k, v in self.state_dict().items() if k not in ("epoch", "position")}
        diffs = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise ValueError("the data state does not match this memmap stream: " + "; ".join(diffs))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
