"""Tokenizers: byte tokenizer, BPE training, loading, vocabulary checks, `looplm tokenizer train`."""

from __future__ import annotations

import argparse
import json

import pytest

from looplm.data.tokenizers import (
    META_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_vocab,
    load_tokenizer,
    train_bpe,
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Looped language models reuse the same block "
    "several times, so depth costs no extra parameters. Recurrence lets a model think longer. "
) * 40 + "Unicode too: naïve café, 東京, emoji 🙂.\n"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "train.txt"
    p.write_text(CORPUS, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def bpe(corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    return train_bpe([corpus_file], 400, out), out


# ----------------------------------------------------------------------------------- byte
def test_byte_tokenizer_round_trip_and_ids():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id) == (259, 256, 257, 258)
    for text in ["", "hello", "naïve café 東京 🙂", "line\nbreak\ttab"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))  # no BOS, no EOS
        assert tok.decode(ids) == text
    # specials are ignored, a cut multi-byte character decodes with a replacement char
    assert tok.decode([256, 104, 105, 257, 258]) == "hi"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"


def test_byte_tokenizer_save_load(tmp_path):
    ByteTokenizer().save(tmp_path)
    assert json.loads((tmp_path / META_FILE).read_text())["type"] == "byte"
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


# ------------------------------------------------------------------------------------ BPE
def test_train_bpe_round_trip(bpe, corpus_file):
    tok, out = bpe
    assert (out / "tokenizer.json").is_file() and (out / META_FILE).is_file()
    assert 258 < tok.vocab_size <= 400
    assert tok.eos_id == 0 and tok.bos_id is None and tok.pad_id == 1  # specials come first
    text = "The lazy fox reuses the block: naïve café 🙂"
    ids = tok.encode(text)
    assert tok.eos_id not in ids  # encode adds no special tokens
    assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS)) < len(CORPUS.encode()) / 2  # merges actually compress
    # both the directory and the tokenizer.json load back to the same tokenizer
    for spec in (str(out), str(out / "tokenizer.json")):
        again = load_tokenizer(spec)
        assert again.encode(text) == ids and again.eos_id == tok.eos_id and again.vocab_size == tok.vocab_size


def test_train_bpe_from_texts(tmp_path):
    tok = train_bpe(None, 300, tmp_path, texts=[CORPUS, "more text here"])
    assert tok.decode(tok.encode("more text")) == "more text"


def test_train_bpe_errors(tmp_path, corpus_file):
    with pytest.raises(ValueError, match="too small"):
        train_bpe([corpus_file], 200, tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        train_bpe([tmp_path / "nope.txt"], 300, tmp_path)
    with pytest.raises(ValueError, match="exactly one"):
        train_bpe(None, 300, tmp_path)


# ----------------------------------------------------------------------------- vocab check
def test_check_vocab():
    check_vocab(ByteTokenizer(), 259)
    check_vocab(ByteTokenizer(), 320)
    with pytest.raises(ValueError, match=r"259 ids but the model's vocab_size is 256.*>= 259"):
        check_vocab(ByteTokenizer(), 256)


# ----------------------------------------------------------------------------- HF / loading
def _tokenizer_without_eos(path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    raw = RawTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "<stop>": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(path))


def test_hf_tokenizer_without_eos_needs_one(tmp_path):
    path = tmp_path / "tokenizer.json"
    _tokenizer_without_eos(path)
    with pytest.raises(ValueError, match="no end-of-text token"):
        load_tokenizer(str(path))
    tok = load_tokenizer(str(path), eos_token="<stop>")
    assert tok.eos_id == 3 and tok.encode("a b a") == [0, 1, 0]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer.from_file(path, eos_token="</s>")


def test_transformers_directory(tmp_path, bpe):
    from transformers import PreTrainedTokenizerFast

    tok, out = bpe
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(tmp_path / "hfdir")
    loaded = load_tokenizer(str(tmp_path / "hfdir"))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.eos_id == tok.eos_id
    assert loaded.encode("the fox") == tok.encode("the fox")  # no BOS although the tokenizer has one
    loaded.save(tmp_path / "again")
    assert load_tokenizer(str(tmp_path / "again")).encode("the fox") == tok.encode("the fox")


def test_load_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    with pytest.raises(ValueError, match="non-empty"):
        load_tokenizer("")
    # a hub name while offline: a clear message, quickly (no minute of retries)
    import looplm.data.tokenizers as T

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(T.HFTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k: offline()))
    with pytest.raises(ValueError, match="Offline\\? Use 'byte'"):
        load_tokenizer("some-org/some-tokenizer")


# ------------------------------------------------------------------------------------- CLI
def _parser():
    from looplm.data.cli import register

    p = argparse.ArgumentParser(prog="looplm")
    register(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_tokenizer_train(tmp_path, corpus_file, capsys):
    args = _parser().parse_args(
        ["tokenizer", "train", "--vocab-size", "320", "--out", str(tmp_path / "tok"), str(corpus_file)]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "vocab size: 320" in out and "bytes/token" in out
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.vocab_size == 320


def test_cli_tokenizer_train_input_errors(tmp_path):
    p = _parser()
    args = p.parse_args(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no input"):
        args.func(args)
    args = p.parse_args(
        ["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path), str(tmp_path / "nothing*.txt")]
    )
    with pytest.raises(SystemExit, match="no files match"):
        args.func(args)
