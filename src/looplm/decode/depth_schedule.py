"""Continuous depth batching: every core pass runs each row at its own loop of its own token.

Under per-token exit with the token schedule (:mod:`looplm.decode.token_schedule`) the rows of a batch decode one token
together: a row that exits after loop 2 waits at the coda while the deepest row runs loop 4, so a batch's
wall time follows the loops its *deepest* row runs (batch 8 on the d = 1024 bench LM, kl ε = 0.01: 3.5 of
4 loops at a mean exit depth of 2.4). Here a row that exits goes through the coda and the head, picks its next token, and
starts that token's loop 0 at the next core pass, beside rows still in loop 3 of theirs; the passes a
batch needs follow the rows' *mean* depth (ZH-Haoran/continuous-depth-batching's idea, arXiv 2608.09444;
here for every criterion of :mod:`looplm.decode.exits`, greedy and sampled, on the CPU's fused path).

One pass (a *tick*)::

    start:  rows with no token in flight: E = embed(token); x = prelude(E)      # their own columns
            rule.begin(x) -> a new cohort at loop 0
    core:   z_c = rule.next_input(state_c) for every cohort c (rows at loop k_c)  # per cohort: the rule
            h = core(cat_c z_c)                                                # ONE call, every row
    step:   state_c = rule.step(state_c, h_c); exit = criterion or k_c + 1 = R  # per cohort
            exiting rows: y = rule.finish(exit_rows(state)); fill loops k_c+1..R−1 (kv policy)
            coda, norm, head of the exiting rows -> their next token; cohort c moves on to loop k_c + 1

A *cohort* is the rows that started their token at the same pass, so they are at the same loop: the rule
is called once per cohort with one loop index (no rule needs a per-row loop index, and a cohort only ever
loses rows, never merges). Only the core — where the FLOPs are — runs once for every row.

State: each row's token in flight sits at its own column ``col[b]`` of every cache (the prompt, padded to
``P`` columns, fills columns ``< P``; a row's ``t``-th generated token is at column ``P + t``) and reads the
columns up to its own (a ``[B, 1, 1, L]`` mask, ``L`` = the furthest row's column + 1, its left padding
kept). The core's attention slots of all loops of a layer are one buffer ``[R·B, H_kv, capacity, hd]``
(loop ``k``'s slot is its view ``[k·B : (k+1)·B]``), so the row at loop ``k`` writes and reads its cache
row ``k·B + b`` in place: one :class:`~looplm.layers.attention.KVRows` view with per-row columns over
that buffer, which the fused CPU step (``decode_stack``, ``rows`` and ``cols``) runs as one call;
``kv='shared'`` views the family's one buffer at row ``b``. The reference attention of such a view gathers
the rows' keys and values when they are under a third of the buffer's ``R·B`` rows (``R >= 4`` at a full
batch; :class:`KVRows`), else attends over the buffer in place, up to the furthest row's column under each
row's mask.

Exactness: a row's arithmetic depends only on its own tokens, so greedy decoding equals the token
schedule's (each row decoded alone with the same exits), up to the row count of the products
(``tests/test_depth_batch.py``: the same tokens, with left padding, for every KV policy and criterion; the
caches of every loop at every row's columns to 1e-5). Unwritten columns are zeroed first: a row reads the
buffer up to the furthest row's column under its mask, and a masked NaN of uninitialised memory would
still reach it (0 × NaN). Sampled decoding draws each row's token when it is picked, so a seed fixes the
output, but at batch > 1 the draws come in another order than under the token schedule.

Mamba-2 layers of the core: a state per row, whatever its column — loop ``k``'s state of row ``b`` is row
``k·B + b`` of one flat :class:`~looplm.layers.mamba2.Mamba2State` per layer (made from the loops' states
after the prompt; the loops' own slots are views of it), stepped in place through a row view; the loops a
token skips keep their state (``ssm='freeze'``) or take the stand-in's propagation / decay
(:meth:`AdaptiveDecoder._fill`, per exit, through the loops' slots).

What it does not run (refused by :meth:`looplm.decode.exits.Exit.resolved`): Mamba-2 layers outside the core,
sliding-window attention, rules with their own per-loop slots
(StateLoop's state mixers), rules that replace a block's residual stream, and ``kv='full'``. Prefill runs
at full depth, or takes the exits with ``prefill='exit'`` (as under the token schedule: the decoder's first
call).

Scheduling — which prompt takes which row and when (the first ``B`` prompts together, then request refill: a
finished row takes the next prompt), which rows start a token at a pass, when a row is done (``eos`` or
``max_new_tokens``) — is the serving engine's scheduler's (:class:`looplm.decode.scheduler.Scheduler`, also
:mod:`looplm.serve.scheduler`), driven by :meth:`DepthBatchedDecoder.run` as the engine drives it: admit and
place, ``schedule_decode``, one pass, ``update_from_output``, finish. Its requests keep the rows' columns, token
counts and states on the host: a pass reads the exits' rows, tokens and depths once, and each checking cohort's exit flags (on CUDA each read is a
synchronisation: :mod:`looplm.decode.static_schedule` reads none). Host work per
pass, measured: ``docs/adaptive-depth.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from .token_schedule import AdaptiveDecoder, _modulates
from ..context import BlockModulation, BranchModulation, ForwardContext, LoopContext, restrict_fctx
from .exits import Exit, make_criterion, output_is_core
from ..layers.attention import Attention, KVCache, KVRows, copy_kv_columns
from ..cache import SharedKV
from .kv_fill import KVFill
from ..layers.mamba2 import Mamba2Rows, Mamba2State
from .sampling import decode_context, eval_mode, sample_next
from .scheduler import Request, RequestStatus, Scheduler

__all__ = ["DepthBatchedDecoder", "copy_prompt_rows", "depth_batched_generate", "merge_modulations"]


@dataclass
class _Cohort:
    """Rows that started their token at the same pass: all at loop ``k``."""

    rows: torch.Tensor  # [n] global row ids
    k: int  # the loop they run at the next pass (0-based)
    state: dict  # the rule's state of these rows
    lctx: LoopContext  # their loop context: embeddings, the cache at their columns (fctx: each pass's)
    crit: object  # their criterion (its memory of their previous loop)
    req: torch.Tensor  # [n] their prompts' indices (request refill; else rows itself): a replay criterion's rows


class DepthBatchedDecoder(AdaptiveDecoder):
    """:class:`~looplm.decode.token_schedule.AdaptiveDecoder` (its cache, criterion, fills, statistics) with the prompt
    at full depth and then :meth:`run`: the token loop of continuous depth batching (module docstring)."""

    schedule = "depth"  # the Exit.schedule it runs (looplm.decode.static_schedule's subclass: 'static')

    def __init__(
        self, model, batch_size: int, capacity: int, exit, loop_options: dict | None = None, prompts: int | None = None
    ):
        super().__init__(model, batch_size, capacity, exit, loop_options, prompts)
        if self.exit.schedule != self.schedule:
            raise ValueError(f"{type(self).__name__} runs exit schedule {self.schedule!r}, got {self.exit.schedule!r}")
        self.flat = self._flat_core_slots()  # layer -> (the KVCache over [R·B, ...] or kv='shared''s, rows, offset)
        self.kv_flat = {j: v for j, v in self.flat.items() if isinstance(v[0], KVCache)}  # the attention layers'
        self.pending: list = []  # (rows, exit loop, stand-in, columns) whose core fills this pass still owes (_fill_core)
        self.modulated = _modulates(model.rule)  # blocks differ per loop: propagation per loop (_fill)
        # bytes of one (row, loop)'s K and V column
        self.copy_bytes = sum(2 * b._k[0, :, 0].numel() * b._k.element_size() for b, _, _ in self.kv_flat.values())
        # Mamba-2 core layers whose skipped loops take ssm='propagate' / 'decay' (AdaptiveDecoder._fill, per exit)
        self.ssm_fills = self.exit.ssm != "freeze" and len(self.kv_flat) < len(self.flat)
        # an exit whose output is its core output H^k and whose fills are the core's copies needs no rule state
        # or loop context of its rows (the base rule under kv='copy', attention cores, no readout coda)
        self.lean_exit = (
            self.exit.kv == "copy"
            and not self.ssm_fills
            and len(self.cache.loop_slots) == len(self.flat)
            and output_is_core(model)
        )
        self.stats.batch_size = batch_size

    def _flat_core_slots(self) -> dict:
        """Make the core's attention slots of every loop now, as views of one ``[R·B, H_kv, capacity, hd]``
        buffer per layer; returns layer -> ``(buffer's KVCache, its rows, rows per loop)`` (``kv='shared'``:
        the family's one buffer, ``(base, B, 0)``). A Mamba-2 layer's entry is ``(None, R·B, B)`` until the
        prompt has run: then its loops' states become one :class:`Mamba2State` over ``[R·B, ...]``
        (:meth:`_flat_ssm_states`)."""
        m, cache, R, B, cap = self.model, self.cache, self.R, self.cache.batch_size, self.cache.capacity
        p = next(m.parameters())
        by_loop = [m.cache_slots(cache, m.core.stack, (k,), B, loop=k, family="core") for k in range(R)]
        flat = {}
        self.loop_kv = [[] for _ in range(R)]  # loop k's core attention caches (views of the flat buffers), K and V
        for j, blk in enumerate(m.core.stack.blocks):
            a = blk.mixer
            if not isinstance(a, Attention):  # a Mamba-2 layer: a state per row, whatever the column
                flat[blk.layer_idx] = (None, R * B, B)
                continue
            if self.exit.kv == "shared":
                base = by_loop[0][j].base
                base.allocate(B, a.n_kv_heads, a.head_dim, a.head_dim, p.dtype, p.device)
                flat[blk.layer_idx] = (base, B, 0)
                continue
            big = KVCache(cap)
            big.allocate(R * B, a.n_kv_heads, a.head_dim, a.head_dim, p.dtype, p.device)  # [R·B, H_kv, cap, hd]
            for k in range(R):
                s = by_loop[k][j]
                s._k, s._v = big._k[k * B : (k + 1) * B], big._v[k * B : (k + 1) * B]  # loop k's slot: a view
                self.loop_kv[k] += [s._k, s._v]
            flat[blk.layer_idx] = (big, R * B, B)
        return flat

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None,
        pick,
        eos_token_id: int | None,
        pad_token_id: int,
        now=time.perf_counter,
    ) -> torch.Tensor:
        """The prompt at full depth, then ``max_new_tokens`` tokens per row, each row at its own pace;
        ``pick(logits [n, V]) -> [n]`` chooses a token. Returns ``[N, P + n]`` ids (``n``: the most any row
        generated; a row that emitted ``eos_token_id`` is padded with ``pad_token_id`` after it).

        ``input_ids [N, P]`` may hold more prompts than the decoder's ``B`` rows (request refill): the first
        ``B`` start together, and whenever rows finish the next prompts take them — their prompts at full
        depth into those rows (:meth:`_refill`), their tokens beside the other rows' at the next pass.
        Which prompt takes which row, and which rows start a token at a pass, is the serving engine's scheduler's
        (:class:`~looplm.decode.scheduler.Scheduler`, :attr:`scheduler` after the run; :meth:`_scheduler`): each
        prompt is a request of ``max_new_tokens`` tokens, admitted in order into the row freed first, placed after
        its prompt ran, and finished at ``eos_token_id`` or its length. ``decode_seconds``: the time after the
        prompts, on the clock ``now`` (a host clock: CPU time); the refills' prompts are left out of it as the
        first prompts are (``prompt_seconds``)."""
        N, P = input_ids.shape
        B = self.cache.batch_size
        if N < B:
            raise ValueError(
                f"{type(self).__name__} decodes {B} rows; input_ids has {N} (give at least {B} prompts, "
                f"or build the decoder for {N} rows)"
            )
        if N > B:  # the queued prompts are checked now too (their rows prefill them later, unchecked)
            self.model.check_inputs(input_ids, None, attention_mask)
        self.prompt_seconds = 0.0
        if max_new_tokens == 0:
            return self._prefill(input_ids, 0, attention_mask, pick, eos_token_id, pad_token_id)[0]
        sched = self.scheduler = self._scheduler(input_ids, max_new_tokens)
        reqs = list(sched.waiting)  # request i: prompt i (its output row)
        first = [c.request for c in sched.schedule_prefill()]  # the first B prompts, together
        if [(r.id, r.row) for r in first] != [(b, b) for b in range(B)]:  # (the scheduler's order: rows 0 .. B − 1)
            raise RuntimeError(
                f"the scheduler admitted {[(r.id, r.row) for r in first]} first, not prompts 0 .. {B - 1} "
                f"into rows 0 .. {B - 1}"
            )
        out, col, _, _ = self._prefill(input_ids, max_new_tokens, attention_mask, pick, eos_token_id, pad_token_id)
        self._took_first(sched, first, out[:B, P].tolist(), eos_token_id)
        m, cache, st = self.model, self.cache, self.stats
        dev = input_ids.device
        req_of_row = torch.arange(B, device=dev) if N > B else None  # [B] each row's prompt (None: row b is prompt b)
        if N > B:
            self._check_refill()
        cohorts: list[_Cohort] = []
        t0 = now()
        with decode_context(m, B):
            while True:
                # request refill: finished rows take the next prompts (a first token may end them: again)
                while admitted := [c.request for c in sched.schedule_prefill()]:
                    rows_h, idx_h = [r.row for r in admitted], [r.id for r in admitted]
                    tokens = self._refill(rows_h, input_ids, attention_mask, idx_h, out, col, pick, now)
                    self._took_first(sched, admitted, tokens, eos_token_id)
                    req_of_row.index_copy_(0, torch.tensor(rows_h, device=dev), torch.tensor(idx_h, device=dev))
                start = sched.schedule_decode()  # the rows whose next token waits, in row order: in flight now
                if not sched.in_flight:
                    break
                L = max(r.num_cached for r in sched.rows if r is not None) + 1  # keys of the furthest row in flight
                if start:
                    running = [sched.rows[t.row] for t in start]
                    rows = torch.tensor([t.row for t in start], device=dev)  # [n]
                    ids = torch.tensor([[t.token_id] for t in start], dtype=input_ids.dtype, device=dev)  # [n, 1]
                    # [n] each row's decoded-token index (a replay criterion's depths are read there)
                    token = torch.tensor([r.num_output_tokens - 1 for r in running], device=dev)
                    orow = None if req_of_row is None else torch.tensor([r.id for r in running], device=dev)  # [n]
                    cohorts.append(self._start(rows, ids, col, token, L, orow))
                n0 = len(st.selected)
                exits = self._pass(cohorts, col, L)  # [(rows, y, logits or None)] of the tokens that exited
                cohorts = [c for c in cohorts if c.rows.numel()]
                if not exits:
                    continue
                rows = torch.cat([r for r, _, _ in exits]) if len(exits) > 1 else exits[0][0]  # [e]
                nxt = pick(self._logits_of(exits, col, L))  # [e]
                c = col.index_select(0, rows) + 1  # their next tokens' columns
                col.index_copy_(0, rows, c)
                out[rows if req_of_row is None else req_of_row.index_select(0, rows), c] = nxt
                self.attn_rows.index_put_((rows, c), self.yes)  # a row's next token reads its own column too
                depth = torch.cat(st.selected[n0:])  # [e] the loops each exited token ran
                rows_l, nxt_l, depth_l = torch.stack((rows, nxt.to(rows.dtype), depth)).tolist()
                # each row holds one more column; no budget, so none is preempted: every row picks its next token
                sample, _ = sched.update_from_output(rows_l)
                for i in sample:
                    req = sched.rows[rows_l[i]]
                    sched.append_token(req, nxt_l[i], depth_l[i])
                    self._finish_if_done(sched, req, nxt_l[i], eos_token_id)
            self.flush()  # the last pass's fills (looplm.decode.kv_fill)
        self.decode_seconds = now() - t0 - self.prompt_seconds  # after the prompts
        self._count_flops()
        most = max(r.num_output_tokens for r in reqs)  # the most tokens any prompt made
        cache.seqlen = P + most - 1  # the columns written (rows that stopped early: holes, masked)
        return out[:, : P + most]

    def _scheduler(self, input_ids: torch.Tensor, max_new_tokens: int) -> Scheduler:
        """The run's scheduler, the engine's: ``B`` rows, no KV budget (the cache holds ``P + max_new_tokens``
        columns of every row), one request of ``max_new_tokens`` tokens per prompt, queued in order, and batched
        prefill of whole prompts (a chunk of ``N × P`` tokens: every free row takes a prompt at once)."""
        N, P = input_ids.shape
        sched = Scheduler(
            max_batch=self.cache.batch_size, max_waiting=N, prefill_chunk=max(2, N * P), batch_prefill=True
        )
        for i, prompt in enumerate(input_ids.tolist()):
            sched.add(Request(i, prompt, max_new_tokens))
        return sched

    def _took_first(self, sched: Scheduler, admitted: list, tokens: list, eos_token_id: int | None) -> None:
        """The prompts of ``admitted`` ran: each request is placed in its row with its first token (picked from the
        prompt's logits, at full depth), and finished when that token ends it."""
        for req, t in zip(admitted, tokens):
            sched.place(req)
            sched.append_token(req, t, self.R)
            self._finish_if_done(sched, req, t, eos_token_id)

    @staticmethod
    def _finish_if_done(sched: Scheduler, req: Request, token: int, eos_token_id: int | None) -> None:
        """``req`` ends at ``eos_token_id`` (stop) or at its ``max_tokens`` (length): its row frees for the next prompt."""
        if token == eos_token_id:
            sched.finish(req, RequestStatus.FINISHED_STOPPED)
        elif req.num_output_tokens >= req.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)

    def _check_refill(self) -> None:
        """Request refill copies a prompt's slots into a row of each of this cache's: attention KV (per loop or
        ``kv='shared'``'s one buffer) and Mamba-2 states; another kind of slot is refused here, before decoding."""
        for key, s in self.cache.slots.items():
            if not isinstance(s, (KVCache, SharedKV, Mamba2State)):
                raise TypeError(
                    f"request refill (exit max_batch) cannot copy a prompt into cache slot {key!r} "
                    f"({type(s).__name__}); give max_batch=None (the whole batch at once)"
                )

    def _refill(self, rows_h: list, input_ids, attention_mask, idx_h: list, out, col, pick, now) -> list:
        """Rows ``rows_h`` (finished) take prompts ``idx_h`` (the scheduler's admission): those prompts at full depth
        in a cache of their own (:meth:`AdaptiveDecoder.__call__`, the first prompts' path), its slots copied into the
        rows' columns ``< P`` of every slot (every loop), the rows' visible columns, position shift and mask reset,
        each first token picked into ``out``. Returns the first tokens (a host list)."""
        m, main, n, P = self.model, self.cache, len(rows_h), input_ids.shape[1]
        dev = input_ids.device
        rows = torch.tensor(rows_h, device=dev)  # [n]
        idx = torch.tensor(idx_h, device=dev)  # [n]
        ids = input_ids.index_select(0, idx)  # [n, P]
        mask = None if attention_mask is None else attention_mask.index_select(0, idx)  # [n, P]
        t = now()
        self.flush()  # the fills carried into the next pass, before rows change hands
        self.cache = m.new_cache(n, self.R, capacity=P, kv_shared=main.kv_shared)
        try:
            logits = self(ids, mask, validate=False)  # [n, 1, V]: full depth (a first call), no statistics
            part = self.cache
        finally:
            self.cache = main
        for key, src in part.slots.items():
            if not isinstance(src, SharedKV):
                _copy_rows(src, main.slots[key], rows, P)
        for fam, src in part.shared.items():
            _copy_rows(src, main.shared[fam], rows, P)
        first = pick(logits[:, -1])  # [n]
        out[idx, P] = first
        col.index_fill_(0, rows, P)
        vis = self.visible.index_select(0, rows)
        vis[:, :P] = True if mask is None else mask.bool()
        vis[:, P:] = True
        self.visible.index_copy_(0, rows, vis)
        self.pos_shift.index_copy_(0, rows, vis[:, :P].long().sum(-1) - P)
        self.attn_rows.index_copy_(0, rows, vis & (self.keys[None] <= P))
        self.prompt_seconds += now() - t
        return first.tolist()

    # ------------------------------------------------------------------------------------------
    def _prefill(self, input_ids, max_new_tokens, attention_mask, pick, eos_token_id, pad_token_id):
        """The first ``B`` prompts at full depth and each row's first token; the per-row decoding state (visible
        columns, position shifts, rotary tables, keys). Returns ``(out [N, P + n] ids, col [B], made [B], done
        [B])`` (``max_new_tokens = 0``: ``out`` is the prompts; the rows past ``B`` are filled by :meth:`run`)."""
        m, cache, (N, P), B = self.model, self.cache, input_ids.shape, self.cache.batch_size
        dev = input_ids.device
        out = torch.full((N, P + max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=dev)
        out[:, :P] = input_ids
        if max_new_tokens == 0:
            return out[:, :P], None, None, None
        if N > B:
            input_ids = input_ids[:B]
            attention_mask = None if attention_mask is None else attention_mask[:B]
        logits = self(input_ids, attention_mask)  # [B, 1, V]: the prompt at full depth, committed at columns < P
        out[:B, P] = pick(logits[:, -1])
        for base, _, _ in self.kv_flat.values():
            base._len = P  # the flat buffers' own length (the fused step's bounds check reads it)
        self._flat_ssm_states()
        for slot in cache.physical_slots():  # columns a row has not reached are read under a mask: zeros, not
            if getattr(slot, "_k", None) is not None:  # uninitialised memory (a masked NaN value is 0 × NaN)
                slot._k[:, :, P:].zero_()
                slot._v[:, :, P:].zero_()
        # every column's visibility: the prompt's mask, then each row's generated tokens
        self.visible = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=dev)
        if attention_mask is not None:
            self.visible[:, :P] = attention_mask.bool()
        # the position of column P: the row's real prompt tokens (left padding does not count)
        self.pos_shift = (
            self.visible[:, :P].long().sum(-1) if attention_mask is not None else torch.full((B,), P, device=dev)
        ) - P
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)  # per row: its token in flight's position
        self.keys = torch.arange(P + max_new_tokens, device=dev)
        # every position's rotary tables [P + n, 1, rot] (a row's position is under P + n), read at the rows' positions
        self.rope_at = {int(r): rot(self.keys[:, None]) for r, rot in m.rotary.items()}
        # what each row's token in flight reads, [B, 1, 1, P + n]: visible columns up to its own (one more per token)
        self.attn_rows = self.visible & (self.keys[None] <= P)  # [B, P + n]
        self.attn = self.attn_rows[:, None, None, :]  # (a view)
        self.yes = torch.ones((), dtype=torch.bool, device=dev)
        self.exit_keys: list = []  # per exit: the rows' keys (column + 1); FLOPs are summed once, at the end
        col = torch.full((B,), P, dtype=torch.long, device=dev)  # the column of each row's token in flight
        made = torch.ones(B, dtype=torch.long, device=dev)  # tokens generated per row
        done = made >= max_new_tokens
        if eos_token_id is not None:
            done |= out[:B, P] == eos_token_id
        return out, col, made, done

    def _flat_ssm_states(self) -> None:
        """After the prompt: each core Mamba-2 layer's per-loop states (what the prompt left in them) as one
        :class:`Mamba2State` over ``[R·B, ...]`` — row ``k·B + b`` is loop ``k``'s state of row ``b``, read and
        written in place through a row view; the loops' own slots become views of it."""
        m, R, B = self.model, self.R, self.cache.batch_size
        for blk in m.core.stack.blocks:
            if self.flat[blk.layer_idx][0] is not None:
                continue
            loops = [self.cache.slots[(k, blk.layer_idx)] for k in range(R)]
            # (contiguous, fp32: a fused step never rebinds them)
            big = Mamba2State(
                torch.cat([s.conv_state for s in loops]),
                torch.cat([s.ssm_state for s in loops]).float(),
                loops[0].seqlen_offset,
            )
            for k, s in enumerate(loops):
                s.conv_state, s.ssm_state = big.conv_state[k * B : (k + 1) * B], big.ssm_state[k * B : (k + 1) * B]
            self.flat[blk.layer_idx] = (big, R * B, B)

    def _core_slots(
        self, idx_loop: torch.Tensor, idx_row: torch.Tensor, cols: torch.Tensor, keep: torch.Tensor | None = None
    ) -> list:
        """The core blocks' slots of a pass: the flat buffers' row views at buffer rows ``idx_loop`` (``k·B + b``)
        or, for ``kv='shared'``'s one KV buffer, ``idx_row`` (``b``), each row at its column ``cols``; ``keep``:
        the rows whose Mamba-2 states the pass may change (the others' are written back unchanged)."""
        out = []
        for b in self.model.core.stack.blocks:
            base, nrows, off = self.flat[b.layer_idx]
            idx = idx_loop if off else idx_row
            out.append(KVRows(base, idx, nrows, cols) if isinstance(base, KVCache) else Mamba2Rows(base, idx, keep))
        return out

    def _fctx(self, rows: torch.Tensor, col: torch.Tensor, L: int) -> ForwardContext:
        """Rows' positions, rotary tables and ``[n, 1, 1, L]`` mask (each reads its columns up to its own)."""
        mask = self.attn[..., :L].index_select(0, rows)  # [n, 1, 1, L]: visible columns up to col[rows] (run keeps it)
        pos = self.positions.index_select(0, rows)  # [n, 1]
        at = pos[:, 0]
        rope = {
            r: (cos.index_select(0, at), sin.index_select(0, at)) for r, (cos, sin) in self.rope_at.items()
        }  # [n, 1, rot]
        return ForwardContext(rope=rope, positions=pos, attn_mask=mask, is_causal=False, pad_mask=None)

    def _start(self, rows, ids, col, token, L, req=None) -> _Cohort:
        """Rows ``rows`` begin their next token ``ids [n, 1]``: its position, the embedding, the prelude (at their
        columns), ``rule.begin``: a new cohort at loop 0. ``req``: their prompts' indices (request refill: what a
        replay criterion's per-row depths are indexed by; ``None``: the rows')."""
        m = self.model
        pos = self.pos_shift.index_select(0, rows) + col.index_select(0, rows)  # [n]
        self.positions.index_copy_(0, rows, pos[:, None])
        f = self._fctx(rows, col, L)
        E = m.embed_tokens(ids)  # [n, 1, d]
        view = self.cache.rows(rows, col[rows])
        x = m.prelude(E, f, m.cache_slots(view, m.prelude, (0,), rows.shape[0])) if len(m.prelude.blocks) else E
        lctx = self._context(f, E)
        lctx.cache, lctx.iteration = view, 0
        crit = make_criterion(self.exit)
        crit.begin(token)  # each row's decoded-token index [n] (replay depths are read there)
        return _Cohort(rows, 0, m.rule.begin(x, lctx), lctx, crit, rows if req is None else req)

    def _pass(self, cohorts: list[_Cohort], col, L: int) -> list:
        """One core pass over every row in flight; the cohorts step, exit and move on. Returns the exits
        ``[(rows [e], y [e, 1, d])]``."""
        m, rule, e, R, st = self.model, self.model.rule, self.exit, self.R, self.stats
        rows = torch.cat([c.rows for c in cohorts]) if len(cohorts) > 1 else cohorts[0].rows  # [n], cohort order
        fctx = self._fctx(rows, col, L)
        zs, mods, off = [], [], 0
        for c in cohorts:  # each cohort's context: its slice of the pass's (views)
            n = c.rows.shape[0]
            c.lctx.fctx = _slice_fctx(fctx, off, off + n) if len(cohorts) > 1 else fctx
            c.lctx.iteration = c.k
            off += n
            zs.append(rule.next_input(c.state, c.lctx))  # Z^k of the cohort  [n_c, 1, d]
            c.lctx.core_input = zs[-1]
            mods.append(rule.block_modulation(c.state, c.lctx))
        idx = torch.cat([c.rows + c.k * self.cache.batch_size for c in cohorts])  # buffer row of each row: k·B + b
        slots = self._core_slots(idx, rows, col.index_select(0, rows))
        mod = _cat_modulations(mods, [c.rows.shape[0] for c in cohorts], len(m.core.stack.blocks))
        # [n, 1, d]; offered the last pass's propagate fills (looplm.decode.kv_fill)
        h_all = self._offering(lambda: m.core(torch.cat(zs) if len(zs) > 1 else zs[0], fctx, slots, mod))
        st.core_calls += 1
        exits, off = [], 0
        check_before = sum(c.crit.flops for c in cohorts)
        # a readout criterion without coda layers (no per-loop coda slots): one readout for every row that
        # checks (the cohorts at their last loop, the oldest, come first and do not check)
        last = cohorts[0].rows.shape[0] if cohorts[0].k == R - 1 else 0
        shared = raw = None
        if cohorts[0].crit.readout and len(m.coda.blocks) == 0 and last < h_all.shape[0]:
            c0 = cohorts[1] if last else cohorts[0]
            shared = c0.crit.value(c0.k, h_all[last:], c0.lctx, m)  # [n − last, V]
            raw = c0.crit.logits if self.reuse_readout else None  # [n − last, V]: the logits of whoever exits now
        for c in cohorts:
            n = c.rows.shape[0]
            h = h_all[off : off + n]
            off += n
            c.state = rule.step(c.state, h, c.lctx)
            if c.k == R - 1:
                leave = logits = None  # every row leaves (the head makes its logits)
            else:
                cur = None if shared is None else shared[off - n - last : off - last]
                leave = c.crit.check(c.k, h, c.state, c.lctx, c.req, m, **({} if cur is None else {"cur": cur}))
                if c.k + 1 < e.min_loops or not bool(leave.any()):
                    c.k += 1
                    continue
                logits = None if raw is None else raw[off - n - last : off - last]
            exits.append(self._exit(c, leave, h, col, logits))
            c.k += 1
        st.check_flops += sum(c.crit.flops for c in cohorts) - check_before
        if self.pending:
            self._fill_core(col, L)
        return exits

    def decode_pass(self, cohorts: list[_Cohort], col, L: int) -> tuple | None:
        """Public step API (the serving engine's runner): one core pass over ``cohorts`` (:meth:`_pass`; each moves
        on, emptied cohorts stay for the caller to drop) and the logits of the tokens that exited. Returns
        ``(rows [e], logits [e, V], depths [e])`` in exit order, or None when no token exited. ``col`` is not moved
        on (the caller advances the exited rows after reading the logits)."""
        st = self.stats
        n0 = len(st.selected)
        exits = self._pass(cohorts, col, L)
        if not exits:
            return None
        rows = torch.cat([r for r, _, _ in exits]) if len(exits) > 1 else exits[0][0]  # [e]
        logits = self._logits_of(exits, col, L)  # [e, V]
        depths = torch.cat(st.selected[n0:])  # [e]
        return rows, logits, depths

    def settle_stats(self) -> None:
        """Public step API: add the FLOPs of the tokens decoded since the last call to :attr:`stats` and drop their
        per-token depth lists, so a caller that decodes without end (a server) keeps totals, not a list per token."""
        self._count_flops()
        self.stats.selected.clear()
        self.stats.executed.clear()

    def _exit(self, c: _Cohort, leave, h, col, logits=None):
        """The rows ``leave`` (``None``: all) of cohort ``c`` stop after loop ``c.k``: their outputs, the fills
        of the loops they skip; the cohort keeps the rest. ``logits [n, V]``: the cohort's check readout, when
        it is the exit's logits (``reuse_readout``). Returns ``(rows [e], y [e, 1, d], logits [e, V] or None)``."""
        rule, st = self.model.rule, self.stats
        n, dev = c.rows.shape[0], h.device
        # (a kl readout through coda layers makes its own per-loop slots at the first check, after __init__
        # decided lean_exit: their fills need the rule state and the loop context)
        lean = self.lean_exit and len(self.cache.loop_slots) == len(self.flat)
        every = leave is None or bool(leave.all())
        if every:
            g, st_out, ctx_out, h_out = c.rows, c.state, c.lctx, h
            cg = col.index_select(0, g)  # their columns
        else:
            out = leave.nonzero()[:, 0]
            g = c.rows.index_select(0, out)
            cg = col.index_select(0, g)
            logits = None if logits is None else logits.index_select(0, out)
            h_out = h.index_select(0, out)
            if not lean:
                st_out = rule.take_rows(c.state, out, n)
                ctx_out = self._context(restrict_fctx(c.lctx.fctx, out), c.lctx.embeddings.index_select(0, out))
                ctx_out.cache, ctx_out.iteration = self.cache.rows(g, cg), c.k
        if lean:  # (exits.output_is_core: what exit_rows and finish would return)
            y = h_out
        else:
            st_out = rule.exit_rows(st_out, torch.ones(g.shape[0], 1, dtype=torch.bool, device=dev), ctx_out)
            y = rule.finish(st_out, ctx_out)  # [e, 1, d]
        # the core's fills, once for every exit of the pass (_fill_core): copies; propagation's stand-ins Z^{k+1}
        mine = self.exit.kv == "copy" or (self.exit.kv == "propagate" and not self.modulated)
        if mine and c.k < self.R - 1:
            # [e, 1, d] (copy: none)
            z = None if self.exit.kv == "copy" else rule.next_input(st_out, replace(ctx_out, iteration=c.k + 1))
            self.pending.append((g, c.k, z, cg))
        if (
            not mine or self.ssm_fills or len(self.cache.loop_slots) > len(self.flat)
        ):  # the rest: readouts' coda layers,
            # modulated blocks, the Mamba-2 core layers' states
            self._fill(g, c.k, st_out, ctx_out, h_out, cols=cg, skip_core=mine)
        depth = torch.full((g.shape[0],), c.k + 1, dtype=torch.long, device=dev)
        st.selected.append(depth)
        st.executed.append(depth)
        self.exit_keys.append(cg)  # (+ 1 at the end) every pass of this token read as many keys
        if every:
            c.rows = c.rows[:0]
        else:
            stay = (~leave).nonzero()[:, 0]
            c.state = rule.take_rows(c.state, stay, n)
            same = c.req is c.rows
            c.rows = c.rows.index_select(0, stay)
            c.req = c.rows if same else c.req.index_select(0, stay)
            c.lctx.embeddings = c.lctx.embeddings.index_select(0, stay)
            c.lctx.cache = self.cache.rows(c.rows, col[c.rows])
            c.crit.take(stay)
        return g, y, logits

    def _count_flops(self) -> None:
        """The FLOPs of the decoded tokens, from each exit's depth and keys: a token of depth ``r`` at column
        ``c`` ran ``r`` core passes of ``c + 1`` keys; full depth would run ``R``; the rest once."""
        st = self.stats
        if not self.exit_keys:
            return
        keys = torch.cat(self.exit_keys).double() + 1  # [tokens]
        depth = torch.cat(st.selected[-len(self.exit_keys) :]).double()
        (w, a), (ow, oa) = self._core_terms, self._other_terms
        n, k_sum = keys.numel(), float(keys.sum())
        st.core_flops += w * float(depth.sum()) + a * float((depth * keys).sum())
        st.full_core_flops += self.R * (w * n + a * k_sum)
        st.other_flops += ow * n + oa * k_sum
        self.exit_keys = []

    def _fill_core(self, col, L: int) -> None:
        """The core layers' slots of the loops skipped by every row that exited at this pass (buffer rows
        ``k'·B + b``, ``k' > k`` its exit loop, at the row's column), one gather / projection and one scatter
        per layer and buffer for all of them: ``copy`` — the exit loop's key and value (buffer row
        ``k·B + b``); ``propagate`` — the stand-in ``Z^{k+1}`` through each layer's norm and K/V projections
        (once per layer: the rule does not modulate the blocks, ``_fill``'s per-loop case), carried into the
        next pass's core call as a :class:`~looplm.decode.kv_fill.KVFill` (the fused step's extra K/V rows)."""
        B, R, m = self.cache.batch_size, self.R, self.model
        if self.pending[0][2] is None:  # copy: per exit, loop k's caches of every layer into each skipped loop's
            for g, k, _, cg in self.pending:
                n = R - 1 - k  # skipped loops
                copy_kv_columns(self.loop_kv[k] * n, [t for kk in range(k + 1, R) for t in self.loop_kv[kk]], g, cg)
                self.stats.fill_bytes += self.copy_bytes * g.shape[0] * n
            self.pending = []
            return
        src, dst, cc, o = [], [], [], 0  # per (row, skipped loop), loop-major per exit: the stand-in's row, the target
        for g, k, _, cg in self.pending:
            n = R - 1 - k  # skipped loops
            src.append((torch.arange(g.shape[0], device=g.device) + o).repeat(n))
            dst.append(torch.cat([g + kk * B for kk in range(k + 1, R)]))
            cc.append(cg.repeat(n))
            o += g.shape[0]
        src, dst, cc = torch.cat(src), torch.cat(dst), torch.cat(cc)
        G = torch.cat([p[0] for p in self.pending])  # [e] the exiting rows
        Z = torch.cat([p[2] for p in self.pending])  # [e, 1, d] their stand-ins
        self.pending = []
        # carried into the next pass's core call (looplm.decode.kv_fill): no row reads them before that pass is over
        blocks = [b for b in m.core.stack.blocks if b.layer_idx in self.kv_flat]  # (Mamba-2: AdaptiveDecoder._fill's)
        fill = KVFill(m.core.stack, blocks, [[self.flat[b.layer_idx][0]] for b in blocks])
        fill.add(Z, self._fctx(G, col, L).rope, [(0, dst, cc, src)])
        if self.carry_fills:
            self._deferred = fill
        else:  # (written now: the fill computed on its own)
            fill.write()
        self.stats.fill_flops += G.shape[0] * fill.flops_per_row()

    def _logits_of(self, exits: list, col, L: int) -> torch.Tensor:
        """Logits ``[e, V]`` of a pass's exits ``[(rows, y, logits or None)]``, in their order: a check's readout
        where it is the token's logits, else (:meth:`_head_rows`) the coda, the final norm and the head."""
        need = [(r, y) for r, y, lg in exits if lg is None]
        head = None
        if need:
            head = self._head_rows(
                torch.cat([y for _, y in need]) if len(need) > 1 else need[0][1],
                torch.cat([r for r, _ in need]) if len(need) > 1 else need[0][0],
                col,
                L,
            )
            if len(need) == len(exits):
                return head
        parts, o = [], 0
        for r, _, lg in exits:
            if lg is None:
                parts.append(head[o : o + r.shape[0]])
                o += r.shape[0]
            else:
                parts.append(lg)
                self.stats.reused_flops += r.shape[0] * self._head_flops
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _head_rows(self, y, rows, col, L: int) -> torch.Tensor:
        """Logits ``[e, V]`` of the exiting rows: the coda at their columns, the final norm, the head."""
        m = self.model
        if len(m.coda.blocks):  # (an empty stack is the identity)
            view = self.cache.rows(rows, col[rows])
            y = m.coda(y, self._fctx(rows, col, L), m.cache_slots(view, m.coda, (0,), rows.shape[0]))
        return m.lm_head(m.norm(y))[
            :, -1
        ]  # [e, 1, d] -> [e, V]: a decode step's shape, so the head takes the GEMV step


def _copy_rows(src, dst, rows: torch.Tensor, P: int) -> None:
    """A prompt's slot ``src`` (its ``n`` rows, ``P`` columns) into rows ``rows`` of the decoder's slot ``dst``
    (a view of a flat buffer writes the buffer): a KV cache's columns ``< P``, a Mamba-2 state whole."""
    if isinstance(src, KVCache):
        if src._k is None:  # (a slot the prompt never wrote)
            return
        dst._k[rows, :, :P] = src._k[:, :, :P].to(dst._k.dtype)  # [n, H_kv, P, hd]
        dst._v[rows, :, :P] = src._v[:, :, :P].to(dst._v.dtype)
    else:  # Mamba2State
        dst.conv_state[rows] = src.conv_state.to(dst.conv_state.dtype)
        dst.ssm_state[rows] = src.ssm_state.to(dst.ssm_state.dtype)


copy_prompt_rows = _copy_rows  # (public: the serving engine's runner places prompts with it)


def _slice_fctx(f: ForwardContext, a: int, b: int) -> ForwardContext:
    """Rows ``a .. b − 1`` of ``f`` (views)."""
    return ForwardContext(
        rope={r: (cos[a:b], sin[a:b]) for r, (cos, sin) in f.rope.items()},
        positions=f.positions[a:b],
        attn_mask=f.attn_mask[a:b],
        is_causal=f.is_causal,
        pad_mask=None,
    )


def _cat_modulations(mods: list, sizes: list[int], n_blocks: int):
    """The cohorts' block modulations as one per-row modulation of the concatenated rows (``None`` when no
    cohort modulates): each field broadcast to ``[n_c, 1, d or 1]`` (absent: 1 for scale and gate, 0 for
    shift) and concatenated in cohort order."""
    return merge_modulations(mods, sizes, n_blocks, torch.cat)


def merge_modulations(mods: list, rows: list[int], n_blocks: int, combine):
    """Groups' block modulations (``mods[g]``: ``None`` or one per block) as one per-row modulation:
    each field of group ``g`` broadcast to ``[rows[g], 1, width]`` (absent: 1 for scale and gate, 0 for
    shift; ``width`` the widest of the groups'), the groups' fields joined by ``combine(list) -> tensor``
    (``torch.cat`` for cohorts of rows; a per-row choice among same-size groups, :mod:`looplm.decode.static_schedule`).
    ``None`` when no group modulates."""
    if all(x is None for x in mods):
        return None
    out = []
    for j in range(n_blocks):
        branches = {}
        for name in ("mixer", "mlp"):
            fields = {}
            for f, ident in (("scale", 1.0), ("shift", 0.0), ("gate", 1.0)):
                vals = [
                    None
                    if ms is None or ms[j] is None or getattr(ms[j], name) is None
                    else getattr(getattr(ms[j], name), f)
                    for ms in mods
                ]
                if all(v is None for v in vals):
                    fields[f] = None
                    continue
                like = next(v for v in vals if v is not None)
                width = max(v.shape[-1] if v.dim() else 1 for v in vals if v is not None)
                parts = []
                for v, n in zip(vals, rows):
                    v = like.new_full((1, 1, 1), ident) if v is None else v
                    v = v.reshape((1,) * max(0, 3 - v.dim()) + tuple(v.shape)) if v.dim() < 3 else v
                    parts.append(v.expand(n, 1, width))
                fields[f] = combine(parts)
            branches[name] = None if all(v is None for v in fields.values()) else BranchModulation(**fields)
        out.append(None if all(v is None for v in branches.values()) else BlockModulation(**branches))
    return out


@torch.no_grad()
def depth_batched_generate(
    model,
    input_ids,
    max_new_tokens,
    exit,
    do_sample,
    temperature,
    top_k,
    top_p,
    eos_token_id,
    pad_token_id,
    attention_mask,
    generator,
    loop_options,
    return_stats,
    decoder=None,
):
    """:func:`looplm.decode.generate.generate` under ``exit`` with ``schedule='depth'`` (module docstring), or with
    another decoder class of the same ``run`` (``decoder``: :class:`looplm.decode.static_schedule.StaticDepthDecoder`)."""
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    N, P = input_ids.shape
    # (generate's: the Exit it resolved, returned as it is; the decoder does not check it again)
    exit = Exit.parse(exit)
    mb = exit.max_batch
    rows = N if mb is None else min(N, mb)  # request refill: N prompts through `rows` rows
    with eval_mode(model):
        dec = (decoder or DepthBatchedDecoder)(
            model, rows, P + max_new_tokens, exit, loop_options, **({} if rows == N else {"prompts": N})
        )
        ids = dec.run(
            input_ids,
            max_new_tokens,
            attention_mask,
            lambda logits: sample_next(logits, do_sample, temperature, top_k, top_p, generator),
            eos_token_id,
            pad_token_id,
        )
    return (ids, dec.stats) if return_stats else ids
