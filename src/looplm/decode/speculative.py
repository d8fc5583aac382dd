"""Lossless self-speculative decoding for looped models: draft with ``r_d`` loops, verify with all ``K``.

A looped model is its own draft model: the first ``r_d < K`` loops of a token are exactly the first
``r_d`` loops of its full-depth computation (with per-loop caches, loop ``k`` of a token reads only loop
``k`` of earlier tokens). One round, per batch row::

    draft   t_0 → d_1 → … → d_k → (·)        k + 1 one-token steps through loops 1..r_d (no fill; d_k's without
                                              the coda and head: only verification reads its state)
    verify  [t_0, d_1, …, d_k]                one forward over the k + 1 tokens that resumes at loop r_d + 1
                                              from the drafted states: p_0 … p_k at full depth
    accept  greedy: d_i while argmax p_{i−1} = d_i;  sampling: d_i with probability min(1, p_{i−1}(d_i) / q_{i−1}(d_i))
    emit    the accepted d_1..d_a, then argmax p_a (greedy) / a sample of norm(max(p_a − q_a, 0)), or of p_k
            when all k were accepted

So greedy output equals full-depth greedy decoding token for token, and sampled output has full
depth's distribution (Leviathan et al. 2023, Chen et al. 2023: the accept / resample rule). Rows accept
different numbers of tokens: every row writes ``k + 1`` cache columns per round and the rejected ones
become holes, masked like left padding (positions count real tokens only, so a row continues exactly as
if they had never been written); a Mamba-2 state cannot hold a hole, so every Mamba-2 slot keeps a
snapshot after each token of the round and each row returns to the snapshot of its own accepted length
(:meth:`looplm.layers.mamba2.Mamba2State.rollback`). The coda ran on draft states during the draft, so
its slots are rolled back to the round's start before verification (KV: crop; Mamba-2: snapshot 0).

**Reclaiming the holes** (``reclaim=True``, the default): after each round the columns past the longest
accepted run are holes in every row and are cropped (at batch 1 no hole is ever kept); when compacting
would free a quarter of the columns (and at least ``k + 1``), or the next round would not fit, the cache is
compacted: each row's kept columns move, in order, to the right end of ``n = max_b`` (row ``b``'s kept
columns), its holes to the left
(:meth:`looplm.cache.LoopCache.keep_columns`: one row selection per KV slot; a Mamba-2 state has no columns).
A row that has emitted its ``max_new_tokens`` (or ``eos``) keeps running with the batch but commits nothing
more (its round's columns become holes, its Mamba-2 states return to the round's start). So the cache holds
``T + max_new_tokens + 2(k + 1)`` columns rather than ``T + (max_new_tokens + 1)(k + 1)`` — at k = 4 the
KV memory of plain decoding plus 10 columns instead of five times it — and attention reads a row's own
tokens plus at most a quarter in holes. ``reclaim=False`` keeps every column to the end (the cache a
caller inspects through ``SpeculativeStats.decoder`` then has every round's columns in place).

**A draft with an exit criterion** (``exit=``: ``kl``, ``convergence`` or ``gate``; ``draft_loops`` is then the
most loops a draft token runs): each draft token stops at its own exit (:meth:`AdaptiveDecoder.draft_exit`:
the batch's rows still looping run on, the skipped loops below ``r_d`` filled by the exit's ``kv`` / ``ssm``
policy so that a later draft token reads an entry at every loop it runs), and verification resumes at
``s = min`` over the round's tokens and rows of the draft depth: loops ``< s`` ran for every token of the
round, each reading only loop-``< s`` entries of earlier tokens, all computed, so they are exactly full
depth's; the core's slots of loops ``>= s`` go back to the round's start (KV: crop; Mamba-2: snapshot 0) and
verification recomputes them for every token. So the output is lossless as with a fixed ``r_d``; what an
exit buys is fewer draft loops on easy tokens, paid for by verification resuming at the shallowest one.

Where exactness needs care: the draft stops at loop ``r_d`` of a forward planned for ``K`` loops (the rule
sees ``num_loops = K``), so rules whose early loops depend on the total (a timestep grid) draft the same
states verification resumes. The ``shared`` KV policy breaks it (a loop's entry is overwritten by later
loops) and is refused. Verification computes loops ``> r_d`` for ``k + 1`` tokens in one batched forward
while plain decoding computes them one token at a time: the same values up to the order of float
additions, so greedy output can differ only where two logits tie to rounding.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace

import torch

__all__ = ["Speculative", "SpeculativeStats", "speculative_generate"]

DEFAULT_DRAFT_K = 4  # tokens drafted per round unless told (Speculative.k)


@dataclass(frozen=True)
class Speculative:
    """``draft_loops`` (``r_d``, ``1 <= r_d < K``) and ``k`` drafted tokens per round; ``exit``: a draft
        whose depth an exit criterion picks per token and row (``'kl:0.01'``, ``'convergence:0.3'``, ``'gate:0.5'``,
        an :class:`~looplm.decode.exits.Exit` or its dict, with its ``kv`` / ``ssm`` fill policies and ``min_loops``), at
        most ``draft_loops`` loops (module docstring, "A draft with an exit criterion"); ``reclaim``: crop and compact
    the rejected drafts' cache columns (module docstring, "Reclaiming the holes")."""

    draft_loops: int
    k: int = DEFAULT_DRAFT_K
    exit: object = None
    reclaim: bool = True  # give rejected drafts' cache columns back (module docstring, "Reclaiming the holes")
    # the model (a weak reference) it was checked for: resolved once, at the entry (as Exit.resolved)
    _checked: object = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def parse(cls, spec) -> "Speculative":
        if isinstance(spec, Speculative):
            return spec
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {"draft_loops", "k", "exit", "reclaim"})
            if unknown:
                raise ValueError(
                    f"speculative: unknown option(s) {unknown}; options are ['draft_loops', 'exit', 'k', 'reclaim']"
                )
            if "draft_loops" not in spec:
                raise ValueError("speculative: give draft_loops (the draft's loop count r_d < K)")
            return cls(**spec)
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls(draft_loops=spec)
        raise TypeError(f"speculative must be a Speculative, a dict or an int (draft loops), got {type(spec).__name__}")

    def resolved(self, model) -> "Speculative":
        """Checked against ``model``; a ``ValueError`` naming the option otherwise (before any work). Once: a
        spec already resolved for ``model`` (by a front end, then handed to ``generate``) is returned as it is."""
        if self._checked is not None and self._checked() is model:
            return self
        sp = self._check(model)
        object.__setattr__(sp, "_checked", weakref.ref(model))
        return sp

    def _check(self, model) -> "Speculative":
        K = model.config.n_loops
        errs = []
        r = self.draft_loops
        if K < 2:  # no draft depth below K exists
            errs.append(
                f"self-speculative decoding needs a model with K >= 2 loops (a draft of fewer loops than K verified "
                f"with all K); this model has K = {K}: decode without speculative (looplm: leave out --speculative)"
            )
        elif isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < K:
            errs.append(
                f"speculative draft_loops must be an int in [1, {K - 1}] (fewer than the model's K = {K} loops), got {r!r}"
            )
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            errs.append(
                f"speculative k (tokens drafted per round) must be an int >= 1 (looplm: --draft-k), got {self.k!r}"
            )
        if not isinstance(self.reclaim, bool):
            errs.append(f"speculative reclaim must be True or False, got {self.reclaim!r}")
        if getattr(model, "n_pause", 0):
            errs.append(
                "speculative decoding does not run pause-token models (PauseLM inserts pause positions in its own forward)"
            )
        if any(getattr(mod, "sliding_window", None) for mod in model.modules()):
            errs.append(
                "speculative decoding does not run sliding-window attention (the masked columns of rejected drafts "
                "would count in the window)"
            )
        e = None
        if self.exit is not None and not errs:
            e, why = self._draft_exit(model, r)
            errs += why
        if errs:
            raise ValueError("; ".join(errs))
        return self if e is None else replace(self, exit=e)

    def check_room(self, model, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a draft longer than the model has room for, before any work. A round drafts ``k`` tokens past
        a row's committed ones, so the last round's drafts reach position ``prompt + max_new_tokens - 1 + k``:
        ``k`` may be at most the room ``max_seq_len - prompt - max_new_tokens`` (where less is left, the default
        4: drafts past the end are never emitted). A longer draft computes tokens only to throw them away, in
        cache columns past ``max_seq_len`` (and a huge ``k`` would run until killed)."""
        room = model.config.max_seq_len - prompt_len - max_new_tokens
        most = max(room, DEFAULT_DRAFT_K)
        if self.k > most:
            raise ValueError(
                f"speculative k (tokens drafted per round, looplm: --draft-k) = {self.k} is more than the {most} this call "
                f"has room for (max_seq_len {model.config.max_seq_len} - prompt {prompt_len} - max_new_tokens {max_new_tokens}"
                f"{'' if room >= DEFAULT_DRAFT_K else f', or the default {DEFAULT_DRAFT_K}'}): draft at most {most} tokens per round"
            )

    def _draft_exit(self, model, cap: int):
        """The draft's :class:`~looplm.decode.exits.Exit`, resolved for ``model`` (``max_loops`` = K: the cache holds
        every loop), and the reasons it cannot draft."""
        from .exits import Exit

        try:
            e = Exit.parse(self.exit)
        except (TypeError, ValueError) as err:
            return None, [f"speculative exit: {err}"]
        why = []
        if e.criterion == "replay":
            why.append(
                "speculative exit: a replayed depth drafts every token at one depth: give it as draft_loops instead"
            )
        if e.kv == "shared":
            why.append(
                "speculative exit: kv policy 'shared' overwrites a loop's entry with later loops' (what verification "
                "resumes from): use 'copy', 'propagate' or 'full'"
            )
        if e.schedule != "token" or e.max_batch is not None:
            why.append(
                f"speculative exit: the draft runs under the token schedule; schedule={e.schedule!r} / max_batch are "
                "options of exit= decoding"
            )
        if e.max_loops not in (None, model.config.n_loops):  # (K: the resolved exit's, the cache's every loop)
            why.append(
                f"speculative exit: the draft's most loops are draft_loops={cap}; leave the exit's max_loops "
                f"(got {e.max_loops!r}) unset"
            )
        if isinstance(e.min_loops, int) and e.min_loops > cap:
            why.append(f"speculative exit: min_loops={e.min_loops} exceeds draft_loops={cap}")
        if why:
            return None, why
        try:
            e = e.resolved(model)
        except ValueError as err:
            return None, [f"speculative {err}"]
        return e, []


@dataclass
class SpeculativeStats:
    """Per round: accepted drafts per row ``[B]``; the draft's and verification's loop counts."""

    draft_loops: int
    k: int
    max_loops: int
    accepted: list = field(default_factory=list)  # [B] long per round
    live: list = field(default_factory=list)  # [B] bool per round: the row commits its tokens (not yet done)
    # per round: the loop passes each row ran ([B]: its drafts' core passes + verification's), and under a draft
    # exit the draft depth of each token ([B, k + 1]) and the loop verification resumed at
    passes: list = field(default_factory=list)
    depths: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    exit: str | None = None  # the draft's exit criterion, 'kl:0.01' (None: every draft token runs draft_loops)
    # wall seconds in the drafts and in the verifications (CPU only: on CUDA the host clock would time the
    # kernel launches, not the kernels; None there)
    draft_s: float | None = 0.0
    verify_s: float | None = 0.0
    capacity: int = 0  # cache columns allocated per row
    peak_columns: int = 0  # the most columns in use at a round's end (before a compaction)
    compactions: int = 0  # cache compactions (reclaim): each a row selection of every KV slot
    decoder: object = None  # the AdaptiveDecoder (its cache), the column mask and every emitted token, for inspection
    mask: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # [B, T + emitted]: a row's last round may run past max_new_tokens
    emitted: torch.Tensor | None = None  # [B]

    def summary(self) -> dict:
        if not self.accepted:
            return {"rounds": 0}
        acc = torch.stack(self.accepted).float()  # [rounds, B]
        live = torch.stack(self.live)  # [rounds, B]: a row's rounds once it is done commit nothing
        mean_acc = float(acc[live].mean())
        out = {
            "rounds": acc.shape[0],
            "accepted_per_round": mean_acc,
            "tokens_per_round": mean_acc + 1.0,
            "acceptance": mean_acc / self.k,  # share of drafted tokens accepted
            "draft_loops": self.draft_loops,
            "k": self.k,
            # loop passes per committed token: the k + 1 drafts' (r_d loops each without an exit) + verification's
            # k + 1 tokens from the loop it resumes at (r_d + 1 without an exit) to K (done rows' passes count too)
            "loops_per_token": float(torch.stack(self.passes).float().sum() / (acc + 1)[live].sum()),
            "cache_columns": self.capacity,
            "peak_columns": self.peak_columns,
            "compactions": self.compactions,
            "draft_ms_per_round": None if self.draft_s is None else 1000 * self.draft_s / acc.shape[0],
            "verify_ms_per_round": None if self.verify_s is None else 1000 * self.verify_s / acc.shape[0],
        }
        if self.exit is not None:
            out["draft_exit"] = self.exit
            out["mean_draft_depth"] = float(torch.stack(self.depths).float().mean())
            out["mean_verify_start"] = (
                sum(self.starts) / len(self.starts) + 1.0
            )  # the first loop verification runs (1-based)
        return out


def _rollback_mamba(cache, keep: torch.Tensor) -> None:
    for s in cache.physical_slots():
        if getattr(s, "snapshots", None) is not None:
            if len(s.snapshots) == 1:  # absorbed nothing this round (a readout loop a capped draft never checks)
                s.snapshots = None
            else:
                s.rollback(keep)


def _to_round_start(slot, past: int) -> None:
    """One cache slot back to the round's start: a Mamba-2 state to its snapshot 0, a KV slot to ``past``
    columns (no-ops where the round wrote nothing)."""
    if hasattr(slot, "restart_recording"):
        if slot.snapshots is not None and len(slot.snapshots) > 1:
            slot.restart_recording()
    elif slot.seqlen > past:
        slot.crop(past)


def _restart_core(cache, start: int, past: int) -> None:
    """The core's slots of loops ``>= start`` back to the round's start (``past`` columns): verification
    writes them for every token of the round (a draft with an exit ran or filled some of them)."""
    for family, by_loop in cache.loop_slots.items():
        if family[0] == "core":
            for k, slot in by_loop.items():
                if k >= start:
                    _to_round_start(slot, past)


def _drop_stale(cache) -> None:
    """Slots shorter than the cache stopped absorbing tokens after the prompt (a kl check's readout loops at
    or past a capped draft's last check, filled by the prompt at full depth): no later token reads them, so
    they are dropped rather than compacted."""
    stale = [key for key, s in cache.slots.items() if s.seqlen < cache.seqlen]
    for key in stale:
        s = cache.slots.pop(key)
        for by_loop in cache.loop_slots.values():
            for k in [k for k, v in by_loop.items() if v is s]:
                del by_loop[k]


def _compaction(mask: torch.Tensor, L: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's unmasked columns of ``mask[:, :L]``, in order, at the right end of ``n`` columns (``n`` = the
    longest row's): the kept column indices ``[B, n]`` and the new mask ``[B, n]`` (the holes moved left)."""
    order = torch.sort(mask[:, :L], dim=1, stable=True).indices  # [B, L]: each row's holes, then its tokens, in order
    idx = order[:, L - n :]
    return idx, mask[:, :L].gather(1, idx)


@torch.no_grad()
def speculative_generate(model, input_ids, max_new_tokens, spec, **kwargs):
    """:func:`looplm.decode.generate.generate` with ``speculative=spec`` (see the module docstring); keyword
    arguments as :func:`_speculative_generate`'s. The model runs in eval mode, its own mode restored after."""
    from .sampling import eval_mode

    with eval_mode(model):
        return _speculative_generate(model, input_ids, max_new_tokens, spec, **kwargs)


def _speculative_generate(
    model,
    input_ids,
    max_new_tokens,
    spec,
    *,
    do_sample=False,
    temperature=1.0,
    top_k=None,
    top_p=None,
    eos_token_id=None,
    pad_token_id=None,
    attention_mask=None,
    generator=None,
    loop_options=None,
    return_stats=False,
):
    from .token_schedule import AdaptiveDecoder
    from .exits import Exit
    from .sampling import decode_context, sample_next, sampling_probs, small_row_products

    sp = Speculative.parse(spec).resolved(model)
    K, r_d, k = model.config.n_loops, sp.draft_loops, sp.k
    B, T = input_ids.shape
    sp.check_room(model, T, max_new_tokens)
    dev = input_ids.device
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    greedy = not do_sample or temperature == 0
    # each round writes k + 1 columns and emits at least one token; reclaiming, a row holds at most
    # T + max_new_tokens + k - 1 tokens, compacted when the next round would not fit
    cols = T + (max_new_tokens + 1) * (k + 1)
    if sp.reclaim:
        cols = min(cols, T + max_new_tokens + 2 * (k + 1))
    # a draft exit: its criterion and fill policies (the prompt fills a kl check's readout slots at full depth)
    de = sp.exit if sp.exit is not None else Exit(criterion="replay", depths=K, kv="full")
    dec = AdaptiveDecoder(model, B, cols, de, loop_options, rule_selects_at_exit=False)
    cache = dec.cache
    mask = torch.zeros(B, cols, dtype=torch.long, device=dev)
    mask[:, :T] = 1 if attention_mask is None else attention_mask.long()
    # every token a row commits (a row that reached max_new_tokens or eos commits nothing more)
    out = torch.full((B, T + max_new_tokens + k), pad_token_id, dtype=input_ids.dtype, device=dev)
    out[:, :T] = input_ids
    n_out = torch.zeros(B, dtype=torch.long, device=dev)  # tokens emitted per row
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    stats = SpeculativeStats(r_d, k, K, capacity=cols)
    if sp.exit is not None:
        stats.exit = f"{sp.exit.criterion}:{sp.exit.threshold:g}"
    timed = dev.type == "cpu"
    if not timed:
        stats.draft_s = stats.verify_s = None
    clock = time.perf_counter
    rows = torch.arange(B, device=dev)

    def emit(tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append ``tokens [B, m]``'s first ``counts[b]`` to row b (eos: the row pads from there on)."""
        nonlocal finished
        for j in range(tokens.shape[1]):
            live = counts > j
            tok = torch.where(finished, torch.full_like(tokens[:, j], pad_token_id), tokens[:, j])
            pos = (T + n_out).clamp(max=out.shape[1] - 1)  # (a row not emitting writes its own value back)
            out[rows, pos] = torch.where(live, tok, out[rows, pos])
            if eos_token_id is not None:
                finished = finished | (live & (tok == eos_token_id))
            n_out.add_(live.long())

    with decode_context(model, B):
        if max_new_tokens == 0:
            return (out[:, :T], stats) if return_stats else out[:, :T]
        logits = dec(input_ids, mask[:, :T])  # the prompt at full depth
        if sp.reclaim:
            missing = cache.lacking("keep_columns")
            if missing:
                raise ValueError(
                    f"speculative reclaim: cache slots {missing} cannot drop columns (no keep_columns(idx, "
                    "length)); give them one, or pass speculative={..., 'reclaim': False}"
                )
        lens = mask[:, :T].sum(1)  # each row's committed columns
        t0 = sample_next(logits[:, -1], do_sample, temperature, top_k, top_p, generator)  # [B]
        emit(t0[:, None], torch.ones_like(n_out))
        L = T  # committed columns (the pending token t_0 goes to column L)
        while True:
            live = (n_out < max_new_tokens) & ~finished  # rows done run with the batch and commit nothing
            if not bool(live.any()):
                break
            for s in cache.physical_slots():  # every Mamba-2 state snapshots each token of the round
                if hasattr(s, "begin_recording"):
                    s.begin_recording()
            # draft: t_0 -> d_1 .. d_k, and d_k through the draft loops too (verification resumes it)
            tok, drafted, q, states = t0, [], [], []
            depths, passes = [], torch.zeros(B, dtype=torch.long, device=dev)
            t_draft = clock() if timed else 0.0
            for i in range(k + 1):
                mask[:, L + i] = 1
                if sp.exit is None:
                    lg, st = dec.draft(tok[:, None], mask[:, : L + i + 1], r_d, readout=i < k)  # d_k: no coda, no head
                    states.append(st)
                    passes += r_d
                else:  # each row stops at its own exit (<= r_d); d_k too: its readout slots stay aligned
                    lg, dep, ran, rec = dec.draft_exit(tok[:, None], mask[:, : L + i + 1], r_d)
                    states.append(rec)  # the states after loops 1 .. min(dep)
                    depths.append(dep)
                    passes += ran
                if i == k:
                    break
                if greedy:
                    tok = lg[:, -1].max(-1).indices
                else:
                    qi = sampling_probs(lg[:, -1], temperature, top_k, top_p)  # [B, V]
                    tok = torch.multinomial(qi, 1, generator=generator)[:, 0]
                    q.append(qi)
                drafted.append(tok)
            d = torch.stack(drafted, 1)  # [B, k]
            start = r_d
            if sp.exit is not None:  # resume at the shallowest draft of the round: loops below it ran for every token
                dep = torch.stack(depths, 1)  # [B, k + 1]
                start = int(dep.min())  # (one host read per round)
                states = [rec[start - 1] for rec in states]
                _restart_core(cache, start, L)
                stats.depths.append(dep)
                stats.starts.append(start)
            passes += (k + 1) * (K - start)
            stats.passes.append(passes)
            if timed:
                t_verify = clock()
                stats.draft_s += t_verify - t_draft
            # verify: roll the coda back to the round's start, resume loops r_d+1..K for all k + 1 tokens
            for layer in (b.layer_idx for b in model.coda.blocks):
                s = cache.slots.get((0, layer))
                if s is not None:
                    _to_round_start(s, L)
            block = torch.cat([t0[:, None], d], 1)  # [B, k + 1] at columns L .. L + k
            with small_row_products(model):  # a few rows per product: the decode kernels where they win
                p_logits = dec.verify(states, block, mask[:, : L + k + 1], start, L)  # [B, k + 1, V]
            if timed:
                stats.verify_s += clock() - t_verify
            if greedy:
                best = p_logits.max(-1).indices  # [B, k + 1]
                ok = best[:, :k] == d
                a = ok.long().cumprod(1).sum(1)  # accepted drafts per row
                nxt = best.gather(1, a[:, None])[:, 0]
            else:
                p = sampling_probs(p_logits.reshape(B * (k + 1), -1), temperature, top_k, top_p).view(B, k + 1, -1)
                qs = torch.stack(q, 1)  # [B, k, V]
                pd = p[:, :k].gather(-1, d[..., None])[..., 0]
                qd = qs.gather(-1, d[..., None])[..., 0]
                u = torch.rand(B, k, generator=generator, device=dev)
                ok = u < (pd / qd).clamp(max=1.0)  # accept d_i with probability min(1, p/q)
                a = ok.long().cumprod(1).sum(1)
                p_a = p[rows, a]  # [B, V]
                q_a = torch.cat([qs, torch.zeros_like(qs[:, :1])], 1)[rows, a]  # q_k := 0: the bonus samples p_k
                resid = (p_a - q_a).clamp(min=0.0)
                resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)
                nxt = torch.multinomial(resid / resid.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
            stats.accepted.append(a)
            stats.live.append(live)
            emitted = torch.cat([d, d[:, :1]], 1)  # [B, k + 1]: d_1 .. d_a, then the verified token
            emitted[rows, a] = nxt
            kept = torch.where(live, a + 1, 0)  # [B] columns each row commits
            emit(emitted, kept)
            # rollback: columns of rejected drafts become holes; Mamba-2 states return to their row's length
            cols_round = torch.arange(k + 1, device=dev)[None]  # [1, k + 1]
            mask[:, L : L + k + 1] = (cols_round < kept[:, None]).long()
            _rollback_mamba(cache, kept)
            lens += kept
            t0 = torch.where(live, nxt, t0)
            if not sp.reclaim:
                L += k + 1
                stats.peak_columns = L
                continue
            # reclaim: crop the columns every row rejected; compact when that frees a quarter of them, or when
            # the next round would not fit
            _drop_stale(cache)
            m, n = torch.stack([kept.max(), lens.max()]).tolist()  # (one host read per round)
            L += m
            stats.peak_columns = max(stats.peak_columns, L)
            if L < cache.seqlen:
                cache.keep_columns(None, L)
            if L + k + 1 > cols or (L - n >= k + 1 and 4 * (L - n) >= L):
                idx, kept_mask = _compaction(mask, L, n)
                mask[:, :n], mask[:, n:] = kept_mask, 0
                cache.keep_columns(idx, n)
                stats.compactions += 1
                L = n
    stats.decoder, stats.mask, stats.tokens, stats.emitted = dec, mask, out, n_out.clone()
    n = T + min(max_new_tokens, int(n_out.max()))
    res = out[:, :n]
    return (res, stats) if return_stats else res
