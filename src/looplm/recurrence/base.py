"""The recurrence-rule interface: what passes between loop iterations.

The loop driver (:class:`looplm.model.LoopedLM`) knows nothing about any rule. For ``r`` loops it runs

.. code-block:: text

    state = rule.begin(h0, lctx)                          # h0: prelude output (= E when p = 0)
    for k in range(r):
        z = rule.next_input(state, lctx)                  # Z^k, input of the shared core at iteration k
        lctx.core_input = z
        H = core(z, modulation=rule.block_modulation(state, lctx))
        state = rule.step(state, H, lctx)                 # absorb the core output H^k
        (rows whose own loop count is reached keep their old state: rule.select_rows)
        (stop when every token has halted: rule.halted, only without a decoding cache)
    y = rule.finish(state, lctx)                          # what the coda / final norm / head read
    loss = rule.lm_loss_weight · CE(head(y)) + rule.aux_loss(state, lctx)

``state`` is a plain ``dict`` (compile-friendly). A rule is one small ``nn.Module`` whose parameters
are shared over iterations and token positions; each paper design is one file in this package.

What a rule can read from the loop context ``lctx`` (:class:`LoopContext`), built once per forward:

* ``iteration`` ``k``, ``num_loops`` ``r`` (the most any row runs), ``train_loops`` ``K``,
  ``loops_per_row`` (``[B]`` when depth is given per sequence) — for timestep conditioning ``(t, Δt)``;
* ``embeddings`` ``E`` ``[B, T, d]`` (token embeddings before the prelude, already scaled) and
  ``embed_weight`` ``[V, d]`` (e.g. PonderLM's expected embedding ``softmax(logits) · W_E``);
* ``fctx`` (positions, rotary tables per declared dim, masks) — a rule-owned attention at its own head
  dim declares that dim in :attr:`RecurrenceRule.rope_dims`;
* ``core_input`` — ``Z^k``, set by the driver before ``step`` (Parcae's injection needs it);
* ``readout(h)`` — coda, final norm and head on any iterate: logits ``[B, T, V]`` (PonderLM, exit
  gates, a per-iteration logit lens);
* ``targets`` — the shifted next-token targets ``[B, T]`` (``-100`` = ignored) when labels are given,
  for auxiliary losses on intermediate iterates;
* ``loop_options`` — rule-specific inference options passed to ``forward(loop_options=...)``;
* ``cache_slot(key, factory)`` — a decoding slot owned by the rule (one per iteration: put
  ``lctx.iteration`` in the key), ``None`` when not decoding.

Hooks with defaults that do nothing: ``block_modulation`` (shifts, scales, gates — per channel or per
token — and read/write hooks that let a rule own a block's residual streams, see
:mod:`looplm.blocks`), ``aux_loss``, ``halted`` and ``select_rows``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

RULES: dict[str, type["RecurrenceRule"]] = {}


def register_rule(name: str):
    """Class decorator: make a rule available as ``rule: {name: ...}`` in model configs."""

    def deco(cls):
        cls.rule_name = name
        RULES[name] = cls
        return cls

    return deco


@dataclass
class LoopContext:
    """Where the driver is and what a rule may read (see the module docstring). Called ``lctx``."""

    iteration: int = 0  # k
    num_loops: int = 1  # r: iterations the driver runs (the largest per-row count)
    train_loops: int = 1  # K: the config's training loop count
    loops_per_row: torch.Tensor | None = None  # [B] long, when depth was given per sequence
    fctx: Any = None  # the blocks' ForwardContext (positions, rotary tables, masks)
    cache: Any = None  # LoopCache or None
    loop_options: dict = field(default_factory=dict)  # rule-specific inference options
    embeddings: torch.Tensor | None = None  # E [B, T, d], before the prelude
    embed_weight: torch.Tensor | None = None  # [V, d] token embedding matrix (unscaled)
    embed_multiplier: float = 1.0  # E = embed_multiplier · embed_weight[x]
    targets: torch.Tensor | None = None  # [B, T] next-token targets (-100 = ignore), training only
    core_input: torch.Tensor | None = None  # Z^k, set by the driver before rule.step
    readout_fn: Callable[[torch.Tensor, "LoopContext"], torch.Tensor] | None = None

    @property
    def positions(self) -> torch.Tensor:
        """``[B, T]`` token positions."""
        return self.fctx.positions

    @property
    def is_last(self) -> bool:
        """Whether this is the last iteration the driver runs."""
        return self.iteration == self.num_loops - 1

    def rope_for(self, rotary_dim: int):
        """Rotary ``(cos, sin)`` tables ``[B, T, rotary_dim]`` (the dim must be declared in ``rope_dims``)."""
        return self.fctx.rope_for(rotary_dim)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of any iterate ``h [B, T, d]``: coda, final norm and head. During decoding
        the coda uses slots of its own per iteration (``("readout", k, layer)``)."""
        return self.readout_fn(h, self)

    def active_rows(self) -> torch.Tensor | None:
        """``[B]`` bool: rows still looping at this iteration (``None`` = every row)."""
        if self.loops_per_row is None:
            return None
        return self.iteration < self.loops_per_row

    def cache_slot(self, key, factory: Callable[[], Any]):
        """A decoding cache slot owned by the rule (``None`` when not decoding); see :mod:`looplm.cache`."""
        if self.cache is None:
            return None
        return self.cache.slot(("rule", key), factory)


def where_rows(keep_new: torch.Tensor, new: Any, old: Any) -> Any:
    """Per batch row, ``new`` where ``keep_new [B]`` else ``old``, through dicts / lists / tuples.

    Tensors whose first dim is the batch are selected row-wise; anything else (flags, counters, lists
    of different lengths, parameters) takes ``new``.
    """
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        if new.dim() >= 1 and new.shape == old.shape and new.shape[0] == keep_new.shape[0]:
            return torch.where(keep_new.view(-1, *([1] * (new.dim() - 1))), new, old)
        return new
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: where_rows(keep_new, v, old[k]) if k in old else v for k, v in new.items()}
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(new) == len(old):
        return type(new)(where_rows(keep_new, a, b) for a, b in zip(new, old))
    return new


class RecurrenceRule(nn.Module):
    """Base class; the defaults implement the vanilla rule ``Z^{k+1} = H^k``.

    Class attributes a rule may set:

    * ``rope_dims`` — rotary dims of attention mixers the rule owns (the model builds their tables);
    * ``lm_loss_weight`` — weight of the final next-token loss in the training loss (a rule whose
      objective is entirely its own, e.g. an expected loss over exit steps, sets 0 and returns it from
      :meth:`aux_loss`).
    """

    rule_name: ClassVar[str] = "base"
    rope_dims: tuple[int, ...] = ()
    lm_loss_weight: float = 1.0

    def __init__(self, cfg, **options):
        """Subclasses read what they need from ``cfg`` (the ModelConfig) and declare their options as
        keyword-only arguments (they become the valid ``rule.options`` keys)."""
        super().__init__()

    # --- configuration ---------------------------------------------------------------------------
    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        """Messages for unknown/invalid ``rule.options`` (default: keys must be ``__init__`` kwargs)."""
        from ..dataclass_util import _suggest

        params = inspect.signature(cls.__init__).parameters
        known = [p for p in params if p not in ("self", "cfg") and params[p].kind == params[p].KEYWORD_ONLY]
        return [f"options.{k}: unknown option for rule {cls.rule_name!r}{_suggest(k, known)}" for k in options if k not in known]

    # --- the loop protocol -----------------------------------------------------------------------
    def begin(self, h0: torch.Tensor, lctx: LoopContext) -> dict:
        """The state before iteration 0 from the prelude output ``h0 [B, T, d]``."""
        return {"h": h0}

    def next_input(self, state: dict, lctx: LoopContext) -> torch.Tensor:
        """``Z^k``: what the core reads at iteration ``lctx.iteration``."""
        return state["h"]

    def block_modulation(self, state: dict, lctx: LoopContext):
        """``None`` or one :class:`~looplm.blocks.BlockModulation` (or ``None``) per core block."""
        return None

    def step(self, state: dict, h: torch.Tensor, lctx: LoopContext) -> dict:
        """Absorb the core output ``H^k``; return the new state (do not modify ``state`` in place)."""
        return {**state, "h": h}

    def finish(self, state: dict, lctx: LoopContext) -> torch.Tensor:
        """``Y``: what the coda (or the final norm and head) reads, ``[B, T, d]``."""
        return state["h"]

    # --- optional hooks --------------------------------------------------------------------------
    def aux_loss(self, state: dict, lctx: LoopContext) -> torch.Tensor | None:
        """A scalar added to the training loss (and returned as ``output.aux_loss``); ``None`` = none."""
        return None

    def halted(self, state: dict, lctx: LoopContext) -> torch.Tensor | None:
        """``[B, T]`` bool, True where a token has exited (``None`` = never). The driver stops early only
        when every token has halted and no decoding cache is in use (later tokens need complete caches)."""
        return None

    def select_rows(self, keep_new: torch.Tensor, new: dict, old: dict) -> dict:
        """Per-sequence loop counts: rows whose count is reached keep ``old``. Override when the state
        holds tensors whose first dim is not the batch or lists that grow per iteration."""
        return where_rows(keep_new, new, old)

    def extra_repr(self) -> str:
        return f"rule={self.rule_name!r}"
