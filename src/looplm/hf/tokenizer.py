"""looplm tokenizers <-> ``transformers.PreTrainedTokenizerFast``.

An export saves its tokenizer as a ``PreTrainedTokenizerFast`` (a ``tokenizer.json`` plus
``tokenizer_config.json`` naming that class), which ``AutoTokenizer`` loads with transformers 4.x
and 5.x alike, without custom code. The token ids are the ones the model was trained with:

* the byte tokenizer (ids ``0..255`` = bytes, ``256/257/258`` = EOS/BOS/PAD) becomes a byte-level
  BPE without merges whose vocabulary maps byte ``b`` to id ``b``, plus the three specials. As in
  looplm, text that spells a special token (``"<eos>"``) is encoded as its bytes
  (``split_special_tokens``);
* a ``tokenizers`` fast tokenizer (a ``tokenizer.json``) is saved with its specials named;
* a ``transformers`` fast tokenizer is saved as the source had it — ``save_pretrained`` of the very object,
  so its chat template, special and added tokens, ``model_max_length`` and class survive an import →
  export round trip — with the special tokens looplm uses named (looplm may have picked the EOS itself),
  and without ``auto_map`` (a tokenizer that needs custom code is saved as the generic fast class).
"""

from __future__ import annotations

BYTE_SPECIALS = ("<eos>", "<bos>", "<pad>")
_LOAD_OPTIONS = (
    "is_local",
    "local_files_only",
    "cache_dir",
    "force_download",
    "token",
    "revision",
    "subfolder",
    "_commit_hash",
    "trust_remote_code",
)  # ids 256, 257, 258 (looplm.data.tokenizers.ByteTokenizer)


def byte_backend():
    """A ``tokenizers.Tokenizer`` that encodes exactly like :class:`~looplm.data.tokenizers.ByteTokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()  # byte -> printable char (the byte-level BPE alphabet)
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    assert tok.token_to_id("<eos>") == 256 and tok.token_to_id("<pad>") == 258
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to chars from U+0100 on."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def to_pretrained_tokenizer_fast(tok):
    """A ``transformers.PreTrainedTokenizerFast`` giving the same ids as the looplm tokenizer ``tok``."""
    from transformers import PreTrainedTokenizerFast

    from ..data.tokenizers import ByteTokenizer, HFTokenizer

    if isinstance(tok, ByteTokenizer):
        return PreTrainedTokenizerFast(
            tokenizer_object=byte_backend(),
            eos_token="<eos>",
            bos_token="<bos>",
            pad_token="<pad>",
            split_special_tokens=True,
            clean_up_tokenization_spaces=False,
            model_max_length=1 << 30,
        )
    if isinstance(tok, HFTokenizer):
        backend = tok._tok
        if tok._kind == "transformers":
            backend = getattr(backend, "backend_tokenizer", None) or getattr(backend, "_tokenizer", None)
            if backend is None:
                raise ValueError(
                    f"tokenizer {tok.name!r} is a slow (Python) transformers tokenizer; export needs a fast one"
                )
        inv = {i: t for t, i in tok._vocab().items()}
        specials = {"eos_token": inv.get(tok.eos_id)}
        if tok.bos_id is not None:
            specials["bos_token"] = inv.get(tok.bos_id)
        if tok.pad_id is not None:  # none is invented: the ids (and looplm's tokenizer fingerprint) stay the same
            specials["pad_token"] = inv.get(tok.pad_id)
        return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **specials)
    raise TypeError(
        f"cannot export tokenizer {tok!r}: only the byte tokenizer and Hugging Face tokenizers are supported"
    )


def save_pretrained_tokenizer(tok, out_dir) -> None:
    """Save ``tok`` so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it without custom code under
    transformers 4.x and 5.x, giving looplm's ids (see the module docstring)."""
    import json
    from pathlib import Path

    from ..data.tokenizers import HFTokenizer

    cfg_path = Path(out_dir) / "tokenizer_config.json"
    source = getattr(tok, "_tok", None) if isinstance(tok, HFTokenizer) and tok._kind == "transformers" else None
    if source is not None and getattr(source, "is_fast", False):
        source.save_pretrained(str(out_dir))  # chat template, specials, added tokens: as the source had them
        cfg = json.loads(cfg_path.read_text())
        inv = {i: t for t, i in tok._vocab().items()}
        for key, tid in (("eos_token", tok.eos_id), ("bos_token", tok.bos_id), ("pad_token", tok.pad_id)):
            if tid is not None and inv.get(tid) is not None:
                cfg[key] = inv[tid]
        cfg = portable_config(cfg)
    else:
        fast = to_pretrained_tokenizer_fast(tok)
        fast.save_pretrained(str(out_dir))
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# classes transformers >= 5 writes into tokenizer_config.json that 4.x does not have; the generic fast class
# is the same tokenizer.json read the same way under every version (our pin allows transformers >= 4.46)
_V5_ONLY_CLASSES = ("TokenizersBackend", "PythonBackend", "SentencePieceBackend")


def portable_config(cfg: dict) -> dict:
    """``tokenizer_config.json``'s dict made loadable by every supported transformers version without custom
    code: no ``auto_map``, a ``tokenizer_class`` that transformers 4.x has (transformers 5 records
    ``TokenizersBackend`` for a tokenizer loaded by the generic fast class, which 4.x cannot import), and none
    of the options describing how the source was loaded."""
    cfg = dict(cfg)
    cls = cfg.get("tokenizer_class")
    if cfg.pop("auto_map", None) is not None or not cls or cls in _V5_ONLY_CLASSES:
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in _LOAD_OPTIONS:  # how the source was loaded (transformers 5 saves some), not what it is
        cfg.pop(k, None)
    return cfg


def make_portable(directory) -> None:
    """Rewrite ``directory/tokenizer_config.json`` (when there is one) with :func:`portable_config`."""
    import json
    from pathlib import Path

    path = Path(directory) / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if isinstance(cfg, dict):
            path.write_text(json.dumps(portable_config(cfg), indent=2, ensure_ascii=False) + "\n")


# the JSON files transformers reads from a tokenizer directory (each checked first, naming the file)
_TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def check_tokenizer_dir(src) -> None:
    """Check the tokenizer files of a model directory before transformers reads them, naming the file:

    * ``tokenizer_config.json`` and its siblings are JSON objects (no nesting too deep to parse);
    * no ``auto_map`` entry names tokenizer code (a ``.py`` module): transformers would offer, interactively,
      to run it; looplm never runs a model's own code, so it is refused here (say which entry, which file);
    * ``tokenizer.json`` (a symlink is followed: Hugging Face's cache links into its blob store) exists and is
      a tokenizer the ``tokenizers`` library reads.
    """
    from pathlib import Path

    from .weights import read_json

    src = Path(src)
    for name in _TOKENIZER_JSON:
        if (src / name).is_file():
            read_json(src / name, "tokenizer file")
    cfg_path = src / "tokenizer_config.json"
    auto_map = read_json(cfg_path, "tokenizer file").get("auto_map") if cfg_path.is_file() else None
    if auto_map:
        entries = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
        for key, value in entries:
            for ref in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(ref, str) and ref:
                    module = ref.split("--")[-1].rsplit(".", 1)[0]
                    raise ValueError(
                        f"tokenizer file {str(cfg_path)!r} names custom tokenizer code (auto_map {key}: {ref!r}, the "
                        f"file {str(src / (module.replace('.', '/') + '.py'))!r}); looplm never runs a model's own code. "
                        "If tokenizer.json is all the tokenizer needs, remove auto_map from tokenizer_config.json"
                    )
    tj = src / "tokenizer.json"
    if tj.is_symlink() or tj.exists():
        via = f" (a symlink to {str(tj.resolve())!r})" if tj.is_symlink() else ""
        if not tj.is_file():
            raise FileNotFoundError(f"tokenizer file {str(tj)!r}{via} does not exist or is not a file")
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(tj))
        except Exception as e:  # the tokenizers library's own exception, which names no file
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ValueError(
                f"tokenizer file {str(tj)!r}{via} is not a tokenizer the tokenizers library can read "
                f"({type(e).__name__}: {first}); it is corrupted or not a tokenizer.json"
            ) from e
