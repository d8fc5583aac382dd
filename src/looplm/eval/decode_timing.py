"""Timing decoding contenders against full depth in one process, interleaved token by token (used by
``looplm bench adaptive`` and ``looplm eval threshold``)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

__all__ = ["FullDepth", "decode_timing", "decoded_nll", "generation_timing", "queue_timing", "teacher_forced_timing"]


class FullDepth:
    """Full-depth decoding as :func:`looplm.decode.generate.generate` does it (the plain path): the prompt, then one
    ``model(token, cache=...)`` per step with preallocated KV slots, the head on the last position."""

    def __init__(self, model, batch_size: int, capacity: int):
        self.model = model
        self.cache = model.new_cache(batch_size, capacity=capacity)

    def __call__(self, ids, attention_mask=None, logits_to_keep: int = 1, validate: bool = True):
        return self.model(
            ids, cache=self.cache, attention_mask=attention_mask, logits_to_keep=logits_to_keep, validate=validate
        ).logits


def _now(clock: str):
    return time.perf_counter if clock == "wall" else time.process_time


def _flushed(dec, now) -> float:
    """Seconds ``dec.flush()`` takes (what a decoder still carries, :mod:`looplm.decode.kv_fill`, is part of its
    decoding); 0 for a decoder without one."""
    if not hasattr(dec, "flush"):
        return 0.0
    t0 = now()
    dec.flush()
    return now() - t0


def _rotated(names: list, i: int) -> list:
    """``names`` starting at position ``i`` (mod their count): each step a different contender goes first."""
    shift = i % len(names)
    return names[shift:] + names[:shift]


def _summary(per_run: dict, last: dict) -> dict:
    """``{name: {"ms_per_token" (median over runs), "ratio" (median of the per-run ratios to the first
    contender), "ratios", "stats" (the last run's decoder statistics, if it keeps any)}}``."""
    names = list(per_run)
    base = per_run[names[0]]
    out = {}
    for k in names:
        ratios = [a / b for a, b in zip(per_run[k], base)]
        st = getattr(last[k], "stats", None)
        out[k] = {
            "ms_per_token": statistics.median(per_run[k]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "stats": st.summary() if st is not None else None,
        }
    return out


@torch.inference_mode()
def decode_timing(
    model, prompts: torch.Tensor, new_tokens: int, contenders: dict, *, runs: int = 3, clock: str = "wall"
) -> dict:
    """Decode-only time per generated token of each contender (``{name: factory(batch, capacity)}``, the
    first is the baseline): every run prefills each contender with ``prompts [B, P]`` (untimed), then
    decodes ``new_tokens`` greedy tokens, one step of every contender in a rotating order before any
    takes the next (a burst of load hits all alike). Returns ``{name: {"ms_per_token", "ratio",
    "ratios", "stats"}}`` (``ratio``: median over runs of the time relative to the first contender)."""
    from ..decode.sampling import decode_context

    B, P = prompts.shape
    now = _now(clock)
    names = list(contenders)
    per_run = {k: [] for k in names}
    last = {}
    with decode_context(model, B):
        for run in range(runs + 1):  # the first run warms up (allocations, caches)
            decs = {k: contenders[k](B, P + new_tokens + 1) for k in names}
            toks = {k: decs[k](prompts)[:, -1].argmax(-1, keepdim=True) for k in names}
            spent = dict.fromkeys(names, 0.0)
            n = new_tokens if run else min(4, new_tokens)
            for t in range(n):
                for k in _rotated(names, run + t):
                    t0 = now()
                    toks[k] = decs[k](toks[k], validate=False)[:, -1].argmax(-1, keepdim=True)
                    spent[k] += now() - t0
            for k in names:
                spent[k] += _flushed(decs[k], now)
            if run:
                for k in names:
                    per_run[k].append(1000 * spent[k] / n)
            last = decs
    return _summary(per_run, last)


def _greedy_steps(model, dec, prompts: torch.Tensor, n: int, now) -> float:
    """A one-step decoder ``dec``: the prompts (untimed), then ``n`` greedy steps; returns their seconds on ``now``."""
    from ..decode.sampling import decode_context

    greedy = lambda logits: logits.max(-1).indices  # noqa: E731
    with decode_context(model, prompts.shape[0]):
        tok = greedy(dec(prompts)[:, -1])[:, None]
        t0 = now()
        for _ in range(n):
            tok = greedy(dec(tok, validate=False)[:, -1])[:, None]
        return now() - t0 + _flushed(dec, now)


@torch.inference_mode()
def generation_timing(
    model, prompts: torch.Tensor, new_tokens: int, contenders: dict, *, runs: int = 3, clock: str = "wall"
) -> dict:
    """As :func:`decode_timing`, for contenders that decode a whole generation at their own pace (continuous
    depth batching, :class:`looplm.decode.depth_schedule.DepthBatchedDecoder`: rows are at different tokens, so no
    step is the batch's). Each run decodes ``new_tokens`` greedy tokens per row with every contender in a
    rotating order, the prompt untimed; a contender is either a one-step decoder (as for
    :func:`decode_timing`: timed step by step) or has ``run(prompts, new_tokens, mask, pick, eos, pad,
    now=clock)`` and reports ``decode_seconds``. Time per token: the decode after the prompt over the
    ``new_tokens − 1`` tokens it produced. Returns what :func:`decode_timing` does."""
    B, P = prompts.shape
    now = _now(clock)
    names = list(contenders)
    per_run = {k: [] for k in names}
    last = {}
    greedy = lambda logits: logits.max(-1).indices  # noqa: E731
    n = max(1, new_tokens - 1)
    for run in range(runs + 1):  # the first run warms up
        decs = {k: contenders[k](B, P + new_tokens + 1) for k in names}
        for k in _rotated(names, run):
            dec = decs[k]
            if hasattr(dec, "run"):
                dec.run(prompts, new_tokens, None, greedy, None, 0, now=now)
                spent = dec.decode_seconds
            else:
                spent = _greedy_steps(model, dec, prompts, n, now)
            if run:
                per_run[k].append(1000 * spent / n)
        last = decs
    return _summary(per_run, last)


@torch.inference_mode()
def queue_timing(
    model, prompts: torch.Tensor, rows: int, new_tokens: int, refill, *, runs: int = 3, clock: str = "wall"
) -> dict:
    """A queue of ``prompts [N, P]`` (``N`` a multiple of ``rows``) through ``rows`` rows: full depth in fixed
    batches of ``rows`` prompts (:class:`FullDepth`, the batches one after another) against ``refill(rows,
    capacity, N)``, a decoder whose ``run`` takes all ``N`` prompts and refills a finished row with the next
    (:class:`looplm.decode.depth_schedule.DepthBatchedDecoder`, exit ``max_batch``). Both decode ``new_tokens`` greedy
    tokens per prompt, prompts untimed, in a rotating order per run. Returns ``{"full", "refill"}`` as
    :func:`decode_timing` does (time per decoded token; ``ratio``: median of the per-run ratios to full)."""
    N, P = prompts.shape
    if rows < 1 or N % rows:
        raise ValueError(f"queue_timing: {N} prompts do not split into batches of rows={rows}")
    now = _now(clock)
    per_run = {"full": [], "refill": []}
    last = {}
    greedy = lambda logits: logits.max(-1).indices  # noqa: E731
    n = max(1, new_tokens - 1)  # tokens decoded after each prompt's first
    for run in range(runs + 1):  # the first run warms up
        for k in _rotated(["full", "refill"], run):
            if k == "refill":
                dec = refill(rows, P + new_tokens + 1, N)
                dec.run(prompts, new_tokens, None, greedy, None, 0, now=now)
                spent = dec.decode_seconds
            else:
                spent = 0.0
                for a in range(0, N, rows):
                    dec = FullDepth(model, rows, P + new_tokens + 1)
                    spent += _greedy_steps(model, dec, prompts[a : a + rows], n, now)
            last[k] = dec
            if run:
                per_run[k].append(1000 * spent / (n * N // rows))
    return _summary(per_run, last)


@torch.inference_mode()
def teacher_forced_timing(
    model, ids: torch.Tensor, contenders: dict, *, prompt_len: int = 8, runs: int = 1, clock: str = "wall"
) -> dict:
    """Score ``ids [B, T]`` with every contender (``{name: factory(batch, capacity)}``), the first ``prompt_len``
    tokens as a prompt (untimed) and then one token at a time, the contenders interleaved token by token in a
    rotating order. Returns ``{name: {"ms_per_token", "ratio" (median over runs vs the first), "ratios",
    "logits" [B, T, V] from prompt_len − 1 on, "stats"}}``."""
    from ..decode.sampling import decode_context

    B, T = ids.shape
    now = _now(clock)
    names = list(contenders)
    per_run = {k: [] for k in names}
    logits, last = {}, {}
    with decode_context(model, B):
        for run in range(runs):
            decs = {k: contenders[k](B, T) for k in names}
            out = {k: torch.zeros(B, T, model.config.vocab_size) for k in names}
            for k in names:
                out[k][:, :prompt_len] = decs[k](ids[:, :prompt_len], logits_to_keep=prompt_len).float()
            spent = dict.fromkeys(names, 0.0)
            for t in range(prompt_len, T):
                for k in _rotated(names, run + t):
                    t0 = now()
                    lg = decs[k](ids[:, t : t + 1], validate=False)
                    spent[k] += now() - t0
                    out[k][:, t] = lg[:, -1].float()
            for k in names:
                spent[k] += _flushed(decs[k], now)
            for k in names:
                per_run[k].append(1000 * spent[k] / max(1, T - prompt_len))
            logits, last = out, decs
    res = _summary(per_run, last)
    for k in names:
        res[k]["logits"] = logits[k]
    return res


def decoded_nll(logits: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> float:
    """Mean next-token NLL of the positions :func:`teacher_forced_timing` decoded one at a time: ``logits
    [B, T, V]`` at ``prompt_len .. T − 2`` against ``ids [B, T]`` at ``prompt_len + 1 .. T − 1``."""
    lp = logits[:, prompt_len:-1].float()
    return float(F.cross_entropy(lp.reshape(-1, lp.shape[-1]), ids[:, prompt_len + 1 :].reshape(-1)))
