"""Continuous depth batching (looplm.decode.depth_schedule, exit schedule 'depth'): every core pass runs each row at its
own loop of its own token. Against the token schedule (looplm.decode.token_schedule, itself held to rows decoded alone),
the caches it leaves at every row's columns, the fused op with per-row columns against the reference, the
criteria, sampling, eos, statistics, and the refusals."""

import pytest
import torch

import looplm
from looplm.decode.token_schedule import AdaptiveDecoder
from looplm.decode.depth_schedule import DepthBatchedDecoder
from looplm.context import ForwardContext
from looplm.decode.exits import Exit
from looplm.layers.attention import KVCache, KVRows
from looplm.kernels import decode as kd
from looplm.decode.sampling import decode_context

from helpers import assert_refused_before_any_work, tiny_variant

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return looplm.build(name, **kw).eval().to(dtype)


def _replay(depths, **kw):
    return dict(criterion="replay", depths=depths, **kw)


def _both(m, ids, n, exit, **kw):
    """(token schedule, depth schedule) generations of ``n`` tokens under ``exit``."""
    tok = m.generate(ids, n, exit=exit, **kw)
    dep = m.generate(ids, n, exit={**exit, "schedule": "depth"}, **kw)
    return tok, dep


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-coreloop", "tiny-stateloop"])
@pytest.mark.parametrize("kv", ["copy", "propagate", "shared"])
def test_depth_schedule_equals_the_token_schedule_with_left_padding(name, kv):
    """Greedy tokens under replayed per-row, per-token depths: the depth schedule's rows (each at its own
    token and loop) equal the token schedule's (which equal rows decoded alone: tests/test_adaptive.py)."""
    m = _model(name)
    K, B, P, N = m.config.n_loops, 4, 6, 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :3], mask[3, :1] = 0, 0
    depths = torch.randint(1, K + 1, (B, N), generator=g)
    tok, dep = _both(m, ids, N, _replay(depths, kv=kv), attention_mask=mask)
    assert torch.equal(tok, dep)
    perm = torch.tensor([2, 0, 3, 1])
    again = m.generate(ids[perm], N, attention_mask=mask[perm], exit=_replay(depths[perm], kv=kv, schedule="depth"))
    assert torch.equal(again, dep[perm])


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-mamba2"])
@pytest.mark.parametrize(
    "kv,ssm",
    [
        ("copy", "freeze"),
        ("propagate", "freeze"),
        ("shared", "freeze"),
        ("copy", "propagate"),
        ("shared", "decay"),
        ("propagate", "decay"),
    ],
)
def test_mamba2_cores_under_the_depth_schedule_equal_the_token_schedule_and_keep_its_states(name, kv, ssm):
    """Mamba-2 layers in the core: each row's state of loop k is buffer row k·B + b of one flat state per
    layer, stepped in place by the row's tokens that ran loop k; the loops it skipped frozen, or given the
    stand-in's propagation / decay. Greedy tokens (left padding included) and every loop's conv and SSM
    state after the decode equal the token schedule's on the same tokens and depths."""
    m = _model(name)
    K, B, P, N = m.config.n_loops, 3, 5, 8
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 250, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[2, :2] = 0
    depths = torch.randint(1, K + 1, (B, N), generator=g)
    tok, dep = _both(m, ids, N, _replay(depths, kv=kv, ssm=ssm), attention_mask=mask)
    assert torch.equal(tok, dep)
    dec = DepthBatchedDecoder(m, B, P + N, _replay(depths, kv=kv, ssm=ssm, schedule="depth"))
    out = dec.run(ids, N, None, lambda logits: logits.max(-1).indices, None, 0)
    ref = AdaptiveDecoder(m, B, P + N, _replay(depths, kv=kv, ssm=ssm))
    ref.score(out[:, : P + N - 1], prompt_len=P)
    ssm_layers = [b.layer_idx for b in m.core.stack.blocks if b.layer_idx not in dec.kv_flat]
    assert ssm_layers
    for j in ssm_layers:
        big = dec.flat[j][0]
        for k in range(K):
            s = ref.cache.slots[(k, j)]
            torch.testing.assert_close(big.conv_state[k * B : (k + 1) * B], s.conv_state, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(big.ssm_state[k * B : (k + 1) * B], s.ssm_state, atol=1e-5, rtol=1e-5)
    if ssm != "freeze":  # the policy took effect: the deeper loops' states differ from a frozen decode's
        frozen = DepthBatchedDecoder(m, B, P + N, _replay(depths, kv=kv, schedule="depth"))
        frozen.run(ids, N, None, lambda logits: logits.max(-1).indices, None, 0)
        assert not torch.allclose(frozen.flat[ssm_layers[0]][0].ssm_state, dec.flat[ssm_layers[0]][0].ssm_state)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.kernels)])
@pytest.mark.parametrize("kv", ["copy", "propagate"])
def test_every_loops_cache_at_every_rows_column_equals_the_token_schedules(kv, fused):
    """The state the depth schedule leaves: each core layer's keys and values of every loop, row and
    written column equal the token schedule's on the same tokens and depths (the copies and propagations
    of skipped loops included), in the flat ``[R·B, ...]`` buffer the loops' slots view. Fused: the depth
    schedule's one decode_stack per pass (per-row cache rows and columns) against the token schedule's steps."""
    m = _model("tiny-llama")
    K, B, P, N = m.config.n_loops, 3, 5, 8
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 250, (B, P), generator=g)
    depths = torch.randint(1, K + 1, (B, N), generator=g)
    dec = DepthBatchedDecoder(m, B, P + N, _replay(depths, kv=kv, schedule="depth"))
    out = dec.run(ids, N, None, lambda logits: logits.max(-1).indices, None, 0)
    ref = AdaptiveDecoder(m, B, P + N, _replay(depths, kv=kv))
    with decode_context(m, B):  # fused: the token schedule's own fused steps
        ref.score(out[:, : P + N - 1], prompt_len=P)  # the same tokens, one at a time, the same depths
    cols = P + N - 1
    for k in range(K):
        for blk in m.core.stack.blocks:
            a, b = dec.cache.slots[(k, blk.layer_idx)], ref.cache.slots[(k, blk.layer_idx)]
            torch.testing.assert_close(a._k[:, :, :cols], b._k[:, :, :cols], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a._v[:, :, :cols], b._v[:, :, :cols], atol=1e-5, rtol=1e-5)
            flat = dec.flat[blk.layer_idx][0]._k
            assert a._k.data_ptr() == flat[k * B].data_ptr()  # loop k's slot is a view of the layer's one buffer


@pytest.mark.kernels
def test_the_fused_pass_equals_the_reference_and_takes_the_calls():
    """bf16 and fp32: the fused decode_stack with per-row cache rows and columns gives the reference's tokens,
    and runs one call per core pass."""
    from torch.profiler import profile

    for dt in (torch.float32, torch.bfloat16):
        m = _model("tiny-qwen3", dt)  # QK-norm, GQA
        K, B, P, N = m.config.n_loops, 4, 5, 8
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 250, (B, P), generator=g)
        ex = _replay(torch.randint(1, K + 1, (B, N), generator=g), schedule="depth")
        with kd.enabled(False):
            ref = m.generate(ids, N, exit=ex)
        with profile() as prof:
            got, st = m.generate(ids, N, exit=ex, return_stats=True)
        assert torch.equal(got, ref)
        calls = sum(e.count for e in prof.key_averages() if e.key == "looplm_cpu::decode_stack")
        assert calls == st.core_calls > 0


@pytest.mark.kernels
def test_decode_stack_with_per_row_columns_checks_them_and_equals_the_reference():
    """The op's ``cols``: refused outside ``0..pos`` or as int32; each row writes its own column only; the
    output and every written key / value equal the reference blocks on a per-row-column row view."""
    from looplm import kernels

    kernels.load("cpu")
    m = _model("tiny-llama")
    plan = kd._prepare_stack(m.core.stack, 2)
    d = m.config.d_model
    a = m.core.stack.blocks[0].mixer
    kc = [torch.zeros(2, a.n_kv_heads, 8, a.head_dim) for _ in m.core.stack.blocks]
    vc = [torch.zeros_like(t) for t in kc]
    x = torch.randn(2, 1, d)
    ang = torch.rand(2, 1, a.rotary_dim // 2).repeat(1, 1, 2) * 3
    cos, sin = ang.cos(), ang.sin()
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"cols\[1\] = 4 is outside 0..pos = 0..3"):
        torch.ops.looplm_cpu.decode_stack(x, plan.plan, kc, vc, 3, cos, sin, mask, cols=torch.tensor([1, 4]))
    with pytest.raises(RuntimeError, match="cols must be a contiguous int64"):
        torch.ops.looplm_cpu.decode_stack(
            x, plan.plan, kc, vc, 3, cos, sin, mask, cols=torch.tensor([1, 2], dtype=torch.int32)
        )
    cols = torch.tensor([1, 3])
    y = torch.ops.looplm_cpu.decode_stack(x, plan.plan, kc, vc, 3, cos, sin, mask, cols=cols)
    assert kc[0][0, :, 1].abs().sum() > 0 and kc[0][0, :, 3].abs().sum() == 0  # row 0 wrote column 1 only
    assert kc[0][1, :, 3].abs().sum() > 0 and kc[0][1, :, 1].abs().sum() == 0
    # against the reference blocks on a row view with the same per-row columns, over random earlier keys
    g = torch.Generator().manual_seed(9)
    before = [
        (
            torch.randn(2, a.n_kv_heads, 8, a.head_dim, generator=g),
            torch.randn(2, a.n_kv_heads, 8, a.head_dim, generator=g),
        )
        for _ in m.core.stack.blocks
    ]
    mask[0, 0, 0, 2:] = False  # row 0 reads its columns 0..1 only (what the driver's mask says)
    fused = [(k.clone(), v.clone()) for k, v in before]
    y = torch.ops.looplm_cpu.decode_stack(
        x, plan.plan, [k for k, _ in fused], [v for _, v in fused], 3, cos, sin, mask, cols=cols
    )
    views = []
    for k, v in before:
        base = KVCache(8)
        base._k, base._v, base._len = k, v, 3
        views.append(KVRows(base, torch.arange(2), 2, cols))
    fctx = ForwardContext(rope={a.rotary_dim: (cos, sin)}, positions=None, attn_mask=mask, is_causal=False)
    ref = m.core.stack(x, fctx, views)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)
    for (fk, fv), (rk, rv) in zip(fused, before):
        torch.testing.assert_close(fk, rk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fv, rv, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", ["kl:0.5", "convergence:0.6", {"criterion": "kl", "threshold": 0.5, "min_loops": 2}])
def test_zero_shot_criteria_under_the_depth_schedule(spec):
    m = _model("tiny-llama")
    ids = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(4))
    e = Exit.parse(spec)
    tok, (dep, st) = (
        m.generate(ids, 8, exit=e),
        m.generate(ids, 8, exit=e.with_policies(schedule="depth"), return_stats=True),
    )
    assert torch.equal(tok, dep)
    s = st.summary()
    assert s["selected_depth"] == s["executed_depth"] >= e.min_loops  # nobody waits under the depth schedule
    assert s["check_flops_per_token"] > 0


def _rule_case(rule):
    """tiny-llama with ``rule`` (an exit gate with a spread-out gate), three prompts, and its exit: the gate
    at q = 0.5, or replayed per-row, per-token depths."""
    m = _model("tiny-llama", overrides={"rule": {"name": rule}})
    if rule == "exit_gate":
        with torch.no_grad():
            m.rule.gate.weight.normal_(0, 1.0)
            m.rule.gate.bias.zero_()
    K = m.config.n_loops
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (3, 5), generator=g)
    ex = (
        {"criterion": "gate", "threshold": 0.5}
        if rule == "exit_gate"
        else _replay(torch.randint(1, K + 1, (3, 8), generator=g))
    )
    return m, ids, ex


@pytest.mark.parametrize("rule", ["exit_gate", "timestep", "injection", "history"])
def test_rules_with_loop_dependent_parts_under_the_depth_schedule(rule):
    """Per cohort the rule sees one loop index: the gate's CDF, timestep conditioning's per-loop block
    modulation (concatenated per row for the one core pass), injection, a history of iterates."""
    m, ids, ex = _rule_case(rule)
    for kv in ("copy", "propagate"):  # propagate under timestep conditioning: per loop, with its scale (_fill)
        tok, dep = _both(m, ids, 8, {**ex, "kv": kv})
        assert torch.equal(tok, dep)


@pytest.mark.parametrize("preset", ["huginn-0125"])
def test_public_model_rule_under_the_depth_schedule(preset):
    """Huginn at toy width (post-sum blocks: the reference path with per-row columns, 32 loops)."""
    torch.manual_seed(0)
    m = looplm.build(tiny_variant(preset)).eval()
    K = m.config.n_loops
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 128, (3, 4), generator=g)
    tok, dep = _both(m, ids, 5, _replay(torch.randint(1, K + 1, (3, 5), generator=g)))
    assert torch.equal(tok, dep)


def test_eos_rows_stop_at_their_own_pace_and_pad():
    m = _model("tiny-llama")
    K = m.config.n_loops
    ids = torch.randint(0, 250, (4, 4), generator=torch.Generator().manual_seed(7))
    ex = _replay(torch.tensor([1, K, 2, 1]).repeat_interleave(10).view(4, 10))
    free = m.generate(ids, 10, exit=ex)
    eos = int(free[1, 6])  # a token row 1 emits early
    tok, dep = _both(m, ids, 10, ex, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(tok, dep)
    first = int((dep[1, 4:] == eos).nonzero()[0, 0]) + 4
    assert first <= 6 and (dep[1, first + 1 :] == 0).all()  # row 1 stopped there, padded after


def test_sampling_is_deterministic_and_at_batch_one_draws_as_the_token_schedule():
    m = _model("tiny-llama")
    x = torch.randint(0, 250, (3, 4))
    ex = {"criterion": "convergence", "threshold": 0.9, "kv": "propagate", "schedule": "depth"}
    runs = [
        m.generate(x, 8, do_sample=True, top_k=20, generator=torch.Generator().manual_seed(3), exit=ex)
        for _ in range(2)
    ]
    assert torch.equal(*runs)
    one = [
        m.generate(
            x[:1],
            8,
            do_sample=True,
            temperature=0.8,
            generator=torch.Generator().manual_seed(4),
            exit={**ex, "schedule": s},
        )
        for s in ("token", "depth")
    ]
    assert torch.equal(*one)  # one row: the same draws in the same order


def test_statistics_count_each_rows_own_depths_and_the_passes():
    m = _model("tiny-llama")
    K, B, P, N = m.config.n_loops, 4, 3, 7
    depths = torch.randint(1, K + 1, (B, N), generator=torch.Generator().manual_seed(8))
    _, st = m.generate(torch.randint(0, 250, (B, P)), N, exit=_replay(depths, schedule="depth"), return_stats=True)
    used = depths[:, : N - 1]  # the first new token comes from the prompt's forward
    assert int(torch.cat(st.selected).sum()) == int(used.sum())
    s = st.summary()
    assert s["tokens"] == B * (N - 1) and s["executed_depth"] == pytest.approx(float(used.float().mean()))
    # every pass runs every row in flight; the passes cover every row's own loops, not the deepest row's
    assert (
        int(used.sum(1).max()) <= st.core_calls <= int(used.sum()) and st.core_calls < int(used.max(0).values.sum()) * 2
    )
    assert s["batch_depth"] == pytest.approx(st.core_calls * B / s["tokens"])
    assert 0 < s["flops_ratio"] < 1
    ids = torch.randint(0, 250, (B, P))
    for kv in ("copy", "propagate"):  # the same tokens did the same work: every counter equals the token schedule's
        _, tok = m.generate(ids, N, exit=_replay(depths, kv=kv), return_stats=True)
        _, dep = m.generate(ids, N, exit=_replay(depths, kv=kv, schedule="depth"), return_stats=True)
        for f in ("core_flops", "fill_flops", "fill_bytes", "other_flops", "full_core_flops"):
            assert getattr(dep, f) == pytest.approx(getattr(tok, f)), (kv, f)


@pytest.mark.parametrize(
    "name,overrides,spec,match",
    [
        (
            "tiny-hybrid",
            {"n_prelude": 1, "n_core": 2},
            {"criterion": "kl", "threshold": 0.1},
            "Mamba-2 layers in the core only",
        ),
        ("tiny-llama", {}, {"criterion": "kl", "threshold": 0.1, "kv": "full"}, "kv='full' runs every loop"),
        (
            "tiny-llama",
            {"attention.sliding_window": 4, "attention.sliding_layer_idx": [1]},
            {"criterion": "kl", "threshold": 0.1},
            "sliding-window band",
        ),
        (
            "tiny-stateloop",
            {"rule.options.mixer": "attention", "rule.options.mixer_head_dim": 16},
            {"criterion": "kl", "threshold": 0.1},
            "own per-loop slots",
        ),
        ("tiny-llama", {}, {"criterion": "kl", "threshold": 0.1, "schedule": "async"}, "schedule 'async' is unknown"),
    ],
)
def test_what_the_depth_schedule_cannot_run_is_refused_before_any_work(name, overrides, spec, match):
    _refused(name, overrides, {"schedule": "depth", **spec}, match)


def _refused(name, overrides, spec, match):
    """Generating 4 tokens with ``exit=spec`` on the tiny ``name`` (with ``overrides``) raises ``match``
    before any work."""
    m = _model(name, overrides=overrides) if overrides else _model(name)
    assert_refused_before_any_work(m, lambda: m.generate(torch.randint(0, 128, (2, 3)), 4, exit=spec), match)


def test_front_ends_take_the_schedule():
    from looplm.cli import build_parser
    from looplm.eval.harness import adaptive_options as harness_options
    from looplm.decode.generate import adaptive_options

    m = _model("tiny-llama")
    assert adaptive_options(m, exit="kl:0.1", schedule="depth")["exit"].schedule == "depth"
    assert harness_options(m, exit="kl:0.1", exit_schedule="depth")["exit"].schedule == "depth"
    with pytest.raises(ValueError, match="options of --exit"):
        adaptive_options(m, schedule="depth")
    from looplm.cli import _adaptive_args

    args = build_parser("generate").parse_args(
        ["generate", "--model", "tiny-llama", "--exit", "kl:0.1", "--exit-schedule", "depth"]
    )
    assert _adaptive_args(args, m)["exit"].schedule == "depth"


def test_generation_timing_times_both_kinds_of_contenders():
    from looplm.eval.decode_timing import FullDepth, generation_timing

    m = _model("tiny-llama")
    spec = _replay(2)
    res = generation_timing(
        m,
        torch.randint(0, 250, (2, 4)),
        6,
        {
            "full": lambda b, c: FullDepth(m, b, c),
            "token": lambda b, c: AdaptiveDecoder(m, b, c, spec),
            "depth": lambda b, c: DepthBatchedDecoder(m, b, c, {**spec, "schedule": "depth"}),
        },
        runs=1,
    )
    assert res["full"]["ratio"] == 1.0 and res["depth"]["ms_per_token"] > 0
    assert res["depth"]["stats"]["executed_depth"] == res["token"]["stats"]["executed_depth"] == 2


@pytest.mark.parametrize("cols", [False, True])
def test_a_row_view_attends_the_same_by_gathering_or_in_place(cols):
    """KVRows' reference attention: a few rows of a large buffer gather their keys (3·n < B), more rows
    attend in place over the whole buffer; both equal each row's own attention, and write the same keys."""
    from looplm.layers.attention import KVCache, KVRows
    from looplm.kernels.training import attention

    g = torch.Generator().manual_seed(13)
    B, H, L, hd = 12, 2, 7, 8
    for n in (2, 6):  # gathered (6 < 12), in place (18 >= 12)
        base = KVCache(9)
        base.allocate(B, H, hd, hd, torch.float32, "cpu")
        base._k[:, :, :L] = torch.randn(B, H, L, hd, generator=g)
        base._v[:, :, :L] = torch.randn(B, H, L, hd, generator=g)
        base._len = L - 1
        idx = torch.randperm(B, generator=g)[:n]
        q, k, v = (torch.randn(n, H, 1, hd, generator=g) for _ in range(3))
        c = torch.randint(0, L, (n,), generator=g) if cols else None
        mask = (torch.arange(L)[None] <= (c if cols else torch.full((n,), L - 1))[:, None])[:, None, None, :]
        y = KVRows(base, idx, B, c).attend(q, k, v, mask, False)
        K, V = base._k[idx, :, :L], base._v[idx, :, :L]
        torch.testing.assert_close(y, attention(q, K, V, attn_mask=mask), atol=1e-6, rtol=1e-6)
        at = c if cols else torch.full((n,), L - 1)
        torch.testing.assert_close(base._k[idx, :, at], k[:, :, 0])


def test_a_kl_readout_through_coda_layers_under_the_depth_schedule():
    """tiny-coreloop (a coda: the kl readout makes its own per-loop coda slots at its first check, after the
    decoder was built): rows that leave early take the full exit path (rule state, fills of the readout's slots);
    greedy tokens equal the token schedule's. Failed with an UnboundLocalError before."""
    m = _model("tiny-coreloop")
    ids = torch.randint(0, 250, (3, 5), generator=torch.Generator().manual_seed(1))
    tok, (dep, st) = (
        m.generate(ids, 10, exit="kl:0.004"),
        m.generate(ids, 10, exit={"criterion": "kl", "threshold": 0.004, "schedule": "depth"}, return_stats=True),
    )
    assert torch.equal(tok, dep)
    depths = torch.cat([s.reshape(-1) for s in st.selected])
    assert depths.min() < m.config.n_loops == depths.max()  # some rows left early, beside others
