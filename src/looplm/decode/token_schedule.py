"""The decode-time loop driver with per-token exit: each token's loop stops at its own exit.

:meth:`LoopedLM.forward` runs every loop for every token. :class:`AdaptiveDecoder` runs the same
computation one decoding call at a time, with an :class:`~looplm.decode.exits.Exit`: after each loop ``k`` the
criterion decides which of the rows still looping may stop; only the rows still active run the next loop
(their hidden states gathered, every cache slot read and written through a row view of the whole batch's
slot, in place: :mod:`looplm.cache`); rows that exited wait at the coda, which runs once for the whole batch.
Then the exit policy fills the loops each exited token skipped (``kv`` / ``ssm``, :mod:`looplm.decode.exits`) and
the token is committed to the cache. It calls the rule's hooks and never asks which rule it holds::

    x = prelude(embed(ids))                      # every row
    state = rule.begin(x)
    for k in range(R):                           # R = max_loops
        z = rule.next_input(state); h = core(z)  # the active rows only (n of B)
        state = rule.step(state, h)
        exit = criterion(h, state) and k + 1 >= min_loops
        y[exiting rows] = rule.finish(rule.exit_rows(state[exiting]))
        state = state[staying rows]              # (kv = 'full': every row goes on, only y is taken here)
    y[rows still looping] = rule.finish(state)
    fill the skipped loops' slots of every exited row (policy); cache.commit()
                                                 # (propagate's core fills: carried into the next core call, looplm.decode.kv_fill)
    logits = head(norm(coda(y)))                 # every row

The prompt (the first call, whatever its length) and any call of several tokens run at full depth (every
loop, no exit; a ``kl`` criterion still reads out every loop so that its readout slots hold the prompt);
a single new token per row takes the exits. So every slot of every loop exists, aligned, before the
first exit. With ``Exit(prefill='exit')`` the prompt's tokens after the first take the exits too, in one
forward (:func:`looplm.decode.exit_forward.adaptive_forward`, which leaves the caches decoding the prompt token
by token would). Teacher forcing (scoring a given text token by token with exits) is
:meth:`AdaptiveDecoder.score`; the same in one forward, :func:`~looplm.decode.exit_forward.adaptive_forward`.

Per decoded token and row :class:`DepthStats` records the selected depth (the exit), the executed depth
(the core passes the row ran), the loops the batch ran (what a waiting row waits for), and FLOPs where the
work runs: core passes, fills, checks (readouts, norms) and the rest (prelude, coda, head).

CUDA: the active rows are index tensors built on the device (``nonzero``); the row count is read on the
host once per loop to size the next loop's tensors — the one synchronisation per loop that compaction
costs (see ``docs/adaptive-depth.md``; not measured on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..context import LoopContext, restrict_context
from ..dispatch import offer_kv_fill
from .exits import Exit, _modulates, finish_rest, keep_staying, make_criterion, readout_is_output, stack_flop_terms
from .kv_fill import KVFill
from ..layers.attention import Attention, copy_kv_columns

__all__ = ["AdaptiveDecoder", "DepthStats", "restrict_context"]


@dataclass
class DepthStats:
    """What adaptive decoding did, per decoded token (lists over tokens; tensors over rows ``[B]``)."""

    max_loops: int
    selected: list = field(default_factory=list)  # [B] long: the exit depth of each row's token
    executed: list = field(default_factory=list)  # [B] long: core passes each row ran (kv='full': max_loops)
    batch_loops: list = field(default_factory=list)  # int: loops the batch ran (a row that exited waits for them)
    core_flops: float = 0.0  # the core passes that ran
    fill_flops: float = 0.0  # propagate fills (copy / freeze / shared: 0)
    fill_bytes: float = 0.0  # bytes a copy fill moved
    # propagate fills carried into the next core call (looplm.decode.kv_fill), and of them those a fused step wrote
    # with its own K/V products (the rest: written on their own right after that call, or at a flush)
    carried_fills: int = 0
    folded_fills: int = 0
    check_flops: float = 0.0  # the criterion: readouts (kl), norms (convergence), the gate's linear
    other_flops: float = 0.0  # prelude, coda, final norm, head (of every token, as full depth runs them)
    reused_flops: float = 0.0  # of other_flops, the heads not run: an exit's logits were its kl check's readout
    full_core_flops: float = 0.0  # the core passes full depth would run on the same tokens
    # continuous depth batching (looplm.decode.depth_schedule): selected / executed then hold [n] tensors of the rows
    # whose token exited at one core pass, and the passes are counted here instead of batch_loops
    core_calls: int = 0  # core passes (each runs every row still decoding, at its own loop)
    batch_size: int = 0
    prefill: dict | None = None  # Exit(prefill='exit'): the prompt's exits (looplm.decode.exit_forward's statistics)

    def summary(self) -> dict:
        """Means per decoded token and row, next to full depth ``max_loops``. ``batch_depth``: core passes
        per decoded token of the batch (token schedule: the loops the batch ran; depth schedule: passes ×
        rows / tokens)."""
        if not self.selected:
            return {"tokens": 0, **({"prefill": self.prefill} if self.prefill is not None else {})}
        sel = torch.cat([t.reshape(-1) for t in self.selected]).float()
        ex = torch.cat([t.reshape(-1) for t in self.executed]).float()
        n = sel.numel()
        batch_depth = (
            self.core_calls * self.batch_size / n
            if self.core_calls
            else float(sum(self.batch_loops)) / len(self.batch_loops)
        )
        total = self.core_flops + self.fill_flops + self.check_flops + self.other_flops - self.reused_flops
        full = self.full_core_flops + self.other_flops
        return {
            "tokens": n,
            "selected_depth": float(sel.mean()),
            "executed_depth": float(ex.mean()),
            "batch_depth": batch_depth,
            "max_loops": self.max_loops,
            "executed_ratio": float(ex.mean()) / self.max_loops,
            "flops_per_token": total / n,
            "flops_ratio": total / full if full else float("nan"),
            "fill_flops_per_token": self.fill_flops / n,
            "fill_bytes_per_token": self.fill_bytes / n,
            "check_flops_per_token": self.check_flops / n,
            "folded_fills": self.folded_fills,
            "carried_fills": self.carried_fills,
            **({"prefill": self.prefill} if self.prefill is not None else {}),
        }


class AdaptiveDecoder:
    """Decoding with per-token exit for one batch: a cache of ``max_loops`` loops (``capacity`` tokens, one
    KV buffer per family under ``kv='shared'``), the criterion, and :class:`DepthStats`.

    ``decoder(ids, attention_mask)`` takes the prompt (several tokens: full depth) or one new token per row
    (``[B, 1]``: exits) and returns the logits of the last position ``[B, 1, V]`` (``logits_to_keep`` more).
    ``attention_mask`` ``[B, past + T]`` as for :meth:`LoopedLM.forward` (left padding).
    ``rule_selects_at_exit=False``: a gate criterion's q is not handed to the rule's output selection (a
    speculative draft's gate, :mod:`looplm.decode.speculative`: verification's output must stay full depth's).
    """

    def __init__(
        self,
        model,
        batch_size: int,
        capacity: int,
        exit,
        loop_options: dict | None = None,
        prompts: int | None = None,
        rule_selects_at_exit: bool = True,
    ):
        self.model = model
        # prompts: how many the decoder will see (request refill, looplm.decode.depth_schedule: more than its rows)
        self.exit = e = Exit.parse(exit).resolved(model, batch_size if prompts is None else prompts)
        self.R = e.max_loops
        self.cache = model.new_cache(batch_size, self.R, capacity=capacity, kv_shared=e.kv == "shared")
        self.criterion = make_criterion(e)
        opts = dict(loop_options or {})
        # the rule's own selection agrees with the criterion's q (not for a speculative draft's gate: the
        # verification's output must be full depth's, the rule's own selection under the caller's options)
        if e.criterion == "gate" and rule_selects_at_exit:
            q = opts.get("exit_threshold")
            if q is not None and float(q) != e.threshold:
                raise ValueError(
                    f"exit='gate:{e.threshold}' and loop_options exit_threshold={q} disagree: with the gate criterion its "
                    "q is also the rule's output selection; give one of them (or the same q)"
                )
            opts["exit_threshold"] = e.threshold
        if opts:
            model.rule.check_loop_options(opts)  # a key the rule does not read is refused, as forward does
        self.loop_options = opts
        self.stats = DepthStats(self.R)
        self.token = 0  # single-token calls so far (the index replay depths are read at)
        # FLOPs, (weights, per key of context) of one token: a core pass; prelude + coda + head
        self._core_terms = stack_flop_terms(model.core.stack)
        (pw, pa), (cw, ca) = stack_flop_terms(model.prelude), stack_flop_terms(model.coda)
        self._other_terms = (pw + cw + 2.0 * model.lm_head.weight.numel(), pa + ca)
        # a kl check's readout of the exit loop is the token's logits (no coda, the rule's Y = H^k): an exit
        # takes them instead of running the final norm and the head again (exits.readout_is_output)
        self.reuse_readout = self.criterion.readout and readout_is_output(model)
        self._head_flops = 2.0 * model.lm_head.weight.numel()
        # kv='propagate' without per-loop block modulation: the core's fills of a token are carried into the
        # next core call (looplm.decode.kv_fill: a fused stack step runs them as extra rows of its own K/V products)
        self.carry_fills = e.kv == "propagate" and not _modulates(model.rule)
        self._deferred: KVFill | None = None  # the fill carried into the next core call

    def core_pass(self, ctx: int) -> float:
        """FLOPs of one row's core pass at ``ctx`` keys."""
        return self._core_terms[0] + self._core_terms[1] * ctx

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 1,
        validate: bool = True,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One call: the prompt (the first call; full depth, or the exits with ``prefill='exit'``) or one decoded token
        per row. Returns the logits of the last ``logits_to_keep`` positions ``[B, keep, V]``; with ``logits_at [B]``
        (positions, one per row) the final norm and the head run at row ``b``'s position ``logits_at[b]`` only:
        ``[B, 1, V]`` (a batch of right-padded prompts, each read at its own last position)."""
        m = self.model
        B, T = input_ids.shape
        if logits_at is not None:
            _check_positions(logits_at, B, T)
        if validate:
            m.check_inputs(input_ids, self.cache, attention_mask)
        cache = self.cache
        decoding = T == 1 and cache.seqlen > 0  # the prompt (the first call, any length) runs at full depth ...
        if not decoding:
            self.flush()
        if (
            cache.seqlen == 0 and T > 1 and self.exit.prefill == "exit"
        ):  # ... or takes the exits (its tokens after the first)
            if logits_at is None:
                return self._prefill_exit(input_ids, attention_mask, logits_to_keep)
            keep = T - int(logits_at.min())  # the last positions that hold every row's asked one
            logits = self._prefill_exit(input_ids, attention_mask, keep)  # [B, keep, V]
            return logits[torch.arange(B, device=logits.device), logits_at - (T - keep)][:, None]  # [B, 1, V]
        ctx = cache.seqlen + T  # keys each attention layer reads (the last position)
        fctx, lctx = self._enter(input_ids, attention_mask, cache.seqlen)
        x = m.prelude(lctx.embeddings, fctx, m.cache_slots(cache, m.prelude, (0,), B))  # [B, T, d]
        y, depth, executed, loops, exit_logits = self._loops(x, lctx, allow_exit=decoding)
        st = self.stats
        if exit_logits is not None and logits_to_keep == 1 and logits_at is None:
            logits = exit_logits[:, None]  # [B, 1, V]: the check's readout of the exit loop
            st.reused_flops += B * self._head_flops
        else:
            logits = self._head(y, fctx, logits_to_keep, logits_at)  # [B, keep, V], or [B, 1, V] at logits_at
        if decoding:  # the statistics are of decoded tokens (a prompt runs at full depth)
            st.other_flops += B * (self._other_terms[0] + self._other_terms[1] * ctx)
            st.selected.append(depth)
            st.executed.append(executed)
            st.batch_loops.append(loops)
            st.full_core_flops += B * self.R * self.core_pass(ctx)
            self.token += 1
        cache.commit(T)
        return logits

    def _prefill_exit(self, input_ids, attention_mask, logits_to_keep: int) -> torch.Tensor:
        """The prompt with ``Exit(prefill='exit')``: its tokens after the first take the exits, all at once
        (:func:`looplm.decode.exit_forward.adaptive_forward`, which writes and commits the cache as decoding the
        prompt token by token after its first would); the statistics in ``stats.prefill``."""
        from .exit_forward import adaptive_forward, add_depth_stats

        out = adaptive_forward(
            self.model,
            input_ids,
            self.exit,
            attention_mask=attention_mask,
            loop_options=self.loop_options,
            full_depth_prefix=1,
            cache=self.cache,
            logits_to_keep=logits_to_keep,
        )
        st = out.stats
        self.stats.prefill = (
            st if self.stats.prefill is None else add_depth_stats(self.stats.prefill, st)
        )  # (request refill:
        return out.logits  # every prompt's exits, token-weighted)

    # ------------------------------------------------------------------------------------------
    def _loops(
        self, x: torch.Tensor, lctx: LoopContext, allow_exit: bool, cap: int | None = None, record: list | None = None
    ):
        """The loops of one call: ``(y [B, T, d] for the coda, depth [B], executed [B], loops the batch ran, the
        logits [B, V] when every row left at a check whose readout is its logits (``reuse_readout``) or None)``.
        ``cap``: at most that many loops (a speculative draft, :meth:`draft_exit`; the skipped loops are filled
        below ``cap`` only); ``record``: the rule state after each loop is appended while every row still loops."""
        m, rule, e, crit, cache = self.model, self.model.rule, self.exit, self.criterion, self.cache
        B, T = x.shape[:2]
        R, full = self.R if cap is None else cap, e.kv == "full"
        dev = x.device
        ctx = cache.seqlen + T
        state = rule.begin(x, lctx)
        crit.begin(self.token)
        rows = torch.arange(B, device=dev)  # global ids of the rows still looping
        sub = lctx  # their loop context (the whole batch until the first exit)
        y = None  # [B, T, d]: rows' outputs as they exit
        depth = torch.full((B,), R, dtype=torch.long, device=dev)
        exited = torch.zeros(B, dtype=torch.bool, device=dev) if full else None  # kv='full': exited, still looping
        fills = []
        exit_logits = None
        check_before = crit.flops
        loops = 0
        for k in range(R):
            sub.iteration = k
            n = rows.shape[0]
            h, state = self._iterate(state, sub, n)  # H^k [n, T, d] of the rows still looping
            loops += 1
            if record is not None and sub is lctx:
                record.append(state)
            if allow_exit:
                self.stats.core_flops += n * self.core_pass(ctx)
            if k == R - 1:
                break
            if not allow_exit:
                if crit.readout:  # the prompt's readout slots (a kl criterion reads out every loop)
                    crit.check(k, h, state, sub, rows, m)
                continue
            leave = crit.check(k, h, state, sub, rows, m)  # [n] bool
            if k + 1 < e.min_loops:
                continue
            if full:
                leave = leave & ~exited[rows]
            if not bool(leave.any()):  # the host reads one flag per loop (the row count of the next loop)
                continue
            every = sub is lctx and (
                B == 1 or bool(leave.all())
            )  # the whole batch leaves together (batch 1): no gather
            out = rows if every else leave.nonzero()[:, 0]  # local ids of the rows leaving now
            g = rows if every else rows.index_select(0, out)
            st_out = state if every else rule.take_rows(state, out, n)
            ctx_out = lctx if every else restrict_context(lctx, g)
            ctx_out.iteration = k
            st_out = rule.exit_rows(st_out, torch.ones(out.shape[0], T, dtype=torch.bool, device=dev), ctx_out)
            if every and not full:
                y = rule.finish(st_out, ctx_out)
                if self.reuse_readout:
                    exit_logits = crit.logits  # [B, V]: head(norm(H^k)), what _head computes from y
                depth.fill_(k + 1)
                fills.append((g, k, st_out, ctx_out, h))
                rows = rows[:0]
                break
            if y is None:
                y = x.new_zeros(B, T, x.shape[-1])
            y.index_copy_(0, g, rule.finish(st_out, ctx_out))
            depth[g] = k + 1
            if full:  # exact caches: the row keeps looping, only its output was taken here
                exited[g] = True
                continue
            fills.append((g, k, st_out, ctx_out, h.index_select(0, out)))
            state, rows, sub = keep_staying(rule, crit, lctx, state, rows, leave)
            if rows.numel() == 0:
                break
        if allow_exit:
            self.stats.check_flops += crit.flops - check_before
        if rows.numel():
            if y is None:  # nobody exited: the forward's own last step
                y = rule.finish(state, sub)
            else:
                finish_rest(rule, y, state, sub, rows, exited)
        for f in fills:
            self._fill(*f, upto=cap)
        executed = torch.full_like(depth, loops) if full else depth  # core passes per row (kv='full': every loop)
        return y, depth, executed, loops, exit_logits

    def _iterate(self, state, lctx: LoopContext, n: int):
        """``model.loop_iteration`` of ``n`` rows, offered the fill carried from the last token (:meth:`_offering`)."""
        return self._offering(lambda: self.model.loop_iteration(state, lctx, n))

    def _offering(self, core_call):
        """``core_call()`` (a call that runs the core) with the carried fill offered to it (:mod:`looplm.decode.kv_fill`):
        the fused stack step writes it with its own K/V products, else it is written right after; counted."""
        fill, self._deferred = self._deferred, None
        if fill is None:
            return core_call()
        with offer_kv_fill(fill):
            out = core_call()
        self.stats.carried_fills += 1
        self.stats.folded_fills += fill.written
        fill.write()  # (nothing left to do where the fused step wrote it)
        return out

    def flush(self) -> None:
        """Write the fill still carried (:mod:`looplm.decode.kv_fill`): before the cache is read or changed other than
        by the next token's core pass (the end of decoding, a prompt, a speculative draft)."""
        fill, self._deferred = self._deferred, None
        if fill is not None:
            self.stats.carried_fills += 1
            fill.write()

    def _carried(self) -> KVFill:
        """The fill carried into the next core call (made empty on first use): every core attention block,
        its loops' slots as the buffers (buffer ``k'`` is loop ``k'``'s)."""
        if self._deferred is None:
            m, by_family = self.model, self.cache.loop_slots
            blocks = [b for b in m.core.stack.blocks if isinstance(b.mixer, Attention)]
            bufs = [[by_family[("core", b.layer_idx)][k] for k in range(self.R)] for b in blocks]  # KVCache per loop
            self._deferred = KVFill(m.core.stack, blocks, bufs)
        return self._deferred

    # ------------------------------------------------------------------------------------------
    def _fill(
        self,
        g: torch.Tensor,
        k_exit: int,
        state: dict,
        lctx: LoopContext,
        h_exit: torch.Tensor,
        cols: torch.Tensor | None = None,
        skip_core: bool = False,
        upto: int | None = None,
    ) -> None:
        """The slots of loops ``k_exit + 1 .. R − 1`` for rows ``g`` that exited after loop ``k_exit`` (their
        token at column ``seqlen``, or at each row's own column ``cols [n]``: :mod:`looplm.decode.depth_schedule`, which
        fills the core's attention slots itself: ``skip_core``). ``upto``: a draft capped at ``upto`` loops fills
        the core's loops below it and the readout's below ``upto − 1`` (the loops it can check), nothing else."""
        m, e, cache = self.model, self.exit, self.cache
        skipped = range(k_exit + 1, self.R if upto is None else upto)
        B, pos = cache.batch_size, cache.seqlen
        blocks = {b.layer_idx: b for stack in (m.core.stack, m.coda) for b in stack.blocks}
        modulated = _modulates(m.rule)
        z_next = None
        per_layer: dict = {}  # (family, layer, k or None) -> the stand-in's fill (computed once per layer)
        st = self.stats
        n = g.shape[0]
        copies = ([], [])  # kv='copy': (exit loop's cache, skipped loop's cache) pairs, one copy_kv_columns for all
        # kv='propagate' in the core, unmodulated, at column seqlen: carried into the next core call (looplm.decode.kv_fill)
        carry = self.carry_fills and cols is None and upto is None
        carried = False
        for family, by_loop in cache.loop_slots.items():
            if skip_core and family[0] == "core" and hasattr(next(iter(by_loop.values())), "update"):
                continue  # a core attention family (its caller's); a core Mamba-2 family is filled here
            src = by_loop.get(k_exit)
            for k in skipped:
                dst = by_loop.get(k)
                if dst is None or (upto is not None and family[0] != "core" and k >= upto - 1):
                    continue
                kv_slot = hasattr(dst, "update")
                if kv_slot and e.kv == "shared":
                    continue  # the token's column keeps the last loop it ran
                if not kv_slot and e.ssm == "freeze":
                    dst.pending = max(dst.pending, 1)  # state and conv window untouched; the token is counted
                    continue
                if kv_slot and e.kv == "copy":  # the exit loop's key and value at the token's column
                    s, d = getattr(src, "base", src), getattr(dst, "base", dst)  # (every loop's cache holds the prompt)
                    copies[0].extend((s._k, s._v))
                    copies[1].extend((d._k, d._v))
                    if cols is None:
                        d.pending = max(d.pending, 1)  # written at column seqlen: committed with the token
                    st.fill_bytes += 2 * n * s._k.shape[1] * s._k.shape[-1] * s._k.element_size()
                    continue
                # propagate (KV or SSM) / decay (SSM): the stand-in through the skipped layer
                kind, layer = family
                blk = blocks[layer]
                if kind == "core":
                    if z_next is None:
                        nxt = replace(lctx, iteration=k_exit + 1)
                        z_next = m.rule.next_input(state, nxt)  # Z^{k+1}: what the next loop would read
                    stand = z_next
                    if carry and kv_slot:  # every core attention layer's slots of loops k+1 .. R−1 at once
                        if not carried:
                            fill, loc = self._carried(), torch.arange(n, device=g.device)
                            fill.add(z_next, lctx.fctx.rope, [(kk, g, pos, loc) for kk in skipped])
                            st.fill_flops += n * fill.flops_per_row()  # one projection per layer, as below
                            carried = True
                        d = getattr(dst, "base", dst)
                        d.pending = max(d.pending, 1)  # the token's column, committed with it (written later)
                        continue
                else:  # a readout's coda layer: the exit iterate H^k
                    stand = h_exit
                mod_key = k if (kind == "core" and modulated) else None
                key = (family, mod_key)
                u = per_layer.get(key)
                if u is None:
                    u = blk.mixer_norm(stand)  # [n, 1, d]
                    if mod_key is not None:  # the rule's per-loop scale / shift of this block's mixer input
                        mods = m.rule.block_modulation(state, replace(lctx, iteration=k))
                        mm = None if mods is None else mods[layer - m.core.stack.first].mixer
                        if mm is not None and mm.scale is not None:
                            u = u * mm.scale
                        if mm is not None and mm.shift is not None:
                            u = u + mm.shift
                    if kv_slot:
                        u = blk.mixer.kv_of(u, lctx.fctx)  # (k, v) [n, H_kv, 1, hd]
                        st.fill_flops += n * 2.0 * (blk.mixer.k_proj.weight.numel() + blk.mixer.v_proj.weight.numel())
                    else:
                        mix = blk.mixer
                        rows_w = mix.in_proj.weight if e.ssm == "propagate" else mix.in_proj.weight[-mix.nheads :]
                        u = (u, mix.in_proj(u[:, 0]) if e.ssm == "propagate" else None)
                        st.fill_flops += n * 2.0 * rows_w.numel()
                    per_layer[key] = u
                if kv_slot:
                    getattr(dst, "base", dst).write_rows(g, u[0], u[1], B, cols)
                else:
                    mix = blk.mixer
                    mix.absorb(u[0], dst.rows(g, B), e.ssm, zxbcdt=u[1])
                    st.fill_flops += n * (
                        2.0 * mix.conv_dim * mix.d_conv + 4.0 * mix.nheads * mix.headdim * mix.d_state
                    )
        if copies[0]:  # every (layer, skipped loop) pair in one call (a kernel on the CPU: looplm.kernels.decode)
            copy_kv_columns(
                *copies, g, cols if cols is not None else torch.full((1,), pos, dtype=torch.long, device=g.device)
            )

    # ------------------------------------------------------------------------------------------
    # self-speculative decoding (looplm.decode.speculative): a draft that stops at r_d, a verification that resumes
    @torch.no_grad()
    def draft(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, loops: int, readout: bool = True):
        """One new token per row through ``loops`` loops only, with no fill (the deeper loops' slots stay one
        token behind: verification writes them). Returns the logits ``[B, 1, V]`` of the exit at ``loops``
        (``None`` without ``readout``: a round's last token, whose draft only verification resumes) and the
        rule state after it (what verification resumes from)."""
        self.flush()
        m, cache, rule = self.model, self.cache, self.model.rule
        B = input_ids.shape[0]
        fctx, lctx = self._enter(input_ids, attention_mask, cache.seqlen)
        x = m.prelude(lctx.embeddings, fctx, m.cache_slots(cache, m.prelude, (0,), B))
        state = rule.begin(x, lctx)
        for k in range(loops):
            lctx.iteration = k
            h, state = m.loop_iteration(state, lctx, B)
        logits = None
        if readout:  # the coda's slots are rolled back to the round's start before verification anyway
            out = rule.exit_rows(state, torch.ones(B, 1, dtype=torch.bool, device=x.device), lctx)
            logits = self._head(rule.finish(out, lctx), fctx)  # [B, 1, V]
        cache.commit(1)
        return logits, state

    @torch.no_grad()
    def draft_exit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cap: int):
        """One new token per row under this decoder's exit criterion, at most ``cap`` loops: each row stops at its
        own exit (the batch's rows still looping run on, :meth:`_loops`), the skipped loops below ``cap`` are
        filled by the exit policy (so a later draft token finds an entry at every loop it runs), and the token
        is read out at its exit. Returns the logits ``[B, 1, V]``, the exit depth ``[B]``, the core passes each
        row ran ``[B]`` and the rule states after loops ``1 .. min(depth)`` (what verification resumes from)."""
        self.flush()
        m, cache = self.model, self.cache
        B = input_ids.shape[0]
        fctx, lctx = self._enter(input_ids, attention_mask, cache.seqlen)
        x = m.prelude(lctx.embeddings, fctx, m.cache_slots(cache, m.prelude, (0,), B))  # [B, 1, d]
        record: list = []
        y, depth, executed, _, exit_logits = self._loops(x, lctx, allow_exit=True, cap=cap, record=record)
        logits = exit_logits[:, None] if exit_logits is not None else self._head(y, fctx)  # [B, 1, V]
        cache.commit(1)
        return logits, depth, executed, record

    @torch.no_grad()
    def verify(self, states: list, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, start: int, past: int):
        """Resume the drafted tokens ``input_ids [B, n]`` (columns ``past .. past + n − 1``, their loops
        ``< start`` already run by :meth:`draft`, whose states ``states`` are) at loop ``start``: loops
        ``start .. R − 1`` of all ``n`` tokens in one forward, then finish, coda and head: logits ``[B, n, V]``
        at full depth. The coda's slots must have been rolled back to ``past`` by the caller."""
        self.flush()
        m, rule = self.model, self.model.rule
        B, n = input_ids.shape
        fctx, lctx = self._enter(input_ids, attention_mask, past)
        state = rule.cat_tokens(states)  # [B, n, ...]
        for k in range(start, self.R):
            lctx.iteration = k
            h, state = m.loop_iteration(state, lctx, B)
        return self._head(rule.finish(state, lctx), fctx, n)  # [B, n, V]

    def _enter(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: int):
        """The forward context of ``input_ids`` after ``past`` cached tokens and the loop context holding
        their scaled embeddings ``E [B, T, d]`` (``lctx.embeddings``, what the prelude reads)."""
        m = self.model
        fctx = m.forward_context(input_ids, attention_mask, None, past)
        E = m.embed_tokens(input_ids)  # [B, T, d]
        return fctx, self._context(fctx, E)

    def _head(self, y: torch.Tensor, fctx, keep: int = 1, at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, keep, V]`` of the loop output ``y [B, T, d]``: the coda (its slots, every position), then the
        final norm and the head on the last ``keep`` positions — or, with ``at [B]``, on row ``b``'s position
        ``at[b]`` only (gathered before the norm): ``[B, 1, V]``."""
        m = self.model
        y = m.coda(y, fctx, m.cache_slots(self.cache, m.coda, (0,), y.shape[0]))  # [B, T, d]
        if at is None:
            return m.lm_head(m.norm(y[:, -keep:]))  # [B, keep, V]
        y = y[torch.arange(y.shape[0], device=y.device), at][:, None]  # [B, 1, d]
        return m.lm_head(m.norm(y))  # [B, 1, V]

    def _context(self, fctx, E) -> LoopContext:
        m = self.model
        return LoopContext(
            num_loops=self.R,
            train_loops=m.config.n_loops,
            fctx=fctx,
            cache=self.cache,
            loop_options=self.loop_options,
            embeddings=E,
            embed_weight=m.embed.weight,
            embed_multiplier=m.embed_multiplier,
            readout_fn=m.readout,
            final_norm=m.norm,
        )

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, prompt_len: int = 1) -> torch.Tensor:
        """Teacher forcing with exits: the first ``prompt_len`` tokens as a prompt (full depth), then every
        further token one at a time (its exit decided as in decoding). Returns the logits of every position
        ``[B, T, V]`` from position ``prompt_len − 1`` on (earlier positions are zeros)."""
        B, T = input_ids.shape
        if not 1 <= prompt_len <= T:
            raise ValueError(f"prompt_len must be in [1, {T}], got {prompt_len}")
        V = self.model.config.vocab_size
        out = torch.zeros(B, T, V, device=input_ids.device)
        out[:, :prompt_len] = self(input_ids[:, :prompt_len], logits_to_keep=prompt_len).float()
        for t in range(prompt_len, T):
            out[:, t] = self(input_ids[:, t : t + 1], validate=False)[:, -1].float()
        self.flush()
        return out


def _check_positions(at, B: int, T: int) -> None:
    """``at`` must be a ``[B]`` integer tensor of positions in ``[0, T)`` (one per row of a ``[B, T]`` call)."""
    if not isinstance(at, torch.Tensor) or at.dtype not in (torch.int32, torch.int64) or tuple(at.shape) != (B,):
        what = f"a {at.dtype} tensor of shape {tuple(at.shape)}" if isinstance(at, torch.Tensor) else repr(at)
        raise ValueError(f"logits_at must be a [{B}] integer tensor of positions (one per row), got {what}")
    lo, hi = int(at.min()), int(at.max())
    if lo < 0 or hi >= T:
        raise ValueError(f"logits_at holds positions {lo} .. {hi}; input_ids has {T} positions per row (0 .. {T - 1})")
