"""Layers: attention (GQA, RoPE, QK-norm, KV cache), SwiGLU MLP, RMSNorm, Mamba-2 (see mamba2.py)."""

from .attention import Attention, KVCache
from .mlp import SwiGLU
from .rope import RotaryEmbedding, apply_rotary

__all__ = ["Attention", "KVCache", "SwiGLU", "RotaryEmbedding", "apply_rotary"]
