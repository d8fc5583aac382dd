"""Vanilla looped rule (Universal Transformer, Dehghani et al. 2019; StateLoop "Vanilla Looped";
Looped-Mamba ``h^{(r)} = M_θ(h^{(r−1)})``): each core output is the next core input, ``Z^{k+1} = H^k``.
No parameters."""

from __future__ import annotations

from .base import RecurrenceRule, register_rule


@register_rule("vanilla")
class Vanilla(RecurrenceRule):
    """``Z^0 = h0``, ``Z^{k+1} = H^k``, output ``H^{r−1}`` (the base-class defaults)."""

    def __init__(self, cfg):
        super().__init__(cfg)
