"""Per-token exit in one parallel forward: a whole text (a prompt, a scored continuation) at adaptive depth.

:class:`looplm.decode.token_schedule.AdaptiveDecoder` takes the exits one decoded token at a time, and its prompt runs
at full depth. :func:`adaptive_forward` runs a whole ``[B, T]`` text at once with the same exits: after each
loop the criterion decides, for every position still looping, whether its token stops there; the next
loop runs only the positions still looping — loop-major instead of token-major. Its logits are what
decoding the text one token at a time with the same :class:`~looplm.decode.exits.Exit` gives (teacher forcing,
:meth:`AdaptiveDecoder.score`, with no full-depth prompt), up to the order of floating-point sums: a token's
arithmetic depends only on the tokens before it, and at loop ``k`` those are either still looping (their
loop-``k`` keys and values are computed in the same pass, before anyone reads them) or exited (their
skipped loops hold the policy's fill). What lm-eval's loglikelihood tasks need to score a model at adaptive
depth (:mod:`looplm.eval.harness`), and a prompt's per-token exit.

One loop ``k`` over the ``n`` positions still looping (tokens as rows of the rule, ``[n, 1, d]``)::

    z = rule.next_input(state)                          # Z^k  [n, 1, d], one row per (row b, position t)
    Z = pack(z)                                         # [B, T_a, d]: each row's looping positions, in order
    H = core(Z, rope at their positions, mask)          # attention: queries T_a, keys every position of the row
    h = unpack(H); state = rule.step(state, h)          # [n, 1, d]
    leave = criterion(h, state)                         # [n] bool; the leavers' outputs rule.finish(...)
    fill the leavers' keys and values of the loops they skip (kv policy), drop them from the rows

Each core attention layer keeps one key/value buffer ``[B, H_kv, T + 1, hd]`` for all loops, written in
place: at loop ``k`` a looping position writes its loop-``k`` key and value at its column before the pass
attends (every query reads its row's columns up to its own), and an exited position's column keeps what
the policy left there — ``copy``: its exit loop's key and value (it is simply not overwritten);
``propagate``: the stand-in ``Z^{r+1}`` through each layer's norm and K/V projections, written once at the
exit (CALM's propagation, :mod:`looplm.decode.exits`); ``full``: every position keeps running every loop and only
its output is taken at the exit (the exact caches; no compute saved). Column ``T`` is a scratch column the
padding of the pack writes to and no real query reads. ``shared`` is refused: with one slot for every loop a
token reads the earlier tokens at the *last* loop they ran, which exists only once they have finished —
tokens one after another, not loops (use :meth:`AdaptiveDecoder.score`).

A Mamba-2 layer of the core has no slot here: it scans the pack, i.e. the tokens still looping at loop ``k``
in order — an exited token has left that loop's scan, which is ``ssm='freeze'`` (state and conv window
untouched by it). Each row's pack is right-aligned, its padding first and masked as left padding (which
leaves the state as it was), so the scan's final state is the loop's state after the text. Prelude and coda
layers, attention or Mamba-2, run once over the whole text — except where a readout of each loop goes through
the coda, the ``kl`` check's and a rule's own (PonderLM's feedback, ``lctx.readout``), for which decoding keeps
coda slots per loop (families ``exit-check`` and ``readout``): here the coda runs over the same pack at each
loop with buffers of its own per family, filled as the core's (``copy``: an exited token's last readout keys
and values stay; ``propagate``: its exit iterate ``H^k`` through each coda layer's norm and K/V projections, as
decoding's fill; a Mamba-2 coda layer scans the pack).

What runs (refused before any work otherwise, naming the option, by :func:`looplm.decode.exits.forward_support`):
no ``ssm='propagate'`` / ``'decay'`` with Mamba-2 layers in the core (or in a coda a readout goes through per
loop: they feed an exited token's stand-in into the skipped loops' scans), no sliding window there, no
rule with per-loop slots of its own or a rule that replaces the blocks' residual stream, and ``propagate``
only for rules that do not modulate the blocks per loop. Padding tokens (``attention_mask`` 0) leave after the
first loop and are left out of the statistics.

Cost: the core runs ``Σ_k B · T_a(k)`` positions (``T_a(k)``: the most positions any row still loops at
loop ``k``; a row with fewer computes padding), which :attr:`AdaptiveForward.stats` reports beside the
executed depth per token; the criterion's readouts (``kl``: the final norm and the head at every loop of
every looping position) are counted there too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..context import BlockModulation, BranchModulation, ForwardContext, LoopContext, restrict_context
from .exits import Exit, finish_rest, forward_support, keep_staying, make_criterion, stack_flop_terms
from ..layers.attention import Attention, attention

__all__ = ["AdaptiveForward", "DEPTH_MEANS", "PositionKV", "adaptive_forward", "add_depth_stats"]


@dataclass
class AdaptiveForward:
    """What :func:`adaptive_forward` returns."""

    logits: torch.Tensor  # [B, T, V] next-token logits of every position
    depth: torch.Tensor  # [B, T] long: the loop each position's token exited after (1-based)
    executed: torch.Tensor  # [B, T] long: the core passes each position ran (kv='full': every loop)
    stats: dict  # means over the real tokens (padding left out): see adaptive_forward


class PositionKV:
    """A core attention layer's key/value buffer ``[B, H_kv, T + 1, hd]`` for one loop pass over some
    positions of every row: the pass's queries are each row's looping positions packed to ``[B, T_a]``,
    at columns ``cols [B, T_a]`` (``T``: the scratch column of the pack's padding). :meth:`attend` writes
    the new keys and values at those columns, then every query attends to its row's columns under the
    mask (its own and the visible ones before it)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cols: torch.Tensor):
        self.k, self.v, self.cols = k, v, cols

    @property
    def seqlen(self) -> int:  # (no sliding window runs on this slot: forward_support refuses it)
        return self.k.shape[2] - 1

    def attend(self, q, k, v, attn_mask, enable_gqa: bool) -> torch.Tensor:
        """``q [B, H, T_a, hd]``, ``k, v [B, H_kv, T_a, hd]`` at ``cols``; ``attn_mask`` bool
        ``[B, 1, T_a, T + 1]`` -> ``[B, H, T_a, hd]``."""
        B, H, Ta, hd = k.shape
        C = self.k.shape[2]
        # row (b, h, cols[b, j]) of the buffer seen as [B·H·C, hd]: one contiguous hd-vector per (head, query)
        # (2-3x faster than a scatter along dim 2; padding writes the scratch column, several writers, never read)
        at = (
            (torch.arange(B, device=k.device)[:, None, None] * H + torch.arange(H, device=k.device)[None, :, None]) * C
            + self.cols[:, None, :]
        ).reshape(-1)  # [B·H·T_a]
        self.k.view(-1, hd).index_copy_(0, at, k.reshape(-1, hd).to(self.k.dtype))
        self.v.view(-1, self.v.shape[-1]).index_copy_(0, at, v.reshape(-1, v.shape[-1]).to(self.v.dtype))
        return attention(q, self.k, self.v, attn_mask=attn_mask, is_causal=False, enable_gqa=enable_gqa)

    def write(self, b: torch.Tensor, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values ``[n, H_kv, hd]`` of positions ``(b [n], t [n])`` (a fill)."""
        self.k[b, :, t] = k.to(self.k.dtype)
        self.v[b, :, t] = v.to(self.v.dtype)


@torch.no_grad()
def adaptive_forward(
    model,
    input_ids: torch.Tensor,
    exit,
    *,
    attention_mask: torch.Tensor | None = None,
    loop_options: dict | None = None,
    full_depth_prefix: int = 0,
    cache=None,
    logits_to_keep: int | None = None,
) -> AdaptiveForward:
    """Next-token logits of every position of ``input_ids [B, T]`` with per-token exit (module docstring).

    ``exit``: an :class:`~looplm.decode.exits.Exit` (or its string / dict; its ``schedule`` and ``max_batch`` are
    for decoding and not read here). ``attention_mask [B, T]``: 1 = real token (left or right padding).
    ``full_depth_prefix``: the first that many positions run every loop (what :meth:`AdaptiveDecoder.score`'s
    full-depth prompt does). Replay depths: an int, ``[B]`` per row or ``[B, T]`` per position.
    ``cache``: an empty :class:`~looplm.cache.LoopCache` of ``B`` rows and ``max_loops`` loops (a decoder's,
    ``Exit(prefill='exit')``): the text's prelude and coda slots and every loop's core slots are written as
    decoding the text token by token leaves them (an exited token's skipped loops hold the policy's fill; a
    Mamba-2 layer's state of loop ``k`` has absorbed the tokens that ran loop ``k``), then committed.
    ``logits_to_keep``: the head on the last that many positions only (``logits [B, keep, V]``).

    ``stats``: ``tokens`` (real ones), ``selected_depth`` / ``executed_depth`` (means per token),
    ``max_loops``, ``executed_ratio`` (executed / max_loops), ``computed_ratio`` (the positions the core ran,
    padding of the packs included, over ``max_loops`` · B · T), ``core_flops_ratio`` (the core's FLOPs of the
    executed passes over full depth's), ``check_flops_per_token``, ``fill_flops_per_token``."""
    m, rule = model, model.rule
    B, T = input_ids.shape
    e = Exit.parse(exit).for_one_forward().resolved(m, B)  # (a decoder's prefill: resolved at its entry, not again)
    errs = forward_support(m, e)
    if isinstance(full_depth_prefix, bool) or not isinstance(full_depth_prefix, int) or not 0 <= full_depth_prefix <= T:
        errs.append(
            f"full_depth_prefix must be an int in [0, {T}] (positions run at every loop), got {full_depth_prefix!r}"
        )
    d = e.depths
    if isinstance(d, torch.Tensor) and d.dim() == 2 and d.shape[1] < T:
        errs.append(f"exit depths give {d.shape[1]} positions per row; the text has {T}")
    if cache is not None and (
        cache.seqlen != 0 or cache.num_loops != e.max_loops or cache.batch_size != B or cache.kv_shared
    ):
        errs.append(
            f"cache: an empty cache of {B} rows and {e.max_loops} loops with a slot per loop is written here; got "
            f"{cache.batch_size} rows, {cache.num_loops} loops, {cache.seqlen} tokens"
            f"{', kv_shared' if cache.kv_shared else ''}"
        )
    if errs:
        raise ValueError("exit: " + "; ".join(errs))
    m.check_inputs(input_ids, cache, attention_mask)
    opts = dict(loop_options or {})
    if e.criterion == "gate":  # the rule's own output selection agrees with the criterion's q (as AdaptiveDecoder)
        q = opts.get("exit_threshold")
        if q is not None and float(q) != e.threshold:
            raise ValueError(
                f"exit='gate:{e.threshold}' and loop_options exit_threshold={q} disagree: give one of them (or the same q)"
            )
        opts["exit_threshold"] = e.threshold
    if opts:
        rule.check_loop_options(opts)
    R, full, dev = e.max_loops, e.kv == "full", input_ids.device
    p = next(m.parameters())

    fctx = m.forward_context(input_ids, attention_mask, None, 0)  # rope [B, T, rot], the mask of the plain forward
    E = m.embed_tokens(input_ids)  # [B, T, d]
    x = m.prelude(
        E, fctx, m.cache_slots(cache, m.prelude, (0,), B)
    )  # [B, T, d]: once over the text (no exit before the core)
    dm = x.shape[-1]
    N = B * T
    tok_b = torch.arange(B, device=dev).repeat_interleave(T)  # [N] the row of token i (row-major: i = b·T + t)
    tok_t = torch.arange(T, device=dev).repeat(B)  # [N] its position
    vis = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
    real = vis.reshape(N)
    forced = (tok_t < full_depth_prefix) & real  # never exit
    flat = lambda t: t.reshape(N, 1, *t.shape[2:])  # noqa: E731  [B, T, ...] -> [N, 1, ...]: tokens as rows
    lctx = LoopContext(
        num_loops=R,
        train_loops=m.config.n_loops,
        fctx=ForwardContext(
            rope={r: (flat(c), flat(s)) for r, (c, s) in fctx.rope.items()},
            positions=flat(fctx.positions),
            is_causal=False,
        ),
        loop_options=opts,
        embeddings=flat(E),
        embed_weight=m.embed.weight,
        embed_multiplier=m.embed_multiplier,
        readout_fn=m.readout,
        final_norm=m.norm,
    )

    # one key/value buffer per core attention layer for every loop; column T: the packs' scratch column
    bufs = _kv_buffers(m.core.stack.blocks, B, T, p.dtype, dev)
    # with coda layers, a readout of an iterate (the kl check's, a rule's own: PonderLM's feedback) runs the coda
    # over the loop's pack with buffers of its own per family, as decoding keeps coda slots per loop and family
    codas = {f: _CodaReadout(m, f, B, T, p.dtype, dev) for f in ("exit-check", "readout")} if len(m.coda.blocks) else {}
    keys = torch.arange(T + 1, device=dev)
    ssm_layers = any(kb is None for kb, _ in bufs) or any(not isinstance(b.mixer, Attention) for b in m.coda.blocks)
    vis_ext = torch.cat([vis, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)[:, None, None, :]  # [B, 1, 1, T + 1]
    (cw, ca) = stack_flop_terms(m.core.stack)
    ctx_keys = (vis.long().cumsum(-1)).reshape(N).double()  # keys a token's attention reads (its visible prefix)

    crit = make_criterion(e)
    crit.begin(tok_t)  # replay: depths[b, t] (rows passed as each token's row b)
    state = rule.begin(flat(x), lctx)
    rows = torch.arange(N, device=dev)  # flat ids of the tokens still looping (increasing: each row's in order)
    sub = lctx
    y = x.new_zeros(N, 1, dm)
    depth = torch.full((N,), R, dtype=torch.long, device=dev)
    exited = torch.zeros(N, dtype=torch.bool, device=dev) if full else None
    computed, fill_flops = 0, 0.0
    core_flops = 0.0
    last = -1  # the last loop that ran
    for k in range(R):
        last = k
        sub.iteration = k
        n = rows.shape[0]
        b_of, t_of = tok_b.index_select(0, rows), tok_t.index_select(0, rows)
        counts = torch.bincount(b_of, minlength=B)  # [B] looping positions per row
        Ta = int(counts.max())  # (the pack's width: one host read per loop)
        # each row's looping tokens in order, right-aligned in the pack (its padding first: a Mamba-2 layer's
        # left padding, which leaves its state and conv window as they were)
        j_of = (
            torch.arange(n, device=dev)
            - (counts.cumsum(0) - counts).index_select(0, b_of)
            + (Ta - counts).index_select(0, b_of)
        )
        cols = torch.full((B, Ta), T, dtype=torch.long, device=dev)  # [B, T_a]: each query's column (T: padding)
        cols[b_of, j_of] = t_of
        at = cols.clamp(max=T - 1)
        rope = {
            r: (
                c.gather(1, at[..., None].expand(-1, -1, c.shape[-1])),
                s.gather(1, at[..., None].expand(-1, -1, s.shape[-1])),
            )
            for r, (c, s) in fctx.rope.items()
        }  # [B, T_a, rot]: the queries' own positions
        q_col = cols[:, None, :, None]  # [B, 1, T_a, 1]
        mask = ((keys <= q_col) & vis_ext) | (keys == q_col)  # [B, 1, T_a, T + 1]: visible columns up to its own
        fk = ForwardContext(rope=rope, positions=fctx.positions.gather(1, at), attn_mask=mask, is_causal=False)
        if ssm_layers and (attention_mask is not None or B * Ta > n):  # the pack's real tokens (a Mamba-2 layer
            fk.pad_mask = (cols < T) & vis.gather(1, at)  # zeroes its left padding: the state passes it unchanged)
        if codas:  # the loop's readouts (the check's, the rule's own) over this pack
            sub.check_readout = codas["exit-check"].reader(fk, b_of, j_of, Ta, cols, cache, k)
            sub.readout_fn = codas["readout"].reader(fk, b_of, j_of, Ta, cols, cache, k)
        z = rule.next_input(state, sub)  # Z^k [n, 1, d]
        sub.core_input = z
        mods = rule.block_modulation(state, sub)
        zp = z.new_zeros(B, Ta, dm)
        zp[b_of, j_of] = z[:, 0]  # [B, T_a, d]
        # a Mamba-2 layer: no slot (it scans the pack), or the cache's state of loop k (the pack's scan fills it)
        kept = _loop_slots(m, cache, k, B)
        slots = [kept[i] if kb is None else PositionKV(kb, vb, cols) for i, (kb, vb) in enumerate(bufs)]
        H = m.core(zp, fk, slots, _pack_modulations(mods, n, b_of, j_of, B, Ta))  # [B, T_a, d]
        if cache is not None:
            _keep_loop(kept, bufs, T)
        h = H[b_of, j_of][:, None]  # [n, 1, d]
        state = rule.step(state, h, sub)
        if "readout" in codas:  # (a rule's own readout of this loop, e.g. PonderLM's: its slots, before any fill)
            codas["readout"].keep_loop(k)
        computed += B * Ta
        core_flops += float((cw + ca * ctx_keys.index_select(0, rows)).masked_select(real.index_select(0, rows)).sum())
        if k == R - 1:
            break
        leave = crit.check(k, h, state, sub, b_of, m)  # [n] bool
        if "exit-check" in codas:  # (the kl check's readout of this loop: its slots, before the exits' fills)
            codas["exit-check"].keep_loop(k)
        if k + 1 < e.min_loops:
            leave = torch.zeros_like(leave)
        leave = (leave & ~forced.index_select(0, rows)) | ~real.index_select(0, rows)  # padding: out after one loop
        if full:
            leave = leave & ~exited.index_select(0, rows)
        if not bool(leave.any()):
            continue
        out = leave.nonzero()[:, 0]  # local ids of the tokens leaving now
        g = rows.index_select(0, out)
        st_out = rule.take_rows(state, out, n)
        ctx_out = restrict_context(lctx, g)
        ctx_out.iteration = k
        st_out = rule.exit_rows(st_out, torch.ones(out.shape[0], 1, dtype=torch.bool, device=dev), ctx_out)
        y.index_copy_(0, g, rule.finish(st_out, ctx_out))
        depth[g] = k + 1
        if full:  # exact caches: the token keeps looping, only its output was taken here
            exited[g] = True
            continue
        if e.kv == "propagate":  # the stand-in Z^{k+1} through each core layer's norm and K/V projections, once
            zs = rule.next_input(st_out, replace(ctx_out, iteration=k + 1))  # [e, 1, d]
            gb, gt = b_of.index_select(0, out), t_of.index_select(0, out)
            per_token = _propagate(m.core.stack.blocks, bufs, zs, ctx_out.fctx, gb, gt)
            for cr in codas.values():  # the readouts' coda layers: the exit iterate H^k (as decoding's fill)
                per_token += _propagate(m.coda.blocks, cr.bufs or [], h.index_select(0, out), ctx_out.fctx, gb, gt)
            fill_flops += float(real.index_select(0, g).sum()) * per_token
        state, rows, sub = keep_staying(rule, crit, lctx, state, rows, leave)
        if rows.numel() == 0:
            break
    if rows.numel():
        finish_rest(rule, y, state, sub, rows, exited)  # [n, 1, d] outputs of the tokens that ran every loop
    if cache is not None:  # the loops nobody reached: the fills as they stand, the states untouched
        for kk in range(last + 1, R):
            _keep_loop(_loop_slots(m, cache, kk, B), bufs, T, ran=False)
        for cr in codas.values():  # the loops a readout reached, then those after the last that ran (as they stand)
            cr.keep(cache, last, R)
    Y = y.reshape(B, T, dm)
    Y = m.coda(
        Y, fctx, m.cache_slots(cache, m.coda, (0,), B)
    )  # once over the text: a token's coda reads the earlier tokens' outputs
    if cache is not None:
        cache.commit(T)
    Y = Y if logits_to_keep is None else Y[:, -logits_to_keep:]
    logits = m.lm_head(m.norm(Y))  # [B, T or keep, V]
    executed = torch.full_like(depth, R) if full else depth
    sel, ex = depth.masked_select(real).double(), executed.masked_select(real).double()
    n_real = max(1, int(real.sum()))
    full_flops = R * float((cw + ca * ctx_keys).masked_select(real).sum())
    stats = {
        "tokens": int(real.sum()),
        "selected_depth": float(sel.mean()) if sel.numel() else float("nan"),
        "executed_depth": float(ex.mean()) if ex.numel() else float("nan"),
        "max_loops": R,
        "executed_ratio": float(ex.mean()) / R if ex.numel() else float("nan"),
        "computed_ratio": computed / (R * N),
        "core_flops_ratio": core_flops / full_flops if full_flops else float("nan"),
        "check_flops_per_token": crit.flops / n_real,
        "fill_flops_per_token": fill_flops / n_real,
    }
    return AdaptiveForward(logits, depth.reshape(B, T), executed.reshape(B, T), stats)


DEPTH_MEANS = ("selected_depth", "executed_depth", "executed_ratio", "computed_ratio", "core_flops_ratio")


def add_depth_stats(acc: dict, st: dict) -> dict:
    """``st`` (one call's :attr:`AdaptiveForward.stats`) added into ``acc`` (empty at first): ``tokens``,
    ``max_loops`` and the token-weighted means of :data:`DEPTH_MEANS` over every call so far (an evaluation's
    batches). Returns ``acc``."""
    n = st["tokens"]
    if not acc:
        acc.update(tokens=0, max_loops=st["max_loops"], **dict.fromkeys(DEPTH_MEANS, 0.0))
    tot = acc["tokens"] + n
    for k in DEPTH_MEANS:
        acc[k] = (acc[k] * acc["tokens"] + st[k] * n) / tot if tot else 0.0
    acc["tokens"] = tot
    return acc


def _kv_buffers(blocks, B: int, T: int, dtype, dev) -> list:
    """``(k, v)`` zero buffers ``[B, H_kv, T + 1, hd]`` per attention block (column ``T``: the packs' scratch
    column); ``(None, None)`` for a Mamba-2 block (no slot: it scans the pack, the looping tokens in order)."""
    out = []
    for blk in blocks:
        a = blk.mixer
        if not isinstance(a, Attention):
            out.append((None, None))
            continue
        shape = (B, a.n_kv_heads, T + 1, a.head_dim)
        out.append((torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)))
    return out


class _CodaReadout:
    """The readouts of one family (``exit-check``: the kl check's; ``readout``: a rule's own, ``lctx.readout``)
    through the coda, loop by loop over each loop's pack: key/value buffers ``[B, H_kv, T + 1, hd]`` per coda
    attention layer (made at the first readout; a Mamba-2 coda layer scans the pack), filled as the core's —
    ``copy``: an exited token's last readout stays; ``propagate``: :func:`_propagate` writes its exit iterate's —
    and, for a decoder's cache, written into the family's slot of each loop a readout ran (:meth:`keep`)."""

    def __init__(self, m, family: str, B: int, T: int, dtype, dev):
        self.m, self.family, self.B, self.T, self.dtype, self.dev = m, family, B, T, dtype, dev
        self.bufs: list | None = None  # made at the first readout
        self.read_at: dict = {}  # loop -> the cache's slots it wrote through (to keep once the loop is over)

    def reader(self, fk, b_of, j_of, Ta: int, cols, cache, k: int):
        """``(h [n, 1, d], lctx) -> logits [n, 1, V]`` for loop ``k``'s pack: the coda, the final norm, the head."""
        m = self.m

        def read(h, lctx):
            if self.bufs is None:
                self.bufs = _kv_buffers(m.coda.blocks, self.B, self.T, self.dtype, self.dev)
            kept = _loop_slots(m, cache, k, self.B, m.coda, self.family)
            self.read_at[k] = kept
            slots = [kept[i] if kb is None else PositionKV(kb, vb, cols) for i, (kb, vb) in enumerate(self.bufs)]
            hp = h.new_zeros(self.B, Ta, h.shape[-1])
            hp[b_of, j_of] = h[:, 0]  # [B, T_a, d]
            y = m.coda(hp, fk, slots)[b_of, j_of]  # [n, d]
            return m.lm_head(m.norm(y))[:, None]  # [n, 1, V]

        return read

    def keep_loop(self, k: int) -> None:
        """After loop ``k``'s readout (before the exits' fills): the buffers into a decoder's slots of this family
        and loop, if a readout ran (a Mamba-2 coda slot was written by the pack's scan itself)."""
        kept = self.read_at.pop(k, None)
        if kept is not None and kept[0] is not None:
            _keep_loop(kept, self.bufs, self.T)

    def keep(self, cache, last: int, R: int) -> None:
        """Into a decoder's cache, the loops after ``last`` (the last that ran) a readout reads (0 .. R − 2): the
        buffers as they stand (every token had exited: the fills), Mamba-2 states untouched."""
        if self.bufs is None:
            return
        for kk in range(last + 1, R - 1):
            _keep_loop(_loop_slots(self.m, cache, kk, self.B, self.m.coda, self.family), self.bufs, self.T, ran=False)


def _propagate(blocks, bufs: list, z: torch.Tensor, fctx, b: torch.Tensor, t: torch.Tensor) -> float:
    """``kv='propagate'``: the stand-ins ``z [e, 1, d]`` of exited tokens at positions ``(b [e], t [e])`` through
    each attention block's norm and K/V projections into its buffer (``bufs``, one per block; once: the loops they
    skip read it). Returns the FLOPs per token."""
    flops = 0.0
    for blk, (kb, vb) in zip(blocks, bufs):
        if kb is None:
            continue
        kk, vv = blk.mixer.kv_of(blk.mixer_norm(z), fctx)  # [e, H_kv, 1, hd]
        PositionKV(kb, vb, None).write(b, t, kk[:, :, 0], vv[:, :, 0])
        flops += 2.0 * (blk.mixer.k_proj.weight.numel() + blk.mixer.v_proj.weight.numel())
    return flops


def _loop_slots(m, cache, k: int, B: int, stack=None, family: str = "core") -> list:
    """The cache's slots of loop ``k`` (the core's, or ``family``'s of ``stack``: the check's coda); ``None`` per
    block without a cache."""
    stack = m.core.stack if stack is None else stack
    if cache is None:
        return [None] * len(stack.blocks)
    return m.cache_slots(cache, stack, (k,) if family == "core" else (family, k), B, loop=k, family=family)


def _keep_loop(slots: list, bufs: list, T: int, ran: bool = True) -> None:
    """After loop ``k`` (or for a loop no token reached, ``ran=False``): each attention layer's buffer — every
    position's key and value as loop ``k`` left it, fills included — into the loop's slot; a Mamba-2 state
    counts the text's ``T`` tokens (a loop no token reached leaves it empty: all zeros)."""
    for slot, (kb, vb) in zip(slots, bufs):
        if kb is not None:
            k, v = kb[:, :, :T], vb[:, :, :T]  # [B, H_kv, T, hd] (a growing slot keeps what it is given: a copy)
            slot.update(k, v) if slot.capacity else slot.update(k.clone(), v.clone())
        else:
            slot.seqlen_offset = T


def _pack_modulations(mods, n: int, b_of, j_of, B: int, Ta: int):
    """The rule's block modulation of ``n`` token rows (fields ``[n, 1, ...]`` per token, or broadcasting) as
    the pack's ``[B, T_a, ...]`` (padding: zeros)."""
    if mods is None:
        return None

    def pack(t):
        if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.shape[0] != n or t.shape[0] == 1 == B * Ta:
            return t
        out = t.new_zeros(B, Ta, *t.shape[2:])
        out[b_of, j_of] = t[:, 0]
        return out

    def branch(bm):
        return (
            None
            if bm is None
            else BranchModulation(
                scale=pack(bm.scale), shift=pack(bm.shift), gate=pack(bm.gate), read=bm.read, write=bm.write
            )
        )

    return [None if mo is None else BlockModulation(mixer=branch(mo.mixer), mlp=branch(mo.mlp)) for mo in mods]
