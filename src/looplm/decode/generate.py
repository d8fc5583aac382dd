"""Autoregressive decoding with per-(loop iteration, layer) caches, batched with left padding."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .sampling import decode_context, eval_mode, sample_next, sampling_probs  # noqa: F401  (re-exported: looplm.decode.generate.sample_next)


@dataclass(frozen=True)
class _Decoding:
    """The arguments of :func:`generate` that every decode path takes alike, checked once
    (:func:`_check_generate_args`) and handed down as one: how a row's next token is picked, when a row ends
    and what it emits after, the batch's mask, the rule's options and whether the statistics are returned.
    By name they are also :func:`~looplm.decode.speculative.speculative_generate`'s and
    :func:`~looplm.decode.depth_schedule.depth_batched_generate`'s keyword arguments (:meth:`kwargs`)."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_id: int | None
    pad_token_id: int | None
    attention_mask: torch.Tensor | None
    generator: torch.Generator | None
    loop_options: dict | None
    return_stats: bool

    def kwargs(self) -> dict:
        """The fields by name, the objects themselves (:func:`dataclasses.asdict` would copy the mask and the
        generator: another generator's draws)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def pad(self) -> int:
        """The id a row emits after its eos: ``pad_token_id``, else the eos id, else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id if self.eos_token_id is not None else 0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from ``logits [n, V]``: ``[n]`` (greedy, or temperature / top-k / top-p sampling)."""
        return sample_next(logits, self.do_sample, self.temperature, self.top_k, self.top_p, self.generator)


def _check_generate_args(
    model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, attention_mask
) -> None:
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
        shape = (
            tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        )
        errs.append(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    elif attention_mask is not None:
        errs += _mask_errors(attention_mask)
    limit = model.config.max_seq_len
    if not errs and input_ids.shape[1] + max_new_tokens > limit:
        errs.append(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_seq_len={limit}; shorten the prompt or ask for at most {max(0, limit - input_ids.shape[1])} new tokens"
        )
    if errs:
        raise ValueError("generate: " + "; ".join(errs))


def _mask_errors(attention_mask: torch.Tensor) -> list[str]:
    """Why ``attention_mask`` cannot decode: decoding appends every new token at the right end of a row, so
    a row's padding must be on its left (0s, then 1s); right padding would put the new tokens after the
    pad columns (other tokens than the row decoded alone), and a row of 0s has no token to continue."""
    m = attention_mask
    if m.dtype != torch.bool:
        other = ((m != 0) & (m != 1)).any(1).nonzero()[:, 0].tolist()
        if other:
            return [f"attention_mask must hold 0 (padding) and 1 (token) only; row(s) {other[:8]} hold other values"]
    m = m.long()
    errs = []
    empty = (m.sum(1) == 0).nonzero()[:, 0].tolist()
    if empty:
        errs.append(
            f"attention_mask row(s) {empty[:8]} are all 0 (no token to continue): give each row at least one token"
        )
    if m.shape[1] > 1:
        right = (m[:, 1:] < m[:, :-1]).any(1).nonzero()[:, 0].tolist()  # a 0 after a 1: padding on the right
        if right:
            errs.append(
                f"attention_mask row(s) {right[:8]} are right-padded (a 0 after a 1); decoding appends new tokens "
                "on the right: left-pad the batch (padding_side='left': 0s first, then the row's tokens)"
            )
    return errs


def _check_depth(model, num_loops, allow_deep) -> None:
    """``num_loops`` past :data:`~looplm.decode.exits.DEEP_LOOPS_FACTOR` x K refused unless ``allow_deep``."""
    from .exits import deep_loops_error

    if not isinstance(allow_deep, bool):
        raise ValueError(f"generate: allow_deep must be True or False, got {allow_deep!r}")
    if isinstance(num_loops, torch.Tensor) and num_loops.numel() and not num_loops.dtype.is_floating_point:
        r = int(num_loops.max())
    elif isinstance(num_loops, int) and not isinstance(num_loops, bool):
        r = num_loops
    else:
        return  # (None, or a bad value: the model's forward names it)
    why = deep_loops_error("num_loops", r, model.config.n_loops, allow_deep)
    if why is not None:
        raise ValueError(f"generate: {why}")


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
    exit=None,
    speculative=None,
    return_stats: bool = False,
    allow_deep: bool = False,
):
    """Return ``[B, T + max_new_tokens]`` token ids, prompt included.

    Batches of different prompt lengths are left-padded; pass their ``attention_mask`` (1 = token).
    Rows that emitted ``eos_token_id`` keep emitting ``pad_token_id`` (default: the eos id); decoding
    stops early when every row has finished (the result is then shorter).
    ``use_cache=False`` recomputes the full forward each step (the reference the cache is tested against).
    ``loop_options`` reach the recurrence rule at every step (e.g. ``{"exit_threshold": 0.8}``: output
    selection; every loop still runs).

    Adaptive depth (``docs/adaptive-depth.md``):

    * ``exit`` — per-token early exit that skips the work (:class:`looplm.decode.exits.Exit`, a dict of its fields
      or a string such as ``"gate:0.8"``, ``"kl:5e-4"``, ``"convergence:0.03"``, ``"replay:2"``): each
      token stops looping at its exit and the loops it skipped are filled by the ``kv`` / ``ssm`` policies.
      A criterion that is off (``q = 1``, ``ε = 0``) with the ordinary caches runs exactly today's path;
    * ``speculative`` — lossless self-speculative decoding (:class:`looplm.decode.speculative.Speculative`, a dict,
      or an int: the draft's loop count ``r_d``): ``k`` tokens drafted with ``r_d`` loops, verified with
      every loop in one forward that resumes at loop ``r_d + 1``; greedy output equals full-depth greedy,
      sampled output has full depth's distribution;
    * ``allow_deep`` — allow more than 64 x the trained K loops (``num_loops``, an exit's ``max_loops`` or
      replay depths); without it such a count is refused (a typo should not decode for hours);
    * ``return_stats`` — also return what ran: ``(ids, stats)`` with :meth:`looplm.decode.token_schedule.DepthStats.summary`
      (selected / executed depth, FLOPs) or the speculative round statistics.
    """
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids[None]
    _check_generate_args(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, attention_mask)
    _check_depth(model, num_loops, allow_deep)
    if exit is not None and speculative is not None:
        raise ValueError("generate: pass exit= or speculative=, not both (a speculative draft takes its own depth)")
    if (exit is not None or speculative is not None) and not use_cache:
        raise ValueError(
            "generate: exit= / speculative= decode with the cache; use_cache=False is the full-forward reference"
        )
    if return_stats and exit is None and speculative is None:  # full depth, counted by the adaptive driver
        from .exits import Exit

        exit = Exit(criterion="replay", depths=num_loops or model.config.n_loops, kv="full")
    args = _Decoding(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attention_mask=attention_mask,
        generator=generator,
        loop_options=loop_options,
        return_stats=return_stats,
    )
    if speculative is not None:
        from .speculative import speculative_generate

        if num_loops is not None and num_loops != model.config.n_loops:
            raise ValueError(
                f"generate: speculative decoding verifies at the model's K = {model.config.n_loops} loops; num_loops={num_loops!r} cannot change it"
            )

        return speculative_generate(model, input_ids, max_new_tokens, speculative, **args.kwargs())
    if exit is not None:
        from .exits import Exit

        if isinstance(num_loops, torch.Tensor):
            raise ValueError(
                "generate: exit= decides each token's depth; per-sequence num_loops cannot be combined with it"
            )
        e = Exit.parse(exit)  # (an Exit a front end resolved comes back as it is: checked once, not here again)
        if allow_deep and not e.allow_deep:
            e = e.with_policies(allow_deep=True)  # (checked anew)
        if num_loops is not None and e.default_depth and num_loops != e.max_loops:
            e = e.with_policies(max_loops=num_loops)  # another depth: checked anew
        e = e.resolved(model, input_ids.shape[0])  # every bad option refused here, before any work; handed down as is
        if e.schedule in ("depth", "static") and not e.is_off(model):
            from .depth_schedule import depth_batched_generate
            from .static_schedule import StaticDepthDecoder

            decoder = StaticDepthDecoder if e.schedule == "static" else None
            return depth_batched_generate(model, input_ids, max_new_tokens, e, **args.kwargs(), decoder=decoder)
        if not e.is_off(model) or return_stats:
            return _generate_adaptive(model, input_ids, max_new_tokens, e, args)
    # the lean path: output ids and mask preallocated, KV slots preallocated for T + max_new_tokens,
    # the head applied to the last position only, token ids checked once (for the prompt), and no
    # host synchronisation per token except the all-rows-finished check when an eos id is given
    B, T = input_ids.shape
    cache_loops = int(num_loops.max()) if isinstance(num_loops, torch.Tensor) else num_loops
    with eval_mode(model):
        cache = model.new_cache(B, cache_loops, capacity=T + max_new_tokens) if use_cache else None

        def step(i: int, ids: torch.Tensor, step_mask: torch.Tensor | None) -> torch.Tensor:
            if use_cache and i > 0:  # the prompt first, then the newest token against the cache
                ids = ids[:, -1:]
            return model(
                ids,
                cache=cache,  # (None without use_cache: the full forward each step)
                attention_mask=step_mask,
                num_loops=num_loops,
                logits_to_keep=1,
                validate=i == 0,
                loop_options=loop_options,
            ).logits

        return _decode(model, input_ids, max_new_tokens, step, args)


def _decode(model, input_ids: torch.Tensor, max_new_tokens: int, step, args: _Decoding) -> torch.Tensor:
    """The token loop of both decode paths: ``step(i, ids [B, n], mask [B, n] | None)`` returns the logits
    whose last position picks token ``i`` (``args.pick``); a row that has emitted ``eos_token_id`` pads from
    there on; the loop ends early once every row has. Output ids and mask are preallocated for
    ``T + max_new_tokens``, and the fused decode steps (:func:`decode_context`) are on for the whole loop."""
    B, T = input_ids.shape
    # (locals: the loop reads them every token)
    attention_mask, eos_token_id, pad_token_id, pick = args.attention_mask, args.eos_token_id, args.pad, args.pick
    padded = attention_mask is not None and bool((attention_mask == 0).any())
    out = torch.empty(B, T + max_new_tokens, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :T] = input_ids
    mask = torch.ones(B, T + max_new_tokens, dtype=torch.long, device=input_ids.device)
    if padded:
        mask[:, :T] = attention_mask.long()
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    n = T
    with decode_context(model, B):
        for i in range(max_new_tokens):
            logits = step(i, out[:, :n], mask[:, :n] if padded else None)
            nxt = pick(logits[:, -1])  # [B]
            nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
            out[:, n] = nxt
            n += 1
            if eos_token_id is not None:
                finished |= nxt == eos_token_id
                if bool(finished.all()):
                    break
    return out[:, :n]


@torch.no_grad()
def _generate_adaptive(model, input_ids: torch.Tensor, max_new_tokens: int, exit, args: _Decoding):
    """:func:`generate` with per-token exit (:class:`looplm.decode.token_schedule.AdaptiveDecoder`): the prompt at full
    depth, every new token with its own exit."""
    from .token_schedule import AdaptiveDecoder

    with eval_mode(model):
        dec = AdaptiveDecoder(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, exit, args.loop_options)
        ids = _decode(
            model,
            input_ids,
            max_new_tokens,
            lambda i, ids, m: dec(ids if i == 0 else ids[:, -1:], m, validate=i == 0),
            args,
        )
        dec.flush()  # the last token's propagate fills, carried for its next token (looplm.decode.kv_fill)
    return (ids, dec.stats) if args.return_stats else ids


def adaptive_options(
    model,
    exit=None,
    speculative=None,
    draft_k: int | None = None,
    kv: str | None = None,
    ssm: str | None = None,
    min_loops: int | None = None,
    max_loops: int | None = None,
    schedule: str | None = None,
    draft_exit: str | None = None,
    prefill: str | None = None,
    compile: bool | None = None,
    allow_deep: bool = False,
) -> dict:
    """``generate()``'s adaptive-depth keyword arguments from a front end's options (``looplm generate``'s
    flags, the lm-eval model's arguments), checked against ``model`` before any decoding: ``{"exit": Exit}``
    (``exit`` with the policies and loop bounds), ``{"speculative": Speculative}`` (``speculative`` draft
    loops, ``draft_k`` tokens per round, default 4, ``draft_exit`` the draft's exit criterion) or ``{}``;
    ``allow_deep``: an exit's ``max_loops`` / replay depth may exceed 64 x K (else refused). A ``ValueError``
    names a bad option."""
    from .exits import Exit
    from .speculative import Speculative

    policy = {
        "kv": kv,
        "ssm": ssm,
        "min_loops": min_loops,
        "max_loops": max_loops,
        "schedule": schedule,
        "prefill": prefill,
        "compile": compile,
    }
    if exit is not None and speculative is not None:
        raise ValueError(
            "exit (--exit / exit=) and speculative decoding (--speculative / speculative=) cannot be combined "
            "(the draft takes its own depth): give one, not both"
        )
    if exit is not None:
        e = Exit.parse(exit).with_policies(**policy, allow_deep=True if allow_deep else None)
        return {"exit": e.resolved(model)}  # generate() does not check it again
    if any(v is not None for v in policy.values()):
        raise ValueError(
            "--kv-policy / --ssm-policy / --min-loops / --max-loops / --exit-schedule / --exit-prefill (kv_policy= ... exit_compile=) "
            "are options of --exit (exit=): give an exit criterion too"
        )
    if draft_exit is not None and speculative is None:
        raise ValueError(
            "--draft-exit (draft_exit=) is the exit criterion of a speculative draft: give --speculative R_D "
            "(speculative=, the draft's most loops) too"
        )
    if speculative is not None:
        sp = Speculative(draft_loops=speculative, k=4 if draft_k is None else draft_k, exit=draft_exit)
        return {"speculative": sp.resolved(model)}
    return {}
