"""fp32 prompt products on oneDNN (:mod:`looplm.kernels.onednn`) against their reference (``F.linear`` and an
fp64 product of the same numbers), the rule that picks them, and their use in ``generate``'s prompt step."""

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.kernels import gemv, onednn

pytestmark = pytest.mark.kernels
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture
def force(monkeypatch):
    """``force("onednn")`` / ``force("mkl")``: the ``LOOPLM_FP32_GEMM`` setting for the test."""
    return lambda value: monkeypatch.setenv(onednn.ENV, value)


@needs_onednn
@pytest.mark.parametrize("M,N,K", [(9, 193, 577), (48, 1536, 576), (64, 50, 768), (17, 7, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_fp64_reference(force, M, N, K, bias):
    force("onednn")
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    assert onednn.applies(x, w, b)
    y = onednn.linear(x, w, b)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)
    err = float(((y.double() - exact).abs() / scale).max())
    assert err < K * 2**-24  # fp32 accumulation: each of the K additions rounds by at most 2^-24 of the running sum
    ref_err = float(((F.linear(x, w, b).double() - exact).abs() / scale).max())
    assert err < 8 * ref_err + 2**-22  # MKL's order of magnitude


@needs_onednn
def test_linear_keeps_the_leading_dims(force):
    force("onednn")
    x, w, b = torch.randn(2, 7, 64), torch.randn(96, 64), torch.randn(96)
    y = onednn.linear(x, w, b)
    assert y.shape == (2, 7, 96)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(64, 14).t()  # a non-contiguous x: copied once, same numbers
    torch.testing.assert_close(onednn.linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and onednn.prefers_onednn()),
    reason="this CPU's fp32 products stay on MKL",
)
def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Where the prompt steps take oneDNN, a prompt prefilled beside others gets the numbers it gets alone
    (bit for bit) from 9 rows on: the exactness of batched prefill rests on it."""
    g = torch.Generator().manual_seed(0)
    for N, K in ((1536, 576), (576, 1536), (1024, 4096)):
        x, w, b = torch.randn(160, K, generator=g), torch.randn(N, K, generator=g) * 0.02, torch.randn(N, generator=g)
        full = onednn.linear(x, w, b)
        for start, rows in ((0, 9), (5, 48), (100, 60), (3, 17)):
            assert torch.equal(onednn.linear(x[start : start + rows], w, b), full[start : start + rows]), (N, K, start)


def test_applies_only_to_fp32_inference_products_of_enough_rows(force):
    force("onednn")
    w = torch.randn(32, 64)
    big = torch.randn(onednn.MIN_ROWS, 64)
    assert onednn.applies(big, w) == torch.backends.mkldnn.is_available()
    assert not onednn.applies(torch.randn(onednn.MIN_ROWS - 1, 64), w)  # 1-8 rows: the GEMV kernels' (or MKL's)
    assert not onednn.applies(big.bfloat16(), w.bfloat16())  # bf16 is oneDNN in torch already
    assert not onednn.applies(big, w.double())
    assert not onednn.applies(big.requires_grad_(), w)  # training keeps torch's autograd product
    with torch.no_grad():
        assert onednn.applies(big, w) == torch.backends.mkldnn.is_available()
    force("mkl")
    assert not onednn.applies(torch.randn(16, 64), w)
    assert torch.equal(onednn.linear(torch.ones(16, 64), w), F.linear(torch.ones(16, 64), w))


def test_auto_follows_the_cpu_vendor(force, monkeypatch):
    from looplm.utils import cpuinfo

    force("auto")
    monkeypatch.setattr(cpuinfo, "vendor", lambda: "GenuineIntel")
    assert not onednn.prefers_onednn()  # MKL's fast paths are Intel's
    monkeypatch.setattr(cpuinfo, "vendor", lambda: "AuthenticAMD")
    assert onednn.prefers_onednn() == torch.backends.mkldnn.is_available()
    monkeypatch.setattr(cpuinfo, "vendor", lambda: None)  # unknown: leave torch's choice alone
    assert not onednn.prefers_onednn()


def test_a_bad_setting_is_refused_by_name(force):
    force("fastest")
    with pytest.raises(ValueError, match=r"LOOPLM_FP32_GEMM='fastest': expected one of auto, onednn, mkl"):
        onednn.prefers_onednn()
    if gemv.available():
        with pytest.raises(ValueError, match="LOOPLM_FP32_GEMM='fastest'"):
            gemv.register()  # kernels.load() refuses it before any product runs


@needs_onednn
@pytest.mark.skipif(not gemv.available(), reason=f"looplm's CPU kernels: {gemv.unavailable_reason()}")
def test_generate_takes_onednn_for_the_prompt_and_matches_mkl(force, monkeypatch):
    """``generate``'s prompt step (inside the decode steps) runs its fp32 products on oneDNN; the answer is the
    one MKL's products give (greedy tokens equal, logits within fp32 rounding)."""
    torch.manual_seed(0)
    model = looplm.build("tiny-llama", d_model=64, n_loops=2, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 12))
    calls = []
    real = onednn.linear_onednn  # the oneDNN product itself, whichever caller asked for it
    monkeypatch.setattr(onednn, "linear_onednn", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    outs = {}
    for setting in ("mkl", "onednn"):
        force(setting)
        calls.clear()
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=6)
            with gemv.decode_linears(model):  # the linear steps generate enters: a prompt step's logits
                logits = model(prompt).logits  # [2, 12, V]
        outs[setting] = tokens, logits
        big = [s for s in calls if s[:-1].numel() >= onednn.MIN_ROWS]
        assert bool(big) == (setting == "onednn"), (setting, calls[:4])
    assert torch.equal(outs["mkl"][0], outs["onednn"][0])
    torch.testing.assert_close(outs["mkl"][1], outs["onednn"][1], rtol=1e-5, atol=1e-5)
