"""Rotary position embeddings (Su et al. 2021), with the Llama-3 frequency scaling rule.

Half-split convention (``rotate_half``): dimension ``i`` is paired with ``i + rot/2``, as in the
Hugging Face Llama / Qwen3 implementations, so copied weights give identical logits. With
``rotary_dim < head_dim`` only the first ``rotary_dim`` channels of each head rotate (partial RoPE, as
in the hybrid Mamba-2 models' attention layers with rotary dim 64).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeScaling


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling | None = None, precision: str = "fp64"
) -> torch.Tensor:
    """Inverse frequencies ``θ^(-2i/rot)`` for ``i < rot/2``; Llama-3 scaling when ``scaling`` is given.

    ``precision``: the arithmetic before the result is rounded to fp32 — ``fp64`` (correctly rounded), or
    ``fp32`` (``1 / θ ** (arange / rot)`` in fp32, as the modelling code of Ouro, Huginn and transformers
    computes it). They differ by an ulp in some frequencies, which grows with the position: about 2e-4 rad at
    position 4,095 — enough to move logits by more than 1e-5 on long prompts, so imports match their source's.

    Llama-3 rule: wavelengths longer than ``original_max / low_freq_factor`` are divided by ``factor``;
    shorter than ``original_max / high_freq_factor`` are kept; in between, interpolate smoothly with
    ``s = (original_max / wavelen − low) / (high − low)``: ``f ← (1 − s)·f/factor + s·f``.
    """
    # computed on the CPU even inside a `torch.device("meta")` context: meta-device ops import torch's
    # reference kernels (seconds), which would slow down parameter counting
    dt = torch.float64 if precision == "fp64" else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=dt, device="cpu") / rotary_dim))
    if scaling is None:
        return inv_freq.float()
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` tables for given positions. No parameters; buffers are not saved."""

    def __init__(self, rotary_dim: int, theta: float, scaling: RopeScaling | None = None, precision: str = "fp64"):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self.precision = precision
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta, scaling, precision), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (needed after materialising a model built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.precision).to(
            self.inv_freq.device
        )

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, T, rot] (float32)
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, rot]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos, sin [B, T, rot]`` on its first ``rot`` channels."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, T, rot]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
