"""Initial-state injection (recurrence-effectiveness paper, "initial-state injection").

An adapter at the entrance of the shared stack mixes the current recurrent state ``h_ℓ`` with the
initial state ``h_0`` (the prelude output; the token embedding when ``p = 0``, as in the paper's
BaseLoop experiments). Each transition is ``h_{ℓ+1} = F_θ(A(h_ℓ, h_0))`` for ``ℓ = 0 .. r−1``, with
``A`` one of (the equations were lost in extraction; this is our reading, ``../shared/DESIGN.md``):

==========================  ======================================  ========================  ===========
form                        ``A(h, h_0)``                           initialisation            parameters
==========================  ======================================  ========================  ===========
``scalar``                  ``h + α·h_0``                           ``α = 0``                 ``1``
``channel``                 ``a ⊙ h + b ⊙ h_0``                     ``a = 1, b = 0``          ``2d``
``residual_channel``        ``(1 + δ_a) ⊙ h + b ⊙ h_0``             ``δ_a = b = 0``           ``2d``
``dense``                   ``[W_h W_0]·[h; h_0]`` (bias-free)      ``[W_h W_0] = [I_d 0]``   ``2d²``
==========================  ======================================  ========================  ===========

Every form is the identity on the current state at initialisation, so an injected model starts as
the plain BaseLoop with the same weights. The parameters are shared over iterations and positions,
are unconstrained, and are marked ``_no_muon`` so that they are optimised by AdamW (the paper's
optimizer section gives Muon only the attention and feed-forward matrices).

The adapter is applied at every iteration including the first (``h_1 = F_θ(A(h_0, h_0))``).
:class:`InjectionAdapter` is also used by :mod:`.history` for the combined variant.

Huginn / Raven (Geiping et al. 2025) is the ``dense`` form with two options: the state starts from a random
``s_0`` instead of ``h_0`` (``init_state: normal``, :mod:`.state_init`: ``s_{ℓ+1} = F_θ([W_h W_0]·[s_ℓ; h_0])``,
their adapter on ``[state; prelude output]``) and the loop's output goes through the model's final norm
before the coda (``finish_norm``: their ``ln_f`` used twice, after the core and at the end).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import RecurrenceRule, register_rule
from .state_init import initial_state, init_state_errors

FORMS = ("scalar", "channel", "residual_channel", "dense")


class InjectionAdapter(nn.Module):
    """``A(h, h_0)`` of one of :data:`FORMS` (see the module docstring); ``extra_params(d)`` is its size."""

    def __init__(self, d: int, form: str):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"injection form must be one of {list(FORMS)}, got {form!r}")
        self.form, self.d = form, d
        if form == "scalar":
            self.alpha = nn.Parameter(torch.zeros(()))
        elif form == "channel":
            self.a = nn.Parameter(torch.ones(d))
            self.b = nn.Parameter(torch.zeros(d))
        elif form == "residual_channel":
            self.delta_a = nn.Parameter(torch.zeros(d))
            self.b = nn.Parameter(torch.zeros(d))
        else:  # dense: one bias-free projection of the concatenation [h; h_0] (an nn.Linear, so FLOPs count it)
            self.proj = nn.Linear(2 * d, d, bias=False)
        for p in self.parameters():
            p._no_muon = True  # AdamW, not Muon (paper, optimizer section)
            # decayed like the matrices: the paper notes that regularising a favours a state scale of
            # zero and regularising δ_a favours one, i.e. these scales are weight-decayed
            p._weight_decay = True
        self.looplm_init()

    @staticmethod
    def extra_params(form: str, d: int) -> int:
        """The paper's count: ``1, 2d, 2d, 2d²``."""
        return {"scalar": 1, "channel": 2 * d, "residual_channel": 2 * d, "dense": 2 * d * d}[form]

    def looplm_init(self) -> None:
        """Identity on the current state (runs after the model's N(0, 0.02) initialisation)."""
        with torch.no_grad():
            if self.form == "scalar":
                self.alpha.zero_()
            elif self.form == "channel":
                self.a.fill_(1.0)
                self.b.zero_()
            elif self.form == "residual_channel":
                self.delta_a.zero_()
                self.b.zero_()
            elif not self.proj.weight.is_meta:
                self.proj.weight.zero_()
                self.proj.weight[:, : self.d].copy_(torch.eye(self.d))  # [W_h W_0] = [I_d 0]

    def precompute(self, h0: torch.Tensor) -> torch.Tensor:
        """The part of ``A`` that depends on ``h_0`` only (computed once per forward): ``[B, T, d]``."""
        if self.form == "scalar":
            return self.alpha * h0
        if self.form == "dense":
            return h0 @ self.proj.weight[:, self.d :].T  # W_0 h_0
        return self.b * h0

    def forward(self, h: torch.Tensor, h0_term: torch.Tensor) -> torch.Tensor:
        """``A(h, h_0)`` from ``h [B, T, d]`` and ``h0_term = precompute(h_0)``."""
        if self.form == "scalar":
            return h + h0_term
        if self.form == "channel":
            return self.a * h + h0_term
        if self.form == "residual_channel":
            return (1 + self.delta_a) * h + h0_term
        return h @ self.proj.weight[:, : self.d].T + h0_term  # W_h h + W_0 h_0

    def extra_repr(self) -> str:
        return f"form={self.form!r}, d={self.d}"


@register_rule("injection")
class Injection(RecurrenceRule):
    """``Z^ℓ = A(h_ℓ, h_0)``, ``h_{ℓ+1} = H^ℓ = F_θ(Z^ℓ)`` (see the module docstring).

    Options:
        form: ``scalar`` | ``channel`` | ``residual_channel`` | ``dense``.
        init_state: the state before the first iteration, ``prelude`` (``h_0``, the default) | ``zeros`` |
            ``normal`` (Huginn's random state, :mod:`.state_init`), with ``init_std`` (σ) and ``init_seed``
            (an int: deterministic per token position; ``null``: fresh draws each forward).
        finish_norm: the loop's output goes through the model's final norm before the coda (Huginn).
    """

    loop_options = ("initial_state",)  # a given s_0 [B, T, d] for one forward (Huginn's input_states)

    def __init__(
        self,
        cfg,
        *,
        form: str = "scalar",
        init_state: str = "prelude",
        init_std: float = 0.02,
        init_seed: int | None = 0,
        finish_norm: bool = False,
    ):
        super().__init__(cfg)
        self.inject = InjectionAdapter(cfg.d_model, form)
        self.init_state, self.init_std, self.init_seed = init_state, float(init_std), init_seed
        self.finish_norm = bool(finish_norm)

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        errs = super().validate_options(options)
        form = options.get("form", "scalar")
        if form not in FORMS:
            errs.append(f"options.form: must be one of {list(FORMS)}, got {form!r}")
        if "finish_norm" in options and not isinstance(options["finish_norm"], bool):
            errs.append(f"options.finish_norm: must be true or false, got {options['finish_norm']!r}")
        return errs + init_state_errors(options)

    def begin(self, h0, lctx):
        s0 = initial_state(h0, lctx, self.init_state, self.init_std, self.init_seed)  # [B, T, d]
        return {"h": s0, "h0_term": self.inject.precompute(h0)}

    def next_input(self, state, lctx):
        return self.inject(state["h"], state["h0_term"])  # Z^ℓ = A(h_ℓ, h_0)  [B, T, d]

    def finish(self, state, lctx):
        return lctx.final_norm(state["h"]) if self.finish_norm else state["h"]


__all__ = ["FORMS", "InjectionAdapter", "Injection"]
