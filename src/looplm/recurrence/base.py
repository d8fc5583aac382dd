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
* ``cache_slot(key, factory)`` — a decoding slot owned by the rule, ``None`` when not decoding;
  ``loop_slot(name, factory)`` — the rule's slot of this iteration (per-token exit fills the
  iterations a token skipped; declare the slot's mixer in :meth:`RecurrenceRule.loop_slot_mixers`).
* ``final_norm`` — the model's final RMSNorm ``N`` (the module, its weights shared): Ouro normalises the
  state between iterations and feeds its gate ``N(h)`` (exit_gate ``inter_norm`` / ``gate_norm``), Huginn
  normalises the loop's output before the coda (injection ``finish_norm``).

Hooks with defaults that do nothing: ``block_modulation`` (shifts, scales, gates — per channel or per
token — and read/write hooks that let a rule own a block's residual streams, see
:mod:`looplm.blocks`), ``aux_loss``, ``halted`` and ``select_rows``.

Hooks of adaptive decoding (:mod:`looplm.decode.token_schedule`, per-token exit; defaults serve every rule whose
state is a dict of ``[B, T, ...]`` tensors): ``exit_log_survival`` (a learned exit distribution, read by
the ``gate`` criterion), ``exit_rows`` (tokens that stop after this iteration), ``take_rows`` (the rows
still looping), ``cat_tokens`` (draft states joined for speculative verification) and
``loop_slot_mixers`` (the mixers of the rule's per-iteration slots).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn

from ..context import LoopContext

RULES: dict[str, type["RecurrenceRule"]] = {}


def register_rule(name: str):
    """Class decorator: make a rule available as ``rule: {name: ...}`` in model configs."""

    def deco(cls):
        cls.rule_name = name
        RULES[name] = cls
        return cls

    return deco


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
      :meth:`aux_loss`);
    * ``loop_options`` — the keys of ``forward(loop_options=...)`` the rule reads (``lctx.loop_options``);
      any other key is refused by :meth:`check_loop_options` (a misspelt option would be ignored).
    """

    rule_name: ClassVar[str] = "base"
    rope_dims: tuple[int, ...] = ()
    lm_loss_weight: float = 1.0
    loop_options: tuple[str, ...] = ()

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
        return [
            f"options.{k}: unknown option for rule {cls.rule_name!r}{_suggest(k, known)}"
            for k in options
            if k not in known
        ]

    def check_loop_options(self, options: dict) -> None:
        """Refuse ``forward(loop_options=...)`` keys this rule does not read, naming the ones it does."""
        unknown = [k for k in options if k not in self.loop_options]
        if unknown:
            from ..dataclass_util import _suggest

            known = ", ".join(map(repr, self.loop_options)) or "none"
            hints = "".join(_suggest(str(k), list(self.loop_options)) for k in unknown)
            raise ValueError(
                f"loop_options {unknown}: not read by the recurrence rule {self.rule_name!r}{hints}; it reads: {known}"
            )

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

    # --- adaptive decoding (looplm.decode.token_schedule) -----------------------------------------------------
    def exit_log_survival(self, state: dict, lctx: LoopContext) -> torch.Tensor | None:
        """``[B, T]`` float64 ``log(1 − CDF(r))`` of a learned per-token exit distribution after the step just
        taken (the ``gate`` criterion exits at the first ``r`` with ``CDF(r) >= q``); ``None`` = no gate."""
        return None

    def exit_rows(self, state: dict, exiting: torch.Tensor, lctx: LoopContext) -> dict:
        """Tokens ``exiting [B, T]`` (bool) stop looping after this iteration: return the state whose
        :meth:`finish` gives their output at this depth. Default: unchanged (``finish`` reads the latest
        state). A rule that selects among iterates (the exit gate) selects this one."""
        return state

    def take_rows(self, state: dict, idx: torch.Tensor, batch: int) -> dict:
        """The state of batch rows ``idx`` (of ``batch``): the rows still looping. Default: every tensor
        whose first dim is the batch, through dicts / lists / tuples."""
        return take_rows(state, idx, batch)

    def cat_tokens(self, states: list[dict]) -> dict:
        """States of consecutive single tokens joined along the token axis (dim 1), ``[B, 1, ...]`` ->
        ``[B, n, ...]`` (speculative verification resumes the draft's states at its depth)."""
        return cat_tokens(states)

    def loop_slot_mixers(self) -> list[nn.Module]:
        """Mixers whose decoding slots the rule takes per iteration (``lctx.loop_slot``): per-token exit
        checks that its KV / SSM policies can fill them. Default: none."""
        return []

    def extra_repr(self) -> str:
        return f"rule={self.rule_name!r}"


def take_rows(state: Any, idx: torch.Tensor, batch: int) -> Any:
    """Rows ``idx`` of every tensor in ``state`` whose first dim is ``batch`` (dicts, lists, tuples)."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, idx) if state.dim() >= 1 and state.shape[0] == batch else state
    if isinstance(state, dict):
        return {k: take_rows(v, idx, batch) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(take_rows(v, idx, batch) for v in state)
    return state


def cat_tokens(states: list) -> Any:
    """``[B, 1, ...]`` tensors of the same place in each state joined along dim 1; others from the first."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=1) if first.dim() >= 2 else first
    if isinstance(first, dict):
        return {k: cat_tokens([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(cat_tokens([s[i] for s in states]) for i in range(len(first)))
    return first
