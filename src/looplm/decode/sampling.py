"""Picking the next token (greedy, temperature / top-k / top-p) and the decode-time context that switches
looplm's CPU fast paths in; shared by :mod:`looplm.decode.generate` and :mod:`looplm.decode.speculative`."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .. import dispatch

__all__ = ["decode_context", "eval_mode", "sample_next", "sampling_probs", "small_row_products"]


def sample_next(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from ``logits [B, V]``: greedy, or temperature / top-k / top-p sampling."""
    if not do_sample or temperature == 0:
        # the first maximum, as argmax; torch's CPU argmax is 2-4x slower (0.17 vs 0.04 ms for one bf16
        # row of 49,152 logits: 1.5% of a batch-1 decode step at the SmolLM2-135M shape)
        return logits.max(-1).indices
    return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The distribution :func:`sample_next` samples from: ``softmax(logits / temperature)`` restricted to the
    top ``k`` and to the smallest set of mass ``top_p`` (``[..., V]`` float32)."""
    logits = logits.float() / max(temperature, 1e-8)
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # keep the smallest set whose mass reaches top_p: drop a token once the mass before it does
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return F.softmax(logits, dim=-1)


@contextlib.contextmanager
def eval_mode(model):
    """``model`` in eval mode inside the block, its own mode restored after (also on an error)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def decode_context(model, B: int):
    """The fused one-token steps of :mod:`looplm.dispatch` for a decode of ``B`` rows: on a CPU, looplm.kernels
    (loaded here, built once if needed) runs each plain block's step as fused ops and the products on its
    kernels where they beat torch's matmul at this batch size; everywhere else the reference forward."""
    p = next(model.parameters())
    if p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32):
        from .. import kernels

        kernels.load("cpu")
    return dispatch.decode_steps(model, batch_size=B)


def small_row_products(model):
    """A forward of a few tokens per row (speculative verification) with the decode steps taking it too:
    the linear layers' products on looplm's CPU kernels where they beat torch's matmul at that row count
    (inside :func:`decode_context`; see :func:`looplm.dispatch.few_token_steps`); a no-op without steps."""
    return dispatch.few_token_steps()
