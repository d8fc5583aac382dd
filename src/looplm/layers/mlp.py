"""SwiGLU feed-forward network (Shazeer 2020), bias-free as in Llama / Qwen3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import linear_group


class SwiGLU(nn.Module):
    """``down( silu(gate(x)) ⊙ up(x) )`` with hidden width ``d_ff``. Parameter names follow HF Llama."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, d] -> [B, T, d_ff] -> [B, T, d]
        gate, up = linear_group(x, (self.gate_proj, self.up_proj))  # a dispatch point (looplm.dispatch)
        return self.down_proj(F.silu(gate) * up)
