"""The OpenAI-compatible HTTP server over an :class:`~looplm.serve.engine.Engine` (FastAPI + uvicorn).

:func:`build_app` makes the app; :class:`Server` runs it in a thread of this process (tests, notebooks) and
:func:`run_server` in the foreground with the signals handled (``looplm serve``). ``docs/serving.md`` is the
user's guide; this docstring is the map of the code.

A request goes through four steps:

1. **refuse what costs nothing to refuse**, before any parsing: no API key (401), a body that is not
   ``application/json`` (415: a web page cannot POST JSON to the local server without a CORS preflight), a body
   over ``max_body_bytes`` (413, read no further);
   **parse** (:mod:`.protocol`): the JSON body against the request model; unknown fields, bad types, bad
   values and fields the server does not implement are collected into one 400 naming every field, and nothing
   is built from a refused request. Then, still before any tokenizing or copying, the sizes: ``n`` × prompts
   beyond what the engine can ever hold at once (``max_batch + max_waiting``), a prompt of more characters (or
   token ids) than the context can hold, more messages than that (400). Then, off the event loop (a thread),
   the chat template, the tokenizer and the engine's own checks (:meth:`Engine.check`: context length, the
   ``looplm`` extension);
2. **submit**: one engine request per choice (``n`` per prompt; with a ``seed``, sample ``i`` uses
   ``seed + i``); the engine calls back from its thread and :class:`_Channel` hands each event to the event
   loop (``loop.call_soon_threadsafe``);
3. **detokenize** (:class:`~looplm.serve.detokenizer.IncrementalText`): each choice's tokens become text as they come; the stop
   strings are the server's job (a stop string may span tokens; its text is cut; while streaming, text that
   may be the start of a stop string and a partial UTF-8 character are held back); a found stop string ends
   the engine request (``abort('stop')``);
4. **answer**: one JSON body, or server-sent events (``data: {chunk}``, ``data: [DONE]``).

Every wait is bounded by the request's deadline (``request_timeout_s``: the engine request is aborted and the
answer is an error), and a client that goes away (``request.is_disconnected()``, or the stream cancelled)
aborts its engine requests, so their rows free at once.

Shutdown (SIGTERM / SIGINT, or :meth:`Server.stop`): the app stops taking requests (503), the engine lets the
requests in flight finish for up to ``grace_s`` and ends the rest (their streams get an error event), then
uvicorn closes the connections (``timeout_graceful_shutdown``) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..data.tokenizers import ByteTokenizer

from .detokenizer import IncrementalText, detokenize_prompt
from .engine import EngineClosed, FinishEvent, PromptEvent, QueueFull, RequestError, SamplingParams, TokenEvent
from .fields import FieldError
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatRequest,
    ChoiceStats,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
    field_error_message,
    parse_request,
)

__all__ = ["APIError", "DEFAULT_MAX_BODY_BYTES", "IncrementalText", "Server", "build_app", "run_server"]

log = logging.getLogger("looplm.serve")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a request body's bound (``--max-body-mib``, docs/serving.md)
_CHARS_MARGIN = 4  # a text prompt may have this many times the characters its context's tokens can decode to

_POLL_S = 0.25  # how often a request waiting for tokens checks its client and its deadline


# ------------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An answer in OpenAI's error shape: ``status`` (400, 401, 404, 429, 503, 504, 500), ``message``, ``type``,
    ``param`` / ``fields`` (the bad fields), ``code`` and extra ``headers`` (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        fields: list[FieldError] | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.fields, self.headers = fields, headers

    @classmethod
    def bad_fields(cls, fields: list[FieldError]) -> APIError:
        ctx = any(_is_context_error(f) for f in fields)
        return cls(
            400, field_error_message(fields), fields=fields, code="context_length_exceeded" if ctx else "invalid_field"
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code, self.fields)

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a value quoted from the request (a lone surrogate, a control character) is
    escaped, so the answer can always be encoded (starlette's JSONResponse encodes ``ensure_ascii=False``)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _is_context_error(f: FieldError) -> bool:
    return (
        f.field.split("[")[0] in ("prompt", "messages", "max_tokens", "max_completion_tokens")
        and "context" in f.message
    )


def _closed_error() -> APIError:
    return APIError(
        503, "the server is shutting down: it takes no new requests", "server_shutting_down", code="shutting_down"
    )


# ------------------------------------------------------------------------------------------------ a request
@dataclass
class _Tok:
    """A generated (or prompt) token for the log-probabilities."""

    id: int
    logprob: float | None
    top: list | None
    offset: int


@dataclass
class _Choice:
    """One engine request: a choice of the answer."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: IncrementalText
    handle: object = None
    finish: FinishEvent | None = None
    prompt_event: PromptEvent | None = None
    tokens: list[_Tok] = field(default_factory=list)
    n_generated: int = 0  # tokens received, the stop token included
    depth_sum: int = 0
    shown: int = 0  # characters of text already sent (streaming)
    sent_tokens: int = 0  # tokens already sent with their log-probabilities (streaming)
    last_token_t: float | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        return self.finish.reason

    def completion_tokens(self) -> int:
        n = self.finish.completion_tokens if self.finish is not None else self.n_generated
        return min(n, self.n_generated) if self.text.stopped else n

    def mean_loops(self) -> float | None:
        if self.finish is not None and self.finish.loops is not None:
            return float(self.finish.loops)
        return self.depth_sum / self.n_generated if self.n_generated else None

    def visible_tokens(self, upto_chars: int, final: bool) -> list[_Tok]:
        """The unsent tokens whose text begins before ``upto_chars`` (all of them at the end of an uncut text)."""
        out = []
        for t in self.tokens[self.sent_tokens :]:
            if t.offset < upto_chars or (final and not self.text.stopped):
                out.append(t)
            else:
                break
        self.sent_tokens += len(out)
        return out


class _Channel:
    """Engine events into the event loop: the engine thread's callback appends (``call_soon_threadsafe``), the
    request's coroutine waits with a timeout (no event is lost to a timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.ready = loop, deque(), asyncio.Event()

    def callback(self, index: int):
        def on_event(ev):
            try:
                self.loop.call_soon_threadsafe(self._put, (index, ev))
            except RuntimeError:  # the loop is closed: nobody waits for this request any more
                pass

        return on_event

    def _put(self, item) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self, timeout: float):
        """The next ``(choice index, event)``, or None after ``timeout`` seconds."""
        if not self.items:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self.items.popleft()


class _Disconnected(Exception):
    pass


class _Run:
    """The engine requests of one HTTP request, their events and the text they make."""

    def __init__(self, state: "_ServerState", request: Request, choices: list[_Choice], t0: float):
        self.state, self.request, self.choices, self.t0 = state, request, choices, t0
        self.deadline = t0 + state.request_timeout_s
        self.channel = _Channel(asyncio.get_running_loop())

    def submit(self) -> None:
        """Every choice into the engine at once, or none (:meth:`Engine.submit_group`): a refusal queues nothing."""
        eng = self.state.engine
        try:
            handles = eng.submit_group([(c.prompt_ids, c.params, self.channel.callback(c.index)) for c in self.choices])
        except QueueFull:
            raise APIError(
                429,
                f"the engine's queue is full ({self.state.engine_config_text('max_waiting')} requests "
                "waiting): try again shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except EngineClosed:
            raise _closed_error() from None
        except RequestError as e:
            raise APIError.bad_fields(e.errors) from None
        for c, h in zip(self.choices, handles):
            c.handle = h

    def abort(self, reason: str = "abort") -> None:
        for c in self.choices:
            if c.handle is not None and not c.done:
                c.handle.abort(reason)

    async def events(self):
        """Yield each choice as an event changes it, until every choice has finished. Raises :class:`APIError`
        (504) at the deadline and :class:`_Disconnected` when the client has gone (both abort first)."""
        pending = len(self.choices)
        last_check = time.monotonic()
        while pending:
            now = time.monotonic()
            if now >= self.deadline:
                self.abort()
                self.state.metrics.requests.labels(self.state.endpoint_of(self.request), "timeout").inc()
                raise self._timeout_error()
            if now - last_check >= _POLL_S:
                last_check = now
                if await self.request.is_disconnected():
                    self.abort()
                    raise _Disconnected()
            item = await self.channel.get(min(_POLL_S, max(self.deadline - now, 0.0)))
            if item is None:
                continue
            c = self.choices[item[0]]
            if c.done:
                continue
            self._apply(c, item[1])
            if c.done:
                pending -= 1
            yield c

    def _timeout_error(self) -> APIError:
        """The 504: a request that never got a token waited (in the queue, or behind other prompts' prefill), so
        fewer tokens would not have helped it; one that was generating ran out of time."""
        t = f"{self.state.request_timeout_s:g} s"
        if not any(c.n_generated or c.prompt_event is not None for c in self.choices):
            msg = (
                f"the request waited for the engine past the server's request timeout ({t}) without starting: it "
                "was aborted; the server is busy: retry later, or send fewer requests at once"
            )
        else:
            msg = (
                f"the request did not finish within the server's request timeout ({t}): it was aborted; ask for "
                "fewer tokens (max_tokens), or retry when the server is less busy"
            )
        return APIError(504, msg, "timeout_error", code="request_timeout")

    def _apply(self, c: _Choice, ev) -> None:
        m = self.state.metrics
        if isinstance(ev, TokenEvent):
            now = time.monotonic()
            if c.last_token_t is None:
                m.ttft.observe(now - self.t0)
            else:
                m.itl.observe(now - c.last_token_t)
            c.last_token_t = now
            c.n_generated += 1
            if ev.depth:
                c.depth_sum += ev.depth
                m.token_loops.observe(ev.depth)
            if c.text.stopped:
                return  # a token after a found stop string
            if ev.stop:  # an EOS / stop token: its text is not shown, but it was generated — it has its log-probability
                # (as in OpenAI's and vLLM's answers: lm-eval's local-completions drops the last token of an echoed
                # prompt + max_tokens=1 as the generated one, which would otherwise be the prompt's last)
                c.tokens.append(_Tok(ev.token_id, ev.logprob, ev.top_logprobs, len(c.text.text)))
                return
            offset = c.text.add(ev.token_id)
            c.tokens.append(_Tok(ev.token_id, ev.logprob, ev.top_logprobs, offset))
            if c.text.stopped:
                c.handle.abort("stop")
        elif isinstance(ev, PromptEvent):
            c.prompt_event = ev
        elif isinstance(ev, FinishEvent):
            c.finish = ev
            c.text.finish()
            m.duration.observe(time.monotonic() - self.t0)

    def check_finished(self, c: _Choice) -> None:
        """A finished choice that did not end well becomes an error: the shutdown (503), an engine error (500)."""
        f = c.finish
        if c.text.stopped or f.reason in ("stop", "length"):
            return
        if f.reason == "abort":
            raise APIError(
                503,
                f"the request was aborted: {f.error or 'aborted by the server'}",
                "server_shutting_down" if "shutting down" in (f.error or "") else "aborted",
                code="aborted",
            )
        raise APIError(500, f"the engine failed on this request: {f.error}", "server_error", code="engine_error")


# ------------------------------------------------------------------------------------------------ the app state
class _ServerState:
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

    @staticmethod
    def endpoint_of(request: Request) -> str:
        return "chat" if request.url.path.endswith("/chat/completions") else "completions"

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
def build_app(
    engine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    request_timeout_s: float = 600.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The OpenAI-compatible app over a started (or not yet started: the app's startup starts it) ``engine``.

    ``tokenizer``: looplm's (``encode`` / ``decode`` / ``eos_id``; an :class:`HFTokenizer` of kind
    ``transformers`` with a ``chat_template`` for the chat endpoint). ``model_name``: the id ``/v1/models``
    lists and requests must name. ``api_key``: when set, ``/v1/*`` wants ``Authorization: Bearer KEY``
    (``/health`` and ``/metrics`` stay open). ``request_timeout_s``: a request still running after it is
    aborted and answered with an error. ``max_body_bytes``: a larger request body is a 413, read no further. The
    engine is shut down with the app (at the latest)."""
    state = _ServerState(engine, tokenizer, model_name, api_key, request_timeout_s, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not _engine_running(engine):
            engine.start()
        yield
        await asyncio.to_thread(state.drain, 0.0)

    app = FastAPI(
        title="looplm serve",
        summary="an OpenAI-compatible server of a looped language model",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.looplm = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        msg = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _ErrorResponse(error_body(msg, kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _ErrorResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    def guard(request: Request) -> None:
        """401 without the API key, 503 while shutting down."""
        if state.api_key is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
                raise APIError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer KEY' (the "
                    "key the server was started with, --api-key)",
                    "authentication_error",
                    code="invalid_api_key",
                )
        if state.draining:
            raise _closed_error()

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        describe = getattr(engine, "describe", None)
        return ModelCard(
            id=state.model_name,
            created=state.created,
            max_model_len=getattr(engine, "max_model_len", None),
            looplm={"K": getattr(engine, "K", None), "engine": describe() if describe else None},
        )

    @app.get("/v1/models")
    async def models(request: Request):
        guard(request)
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        guard(request)
        if model_id != state.model_name:
            raise _unknown_model(model_id, state)
        return model_card().model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _endpoint(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _endpoint(state, request, "chat")

    app.state.guard = guard
    return app


def _engine_running(engine) -> bool:
    t = getattr(engine, "_thread", None)
    return t is not None and (t.is_alive() or getattr(engine, "_closed", False))


def _unknown_model(name, state) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist: this server serves {state.model_name!r} (GET /v1/models)",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


async def _endpoint(state: _ServerState, request: Request, kind: str):
    t0 = time.monotonic()
    try:
        request.app.state.guard(request)
        _require_json(request)
        body = await _read_body(request, state.max_body_bytes)
        req, errors = parse_request(
            body, ChatRequest if kind == "chat" else CompletionRequest, max_messages=state.context_tokens()
        )
        del body
        if errors:
            raise APIError.bad_fields(errors)
        if req.model is not None and req.model != state.model_name:
            raise _unknown_model(req.model, state)
        _check_sizes(state, req, kind)
        # the chat template and the tokenizer take time on a long prompt: off the event loop
        choices, echo = await run_in_threadpool(_choices, state, req, kind)
        run = _Run(state, request, choices, t0)
        run.submit()
    except APIError as e:
        outcome = {
            400: "bad_request",
            401: "unauthorized",
            404: "bad_request",
            413: "bad_request",
            415: "bad_request",
            429: "rejected",
            503: "rejected",
        }
        state.metrics.requests.labels(kind, outcome.get(e.status, "error")).inc()
        return e.response()
    if req.stream:
        gen = _stream_chat(state, run, req) if kind == "chat" else _stream_completion(state, run, req, echo)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        async for _ in run.events():
            pass
        for c in run.choices:
            run.check_finished(c)
        body = _chat_body(state, run) if kind == "chat" else _completion_body(state, run, req, echo)
    except _Disconnected:
        state.metrics.requests.labels(kind, "disconnect").inc()
        return Response(status_code=499)
    except APIError as e:
        if e.status != 504:
            state.metrics.requests.labels(kind, "error").inc()
        return e.response()
    except BaseException:
        run.abort()
        raise
    state.metrics.requests.labels(kind, "ok").inc()
    return JSONResponse(body)


# ------------------------------------------------------------------------------------------------ before parsing
def _require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (as vLLM: a cross-site form or ``text/plain`` POST,
    which a browser sends without a preflight, never reaches the model)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"the body must be JSON with the header 'Content-Type: application/json', got "
            f"{ctype[:60] or 'no Content-Type'!r} (curl: add -H 'Content-Type: application/json')",
            param="Content-Type",
            code="unsupported_media_type",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it passes ``limit`` bytes (by its Content-Length, or while it streams in).
    By hand: neither starlette nor uvicorn bounds a request body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large("sent without a Content-Length", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body ({size}) is over this server's bound of {limit} bytes (--max-body-mib): "
        "send a shorter prompt or fewer prompts per request",
        param="body",
        code="request_too_large",
    )


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


def _check_sizes(state: _ServerState, req, kind: str) -> None:
    """The 400s that need no tokenizing and no copy: ``n`` × prompts beyond what the engine can ever hold, a text
    longer than the context can hold in characters, more token ids or more messages than the context's tokens."""
    cap, ctx, max_chars = state.capacity(), state.context_tokens(), state.max_prompt_chars()
    errors = []
    if kind == "chat":
        n_prompts = 1
        chars = sum(len(m.text()) + len(m.name or "") for m in req.messages)
        if max_chars is not None and chars > max_chars:  # (more messages than the context's tokens: parse_request)
            errors.append(
                FieldError(
                    "messages",
                    f"hold {chars} characters, more than the model's context of {ctx} "
                    f"tokens can hold with this tokenizer (at most {max_chars}): shorten them",
                )
            )
    else:
        prompts = req.prompt_parts()
        n_prompts = len(prompts)
        for i, p in enumerate(prompts):
            name = "prompt" if n_prompts == 1 else f"prompt[{i}]"
            if isinstance(p, str) and max_chars is not None and len(p) > max_chars:
                errors.append(
                    FieldError(
                        name,
                        f"is {len(p)} characters, more than the model's context of {ctx} tokens "
                        f"can hold with this tokenizer (at most {max_chars}): shorten it",
                    )
                )
            elif not isinstance(p, str) and ctx is not None and len(p) > ctx:
                errors.append(
                    FieldError(
                        name, f"holds {len(p)} token ids, more than the model's context of {ctx} tokens: shorten it"
                    )
                )
    if cap is not None and n_prompts * req.n > cap:
        if n_prompts > cap:
            errors.append(
                FieldError(
                    "prompt",
                    f"holds {n_prompts} prompts, more than this server can ever hold at once "
                    f"({cap} requests: --max-batch + --max-waiting): send at most {cap} per request",
                )
            )
        else:
            errors.append(
                FieldError(
                    "n",
                    f"asks for {req.n} samples of {n_prompts} prompt(s) = {n_prompts * req.n} "
                    f"engine requests, more than this server can ever hold at once ({cap}: "
                    f"--max-batch + --max-waiting): ask for n <= {cap // n_prompts}",
                )
            )
    if errors:
        raise APIError.bad_fields(errors)


# ------------------------------------------------------------------------------------------------ requests → engine
def _choices(state: _ServerState, req, kind: str) -> tuple[list[_Choice], list]:
    """The engine requests of ``req`` (its prompts' ids, each ``n`` times; ``req`` has passed every check of the
    protocol and :func:`_check_sizes`) after the model's checks; raises the 400 naming every bad field. Runs in
    a worker thread (the chat template and the tokenizer)."""
    tok, eng = state.tokenizer, state.engine
    errors: list[FieldError] = []
    echo: list = []
    if kind == "chat":
        ids = _chat_prompt(state, req, errors)
        prompts = [ids] if ids is not None else []
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        limit = req.completion_limit()
        prompt_name = "messages"
    else:
        prompts = []
        for p in req.prompts():
            prompts.append(tok.encode(p) if isinstance(p, str) else p)
            echo.append(p if isinstance(p, str) else None)
        logprobs, limit, prompt_name = req.logprobs, req.max_tokens, "prompt"
    vocab = _vocab_size(state)
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    top_k = None if req.top_k in (None, 0, -1) else req.top_k
    stops = req.stop_strings()
    lo = req.looplm
    choices = []
    for pi, ids in enumerate(prompts):
        name = prompt_name if len(prompts) == 1 else f"{prompt_name}[{pi}]"
        if not ids:
            errors.append(FieldError(name, "is empty: give at least one token"))
            continue
        if vocab is not None and max(ids) >= vocab:
            errors.append(FieldError(name, f"token id {max(ids)} is not in the model's vocabulary (ids < {vocab})"))
            continue
        max_tokens = limit
        if max_tokens is None:  # chat without a limit: what the context leaves
            max_tokens = max(int(getattr(eng, "max_model_len", 0) or 0) - len(ids), 1)
        for i in range(req.n):
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=req.top_p,
                top_k=top_k,
                seed=None if req.seed is None else req.seed + i,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=kind == "completions" and req.echo and logprobs is not None,
                exit=lo.exit if lo else None,
                loops=lo.loops if lo else None,
                kv_policy=lo.kv_policy if lo else None,
                speculative=lo.speculative if lo else None,
            )
            if i == 0:  # the samples of a prompt differ only in their seed (checked whole by the protocol)
                errs = [FieldError(name, f.message) if f.field == "prompt" else f for f in eng.check(ids, params)]
                errors += errs
                if errs:
                    break  # (the other samples would say the same)
            # the samples of a prompt share its ids (the engine copies what it keeps)
            choices.append(
                _Choice(
                    index=pi * req.n + i,
                    prompt_index=pi,
                    prompt_ids=ids,
                    params=params,
                    text=IncrementalText(tok, ids, stops),
                )
            )
    if errors:
        raise APIError.bad_fields(list({(f.field, f.message): f for f in errors}.values()))
    return choices, echo


def _vocab_size(state) -> int | None:
    model = getattr(state.engine, "model", None)
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vocab_size", None)


def _chat_prompt(state: _ServerState, req: ChatRequest, errors: list[FieldError]) -> list[int] | None:
    tok = state.tokenizer
    backend = getattr(tok, "_tok", None)
    template = getattr(backend, "chat_template", None) if getattr(tok, "_kind", None) == "transformers" else None
    if not template:
        raise APIError(
            400,
            f"the served tokenizer ({getattr(tok, 'name', type(tok).__name__)}) has no chat template, "
            "so this server cannot answer /v1/chat/completions: use /v1/completions with your own "
            "prompt format, or serve with --tokenizer a Hugging Face tokenizer directory whose "
            "tokenizer_config.json has a chat_template",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = backend.apply_chat_template(
            req.conversation(), tokenize=False, add_generation_prompt=req.add_generation_prompt
        )
    except Exception as e:  # the template's own checks (roles must alternate, ...) raise
        errors.append(FieldError("messages", f"the chat template refused them: {e}"))
        return None
    return tok.encode(text)


# ------------------------------------------------------------------------------------------------ responses
def _top_dict(state, top, chosen: int, chosen_lp) -> dict[str, float]:
    tok = state.tokenizer
    d = {tok.decode([int(i)]): float(lp) for i, lp in (top or [])}
    if chosen_lp is not None:
        d.setdefault(tok.decode([chosen]), float(chosen_lp))
    return d


def _completion_logprobs(state, c: _Choice, toks: list[_Tok], base: int) -> CompletionLogprobs:
    tok = state.tokenizer
    return CompletionLogprobs(
        tokens=[tok.decode([t.id]) for t in toks],
        token_logprobs=[_num(t.logprob) for t in toks],
        top_logprobs=[_top_dict(state, t.top, t.id, t.logprob) if t.logprob is not None else None for t in toks],
        text_offset=[base + t.offset for t in toks],
    )


def _num(x):
    """A log-probability for JSON (``-inf`` is not JSON: the most negative float stands in for it)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else -3.4028234663852886e38


def _echo_part(state, c: _Choice, echo_src) -> tuple[str, list[_Tok]]:
    """The echoed prompt's text and, with ``prompt_logprobs``, its tokens with their log-probabilities."""
    if not c.params.prompt_logprobs:
        text = echo_src if isinstance(echo_src, str) else state.tokenizer.decode(c.prompt_ids)
        return text, []
    text, offsets = detokenize_prompt(state.tokenizer, c.prompt_ids)
    pe = c.prompt_event
    lps = pe.token_logprobs if pe is not None else [None] * len(c.prompt_ids)
    tops = pe.top_logprobs if pe is not None else [None] * len(c.prompt_ids)
    return text, [_Tok(i, lp, top, o) for i, lp, top, o in zip(c.prompt_ids, lps, tops, offsets)]


def _usage(run: _Run) -> Usage:
    prompt = {}
    for c in run.choices:
        prompt.setdefault(c.prompt_index, c.finish.prompt_tokens if c.finish else len(c.prompt_ids))
    p, g = sum(prompt.values()), sum(c.completion_tokens() for c in run.choices)
    return Usage(prompt_tokens=p, completion_tokens=g, total_tokens=p + g)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _completion_body(state, run: _Run, req: CompletionRequest, echo_src: list) -> dict:
    choices = []
    for c in run.choices:
        text, logprobs = c.text.text, None
        if req.echo:
            ptext, ptoks = _echo_part(state, c, echo_src[c.prompt_index])
            toks = c.tokens
            if req.logprobs is not None:
                lp_p = _completion_logprobs(state, c, ptoks, 0)
                lp_g = _completion_logprobs(
                    state, c, [t for t in toks if t.offset < len(text) or not c.text.stopped], len(ptext)
                )
                logprobs = CompletionLogprobs(
                    tokens=lp_p.tokens + lp_g.tokens,
                    token_logprobs=lp_p.token_logprobs + lp_g.token_logprobs,
                    top_logprobs=lp_p.top_logprobs + lp_g.top_logprobs,
                    text_offset=lp_p.text_offset + lp_g.text_offset,
                )
            text = ptext + text
        elif req.logprobs is not None:
            logprobs = _completion_logprobs(state, c, c.visible_tokens(len(text), final=True), 0)
        choices.append(
            CompletionChoice(
                index=c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason(),
                looplm=ChoiceStats(loops=c.mean_loops()),
            )
        )
    return Completion(
        id=_new_id("cmpl"), created=int(time.time()), model=state.model_name, choices=choices, usage=_usage(run)
    ).model_dump()


def _chat_logprobs(state, toks: list[_Tok]) -> ChatLogprobs:
    tok = state.tokenizer
    content = []
    for t in toks:
        s = tok.decode([t.id])
        tops = [
            TopLogprob(token=(a := tok.decode([int(i)])), logprob=_num(lp), bytes=list(a.encode()))
            for i, lp in (t.top or [])
        ]
        content.append(
            TokenLogprob(
                token=s,
                logprob=_num(t.logprob if t.logprob is not None else 0.0),
                bytes=list(s.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


def _chat_body(state, run: _Run) -> dict:
    choices = []
    for c in run.choices:
        lp = (
            _chat_logprobs(state, c.visible_tokens(len(c.text.text), final=True))
            if c.params.logprobs is not None
            else None
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text.text),
                logprobs=lp,
                finish_reason=c.finish_reason(),
                looplm=ChoiceStats(loops=c.mean_loops()),
            )
        )
    return ChatCompletion(
        id=_new_id("chatcmpl"), created=int(time.time()), model=state.model_name, choices=choices, usage=_usage(run)
    ).model_dump()


# ------------------------------------------------------------------------------------------------ streaming
def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


async def _stream(state, run: _Run, kind: str, first_chunks, chunk_of, usage_chunk):
    """The SSE body shared by both endpoints: ``first_chunks()`` (chat's role, completions' echo), then one
    chunk per change of a choice (``chunk_of(choice, text, tokens, final)``), the usage chunk, ``[DONE]``. An
    error after the headers went out is an error event; a client gone, a cancelled stream or the end of the
    server abort the engine requests first."""
    try:
        for chunk in first_chunks():
            yield _sse(chunk)
        async for c in run.events():
            if c.done:
                run.check_finished(c)
            shown = c.text.text if c.done else c.text.shown()
            if len(shown) > c.shown or c.done:
                delta, c.shown = shown[c.shown :], len(shown)
                toks = c.visible_tokens(len(shown), final=c.done)
                if delta or c.done or toks:
                    yield _sse(chunk_of(c, delta, toks, c.done))
        if usage_chunk is not None:
            yield _sse(usage_chunk())
        state.metrics.requests.labels(kind, "ok").inc()
        yield _DONE
    except APIError as e:
        run.abort()
        if e.status != 504:
            state.metrics.requests.labels(kind, "error").inc()
        yield _sse(e.body())
        yield _DONE
    except _Disconnected:
        state.metrics.requests.labels(kind, "disconnect").inc()
    finally:  # also when the stream is cancelled (the client went away) or closed early
        run.abort()


def _stream_completion(state, run: _Run, req: CompletionRequest, echo_src: list):
    rid, created = _new_id("cmpl"), int(time.time())
    bases = {}  # choice index → the offset of its generated text (after an echoed prompt)

    def chunk(choices, usage=None):
        return Completion(id=rid, created=created, model=state.model_name, choices=choices, usage=usage).model_dump()

    def first_chunks():
        for c in run.choices:
            bases[c.index] = 0
            if req.echo and not c.params.prompt_logprobs:  # the prompt's text right away
                text, _ = _echo_part(state, c, echo_src[c.prompt_index])
                bases[c.index] = len(text)
                yield chunk([CompletionChoice(index=c.index, text=text)])
        return

    def chunk_of(c: _Choice, delta: str, toks, final: bool):
        if req.echo and c.params.prompt_logprobs and c.index not in _echoed:  # the prompt with its log-probabilities
            _echoed.add(c.index)
            ptext, ptoks = _echo_part(state, c, echo_src[c.prompt_index])
            bases[c.index] = len(ptext)
            toks = ptoks + [_Tok(t.id, t.logprob, t.top, t.offset + len(ptext)) for t in toks]
            lp = _completion_logprobs(state, c, toks, 0)
            delta = ptext + delta
        else:
            lp = _completion_logprobs(state, c, toks, bases.get(c.index, 0)) if req.logprobs is not None else None
        return chunk(
            [
                CompletionChoice(
                    index=c.index,
                    text=delta,
                    logprobs=lp,
                    finish_reason=c.finish_reason() if final else None,
                    looplm=ChoiceStats(loops=c.mean_loops()) if final else None,
                )
            ]
        )

    _echoed: set[int] = set()
    usage = (lambda: chunk([], _usage(run))) if req.include_usage() else None
    return _stream(state, run, "completions", first_chunks, chunk_of, usage)


def _stream_chat(state, run: _Run, req: ChatRequest):
    rid, created = _new_id("chatcmpl"), int(time.time())

    def chunk(choices, usage=None):
        return ChatCompletionChunk(
            id=rid, created=created, model=state.model_name, choices=choices, usage=usage
        ).model_dump()

    def first_chunks():
        for c in run.choices:
            yield chunk([ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})])

    def chunk_of(c: _Choice, delta: str, toks, final: bool):
        lp = _chat_logprobs(state, toks) if c.params.logprobs is not None and toks else None
        return chunk(
            [
                ChatChunkChoice(
                    index=c.index,
                    delta={"content": delta} if delta else {},
                    logprobs=lp,
                    finish_reason=c.finish_reason() if final else None,
                    looplm=ChoiceStats(loops=c.mean_loops()) if final else None,
                )
            ]
        )

    usage = (lambda: chunk([], _usage(run))) if req.include_usage() else None
    return _stream(state, run, "chat", first_chunks, chunk_of, usage)


# ------------------------------------------------------------------------------------------------ running it
def _uvicorn_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn with looplm's shutdown: the first SIGTERM / SIGINT drains (503 for new requests, the engine
        finishes what it has for up to ``grace_s``), then uvicorn exits; a second SIGINT exits at once. The
        signal is not raised again after the exit (uvicorn's default), so the process exits 0."""

        def __init__(self, config, state: _ServerState, grace_s: float):
            super().__init__(config)
            self.looplm_state, self.grace_s, self._draining = state, float(grace_s), None

        def handle_exit(self, sig, frame) -> None:  # from a signal handler: start the drain, return at once
            if self._draining is not None:
                if sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            log.info("looplm serve: signal %s, draining (grace %.0f s)", sig, self.grace_s)
            self.drain_async()

        def drain_async(self) -> threading.Thread:
            if self._draining is None:
                self._draining = threading.Thread(target=self._drain, name="looplm-drain", daemon=True)
                self.looplm_state.draining = True
                self._draining.start()
            return self._draining

        def _drain(self) -> None:
            try:
                self.looplm_state.drain(self.grace_s)
            finally:
                self.should_exit = True

    return _DrainingServer


def _config(app: FastAPI, host: str, port: int, log_level: str, **kw):
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5, **kw
    )


def run_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0, log_level: str = "info"
) -> None:
    """Serve ``app`` (from :func:`build_app`) in the foreground until SIGTERM / SIGINT, then drain: new
    requests get 503, the requests in flight get up to ``grace_s`` seconds, the rest an error, and it returns."""
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    print(
        f"looplm serve: listening on http://{host}:{port}/v1 (Ctrl-C or SIGTERM drains and stops, grace {grace_s:g} s)",
        file=sys.stderr,
        flush=True,
    )
    server = _uvicorn_server_class()(_config(app, host, port, log_level), app.state.looplm, grace_s)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), bound before uvicorn starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on an accepted connection only when its socket says
    # so (the accepted socket inherits this one's proto). Without it Nagle holds each streamed chunk until the
    # client's delayed ACK (~40 ms on Linux): on a reused keep-alive connection a whole stream then arrived at once
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host") from e
    return sock


class Server:
    """``app`` served by uvicorn in a thread of this process, on ``host`` (127.0.0.1) at ``port`` (0: a free
    one, bound before the thread starts; :attr:`port` / :attr:`url` say which).

    ``with Server(app) as s: openai.OpenAI(base_url=s.url + "/v1", ...)``; :meth:`stop` drains like SIGTERM
    (``grace_s``) and joins the thread."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0, log_level: str = "warning"
    ):
        self.app, self.host, self.grace_s = app, host, grace_s
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = _uvicorn_server_class()(_config(app, host, self.port, log_level), app.state.looplm, grace_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Server:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="looplm-uvicorn", daemon=True
        )
        self._thread.start()
        t_end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain (503 for new requests, ``grace_s`` for those in flight), stop uvicorn, join its thread."""
        if self._thread is None:
            return
        self._server.drain_async()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(10)
        self._thread = None
        self._sock.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
