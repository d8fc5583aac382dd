"""Timestep conditioning (recurrence-effectiveness paper, "timestep conditioning").

The loop is read as an integrator on a grid of ``T`` steps: at iteration ``ℓ`` the time is
``t_ℓ = ℓ / T`` and the step ``Δt = 1 / T``. A fixed featurisation ``ψ_ℓ = ψ(t_ℓ, Δt) ∈ R^8``
conditions the update. The paper's ``ψ`` and update equations were lost in extraction; this module
implements our reading (``../shared/DESIGN.md``).

The features (our design; every entry is bounded for ``t ∈ [0, 1)``, ``Δt ∈ (0, 1]``)::

    ψ(t, Δt) = [ 1, t, t², sin(πt), cos(πt), sin(2πt), cos(2πt), Δt ]

a bias, a quadratic trend in ``t``, two Fourier harmonics of the position on the grid, and the step
size itself (the only way the step size enters: the updates have no ``Δt`` multiplier).

Variants (option ``gating``); ``k`` indexes a layer of the loop (the paper's ``K`` = the ``s`` blocks
of the core) and ``b ∈ {attn, mlp}`` its residual branch with RMSNorm ``N_k^b`` (whose own weights
are kept):

* ``loop`` — Loop Gating, ``q ∈ R^8`` gates the whole loop update (the "loop-level mixing" after the
  last shared block)::

      h_{ℓ+1} = h_ℓ + g_ℓ · (F_θ(h_ℓ) − h_ℓ),        g_ℓ = 1 + qᵀψ_ℓ                 (8 parameters)

* ``branch`` — Branch Gating, a scalar gate per layer and branch, broadcast over channels::

      u ← u + g_k^b · B_k^b(N_k^b(u)),              g_k^b = 1 + (q_k^b)ᵀψ_ℓ          (16K parameters)

* ``adaln`` — AdaLN, per layer and branch a norm scale and a branch gate, both ``d``-vectors, no
  timestep-dependent shift (four ``d``-vectors per layer)::

      u ← u + γ_k^b ⊙ B_k^b(σ_k^b ⊙ N_k^b(u)),      [σ_k^b − 1; γ_k^b − 1] = W_k^b ψ_ℓ,  W_k^b ∈ R^{2d×8}
                                                                                     (32Kd parameters)

``q``, ``q_k^b`` and ``W_k^b`` start at zero: every gate is one and every extra scale zero, which is
exactly the unconditioned BaseLoop. They are unconstrained, shared over positions and iterations,
distinct over layers and branches, and optimised by AdamW (marked ``_no_muon``).

Grids (training uses ``T = L_train = K``). At inference with ``r = L_infer`` loops, chosen through
``loop_options={"grid": ...}`` (or the rule option ``grid`` as the default):

* ``prefix`` — keep ``T = K`` and run the first ``r`` steps; needs ``r <= K``;
* ``rescaled`` — ``T = r`` (``t_ℓ = ℓ / r``, ``Δt = 1 / r``), any ``r``; with per-sequence loop counts
  every row uses its own ``r``;
* ``auto`` (default) — ``prefix`` when ``r <= K``, ``rescaled`` otherwise.

In every case ``ℓ = 0 .. r − 1``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..context import BlockModulation, BranchModulation
from .base import LoopContext, RecurrenceRule, register_rule

GATINGS = ("loop", "branch", "adaln")
GRIDS = ("auto", "prefix", "rescaled")
N_FEATURES = 8


def psi(t: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """``ψ(t, Δt)`` — ``t``, ``Δt``: tensors of the same shape ``S`` -> features ``[*S, 8]``."""
    pi_t = math.pi * t
    feats = [
        torch.ones_like(t),
        t,
        t * t,
        torch.sin(pi_t),
        torch.cos(pi_t),
        torch.sin(2 * pi_t),
        torch.cos(2 * pi_t),
        dt,
    ]
    return torch.stack(feats, dim=-1)


def grid_steps(lctx: LoopContext, default: str = "auto") -> tuple[str, int | torch.Tensor]:
    """The grid in use and its number of steps ``T`` (an int, or ``[B]`` per-sequence counts)."""
    grid = lctx.loop_options.get("grid", default)
    if grid not in GRIDS:
        raise ValueError(f"loop_options['grid'] must be one of {list(GRIDS)}, got {grid!r}")
    r, K, rows = lctx.num_loops, lctx.train_loops, lctx.loops_per_row
    if grid == "auto":
        if rows is not None:  # each sequence decides for itself, so a row in a batch equals the row alone
            return grid, torch.where(rows <= K, torch.full_like(rows, K), rows)
        grid = "prefix" if r <= K else "rescaled"
    if grid == "prefix":
        if r > K:
            raise ValueError(
                f"prefix inference keeps the training grid (T = {K}) and can run at most {K} loops, asked for {r}; "
                "use loop_options={'grid': 'rescaled'} (T = r) for deeper inference"
            )
        return grid, K
    return grid, (rows if rows is not None else r)


@register_rule("timestep")
class TimestepConditioning(RecurrenceRule):
    """Loop Gating, Branch Gating or AdaLN conditioned on ``ψ(t_ℓ, Δt)`` (see the module docstring).

    Options:
        gating: ``loop`` | ``branch`` | ``adaln``.
        grid: the default inference grid, ``auto`` | ``prefix`` | ``rescaled`` (``loop_options`` wins).
    """

    loop_options = ("grid",)

    def __init__(self, cfg, *, gating: str = "loop", grid: str = "auto"):
        super().__init__(cfg)
        self.gating, self.grid = gating, grid
        s, d = cfg.n_core, cfg.d_model
        if gating == "loop":
            self.q = nn.Parameter(torch.zeros(N_FEATURES))  # q ∈ R^8
        elif gating == "branch":
            self.q = nn.Parameter(torch.zeros(s, 2, N_FEATURES))  # q_k^b: layer, branch (attn, mlp)
        else:
            self.W = nn.Parameter(torch.zeros(s, 2, 2, d, N_FEATURES))  # W_k^b: layer, branch, (scale, gate), d, 8
        for p in self.parameters():
            p._no_muon = True  # AdamW (paper, optimizer section)

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        errs = super().validate_options(options)
        if options.get("gating", "loop") not in GATINGS:
            errs.append(f"options.gating: must be one of {list(GATINGS)}, got {options.get('gating')!r}")
        if options.get("grid", "auto") not in GRIDS:
            errs.append(f"options.grid: must be one of {list(GRIDS)}, got {options.get('grid')!r}")
        return errs

    @staticmethod
    def extra_params(gating: str, n_core: int, d: int) -> int:
        """The paper's count: ``8``, ``16K``, ``32Kd`` (``K`` = layers in the loop = ``n_core``)."""
        return {"loop": N_FEATURES, "branch": 2 * N_FEATURES * n_core, "adaln": 4 * N_FEATURES * n_core * d}[gating]

    def looplm_init(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()

    def features(self, lctx: LoopContext) -> torch.Tensor:
        """``ψ_ℓ``: ``[8]``, or ``[B, 8]`` when each sequence has its own rescaled grid."""
        p = next(self.parameters())
        _, T = grid_steps(lctx, self.grid)
        T = torch.as_tensor(T, dtype=p.dtype, device=p.device)  # [] or [B]
        t = torch.full_like(T, float(lctx.iteration)) / T  # t_ℓ = ℓ / T
        return psi(t, 1.0 / T)

    def block_modulation(self, state, lctx):
        if self.gating == "loop":
            return None
        f = self.features(lctx)  # [8] or [B, 8]
        per_row = f.dim() == 2
        if self.gating == "branch":
            g = 1 + (self.q @ f.T if per_row else self.q @ f)  # [s, 2, B] or [s, 2]
            if per_row:
                g = g[..., None, None]  # [s, 2, B, 1, 1]
            return [
                BlockModulation(mixer=BranchModulation(gate=g[k, 0]), mlp=BranchModulation(gate=g[k, 1]))
                for k in range(g.shape[0])
            ]
        v = 1 + (
            torch.einsum("kbvdf,Bf->kbvBd", self.W, f)[..., None, :] if per_row else self.W @ f
        )  # [s, 2, 2, (B, 1,) d]
        return [
            BlockModulation(
                mixer=BranchModulation(scale=v[k, 0, 0], gate=v[k, 0, 1]),
                mlp=BranchModulation(scale=v[k, 1, 0], gate=v[k, 1, 1]),
            )
            for k in range(v.shape[0])
        ]

    def step(self, state, h, lctx):
        if self.gating != "loop":
            return {**state, "h": h}
        f = self.features(lctx)  # [8] or [B, 8]
        c = f @ self.q  # g_ℓ − 1 = qᵀψ_ℓ: [] or [B]
        if c.dim() == 1:
            c = c[:, None, None]  # [B, 1, 1]
        # h_{ℓ+1} = h_ℓ + g_ℓ (F_θ(h_ℓ) − h_ℓ), written as F_θ(h_ℓ) + (g_ℓ − 1)(F_θ(h_ℓ) − h_ℓ) so that
        # g_ℓ = 1 returns F_θ(h_ℓ) bit for bit
        return {**state, "h": h + c * (h - state["h"])}

    def extra_repr(self) -> str:
        return f"gating={self.gating!r}, grid={self.grid!r}"


__all__ = ["GATINGS", "GRIDS", "N_FEATURES", "TimestepConditioning", "grid_steps", "psi"]
