"""A fused decode step for looplm's blocks on CPU, beside their reference :class:`looplm.blocks.Block`.

With the products on :mod:`looplm.layers.gemv`'s kernels, a batch-1 bf16 decode step of the SmolLM2-135M
shape still spent as long again *between* the products: ~330 µs per block of eager PyTorch (RMSNorm's
composite, RoPE's eight ops per head set, views, the KV writes, SDPA, the residual adds) and ~270 µs in a
compiled block (guard evaluation, the generated wrapper) — 10 ms of a 28 ms token. ``csrc/decode.cpp``
runs each branch of a block as one op:

* ``decode_attention``: RMSNorm → q/k/v products → QK-norm → RoPE → KV write → attention over the cache
  → output product → residual;
* ``decode_swiglu``: RMSNorm → gate/up products → SiLU ⊙ up → down product → residual;
* ``decode_mamba2`` (Looped-Mamba blocks, 96 block steps per token at 24 ⊗ 4): RMSNorm → in_proj →
  the conv window slid by one → SiLU → the SSM state update ``S ← exp(dt·A)·S + dt·x ⊗ B``,
  ``y = S·C + D·x`` → gated RMSNorm → out_proj → residual (``Mamba2Mixer._step``'s arithmetic).

The products inside are the same kernels (or torch's matmul where those do not win, e.g. fp32 with one
row: MKL, and on CPUs without AVX512-BF16, where the extension is built without the kernels: the portable
build); at batch 1 in bf16 the products that read one input (q/k/v, gate/up) are one parallel region,
each thread prefetching its share of the group that comes next.

A whole :class:`~looplm.blocks.Stack` of such attention blocks (the flat model's 30 layers, a looped
core's blocks at each iteration) runs as one ``decode_stack`` call (:class:`DecodeStack`): the blocks'
``decode_attention`` and ``decode_swiglu`` back to back in C++, the same bits as calling them one by one,
but without a Python op call and a dozen allocations per block — a decode step's weight stream evicts the
allocator's state and the interpreter's objects from the caches, so each of those cost microseconds of
cache misses — and with each block's last product prefetching the next block's first (SmolLM2-135M shape,
bf16, batch 1, 2-core Xeon: 10.9 → 10.1 ms/token; `benchmarks/bench_decode.py`, "op per branch").

Exactness: every intermediate the reference stores in the model's dtype is rounded to it at the same
point (RMSNorm, the products, RoPE's products and sum, SiLU, SiLU ⊙ up, the conv output, the SSM output,
the residual sums); only the order of the fp32 additions inside the reductions (RMSNorm's mean of
squares, the attention's dot products, softmax and weighted sum, the SSM's ``S·C``) and fused
multiply-adds differ from torch's. ``tests/test_decode_block.py`` holds the fused step to the reference
(fp32: 1e-4 of the logits; bf16: about one rounding) and greedy generations of every preset family to the
reference's tokens, in both builds.

When it runs: :func:`fused_blocks` (entered by :func:`looplm.generate.generate`) switches every eligible
block to :class:`DecodeBlock` for the call, and every stack whose blocks are all eligible attention blocks
(:func:`stack_eligible`) to :class:`DecodeStack`. A block is eligible when it is a plain :class:`Block` with an
:class:`~looplm.layers.attention.Attention` mixer (GQA, optional QK-norm, optional biases, full or
partial RoPE) or a :class:`~looplm.layers.mamba2.Mamba2Mixer`, and a SwiGLU MLP or none, all of one
dtype (bf16 or fp32) on the CPU, with no hooks on it or its submodules. A call takes the fused op only
for one new token per row with a preallocated KV slot (attention) or a non-empty state (Mamba-2), no
block modulation (timestep conditioning, hyper-connections: those blocks keep the reference) and no
autograd; every other call — the prompt step, a rule's modulated blocks — is the reference
``Block.forward`` (compiled, if the block was compiled). A rule's own residual mixers — StateLoop's
``S + mixer(RMSNorm(S))`` over its state (eqs. 8, 9), an attention or Mamba-2 mixer — are the same
branch and switch to :class:`DecodeResidualMixer` under the same conditions; StateLoop's own step — its
selective update (eqs. 2, 5, 6) and its state reads (eqs. 4, 10) — runs as ``decode_stateloop_update`` /
``decode_stateloop_read`` (:func:`stateloop_eligible`; the rounding points of ``SelectiveUpdate`` and the
reads kept as above).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..blocks import Block, Stack
from . import gemv
from .attention import Attention, KVCache
from .cpu_gemm import TunedLinear
from .mamba2 import Mamba2Mixer, Mamba2State, RMSNormGated
from .mlp import SwiGLU
from .residual import ResidualMixer

_LINEARS = (nn.Linear, gemv.DecodeLinear, TunedLinear)  # TunedLinear: switched for CPU training (cpu_gemm)
_on = True
_stacks_on = True


@contextlib.contextmanager
def enabled(on: bool):
    """Switch the fused block on or off for :func:`fused_blocks` entered inside (benchmarks, tests)."""
    global _on
    prev, _on = _on, on
    try:
        yield
    finally:
        _on = prev


@contextlib.contextmanager
def stacks_enabled(on: bool):
    """Switch :class:`DecodeStack` (one op per stack of blocks) on or off for :func:`fused_blocks` entered
    inside; off, each block's step is its own two ops (benchmarks, tests)."""
    global _stacks_on
    prev, _stacks_on = _stacks_on, on
    try:
        yield
    finally:
        _stacks_on = prev


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


def _mixer_eligible(mixer: nn.Module) -> bool:
    if type(mixer) is Attention:
        return (
            all(type(lin) in _LINEARS for lin in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj))
            and all(n is None or (type(n) is nn.RMSNorm and n.weight is not None) for n in (mixer.q_norm, mixer.k_norm))
            and mixer.head_dim <= 256
            and (mixer.rotary_dim is None or (mixer.rotary_dim % 2 == 0 and mixer.rotary_dim <= mixer.head_dim))
        )
    if type(mixer) is Mamba2Mixer:
        return (
            all(type(lin) in _LINEARS for lin in (mixer.in_proj, mixer.out_proj))
            and type(mixer.conv1d) is nn.Conv1d
            and type(mixer.norm) is RMSNormGated
            and mixer.d_inner == mixer.nheads * mixer.headdim
        )
    return False


def eligible(block: nn.Module) -> bool:
    """Whether :class:`DecodeBlock` can run ``block``'s decode steps (see the module docstring)."""
    if type(block) is not Block or not _mixer_eligible(block.mixer):
        return False
    mlp = block.mlp
    if mlp is not None and (type(mlp) is not SwiGLU or any(type(lin) not in _LINEARS for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))):
        return False
    return _norms_and_params_fit(block, [block.mixer_norm] + ([block.mlp_norm] if mlp is not None else []))


def _norms_and_params_fit(module: nn.Module, norms: list) -> bool:
    """``norms`` are RMSNorms with weights, and every parameter of ``module`` is a contiguous CPU tensor of the
    first norm's dtype, bf16 or fp32; no hooks anywhere in ``module``."""
    if any(type(n) is not nn.RMSNorm or n.weight is None for n in norms):
        return False
    dt = norms[0].weight.dtype
    return (
        dt in (torch.bfloat16, torch.float32)
        and all(t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() for t in module.parameters())
        and not _has_hooks(module)
    )


class DecodeBlock(Block):
    """A :class:`Block` whose one-token decode steps run the fused ops of ``csrc/decode.cpp``.

    Same parameters, same state dict, same ``forward`` (the reference, which every other call takes).
    Made by :func:`fused_blocks` only, which stores the op arguments that do not change per step.
    """

    _weights: tuple  # set by fused_blocks: decode_attention's arguments from norm_weight to qk_eps (Mamba-2: decode_mamba2's to b_out)
    _swiglu: tuple | None  # decode_swiglu's arguments after x (None: no MLP)
    _dtype: torch.dtype

    def __call__(self, x, fctx, cache=None, mod=None):
        if mod is None or (mod.mixer is None and mod.mlp is None):
            y = _one_token_step(self._weights, self.mixer, self._dtype, x, fctx, cache)  # the mixer branch, or None
            if y is not None:
                return y if self._swiglu is None else torch.ops.looplm_cpu.decode_swiglu(y, *self._swiglu)
        return super().__call__(x, fctx, cache, mod)  # the reference (compiled if the block was)

    def _attention_step(self, x, fctx, cache: KVCache):
        return _attention_step(self._weights, self.mixer, x, fctx, cache)

    def _mamba2_step(self, x, fctx, state: Mamba2State):
        return _mamba2_step(self._weights, x, fctx, state)


def _step_tables(fctx, B: int, pos: int, rot: int | None):
    """``(cos, sin, attn_mask)`` of a one-token attention step at ``pos`` as the fused ops take them, or
    ``None`` where they cannot (a causal call without a mask after the first token, a mask of another
    kind or shape)."""
    mask = fctx.attn_mask
    if mask is None and fctx.is_causal and pos > 0:
        return None
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, 1, 1, pos + 1)):
        return None
    cos, sin = fctx.rope_for(rot) if rot is not None else (None, None)  # [B, 1, rot] fp32
    return cos, sin, None if mask is None else mask.contiguous()


def _attention_step(weights: tuple, mixer: Attention, x, fctx, cache: KVCache):
    """``x + attention(RMSNorm(x))`` for one new token as ``decode_attention`` (``weights``: its arguments
    from norm_weight to qk_eps), or ``None`` where the op does not apply to this call."""
    bufs = cache.append_buffers(x.shape[0])
    if bufs is None:  # a growing cache, buffers not allocated yet, full, another batch size
        return None
    k_buf, v_buf, pos = bufs
    tables = _step_tables(fctx, x.shape[0], pos, mixer.rotary_dim)
    if tables is None:
        return None
    y = torch.ops.looplm_cpu.decode_attention(
        x, *weights, *tables[:2], k_buf, v_buf, pos, tables[2], mixer.n_heads
    )  # [B, 1, d]; the new token's key and value written into k_buf / v_buf at pos
    cache.advance(1)
    return y


def _mamba2_step(weights: tuple, x, fctx, state: Mamba2State):
    """``x + mamba2(RMSNorm(x))`` for one new token as ``decode_mamba2`` (``weights``: its arguments from
    norm_weight to b_out), or ``None`` where the op does not apply to this call."""
    B = x.shape[0]
    pad = fctx.pad_mask
    if (state.seqlen_offset == 0 or state.conv_state.shape[0] != B or state.conv_state.dtype != x.dtype
            or (pad is not None and tuple(pad.shape) != (B, 1))):  # fmt: skip
        return None  # an empty state (the prompt's first token), another batch or dtype
    if not state.conv_state.is_contiguous():  # the prompt step leaves views; the op writes in place
        state.conv_state = state.conv_state.contiguous()
    if state.ssm_state.dtype != torch.float32 or not state.ssm_state.is_contiguous():
        state.ssm_state = state.ssm_state.float().contiguous()
    y = torch.ops.looplm_cpu.decode_mamba2(
        x, *weights, state.conv_state, state.ssm_state, None if pad is None else pad.contiguous()
    )  # [B, 1, d]; the conv window and the SSM state updated in place
    state.seqlen_offset += 1
    return y


def _one_token_step(weights: tuple, mixer: nn.Module, dtype: torch.dtype, x, fctx, cache):
    """The fused branch for ``x [B, 1, d]`` in ``dtype`` without autograd, or ``None`` (the reference's call)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.dtype != dtype or torch.is_grad_enabled():
        return None
    if type(cache) is KVCache:
        return _attention_step(weights, mixer, x.contiguous(), fctx, cache)
    if type(cache) is Mamba2State:
        return _mamba2_step(weights, x.contiguous(), fctx, cache)
    return None


def _mixer_args(norm: nn.RMSNorm, mixer: nn.Module) -> tuple:
    """The arguments of the op of the branch ``x + mixer(norm(x))`` that do not change per step
    (decode_attention's from norm_weight to qk_eps, decode_mamba2's from norm_weight to b_out)."""
    dt = norm.weight.dtype
    if type(mixer) is Mamba2Mixer:
        m = mixer
        return (
            norm.weight, _eps(norm, dt), m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias,
            m.dt_bias, m.A_log, m.D, m.norm.weight, m.norm.eps, m.out_proj.weight, m.out_proj.bias,
        )  # fmt: skip
    a = mixer
    qn, kn = a.q_norm, a.k_norm
    return (
        norm.weight, _eps(norm, dt),
        a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
        a.o_proj.weight, a.o_proj.bias,
        None if qn is None else qn.weight, None if kn is None else kn.weight, _eps(qn, dt) if qn is not None else 0.0,
    )  # fmt: skip


def residual_mixer_eligible(module: nn.Module) -> bool:
    """Whether :class:`DecodeResidualMixer` can run ``module``'s decode steps: a rule's residual mixer
    (StateLoop's ``S + mixer(RMSNorm(S))``) whose mixer a block could fuse, all of one dtype on the CPU, no hooks."""
    if type(module) is not ResidualMixer or not _mixer_eligible(module.mixer):
        return False
    return _norms_and_params_fit(module, [module.norm])


def stateloop_eligible(module: nn.Module) -> bool:
    """Whether a StateLoop rule's own decode step (the selective update, eqs. 2, 5, 6, and the reads, eqs. 4, 10)
    can run on ``decode_stateloop_update`` / ``_read``: the SSM update without reset, and all of the rule's
    parameters of one CPU dtype, bf16 or fp32, with no hooks anywhere in it."""
    from ..recurrence.stateloop import SelectiveUpdate, StateLoop  # here: the rules import the layers

    if type(module) is not StateLoop or type(module.update) is not SelectiveUpdate or module.reset:
        return False
    if any(type(lin) not in _LINEARS for lin in (module.W_u, module.update.W_delta, module.W_sz, module.W_out)):
        return False
    return _norms_and_params_fit(module, [module.norm_h, module.norm_s])


class DecodeResidualMixer(ResidualMixer):
    """A rule's residual mixer (``S + mixer(RMSNorm(S))``) whose one-token decode steps run the block's
    fused mixer op; made by :func:`fused_blocks` only (the class is swapped in and back; every other call
    is the reference ``forward``)."""

    _weights: tuple
    _dtype: torch.dtype

    def __call__(self, S, fctx, cache=None):
        y = _one_token_step(self._weights, self.mixer, self._dtype, S, fctx, cache)
        return y if y is not None else super().__call__(S, fctx, cache)  # the reference forward


def _swiglu_args(block: Block) -> tuple | None:
    m = block.mlp
    if m is None:
        return None
    dt = block.mlp_norm.weight.dtype
    return (block.mlp_norm.weight, _eps(block.mlp_norm, dt), m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight,
            m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)  # fmt: skip


def stack_eligible(stack: nn.Module) -> bool:
    """Whether :class:`DecodeStack` can run ``stack``'s one-token steps as one ``decode_stack`` call: a plain
    :class:`~looplm.blocks.Stack` whose blocks are all :func:`eligible` attention blocks (SwiGLU or no MLP) of
    one dtype and one rotary dim, with no hooks on the stack."""
    if type(stack) is not Stack or len(stack.blocks) == 0 or _has_hooks(stack):
        return False
    blocks = list(stack.blocks)
    if not all(type(b) is Block and type(b.mixer) is Attention and eligible(b) for b in blocks):
        return False
    return len({b.mixer_norm.weight.dtype for b in blocks}) == 1 and len({b.mixer.rotary_dim for b in blocks}) == 1


def _stack_args(stack: Stack) -> tuple:
    """``decode_stack``'s weights (18 per block), eps (3 per block) and n_heads (1 per block)."""
    weights, eps, heads = [], [], []
    for b in stack.blocks:
        m, s = _mixer_args(b.mixer_norm, b.mixer), _swiglu_args(b)
        weights += [m[0], *m[2:12], *((s[0], *s[2:]) if s is not None else (None,) * 7)]
        eps += [m[1], m[12], s[1] if s is not None else 0.0]
        heads.append(b.mixer.n_heads)
    return weights, eps, heads


class DecodeStack(Stack):
    """A :class:`~looplm.blocks.Stack` whose one-token decode steps run as one ``decode_stack`` call (every
    block's ``decode_attention`` and ``decode_swiglu`` back to back in C++, each block's last product
    prefetching the next block's weights). Made by :func:`fused_blocks` only; every other call — the prompt,
    modulated blocks, caches that are not preallocated or not at one position — is the reference
    ``forward`` (whose blocks are :class:`DecodeBlock` s)."""

    _stack: tuple  # decode_stack's weights, eps and n_heads
    _rot: int | None
    _dtype: torch.dtype

    def __call__(self, x, fctx, caches=None, mods=None):
        y = self._one_token_step(x, fctx, caches, mods)
        return y if y is not None else super().__call__(x, fctx, caches, mods)

    def _one_token_step(self, x, fctx, caches, mods):
        if caches is None or x.dim() != 3 or x.shape[1] != 1 or x.dtype != self._dtype or torch.is_grad_enabled():
            return None
        if mods is not None and any(m is not None and (m.mixer is not None or m.mlp is not None) for m in mods):
            return None
        B = x.shape[0]
        ks, vs, pos = [], [], None
        for c in caches:
            bufs = c.append_buffers(B) if type(c) is KVCache else None
            if bufs is None or (pos is not None and bufs[2] != pos):
                return None
            ks.append(bufs[0])
            vs.append(bufs[1])
            pos = bufs[2]
        tables = _step_tables(fctx, B, pos, self._rot)
        if tables is None:
            return None
        y = torch.ops.looplm_cpu.decode_stack(
            x.contiguous(), *self._stack, ks, vs, pos, *tables
        )  # [B, 1, d]; each block's new key and value written into its cache at pos
        for c in caches:
            c.advance(1)
        return y


@contextlib.contextmanager
def fused_blocks(model: nn.Module):
    """Inside the block, every :func:`eligible` block of ``model`` runs as :class:`DecodeBlock`, every
    eligible residual state mixer as :class:`DecodeResidualMixer`, and an eligible StateLoop rule takes its
    fused update and reads (:func:`stateloop_eligible`); the classes and flags are restored on exit (a
    compiled block keeps its compiled call for the reference path). Yields how many blocks were switched.
    A no-op where looplm's CPU extension is unavailable (:func:`looplm.layers.gemv.extension_available`:
    no compiler, ``LOOPLM_CPU_KERNELS=0``), under
    :func:`enabled` ``(False)``, or with global module hooks registered."""
    blocks, mixers, rules, stacks = [], [], [], []
    if _on and not _global_hooks():
        blocks = [m for m in model.modules() if type(m) is Block and eligible(m)]
        mixers = [m for m in model.modules() if residual_mixer_eligible(m)]
        rules = [m for m in model.modules() if stateloop_eligible(m)]
        stacks = [m for m in model.modules() if stack_eligible(m)] if _stacks_on else []
        if (blocks or mixers or rules) and not gemv.extension_available():
            blocks, mixers, rules, stacks = [], [], [], []
    for s in stacks:  # before the blocks switch class (stack_eligible reads them)
        s._stack = _stack_args(s)
        s._rot = s.blocks[0].mixer.rotary_dim
        s._dtype = s.blocks[0].mixer_norm.weight.dtype
        s.__class__ = DecodeStack
    for r in rules:
        r._fused_decode = True  # StateLoop.step / next_input / finish take decode_stateloop_update / _read
    for b in blocks:
        b._weights = _mixer_args(b.mixer_norm, b.mixer)
        b._swiglu = _swiglu_args(b)
        b._dtype = b.mixer_norm.weight.dtype
        b.__class__ = DecodeBlock
    for m in mixers:
        m._weights = _mixer_args(m.norm, m.mixer)
        m._dtype = m.norm.weight.dtype
        m.__class__ = DecodeResidualMixer
    try:
        yield len(blocks)
    finally:
        for b in blocks:
            b.__class__ = Block
            for name in ("_weights", "_swiglu", "_dtype"):
                b.__dict__.pop(name, None)
        for m in mixers:
            m.__class__ = ResidualMixer
            for name in ("_weights", "_dtype"):
                m.__dict__.pop(name, None)
        for r in rules:
            r.__dict__.pop("_fused_decode", None)
        for s in stacks:
            s.__class__ = Stack
            for name in ("_stack", "_rot", "_dtype"):
                s.__dict__.pop(name, None)
