"""The bf16 GEMV kernel of CPU decoding against its reference (an fp32 product of the same bf16 numbers,
and F.linear), the dispatch rules of ``gemv.linear``, and its use inside ``generate``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import looplm
from looplm.kernels import decode, gemv, loader, onednn

pytestmark = pytest.mark.kernels
needs_kernel = pytest.mark.skipif(
    not gemv.available(), reason=f"bf16 GEMV kernel not available: {gemv.unavailable_reason()}"
)


def _reference(x, w, b=None):
    """fp32 product of the bf16 inputs, bias added in fp32, rounded once to bf16."""
    y = x.float() @ w.float().t()
    if b is not None:
        y = y + b.float()
    return y.to(torch.bfloat16)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place (bit patterns of same-sign values are ordered)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    ai = torch.where(ai < 0, -32768 - ai, ai)  # sign-magnitude -> ordered integers
    bi = torch.where(bi < 0, -32768 - bi, bi)
    return int((ai - bi).abs().max())


@needs_kernel
@pytest.mark.parametrize("M,use_amx", [(1, True), (2, True), (3, True), (8, True), (16, True), (2, False), (4, False)])
@pytest.mark.parametrize("N,K", [(16, 32), (7, 5), (193, 577), (576, 576), (1000, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_reference(M, use_amx, N, K, bias):
    """Every path: one row (AVX512-BF16), 2-16 rows (AMX where the CPU has it), the per-row path for
    several rows (CPUs without AMX); N and K with and without a tail past the blocks of 16 and 32."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else None
    y = gemv.gemv_bf16(x, w, b, use_amx=use_amx)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    # only the order of the fp32 additions differs from the reference: the error is fp32 accumulation
    # noise on top of one bf16 rounding, so results agree with it to within 1 ulp of bf16 where the
    # sum is not cancelling, and within an fp32-scale bound everywhere
    ref = _reference(x, w, b)
    scale = (x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)).clamp_min(1e-30)
    err = (y.double() - exact).abs() / scale
    assert float(err.max()) < 2**-8 + 1e-5, float(err.max())
    well_conditioned = exact.abs() > 0.05 * scale
    assert _ulps_apart(y[well_conditioned], ref[well_conditioned]) <= 1


@needs_kernel
def test_kernel_is_f_linear_up_to_summation_order():
    torch.manual_seed(0)
    x = torch.randn(1, 576).to(torch.bfloat16)
    w = torch.randn(1536, 576).to(torch.bfloat16)
    y, ref = gemv.gemv_bf16(x, w), F.linear(x, w)
    assert _ulps_apart(y, ref) <= 2
    assert (y != ref).float().mean() < 0.05  # almost every output identical


@needs_kernel
def test_kernel_rejects_bad_inputs_with_a_message():
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        gemv.gemv_bf16(x.float(), w)
    with pytest.raises(RuntimeError, match=r"\[M, K\] and weight \[N, K\]"):
        gemv.gemv_bf16(x, torch.randn(3, 9, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv.gemv_bf16(torch.randn(8, 2, dtype=torch.bfloat16).t(), w)


@needs_kernel
def test_dispatch_takes_the_kernel_only_where_it_wins():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    row = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    assert gemv.uses_kernel(row, w)
    assert gemv.uses_kernel(torch.randn(2, 2, 64, dtype=torch.bfloat16), w)  # 4 rows
    assert not gemv.uses_kernel(torch.randn(17, 64, dtype=torch.bfloat16), w)  # more rows than MAX_ROWS
    assert gemv.uses_kernel(torch.randn(16, 64, dtype=torch.bfloat16), w) == gemv.amx()
    w_long = torch.randn(32, 2048, dtype=torch.bfloat16)
    assert gemv.uses_kernel(torch.randn(1, 2048, dtype=torch.bfloat16), w_long)  # one row: always
    # several long rows of a large weight: AMX where the CPU has it, else torch's matmul (the per-row path
    # loses there); of a small weight (N x K <= 2^19): the kernel
    w_big = torch.randn(512, 2048, dtype=torch.bfloat16)
    assert gemv.uses_kernel(torch.randn(4, 2048, dtype=torch.bfloat16), w_big) == gemv.amx()
    assert gemv.uses_kernel(torch.randn(4, 2048, dtype=torch.bfloat16), w_long)
    assert gemv.uses_kernel(torch.randn(9, 2048, dtype=torch.bfloat16), w_long) == gemv.amx()
    assert gemv.uses_kernel(row.float(), w.float())  # fp32, one row: 2.4x MKL's GEMV for weights read from memory
    assert not gemv.uses_kernel(torch.randn(9, 64), w.float())  # fp32, 9 rows: torch's matmul
    assert not gemv.uses_kernel(row, w.t().contiguous().t())  # strided weight
    wg = w.clone().requires_grad_()
    assert not gemv.uses_kernel(row, wg)  # autograd needs the reference
    with torch.no_grad():
        assert gemv.uses_kernel(row, wg)
    with gemv.enabled(False):
        assert not gemv.uses_kernel(row, w)
    # where it does not take the kernel, linear() is F.linear exactly
    x17 = torch.randn(17, 64, dtype=torch.bfloat16)
    assert torch.equal(gemv.linear(x17, w), F.linear(x17, w))
    out = gemv.linear(row, w)
    assert out.shape == (1, 1, 32)
    assert torch.equal(out, gemv.gemv_bf16(row.view(1, 64), w).view(1, 1, 32))


@needs_kernel
def test_kernel_traces_under_torch_compile():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)

    def f(x):
        return gemv.linear(x, lin.weight, lin.bias) * 2

    with torch.no_grad():
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
        assert torch.equal(got, f(x))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemv = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "looplm_cpu.gemv" in str(func):
            self.gemv += 1
        return func(*args, **(kwargs or {}))


def _tiny(dtype):
    torch.manual_seed(0)
    return looplm.build("tiny-llama", d_model=64, n_loops=2, dtype=dtype).eval()


@needs_kernel
def test_generate_uses_the_kernel_and_restores_the_layers():
    model = _tiny(torch.bfloat16)
    x = torch.randint(0, model.config.vocab_size, (1, 6))
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    with decode.enabled(False), _CountOps() as c:  # the blocks on their reference forward
        out = model.generate(x, max_new_tokens=4)
    assert out.shape == (1, 10)
    # 3 one-token steps: 7 projections per block per loop iteration and the head; the prompt step's
    # projections see 6 positions per sequence (F.linear), its head reads the last position only
    per_step = model.config.n_loops * len(model.core.stack.blocks) * 7 + 1
    assert c.gemv == 3 * per_step + 1
    with _CountOps() as c:  # fused blocks (kernels/decode.py) run their products inside their own ops
        assert torch.equal(model.generate(x, max_new_tokens=4), out)
    assert c.gemv == 3 + 1
    assert sum(type(m) is nn.Linear for m in model.modules()) == n_linear  # classes restored
    assert not any(type(m) is gemv.fused_linear_class() for m in model.modules())
    with gemv.enabled(False), _CountOps() as c:
        model.generate(x, max_new_tokens=4)
    assert c.gemv == 0


@needs_kernel
def test_cached_decode_logits_match_the_reference_path():
    """Every logit of a kernel decode step agrees with the F.linear step to bf16 precision."""
    model = _tiny(torch.bfloat16)
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        outs = []
        for on in (True, False):
            with gemv.enabled(on), gemv.decode_linears(model):
                cache = model.new_cache(2, capacity=8)
                model(x[:, :-1], cache=cache)
                outs.append(model(x[:, -1:], cache=cache).logits.float())
    fast, ref = outs
    torch.testing.assert_close(fast, ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))


def test_unavailable_means_reference_everywhere(monkeypatch):
    """Where the kernel cannot run (an AVX2 CPU, no compiler), linear() and generate() are F.linear."""
    monkeypatch.setattr(loader, "_state", {"ok": False, "reason": "test"})
    assert not gemv.available() and gemv.unavailable_reason() == "test"
    w, row = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(1, 16, dtype=torch.bfloat16)
    assert torch.equal(gemv.linear(row, w), F.linear(row, w))
    model = _tiny(torch.bfloat16)
    with gemv.decode_linears(model) as n:
        assert n == 0
    with pytest.raises(RuntimeError, match="not available: test"):
        gemv.gemv_bf16(row, w)


@needs_kernel
@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_compiled_blocks_decode_with_the_kernel_like_eager_without_recompiling(dtype, batch):
    """``looplm generate --compile``: the compiled blocks call the kernels (their fake shapes let dynamo
    trace them), give the eager kernel path's tokens, and swapping the layers' class at every
    ``generate`` call or a new prompt length does not recompile after warm-up."""
    import torch._dynamo.utils as dynamo_utils

    from looplm.parallel import compile_blocks

    torch._dynamo.reset()
    eager = _tiny(dtype)
    model = _tiny(dtype)
    compile_blocks(model, backend="eager")
    V = model.config.vocab_size

    def both(T, new):
        x = torch.randint(0, V, (batch, T))  # bf16: the AMX path where the CPU has it; fp32: the 3-8-row kernel
        with _CountOps() as c:
            got = model.generate(x, max_new_tokens=new)
        assert c.gemv > 0
        assert torch.equal(got, eager.generate(x, max_new_tokens=new))

    both(5, 4)
    both(9, 3)
    warm = dynamo_utils.counters["stats"]["unique_graphs"]
    for T, new in [(7, 6), (3, 9), (12, 2)]:
        both(T, new)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == warm


def test_models_without_cpu_bf16_or_fp32_linears_never_build_the_kernels(monkeypatch):
    def boom():
        raise AssertionError("available() called for a model without bf16 / fp32 CPU linears")

    monkeypatch.setattr(gemv, "available", boom)
    model = _tiny(torch.float64)
    with gemv.decode_linears(model) as n:
        assert n == 0
    model.generate(torch.randint(0, 260, (1, 4)), max_new_tokens=2)


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("N,K", [(7, 5), (193, 577), (50, 768), (1000, 96), (67, 4099)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_kernel_matches_fp64_reference(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    y = gemv.gemv_fp32(x, w, b)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)
    # fp32 accumulation: each of the K additions rounds by at most 2^-24 of the running sum
    assert float(((y.double() - exact).abs() / scale).max()) < K * 2**-24
    ref_err = float(((F.linear(x, w, b).double() - exact).abs() / scale).max())
    assert float(((y.double() - exact).abs() / scale).max()) < 8 * ref_err + 2**-22  # MKL's order of magnitude


@needs_kernel
def test_decode_linears_swaps_only_what_a_kernel_serves_at_the_batch_size():
    model16, model32 = _tiny(torch.bfloat16), _tiny(torch.float32)
    n = sum(type(m) is nn.Linear for m in model32.modules())
    with gemv.decode_linears(model32, batch_size=1) as k:
        assert k == n  # fp32, one row: the kernel (MKL reads weights from memory at 10-14 GB/s, the kernel at ~30)
    with gemv.decode_linears(model32, batch_size=9) as k:  # fp32, 9 rows: torch's matmul, or oneDNN off Intel CPUs
        assert k == (n if onednn.prefers_onednn() else 0)
    with gemv.decode_linears(model32, batch_size=4) as k:
        assert k == n and all(type(m) is not nn.Linear for m in model32.modules() if isinstance(m, nn.Linear))
    assert sum(type(m) is nn.Linear for m in model32.modules()) == n
    with gemv.decode_linears(model16, batch_size=1) as k:
        assert k == n
    with gemv.decode_linears(model16, batch_size=gemv.MAX_ROWS + 1) as k:
        assert k == 0


@needs_kernel
def test_fp32_dispatch_and_decode():
    w = torch.randn(32, 64)
    assert gemv.uses_kernel(torch.randn(1, 64), w)  # one row: the kernel (MKL's GEMV lags it for streamed weights)
    assert gemv.uses_kernel(torch.randn(2, 64), w)
    # x past 6144 floats: MKL on Intel CPUs; elsewhere MKL takes its slow path and the kernel wins at any K
    off_intel = not torch.ops.looplm_cpu.intel_cpu()
    assert gemv.uses_kernel(torch.randn(1, 8192), torch.randn(32, 8192)) == off_intel
    assert gemv.uses_kernel(torch.randn(4, 1, 64), w)
    assert not gemv.uses_kernel(torch.randn(9, 64), w)
    assert gemv.uses_kernel(torch.randn(8, 1536), torch.randn(32, 1536)) == off_intel  # x no longer fits in L1
    assert gemv.uses_kernel(torch.randn(4, 1536), torch.randn(32, 1536))
    # a batch-4 decode step on the kernel gives the reference path's logits (fp32: summation order only)
    model = _tiny(torch.float32)
    x = torch.randint(0, model.config.vocab_size, (4, 7))
    with torch.no_grad():
        outs = []
        for on in (True, False):
            with gemv.enabled(on), gemv.decode_linears(model), _CountOps() as c:
                cache = model.new_cache(4, capacity=8)
                model(x[:, :-1], cache=cache)
                outs.append(model(x[:, -1:], cache=cache).logits)
            assert (c.gemv > 0) == on
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_amx_is_decided_by_the_cpu_not_by_a_switched_off_moment(monkeypatch):
    monkeypatch.setattr(loader, "_state", {k: v for k, v in loader._state.items() if k != "amx"})
    with gemv.enabled(False):
        first = gemv.amx()
    assert first == bool(torch.ops.looplm_cpu.amx_ready()) == gemv.amx()
