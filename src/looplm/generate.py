"""Autoregressive decoding with per-(loop iteration, layer) caches, batched with left padding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import dispatch


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from ``logits [B, V]``: greedy, or temperature / top-k / top-p sampling."""
    if not do_sample or temperature == 0:
        # the first maximum, as argmax; torch's CPU argmax is 2-4x slower (0.17 vs 0.04 ms for one bf16
        # row of 49,152 logits: 1.5% of a batch-1 decode step at the SmolLM2-135M shape)
        return logits.max(-1).indices
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
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_generate_args(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, attention_mask) -> None:
    """Fail before any decoding work, naming the argument and the valid range."""
    errs = []
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq_len] (or [seq_len]) tensor of token ids, got {shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        errs.append(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        errs.append(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")  # NaN fails too
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        errs.append(f"top_k must be an int >= 0 (0 or None = off), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        errs.append(f"top_p must be in (0, 1] (1 or None = off), got {top_p!r}")
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape)
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        errs.append(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    limit = model.config.max_seq_len
    if not errs and input_ids.shape[1] + max_new_tokens > limit:
        errs.append(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_seq_len={limit}; shorten the prompt or ask for at most {max(0, limit - input_ids.shape[1])} new tokens"
        )
    if errs:
        raise ValueError("generate: " + "; ".join(errs))


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    num_loops: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    loop_options: dict | None = None,
) -> torch.Tensor:
    """Return ``[B, T + max_new_tokens]`` token ids, prompt included.

    Batches of different prompt lengths are left-padded; pass their ``attention_mask`` (1 = token).
    Rows that emitted ``eos_token_id`` keep emitting ``pad_token_id`` (default: the eos id); decoding
    stops early when every row has finished (the result is then shorter).
    ``use_cache=False`` recomputes the full forward each step (the reference the cache is tested against).
    ``loop_options`` reach the recurrence rule at every step (e.g. ``{"exit_threshold": 0.8}``).
    """
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids[None]
    _check_generate_args(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, attention_mask)
    was_training = model.training
    model.eval()
    B, T = input_ids.shape
    dev = input_ids.device
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    padded = attention_mask is not None and bool((attention_mask == 0).any())
    # the lean path: output ids and mask preallocated, KV slots preallocated for T + max_new_tokens,
    # the head applied to the last position only, token ids checked once (for the prompt), and no
    # host synchronisation per token except the all-rows-finished check when an eos id is given
    out = torch.empty(B, T + max_new_tokens, dtype=input_ids.dtype, device=dev)
    out[:, :T] = input_ids
    mask = torch.ones(B, T + max_new_tokens, dtype=torch.long, device=dev)
    if padded:
        mask[:, :T] = attention_mask.long()
    cache_loops = int(num_loops.max()) if isinstance(num_loops, torch.Tensor) else num_loops
    cache = model.new_cache(B, cache_loops, capacity=T + max_new_tokens) if use_cache else None
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    n = T
    # the fused one-token steps registered with looplm.dispatch: on a CPU, looplm.kernels (loaded here,
    # built once if needed) runs each plain block's step as fused ops and the products on its kernels where
    # they beat torch's matmul at this batch size; everywhere else the reference forward
    p = next(model.parameters())
    if p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32):  # other dtypes never build the kernels
        from . import kernels

        kernels.load("cpu")
    try:
        with dispatch.decode_steps(model, batch_size=B):
            for i in range(max_new_tokens):
                step_mask = mask[:, :n] if padded else None
                if use_cache:
                    step_input = out[:, :n] if i == 0 else out[:, n - 1 : n]
                    res = model(step_input, cache=cache, attention_mask=step_mask, num_loops=num_loops, logits_to_keep=1,
                                validate=i == 0, loop_options=loop_options)  # fmt: skip
                else:
                    res = model(out[:, :n], attention_mask=step_mask, num_loops=num_loops, logits_to_keep=1, validate=i == 0,
                                loop_options=loop_options)  # fmt: skip
                nxt = sample_next(res.logits[:, -1], do_sample, temperature, top_k, top_p, generator)  # [B]
                nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
                out[:, n] = nxt
                n += 1
                if eos_token_id is not None:
                    finished |= nxt == eos_token_id
                    if bool(finished.all()):
                        break
    finally:
        model.train(was_training)
    return out[:, :n]

