"""Lossless self-speculative decoding (looplm.decode.speculative): greedy == full depth, the rejection sampler's
distribution == full depth's (chi-square), per-row rollback of KV columns and Mamba-2 states."""

import pytest
import torch

import looplm
from looplm.decode.sampling import sampling_probs

from helpers import assert_refused_before_any_work

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name, **kw):
    torch.manual_seed(0)
    return looplm.build(name, **kw).eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2", "tiny-stateloop", "tiny-hybrid", "tiny-coreloop"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculative_equals_greedy_full_depth(name, batch):
    m = _model(name)
    K = m.config.n_loops
    x = torch.randint(0, 260, (batch, 5))
    ref = m.generate(x, 12)
    for r_d in sorted({1, K - 1}):
        out, st = m.generate(x, 12, speculative={"draft_loops": r_d, "k": 3}, return_stats=True)
        assert torch.equal(out, ref), (r_d, out, ref)
        s = st.summary()
        assert s["rounds"] >= 1 and 0 <= s["accepted_per_round"] <= 3
        assert s["draft_ms_per_round"] > 0 and s["verify_ms_per_round"] > 0  # CPU: the phases are timed


def test_greedy_speculative_with_left_padding_and_eos():
    m = _model("tiny-hybrid")
    ids = torch.randint(0, 260, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    ref = m.generate(ids, 10, attention_mask=mask)
    out = m.generate(ids, 10, attention_mask=mask, speculative=1)
    assert torch.equal(out, ref)
    eos = int(ref[0, 9])  # a token row 0 emits: it stops there and pads, as plain decoding does
    ref_e = m.generate(ids, 10, attention_mask=mask, eos_token_id=eos)
    out_e = m.generate(ids, 10, attention_mask=mask, eos_token_id=eos, speculative={"draft_loops": 1, "k": 4})
    assert torch.equal(out_e[:, : ref_e.shape[1]], ref_e) and bool((out_e[:, ref_e.shape[1] :] == eos).all())


def _exact_joint(m, prompt, n, **samp):
    """P(t_1 .. t_n | prompt) at full depth over every continuation in the sampler's support: ``{tuple: p}``."""
    seqs = {(): 1.0}
    for _ in range(n):
        keys = list(seqs)
        x = torch.stack([torch.cat([prompt, torch.tensor(k, dtype=torch.long)]) for k in keys])
        with torch.no_grad():
            p = sampling_probs(m(x).logits[:, -1], **samp)  # [S, V]
        nxt = {}
        for i, key in enumerate(keys):
            for t in p[i].nonzero()[:, 0].tolist():
                nxt[key + (t,)] = seqs[key] * float(p[i, t])
        seqs = nxt
    return seqs


def _chi2_pvalue(samples: torch.Tensor, exact: dict) -> float:
    """The chi-square p-value of the sampled continuations ``[N, n]`` against the exact joint distribution
    (cells expected below 5 folded into one); nothing may fall outside its support."""
    N = samples.shape[0]
    counts = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(exact)  # nothing outside full depth's support
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * N >= 5]
    obs = [counts.get(c, 0) for c in big] + [N - sum(counts.get(c, 0) for c in big)]
    expd = [exact[c] * N for c in big] + [N - sum(exact[c] * N for c in big)]
    if expd[-1] < 5:  # fold a too-small remainder into the last cell
        obs[-2] += obs.pop()
        expd[-2] += expd.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, expd))
    dof = len(obs) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def test_rejection_sampling_matches_full_depth_distribution():
    """6,000 rows sample 3 tokens with a 1-loop draft (k = 2) of a 3-loop model; the joint distribution of
    the tokens passes a chi-square test against the exact full-depth distribution (and the draft alone,
    which differs, fails it: the test can fail)."""
    m = _model("tiny-llama")
    samp = dict(temperature=1.5, top_k=4, top_p=None)
    prompt = torch.randint(0, 260, (4,))
    N = 6000
    g = torch.Generator().manual_seed(1234)
    out, st = m.generate(
        prompt.expand(N, 4),
        3,
        do_sample=True,
        generator=g,
        speculative={"draft_loops": 1, "k": 2},
        return_stats=True,
        **samp,
    )
    acc = st.summary()["acceptance"]
    assert 0.05 < acc < 0.95  # drafts are accepted, and rejected often enough for the resampling to matter
    exact = _exact_joint(m, prompt, 3, **samp)

    assert _chi2_pvalue(out[:, 4:], exact) > 1e-3
    # the draft's own samples (every token from 1 loop) are far from full depth's
    g = torch.Generator().manual_seed(1234)
    draft = m.generate(prompt.expand(N, 4), 3, do_sample=True, generator=g, num_loops=1, **samp)
    keep = [all(tuple(r[:j]) in {c[:j] for c in exact} for j in range(1, 4)) for r in draft[:, 4:].tolist()]
    assert not all(keep) or _chi2_pvalue(draft[:, 4:], exact) < 1e-6


def test_sampling_is_deterministic_with_a_seed():
    m = _model("tiny-mamba2")
    x = torch.randint(0, 260, (4, 3))
    runs = [
        m.generate(x, 8, do_sample=True, top_k=20, generator=torch.Generator().manual_seed(7), speculative=2)
        for _ in range(2)
    ]
    assert torch.equal(*runs)


@pytest.mark.parametrize(
    "loops,spec", [(3, {"draft_loops": 1, "k": 3}), (5, {"draft_loops": 4, "k": 3, "exit": "convergence:0.8"})]
)
def test_rollback_restores_row_lengths_and_ssm_states(loops, spec):
    """After speculative rounds with different acceptance per row, each row's valid KV columns are its
    committed tokens and every Mamba-2 state equals decoding that row's tokens alone at full depth (a fixed
    draft, and a draft at each token's exit: its restarted deeper loops and filled slots)."""
    m = _model("tiny-hybrid", n_loops=loops)
    x = torch.randint(0, 260, (3, 4))
    out, st = m.generate(x, 9, speculative=spec, return_stats=True)
    acc = torch.stack(st.accepted)
    assert len(set(acc.flatten().tolist())) > 1  # rows accepted different numbers
    mask = st.mask
    live = torch.stack(st.live)  # a row done commits nothing more
    committed = 4 + ((acc + 1) * live).sum(0)  # per row: the prompt, then t_0 and the accepted drafts of each round
    assert mask.sum(1).tolist() == committed.tolist()  # the rows' own lengths (rejected columns masked)
    assert torch.equal(committed, 4 + st.emitted - 1)  # the last emitted token is pending (not in the cache yet)
    assert torch.equal(st.tokens[:, : out.shape[1]], out)
    _assert_rows_cached_as_alone(m, st, committed)


def _assert_rows_cached_as_alone(m, st, committed):
    """Every row's Mamba-2 states equal its ``committed[b]`` tokens decoded alone at full depth, and its
    unmasked KV columns hold exactly that row's keys."""
    dec, mask = st.decoder, st.mask
    for b in range(len(committed)):
        ref = m.new_cache(1)
        with torch.no_grad():
            m(st.tokens[b : b + 1, : int(committed[b])], cache=ref)
        for key, s in ref.slots.items():
            mine = dec.cache.slots[key]
            if hasattr(s, "ssm_state"):
                torch.testing.assert_close(mine.ssm_state[b], s.ssm_state[0], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(mine.conv_state[b], s.conv_state[0], atol=2e-5, rtol=1e-4)
                assert mine.snapshots is None
            else:  # the valid columns of the row hold exactly the row's keys
                valid = mask[b, : mine.seqlen].bool()
                torch.testing.assert_close(mine.k[b][:, valid], s.k[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"draft_loops": 3}, r"draft_loops must be an int in \[1, 2\]"),
        ({"draft_loops": 0}, "draft_loops"),
        ({"draft_loops": 1, "k": 0}, "k \\(tokens drafted per round\\)"),
        ({"k": 2}, "give draft_loops"),
        ({"draft_loops": 1, "depth": 2}, "unknown option"),
    ],
)
def test_bad_speculative_options_are_refused_before_any_work(spec, match):
    m = _model("tiny-llama")
    assert_refused_before_any_work(m, lambda: m.generate(torch.randint(0, 260, (1, 3)), 4, speculative=spec), match)
    assert_refused_before_any_work(
        m, lambda: m.generate(torch.randint(0, 260, (1, 3)), 4, speculative=1, exit="kl:1e-3"), "not both"
    )


def test_draft_k_is_bounded_by_the_room_the_model_has():
    """--draft-k 600 on max_seq_len 512 wrote past the model's positions; --draft-k 1000000 ran until killed."""
    m = _model("tiny-llama", max_seq_len=32)
    x = torch.randint(0, 260, (1, 4))
    for k in (600, 10**6, 21):  # room: 32 - 4 - 8 = 20
        assert_refused_before_any_work(
            m,
            lambda: m.generate(x, 8, speculative={"draft_loops": 1, "k": k}),
            rf"k .*= {k} is more than the 20 this call has room for .*draft at most 20",
        )
    assert torch.equal(m.generate(x, 8, speculative={"draft_loops": 1, "k": 20}), m.generate(x, 8))
    # where less room is left, the default 4 still runs (drafts past the end are never emitted)
    assert torch.equal(m.generate(x, 28, speculative=1), m.generate(x, 28))
    assert_refused_before_any_work(
        m, lambda: m.generate(x, 28, speculative={"draft_loops": 1, "k": 5}), "or the default 4"
    )


def test_speculative_on_a_one_loop_model_says_it_needs_two():
    m = _model("tiny-llama", n_loops=1)
    assert_refused_before_any_work(
        m,
        lambda: m.generate(torch.randint(0, 260, (1, 3)), 4, speculative=1),
        r"needs a model with K >= 2 loops.*has K = 1",
    )


# --- a draft whose depth an exit criterion picks (speculative={"exit": ...}) ---------------------------
# convergence at 0.8 on these random-weight models exits tokens at 2-5 of the 5 draft loops: rounds resume
# verification below draft_loops, and rows of a batch draft at different depths


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2", "tiny-stateloop", "tiny-hybrid", "tiny-coreloop"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculative_with_an_exit_draft_equals_greedy_full_depth(name, batch):
    m = _model(name, n_loops=6)
    x = torch.randint(0, 260, (batch, 5))
    ref = m.generate(x, 12)
    for crit in ("convergence:0.8", "kl:0.01"):
        out, st = m.generate(x, 12, speculative={"draft_loops": 5, "k": 3, "exit": crit}, return_stats=True)
        assert torch.equal(out, ref), (crit, out, ref)
        s = st.summary()
        assert s["draft_exit"] == crit and 2 <= s["mean_draft_depth"] <= 5  # kl / convergence: nobody leaves at loop 1
        dep = torch.cat([d.flatten() for d in st.depths])
        if crit.startswith("convergence"):
            assert min(st.starts) < 5  # verification resumed below r_d
            assert batch == 1 or len(set(dep.tolist())) > 1  # rows and tokens drafted at different depths
        # loop passes: every draft's core passes plus verification's k + 1 tokens from its start to K
        verified = sum(4 * (6 - s0) for s0 in st.starts)  # k + 1 = 4 tokens per round from loop s0 to K = 6
        assert int(torch.stack(st.passes).sum()) >= batch * verified


def test_exit_draft_counts_its_passes_and_resumes_at_the_shallowest_draft():
    m = _model("tiny-llama", n_loops=6)
    x = torch.randint(0, 260, (1, 5))
    out, st = m.generate(x, 10, speculative={"draft_loops": 5, "k": 2, "exit": "convergence:0.8"}, return_stats=True)
    for dep, s0, passes in zip(st.depths, st.starts, st.passes):
        assert s0 == int(dep.min())  # the loop verification resumes at: the round's shallowest draft
        assert int(passes[0]) == int(dep.sum()) + 3 * (6 - s0)  # k + 1 = 3 drafts at their depths, 3 verified tokens
    assert st.summary()["mean_verify_start"] == sum(st.starts) / len(st.starts) + 1


def test_gate_exit_draft_keeps_full_depth_output():
    """A draft exiting at the learned gate's q: verification's output is still the rule's own at full depth
    (the decoder does not hand q to the rule's output selection, as exit='gate:q' decoding does)."""
    m = _model("tiny-mamba2", n_loops=5, rule={"name": "exit_gate"})
    with torch.no_grad():
        m.rule.gate.bias.fill_(1.0)  # exits spread over the loops
    x = torch.randint(0, 260, (4, 5))
    ref = m.generate(x, 10)
    out, st = m.generate(x, 10, speculative={"draft_loops": 4, "k": 3, "exit": "gate:0.5"}, return_stats=True)
    assert torch.equal(out, ref)
    assert st.summary()["mean_draft_depth"] < 4


def test_exit_draft_rejection_sampling_matches_full_depth_distribution():
    """The accept / resample rule holds for any draft distribution q: drafted at per-token depths, 3 sampled
    tokens pass the chi-square test against exact full depth."""
    m = _model("tiny-llama", n_loops=4)
    samp = dict(temperature=1.5, top_k=4, top_p=None)
    prompt = torch.randint(0, 260, (4,))
    N = 6000
    g = torch.Generator().manual_seed(99)
    out, st = m.generate(
        prompt.expand(N, 4),
        3,
        do_sample=True,
        generator=g,
        speculative={"draft_loops": 3, "k": 2, "exit": "convergence:0.8"},
        return_stats=True,
        **samp,
    )
    assert len(set(torch.cat([d.flatten() for d in st.depths]).tolist())) > 1
    assert _chi2_pvalue(out[:, 4:], _exact_joint(m, prompt, 3, **samp)) > 1e-3


@pytest.mark.parametrize(
    "exit,match",
    [
        ("replay:2", "give it as draft_loops"),
        ({"criterion": "kl", "kv": "shared"}, "kv policy 'shared'"),
        ({"criterion": "kl", "max_loops": 2}, "leave the exit's max_loops"),
        ({"criterion": "kl", "min_loops": 3}, "min_loops=3 exceeds"),
        ("nope:1", "speculative exit: exit criterion 'nope'"),
        ("kl:-1", "ε must be a finite number"),
        ("gate:0.5", "needs a rule with a learned exit gate"),
        ({"criterion": "kl", "schedule": "depth"}, "token schedule"),
    ],
)
def test_bad_exit_drafts_are_refused_before_any_work(exit, match):
    m = _model("tiny-llama")
    spec = {"draft_loops": 2, "k": 2, "exit": exit}
    assert_refused_before_any_work(m, lambda: m.generate(torch.randint(0, 260, (1, 3)), 4, speculative=spec), match)


# --- reclaiming rejected drafts' cache columns (Speculative.reclaim) --------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
def test_reclaim_keeps_greedy_output_and_gives_columns_back(batch):
    """reclaim=True (the default) and reclaim=False both equal full-depth greedy; reclaiming, the cache holds
    T + max_new + 2(k + 1) columns, batch 1 keeps no hole, and batch 8 compacts (its rows accept differently)."""
    m = _model("tiny-hybrid", n_loops=3)
    x = torch.randint(0, 260, (batch, 4))
    ref = m.generate(x, 24)
    outs = {}
    for rc in (True, False):
        out, st = m.generate(x, 24, speculative={"draft_loops": 1, "k": 4, "reclaim": rc}, return_stats=True)
        assert torch.equal(out, ref), rc
        outs[rc] = st
    on, off = outs[True], outs[False]
    assert on.capacity == 4 + 24 + 10 and off.capacity == 4 + 25 * 5
    assert on.peak_columns <= on.capacity and on.peak_columns < off.peak_columns
    cache, mask = on.decoder.cache, on.mask
    assert mask[:, : cache.seqlen].sum(1).tolist() == (4 + on.emitted - 1).tolist()  # each row's committed tokens
    if batch == 1:
        assert bool(mask[:, : cache.seqlen].all()) and on.compactions == 0
    else:
        assert on.compactions >= 1
        assert cache.seqlen <= int((4 + on.emitted - 1).max()) + 4 * 5  # compacted within a few rounds' holes
    assert on.summary()["loops_per_token"] == pytest.approx(off.summary()["loops_per_token"])


def test_reclaimed_cache_columns_and_states_equal_each_row_decoded_alone():
    """After compactions, each row's unmasked KV columns are its own tokens' keys at full depth and its
    Mamba-2 states equal decoding the row alone (the compaction moved columns, never changed them)."""
    m = _model("tiny-hybrid", n_loops=3)
    x = torch.randint(0, 260, (8, 4))
    out, st = m.generate(x, 24, speculative={"draft_loops": 1, "k": 4}, return_stats=True)
    assert st.compactions >= 1
    _assert_rows_cached_as_alone(m, st, 4 + st.emitted - 1)


def test_keep_columns_of_each_slot_type():
    from looplm.cache import LoopCache, TensorSlot
    from looplm.layers.attention import KVCache

    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 4)  # (value width ≠ key width, as MLA's)
    idx = torch.tensor([[1, 3, 4], [0, 2, 4]])
    for cap, crop in ((None, False), (None, True), (8, False)):
        kv = KVCache(cap)
        kv.update(k, v)
        if crop:
            kv.crop(5)  # a growing cache's buffers are now views that skip a column per head
        kv.keep_columns(idx, 3)
        assert kv.seqlen == 3
        for b in range(2):
            assert torch.equal(kv.k[b], k[b][:, idx[b]]) and torch.equal(kv.v[b], v[b][:, idx[b]])
    ts = TensorSlot(time_dim=1)
    ts.append(torch.arange(10.0).view(2, 5))
    ts.keep_columns(idx, 3)
    assert ts.value.tolist() == [[1.0, 3.0, 4.0], [5.0, 7.0, 9.0]]
    cache = LoopCache(1, 2, capacity=8)
    cache.seqlen = 5
    with pytest.raises(ValueError, match="idx shape"):
        cache.keep_columns(idx[:, :2], 3)
    with pytest.raises(ValueError, match="length 6"):
        cache.keep_columns(None, 6)

    class NoColumns:
        seqlen = 5

        def index_select(self, idx):
            pass

        def crop(self, length):
            pass

    cache.slot("x", NoColumns)
    with pytest.raises(TypeError, match="NoColumns"):
        cache.keep_columns(idx, 3)


def test_bad_reclaim_is_refused_before_any_work():
    m = _model("tiny-llama")
    assert_refused_before_any_work(
        m,
        lambda: m.generate(torch.randint(0, 260, (1, 3)), 4, speculative={"draft_loops": 1, "reclaim": "yes"}),
        "reclaim must be True or False",
    )


def test_a_cache_that_cannot_drop_columns_is_refused_naming_its_slots(monkeypatch):
    """Reclaiming needs every slot's keep_columns: without KVCache's, the call names the slots and the way out
    (reclaim=False), which still decodes like full depth."""
    from looplm.layers.attention import KVCache

    m = _model("tiny-llama")
    ids = torch.randint(0, 260, (2, 5))
    ref = m.generate(ids, 6)
    monkeypatch.delattr(KVCache, "keep_columns")
    with pytest.raises(ValueError, match=r"cache slots \{.*'KVCache'.*\} cannot drop columns.*'reclaim': False"):
        m.generate(ids, 6, speculative={"draft_loops": 1, "k": 2})
    assert torch.equal(m.generate(ids, 6, speculative={"draft_loops": 1, "k": 2, "reclaim": False}), ref)


def test_stops_when_one_row_ends_at_eos_and_another_at_max_new_tokens():
    m = _model("tiny-hybrid")
    ids = torch.randint(0, 260, (2, 5))
    ref = m.generate(ids, 10)
    # a token row 0 emits early and row 1 never does (row 1 runs to max_new_tokens)
    eos = next(t for t in ref[0, 5:10].tolist() if t not in ref[1, 5:].tolist())
    ref_e = m.generate(ids, 10, eos_token_id=eos)
    out_e = m.generate(ids, 10, eos_token_id=eos, speculative={"draft_loops": 1, "k": 4})
    assert torch.equal(out_e, ref_e)
