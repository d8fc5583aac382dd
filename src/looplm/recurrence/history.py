"""History-state injection (recurrence-effectiveness paper, Eq. 3 with scalar lag operators).

With the scalar lag-specific operators ``B_j(x) = β_j x`` each transition is (our reading of the lost
equation, ``../shared/DESIGN.md``)::

    h_{ℓ+1} = F_θ( h_ℓ + Σ_{j=1..m_ℓ} β_j (h_{ℓ−j} − h_ℓ) ),        m_ℓ = min(w, ℓ − 1),  m_0 = 0

* The window of transition ``h_ℓ → h_{ℓ+1}`` holds the ``m_ℓ`` most recent *completed* states
  ``h_{ℓ−1}, …, h_{ℓ−m_ℓ}``, indexed by the relative lag ``j``. It excludes the current state ``h_ℓ``
  (the reference point of every difference) and the embedding state ``h_0`` (reserved for initial-state
  injection). So ``m_0 = m_1 = 0``: the first two transitions are plain BaseLoop,
  ``h_1 = F_θ(h_0)`` and ``h_2 = F_θ(h_1)``; the first history-dependent one is
  ``h_3 = F_θ(h_2 + β_1 (h_1 − h_2))``. Once more than ``w`` states are available only the ``w``
  most recent are kept.
* ``β_1 … β_w`` are unconstrained, zero at initialisation, depend on the lag only and are shared over
  iterations and positions: exactly ``w`` extra parameters, and BaseLoop exactly at initialisation.
* Buffered states are **not** detached: gradients flow through them (full backpropagation in time).

Combined variant (option ``inject``): initial-state injection (:mod:`.injection`) and history enter
additively and do not interact — the differences are taken against the recurrent state ``h_ℓ``, not
against the injected input::

    h_{ℓ+1} = F_θ( A(h_ℓ, h_0) + Σ_{j=1..m_ℓ} β_j (h_{ℓ−j} − h_ℓ) )

(for ``inject: scalar``, ``A(h, h_0) = h + α h_0``; ``α = β_j = 0`` at initialisation). The extra
parameters are ``w`` plus those of the injection form.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import RecurrenceRule, register_rule
from .injection import FORMS, InjectionAdapter


@register_rule("history")
class History(RecurrenceRule):
    """History-state injection over a window of ``w`` completed states (see the module docstring).

    Options:
        window: ``w >= 1``, the number of lags (and of ``β`` coefficients).
        inject: ``None`` (history only) or an initial-state injection form, combined additively.
    """

    def __init__(self, cfg, *, window: int = 1, inject: str | None = None):
        super().__init__(cfg)
        self.window = window
        self.beta = nn.Parameter(torch.zeros(window))  # β_j for lags j = 1..w
        self.beta._no_muon = True
        self.inject = InjectionAdapter(cfg.d_model, inject) if inject is not None else None

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        errs = super().validate_options(options)
        w = options.get("window", 1)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            errs.append(f"options.window: the history window must be an int >= 1, got {w!r}")
        inj = options.get("inject")
        if inj is not None and inj not in FORMS:
            errs.append(f"options.inject: must be null (history only) or one of {list(FORMS)}, got {inj!r}")
        return errs

    def looplm_init(self) -> None:
        with torch.no_grad():
            self.beta.zero_()

    def begin(self, h0, lctx):
        state = {"h": h0, "past": []}  # past: [h_{ℓ-m}, ..., h_{ℓ-1}], oldest first, never h_0
        if self.inject is not None:
            state["h0_term"] = self.inject.precompute(h0)
        return state

    def next_input(self, state, lctx):
        h = state["h"]  # h_ℓ  [B, T, d]
        z = h if self.inject is None else self.inject(h, state["h0_term"])
        # lag j = 1 is the newest buffered state h_{ℓ-1}
        for j, past in enumerate(reversed(state["past"])):
            z = z + self.beta[j] * (past - h)
        return z

    def step(self, state, h, lctx):
        # h_ℓ joins the window once it is a completed state other than h_0 (ℓ >= 1)
        past = state["past"] + [state["h"]] if lctx.iteration > 0 else state["past"]
        return {**state, "h": h, "past": past[-self.window :]}

    def extra_repr(self) -> str:
        return f"window={self.window}, inject={None if self.inject is None else self.inject.form!r}"


__all__ = ["History"]
