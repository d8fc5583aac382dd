"""The data pipeline: documents -> shuffle buffer -> tokens + EOS -> packed rows -> batches.

The recipe (as in the recurrence-effectiveness paper)::

    stream documents
      -> shuffle with a buffer of 10,000 documents, seed 42     (ShuffleBuffer)
      -> tokenize each document, NO BOS, one EOS after it       (tokenizer.encode(doc) + [eos])
      -> concatenate and cut into non-overlapping rows of L     (Packer)
      -> batches [n, L]; the incomplete tail is dropped         (TokenStream.next_batch)

A packed row of ``L`` tokens is both the input and the target: the model shifts labels itself.

**Exact resume.** ``TokenStream.state_dict()`` holds everything that decides the future: the source
position (documents consumed), the epoch, the shuffle buffer's contents and RNG state, and the
packer's carried tokens. A stream built fresh from the same config + ``load_state_dict(state)``
produces exactly the batches the saved stream would have produced next. The state is plain JSON
(the trainer stores it with the checkpoint). It also records the tokenizer's fingerprint (a hash of
its vocabulary, :func:`~looplm.data.tokenizers.tokenizer_fingerprint`): a tokenizer replaced at the
same path is refused instead of silently producing other token ids.

**Distributed training.** Every rank builds the *same global* stream and calls
``next_batch(global_batch_size)``; each rank keeps its own rows (:func:`shard_batch`). All ranks
tokenize all documents (cheap next to the model), in exchange 2 processes see exactly the batches
1 process sees, and a run can resume on a different world size: the state is global.

Validation (``build_stream(cfg, tok, split="val")``) is deterministic: the held-out documents in
source order, no shuffling, one pass (:func:`iter_val_batches`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .config import DataConfig
from .memmap import MemmapStream
from .sources import DocumentSource, EmptyCorpusError, make_source
from .stream import (
    STATE_VERSION,
    BatchStream,
    StreamExhausted,
    check_config,
    resolve_tokenizer,
    rng_state_from_json,
    rng_state_to_json,
)
from .tokenizers import Tokenizer, check_tokenizer_fingerprint, tokenizer_fingerprint


# ------------------------------------------------------------------------------ shuffle buffer
class ShuffleBuffer:
    """Reservoir-style shuffle buffer over a stream of items (documents).

    Fill the buffer up to ``size`` items; after that, every new item replaces a uniformly chosen
    buffered item, which is emitted. At the end of the stream, :meth:`pop` drains the rest in random
    order. ``size <= 1`` passes items straight through. Items must not be ``None``.

    The state (buffer contents + ``random.Random`` state) is JSON-serialisable and restores exactly.
    """

    def __init__(self, size: int, seed: int):
        if size < 0:
            raise ValueError(f"shuffle buffer size must be >= 0, got {size}")
        self.size = int(size)
        self.seed = int(seed)
        self.items: list[Any] = []
        self.rng = random.Random(self.seed)

    def __len__(self) -> int:
        return len(self.items)

    def push(self, item: Any) -> Any | None:
        """Add ``item``; return an item to emit (``None`` while the buffer is still filling)."""
        if self.size <= 1:
            return item
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        i = self.rng.randrange(self.size)
        out, self.items[i] = self.items[i], item
        return out

    def pop(self) -> Any:
        """Remove and return a random buffered item (draining at the end of the stream)."""
        if not self.items:
            raise IndexError("pop from an empty ShuffleBuffer")
        i = self.rng.randrange(len(self.items))
        self.items[i], self.items[-1] = self.items[-1], self.items[i]
        return self.items.pop()

    def shuffle(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Convenience: the whole shuffled stream of ``iterable`` (fill, emit, drain)."""
        for item in iterable:
            out = self.push(item)
            if out is not None:
                yield out
        while self.items:
            yield self.pop()

    def state_dict(self) -> dict:
        return {
            "size": self.size,
            "seed": self.seed,
            "items": list(self.items),
            "rng": rng_state_to_json(self.rng.getstate()),
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise ValueError(
                f"saved shuffle buffer has size {state['size']} but this stream uses {self.size}; "
                "resume with the same data.shuffle_buffer"
            )
        self.items = list(state["items"])
        self.rng.setstate(rng_state_from_json(state["rng"]))


# -------------------------------------------------------------------------------------- packer
class Packer:
    """Concatenates documents (tokens + EOS, no BOS) and cuts rows of ``seq_len`` tokens.

    Tokens that do not fill a row yet are carried over to the next documents (and are part of the
    state). Rows never overlap; whatever is left when the data ends is dropped.
    """

    def __init__(self, seq_len: int, eos_id: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = int(seq_len)
        self.eos_id = int(eos_id)
        self.buffer: list[int] = []

    def add_document(self, tokens: Iterable[int]) -> None:
        """Append one document's tokens followed by EOS."""
        self.buffer.extend(tokens)
        self.buffer.append(self.eos_id)

    def rows_ready(self) -> int:
        """How many full rows can be taken now."""
        return len(self.buffer) // self.seq_len

    def take(self, n: int) -> list[int]:
        """Remove ``n`` full rows; return their ``n * seq_len`` tokens, row after row."""
        if n > self.rows_ready():
            raise ValueError(f"only {self.rows_ready()} full rows are ready, asked for {n}")
        k = n * self.seq_len
        out = self.buffer[:k]
        del self.buffer[:k]
        return out

    def state_dict(self) -> dict:
        return {"seq_len": self.seq_len, "eos_id": self.eos_id, "carry": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seq_len"]) != self.seq_len or int(state["eos_id"]) != self.eos_id:
            raise ValueError(
                f"saved packer has seq_len={state['seq_len']}, eos_id={state['eos_id']} but this "
                f"stream has seq_len={self.seq_len}, eos_id={self.eos_id}; resume with the same "
                "data.seq_len and tokenizer"
            )
        self.buffer = [int(t) for t in state["carry"]]


def pack_documents(docs_tokens: Iterable[list[int]], seq_len: int, eos_id: int) -> list[list[int]]:
    """Pack whole token lists (one per document) into rows; the incomplete tail is dropped."""
    p = Packer(seq_len, eos_id)
    for toks in docs_tokens:
        p.add_document(toks)
    flat = p.take(p.rows_ready())
    return [flat[i : i + seq_len] for i in range(0, len(flat), seq_len)]


# ----------------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class Selection:
    """Which documents of a source (by raw index ``i``) a split uses.

    ``rule``: ``"all"``, ``"every_nth"`` (index ``i`` is held out when ``(i + 1) % n == 0``) or
    ``"first_n"`` (indices ``< n`` are held out). ``role`` ``"val"`` takes the held-out documents,
    ``"train"`` the others.
    """

    rule: str = "all"
    n: int = 0
    role: str = "train"

    @property
    def start(self) -> int:
        return self.n if (self.rule == "first_n" and self.role == "train") else 0

    @property
    def stop(self) -> int | None:
        return self.n if (self.rule == "first_n" and self.role == "val") else None

    def keep(self, i: int) -> bool:
        if self.rule == "every_nth":
            held = (i + 1) % self.n == 0
            return held if self.role == "val" else not held
        return True

    def to_json(self) -> list:
        return [self.rule, self.n, self.role]


# -------------------------------------------------------------------------------------- stream
class TokenStream(BatchStream):
    """Packed token batches from a document source, with exact resume.

    Args:
        source: the documents.
        tokenizer: turns a document into ids (``encode``) and gives ``eos_id``.
        seq_len: tokens per row.
        shuffle_buffer, seed: the document shuffle (0 or 1 = source order).
        selection: which documents of the source to use (train / held-out validation).
        epochs: ``None`` = repeat forever (training; each epoch re-reads the source and the shuffle
            continues with the same RNG), ``1`` = a single pass (validation, ``prepare``).
        split: a label stored in the state (``"train"`` / ``"val"``).
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        shuffle_buffer: int = 10000,
        seed: int = 42,
        selection: Selection | None = None,
        epochs: int | None = None,
        split: str = "train",
    ):
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (forever), got {epochs}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.selection = selection or Selection()
        self.epochs = epochs
        self.split = split
        self.shuffle = ShuffleBuffer(shuffle_buffer, seed)
        self.packer = Packer(seq_len, tokenizer.eos_id)
        self.epoch = 0
        self.position = self.selection.start  # raw documents consumed from the source this epoch
        self.source_done = False
        self.docs_in_epoch = 0  # documents kept (non-empty, selected) this epoch
        self.rows_emitted = 0
        self._live: Iterator[str] | None = None  # the open source iterator, at self.position

    # -------------------------------------------------------------- documents
    def _read_raw(self) -> str | None:
        stop = self.selection.stop
        if stop is not None and self.position >= stop:
            return None
        if self._live is None:
            self._live = self.source.iter_from(self.position)
        doc = next(self._live, None)
        if doc is not None:
            self.position += 1
        return doc

    def _next_document(self) -> str | None:
        """The next document after selection and shuffling; ``None`` when a finite stream ends."""
        while True:
            if not self.source_done:
                index = self.position
                doc = self._read_raw()
                if doc is None:
                    self.source_done = True
                    self._live = None
                    continue
                if not self.selection.keep(index) or not doc.strip():
                    continue
                self.docs_in_epoch += 1
                out = self.shuffle.push(doc)
                if out is not None:
                    return out
                continue
            if len(self.shuffle):
                return self.shuffle.pop()
            # end of an epoch
            if self.docs_in_epoch == 0:
                raise EmptyCorpusError(
                    f"{self.source.description}: no non-empty documents in the {self.split!r} split "
                    f"(selection {self.selection.rule}); check the paths / text_field / max_docs"
                    + (
                        ". A corpus of few large documents (e.g. one .txt file) has no held-out documents: split "
                        "it with data.split_mode=blank_lines (or lines), or give data.val_paths, or set data.val_every_nth=0"
                        if self.split == "val"
                        else ""
                    )
                )
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                return None
            self.epoch += 1
            self.position = self.selection.start
            self.source_done = False
            self.docs_in_epoch = 0

    def iter_documents(self) -> Iterator[str]:
        """The remaining documents in stream order (forever for ``epochs=None``)."""
        while (doc := self._next_document()) is not None:
            yield doc

    # -------------------------------------------------------------- batches
    def next_batch(self, n: int, allow_partial: bool = False) -> torch.Tensor:
        """The next ``n`` packed rows as a ``torch.long`` tensor ``[n, seq_len]``.

        In distributed training ``n`` is the *global* batch size (see :func:`shard_batch`).
        A finite stream raises :class:`StreamExhausted` when fewer than ``n`` rows are left
        (with ``allow_partial=True`` it returns the remaining rows first).
        """
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        while self.packer.rows_ready() < n:
            doc = self._next_document()
            if doc is None:
                left = self.packer.rows_ready()
                if left == 0 or not allow_partial:
                    raise StreamExhausted(
                        f"the {self.split!r} stream of {self.source.description} ended "
                        f"({left} full rows of {self.seq_len} tokens left, {n} asked)"
                    )
                n = left
                break
            self.packer.add_document(self.tokenizer.encode(doc))
        flat = self.packer.take(n)
        self.rows_emitted += n
        return torch.tensor(flat, dtype=torch.long).view(n, self.seq_len)

    # -------------------------------------------------------------- state
    def _fingerprint(self) -> dict:
        tok = self.tokenizer
        return {
            "split": self.split,
            "seq_len": self.seq_len,
            "selection": self.selection.to_json(),
            "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        }

    def state_dict(self) -> dict:
        """A JSON-serialisable snapshot; :meth:`load_state_dict` on a fresh stream resumes exactly."""
        return {
            "version": STATE_VERSION,
            "kind": "tokens",
            **self._fingerprint(),
            "source": self.source.description,
            "source_key": self.source.key,
            "epoch": self.epoch,
            "position": self.position,
            "source_done": self.source_done,
            "docs_in_epoch": self.docs_in_epoch,
            "rows_emitted": self.rows_emitted,
            "shuffle": self.shuffle.state_dict(),
            "packer": self.packer.state_dict(),
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. The stream must be built from the same config."""
        if state.get("kind") != "tokens":
            raise ValueError(
                f"this is a {state.get('kind')!r} data state, but the stream reads documents; "
                "resume with the same data.source"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported data state version {state.get('version')} (expected {STATE_VERSION})")
        # states written before fingerprints were recorded carry none: nothing to compare
        check_tokenizer_fingerprint(
            self.tokenizer,
            state.get("tokenizer_fingerprint"),
            "the saved data state",
            fix="use the tokenizer the state was saved with",
        )
        mine = self._fingerprint()
        theirs = {k: state.get(k) for k in mine}
        theirs["selection"] = list(theirs["selection"] or [])
        if theirs != mine:
            diffs = [f"{k}: saved {theirs[k]!r}, now {mine[k]!r}" for k in mine if theirs[k] != mine[k]]
            raise ValueError("the data state does not match this stream: " + "; ".join(diffs))
        if state.get("source_key") != self.source.key:
            raise ValueError(
                f"the data state was saved for source {state.get('source')!r} but this stream reads "
                f"{self.source.description!r}; the saved position would point at other documents. "
                "Resume with the same files (same names, same order)."
            )
        self.shuffle.load_state_dict(state["shuffle"])
        self.packer.load_state_dict(state["packer"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.source_done = bool(state["source_done"])
        self.docs_in_epoch = int(state["docs_in_epoch"])
        self.rows_emitted = int(state["rows_emitted"])
        self._live = None  # reopened at the restored position on the next read


# ------------------------------------------------------------------------------------ building
def selection_for(cfg: DataConfig, split: str) -> Selection:
    """The :class:`Selection` of ``split`` within ``cfg``'s source (hold-out rules only)."""
    rule, n = cfg.holdout()
    if rule in ("every_nth", "first_n"):
        return Selection(rule, n, split)
    return Selection()  # separate val files / hub split / no validation: train reads everything


def build_stream(
    cfg: DataConfig, tokenizer: Tokenizer | str | None = None, split: str = "train", *, epochs: int | None = None
):
    """The batch stream of ``split`` ("train" or "val") for ``cfg``.

    ``tokenizer``: a tokenizer, a spec for :func:`load_tokenizer`, or ``None`` (= ``cfg.tokenizer``).
    Train streams repeat forever (``epochs=None``) and shuffle; val streams make one pass in source
    order. Memmap sources (``source: memmap`` / ``format: memmap``) give a
    :class:`~looplm.data.memmap.MemmapStream` with the same interface.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    check_config(cfg)
    tok = resolve_tokenizer(cfg, tokenizer)
    rule, n = cfg.holdout()
    if split == "val" and rule == "none":
        raise ValueError(
            "no validation split is configured (val_every_nth: 0 and no val_paths); set "
            "data.val_every_nth, data.val_first_n or data.val_paths"
        )
    if cfg.kind == "memmap":
        if split == "train":
            return MemmapStream(cfg.paths[0], cfg.seq_len, seed=cfg.seed, split="train", tokenizer=tok, epochs=epochs)
        if rule == "paths":
            return MemmapStream(
                cfg.val_paths[0], cfg.seq_len, seed=cfg.seed, split="train", tokenizer=tok, shuffle=False, epochs=1
            )
        return MemmapStream(
            cfg.paths[0], cfg.seq_len, seed=cfg.seed, split="val", tokenizer=tok, shuffle=False, epochs=1
        )
    source = make_source(cfg, split)
    selection = selection_for(cfg, split)
    if split == "val":
        return TokenStream(
            source, tok, cfg.seq_len, shuffle_buffer=0, seed=cfg.seed, selection=selection, epochs=1, split="val"
        )
    return TokenStream(
        source,
        tok,
        cfg.seq_len,
        shuffle_buffer=cfg.shuffle_buffer,
        seed=cfg.seed,
        selection=selection,
        epochs=epochs,
        split="train",
    )


def iter_val_batches(
    cfg: DataConfig, tokenizer: Tokenizer | str | None, n_batches: int | None, batch_size: int
) -> Iterator[torch.Tensor]:
    """Fresh, deterministic validation batches ``[<=batch_size, seq_len]``: the same every call.

    Stops after ``n_batches`` (``None`` = the whole validation split); the last batch may be smaller.
    """
    return build_stream(cfg, tokenizer, split="val").iter_batches(n_batches, batch_size)


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous rows of a global batch ``[B, L]`` -> ``[B // world_size, L]``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    b = batch.shape[0]
    if b % world_size:
        raise ValueError(
            f"global batch of {b} rows does not split evenly over {world_size} ranks; "
            "make the global batch size a multiple of the world size"
        )
    per = b // world_size
    return batch[rank * per : (rank + 1) * per]
