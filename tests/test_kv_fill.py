"""``kv='propagate'`` fills carried into the next core pass (looplm.decode.kv_fill): written by the fused stack step as
extra rows of its own K/V products, or by the reference right after the call; the entries equal the fill
computed on its own, nothing is left unwritten when decoding stops, and the op's fill arguments are checked
before anything is written."""

import pytest
import torch

import looplm
from looplm import dispatch
from looplm.decode.token_schedule import AdaptiveDecoder
from looplm.context import ForwardContext
from looplm.decode.depth_schedule import DepthBatchedDecoder
from looplm.kernels import decode as kd
from looplm.kernels import gemv
from looplm.decode.kv_fill import KVFill
from looplm.layers.attention import KVCache
from looplm.decode.sampling import decode_context

pytestmark = pytest.mark.usefixtures("one_thread")
needs_extension = pytest.mark.skipif(
    not gemv.extension_available(), reason=f"looplm's CPU extension not available: {gemv.unavailable_reason()}"
)


def _model(name, dtype=torch.float32):
    torch.manual_seed(0)
    return looplm.build(name, init_std=0.1).eval().to(dtype)


def _decode(m, ids, depths, n, schedule, carry=True, fused=False):
    """``n`` greedy tokens under replayed depths with kv='propagate'; returns the decoder (its cache complete)."""
    B, P = ids.shape
    spec = dict(criterion="replay", depths=depths, kv="propagate")
    greedy = lambda logits: logits.max(-1).indices  # noqa: E731
    ctx = decode_context(m, B) if fused else dispatch.reference_only()
    if schedule == "depth":
        dec = DepthBatchedDecoder(m, B, P + n, {**spec, "schedule": "depth"})
        dec.carry_fills = carry
        with ctx:
            dec.run(ids, n, None, greedy, None, 0)
        return dec
    dec = AdaptiveDecoder(m, B, P + n, spec)
    dec.carry_fills = carry
    with ctx:
        tok = greedy(dec(ids)[:, -1])[:, None]
        for _ in range(n - 1):
            tok = greedy(dec(tok, validate=False)[:, -1])[:, None]
        dec.flush()
    return dec


def _core_kv(m, dec, cols):
    """Every core attention layer's keys and values of every loop at columns ``< cols`` (loop-major)."""
    out = []
    for k in range(m.config.n_loops):
        for blk in m.core.stack.blocks:
            s = dec.cache.slots[(k, blk.layer_idx)]
            out += [s._k[:, :, :cols], s._v[:, :, :cols]]
    return out


@pytest.mark.parametrize("schedule", ["token", "depth"])
def test_carrying_the_fill_leaves_the_entries_of_the_fill_computed_on_its_own(schedule):
    """Reference path: the skipped loops' keys and values written when the next core call runs (or at the
    flush) equal those written at the exit itself (carry off), at every loop, layer, row and column."""
    m = _model("tiny-qwen3")  # QK-norm, GQA, RoPE
    B, P, N = 3, 4, 9
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (B, P), generator=g)
    depths = torch.randint(1, m.config.n_loops + 1, (B, N), generator=g)
    now, then = _decode(m, ids, depths, N, schedule), _decode(m, ids, depths, N, schedule, carry=False)
    assert now.stats.carried_fills > 0 and now.stats.folded_fills == 0 and then.stats.carried_fills == 0
    for a, b in zip(_core_kv(m, now, P + N - 1), _core_kv(m, then, P + N - 1)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_last_tokens_fill_is_written_by_the_flush_not_lost():
    """A token that exited after loop 1 leaves its deeper loops' entries carried, not yet written; the flush
    (what generate() and score() do when they stop) writes them: then they are the fill computed at the exit."""
    m = _model("tiny-llama")
    ids = torch.randint(0, 250, (1, 4))
    decs = [AdaptiveDecoder(m, 1, 8, dict(criterion="replay", depths=1, kv="propagate")) for _ in range(2)]
    decs[1].carry_fills = False
    with dispatch.reference_only():
        for dec in decs:
            tok = dec(ids)[:, -1:].argmax(-1)
            dec(tok, validate=False)  # exits after loop 1: loops 2 .. R of column 4 skipped
    deep = [d.cache.slots[(m.config.n_loops - 1, m.core.stack.blocks[0].layer_idx)]._k[:, :, 4] for d in decs]
    assert decs[0]._deferred is not None and decs[1]._deferred is None
    assert not torch.equal(deep[0], deep[1])  # carried: not written yet
    decs[0].flush()
    assert decs[0]._deferred is None and torch.equal(deep[0], deep[1])


@needs_extension
@pytest.mark.kernels
@pytest.mark.parametrize("schedule", ["token", "depth"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_step_writes_the_carried_fill_with_its_own_products(schedule, dtype):
    """Fused path: every carried fill but the flush is written by decode_stack (counted), and the caches equal
    the reference path's (fp32 to 1e-5; bf16 to a rounding or two), as do the tokens."""
    m = _model("tiny-qwen3", dtype)
    B, P, N = 3, 4, 9
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 250, (B, P), generator=g)
    depths = torch.randint(1, m.config.n_loops + 1, (B, N), generator=g)
    fused, ref = _decode(m, ids, depths, N, schedule, fused=True), _decode(m, ids, depths, N, schedule)
    st = fused.stats
    assert st.carried_fills > 1 and st.folded_fills == st.carried_fills - 1  # all but the last token's (the flush)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    for a, b in zip(_core_kv(m, fused, P + N - 1), _core_kv(m, ref, P + N - 1)):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def _stack_inputs(m, B=2, pos=3):
    """A one-token decode_stack call of ``m``'s core at column ``pos`` with filled caches, and a plan."""
    torch.manual_seed(1)
    blocks = list(m.core.stack.blocks)
    a0 = blocks[0].mixer
    d, G, hd, cap = m.config.d_model, a0.n_kv_heads, a0.head_dim, 8
    caches = [(torch.randn(B, G, cap, hd), torch.randn(B, G, cap, hd)) for _ in blocks]
    x = torch.randn(B, 1, d)
    rot = a0.rotary_dim
    cos, sin = m.rotary[str(rot)](torch.full((B, 1), pos))
    return blocks, caches, x, cos.float().contiguous(), sin.float().contiguous(), pos


@needs_extension
@pytest.mark.kernels
def test_decode_stack_fill_rows_equal_kv_of_and_leave_the_step_unchanged():
    """The op with two stand-ins written into three (buffer, row, column) entries: the step's output and its own
    cache entries as without the fill; each entry the block's kv_of(norm(z)) at the stand-in's position; every
    other entry of the buffers untouched."""
    m = _model("tiny-qwen3")
    plan = kd._prepare_stack(m.core.stack, None)
    blocks, caches, x, cos, sin, pos = _stack_inputs(m)
    z = torch.randn(2, 1, m.config.d_model)
    fcos, fsin = m.rotary[str(blocks[0].mixer.rotary_dim)](torch.tensor([[5], [2]]))
    bufs = [[KVCache(6), KVCache(6)] for _ in blocks]
    for pair in bufs:
        for b in pair:
            b.allocate(
                4,
                caches[0][0].shape[1],
                caches[0][0].shape[3],
                caches[0][0].shape[3],
                torch.float32,
                torch.device("cpu"),
            )
            b._k.normal_(), b._v.normal_()
    before = [[(b._k.clone(), b._v.clone()) for b in pair] for pair in bufs]
    index = torch.tensor([[0, 3, 5, 0], [1, 0, 2, 1], [1, 2, 4, 0]])  # (buffer, row, column, stand-in)
    plain = [(k.clone(), v.clone()) for k, v in caches]
    y0 = torch.ops.looplm_cpu.decode_stack(
        x, plan.plan, [k for k, _ in plain], [v for _, v in plain], pos, cos, sin, None
    )
    with_fill = [(k.clone(), v.clone()) for k, v in caches]
    y1 = torch.ops.looplm_cpu.decode_stack(
        x,
        plan.plan,
        [k for k, _ in with_fill],
        [v for _, v in with_fill],
        pos,
        cos,
        sin,
        None,
        fill_z=z,
        fill_cos=fcos.float().contiguous(),
        fill_sin=fsin.float().contiguous(),
        fill_k=[b._k for pair in bufs for b in pair],
        fill_v=[b._v for pair in bufs for b in pair],
        fill_index=index,
    )
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-6)
    for (k0, v0), (k1, v1) in zip(plain, with_fill):
        torch.testing.assert_close(k1, k0, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v1, v0, atol=1e-6, rtol=1e-6)
    fctx = ForwardContext(rope={blocks[0].mixer.rotary_dim: (fcos, fsin)}, is_causal=False)
    for blk, pair, prev in zip(blocks, bufs, before):
        k, v = blk.mixer.kv_of(blk.mixer_norm(z), fctx)  # [2, G, 1, hd]
        want = [(pk.clone(), pv.clone()) for pk, pv in prev]
        for j, r, c, s in index.tolist():
            want[j][0][r, :, c], want[j][1][r, :, c] = k[s, :, 0], v[s, :, 0]
        for b, (wk, wv) in zip(pair, want):
            torch.testing.assert_close(b._k, wk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b._v, wv, atol=1e-5, rtol=1e-5)


@needs_extension
@pytest.mark.kernels
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(fill_index=torch.tensor([[2, 0, 0, 0]])), "names buffer 2; each block has 2"),
        (dict(fill_index=torch.tensor([[0, 4, 0, 0]])), r"outside buffer 0's 4 rows and 6 columns"),
        (dict(fill_index=torch.tensor([[0, 0, 6, 0]])), r"outside buffer 0's 4 rows and 6 columns"),
        (dict(fill_index=torch.tensor([[0, 0, 0, 1]])), "reads stand-in row 1 of 1"),
        (dict(fill_index=torch.tensor([[0, 0, 0, 0]], dtype=torch.int32)), "fill_index must be a contiguous int64"),
        (dict(fill_cos=None, fill_sin=None), "need RoPE tables exactly when the step has them"),
        (dict(fill_k="short"), "same number of buffers for each of the plan's"),
        (dict(fill_z="bf16"), "fill_z must be a contiguous CPU float32"),
    ],
)
def test_decode_stack_refuses_bad_fill_arguments_before_writing_anything(bad, match):
    m = _model("tiny-qwen3")
    plan = kd._prepare_stack(m.core.stack, None)
    blocks, caches, x, cos, sin, pos = _stack_inputs(m)
    G, hd = caches[0][0].shape[1], caches[0][0].shape[3]
    bufs = [torch.randn(4, G, 6, hd) for _ in range(4 * len(blocks))]  # per block: 2 (k, v) buffer pairs
    args = dict(
        fill_z=torch.randn(1, 1, m.config.d_model),
        fill_cos=cos[:1].contiguous(),
        fill_sin=sin[:1].contiguous(),
        fill_k=bufs[0::2],
        fill_v=bufs[1::2],
        fill_index=torch.tensor([[0, 0, 0, 0]]),
    )
    args.update(bad)
    if args["fill_k"] == "short":
        args["fill_k"], args["fill_v"] = bufs[0:1], bufs[1:2]
    if isinstance(args["fill_z"], str):
        args["fill_z"] = args["fill_z"] and torch.randn(1, 1, m.config.d_model, dtype=torch.bfloat16)
    before = [t.clone() for t in bufs] + [t.clone() for pair in caches for t in pair]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.looplm_cpu.decode_stack(
            x, plan.plan, [k for k, _ in caches], [v for _, v in caches], pos, cos, sin, None, **args
        )
    for t, t0 in zip(bufs + [t for pair in caches for t in pair], before):
        assert torch.equal(t, t0)  # nothing written: every check runs before the step


def test_a_fill_is_offered_to_its_own_stack_only_and_write_is_the_reference():
    """offered_kv_fill names the fill to its own stack only, inside the block only; nothing writes it but a step
    that takes it or write(): the block's kv_of(norm(z)) at the entry's row and column."""
    m = _model("tiny-llama")
    blk = m.core.stack.blocks[0]
    buf = KVCache(4)
    buf.allocate(1, blk.mixer.n_kv_heads, blk.mixer.head_dim, blk.mixer.head_dim, torch.float32, torch.device("cpu"))
    buf._k.zero_(), buf._v.zero_()
    fill = KVFill(m.core.stack, [blk], [[buf]])
    cos, sin = m.rotary[str(blk.mixer.rotary_dim)](torch.tensor([[2]]))
    fill.add(
        torch.randn(1, 1, m.config.d_model),
        {blk.mixer.rotary_dim: (cos, sin)},
        [(0, torch.tensor([0]), 2, torch.tensor([0]))],
    )
    with dispatch.offer_kv_fill(fill):
        assert dispatch.offered_kv_fill(m.core.stack) is fill and dispatch.offered_kv_fill(m.prelude) is None
    assert dispatch.offered_kv_fill(m.core.stack) is None
    assert not fill.written and float(buf._k.abs().max()) == 0.0
    fill.write()
    k, v = blk.mixer.kv_of(blk.mixer_norm(fill.z()), fill.tables())
    assert fill.written and torch.equal(buf._k[0, :, 2], k[0, :, 0]) and torch.equal(buf._v[0, :, 2], v[0, :, 0])
