"""Pre-tokenized memmap shards: :class:`MemmapStream` samples them (:mod:`looplm.data.prepare`
writes them with ``prepare_memmap`` / ``looplm data prepare``).

Layout of a prepared directory::

    meta.json            tokenizer (name, vocab_size, eos_id, fingerprint), dtype, per-split files/tokens/docs
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
from pathlib import Path

import numpy as np
import torch

from .sources import DataError, EmptyCorpusError
from .stream import STATE_VERSION, BatchStream, StreamExhausted
from .tokenizers import Tokenizer, check_tokenizer_fingerprint

META_NAME = "meta.json"
FORMAT_NAME = "looplm-memmap"
SHARD_PREFIX = {"train": "tokens", "val": "val"}  # file names: <prefix>-00000.bin, ...


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared directory (clear error if it is not one)."""
    p = Path(path) / META_NAME
    if not p.is_file():
        raise FileNotFoundError(
            f"{path} is not a prepared memmap directory (no {META_NAME}); create it with "
            "'looplm data prepare --out DIR ...'"
        )
    try:
        meta = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise DataError(f"{p} is not valid JSON ({e}); re-run 'looplm data prepare --overwrite'") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{p} is not a looplm memmap description (format={got!r})")
    _check_meta(meta, Path(path), p)
    return meta


def _check_meta(meta: dict, directory: Path, where: Path) -> None:
    """The entries :class:`MemmapStream` reads, each of the right kind; every shard a file inside
    ``directory``: an absolute path, a ``..`` or a symbolic link leading out of it is refused, so a
    ``meta.json`` can never make training read a file elsewhere on the machine."""
    fix = "re-run 'looplm data prepare --overwrite'"
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict) or not all(
        isinstance(tok.get(k), int) and not isinstance(tok.get(k), bool) for k in ("vocab_size", "eos_id")
    ):
        raise DataError(f"{where}: 'tokenizer' must record the integers vocab_size and eos_id, got {tok!r}; {fix}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise DataError(f"{where}: 'dtype' must be 'uint16' or 'uint32', got {meta.get('dtype')!r}; {fix}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise DataError(f"{where}: 'splits' must map split names to their shards, got {splits!r}; {fix}")
    root = directory.resolve()
    for split, info in splits.items():
        files = info.get("files") if isinstance(info, dict) else None
        if not isinstance(files, list):
            raise DataError(f"{where}: splits.{split}.files must be a list of shard file names, got {files!r}; {fix}")
        for name in files:
            entry = f"splits.{split}.files entry {name!r}"
            if not isinstance(name, str) or not name:
                raise DataError(f"{where}: {entry} is not a file name; {fix}")
            if Path(name).is_absolute():
                raise DataError(
                    f"{where}: {entry} is an absolute path: shards are read from inside {directory} only; {fix}"
                )
            target = (directory / name).resolve()
            if not target.is_relative_to(root):
                how = "a symbolic link" if ".." not in Path(name).parts else "a '..' path"
                raise DataError(
                    f"{where}: {entry} is {how} leading out of {directory} (to {target}): shards are read "
                    f"from inside it only; {fix}"
                )


class _TokenArray:
    """The shards of one split seen as one long read-only array."""

    def __init__(self, directory: Path, files: list[str], dtype: np.dtype):
        self.parts = []
        for name in files:
            f = directory / name
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {META_NAME} is missing; re-run 'looplm data prepare'")
            size = f.stat().st_size
            if size % dtype.itemsize:
                raise DataError(
                    f"shard {f} listed in {META_NAME} has {size} bytes, not a whole number of {dtype.name} "
                    "tokens (truncated?); re-run 'looplm data prepare --overwrite'"
                )
            if size:
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
            out[done : done + n] = part[lo : lo + n]
            done += n
            k += 1
        return out


class MemmapStream(BatchStream):
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

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        *,
        seed: int = 42,
        split: str = "train",
        tokenizer: Tokenizer | None = None,
        shuffle: bool = True,
        epochs: int | None = None,
    ):
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
        if tokenizer is not None:  # directories prepared before fingerprints were recorded carry none
            check_tokenizer_fingerprint(
                tokenizer,
                tmeta.get("fingerprint"),
                f"the memmap directory {str(self.path)!r}",
                fix="re-prepare the directory with this tokenizer",
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
                f"{self.path} ({split}) has {self.tokens.size} tokens, fewer than one window of seq_len={self.seq_len}"
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
            windows.extend(self._order(epoch)[pos : pos + take].tolist())
            pos += take
        if len(windows) < n and (not windows or not allow_partial):
            raise StreamExhausted(
                f"the {self.split!r} memmap stream of {self.path} ended ({len(windows)} windows left, {n} asked)"
            )
        self.epoch, self.position = epoch, pos
        rows = np.stack([self.tokens.read(w * self.seq_len, self.seq_len) for w in windows])
        return torch.from_numpy(rows)

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": "memmap",
            "split": self.split,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "n_windows": self.n_windows,
            "epoch": self.epoch,
            "position": self.position,
        }

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
