"""The engine requests of one HTTP request, in flight: :class:`Choice` (one engine request: a choice of the
answer, its tokens and its text), :class:`Channel` (the engine thread's events into the event loop) and
:class:`Run` (the choices of one request: submitted together, their events applied, their deadline and their
client watched). :mod:`.serving` builds them and turns them into answers."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from fastapi import Request

from .detokenizer import IncrementalText
from .engine import (
    EngineClosed,
    FinishEvent,
    PreparedRequest,
    PromptEvent,
    QueueFull,
    RequestError,
    SamplingParams,
    TokenEvent,
)
from .errors import APIError, closed_error
from .protocol import Usage
from .state import ServerState

_POLL_S = 0.25  # how often a request waiting for tokens checks its client and its deadline


@dataclass
class Tok:
    """A generated (or prompt) token for the log-probabilities."""

    id: int
    logprob: float | None
    top: list | None
    offset: int


@dataclass
class Choice:
    """One engine request: a choice of the answer."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: IncrementalText
    prepared: PreparedRequest  # the engine's checked request (Engine.prepare): submitted without a second check
    source: str | None = None  # the prompt's text as sent, for an echo (None: sent as token ids, or a chat)
    handle: object = None
    finish: FinishEvent | None = None
    prompt_event: PromptEvent | None = None
    tokens: list[Tok] = field(default_factory=list)
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

    def visible_tokens(self, upto_chars: int, final: bool) -> list[Tok]:
        """The unsent tokens whose text begins before ``upto_chars`` (all of them at the end of an uncut text)."""
        out = []
        for t in self.tokens[self.sent_tokens :]:
            if t.offset < upto_chars or (final and not self.text.stopped):
                out.append(t)
            else:
                break
        self.sent_tokens += len(out)
        return out


class Channel:
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
                async with asyncio.timeout(timeout):  # (not wait_for: no task made per event)
                    await self.ready.wait()
            except TimeoutError:
                return None
        return self.items.popleft()


class Disconnected(Exception):
    """The client went away (the run's engine requests are aborted)."""


class Run:
    """The engine requests of one HTTP request, their events and the text they make. ``endpoint``: the
    request's label in the metrics (``completions``, ``chat``)."""

    def __init__(self, state: ServerState, endpoint: str, request: Request, choices: list[Choice], t0: float):
        self.state, self.endpoint, self.request, self.choices, self.t0 = state, endpoint, request, choices, t0
        self.deadline = t0 + state.request_timeout_s
        self.channel = Channel(asyncio.get_running_loop())

    def submit(self) -> None:
        """Every choice into the engine at once, or none (:meth:`Engine.submit_group`): a refusal queues nothing."""
        eng = self.state.engine
        try:
            handles = eng.submit_group([(c.prepared, self.channel.callback(c.index)) for c in self.choices])
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
            raise closed_error() from None
        except RequestError as e:
            raise APIError.bad_fields(e.errors) from None
        for c, h in zip(self.choices, handles):
            c.handle = h

    def abort(self, reason: str = "abort") -> None:
        for c in self.choices:
            if c.handle is not None and not c.done:
                c.handle.abort(reason)

    async def events(self, watch_disconnect: bool = True):
        """Yield each choice as an event changes it, until every choice has finished. Raises :class:`APIError`
        (504) at the deadline and, with ``watch_disconnect`` (every ``_POLL_S``), :class:`Disconnected` when the
        client has gone (both abort first). A stream passes False: the server cancels it when its client goes."""
        pending = len(self.choices)
        last_check = time.monotonic()
        while pending:
            now = time.monotonic()
            if now >= self.deadline:
                self.abort()
                self.state.metrics.requests.labels(self.endpoint, "timeout").inc()
                raise self._timeout_error()
            if watch_disconnect and now - last_check >= _POLL_S:
                last_check = now
                if await self.request.is_disconnected():
                    self.abort()
                    raise Disconnected()
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

    def _apply(self, c: Choice, ev) -> None:
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
                c.tokens.append(Tok(ev.token_id, ev.logprob, ev.top_logprobs, len(c.text.text)))
                return
            offset = c.text.add(ev.token_id)
            c.tokens.append(Tok(ev.token_id, ev.logprob, ev.top_logprobs, offset))
            if c.text.stopped:
                c.handle.abort("stop")
        elif isinstance(ev, PromptEvent):
            c.prompt_event = ev
        elif isinstance(ev, FinishEvent):
            c.finish = ev
            c.text.finish()
            m.duration.observe(time.monotonic() - self.t0)

    def check_finished(self, c: Choice) -> None:
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

    def usage(self) -> Usage:
        """The tokens of the answer: each prompt's once (the engine's count once it finished), every choice's."""
        prompt = {}
        for c in self.choices:
            prompt.setdefault(c.prompt_index, c.finish.prompt_tokens if c.finish else len(c.prompt_ids))
        p, g = sum(prompt.values()), sum(c.completion_tokens() for c in self.choices)
        return Usage(prompt_tokens=p, completion_tokens=g, total_tokens=p + g)
