"""MeSH — Memory-as-State-Highways (Yu et al. 2026, "MeSH: memory-as-state-highways for recursive
transformers"; StateLoop ref. [26]): the state passed between iterations is an explicit per-token
buffer of ``S`` memory slots; iteration-specific *write* routers decide where each core output is
stored and iteration-specific *read* routers compose the next core input from the slots.

With ``M^k ∈ R^{S×d}`` the buffer of a token, ``h0`` the prelude output and ``ρ(x) = RMSNorm(x)`` (no
learned scale),

.. code-block:: text

    w^j = softmax_S(W^w_j ρ(x_j)),   r^j = softmax_S(W^r_j ρ(x_j))       routers, j = 0 … K
    M^0     = w^0 ⊗ h0                                 x_0 = h0   (the prelude output is written too)
    Z^k     = Σ_s r^k_s M^k_s                          read: input of iteration k (router input x_k)
    H^k     = core(Z^k)
    M^{k+1} = M^k + w^{k+1} ⊗ H^k                      write: x_{k+1} = H^k
    y       = Σ_s r^K_s M^K_s                          final read → coda

so the slots are "highways": information written at any iteration reaches every later one (and the
coda) without passing through the core again, and each iteration decides what it reads — the
paper's remedies for "undifferentiated computation" and "information overload".

Routers: ``W^w_j, W^r_j ∈ R^{S×d}`` for ``j = 0 … K`` (``2(K+1)·S·d`` parameters). At inference past
``K`` the reads ``k ≥ K`` reuse router ``K−1``, the writes ``k+1 > K`` reuse router ``K``; the final read
always uses router ``K``.

Choices that are ours: the exact router form (linear, no bias, on an unscaled RMSNorm of the vector
being written / last written), the additive write, the initial write of ``h0`` and the slot count.
StateLoop prints 1421.51M for MeSH (8 / 8 / 8 layers, 10 repetitions, d = 2048), i.e. 0.58–0.59M
routing parameters; ``S = 13`` slots give ``2·11·13·2048 = 585,728`` and 1,421,506,560 = 1421.51M.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import RecurrenceRule, register_rule


@register_rule("mesh")
class MeSH(RecurrenceRule):
    """A buffer of ``n_slots`` memory slots per token with iteration-specific read / write routers."""

    def __init__(self, cfg, *, n_slots: int = 13):
        super().__init__(cfg)
        if n_slots < 1:
            raise ValueError(f"mesh: n_slots must be >= 1, got {n_slots}")
        d, K = cfg.d_model, cfg.n_loops
        self.n_slots = n_slots
        self.eps = cfg.norm_eps
        self.write = nn.ModuleList(nn.Linear(d, n_slots, bias=False) for _ in range(K + 1))  # W^w_0 … W^w_K
        self.read = nn.ModuleList(nn.Linear(d, n_slots, bias=False) for _ in range(K + 1))  # W^r_0 … W^r_K

    def _route(self, router: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Slot weights ``[B, T, S]`` (a softmax over slots) of ``x [B, T, d]``."""
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return router(x).float().softmax(-1).to(x.dtype)

    def _write(self, M, j, x):
        w = self._route(self.write[min(j, len(self.write) - 1)], x)  # [B, T, S]
        return M + w.unsqueeze(-1) * x.unsqueeze(-2)  # [B, T, S, d]

    def _read(self, M, j, x):
        r = self._route(self.read[j], x)  # [B, T, S]
        return torch.einsum("bts,btsd->btd", r, M)

    def begin(self, h0, lctx):
        M = h0.new_zeros(*h0.shape[:-1], self.n_slots, h0.shape[-1])  # [B, T, S, d]
        return {"M": self._write(M, 0, h0), "last": h0}

    def next_input(self, state, lctx):
        return self._read(state["M"], min(lctx.iteration, len(self.read) - 2), state["last"])  # Z^k

    def step(self, state, h, lctx):
        return {"M": self._write(state["M"], lctx.iteration + 1, h), "last": h}

    def finish(self, state, lctx):
        return self._read(state["M"], len(self.read) - 1, state["last"])  # y = Σ r^K M^K
