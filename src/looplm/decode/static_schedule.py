"""Continuous depth batching at fixed shapes: every core pass runs all ``B`` rows, with no host reads.

:mod:`looplm.decode.depth_schedule` (``schedule='depth'``) keeps its cohorts on the host: which rows exit, which start,
how many run — a few reads of device values per pass, each a synchronisation on CUDA (the GPU drains and
waits for the host's next launch). ``schedule='static'`` runs the same computation with every shape fixed:

* each row carries its loop ``k_b`` (a ``[B]`` tensor); a pass runs the core once for all ``B`` rows, row
  ``b`` at loop ``k_b`` (its attention slot ``k_b·B + b`` of the flat ``[R·B, ...]`` buffer, its own column);
* the rule is called once per loop index ``j = 0 .. R − 1`` on all rows and each row keeps the result of its
  own loop (``rule.select_rows``, the hook of per-row loop counts) — so no rule sees a per-row loop index;
  that is ``R`` small calls of the rule per pass, beside one core call;
* the exit test, the exit states, the fills (``copy``: a masked gather / scatter per layer; ``propagate``:
  one projection per layer for every row; a Mamba-2 ``ssm`` policy: the stand-in absorbed for every
  (row, deeper loop) pair, written back where the pair is skipped) and the coda, norm and head run for
  every row each pass, masked by the rows that exit; the picked token is kept only where a row exited
  (``torch.where``); a finished row's Mamba-2 states are written back unchanged;
* a row that exited starts its next token at loop 0 at the next pass (its embedding and prelude: every row
  runs them each pass, the others rewrite their in-flight token's prelude keys with the same values).

So a pass is a fixed sequence of kernels over fixed shapes (what a CUDA graph captures). The one host read
is the batch's end: before each pass the host reads whether every row was done *``lag`` passes earlier*
(on CUDA through pinned memory behind an event: by then the GPU has long finished it), so it never waits
for the pass it just launched, and at most ``lag`` passes run after the last row finished (their rows are
masked: nothing changes). ``lag`` is ``R`` on CUDA, 0 on a CPU (no synchronisation to avoid).

What this costs, against ``schedule='depth'``: the prelude, the coda, the head (and a ``kl`` readout) of
every row every pass instead of the rows that start or exit, ``R`` rule calls per pass, and attention over
the whole capacity under each row's mask on the reference path (a per-row-length kernel, e.g.
flash-attention's ``cache_batch_idx`` / ``cache_seqlens``, would read each row's own columns only). On a
GPU at decoding batch sizes a pass is bound by streaming the weights, which costs the same for ``B`` rows as
for a few; on a CPU the extra rows are real FLOPs — use ``schedule='depth'`` there. Not measured on a GPU
(none lent to this project's sessions yet); ``tests/test_depth_static.py`` checks on a CPU that a pass makes
no host read of a tensor (``aten._local_scalar_dense``, ``nonzero``, ...) and that greedy decoding equals the
token schedule's.

Refused, beside what ``schedule='depth'`` refuses: ``kv='propagate'`` (and a Mamba-2 ``ssm`` policy other
than ``'freeze'``) with a rule that modulates its blocks per loop, the ``kl`` criterion with coda layers (its readout slots are per loop), and rules whose state
changes structure over the loops (e.g. a history that grows), which no per-row selection can merge.
Sampled decoding draws a token for every row each pass and keeps the exiting rows': a seed fixes the output,
but the draws differ from the other schedules'.
"""

from __future__ import annotations

import collections
import time

import torch

from ..context import ForwardContext
from .depth_schedule import DepthBatchedDecoder, merge_modulations
from .exits import Exit
from ..layers.mamba2 import Mamba2Rows
from .sampling import decode_context

__all__ = ["StaticDepthDecoder"]


class StaticDepthDecoder(DepthBatchedDecoder):
    """:class:`~looplm.decode.depth_schedule.DepthBatchedDecoder`'s cache and prompt, then :meth:`run`'s fixed-shape
    passes (module docstring). ``lag``: passes between a row set's end and the host learning of it (default
    ``R`` on CUDA, 0 elsewhere). ``cuda_graphs``: capture one pass as a CUDA graph and replay it for every
    later pass (greedy picking or the default CUDA generator; not yet run on a GPU). ``exit.compile``: run each pass
    through ``torch.compile`` (:func:`_compiled_tick`; the fused CPU decode kernel stays one opaque call between
    graphs); it cannot be combined with ``cuda_graphs``."""

    schedule = "static"

    def __init__(
        self,
        model,
        batch_size: int,
        capacity: int,
        exit,
        loop_options: dict | None = None,
        lag: int | None = None,
        cuda_graphs: bool = False,
    ):
        p = next(model.parameters())
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ValueError(f"lag must be an int >= 0 passes, got {lag!r}")
        if cuda_graphs and Exit.parse(exit).compile is True:  # before the cache is allocated
            raise ValueError(
                "cuda_graphs=True and exit compile=True both take the pass out of eager mode: give one "
                "(cuda_graphs replays one captured pass; compile fuses its kernels)"
            )
        if cuda_graphs and p.device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True captures the pass as a CUDA graph; the model is on {p.device}: use a CUDA device "
                "or cuda_graphs=False"
            )
        super().__init__(model, batch_size, capacity, exit, loop_options)
        self.lag = (self.R if p.device.type == "cuda" else 0) if lag is None else lag
        self.cuda_graphs, self.graph = bool(cuda_graphs), None

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
        """As :meth:`DepthBatchedDecoder.run` (the same arguments and result), every pass at fixed shapes."""
        d = self.exit.depths
        if isinstance(d, torch.Tensor) and d.dim() == 2 and d.shape[1] < max_new_tokens - 1:
            raise ValueError(
                f"exit depths give {d.shape[1]} tokens per row; max_new_tokens={max_new_tokens} decodes "
                f"{max_new_tokens - 1} after the prompt's: give at least that many"
            )
        out, col, made, done = self._prefill(
            input_ids, max_new_tokens, attention_mask, pick, eos_token_id, pad_token_id
        )
        if max_new_tokens == 0:
            return out
        m, cache, R = self.model, self.cache, self.R
        B, P = input_ids.shape
        dev = input_ids.device
        self.ar = torch.arange(B, device=dev)
        rep = self.ar.repeat(R - 1)  # [(R−1)·B]: the deeper loops' buffer rows j·B + b, j = 1 .. R − 1
        self.deeper = (rep, torch.arange(1, R, device=dev).repeat_interleave(B))
        if isinstance(d, torch.Tensor):
            self.depths = d.to(dev)  # once, not per pass (a copy to the device per pass is a host-side op)
        bound = (max_new_tokens - 1) * R  # every row's tokens fit in this many passes
        # every tensor a pass reads or writes lives in one buffer for the whole decode (a captured pass replays
        # on the same memory): the counters, each pass's exits and columns, the rule state, the criterion's value
        self.key_sum = torch.zeros((), dtype=torch.float64, device=dev)  # Σ over passes and rows of keys read
        self.pairs = torch.zeros((), dtype=torch.long, device=dev)  # (row, skipped loop) entries filled
        self.pass_idx = torch.zeros(1, dtype=torch.long, device=dev)
        rows_kept = bound + self.lag + 2  # (a late end flag and a graph's warm-up pass run past the bound)
        self.sel = torch.zeros(rows_kept, B, dtype=torch.long, device=dev)  # per pass: each row's exit depth (0: none)
        self.at_col = torch.zeros(rows_kept, B, dtype=torch.long, device=dev)  # and its column
        k = torch.zeros(B, dtype=torch.long, device=dev)  # the loop each row runs at the next pass
        mem = {"S": None, "prev": None}  # the rule state after the last step; the criterion's last value
        flags = _DoneFlags(self.lag, dev)
        args = (out, col, made, done, k, mem, pick, max_new_tokens, eos_token_id)
        passes = 0
        t0 = now()
        with decode_context(m, B):
            while passes < bound and not flags.seen_done(passes):
                passes += self._step(args)
                flags.post(done, passes)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.decode_seconds = now() - t0
        self.passes = self.stats.core_calls = passes
        self._count_static(passes)
        cache.seqlen = P + int(made.max()) - 1
        return out[:, : P + int(made.max())]

    def _step(self, args) -> int:
        """One pass (eager), or with ``cuda_graphs`` a replay of the captured pass: the first call runs a
        warm-up pass eagerly on a side stream, captures the next and replays it (2 passes). Returns the
        passes run."""
        if not self.cuda_graphs:
            if self.exit.compile:
                _compiled_tick()(self, *args)
            else:
                self._tick(*args)
            return 1
        if self.graph is not None:
            self.graph.replay()
            return 1
        mem = args[5]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (cuBLAS handles, the allocator) as torch.cuda.graph asks: a real pass
            self._tick(*args)
        torch.cuda.current_stream().wait_stream(side)
        if mem["prev"] is None and self.exit.criterion in ("kl", "convergence"):
            raise RuntimeError("internal: the criterion's buffer must exist before capture")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: every tensor it touches is a buffer of the decode
            self._tick(*args)
        self.graph.replay()
        return 2

    # ------------------------------------------------------------------------------------------
    def _tick(self, out, col, made, done, k, mem, pick, max_new_tokens, eos_token_id) -> None:
        """One pass over all ``B`` rows (each at its loop ``k[b]``, its column ``col[b]``); updates ``out``,
        ``col``, ``made``, ``done``, ``k`` and ``mem`` in place. No value is read on the host."""
        m, rule, R, e, B, ar = self.model, self.model.rule, self.R, self.exit, self.cache.batch_size, self.ar
        pos = (self.pos_shift + col)[:, None]  # [B, 1]: each row's position of its token in flight
        mask = self.visible & (self.keys[None] <= col[:, None])  # [B, capacity]: its columns up to its own
        fctx = ForwardContext(
            rope={int(r): rot(pos) for r, rot in m.rotary.items()},
            positions=pos,
            attn_mask=mask[:, None, None, :],
            is_causal=False,
            pad_mask=None,
        )
        self.key_sum += (col + 1).sum()
        # start: the token in flight of every row (rows that exited last pass start it; the others rewrite
        # its prelude keys at the same column with the same values)
        E = m.embed_tokens(out.gather(1, col[:, None]))  # [B, 1, d]
        view = self.cache.rows(ar, col)
        x = m.prelude(E, fctx, m.cache_slots(view, m.prelude, (0,), B)) if len(m.prelude.blocks) else E
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
        mods = _by_loop_modulations(
            at, [rule.block_modulation(src[j], ctxs[j]) for j in range(R)], len(m.core.stack.blocks)
        )
        # each row's buffer row k_b·B + b (kv='shared': b), its column; a finished row's Mamba-2 states stay as they are
        slots = self._core_slots(k * B + ar, ar, col, keep=~done)
        h = m.core(z, fctx, slots, mods)  # [B, 1, d]: H^{k_b} of row b
        news = [rule.step(src[j], h, ctxs[j]) for j in range(R)]
        S = news[R - 1]
        for j in range(R - 2, -1, -1):
            S = rule.select_rows(at[j], news[j], S)  # each row keeps its own loop's step
        mem["S"] = _keep(mem["S"], S)
        leave = self._leave(k, at, news, h, ctxs, mem, made)
        leave = ((leave & (k + 1 >= e.min_loops)) | (k == R - 1)) & ~done  # [B]
        outs = [rule.exit_rows(news[j], (leave & at[j])[:, None], ctxs[j]) for j in range(R)]
        y = _by_loop(at, [rule.finish(outs[j], ctxs[j]) for j in range(R)])  # [B, 1, d]
        self._fill_static(leave, k, col, at, outs, ctxs, fctx)
        if len(m.coda.blocks):
            y = m.coda(y, fctx, m.cache_slots(view, m.coda, (0,), B))
        nxt = pick(m.lm_head(m.norm(y[:, -1:]))[:, -1])  # [B]: kept where a row exits
        self.sel.index_copy_(0, self.pass_idx, torch.where(leave, k + 1, 0)[None])
        self.at_col.index_copy_(0, self.pass_idx, col[None])
        self.pass_idx += 1
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
        if e.criterion == "gate":
            from ..recurrence.exit_gate import reaches

            log_S = _by_loop(
                at, [m.rule.exit_log_survival(news[j], ctxs[j])[:, -1] for j in range(self.R)]
            )  # [B] float64
            return reaches(log_S, e.threshold)
        if e.criterion == "replay":
            d = e.depths
            if isinstance(d, int):
                return torch.full_like(k, d) <= k + 1
            d = self.depths
            depth = d if d.dim() == 1 else d.gather(1, (made - 1).clamp(max=d.shape[1] - 1)[:, None])[:, 0]
            return depth <= k + 1
        crit = self.criterion  # kl / convergence: successive iterates of each row's token
        cur = crit.measure(
            h, ctxs[0], m
        )  # [B, V] log-probabilities (no coda: the same readout at every loop) or [B, d]
        prev = mem["prev"]
        if prev is None:  # the first pass: every row is at loop 0
            mem["prev"] = cur.clone()
            return torch.zeros(B, dtype=torch.bool, device=h.device)
        leave = (k > 0) & (crit.distance(prev, cur) < e.threshold)  # a row at loop 0 has no previous iterate
        prev.copy_(cur)
        return leave

    def _fill_static(self, leave, k, col, at, outs, ctxs, fctx) -> None:
        """The core slots of the loops each exiting row skips (``j > k_b``, at its column), masked over every
        (row, deeper loop) pair — attention (one gather / scatter per layer and buffer): ``copy``, buffer row
        ``k_b·B + b``; ``propagate``, the stand-in ``Z^{k_b + 1}`` of every row through each layer's norm and
        K/V projections; ``shared``, nothing (a row's column holds its last loop). Mamba-2 (``ssm``):
        ``freeze``, nothing; ``propagate`` / ``decay``, the stand-in absorbed into each pair's state, kept
        where the pair is skipped (a masked row view)."""
        kv, ssm, B, R, m = self.exit.kv, self.exit.ssm, self.cache.batch_size, self.R, self.model
        ssm_blocks = (
            [blk for blk in m.core.stack.blocks if blk.layer_idx not in self.kv_flat] if ssm != "freeze" else []
        )
        if R == 1 or (kv == "shared" and not ssm_blocks):
            return
        b, j = self.deeper  # [(R−1)·B]
        dst = j * B + b
        w = leave[b] & (k[b] < j)  # [(R−1)·B]: this row exits before loop j
        self.pairs += w.sum()
        c = col[b]
        w3 = w[:, None, None]
        stand = None  # the rule does not modulate the blocks (else refused): one stand-in per row for every deeper loop
        if kv == "propagate" or ssm_blocks:
            stand = _by_loop(at[: R - 1], [m.rule.next_input(outs[i], ctxs[i + 1]) for i in range(R - 1)])  # [B, 1, d]
        if kv == "copy":
            src = k[b] * B + b
            for base, _, _ in self.kv_flat.values():
                for buf in (base._k, base._v):
                    buf[dst, :, c] = torch.where(w3, buf[src, :, c], buf[dst, :, c])  # [pairs, H_kv, hd]
        elif kv == "propagate":
            for blk in m.core.stack.blocks:
                if blk.layer_idx not in self.kv_flat:
                    continue
                kk, vv = blk.mixer.kv_of(blk.mixer_norm(stand), fctx)  # [B, H_kv, 1, hd]
                base = self.flat[blk.layer_idx][0]
                base._k[dst, :, c] = torch.where(w3, kk[b, :, 0].to(base._k.dtype), base._k[dst, :, c])
                base._v[dst, :, c] = torch.where(w3, vv[b, :, 0].to(base._v.dtype), base._v[dst, :, c])
        for blk in ssm_blocks:
            mix, u = blk.mixer, blk.mixer_norm(stand)  # [B, 1, d]
            zx = mix.in_proj(u[:, 0]) if ssm == "propagate" else None  # [B, d_in_proj], once per row
            mix.absorb(
                u[b], Mamba2Rows(self.flat[blk.layer_idx][0], dst, keep=w), ssm, zxbcdt=None if zx is None else zx[b]
            )

    def _count_static(self, passes: int) -> None:
        """Statistics from the passes: each exit's depth and column; FLOPs of what ran — every row, every
        pass: the core's weights, and attention over each row's keys (``Σ (col + 1)``); prelude, coda, head."""
        st, m, d = self.stats, self.model, self.model.config.d_model
        if passes == 0:
            return
        sel, cols = self.sel.flatten(), self.at_col.flatten()
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
        if self.exit.kv == "propagate":  # one stand-in projection per layer for every row, every pass
            st.fill_flops += rows_run * sum(
                2.0 * (b.mixer.k_proj.weight.numel() + b.mixer.v_proj.weight.numel())
                for b in m.core.stack.blocks
                if b.layer_idx in self.kv_flat
            )
        ssm = self.exit.ssm
        if ssm != "freeze":  # every row's stand-in through in_proj (or its dt rows), every pair's state update
            for b in m.core.stack.blocks:
                if b.layer_idx in self.kv_flat:
                    continue
                mix = b.mixer
                w_rows = mix.in_proj.weight if ssm == "propagate" else mix.in_proj.weight[-mix.nheads :]
                st.fill_flops += rows_run * 2.0 * w_rows.numel()
                st.fill_flops += (
                    passes
                    * (self.R - 1)
                    * self.cache.batch_size
                    * (2.0 * mix.conv_dim * mix.d_conv + 4.0 * mix.nheads * mix.headdim * mix.d_state)
                )
        crit = self.exit.criterion  # the check of every row, every pass
        per_row = {"gate": 2.0 * d, "kl": 2.0 * m.lm_head.weight.numel(), "convergence": 4.0 * d}.get(crit, 0.0)
        st.check_flops += rows_run * per_row


_COMPILED = None


def _compiled_tick():
    """:meth:`StaticDepthDecoder._tick` through ``torch.compile`` (built on first use, shared by every decoder:
    dynamo's guards on the decoder's shapes and attributes pick, or trace, the graph for each). ``dynamic=False``:
    a pass has fixed shapes by construction, so each (model, batch, capacity) gets its own specialised graph. The
    fused CPU decode call (``looplm_cpu::decode_stack``, whose plan argument dynamo cannot trace) splits a pass
    into graphs around it; on CUDA there is no such call. Measured in ``docs/adaptive-depth.md``."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(StaticDepthDecoder._tick, dynamic=False)
    return _COMPILED


def _keep(buf, new):
    """``new`` (a rule state: dicts, lists, tuples of tensors) written into the buffers ``buf`` of the same
    structure, in place (``buf`` ``None``: copies of ``new`` become the buffers). Returns the buffers."""
    if buf is None:
        return _clone(new)
    if isinstance(new, torch.Tensor):
        return buf.copy_(new)  # (a no-op when ``new`` is ``buf``: copy_ of a tensor onto itself returns at once)
    if isinstance(new, dict):
        return {k: _keep(buf[k], v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        return type(new)(_keep(b, v) for b, v in zip(buf, new))
    return new


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


class _DoneFlags:
    """Whether every row is done, read on the host ``lag`` passes late (module docstring): :meth:`post` after
    each step records the flag (on CUDA: copied into a ring of pinned scalars behind events), :meth:`seen_done`
    reads the newest flag at least ``lag`` passes old (``lag = 0``: the latest; on CUDA it waits only for an
    event ``lag`` passes behind the host, which the GPU has passed unless it is that far behind — then the
    host has ``lag`` passes queued and the wait is no bubble)."""

    def __init__(self, lag: int, device):
        self.lag, self.cuda = lag, torch.device(device).type == "cuda"
        self.posted: collections.deque = collections.deque()  # (passes after the step, flag or ring slot)
        self.n = 0
        if self.cuda:  # lag + 2 slots: the lag + 1 flags kept are never overwritten before they are read
            self.pinned = [torch.empty((), dtype=torch.bool, pin_memory=True) for _ in range(lag + 2)]
            self.events = [torch.cuda.Event() for _ in range(lag + 2)]

    def post(self, done: torch.Tensor, passes: int) -> None:
        flag = done.all()
        if self.cuda:
            i = self.n % len(self.pinned)
            self.pinned[i].copy_(flag, non_blocking=True)
            self.events[i].record()
            flag = i
        self.posted.append((passes, flag))
        self.n += 1
        while len(self.posted) > self.lag + 1:
            self.posted.popleft()

    def seen_done(self, passes: int) -> bool:
        old = [f for p, f in self.posted if p <= passes - self.lag]
        if not old:
            return False
        if self.cuda:
            self.events[old[-1]].synchronize()  # lag passes old: done on the GPU long ago
            return bool(self.pinned[old[-1]])
        return bool(old[-1])


def _by_loop(at: list, xs: list) -> torch.Tensor:
    """Row ``b`` of ``xs[j]`` where ``at[j][b]`` (the rows at loop ``j``); ``xs[0]`` where no mask holds."""
    y = xs[0]
    for m, x in zip(at[1:], xs[1:]):
        y = torch.where(m.view(-1, *([1] * (x.dim() - 1))), x, y)
    return y


def _by_loop_modulations(at: list, mods: list, n_blocks: int):
    """Each row's block modulation of its own loop (``mods[j]``: loop ``j``'s for every row, or ``None``):
    every field as ``[B, 1, width]``, row ``b`` from loop ``k_b``; ``None`` when no loop modulates."""
    B = at[0].shape[0]
    return merge_modulations(mods, [B] * len(mods), n_blocks, lambda parts: _by_loop(at, parts))
