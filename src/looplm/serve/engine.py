"""The serving engine: continuous batching of requests that arrive at any time, each row at its own depth.

One engine thread owns the model. Callers (the HTTP server, a test, a load generator) :meth:`Engine.submit`
a prompt with its :class:`SamplingParams` and a callback — or :meth:`Engine.submit_group` the samples of one
request, all at once or none; the engine calls it from its thread with a :class:`PromptEvent` (only for
``prompt_logprobs``), one :class:`TokenEvent` per generated token and, last, one :class:`FinishEvent`. A
:class:`RequestHandle` aborts a request from any thread.

The engine owns the API types, the checks (:meth:`Engine.check`, at submit, before any work), the thread and the
events; each *step* of its thread is schedule -> run -> sample -> output, each its own module:

    0. the inbox: new requests (a group at a time) and aborts, thread-safe;
    1. **schedule** (:mod:`.scheduler`, pure Python): the plan of the step — which rows start their next token
       (fitted to the KV budget, the youngest requests preempted where they outgrow it) and which prompt chunk
       runs (the one being prefilled, or the oldest waiting request's, when a row is free and the budget holds it),
       or which whole prompts run together (batched prefill: the waiting prompts, in order, whose padded tokens fit
       in one chunk);
    2. **run** (:mod:`.runner`): the prompt chunk runs at full depth in a cache of its own (one chunk of
       ``prefill_chunk`` tokens per step, so a long prompt does not stall the rows decoding), or the batch of whole
       prompts as one right-padded forward (each prompt's tokens before its padding: under causal attention they
       compute as alone; only where a prompt's caches are attention KV, no Mamba-2 state); after its last chunk a
       prompt's slots are copied into its row's columns ``< p`` of the batch cache (``place``). With
       ``EngineConfig.prefill='exit'`` a prompt whose request takes exits runs at adaptive depth instead, whole,
       in one call: its tokens after the first take the exits at the request's threshold, all at once
       (:func:`looplm.decode.exit_forward.adaptive_forward`, which leaves its cache as decoding the prompt token
       by token would; ``Exit(prefill='exit')`` of ``model.generate``). Then **one core pass** over every row in
       flight (continuous depth batching, :class:`looplm.decode.depth_schedule.DepthBatchedDecoder`): each row is
       at its own loop of its own token; rows whose criterion fires leave through the coda and the head
       (``step() -> StepOutput(rows, logits, depths)``). ``exit_schedule='token'`` runs the token schedule instead:
       a row that exits waits until every row of the batch has left, and all start the next token together (the
       same arithmetic per row, a batch's time set by its deepest row);
    3. **sample** (:mod:`.sampler`): each exited row's next token with its own request's parameters and generator,
       and the prompt's first token after its last chunk (it starts at the next step);
    4. **output**: the events; a request that ends frees its row (the scheduler).

A row frees the moment its request ends (finished, a stop, an abort or a disconnect): an aborted row whose
token is still looping leaves when that token exits (at most ``K`` passes later) and its token is dropped.

What shares a batch: one engine runs one exit criterion (``EngineConfig.exit``: ``kl``, ``convergence`` or
``gate``; ``None`` = full depth), one KV / SSM policy and one depth ``K``. Under ``kl`` and ``convergence``
each request may carry its own threshold ε (``exit='kl:0.05'``) or ask for full depth (``exit='none'``): the
criterion compares every row with its own ε (ε = 0 never exits). Under ``gate`` the rule also reads q for its
output selection, so every request runs the server's q. Anything else — another criterion, another policy,
another ``loops``, ``speculative`` — is refused by :meth:`Engine.check` with a :class:`FieldError` naming the
field, before any work.

Exactness: a row's arithmetic depends only on its own tokens (per-row columns, masks and positions; the
prompt prefilled alone, or before its padding in a batch of prompts), and sampling draws from the request's own generator (``seed``), so a request's output
does not depend on the other requests in the batch; in fp32 greedy output equals ``model.generate`` of the
prompt alone, at full depth and under each criterion (with ``prefill='exit'``: ``generate`` with
``Exit(prefill='exit')``; with batched prefill too), up to the row count of the products
(``tests/test_serve_engine.py``).
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .fields import MAX_LOGPROBS, FieldError  # (torch-free, for the wire format; re-exported here)
from .scheduler import PrefillChunk, Request, RequestStatus, Scheduler

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "FieldError",
    "FinishEvent",
    "PreparedRequest",
    "PromptEvent",
    "QueueFull",
    "RequestError",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
    "parse_kv_budget",
]

SERVED_CRITERIA = ("kl", "convergence", "gate")  # the exit criteria a batch can run (per-row thresholds or q)


# ---------------------------------------------------------------------------------------------- the API types
@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding options (checked by :meth:`Engine.check`; the OpenAI names where one exists).

    ``temperature`` 0 is greedy; ``top_k`` 0 / -1 / None and ``top_p`` 1 / None are off. ``seed`` fixes the
    request's own sampling generator (None: a fresh random one). ``logprobs``: None (none), 0 (the chosen
    token's) or k <= 20 (and the k most likely); ``prompt_logprobs`` (echo): the prompt tokens' too, in one
    :class:`PromptEvent`. ``exit``: this request's exit spec (None: the engine's; ``'none'``: full depth; else
    ``'CRITERION:THRESHOLD'`` of the engine's criterion). ``loops`` / ``kv_policy`` / ``speculative``: the
    looped-model extension fields, accepted where they name what the engine runs."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    exit: str | None = None
    loops: int | None = None
    kv_policy: str | None = None
    speculative: object = None


@dataclass
class TokenEvent:
    """A generated token: its id, its log-probability under the model (``log_softmax`` of the raw logits, before
    temperature; None unless asked), the ``top_logprobs`` [(id, logprob)] asked for, the loops it ran (``depth``)
    and whether it is a stop token (EOS or one of ``stop_token_ids``: the last token of the request)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list | None = None
    depth: int = 0
    stop: bool = False


@dataclass
class PromptEvent:
    """The prompt's log-probabilities (``prompt_logprobs``): per prompt token, ``log p(token | tokens before)``
    (None for the first) and the top ``logprobs`` alternatives [(id, logprob)] (None for the first)."""

    token_logprobs: list
    top_logprobs: list


@dataclass
class FinishEvent:
    """A request's last event. ``reason``: ``'stop'`` (a stop token, or :meth:`RequestHandle.abort` with
    ``'stop'``: a stop string), ``'length'`` (``max_tokens``), ``'abort'`` (aborted: a disconnect, a timeout,
    the shutdown) or ``'error'`` (``error`` says what). ``loops``: the mean loops of its generated tokens."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    loops: float | None = None


class RequestError(ValueError):
    """A request the engine refuses, before any work: every bad field named."""

    def __init__(self, errors: list[FieldError]):
        self.errors = list(errors)
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in self.errors))


class QueueFull(RuntimeError):
    """The bounded queue of waiting requests is full (``EngineConfig.max_waiting``): try again later."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped: it takes no new request."""


@dataclass
class EngineConfig:
    """How the engine batches. ``max_batch``: rows decoded at once; ``max_model_len``: prompt + generated tokens
    of one request (default and upper bound: the model's ``max_seq_len``; it sizes every row's cache);
    ``exit``: the criterion every row is checked with (``'kl:0.01'``, an :class:`~looplm.decode.exits.Exit` or
    its dict; None = full depth); ``exit_schedule``: ``'depth'`` (each row at its own loop) or ``'token'``;
    ``prefill``: ``'full'`` (a prompt at every loop, the default) or ``'exit'`` (a prompt whose request takes exits
    at adaptive depth, whole: ``prefill_chunk`` must then be None);
    ``max_waiting``: the bounded queue (a request beyond it gets :class:`QueueFull`); ``prefill_chunk``: the
    most prompt tokens prefilled per step: one prompt's chunk, or whole prompts prefilled together (requests ×
    the longest prompt; None: one whole prompt a step); ``kv_budget``: the cache tokens requests may
    hold (:func:`parse_kv_budget`: an int or ``'4096'`` in cache tokens — one token's keys and values at one loop
    slot of every layer — or ``'2GiB'`` / ``'512MiB'`` / ``'1.5GB'`` of memory; None: the whole cache block).
    A request counts ``(prompt + max_tokens) × S`` cache tokens at its admission, ``S`` the loop slots its
    policy keeps per layer (K, or 1 under ``kv_policy='shared'``), and ``(columns written) × S`` while it runs."""

    max_batch: int = 8
    max_model_len: int | None = None
    exit: object = None
    exit_schedule: str = "depth"
    kv_policy: str | None = None
    ssm_policy: str | None = None
    max_waiting: int = 64
    prefill_chunk: int | None = 256
    kv_budget: int | str | None = None
    prefill: str = "full"

    def __post_init__(self):
        errs = []
        if self.kv_budget is not None:
            try:
                parse_kv_budget(self.kv_budget)
            except ValueError as e:
                errs.append(str(e))
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            errs.append(f"max_batch must be an int >= 1 (rows decoded at once), got {self.max_batch!r}")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            errs.append(
                f"max_model_len must be an int >= 2 or None (the model's max_seq_len), got {self.max_model_len!r}"
            )
        if self.exit_schedule not in ("depth", "token"):
            errs.append(
                f"exit_schedule must be 'depth' (each row at its own loop) or 'token', got {self.exit_schedule!r}"
            )
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            errs.append(f"max_waiting must be an int >= 0 (the bounded queue), got {self.max_waiting!r}")
        if self.prefill_chunk is not None and (
            isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 2
        ):
            errs.append(
                f"prefill_chunk must be an int >= 2 (prompt tokens per step) or None (whole prompts), got {self.prefill_chunk!r}"
            )
        if self.prefill not in ("full", "exit"):
            errs.append(
                f"prefill must be 'full' (a prompt at every loop) or 'exit' (its tokens after the first take the "
                f"exits), got {self.prefill!r}"
            )
        elif self.prefill == "exit" and self.exit is None:
            errs.append(
                "prefill='exit' needs an exit criterion (exit='kl:0.01', ...): at full depth there is none to take"
            )
        elif self.prefill == "exit" and self.prefill_chunk is not None:
            errs.append(
                f"prefill='exit' runs each prompt whole, in one call (its exits over the whole prompt at once); "
                f"set prefill_chunk=None (got {self.prefill_chunk!r})"
            )
        if errs:
            raise ValueError("EngineConfig: " + "; ".join(errs))


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_kv_budget(value) -> tuple[str, float]:
    """``--kv-budget``: ``('tokens', n)`` for an int or a number of cache tokens (``'4096'``, ``'4096 tokens'``),
    ``('bytes', n)`` for a memory size (``'2GiB'``, ``'512 MiB'``, ``'1.5GB'``). Raises ValueError naming it."""
    what = (
        f"kv_budget must be a number of cache tokens (an int >= 1, e.g. 4096) or a memory size such as '2GiB' "
        f"or '512MiB', got {value!r}"
    )
    if isinstance(value, bool):
        raise ValueError(what)
    if isinstance(value, int):
        if value < 1:
            raise ValueError(what)
        return "tokens", float(value)
    if not isinstance(value, str):
        raise ValueError(what)
    text = value.strip().lower().replace("_", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz ").strip()
    unit = text[len(num) :].strip() or "tokens"
    try:
        n = float(num)
    except ValueError:
        raise ValueError(what) from None
    if not math.isfinite(n) or n <= 0:
        raise ValueError(what)
    if unit in ("tokens", "token", "tok"):
        if n != int(n) or n < 1:
            raise ValueError(what)
        return "tokens", n
    if unit not in _UNITS:
        raise ValueError(what + f" (unknown unit {unit!r}: use tokens, KiB, MiB, GiB, KB, MB or GB)")
    return "bytes", n * _UNITS[unit]


class RequestHandle:
    """What :meth:`Engine.submit` returns: the request's ``id``; :meth:`abort` ends it from any thread."""

    def __init__(self, engine: "Engine", rid: int):
        self._engine, self.id = engine, rid

    def abort(self, reason: str = "abort") -> None:
        """End the request: ``'abort'`` (a disconnect, a timeout) or ``'stop'`` (the caller found a stop
        string). Its :class:`FinishEvent` follows; tokens it was still computing are dropped."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"abort reason must be 'abort' or 'stop', got {reason!r}")
        self._engine._inbox.put(("abort", self.id, reason))
        self._engine._wake.set()


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A request that passed :meth:`Engine.check` — the one validation pass — made by :meth:`Engine.prepare`, which
    :meth:`Engine.submit_group` queues without checking it again. ``thr`` / ``checks``: its exit threshold and
    whether its tokens are checked at all (:meth:`Engine._threshold`)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    thr: float
    checks: bool
    engine: "Engine"

    def with_seed(self, seed: int | None) -> "PreparedRequest":
        """The same request with another ``seed`` (the samples of one prompt differ only in it): only the seed is
        checked, not the prompt again. Raises :class:`RequestError` (``seed``) outside ``[0, 2^63)``."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise RequestError([FieldError("seed", f"must be an int in [0, 2^63), got {seed!r}")])
        return replace(self, params=replace(self.params, seed=seed))


# ---------------------------------------------------------------------------------------------- the engine
@dataclass(eq=False)
class _Request(Request):
    """One request inside the engine (its thread's own: no lock): the scheduler's state
    (:class:`~looplm.serve.scheduler.Request`) and what the engine needs besides."""

    params: SamplingParams = None
    on_event: Callable = None
    thr: float = 0.0  # its exit threshold ε (0 under a criterion that is off: full depth)
    checks: bool = False  # whether its tokens are checked at all
    gen: torch.Generator | None = None  # its own sampling generator (seed)
    prompt_lp: list | None = None  # (echo) per prompt token: its logprob and top alternatives
    prompt_top: list | None = None
    prompt_reported: bool = False  # its prompt was counted (and its PromptEvent sent): not again after a preemption


class Engine:
    """Continuous batching of requests over one model (module docstring). ``start()`` it, :meth:`submit`
    requests from any thread, :meth:`shutdown` at the end; :meth:`check` names every bad field of a request
    before any work. ``eos_token_id``: the tokenizer's end of text (a request stops there unless
    ``ignore_eos``).

    The model is the engine's while it runs: its decode steps (:func:`looplm.decode.sampling.decode_context`) are
    switched in for the engine's batch size, so another caller should not run it meanwhile."""

    def __init__(self, model, config: EngineConfig | None = None, eos_token_id: int | None = None):
        from ..decode.exits import Exit
        from . import sampler

        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model, self.config, self.eos_token_id = model, config, eos_token_id
        self._sampler = sampler
        limit = int(model.config.max_seq_len)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"EngineConfig: max_model_len={config.max_model_len} exceeds the model's max_seq_len={limit}; "
                f"give at most {limit}"
            )
        self.max_model_len = config.max_model_len or limit
        policies = dict(kv=config.kv_policy, ssm=config.ssm_policy, schedule="depth", prefill="full")
        if config.exit is None:  # full depth: an ε of 0 that is never checked
            self.criterion = None
            spec = Exit(criterion="convergence", threshold=0.0)
        else:
            spec = Exit.parse(config.exit)
            if spec.criterion not in SERVED_CRITERIA:
                raise ValueError(
                    f"EngineConfig: exit criterion {spec.criterion!r} cannot be served; give 'kl:EPS', "
                    "'convergence:EPS', 'gate:Q' or None (full depth)"
                )
            if spec.max_batch is not None or spec.compile or spec.min_loops != 1:
                raise ValueError(
                    "EngineConfig: exit may not set max_batch (EngineConfig.max_batch is the batch), "
                    "compile or min_loops when served"
                )
            self.criterion = spec.criterion
        try:
            self.exit = spec.with_policies(**policies).resolved(model, config.max_batch)
            # a prompt at adaptive depth (prefill='exit'): the same exit over one prompt alone, checked here once
            self._prefill_exit = (
                spec.with_policies(**{**policies, "prefill": "exit"}).resolved(model, 1)
                if config.prefill == "exit"
                else None
            )
        except ValueError as e:
            raise ValueError(f"looplm serve cannot run this model with these options: {e}") from None
        self.K = int(self.exit.max_loops)
        self.threshold = float(self.exit.threshold) if self.criterion else None  # the server's ε or q
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # submit's count of requests in the inbox and the closed flag
        self._pending = 0  # submitted, still in the inbox (the scheduler counts the rest: Scheduler.num_held)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # shutdown: when the rest are ended
        self._totals = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished": 0, "preempted": 0}
        self._exits = [0] * self.K  # generated tokens by the loops they ran
        self._finished: dict[str, int] = {}  # requests finished, by reason (stop, length, abort, error)
        self._gauges = {"running": 0, "waiting": 0, "kv_tokens_used": 0}
        self.last_error: str | None = None
        self.runner = None  # the model step (start(): runner.ModelRunner)
        self.scheduler: Scheduler | None = None  # the queues, rows and KV budget (start())
        self._budget: int | None = None  # cache tokens requests may hold (start(): from config.kv_budget)
        self._S = 1  # loop slots a token keeps per layer (K, or 1 under kv='shared'): its cache tokens

    # ------------------------------------------------------------------------------------------ public
    def describe(self) -> str:
        crit = "full depth" if self.criterion is None else f"exit {self.criterion}:{self.threshold:g}"
        out = (
            f"K={self.K}, {crit}, {self.config.exit_schedule} schedule, kv={self.exit.kv}, max_batch={self.config.max_batch}, "
            f"max_model_len={self.max_model_len}"
        )
        if self._prefill_exit is not None:
            out += ", prompts at adaptive depth (prefill exit)"
        if self.runner is not None:
            cap = self.config.max_batch * self.max_model_len * self._S
            per = self.runner.bytes_per_token
            out += (
                f", KV cache {cap * per / 2**20:.1f} MiB ({cap} cache tokens = {self.config.max_batch} rows "
                f"× {self.max_model_len} × {self._S} loop slots)"
            )
            if self._budget is not None:
                out += f", KV budget {self._budget} cache tokens ({self._budget * per / 2**20:.1f} MiB)"
        return out

    def start(self) -> "Engine":
        """Build the batch's decoder (its caches: ``max_batch`` rows × ``max_model_len`` columns per loop slot)
        and start the engine thread. Errors of the model or options raise here."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.model.eval()
        self._build()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="looplm-engine", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def check(self, prompt_ids, params: SamplingParams) -> list[FieldError]:
        """Every bad field of a request (empty: it can run), named as the OpenAI request spells it
        (``looplm.*``: the extension object's fields)."""
        p, errs = params, []

        def bad(name, msg):
            errs.append(FieldError(name, msg))

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(p.max_tokens) or p.max_tokens < 0:
            bad("max_tokens", f"must be an int >= 0, got {p.max_tokens!r}")
        if (
            isinstance(p.temperature, bool)
            or not isinstance(p.temperature, (int, float))
            or not 0 <= p.temperature < math.inf
        ):
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {p.temperature!r}")
        if p.top_p is not None and (
            isinstance(p.top_p, bool) or not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1
        ):
            bad("top_p", f"must be in (0, 1] (1 = off), got {p.top_p!r}")
        if p.top_k is not None and (not is_int(p.top_k) or p.top_k < -1):
            bad("top_k", f"must be an int >= 0 (0 or -1 = off), got {p.top_k!r}")
        if p.seed is not None and (not is_int(p.seed) or not 0 <= p.seed < 2**63):
            bad("seed", f"must be an int in [0, 2^63), got {p.seed!r}")
        if p.logprobs is not None and (not is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an int in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")
        V = int(self.model.config.vocab_size)
        if any(not is_int(t) or not 0 <= t < V for t in p.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {V}), got {list(p.stop_token_ids)!r}")
        ids = list(prompt_ids) if prompt_ids is not None else []
        if not ids:
            bad("prompt", "is empty: give at least one token")
        elif (out := next((t for t in ids if not is_int(t) or not 0 <= t < V), None)) is not None:
            bad("prompt", f"token id {out!r} is not in the model's vocabulary (ids in [0, {V}))")
        elif is_int(p.max_tokens) and p.max_tokens >= 0 and len(ids) + p.max_tokens > self.max_model_len:
            room = self.max_model_len - len(ids)
            bad(
                "prompt" if room <= 0 else "max_tokens",
                f"the prompt's {len(ids)} tokens + max_tokens {p.max_tokens} exceed the model's context of {self.max_model_len} "
                f"tokens; "
                + ("shorten the prompt" if room <= 0 else f"ask for at most {room} tokens or shorten the prompt"),
            )
        elif (
            self._budget is not None
            and is_int(p.max_tokens)
            and p.max_tokens >= 0
            and (len(ids) + p.max_tokens) * self._S > self._budget
        ):
            room = self._budget // self._S - len(ids)
            bad(
                "prompt" if room <= 0 else "max_tokens",
                f"the prompt's {len(ids)} tokens + max_tokens {p.max_tokens} need {(len(ids) + p.max_tokens) * self._S} cache "
                f"tokens ({self._S} loop slots per token), more than this server's KV budget of {self._budget}; "
                + ("shorten the prompt" if room <= 0 else f"ask for at most {room} tokens or shorten the prompt")
                + " (or start the server with a larger --kv-budget)",
            )
        if p.exit is not None:
            try:
                self._threshold(p.exit)
            except ValueError as e:
                bad("looplm.exit", str(e))
        if p.loops is not None and (not is_int(p.loops) or p.loops != self.K):
            bad(
                "looplm.loops",
                f"this server runs every token's loops up to K={self.K} (its exit criterion picks "
                f"fewer); got {p.loops!r}: leave it out or give {self.K}",
            )
        if p.kv_policy is not None and p.kv_policy != self.exit.kv:
            bad(
                "looplm.kv_policy",
                f"this server's caches run kv_policy {self.exit.kv!r} (every row of a batch shares "
                f"them); got {p.kv_policy!r}: leave it out, or start a server with --kv-policy {p.kv_policy}",
            )
        if p.speculative not in (None, False, 0):
            bad(
                "looplm.speculative",
                f"self-speculative decoding is not served (it decodes one request per batch); "
                f"got {p.speculative!r}: leave it out, or use `looplm generate --speculative`",
            )
        return errs

    def prepare(self, prompt_ids, params: SamplingParams) -> tuple[PreparedRequest | None, list[FieldError]]:
        """The one validation pass of a request: ``(the request, [])`` ready for :meth:`submit_group`, or ``(None,
        every bad field)`` (:meth:`check`)."""
        errs = self.check(prompt_ids, params)
        if errs:
            return None, errs
        thr, checks = self._threshold(params.exit)
        return PreparedRequest(tuple(prompt_ids), params, thr, checks, self), []

    def submit(self, prompt_ids, params: SamplingParams, on_event: Callable) -> RequestHandle:
        """Queue a request; ``on_event(event)`` is called from the engine thread (keep it short). Raises
        :class:`RequestError` (bad fields), :class:`QueueFull` or :class:`EngineClosed`."""
        return self.submit_group([(prompt_ids, params, on_event)])[0]

    def submit_group(self, requests: list) -> list[RequestHandle]:
        """Queue ``requests`` ``[(prompt_ids, params, on_event)]`` or ``[(prepared, on_event)]`` (a
        :class:`PreparedRequest` of this engine: checked already, not again) — the samples of one request (``n``,
        or prompts × ``n``) — all at once or not at all: every field of every one is checked, then the capacity for
        the whole group, before any is queued. Raises, with nothing queued, :class:`RequestError` (bad fields, each named once;
        or a group larger than the server ever holds: ``max_batch + max_waiting``, field ``n``), :class:`QueueFull`
        (it does not fit now) or :class:`EngineClosed`. Returns their handles, in order."""
        requests = list(requests)
        if not requests:
            raise ValueError("submit_group needs at least one (prompt_ids, params, on_event)")
        errs: list[FieldError] = []
        prepared: list[tuple[PreparedRequest, Callable]] = []
        for item in requests:
            if len(item) == 2:  # (prepared, on_event)
                pr, on_event = item
                if not isinstance(pr, PreparedRequest) or pr.engine is not self:
                    raise TypeError(
                        "submit_group: a 2-tuple item must be (PreparedRequest made by this engine's prepare(), "
                        f"on_event); got {type(pr).__name__}"
                    )
            else:
                prompt_ids, params, on_event = item
                pr, bad = self.prepare(prompt_ids, params)
                errs += [e for e in bad if e not in errs]
            prepared.append((pr, on_event))
        n, B, W = len(requests), self.config.max_batch, self.config.max_waiting
        if not errs and n > B + W:
            errs.append(
                FieldError(
                    "n",
                    f"this request asks for {n} sequences at once (prompts × n); this server holds at "
                    f"most {B + W} (max_batch {B} + max_waiting {W}): ask for at most {B + W}",
                )
            )
        if errs:
            raise RequestError(errs)
        device = next(self.model.parameters()).device
        made = [
            (
                list(pr.prompt_ids),
                pr.params,
                on_event,
                pr.thr,
                pr.checks,
                self._sampler.new_generator(pr.params, device),
            )
            for pr, on_event in prepared
        ]
        with self._lock:
            if self._closed or self._thread is None or not self._thread.is_alive():
                raise EngineClosed("the engine is not running (shut down, or not started): it takes no new request")
            if self.scheduler.room(self._pending) < n:
                held, free = self._pending + self.scheduler.num_held, self.scheduler.num_free_rows
                raise QueueFull(
                    f"{held} requests are queued or running for {B} rows (max_waiting={W}, {free} rows free); "
                    f"{n} more do not fit: try again later"
                )
            self._pending += n
            reqs = [
                _Request(
                    next(self._ids),
                    p,
                    params.max_tokens,
                    echo=params.prompt_logprobs,
                    params=params,
                    on_event=cb,
                    thr=thr,
                    checks=checks,
                    gen=gen,
                )
                for p, params, cb, thr, checks, gen in made
            ]
        self._inbox.put(("submit", reqs))
        self._wake.set()
        return [RequestHandle(self, r.id) for r in reqs]

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Take no new request; let those in flight run for up to ``grace_s`` seconds, then end the rest with
        ``FinishEvent('abort', error='the server is shutting down')``, and stop the thread. Blocks."""
        with self._lock:
            self._closed = True
        if self._thread is None:
            return
        self._inbox.put(("shutdown", time.monotonic() + max(0.0, float(grace_s))))
        self._wake.set()
        self._thread.join()

    def stats(self) -> dict:
        """Gauges (rows running, requests waiting, cache tokens in use) and running totals, for ``/metrics``.
        Cache tokens: one token's keys and values at one loop slot of every layer (a token position holds
        ``kv_slots`` of them); ``kv_tokens_capacity``: the cache block allocated; ``kv_budget_tokens``: what
        requests may hold of it (the capacity without ``--kv-budget``)."""
        g = dict(self._gauges)
        cap = self.config.max_batch * self.max_model_len * self._S
        per = self.runner.bytes_per_token if self.runner is not None else 0.0
        budget = cap if self._budget is None else self._budget
        return {
            **g,
            "max_batch": self.config.max_batch,
            "K": self.K,
            "kv_slots": self._S,
            "kv_tokens_capacity": cap,
            "kv_budget_tokens": budget,
            "kv_bytes_used": int(g["kv_tokens_used"] * per),
            "kv_bytes_capacity": int(cap * per),
            "kv_budget_bytes": int(budget * per),
            **self._totals,
            "exits_by_depth": list(self._exits),
            "finished_by_reason": dict(self._finished),
        }

    # ------------------------------------------------------------------------------------------ requests
    def _threshold(self, spec) -> tuple[float, bool]:
        """A request's ``(ε, checks)`` from its ``exit`` field (None: the server's)."""
        if spec is None:
            return (
                self.threshold or 0.0,
                self.criterion is not None
                and self.criterion != "gate"
                and self.threshold > 0
                or self.criterion == "gate",
            )
        if not isinstance(spec, str):
            raise ValueError(f"give a string such as '{self.criterion or 'kl'}:0.01' or 'none', got {spec!r}")
        if spec.strip().lower() in ("none", "full"):
            if self.criterion == "gate":
                raise ValueError(
                    "under the gate criterion every row runs the server's q (the rule selects its output "
                    f"with it): leave looplm.exit out, or give 'gate:{self.threshold:g}'"
                )
            return 0.0, False
        name, _, value = spec.partition(":")
        name = name.strip()
        if self.criterion is None:
            raise ValueError(
                f"this server runs full depth; got {spec!r}: leave it out or give 'none', or start a "
                "server with --exit kl:0.01 whose requests may set their own threshold"
            )
        if name != self.criterion:
            raise ValueError(
                f"this server's rows are checked by the {self.criterion} criterion (one per batch); got "
                f"{spec!r}: give '{self.criterion}:VALUE' or 'none'"
            )
        try:
            t = float(value) if value else self.threshold
        except ValueError:
            raise ValueError(f"{spec!r}: {value!r} is not a number") from None
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"{spec!r}: the threshold must be a finite number >= 0 (0 = full depth)")
        if self.criterion == "gate":
            if t != self.threshold:
                raise ValueError(
                    f"under the gate criterion every row runs the server's q={self.threshold:g} (the rule "
                    f"selects its output with it); got {spec!r}"
                )
            return t, True
        return t, t > 0

    def _emit(self, req: _Request, ev) -> None:
        try:
            req.on_event(ev)
        except Exception:  # a caller's callback must not stop the engine
            pass

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        """End ``req`` (its row frees now, or when its token in flight exits) and send its :class:`FinishEvent`."""
        if self.scheduler.finish(req, RequestStatus.of_reason(reason)):
            self._finished_event(req, reason, error)

    def _finish_all(self, reason: str, error: str) -> None:
        for req in self.scheduler.finish_all(RequestStatus.of_reason(reason)):
            self._finished_event(req, reason, error)
        self._gauges.update(running=0, waiting=0, kv_tokens_used=0)

    def _finished_event(self, req: _Request, reason: str, error: str | None) -> None:
        self.runner.release(req.id)
        self._totals["requests_finished"] += 1
        self._finished[reason] = self._finished.get(reason, 0) + 1
        n = req.num_output_tokens
        self._emit(req, FinishEvent(reason, len(req.prompt), n, error, sum(req.output_depths) / n if n else None))

    # ------------------------------------------------------------------------------------------ the thread
    def _build(self) -> None:
        """A fresh model runner (the batch's caches) and scheduler (its queues and rows, under the KV budget)."""
        from .runner import ModelRunner

        self.runner = ModelRunner(self.model, self.config.max_batch, self.max_model_len, self.exit)
        self._S = self.runner.slots_per_token
        self._size_budget()
        self.scheduler = Scheduler(
            self.config.max_batch,
            self.config.max_waiting,
            self._budget,
            self._S,
            self.config.prefill_chunk,
            wait_for_batch=self.config.exit_schedule == "token",
            batch_prefill=self.runner.can_batch_prefill and self._prefill_exit is None,
        )

    def _size_budget(self) -> None:
        """``config.kv_budget`` in cache tokens (a memory size: what is left after the rows' fixed Mamba-2
        states, in cache tokens), at most the cache block; raises ValueError when it holds no request."""
        if self.config.kv_budget is None:
            self._budget = None
            return
        kind, v = parse_kv_budget(self.config.kv_budget)
        cap = self.config.max_batch * self.max_model_len * self._S
        per, ssm = self.runner.bytes_per_token, self.runner.ssm_bytes
        if kind == "bytes":
            room = v - ssm
            if room <= 0:
                raise ValueError(
                    f"EngineConfig: kv_budget={self.config.kv_budget!r} is {v:.0f} bytes, not more than the "
                    f"{ssm} bytes of the {self.config.max_batch} rows' Mamba-2 states; give more "
                    "than that, or fewer rows (--max-batch)"
                )
            tokens = int(room // per) if per > 0 else cap
        else:
            tokens = int(v)
        if tokens < 2 * self._S:
            raise ValueError(
                f"EngineConfig: kv_budget={self.config.kv_budget!r} holds {tokens} cache tokens, fewer than one "
                f"request of two tokens needs ({2 * self._S}: {self._S} loop slots per token); give more"
            )
        self._budget = min(tokens, cap)

    def _main(self, ready: threading.Event) -> None:
        from ..decode.sampling import decode_context

        with torch.no_grad(), decode_context(self.model, self.config.max_batch):
            ready.set()
            while True:
                try:
                    if not self._step():
                        if self._deadline is not None:
                            break
                        self._wake.wait(0.05)
                        self._wake.clear()
                except Exception as e:  # fail what was running; a fresh runner for what comes next
                    self.last_error = f"{type(e).__name__}: {e}"
                    self._finish_all("error", self.last_error)
                    try:
                        self._build()
                    except Exception:
                        break
            self._finish_all("abort", "the server is shutting down")
            self._drain()  # (requests that raced the shutdown)

    def _drain(self) -> None:
        """The inbox: new requests (a group at a time) into the scheduler, aborts, the shutdown."""
        while True:
            try:
                kind, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                reqs = rest[0]
                with self._lock:  # (one move: submit reads pending + held)
                    self._pending -= len(reqs)
                    for req in reqs:
                        self.scheduler.add(req)
                if self._deadline is not None:
                    for req in reqs:
                        self._finish(req, "abort", "the server is shutting down")
            elif kind == "abort":
                rid, reason = rest
                req = self.scheduler.get(rid)
                if req is not None:
                    self._finish(req, reason)
            elif kind == "shutdown":
                self._deadline = rest[0]

    def _step(self) -> bool:
        """One iteration: schedule -> run (a prefill chunk, one core pass) -> sample -> output (module docstring).
        False when there was nothing to do."""
        self._drain()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._finish_all("abort", "the server is shutting down: its grace period ended")
            return False
        sched, runner = self.scheduler, self.runner
        plan = sched.schedule()
        self._preempted(plan.preempted)
        self._gauges.update(running=sched.num_running, waiting=sched.num_waiting, kv_tokens_used=plan.kv_tokens)
        if plan.empty and not runner.in_flight:
            return bool(plan.preempted)
        if len(plan.prefill) == 1:
            self._prefill(plan.prefill[0])
        elif plan.prefill:
            self._prefill_batch(plan.prefill)
        out = runner.step(plan.decode)
        if out is not None:
            self._update(out)
        self._gauges.update(running=sched.num_running, waiting=sched.num_waiting, kv_tokens_used=sched.kv_tokens_used())
        return True

    def _prefill(self, chunk: PrefillChunk) -> None:
        """Run a prompt chunk; after the last, its prompt logprobs (echo), its row (placed) and its first token."""
        req = chunk.request
        echo = req.params.prompt_logprobs and not req.prompt_reported
        if echo and chunk.start == 0:
            req.prompt_lp, req.prompt_top = [None], [None]
        exit = None  # prefill='exit': the prompt (whole: prefill_chunk is None) at adaptive depth, at its own ε
        if self._prefill_exit is not None and req.checks:
            exit = (
                replace(self._prefill_exit, threshold=req.thr)
                if req.thr != self._prefill_exit.threshold
                else self._prefill_exit
            )
        n = chunk.end - chunk.start
        logits, first_depth = self.runner.prefill(
            req.id, req.prompt, chunk.start, chunk.end, n if echo else 1, exit
        )  # [keep, V]
        if echo:  # position a + i predicts token a + i + 1
            lp, top = self._sampler.prompt_logprobs(
                logits, req.prompt[chunk.start + 1 : chunk.end + 1], req.params.logprobs or 0
            )
            req.prompt_lp += lp
            req.prompt_top += top
        if chunk.last:
            self._prefilled([req], logits[-1:], first_depth)

    def _prefill_batch(self, chunks: list) -> None:
        """Whole prompts as one forward (the scheduler's batched prefill: no echo among them), then each placed."""
        reqs = [c.request for c in chunks]
        logits, depth = self.runner.prefill_batch([r.id for r in reqs], [r.prompt for r in reqs])  # [n, V]
        self._prefilled(reqs, logits, depth)

    def _prefilled(self, reqs: list, last_logits: torch.Tensor, depth: int) -> None:
        """Prompts that ran whole: each is counted (and echoed) once, placed in its row and given its first token
        from its row of ``last_logits [n, V]`` (a preempted request replays the tokens it had made instead)."""
        new = []
        for i, req in enumerate(reqs):
            if not req.prompt_reported:
                req.prompt_reported, req.echo = True, False  # (a preempted request's prompt runs again, echo or not)
                self._totals["prompt_tokens_total"] += len(req.prompt)
                if req.params.prompt_logprobs:
                    self._emit(req, PromptEvent(req.prompt_lp, req.prompt_top))
            if req.max_tokens == 0:
                self._finish(req, "length")
                continue
            self.scheduler.place(req)
            self.runner.place(req.id, req.row, len(req.prompt), req.thr, req.checks)
            if req.next_token is None:  # (preempted before: it replays the tokens it had made, from the first)
                new.append(i)
        if new:
            picks = self._sampler.sample(
                [reqs[i].params for i in new],
                [reqs[i].gen for i in new],
                last_logits if len(new) == len(reqs) else last_logits[new],
            )
            for i, pick in zip(new, picks):
                self._token(reqs[i], pick, depth)

    def _update(self, out) -> None:
        """A pass's exits: the scheduler moves their rows on; the new tokens are sampled and sent."""
        sample, preempted = self.scheduler.update_from_output(out.rows)
        self._preempted(preempted)
        if not sample:
            return
        reqs = [self.scheduler.rows[out.rows[i]] for i in sample]
        logits = out.logits if len(sample) == len(out.rows) else out.logits[sample]  # [s, V]
        picks = self._sampler.sample([r.params for r in reqs], [r.gen for r in reqs], logits)
        for i, req, pick in zip(sample, reqs, picks):
            self._exits[out.depths[i] - 1] += 1
            self._token(req, pick, out.depths[i])

    def _preempted(self, reqs: list) -> None:
        for req in reqs:
            self.runner.release(req.id)
            self._totals["preempted"] += 1

    def _token(self, req: _Request, pick, depth: int) -> None:
        """A generated token of ``req``: its event; the request ends (its row frees) or its row starts it next."""
        p = req.params
        self.scheduler.append_token(req, pick.token_id, depth)
        self._totals["generation_tokens_total"] += 1
        stop = (pick.token_id == self.eos_token_id and not p.ignore_eos) or pick.token_id in p.stop_token_ids
        self._emit(req, TokenEvent(pick.token_id, pick.logprob, pick.top_logprobs, depth, stop))
        if req.finished:
            return
        if stop:
            self._finish(req, "stop")
        elif req.num_output_tokens >= p.max_tokens or len(req.prompt) + req.num_output_tokens >= self.max_model_len:
            self._finish(req, "length")
