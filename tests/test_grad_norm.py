"""Gradient clipping in parts: the global norm (looplm_cpu::sum_squares where the extension runs) and
the clipping factor applied inside the optimizer's step (MultiOptimizer.step(grad_factor))."""

import math

import pytest
import torch

from looplm.kernels import gemv
from looplm.kernels.training import grad_norm_applies as _fast_applies
from looplm.train.grad_norm import clip_factor, total_norm
from looplm.train.optim import MultiOptimizer, folds_grad_factor

from helpers import run_under_portable_build

pytestmark = pytest.mark.kernels

needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)


def exact_norm(ts):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def grads_like_a_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    # sizes not multiples of the op's 4,096-entry block or its 32 lanes; a large tensor; scalars; bf16
    shapes = [(3000, 257), (1,), (), (17, 5), (4096,), (4097,), (640, 33)]
    ts = [torch.randn(s, generator=g) * (10.0 ** (i % 3 - 1)) for i, s in enumerate(shapes)]
    ts.append((torch.randn(999, 31, generator=g) * 3).bfloat16())
    return ts


@needs_extension
def test_total_norm_is_the_exact_norm_and_more_accurate_than_torch():
    ts = grads_like_a_model()
    assert _fast_applies(ts)
    exact = exact_norm(ts)
    got = total_norm(ts)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == pytest.approx(exact, rel=2e-7)  # fp32 rounding of the result only
    s = float(torch.ops.looplm_cpu.sum_squares(ts))
    assert s == pytest.approx(exact**2, rel=1e-7)
    # a sum of many similar entries: torch's fp32 reduction drifts, the fp64 sum of short fp32 runs does not
    many = [torch.full((1 << 22,), 0.1) + torch.randn(1 << 22) * 1e-3 for _ in range(4)]
    exact = exact_norm(many)
    assert abs(float(torch.ops.looplm_cpu.sum_squares(many)) ** 0.5 / exact - 1) < 1e-8
    assert abs(float(torch.nn.utils.get_total_norm(many, 2.0)) / exact - 1) > abs(float(total_norm(many)) / exact - 1)


@needs_extension
def test_total_norm_does_not_depend_on_the_thread_count():
    ts = grads_like_a_model(1) + [torch.randn(300_000)]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.looplm_cpu.sum_squares(ts)
        torch.set_num_threads(max(2, n))
        many = torch.ops.looplm_cpu.sum_squares(ts)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, many)


@needs_extension
def test_total_norm_propagates_inf_and_nan():
    a, b = torch.ones(5000), torch.ones(10)
    b[3] = float("inf")
    assert math.isinf(float(total_norm([a, b])))
    b[3] = float("nan")
    assert math.isnan(float(total_norm([a, b])))


def test_total_norm_falls_back_where_the_op_does_not_apply():
    base = torch.randn(64, 64)
    for ts in ([], [base.t()], [base.double()], [base.half()], [base, base.t()]):
        assert not _fast_applies(ts)
        torch.testing.assert_close(total_norm(ts), torch.nn.utils.get_total_norm(ts, 2.0))


@needs_extension
def test_sum_squares_errors_name_the_tensor():
    with pytest.raises(RuntimeError, match="tensor 1 is Double"):
        torch.ops.looplm_cpu.sum_squares([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="not contiguous"):
        torch.ops.looplm_cpu.sum_squares([torch.ones(4, 4).t()])


def test_clip_factor_is_torchs_and_none_when_it_is_one():
    t = torch.tensor(5.0)
    f = clip_factor(5.0, t, 1.0)
    assert torch.equal(f, torch.clamp(1.0 / (t + 1e-6), max=1.0))
    assert clip_factor(0.5, torch.tensor(0.5), 1.0) is None
    assert clip_factor(5.0, t, float("inf")) is None
    # at the threshold torch's factor rounds to exactly 1 or just below: never skipped when below
    for norm in (1.0, 1.0 - 1e-7, 1.0 + 1e-7, 0.999999):
        tn = torch.tensor(norm)
        torch_f = float(torch.clamp(1.0 / (tn + 1e-6), max=1.0))
        ours = clip_factor(float(tn), tn, 1.0)
        assert (ours is None and torch_f == 1.0) or (ours is not None and float(ours) == torch_f)


def _model_and_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Linear(64, 8))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


@pytest.mark.parametrize("impl", ["fused", "foreach", "muon+fused"])
def test_step_with_grad_factor_equals_clip_then_step(impl):
    """The factor folded into a fused AdamW (grad_scale) gives the update of clip-then-step to fp32
    rounding; optimizers that cannot fold it scale the gradients first, bit for bit as clipping does."""

    def build(model):
        ps = list(model.parameters())
        if impl == "muon+fused":
            mats = [p for p in ps if p.ndim == 2]
            rest = [p for p in ps if p.ndim != 2]
            return MultiOptimizer(
                {"muon": torch.optim.Muon(mats, lr=0.02), "adamw": torch.optim.AdamW(rest, lr=1e-2, fused=True)}
            )
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        return MultiOptimizer({"adamw": torch.optim.AdamW(ps, lr=1e-2, **kw)})

    ref, ours = _model_and_grads(), _model_and_grads()
    opt_ref, opt = build(ref), build(ours)
    for step in range(3):
        for a, b in zip(ref.parameters(), ours.parameters()):
            a.grad = torch.randn_like(a) * (step + 1)
            b.grad = a.grad.clone()
        total = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], 2.0)
        torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), 0.5, total)
        opt_ref.step()
        factor = clip_factor(float(total), total, 0.5)
        assert factor is not None and float(factor) < 1
        opt.step(grad_factor=factor)
        for o in opt:
            assert not hasattr(o, "grad_scale")  # nothing left for the next step
    for a, b in zip(ref.parameters(), ours.parameters()):
        if impl == "foreach":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert folds_grad_factor(opt_ref.optimizers["adamw"]) == (impl != "foreach")


def test_folds_grad_factor_only_for_fused_adam():
    p = [torch.nn.Parameter(torch.ones(3))]
    assert folds_grad_factor(torch.optim.AdamW(p, fused=True))
    assert folds_grad_factor(torch.optim.Adam(p, fused=True))
    assert not folds_grad_factor(torch.optim.AdamW(p))
    assert not folds_grad_factor(torch.optim.SGD(p, lr=0.1))
    # the groups decide: a state dict saved by an unfused AdamW (e.g. an FSDP2 run) turns fusion off
    fused = torch.optim.AdamW(p, fused=True)
    fused.load_state_dict(torch.optim.AdamW(p).state_dict())
    assert not folds_grad_factor(fused)


def test_grad_factor_scales_the_update_of_a_fused_adamw():
    """The factor reaches the fused kernel: AdamW's first update is sign-like (it would hide a lost
    factor), so read the moments, which are linear / quadratic in the gradient."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = MultiOptimizer({"adamw": torch.optim.AdamW([p], lr=1e-3, fused=True)})
    p.grad = torch.full((4,), 2.0)
    opt.step(grad_factor=torch.tensor(0.25))
    state = opt.optimizers["adamw"].state[p]
    torch.testing.assert_close(state["exp_avg"], torch.full((4,), 0.1 * 0.5))  # (1 − β₁) · 2 · 0.25
    torch.testing.assert_close(state["exp_avg_sq"], torch.full((4,), 0.001 * 0.25))  # (1 − β₂) · 0.5²


@needs_extension
def test_portable_build_passes_these_tests():
    """The build CPUs without AVX512-BF16 get: every other test of this file in a fresh process."""
    run_under_portable_build(__file__)
