"""Recurrence rules: one small module per paper design for what passes between loop iterations."""

from .base import RULES, LoopContext, RecurrenceRule, register_rule
from .vanilla import Vanilla

__all__ = ["RULES", "LoopContext", "RecurrenceRule", "register_rule", "Vanilla", "build_rule"]


def build_rule(cfg) -> RecurrenceRule:
    """Instantiate ``cfg.rule.name`` with ``cfg.rule.options``."""
    return RULES[cfg.rule.name](cfg, **cfg.rule.options)
