"""LR schedules: WSD exactly as the recurrence-effectiveness paper, cosine as Looped-Mamba."""

import math

import pytest
import torch

from looplm.train.config import ScheduleConfig
from looplm.train.schedule import (
    apply_lr,
    build_lr_lambda,
    constant_lambda,
    cosine_lambda,
    schedule_lengths,
    wsd_lambda,
)


def test_wsd_boundaries_paper_recipe():
    T = 1000  # 5% warmup = 50, 10% decay = 100, stable = 850
    lam = wsd_lambda(T)
    L = lam.lengths
    assert (L.warmup, L.stable, L.decay) == (50, 850, 100)
    assert lam(0) == 0.0  # linear warmup from zero
    assert lam(25) == pytest.approx(0.5)
    assert lam(49) == pytest.approx(49 / 50)
    assert lam(50) == 1.0  # peak after 5%
    assert all(lam(t) == 1.0 for t in range(50, 901))  # stable until 90%
    assert lam(950) == pytest.approx(1 - 0.9 * 0.5)  # linear decay in between
    assert lam(T) == pytest.approx(0.1)  # 0.1 x peak at the end
    assert lam(T + 50) == pytest.approx(0.1)  # stays there
    # linear in both ramps: constant increments
    up = [lam(t + 1) - lam(t) for t in range(0, 49)]
    down = [lam(t + 1) - lam(t) for t in range(900, 1000)]
    assert max(up) - min(up) < 1e-12 and up[0] == pytest.approx(1 / 50)
    assert max(down) - min(down) < 1e-12 and down[0] == pytest.approx(-0.9 / 100)


def test_wsd_small_run_and_warmup_steps():
    lam = wsd_lambda(20, warmup_fraction=0.05, decay_fraction=0.1, min_ratio=0.1)
    assert [lam(t) for t in (0, 1, 17, 18, 19, 20)] == pytest.approx([0.0, 1.0, 1.0, 1.0, 0.55, 0.1])
    lam = wsd_lambda(100, warmup_steps=10)
    assert lam(5) == pytest.approx(0.5) and lam(10) == 1.0


def test_cosine_looped_mamba_recipe():
    T = 1000  # warmup ratio 0.1, min LR 0.1 x peak
    lam = cosine_lambda(T, warmup_fraction=0.1, min_ratio=0.1)
    assert lam(0) == 0.0
    assert lam(50) == pytest.approx(0.5)
    assert lam(100) == pytest.approx(1.0)
    assert lam(550) == pytest.approx(0.55)  # half-way through the cosine: (1 + 0.1) / 2
    assert lam(T) == pytest.approx(0.1)
    assert lam(T + 10) == pytest.approx(0.1)
    vals = [lam(t) for t in range(100, T + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(vals, vals[1:]))  # monotone decreasing
    t = 300
    assert lam(t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 100) / 900)))


def test_constant_and_config_dispatch():
    lam = constant_lambda(100, warmup_fraction=0.1)
    assert [lam(0), lam(5), lam(10), lam(99)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert build_lr_lambda(ScheduleConfig(name="wsd"), 1000)(1000) == pytest.approx(0.1)
    assert build_lr_lambda(ScheduleConfig(name="cosine", warmup_fraction=0.1), 1000)(550) == pytest.approx(0.55)
    assert build_lr_lambda(ScheduleConfig(name="constant", warmup_fraction=0.0), 10)(0) == 1.0


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match="exceed"):
        schedule_lengths(10, warmup_steps=8, decay_fraction=0.5)
    with pytest.raises(ValueError, match="at least one"):
        wsd_lambda(0)


def test_apply_lr_scales_each_groups_peak():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [a], "peak_lr": 1e-3}, {"params": [b], "peak_lr": 2e-2}])
    apply_lr([opt], 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 1e-2])
