"""``decode_stack`` with a few new tokens per row (a speculative verification's ``k + 1`` drafted tokens,
inside :func:`looplm.dispatch.few_token_steps`) against the reference forward of those tokens on the same
cache: causal inside the call, left padding and holes in the mask, QK-norm, GQA, partial RoPE, row views."""

import pytest
import torch

import looplm
from looplm import dispatch
from looplm.kernels import decode, gemv

from helpers import run_under_portable_build, tiny_variant

pytestmark = pytest.mark.kernels

needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)


class _CountStacks(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.tokens = []  # new tokens per row of every decode_stack call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "looplm_cpu.decode_stack" in str(func):
            self.tokens.append(args[0].shape[1])
        return func(*args, **(kwargs or {}))


def _model(spec, dtype, overrides=None):
    torch.manual_seed(0)
    cfg = spec if spec.startswith("tiny-") else tiny_variant(spec)
    return looplm.build(cfg, dtype=dtype, init_std=0.15, overrides=overrides).eval()


def _few(model, ids, mask, T, fused: bool):
    """Prefill ids[:, :-T], then one forward of the last T tokens on the cache: (logits [B, T, V], counter)."""
    B = ids.shape[0]
    with torch.no_grad(), decode.enabled(fused), dispatch.decode_steps(model, batch_size=B):
        cache = model.new_cache(B, capacity=ids.shape[1] + 4)
        model(ids[:, :-T], cache=cache, attention_mask=None if mask is None else mask[:, :-T])
        with dispatch.few_token_steps(), _CountStacks() as c:
            logits = model(ids[:, -T:], cache=cache, attention_mask=mask).logits.float()
    return logits, c


CASES = {
    # preset, overrides, batch, mask: None | "pad" (left padding) | "holes" (left padding and masked columns)
    "llama, one row": ("tiny-llama", {}, 1, None),
    "qwen3 QK-norm and GQA, left padding": ("tiny-qwen3", {}, 3, "pad"),
    "partial RoPE, no MLP, holes": ("tiny-qwen3", {"d_ff": 0, "attention.rotary_dim": 8}, 2, "holes"),
    "attention biases": ("tiny-llama", {"attention.bias": True}, 2, None),
    "prelude and coda, holes": ("tiny-coreloop", {}, 2, "holes"),
}


@needs_extension
@pytest.mark.parametrize("T", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_few_token_stack_matches_the_reference(case, dtype, T):
    spec, over, B, kind = CASES[case]
    model = _model(spec, dtype, over)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (B, 9 + T), generator=g)
    mask = None
    if kind is not None:
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0  # the last row is left-padded
        if kind == "holes":
            mask[0, 6] = 0  # a rejected draft's column inside the cache (a hole)
            mask[-1, 7] = 0
    ref, c_ref = _few(model, ids, mask, T, fused=False)
    got, c = _few(model, ids, mask, T, fused=True)
    assert c_ref.tokens == [] and T in c.tokens, c.tokens  # the fused op took the T-token calls
    tol = 1e-4 if dtype == torch.float32 else 0.08
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= tol * scale, float((got - ref).abs().max() / scale)
    if dtype == torch.float32:
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@needs_extension
def test_several_tokens_outside_few_token_steps_keep_the_reference():
    model = _model("tiny-llama", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad(), dispatch.decode_steps(model, batch_size=2):
        cache = model.new_cache(2, capacity=16)
        model(ids[:, :8], cache=cache)
        with _CountStacks() as c:
            model(ids[:, 8:], cache=cache)  # 4 tokens, not inside few_token_steps: the reference
    assert c.tokens == []


@needs_extension
def test_few_token_op_checks_capacity_and_mask_shape():
    torch.manual_seed(0)
    model = _model("tiny-llama", torch.float32)
    stack = model.core.stack
    plan = decode._prepare_stack(stack, 1).plan
    n = len(stack.blocks)
    hd = stack.blocks[0].mixer.head_dim
    G = stack.blocks[0].mixer.n_kv_heads
    d = model.config.d_model
    ks = [torch.zeros(1, G, 8, hd) for _ in range(n)]
    vs = [torch.zeros(1, G, 8, hd) for _ in range(n)]
    x = torch.randn(1, 3, d)
    with pytest.raises(RuntimeError, match="do not fit the caches' capacity"):
        torch.ops.looplm_cpu.decode_stack(x, plan, ks, vs, 6, None, None, None)
    with pytest.raises(RuntimeError, match=r"attn_mask must be a contiguous bool \[B, 1, T, pos \+ T\]"):
        torch.ops.looplm_cpu.decode_stack(x, plan, ks, vs, 2, None, None, torch.ones(1, 1, 1, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="1 <= T <= 64"):
        torch.ops.looplm_cpu.decode_stack(torch.randn(1, 65, d), plan, ks, vs, 0, None, None, None)


@needs_extension
def test_portable_build_passes_these_tests():
    """The build CPUs without AVX512-BF16 get (LOOPLM_CPU_KERNELS=portable): every other test of this file."""
    run_under_portable_build(__file__)
