"""Continuous depth batching at fixed shapes: every core pass runs all ``B`` rows, with no host reads.

:mod:`looplm.depth_batch` (``schedule='depth'``) keeps its cohorts on the host: which rows exit, which start,
how many run — a few reads of device values per pass, each a synchronisation on CUDA (the GPU drains and
waits for the host's next launch). ``schedule='static'`` runs the same computation with every shape fixed:

* each row carries its loop ``k_b`` (a ``[B]`` tensor); a pass runs the core once for all ``B`` rows, row
  ``b`` at loop ``k_b`` (its attention slot ``k_b·B + b`` of the flat ``[R·B, ...]`` buffer, its own column);
* the rule is called once per loop index ``j = 0 .. R − 1`` on all rows and each row keeps the result of its
  own loop (``rule.select_rows``, the hook of per-row loop counts) — so no rule sees a per-row loop index;
  that is ``R`` small calls of the rule per pass, beside one core call;
* the exit test, the exit states, the fills (``copy``: a masked gather / scatter per layer; ``propagate``:
  one projection per layer for every row) and the coda, norm and head run for every row each pass, masked
  by the rows that exit; the picked token is kept only where a row exited (``torch.where``);
* a row that exited starts its next token at loop 0 at the next pass (its embedding and prelude: every row
  runs them each pass, the others rewrite their in-flight token's prelude keys with the same values).

So a pass is a fixed sequence of kernels over fixed shapes (what a CUDA graph captures). The one host read
is the batch's end: every ``lag`` passes the host reads whether every row is done *as of ``lag`` passes
earlier* (on CUDA through pinned memory behind an event: by then the GPU has long finished it), so it
never waits for the pass it just launched, and at most ``lag`` passes run after the last row finished
(their rows are masked: nothing changes). ``lag`` is ``R`` on CUDA, 0 on a CPU (no synchronisation to avoid).

What this costs, against ``schedule='depth'``: the prelude, the coda, the head (and a ``kl`` readout) of
every row every pass instead of the rows that start or exit, ``R`` rule calls per pass, and attention over
the whole capacity under each row's mask on the reference path (a per-row-length kernel, e.g.
flash-attention's ``cache_batch_idx`` / ``cache_seqlens``, would read each row's own columns only). On a
GPU at decoding batch sizes a pass is bound by streaming the weights, which costs the same for ``B`` rows as
for a few; on a CPU the extra rows are real FLOPs — use ``schedule='depth'`` there. Not measured on a GPU
(none lent to this project's sessions yet); ``tests/test_depth_static.py`` checks on a CPU that a pass makes
no host read of a tensor (``aten._local_scalar_dense``, ``nonzero``, ...) and that greedy decoding equals the
token schedule's.

Refused, beside what ``schedule='depth'`` refuses: ``kv='propagate'`` with a rule that modulates its blocks
per loop, the ``kl`` criterion with coda layers (its readout slots are per loop), and rules whose state
changes structure over the loops (e.g. a history that grows), which no per-row selection can merge.
Sampled decoding draws a token for every row each pass and keeps the exiting rows': a seed fixes the output,
but the draws differ from the other schedules'.
"""

from __future__ import annotations

import time

import torch

from .context import BlockModulation, BranchModulation, ForwardContext
from .depth_batch import DepthBatchedDecoder
from .layers.attention import KVRows
from .sampling import decode_context, eval_mode, sample_next

__all__ = ["StaticDepthDecoder", "static_depth_generate"]


class StaticDepthDecoder(DepthBatchedDecoder):
    """:class:`~looplm.depth_batch.DepthBatchedDecoder`'s cache and prompt, then :meth:`run`'s fixed-shape
    passes (module docstring). ``lag``: passes between a row set's end and the host learning of it (default
    ``R`` on CUDA, 0 elsewhere)."""

    schedule = "static"

    def __init__(self, model, batch_size: int, capacity: int, exit, loop_options: dict | None = None, lag: int | None = None):
        super().__init__(model, batch_size, capacity, exit, loop_options)
        p = next(model.parameters())
        self.lag = (self.R if p.device.type == "cuda" else 0) if lag is None else int(lag)
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0 passes, got {lag!r}")

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None, pick,
            eos_token_id: int | None, pad_token_id: int, now=time.perf_counter) -> torch.Tensor:
        """As :meth:`DepthBatchedDecoder.run` (the same arguments and result), every pass at fixed shapes."""
        d = self.exit.depths
        if isinstance(d, torch.Tensor) and d.dim() == 2 and d.shape[1] < max_new_tokens - 1:
            raise ValueError(f"exit depths give {d.shape[1]} tokens per row; max_new_tokens={max_new_tokens} decodes "
                             f"{max_new_tokens - 1} after the prompt's: give at least that many")  # fmt: skip
        out, col, made, done = self._prefill(input_ids, max_new_tokens, attention_mask, pick, eos_token_id, pad_token_id)
        if max_new_tokens == 0:
            return out
        m, cache, R = self.model, self.cache, self.R
        B, P = input_ids.shape
        dev = input_ids.device
        self.ar = torch.arange(B, device=dev)
        rep = self.ar.repeat(R - 1)  # [(R−1)·B]: the deeper loops' buffer rows j·B + b, j = 1 .. R − 1
        self.deeper = (rep, torch.arange(1, R, device=dev).repeat_interleave(B))
        self.key_sum = torch.zeros((), dtype=torch.float64, device=dev)  # Σ over passes and rows of keys read
        self.pairs = torch.zeros((), dtype=torch.long, device=dev)  # (row, skipped loop) entries filled
        self.sel, self.at_col = [], []  # per pass: each row's exit depth (0: no exit), its column
        k = torch.zeros(B, dtype=torch.long, device=dev)  # the loop each row runs at the next pass
        mem = {"S": None, "prev": None}  # the rule state after the last step; the criterion's last value
        flags = _DoneFlags(self.lag, dev)
        bound = (max_new_tokens - 1) * R  # every row's tokens fit in this many passes
        passes = 0
        t0 = now()
        with decode_context(m, B):
            while passes < bound and not flags.seen_done(passes):
                self._tick(out, col, made, done, k, mem, pick, max_new_tokens, eos_token_id)
                passes += 1
                flags.post(done)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.decode_seconds = now() - t0
        self.passes = passes
        self._count_static(passes)
        cache.seqlen = P + int(made.max()) - 1
        return out[:, : P + int(made.max())]

    # ------------------------------------------------------------------------------------------
    def _tick(self, out, col, made, done, k, mem, pick, max_new_tokens, eos_token_id) -> None:
        """One pass over all ``B`` rows (each at its loop ``k[b]``, its column ``col[b]``); updates ``out``,
        ``col``, ``made``, ``done``, ``k`` and ``mem`` in place. No value is read on the host."""
        m, rule, R, e, B, ar = self.model, self.model.rule, self.R, self.exit, self.cache.batch_size, self.ar
        pos = (self.pos_shift + col)[:, None]  # [B, 1]: each row's position of its token in flight
        mask = self.visible & (self.keys[None] <= col[:, None])  # [B, capacity]: its columns up to its own
        fctx = ForwardContext(rope={int(r): rot(pos) for r, rot in m.rotary.items()}, positions=pos,
                              attn_mask=mask[:, None, None, :], is_causal=False, pad_mask=None)  # fmt: skip
        self.key_sum += (col + 1).sum()
        # start: the token in flight of every row (rows that exited last pass start it; the others rewrite
        # its prelude keys at the same column with the same values)
        E = m._embed(out.gather(1, col[:, None]), head_in_loss=False) * m.embed_multiplier  # [B, 1, d]
        view = self.cache.rows(ar, col)
        x = m.prelude(E, fctx, m._slots(view, m.prelude, (0,), B)) if len(m.prelude.blocks) else E
        ctxs = []
        for j in range(R):  # loop j's context for every row (the rule is called once per loop index)
            c = self._context(fctx, E)
            c.cache, c.iteration = view, j
            ctxs.append(c)
        at = [k == j for j in range(R)]  # [B] bool: the rows at loop j
        s0 = rule.begin(x, ctxs[0])
        src = [s0] + [s0 if mem["S"] is None else mem["S"]] * (R - 1)  # loop j's input state (loop 0: begin)
        zs = []
        for j in range(R):
            zs.append(rule.next_input(src[j], ctxs[j]))  # Z^j of every row  [B, 1, d]
            ctxs[j].core_input = zs[j]
        z = _by_loop(at, zs)  # [B, 1, d]: row b's Z^{k_b}
        mods = _by_loop_modulations(at, [rule.block_modulation(src[j], ctxs[j]) for j in range(R)], len(m.core.stack.blocks))
        idx = k * self.loop_offset + ar  # buffer row of each row: k_b·B + b
        slots = [KVRows(base, idx, nrows, col) for base, nrows, _ in (self.flat[b.layer_idx] for b in m.core.stack.blocks)]
        h = m.core(z, fctx, slots, mods)  # [B, 1, d]: H^{k_b} of row b
        self.stats.core_calls += 1
        news = [rule.step(src[j], h, ctxs[j]) for j in range(R)]
        S = news[R - 1]
        for j in range(R - 2, -1, -1):
            S = rule.select_rows(at[j], news[j], S)  # each row keeps its own loop's step
        mem["S"] = S
        leave = self._leave(k, at, news, h, ctxs, mem, made)
        leave = ((leave & (k + 1 >= e.min_loops)) | (k == R - 1)) & ~done  # [B]
        outs = [rule.exit_rows(news[j], (leave & at[j])[:, None], ctxs[j]) for j in range(R)]
        y = _by_loop(at, [rule.finish(outs[j], ctxs[j]) for j in range(R)])  # [B, 1, d]
        self._fill_static(leave, k, col, at, outs, ctxs, fctx)
        if len(m.coda.blocks):
            y = m.coda(y, fctx, m._slots(view, m.coda, (0,), B))
        nxt = pick(m.lm_head(m.norm(y[:, -1])))  # [B]: kept where a row exits
        self.sel.append(torch.where(leave, k + 1, 0))
        self.at_col.append(col.clone())
        # commit: the exiting rows' tokens, columns, counts; their next token starts at loop 0
        col += leave
        made += leave
        here = out.gather(1, col[:, None])[:, 0]
        out.scatter_(1, col[:, None], torch.where(leave, nxt.to(out.dtype), here)[:, None])
        fin = made >= max_new_tokens
        if eos_token_id is not None:
            fin = fin | (nxt == eos_token_id)
        done |= leave & fin
        k.copy_(torch.where(leave | done, 0, k + 1))

    def _leave(self, k, at, news, h, ctxs, mem, made) -> torch.Tensor:
        """``[B]`` bool: the criterion says each row may stop after the loop it just ran."""
        e, m, B = self.exit, self.model, h.shape[0]
        st = self.stats
        if e.criterion == "gate":
            from .recurrence.exit_gate import reaches

            log_S = _by_loop(at, [m.rule.exit_log_survival(news[j], ctxs[j])[:, -1] for j in range(self.R)])  # [B] float64
            st.check_flops += 2.0 * B * h.shape[-1]  # the gate's linear (in the rule's step)
            return reaches(log_S, e.threshold)
        if e.criterion == "replay":
            d = e.depths
            if isinstance(d, int):
                return torch.full_like(k, d) <= k + 1
            d = d.to(k.device)
            depth = d if d.dim() == 1 else d.gather(1, (made - 1).clamp(max=d.shape[1] - 1)[:, None])[:, 0]
            return depth <= k + 1
        crit = self.criterion  # kl / convergence: successive iterates of each row's token
        before = crit.flops
        cur = crit.value(0, h, ctxs[0], m)  # [B, V] log-probabilities (no coda: the same readout at every loop) or [B, d]
        if crit.readout:
            st.check_flops += B * 2.0 * m.lm_head.weight.numel()  # every row's readout, every pass
        else:
            st.check_flops += crit.flops - before
        prev = mem["prev"]
        mem["prev"] = cur
        if prev is None:
            return torch.zeros(B, dtype=torch.bool, device=h.device)
        return (k > 0) & (crit.distance(prev, cur) < e.threshold)  # a row at loop 0 has no previous iterate

    def _fill_static(self, leave, k, col, at, outs, ctxs, fctx) -> None:
        """The core slots of the loops each exiting row skips (``j > k_b``, at its column): one masked gather /
        scatter per layer and buffer over every (row, deeper loop) pair — ``copy``: buffer row ``k_b·B + b``;
        ``propagate``: the stand-in ``Z^{k_b + 1}`` of every row through each layer's norm and K/V
        projections. ``shared``: nothing (a row's column holds its last loop)."""
        kv, B, R, m = self.exit.kv, self.cache.batch_size, self.R, self.model
        if kv == "shared" or R == 1:
            return
        b, j = self.deeper  # [(R−1)·B]
        dst = j * B + b
        w = leave[b] & (k[b] < j)  # [(R−1)·B]: this row exits before loop j
        self.pairs += w.sum()
        c = col[b]
        w3 = w[:, None, None]
        if kv == "copy":
            src = k[b] * B + b
            for base, _, _ in self.flat.values():
                for buf in (base._k, base._v):
                    buf[dst, :, c] = torch.where(w3, buf[src, :, c], buf[dst, :, c])  # [pairs, H_kv, hd]
            return
        # propagate (the rule does not modulate the blocks: one stand-in per row for every deeper loop)
        stand = _by_loop(at[: R - 1], [m.rule.next_input(outs[i], ctxs[i + 1]) for i in range(R - 1)])  # [B, 1, d]
        for blk in m.core.stack.blocks:
            kk, vv = blk.mixer.kv_of(blk.mixer_norm(stand), fctx)  # [B, H_kv, 1, hd]
            base = self.flat[blk.layer_idx][0]
            base._k[dst, :, c] = torch.where(w3, kk[b, :, 0].to(base._k.dtype), base._k[dst, :, c])
            base._v[dst, :, c] = torch.where(w3, vv[b, :, 0].to(base._v.dtype), base._v[dst, :, c])
            self.stats.fill_flops += B * 2.0 * (blk.mixer.k_proj.weight.numel() + blk.mixer.v_proj.weight.numel())

    def _count_static(self, passes: int) -> None:
        """Statistics from the passes: each exit's depth and column; FLOPs of what ran — every row, every
        pass: the core's weights, and attention over each row's keys (``Σ (col + 1)``); prelude, coda, head."""
        st = self.stats
        if not self.sel:
            return
        sel, cols = torch.cat(self.sel), torch.cat(self.at_col)
        ex = sel > 0
        st.selected.append(sel[ex])
        st.executed.append(sel[ex])
        keys = cols[ex].double() + 1
        (w, a), (ow, oa) = self._core_terms, self._other_terms
        rows_run, key_sum = passes * self.cache.batch_size, float(self.key_sum)
        st.core_flops += w * rows_run + a * key_sum
        st.other_flops += ow * rows_run + oa * key_sum
        st.full_core_flops += self.R * (w * keys.numel() + a * float(keys.sum()))
        st.fill_bytes += self.copy_bytes * float(self.pairs) if self.exit.kv == "copy" else 0.0
        self.sel, self.at_col = [], []


class _DoneFlags:
    """Whether every row is done, read on the host ``lag`` passes late (module docstring): :meth:`post` after
    each pass records the flag (on CUDA: copied to pinned memory behind an event), :meth:`seen_done` before a
    pass reads the one of ``lag`` passes earlier (0: the latest; on a CPU no synchronisation is involved)."""

    def __init__(self, lag: int, device):
        self.lag, self.cuda = lag, torch.device(device).type == "cuda"
        self.ring: list = []  # the last lag + 1 passes' flags: device tensors, or (pinned tensor, event)

    def post(self, done: torch.Tensor) -> None:
        flag = done.all()
        if self.cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            flag = (host, ev)
        self.ring.append(flag)
        if len(self.ring) > self.lag + 1:
            self.ring.pop(0)

    def seen_done(self, passes: int) -> bool:
        if passes == 0 or len(self.ring) <= self.lag:
            return False
        if (passes - self.lag) % max(self.lag, 1):  # read once every lag passes
            return False
        flag = self.ring[0]
        if self.cuda:
            host, ev = flag
            ev.synchronize()  # lag passes old: done on the GPU long ago
            return bool(host)
        return bool(flag)


def _by_loop(at: list, xs: list) -> torch.Tensor:
    """Row ``b`` of ``xs[j]`` where ``at[j][b]`` (the rows at loop ``j``); ``xs[0]`` where no mask holds."""
    y = xs[0]
    for m, x in zip(at[1:], xs[1:]):
        y = torch.where(m.view(-1, *([1] * (x.dim() - 1))), x, y)
    return y


def _by_loop_modulations(at: list, mods: list, n_blocks: int):
    """Each row's block modulation of its own loop (``mods[j]``: loop ``j``'s for every row, or ``None``):
    every field as ``[B, 1, width]`` (absent: 1 for scale and gate, 0 for shift); ``None`` when no loop
    modulates."""
    if all(x is None for x in mods):
        return None
    B = at[0].shape[0]
    out = []
    for i in range(n_blocks):
        branches = {}
        for name in ("mixer", "mlp"):
            fields = {}
            for f, ident in (("scale", 1.0), ("shift", 0.0), ("gate", 1.0)):
                vals = [None if ms is None or ms[i] is None or getattr(ms[i], name) is None else getattr(getattr(ms[i], name), f)
                        for ms in mods]  # fmt: skip
                if all(v is None for v in vals):
                    fields[f] = None
                    continue
                like = next(v for v in vals if v is not None)
                width = max(v.shape[-1] if v.dim() else 1 for v in vals if v is not None)
                rows = []
                for v in vals:
                    v = like.new_full((1, 1, 1), ident) if v is None else v
                    v = v.reshape((1,) * max(0, 3 - v.dim()) + tuple(v.shape)) if v.dim() < 3 else v
                    rows.append(v.expand(B, 1, width))
                fields[f] = _by_loop(at, rows)
            branches[name] = None if all(v is None for v in fields.values()) else BranchModulation(**fields)
        out.append(None if all(v is None for v in branches.values()) else BlockModulation(**branches))
    return out


@torch.no_grad()
def static_depth_generate(model, input_ids, max_new_tokens, exit, do_sample, temperature, top_k, top_p, eos_token_id,
                          pad_token_id, attention_mask, generator, loop_options, return_stats):
    """:func:`looplm.generate.generate` under ``exit`` with ``schedule='static'`` (module docstring)."""
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    with eval_mode(model):
        dec = StaticDepthDecoder(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, exit, loop_options)
        ids = dec.run(input_ids, max_new_tokens, attention_mask,
                      lambda logits: sample_next(logits, do_sample, temperature, top_k, top_p, generator), eos_token_id, pad_token_id)  # fmt: skip
    return (ids, dec.stats) if return_stats else ids
