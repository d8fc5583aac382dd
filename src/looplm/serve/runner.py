"""The serving engine's model runner: the batch's caches and the model step, behind a public step API.

It owns the depth-schedule decoder (:class:`ServeDecoder`, a
:class:`~looplm.decode.depth_schedule.DepthBatchedDecoder` whose rows take requests one at a time), the cohorts of
tokens in flight, each row's column and the prompts' own prefill caches. The engine calls

* :meth:`ModelRunner.prefill` — a chunk of a prompt, alone, at full depth into the request's own cache (or, with
  ``prefill='exit'``, the whole prompt at adaptive depth): its logits;
* :meth:`ModelRunner.prefill_batch` — several whole prompts as one forward, right-padded to the longest: each
  row's tokens come before its padding, so under causal attention they compute as the prompt alone would
  (positions from 0, no mask); the final norm and the head run at each row's own last position only. Only where
  every cache slot of a prompt is attention KV (:attr:`ModelRunner.can_batch_prefill`: a Mamba-2 state would run on through the
  padding);
* :meth:`ModelRunner.place` — a prefilled prompt into its batch row (its slots copied into the row's columns);
* :meth:`ModelRunner.step` — the rows given start their next tokens, and **one core pass** runs over every row in
  flight: a :class:`StepOutput` of the rows whose token exited, their logits and the loops each ran.

It decides nothing: which rows start, which prompt runs and which row a request takes are the scheduler's
(:mod:`.scheduler`); the picks are the sampler's (:mod:`.sampler`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import SharedKV
from ..decode.depth_schedule import DepthBatchedDecoder, copy_prompt_rows
from ..layers.attention import KVCache

__all__ = ["ModelRunner", "ServeDecoder", "StepOutput"]


@dataclass
class StepOutput:
    """The tokens that exited a pass: their ``rows`` (host ints), ``logits [e, V]`` in that order, and the loops each
    ran (``depths``, host ints)."""

    rows: list
    logits: torch.Tensor  # [e, V]
    depths: list


class _RowCriterion:
    """A cohort's criterion with a threshold per row: ``check`` compares each row with its own ε (a tensor in
    the criterion's place), and a row whose request runs full depth (ε = 0 under ``kl`` / ``convergence``)
    never leaves. A cohort of full-depth rows only skips the check (its rows run every loop). ``forced [n]``
    (None: none): a row's depth fixed in advance (0: its criterion's) — a preempted request replaying the
    tokens it had generated leaves at the loop each of them left at the first time."""

    def __init__(self, crit, thr: torch.Tensor | None, check: bool, forced: torch.Tensor | None = None):
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
            leave = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)  # [n]
        else:
            if self.thr is not None:  # (the gate keeps the server's q: the rule selects its output with it too)
                # [n] against [n] distances
                self.crit.threshold = self.thr if self.thr.numel() != 1 else float(self.thr)
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


class ServeDecoder(DepthBatchedDecoder):
    """:class:`DepthBatchedDecoder` with rows that take requests one at a time: row ``b`` holds its prompt at
    columns ``< p_b`` (no padding, position = column) and its ``t``-th token at column ``p_b + t``; every row
    reads its own columns up to its own under the pass's mask (the depth schedule's per-row columns)."""

    def __init__(self, model, batch_size: int, capacity: int, exit):
        super().__init__(model, batch_size, capacity, exit)
        dev = next(model.parameters()).device
        B, cap = batch_size, capacity
        self.row_thr = torch.zeros(B, device=dev)  # [B] each row's ε (its request's), read when its token starts
        self.row_checks = [True] * B  # whether the row's request takes exits at all
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
        self.visible = torch.ones(B, cap, dtype=torch.bool, device=dev)  # [B, cap]
        self.pos_shift = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)  # [B, 1]
        self.keys = torch.arange(cap, device=dev)  # [cap]
        self.rope_at = {int(r): rot(self.keys[:, None]) for r, rot in model.rotary.items()}  # [cap, 1, rot]
        self.attn_rows = torch.zeros(B, cap, dtype=torch.bool, device=dev)  # [B, cap]: what each row's token reads
        self.attn = self.attn_rows[:, None, None, :]  # [B, 1, 1, cap] (a view)
        self.yes = torch.ones((), dtype=torch.bool, device=dev)
        self.exit_keys = []
        self.col = torch.zeros(B, dtype=torch.long, device=dev)  # [B] each row's token in flight's column

    def prefill(self, part, ids: torch.Tensor, keep: int, exit=None, at: torch.Tensor | None = None) -> tuple:
        """``ids [n, T]``, the next chunk of a prompt (or ``n`` prompts), at full depth into its own cache ``part``
        (made by :meth:`new_part`); or, with ``exit`` (a resolved :class:`~looplm.decode.exits.Exit`,
        ``prefill='exit'``), the whole prompt into the empty ``part`` at adaptive depth, its first token at every
        loop. Returns ``(logits of its last keep positions [n, keep, V], the loops its last position ran)``; with
        ``at [n]`` (full depth only) the final norm and the head run at row ``i``'s position ``at[i]`` alone:
        ``[n, 1, V]``."""
        if exit is not None and at is not None:
            raise ValueError(
                "prefill at positions (at) runs at full depth; a prompt at adaptive depth (exit) keeps "
                "its last positions"
            )
        self.flush()  # the fills carried into the next pass, before the cache changes hands
        if exit is not None:
            from ..decode.exit_forward import adaptive_forward

            out = adaptive_forward(
                self.model,
                ids,
                exit,
                loop_options=self.loop_options,
                full_depth_prefix=1,
                cache=part,
                logits_to_keep=keep,
            )
            return out.logits, int(out.depth[0, -1])
        main = self.cache
        self.cache = part
        try:
            return self(ids, None, logits_to_keep=keep, validate=False, logits_at=at), self.R
        finally:
            self.cache = main

    def new_part(self, p: int, rows: int = 1):
        """A prompt's own cache (or a batch of prompts'): ``rows`` rows, ``p`` columns, every loop."""
        return self.model.new_cache(rows, self.R, capacity=p, kv_shared=self.cache.kv_shared)

    def place(self, b: int, part, p: int, thr: float, checks: bool, src_row: int | None = None) -> None:
        """Row ``b`` takes a prefilled prompt: ``part``'s slots (``src_row`` of a batch's KV slots; None: a one-row
        part's, whatever their kind) into its columns ``< p`` of every slot (every loop), its mask and column reset
        (its first token goes in at column ``p``)."""
        main, dev = self.cache, self.col.device
        self.flush()
        rows = torch.tensor([b], device=dev)
        pairs = [(src, main.slots[key]) for key, src in part.slots.items() if not isinstance(src, SharedKV)]
        pairs += [(src, main.shared[fam]) for fam, src in part.shared.items()]
        for src, dst in pairs:
            if src_row is None:
                copy_prompt_rows(src, dst, rows, p)
            else:
                _place_kv(src, dst, src_row, b, p)
        self.col[b] = p
        self.attn_rows[b] = self.keys <= p
        self.row_thr[b] = thr
        self.row_checks[b] = checks

    def start(self, rows_h: list, ids: torch.Tensor, L: int, forced: list | None = None):
        """Rows ``rows_h`` begin tokens ``ids [n]``: a new cohort at loop 0, its criterion per row; ``forced``:
        each row's fixed depth (0: its criterion's; None: none fixed)."""
        rows = torch.tensor(rows_h, device=self.col.device)  # [n]
        c = self._start(rows, ids[:, None], self.col, torch.zeros_like(rows), L)
        checks = [self.row_checks[b] for b in rows_h]
        thr = None if self.exit.criterion == "gate" else self.row_thr.index_select(0, rows)  # [n]
        f = None if forced is None else torch.tensor(forced, device=rows.device)  # [n]
        c.crit = _RowCriterion(c.crit, thr, any(checks), f)
        return c

    def advance(self, rows: torch.Tensor) -> None:
        """Rows ``rows [e]`` whose tokens exited move to their next column (their next token reads its own too)."""
        c = self.col.index_select(0, rows) + 1  # [e]
        self.col.index_copy_(0, rows, c)
        self.attn_rows.index_put_((rows, c), self.yes)


def _place_kv(src: KVCache, dst: KVCache, i: int, b: int, p: int) -> None:
    """Row ``i`` of a batch's KV slot ``src``, columns ``< p``, into row ``b`` of ``dst`` (a view of a flat buffer
    writes the buffer)."""
    if src._k is None:  # (a slot the prompts never wrote)
        return
    dst._k[b, :, :p] = src._k[i, :, :p].to(dst._k.dtype)  # [H_kv, p, hd]
    dst._v[b, :, :p] = src._v[i, :, :p].to(dst._v.dtype)


class ModelRunner:
    """The batch's model step (module docstring): ``max_batch`` rows of ``max_model_len`` columns at every loop
    slot, under the resolved exit ``exit``. ``slots_per_token`` (``S``): the cache tokens a token position holds
    (the loops' K slots, or 1 under ``kv='shared'``); ``bytes_per_token``: one cache token's bytes; ``ssm_bytes``:
    the rows' fixed Mamba-2 states; ``can_batch_prefill``: every slot of a prompt's cache is attention KV, so
    prompts may run as one right-padded batch (:meth:`prefill_batch`)."""

    def __init__(self, model, max_batch: int, max_model_len: int, exit):
        B = max_batch
        with torch.no_grad():
            self.decoder = dec = ServeDecoder(model, B, max_model_len, exit)
        self.K = dec.R
        self.col = [0] * B  # host copy of each row's column
        self.cohorts: list = []  # the tokens in flight, one cohort per start
        self.in_flight: set = set()  # rows with a token in flight
        self.parts: dict = {}  # request id -> (its prompt's prefill cache, its row there: None for a one-row cache)
        probe = dec.new_part(2)  # which slots a prompt writes: attention KV only, or state that runs over positions
        with torch.no_grad():
            dec.prefill(probe, torch.zeros(1, 2, dtype=torch.long, device=dec.col.device), 1)
        self.can_batch_prefill = all(isinstance(v, (KVCache, SharedKV)) for v in probe.slots.values()) and all(
            isinstance(v, KVCache) for v in probe.shared.values()
        )
        seen, total = set(), 0
        for s in list(dec.cache.physical_slots()) + [b for b, _, _ in dec.kv_flat.values()]:
            for t in (getattr(s, "_k", None), getattr(s, "_v", None)):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        self.slots_per_token = dec.R if any(off for _, _, off in dec.kv_flat.values()) else 1
        self.bytes_per_token = total / (B * max_model_len * self.slots_per_token)  # one column's bytes / S
        ssm = [e[0] for e in dec.flat.values() if hasattr(e[0], "ssm_state")]  # the core's flat Mamba-2 states
        ssm += [s for s in dec.cache.physical_slots() if hasattr(s, "ssm_state")]  # (views of those, and the rest)
        seen, self.ssm_bytes = set(), 0
        for st in ssm:
            for t in (st.conv_state, st.ssm_state):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self.ssm_bytes += t.untyped_storage().nbytes()

    @property
    def device(self) -> torch.device:
        return self.decoder.col.device

    def prefill(self, rid: int, prompt: list, start: int, end: int, keep: int, exit=None) -> tuple:
        """Prompt tokens ``[start, end)`` of request ``rid`` at full depth into its own cache (made at ``start = 0``),
        or with ``exit`` (``prefill='exit'``: ``start = 0``, ``end = len(prompt)``) at adaptive depth. Returns
        ``(logits [keep, V] of the chunk's last keep positions, the loops its last position ran)``."""
        if not 0 <= start < end <= len(prompt) or not 1 <= keep <= end - start:
            raise ValueError(
                f"prefill of prompt tokens [{start}, {end}) keeping {keep} logits: out of the "
                f"{len(prompt)}-token prompt"
            )
        if start == 0:
            self.parts[rid] = (self.decoder.new_part(len(prompt)), None)
        elif rid not in self.parts:
            raise ValueError(f"request {rid} continues a prefill at token {start} that never started")
        ids = torch.tensor([prompt[start:end]], device=self.device)  # [1, T]
        logits, depth = self.decoder.prefill(self.parts[rid][0], ids, keep, exit)  # [1, keep, V]
        return logits[0], depth

    def prefill_batch(self, rids: list, prompts: list) -> tuple:
        """Whole prompts of requests ``rids`` as one forward at full depth, right-padded to the longest (module
        docstring), into one cache their rows share. Returns ``(logits [n, V] at each prompt's last position, the
        loops they ran)``."""
        if not self.can_batch_prefill:
            raise ValueError(
                "this model's prompt caches hold more than attention KV (a Mamba-2 or rule state runs on "
                "through padding): prefill its prompts one at a time"
            )
        if len(rids) != len(prompts) or not prompts or any(not p for p in prompts):
            raise ValueError(
                f"prefill_batch needs as many non-empty prompts as requests, got {len(prompts)} for {len(rids)}"
            )
        lens = [len(p) for p in prompts]
        n, T = len(prompts), max(lens)
        ids = torch.zeros(n, T, dtype=torch.long)  # [n, T]: each prompt, then padding (token 0) after it
        for i, p in enumerate(prompts):
            ids[i, : lens[i]] = torch.tensor(p)
        part = self.decoder.new_part(T, rows=n)
        at = torch.tensor([L - 1 for L in lens], device=self.device)  # [n]: each prompt's last position
        logits, depth = self.decoder.prefill(part, ids.to(self.device), 1, at=at)  # [n, 1, V]: the head at `at` only
        for i, rid in enumerate(rids):
            self.parts[rid] = (part, i)
        return logits[:, 0], depth  # [n, V]

    def place(self, rid: int, row: int, prompt_len: int, thr: float, checks: bool) -> None:
        """Request ``rid``'s prefilled prompt into row ``row`` (its first token goes in at column ``prompt_len``);
        ``thr`` / ``checks``: its exit threshold and whether its tokens take exits."""
        if row in self.in_flight:
            raise ValueError(f"row {row} still has a token in flight")
        part, i = self.parts.pop(rid)
        self.decoder.place(row, part, prompt_len, thr, checks, i)
        self.col[row] = prompt_len

    def release(self, rid: int) -> None:
        """Drop request ``rid``'s prefill cache (it ended or was preempted mid-prompt)."""
        self.parts.pop(rid, None)

    def step(self, tokens: list) -> StepOutput | None:
        """``tokens`` (:class:`~looplm.serve.scheduler.ScheduledToken`: row, token id, forced depth) start at loop 0,
        then one core pass over every row in flight. Returns the exits (None: nothing was in flight)."""
        dec = self.decoder
        rows_h = [t.row for t in tokens]
        if any(b in self.in_flight for b in rows_h):
            raise ValueError(f"rows {sorted(set(rows_h) & self.in_flight)} already have a token in flight")
        self.in_flight.update(rows_h)
        if not self.in_flight:
            return None
        L = max(self.col[b] for b in self.in_flight) + 1  # keys of the furthest row in flight
        if tokens:
            ids = torch.tensor([t.token_id for t in tokens], device=self.device)  # [n]
            forced = [t.forced_depth for t in tokens]
            self.cohorts.append(dec.start(rows_h, ids, L, forced if any(forced) else None))
        exits = dec.decode_pass(self.cohorts, dec.col, L)  # (rows [e], logits [e, V], depths [e]) or None
        self.cohorts = [c for c in self.cohorts if c.rows.numel()]
        out = None
        if exits is not None:
            rows, logits, depths = exits
            dec.advance(rows)
            out = StepOutput(rows.tolist(), logits, depths.tolist())
            for b in out.rows:
                self.col[b] += 1
                self.in_flight.discard(b)
        dec.settle_stats()
        return out
