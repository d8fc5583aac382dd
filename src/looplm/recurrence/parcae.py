"""Parcae (Prairie, Novack, Berg-Kirkpatrick, Fu 2026, "Parcae: scaling laws for stable looped
language models"; StateLoop ref. [16]): a prelude / recurrent core / coda model whose loop is read as
a discretised linear dynamical system with a *constrained* state transition.

With ``e = RMSNorm(P(E))`` the normalised prelude output and ``h_t`` the recurrent state,

.. code-block:: text

    Ā = exp(−Δ ⊙ A),   A = exp(A_log) > 0,   Δ = softplus(dt_bias) > 0       (diagonal, per channel)
    B̄ = Δ ⊙ B                                                                 (B ∈ R^{d×d})
    h_{t+1} = R( Ā ⊙ h_t + B̄ e )                                              (injection, then the core)
    y = C h_T  → coda → norm → head                                           (C ∈ R^{d×d})

Since ``Δ·A > 0`` every entry of ``Ā`` lies in ``(0, 1)``: the spectral norm of the state transition
``diag(Ā)`` is below 1 *by construction* (a parametrisation, so it keeps holding after any optimizer
step — tested). Parcae's argument: an unconstrained injection (``h + e`` or a free linear map of
``[h, e]``) lets ``‖Ā‖`` exceed 1 and the residual stream explode; the negative-diagonal
discretisation (as in an SSM's zero-order hold) rules that out.

Mapped onto the driver: ``begin`` normalises the prelude output into ``e`` and sets ``h_0``;
``next_input`` returns ``Z^k = Ā h_k + B̄ e``; the core gives ``H^k = h_{k+1}``; ``finish`` applies ``C``.
Per-sequence depth (Parcae trains with a per-sequence Poisson loop count and truncated backprop)
is the driver's ``num_loops=[B] tensor`` plus ``num_grad_loops``; :func:`sample_sequence_depths`
draws such counts the way Parcae's "poisson-truncated-full" scheme does.

Parameters: ``A_log, dt_bias ∈ R^d``, ``B, C ∈ R^{d×d}`` and the prelude norm ``∈ R^d``: ``2d² + 3d``.
With the StateLoop comparison's 8 / 8 / 8 layers, 10 repetitions, d = 2048 this is 8,394,752
parameters, 1,429,315,584 in all = 1429.32M (StateLoop Tab. 1).

Choices that are ours (the published code offers several options; we fix one):

* ``h_0 = 0`` (Parcae's code can also start from noise; a deterministic start keeps cached decoding
  and padded batches exact);
* initialisation as Parcae's defaults: ``A = 1`` (``A_log = 0``), ``Δ`` such that ``Ā = sqrt(1/5)``,
  ``B = I``; and ``C = I`` (the coda reads the state unchanged at init);
* the norm on the prelude output is an RMSNorm (the backbone's norm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import RecurrenceRule, register_rule


@register_rule("parcae")
class Parcae(RecurrenceRule):
    """Constrained diagonal injection ``Z^k = exp(−ΔA) h_k + ΔB e`` around the core, readout ``C h``."""

    def __init__(self, cfg, *, init_decay: float = math.sqrt(1 / 5)):
        super().__init__(cfg)
        if not 0.0 < init_decay < 1.0:
            raise ValueError(f"parcae: init_decay must be in (0, 1) (the initial entries of Ā), got {init_decay}")
        d = cfg.d_model
        self.init_decay = init_decay
        self.prelude_norm = nn.RMSNorm(d, eps=cfg.norm_eps)  # e = RMSNorm(P(E))
        self.A_log = nn.Parameter(torch.zeros(d))  # A = exp(A_log) > 0
        self.dt_bias = nn.Parameter(torch.zeros(d))  # Δ = softplus(dt_bias) > 0
        self.B = nn.Parameter(torch.empty(d, d))  # input matrix
        self.C = nn.Linear(d, d, bias=False)  # state -> coda input
        for p in (self.A_log, self.dt_bias):
            p._no_muon = True  # vectors go to AdamW

    def looplm_init(self):
        with torch.no_grad():
            self.A_log.zero_()
            dt = -math.log(self.init_decay)  # Δ·A = Δ at A = 1: Ā = exp(−Δ) = init_decay
            self.dt_bias.fill_(dt + math.log(-math.expm1(-dt)))  # inverse softplus
            self.B.copy_(torch.eye(self.B.shape[0]))
            self.C.weight.copy_(torch.eye(self.C.weight.shape[0]))

    # --- the discretised system ------------------------------------------------------------------
    def transition(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Ā [d], Δ [d])``: the diagonal state transition (entries in (0, 1)) and the step sizes."""
        delta = F.softplus(self.dt_bias)
        return torch.exp(-delta * torch.exp(self.A_log)), delta

    @torch.no_grad()
    def spectral_norm(self) -> float:
        """``‖diag(Ā)‖₂ = max_i Ā_i`` — below 1 for every value of the parameters."""
        return float(self.transition()[0].max())

    # --- the loop protocol -----------------------------------------------------------------------
    def begin(self, h0, lctx):
        e = self.prelude_norm(h0)  # [B, T, d]
        return {"h": torch.zeros_like(e), "e": e}

    def next_input(self, state, lctx):
        a_bar, delta = self.transition()
        return a_bar * state["h"] + delta * (state["e"] @ self.B.T)  # Z^k = Ā h_k + B̄ e   [B, T, d]

    def step(self, state, h, lctx):
        return {**state, "h": h}  # h_{k+1} = R(Z^k)

    def finish(self, state, lctx):
        return self.C(state["h"])  # y = C h_r


def sample_sequence_depths(
    batch_size: int, mean_loops: float, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per-sequence loop counts ``[B]`` as Parcae's "poisson-truncated-full" scheme draws them:
    ``r ~ max(1, Poisson(mean_loops))`` per sequence. Pass them as ``model(x, num_loops=r)``
    (and ``num_grad_loops=m`` for Parcae's truncated backprop through the last ``m`` iterations)."""
    if mean_loops <= 0:
        raise ValueError(f"mean_loops must be > 0, got {mean_loops}")
    r = torch.poisson(torch.full((batch_size,), float(mean_loops)), generator=generator)
    return r.clamp(min=1).long()
