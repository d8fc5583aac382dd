"""Fused one-token decode steps for looplm's blocks on CPU, beside their reference :class:`looplm.blocks.Block`.

With the products on :mod:`looplm.kernels.gemv`'s kernels, a batch-1 bf16 decode step of the SmolLM2-135M
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
core's blocks at each iteration) runs as one ``decode_stack`` call: the blocks'
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

When it runs: these steps are registered with :mod:`looplm.dispatch` (:func:`register`) for
:class:`~looplm.blocks.Block`, :class:`~looplm.blocks.Stack` and :class:`~looplm.layers.residual.ResidualMixer`;
inside :func:`looplm.dispatch.decode_steps` (entered by :func:`looplm.decode.generate.generate`) every eligible module
runs them. A block is eligible when it is a plain pre-norm :class:`Block` (``norm_placement: pre``; a
sandwich or post-sum block keeps the reference) with an :class:`~looplm.layers.attention.Attention` mixer
(GQA, optional QK-norm, optional biases, full or partial RoPE, no sliding window) or a :class:`~looplm.layers.mamba2.Mamba2Mixer`, and a SwiGLU MLP or none, all of one dtype (bf16 or
fp32) on the CPU, with no hooks on it or its submodules; a stack when all its blocks are eligible attention
blocks of one dtype and one rotary dim (:func:`stack_eligible`). A call takes the fused op only for one new
token per row with a preallocated KV slot (attention) or a non-empty state (Mamba-2) — or some rows of the
batch's slots (per-token exit, :mod:`looplm.decode.token_schedule`: an int64 ``rows`` index, each active row reading and
writing its own cache row in place), or a loop-shared KV slot — no block modulation
(timestep conditioning, hyper-connections: those blocks keep the reference) and no autograd; every other
call — the prompt step, a rule's modulated blocks — is the reference ``forward`` (compiled, if the block was
compiled). One exception to "one new token": inside :func:`looplm.dispatch.few_token_steps` a stack's call of
up to 64 new tokens per row after the prompt (a speculative verification's ``k + 1`` drafted tokens,
:mod:`looplm.decode.speculative`) is one ``decode_stack`` call too — every token's key and value written first,
then token ``t`` attending to the columns up to its own, the model's mask (left padding, rejected drafts'
holes) read row by row — so a verification costs one op per loop, not the reference's dozen per block
(bf16, the bench LM's d = 256 core, 5 tokens: 287 µs vs 883 µs through torch's matmul;
``tests/test_decode_few_tokens.py`` holds it to the reference). A row view with per-row columns (continuous
depth batching, :mod:`looplm.decode.depth_schedule`: each row at its own token and loop, its cache row ``k·B + b`` of
a layer's one ``[R·B, ...]`` buffer) passes them as the op's ``cols``, the mask's length as ``pos + 1``.
A ``kv='propagate'`` fill offered to the stack's call (:func:`looplm.dispatch.offer_kv_fill`,
:mod:`looplm.decode.kv_fill`) rides on it: its stand-ins are extra rows of every block's k / v products (the
weights the step streams anyway), QK-normed and rotated at their own positions, written into the skipped
loops' slots (the op's ``fill_*`` arguments); the fill is then marked written.

A rule's own residual mixers — StateLoop's ``S + mixer(RMSNorm(S))`` over its state (eqs. 8, 9), an
attention or Mamba-2 mixer — are the same branch and take the same step under the same conditions
(StateLoop's own update and reads: :mod:`looplm.kernels.stateloop`).

Packing: each op's arguments are taken by name — the per-block ops' from their schema (:func:`op_args`), the
stack's as one ``StackPlan`` (``csrc/decode.cpp``) holding every block's parameters under their state-dict
names — once per ``generate`` call, never by position.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .. import dispatch
from ..blocks import Block, Stack
from ..cache import SharedKV
from ..layers.attention import Attention, KVCache, KVRows, copy_kv_columns
from ..layers.mamba2 import Mamba2Mixer, Mamba2Rows, Mamba2State, RMSNormGated
from ..layers.mlp import SwiGLU
from ..layers.residual import ResidualMixer
from .loader import extension_available
from .gemm import TunedLinear

_LINEARS = (nn.Linear, TunedLinear)  # TunedLinear: switched for CPU training (looplm.kernels.gemm)
_on = [True]
_stacks_on = [True]


@contextlib.contextmanager
def enabled(on: bool):
    """Switch the fused steps of this module on or off for :func:`~looplm.dispatch.decode_steps` entered
    inside (benchmarks, tests)."""
    prev, _on[0] = _on[0], on
    try:
        yield
    finally:
        _on[0] = prev


@contextlib.contextmanager
def stacks_enabled(on: bool):
    """Switch the one-op-per-stack step on or off for :func:`~looplm.dispatch.decode_steps` entered inside;
    off, each block's step is its own two ops (benchmarks, tests)."""
    prev, _stacks_on[0] = _stacks_on[0], on
    try:
        yield
    finally:
        _stacks_on[0] = prev


def _eps(norm: nn.Module, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps  # nn.RMSNorm's default


def _has_hooks(module: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_forward_hooks_with_kwargs", None)
        for m in module.modules()
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as M

    return bool(M._global_forward_hooks or M._global_forward_pre_hooks or M._global_backward_hooks)


def fusing() -> bool:
    """Whether the fused steps may be switched in now: on, no global module hooks, the extension loaded."""
    return _on[0] and not _global_hooks() and extension_available()


def op_args(op, named: dict, first: int, last: str) -> tuple:
    """The arguments of ``op`` (``torch.ops.looplm_cpu.*``) from ``first`` (an index) up to and including the
    one called ``last``, in the op's schema order, taken from ``named`` by their schema names (a name the
    schema has and ``named`` lacks is an error: the packing never relies on positions)."""
    names = [a.name for a in op.default._schema.arguments]
    wanted = names[first : names.index(last) + 1]
    missing = [n for n in wanted if n not in named]
    if missing:
        raise KeyError(f"{op.default._schema.name}: no value for {missing}")
    return tuple(named[n] for n in wanted)


def plain_linear(lin: nn.Module) -> bool:
    """A plain linear layer (``nn.Linear`` or TunedLinear, also while its own decode step is switched in)."""
    return dispatch.plain_class(lin) in _LINEARS


def _mixer_eligible(mixer: nn.Module) -> bool:
    if type(mixer) is Attention:
        return (
            mixer.sliding_window is None  # the fused step attends to the whole cache
            and all(plain_linear(lin) for lin in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj))
            and all(n is None or (type(n) is nn.RMSNorm and n.weight is not None) for n in (mixer.q_norm, mixer.k_norm))
            and mixer.head_dim <= 256
            and (mixer.rotary_dim is None or (mixer.rotary_dim % 2 == 0 and mixer.rotary_dim <= mixer.head_dim))
        )
    if type(mixer) is Mamba2Mixer:
        return (
            all(plain_linear(lin) for lin in (mixer.in_proj, mixer.out_proj))
            and type(mixer.conv1d) is nn.Conv1d
            and type(mixer.norm) is RMSNormGated
            and mixer.d_inner == mixer.nheads * mixer.headdim
        )
    return False


def eligible(block: nn.Module) -> bool:
    """Whether the fused step can run ``block``'s decode steps (see the module docstring)."""
    if type(block) is not Block or block.norm_placement != "pre" or not _mixer_eligible(block.mixer):
        return False  # the fused step computes x + f(N(x)): sandwich / post-sum blocks keep the reference
    mlp = block.mlp
    if mlp is not None and (
        type(mlp) is not SwiGLU or not all(plain_linear(lin) for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    ):
        return False
    return norms_and_params_fit(block, [block.mixer_norm] + ([block.mlp_norm] if mlp is not None else []))


def norms_and_params_fit(module: nn.Module, norms: list) -> bool:
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


# ------------------------------------------------------------------------------------------------
# one branch: x + mixer(norm(x)) for one new token
# ------------------------------------------------------------------------------------------------


@dataclass
class BranchPlan:
    """The fused mixer branch ``x + mixer(norm(x))`` of one module: its op's fixed arguments (taken by name)."""

    kind: str  # "attention" | "mamba2"
    weights: tuple  # the op's arguments that do not change per step, in its schema order
    dtype: torch.dtype
    n_heads: int = 0
    rotary_dim: int | None = None


def branch_plan(norm: nn.RMSNorm, mixer: nn.Module) -> BranchPlan:
    """The plan of the branch ``x + mixer(norm(x))`` (an eligible Attention or Mamba2Mixer)."""
    dt = norm.weight.dtype
    if type(mixer) is Mamba2Mixer:
        m = mixer
        named = dict(
            norm_weight=norm.weight,
            eps=_eps(norm, dt),
            w_in=m.in_proj.weight,
            b_in=m.in_proj.bias,
            conv_weight=m.conv1d.weight,
            conv_bias=m.conv1d.bias,
            dt_bias=m.dt_bias,
            A_log=m.A_log,
            D=m.D,
            gate_norm_weight=m.norm.weight,
            gate_norm_eps=m.norm.eps,
            w_out=m.out_proj.weight,
            b_out=m.out_proj.bias,
        )
        return BranchPlan("mamba2", op_args(torch.ops.looplm_cpu.decode_mamba2, named, 1, "b_out"), dt)
    a, qn, kn = mixer, mixer.q_norm, mixer.k_norm
    named = dict(
        norm_weight=norm.weight,
        eps=_eps(norm, dt),
        wq=a.q_proj.weight,
        bq=a.q_proj.bias,
        wk=a.k_proj.weight,
        bk=a.k_proj.bias,
        wv=a.v_proj.weight,
        bv=a.v_proj.bias,
        wo=a.o_proj.weight,
        bo=a.o_proj.bias,
        q_norm_weight=None if qn is None else qn.weight,
        k_norm_weight=None if kn is None else kn.weight,
        qk_eps=_eps(qn, dt) if qn is not None else 0.0,
    )
    return BranchPlan(
        "attention", op_args(torch.ops.looplm_cpu.decode_attention, named, 1, "qk_eps"), dt, a.n_heads, a.rotary_dim
    )


def _step_tables(fctx, B: int, T: int, pos: int, rot: int | None):
    """``(cos, sin, attn_mask)`` of ``T`` new tokens per row at ``pos .. pos + T − 1`` as the fused ops take
    them, or ``None`` where they cannot: a prompt of several tokens, a causal call without a mask after the
    first token, a mask of another kind or shape. The op is causal inside a call of several tokens (a
    speculative verification's, inside :func:`looplm.dispatch.few_token_steps`); a mask ``[1 or B, 1, T,
    pos + T]`` adds left padding and the holes of rejected drafts."""
    mask = fctx.attn_mask
    if (T > 1 and pos == 0) or (mask is None and fctx.is_causal and pos > 0):
        return None
    if mask is not None:
        if (
            mask.dtype != torch.bool
            or mask.dim() != 4
            or tuple(mask.shape[1:]) != (1, T, pos + T)
            or mask.shape[0] not in (1, B)
        ):
            return None
        mask = mask.expand(B, 1, T, pos + T).contiguous()
    cos, sin = fctx.rope_for(rot) if rot is not None else (None, None)  # [B, T, rot] fp32
    if cos is not None:
        cos, sin = cos.expand(B, T, -1).contiguous(), sin.expand(B, T, -1).contiguous()
    return cos, sin, mask


_KV_SLOTS = (KVCache, KVRows, SharedKV)  # a layer's own slot; some rows of one (per-token exit); a loop-shared one


def _rows_of(cache) -> torch.Tensor | None:
    """The cache rows a row view writes (``None``: x's rows are the slot's)."""
    return cache.idx if type(cache) in (KVRows, Mamba2Rows) else None


def _cols_of(cache) -> torch.Tensor | None:
    """The per-row columns a row view writes at (rows at different tokens, :mod:`looplm.decode.depth_schedule`), or ``None``."""
    return cache.cols if type(cache) is KVRows else None


def _write_pos(fctx, bufs, cols, T: int) -> int | None:
    """The op's ``pos``: the slot's length, or with per-row ``cols`` the mask's ``[.., pos + T]`` (``None``:
    no mask to read the rows' keys from, or it does not fit the buffers)."""
    if cols is None:
        return bufs[2]
    mask = fctx.attn_mask
    if mask is None or mask.shape[-1] - T < 0 or mask.shape[-1] > bufs[0].shape[2]:
        return None
    return mask.shape[-1] - T


def _attention_step(plan: BranchPlan, x, fctx, cache):
    """``x + attention(RMSNorm(x))`` for one new token as ``decode_attention``, or ``None`` where the op does
    not apply to this call. A row view (:class:`~looplm.layers.attention.KVRows`) writes and reads its rows
    of the whole batch's buffers in place."""
    bufs = cache.append_buffers(x.shape[0])
    if bufs is None:  # a growing cache, buffers not allocated yet, full, another batch size
        return None
    k_buf, v_buf = bufs[:2]
    cols = _cols_of(cache)
    pos = _write_pos(fctx, bufs, cols, 1)
    tables = None if pos is None else _step_tables(fctx, x.shape[0], 1, pos, plan.rotary_dim)
    if tables is None:
        return None
    y = torch.ops.looplm_cpu.decode_attention(
        x, *plan.weights, *tables[:2], k_buf, v_buf, pos, tables[2], plan.n_heads, rows=_rows_of(cache), cols=cols
    )  # [B, 1, d]; the new token's key and value written into k_buf / v_buf at pos
    cache.advance(1)
    return y


def _mamba2_step(plan: BranchPlan, x, fctx, state):
    """``x + mamba2(RMSNorm(x))`` for one new token as ``decode_mamba2``, or ``None`` where the op does not
    apply to this call. A row view (:class:`~looplm.layers.mamba2.Mamba2Rows`) updates its rows of the whole
    batch's states in place."""
    B = x.shape[0]
    pad = fctx.pad_mask
    if getattr(state, "keep", None) is not None:
        return None  # a masked row view (rows that keep their state): the reference writes it back row by row
    rows = _rows_of(state)
    base = state.base if rows is not None else state
    if (
        base.seqlen_offset == 0
        or (rows is None and base.conv_state.shape[0] != B)
        or base.conv_state.dtype != x.dtype
        or (pad is not None and tuple(pad.shape) != (B, 1))
    ):
        return None  # an empty state (the prompt's first token), another batch or dtype
    if not base.conv_state.is_contiguous():  # the prompt step leaves views; the op writes in place
        base.conv_state = base.conv_state.contiguous()
    if base.ssm_state.dtype != torch.float32 or not base.ssm_state.is_contiguous():
        base.ssm_state = base.ssm_state.float().contiguous()
    y = torch.ops.looplm_cpu.decode_mamba2(
        x, *plan.weights, base.conv_state, base.ssm_state, None if pad is None else pad.contiguous(), rows=rows
    )  # [B, 1, d]; the conv window and the SSM state updated in place
    state.seqlen_offset += 1  # a row view: counted at the token's commit
    return y


def branch_step(plan: BranchPlan, x, fctx, cache):
    """The fused branch for ``x [B, 1, d]`` in the plan's dtype without autograd, or ``None`` (the reference)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.dtype != plan.dtype or torch.is_grad_enabled():
        return None
    if plan.kind == "attention" and type(cache) in _KV_SLOTS:
        return _attention_step(plan, x.contiguous(), fctx, cache)
    if plan.kind == "mamba2" and type(cache) in (Mamba2State, Mamba2Rows):
        return _mamba2_step(plan, x.contiguous(), fctx, cache)
    return None


# ------------------------------------------------------------------------------------------------
# Block: the mixer branch, then the SwiGLU branch
# ------------------------------------------------------------------------------------------------


@dataclass
class BlockPlan:
    mixer: BranchPlan
    swiglu: tuple | None  # decode_swiglu's arguments after x (None: no MLP)


def _swiglu_args(block: Block) -> tuple | None:
    m = block.mlp
    if m is None:
        return None
    n = block.mlp_norm
    named = dict(
        norm_weight=n.weight,
        eps=_eps(n, n.weight.dtype),
        w_gate=m.gate_proj.weight,
        b_gate=m.gate_proj.bias,
        w_up=m.up_proj.weight,
        b_up=m.up_proj.bias,
        w_down=m.down_proj.weight,
        b_down=m.down_proj.bias,
    )
    return op_args(torch.ops.looplm_cpu.decode_swiglu, named, 1, "b_down")


def _prepare_block(block: Block, batch_size: int | None) -> BlockPlan | None:
    if not eligible(block) or not fusing():
        return None
    return BlockPlan(branch_plan(block.mixer_norm, block.mixer), _swiglu_args(block))


def _block_call(block: Block, plan: BlockPlan, x, fctx, cache=None, mod=None):
    if mod is not None and (mod.mixer is not None or mod.mlp is not None):
        return None  # a modulated block (timestep conditioning, hyper-connections): the reference
    y = branch_step(plan.mixer, x, fctx, cache)  # the mixer branch, or None
    if y is None or plan.swiglu is None:
        return y
    return torch.ops.looplm_cpu.decode_swiglu(y, *plan.swiglu)


# ------------------------------------------------------------------------------------------------
# ResidualMixer: a rule's S + mixer(RMSNorm(S)) (StateLoop's state mixers, eqs. 8, 9)
# ------------------------------------------------------------------------------------------------


def residual_mixer_eligible(module: nn.Module) -> bool:
    """Whether the fused branch can run ``module``'s decode steps: a rule's residual mixer (StateLoop's
    ``S + mixer(RMSNorm(S))``) whose mixer a block could fuse, all of one dtype on the CPU, no hooks."""
    if type(module) is not ResidualMixer or not _mixer_eligible(module.mixer):
        return False
    return norms_and_params_fit(module, [module.norm])


def _prepare_residual_mixer(module: ResidualMixer, batch_size: int | None) -> BranchPlan | None:
    if not residual_mixer_eligible(module) or not fusing():
        return None
    return branch_plan(module.norm, module.mixer)


def _residual_mixer_call(module: ResidualMixer, plan: BranchPlan, S, fctx, cache=None):
    return branch_step(plan, S, fctx, cache)


# ------------------------------------------------------------------------------------------------
# Stack: every block's step in one decode_stack call
# ------------------------------------------------------------------------------------------------


def stack_eligible(stack: nn.Module) -> bool:
    """Whether one ``decode_stack`` call can run ``stack``'s one-token steps: a plain
    :class:`~looplm.blocks.Stack` whose blocks are all :func:`eligible` attention blocks (SwiGLU or no MLP) of
    one dtype and one rotary dim, with no hooks on the stack."""
    if type(stack) is not Stack or len(stack.blocks) == 0 or _has_hooks(stack):
        return False
    blocks = list(stack.blocks)
    if not all(type(b) is Block and type(b.mixer) is Attention and eligible(b) for b in blocks):
        return False
    return len({b.mixer_norm.weight.dtype for b in blocks}) == 1 and len({b.mixer.rotary_dim for b in blocks}) == 1


@dataclass
class StackPlan:
    plan: torch.ScriptObject  # looplm_cpu.StackPlan: every block's parameters by name
    rotary_dim: int | None
    dtype: torch.dtype


def _prepare_stack(stack: Stack, batch_size: int | None) -> StackPlan | None:
    if not _stacks_on[0] or not stack_eligible(stack) or not fusing():
        return None
    plan = torch.classes.looplm_cpu.StackPlan()
    for b in stack.blocks:
        a, dt = b.mixer, b.mixer_norm.weight.dtype
        eps_qk = _eps(a.q_norm, dt) if a.q_norm is not None else 0.0
        eps_mlp = _eps(b.mlp_norm, dt) if b.mlp is not None else 0.0
        plan.add_block(dict(b.named_parameters()), _eps(b.mixer_norm, dt), eps_qk, eps_mlp, a.n_heads)
    b0 = stack.blocks[0]
    return StackPlan(plan, b0.mixer.rotary_dim, b0.mixer_norm.weight.dtype)


_MAX_TOKENS = 64  # csrc/decode.cpp's kMaxTokens: new tokens per row one decode_stack call takes


def _stack_call(stack: Stack, plan: StackPlan, x, fctx, caches=None, mods=None):
    if caches is None or x.dim() != 3 or x.dtype != plan.dtype or torch.is_grad_enabled():
        return None
    B, T = x.shape[:2]
    if T != 1 and not (dispatch.few_token_calls() and T <= _MAX_TOKENS):
        return None  # several tokens per row: the reference, except a verification's few (few_token_steps)
    if mods is not None and any(m is not None and (m.mixer is not None or m.mlp is not None) for m in mods):
        return None
    ks, vs, pos = [], [], None
    rows = _rows_of(caches[0]) if caches else None
    cols = _cols_of(caches[0]) if caches else None
    for c in caches:
        bufs = c.append_buffers(B) if type(c) in _KV_SLOTS else None
        p = None if bufs is None else _write_pos(fctx, bufs, cols, T)
        if (
            p is None
            or (pos is not None and p != pos)
            or _rows_of(c) is not rows
            or _cols_of(c) is not cols
            or p + T > bufs[0].shape[2]
        ):
            return None
        ks.append(bufs[0])
        vs.append(bufs[1])
        pos = p
    tables = _step_tables(fctx, B, T, pos, plan.rotary_dim)
    if tables is None:
        return None
    fill = dispatch.offered_kv_fill(stack)
    extra = _fill_args(fill, plan, len(caches)) if fill is not None else None
    # [B, T, d]; each block's keys and values written at pos .. pos + T − 1 (in rows `rows` of the buffers
    # under per-token exit; at each row's own column `cols` under continuous depth batching); an offered
    # propagate fill's stand-ins as extra rows of every block's k/v products, written into their buffers
    y = torch.ops.looplm_cpu.decode_stack(
        x.contiguous(), plan.plan, ks, vs, pos, *tables, rows=rows, cols=cols, **(extra or {})
    )
    if extra is not None:
        fill.written = True
    for c in caches:
        c.advance(T)
    return y


def _fill_args(fill, plan: StackPlan, n_blocks: int) -> dict | None:
    """``decode_stack``'s fill arguments for ``fill`` (:class:`looplm.decode.kv_fill.KVFill`: stand-ins for every
    block of the stack, CPU buffers of the plan's dtype), else ``None`` (the caller's reference writes it)."""
    z = fill.z()
    if len(fill.blocks) != n_blocks or z.dtype != plan.dtype or z.device.type != "cpu":
        return None
    ks = [b._k for bufs in fill.buffers for b in bufs]
    vs = [b._v for bufs in fill.buffers for b in bufs]
    if any(t is None or t.dtype != plan.dtype or not t.is_contiguous() for t in ks + vs):
        return None
    cos = sin = None
    if plan.rotary_dim is not None:
        cos, sin = fill.rope(plan.rotary_dim)  # [F, 1, rot]
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return dict(fill_z=z.contiguous(), fill_cos=cos, fill_sin=sin, fill_k=ks, fill_v=vs, fill_index=fill.index())


PROVIDERS = ("looplm.kernels.decode", "looplm.kernels.stateloop")


@contextlib.contextmanager
def fused_blocks(model: nn.Module):
    """Only the fused steps of blocks, stacks, state mixers and StateLoop's update / reads, for the ``with``
    block (:func:`looplm.dispatch.decode_steps` with those steps; ``generate`` enters all steps at once).
    Yields how many blocks were switched."""
    with dispatch.decode_steps(model, only=lambda s: s.provider in PROVIDERS) as counts:
        yield counts.get("fused block", 0)


def _prepare_norm(norm: nn.Module, batch_size: int | None):
    """A lone ``nn.RMSNorm``'s one-token step (the final norm before the head; an exit criterion's readout;
    a rule's norm of the state): bf16 / fp32 weights on the CPU, with the extension loaded."""
    w = norm.weight
    if (
        w is None
        or w.dtype not in (torch.bfloat16, torch.float32)
        or w.device.type != "cpu"
        or not extension_available()
    ):
        return None
    return _eps(norm, w.dtype)


def _norm_step(norm: nn.Module, eps: float, x: torch.Tensor):
    """``decode_norm`` for one new token per row (``x [B, 1, d]`` of the weight's dtype, no autograd), else
    ``None`` (torch's ``rms_norm``): one pass per row instead of a chain of kernels that runs cold after a core
    pass (180 vs ~20 µs at d = 1024 on one EPYC thread, measured in isolation)."""
    if (
        x.dim() != 3
        or x.shape[1] != 1
        or x.dtype != norm.weight.dtype
        or torch.is_grad_enabled()
        or x.device.type != "cpu"
    ):
        return None
    return torch.ops.looplm_cpu.decode_norm(x.contiguous(), norm.weight, eps)


def _copy_kv_columns(src: list, dst: list, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """``copy_kv_columns`` as one call (every layer and skipped loop of an exit) for CPU caches of one dtype per
    pair; else the reference (an indexed read and write per pair: ~20 small ops per exit at two layers)."""
    if rows.device.type != "cpu" or any(a.dtype != b.dtype for a, b in zip(src, dst)):
        return copy_kv_columns.reference(src, dst, rows, cols)
    torch.ops.looplm_cpu.copy_kv_columns(src, dst, rows, cols)


def register() -> None:
    """Register the fused steps of :class:`Block`, :class:`Stack`, :class:`ResidualMixer` and a lone
    ``nn.RMSNorm``, and the copy fill of per-token exit (``copy_kv_columns``)."""
    src = "looplm.kernels.decode"
    dispatch.register("copy_kv_columns", _copy_kv_columns, src)
    dispatch.register_decode_step(
        dispatch.DecodeStep("fused norm", nn.RMSNorm, _prepare_norm, {"forward": _norm_step}, src)
    )
    dispatch.register_decode_step(
        dispatch.DecodeStep("fused block", Block, _prepare_block, {"__call__": _block_call}, src)
    )
    dispatch.register_decode_step(
        dispatch.DecodeStep("decode_stack", Stack, _prepare_stack, {"__call__": _stack_call}, src)
    )
    dispatch.register_decode_step(
        dispatch.DecodeStep(
            "fused residual mixer", ResidualMixer, _prepare_residual_mixer, {"__call__": _residual_mixer_call}, src
        )
    )


__all__ = [
    "BlockPlan",
    "BranchPlan",
    "StackPlan",
    "branch_plan",
    "branch_step",
    "eligible",
    "enabled",
    "fused_blocks",
    "fusing",
    "norms_and_params_fit",
    "op_args",
    "plain_linear",
    "register",
    "residual_mixer_eligible",
    "stack_eligible",
    "stacks_enabled",
]
