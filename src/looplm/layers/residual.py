"""A residual mixer branch over a sequence of states: ``S + mixer(RMSNorm(S))``.

StateLoop's state mixers (eqs. 8, 9: an attention or Mamba-2 mixer over the per-token states ``S̃``, one
module shared across loop iterations) are this branch. It lives with the layers so that the fused decode
step (:mod:`looplm.kernels.decode`) can run it as it runs a block's mixer branch.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualMixer(nn.Module):
    """``S = S̃ + mixer(RMSNorm_m(S̃))`` with ``mixer(x, fctx, cache)`` a token mixer (attention, Mamba-2)."""

    def __init__(self, d_s: int, mixer: nn.Module, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(d_s, eps=eps)  # RMSNorm_m
        self.mixer = mixer

    def new_cache(self, batch_size: int, capacity: int | None = None):
        """The mixer's decoding slot (attention: KV preallocated for ``capacity`` tokens when given)."""
        return self.mixer.new_cache(batch_size, capacity=capacity)

    def forward(self, S: torch.Tensor, fctx, cache=None) -> torch.Tensor:
        # S [B, T, d_s] -> [B, T, d_s]
        return S + self.mixer(self.norm(S), fctx, cache)
