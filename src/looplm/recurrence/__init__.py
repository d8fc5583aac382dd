"""Recurrence rules: one small module per paper design for what passes between loop iterations."""

from .base import RULES, LoopContext, RecurrenceRule, register_rule
from .vanilla import Vanilla
from . import history, injection, timestep  # noqa: F401,E402  (register: injection, history, timestep)
from . import stateloop  # noqa: F401,E402  (register: stateloop, stateloop-state-only)
from . import hyperloop, mesh, parcae, ponderlm  # noqa: F401,E402  (register: StateLoop's comparison models)
from . import exit_gate  # noqa: F401,E402  (register: exit_gate, Looped-Mamba App. B)

from ..config import register_validator  # noqa: E402

__all__ = ["RULES", "LoopContext", "RecurrenceRule", "register_rule", "Vanilla", "build_rule", "rule_errors"]


def rule_errors(cfg) -> list[str]:
    """``rule.name`` is a registered rule and ``rule.options`` are its options (the model config's check)."""
    name = cfg.rule.name
    if name not in RULES:
        from ..dataclass_util import _suggest

        return [f"rule.name: unknown rule {name!r}{_suggest(name, sorted(RULES))}; known: {sorted(RULES)}"]
    return [e if e.startswith("rule.") else f"rule.{e}" for e in RULES[name].validate_options(cfg.rule.options)]


register_validator(rule_errors)


def build_rule(cfg) -> RecurrenceRule:
    """Instantiate ``cfg.rule.name`` with ``cfg.rule.options``."""
    return RULES[cfg.rule.name](cfg, **cfg.rule.options)
