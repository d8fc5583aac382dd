"""Learning-rate schedules as LambdaLR-style multipliers ``λ(t)``.

The learning rate of every parameter group at optimizer update ``t`` (0-based: ``t`` updates have
been applied before it) is ``η(t) = η_max · λ(t)``, where ``η_max`` is the group's peak LR.
This is the same convention as ``torch.optim.lr_scheduler.LambdaLR`` and Hugging Face's
``get_wsd_schedule``: the first update uses ``λ(0)``, the last one ``λ(T-1)``, and ``λ(T)`` is the
value "at the end of training".

Schedules
---------
``wsd`` (recurrence-effectiveness paper, §3 "Optimization"): with warmup, stable and decay lengths
``T_w``, ``T_s``, ``T_d`` (``T_w = 5%``, ``T_d = 10%`` of the ``T`` updates, ``T_s`` the rest)::

    λ(t) = t / T_w                                   0 <= t < T_w          (linear from 0)
    λ(t) = 1                                         T_w <= t < T_w + T_s
    λ(t) = 1 - (1 - r) · (t - T_w - T_s) / T_d       T_w + T_s <= t <= T   (linear to r = 0.1)

``cosine`` (Looped-Mamba paper, App. E: warmup ratio 0.1, minimum LR 0.1 × peak)::

    λ(t) = t / T_w                                              t < T_w
    λ(t) = r + (1 - r) · ½ (1 + cos(π (t - T_w) / (T - T_w)))   T_w <= t <= T

``constant``: linear warmup, then 1.

Beyond ``T`` every schedule stays at its final value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "ScheduleLengths",
    "schedule_lengths",
    "wsd_lambda",
    "cosine_lambda",
    "constant_lambda",
    "build_lr_lambda",
    "apply_lr",
]


@dataclass(frozen=True)
class ScheduleLengths:
    """Phase lengths in optimizer updates: ``total = warmup + stable + decay``."""

    total: int
    warmup: int
    stable: int
    decay: int


def schedule_lengths(
    total: int, warmup_fraction: float = 0.05, warmup_steps: int | None = None, decay_fraction: float = 0.0
) -> ScheduleLengths:
    """Split ``total`` updates into warmup / stable / decay phases (rounded to whole updates).

    ``warmup_steps`` (if given) wins over ``warmup_fraction``. ``decay_fraction`` is only used by WSD.
    """
    if total < 1:
        raise ValueError(f"a schedule needs at least one optimizer update, got total={total}")
    warmup = warmup_steps if warmup_steps is not None else int(round(warmup_fraction * total))
    decay = int(round(decay_fraction * total))
    if warmup < 0 or decay < 0:
        raise ValueError(f"phase lengths must be >= 0 (warmup={warmup}, decay={decay})")
    if warmup + decay > total:
        raise ValueError(
            f"warmup ({warmup}) + decay ({decay}) exceed the {total} training updates; shorten them or train longer"
        )
    return ScheduleLengths(total, warmup, total - warmup - decay, decay)


def _warmup(t: int, warmup: int) -> float | None:
    if warmup > 0 and t < warmup:
        return t / warmup
    return None


def wsd_lambda(
    total: int,
    warmup_fraction: float = 0.05,
    decay_fraction: float = 0.1,
    min_ratio: float = 0.1,
    warmup_steps: int | None = None,
) -> Callable[[int], float]:
    """Warmup-stable-decay multiplier (linear warmup from 0, flat, linear decay to ``min_ratio``)."""
    L = schedule_lengths(total, warmup_fraction, warmup_steps, decay_fraction)
    decay_start = L.warmup + L.stable

    def lam(t: int) -> float:
        w = _warmup(t, L.warmup)
        if w is not None:
            return w
        if t < decay_start or L.decay == 0:
            return 1.0
        progress = min(1.0, (t - decay_start) / L.decay)
        return 1.0 - (1.0 - min_ratio) * progress

    lam.lengths = L  # type: ignore[attr-defined]
    return lam


def cosine_lambda(
    total: int, warmup_fraction: float = 0.1, min_ratio: float = 0.1, warmup_steps: int | None = None
) -> Callable[[int], float]:
    """Linear warmup from 0, then half-cosine from 1 down to ``min_ratio`` at update ``total``."""
    L = schedule_lengths(total, warmup_fraction, warmup_steps, 0.0)
    span = total - L.warmup

    def lam(t: int) -> float:
        w = _warmup(t, L.warmup)
        if w is not None:
            return w
        if span <= 0:
            return min_ratio
        progress = min(1.0, (t - L.warmup) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    lam.lengths = L  # type: ignore[attr-defined]
    return lam


def constant_lambda(
    total: int, warmup_fraction: float = 0.0, warmup_steps: int | None = None
) -> Callable[[int], float]:
    """Linear warmup from 0, then a constant 1."""
    L = schedule_lengths(total, warmup_fraction, warmup_steps, 0.0)

    def lam(t: int) -> float:
        w = _warmup(t, L.warmup)
        return 1.0 if w is None else w

    lam.lengths = L  # type: ignore[attr-defined]
    return lam


def build_lr_lambda(cfg, total_steps: int) -> Callable[[int], float]:
    """The multiplier function described by a ``ScheduleConfig`` for a run of ``total_steps`` updates."""
    if cfg.name == "wsd":
        return wsd_lambda(total_steps, cfg.warmup_fraction, cfg.decay_fraction, cfg.min_ratio, cfg.warmup_steps)
    if cfg.name == "cosine":
        return cosine_lambda(total_steps, cfg.warmup_fraction, cfg.min_ratio, cfg.warmup_steps)
    if cfg.name == "constant":
        return constant_lambda(total_steps, cfg.warmup_fraction, cfg.warmup_steps)
    raise ValueError(f"unknown schedule {cfg.name!r}; use 'wsd', 'cosine' or 'constant'")


def apply_lr(optimizers, multiplier: float) -> None:
    """Set ``group['lr'] = group['peak_lr'] * multiplier`` in every group of every optimizer.

    The schedule is a pure function of the step, so resuming only needs the step number: there is
    no scheduler state to save beyond it.
    """
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
