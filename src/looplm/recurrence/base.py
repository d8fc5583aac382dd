"""The recurrence-rule interface: what passes between loop iterations.

The loop driver (:class:`looplm.model.LoopedLM`) knows nothing about any rule. For ``r`` loops it runs

.. code-block:: text

    state = rule.begin(h0, ctx)                  # h0: prelude output (the embedding when p = 0)
    for k in range(r):
        z = rule.next_input(state, ctx)          # Z^k, input of the shared core at iteration k
        H = core(z, modulation=rule.block_modulation(ctx))
        state = rule.step(state, H, ctx)         # absorb the core output H^k
    y = rule.finish(state, ctx)                  # what the coda / final norm / head read

``state`` is a plain ``dict`` of tensors (compile-friendly). A rule is one small ``nn.Module``: its
parameters are shared over iterations and token positions. Rules that need past iterations keep them
in ``state``; rules that need ``(t, Δt)`` read ``ctx.iteration`` / ``ctx.num_loops`` /
``ctx.train_loops``; rules with token-axis mixers get decoding cache slots from
``ctx.cache_slot(key, factory)``, one per loop iteration.
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
    """Where the driver is: iteration ``k`` of ``num_loops`` (``r``); ``train_loops`` is the config's K."""

    iteration: int = 0
    num_loops: int = 1
    train_loops: int = 1
    forward: Any = None  # the blocks' ForwardContext (rope, masks)
    cache: Any = None  # LoopCache or None
    extras: dict = field(default_factory=dict)  # rule-specific inference options (e.g. timestep grid)

    def cache_slot(self, key, factory: Callable[[], Any]):
        """A decoding cache slot owned by the rule (``None`` when not decoding)."""
        if self.cache is None:
            return None
        return self.cache.slot(("rule", key), factory)


class RecurrenceRule(nn.Module):
    """Base class; the defaults implement the vanilla rule ``Z^{k+1} = H^k``."""

    rule_name: ClassVar[str] = "base"

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
    def begin(self, h0: torch.Tensor, ctx: LoopContext) -> dict:
        return {"h": h0}

    def next_input(self, state: dict, ctx: LoopContext) -> torch.Tensor:
        return state["h"]

    def step(self, state: dict, h: torch.Tensor, ctx: LoopContext) -> dict:
        return {**state, "h": h}

    def finish(self, state: dict, ctx: LoopContext) -> torch.Tensor:
        return state["h"]

    def block_modulation(self, ctx: LoopContext):
        """``None`` or one :class:`~looplm.blocks.BranchModulation` per core block for iteration ``ctx.iteration``."""
        return None

    def extra_repr(self) -> str:
        return f"rule={self.rule_name!r}"
