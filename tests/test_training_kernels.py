"""The extension's training kernels against their references: the CPU attention backward
(csrc/attention.cpp, kernels/training.py: CPUAttention) against the autograd of
F.scaled_dot_product_attention — gradients, where it applies, models, compiled blocks, errors — and the
cross-entropy rows (csrc/loss.cpp) against loss.py's PyTorch loop; and both in the portable build."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.kernels import gemv
from looplm.kernels.training import CPUAttention, attention, cpu_backward_applies
from looplm.layers import loss as loss_mod

from helpers import run_under_portable_build, tiny_variant

pytestmark = pytest.mark.kernels

needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)
# training takes the ops only in the build with the AVX-512 kernels (the portable one runs them for these tests)
needs_kernels = pytest.mark.skipif(
    not gemv.available(), reason=f"the AVX-512 build is not available: {gemv.unavailable_reason()}"
)

# (B, H, H_kv, T, hd, causal): GQA and MHA, T not a multiple of the 64-row query block, odd T, one
# query, head dims 32 / 64 / 128, full (non-causal) attention with S != T.
SHAPES = [
    (2, 6, 2, 70, 64, True),
    (1, 4, 4, 129, 32, True),
    (2, 3, 1, 1, 64, True),
    (1, 2, 1, 33, 128, True),
    (2, 4, 2, 65, 64, False),
]


def _inputs(B, H, Hkv, T, hd, dtype, S=None, seed=0):
    """q, k, v as the model makes them: [B, T, H, hd] projections viewed as [B, H, T, hd] (strided)."""
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, H, hd, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(B, S, Hkv, hd, generator=g).transpose(1, 2).to(dtype)
    v = torch.randn(B, S, Hkv, hd, generator=g).transpose(1, 2).to(dtype)
    go = torch.randn(B, H, T, hd, generator=g).to(dtype)
    return q, k, v, go


def _grads(fn, q, k, v, go, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _ours(q, k, v, causal):
    return CPUAttention.apply(q, k, v, causal)


def _rel(a, ref):
    """Largest error relative to the largest gradient, or to 1 (the inputs' scale) where that is smaller:
    with one key dq is exactly 0 and only rounding remains."""
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


@needs_extension
@pytest.mark.parametrize(
    "shape", SHAPES, ids=[f"B{s[0]}H{s[1]}kv{s[2]}T{s[3]}hd{s[4]}{'c' if s[5] else 'full'}" for s in SHAPES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_match_sdpa(shape, dtype):
    """The output and dq, dk, dv against SDPA's autograd in float64: fp32 to ~1e-6; bf16 no further from
    float64 than SDPA's own bf16 forward and backward are (plus a rounding), for every shape."""
    B, H, Hkv, T, hd, causal = shape
    S = T + 7 if not causal else None
    q, k, v, go = _inputs(B, H, Hkv, T, hd, dtype, S)
    ref = _grads(_sdpa, *(t.double() for t in (q, k, v, go)), causal)
    ours = _grads(_ours, q, k, v, go, causal)
    theirs = _grads(_sdpa, q, k, v, go, causal)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert a.shape == r.shape and a.dtype == dtype
        if dtype == torch.float32:
            assert _rel(a, r) < 5e-6, name
        else:
            assert _rel(a, r) <= 1.5 * _rel(b, r) + 4e-3, (name, _rel(a, r), _rel(b, r))


@needs_extension
def test_large_scores_and_fully_masked_tail():
    """Sharp softmaxes (scores of ±60 after scaling: e^x over- and underflows without the log-sum-exp)
    and keys past a row's position (exactly zero weight) give SDPA's gradients."""
    q, k, v, go = _inputs(1, 2, 1, 90, 64, torch.float32, seed=3)
    q = q * 8.0
    ref = _grads(_sdpa, *(t.double() for t in (q, k, v, go)), True)
    ours = _grads(_ours, q, k, v, go, True)
    for a, r in zip(ours[1:], ref[1:]):
        assert torch.isfinite(a).all()
        assert _rel(a, r) < 2e-5
    # the last key only receives gradient from the last query row
    q2, k2, v2, go2 = _inputs(1, 1, 1, 5, 16, torch.float32, seed=4)
    go2[:, :, :-1] = 0
    _, _, dk, dv = _grads(_ours, q2, k2, v2, go2, True)
    _, _, dk_ref, dv_ref = _grads(_sdpa, q2, k2, v2, go2, True)
    torch.testing.assert_close(dk, dk_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dv, dv_ref, atol=1e-6, rtol=1e-5)


@needs_kernels
def test_where_it_applies():
    """Training on a CPU without a mask takes CPUAttention; inference, masks, a causal call with a cache
    (fewer queries than keys) and tensors that need no gradient keep SDPA."""
    q, k, v, _ = _inputs(1, 4, 2, 8, 16, torch.float32)
    qg = q.clone().requires_grad_()
    assert cpu_backward_applies(qg, k, v, None, True)
    assert cpu_backward_applies(qg, k, v, None, False)
    assert not cpu_backward_applies(q, k, v, None, True)  # nothing needs a gradient
    with torch.no_grad():
        assert not cpu_backward_applies(qg, k, v, None, True)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert not cpu_backward_applies(qg, k, v, mask, False)
    assert not cpu_backward_applies(qg[:, :, :3], k, v, None, True)
    assert cpu_backward_applies(qg.double(), k.double(), v.double(), None, True) is False  # fp64: SDPA
    y = attention(qg, k, v, is_causal=True, enable_gqa=True)
    assert y.grad_fn is not None and "CPUAttention" in type(y.grad_fn).__name__
    with torch.no_grad():  # fp32: looplm's forward in training, SDPA in inference, equal to rounding
        torch.testing.assert_close(
            attention(qg, k, v, is_causal=True, enable_gqa=True), y.detach(), rtol=1e-5, atol=1e-6
        )
    qb, kb, vb = qg.detach().bfloat16().requires_grad_(), k.bfloat16(), v.bfloat16()
    yb = attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    assert "CPUAttention" in type(yb.grad_fn).__name__
    with torch.no_grad():  # bf16: the flash forward in both, bit for bit
        assert torch.equal(attention(qb, kb, vb, is_causal=True, enable_gqa=True), yb.detach())


@needs_extension
def test_without_the_kernels_training_keeps_sdpa_and_the_pytorch_loop(monkeypatch):
    """Where the extension lacks its AVX-512 kernels (the portable build: its plain-loop softmax is slower
    than torch's), training keeps SDPA and loss.py's loop; with them, it takes both ops."""
    q, k, v, _ = _inputs(1, 4, 2, 8, 16, torch.float32)
    assert cpu_backward_applies(q.requires_grad_(), k, v, None, True) == gemv.available()
    calls = []
    op = torch.ops.looplm_cpu.cross_entropy_rows_
    monkeypatch.setattr(
        loss_mod.torch.ops.looplm_cpu, "cross_entropy_rows_", lambda *a: calls.append(1) or op(*a), raising=False
    )
    loss_mod.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.arange(4))
    assert bool(calls) == gemv.available()


@needs_extension
def test_autocast_casts_inputs_like_sdpa():
    """Under CPU autocast the inputs are cast to bf16 first (as autocast does for SDPA): same output as
    SDPA under autocast, a bf16 result, gradients back in the inputs' dtype."""
    q, k, v, go = _inputs(2, 4, 2, 20, 32, torch.float32)
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attention(q, k, v, is_causal=True, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert y.dtype == torch.bfloat16
    if gemv.available():  # bf16 takes the kernel where the CPU has native bf16
        assert "CPUAttention" in type(y.grad_fn).__name__
    torch.testing.assert_close(y.float(), ref.float(), atol=0, rtol=0)
    y.backward(go.to(y.dtype))
    assert q.grad.dtype == torch.float32


def _model_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, return_logits=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _uses_cpu_attention(model, ids) -> bool:
    """Whether a training forward of ``model`` builds a CPUAttention node (the path under test ran)."""
    seen = []
    orig = CPUAttention.forward

    def spy(ctx, *args):
        seen.append(1)
        return orig(ctx, *args)

    CPUAttention.forward = staticmethod(spy)
    try:
        model(ids, labels=ids, return_logits=False)
    finally:
        CPUAttention.forward = staticmethod(orig)
    return bool(seen)


@needs_kernels
@pytest.mark.parametrize(
    "preset", ["tiny-llama", "tiny-qwen3", "tiny-stateloop", "tiny-coreloop", "llama3.1-1b-baseloop-4x5-adaln"]
)
def test_model_gradients_match_the_sdpa_path(preset):
    """Whole models (GQA; QK-norm; StateLoop's attention over the state; CoreLoop's injection; AdaLN
    timestep conditioning): loss and every parameter's gradient with the extension's kernels equal the
    PyTorch path's (switched off with gemv.enabled(False)) in fp32."""
    torch.manual_seed(0)
    cfg = tiny_variant(preset) if not preset.startswith("tiny") else preset
    model = looplm.build(cfg).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    loss, grads = _model_grads(model, ids)
    assert _uses_cpu_attention(model, ids)
    with gemv.enabled(False):
        loss_ref, grads_ref = _model_grads(model, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)  # the loss op is switched off too
    assert grads.keys() == grads_ref.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], atol=2e-6, rtol=1e-4, msg=n)


@needs_kernels
def test_compiled_block_traces_it_without_a_break():
    """A compiled function calling attention() (as a compiled block does) holds CPUAttention in one
    graph (fullgraph) and gives the eager gradients."""
    q, k, v, go = _inputs(2, 4, 2, 16, 32, torch.float32)

    def f(q, k, v):
        return attention(q * 1.5, k, v, is_causal=True, enable_gqa=True).sin()

    eager = _grads(lambda q, k, v, c: f(q, k, v), q, k, v, go, True)
    compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager")
    comp = _grads(lambda q, k, v, c: compiled_f(q, k, v), q, k, v, go, True)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_log_sum_exp_and_layout(dtype):
    """The forward op's log-sum-exp is torch's flash kernel's (what the backward needs), and its output is
    laid out [B, T, H, hd] as flash's is (the o_proj input is a free view)."""
    q, k, v, _ = _inputs(2, 6, 2, 70, 64, dtype)
    out, lse = torch.ops.looplm_cpu.attention_forward(q, k, v, 0.125, True)
    ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.125)
    assert out.shape == ref_out.shape and out.stride() == ref_out.stride() and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        out, ref_out, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5
    )


@needs_extension
def test_argument_errors_say_what_is_wrong():
    q, k, v, go = _inputs(1, 4, 2, 8, 16, torch.float32)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.25)
    op = torch.ops.looplm_cpu.attention_backward
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(go.double(), q.double(), k.double(), v.double(), out.double(), lse, 0.25, True)
    with pytest.raises(RuntimeError, match="Hkv dividing"):
        op(go, q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), out, lse, 0.25, True)
    with pytest.raises(RuntimeError, match="as many keys as queries"):
        op(go[:, :, :4], q[:, :, :4], k, v, out[:, :, :4], lse[:, :, :4], 0.25, True)
    with pytest.raises(RuntimeError, match="lse must be"):
        op(go, q, k, v, out, lse.double(), 0.25, True)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        op(go, q.transpose(2, 3), k, v, out, lse, 0.25, True)
    fwd = torch.ops.looplm_cpu.attention_forward
    with pytest.raises(RuntimeError, match="Hkv dividing"):
        fwd(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), 0.25, True)
    with pytest.raises(RuntimeError, match="as many keys as queries"):
        fwd(q[:, :, :4], k, v, 0.25, True)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        fwd(q.double(), k.double(), v.double(), 0.25, True)


def _rows_reference(z, y, scale, grad):
    """loss.py's PyTorch loop over one chunk: (the summed loss, z afterwards)."""
    z = z.clone()
    total = loss_mod._chunk_softmax_(z, y, y != -100, torch.tensor(scale), torch.float32, grad)
    return total, z


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("V", [1, 37, 1000])  # one word; not a multiple of 16; larger
def test_cross_entropy_rows_match_the_pytorch_loop(dtype, V):
    """Loss and the gradient written into the logits equal loss.py's loop: fp32 to float rounding, bf16
    within one rounding of the stored gradient; ignored rows give 0 loss and a zero gradient row; rows
    with logits spread over ±80 (exp under- and overflow without the max) stay finite."""
    g = torch.Generator().manual_seed(V)
    z = (3 * torch.randn(9, V, generator=g)).to(dtype)
    z[4] = torch.linspace(-80, 80, V).to(dtype)
    y = torch.randint(0, V, (9,), generator=g)
    y[[2, 7]] = -100
    scale = 1.0 / 7
    ref_loss, ref_z = _rows_reference(z, y, scale, True)
    got_z = z.clone()
    rows = torch.ops.looplm_cpu.cross_entropy_rows_(got_z, y, torch.tensor(scale), True)
    assert rows.shape == (9,) and rows.dtype == torch.float32 and torch.isfinite(rows).all()
    assert rows[2] == 0 and rows[7] == 0 and (got_z[[2, 7]] == 0).all()
    torch.testing.assert_close(rows.sum(), ref_loss, rtol=2e-6, atol=2e-6)
    ulp = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got_z.float(), ref_z.float(), rtol=ulp, atol=1e-7)
    # without a gradient the logits stay as they were
    z2 = z.clone()
    rows2 = torch.ops.looplm_cpu.cross_entropy_rows_(z2, y, torch.tensor(scale), False)
    assert torch.equal(z2, z) and torch.equal(rows2, rows)


@needs_kernels
def test_linear_cross_entropy_takes_the_op_and_keeps_its_gradients(monkeypatch):
    """linear_cross_entropy on a CPU runs the op (counted) and gives the PyTorch loop's loss and gradients
    (the loop forced by switching the extension off), in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    h, W = torch.randn(70, 48, requires_grad=True), (0.2 * torch.randn(500, 48)).requires_grad_()
    y = torch.randint(0, 500, (70,))
    y[::6] = -100
    calls = []
    op = torch.ops.looplm_cpu.cross_entropy_rows_

    def spy(*a):
        calls.append(1)
        return op(*a)

    for autocast in (False, True):
        results = []
        for on in (True, False):
            h.grad = W.grad = None
            monkeypatch.setattr(loss_mod.torch.ops.looplm_cpu, "cross_entropy_rows_", spy, raising=False)
            with gemv.enabled(on), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = loss_mod.linear_cross_entropy(h, W, y, chunk_size=32)
            (3.0 * out).backward()
            results.append((out.detach(), h.grad.clone(), W.grad.clone()))
        assert len(calls) == 3 * (1 + autocast)  # 3 chunks with the extension on, none with it off
        # under autocast the kernel path's head weight gradient comes out of MKL in fp32, the loop's is
        # rounded to bf16 first: they differ by that rounding
        tol = dict(rtol=1e-5, atol=1e-7) if not autocast else dict(rtol=1e-2, atol=5e-4)
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, **tol)


@needs_extension
def test_cross_entropy_rows_errors_say_what_is_wrong():
    op = torch.ops.looplm_cpu.cross_entropy_rows_
    z, y, w = torch.randn(3, 10), torch.tensor([1, 2, 3]), torch.tensor(0.5)
    with pytest.raises(RuntimeError, match="outside \\[0, 10\\)"):
        op(z, torch.tensor([1, 10, 3]), w, True)
    with pytest.raises(RuntimeError, match="int64"):
        op(z, y.int(), w, True)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(z.double(), y, w, True)
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        op(z.t(), y, w, True)
    with pytest.raises(RuntimeError, match="one float32"):
        op(z, y, torch.tensor([0.5, 0.5]), True)


@needs_extension
def test_portable_build_passes_these_tests():
    """The build CPUs without AVX512-BF16 get (plain loops, AVX2): every other test of this file, in a
    fresh process with LOOPLM_CPU_KERNELS=portable."""
    assert "skipped" in run_under_portable_build(__file__)  # the dispatch tests skip there
