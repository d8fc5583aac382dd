"""Recurrence rules: one small module per paper design for what passes between loop iterations."""

from .base import RULES, LoopContext, RecurrenceRule, register_rule
from .vanilla import Vanilla
from . import history, injection, timestep  # noqa: F401,E402  (register: injection, history, timestep)
from . import stateloop  # noqa: F401,E402  (register: stateloop, stateloop-state-only)
from . import hyperloop, mesh, parcae, ponderlm  # noqa: F401,E402  (register: StateLoop's comparison models)
from . import exit_gate  # noqa: F401,E402  (register: exit_gate, Looped-Mamba App. B)

__all__ = ["RULES", "LoopContext", "RecurrenceRule", "register_rule", "Vanilla", "build_rule"]


def build_rule(cfg) -> RecurrenceRule:
    """Instantiate ``cfg.rule.name`` with ``cfg.rule.options``."""
    return RULES[cfg.rule.name](cfg, **cfg.rule.options)
