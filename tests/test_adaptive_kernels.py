"""Per-token exit and self-speculative decoding on the fused CPU decode path: the active rows' steps are
the fused ops with a row index (each row reads and writes its own cache / state row in place), held to
the plain-PyTorch reference; and the same in the portable build."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import looplm
from looplm import dispatch
from looplm.decode.token_schedule import AdaptiveDecoder
from looplm.kernels import gemv

from helpers import run_under_portable_build

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]
needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)


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
    depths = torch.tensor(
        [[1, 2, 1, 2, 2, 1, 1, 2, 2, 1], [2, 1, 1, 1, 2, 2, 1, 1, 2, 2], [1, 1, 2, 2, 1, 2, 2, 1, 1, 1]]
    )
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
    fctx = m.forward_context(torch.zeros(2, 1, dtype=torch.long), None, None, 3)
    cos, sin = fctx.rope_for(blk.mixer.rotary_dim)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="outside the caches' 4 rows"):
            torch.ops.looplm_cpu.decode_attention(
                x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([0, 4])
            )
        with pytest.raises(RuntimeError, match="distinct"):
            torch.ops.looplm_cpu.decode_attention(
                x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([1, 1])
            )
        with pytest.raises(RuntimeError, match="pass rows"):
            torch.ops.looplm_cpu.decode_attention(x, *plan.weights, cos, sin, k, v, 3, None, 4)
        y = torch.ops.looplm_cpu.decode_attention(
            x, *plan.weights, cos, sin, k, v, 3, None, 4, rows=torch.tensor([3, 1])
        )
    assert (
        y.shape == (2, 1, 64) and k[[1, 3], :, 3].abs().sum() > 0 and k[[0, 2]].abs().sum() == 0
    )  # only rows 3 and 1 written


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_kv_columns_kernel_equals_the_reference(dtype):
    """The copy fill in one call: every (source, target) pair of ``[B, H_kv, capacity, hd]`` caches — views of one
    flat buffer, as the depth schedule's loops are — at each row's own column or one column for all, equal to
    the reference's indexed writes, bit for bit; nothing else written; bad arguments refused by name."""
    from looplm.layers.attention import copy_kv_columns

    assert copy_kv_columns.provider == "looplm.kernels.decode"
    torch.manual_seed(0)
    R, B, H, cap, hd = 4, 3, 2, 9, 16
    for cols in (torch.tensor([4, 7]), torch.tensor([5])):
        bufs = [torch.randn(R * B, H, cap, hd).to(dtype) for _ in range(2)]  # K and V of one layer, every loop
        want = [b.clone() for b in bufs]
        views = lambda xs, k: [x[k * B : (k + 1) * B] for x in xs]  # noqa: E731  loop k's caches
        src, dst = views(bufs, 1) * 2, views(bufs, 2) + views(bufs, 3)
        rows = torch.tensor([2, 0])
        copy_kv_columns(src, dst, rows, cols)
        copy_kv_columns.reference(views(want, 1) * 2, views(want, 2) + views(want, 3), rows, cols)
        for got, ref in zip(bufs, want):
            assert torch.equal(got, ref)
        c = cols.expand(2)
        assert torch.equal(bufs[0][2 * B + rows, :, c], bufs[0][B + rows, :, c])  # the targets hold the sources
    k = torch.zeros(B, H, cap, hd)
    op = torch.ops.looplm_cpu.copy_kv_columns
    with pytest.raises(RuntimeError, match="outside pair 0"):
        op([k], [k.clone()], torch.tensor([0]), torch.tensor([cap]))
    with pytest.raises(RuntimeError, match="one dtype"):
        op([k], [k.double()], torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="one entry per row"):
        op([k], [k.clone()], torch.tensor([0, 1]), torch.tensor([1, 2, 3]))


@needs_extension
@pytest.mark.parametrize("schedule", ["token", "depth"])
def test_an_exit_takes_its_kl_readout_as_its_logits(schedule):
    """Under kl, a token that exits at a check takes the readout that check computed as its logits (the
    base rule's output is the core output; no coda): the same tokens as running the final norm and head again
    (the exit's own head switched off by hand), and the heads not run are counted out of the executed FLOPs;
    rules whose output is not the core output (the exit gate's selection) or models with a coda run the head."""
    from looplm.decode.depth_schedule import DepthBatchedDecoder
    from looplm.decode.exits import readout_is_output

    m = _model("tiny-llama", torch.float32)
    assert readout_is_output(m)
    gate = looplm.build("tiny-llama", overrides={"rule.name": "exit_gate"}).eval()
    coda = looplm.build("tiny-llama", overrides={"n_coda": 1}).eval()
    assert not readout_is_output(gate) and not readout_is_output(coda)
    B = 1 if schedule == "token" else 4
    x = torch.randint(0, 260, (B, 6))
    spec = {"criterion": "kl", "threshold": 0.5, "kv": "copy", "schedule": schedule}
    cls = AdaptiveDecoder if schedule == "token" else DepthBatchedDecoder

    def decode(reuse: bool):
        from looplm.decode.depth_schedule import depth_batched_generate

        class D(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.reuse_readout = self.reuse_readout and reuse

        if schedule == "depth":
            return depth_batched_generate(
                m, x, 12, spec, False, 1.0, None, None, None, None, None, None, None, True, decoder=D
            )
        dec = D(m, B, 6 + 12, spec)
        toks, out = x[:, -1:], [x]
        with dispatch.decode_steps(m, batch_size=B):
            logits = dec(x)
            for _ in range(12):
                toks = logits[:, -1].argmax(-1, keepdim=True)
                out.append(toks)
                logits = dec(toks, validate=False)
        return torch.cat(out, 1), dec.stats

    (a, sa), (b, sb) = decode(True), decode(False)
    assert torch.equal(a, b)
    assert sa.reused_flops > 0 and sb.reused_flops == 0
    assert sa.other_flops == pytest.approx(sb.other_flops)  # every token's head, as full depth runs it; less the reused
    s = sa.summary()
    assert s["flops_per_token"] * s["tokens"] == pytest.approx(
        sa.core_flops + sa.fill_flops + sa.check_flops + sa.other_flops - sa.reused_flops
    )
    assert s["flops_per_token"] < sb.summary()["flops_per_token"]


def test_portable_build_passes_these_tests():
    """The same tests with LOOPLM_CPU_KERNELS=portable (CPUs without AVX512-BF16), in a fresh process."""
    run_under_portable_build(__file__)
