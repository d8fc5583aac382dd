"""The state of one app of :func:`~looplm.serve.app.build_app` (``app.state.looplm``): what its routes and
:mod:`.serving` share, and the drain.

The drain (:meth:`ServerState.drain`): the app stops taking requests (503) and the engine shuts down, letting the
requests in flight finish for up to ``grace_s`` and ending the rest (their streams get an error event).
:mod:`.server` starts it on SIGTERM / SIGINT and :meth:`~looplm.serve.server.Server.stop`; the app's shutdown
runs it (with no grace) at the latest.
"""

from __future__ import annotations

import threading
import time

from ..data.tokenizers import ByteTokenizer
from .metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a request body's bound (``--max-body-mib``, docs/serving.md)
_CHARS_MARGIN = 4  # a text prompt may have this many times the characters its context's tokens can decode to


class ServerState:
    """What the app's routes and :mod:`.serving` share: the engine, the tokenizer, the served name, the limits,
    the metrics, and whether the server is draining (:meth:`drain`)."""

    def __init__(
        self,
        engine,
        tokenizer,
        model_name: str,
        api_key: str | None,
        request_timeout_s: float,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        if not model_name:
            raise ValueError(f"model_name must be a non-empty string (the id of /v1/models), got {model_name!r}")
        if not (isinstance(request_timeout_s, (int, float)) and request_timeout_s > 0):
            raise ValueError(f"request_timeout_s must be a number > 0 (seconds), got {request_timeout_s!r}")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an int >= 1024 (a request body's bound), got {max_body_bytes!r}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.request_timeout_s = api_key or None, float(request_timeout_s)
        self.max_body_bytes = max_body_bytes
        self._max_token_chars: int | None = None
        self.metrics = ServerMetrics(engine, model_name)
        self.draining = False
        self.created = int(time.time())
        self._shutdown_lock = threading.Lock()
        self._engine_down = False

    def engine_config_text(self, name: str) -> str:
        cfg = getattr(self.engine, "config", None)
        return str(getattr(cfg, name, "?"))

    def capacity(self) -> int | None:
        """The most engine requests (samples) the engine can ever hold at once: its rows and its queue (None: an
        engine without an :class:`EngineConfig`)."""
        cfg = getattr(self.engine, "config", None)
        b, w = getattr(cfg, "max_batch", None), getattr(cfg, "max_waiting", None)
        return b + w if isinstance(b, int) and isinstance(w, int) else None

    def context_tokens(self) -> int | None:
        n = getattr(self.engine, "max_model_len", None)
        return n if isinstance(n, int) and n > 0 else None

    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt (or the messages' text) may have: a longer one cannot fit the context
        with this tokenizer (its longest token decodes to this many characters; times a margin for normalizers
        that shrink a text). None: no context known."""
        ctx = self.context_tokens()
        if ctx is None:
            return None
        if self._max_token_chars is None:
            self._max_token_chars = _max_token_chars(self.tokenizer)
        return ctx * self._max_token_chars * _CHARS_MARGIN

    def drain(self, grace_s: float) -> None:
        """Stop taking requests (503) and shut the engine down: requests in flight may finish for up to
        ``grace_s`` seconds, the rest end with an error. Blocks; safe to call more than once."""
        self.draining = True
        with self._shutdown_lock:
            if self._engine_down:
                return
            self._engine_down = True
        self.engine.shutdown(grace_s)


# ------------------------------------------------------------------------------------------------ the app


def _max_token_chars(tok) -> int:
    """The most characters one token of ``tok`` decodes to: 1 for bytes; else the longest entry of its vocabulary
    (a byte-level or SentencePiece entry has at least as many characters as its text); 64 if it has none."""
    if isinstance(tok, ByteTokenizer):
        return 1
    vocab = getattr(tok, "_vocab", None)
    try:
        return max(1, max(len(k) for k in vocab()))
    except Exception:  # no vocabulary to read: a bound generous for any real tokenizer
        return 64
