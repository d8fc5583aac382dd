"""Per-token early exit that skips the work (looplm.decode.token_schedule, looplm.decode.exits): criteria, row subsets, the
KV and SSM policies of skipped loops against hand-written references, counters, and refused options."""

import math

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.decode.token_schedule import AdaptiveDecoder
from looplm.decode.exits import Exit
from looplm.layers.mamba2 import Mamba2Mixer

from helpers import assert_refused_before_any_work

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name, **kw):
    torch.manual_seed(0)
    return looplm.build(name, **kw).eval()


def _gate_model(base="tiny-hybrid", spread=True):
    m = _model(base, n_loops=4, overrides={"rule": {"name": "exit_gate"}})
    if spread:
        with torch.no_grad():
            m.rule.gate.weight.normal_(0, 1.0)  # a spread exit distribution
            m.rule.gate.bias.zero_()
    return m


def _score(model, ids, prompt_len=1, **exit):
    dec = AdaptiveDecoder(model, ids.shape[0], ids.shape[1], exit)
    return dec.score(ids, prompt_len), dec


def _replay(depths, **kw):
    return dict(criterion="replay", depths=depths, **kw)


# ------------------------------------------------------------------------------------------------
# the exit gate's CDF (the fix) and the criterion
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias,q,expected", [(10.0, 1.0, 4), (-20.0, 1e-12, 1), (10.0, 0.5, 1), (-20.0, 1.0, 4)])
def test_gate_selection_is_exact_at_both_ends_under_saturation(bias, q, expected):
    """z(1.0) = R even when 1 − S rounds to 1 early (bias +10); z(q → 0) = 1 even when λ rounds 1 − λ to 1."""
    m = _gate_model(spread=False)
    with torch.no_grad():
        m.rule.gate.weight.zero_()
        m.rule.gate.bias.fill_(bias)
    x = torch.randint(0, 260, (2, 5))
    with torch.no_grad():
        m(x, loop_options={"exit_threshold": q})
    assert torch.all(m.rule.last_exit["selected_depth"] == expected)
    if bias == 10.0:  # the old float32 CDF: 1 − S reaches exactly 1.0 at step 2
        lam = torch.sigmoid(torch.tensor(bias))
        assert float(1 - (1 - lam) ** 2) == 1.0


def test_gate_criterion_with_full_caches_is_output_selection():
    """exit='gate:q' with kv='full' decodes exactly what the full forward selects at q (the paper's
    output selection), and its selected depths are the forward's z(q)."""
    m = _gate_model()
    ids = torch.randint(0, 260, (2, 9))
    q = 0.5
    got, dec = _score(m, ids, prompt_len=3, criterion="gate", threshold=q, kv="full")
    with torch.no_grad():
        ref = m(ids, loop_options={"exit_threshold": q}).logits
    z = m.rule.last_exit["selected_depth"]
    torch.testing.assert_close(got[:, 2:], ref[:, 2:], atol=2e-5, rtol=1e-4)
    assert torch.equal(torch.stack(dec.stats.selected, 1), z[:, 3:])
    assert 1 < float(z[:, 3:].float().mean()) < 4  # the draw spreads the exits
    assert all(bool((e == 4).all()) for e in dec.stats.executed)  # 'full' runs every loop


def test_gate_criterion_skips_loops_and_rows_equal_alone():
    m = _gate_model()
    ids = torch.randint(0, 260, (3, 8))
    got, dec = _score(m, ids, criterion="gate", threshold=0.5, kv="copy", ssm="propagate")
    ex = torch.stack(dec.stats.executed, 1)
    assert torch.equal(ex, torch.stack(dec.stats.selected, 1)) and float(ex.float().mean()) < 4
    for b in range(3):
        alone, _ = _score(m, ids[b : b + 1], criterion="gate", threshold=0.5, kv="copy", ssm="propagate")
        torch.testing.assert_close(alone[0], got[b], atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# criteria off, uniform depth, batches
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid", "tiny-stateloop"])
def test_criteria_off_is_bit_identical_to_todays_decoding(name):
    m = _model(name)
    ids = torch.randint(0, 260, (2, 4))
    plain = m.generate(ids, 6)
    for spec in ("convergence:0", "kl:0"):
        out, stats = m.generate(ids, 6, exit=spec, return_stats=True)  # the adaptive driver, nobody exits
        assert torch.equal(out, plain)
        assert stats.summary()["executed_depth"] == m.config.n_loops
    assert torch.equal(m.generate(ids, 6, exit="convergence:0"), plain)  # off: today's path itself
    # logits, bit for bit, against the cached forward
    full = torch.cat(
        [
            m(ids[:, :3], cache=(c := m.new_cache(2, capacity=4)), logits_to_keep=3).logits,
            m(ids[:, 3:], cache=c).logits,
        ],
        1,
    )
    got, _ = _score(m, ids, prompt_len=3, criterion="convergence", threshold=0.0)
    assert torch.equal(got, full)


def test_gate_at_one_takes_todays_path():
    m = _gate_model()
    ids = torch.randint(0, 260, (2, 4))
    assert Exit.parse("gate:1.0").is_off(m)
    assert torch.equal(m.generate(ids, 5, exit="gate:1.0"), m.generate(ids, 5))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2", "tiny-hybrid", "tiny-stateloop", "tiny-qwen3"])
def test_uniform_exit_equals_fewer_loops(name):
    """Every token exiting at r == num_loops = r: loops <= r never read deeper slots, and the prompt's (full
    depth) entries at loops <= r are the same. (Not with an attention coda, whose prompt entries come from
    the prompt's full-depth output: tiny-coreloop.)"""
    m = _model(name)
    ids = torch.randint(0, 260, (2, 8))
    with torch.no_grad():
        ref = m(ids, num_loops=2).logits
    for kv, ssm in (("copy", "freeze"), ("propagate", "propagate"), ("full", "decay")):
        got, dec = _score(m, ids, prompt_len=3, **_replay(2, kv=kv, ssm=ssm))
        torch.testing.assert_close(got[:, 3:], ref[:, 3:], atol=2e-5, rtol=1e-4)
        assert all(bool((s == 2).all()) for s in dec.stats.selected)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid", "tiny-stateloop"])
@pytest.mark.parametrize(
    "kv,ssm", [("copy", "freeze"), ("propagate", "propagate"), ("shared", "decay"), ("full", "freeze")]
)
def test_batched_exit_equals_each_row_alone_and_ignores_row_order(name, kv, ssm):
    m = _model(name)
    B, T, K = 4, 8, m.config.n_loops
    ids = torch.randint(0, 260, (B, T))
    depths = torch.randint(1, K + 1, (B, T))
    got, dec = _score(m, ids, **_replay(depths, kv=kv, ssm=ssm))
    assert torch.equal(torch.stack(dec.stats.selected, 1), depths[:, : T - 1])
    for b in range(B):
        alone, _ = _score(m, ids[b : b + 1], **_replay(depths[b : b + 1], kv=kv, ssm=ssm))
        torch.testing.assert_close(alone[0], got[b], atol=2e-5, rtol=1e-4)
    perm = torch.tensor([2, 0, 3, 1])
    again, _ = _score(m, ids[perm], **_replay(depths[perm], kv=kv, ssm=ssm))
    torch.testing.assert_close(again, got[perm], atol=1e-6, rtol=1e-5)


def test_left_padded_rows_with_exits_equal_rows_alone():
    m = _model("tiny-hybrid")
    a, b = torch.randint(0, 260, (1, 6)), torch.randint(0, 260, (1, 3))
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 3:], mask[1, 3:] = b[0], 1
    torch.manual_seed(1)
    out = m.generate(
        ids, 5, attention_mask=mask, exit=_replay(torch.tensor([[1, 2, 1, 2, 1], [2, 1, 1, 2, 2]]), kv="copy")
    )
    alone_a = m.generate(a, 5, exit=_replay(torch.tensor([[1, 2, 1, 2, 1]]), kv="copy"))
    alone_b = m.generate(b, 5, exit=_replay(torch.tensor([[2, 1, 1, 2, 2]]), kv="copy"))
    assert torch.equal(out[0, 6:], alone_a[0, 6:]) and torch.equal(out[1, 6:], alone_b[0, 3:])


def test_kl_and_convergence_criteria_exit_and_count_their_checks():
    """kl reads out every loop a row runs (the coda has attention: its own readout slots), convergence
    needs no readout; both skip loops, and a batch equals each row alone."""
    m = _model("tiny-coreloop")
    ids = torch.randint(0, 260, (3, 9))
    heads = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: heads.append(o.shape[0] * o.shape[1]))
    for spec in (dict(criterion="kl", threshold=4e-3), dict(criterion="convergence", threshold=0.9)):
        dec = AdaptiveDecoder(m, 3, 9, spec)
        got = torch.zeros(3, 9, 260)
        got[:, :2] = dec(ids[:, :2], logits_to_keep=2)
        heads.clear()  # from here: one final head per row and call, and the criterion's readouts
        for t in range(2, 9):
            got[:, t] = dec(ids[:, t : t + 1])[:, -1]
        ex = torch.stack(dec.stats.executed)
        assert 2 <= float(ex.float().mean()) < 3  # some tokens exit at loop 2 (a check needs two iterates)
        s = dec.stats
        readout_rows = sum(heads) - 3 * 7
        if spec["criterion"] == "kl":  # one readout per row per loop it ran before the last
            assert readout_rows == int((ex.clamp(max=2)).sum())
            assert s.check_flops > 0
        else:
            assert readout_rows == 0
        for b in range(3):
            alone, _ = _score(m, ids[b : b + 1], prompt_len=2, **spec)
            torch.testing.assert_close(alone[0, 1:], got[b, 1:], atol=2e-5, rtol=1e-4)
    hook.remove()


def test_executed_counters_equal_the_work_that_ran():
    """Rows through the core == Σ executed depths; FLOPs = per-token depths × one core pass + fills + checks."""
    from looplm.decode.exits import stack_flops

    m = _model("tiny-hybrid")
    B, T = 3, 7
    ids = torch.randint(0, 260, (B, T))
    depths = torch.randint(1, 3, (B, T))
    rows = []
    hook = m.core.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    _, dec = _score(m, ids, **_replay(depths, kv="propagate", ssm="propagate"))
    hook.remove()
    s = dec.stats
    decode_rows = rows[m.config.n_loops :]  # after the prompt's full-depth loops
    assert sum(decode_rows) == int(torch.stack(s.executed).sum()) == int(depths[:, : T - 1].sum())
    assert s.batch_loops == [int(d.max()) for d in depths[:, : T - 1].T]
    expect = sum(int(e.sum()) * stack_flops(m.core.stack, t + 2) for t, e in enumerate(s.executed))
    assert s.core_flops == pytest.approx(expect)
    assert s.fill_flops > 0 and s.check_flops == 0  # propagate fills run; replay checks nothing
    summ = s.summary()
    assert summ["executed_depth"] == pytest.approx(float(depths[:, : T - 1].float().mean()))
    assert s.reused_flops == 0  # (replay reads nothing out: every exit runs the head)
    assert summ["flops_per_token"] * summ["tokens"] == pytest.approx(
        s.core_flops + s.fill_flops + s.check_flops + s.other_flops
    )


# ------------------------------------------------------------------------------------------------
# the policies against hand-written references (tiny models, batch 1, token by token)
# ------------------------------------------------------------------------------------------------


def _ref_attention_decode(m, ids, depths, kv):
    """A looped Transformer (no prelude / coda, vanilla rule) decoded by hand: per (loop, layer) key lists
    (kv='shared': one per layer, each loop overwriting the token's entry), softmax attention written out,
    the skipped loops' keys filled as the policy says. Token 0 is the prompt (full depth)."""
    R, blocks = m.config.n_loops, list(m.core.stack.blocks)
    keys, vals, out = {}, {}, []
    for t in range(ids.shape[1]):
        fctx = m.forward_context(ids[:, t : t + 1], None, None, t)
        h = m.embed(ids[:, t : t + 1]) * m.embed_multiplier  # [1, 1, d]
        r = R if t == 0 else int(depths[0, t - 1])

        def kv_of(a, u):
            k = a.k_proj(u).view(1, 1, a.n_kv_heads, a.head_dim).transpose(1, 2)
            v = a.v_proj(u).view(1, 1, a.n_kv_heads, a.head_dim).transpose(1, 2)
            if a.k_norm is not None:
                k = a.k_norm(k)
            cos, sin = fctx.rope_for(a.rotary_dim)
            return looplm.layers.rope.apply_rotary(k, cos, sin), v

        def put(slot, k, v):
            ks, vs = keys.setdefault(slot, []), vals.setdefault(slot, [])
            if len(ks) == t + 1:  # shared: the token's entry is overwritten
                ks[t], vs[t] = k, v
            else:
                ks.append(k)
                vs.append(v)

        for k_loop in range(r):
            for j, blk in enumerate(blocks):
                a, u = blk.mixer, blk.mixer_norm(h)
                q = a.q_proj(u).view(1, 1, a.n_heads, a.head_dim).transpose(1, 2)
                if a.q_norm is not None:
                    q = a.q_norm(q)
                cos, sin = fctx.rope_for(a.rotary_dim)
                q = looplm.layers.rope.apply_rotary(q, cos, sin)
                slot = j if kv == "shared" else (k_loop, j)
                put(slot, *kv_of(a, u))
                K = torch.cat(keys[slot], 2).repeat_interleave(a.n_heads // a.n_kv_heads, 1)  # [1, H, t+1, hd]
                V = torch.cat(vals[slot], 2).repeat_interleave(a.n_heads // a.n_kv_heads, 1)
                w = torch.softmax(q @ K.transpose(-1, -2) / math.sqrt(a.head_dim), -1)
                h = h + a.o_proj((w @ V).transpose(1, 2).reshape(1, 1, -1))
                h = h + blk.mlp(blk.mlp_norm(h))
        for k_loop in range(r, R):  # the loops this token skipped
            for j, blk in enumerate(blocks):
                if kv == "copy":
                    put((k_loop, j), keys[(r - 1, j)][t], vals[(r - 1, j)][t])
                elif kv == "propagate":  # the exit state through the layer's norm and K/V projections
                    put((k_loop, j), *kv_of(blk.mixer, blk.mixer_norm(h)))
        out.append(m.lm_head(m.norm(h))[:, 0])
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])  # GQA + RoPE; QK-norm, tied head
@pytest.mark.parametrize("kv", ["copy", "propagate", "shared"])
def test_kv_policies_against_a_hand_written_reference(name, kv):
    m = _model(name)
    T = 9
    ids = torch.randint(0, 260, (1, T))
    depths = torch.tensor([[1, 3, 2, 1, 1, 3, 2, 1]])
    with torch.no_grad():
        ref = _ref_attention_decode(m, ids, depths, kv)
    got, _ = _score(m, ids, **_replay(depths, kv=kv))
    torch.testing.assert_close(got, ref, atol=3e-5, rtol=1e-4)
    if kv == "shared":  # one buffer per layer: memory ÷ K
        dec = AdaptiveDecoder(m, 1, T, _replay(depths, kv=kv))
        dec.score(ids)
        assert len(dec.cache.physical_slots()) == len(m.core.stack.blocks)


def _ref_mamba_decode(m, ids, depths, ssm):
    """A looped Mamba-2 (Mamba-only blocks, no MLP) decoded by hand, per (loop, layer) states; skipped loops:
    freeze = untouched, propagate = the reference layer's own step on the stand-in (its state only),
    decay = S · exp(Δ·A) written out."""
    R, blocks = m.config.n_loops, list(m.core.stack.blocks)
    states = {(k, j): blk.mixer.new_cache(1) for k in range(R) for j, blk in enumerate(blocks)}
    out = []
    for t in range(ids.shape[1]):
        h = m.embed(ids[:, t : t + 1]) * m.embed_multiplier
        r = R if t == 0 else int(depths[0, t - 1])
        for k in range(r):
            for j, blk in enumerate(blocks):
                h = h + blk.mixer(blk.mixer_norm(h), None, states[(k, j)])
        for k in range(r, R):
            for j, blk in enumerate(blocks):
                st, mix = states[(k, j)], blk.mixer
                u = blk.mixer_norm(h)
                if ssm == "propagate":
                    probe = type(st)(st.conv_state.clone(), st.ssm_state.clone(), st.seqlen_offset)
                    mix._step(u, None, probe)  # the layer's step; keep its state, drop its output
                    st.conv_state, st.ssm_state = probe.conv_state, probe.ssm_state
                elif ssm == "decay":
                    dt = F.softplus(mix.in_proj(u[:, 0])[:, -mix.nheads :].float() + mix.dt_bias.float())  # [1, h]
                    st.ssm_state = st.ssm_state * torch.exp(dt * -torch.exp(mix.A_log.float()))[:, :, None, None]
                st.seqlen_offset += 1
        out.append(m.lm_head(m.norm(h))[:, 0])
    return torch.stack(out, 1), states


@pytest.mark.parametrize("ssm", ["freeze", "propagate", "decay"])
def test_ssm_policies_against_a_hand_written_reference(ssm):
    m = _model("tiny-mamba2")
    T = 9
    ids = torch.randint(0, 260, (1, T))
    depths = torch.tensor([[1, 3, 2, 1, 1, 3, 2, 1]])
    with torch.no_grad():
        ref, states = _ref_mamba_decode(m, ids, depths, ssm)
    got, dec = _score(m, ids, **_replay(depths, ssm=ssm))
    torch.testing.assert_close(got, ref, atol=3e-5, rtol=1e-4)
    for (k, j), st in states.items():
        mine = dec.cache.slots[(k, j)]
        assert mine.seqlen == st.seqlen == T
        torch.testing.assert_close(mine.ssm_state, st.ssm_state, atol=1e-5, rtol=1e-5)


def test_freeze_leaves_the_state_bit_identical_and_propagate_is_the_layers_update():
    m = _model("tiny-hybrid")
    ids = torch.randint(0, 260, (2, 4))
    dec = AdaptiveDecoder(m, 2, 5, _replay(torch.tensor([[1], [2]]), ssm="freeze"))
    dec(ids)
    before = {
        k: (s.conv_state.clone(), s.ssm_state.clone()) for k, s in dec.cache.slots.items() if hasattr(s, "ssm_state")
    }
    dec(torch.randint(0, 260, (2, 1)), validate=False)  # row 0 exits after loop 1: loop 2's states untouched
    for (k, layer), (conv, ssm) in before.items():
        s = dec.cache.slots[(k, layer)]
        same = torch.equal(s.conv_state[0], conv[0]) and torch.equal(s.ssm_state[0], ssm[0])
        assert same == (k == 1), (k, layer)  # frozen in the skipped loop, moved where row 0 ran
        assert not torch.equal(s.ssm_state[1], ssm[1])  # row 1 ran both loops
        assert s.seqlen == 5
    # propagate: the mixer's state after absorb == after its own step on that input (bit for bit)
    mix = Mamba2Mixer(32, d_state=8, headdim=16, ngroups=2)
    st = mix.new_cache(3)
    with torch.no_grad():
        mix(torch.randn(3, 5, 32), None, st)
        u = torch.randn(3, 1, 32)
        a = type(st)(st.conv_state.clone(), st.ssm_state.clone(), st.seqlen_offset)
        b = type(st)(st.conv_state.clone(), st.ssm_state.clone(), st.seqlen_offset)
        mix._step(u, None, a)
        mix.absorb(u, b, "propagate")
    assert torch.equal(a.conv_state, b.conv_state) and torch.equal(a.ssm_state, b.ssm_state) and b.seqlen == 6


# ------------------------------------------------------------------------------------------------
# bad options: refused before any work, naming the option
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"criterion": "gate", "threshold": 0.0}, "threshold q"),
        ({"criterion": "gate", "threshold": 1.5}, "threshold q"),
        ({"criterion": "kl", "threshold": -1e-3}, "threshold ε"),
        ({"criterion": "convergence", "threshold": -0.1}, "threshold ε"),
        ({"criterion": "kl", "threshold": 1e-3, "kv": "cpy"}, "kv policy 'cpy'"),
        ({"criterion": "kl", "threshold": 1e-3, "ssm": "thaw"}, "ssm policy 'thaw'"),
        ({"criterion": "gate", "threshold": 0.5}, "needs a rule with a learned exit gate"),
        ({"criterion": "replay"}, "needs depths"),
        ({"criterion": "replay", "depths": 0}, "depths must be an int >= 1"),
        ({"criterion": "replay", "depths": torch.tensor([1, 2, 3])}, "3 rows, the batch has 2"),
        ({"criterion": "kl", "threshold": 1e-3, "min_loops": 5}, "min_loops=5 exceeds max_loops=3"),
        ({"criterion": "kl", "threshold": 1e-3, "max_loops": 0}, "max_loops must be an int >= 1"),
        ({"criterion": "kl", "tresh": 1e-3}, "unknown option"),
        ("gate:abc", "not a number"),
        ("halt:0.5", "criterion 'halt' is unknown"),
    ],
)
def test_bad_exit_options_are_refused_before_any_work(spec, match):
    m = _model("tiny-llama")
    assert_refused_before_any_work(m, lambda: m.generate(torch.randint(0, 260, (2, 3)), 4, exit=spec), match)


def test_a_policy_the_model_cannot_support_is_refused_naming_it():
    m = _model("tiny-stateloop", overrides={"rule.options.mixer": "attention", "rule.options.mixer_head_dim": 16})
    with pytest.raises(ValueError, match="kv policy 'propagate' cannot fill the rule 'stateloop'"):
        m.generate(torch.randint(0, 260, (1, 3)), 2, exit={"criterion": "kl", "threshold": 1e-3, "kv": "propagate"})
    out = m.generate(
        torch.randint(0, 260, (2, 3)), 3, exit={"criterion": "replay", "depths": 2, "kv": "copy"}
    )  # copy fills it
    assert out.shape == (2, 6)
    mm = _model(
        "tiny-stateloop",
        overrides={
            "rule.options.mixer": "mamba2",
            "rule.options.mamba_headdim": 16,
            "rule.options.mamba_d_state": 8,
            "rule.options.mamba_ngroups": 2,
        },
    )
    with pytest.raises(ValueError, match="ssm policy 'decay' cannot fill the rule 'stateloop'"):
        mm.generate(torch.randint(0, 260, (1, 3)), 2, exit={"criterion": "replay", "depths": 2, "ssm": "decay"})


def test_sampling_with_exits_is_deterministic_with_a_seed():
    m = _model("tiny-hybrid")
    x = torch.randint(0, 260, (3, 4))
    runs = [
        m.generate(
            x,
            8,
            do_sample=True,
            top_k=20,
            generator=torch.Generator().manual_seed(3),
            exit={"criterion": "convergence", "threshold": 0.9, "kv": "propagate"},
        )
        for _ in range(2)
    ]
    assert torch.equal(*runs)


@pytest.mark.parametrize("preset", ["ouro-1.4b", "huginn-0125"])
def test_public_model_rules_exit_per_token_and_speculate(preset):
    """Ouro (the exit gate reading the final norm, sandwich blocks) and Huginn (random initial state,
    post-sum blocks, 32 loops) at toy widths: a batch with exits equals each row alone, and greedy
    self-speculative decoding equals full depth."""
    from helpers import tiny_variant

    torch.manual_seed(0)
    m = looplm.build(tiny_variant(preset)).eval()
    K = m.config.n_loops
    ids = torch.randint(0, 128, (3, 7))
    depths = torch.randint(1, K + 1, (3, 7))
    for kv in ("copy", "propagate"):
        got, _ = _score(m, ids, **_replay(depths, kv=kv))
        for b in range(3):
            alone, _ = _score(m, ids[b : b + 1], **_replay(depths[b : b + 1], kv=kv))
            torch.testing.assert_close(alone[0], got[b], atol=3e-5, rtol=1e-4)
    x = torch.randint(0, 128, (2, 4))
    assert torch.equal(m.generate(x, 6, speculative={"draft_loops": K // 2, "k": 3}), m.generate(x, 6))
