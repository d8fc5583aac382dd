"""``looplm.serve.detokenizer`` without a model: incremental UTF-8 and stop strings against whole-text references,
on the byte tokenizer (characters split over tokens) and on a byte-level BPE trained here in memory (tokens of
several characters, a leading space that needs the prompt's context)."""

from __future__ import annotations

import random
import time

import pytest

from looplm.data.tokenizers import ByteTokenizer
from looplm.serve.detokenizer import IncrementalText, StopMatcher, detokenize_prompt

TEXTS = ["plain ascii text, with spaces", "héllo wörld — ünïcode ✓", "emoji 😀🎉 and 中文字符 mixed", "a\nb\n\nc", "x"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (``tokenizers``) trained on a few sentences: multi-character tokens, ``Ġ`` spaces."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXTS * 20 + ["the loop runs again and again, the loop ends"] * 20, trainer)
    assert tokenizers

    class Wrapped:  # looplm's tokenizer interface: encode / decode of a list of ids
        def encode(self, s):
            return tok.encode(s).ids

        def decode(self, ids):
            return tok.decode(list(ids))

    return Wrapped()


def _stream(tok, context, ids, stops=()):
    """Feed ``ids`` one by one; the offsets ``add`` returns and what ``shown()`` gave after each token."""
    it = IncrementalText(tok, context, stops)
    offsets, shown = [], []
    for t in ids:
        offsets.append(it.add(t))
        shown.append(it.shown())
    return it, offsets, shown


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_token_by_token_text_equals_the_whole_decode(kind, bpe):
    tok = ByteTokenizer() if kind == "byte" else bpe
    for prompt in ("", "the loop "):
        ctx = tok.encode(prompt) if prompt else []
        for text in TEXTS:
            ids = tok.encode(text)
            it, offsets, _ = _stream(tok, ctx, ids)
            want = tok.decode(ctx + ids)[len(tok.decode(ctx)) :]
            assert it.finish() == want, (kind, text)
            # each token's offset is where its text begins; the text never shows a partial character
            assert offsets == sorted(offsets) and offsets[0] == 0
            assert "\ufffd" not in it.text
    # a token window much longer than the context window (the window is trimmed as it goes)
    long = " ".join(TEXTS) * 8
    it, _, _ = _stream(tok, [], tok.encode(long))
    assert it.finish() == long


def test_a_partial_character_is_held_back_and_shown_at_finish():
    tok = ByteTokenizer()
    ids = tok.encode("a😀")
    it = IncrementalText(tok)
    for t in ids[:3]:  # 'a' and the first two of the emoji's four bytes
        it.add(t)
    assert it.text == "a" and it.tail  # the partial character waits
    assert it.finish() == "a\ufffd"  # the end of the answer: shown as decoded
    # invalid bytes (a run of four continuation bytes) are not held forever
    it = IncrementalText(tok)
    for t in [0x80, 0x80, 0x80, 0x80, ord("z")]:
        it.add(t)
    assert it.text.endswith("z") and "\ufffd" in it.text


def test_detokenize_prompt_gives_each_tokens_offset():
    tok = ByteTokenizer()
    text, offsets = detokenize_prompt(tok, tok.encode("hé!"))
    assert text == "hé!" and offsets == [0, 1, 1, 2]  # 'é' is two bytes: its second token begins where it does


def _first_stop(text: str, stops: list[str]) -> str:
    """The reference: the text before the stop string that ends first (of those ending there, the longest)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
            best = (i + len(s), -len(s))
    return text if best is None else text[: best[0] + best[1]]


def _held(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])), default=0)


def test_stop_strings_cut_where_the_first_ends_whatever_the_tokens():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for trial in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        it, _, shown = _stream(tok, [], tok.encode(text), stops)
        final = it.finish()
        want = _first_stop(text, stops)
        assert final == want, (text, stops)
        assert it.stopped == (want != text)
        # while streaming, what is shown is a prefix of the final text, holding back exactly a stop's beginning
        for i, s in enumerate(shown):
            assert final.startswith(s), (text, stops, i)
    # a stop string spanning tokens, and one that only appears once a multi-byte character completes
    it, _, _ = _stream(tok, [], tok.encode("one two three"), ["o th", "zz"])
    assert it.stopped and it.text == "one tw"
    it, _, _ = _stream(tok, [], tok.encode("x😀y"), ["😀"])
    assert it.stopped and it.text == "x"


def test_shown_holds_back_the_longest_end_that_begins_a_stop_string():
    tok = ByteTokenizer()
    stops = ["abcab", "bx", "cc"]
    it = IncrementalText(tok, (), stops)
    text = ""
    for ch in "zabcabzabcz":
        it.add(ord(ch))
        text += ch
        if it.stopped:
            break
        assert it.shown() == text[: len(text) - _held(text, stops)], text
    assert it.stopped and it.text == "z"  # "abcab" ended at the 6th character


def test_the_stop_search_looks_at_each_character_once():
    """16 stop strings of 256 characters that almost match all the time: the automaton is fed each character once
    (the old search tried every stop string at every held-back length on every token)."""
    tok = ByteTokenizer()
    stops = ["a" * 255 + chr(ord("b") + i) for i in range(16)]  # each begins with what the text is made of
    it = IncrementalText(tok, (), stops)
    t0 = time.perf_counter()
    for _ in range(20_000):
        it.add(ord("a"))
        it.shown()
    elapsed = time.perf_counter() - t0
    assert not it.stopped and len(it.text) == 20_000
    assert it.matcher.scanned == 20_000  # each character looked at once
    assert it.matcher.held == 255 and it.shown() == "a" * (20_000 - 255)
    assert elapsed < 5.0, elapsed  # (about 0.1 s; the rescanning search took minutes at 10,000 stop strings)


def test_stop_matcher_across_chunks():
    m = StopMatcher(["hello", "lo w", "", "hello"])
    assert m.stops == ["hello", "lo w"]  # empty and repeated ones dropped
    assert m.feed("say hel") is None and m.held == 3
    assert m.feed("lo") == (2, 5)  # "hello" ends after the 2nd character of this chunk
    m = StopMatcher(["abcd", "c"])
    assert m.feed("abcd") == (3, 1)  # "c" ends first
