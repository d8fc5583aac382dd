"""A fused decode step for the transformer block on CPU, beside its reference :class:`looplm.blocks.Block`.

With the products on :mod:`looplm.layers.gemv`'s kernels, a batch-1 bf16 decode step of the SmolLM2-135M
shape still spent as long again *between* the products: ~330 µs per block of eager PyTorch (RMSNorm's
composite, RoPE's eight ops per head set, views, the KV writes, SDPA, the residual adds) and ~270 µs in a
compiled block (guard evaluation, the generated wrapper) — 10 ms of a 28 ms token. ``csrc/decode.cpp``
runs each branch of the block as one op: ``decode_attention`` (RMSNorm → q/k/v products → QK-norm → RoPE
→ KV write → attention over the cache → output product → residual) and ``decode_swiglu`` (RMSNorm →
gate/up products → SiLU ⊙ up → down product → residual). The products inside are the same kernels (or
torch's matmul where those do not win, e.g. fp32 with one row: MKL, and on CPUs without AVX512-BF16,
where the extension is built without the kernels: the portable build).

Exactness: every intermediate the reference stores in the model's dtype is rounded to it at the same
point (RMSNorm, the products, RoPE's products and sum, SiLU, SiLU ⊙ up, the residual sums); only the
order of the fp32 additions inside RMSNorm's mean of squares and the attention (dot products, softmax,
weighted sum) differs from torch's. ``tests/test_decode_block.py`` holds the fused step to the reference
(fp32: 1e-5; bf16: one rounding) and greedy generations of every plain preset family to the reference's
tokens.

When it runs: :func:`fused_blocks` (entered by :func:`looplm.generate.generate`) switches every eligible
block to :class:`DecodeBlock` for the call. A block is eligible when it is a plain :class:`Block` with an
:class:`~looplm.layers.attention.Attention` mixer (GQA, optional QK-norm, optional biases, full or
partial RoPE) and a SwiGLU MLP or none, all of one dtype (bf16 or fp32) on the CPU, with no hooks on it
or its submodules. A call takes the fused op only for one new token per row with a preallocated KV slot,
no block modulation (timestep conditioning, hyper-connections: those blocks keep the reference) and no
autograd; every other call — the prompt step, a rule's modulated blocks — is the reference
``Block.forward`` (compiled, if the block was compiled). Mamba-2 blocks always run the reference.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..blocks import Block
from . import gemv
from .attention import Attention, KVCache
from .mlp import SwiGLU

_LINEARS = (nn.Linear, gemv.DecodeLinear)
_on = True


@contextlib.contextmanager
def enabled(on: bool):
    """Switch the fused block on or off for :func:`fused_blocks` entered inside (benchmarks, tests)."""
    global _on
    prev, _on = _on, on
    try:
        yield
    finally:
        _on = prev


def _eps(norm: nn.RMSNorm, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps  # nn.RMSNorm's default


def _has_hooks(module: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_forward_hooks_with_kwargs", None)
        for m in module.modules()
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as M

    return bool(M._global_forward_hooks or M._global_forward_pre_hooks or M._global_backward_hooks)


def eligible(block: nn.Module) -> bool:
    """Whether :class:`DecodeBlock` can run ``block``'s decode steps (see the module docstring)."""
    if type(block) is not Block or type(block.mixer) is not Attention:
        return False
    a, mlp = block.mixer, block.mlp
    if mlp is not None and type(mlp) is not SwiGLU:
        return False
    norms = [block.mixer_norm] + ([block.mlp_norm] if mlp is not None else []) + [n for n in (a.q_norm, a.k_norm) if n is not None]
    if any(type(n) is not nn.RMSNorm or n.weight is None for n in norms):
        return False
    linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj] + ([mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else [])
    if any(type(lin) not in _LINEARS for lin in linears):
        return False
    tensors = list(block.parameters())
    dt = block.mixer_norm.weight.dtype
    return (
        dt in (torch.bfloat16, torch.float32)
        and all(t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and a.head_dim <= 256
        and (a.rotary_dim is None or (a.rotary_dim % 2 == 0 and a.rotary_dim <= a.head_dim))
        and not _has_hooks(block)
    )


class DecodeBlock(Block):
    """A :class:`Block` whose one-token decode steps run the fused ops of ``csrc/decode.cpp``.

    Same parameters, same state dict, same ``forward`` (the reference, which every other call takes).
    Made by :func:`fused_blocks` only, which stores the op arguments that do not change per step.
    """

    _weights: tuple  # set by fused_blocks: decode_attention's arguments from norm_weight to qk_eps
    _swiglu: tuple | None  # decode_swiglu's arguments after x (None: no MLP)
    _dtype: torch.dtype

    def __call__(self, x, fctx, cache=None, mod=None):
        fast = (
            (mod is None or (mod.mixer is None and mod.mlp is None))
            and type(cache) is KVCache
            and x.dim() == 3
            and x.shape[1] == 1
            and x.dtype == self._dtype
            and not torch.is_grad_enabled()
        )
        bufs = cache.append_buffers(x.shape[0]) if fast else None
        if bufs is not None:
            k_buf, v_buf, pos = bufs
            B = x.shape[0]
            mask = fctx.attn_mask
            if mask is None:
                fast = not fctx.is_causal or pos == 0
            else:
                fast = mask.dtype == torch.bool and tuple(mask.shape) == (B, 1, 1, pos + 1)
        if bufs is None or not fast:
            return super().__call__(x, fctx, cache, mod)  # the reference (compiled if the block was)
        rot = self.mixer.rotary_dim
        cos, sin = fctx.rope_for(rot) if rot is not None else (None, None)  # [B, 1, rot] fp32
        x = torch.ops.looplm_cpu.decode_attention(
            x.contiguous(), *self._weights, cos, sin, k_buf, v_buf, pos, None if mask is None else mask.contiguous(), self.mixer.n_heads
        )  # [B, 1, d]; the new token's key and value written into k_buf / v_buf at pos
        cache.advance(1)
        if self._swiglu is not None:
            x = torch.ops.looplm_cpu.decode_swiglu(x, *self._swiglu)
        return x


def _attention_args(block: Block) -> tuple:
    a, dt = block.mixer, block.mixer_norm.weight.dtype
    qn, kn = a.q_norm, a.k_norm
    return (
        block.mixer_norm.weight, _eps(block.mixer_norm, dt),
        a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
        a.o_proj.weight, a.o_proj.bias,
        None if qn is None else qn.weight, None if kn is None else kn.weight, _eps(qn, dt) if qn is not None else 0.0,
    )  # fmt: skip


def _swiglu_args(block: Block) -> tuple | None:
    m = block.mlp
    if m is None:
        return None
    dt = block.mlp_norm.weight.dtype
    return (block.mlp_norm.weight, _eps(block.mlp_norm, dt), m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight,
            m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)  # fmt: skip


@contextlib.contextmanager
def fused_blocks(model: nn.Module):
    """Inside the block, every :func:`eligible` block of ``model`` runs as :class:`DecodeBlock`; the
    classes are restored on exit (a compiled block keeps its compiled call for the reference path). Yields how many blocks were switched.
    A no-op where looplm's CPU extension is unavailable (:func:`looplm.layers.gemv.extension_available`:
    no compiler, ``LOOPLM_CPU_KERNELS=0``), under
    :func:`enabled` ``(False)``, or with global module hooks registered."""
    blocks = []
    if _on and not _global_hooks():
        blocks = [m for m in model.modules() if type(m) is Block and eligible(m)]
        if blocks and not gemv.extension_available():
            blocks = []
    for b in blocks:
        b._weights = _attention_args(b)
        b._swiglu = _swiglu_args(b)
        b._dtype = b.mixer_norm.weight.dtype
        b.__class__ = DecodeBlock
    try:
        yield len(blocks)
    finally:
        for b in blocks:
            b.__class__ = Block
            for name in ("_weights", "_swiglu", "_dtype"):
                b.__dict__.pop(name, None)
