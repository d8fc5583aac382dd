"""One scheduler for every batch of rows: which requests hold the rows, and what each step runs. Pure Python (no torch).

Both continuous-batching loops drive it, so the two cannot drift apart: the serving engine (:mod:`looplm.serve.engine`,
re-exported as :mod:`looplm.serve.scheduler`) and the offline depth-batched decoder
(:meth:`looplm.decode.depth_schedule.DepthBatchedDecoder.run`: ``model.generate`` with ``Exit(schedule='depth')``,
its request refill when there are more prompts than rows). It lives on decode/'s floor 0 because it imports nothing:
decode/ must not import serve/ (serve/ imports decode/).

It owns the waiting queue, the batch's ``max_batch`` rows (free rows are taken in the order they were freed), the KV
budget, admission, prefill chunks and preemption, and each request's :class:`RequestStatus`. Each engine step asks it
for a plan (:meth:`Scheduler.schedule` -> :class:`SchedulerOutput`; or its two halves, :meth:`Scheduler.schedule_decode`
and :meth:`Scheduler.schedule_prefill`, in the order a loop needs them: the offline decoder admits and places refilled
prompts before the pass their first tokens join), runs the plan on the model, samples and tells it what came out
(:meth:`Scheduler.place` after a prompt's last chunk, :meth:`Scheduler.update_from_output` after a core pass,
:meth:`Scheduler.finish`). It never touches a tensor, so it is tested without a model
(``tests/test_serve_scheduler.py``), the way vLLM tests its scheduler.

The rules (each step):

1. **Decode.** Every running row whose next token waits starts it (the *depth* schedule: beside rows still looping
   through theirs); under the *token* schedule (``wait_for_batch``) only when no token of the batch is in flight.
2. **The KV budget** (cache tokens; None: no budget). A request holds ``len(prompt) × S`` while its prompt is
   prefilled (its own prefill cache) and ``(columns written + a token in flight) × S`` once its prompt is in its
   row (``S``: the loop slots a token keeps per layer). Where the rows starting a token would outgrow the budget, the
   youngest requests are preempted — never the oldest, which always fits (the engine refuses a request that alone
   outgrows the budget): at once when their row is idle, else when their token in flight exits (its token is
   dropped). A preempted request goes to the head of the queue; it is prefilled again later and replays the tokens
   it had made, at the depths they ran, so it goes on exactly as it would have.
3. **Prefill.** The prompt being prefilled gets its next chunk (``prefill_chunk`` tokens; None: whole); else the
   oldest waiting request (FIFO: no request overtakes the head) takes a free row (the one freed first) when the budget holds its
   ``(prompt + max_tokens) × S`` beside what the rows hold and grow by this step. A request with ``max_tokens = 0``
   (prompt logprobs only) is prefilled without a row. A chunk never leaves a single prompt token for the next (a
   one-token call on a filled cache would decode it).
4. **Batched prefill** (``batch_prefill``, with a ``prefill_chunk``): when the head's whole prompt fits in one
   chunk, the next waiting requests join it, in order, while each takes a free row under the budget and the
   batch's padded tokens (``requests × longest prompt``) stay within ``prefill_chunk``: their prompts run as one
   forward, whole. A request whose prompt logprobs are asked (``echo``: every position's logits) or with no row
   (``max_tokens = 0``) runs alone. Otherwise one prompt is prefilled per step.

A prompt whose last chunk ran is :meth:`place` d in its row and starts its first decoded token at the next step.

Capacity: :attr:`Scheduler.num_held` counts the requests that wait or hold a row (a single int the engine's
submitting threads read without a lock); a prefilling request holds a row and does not wait.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

__all__ = ["PrefillChunk", "Request", "RequestStatus", "ScheduledToken", "Scheduler", "SchedulerOutput"]


class RequestStatus(enum.Enum):
    """Where a request is in its life. ``WAITING`` -> ``PREFILLING`` (holds a row, its prompt runs chunk by chunk)
    -> ``RUNNING`` (its prompt is in its row; it decodes) -> a ``FINISHED_*``. ``RUNNING`` -> ``PREEMPTING`` (to lose
    its row when its token in flight exits) -> ``PREEMPTED`` (back in the queue, first; prefilled again, it replays its
    tokens) -> ``PREFILLING`` ... A request finished while its token is in flight keeps its row until the token exits
    (the token is dropped)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PREEMPTING = "preempting"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # a stop token, or a stop string found by the caller
    FINISHED_LENGTH = "length"  # max_tokens, or the model's context
    FINISHED_ABORTED = "abort"  # a disconnect, a timeout, the shutdown
    FINISHED_ERROR = "error"  # the model step raised

    @property
    def finished(self) -> bool:
        return self.value in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` (``'stop'``, ``'length'``, ``'abort'``, ``'error'``); None while unfinished."""
        return self.value if self.finished else None

    @classmethod
    def of_reason(cls, reason: str) -> "RequestStatus":
        """The finished status of a finish reason (``'stop'``, ``'length'``, ``'abort'``, ``'error'``)."""
        if reason not in _FINISHED:
            raise ValueError(f"a finish reason is one of {sorted(_FINISHED)}, got {reason!r}")
        return cls(reason)


_FINISHED = {"stop", "length", "abort", "error"}


@dataclass(eq=False)
class Request:
    """A request's scheduling state. The engine subclasses it with what it needs besides (sampling parameters,
    callback, generator)."""

    id: int
    prompt: list  # token ids
    max_tokens: int
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None  # its batch row, from the start of its prefill
    num_prefilled: int = 0  # prompt tokens prefilled (in this admission: a preemption starts again at 0)
    num_cached: int = 0  # once placed: the columns its row holds in the batch cache (prompt + tokens whose pass ended)
    in_flight: bool = False  # its row has a token looping (the row frees only when the token exits)
    next_token: int | None = None  # the token its row starts at its next step (None: none waiting)
    output_token_ids: list = field(default_factory=list)  # generated tokens
    output_depths: list = field(default_factory=list)  # the loops each generated token ran
    replay_tokens: deque = field(default_factory=deque)  # after a preemption: generated tokens still to replay
    replay_depths: deque = field(default_factory=deque)  # the depth each replayed token's pass left at
    num_preemptions: int = 0
    echo: bool = False  # its prompt's logprobs are asked: every position's logits (its prompt runs alone)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def replaying(self) -> bool:
        """Its row recomputes tokens it had made before a preemption (their picks are known: no sampling)."""
        return bool(self.replay_tokens)


@dataclass(frozen=True)
class ScheduledToken:
    """A row starting a token this step: ``forced_depth`` > 0 fixes the loop its pass leaves at (a replayed token
    leaves where it left the first time); 0: its exit criterion decides."""

    row: int
    token_id: int
    forced_depth: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start, end)`` of ``request`` to prefill this step."""

    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        """The prompt's last chunk: its request is placed in its row (or, at ``max_tokens = 0``, ends) after it."""
        return self.end == len(self.request.prompt)


@dataclass
class SchedulerOutput:
    """One step's plan: ``prefill`` (one chunk of one prompt, several whole prompts to run as one batch, or none),
    the rows starting a token (``decode``), the requests preempted at once (their rows were idle; the engine drops
    their prefill state), and ``kv_tokens``: the cache tokens the rows hold while the step runs."""

    prefill: list = field(default_factory=list)  # [PrefillChunk]
    decode: list = field(default_factory=list)  # [ScheduledToken]
    preempted: list = field(default_factory=list)  # [Request]
    kv_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """Queues, rows, the KV budget and each step's plan (module docstring). ``max_batch``: rows; ``max_waiting``:
    requests that may wait for a row beside them (:meth:`room`); ``kv_budget``: cache tokens the requests may hold (None: no bound); ``slots_per_token`` (``S``): cache tokens
    per token position; ``prefill_chunk``: prompt tokens per step (None: whole prompts, >= 2); ``wait_for_batch``:
    the token schedule (rows start tokens only when none is in flight); ``batch_prefill``: whole prompts that fit
    in one chunk run together (rule 4; off without a ``prefill_chunk``)."""

    def __init__(
        self,
        max_batch: int,
        max_waiting: int = 64,
        kv_budget: int | None = None,
        slots_per_token: int = 1,
        prefill_chunk: int | None = None,
        wait_for_batch: bool = False,
        batch_prefill: bool = False,
    ):
        errs = []
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            errs.append(f"max_batch must be an int >= 1, got {max_batch!r}")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            errs.append(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
            errs.append(f"kv_budget must be an int >= 1 (cache tokens) or None, got {kv_budget!r}")
        if isinstance(slots_per_token, bool) or not isinstance(slots_per_token, int) or slots_per_token < 1:
            errs.append(f"slots_per_token must be an int >= 1, got {slots_per_token!r}")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 2
        ):
            errs.append(f"prefill_chunk must be an int >= 2 or None, got {prefill_chunk!r}")
        if errs:
            raise ValueError("Scheduler: " + "; ".join(errs))
        self.max_batch, self.max_waiting, self.budget, self.S = max_batch, max_waiting, kv_budget, slots_per_token
        self.prefill_chunk, self.wait_for_batch = prefill_chunk, wait_for_batch
        self.batch_prefill = batch_prefill and prefill_chunk is not None
        self.rows: list[Request | None] = [None] * max_batch
        self.free_rows: deque[int] = deque(range(max_batch))  # free rows, the first freed first (admission takes it)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # requests whose prompts run (one chunk by chunk, or a batch's, whole)
        self.requests: dict[int, Request] = {}  # unfinished requests by id
        self.num_held = 0  # requests waiting or holding a row (read by submitting threads: one int, no lock)
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        """Rows held (prefilling, decoding, or a finished request's token still in flight)."""
        return sum(r is not None for r in self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_rows(self) -> int:
        return len(self.free_rows)

    @property
    def in_flight(self) -> bool:
        """Some row has a token looping."""
        return any(r is not None and r.in_flight for r in self.rows)

    @property
    def capacity(self) -> int:
        """The most requests it ever holds at once: ``max_batch`` rows + ``max_waiting`` in the queue."""
        return self.max_batch + self.max_waiting

    def room(self, pending: int = 0) -> int:
        """How many more requests it takes now (``pending``: requests on their way, not yet :meth:`add` ed): the
        capacity less those waiting or holding a row. A prefilling request holds a row; it does not also wait."""
        return self.capacity - self.num_held - pending

    def occupied(self, req: Request) -> int:
        """The cache tokens a request with a row holds: its prompt's while it prefills (its own prefill cache), its
        columns (and a token in flight) once placed."""
        if req.status is RequestStatus.PREFILLING:
            return len(req.prompt) * self.S
        return (req.num_cached + req.in_flight) * self.S

    def kv_tokens_used(self) -> int:
        return sum(self.occupied(r) for r in self.rows if r is not None)

    def unfinished(self) -> list:
        """Every request not finished, plus finished ones whose token is still in flight (they hold rows)."""
        out = [r for r in self.rows if r is not None]
        out += [r for r in self.prefilling if r.row is None]
        return out + list(self.waiting)

    # ------------------------------------------------------------------------------------------ requests in
    def add(self, req: Request) -> None:
        """Queue a new request (last)."""
        if req.status is not RequestStatus.WAITING or req.id in self.requests:
            raise ValueError(f"request {req.id} is already scheduled ({req.status.value})")
        if not req.prompt:
            raise ValueError(f"request {req.id} has an empty prompt")
        self.requests[req.id] = req
        self.waiting.append(req)
        self.num_held += 1

    def get(self, rid: int) -> Request | None:
        """The unfinished request ``rid`` (None: unknown or finished)."""
        return self.requests.get(rid)

    def finish(self, req: Request, status: RequestStatus) -> bool:
        """End ``req`` with ``status`` (a ``FINISHED_*``): out of the queue, its row freed now — or, with a token in
        flight, when that token exits. False when it had already finished."""
        if not status.finished:
            raise ValueError(f"finish needs a finished status, got {status}")
        if req.finished:
            return False
        was = req.status
        req.status = status
        self.requests.pop(req.id, None)
        if was in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
            self.num_held -= 1
        elif req in self.prefilling:
            self.prefilling.remove(req)
            self._release(req)
        elif not req.in_flight:
            self._release(req)
        req.next_token = None
        req.replay_tokens.clear()
        req.replay_depths.clear()
        return True

    def _release(self, req: Request) -> None:
        if req.row is not None:
            self._free(req.row)
            req.row = None
        self.num_held -= 1

    def _free(self, b: int) -> None:
        """Row ``b`` is free: the last of the free rows to be taken."""
        self.rows[b] = None
        self.free_rows.append(b)

    def finish_all(self, status: RequestStatus) -> list:
        """Finish every request (error, shutdown), tokens in flight included: the rows are all free after it.
        Returns those that were unfinished."""
        out = []
        for req in self.unfinished():
            req.in_flight = False
            if req.finished:  # (its row waited for its token in flight)
                self._release(req)
            elif self.finish(req, status):
                out.append(req)
        self.rows = [None] * self.max_batch
        self.free_rows = deque(range(self.max_batch))
        self.waiting.clear()
        self.prefilling, self.num_held = [], 0
        return out

    # ------------------------------------------------------------------------------------------ the plan
    def schedule(self) -> SchedulerOutput:
        """This step's plan (module docstring): decode starts fitted to the budget (:meth:`schedule_decode`), then
        one prefill chunk or a batch of whole prompts (:meth:`schedule_prefill`)."""
        out = SchedulerOutput()
        out.decode = self.schedule_decode(out.preempted)
        out.prefill = self.schedule_prefill()
        out.kv_tokens = self.kv_tokens_used()
        return out

    def schedule_decode(self, preempted: list | None = None) -> list:
        """Rules 1 and 2: the rows that start their next token now (in row order), fitted to the KV budget; they are
        in flight after it. Requests preempted at once (their rows were idle) are appended to ``preempted``."""
        ready = (
            []
            if (self.wait_for_batch and self.in_flight)
            else [
                r for r in self.rows if r is not None and r.status is RequestStatus.RUNNING and r.next_token is not None
            ]
        )
        ready = self._fit(ready, [] if preempted is None else preempted)
        out = []
        for r in ready:
            forced = r.replay_depths.popleft() if r.replay_depths else 0
            out.append(ScheduledToken(r.row, r.next_token, forced))
            r.next_token, r.in_flight = None, True
        return out

    def schedule_prefill(self) -> list:
        """Rules 3 and 4: the prompt chunks that run now (:class:`PrefillChunk`: one chunk of one prompt, several whole
        prompts to run as one batch, or none); their requests hold their rows (``PREFILLING``) after it."""
        if self.prefilling:  # (a prompt that runs chunk by chunk: one at a time)
            return [self._chunk(self.prefilling[0])]
        if not self.waiting or not self._admit(self.waiting[0]):
            return []
        first = self._chunk(self.waiting[0])
        self.waiting.popleft()
        out = [first]
        head = first.request
        if not (self.batch_prefill and first.last and head.row is not None and not head.echo):
            return out
        longest = len(head.prompt)
        while self.waiting:  # whole prompts join it (rule 4) while rows, the budget and the chunk hold them
            req = self.waiting[0]
            longest = max(longest, len(req.prompt))
            if req.echo or req.max_tokens == 0 or (len(out) + 1) * longest > self.prefill_chunk or not self._admit(req):
                break
            out.append(self._chunk(req))
            self.waiting.popleft()
        return out

    def _admit(self, req: Request) -> bool:
        """``req`` (the queue's first) takes a free row when the budget holds it (one with ``max_tokens = 0`` takes
        none) and starts its prefill."""
        if req.max_tokens > 0:
            if not self.free_rows:
                return False
            if (
                self.budget is not None
                and self.kv_tokens_used() + (len(req.prompt) + req.max_tokens) * self.S > self.budget
            ):
                return False  # the budget is full: it waits (the oldest first) until rows end or are preempted
            req.row = self.free_rows.popleft()
            self.rows[req.row] = req
        req.status, req.num_prefilled = RequestStatus.PREFILLING, 0
        self.prefilling.append(req)
        return True

    def _chunk(self, req: Request) -> PrefillChunk:
        """The next chunk of ``req``'s prompt (``prefill_chunk`` tokens; never a single token left for the next)."""
        P, a = len(req.prompt), req.num_prefilled
        n = P - a if self.prefill_chunk is None else min(self.prefill_chunk, P - a)
        if P - a - n == 1:  # a 1-token call on a filled cache would decode (with exits): take it now
            n += 1
        req.num_prefilled = a + n
        return PrefillChunk(req, a, a + n)

    def _fit(self, start: list, preempted: list) -> list:
        """The requests of ``start`` (each about to write one more column) that the budget holds. Where they would
        outgrow it, the youngest requests are preempted (never the oldest: it always fits) — at once when their row
        is idle (into ``preempted``), when their token exits when it is in flight (the rows that do not fit
        meanwhile wait, the youngest first)."""
        if self.budget is None or not start:
            return start
        S, T = self.S, self.budget
        reqs = sorted((r for r in self.rows if r is not None), key=lambda r: r.id)  # oldest first
        used = sum(self.occupied(r) for r in reqs)
        pending = sum(self.occupied(r) for r in reqs if r.status is RequestStatus.PREEMPTING)  # frees when they exit
        for r in reversed(reqs[1:]):  # the youngest first
            if used - pending + S * len(start) <= T:
                break
            if r.status is RequestStatus.PREEMPTING or r.finished:
                continue
            if r.in_flight:
                r.status, pending = RequestStatus.PREEMPTING, pending + self.occupied(r)
            else:
                used -= self.occupied(r)
                if r in start:
                    start.remove(r)
                self._preempt(r)
                preempted.append(r)
        while start and used + S * len(start) > T:  # (rows preempted in flight still hold their columns)
            start.remove(max(start, key=lambda r: r.id))
        return start

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s row and queue it first: prefilled again later, it replays the tokens it had made at the
        depths they ran (depth of the pass each token started: the next one's), then goes on."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req.row is not None:
            self._free(req.row)
        req.row, req.num_prefilled, req.num_cached, req.next_token, req.in_flight = None, 0, 0, None, False
        req.replay_tokens = deque(req.output_token_ids[1:])
        req.replay_depths = deque(req.output_depths[1:])
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------------------------------ outcomes
    def place(self, req: Request) -> None:
        """``req``'s last prompt chunk ran: its prompt is in its row (``RUNNING``). A request that had made tokens
        before a preemption replays them from the first; else the engine gives it its first token
        (:meth:`append_token`)."""
        if req not in self.prefilling or req.num_prefilled != len(req.prompt):
            raise ValueError(
                f"request {req.id} has no finished prompt to place ({req.status.value}, "
                f"{req.num_prefilled}/{len(req.prompt)} prompt tokens prefilled)"
            )
        if req.row is None:
            raise ValueError(f"request {req.id} has no row (max_tokens={req.max_tokens}): finish it instead")
        self.prefilling.remove(req)
        req.status, req.num_cached = RequestStatus.RUNNING, len(req.prompt)
        if req.output_token_ids:
            req.next_token = req.output_token_ids[0]

    def append_token(self, req: Request, token_id: int, depth: int) -> None:
        """A new (sampled) token of ``req``: recorded; its row starts it next unless the engine finishes ``req``."""
        req.output_token_ids.append(token_id)
        req.output_depths.append(depth)
        if not req.finished:
            req.next_token = token_id

    def update_from_output(self, rows: list) -> tuple[list, list]:
        """The tokens in flight of ``rows`` exited this pass: each row holds one more column. Returns
        ``(sample, preempted)``: the indices ``i`` of ``rows`` whose request needs its next token picked (not finished,
        preempting or replaying; the engine samples and calls :meth:`append_token` or :meth:`finish`), and the
        requests preempted now (their token dropped). A finished request's row frees; a replaying row takes its next
        replayed token."""
        sample, preempted = [], []
        for i, b in enumerate(rows):
            req = self.rows[b]
            if req is None or not req.in_flight:
                raise ValueError(f"row {b} had no token in flight")
            req.in_flight = False
            req.num_cached += 1
            if req.finished:  # ended while its token looped: the row frees now, the token is dropped
                self._free(b)
                req.row = None
                self.num_held -= 1
            elif req.status is RequestStatus.PREEMPTING:  # the token is dropped (recomputed later)
                self._preempt(req)
                preempted.append(req)
            elif req.replay_tokens:  # replaying after a preemption: the next token is the one it had made
                req.next_token = req.replay_tokens.popleft()
            else:
                sample.append(i)
        return sample, preempted
