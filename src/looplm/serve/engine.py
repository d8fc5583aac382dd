"""The serving engine: continuous batching of requests that arrive at any time, each row at its own depth.

One engine thread owns the model. Callers (the HTTP server, a test, a load generator) :meth:`Engine.submit`
a prompt with its :class:`SamplingParams` and a callback; the engine calls it from its thread with a
:class:`PromptEvent` (only for ``prompt_logprobs``), one :class:`TokenEvent` per generated token and, last,
one :class:`FinishEvent`. A :class:`RequestHandle` aborts a request from any thread.

The scheduling is iteration-level: every *tick* of the engine thread

    1. takes the new requests and aborts (thread-safe inbox);
    2. admits waiting requests into free rows: each prompt runs **alone** at full depth in a cache of its own
       (one chunk of ``prefill_chunk`` tokens per tick, so a long prompt does not stall the rows decoding),
       then its slots are copied into its row's columns ``< p`` of the batch cache and its first token is
       picked (:meth:`_ServeDecoder.place`). With ``EngineConfig.prefill='exit'`` a prompt whose request takes
       exits runs at adaptive depth instead, whole, in one call: its tokens after the first take the exits at the
       request's threshold, all at once (:func:`looplm.decode.exit_forward.adaptive_forward`, which leaves its
       cache as decoding the prompt token by token would; ``Exit(prefill='exit')`` of ``model.generate``);
    3. runs **one core pass** over every row in flight (continuous depth batching,
       :class:`looplm.decode.depth_schedule.DepthBatchedDecoder`): each row is at its own loop of its own
       token, rows whose criterion fires leave through the coda and the head, pick their next token with their
       own sampling parameters and start it at the next pass. ``exit_schedule='token'`` runs the token schedule
       instead: a row that exits waits until every row of the batch has left, and all start the next token
       together (the same arithmetic per row, a batch's time set by its deepest row).

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
prompt prefilled alone), and sampling draws from the request's own generator (``seed``), so a request's output
does not depend on the other requests in the batch; in fp32 greedy output equals ``model.generate`` of the
prompt alone, at full depth and under each criterion (with ``prefill='exit'``: ``generate`` with
``Exit(prefill='exit')``), up to the row count of the products (``tests/test_serve_engine.py``).
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

__all__ = ["Engine", "EngineClosed", "EngineConfig", "FieldError", "FinishEvent", "PromptEvent", "QueueFull",
           "RequestError", "RequestHandle", "SamplingParams", "TokenEvent", "parse_kv_budget"]

MAX_LOGPROBS = 20  # the most top log-probabilities a token may ask for (OpenAI's limit)
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


@dataclass(frozen=True)
class FieldError:
    """One bad field of a request: its name as the request spells it, and what to do."""

    field: str
    message: str


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
    most prompt tokens prefilled per tick (None: a whole prompt); ``kv_budget``: the cache tokens requests may
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
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):  # fmt: skip
            errs.append(f"max_model_len must be an int >= 2 or None (the model's max_seq_len), got {self.max_model_len!r}")
        if self.exit_schedule not in ("depth", "token"):
            errs.append(f"exit_schedule must be 'depth' (each row at its own loop) or 'token', got {self.exit_schedule!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            errs.append(f"max_waiting must be an int >= 0 (the bounded queue), got {self.max_waiting!r}")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int)
                                               or self.prefill_chunk < 2):  # fmt: skip
            errs.append(f"prefill_chunk must be an int >= 2 (prompt tokens per tick) or None (whole prompts), got {self.prefill_chunk!r}")
        if self.prefill not in ("full", "exit"):
            errs.append(f"prefill must be 'full' (a prompt at every loop) or 'exit' (its tokens after the first take the "
                        f"exits), got {self.prefill!r}")  # fmt: skip
        elif self.prefill == "exit" and self.exit is None:
            errs.append("prefill='exit' needs an exit criterion (exit='kl:0.01', ...): at full depth there is none to take")
        elif self.prefill == "exit" and self.prefill_chunk is not None:
            errs.append(f"prefill='exit' runs each prompt whole, in one call (its exits over the whole prompt at once); "
                        f"set prefill_chunk=None (got {self.prefill_chunk!r})")  # fmt: skip
        if errs:
            raise ValueError("EngineConfig: " + "; ".join(errs))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_kv_budget(value) -> tuple[str, float]:
    """``--kv-budget``: ``('tokens', n)`` for an int or a number of cache tokens (``'4096'``, ``'4096 tokens'``),
    ``('bytes', n)`` for a memory size (``'2GiB'``, ``'512 MiB'``, ``'1.5GB'``). Raises ValueError naming it."""
    what = (f"kv_budget must be a number of cache tokens (an int >= 1, e.g. 4096) or a memory size such as '2GiB' "
            f"or '512MiB', got {value!r}")  # fmt: skip
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
    unit = text[len(num):].strip() or "tokens"  # fmt: skip
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


# ---------------------------------------------------------------------------------------------- the decoder
class _RowCriterion:
    """A cohort's criterion with a threshold per row: ``check`` compares each row with its own ε (a tensor in
    the criterion's place), and a row whose request runs full depth (ε = 0 under ``kl`` / ``convergence``)
    never leaves. A cohort of full-depth rows only skips the check (its rows run every loop). ``forced [n]``
    (None: none): a row's depth fixed in advance (0: its criterion's) — a preempted request replaying the
    tokens it had generated leaves at the loop each of them left at the first time."""

    def __init__(self, crit, thr: torch.Tensor, check: bool, forced: torch.Tensor | None = None):
        self.crit, self.thr, self.checks, self.forced = crit, thr, check, forced  # thr, forced [n]

    def __getattr__(self, name):  # readout, logits, flops, value, ...: the criterion's own
        return getattr(self.crit, name)

    @property
    def flops(self):
        return self.crit.flops

    @flops.setter
    def flops(self, v):
        self.crit.flops = v

    def check(self, k, h, state, lctx, rows, model, **kw):
        if not self.checks:
            leave = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        else:
            if self.thr is not None:  # (the gate keeps the server's q: the rule selects its output with it too)
                self.crit.threshold = self.thr if self.thr.numel() != 1 else float(self.thr)  # [n] against [n] distances
            leave = self.crit.check(k, h, state, lctx, rows, model, **kw)
        if self.forced is not None:  # [n]: a replayed token leaves where it left before, whatever its criterion says
            leave = torch.where(self.forced > 0, self.forced == k + 1, leave)
        return leave

    def take(self, keep):
        self.crit.take(keep)
        if self.thr is not None:
            self.thr = self.thr.index_select(0, keep)
        if self.forced is not None:
            self.forced = self.forced.index_select(0, keep)


def _serve_decoder_class():
    """The decoder class, built on first use (``looplm.decode`` is imported when an engine is made, not with
    ``looplm.serve``)."""
    from ..decode.depth_schedule import DepthBatchedDecoder, _copy_rows
    from ..cache import SharedKV

    class _ServeDecoder(DepthBatchedDecoder):
        """:class:`DepthBatchedDecoder` with rows that take requests one at a time: row ``b`` holds its prompt at
        columns ``< p_b`` (no padding, position = column) and its ``t``-th token at column ``p_b + t``; every row
        reads its own columns up to its own under the pass's mask (the depth schedule's per-row columns)."""

        def __init__(self, model, batch_size: int, capacity: int, exit, thresholds: torch.Tensor):
            super().__init__(model, batch_size, capacity, exit)
            self.row_thr = thresholds  # [B] each row's ε (its request's), read when its token starts
            self.row_checks = [True] * batch_size  # whether the row's request takes exits at all
            dev = next(model.parameters()).device
            B, cap = batch_size, capacity
            # the cache's slots, made by one token of every row at full depth (then every row is overwritten by
            # its prompt's, or masked); the Mamba-2 states become one flat state, as after a prompt
            self(torch.zeros(B, 1, dtype=torch.long, device=dev), validate=False)
            for base, _, _ in self.kv_flat.values():
                base._len = 1
            self._flat_ssm_states()
            for slot in self.cache.physical_slots():  # unwritten columns hold zeros (a masked NaN is 0 × NaN)
                if getattr(slot, "_k", None) is not None:
                    slot._k.zero_()
                    slot._v.zero_()
            self.visible = torch.ones(B, cap, dtype=torch.bool, device=dev)
            self.pos_shift = torch.zeros(B, dtype=torch.long, device=dev)
            self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)
            self.keys = torch.arange(cap, device=dev)
            self.rope_at = {int(r): rot(self.keys[:, None]) for r, rot in model.rotary.items()}
            self.attn_rows = torch.zeros(B, cap, dtype=torch.bool, device=dev)
            self.attn = self.attn_rows[:, None, None, :]
            self.yes = torch.ones((), dtype=torch.bool, device=dev)
            self.exit_keys = []
            self.col = torch.zeros(B, dtype=torch.long, device=dev)  # each row's token in flight's column

        def prefill(self, part, ids: torch.Tensor, keep: int, exit=None) -> tuple:
            """``ids [1, T]``, the next chunk of a prompt, at full depth into its own cache ``part`` (made by
            :meth:`new_part`); or, with ``exit`` (a resolved :class:`~looplm.decode.exits.Exit`, ``prefill='exit'``),
            the whole prompt into the empty ``part`` at adaptive depth, its first token at every loop.
            Returns ``(logits of its last keep positions [1, keep, V], the loops its last position ran)``."""
            self.flush()  # the fills carried into the next pass, before the cache changes hands
            if exit is not None:
                from ..decode.exit_forward import adaptive_forward

                out = adaptive_forward(self.model, ids, exit, loop_options=self.loop_options, full_depth_prefix=1,
                                       cache=part, logits_to_keep=keep)  # fmt: skip
                return out.logits, int(out.depth[0, -1])
            main = self.cache
            self.cache = part
            try:
                return self(ids, None, logits_to_keep=keep, validate=False), self.R
            finally:
                self.cache = main

        def new_part(self, p: int):
            return self.model.new_cache(1, self.R, capacity=p, kv_shared=self.cache.kv_shared)

        def place(self, b: int, part, p: int, thr: float, checks: bool) -> None:
            """Row ``b`` takes a prefilled prompt: ``part``'s slots into its columns ``< p`` of every slot (every
            loop), its mask and column reset (its first token goes in at column ``p``)."""
            main, dev = self.cache, self.col.device
            self.flush()
            rows = torch.tensor([b], device=dev)
            for key, src in part.slots.items():
                if not isinstance(src, SharedKV):
                    _copy_rows(src, main.slots[key], rows, p)
            for fam, src in part.shared.items():
                _copy_rows(src, main.shared[fam], rows, p)
            self.col[b] = p
            self.attn_rows[b] = self.keys <= p
            self.row_thr[b] = thr
            self.row_checks[b] = checks

        def start(self, rows_h: list, ids: torch.Tensor, L: int, forced: list | None = None):
            """Rows ``rows_h`` begin tokens ``ids [n]``: a new cohort at loop 0, its criterion per row; ``forced``:
            each row's fixed depth (0: its criterion's; None: none fixed)."""
            rows = torch.tensor(rows_h, device=self.col.device)
            c = self._start(rows, ids[:, None], self.col, torch.zeros_like(rows), L)
            checks = [self.row_checks[b] for b in rows_h]
            thr = None if self.exit.criterion == "gate" else self.row_thr.index_select(0, rows)
            f = None if forced is None else torch.tensor(forced, device=rows.device)
            c.crit = _RowCriterion(c.crit, thr, any(checks), f)
            return c

        def advance(self, rows: torch.Tensor) -> None:
            """Rows whose tokens exited move to their next column (their next token reads its own too)."""
            c = self.col.index_select(0, rows) + 1
            self.col.index_copy_(0, rows, c)
            self.attn_rows.index_put_((rows, c), self.yes)

    return _ServeDecoder


# ---------------------------------------------------------------------------------------------- the engine
@dataclass(eq=False)
class _Request:
    """One request inside the engine (its thread's own: no lock)."""

    id: int
    prompt: list
    params: SamplingParams
    on_event: Callable
    thr: float  # its exit threshold ε (0 under a criterion that is off: full depth)
    checks: bool  # whether its tokens are checked at all
    gen: torch.Generator | None = None  # its own sampling generator (seed)
    row: int | None = None  # its batch row, from the start of its prefill
    part: object = None  # its private prefill cache
    done_prompt: int = 0  # prompt tokens prefilled
    prompt_lp: list | None = None  # (echo) per prompt token: its logprob and top alternatives
    prompt_top: list | None = None
    made: int = 0  # tokens generated
    depth_sum: int = 0
    next_token: int | None = None  # the token its row feeds at its next start (None: in flight)
    finished: bool = False
    in_flight: bool = False  # its row has a token looping (the row frees when it exits)
    placed: bool = False  # its prompt is in its row (it counts its columns; before: its prompt + max_tokens)
    tokens: list = field(default_factory=list)  # generated token ids
    depths: list = field(default_factory=list)  # the loops each ran
    feed: deque = field(default_factory=deque)  # (after a preemption) generated tokens still to replay
    forced: deque = field(default_factory=deque)  # their depths (the loops the token each produced ran)
    preempt: bool = False  # to be preempted when its token in flight exits
    prompt_sent: bool = False  # its prompt was counted (and its PromptEvent sent): not again after a preemption


class Engine:
    """Continuous batching of requests over one model (module docstring). ``start()`` it, :meth:`submit`
    requests from any thread, :meth:`shutdown` at the end; :meth:`check` names every bad field of a request
    before any work. ``eos_token_id``: the tokenizer's end of text (a request stops there unless
    ``ignore_eos``).

    The model is the engine's while it runs: its decode steps (:func:`looplm.decode.sampling.decode_context`) are
    switched in for the engine's batch size, so another caller should not run it meanwhile."""

    def __init__(self, model, config: EngineConfig | None = None, eos_token_id: int | None = None):
        from ..decode.exits import Exit

        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model, self.config, self.eos_token_id = model, config, eos_token_id
        limit = int(model.config.max_seq_len)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"EngineConfig: max_model_len={config.max_model_len} exceeds the model's max_seq_len={limit}; "
                             f"give at most {limit}")  # fmt: skip
        self.max_model_len = config.max_model_len or limit
        policies = dict(kv=config.kv_policy, ssm=config.ssm_policy, schedule="depth", prefill="full")
        if config.exit is None:  # full depth: an ε of 0 that is never checked
            self.criterion = None
            spec = Exit(criterion="convergence", threshold=0.0)
        else:
            spec = Exit.parse(config.exit)
            if spec.criterion not in SERVED_CRITERIA:
                raise ValueError(f"EngineConfig: exit criterion {spec.criterion!r} cannot be served; give 'kl:EPS', "
                                 "'convergence:EPS', 'gate:Q' or None (full depth)")  # fmt: skip
            if spec.max_batch is not None or spec.compile or spec.min_loops != 1:
                raise ValueError("EngineConfig: exit may not set max_batch (EngineConfig.max_batch is the batch), "
                                 "compile or min_loops when served")  # fmt: skip
            self.criterion = spec.criterion
        try:
            self.exit = spec.with_policies(**policies).resolved(model, config.max_batch)
            # a prompt at adaptive depth (prefill='exit'): the same exit over one prompt alone, checked here once
            self._prefill_exit = (spec.with_policies(**{**policies, "prefill": "exit"}).resolved(model, 1)
                                  if config.prefill == "exit" else None)  # fmt: skip
        except ValueError as e:
            raise ValueError(f"looplm serve cannot run this model with these options: {e}") from None
        self.K = int(self.exit.max_loops)
        self.threshold = float(self.exit.threshold) if self.criterion else None  # the server's ε or q
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # submit's count of waiting requests and the closed flag
        self._queued = 0  # submitted, not yet given a row (submit's bound)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # shutdown: when the rest are ended
        self._totals = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished": 0,
                        "preempted": 0}  # fmt: skip
        self._exits = [0] * self.K  # generated tokens by the loops they ran
        self._finished: dict[str, int] = {}  # requests finished, by reason (stop, length, abort, error)
        self._gauges = {"running": 0, "waiting": 0, "kv_tokens_used": 0}
        self.last_error: str | None = None
        self._dec = None
        self._budget: int | None = None  # cache tokens requests may hold (start(): from config.kv_budget)
        self._S = 1  # loop slots a token keeps per layer (K, or 1 under kv='shared'): its cache tokens

    # ------------------------------------------------------------------------------------------ public
    def describe(self) -> str:
        crit = "full depth" if self.criterion is None else f"exit {self.criterion}:{self.threshold:g}"
        out = (f"K={self.K}, {crit}, {self.config.exit_schedule} schedule, kv={self.exit.kv}, max_batch={self.config.max_batch}, "
               f"max_model_len={self.max_model_len}")  # fmt: skip
        if self._prefill_exit is not None:
            out += ", prompts at adaptive depth (prefill exit)"
        if self._dec is not None:
            cap = self.config.max_batch * self.max_model_len * self._S
            out += (f", KV cache {cap * self._bytes_per_token / 2**20:.1f} MiB ({cap} cache tokens = {self.config.max_batch} rows "
                    f"× {self.max_model_len} × {self._S} loop slots)")  # fmt: skip
            if self._budget is not None:
                out += f", KV budget {self._budget} cache tokens ({self._budget * self._bytes_per_token / 2**20:.1f} MiB)"
        return out

    def start(self) -> "Engine":
        """Build the batch's decoder (its caches: ``max_batch`` rows × ``max_model_len`` columns per loop slot)
        and start the engine thread. Errors of the model or options raise here."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.model.eval()
        self._build()
        self._size_budget()
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
        if isinstance(p.temperature, bool) or not isinstance(p.temperature, (int, float)) or not 0 <= p.temperature < math.inf:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {p.temperature!r}")
        if p.top_p is not None and (isinstance(p.top_p, bool) or not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1):
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
        elif any(not is_int(t) or not 0 <= t < V for t in ids):
            bad("prompt", f"holds a token id outside the model's vocabulary [0, {V})")
        elif is_int(p.max_tokens) and p.max_tokens >= 0 and len(ids) + p.max_tokens > self.max_model_len:
            room = self.max_model_len - len(ids)
            bad("prompt" if room <= 0 else "max_tokens",
                f"the prompt's {len(ids)} tokens + max_tokens {p.max_tokens} exceed the model's context of {self.max_model_len} "
                f"tokens; " + ("shorten the prompt" if room <= 0 else f"ask for at most {room} tokens or shorten the prompt"))
        elif (self._budget is not None and is_int(p.max_tokens) and p.max_tokens >= 0
              and (len(ids) + p.max_tokens) * self._S > self._budget):  # fmt: skip
            room = self._budget // self._S - len(ids)
            bad("prompt" if room <= 0 else "max_tokens",
                f"the prompt's {len(ids)} tokens + max_tokens {p.max_tokens} need {(len(ids) + p.max_tokens) * self._S} cache "
                f"tokens ({self._S} loop slots per token), more than this server's KV budget of {self._budget}; "
                + ("shorten the prompt" if room <= 0 else f"ask for at most {room} tokens or shorten the prompt")
                + " (or start the server with a larger --kv-budget)")  # fmt: skip
        if p.exit is not None:
            try:
                self._threshold(p.exit)
            except ValueError as e:
                bad("looplm.exit", str(e))
        if p.loops is not None and (not is_int(p.loops) or p.loops != self.K):
            bad("looplm.loops", f"this server runs every token's loops up to K={self.K} (its exit criterion picks "
                                f"fewer); got {p.loops!r}: leave it out or give {self.K}")  # fmt: skip
        if p.kv_policy is not None and p.kv_policy != self.exit.kv:
            bad("looplm.kv_policy", f"this server's caches run kv_policy {self.exit.kv!r} (every row of a batch shares "
                                    f"them); got {p.kv_policy!r}: leave it out, or start a server with --kv-policy {p.kv_policy}")  # fmt: skip
        if p.speculative not in (None, False, 0):
            bad("looplm.speculative", f"self-speculative decoding is not served (it decodes one request per batch); "
                                      f"got {p.speculative!r}: leave it out, or use `looplm generate --speculative`")  # fmt: skip
        return errs

    def submit(self, prompt_ids, params: SamplingParams, on_event: Callable) -> RequestHandle:
        """Queue a request; ``on_event(event)`` is called from the engine thread (keep it short). Raises
        :class:`RequestError` (bad fields), :class:`QueueFull` or :class:`EngineClosed`."""
        errs = self.check(prompt_ids, params)
        if errs:
            raise RequestError(errs)
        thr, checks = self._threshold(params.exit)
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=next(self.model.parameters()).device)
            gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        with self._lock:
            if self._closed or self._thread is None or not self._thread.is_alive():
                raise EngineClosed("the engine is not running (shut down, or not started): it takes no new request")
            free = sum(r is None for r in self._rows)  # rows a request may take at once (read from the engine's list)
            if self._queued >= self.config.max_waiting + free:
                raise QueueFull(f"{self._queued} requests are waiting for {free} free rows (max_waiting={self.config.max_waiting}); "
                                "try again later")  # fmt: skip
            self._queued += 1
            rid = next(self._ids)
        self._inbox.put(("submit", _Request(rid, list(prompt_ids), params, on_event, thr, checks, gen)))
        self._wake.set()
        return RequestHandle(self, rid)

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
        per = self._bytes_per_token if self._dec is not None else 0.0
        budget = cap if self._budget is None else self._budget
        return {**g, "max_batch": self.config.max_batch, "K": self.K, "kv_slots": self._S, "kv_tokens_capacity": cap,
                "kv_budget_tokens": budget, "kv_bytes_used": int(g["kv_tokens_used"] * per), "kv_bytes_capacity": int(cap * per),
                "kv_budget_bytes": int(budget * per), **self._totals, "exits_by_depth": list(self._exits),
                "finished_by_reason": dict(self._finished)}  # fmt: skip

    # ------------------------------------------------------------------------------------------ requests
    def _threshold(self, spec) -> tuple[float, bool]:
        """A request's ``(ε, checks)`` from its ``exit`` field (None: the server's)."""
        if spec is None:
            return (self.threshold or 0.0, self.criterion is not None and self.criterion != "gate" and self.threshold > 0
                    or self.criterion == "gate")  # fmt: skip
        if not isinstance(spec, str):
            raise ValueError(f"give a string such as '{self.criterion or 'kl'}:0.01' or 'none', got {spec!r}")
        if spec.strip().lower() in ("none", "full"):
            if self.criterion == "gate":
                raise ValueError("under the gate criterion every row runs the server's q (the rule selects its output "
                                 f"with it): leave looplm.exit out, or give 'gate:{self.threshold:g}'")  # fmt: skip
            return 0.0, False
        name, _, value = spec.partition(":")
        name = name.strip()
        if self.criterion is None:
            raise ValueError(f"this server runs full depth; got {spec!r}: leave it out or give 'none', or start a "
                             "server with --exit kl:0.01 whose requests may set their own threshold")  # fmt: skip
        if name != self.criterion:
            raise ValueError(f"this server's rows are checked by the {self.criterion} criterion (one per batch); got "
                             f"{spec!r}: give '{self.criterion}:VALUE' or 'none'")  # fmt: skip
        try:
            t = float(value) if value else self.threshold
        except ValueError:
            raise ValueError(f"{spec!r}: {value!r} is not a number") from None
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"{spec!r}: the threshold must be a finite number >= 0 (0 = full depth)")
        if self.criterion == "gate":
            if t != self.threshold:
                raise ValueError(f"under the gate criterion every row runs the server's q={self.threshold:g} (the rule "
                                 f"selects its output with it); got {spec!r}")  # fmt: skip
            return t, True
        return t, t > 0

    def _emit(self, req: _Request, ev) -> None:
        try:
            req.on_event(ev)
        except Exception:  # a caller's callback must not stop the engine
            pass

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        self._totals["requests_finished"] += 1
        self._finished[reason] = self._finished.get(reason, 0) + 1
        loops = req.depth_sum / req.made if req.made else None
        self._emit(req, FinishEvent(reason, len(req.prompt), req.made, error, loops))
        if req.row is not None and not req.in_flight:
            self._rows[req.row] = None
            req.row = None
        req.part = None

    # ------------------------------------------------------------------------------------------ the thread
    def _build(self) -> None:
        B = self.config.max_batch
        dev = next(self.model.parameters()).device
        with torch.no_grad():
            self._dec = _serve_decoder_class()(self.model, B, self.max_model_len, self.exit,
                                               torch.zeros(B, device=dev))  # fmt: skip
        self._rows: list[_Request | None] = [None] * B
        self._col = [0] * B  # host copy of each row's column
        self._cohorts: list = []
        self._waiting: deque = deque()
        seen, total = set(), 0
        slots = [s for s in self._dec.cache.physical_slots()] + [b for b, _, _ in self._dec.kv_flat.values()]
        for s in slots:
            for t in (getattr(s, "_k", None), getattr(s, "_v", None)):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        self._S = self._dec.R if any(off for _, _, off in self._dec.kv_flat.values()) else 1
        self._bytes_per_token = total / (B * self.max_model_len * self._S)  # one column's bytes / S
        ssm = [e[0] for e in self._dec.flat.values() if hasattr(e[0], "ssm_state")]  # the core's flat Mamba-2 states
        ssm += [s for s in self._dec.cache.physical_slots() if hasattr(s, "ssm_state")]  # (views of those, and the rest)
        seen, self._ssm_bytes = set(), 0
        for st in ssm:
            for t in (st.conv_state, st.ssm_state):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self._ssm_bytes += t.untyped_storage().nbytes()

    def _size_budget(self) -> None:
        """``config.kv_budget`` in cache tokens (a memory size: what is left after the rows' fixed Mamba-2
        states, in cache tokens), at most the cache block; raises ValueError when it holds no request."""
        if self.config.kv_budget is None:
            self._budget = None
            return
        kind, v = parse_kv_budget(self.config.kv_budget)
        cap = self.config.max_batch * self.max_model_len * self._S
        if kind == "bytes":
            room = v - self._ssm_bytes
            if room <= 0:
                raise ValueError(f"EngineConfig: kv_budget={self.config.kv_budget!r} is {v:.0f} bytes, not more than the "
                                 f"{self._ssm_bytes} bytes of the {self.config.max_batch} rows' Mamba-2 states; give more "
                                 "than that, or fewer rows (--max-batch)")  # fmt: skip
            tokens = int(room // self._bytes_per_token) if self._bytes_per_token > 0 else cap
        else:
            tokens = int(v)
        if tokens < 2 * self._S:
            raise ValueError(f"EngineConfig: kv_budget={self.config.kv_budget!r} holds {tokens} cache tokens, fewer than one "
                             f"request of two tokens needs ({2 * self._S}: {self._S} loop slots per token); give more")  # fmt: skip
        self._budget = min(tokens, cap)

    def _main(self, ready: threading.Event) -> None:
        from ..decode.sampling import decode_context

        with torch.no_grad(), decode_context(self.model, self.config.max_batch):
            ready.set()
            while True:
                try:
                    if not self._tick():
                        if self._deadline is not None:
                            break
                        self._wake.wait(0.05)
                        self._wake.clear()
                except Exception as e:  # fail what was running; a fresh decoder for what comes next
                    self.last_error = f"{type(e).__name__}: {e}"
                    for req in [r for r in self._rows if r is not None] + list(self._waiting):
                        req.in_flight = False
                        self._finish(req, "error", self.last_error)
                    self._waiting.clear()
                    self._queued = 0
                    try:
                        self._build()
                    except Exception:
                        break
            for req in [r for r in self._rows if r is not None] + list(self._waiting):
                req.in_flight = False
                self._finish(req, "abort", "the server is shutting down")
            self._drain()  # (requests that raced the shutdown)
            for item in list(self._waiting):
                self._finish(item, "abort", "the server is shutting down")
            self._gauges.update(running=0, waiting=0, kv_tokens_used=0)

    def _drain(self) -> None:
        while True:
            try:
                kind, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                req = rest[0]
                if self._deadline is not None:
                    with self._lock:
                        self._queued -= 1
                    self._finish(req, "abort", "the server is shutting down")
                else:
                    self._waiting.append(req)
            elif kind == "abort":
                rid, reason = rest
                for req in itertools.chain(self._rows, self._waiting):
                    if req is not None and req.id == rid and not req.finished:
                        if req in self._waiting:
                            self._waiting.remove(req)
                            with self._lock:
                                self._queued -= 1
                        self._finish(req, reason)
                        break
            elif kind == "shutdown":
                self._deadline = rest[0]

    def _tick(self) -> bool:
        """One iteration (module docstring); False when there was nothing to do."""
        self._drain()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            for req in [r for r in self._rows if r is not None] + list(self._waiting):
                req.in_flight = False
                self._finish(req, "abort", "the server is shutting down: its grace period ended")
            self._rows = [None] * len(self._rows)
            self._cohorts, self._waiting = [], deque()
            return False
        worked = self._admit()
        dec, B = self._dec, len(self._rows)
        start = [] if (self.config.exit_schedule == "token" and self._cohorts) else [
            b for b in range(B) if self._rows[b] is not None and self._rows[b].next_token is not None]
        start = self._fit(start)
        live = [b for b in range(B) if self._rows[b] is not None and (self._rows[b].in_flight or self._rows[b].next_token is not None)]
        self._gauges.update(running=sum(r is not None for r in self._rows), waiting=len(self._waiting),
                            kv_tokens_used=self._used() + self._S * len(start))  # fmt: skip
        if not start and not self._cohorts:
            return worked
        L = max(self._col[b] for b in live) + 1
        if start:
            ids = torch.tensor([self._rows[b].next_token for b in start], device=dec.col.device)
            forced = [self._rows[b].forced.popleft() if self._rows[b].forced else 0 for b in start]
            self._cohorts.append(dec.start(start, ids, L, forced if any(forced) else None))
            for b in start:
                self._rows[b].next_token, self._rows[b].in_flight = None, True
        st = dec.stats
        n0 = len(st.selected)
        exits = dec._pass(self._cohorts, dec.col, L)
        self._cohorts = [c for c in self._cohorts if c.rows.numel()]
        if exits:
            rows = torch.cat([r for r, _, _ in exits]) if len(exits) > 1 else exits[0][0]
            logits = dec._logits_of(exits, dec.col, L)  # [e, V]
            dec.advance(rows)
            depth = torch.cat(st.selected[n0:]).tolist()
            rows_h = rows.tolist()
            # the rows whose token is a new one (not aborted, preempted or replayed): only they sample
            new = [i for i, b in enumerate(rows_h) if not (self._rows[b].finished or self._rows[b].preempt or self._rows[b].feed)]
            picks = dict(zip(new, self._pick([self._rows[rows_h[i]] for i in new],
                                             logits if len(new) == len(rows_h) else logits[new]))) if new else {}  # fmt: skip
            for i, (b, d) in enumerate(zip(rows_h, depth)):
                req = self._rows[b]
                self._col[b] += 1
                req.in_flight = False
                if req.finished:  # aborted while its token looped: the row frees now, the token is dropped
                    self._rows[b], req.row = None, None
                elif req.preempt:  # preempted while its token looped: the token is dropped (recomputed later)
                    self._preempt(req)
                elif req.feed:  # replaying after a preemption: the next token is the one it had made
                    req.next_token = req.feed.popleft()
                else:
                    self._exits[d - 1] += 1
                    self._token(req, picks[i], d)
        dec._count_flops()
        st.selected.clear()
        st.executed.clear()
        self._gauges.update(running=sum(r is not None for r in self._rows), waiting=len(self._waiting), kv_tokens_used=self._used())
        return True

    def _admit(self) -> bool:
        """One prefill chunk of the oldest waiting request (its row taken when it starts); a finished prompt
        joins its row (or, at ``max_tokens = 0``, ends). Returns whether it ran anything."""
        if not self._waiting:
            return False
        req = self._waiting[0]
        if req.row is None and req.params.max_tokens > 0:
            free = [b for b in range(len(self._rows)) if self._rows[b] is None]
            if not free:
                return False
            if self._budget is not None and self._used() + (len(req.prompt) + req.params.max_tokens) * self._S > self._budget:
                return False  # the budget is full: it waits (the oldest first) until rows end or are preempted
            req.row = free[0]
            self._rows[req.row] = req
        dec, P = self._dec, len(req.prompt)
        echo = req.params.prompt_logprobs and not req.prompt_sent
        if req.part is None:
            req.part = dec.new_part(P)
            if echo:
                req.prompt_lp, req.prompt_top = [None], [None]
        a = req.done_prompt
        n = P - a if self.config.prefill_chunk is None else min(self.config.prefill_chunk, P - a)
        if P - a - n == 1:  # a 1-token call on a filled cache would decode (with exits): take it now
            n += 1
        ids = torch.tensor([req.prompt[a : a + n]], device=dec.col.device)
        exit = None  # prefill='exit': the prompt (whole: prefill_chunk is None) at adaptive depth, at its own ε
        if self._prefill_exit is not None and req.checks:
            exit = replace(self._prefill_exit, threshold=req.thr) if req.thr != self._prefill_exit.threshold else self._prefill_exit
        logits, first_depth = dec.prefill(req.part, ids, n if echo else 1, exit)
        logits = logits[0]  # [keep, V]
        req.done_prompt = a + n
        if echo:
            lp = torch.log_softmax(logits.float(), -1)  # [n, V]: position a + i predicts token a + i + 1
            nxt = torch.tensor(req.prompt[a + 1 : a + n + 1], device=lp.device)
            chosen = lp[: nxt.numel()].gather(1, nxt[:, None])[:, 0].tolist()
            k = req.params.logprobs or 0
            tops = _top(lp[: nxt.numel()], k)
            req.prompt_lp += chosen
            req.prompt_top += tops
        if req.done_prompt < P:
            return True
        self._waiting.popleft()
        with self._lock:
            self._queued -= 1
        if not req.prompt_sent:
            req.prompt_sent = True
            self._totals["prompt_tokens_total"] += P
            if echo:
                self._emit(req, PromptEvent(req.prompt_lp, req.prompt_top))
        if req.finished:  # aborted during its prefill
            return True
        if req.params.max_tokens == 0:
            self._finish(req, "length")
            return True
        b = req.row
        dec.place(b, req.part, P, req.thr, req.checks)
        req.part, req.placed = None, True
        self._col[b] = P
        if req.tokens:  # preempted before: it replays the tokens it had made (_preempt), from the first
            req.next_token = req.tokens[0]
        else:
            self._token(req, self._pick([req], logits[-1:])[0], first_depth)
        return True

    # ------------------------------------------------------------------------------------------ the budget
    def _occupied(self, req: _Request) -> int:
        """The cache tokens a request with a row holds: its columns × S once placed, its prompt's while it
        prefills (its own prefill cache)."""
        if not req.placed:
            return len(req.prompt) * self._S
        return (self._col[req.row] + req.in_flight) * self._S

    def _used(self) -> int:
        return sum(self._occupied(r) for r in self._rows if r is not None)

    def _fit(self, start: list) -> list:
        """The rows of ``start`` (each about to write one more column) that the budget holds. Where they
        would outgrow it, the youngest requests are preempted (never the oldest: it always fits, by
        :meth:`check`) — at once when their row is idle, when their token exits when it is in flight (the rows
        that do not fit meanwhile wait, the youngest first)."""
        if self._budget is None or not start:
            return start
        S, T = self._S, self._budget
        reqs = sorted((r for r in self._rows if r is not None), key=lambda r: r.id)  # oldest first
        used = sum(self._occupied(r) for r in reqs)
        pending = sum(self._occupied(r) for r in reqs if r.preempt)  # frees when their token exits
        for r in reversed(reqs[1:]):  # the youngest first
            if used - pending + S * len(start) <= T:
                break
            if r.preempt or r.finished:
                continue
            if r.in_flight:
                r.preempt, pending = True, pending + self._occupied(r)
            else:
                used -= self._occupied(r)
                if r.row in start:
                    start.remove(r.row)
                self._preempt(r)
        while start and used + S * len(start) > T:  # (rows preempted in flight still hold their columns)
            start.remove(max(start, key=lambda b: self._rows[b].id))
        return start

    def _preempt(self, req: _Request) -> None:
        """Free ``req``'s row and queue it first: it is prefilled again later and replays the tokens it had
        made at the depths they ran (no event, no sampling: its generator is where it was), so it goes on
        exactly as it would have."""
        if req.row is not None:
            self._rows[req.row] = None
        req.row, req.part, req.done_prompt, req.next_token = None, None, 0, None
        req.in_flight = req.preempt = req.placed = False
        req.feed, req.forced = deque(req.tokens[1:]), deque(req.depths[1:])
        self._totals["preempted"] += 1
        if req not in self._waiting:  # (one still prefilling is the queue's first already)
            self._waiting.appendleft(req)
            with self._lock:
                self._queued += 1

    def _pick(self, reqs: list, logits: torch.Tensor) -> list:
        """Each request's next token from its row of ``logits [n, V]``: ``(id, logprob, top)``."""
        from ..decode.sampling import sample_next

        out = [None] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.temperature == 0]
        if greedy:
            ids = sample_next(logits[greedy] if len(greedy) < len(reqs) else logits, False, 0.0, None, None).tolist()
            for i, t in zip(greedy, ids):
                out[i] = t
        for i, r in enumerate(reqs):
            if out[i] is None:
                p = r.params
                top_k = None if p.top_k in (None, 0, -1) else p.top_k
                out[i] = int(sample_next(logits[i : i + 1], True, float(p.temperature), top_k, p.top_p, r.gen)[0])
        res = []
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        lp = torch.log_softmax(logits[want].float(), -1) if want else None
        for i, r in enumerate(reqs):
            if r.params.logprobs is None:
                res.append((out[i], None, None))
            else:
                row = lp[want.index(i)]
                res.append((out[i], float(row[out[i]]), _top(row[None], r.params.logprobs)[0] if r.params.logprobs else []))
        return res

    def _token(self, req: _Request, pick: tuple, depth: int) -> None:
        """A generated token of ``req``: its event; the request ends (its row frees) or its row feeds it next."""
        tok, lp, top = pick
        p = req.params
        req.made += 1
        req.depth_sum += depth
        req.tokens.append(tok)
        req.depths.append(depth)
        self._totals["generation_tokens_total"] += 1
        stop = (tok == self.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids
        self._emit(req, TokenEvent(tok, lp, top, depth, stop))
        if req.finished:  # (its callback aborted it: a stop string)
            return
        if stop:
            self._finish(req, "stop")
        elif req.made >= p.max_tokens or len(req.prompt) + req.made >= self.max_model_len:
            self._finish(req, "length")
        else:
            req.next_token = tok


def _top(lp: torch.Tensor, k: int) -> list:
    """The ``k`` most likely ``[(id, logprob)]`` of each row of ``lp [n, V]`` (``k = 0``: empty lists)."""
    if k <= 0:
        return [[] for _ in range(lp.shape[0])]
    v, i = lp.topk(min(k, lp.shape[-1]), -1)
    return [list(zip(a, b)) for a, b in zip(i.tolist(), v.tolist())]
