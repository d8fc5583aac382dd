"""The request path of the OpenAI endpoints: :class:`OpenAIServing` holds the flow both share,
:class:`CompletionServing` (``/v1/completions``) and :class:`ChatServing` (``/v1/chat/completions``) what differs:
the request model, the prompts (text or token ids; the chat template), the JSON body and the stream's chunks. The
app (:func:`~looplm.serve.app.build_app`) makes one of each and routes to it; ``docs/serving.md`` is the user's
guide.

A request goes through four steps:

1. **refuse what costs nothing to refuse**, before any parsing (the app's ``admit``, the first thing
   :meth:`OpenAIServing.create` calls): no API key (401), a body that is not ``application/json`` (415: a web
   page cannot POST JSON to the local server without a CORS preflight), a body over ``max_body_bytes`` (413,
   read no further);
   **parse** (:mod:`.protocol`): the JSON body against the request model; unknown fields, bad types, bad
   values and fields the server does not implement are collected into one 400 naming every field, and nothing
   is built from a refused request. Then, still before any tokenizing or copying, the sizes
   (:meth:`~OpenAIServing.check_sizes`): ``n`` × prompts beyond what the engine can ever hold at once
   (``max_batch + max_waiting``), a prompt of more characters (or token ids) than the context can hold, more
   messages than that (400). Then, off the event loop (a thread), the chat template, the tokenizer and the
   engine's own checks (:meth:`~OpenAIServing.choices`, :meth:`Engine.prepare` — the one pass of
   :meth:`Engine.check`: token ids, context length, the ``looplm`` extension —, once per prompt);
2. **submit**: the prepared requests, not checked again (:meth:`Engine.submit_group`): one engine request per
   choice (``n`` per prompt; with a ``seed``, sample ``i`` uses ``seed + i``); the engine calls back from its
   thread and :class:`~looplm.serve.choices.Channel` hands each event to the event loop
   (``loop.call_soon_threadsafe``);
3. **detokenize** (:class:`~looplm.serve.detokenizer.IncrementalText`): each choice's tokens become text as they
   come; the stop strings are the server's job (a stop string may span tokens; its text is cut; while
   streaming, text that may be the start of a stop string and a partial UTF-8 character are held back); a found
   stop string ends the engine request (``abort('stop')``);
4. **answer**: one JSON body (:meth:`~OpenAIServing.body`), or server-sent events (:meth:`~OpenAIServing.stream`:
   ``data: {chunk}``, ``data: [DONE]``).

Every wait is bounded by the request's deadline (``request_timeout_s``: the engine request is aborted and the
answer is an error), and a client that goes away (``request.is_disconnected()``, or the stream cancelled)
aborts its engine requests, so their rows free at once.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import ClassVar

from pydantic import BaseModel
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .choices import Choice, Disconnected, Run, Tok
from .detokenizer import IncrementalText, detokenize_prompt
from .engine import SamplingParams
from .errors import APIError, unknown_model
from .fields import FieldError
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
    TokenLogprob,
    TopLogprob,
    parse_request,
)
from .state import ServerState

__all__ = ["ChatServing", "CompletionServing", "OpenAIServing"]

# a refusal before anything was submitted: its outcome in the metrics (others: "error")
_REFUSED = {
    400: "bad_request",
    401: "unauthorized",
    404: "bad_request",
    413: "bad_request",
    415: "bad_request",
    429: "rejected",
    503: "rejected",
}
_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """One OpenAI endpoint over the app's state: :meth:`create` answers a POST (the four steps of the module's
    docstring). A subclass owns what differs: :attr:`request_model`, its prompts (:meth:`prompts`, their sizes
    :meth:`prompt_sizes`), what it asks of the engine (:meth:`logprobs`, :meth:`max_tokens`,
    :meth:`prompt_logprobs`), the JSON body (:meth:`body`) and the stream's chunks (:meth:`stream`).

    ``admit``: the app's checks before parsing (the API key, the shutdown, the content type, the body's bound),
    which return the body or raise :class:`APIError`."""

    endpoint: ClassVar[str]  # the endpoint's label in the metrics
    request_model: ClassVar[type[CompletionRequest] | type[ChatRequest]]
    prompt_field: ClassVar[str]  # the field that names a bad prompt
    id_prefix: ClassVar[str]  # of an answer's id

    def __init__(self, state: ServerState, admit: Callable[[Request], Awaitable[bytes]]):
        self.state, self.admit = state, admit

    # -------------------------------------------------------------------------------------------- the flow
    async def create(self, request: Request) -> Response:
        """The answer to one POST: one JSON body, server-sent events, or an error in OpenAI's shape."""
        state, t0 = self.state, time.monotonic()
        try:
            body = await self.admit(request)
            req, errors = parse_request(body, self.request_model, max_messages=state.context_tokens())
            del body
            if errors:
                raise APIError.bad_fields(errors)
            if req.model is not None and req.model != state.model_name:
                raise unknown_model(req.model, state.model_name)
            self.check_sizes(req)
            # the chat template and the tokenizer take time on a long prompt: off the event loop
            choices = await run_in_threadpool(self.choices, req)
            run = Run(state, self.endpoint, request, choices, t0)
            run.submit()
        except APIError as e:
            self._count(_REFUSED.get(e.status, "error"))
            return e.response()
        if req.stream:
            return StreamingResponse(
                self.stream(run, req), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            async for _ in run.events():
                pass
            for c in run.choices:
                run.check_finished(c)
            body = self.body(run, req)
        except Disconnected:
            self._count("disconnect")
            return Response(status_code=499)
        except APIError as e:
            if e.status != 504:
                self._count("error")
            return e.response()
        except BaseException:
            run.abort()
            raise
        self._count("ok")
        return JSONResponse(body)

    def _count(self, outcome: str) -> None:
        self.state.metrics.requests.labels(self.endpoint, outcome).inc()

    def check_sizes(self, req) -> None:
        """The 400s that need no tokenizing and no copy: a prompt longer than the context can hold
        (:meth:`prompt_sizes`), ``n`` × prompts beyond what the engine can ever hold."""
        state = self.state
        cap, ctx, max_chars = state.capacity(), state.context_tokens(), state.max_prompt_chars()
        n_prompts, errors = self.prompt_sizes(req, ctx, max_chars)
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

    def choices(self, req) -> list[Choice]:
        """The engine requests of ``req`` (its prompts' ids, each ``n`` times; ``req`` has passed every check of the
        protocol and :meth:`check_sizes`) after the model's checks; raises the 400 naming every bad field. Runs in
        a worker thread (the chat template and the tokenizer)."""
        tok, eng = self.state.tokenizer, self.state.engine
        errors: list[FieldError] = []
        prompts = self.prompts(req, errors)
        logprobs, limit, prompt_logprobs = self.logprobs(req), self.max_tokens(req), self.prompt_logprobs(req)
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_k = None if req.top_k in (None, 0, -1) else req.top_k
        stops = req.stop_strings()
        lo = req.looplm
        choices = []
        for pi, (ids, source) in enumerate(prompts):
            name = self.prompt_field if len(prompts) == 1 else f"{self.prompt_field}[{pi}]"
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
                    prompt_logprobs=prompt_logprobs,
                    exit=lo.exit if lo else None,
                    loops=lo.loops if lo else None,
                    kv_policy=lo.kv_policy if lo else None,
                    speculative=lo.speculative if lo else None,
                )
                # the engine's one check of the request (Engine.prepare); its samples differ in the seed only
                if i == 0:
                    first, errs = eng.prepare(ids, params)
                    errors += [FieldError(name, f.message) if f.field == "prompt" else f for f in errs]
                    if errs:
                        break  # (the other samples would say the same)
                prepared = first if i == 0 else first.with_seed(params.seed)  # (seed + i < 2^63: protocol-checked)
                choices.append(
                    Choice(
                        index=pi * req.n + i,
                        prompt_index=pi,
                        prompt_ids=ids,
                        params=params,
                        text=IncrementalText(tok, ids, stops),
                        source=source,
                        prepared=prepared,
                    )
                )
        if errors:
            raise APIError.bad_fields(list({(f.field, f.message): f for f in errors}.values()))
        return choices

    async def _events(
        self,
        run: Run,
        first_chunks: Callable[[], Iterator[BaseModel]],
        chunk_of: Callable[[Choice, str, list[Tok], bool], BaseModel],
        usage_chunk: Callable[[], BaseModel] | None,
    ) -> AsyncIterator[str]:
        """The SSE body of :meth:`stream`: ``first_chunks()`` (chat's role, completions' echo), then one chunk per
        change of a choice (``chunk_of(choice, text, tokens, final)``), the usage chunk, ``[DONE]``. An error
        after the headers went out is an error event; a client gone, a cancelled stream or the end of the server
        abort the engine requests first."""
        try:
            for chunk in first_chunks():
                yield _sse(chunk)
            # the client going away cancels this stream (Starlette listens for the disconnect beside it): no polling
            async for c in run.events(watch_disconnect=False):
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
            self._count("ok")
            yield _DONE
        except APIError as e:
            run.abort()
            if e.status != 504:
                self._count("error")
            yield _sse(e.body())
            yield _DONE
        except Disconnected:
            self._count("disconnect")
        finally:  # also when the stream is cancelled (the client went away) or closed early
            run.abort()

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    # -------------------------------------------------------------------------------------------- per endpoint
    def prompt_sizes(self, req, ctx: int | None, max_chars: int | None) -> tuple[int, list[FieldError]]:
        """The number of prompts of ``req`` and the ones too long for a context of ``ctx`` tokens (``max_chars``
        characters), before any tokenizing."""
        raise NotImplementedError

    def prompts(self, req, errors: list[FieldError]) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids and its text as sent (None: token ids or a chat); adds to ``errors`` what stops
        a prompt from being made."""
        raise NotImplementedError

    def logprobs(self, req) -> int | None:
        """The most likely tokens each generated token carries the log-probabilities of (None: no log-probabilities)."""
        raise NotImplementedError

    def max_tokens(self, req) -> int | None:
        """The request's limit on generated tokens (None: what the context leaves)."""
        raise NotImplementedError

    def prompt_logprobs(self, req) -> bool:
        """Whether the engine scores the prompt's tokens too."""
        return False

    def body(self, run: Run, req) -> dict:
        """The JSON answer of a finished ``run``."""
        raise NotImplementedError

    def stream(self, run: Run, req) -> AsyncIterator[str]:
        """The server-sent events of ``run`` as its choices change (:meth:`_events` with this endpoint's chunks)."""
        raise NotImplementedError


class CompletionServing(OpenAIServing):
    """``/v1/completions``: prompts as text or token ids, one or many; ``echo`` (with the prompt's
    log-probabilities: how lm-eval scores a loglikelihood); log-probabilities keyed by token text."""

    endpoint, request_model, prompt_field, id_prefix = "completions", CompletionRequest, "prompt", "cmpl"

    def prompt_sizes(self, req: CompletionRequest, ctx, max_chars):
        prompts, errors = req.prompt_parts(), []
        for i, p in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
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
        return len(prompts), errors

    def prompts(self, req: CompletionRequest, errors):
        tok = self.state.tokenizer
        return [(tok.encode(p), p) if isinstance(p, str) else (p, None) for p in req.prompts()]

    def logprobs(self, req: CompletionRequest):
        return req.logprobs

    def max_tokens(self, req: CompletionRequest):
        return req.max_tokens

    def prompt_logprobs(self, req: CompletionRequest) -> bool:
        return req.echo and req.logprobs is not None

    def body(self, run: Run, req: CompletionRequest) -> dict:
        choices = []
        for c in run.choices:
            text, logprobs = c.text.text, None
            if req.echo:
                ptext, ptoks = self._echo_part(c)
                if req.logprobs is not None:
                    lp_p = self._logprobs_of(ptoks, 0)
                    lp_g = self._logprobs_of(
                        [t for t in c.tokens if t.offset < len(text) or not c.text.stopped], len(ptext)
                    )
                    logprobs = CompletionLogprobs(
                        tokens=lp_p.tokens + lp_g.tokens,
                        token_logprobs=lp_p.token_logprobs + lp_g.token_logprobs,
                        top_logprobs=lp_p.top_logprobs + lp_g.top_logprobs,
                        text_offset=lp_p.text_offset + lp_g.text_offset,
                    )
                text = ptext + text
            elif req.logprobs is not None:
                logprobs = self._logprobs_of(c.visible_tokens(len(text), final=True), 0)
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
            id=self.new_id(), created=int(time.time()), model=self.state.model_name, choices=choices, usage=run.usage()
        ).model_dump()

    def stream(self, run: Run, req: CompletionRequest) -> AsyncIterator[str]:
        rid, created, model = self.new_id(), int(time.time()), self.state.model_name
        bases = {}  # choice index → the offset of its generated text (after an echoed prompt)
        echoed: set[int] = set()  # the choices whose prompt went out with its log-probabilities

        def chunk(choices, usage=None):
            return Completion(id=rid, created=created, model=model, choices=choices, usage=usage)

        def first_chunks():
            for c in run.choices:
                bases[c.index] = 0
                if req.echo and not c.params.prompt_logprobs:  # the prompt's text right away
                    text, _ = self._echo_part(c)
                    bases[c.index] = len(text)
                    yield chunk([CompletionChoice(index=c.index, text=text)])

        def chunk_of(c: Choice, delta: str, toks: list[Tok], final: bool):
            if req.echo and c.params.prompt_logprobs and c.index not in echoed:  # the prompt with its log-probabilities
                echoed.add(c.index)
                ptext, ptoks = self._echo_part(c)
                bases[c.index] = len(ptext)
                toks = ptoks + [Tok(t.id, t.logprob, t.top, t.offset + len(ptext)) for t in toks]
                lp = self._logprobs_of(toks, 0)
                delta = ptext + delta
            else:
                lp = self._logprobs_of(toks, bases.get(c.index, 0)) if req.logprobs is not None else None
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

        usage = (lambda: chunk([], run.usage())) if req.include_usage() else None
        return self._events(run, first_chunks, chunk_of, usage)

    def _echo_part(self, c: Choice) -> tuple[str, list[Tok]]:
        """The echoed prompt's text and, with ``prompt_logprobs``, its tokens with their log-probabilities."""
        tok = self.state.tokenizer
        if not c.params.prompt_logprobs:
            return (c.source if c.source is not None else tok.decode(c.prompt_ids)), []
        text, offsets = detokenize_prompt(tok, c.prompt_ids)
        pe = c.prompt_event
        lps = pe.token_logprobs if pe is not None else [None] * len(c.prompt_ids)
        tops = pe.top_logprobs if pe is not None else [None] * len(c.prompt_ids)
        return text, [Tok(i, lp, top, o) for i, lp, top, o in zip(c.prompt_ids, lps, tops, offsets)]

    def _logprobs_of(self, toks: list[Tok], base: int) -> CompletionLogprobs:
        """``toks`` in the completions' shape: each token's text, log-probability, most likely tokens (the chosen
        one among them) and offset in the answer's text (``base`` + its own)."""
        tok = self.state.tokenizer

        def top_dict(t: Tok) -> dict[str, float]:
            d = {tok.decode([int(i)]): float(lp) for i, lp in (t.top or [])}
            d.setdefault(tok.decode([t.id]), float(t.logprob))
            return d

        return CompletionLogprobs(
            tokens=[tok.decode([t.id]) for t in toks],
            token_logprobs=[_num(t.logprob) for t in toks],
            top_logprobs=[top_dict(t) if t.logprob is not None else None for t in toks],
            text_offset=[base + t.offset for t in toks],
        )


class ChatServing(OpenAIServing):
    """``/v1/chat/completions``: the messages through the tokenizer's chat template (one prompt); the answer an
    assistant message, streamed after a first chunk with its role; log-probabilities in the chat shape."""

    endpoint, request_model, prompt_field, id_prefix = "chat", ChatRequest, "messages", "chatcmpl"

    def prompt_sizes(self, req: ChatRequest, ctx, max_chars):
        # (more messages than the context's tokens: parse_request)
        chars = sum(len(m.text()) + len(m.name or "") for m in req.messages)
        if max_chars is None or chars <= max_chars:
            return 1, []
        return 1, [
            FieldError(
                "messages",
                f"hold {chars} characters, more than the model's context of {ctx} "
                f"tokens can hold with this tokenizer (at most {max_chars}): shorten them",
            )
        ]

    def prompts(self, req: ChatRequest, errors):
        ids = self._chat_prompt(req, errors)
        return [(ids, None)] if ids is not None else []

    def logprobs(self, req: ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None

    def max_tokens(self, req: ChatRequest):
        return req.completion_limit()

    def body(self, run: Run, req: ChatRequest) -> dict:
        choices = []
        for c in run.choices:
            lp = (
                self._logprobs_of(c.visible_tokens(len(c.text.text), final=True))
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
            id=self.new_id(), created=int(time.time()), model=self.state.model_name, choices=choices, usage=run.usage()
        ).model_dump()

    def stream(self, run: Run, req: ChatRequest) -> AsyncIterator[str]:
        rid, created, model = self.new_id(), int(time.time()), self.state.model_name

        def chunk(choices, usage=None):
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)

        def first_chunks():
            for c in run.choices:
                yield chunk([ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})])

        def chunk_of(c: Choice, delta: str, toks: list[Tok], final: bool):
            lp = self._logprobs_of(toks) if c.params.logprobs is not None and toks else None
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

        usage = (lambda: chunk([], run.usage())) if req.include_usage() else None
        return self._events(run, first_chunks, chunk_of, usage)

    def _chat_prompt(self, req: ChatRequest, errors: list[FieldError]) -> list[int] | None:
        """The messages through the tokenizer's chat template, tokenized (None: the template refused them, which
        adds to ``errors``); a 400 where the tokenizer has no template."""
        tok = self.state.tokenizer
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

    def _logprobs_of(self, toks: list[Tok]) -> ChatLogprobs:
        """``toks`` in the chat shape: each token's text, bytes, log-probability and most likely tokens."""
        tok = self.state.tokenizer
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


def _num(x):
    """A log-probability for JSON (``-inf`` is not JSON: the most negative float stands in for it)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else -3.4028234663852886e38


def _sse(obj) -> str:
    """One server-sent event: a wire model in pydantic's own (compiled) JSON encoder — a stream's chunks, one per
    token —, else a dict (an error body) through ``json.dumps``; UTF-8 text either way, not ``\\u`` escapes."""
    if isinstance(obj, BaseModel):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
