"""Per-token exit and self-speculative decoding on the fused CPU decode path: the active rows' steps are
the fused ops with a row index (each row reads and writes its own cache / state row in place), held to
the plain-PyTorch reference; and the same in the portable build."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import looplm
from looplm import dispatch
from looplm.adaptive import AdaptiveDecoder
from looplm.kernels import gemv

from helpers import run_under_portable_build

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]
needs_extension = pytest.mark.skipif(not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}")


class _RowOps(TorchDispatchMode):
    """Counts the fused decode ops, and those called with a row index."""

    def __init__(self):
        super().__init__()
        self.fused = self.with_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(f"looplm_cpu.{op}" in name for op in ("decode_attention", "decode_stack", "decode_mamba2")):
            self.fused += 1
            rows = (kwargs or {}).get("rows", args[-1] if args else None)
            self.with_rows += isinstance(rows, torch.Tensor) and rows.dtype == torch.long
        return func(*args, **(kwargs or {}))


def _model(name, dtype):
    torch.manual_seed(0)
    m = looplm.build(name, dtype=dtype, init_std=0.1).eval()
    return m


@needs_extension
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2", "tiny-hybrid", "tiny-stateloop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_of_active_rows_equal_the_reference(name, dtype):
    m = _model(name, dtype)
    B, T = 4, 10
    ids = torch.randint(0, 260, (B, T))
    depths = torch.randint(1, m.config.n_loops + 1, (B, T))
    for kv, ssm in (("copy", "propagate"), ("shared", "freeze"), ("propagate", "decay")):
        spec = dict(criterion="replay", depths=depths, kv=kv, ssm=ssm)
        with dispatch.reference_only():
            ref = AdaptiveDecoder(m, B, T, spec).score(ids, 3)
        ops = _RowOps()
        with dispatch.decode_steps(m, batch_size=B), ops:
            got = AdaptiveDecoder(m, B, T, spec).score(ids, 3)
        assert ops.with_rows > 0 and ops.fused > ops.with_rows  # subsets on the fused ops, the full batch too
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        else:  # each stored intermediate rounded where the reference rounds it
            assert float((got.argmax(-1) == ref.argmax(-1)).float()[:, 2:].mean()) >= 0.95
            torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))


@needs_extension
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_fused_adaptive_and_speculative_generation(name):
    """On the fused path: criteria off decodes today's tokens; a batch with exits decodes each row alone's
    tokens; greedy speculative decodes full depth's tokens."""
    m = _model(name, torch.float32)
    x = torch.randint(0, 260, (3, 5))
    plain = m.generate(x, 10)
    assert torch.equal(m.generate(x, 10, exit="convergence:0", return_stats=True)[0], plain)
    depths = torch.tensor([[1, 2, 1, 2, 2, 1, 1, 2, 2, 1], [2, 1, 1, 1, 2, 2, 1, 1, 2, 2], [1, 1, 2, 2, 1, 2, 2, 1, 1, 1]])
    batch = m.generate(x, 10, exit=dict(criterion="replay", depths=depths, kv="copy"))
    for b in range(3):
        alone = m.generate(x[b : b + 1], 10, exit=dict(criterion="replay", depths=depths[b : b + 1], kv="copy"))
        assert torch.equal(alone[0], batch[b])
    for r_d in range(1, m.config.n_loops):
        assert torch.equal(m.generate(x, 10, speculative={"draft_loops": r_d, "k": 3}), plain)


@needs_extension
def test_row_index_is_checked_by_the_op():
    from looplm.kernels.decode import branch_plan

    m = _model("tiny-llama", torch.float32)
    blk = m.core.stack.blocks[0]
    plan = branch_plan(blk.mixer_norm, blk.mixer)
    k = torch.zeros(4, 2, 8, 16)  # [cache rows, G, capacity, hd]
    v = torch.zeros(4, 2, 8, 16)
    x = torch.randn(2, 1, 64)
    fctx = m._forward_context(torch.zeros(2, 1, dtype=torch.long), None, None, 3)
    cos, sin = fctx.rope_for(blk.mixer.rotary_dim)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="outside the caches' 4 rows"):
            torch.ops.looplm_cpu.decode_attention(x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([0, 4]))
        with pytest.raises(RuntimeError, match="distinct"):
            torch.ops.looplm_cpu.decode_attention(x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([1, 1]))
        with pytest.raises(RuntimeError, match="pass rows"):
            torch.ops.looplm_cpu.decode_attention(x, *plan.weights, cos, sin, k, v, 3, None, 4)
        y = torch.ops.looplm_cpu.decode_attention(x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([3, 1]))
    assert y.shape == (2, 1, 64) and k[[1, 3], :, 3].abs().sum() > 0 and k[[0, 2]].abs().sum() == 0  # only rows 3 and 1 written


def test_portable_build_passes_these_tests():
    """The same tests with LOOPLM_CPU_KERNELS=portable (CPUs without AVX512-BF16), in a fresh process."""
    run_under_portable_build(__file__)
