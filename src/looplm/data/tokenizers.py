"""Tokenizers: a small protocol, a file-free byte tokenizer, a Hugging Face wrapper, BPE training.

Every tokenizer in looplm follows :class:`Tokenizer`::

    encode(text) -> list[int]      # never adds BOS/EOS: the data pipeline appends EOS itself
    decode(ids) -> str             # special tokens are dropped
    vocab_size: int                # number of ids (the model's embedding needs at least this many)
    eos_id: int                    # appended after every document
    bos_id: int | None             # not used by the training recipe (no BOS), kept for decoding
    pad_id: int | None
    name: str                      # what load_tokenizer() was given: "byte", a path, a hub name
    save(dir)                      # write files so that load_tokenizer(dir) gives it back
    fingerprint() -> str           # optional: a hash of the vocabulary (see tokenizer_fingerprint)

:func:`load_tokenizer` turns a spec string into a tokenizer; :func:`train_bpe` trains a byte-level
BPE with the ``tokenizers`` library; :func:`check_vocab` compares a tokenizer with a model.

**Fingerprints.** A checkpoint and a data-stream state record the tokenizer by its spec (a path,
say) *and* by :func:`tokenizer_fingerprint`: a SHA-256 of its vocabulary (every token string with
its id, added tokens included) and its special-token ids. It does not depend on file layout,
library version or dictionary order, so it changes only when the token ids would. Resuming,
evaluating or decoding with a tokenizer whose fingerprint differs from the recorded one fails
(:func:`check_tokenizer_fingerprint`): a tokenizer replaced at the same path with the same
vocabulary size would otherwise give garbage silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

META_FILE = "looplm_tokenizer.json"  # our small side file: tokenizer type + names of special tokens
# Names of end-of-text tokens we recognise when a tokenizer does not declare its EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[EOS]", "<|im_end|>")
DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")  # train_bpe: first = EOS, "<|pad|>" = pad


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the decoders need from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


class TokenizerMismatchError(ValueError):
    """A tokenizer is not the one a checkpoint / data state / memmap directory was made with."""


def _vocabulary_digest(vocab: dict[str, int], eos_id: int, bos_id: int | None, pad_id: int | None) -> str:
    """``sha256:<16 hex>`` of the vocabulary (sorted by id) and the special ids: deterministic."""
    canonical = json.dumps(
        {"vocab": sorted(([i, t] for t, i in vocab.items())), "eos_id": eos_id, "bos_id": bos_id, "pad_id": pad_id},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------- bytes
class ByteTokenizer:
    """UTF-8 bytes as tokens; needs no files.

    Ids ``0..255`` are the bytes, then three specials: ``256`` = EOS, ``257`` = BOS, ``258`` = PAD,
    so ``vocab_size == 259``. ``decode`` drops the specials and decodes with ``errors="replace"``
    (a sequence cut inside a multi-byte character still decodes).
    """

    EOS, BOS, PAD = 256, 257, 258

    def __init__(self) -> None:
        self.name = "byte"
        self.vocab_size = 259
        self.eos_id = self.EOS
        self.bos_id: int | None = self.BOS
        self.pad_id: int | None = self.PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / META_FILE).write_text(json.dumps({"type": "byte", "vocab_size": self.vocab_size}, indent=2))

    def fingerprint(self) -> str:
        """The hash of the 256 byte ids and the three specials (the same for every ``ByteTokenizer``)."""
        vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<eos>": self.EOS, "<bos>": self.BOS, "<pad>": self.PAD}
        return _vocabulary_digest(vocab, self.eos_id, self.bos_id, self.pad_id)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, eos=256, bos=257, pad=258)"


# ------------------------------------------------------------------------------- hugging face
class HFTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` (a ``tokenizer.json``) or a ``transformers`` tokenizer.

    Build it with :meth:`from_file` (a ``tokenizer.json``) or :meth:`from_pretrained` (a local
    directory, or a hub name when online). ``encode`` never adds special tokens (no BOS).

    The EOS id is, in order: the ``eos_token`` argument, the EOS named in our
    ``looplm_tokenizer.json``, the tokenizer's own ``eos_token``, the first of
    :data:`EOS_CANDIDATES` present in the vocabulary. If none exists, a ``ValueError`` asks for one.
    """

    def __init__(
        self,
        backend,
        name: str,
        *,
        kind: str,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ):
        self._tok = backend
        self._kind = kind  # "tokenizers" | "transformers"
        self.name = name
        if kind == "tokenizers":
            vocab = backend.get_vocab(with_added_tokens=True)
            declared_eos = declared_bos = declared_pad = None
        else:
            vocab = backend.get_vocab()
            declared_eos, declared_bos, declared_pad = backend.eos_token, backend.bos_token, backend.pad_token
        self.vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1)
        eos = eos_token or declared_eos or next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ValueError(
                f"tokenizer {name!r} has no end-of-text token and none was given: pass "
                f"eos_token=... (one of its special tokens), or add one of {list(EOS_CANDIDATES)}"
            )
        if eos not in vocab:
            raise ValueError(f"eos token {eos!r} is not in the vocabulary of tokenizer {name!r}")
        self.eos_id: int = vocab[eos]
        self.eos_token = eos
        bos = bos_token or declared_bos
        pad = pad_token or declared_pad
        self.bos_id: int | None = vocab.get(bos) if bos else None
        self.pad_id: int | None = vocab.get(pad) if pad else None

    # -------------------------------------------------------------- constructors
    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_token: str | None = None) -> HFTokenizer:
        """Load a ``tokenizer.json`` (our meta file next to it, if any, names the specials)."""
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        try:
            backend = _Tok.from_file(str(path))
        except Exception as e:
            raise ValueError(f"could not read tokenizer file {str(path)!r}: {e}") from e
        meta = _read_meta(path.parent)
        return cls(
            backend,
            str(path),
            kind="tokenizers",
            eos_token=eos_token or meta.get("eos_token"),
            bos_token=meta.get("bos_token"),
            pad_token=meta.get("pad_token"),
        )

    @classmethod
    def from_pretrained(cls, name_or_dir: str, eos_token: str | None = None, **kwargs) -> HFTokenizer:
        """``transformers.AutoTokenizer.from_pretrained`` on a local directory or a hub name."""
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(
                f"loading tokenizer {name_or_dir!r} needs the 'transformers' package: "
                "pip install 'looplm[hf]' (or use a tokenizer.json file / 'byte')"
            ) from e
        backend = AutoTokenizer.from_pretrained(name_or_dir, **kwargs)
        return cls(backend, name_or_dir, kind="transformers", eos_token=eos_token)

    # -------------------------------------------------------------- protocol
    def encode(self, text: str) -> list[int]:
        if self._kind == "tokenizers":
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (parallel in the Rust backend)."""
        if self._kind == "tokenizers":
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self._kind == "tokenizers":
            self._tok.save(str(d / "tokenizer.json"))
        else:
            self._tok.save_pretrained(str(d))
        inv = {i: t for t, i in self._vocab().items()}
        meta = {
            "type": "bpe" if self._kind == "tokenizers" else "transformers",
            "vocab_size": self.vocab_size,
            "eos_token": self.eos_token,
            "bos_token": inv.get(self.bos_id) if self.bos_id is not None else None,
            "pad_token": inv.get(self.pad_id) if self.pad_id is not None else None,
        }
        (d / META_FILE).write_text(json.dumps(meta, indent=2))

    def _vocab(self) -> dict[str, int]:
        if self._kind == "tokenizers":
            return self._tok.get_vocab(with_added_tokens=True)
        return self._tok.get_vocab()

    def fingerprint(self) -> str:
        """The hash of the vocabulary and the special ids (computed once, then cached)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = _vocabulary_digest(self._vocab(), self.eos_id, self.bos_id, self.pad_id)
        return self._fingerprint

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def _read_meta(directory: Path) -> dict:
    p = Path(directory) / META_FILE
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON ({e}); delete it or re-save the tokenizer") from e


# ------------------------------------------------------------------------------------ loading
def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """Turn a spec into a tokenizer.

    * ``"byte"`` -> :class:`ByteTokenizer`;
    * a path to a ``tokenizer.json`` -> :class:`HFTokenizer` via ``tokenizers``;
    * a directory: written by :meth:`save` / :func:`train_bpe` (our meta file), or any directory
      ``transformers.AutoTokenizer`` can load;
    * anything else is taken as a hub name (needs network and ``transformers``).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer spec must be a non-empty string ('byte', a path, a hub name), got {spec!r}")
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        if path.name == META_FILE:
            path = path.parent
        else:
            return HFTokenizer.from_file(path, eos_token=eos_token)
    if path.is_dir():
        meta = _read_meta(path)
        if meta.get("type") == "byte":
            return ByteTokenizer()
        has_json = (path / "tokenizer.json").is_file()
        saved_by_transformers = meta.get("type") == "transformers" or (
            not meta and (path / "tokenizer_config.json").is_file()
        )
        if has_json and not (saved_by_transformers and _has_transformers()):
            return HFTokenizer.from_file(path / "tokenizer.json", eos_token=eos_token)
        return HFTokenizer.from_pretrained(str(path), eos_token=eos_token)
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise FileNotFoundError(f"tokenizer file or directory {spec!r} does not exist")
    try:
        if not hub_reachable():  # offline: only a copy in the local Hugging Face cache can work
            return HFTokenizer.from_pretrained(spec, eos_token=eos_token, local_files_only=True)
        return HFTokenizer.from_pretrained(spec, eos_token=eos_token)
    except ImportError:
        raise
    except ValueError as e:
        if "end-of-text" in str(e):
            raise
        raise _hub_error(spec, e) from e
    except Exception as e:  # network errors, repository not found, ...
        raise _hub_error(spec, e) from e


_HUB_REACHABLE: dict[str, bool] = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (cached for the process).

    Without this check an offline machine spends a minute in ``huggingface_hub`` retries before
    failing. ``HF_HUB_OFFLINE=1`` means unreachable; with an HTTP(S) proxy configured we cannot
    tell and answer ``True``.
    """
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if host not in _HUB_REACHABLE:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _HUB_REACHABLE[host] = True
        except OSError:
            _HUB_REACHABLE[host] = False
    return _HUB_REACHABLE[host]


def _hub_error(spec: str, e: Exception) -> ValueError:
    return ValueError(
        f"could not load tokenizer {spec!r}: it is not a local file or directory, and loading it "
        f"as a Hugging Face hub name failed ({type(e).__name__}: {str(e)[:300]}). Offline? Use "
        "'byte', a path to a tokenizer.json, a local tokenizer directory, or train one with "
        "'looplm tokenizer train'."
    )


# ----------------------------------------------------------------------------------- training
MAX_BPE_VOCAB = 1 << 21  # train_bpe's vocab_size: 2,097,152 ids


def train_bpe(
    files: Sequence[str | os.PathLike] | None,
    vocab_size: int,
    out_dir: str | os.PathLike,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    *,
    texts: Iterable[str] | None = None,
    min_frequency: int = 2,
) -> HFTokenizer:
    """Train a byte-level BPE tokenizer and save it to ``out_dir``.

    Args:
        files: plain-text files to train on (read line by line by ``tokenizers``); or ``None`` and
            pass ``texts`` (an iterable of documents, e.g. a document source).
        vocab_size: total size including the 256 byte symbols and the special tokens.
        out_dir: gets ``tokenizer.json`` and ``looplm_tokenizer.json`` (names of the specials).
        special_tokens: the first one is the EOS; ``"<|pad|>"``, if present, is the pad token.
        min_frequency: merges must occur at least this often.

    Returns the trained tokenizer (``load_tokenizer(out_dir)`` loads it again).
    """
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    special_tokens = list(special_tokens)
    if not special_tokens:
        raise ValueError("special_tokens must contain at least the end-of-text token")
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte symbols + "
            f"{len(special_tokens)} special tokens = {minimum} at least"
        )
    if vocab_size > MAX_BPE_VOCAB:  # the trainer allocates per id up front: a typo of a few zeros aborts the process
        raise ValueError(
            f"vocab_size={vocab_size} is too large: at most {MAX_BPE_VOCAB:,} (large LM vocabularies are ~32k-262k)"
        )
    if not 0 <= min_frequency < 2**32:  # the trainer takes a u32 (OverflowError past it)
        raise ValueError(f"min_frequency={min_frequency}: must be in [0, 2**32) (merges rarer than it are not learned)")
    if (files is None) == (texts is None):
        raise ValueError("train_bpe needs exactly one of files=[...] or texts=...")

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if files is not None:
        paths = [str(f) for f in files]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"train_bpe: no such file(s): {missing[:5]}")
        if not paths:
            raise ValueError("train_bpe: the list of files is empty")
        tok.train(paths, trainer)
    else:
        tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() <= minimum:
        raise ValueError("train_bpe learnt no merges: the training text is empty or too small")
    out = HFTokenizer(
        tok,
        str(out_dir),
        kind="tokenizers",
        eos_token=special_tokens[0],
        pad_token="<|pad|>" if "<|pad|>" in special_tokens else None,
    )
    out.save(out_dir)
    return out


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str | None:
    """``tokenizer.fingerprint()``: ``"sha256:<16 hex digits>"`` of its vocabulary and special ids.

    ``None`` for a tokenizer object without a ``fingerprint`` method (nothing can be checked).
    """
    fingerprint = getattr(tokenizer, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def check_tokenizer_fingerprint(tokenizer: Tokenizer, recorded: str | None, what: str, fix: str) -> str | None:
    """Compare ``tokenizer`` with the fingerprint ``recorded`` by ``what`` (a checkpoint, a data state).

    Raises :class:`TokenizerMismatchError` naming both fingerprints and the tokenizer's path when
    they differ; ``fix`` says what to do instead. Returns a warning message when ``what`` recorded
    no fingerprint (written by an older looplm) and the tokenizer has files that could have been
    replaced, else ``None``.
    """
    current = tokenizer_fingerprint(tokenizer)
    if recorded is None:
        if tokenizer.name == "byte" or current is None:  # built in: nothing at a path to replace
            return None
        return (
            f"{what} records no tokenizer fingerprint (written by an older looplm), so it cannot be checked that "
            f"the tokenizer at {tokenizer.name!r} is the one it was made with"
        )
    if current is not None and current != recorded:
        raise TokenizerMismatchError(
            f"the tokenizer at {tokenizer.name!r} has fingerprint {current}, but {what} was made with a tokenizer "
            f"of fingerprint {recorded}: the tokenizer files were replaced or changed (same vocabulary size or not, "
            f"the token ids differ). Restore the original tokenizer, or {fix}."
        )
    return None


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise ``ValueError`` if ``tokenizer`` produces ids the model's embedding cannot hold."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the model's vocab_size "
            f"is {model_vocab_size}: ids >= {model_vocab_size} would index past the embedding. Set "
            f"model.vocab_size >= {tokenizer.vocab_size} (a multiple of 64 is efficient, e.g. "
            f"{-(-tokenizer.vocab_size // 64) * 64}) or use a smaller tokenizer."
        )
