"""Continuous depth batching at fixed shapes (looplm.decode.static_schedule, exit schedule 'static'): every pass runs
all rows, each at its own loop, with no host read of a tensor. Against the token schedule (itself held to
rows decoded alone) and the depth schedule: tokens, caches, statistics; a pass's host reads counted with a
dispatch mode (what would be a CUDA synchronisation); the late end-of-batch flag; the refusals."""

import collections

import pytest
import torch

import looplm
from looplm import dispatch
from looplm.decode.depth_schedule import DepthBatchedDecoder
from looplm.decode.static_schedule import StaticDepthDecoder
from looplm.decode.exits import Exit
from looplm.recurrence import RULES

from helpers import assert_refused_before_any_work, tiny_variant
from host_reads import HostReads
from test_depth_batch import _model, _refused, _replay, _rule_case

pytestmark = pytest.mark.usefixtures("one_thread")


def _greedy(logits):
    return logits.max(-1).indices


def _counted(dec):
    """``dec`` with every pass run under :class:`HostReads`; returns the counter of ops that read a value."""
    reads = collections.Counter()
    tick = dec._tick

    def counted(*a, **k):
        with HostReads() as r:
            tick(*a, **k)
        reads.update(r.reads)

    dec._tick = counted
    return reads


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-coreloop", "tiny-hybrid", "tiny-mamba2"])
@pytest.mark.parametrize("kv", ["copy", "propagate", "shared"])
def test_static_schedule_equals_the_token_schedule_with_left_padding(name, kv):
    """Greedy tokens under replayed per-row, per-token depths equal the token schedule's, with left padding
    and under a row permutation."""
    m = _model(name)
    K, B, P, N = m.config.n_loops, 4, 6, 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :3], mask[3, :1] = 0, 0
    depths = torch.randint(1, K + 1, (B, N), generator=g)
    tok = m.generate(ids, N, exit=_replay(depths, kv=kv), attention_mask=mask)
    st = m.generate(ids, N, exit=_replay(depths, kv=kv, schedule="static"), attention_mask=mask)
    assert torch.equal(tok, st)
    perm = torch.tensor([2, 0, 3, 1])
    again = m.generate(ids[perm], N, attention_mask=mask[perm], exit=_replay(depths[perm], kv=kv, schedule="static"))
    assert torch.equal(again, st[perm])


@pytest.mark.parametrize("kv", ["copy", "propagate"])
def test_every_loops_cache_equals_the_depth_schedules(kv):
    """The flat ``[R·B, ...]`` core buffers (every loop, row and written column: the copies and propagations
    of skipped loops) and the prelude's and coda's slots equal the depth schedule's on the same depths."""
    m = _model("tiny-llama", overrides={"n_prelude": 1, "n_coda": 1})
    K, B, P, N = m.config.n_loops, 3, 5, 8
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 250, (B, P), generator=g)
    depths = torch.randint(1, K + 1, (B, N), generator=g)
    dyn = DepthBatchedDecoder(m, B, P + N, _replay(depths, kv=kv, schedule="depth"))
    out = dyn.run(ids, N, None, _greedy, None, 0)
    fix = StaticDepthDecoder(m, B, P + N, _replay(depths, kv=kv, schedule="static"))
    assert torch.equal(fix.run(ids, N, None, _greedy, None, 0), out)
    cols = P + N - 1  # the last token's column is never run
    for layer, (base, _, _) in dyn.flat.items():
        other = fix.flat[layer][0]
        torch.testing.assert_close(other._k[:, :, :cols], base._k[:, :, :cols], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other._v[:, :, :cols], base._v[:, :, :cols], atol=1e-5, rtol=1e-5)
    for key, slot in dyn.cache.slots.items():
        if getattr(slot, "_k", None) is not None and key[0] not in range(K):  # prelude / coda
            torch.testing.assert_close(fix.cache.slots[key]._k[:, :, :cols], slot._k[:, :, :cols], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [
        {"criterion": "convergence", "threshold": 0.6},
        {"criterion": "kl", "threshold": 0.5, "kv": "propagate"},
        {"criterion": "kl", "threshold": 0.5, "min_loops": 2, "kv": "shared"},
        "replay",
    ],
)
def test_a_pass_reads_no_value_on_the_host(spec):
    """The reference path (what CUDA runs) of every pass makes no op that reads a tensor's value on the host
    (``.item()``, ``bool()``, ``nonzero``, a bool-mask index, ...): on CUDA, no synchronisation per pass. The
    depth schedule, for contrast, reads several per pass."""
    m = _model("tiny-llama")
    K, B, P, N = m.config.n_loops, 4, 5, 9
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (B, P), generator=g)
    if spec == "replay":
        spec = _replay(torch.randint(1, K + 1, (B, N), generator=g))
    e = Exit.parse(spec)
    with dispatch.reference_only():
        fix = StaticDepthDecoder(m, B, P + N, e.with_policies(schedule="static"))
        reads = _counted(fix)
        out = fix.run(ids, N, None, _greedy, None, 0)
        dyn = DepthBatchedDecoder(m, B, P + N, e.with_policies(schedule="depth"))
        with HostReads() as dyn_reads:  # the whole decode: its token loop reads the rows to start, the furthest column
            assert torch.equal(dyn.run(ids, N, None, _greedy, None, 0), out)
    assert fix.passes > 0 and sum(reads.values()) == 0, dict(reads)
    assert len(dyn_reads.reads) >= dyn.stats.core_calls // 2  # the detector sees the depth schedule's reads


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-mamba2"])
@pytest.mark.parametrize("ssm", ["freeze", "propagate", "decay"])
def test_mamba2_cores_read_no_value_on_the_host_and_keep_the_depth_schedules_states(name, ssm):
    """Mamba-2 core layers: each row steps its own loop's state (row k_b·B + b of the flat state) in place;
    the skipped loops' states take the policy where the pair is skipped (masked). No host read per pass; the
    depth schedule's tokens and every loop's conv and SSM state."""
    m = _model(name)
    K, B, P, N = m.config.n_loops, 3, 5, 8
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 250, (B, P), generator=g)
    spec = _replay(torch.randint(1, K + 1, (B, N), generator=g), ssm=ssm)
    with dispatch.reference_only():
        dec = StaticDepthDecoder(m, B, P + N, {**spec, "schedule": "static"})
        reads = _counted(dec)
        out = dec.run(ids, N, None, _greedy, None, 0)
    assert dec.passes > 0 and sum(reads.values()) == 0, dict(reads)
    dyn = DepthBatchedDecoder(m, B, P + N, {**spec, "schedule": "depth"})
    assert torch.equal(dyn.run(ids, N, None, _greedy, None, 0), out)
    for j, (base, _, _) in dyn.flat.items():
        if j not in dyn.kv_flat:
            torch.testing.assert_close(dec.flat[j][0].conv_state, base.conv_state, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dec.flat[j][0].ssm_state, base.ssm_state, atol=1e-5, rtol=1e-5)


def test_a_pass_of_the_exit_gate_and_of_sampling_reads_no_value_on_the_host():
    m = _model("tiny-llama", overrides={"rule": {"name": "exit_gate"}})
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)
        m.rule.gate.bias.zero_()
    ids = torch.randint(0, 250, (3, 5), generator=torch.Generator().manual_seed(4))
    from looplm.decode.sampling import sample_next

    gen = torch.Generator().manual_seed(5)
    with dispatch.reference_only():
        dec = StaticDepthDecoder(m, 3, 13, {"criterion": "gate", "threshold": 0.5, "schedule": "static"})
        reads = _counted(dec)
        dec.run(ids, 8, None, lambda x: sample_next(x, True, 0.9, 20, 0.95, gen), eos_token_id=7, pad_token_id=0)
    assert dec.passes > 0 and sum(reads.values()) == 0, dict(reads)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_under_the_static_schedule(rule):
    """The rule is called once per loop index on every row and each row keeps its own loop's result (the
    gate's CDF and selection, timestep conditioning's per-loop modulation, injection, memory slots, ...):
    the token schedule's tokens for every KV policy, or a refusal that names the reason."""
    m, ids, ex = _rule_case(rule)
    refused = {"history": "state changes over the loops", ("timestep", "propagate"): "modulates its blocks per loop"}
    for kv in ("copy", "propagate", "shared"):
        why = refused.get(rule) or refused.get((rule, kv))
        if why:
            with pytest.raises(ValueError, match=why):
                m.generate(ids, 8, exit={**ex, "kv": kv, "schedule": "static"})
            continue
        tok = m.generate(ids, 8, exit={**ex, "kv": kv})
        assert torch.equal(m.generate(ids, 8, exit={**ex, "kv": kv, "schedule": "static"}), tok), kv


@pytest.mark.parametrize("spec", ["kl:0.5", "convergence:0.6"])
def test_zero_shot_criteria_and_statistics_under_the_static_schedule(spec):
    """Tokens equal the token schedule's; the statistics count each row's own depths, the passes, and the
    work of every row every pass (so more FLOPs than the depth schedule on the same tokens)."""
    m = _model("tiny-llama")
    ids = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(6))
    e = Exit.parse(spec)
    tok, tst = m.generate(ids, 8, exit=e, return_stats=True)
    dep, dst = m.generate(ids, 8, exit=e.with_policies(schedule="depth"), return_stats=True)
    fix, fst = m.generate(ids, 8, exit=e.with_policies(schedule="static"), return_stats=True)
    assert torch.equal(tok, fix) and torch.equal(dep, fix)
    s, d = fst.summary(), dst.summary()
    assert s["tokens"] == d["tokens"] == 4 * 7
    assert s["selected_depth"] == pytest.approx(d["selected_depth"]) and s["executed_depth"] == s["selected_depth"]
    assert torch.equal(torch.cat(fst.selected).sort().values, torch.cat(dst.selected).sort().values)
    assert fst.core_calls >= dst.core_calls  # the same passes, or more (rows that finished still run, masked)
    assert fst.full_core_flops == pytest.approx(dst.full_core_flops)
    assert fst.other_flops > dst.other_flops and fst.check_flops >= dst.check_flops > 0


def test_eos_rows_stop_and_pad_and_the_late_flag_only_adds_masked_passes():
    """A row that emits eos stops there (padded after); reading the end-of-batch flag ``lag`` passes late
    runs at most ``lag`` passes more, which change nothing."""
    m = _model("tiny-llama")
    K = m.config.n_loops
    ids = torch.randint(0, 250, (4, 4), generator=torch.Generator().manual_seed(7))
    ex = _replay(torch.tensor([1, K, 2, 1]).repeat_interleave(10).view(4, 10))
    free = m.generate(ids, 10, exit=ex)
    eos = int(free[1, 6])
    tok = m.generate(ids, 10, exit=ex, eos_token_id=eos, pad_token_id=0)
    runs = {}
    for lag in (0, 3, K):
        dec = StaticDepthDecoder(m, 4, 14, {**ex, "schedule": "static"}, lag=lag)
        runs[lag] = (dec.run(ids, 10, None, _greedy, eos, 0), dec.passes, dec.stats.summary())
        assert torch.equal(runs[lag][0], tok), lag
    base = runs[0][1]
    for lag in (3, K):
        assert base <= runs[lag][1] <= base + lag
        assert runs[lag][2]["selected_depth"] == runs[0][2]["selected_depth"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lag must be an int >= 0"):
            StaticDepthDecoder(m, 4, 14, {**ex, "schedule": "static"}, lag=bad)
    with pytest.raises(ValueError, match="cuda_graphs=True captures the pass as a CUDA graph; the model is on cpu"):
        StaticDepthDecoder(m, 4, 14, {**ex, "schedule": "static"}, cuda_graphs=True)


@pytest.mark.parametrize(
    "spec", [{"criterion": "kl", "threshold": 0.5, "kv": "propagate"}, {"criterion": "gate", "threshold": 0.5}]
)
def test_a_pass_touches_only_the_decodes_buffers(spec):
    """What a captured pass needs: from the second pass on, the rule state, the criterion's memory, the
    counters and the per-pass records stay the same tensors (written in place), so a replay of one pass's
    kernels on that memory is the next pass."""
    rule = "exit_gate" if spec["criterion"] == "gate" else "vanilla"
    m = _model("tiny-llama", overrides={"rule": {"name": rule}})
    if rule == "exit_gate":
        with torch.no_grad():
            m.rule.gate.weight.normal_(0, 1.0)
    ids = torch.randint(0, 250, (3, 5), generator=torch.Generator().manual_seed(9))
    dec = StaticDepthDecoder(m, 3, 13, {**spec, "schedule": "static"})
    seen = []
    tick = dec._tick

    def record(*a, **k):
        tick(*a, **k)
        mem = a[5]
        leaves = [t for t in _leaves(mem) if isinstance(t, torch.Tensor)]
        seen.append([t.data_ptr() for t in leaves + [dec.sel, dec.at_col, dec.key_sum, dec.pairs, dec.pass_idx]])

    dec._tick = record
    out = dec.run(ids, 8, None, _greedy, None, 0)
    assert len(seen) == dec.passes >= 3 and all(s == seen[0] for s in seen[1:])
    assert int(dec.pass_idx) == dec.passes and torch.equal(out, m.generate(ids, 8, exit=spec))


def _leaves(x):
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return [x]


def test_sampling_is_deterministic():
    m = _model("tiny-llama")
    x = torch.randint(0, 250, (3, 4))
    ex = {"criterion": "convergence", "threshold": 0.9, "kv": "propagate", "schedule": "static"}
    runs = [
        m.generate(x, 8, do_sample=True, top_k=20, generator=torch.Generator().manual_seed(3), exit=ex)
        for _ in range(2)
    ]
    assert torch.equal(*runs) and runs[0].shape == (3, 12)


def test_public_model_rule_under_the_static_schedule():
    """Huginn at toy width (injection with its own norms, 32 loops)."""
    torch.manual_seed(0)
    m = looplm.build(tiny_variant("huginn-0125")).eval()
    K = m.config.n_loops
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 128, (3, 4), generator=g)
    ex = _replay(torch.randint(1, K + 1, (3, 5), generator=g))
    assert torch.equal(m.generate(ids, 5, exit={**ex, "schedule": "static"}), m.generate(ids, 5, exit=ex))


@pytest.mark.parametrize(
    "name,overrides,spec,match",
    [
        ("tiny-llama", {"rule": {"name": "history"}}, _replay(2), "state changes over the loops"),
        ("tiny-llama", {"rule": {"name": "timestep"}}, _replay(2, kv="propagate"), "modulates its blocks per loop"),
        ("tiny-llama", {"n_coda": 1}, {"criterion": "kl", "threshold": 0.1}, "readout slot per loop"),
        (
            "tiny-hybrid",
            {"rule": {"name": "timestep"}},
            _replay(2, ssm="decay"),
            "modulates its blocks per loop: use ssm='freeze'",
        ),
        ("tiny-llama", {}, {"criterion": "kl", "threshold": 0.1, "kv": "full"}, "kv='full' runs every loop"),
    ],
)
def test_what_the_static_schedule_cannot_run_is_refused_before_any_work(name, overrides, spec, match):
    _refused(name, overrides, {"schedule": "static", **spec}, match)


def test_too_few_replayed_depths_are_refused_before_any_work():
    m = _model("tiny-llama")
    spec = _replay(torch.ones(2, 2, dtype=torch.long), schedule="static")
    assert_refused_before_any_work(
        m, lambda: m.generate(torch.randint(0, 128, (2, 3)), 6, exit=spec), "give at least that many"
    )


@pytest.mark.slow
def test_a_compiled_pass_decodes_the_eager_passes_tokens_and_statistics():
    """``compile=True`` (the pass through torch.compile): the eager pass's tokens, depths and counters; a
    second decode of the same shapes reuses the graphs (no new compilation)."""
    from torch._dynamo.utils import counters

    m = _model("tiny-llama")
    ids = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(6))
    e = Exit.parse("convergence:0.6").with_policies(schedule="static")
    eager, est = m.generate(ids, 8, exit=e, return_stats=True)
    comp, cst = m.generate(ids, 8, exit=e.with_policies(compile=True), return_stats=True)
    assert torch.equal(eager, comp)
    assert cst.summary() == est.summary() and cst.core_calls == est.core_calls
    assert torch.equal(torch.cat(cst.selected), torch.cat(est.selected))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # it did compile
    assert torch.equal(
        m.generate(ids.flip(0), 8, exit=e.with_policies(compile=True)), m.generate(ids.flip(0), 8, exit=e)
    )
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_is_refused_outside_the_static_schedule_and_with_cuda_graphs():
    _refused(
        "tiny-llama",
        {},
        {"criterion": "kl", "threshold": 0.1, "schedule": "depth", "compile": True},
        "use schedule='static'",
    )
    _refused(
        "tiny-llama",
        {},
        {"criterion": "kl", "threshold": 0.1, "schedule": "static", "compile": "yes"},
        "compile must be True or False",
    )
    m = _model("tiny-llama")
    with pytest.raises(ValueError, match="cuda_graphs=True and exit compile=True"):
        StaticDepthDecoder(
            m, 2, 8, {"criterion": "kl", "threshold": 0.1, "schedule": "static", "compile": True}, cuda_graphs=True
        )


def test_front_ends_take_the_static_schedule():
    from looplm.cli import _adaptive_args, build_parser
    from looplm.eval.harness import adaptive_options as harness_options

    m = _model("tiny-llama")
    assert harness_options(m, exit="kl:0.1", exit_schedule="static")["exit"].schedule == "static"
    args = build_parser("generate").parse_args(
        ["generate", "--model", "tiny-llama", "--exit", "kl:0.1", "--exit-schedule", "static"]
    )
    assert _adaptive_args(args, m)["exit"].schedule == "static" and not _adaptive_args(args, m)["exit"].compile
    # --compile under the static schedule compiles its pass (not each block)
    args = build_parser("generate").parse_args(
        ["generate", "--model", "tiny-llama", "--exit", "kl:0.1", "--exit-schedule", "static", "--compile"]
    )
    assert _adaptive_args(args, m)["exit"].compile
    assert harness_options(m, exit="kl:0.1", exit_schedule="static", exit_compile="true")["exit"].compile
    assert not harness_options(m, exit="kl:0.1", exit_schedule="static", exit_compile="False")["exit"].compile
    with pytest.raises(ValueError, match="exit_compile must be true or false, got 'maybe'"):
        harness_options(m, exit="kl:0.1", exit_schedule="static", exit_compile="maybe")


@pytest.mark.kernels
@pytest.mark.parametrize("name,ssm", [("tiny-llama", "freeze"), ("tiny-hybrid", "propagate")])
def test_the_fused_cpu_path_runs_the_static_schedule(name, ssm):
    """On a CPU the fused decode step takes each pass (rows ``k_b·B + b`` at their own columns; a masked
    Mamba-2 row view goes to the reference): the reference's tokens, and the depth schedule's, in fp32 and
    bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(name, dtype)
        K = m.config.n_loops
        g = torch.Generator().manual_seed(8)
        ids = torch.randint(0, 250, (4, 5), generator=g)
        ex = _replay(torch.randint(1, K + 1, (4, 8), generator=g), ssm=ssm, schedule="static")
        fused = m.generate(ids, 8, exit=ex)
        assert torch.equal(m.generate(ids, 8, exit={**ex, "schedule": "depth"}), fused)
        with dispatch.reference_only():
            ref = m.generate(ids, 8, exit=ex)
        if dtype == torch.float32:
            assert torch.equal(fused, ref)
        else:
            assert (fused == ref).float().mean() >= 0.9  # bf16: rounding may flip a near tie
