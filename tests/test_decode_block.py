"""The fused decode step of the transformer block (``kernels/csrc/decode.cpp`` via ``kernels/decode.py``)
against its reference, ``Block.forward``: one decode step of whole models (every attention variant the
presets use, padding, looped rules, modulated blocks that must keep the reference), greedy generations,
the fallbacks, the op's argument checks and its vectorised exp at extreme inputs."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import looplm
from looplm.blocks import Block, Stack
from looplm import dispatch
from looplm.kernels import decode, gemv, loader
from looplm.kernels.stateloop import stateloop_eligible
from looplm.recurrence.stateloop import StateLoop
from looplm.layers.residual import ResidualMixer
from looplm.layers.attention import Attention, KVCache
from looplm.layers.mamba2 import Mamba2Mixer, Mamba2State
from looplm.layers.mlp import SwiGLU

from helpers import run_under_portable_build, tiny_variant

pytestmark = pytest.mark.kernels


def _fused(cls):
    """The class a module of ``cls`` has while its fused decode step is switched in."""
    return dispatch.DECODE_STEPS[cls].fused_class()


needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)
needs_kernel = pytest.mark.skipif(
    not gemv.available(), reason=f"GEMV kernels not available: {gemv.unavailable_reason()}"
)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.attention = self.swiglu = self.mamba2 = self.stateloop = self.stack = self.norm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.attention += "looplm_cpu.decode_attention" in name
        self.swiglu += "looplm_cpu.decode_swiglu" in name
        if "looplm_cpu.decode_stack" in name:  # a stack's blocks in one call: count its branches
            plan = args[1]  # looplm_cpu.StackPlan
            self.stack += 1
            self.attention += plan.size()
            self.swiglu += plan.mlp_blocks()
        self.mamba2 += "looplm_cpu.decode_mamba2" in name
        self.stateloop += "looplm_cpu.decode_stateloop" in name
        self.norm += "looplm_cpu.decode_norm" in name
        return func(*args, **(kwargs or {}))


def _model(spec, dtype, overrides=None):
    """A tiny model whose branches matter: weights ~ N(0, 0.15²) at width 64 keep every product's output
    at the scale of its input, so an error inside a branch is not hidden under the residual stream.
    ``spec``: a tiny preset, or a real preset at toy widths (tests/helpers.py)."""
    torch.manual_seed(0)
    cfg = spec if spec.startswith("tiny-") else tiny_variant(spec)
    return looplm.build(cfg, dtype=dtype, init_std=0.15, overrides=overrides).eval()


def _fused_calls_per_step(model, mixer=Attention, rule: bool = True) -> int:
    """Blocks with a ``mixer`` one decode step runs on the fused op (no modulated blocks in these models),
    and with ``rule`` the rule's residual state mixer (StateLoop's) where it has such a mixer."""

    def n(blocks):
        return sum(decode.eligible(b) and type(b.mixer) is mixer for b in blocks)

    outside = n(model.prelude.blocks) + n(model.coda.blocks)
    rule_mixer = getattr(model.rule, "mixer", None)  # StateLoop's residual state mixer: once per iteration
    in_rule = (
        rule
        and rule_mixer is not None
        and decode.residual_mixer_eligible(rule_mixer)
        and type(rule_mixer.mixer) is mixer
    )
    return outside + (n(model.core.stack.blocks) + in_rule) * model.config.n_loops


CASES = {
    # preset, overrides, batch, left padding
    "llama, one row": ("tiny-llama", {}, 1, False),
    "qwen3 QK-norm and GQA, three rows": ("tiny-qwen3", {}, 3, False),
    "attention biases": ("tiny-llama", {"attention.bias": True}, 2, False),
    "partial RoPE, attention without MLP, Mamba-2 beside": ("tiny-hybrid", {}, 2, False),
    "a stack of attention blocks without MLP, partial RoPE, left padding": (
        "tiny-qwen3",
        {"d_ff": 0, "attention.rotary_dim": 8},
        2,
        True,
    ),
    "prelude and coda, left padding": ("tiny-coreloop", {}, 2, True),
    "StateLoop's own mixers beside the blocks": ("stateloop-410m-k3", {}, 2, False),
    "StateLoop + attention state mixer (fused too)": ("stateloop-1.4b-attn", {}, 2, False),
    "StateLoop + Mamba-2 state mixer (fused too), left padding": ("stateloop-1.4b-mamba2", {}, 2, True),
    "Llama-3 RoPE scaling, tied, 2 x 10 loops": ("llama3.1-1b-baseloop-2x10", {}, 1, False),
    "Mamba-2": ("tiny-mamba2", {}, 2, False),
    "Looped Mamba-2 24x4 structure, left padding": ("mamba2-140m-loop4", {}, 2, True),
    "hybrid Looped Mamba (ngroups 2), left padding": ("tiny-hybrid", {"mamba.ngroups": 2}, 3, True),
}


def _step(model, ids, mask, fused: bool, stacks: bool = True):
    """Prefill ids[:, :-1], then decode the last token: (logits of the step, the cache, fused op counts).
    ``stacks``: whole stacks of attention blocks as one decode_stack call where they qualify."""
    B = ids.shape[0]
    with (
        torch.no_grad(),
        gemv.decode_linears(model, batch_size=B),
        decode.enabled(fused),
        decode.stacks_enabled(stacks),
        decode.fused_blocks(model),
    ):
        cache = model.new_cache(B, capacity=ids.shape[1] + 2)
        model(ids[:, :-1], cache=cache, attention_mask=None if mask is None else mask[:, :-1])
        with _CountOps() as c:
            logits = model(ids[:, -1:], cache=cache, attention_mask=mask).logits[:, -1].float()
    return logits, cache, c


def _close_bf16(got, ref, rtol, atol):
    """bf16 closeness through a recurrence: every element within 4× (atol + rtol·|ref|) and at most 3% of them
    beyond 1×. Where torch's bf16 matmul has no native bf16 (AVX2-only CPUs) the reference rounds at other
    points than the fused op, and StateLoop's state mixers carry that through every loop: a few elements land
    just past one tolerance (measured on one: single keys at 1.3–2.3×, 2 of 256 logits at 1.5×, 1% of a conv window)."""
    bound = atol + rtol * ref.float().abs()
    err = (got.float() - ref.float()).abs()
    assert got.shape == ref.shape and bool(torch.isfinite(got).all())
    assert bool((err <= 4 * bound).all()), f"max error {float(err.max()):.4g}, beyond 4× tolerance"
    frac = float((err > bound).float().mean())
    assert frac <= 0.03, f"{frac:.2%} of the elements beyond tolerance (max error {float(err.max()):.4g})"


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_step_matches_the_reference(case, dtype):
    spec, overrides, B, padded = CASES[case]
    model = _model(spec, dtype, overrides)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (B, 13), generator=g)
    mask = None
    if padded:
        mask = torch.ones(B, 13, dtype=torch.long)
        mask[0, :4] = 0  # row 0 left-padded by four
    ref, ref_cache, c_ref = _step(model, ids, mask, fused=False)
    got, got_cache, c = _step(model, ids, mask, fused=True)
    per_block, _, c_blocks = _step(model, ids, mask, fused=True, stacks=False)
    assert torch.equal(got, per_block)  # decode_stack runs the blocks' own two ops back to back: the same bits
    assert c_blocks.stack == 0
    stacks = [s for s in (model.prelude, model.core.stack, model.coda) if decode.stack_eligible(s)]
    assert c.stack == sum(model.config.n_loops if s is model.core.stack else 1 for s in stacks)
    assert c_ref.attention == c_ref.mamba2 == c_ref.stack == 0
    assert c.attention == _fused_calls_per_step(model, Attention)
    assert c.mamba2 == _fused_calls_per_step(model, Mamba2Mixer)
    assert c.attention + c.mamba2 > 0
    blocks = _fused_calls_per_step(model, Attention, rule=False) + _fused_calls_per_step(model, Mamba2Mixer, rule=False)
    assert c.swiglu == (blocks if model.config.d_ff else 0)
    # StateLoop's own step: one update per iteration, one read per iteration after the first, one terminal read
    assert c.stateloop == (2 * model.config.n_loops if stateloop_eligible(model.rule) else 0)
    assert c_ref.stateloop == 0
    if dtype == torch.float32:  # only the order of fp32 additions differs
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    else:  # each stored intermediate rounded at the reference's points: ~one bf16 rounding apart
        _close_bf16(got, ref, rtol=0.03, atol=0.03 * float(ref.abs().max()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    close = torch.testing.assert_close if dtype == torch.float32 else _close_bf16
    for key, slot in ref_cache.slots.items():  # what the op wrote: the new token's keys and values, Mamba-2 states
        other = got_cache.slots[key]
        if isinstance(slot, KVCache):
            assert other.seqlen == slot.seqlen == 13
            # bf16: a state mixer's keys come from states that went through every loop's rounding (StateLoop)
            for a, b in ((other.k, slot.k), (other.v, slot.v)):
                close(a.float(), b.float(), rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(b.abs().max())))
        elif isinstance(slot, Mamba2State):
            assert other.seqlen == slot.seqlen == 13
            conv_scale = (
                1.0 if dtype == torch.float32 else max(1.0, float(slot.conv_state.abs().max()))
            )  # fp32: absolute
            close(other.conv_state.float(), slot.conv_state.float(), rtol=tol["rtol"], atol=tol["atol"] * conv_scale)
            close(
                other.ssm_state, slot.ssm_state, rtol=tol["rtol"], atol=tol["atol"] * float(slot.ssm_state.abs().max())
            )


def _block(dtype, qk_norm=False, bias=False):
    """One block of width 64 (4 query heads, 2 key/value heads of 16), weights at the scale of _model's."""
    torch.manual_seed(3)
    ov = {"attention.qk_norm": qk_norm, "attention.bias": bias, "attention.n_heads": 4, "attention.n_kv_heads": 2}
    blk = looplm.build("tiny-llama", dtype=dtype, init_std=0.15, overrides=ov).core.stack.blocks[0].eval()
    with torch.no_grad():
        for p in blk.parameters():  # norms and biases away from 1 and 0, so that a misplaced one shows
            if p.dim() == 1:
                p.add_((0.2 * torch.randn(p.shape)).to(dtype))
    return blk


@needs_kernel  # the same products on both sides: the kernels (the portable build's differ in shape from F.linear's)
@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, True)])
def test_fused_block_is_bitwise_where_the_reference_rounds_the_same(qk_norm, bias):
    """bf16, one block, short context (one block of torch's flash kernel): every stored intermediate is
    rounded where the reference rounds it, so the caches are identical and the outputs at most one
    rounding apart at the scale of the residual sum."""
    blk = _block(torch.bfloat16, qk_norm=qk_norm, bias=bias)
    model = looplm.build("tiny-llama", overrides={"attention.n_heads": 4, "attention.n_kv_heads": 2})
    B, P = 2, 9
    fctx_p = model.forward_context(torch.zeros(B, P, dtype=torch.long), None, None, 0)
    fctx = model.forward_context(torch.zeros(B, 1, dtype=torch.long), None, None, P)
    ref_cache = KVCache(capacity=16)
    with torch.no_grad(), gemv.decode_linears(blk, batch_size=B):
        blk(torch.randn(B, P, 64).to(torch.bfloat16), fctx_p, ref_cache)
        got_cache = copy.deepcopy(ref_cache)
        x = torch.randn(B, 1, 64).to(torch.bfloat16)
        ref = blk(x, fctx, ref_cache)
        with decode.fused_blocks(blk) as n:
            assert n == 1
            got = blk(x, fctx, got_cache)
    assert type(blk) is Block
    assert torch.equal(got_cache.k, ref_cache.k) or qk_norm  # QK-norm's mean of squares may round differently
    torch.testing.assert_close(got_cache.v, ref_cache.v, rtol=0, atol=0)
    scale = torch.maximum(x.float().abs(), ref.float().abs())
    assert bool(((got.float() - ref.float()).abs() <= 2 * 2.0**-8 * scale + 1e-6).all())


@needs_extension
def test_fused_attention_long_masked_context_fp32():
    """Hundreds of cached tokens, most of one row masked (left padding), GQA: the op against SDPA."""
    blk = _block(torch.float32)
    model = looplm.build("tiny-llama", overrides={"attention.n_heads": 4, "attention.n_kv_heads": 2}, max_seq_len=512)
    B, P = 2, 300
    mask = torch.ones(B, P + 1, dtype=torch.long)
    mask[1, :250] = 0
    fctx_p = model.forward_context(torch.zeros(B, P, dtype=torch.long), mask[:, :-1], None, 0)
    fctx = model.forward_context(torch.zeros(B, 1, dtype=torch.long), mask, None, P)
    ref_cache = KVCache(capacity=P + 1)
    with torch.no_grad():
        blk(torch.randn(B, P, 64), fctx_p, ref_cache)
        got_cache = copy.deepcopy(ref_cache)
        x = torch.randn(B, 1, 64)
        ref = blk(x, fctx, ref_cache)
        with decode.fused_blocks(blk), _CountOps() as c:
            got = blk(x, fctx, got_cache)
    assert c.attention == 1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_at_extreme_gates(dtype):
    """The op's SiLU (its own vectorised exp) at gate values from -120 to 120 (exp over- and underflow)."""
    torch.manual_seed(0)
    d, ff = 64, 96
    sw, norm = SwiGLU(d, ff).to(dtype), nn.RMSNorm(d, eps=1e-5).to(dtype)
    x = torch.randn(3, 1, d).to(dtype)
    with torch.no_grad():
        sw.gate_proj.weight.mul_(400)  # gate pre-activations of order +-100
        ref = x + sw(norm(x))
        got = torch.ops.looplm_cpu.decode_swiglu(
            x, norm.weight, 1e-5, sw.gate_proj.weight, None, sw.up_proj.weight, None, sw.down_proj.weight, None
        )
        gates = sw.gate_proj(norm(x)).float()
    assert gates.min() < -88 and gates.max() > 88
    assert torch.isfinite(got).all()
    tol = (
        dict(rtol=1e-5, atol=1e-4)
        if dtype == torch.float32
        else dict(rtol=0.02, atol=0.05 * float(ref.float().abs().max()))
    )
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@needs_extension
@pytest.mark.parametrize(
    "spec,B,padded",
    [
        ("tiny-llama", 1, False),
        ("tiny-qwen3", 3, True),
        ("tiny-coreloop", 2, False),
        ("tiny-hybrid", 2, True),
        ("tiny-stateloop", 1, False),
        ("tiny-mamba2", 2, True),
        ("stateloop-1.4b-attn", 2, False),
        ("stateloop-1.4b-mamba2", 2, True),
    ],
)
def test_generate_fused_gives_the_reference_tokens(spec, B, padded):
    """fp32 greedy decoding: the fused blocks change only the order of fp32 additions, so the tokens of
    every step are the reference's (and the blocks are switched back afterwards)."""
    model = _model(spec, torch.float32)
    torch.manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (B, 9))
    mask = None
    if padded:
        mask = torch.ones(B, 9, dtype=torch.long)
        mask[0, :3] = 0
    with _CountOps() as c:
        got = model.generate(ids, max_new_tokens=8, attention_mask=mask)
    with decode.enabled(False):
        ref = model.generate(ids, max_new_tokens=8, attention_mask=mask)
    assert torch.equal(got, ref)
    assert c.attention == 7 * _fused_calls_per_step(model, Attention)  # 7 one-token steps after the prompt
    assert c.mamba2 == 7 * _fused_calls_per_step(model, Mamba2Mixer)
    assert not any(type(m) in (_fused(Block), _fused(ResidualMixer)) for m in model.modules())


@needs_extension
def test_modulated_blocks_keep_the_reference():
    """Timestep conditioning (branch gating) modulates every core block: those calls take Block.forward,
    the unmodulated prelude/coda blocks the fused op, and the tokens are the reference's."""
    model = looplm.build(
        "tiny-coreloop", overrides={"rule": {"name": "timestep", "options": {"gating": "branch"}}}
    ).eval()
    for p in model.rule.parameters():
        p.data.normal_(0, 0.3)  # a gating that is not the identity
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with _CountOps() as c:
        got = model.generate(ids, max_new_tokens=4)
    with decode.enabled(False):
        ref = model.generate(ids, max_new_tokens=4)
    assert torch.equal(got, ref)
    outside_core = len(model.prelude.blocks) + len(model.coda.blocks)
    assert outside_core > 0 and c.attention == 3 * outside_core


@needs_extension
@pytest.mark.parametrize("spec", ["ouro-1.4b", "huginn-0125", "sliding"])
def test_sandwich_post_sum_and_windowed_blocks_keep_the_reference(spec):
    """The fused step computes ``x + f(N(x))`` over the whole cache: sandwich (Ouro) and post-sum (Huginn)
    blocks and sliding-window attention are not eligible (nor their stacks), decode on the reference, and
    give its tokens; a pre-norm block of the same model shape stays eligible."""
    if spec == "sliding":
        model = _model(
            "tiny-llama", torch.float32, overrides={"attention.sliding_window": 3, "attention.sliding_layer_idx": [1]}
        )
        windowed = [b for b in model.modules() if isinstance(b, Block) and b.mixer.sliding_window is not None]
        assert windowed and not any(decode.eligible(b) for b in windowed)
        assert not decode.stack_eligible(model.core.stack)
    else:
        model = _model(spec, torch.float32, overrides={"n_loops": 2})
        blocks = [b for b in model.modules() if isinstance(b, Block)]
        assert blocks and not any(decode.eligible(b) for b in blocks)
        assert not any(decode.stack_eligible(st) for st in (model.prelude, model.core.stack, model.coda) if len(st))
        plain = _model(spec, torch.float32, overrides={"n_loops": 2, "norm_placement": "pre"})
        assert all(decode.eligible(b) for b in plain.modules() if isinstance(b, Block))
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    with _CountOps() as c:
        got = model.generate(ids, max_new_tokens=5, attention_mask=mask)
    with decode.enabled(False):
        ref = model.generate(ids, max_new_tokens=5, attention_mask=mask)
    assert torch.equal(got, ref)
    assert c.attention == 4 * _fused_calls_per_step(model, Attention)  # only eligible blocks took the op
    if spec != "sliding":
        assert c.attention == 0 and c.stack == 0


@needs_extension
def test_fallbacks_take_the_reference():
    """The prompt step, a growing cache, autograd, a hooked block and a compiled block's prompt."""
    model = _model("tiny-llama", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with decode.fused_blocks(model) as n, _CountOps() as c, torch.no_grad():
        assert n == len(model.core.stack.blocks)
        cache = model.new_cache(1, capacity=8)
        model(ids, cache=cache)  # prompt: several tokens per row
        assert c.attention == 0
        model(ids[:, :1], cache=cache)
        assert c.attention == n * model.config.n_loops
        grow = model.new_cache(1)  # no capacity: KV slots grow by concatenation
        model(ids, cache=grow)
        model(ids[:, :1], cache=grow)
        assert c.attention == n * model.config.n_loops
    with decode.fused_blocks(model), _CountOps() as c:  # autograd on: the reference (the op has no backward)
        cache = model.new_cache(1, capacity=8)
        model(ids, cache=cache)
        assert model(ids[:, :1], cache=cache).logits.requires_grad
        assert c.attention == 0
    h = model.core.stack.blocks[0].mlp.register_forward_hook(lambda *a: None)
    try:
        assert not decode.eligible(model.core.stack.blocks[0])
        with decode.fused_blocks(model) as n:
            assert n == len(model.core.stack.blocks) - 1
    finally:
        h.remove()
    with decode.enabled(False), decode.fused_blocks(model) as n:
        assert n == 0


@needs_extension
def test_compiled_blocks_decode_fused_and_match_eager():
    """``looplm generate --compile``: the prompt step runs the compiled blocks, the one-token steps the
    fused op (cheaper than a compiled block's guards and wrapper), with the eager tokens."""
    from looplm.parallel import compile_blocks

    torch._dynamo.reset()
    eager = _model("tiny-llama", torch.bfloat16)
    model = _model("tiny-llama", torch.bfloat16)
    compile_blocks(model, backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with _CountOps() as c:
        got = model.generate(ids, max_new_tokens=5)
    assert torch.equal(got, eager.generate(ids, max_new_tokens=5))
    assert c.attention == 4 * _fused_calls_per_step(model)
    assert all(b._compiled_call_impl is not None for b in model.modules() if isinstance(b, Block))


def test_unavailable_kernels_mean_no_fused_blocks(monkeypatch):
    monkeypatch.setattr(loader, "_state", {"ok": False, "reason": "test"})
    model = looplm.build("tiny-llama", dtype=torch.bfloat16).eval()
    with decode.fused_blocks(model) as n:
        assert n == 0
    assert not any(type(m) is _fused(Block) for m in model.modules())


def test_eligibility():
    """Plain attention and Mamba-2 blocks of one CPU dtype (bf16 or fp32) qualify; fp64, mixed dtypes do
    not. A rule's residual state mixer (StateLoop's attention / Mamba-2 over its state) qualifies as a
    fused residual mixer under the same rules, not as a block; hooks on it keep the reference."""
    for name in ("stateloop-1.4b-attn", "stateloop-1.4b-mamba2"):
        sl = _model(name, torch.float32)
        assert decode.residual_mixer_eligible(sl.rule.mixer) and not decode.eligible(sl.rule.mixer)
        with decode.fused_blocks(sl):
            assert type(sl.rule.mixer) is _fused(ResidualMixer)
        assert type(sl.rule.mixer) is ResidualMixer and "_looplm_decode" not in sl.rule.mixer.__dict__
        handle = sl.rule.mixer.mixer.register_forward_hook(lambda *a: None)
        assert not decode.residual_mixer_eligible(sl.rule.mixer)
        handle.remove()
        assert not decode.residual_mixer_eligible(_model(name, torch.float64).rule.mixer)
    assert not decode.residual_mixer_eligible(looplm.build("tiny-stateloop").rule)  # identity mixer: nothing to fuse
    # the rule's own update and reads: the SSM update without reset, one dtype, no hooks
    sl = looplm.build("tiny-stateloop")
    assert stateloop_eligible(sl.rule) and not stateloop_eligible(looplm.build("tiny-llama").rule)
    with decode.fused_blocks(sl):
        assert type(sl.rule) is _fused(StateLoop)
    assert type(sl.rule) is StateLoop and "_looplm_decode" not in sl.rule.__dict__
    for opts in ({"update": "gru"}, {"reset": True}):
        other = looplm.build("tiny-stateloop", overrides={f"rule.options.{k}": v for k, v in opts.items()})
        assert not stateloop_eligible(other.rule), opts
    handle = sl.rule.W_u.register_forward_hook(lambda *a: None)
    assert not stateloop_eligible(sl.rule)
    handle.remove()
    assert not stateloop_eligible(looplm.build("tiny-stateloop", dtype=torch.float64).rule)
    hybrid = looplm.build("tiny-hybrid")
    kinds = {(type(b.mixer).__name__, decode.eligible(b)) for b in hybrid.modules() if isinstance(b, Block)}
    assert kinds == {("Attention", True), ("Mamba2Mixer", True)}
    assert not any(
        decode.eligible(b) for b in looplm.build("tiny-llama", dtype=torch.float64).modules() if isinstance(b, Block)
    )
    mixed = looplm.build("tiny-llama")
    mixed.core.stack.blocks[0].mlp.down_proj.to(torch.bfloat16)
    assert not decode.eligible(mixed.core.stack.blocks[0]) and decode.eligible(mixed.core.stack.blocks[1])


@needs_extension
def test_op_rejects_bad_arguments_with_a_message():
    blk = _block(torch.float32)
    args = list(decode.branch_plan(blk.mixer_norm, blk.mixer).weights)
    x = torch.randn(2, 1, 64)
    k = torch.zeros(2, 2, 8, 16)
    cos, sin = torch.ones(2, 1, 16), torch.zeros(2, 1, 16)
    op = torch.ops.looplm_cpu.decode_attention
    with pytest.raises(RuntimeError, match="do not fit the caches' capacity 8"):
        op(x, *args, cos, sin, k, k.clone(), 8, None, 4)
    with pytest.raises(
        RuntimeError, match=r"attn_mask must be a contiguous bool \[B, 1, T, pos \+ T\] = \[2, 1, 1, 4\]"
    ):
        op(x, *args, cos, sin, k, k.clone(), 3, torch.ones(2, 1, 1, 3, dtype=torch.bool), 4)
    with pytest.raises(RuntimeError, match="wq must be a contiguous CPU float32 tensor like x"):
        bad = list(args)
        bad[2] = bad[2].to(torch.bfloat16)
        op(x, *bad, cos, sin, k, k.clone(), 3, None, 4)
    with pytest.raises(RuntimeError, match=r"with 1 <= T <= 64 new tokens per row"):
        op(torch.randn(2, 65, 64), *args, cos, sin, k, k.clone(), 3, None, 4)
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[B, T, rot\] tables \(T = 3\)"):
        op(torch.randn(2, 3, 64), *args, cos, sin, k, k.clone(), 3, None, 4)  # 3 tokens, tables of one
    with pytest.raises(RuntimeError, match="must be a multiple of the caches' 2 key/value heads"):
        op(x, *args, cos, sin, k, k.clone(), 3, None, 3)


@needs_extension
def test_decode_stack_eligibility_fallbacks_and_checks():
    """A plain stack of eligible attention blocks runs as one decode_stack call per step; a hooked stack, a
    stack with a Mamba-2 block, caches at different positions and bad arguments do not."""
    model = _model("tiny-llama", torch.bfloat16)
    stack = model.core.stack
    assert decode.stack_eligible(stack) and not decode.stack_eligible(model.prelude)  # no blocks: nothing to run
    assert not decode.stack_eligible(looplm.build("tiny-hybrid").core.stack)
    h = stack.register_forward_pre_hook(lambda *a: None)
    assert not decode.stack_eligible(stack)
    h.remove()
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad(), decode.fused_blocks(model), _CountOps() as c:
        assert type(stack) is _fused(Stack)
        cache = model.new_cache(1, capacity=8)
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
        assert c.stack == model.config.n_loops and c.attention == len(stack.blocks) * model.config.n_loops
        slot = cache.slot((0, stack.blocks[1].layer_idx), None)
        slot.crop(slot.seqlen - 1)  # one block's cache a token behind the others: the blocks one by one
        model(ids[:, :1], cache=cache)
        assert c.stack == model.config.n_loops + model.config.n_loops - 1
    assert type(stack) is Stack and "_looplm_decode" not in stack.__dict__
    plan = decode._prepare_stack(stack, 1).plan  # every block's parameters by their state-dict names
    assert plan.size() == len(stack.blocks)
    x = torch.randn(1, 1, model.config.d_model, dtype=torch.bfloat16)
    ks = [
        torch.zeros(1, model.config.attention.n_kv_heads, 8, model.config.head_dim, dtype=torch.bfloat16)
        for _ in stack.blocks
    ]
    op = torch.ops.looplm_cpu.decode_stack
    with pytest.raises(RuntimeError, match=r"the plan has 2 blocks; give one k and one v cache each, got 1 and 2"):
        op(x, plan, ks[:1], [k.clone() for k in ks], 3, None, None, None)
    named = dict(stack.blocks[1].named_parameters())
    bad = torch.classes.looplm_cpu.StackPlan()
    with pytest.raises(RuntimeError, match="StackPlan.add_block: block 0 lacks mixer.k_proj.weight"):
        bad.add_block({k: v for k, v in named.items() if k != "mixer.k_proj.weight"}, 1e-5, 0.0, 1e-5, 4)
    bad.add_block({**named, "mlp.up_proj.weight": named["mlp.up_proj.weight"].float()}, 1e-5, 0.0, 1e-5, 4)
    with pytest.raises(RuntimeError, match="decode_stack: w_up must be a contiguous CPU bfloat16 tensor like x"):
        op(x, bad, ks[:1], [ks[0].clone()], 3, None, None, None)
    with pytest.raises(RuntimeError, match="decode_stack: positions 8..8 do not fit the caches' capacity 8"):
        op(x, plan, ks, [k.clone() for k in ks], 8, None, None, None)


@needs_extension
def test_cpp_dispatch_rule_is_the_python_one():
    """The fused op picks its products' path in C++ (gemv.h kernel_wins) by the rule gemv.py documents
    (never a kernel in the portable build)."""
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):
            for k in (64, 576, 1024, 1536, 2048, 6144, 8192):
                want = gemv.available() and gemv.kernel_wins(rows, k, dt) and dt in (torch.bfloat16, torch.float32)
                assert torch.ops.looplm_cpu.kernel_wins(rows, k, dt) == want, (dt, rows, k)
    if (
        gemv.available()
    ):  # fp32: 1-8 rows, rows x K <= 6144 on Intel CPUs; 1-8 rows of any K elsewhere (MKL's slow path)
        from looplm.utils import cpuinfo

        intel = torch.ops.looplm_cpu.intel_cpu()
        assert intel == (cpuinfo.vendor() == "GenuineIntel")
        fp32 = {(1, 8192): not intel, (8, 768): True, (8, 1024): not intel, (4, 4096): not intel, (9, 64): False}
        assert {rk: torch.ops.looplm_cpu.kernel_wins(*rk, torch.float32) for rk in fp32} == fp32
    if gemv.available() and not torch.ops.looplm_cpu.amx_ready():  # bf16 without AMX: up to 8 rows, rows x K <= 4608
        wins = {
            (5, 256): True,
            (8, 576): True,
            (4, 1024): True,
            (6, 768): True,
            (5, 1024): False,
            (9, 256): False,
            (2, 4096): False,
        }
        assert {rk: torch.ops.looplm_cpu.kernel_wins(*rk, torch.bfloat16) for rk in wins} == wins
        # and up to 8 rows of any K for a weight of N x K <= 2^19 entries (a small vocabulary's head)
        small = {
            (8, 1024, 260): True,
            (8, 1024, 512): True,
            (8, 1024, 513): False,
            (8, 4096, 128): True,
            (9, 1024, 260): False,
            (8, 1024, 0): False,
        }
        assert {rkn: torch.ops.looplm_cpu.kernel_wins(rkn[0], rkn[1], torch.bfloat16, rkn[2]) for rkn in small} == small
        assert {rkn: gemv.kernel_wins(rkn[0], rkn[1], torch.bfloat16, rkn[2]) for rkn in small} == small


@needs_extension
def test_portable_build_passes_these_tests():
    """The build CPUs without AVX512-BF16 get (plain C++ and AVX2, torch's matmul for the products), forced
    with LOOPLM_CPU_KERNELS=portable: every other test of this file, in a fresh process."""
    assert "skipped" in run_under_portable_build(__file__)  # the kernel-only tests skip there


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mamba2_step_of_a_padding_row(dtype):
    """A row whose new position is padding (pad_mask false) enters the conv as zeros and keeps its SSM
    state (dt = 0), as the reference step does; the other row steps normally."""
    model = _model("tiny-mamba2", dtype)
    blk = model.core.stack.blocks[0]
    B, P = 2, 6
    fctx_p = model.forward_context(torch.zeros(B, P, dtype=torch.long), None, None, 0)
    fctx = model.forward_context(torch.zeros(B, 1, dtype=torch.long), None, None, P)
    fctx.pad_mask = torch.tensor([[True], [False]])
    ref_state = blk.new_cache(B)
    with torch.no_grad():
        blk(torch.randn(B, P, 64).to(dtype), fctx_p, ref_state)
        got_state = copy.deepcopy(ref_state)
        before = ref_state.ssm_state.clone()
        x = torch.randn(B, 1, 64).to(dtype)
        ref = blk(x, fctx, ref_state)
        with decode.fused_blocks(blk), _CountOps() as c:
            got = blk(x, fctx, got_state)
    assert c.mamba2 == 1
    assert torch.equal(got_state.ssm_state[1], before[1]) and torch.equal(ref_state.ssm_state[1], before[1])
    assert not torch.equal(got_state.ssm_state[0], before[0])
    assert torch.equal(got_state.conv_state[1, :, -1], torch.zeros_like(got_state.conv_state[1, :, -1]))
    tol = (
        dict(rtol=1e-5, atol=1e-5)
        if dtype == torch.float32
        else dict(rtol=0.02, atol=0.02 * float(ref.float().abs().max()))
    )
    # (the input projection may run on looplm's GEMV kernel, fp32 too: summation order only)
    torch.testing.assert_close(got_state.conv_state.float(), ref_state.conv_state.float(), **tol)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    torch.testing.assert_close(
        got_state.ssm_state, ref_state.ssm_state, **(dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else tol)
    )


@needs_extension
def test_mamba2_op_rejects_bad_arguments_with_a_message():
    blk = _model("tiny-mamba2", torch.float32).core.stack.blocks[0]
    args = decode.branch_plan(blk.mixer_norm, blk.mixer).weights
    state = blk.new_cache(2)
    x = torch.randn(2, 1, 64)
    op = torch.ops.looplm_cpu.decode_mamba2
    with pytest.raises(RuntimeError, match="ssm_state must be a contiguous float32"):
        op(x, *args, state.conv_state, state.ssm_state.to(torch.bfloat16), None)
    with pytest.raises(
        RuntimeError, match=r"conv_state must be a contiguous float32 \[B, conv_dim, d_conv\] tensor with B = 2"
    ):
        op(x, *args, state.conv_state[:1], state.ssm_state, None)
    with pytest.raises(RuntimeError, match=r"pad_mask must be a contiguous bool \[B, 1\]"):
        op(x, *args, state.conv_state, state.ssm_state, torch.ones(3, 1, dtype=torch.bool))


@needs_extension
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mamba2"])
def test_fused_generate_gives_transformers_tokens(arch):
    """Parity with transformers holds on the fused path: a model imported from transformers (fp32)
    decodes, with its blocks fused, the tokens of transformers' own greedy ``generate``."""
    import transformers

    from looplm.interop import from_transformers

    torch.manual_seed(0)
    if arch == "mamba2":
        cfg = transformers.Mamba2Config(
            vocab_size=300,
            hidden_size=64,
            state_size=16,
            num_hidden_layers=2,
            expand=2,
            head_dim=16,
            num_heads=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=16,
            tie_word_embeddings=False,
        )
        hf = transformers.Mamba2ForCausalLM(cfg).eval()
    else:
        kind = transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config
        cfg = kind(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            initializer_range=0.1,
        )
        hf = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3ForCausalLM)(cfg).eval()
    ours = from_transformers(hf).eval()
    x = torch.randint(0, 300, (2, 9))
    with _CountOps() as c:
        got = ours.generate(x, max_new_tokens=10)
    assert c.attention + c.mamba2 == 9 * 2  # 9 one-token steps x 2 blocks
    assert torch.equal(got, hf.generate(x, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0))


@needs_extension
def test_stateloop_ops_reject_bad_arguments_with_a_message():
    rule = looplm.build("tiny-stateloop").eval().rule
    u = rule.update
    h, S = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    op = torch.ops.looplm_cpu.decode_stateloop_update
    with pytest.raises(RuntimeError, match=r"w_u must be \[64, 64\]"):
        op(h, S, rule.norm_h.weight, 1e-5, rule.W_u.weight[:10], u.W_delta.weight, u.b_delta, u.A_log)
    with pytest.raises(RuntimeError, match="S must be a \\[B, 1, d_s\\] tensor of h's dtype and batch"):
        op(h, S[:1], rule.norm_h.weight, 1e-5, rule.W_u.weight, u.W_delta.weight, u.b_delta, u.A_log)
    with pytest.raises(RuntimeError, match="one new token per row"):
        torch.ops.looplm_cpu.decode_stateloop_read(torch.randn(2, 3, 64), S, rule.norm_s.weight, 1e-5, rule.W_sz.weight)


@needs_extension
def test_a_lone_norm_takes_decode_norm_for_one_token_per_row():
    """The final norm (and any lone ``nn.RMSNorm``) on ``[B, 1, d]`` runs ``decode_norm`` inside the decode
    steps: torch's ``rms_norm`` bit for bit in bf16, to 1e-6 in fp32 (the mean's additions in another order);
    other shapes, autograd and a weightless norm keep the reference; bad arguments are refused by name."""
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        n = nn.RMSNorm(96, eps=1e-6).to(dt)
        with torch.no_grad():
            n.weight.normal_()
        x = torch.randn(5, 1, 96).to(dt)
        with torch.no_grad():
            ref = n(x)
            model = nn.Sequential(n)
            with dispatch.decode_steps(model, batch_size=5):
                assert type(n) is _fused(nn.RMSNorm)
                with _CountOps() as c:
                    got = n(x)
                    n(torch.randn(5, 3, 96).to(dt))  # a prompt: the reference
            assert type(n) is nn.RMSNorm
        if dt == torch.bfloat16:
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        assert c.norm == 1
    assert decode._prepare_norm(nn.RMSNorm(8, elementwise_affine=False), 1) is None
    op = torch.ops.looplm_cpu.decode_norm
    with pytest.raises(RuntimeError, match="one new token per row"):
        op(torch.randn(2, 3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="norm_weight"):
        op(torch.randn(2, 1, 8), torch.ones(7), 1e-5)
