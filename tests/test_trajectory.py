"""Trajectory metrics (recurrence-effectiveness appendix) on hand-built tensors with known answers,
and on recorded runs of tiny models (telescoping amplification, skip response, `looplm analyze`)."""

import json
import math

import pytest
import torch

import looplm
from looplm.analysis import load_all
from looplm.analysis.trajectory import (
    amplification_factors,
    angular_distance,
    lag_aggregate,
    record_trajectory,
    relative_update_norm,
    skip_response,
    token_variance,
)

from helpers import tiny_variant

# ------------------------------------------------------------------------------------------------
# definitions on hand-built tensors
# ------------------------------------------------------------------------------------------------


def test_angular_distance_known_directions():
    u = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    v = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [-5.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    d = angular_distance(u, v)
    torch.testing.assert_close(d, torch.tensor([0.0, 0.5, 1.0, 0.25, 0.5], dtype=torch.float64))  # zero vector -> 1/2
    # clipping: identical large vectors whose cosine rounds above one give 0, not NaN
    w = torch.full((4, 257), 1e3) + torch.linspace(0, 1, 257)
    assert torch.isfinite(angular_distance(w, w)).all() and angular_distance(w, w).max() < 1e-3
    # insensitive to positive rescaling
    a, b = torch.randn(6, 16), torch.randn(6, 16)
    torch.testing.assert_close(angular_distance(a, b), angular_distance(7.0 * a, 0.01 * b))


def test_angular_distance_is_a_mean_of_per_vector_distances():
    u = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    v = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # distances 0 and 1: mean 1/2
    assert float(angular_distance(u, v).mean()) == pytest.approx(0.5)
    u2, v2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # 0 and 1/2: mean 1/4
    assert float(angular_distance(u2, v2).mean()) == pytest.approx(0.25)
    mean_cos = float(torch.nn.functional.cosine_similarity(u2, v2).mean())  # 1/2 -> arccos/π = 1/3 ≠ 1/4
    assert math.acos(mean_cos) / math.pi == pytest.approx(1 / 3)


def test_relative_update_norm_is_a_mean_of_per_sequence_ratios():
    x = torch.randn(3, 5, 8)
    scale = torch.tensor([1.5, 0.5, 3.0])[:, None, None]
    rho = relative_update_norm(x, scale * x)  # a scaled state: angle 0, relative update |c − 1|
    torch.testing.assert_close(rho, torch.tensor([0.5, 0.5, 2.0], dtype=torch.float64))
    torch.testing.assert_close(
        angular_distance(x, scale * x), torch.zeros(3, 5, dtype=torch.float64), atol=1e-6, rtol=0
    )
    # mean of ratios, not ratio of means: a big and a small sequence
    a = torch.zeros(2, 1, 2)
    a[0, 0, 0], a[1, 0, 0] = 10.0, 1.0
    b = a.clone()
    b[1, 0, 1] = 1.0  # only the small sequence moves, by its own norm
    assert float(relative_update_norm(a, b).mean()) == pytest.approx(0.5)  # (0 + 1) / 2, not 1 / 11


def test_token_variance_uses_correction_one_and_averages_tokens():
    h = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0]]])  # per-token variances 5/3 and 0
    torch.testing.assert_close(token_variance(h), torch.tensor([[5 / 3, 0.0]], dtype=torch.float64))
    assert float(token_variance(h).mean()) == pytest.approx(5 / 6)


def test_amplification_factors_telescope_exactly_on_numbers():
    f = amplification_factors(v_x=2.0, v_z=3.0, v_blocks=[4.5, 9.0, 6.0], v_x_next=12.0)
    assert f["injection"] == 1.5 and f["blocks"] == [1.5, 2.0, 6.0 / 9.0] and f["mixing"] == 2.0
    assert f["injection"] * math.prod(f["blocks"]) * f["mixing"] == pytest.approx(f["total"]) == pytest.approx(6.0)


def test_lag_aggregate_weights_pairs_equally():
    pairs = [{"lag": 1, "C": 1.0}, {"lag": 1, "C": 3.0}, {"lag": 2, "C": 8.0}, {"lag": 0, "C": 100.0}]
    assert lag_aggregate(pairs, [1, 2]) == pytest.approx(4.0)  # (1 + 3 + 8) / 3, not mean of C(1)=2, C(2)=8
    assert lag_aggregate(pairs, [5]) is None


# ------------------------------------------------------------------------------------------------
# recorded runs
# ------------------------------------------------------------------------------------------------


def _model(name, rule=None, **extra):
    torch.manual_seed(0)
    cfg = tiny_variant(name, **extra)
    if rule is not None:
        cfg = cfg.replace(rule=rule)
    return looplm.LoopedLM(cfg).eval()


def _batches(V=128, n=2):
    torch.manual_seed(5)
    return [torch.randint(0, V, (2, 12)) for _ in range(n)]


@pytest.mark.parametrize(
    "rule",
    [None, {"name": "injection", "options": {"form": "channel"}}, {"name": "timestep", "options": {"gating": "loop"}}],
)
def test_recorded_trajectory_telescopes_and_matches_direct_computation(rule):
    model = _model("qwen3-0.6b-baseloop-4x7", rule=rule, n_core=2, n_loops=3)
    if rule is not None:
        with torch.no_grad():
            for p in model.rule.parameters():
                p.add_(0.3 * torch.randn_like(p))  # z != x (injection) / x^{t+1} != y (loop-level mixing)
    batches = _batches()
    tr = record_trajectory(model, batches, loops=5)
    assert tr["layout"]["effective_depth"] == 2 * 5 and len(tr["block_angle"]) == 10 and len(tr["state_variance"]) == 6
    for t, f in enumerate(tr["amplification"]):
        assert f["injection"] * math.prod(f["blocks"]) * f["mixing"] == pytest.approx(f["total"], rel=1e-12)
        assert f["total"] == pytest.approx(tr["state_variance"][t + 1] / tr["state_variance"][t], rel=1e-12)
    assert tr["state_variance_normalised"][3] == 1.0  # Ṽ(L_tr) = 1
    # direct computation over both batches from the model's own iterates
    with torch.no_grad():
        outs = [model(b, num_loops=5, output_iterations=True) for b in batches]
        x0 = torch.cat([model.embed(b) * model.embed_multiplier for b in batches])
        H = [torch.cat([o.iterations[k] for o in outs]) for k in range(5)]
    if rule is None or rule["name"] == "injection":  # no loop-level mixing: x^{t+1} = H^t
        xs = [x0] + H
        for t in range(5):
            assert tr["loop_angle"][t] == pytest.approx(float(angular_distance(xs[t], xs[t + 1]).mean()), rel=1e-9)
            assert tr["loop_update"][t] == pytest.approx(float(relative_update_norm(xs[t], xs[t + 1]).mean()), rel=1e-9)
            assert tr["state_variance"][t + 1] == pytest.approx(float(token_variance(xs[t + 1]).mean()), rel=1e-9)
        assert tr["block_variance_out"][2 * 5 - 1] == pytest.approx(float(token_variance(H[4]).mean()), rel=1e-9)
    if rule is None:
        assert all(f["injection"] == 1.0 and f["mixing"] == 1.0 for f in tr["amplification"])
    else:
        assert any(abs(f["injection"] - 1) > 1e-3 or abs(f["mixing"] - 1) > 1e-3 for f in tr["amplification"])


def test_skip_response_pairs_lags_and_a_skip_that_changes_nothing():
    """The 4 × 7 Qwen BaseLoop layout at toy width, L = 9: |P_0| = 6(L−7), |P_d| = 16(L−7−d)."""
    model = _model("qwen3-0.6b-baseloop-4x7", n_core=4, n_loops=7)
    with torch.no_grad():  # core block 1 writes nothing: its update is zero, skipping it changes nothing
        blk = model.core.stack.blocks[1]
        blk.mixer.o_proj.weight.zero_()
        blk.mlp.down_proj.weight.zero_()
    res = skip_response(model, _batches(n=1), loops=9, lags=[1])
    L = 9
    assert res["lags"] == [0, 1] and res["pairs_by_lag"] == [6 * (L - 7), 16 * (L - 7 - 1)]
    for pr in res["pairs"]:
        r_i, r_j = 1 + (pr["i"] - 1) // 4, 1 + (pr["j"] - 1) // 4  # r(j) = 1 + ⌊(j−1)/4⌋
        assert r_i > 7 and r_j > 7 and pr["lag"] == r_j - r_i and pr["i"] < pr["j"]
        if (pr["i"] - 1) % 4 == 1:  # source = the block that changes nothing
            assert pr["C"] == 0.0
        if (pr["j"] - 1) % 4 == 1:  # target with B_j <= 1e-8: recorded as zero
            assert pr["B_j"] <= 1e-8 and pr["C"] == 0.0
    live = [pr for pr in res["pairs"] if (pr["i"] - 1) % 4 != 1 and (pr["j"] - 1) % 4 != 1]
    assert all(pr["C"] > 0 for pr in live)
    assert res["C_D"]["value"] == pytest.approx(lag_aggregate(res["pairs"], [1]))
    assert res["C_by_lag"][1] == pytest.approx(res["C_D"]["value"])


def test_skip_response_of_one_pair_by_hand():
    """C(i, j) for the last two core occurrences of a 1-block core, recomputed without hooks."""
    model = _model("qwen3-0.6b-baseloop-4x7", n_core=1, n_loops=2)
    (ids,) = _batches(n=1)
    res = skip_response(model, [ids], loops=4)
    fctx = model.forward_context(ids, None, None, 0)
    blk = model.core.stack.blocks[0]
    with torch.no_grad():
        h = model.embed(ids) * model.embed_multiplier
        for _ in range(2):
            h = blk(h, fctx)
        u3 = blk(h, fctx) - h  # occurrence 3 (loop 3)
        h3 = h + u3
        u4 = blk(h3, fctx) - h3
        u4_skip = blk(h, fctx) - h  # occurrence 3 skipped: occurrence 4 reads h
    C = float((u4_skip - u4).double().norm(dim=-1).mean() / u4.double().norm(dim=-1).mean())
    (pair,) = [p for p in res["pairs"] if (p["i"], p["j"]) == (3, 4)]
    assert pair["lag"] == 1 and pair["C"] == pytest.approx(C, rel=1e-6)
    with pytest.raises(ValueError, match="loops > 2"):
        skip_response(model, [ids], loops=2)


def test_analyses_are_registered_and_write_json_and_figures(tmp_path, capsys):
    from looplm.cli import main

    names = ["angular-distance", "update-norm", "state-variance", "skip-response"]
    assert set(names) <= set(load_all())
    rc = main(
        [
            "analyze",
            "--model",
            "tiny-llama",
            "--metrics",
            ",".join(names),
            "--loops",
            "4",
            "--batches",
            "1",
            "--calib-batches",
            "0",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    for n in names:
        res = json.loads((tmp_path / f"{n}.json").read_text())
        assert res["analysis"] == n and (tmp_path / f"{n}.png").stat().st_size > 1000
    res = json.loads((tmp_path / "skip-response.json").read_text())
    assert res["layout"]["L"] == 4 and res["pairs_by_lag"] == [1 * (4 - 3)]  # tiny-llama: s = 2, K = 3


def test_coreloop_positions_and_skip_lags():
    """(p, s, K, c) = (1, 2, 3, 1): positions 1 (prelude), 2..2r+1 (core), 2r+2 (coda); x^(0) = prelude output."""
    model = _model("qwen3-0.6b-coreloop-p1-2x13-c1", n_loops=3)
    (ids,) = _batches(n=1)
    tr = record_trajectory(model, [ids], loops=4)
    assert tr["layout"]["effective_depth"] == 1 + 2 * 4 + 1 and len(tr["block_angle"]) == 10
    assert all(v is not None for v in tr["block_angle"] + tr["block_variance_out"])
    with torch.no_grad():
        fctx = model.forward_context(ids, None, None, 0)
        x0 = model.prelude(model.embed(ids) * model.embed_multiplier, fctx)
        out = model(ids, num_loops=4, output_iterations=True)
    assert tr["state_variance"][0] == pytest.approx(float(token_variance(x0).mean()), rel=1e-9)
    assert tr["block_variance_out"][0] == pytest.approx(tr["state_variance"][0], rel=1e-9)  # prelude output = x^(0)
    assert tr["block_variance_in"][-1] == pytest.approx(
        float(token_variance(out.iterations[-1]).mean()), rel=1e-9
    )  # coda input
    res = skip_response(model, [ids], loops=5)
    assert [(p["i"], p["j"]) for p in res["pairs"]][:3] == [(8, 9), (8, 10), (8, 11)]  # core occurrences of loops 4, 5
    assert res["pairs_by_lag"] == [1 * 2, 4 * 1]  # |P_0| = s(s-1)/2 (L-K), |P_1| = s² (L-K-1)
