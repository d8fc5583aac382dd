"""Residual blocks: one token-mixer branch and an optional SwiGLU branch.

* Transformer block (Llama / Qwen3):   ``x += Attn(N₁(x))``;  ``x += MLP(N₂(x))``
* Mamba-2 block (mamba_ssm ``Block`` with ``d_intermediate = 0``): ``x += Mamba2(N₁(x))``
* Hybrid stacks: Mamba-2 blocks everywhere except ``attn_layer_idx`` (attention, no MLP when
  ``d_ff = 0``), as in the Looped-Mamba paper (§E.4).

Norm placement (``ModelConfig.norm_placement``), for each branch ``f`` with input norm ``N`` and,
outside ``pre``, an output norm ``N'`` (one more RMSNorm per branch: ``d`` parameters each):

==============  =======================  ===================================================
``pre``         ``x + f(N(x))``          Llama, Qwen3, Mamba-2 (the default)
``sandwich``    ``x + N'(f(N(x)))``      Ouro (``input_layernorm`` / ``input_layernorm_2``,
                                         ``post_attention_layernorm`` / ``..._2``)
``post-sum``    ``N'(x + f(N(x)))``      Huginn's ``SandwichBlock`` (``norm_1`` … ``norm_4``:
                                         the residual stream itself is normalised after each sum)
==============  =======================  ===================================================

One mixer interface
-------------------
Every token mixer (attention, Mamba-2, and any mixer a recurrence rule owns) is called as
``mixer(u, fctx, cache) -> [B, T, d]`` and makes its own empty decoding slot with
``mixer.new_cache(batch_size, device=None, dtype=None, capacity=None)`` (see :class:`looplm.cache.CacheSlot`). So
:class:`Block` never asks which kind of mixer it holds.

Modulation hooks (for the recurrence rules)
-------------------------------------------
Timestep conditioning (recurrence-effectiveness paper §3.3) and hyper-connections (Hyperloop) need
hooks inside each branch. A block accepts an optional :class:`BlockModulation` per call; each branch
then computes::

    u = read(x)                       # default: the residual stream itself        [B, T, d]
    u = N(u) · scale + shift          # default: scale = 1, shift = 0 (per channel or per token)
    y = B(u) · gate                   # default: gate = 1
    x = write(x, y)                   # default: x + y

``read`` / ``write`` let a rule own the block's residual carrier (e.g. ``n`` parallel streams
``[B, T, n, d]``) without the block knowing which rule it serves. Without modulation the block is
the plain residual block of its norm placement (``sandwich``: ``N'`` on ``B(u)`` before the gate;
``post-sum``: ``N'`` on what ``write`` returns). (The modulation types and the forward context are plain data in
:mod:`looplm.context`.)
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .context import BlockModulation, BranchModulation, ForwardContext
from .layers.mlp import SwiGLU

__all__ = ["Block", "BlockModulation", "BranchModulation", "ForwardContext", "NORM_PLACEMENTS", "Stack", "build_mixer"]


NORM_PLACEMENTS = ("pre", "sandwich", "post-sum")


def _branch(
    x: torch.Tensor,
    norm: nn.Module,
    fn,
    m: BranchModulation | None,
    out_norm: nn.Module | None = None,
    post_sum: bool = False,
) -> torch.Tensor:
    """One residual branch: ``x + f(N(x))``; with ``out_norm`` ``N'``: ``x + N'(f(N(x)))`` (sandwich) or
    ``N'(x + f(N(x)))`` (``post_sum``). ``x [B, T, d]`` (or a rule's carrier) -> same shape."""
    if m is None:
        if out_norm is None:
            return x + fn(norm(x))
        return out_norm(x + fn(norm(x))) if post_sum else x + out_norm(fn(norm(x)))
    u = norm(m.read(x) if m.read is not None else x)  # [B, T, d]
    if m.scale is not None:
        u = u * m.scale
    if m.shift is not None:
        u = u + m.shift
    y = fn(u)
    if out_norm is not None and not post_sum:
        y = out_norm(y)  # sandwich: N' on the branch output, before the gate
    if m.gate is not None:
        y = y * m.gate
    x = m.write(x, y) if m.write is not None else x + y
    return out_norm(x) if post_sum else x


def build_mixer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The token mixer of physical block ``layer_idx`` (``cfg.mixer_of(layer_idx)``)."""
    if cfg.mixer_of(layer_idx) == "attention":
        from .layers.attention import Attention

        a = cfg.attention
        return Attention(
            cfg.d_model,
            a.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            qk_norm=a.qk_norm,
            norm_eps=cfg.norm_eps,
            bias=a.bias,
            qk_bias=a.qk_bias,
            rotary_dim=cfg.rotary_dim,
            sliding_window=cfg.sliding_window_of(layer_idx),
        )
    from .layers.mamba2 import Mamba2Mixer

    m = cfg.mamba
    return Mamba2Mixer(
        cfg.d_model,
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


class Block(nn.Module):
    """Physical block ``layer_idx`` of the stack: a mixer branch and an optional SwiGLU branch, with the
    norms of ``cfg.norm_placement`` (``mixer_out_norm`` / ``mlp_out_norm`` outside ``pre``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.norm_placement = cfg.norm_placement
        d = cfg.d_model
        two = cfg.norm_placement != "pre"
        self.mixer_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.mixer = build_mixer(cfg, layer_idx)
        self.mixer_out_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if two else None
        if cfg.d_ff > 0:
            self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
            self.mlp = SwiGLU(d, cfg.d_ff)
            self.mlp_out_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if two else None
        else:
            self.mlp_norm = self.mlp = self.mlp_out_norm = None

    def new_cache(self, batch_size: int, device=None, dtype=None, capacity: int | None = None):
        """An empty decoding cache slot for this block (made by its mixer; ``capacity`` = most tokens)."""
        return self.mixer.new_cache(batch_size, device=device, dtype=dtype, capacity=capacity)

    def forward(self, x: torch.Tensor, fctx: ForwardContext, cache=None, mod: BlockModulation | None = None):
        # x [B, T, d] (or the carrier a rule's read/write hooks define) -> same shape
        m = mod if mod is not None else BlockModulation()
        post = self.norm_placement == "post-sum"
        x = _branch(x, self.mixer_norm, lambda u: self.mixer(u, fctx, cache), m.mixer, self.mixer_out_norm, post)
        if self.mlp is not None:
            x = _branch(x, self.mlp_norm, self.mlp, m.mlp, self.mlp_out_norm, post)
        return x


class Stack(nn.Module):
    """A run of physical blocks executed in order (prelude, core, or coda)."""

    def __init__(self, cfg: ModelConfig, first: int, n: int):
        super().__init__()
        self.first = first
        self.blocks = nn.ModuleList(Block(cfg, first + i) for i in range(n))

    def __len__(self) -> int:
        return len(self.blocks)

    def forward(self, x, fctx: ForwardContext, caches=None, mods=None):
        """``caches``/``mods``: ``None`` or one entry per block."""
        for i, blk in enumerate(self.blocks):
            x = blk(x, fctx, None if caches is None else caches[i], None if mods is None else mods[i])
        return x
