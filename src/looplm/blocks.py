"""Residual blocks: one pre-norm mixer branch (attention or Mamba-2) and an optional SwiGLU branch.

* Transformer block (Llama / Qwen3):   ``x += Attn(N₁(x))``;  ``x += MLP(N₂(x))``
* Mamba-2 block (mamba_ssm ``Block`` with ``d_intermediate = 0``): ``x += Mamba2(N₁(x))``
* Hybrid stacks: Mamba-2 blocks everywhere except ``attn_layer_idx`` (attention, no MLP when
  ``d_ff = 0``), as in the Looped-Mamba paper (§E.4).

Timestep conditioning (recurrence-effectiveness paper, §3.3) needs hooks inside each branch: a
block accepts an optional :class:`BranchModulation` per call, ``u ← u + g ⊙ B(s ⊙ N(u))``, where the
rule supplies the norm scale ``s`` and the branch gate ``g`` (``None`` = 1). Without it the block is
the plain pre-norm residual block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .layers.attention import Attention, KVCache
from .layers.mlp import SwiGLU


@dataclass
class BranchModulation:
    """Multipliers applied inside a block's branches; each is ``None`` (= 1) or broadcastable to ``[B, T, d]``."""

    mixer_scale: torch.Tensor | None = None
    mixer_gate: torch.Tensor | None = None
    mlp_scale: torch.Tensor | None = None
    mlp_gate: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """Per-forward information shared by every block (built once by the model)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [B, T, rot]
    attn_mask: torch.Tensor | None = None  # bool [B, 1, T, T_past+T]; None = plain causal
    is_causal: bool = True
    pad_mask: torch.Tensor | None = None  # bool [B, T], True = real token (left padding)


def _branch(x, norm, fn, scale, gate):
    u = norm(x)
    if scale is not None:
        u = u * scale
    y = fn(u)
    if gate is not None:
        y = y * gate
    return x + y


class Block(nn.Module):
    """Physical block ``layer_idx`` of the stack (mixer chosen by ``cfg.mixer_of(layer_idx)``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = cfg.mixer_of(layer_idx)
        d = cfg.d_model
        self.mixer_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        if self.kind == "attention":
            a = cfg.attention
            self.mixer = Attention(
                d, a.n_heads, cfg.n_kv_heads, cfg.head_dim, qk_norm=a.qk_norm, norm_eps=cfg.norm_eps, bias=a.bias
            )
        else:
            from .layers.mamba2 import Mamba2Mixer

            m = cfg.mamba
            self.mixer = Mamba2Mixer(
                d,
                expand=m.expand,
                d_state=m.d_state,
                d_conv=m.d_conv,
                headdim=m.headdim,
                ngroups=m.ngroups,
                chunk_size=m.chunk_size,
                conv_bias=m.conv_bias,
                bias=m.bias,
                norm_eps=cfg.norm_eps,
            )
        if cfg.d_ff > 0:
            self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
            self.mlp = SwiGLU(d, cfg.d_ff)
        else:
            self.mlp_norm = self.mlp = None

    def new_cache(self, batch_size: int, device=None, dtype=None):
        """An empty decoding cache slot for this block (KV for attention, (conv, ssm) for Mamba-2)."""
        if self.kind == "attention":
            return KVCache()
        return self.mixer.allocate_state(batch_size, device=device, dtype=dtype)

    def _mix(self, u: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        if self.kind == "attention":
            return self.mixer(u, ctx.rope, attn_mask=ctx.attn_mask, is_causal=ctx.is_causal, cache=cache)
        return self.mixer(u, pad_mask=ctx.pad_mask, state=cache)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache=None, mod: BranchModulation | None = None):
        # x [B, T, d] -> [B, T, d]
        m = mod or BranchModulation()
        x = _branch(x, self.mixer_norm, lambda u: self._mix(u, ctx, cache), m.mixer_scale, m.mixer_gate)
        if self.mlp is not None:
            x = _branch(x, self.mlp_norm, self.mlp, m.mlp_scale, m.mlp_gate)
        return x


class Stack(nn.Module):
    """A run of physical blocks executed in order (prelude, core, or coda)."""

    def __init__(self, cfg: ModelConfig, first: int, n: int):
        super().__init__()
        self.first = first
        self.blocks = nn.ModuleList(Block(cfg, first + i) for i in range(n))

    def __len__(self) -> int:
        return len(self.blocks)

    def forward(self, x, ctx: ForwardContext, caches=None, mods=None):
        """``caches``/``mods``: ``None`` or one entry per block."""
        for i, blk in enumerate(self.blocks):
            x = blk(x, ctx, None if caches is None else caches[i], None if mods is None else mods[i])
        return x
