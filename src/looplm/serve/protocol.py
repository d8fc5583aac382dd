"""The OpenAI wire format of ``looplm serve``: pydantic request models, the checks that name every bad field,
and the error body.

A request is parsed in two steps, and both collect every problem before answering:

1. :func:`parse_request` validates the JSON body against :class:`CompletionRequest` or :class:`ChatRequest`
   (types, and no field the server does not know: ``extra="forbid"``, so a misspelt or unsupported field is
   refused by name instead of being ignored);
2. :meth:`CompletionRequest.field_errors` / :meth:`ChatRequest.field_errors` check the values: ranges, and
   OpenAI fields the server declares but does not implement beyond their neutral value (``presence_penalty``
   other than 0, a ``logit_bias``, ``tools``, ...).

The server answers 400 with all of them at once, in OpenAI's error shape (:func:`error_body`) plus a ``fields``
list naming each; only a request without any goes on to the checks that depend on the model (context length,
vocabulary, the ``looplm`` extension fields: :meth:`looplm.serve.engine.Engine.check`), so a refused field is
never used to build an engine request.

The response models (:class:`Completion`, :class:`ChatCompletion`, their chunks, :class:`ModelList`) are OpenAI's
shapes; the extensions are marked where they are declared. This module imports pydantic but neither FastAPI nor
uvicorn, nor torch, nor the engine (``tests/test_serve_hardening.py`` holds it).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .fields import MAX_LOGPROBS, FieldError

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatMessage",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "FieldError",
    "LoopLMOptions",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "ModelList",
    "StreamOptions",
    "Usage",
    "error_body",
    "field_error_message",
    "parse_request",
    "pydantic_field_errors",
]

MAX_N = 64  # the most samples one request may ask for (each is an engine request)
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4; lm-eval's `until` lists are a few short strings)
MAX_STOP_CHARS = 256  # characters of one stop string
_SEED_END = 2**63  # seeds are in [0, 2^63) (sample i of n draws from seed + i)


def _null_is_default(cls, v, info: ValidationInfo):
    """``null`` for a field OpenAI types as optional: its default (``"n": null`` is ``n = 1``)."""
    return cls.model_fields[info.field_name].default if v is None else v


class _Strict(BaseModel):
    """Strict types (``"5"`` is not an int, ``1`` is not a bool; an int is a float) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class LoopLMOptions(_Strict):
    """The looped-model extension object ``looplm`` (the openai client: ``extra_body={"looplm": {...}}``).

    ``loops``: the loop count (the engine runs one depth ``K``: other values are refused); ``exit``: this request's
    exit threshold under the engine's criterion (``"kl:0.05"``) or ``"none"`` (full depth); ``kv_policy`` and
    ``speculative``: accepted only where they name what the engine runs (:meth:`Engine.check` says why not)."""

    loops: int | None = None
    exit: str | None = None
    kv_policy: str | None = None
    speculative: Any = None


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and empty ``choices``."""

    include_usage: bool = False
    include_obfuscation: bool | None = None  # sent by newer openai clients; there is nothing to obfuscate


class _Common(_Strict):
    """The fields completions and chat share."""

    model: str | None = None  # None: the served model (OpenAI requires it; curl users may leave it out)
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's name, top level): 0 / -1 / None = off
    seed: int | None = None
    stop: Any = None  # a string or a list of strings (checked in field_errors)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM): decode past EOS until max_tokens
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does with it
    looplm: LoopLMOptions | None = None
    # OpenAI fields the server does not implement: accepted only at their neutral value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    nulls_are_defaults = field_validator("n", "stream", "ignore_eos", mode="before")(classmethod(_null_is_default))

    def _common_errors(self) -> list[FieldError]:
        errs = []
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:  # (NaN fails it too)
            errs.append(FieldError("temperature", f"must be a number in [0, 2] (0 = greedy), got {self.temperature!r}"))
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            errs.append(FieldError("top_p", f"must be a number in (0, 1] (1 = off), got {self.top_p!r}"))
        if self.top_k is not None and self.top_k < -1:
            errs.append(FieldError("top_k", f"must be an int >= 1, or 0 / -1 (off), got {self.top_k!r}"))
        n_ok = 1 <= self.n <= MAX_N
        if not n_ok:
            errs.append(FieldError("n", f"must be an int in [1, {MAX_N}] (independent samples), got {self.n!r}"))
        if self.seed is not None and not (0 <= self.seed and self.seed + (self.n if n_ok else 1) <= _SEED_END):
            errs.append(
                FieldError(
                    "seed",
                    f"must be an int in [0, 2^63 - n] (sample i of n draws from seed + i), "
                    f"got {self.seed!r} with n = {self.n!r}",
                )
            )
        errs += _stop_errors(self.stop)
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            errs.append(FieldError("stop_token_ids", f"token ids are >= 0, got {self.stop_token_ids!r}"))
        if self.stream_options is not None and not self.stream:
            errs.append(FieldError("stream_options", "is only allowed with stream=true"))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                errs.append(
                    FieldError(name, f"is not supported by looplm serve (only 0 / absent), got {v!r}: remove it")
                )
        if self.logit_bias:
            errs.append(FieldError("logit_bias", "is not supported by looplm serve (only {} / absent): remove it"))
        return errs

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (``None`` and ``[]`` are no stop strings)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _stop_errors(stop) -> list[FieldError]:
    """``stop``: None, a non-empty string or a list of at most :data:`MAX_STOP_STRINGS` of them, each at most
    :data:`MAX_STOP_CHARS` characters (the bounds keep the stop search cheap)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        return [FieldError("stop", f"must be a non-empty string or a list of non-empty strings, got {_short(stop)}")]
    if len(stops) > MAX_STOP_STRINGS:
        return [
            FieldError(
                "stop",
                f"holds {len(stops)} stop strings, more than this server's bound of "
                f"{MAX_STOP_STRINGS}: send at most {MAX_STOP_STRINGS}",
            )
        ]
    longest = max(len(s) for s in stops) if stops else 0
    if longest > MAX_STOP_CHARS:
        return [
            FieldError(
                "stop",
                f"holds a stop string of {longest} characters, more than this server's bound of "
                f"{MAX_STOP_CHARS}: shorten it",
            )
        ]
    return []


class CompletionRequest(_Common):
    """``POST /v1/completions`` (OpenAI's legacy completions, as lm-evaluation-harness uses them).

    ``prompt``: a string, a list of strings, a list of token ids or a list of token-id lists (each prompt gets
    ``n`` choices, index ``prompt_index * n + i``). ``logprobs``: 0..20 (the chosen token's log-probability and
    the ``logprobs`` most likely); ``echo``: the prompt's text in front of each choice's, with its tokens'
    log-probabilities when ``logprobs`` is set (``max_tokens=0`` scores a text without generating)."""

    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    nulls_are_defaults_completions = field_validator("echo", mode="before")(classmethod(_null_is_default))

    def field_errors(self) -> list[FieldError]:
        errs = _prompt_errors(self.prompt) + self._common_errors()
        if self.max_tokens is not None and self.max_tokens < 0:
            errs.append(FieldError("max_tokens", f"must be >= 0, got {self.max_tokens!r}"))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            errs.append(FieldError("logprobs", f"must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"))
        if self.best_of is not None and self.best_of != self.n:
            errs.append(
                FieldError(
                    "best_of", f"is not supported other than best_of = n ({self.n}), got {self.best_of!r}: remove it"
                )
            )
        if self.suffix:
            errs.append(FieldError("suffix", "is not supported by looplm serve (no insertion): remove it"))
        return errs

    def prompt_parts(self) -> list:
        """The prompts as sent, without a copy: each a string or a list of token ids (``prompt`` checked)."""
        p = self.prompt
        return [p] if isinstance(p, str) or _is_token_ids(p) else p

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids (``prompt`` checked by :meth:`field_errors`)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt_errors(prompt) -> list[FieldError]:
    what = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if prompt is None:
        return [FieldError("prompt", f"is required: {what}")]
    if isinstance(prompt, str):
        return []
    if not isinstance(prompt, list) or not prompt:
        return [FieldError("prompt", f"must be {what} (not empty), got {_short(prompt)}")]
    if _is_token_ids(prompt):
        return [FieldError("prompt", "token ids must be >= 0")] if min(prompt) < 0 else []
    errs = []
    for i, x in enumerate(prompt):
        if isinstance(x, str):
            continue
        if not _is_token_ids(x) or not x:
            errs.append(
                FieldError(f"prompt[{i}]", f"must be a string or a non-empty list of token ids, got {_short(x)}")
            )
        elif min(x) < 0:
            errs.append(FieldError(f"prompt[{i}]", "token ids must be >= 0"))
    return errs


def _short(v, n: int = 60) -> str:
    """``v`` for an error message: JSON, ASCII only (a lone surrogate or a control character is escaped, so the
    message can always be sent), at most ``n`` characters."""
    if isinstance(v, (bytes, bytearray)):
        s = f"{len(v)} bytes"
    else:
        try:
            s = json.dumps(v, ensure_ascii=True, default=lambda o: type(o).__name__)
        except (RecursionError, ValueError):  # nested too deeply / a circular structure
            s = f"a {type(v).__name__} nested too deeply to show"
    return s if len(s) <= n else s[: n - 3] + "..."


class ContentPart(_Strict):
    """One part of a message's content: only text (``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message. ``content``: a string or a list of text parts; ``developer`` is taken as ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: str


class ChatRequest(_Common):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older ``max_tokens``): None = what the
    context leaves after the prompt. ``logprobs`` (bool) with ``top_logprobs`` 0..20."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI fields accepted only at their neutral value
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # extension (vLLM): end the prompt with the assistant's turn header

    nulls_are_defaults_chat = field_validator("logprobs", "add_generation_prompt", mode="before")(
        classmethod(_null_is_default)
    )

    def field_errors(self) -> list[FieldError]:
        errs = self._common_errors()
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                errs.append(FieldError(name, f"must be >= 1, got {v!r}"))
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            errs.append(
                FieldError("max_completion_tokens", f"differs from max_tokens ({self.max_tokens}): give one of them")
            )
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                errs.append(
                    FieldError("top_logprobs", f"must be an int in [0, {MAX_LOGPROBS}], got {self.top_logprobs!r}")
                )
            elif not self.logprobs:
                errs.append(FieldError("top_logprobs", "needs logprobs=true"))
        if self.response_format is not None and self.response_format.type != "text":
            errs.append(
                FieldError(
                    "response_format", f"only {{'type': 'text'}} is supported, got type {self.response_format.type!r}"
                )
            )
        if self.tools:
            errs.append(FieldError("tools", "tool calls are not supported by looplm serve: remove tools"))
        if self.tool_choice not in (None, "none"):
            errs.append(
                FieldError(
                    "tool_choice", f"tool calls are not supported by looplm serve, got {_short(self.tool_choice)}"
                )
            )
        if self.parallel_tool_calls:
            errs.append(FieldError("parallel_tool_calls", "tool calls are not supported by looplm serve: remove it"))
        return errs

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """The messages as ``apply_chat_template`` takes them (``developer`` → ``system``)."""
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


# ------------------------------------------------------------------------------------------------ parsing
def _loc_name(loc: tuple) -> str:
    """``('messages', 0, 'role')`` → ``messages[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def pydantic_field_errors(err: ValidationError) -> list[FieldError]:
    """One :class:`FieldError` per distinct bad field of a pydantic error (unions' per-member errors merged)."""
    seen: dict[str, FieldError] = {}
    for e in err.errors(include_url=False):
        loc = tuple(
            p for p in e["loc"] if isinstance(p, int) or not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))
        )
        name = _loc_name(loc)
        if name in seen:
            continue
        if e["type"] == "extra_forbidden":
            msg = "is not a field looplm serve supports (unknown or unimplemented): remove it"
        elif e["type"] == "missing":
            msg = "is required"
        else:
            msg = f"{e['msg'][0].lower()}{e['msg'][1:]}, got {_short(e.get('input'))}"
        seen[name] = FieldError(name, msg)
    return list(seen.values())


_UNION_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "function-after",
    "function-before",
    "ContentPart",
    "StreamOptions",
    "LoopLMOptions",
    "ResponseFormat",
}


def parse_request(
    body: bytes, model: type[_Common], max_messages: int | None = None
) -> tuple[_Common | None, list[FieldError]]:
    """The request in ``body`` (UTF-8 JSON; a leading BOM is ignored) and every error found in it: the request
    only when there is none (a refused field is never used). ``max_messages``: more messages than this (the
    context's tokens) are refused before any is validated."""
    try:
        text = bytes(body).decode("utf-8")  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as e:
        return None, [FieldError("body", f"is not UTF-8 (byte {e.start}: {e.reason}): send the JSON encoded as UTF-8")]
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        # pydantic's JSON parser: it refuses a lone surrogate (``"\ud800"``: no tokenizer can encode it) and
        # nesting deeper than its recursion limit (json.loads raises RecursionError there)
        data = pydantic_core.from_json(text or "null")
    except ValueError as e:
        hint = " (a \\uD800-\\uDFFF escape must be half of a surrogate pair)" if "hex escape" in str(e) else ""
        return None, [FieldError("body", f"is not valid JSON ({e}){hint}: send one JSON object")]
    if not isinstance(data, dict):
        return None, [FieldError("body", f"must be a JSON object, got {_short(data)}")]
    messages = data.get("messages")
    if max_messages is not None and isinstance(messages, list) and len(messages) > max_messages:
        return None, [
            FieldError(
                "messages",
                f"holds {len(messages)} messages, more than the model's context of "
                f"{max_messages} tokens can hold: send fewer",
            )
        ]
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        errs = pydantic_field_errors(e)
        # the value checks of the fields that did parse, so that one answer names every bad field
        bad = {loc[0] for loc in (err["loc"] for err in e.errors(include_url=False)) if loc}
        try:
            rest = model.model_validate({k: v for k, v in data.items() if k not in bad})
        except ValidationError:
            return None, errs
        return None, errs + [f for f in rest.field_errors() if f.field.split(".")[0].split("[")[0] not in bad]
    errs = req.field_errors()
    return (None, errs) if errs else (req, [])


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    fields: list[FieldError] | None = None,
) -> dict:
    """OpenAI's error JSON ``{"error": {message, type, param, code}}``; ``fields``: every bad field (their names
    in ``param``, joined by ``", "``, and each with its message in ``error.fields``)."""
    err: dict[str, Any] = {"message": message, "type": type, "param": param, "code": code}
    if fields:
        err["param"] = ", ".join(dict.fromkeys(f.field for f in fields))
        err["fields"] = [{"param": f.field, "message": f.message} for f in fields]
    return {"error": err}


def field_error_message(fields: list[FieldError]) -> str:
    """``"max_tokens: must be >= 0; top_p: ..."``: every bad field with what to do."""
    return "; ".join(f"{f.field}: {f.message}" for f in fields)


# ------------------------------------------------------------------------------------------------ responses
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceStats(_Out):
    """The looped-model extension of a choice: ``loops``, the mean loops its generated tokens ran."""

    loops: float | None = None


class CompletionLogprobs(_Out):
    """OpenAI's legacy completions log-probabilities: per token its text, its log-probability (None for the
    first prompt token under ``echo``), the most likely tokens with theirs (the chosen one included) and the
    offset of its text in the choice's text."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class _ChoiceBase(_Out):
    """What every choice carries: its index, why it ended (None while streaming) and the looplm extension."""

    index: int
    finish_reason: str | None = None
    looplm: ChoiceStats | None = None


class _ResponseBase(_Out):
    """What every response (and streamed chunk) carries; ``usage`` None in a chunk unless it is the last."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionChoice(_ChoiceBase):
    text: str
    logprobs: CompletionLogprobs | None = None


class Completion(_ResponseBase):
    """A ``text_completion`` (also each streamed chunk, with one choice and ``usage`` None)."""

    object: str = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Out):
    role: str = "assistant"
    content: str


class ChatChoice(_ChoiceBase):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_ResponseBase):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class ChatChunkChoice(_ChoiceBase):
    delta: dict[str, str]  # {"role": "assistant"} first, then {"content": ...}; {} with the finish_reason
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_ResponseBase):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(_Out):
    """One entry of ``GET /v1/models``; ``max_model_len`` and ``looplm`` (its depth ``K`` and what the engine
    runs) are extensions."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "looplm"
    max_model_len: int | None = None
    looplm: dict[str, Any] | None = None


class ModelList(_Out):
    object: str = "list"
    data: list[ModelCard]
