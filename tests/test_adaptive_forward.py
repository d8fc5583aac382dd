"""Per-token exit in one parallel forward (looplm.decode.exit_forward) against token-by-token teacher forcing
with the same exits (AdaptiveDecoder.score): every criterion, KV policy, backbone and rule; padding, row
order, the criteria switched off, uniform depths, the statistics, and refused options."""

import pytest
import torch

import looplm
from looplm.decode.token_schedule import AdaptiveDecoder
from looplm.decode.exit_forward import adaptive_forward
from looplm.config import list_presets
from looplm.decode.exits import ConvergenceCriterion, Exit, KLCriterion, forward_support
from looplm.recurrence.base import RULES

from helpers import assert_refused_before_any_work, tiny_variant

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name, loops=5, **kw):
    torch.manual_seed(0)
    return looplm.build(name, n_loops=loops, **kw).eval()


def _sequential(model, ids, exit):
    """Teacher forcing with the decoder: position 0 as the prompt (full depth), then one token at a time.
    Returns ``(logits [B, T, V] from position 0 on, depths [B, T − 1] of positions 1 ..)``."""
    ex = dict(exit)
    if isinstance(ex.get("depths"), torch.Tensor) and ex["depths"].dim() == 2:
        ex["depths"] = ex["depths"][:, 1:]  # the decoder indexes decoded tokens; the forward, positions
    dec = AdaptiveDecoder(model, ids.shape[0], ids.shape[1], ex)
    logits = dec.score(ids, 1)
    return logits, torch.stack(dec.stats.selected, 1)


class _Margins:
    """The closest any criterion distance came to its threshold, relative to it (``distance`` of the
    successive criteria wrapped): a value within float noise of ε can fall on either side in two drivers whose
    products have other shapes (seen on an AMD EPYC: KL 3e-5·ε from ε, an exit one loop apart)."""

    def __init__(self, monkeypatch):
        self.closest = float("inf")
        for cls in (KLCriterion, ConvergenceCriterion):
            monkeypatch.setattr(cls, "distance", self._wrap(cls.distance))

    def _wrap(self, fn):
        def distance(crit, prev, cur):
            d = fn(crit, prev, cur)
            if d.numel() and crit.threshold:
                self.closest = min(self.closest, float(((d.double() - crit.threshold).abs() / crit.threshold).min()))
            return d

        return distance


@pytest.fixture
def margins(monkeypatch):
    return _Margins(monkeypatch)


TIE = 1e-3  # |distance − ε| <= TIE · ε: a tie (fp32 KL of distributions 1e-3 apart carries ~1e-7 absolute noise)


def _assert_matches_sequential(model, ids, exit, margins: _Margins | None = None):
    """The same exits and logits as token-by-token teacher forcing. With ``margins``, a row whose exits differ
    is accepted only where some distance lay within :data:`TIE` of ε (a float tie), and the rows whose exits
    agree are still compared."""
    out = adaptive_forward(model, ids, exit, full_depth_prefix=1)
    ref, depths = _sequential(model, ids, exit)
    same = (out.depth[:, 1:] == depths).all(1)  # [B]
    if margins is None or bool(same.all()):
        assert torch.equal(out.depth[:, 1:], depths)
    else:
        assert margins.closest <= TIE, (
            f"exits differ in rows {(~same).nonzero().flatten().tolist()} without a tie (closest {margins.closest:.2e} ε)"
        )
        assert bool(same.any()), "every row's exits differ"
        out.logits, ref = out.logits[same], ref[same]
    torch.testing.assert_close(out.logits[:, 1:].float(), ref[:, 1:], atol=2e-6, rtol=0)
    assert torch.all(out.depth[:, 0] == out.stats["max_loops"])  # the full-depth prefix
    return out


# models with codas that readouts run through at every loop: the kl check's (a Mamba-2 coda; two attention coda
# layers, so that a propagate fill differs from the readout's own keys and values past the first) and a rule's own
_VARIANTS = {
    "hybrid-coda": ("tiny-hybrid", {"n_prelude": 1, "n_coda": 1}),
    "coreloop-coda2": ("tiny-coreloop", {"n_coda": 2}),
    "ponder-coda2": ("tiny-coreloop", {"n_coda": 2, "rule": {"name": "ponderlm"}}),
}  # PonderLM reads out in step


def _build(name):
    return _model(_VARIANTS[name][0], overrides=_VARIANTS[name][1]) if name in _VARIANTS else _model(name)


@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-qwen3", "tiny-hybrid", "tiny-mamba2", "tiny-coreloop", "hybrid-coda", "coreloop-coda2"]
)
@pytest.mark.parametrize("kv", ["copy", "propagate", "full"])
def test_kl_exit_equals_token_by_token_decoding(name, kv, margins):
    """Loop-major (every looping position of the text at once) equals token-major (the decoder, teacher
    forced): the same exits, the same logits — the fills of skipped loops included (GQA / QK-norm, hybrid and
    Mamba-2 cores, whose scans run over the looping tokens only; attention and Mamba-2 codas, through which
    the check reads every loop out, packed and filled as the core)."""
    m = _build(name)
    ids = torch.randint(0, m.config.vocab_size, (3, 12))
    out = _assert_matches_sequential(m, ids, {"criterion": "kl", "threshold": 0.003, "kv": kv}, margins)
    assert 1 < len(out.depth.unique()), "the exits must spread over several depths for the fills to matter"


@pytest.mark.parametrize("kv", ["copy", "propagate"])
def test_a_rules_own_readout_through_the_coda_equals_token_by_token_decoding(kv):
    """PonderLM reads every iterate out in its step (``lctx.readout``: coda, norm, head); with coda layers that
    readout attends to the earlier tokens' readouts of the same loop — run over the loop's pack with buffers of
    its own and filled as decoding fills its per-loop ``readout`` slots (per-position depths: exits spread)."""
    m = _build("ponder-coda2")
    ids = torch.randint(0, m.config.vocab_size, (3, 10))
    depths = torch.randint(1, 6, (3, 10), generator=torch.Generator().manual_seed(3))
    _assert_matches_sequential(m, ids, {"criterion": "replay", "depths": depths, "kv": kv})


def test_the_policies_change_what_later_tokens_read():
    """copy, propagate and full fill the skipped loops differently, so the logits differ (each matches its own
    token-by-token reference in the test above)."""
    m = _model("tiny-qwen3", loops=6)
    ids = torch.randint(0, m.config.vocab_size, (3, 16))
    out = {
        kv: adaptive_forward(m, ids, {"criterion": "kl", "threshold": 0.002, "kv": kv})
        for kv in ("copy", "propagate", "full")
    }
    for a, b in (("copy", "propagate"), ("copy", "full"), ("propagate", "full")):
        assert (out[a].logits - out[b].logits).abs().max() > 1e-3, (a, b)


@pytest.mark.parametrize(
    "exit",
    [
        {"criterion": "convergence", "threshold": 0.5, "kv": "copy"},
        {"criterion": "replay", "depths": "per-position", "kv": "propagate"},
    ],
)
def test_convergence_and_replay_equal_token_by_token_decoding(exit, margins):
    m = _model("tiny-coreloop")  # prelude and coda layers: once over the text, around the per-token loops
    ids = torch.randint(0, m.config.vocab_size, (2, 10))
    if exit.get("depths") == "per-position":
        exit = {**exit, "depths": torch.randint(1, 6, (2, 10), generator=torch.Generator().manual_seed(1))}
    out = _assert_matches_sequential(m, ids, exit, margins)
    if exit["criterion"] == "replay":
        assert torch.equal(out.depth[:, 1:], exit["depths"][:, 1:])


def test_gate_exit_equals_token_by_token_decoding():
    m = _model("tiny-llama", overrides={"rule": {"name": "exit_gate"}})
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)  # a spread exit distribution
        m.rule.gate.bias.zero_()
    ids = torch.randint(0, m.config.vocab_size, (3, 10))
    for kv in ("copy", "full"):
        _assert_matches_sequential(m, ids, {"criterion": "gate", "threshold": 0.5, "kv": kv})


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_equals_token_by_token_decoding(rule, margins):
    """The driver calls the rule's hooks on tokens as rows ``[n, 1, d]`` and never asks which rule it holds:
    every registered rule gives the decoder's exits and logits (kl, copy; per-position replay, propagate where
    the rule does not modulate its blocks per loop)."""
    m = _model("tiny-llama", overrides={"rule": {"name": rule}})
    ids = torch.randint(0, m.config.vocab_size, (2, 9))
    _assert_matches_sequential(m, ids, {"criterion": "kl", "threshold": 0.003, "kv": "copy"}, margins)
    kv = "copy" if rule == "timestep" else "propagate"
    _assert_matches_sequential(m, ids, {"criterion": "replay", "depths": torch.randint(1, 6, (2, 9)), "kv": kv})


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_criteria_off_and_uniform_depth_are_the_plain_forward(name, dtype):
    """ε = 0 (and the gate's q = 1) runs every loop: the plain forward's logits, padded or not (bf16 bit for
    bit; fp32 to its rounding — the packed products have other shapes, and on some CPUs, e.g. an AMD EPYC,
    other summation orders: 1.5e-7 apart); a uniform replay depth r is ``num_loops = r``."""
    same = (
        torch.testing.assert_close
        if dtype == torch.float32
        else lambda a, b, **_: torch.equal(a, b) or pytest.fail("not bit-equal")
    )
    m = _model(name).to(dtype)
    ids = torch.randint(0, m.config.vocab_size, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        same(adaptive_forward(m, ids, "kl:0").logits, m(ids).logits, atol=1e-6, rtol=0)
        same(
            adaptive_forward(m, ids, "convergence:0", attention_mask=mask).logits[mask.bool()],
            m(ids, attention_mask=mask).logits[mask.bool()],
            atol=1e-6,
            rtol=0,
        )
        for r in (1, 3):
            out = adaptive_forward(m, ids, f"replay:{r}")
            torch.testing.assert_close(
                out.logits, m(ids, num_loops=r).logits, atol=1e-6 if dtype == torch.float32 else 0, rtol=0
            )
            assert out.stats["executed_depth"] == r and out.stats["computed_ratio"] == r / 5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2"])
def test_padding_and_row_order_do_not_change_a_row(name):
    """A left- or right-padded row gives, on its real tokens, the exits and logits of the row alone; permuting
    the rows permutes the outputs."""
    m = _model(name)
    ids = torch.randint(0, m.config.vocab_size, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 9:] = 0
    out = adaptive_forward(m, ids, "kl:0.003", attention_mask=mask)
    for b, sl in ((1, slice(5, 12)), (2, slice(0, 9))):
        alone = adaptive_forward(m, ids[b : b + 1, sl], "kl:0.003")
        assert torch.equal(out.depth[b, sl], alone.depth[0])
        torch.testing.assert_close(out.logits[b, sl], alone.logits[0], atol=1e-6, rtol=0)
    assert out.stats["tokens"] == int(mask.sum())
    perm = torch.tensor([2, 0, 1])
    a, b = adaptive_forward(m, ids, "kl:0.003"), adaptive_forward(m, ids[perm], "kl:0.003")
    assert torch.equal(a.depth[perm], b.depth)
    torch.testing.assert_close(a.logits[perm], b.logits, atol=1e-6, rtol=0)


def test_statistics_count_the_exits_and_the_packs():
    m = _model("tiny-llama")
    ids = torch.randint(0, m.config.vocab_size, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = 0
    out = adaptive_forward(m, ids, "kl:0.003", attention_mask=mask)
    real = mask.bool()
    d = out.depth[real].double()
    st = out.stats
    assert st["tokens"] == int(real.sum()) and st["max_loops"] == 5
    assert st["selected_depth"] == pytest.approx(float(d.mean())) == pytest.approx(st["executed_depth"])
    assert st["executed_ratio"] == pytest.approx(float(d.mean()) / 5)
    # the core ran B · T_a(k) positions at loop k: the deepest row's looping count, padding included
    per_loop = [max(int(((out.depth[b] > k) & real[b]).sum() if k else 12) for b in range(3)) for k in range(5)]
    assert st["computed_ratio"] == pytest.approx(3 * sum(per_loop) / (5 * 36))
    assert st["executed_ratio"] <= st["computed_ratio"] <= 1
    assert 0 < st["core_flops_ratio"] < 1 and st["check_flops_per_token"] > 0 and st["fill_flops_per_token"] == 0
    prop = adaptive_forward(m, ids, {"criterion": "kl", "threshold": 0.003, "kv": "propagate"}, attention_mask=mask)
    assert prop.stats["fill_flops_per_token"] > 0
    full = adaptive_forward(m, ids, {"criterion": "kl", "threshold": 0.003, "kv": "full"}, attention_mask=mask)
    assert torch.all(full.executed == 5) and full.stats["executed_ratio"] == 1 and torch.equal(full.depth, out.depth)


@pytest.mark.parametrize(
    "name,exit,match",
    [
        ("tiny-llama", {"criterion": "kl", "threshold": 0.01, "kv": "shared"}, "kv policy 'shared'"),
        ("tiny-llama", "kl:0.01", "no sliding-window band"),
        ("tiny-mamba2", {"criterion": "kl", "threshold": 0.01, "ssm": "propagate"}, "ssm policy 'propagate'"),
        ("tiny-llama", {"criterion": "kl", "threshold": -1.0}, "threshold ε must be"),
        (
            "tiny-llama",
            {"criterion": "replay", "depths": torch.ones(3, 4, dtype=torch.long)},
            "depths give 4 positions per row",
        ),
    ],
)
def test_bad_options_are_refused_before_any_work(name, exit, match):
    kw = (
        {"overrides": {"attention.sliding_window": 4, "attention.sliding_layer_idx": [1]}}
        if match == "no sliding-window band"
        else {}
    )
    m = _model(name, **kw)
    ids = torch.randint(0, m.config.vocab_size, (3, 8))
    assert_refused_before_any_work(m, lambda: adaptive_forward(m, ids, exit), match)


def test_propagate_is_refused_for_rules_that_modulate_their_blocks_and_bad_prefix():
    m = _model("tiny-llama", overrides={"rule": {"name": "timestep"}})
    ids = torch.randint(0, m.config.vocab_size, (2, 6))
    assert_refused_before_any_work(
        m,
        lambda: adaptive_forward(m, ids, {"criterion": "kl", "threshold": 0.1, "kv": "propagate"}),
        "modulates its blocks per loop",
    )
    assert_refused_before_any_work(
        m, lambda: adaptive_forward(m, ids, "kl:0.1", full_depth_prefix=7), "full_depth_prefix"
    )


# ------------------------------------------------------------------------------------------------
# the prompt at adaptive depth: Exit(prefill='exit') in the decoders
# ------------------------------------------------------------------------------------------------


def _decode_prompt_token_by_token(model, ids, new, exit):
    """The reference: the prompt's first token (full depth), its other tokens one at a time (teacher forcing,
    their exits as decoding takes them), then ``new`` greedy tokens. Returns ``(tokens [B, new], decoder)``."""
    B, P = ids.shape
    dec = AdaptiveDecoder(model, B, P + new, exit)
    logits = dec(ids[:, :1])
    for t in range(1, P):
        logits = dec(ids[:, t : t + 1], validate=False)
    return _greedy(dec, logits, new), dec


def _greedy(dec, logits, new):
    out, tok = [], logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new):
        out.append(tok)
        tok = dec(tok, validate=False)[:, -1].argmax(-1, keepdim=True)
    dec.flush()
    return torch.cat(out, 1)


def _slot_diff(a, b) -> float:
    """The largest difference between two caches' slots (every loop's keys and values, Mamba-2 states)."""
    worst = 0.0
    for key, s in a.slots.items():
        t = b.slots[key]
        if getattr(s, "_k", None) is not None:
            L = s.seqlen
            worst = max(
                worst,
                float((s._k[:, :, :L] - t._k[:, :, :L]).abs().max()),
                float((s._v[:, :, :L] - t._v[:, :, :L]).abs().max()),
            )
        elif hasattr(s, "ssm_state"):
            worst = max(
                worst, float((s.ssm_state - t.ssm_state).abs().max()), float((s.conv_state - t.conv_state).abs().max())
            )
            assert s.seqlen_offset == t.seqlen_offset
    return worst


@pytest.mark.parametrize(
    "name",
    ["tiny-llama", "tiny-hybrid", "tiny-mamba2", "tiny-coreloop", "hybrid-coda", "coreloop-coda2", "ponder-coda2"],
)
@pytest.mark.parametrize("kv", ["copy", "propagate"])
def test_prefill_exit_leaves_the_caches_of_decoding_the_prompt_token_by_token(name, kv):
    """``prefill='exit'``: the prompt in one forward leaves every loop's slots (keys and values with the fills of
    the loops its tokens skipped, Mamba-2 states that absorbed the tokens that ran each loop, the kl check's coda
    slots of every loop) as decoding it token by token after its first token does, so the generation that
    follows is the same."""
    m = _build(name)
    ids = torch.randint(0, m.config.vocab_size, (3, 10))
    exit = Exit.parse("kl:0.003").with_policies(kv=kv)
    ref, rdec = _decode_prompt_token_by_token(m, ids, 6, exit)
    dec = AdaptiveDecoder(m, 3, 16, exit.with_policies(prefill="exit"))
    got = _greedy(dec, dec(ids), 6)
    assert torch.equal(got, ref)
    assert _slot_diff(rdec.cache, dec.cache) < 2e-6
    pre = dec.stats.summary()["prefill"]
    assert pre["tokens"] == 30 and 1 < pre["selected_depth"] < 5  # the prompt's own exits
    rd = torch.stack(rdec.stats.selected[:9], 1).double()  # the reference's exits of prompt tokens 1 ..
    assert pre["selected_depth"] == pytest.approx(float((rd.sum() + 3 * 5) / 30))  # (+ token 0 at full depth)


@pytest.mark.parametrize("schedule", ["token", "depth", "static"])
def test_generate_with_prefill_exit_in_every_schedule(schedule):
    """``generate(..., exit=Exit(prefill='exit'))`` under each batch schedule gives the tokens of the prompt
    decoded token by token, then the generation (the schedules are exact among themselves)."""
    m = _model("tiny-llama")
    ids = torch.randint(0, m.config.vocab_size, (3, 10))
    exit = Exit.parse("kl:0.003")
    ref, _ = _decode_prompt_token_by_token(m, ids, 6, exit)
    out, stats = m.generate(ids, 6, exit=exit.with_policies(prefill="exit", schedule=schedule), return_stats=True)
    assert torch.equal(out[:, 10:], ref)
    assert stats.summary()["prefill"]["tokens"] == 30


def test_prefill_exit_options_are_refused_before_any_work():
    m = _model("tiny-llama")
    ids = torch.randint(0, m.config.vocab_size, (2, 6))
    for exit, match in (
        (Exit(criterion="kl", threshold=0.1, kv="shared", prefill="exit"), "prefill='exit': kv policy 'shared'"),
        (
            Exit(criterion="replay", depths=torch.ones(2, 4, dtype=torch.long), prefill="exit"),
            "per-token replay depths",
        ),
        (Exit(criterion="kl", threshold=0.1, prefill="all"), "exit prefill 'all' is unknown"),
    ):
        assert_refused_before_any_work(m, lambda: m.generate(ids, 4, exit=exit), match)


def test_the_front_ends_pass_the_prefill_option(capsys):
    """``looplm generate --exit-prefill exit`` (its statistics with the prompt's exits on stderr), the lm-eval
    model's ``exit_prefill``, and ``adaptive_options`` without an exit refusing it."""
    import json

    from looplm.cli import build_parser, main
    from looplm.eval.harness import adaptive_options as harness_options
    from looplm.decode.generate import adaptive_options

    m = _model("tiny-llama")
    assert harness_options(m, exit="kl:0.1", exit_prefill="exit")["exit"].prefill == "exit"
    with pytest.raises(ValueError, match="options of --exit"):
        adaptive_options(m, prefill="exit")
    args = build_parser("generate").parse_args(
        ["generate", "--model", "tiny-llama", "--exit", "kl:0.1", "--exit-prefill", "exit"]
    )
    assert args.exit_prefill == "exit"
    assert (
        main(
            [
                "generate",
                "--model",
                "tiny-llama",
                "--prompt",
                "Once upon a time",
                "--max-new-tokens",
                "4",
                "--exit",
                "kl:0.003",
                "--exit-prefill",
                "exit",
                "--stats",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (
        stats["prefill"]["tokens"] == len("Once upon a time") and stats["prefill"]["max_loops"] == 3
    )  # (the preset's K)


def test_prefill_exit_with_request_refill_counts_every_prompt():
    """Under request refill (``max_batch``) each prompt that takes a row is prefilled with the exits; the
    statistics hold every prompt's tokens, and each row's tokens are those of the prompt decoded alone."""
    m = _model("tiny-llama")
    ids = torch.randint(0, m.config.vocab_size, (3, 10))
    exit = Exit(criterion="kl", threshold=0.003, schedule="depth", prefill="exit", max_batch=2)
    out, stats = m.generate(ids, 6, exit=exit, return_stats=True)
    assert stats.summary()["prefill"]["tokens"] == 30
    for b in range(3):
        ref, _ = _decode_prompt_token_by_token(m, ids[b : b + 1], 6, Exit.parse("kl:0.003"))
        assert torch.equal(out[b : b + 1, 10:], ref)


_PRESETS = [n for n in list_presets() if not n.startswith("tiny")]


@pytest.mark.parametrize("preset", _PRESETS)
def test_every_real_preset_equals_token_by_token_decoding_or_is_refused(preset):
    """Each real preset at toy widths (Huginn's prelude / core / coda, Ouro, CoreLoop, StateLoop, Looped Mamba,
    hybrids): the kl exit in one forward equals decoding the text token by token, or is refused before any work
    with the reason (StateLoop's state mixers, pause tokens)."""
    torch.manual_seed(0)
    m = looplm.build(tiny_variant(preset)).eval()
    ids = torch.randint(0, m.config.vocab_size, (2, 8))
    exit = {"criterion": "kl", "threshold": 0.003}
    try:
        refused = forward_support(m, Exit.parse(exit).resolved(m, 2))
    except ValueError as e:  # what no per-token exit runs (pause-token models)
        refused = [str(e)]
    if refused:
        assert_refused_before_any_work(m, lambda: adaptive_forward(m, ids, exit), "exit: ")
        assert preset in _REFUSED, (preset, refused)
        return
    out = adaptive_forward(m, ids, exit, full_depth_prefix=1)
    ref, depths = _sequential(m, ids, exit)
    assert torch.equal(out.depth[:, 1:], depths)
    torch.testing.assert_close(out.logits[:, 1:].float(), ref[:, 1:], atol=2e-5, rtol=0)  # (Ouro: 6e-6)


_REFUSED = {"stateloop-1.4b-attn", "stateloop-1.4b-mamba2", "stateloop-1.4b-pause"}  # state mixers; pause tokens
