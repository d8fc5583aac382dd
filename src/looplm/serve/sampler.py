"""Per-request sampling and log-probabilities for the serving engine.

It owns what a request's :class:`~looplm.serve.engine.SamplingParams` ask of a row of logits: its next token (greedy
rows in one call, a sampled row from the request's own generator, so a seed fixes a sample whatever the batch), the
chosen token's log-probability and the top alternatives (``log_softmax`` of the raw logits, before temperature), and
the prompt's log-probabilities (echo). The tokens come from :func:`looplm.decode.sampling.sample_next`, the function
``model.generate`` samples with, so a request's sample equals ``generate``'s of its prompt alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..decode.sampling import sample_next

__all__ = ["Pick", "new_generator", "prompt_logprobs", "sample", "top_logprobs"]


class Pick(NamedTuple):
    """A row's next token: its id, its log-probability (None unless asked) and the top ``[(id, logprob)]`` asked for
    (None unless asked; ``logprobs=0``: an empty list)."""

    token_id: int
    logprob: float | None
    top_logprobs: list | None


def new_generator(params, device) -> torch.Generator | None:
    """A sampled request's own generator, seeded with its ``seed`` (None: a fresh random seed); None when greedy."""
    if params.temperature == 0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def sample(params: list, generators: list, logits: torch.Tensor) -> list[Pick]:
    """Each row's next token from ``logits [n, V]`` under its request's ``params[i]`` and ``generators[i]``."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(
            f"sample needs logits [n, V] and n params and generators; got logits {tuple(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    n = len(params)
    out: list = [None] * n
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:  # one call for every greedy row
        ids = sample_next(logits[greedy] if len(greedy) < n else logits, False, 0.0, None, None).tolist()
        for i, t in zip(greedy, ids):
            out[i] = t
    for i, p in enumerate(params):
        if out[i] is None:
            top_k = None if p.top_k in (None, 0, -1) else p.top_k
            out[i] = int(sample_next(logits[i : i + 1], True, float(p.temperature), top_k, p.top_p, generators[i])[0])
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp = torch.log_softmax(logits[want].float(), -1) if want else None  # [w, V]
    picks = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            picks.append(Pick(out[i], None, None))
        else:
            row = lp[want.index(i)]  # [V]
            picks.append(Pick(out[i], float(row[out[i]]), top_logprobs(row[None], p.logprobs)[0]))
    return picks


def prompt_logprobs(logits: torch.Tensor, next_ids: list, k: int) -> tuple[list, list]:
    """A prompt chunk's log-probabilities: ``logits [n, V]`` at positions ``a .. a + n - 1`` predict ``next_ids``
    (the prompt's tokens ``a + 1 ..``, as many as it has: the last position of a prompt predicts none). Returns
    ``(log p(next token) per position, its top-k [(id, logprob)])``."""
    lp = torch.log_softmax(logits.float(), -1)[: len(next_ids)]  # [m, V]
    nxt = torch.tensor(next_ids, device=lp.device, dtype=torch.long)
    chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
    return chosen, top_logprobs(lp, k)


def top_logprobs(lp: torch.Tensor, k: int) -> list:
    """The ``k`` most likely ``[(id, logprob)]`` of each row of ``lp [n, V]`` (``k = 0``: empty lists)."""
    if k <= 0:
        return [[] for _ in range(lp.shape[0])]
    v, i = lp.topk(min(k, lp.shape[-1]), -1)
    return [list(zip(a, b)) for a, b in zip(i.tolist(), v.tolist())]
