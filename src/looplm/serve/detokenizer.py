"""Generated tokens into text, one token at a time: incremental UTF-8 and stop strings (no torch, no model).

:class:`IncrementalText` is one choice's text: each token costs one short decode of a window of the last
tokens, a character whose bytes span tokens is held back until it is complete, and the stop strings are
searched by :class:`StopMatcher`, which looks at each new character once, whatever the number of stop strings
and however long the text grows. ``tests/test_serve_detokenizer.py`` checks both against whole-text references.
"""

from __future__ import annotations

__all__ = ["IncrementalText", "StopMatcher", "detokenize_prompt"]

CONTEXT_TOKENS = 6  # prompt tokens a choice's detokenizer starts from (a leading space decodes right)
_UTF8_MAX = 4  # bytes of the longest UTF-8 character


class StopMatcher:
    """The stop strings as one Aho-Corasick automaton, fed the text character by character as it grows.

    :meth:`feed` finds the first place where a stop string ends (across calls: a stop string may span chunks),
    looking at each character once; :attr:`held` is the length of the longest end of the text so far that
    begins a stop string (what a stream must hold back). Hand-rolled: the Python packages of the algorithm
    (``pyahocorasick``) search whole strings, not a stream whose state carries over from chunk to chunk."""

    def __init__(self, stops):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._out = [0]  # the longest stop string ending at the node (0: none)
        for s in self.stops:
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._out.append(0)
                node = nxt
            self._out[node] = len(s)
        self._fail = [0] * len(self._goto)
        order = list(self._goto[0].values())  # breadth first: a node's fail link is shallower than itself
        for node in order:
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[child] = self._goto[f].get(ch, 0)
                self._out[child] = self._out[child] or self._out[self._fail[child]]
                order.append(child)
        self.state = 0
        self.scanned = 0  # characters fed so far (each looked at once)

    @property
    def held(self) -> int:
        """Characters at the end of what was fed that may begin a stop string (0 after a match)."""
        return self._depth[self.state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Feed ``text``; at the first stop string that ends in it, ``(end, length)``: it ends before
        ``text[end]`` and is ``length`` characters long (the longest of those ending there: it starts first).
        None: no stop string ended. After a match the automaton starts over."""
        goto, fail, out = self._goto, self._fail, self._out
        state = self.state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state]:
                self.scanned += i + 1
                self.state = 0
                return i + 1, out[state]
        self.scanned += len(text)
        self.state = state
        return None


class IncrementalText:
    """One choice's text, decoded token by token, with its stop strings.

    :meth:`add` takes a token and returns the offset where its text begins; ``text`` is what was decoded so far,
    without a trailing partial UTF-8 character (a ``'\\ufffd'`` tail: held back until the next token completes
    it, for at most three tokens, or until :meth:`finish`). Decoding uses a window of the last tokens (the prompt's
    last few at first, so that a tokenizer's leading space is right): each token costs one short decode, not one of
    the whole text.

    Stop strings: the first one to end (it may span tokens) ends the text before it (``stopped``); until then
    :meth:`shown` holds back the longest end of ``text`` that begins a stop string. The search looks at each new
    character once (:class:`StopMatcher`)."""

    def __init__(self, tokenizer, context_ids=(), stops=()):
        self.tok = tokenizer
        self.ids = list(context_ids)[-CONTEXT_TOKENS:] if context_ids else []
        self.prefix, self.read = 0, len(self.ids)
        self.text, self.tail = "", ""
        self.matcher = StopMatcher(stops) if any(stops) else None
        self.stopped = False

    @property
    def stops(self) -> list[str]:
        return self.matcher.stops if self.matcher is not None else []

    def add(self, token_id: int) -> int:
        offset = len(self.text)
        if self.stopped:
            return offset
        self.ids.append(int(token_id))
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        new_text = self.tok.decode(self.ids[self.prefix :])
        if new_text.endswith("\ufffd") and len(self.ids) - self.read < _UTF8_MAX:
            # a character not complete yet: hold it back (at most 3 tokens: a UTF-8 character has at most 4 bytes,
            # so a longer run ending in U+FFFD is invalid bytes, shown as they decode)
            self.tail = new_text[len(prefix_text) :]
        elif len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text) :])
            self.prefix, self.read, self.tail = self.read, len(self.ids), ""
            # keep the window short: the last few tokens carry the context a tokenizer needs
            if self.prefix > 4 * CONTEXT_TOKENS:
                drop = self.prefix - CONTEXT_TOKENS
                self.ids, self.prefix, self.read = self.ids[drop:], self.prefix - drop, self.read - drop
        return offset

    def _append(self, new: str) -> None:
        """``new`` onto the text, cut at the first stop string to end in it."""
        self.text += new
        if self.matcher is None:
            return
        hit = self.matcher.feed(new)
        if hit is not None:
            end, length = hit
            self.text = self.text[: len(self.text) - len(new) + end - length]
            self.tail, self.stopped = "", True

    def shown(self) -> str:
        """The text that may be shown now: all of it once stopped; else without an end that may begin a stop
        string."""
        if self.stopped or self.matcher is None or not self.matcher.held:
            return self.text
        return self.text[: len(self.text) - self.matcher.held]

    def finish(self) -> str:
        """The final text: a held-back partial character is shown as decoded (``'\\ufffd'``), a stop string
        looked for once more."""
        if not self.stopped and self.tail:
            tail, self.tail = self.tail, ""
            self._append(tail)
        return self.text


def detokenize_prompt(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """A prompt's text and each token's offset in it, decoded incrementally (as generated text is)."""
    it = IncrementalText(tokenizer)
    offsets = [it.add(t) for t in ids]
    return it.finish(), offsets
