"""StateLoop state interventions (§5): exact Shapley values of read masking, calibrated replacement and
freezing (eq. 15), and ``looplm analyze`` — on hand-built cases whose answers are known."""

import itertools
import json
import math

import pytest
import torch

import looplm
from looplm.analysis import ANALYSES, load_all
from looplm.analysis.interventions import (
    calibrate,
    channel_stats,
    mean_nll,
    read_masking,
    replace_and_freeze,
    shapley_values,
)
from looplm.cli import main


def _model(name="tiny-stateloop", seed=0, **over):
    torch.manual_seed(seed)
    m = looplm.build(name, **over).eval()
    with torch.no_grad():  # gates off their initial values, so every read and state matters
        m.rule.update.W_delta.weight.normal_(0, 0.3)
    return m


def _batches(n=2, B=2, T=16, V=260, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# Shapley values
# ------------------------------------------------------------------------------------------------


def test_shapley_values_of_a_known_game():
    # v(M) = Σ_{i∈M} a_i + b·[0 ∈ M and 1 ∈ M] + c: the interaction b is split evenly between 0 and 1
    a, b, c = [0.5, -1.0, 2.0, 0.0], 3.0, 7.0
    v = lambda M: sum(a[i] for i in M) + (b if {0, 1} <= M else 0.0) + c  # noqa: E731
    phi = shapley_values(v, 4)
    assert phi == pytest.approx([0.5 + 1.5, -1.0 + 1.5, 2.0, 0.0])
    assert sum(phi) == pytest.approx(v(frozenset(range(4))) - v(frozenset()))  # efficiency
    # symmetric players get equal values; a game on one player gives it everything
    assert shapley_values(lambda M: float(len(M) ** 2), 3) == pytest.approx([3.0, 3.0, 3.0])
    assert shapley_values(lambda M: 5.0 if M else 0.0, 1) == [5.0]


def test_shapley_evaluates_every_subset_once():
    seen = []
    shapley_values(lambda M: seen.append(M) or 0.0, 3)
    assert sorted(map(sorted, seen)) == sorted(
        map(sorted, (frozenset(c) for m in range(4) for c in itertools.combinations(range(3), m)))
    )


def test_terminal_read_only_gets_the_whole_share():
    model = _model(n_loops=3)
    with torch.no_grad():
        model.rule.W_sz.weight.zero_()  # feedback reads carry nothing: the loss depends on R_K only
    res = read_masking(model, _batches(1), loops=3)
    assert res["shares"] == pytest.approx([0, 0, 1], abs=1e-9)
    assert res["terminal_share"] == pytest.approx(1.0) and res["feedback_share"] == pytest.approx(0.0, abs=1e-9)
    assert res["kinds"] == ["feedback"] * 2 + ["terminal"] and len(res["subset_nll_increase"]) == 2**3 - 1
    assert sum(res["shapley"]) == pytest.approx(res["all_masked_nll_increase"])  # efficiency on the model


def test_single_feedback_read_gets_the_whole_share():
    model = _model(n_loops=2)
    with torch.no_grad():
        model.rule.W_out.weight.zero_()  # K = 2 and no terminal read: the loss depends on R_1 only
    res = read_masking(model, _batches(1), loops=2)
    assert res["shares"] == pytest.approx([1, 0], abs=1e-9)
    assert res["all_masked_nll_increase"] != 0


def test_masking_a_read_is_zeroing_its_projection():
    model = _model(n_loops=3)
    batches = _batches(1)
    res = read_masking(model, batches, loops=3)
    with torch.no_grad():
        model.rule.W_out.weight.zero_()
    assert res["baseline_nll"] + res["subset_nll_increase"]["001"] == pytest.approx(
        mean_nll(model, batches, 3), rel=1e-6
    )
    assert res["shares"][0] is not None and sum(res["shares"]) == pytest.approx(1.0)


def test_read_masking_needs_a_state_reading_rule():
    with pytest.raises(ValueError, match="read_scale.*rule 'stateloop-state-only'"):
        read_masking(
            looplm.build(
                "stateloop-410m-k7-state-only",
                d_model=32,
                vocab_size=260,
                n_core=1,
                d_ff=32,
                overrides={"attention.n_heads": 2},
            ),
            _batches(1),
            loops=3,
        )


# ------------------------------------------------------------------------------------------------
# calibrated replacement and freezing (eq. 15)
# ------------------------------------------------------------------------------------------------


def test_channel_stats_and_calibration_map_moments():
    model = _model()
    calib = _batches(2, seed=3)
    stats = channel_stats(model, calib, loops=4)
    assert sorted(stats) == [1, 2, 3, 4]
    states = {}
    for x in calib:
        model(x, loop_options={"state_hook": lambda j, S: states.setdefault(j, []).append(S) or S})
    S2 = torch.cat([s.flatten(0, 1) for s in states[2]])  # [N, d_s]
    torch.testing.assert_close(stats[2][0], S2.mean(0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats[2][1], S2.std(0, unbiased=False), atol=1e-5, rtol=1e-4)
    # Ŝ^{2→4} over the calibration tokens has boundary 4's channel means and (up to ε) its std
    S_hat = calibrate(S2, stats[2], stats[4])
    torch.testing.assert_close(S_hat.mean(0), stats[4][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        S_hat.std(0, unbiased=False), stats[4][1] * stats[2][1] / (stats[2][1] + 1e-6), atol=1e-5, rtol=1e-4
    )
    # calibrating a boundary to itself is (up to ε) the identity
    torch.testing.assert_close(calibrate(S2, stats[2], stats[2]), S2, atol=1e-4, rtol=1e-4)


def test_interventions_on_an_unread_state_change_nothing():
    model = _model()
    with torch.no_grad():
        model.rule.W_sz.weight.zero_()
        model.rule.W_out.weight.zero_()
    res = replace_and_freeze(model, _batches(1), _batches(1, seed=5), loops=4)
    assert [e["source"] for e in res["replace"]] == [1, 2, 3] and res["freeze"][0]["targets"] == [2, 3, 4]
    for e in res["replace"] + res["freeze"]:
        assert e["nll_increase"] == pytest.approx(0.0, abs=1e-9)


def test_replacement_and_freezing_on_a_read_state():
    model = _model()
    res = replace_and_freeze(model, _batches(1), _batches(1, seed=5), loops=4)
    rep, frz = res["replace"], res["freeze"]
    # both touch only S^K when the source is K−1: the same intervention
    assert rep[-1]["nll"] == pytest.approx(frz[-1]["nll"], rel=1e-9)
    # freezing at S^1 replaces three states, replacing only one: both move the loss, differently
    assert abs(frz[0]["nll_increase"]) > 1e-5 and abs(rep[0]["nll_increase"]) > 1e-5
    assert frz[0]["nll"] != pytest.approx(rep[0]["nll"], rel=1e-6)
    assert math.isclose(res["baseline_ppl"], math.exp(res["baseline_nll"]))


def test_state_only_rule_supports_replacement():
    torch.manual_seed(0)
    model = looplm.build(
        "stateloop-410m-k7-state-only",
        d_model=32,
        vocab_size=260,
        n_core=1,
        n_loops=4,
        d_ff=32,
        overrides={"attention.n_heads": 2},
    ).eval()
    res = replace_and_freeze(model, _batches(1), _batches(1, seed=4), loops=4)
    assert res["boundaries"] == [1, 2, 3]  # X^4 is never computed
    assert [e["source"] for e in res["replace"]] == [1, 2]


# ------------------------------------------------------------------------------------------------
# looplm analyze
# ------------------------------------------------------------------------------------------------


def test_analyze_cli_writes_json_and_figures(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"Document {i}: the looped model keeps a state per token. " * 3 for i in range(20)))
    out = tmp_path / "an"
    argv = [
        "analyze",
        "--model",
        "tiny-stateloop",
        "--metrics",
        "state-shapley,state-replace-freeze",
        "--loops",
        "3",
        "--data",
        str(data),
        "--batches",
        "1",
        "--calib-batches",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "24",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    sh = json.loads((out / "state-shapley.json").read_text())
    assert sh["loops"] == 3 and len(sh["shapley"]) == 3 and sh["source"].startswith("preset tiny-stateloop")
    rf = json.loads((out / "state-replace-freeze.json").read_text())
    assert rf["calibration_tokens"] == 2 * 24 and len(rf["replace"]) == 2
    assert (out / "state-replace-freeze.png").stat().st_size > 1000
    assert "baseline PPL" in capsys.readouterr().out
    # any registered analysis runs: register one here and ask for it
    load_all()
    ANALYSES.pop("test-count", None)
    from looplm.analysis import register_analysis

    register_analysis("test-count")(lambda model, batches, options: {"n": len(batches), "loops": options["loops"]})
    try:
        assert main(argv[:3] + ["--metrics", "test-count"] + argv[5:]) == 0
        assert json.loads((out / "test-count.json").read_text())["n"] == 1
    finally:
        ANALYSES.pop("test-count", None)
    assert main(["analyze", "--model", "tiny-stateloop", "--metrics", "state-shaply", "--out", str(out)]) == 2
    assert "state-shapley" in capsys.readouterr().err
