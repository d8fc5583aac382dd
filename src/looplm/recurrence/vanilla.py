"""Vanilla looped rule (Universal Transformer, Dehghani et al. 2019; StateLoop "Vanilla Looped";
Looped-Mamba ``h^{(r)} = M_θ(h^{(r−1)})``): each core output is the next core input, ``Z^{k+1} = H^k``.
No parameters.

Option ``inter_norm`` (Nanbeige4.2's ``skip_loop_final_norm: false``): the model's final RMSNorm ``N``
(``lctx.final_norm``, its weights shared) between passes, ``Z^{k+1} = N(H^k)``; the head still reads
``N(H^{r−1})`` through the model's own final norm, so the norm ends every pass, the last one included — the
exit gate's option of the same name without the gate."""

from __future__ import annotations

from .base import RecurrenceRule, register_rule


@register_rule("vanilla")
class Vanilla(RecurrenceRule):
    """``Z^0 = h0``, ``Z^{k+1} = H^k`` (or ``N(H^k)`` with ``inter_norm``), output ``H^{r−1}``."""

    def __init__(self, cfg, *, inter_norm: bool = False):
        super().__init__(cfg)
        self.inter_norm = bool(inter_norm)

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        errs = super().validate_options(options)
        if "inter_norm" in options and not isinstance(options["inter_norm"], bool):
            errs.append(f"options.inter_norm: must be true or false, got {options['inter_norm']!r}")
        return errs

    def next_input(self, state, lctx):
        if self.inter_norm and lctx.iteration > 0:
            return lctx.final_norm(state["h"])  # [B, T, d]
        return state["h"]
