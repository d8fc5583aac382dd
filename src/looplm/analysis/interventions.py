"""StateLoop's state interventions (StateLoop paper, §5 "Analysis of the Persistent State", Fig. 4).

Two analyses, registered for ``looplm analyze``:

``state-shapley`` — read masking (Fig. 4a). A model run at ``r`` loops reads its state ``r`` times: the
feedback reads ``R_j = N^j W_{s→z}ᵀ`` entering ``Z^j`` (``j = 1 … r−1``, eq. 4) and the terminal read
``R_r = N^r W_{s→out}ᵀ`` (eq. 10). Masking a set ``M`` of reads sets their projected outputs to zero;
``v(M) = NLL(M masked) − NLL(unmodified)``. All ``2^r`` subsets are evaluated and each read's exact
Shapley value is

    φ_i = Σ_{M ⊆ N∖{i}} |M|! (r − |M| − 1)! / r! · (v(M ∪ {i}) − v(M)),

its share ``φ_i / Σ_j φ_j`` (efficiency: ``Σ_j φ_j = v(N)``). The feedback share is the sum over
``R_1 … R_{r−1}``.

``state-replace-freeze`` — calibrated single replacement and freezing (Fig. 4b, eq. 15). With per-channel
mean ``μ_{i,c}`` and standard deviation ``σ_{i,c}`` of the state ``S^i`` at boundary ``i`` estimated on a
separate calibration sample of unmodified runs,

    Ŝ^{i→j}_{t,c} = σ_{j,c} / (σ_{i,c} + ε) · (S^i_{t,c} − μ_{i,c}) + μ_{j,c},   ε = 1e-6     (15)

*single replacement* at source ``i`` replaces ``S^{i+1}`` by ``Ŝ^{i→i+1}`` once and resumes normal
updates; *freezing* at ``i`` uses the saved ``S^i``, recalibrated, at every later boundary ``j > i``. The
backbone keeps running in both. Sources are ``i = 1 … r−1`` (``S^0 = 0`` has no scale to calibrate).

Both act through the rule's ``loop_options`` (``read_scale``, ``state_hook``; see
:mod:`looplm.recurrence.stateloop`), so they work on any rule that declares them in
``interventions``. NLLs are mean next-token NLLs (nats) over every token of the evaluation batches.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import register_analysis

EPS = 1e-6

__all__ = ["calibrate", "channel_stats", "mean_nll", "read_masking", "replace_and_freeze", "shapley_values"]


# ------------------------------------------------------------------------------------------------
# pieces
# ------------------------------------------------------------------------------------------------


def shapley_values(value: Callable[[frozenset], float], n: int) -> list[float]:
    """Exact Shapley values of players ``0 … n−1`` for the set function ``value`` (``value(∅)`` is the
    reference; it need not be 0). ``2^n`` evaluations, each subset once."""
    players = range(n)
    v = {frozenset(c): value(frozenset(c)) for m in range(n + 1) for c in itertools.combinations(players, m)}
    phi = []
    for i in players:
        total = 0.0
        for M, vM in v.items():
            if i in M:
                continue
            w = math.factorial(len(M)) * math.factorial(n - len(M) - 1) / math.factorial(n)
            total += w * (v[M | {i}] - vM)
        phi.append(total)
    return phi


def _loops(model, options: dict) -> int:
    r = options.get("loops") or model.config.n_loops
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"loops must be a positive int, got {r!r}")
    return r


def _require(model, what: str, analysis: str) -> None:
    have = getattr(model.rule, "interventions", ())
    if what not in have:
        raise ValueError(
            f"{analysis} needs a rule that supports the {what!r} intervention (StateLoop); "
            f"this model's rule {model.rule.rule_name!r} supports {list(have) or 'none'}"
        )


@torch.no_grad()
def mean_nll(model, batches: list[torch.Tensor], loops: int, loop_options: dict | None = None) -> float:
    """Mean next-token NLL (nats) over every predicted token of ``batches`` (each ``[B, T]``)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x in batches:
        x = x.to(device)
        logits = model(x, num_loops=loops, loop_options=loop_options).logits[:, :-1]  # [B, T−1, V]
        total += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / max(count, 1)


@torch.no_grad()
def channel_stats(model, batches: list[torch.Tensor], loops: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{i: (μ_i, σ_i)}``, each ``[d_s]``: per-channel mean and standard deviation of ``S^i`` over every
    token of ``batches`` in unmodified runs (the calibration sample of eq. 15)."""
    sums: dict[int, list] = {}
    device = next(model.parameters()).device

    def record(j, S):  # S [B, T, d_s]
        s = S.double().flatten(0, -2)  # [B·T, d_s]
        acc = sums.setdefault(j, [0, 0.0, 0.0])
        acc[0] += s.shape[0]
        acc[1] = acc[1] + s.sum(0)
        acc[2] = acc[2] + (s * s).sum(0)
        return S

    for x in batches:
        model(x.to(device), num_loops=loops, loop_options={"state_hook": record})
    stats = {}
    for j, (n, s1, s2) in sorted(sums.items()):
        mu = s1 / n
        var = (s2 / n - mu * mu).clamp(min=0)
        stats[j] = (mu.float(), var.sqrt().float())
    return stats


def calibrate(
    S: torch.Tensor, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor], eps: float = EPS
):
    """Eq. 15: ``σ_j / (σ_i + ε) · (S − μ_i) + μ_j`` per channel, the same for every token."""
    (mu_i, sd_i), (mu_j, sd_j) = src, dst
    return (sd_j / (sd_i + eps)) * (S - mu_i) + mu_j


def _ppl(nll: float) -> float:
    return math.exp(min(nll, 700.0))


# ------------------------------------------------------------------------------------------------
# the analyses
# ------------------------------------------------------------------------------------------------


def read_masking(model, batches: list[torch.Tensor], loops: int) -> dict:
    """Every subset of the ``loops`` state reads masked; exact Shapley values and shares (Fig. 4a)."""
    _require(model, "read_scale", "state-shapley")
    r = loops
    base = mean_nll(model, batches, r)
    cache: dict[frozenset, float] = {}

    def value(M: frozenset) -> float:
        if not M:
            return 0.0
        scales = [0.0 if i in M else 1.0 for i in range(r)]
        cache[M] = mean_nll(model, batches, r, {"read_scale": scales}) - base
        return cache[M]

    phi = shapley_values(value, r)
    total = sum(phi)
    shares = [p / total for p in phi] if abs(total) > 1e-12 else [None] * r
    names = [f"R{i + 1}" for i in range(r)]
    return {
        "loops": r,
        "reads": names,
        "kinds": ["feedback"] * (r - 1) + ["terminal"],
        "baseline_nll": base,
        "baseline_ppl": _ppl(base),
        "subset_nll_increase": {
            "".join("1" if i in M else "0" for i in range(r)): v
            for M, v in sorted(cache.items(), key=lambda kv: sorted(kv[0]))
        },
        "all_masked_nll_increase": cache.get(frozenset(range(r)), 0.0),
        "shapley": phi,
        "shares": shares,
        "feedback_share": None if shares[0] is None else sum(shares[:-1]),
        "terminal_share": shares[-1],
    }


def replace_and_freeze(
    model, batches: list[torch.Tensor], calibration: list[torch.Tensor], loops: int, eps: float = EPS
) -> dict:
    """Calibrated single replacement and freezing at every source boundary (Fig. 4b, eq. 15)."""
    _require(model, "state_hook", "state-replace-freeze")
    r = loops
    stats = channel_stats(model, calibration, r)
    bounds = sorted(stats)  # boundaries j whose S^j the rule exposes (1 … r, or 1 … r−1 for state-only)
    base = mean_nll(model, batches, r)

    def replace_hook(i):
        saved = {}

        def hook(j, S):
            if j == i:
                saved["S"] = S
            elif j == i + 1:
                return calibrate(saved["S"], stats[i], stats[j], eps)
            return S

        return hook

    def freeze_hook(i):
        saved = {}

        def hook(j, S):
            if j == i:
                saved["S"] = S
            elif j > i:
                return calibrate(saved["S"], stats[i], stats[j], eps)
            return S

        return hook

    replace, freeze = [], []
    for i in bounds[:-1]:
        nll = mean_nll(model, batches, r, {"state_hook": replace_hook(i)})
        replace.append({"source": i, "target": i + 1, "nll": nll, "ppl": _ppl(nll), "nll_increase": nll - base})
        nll = mean_nll(model, batches, r, {"state_hook": freeze_hook(i)})
        freeze.append(
            {
                "source": i,
                "targets": [j for j in bounds if j > i],
                "nll": nll,
                "ppl": _ppl(nll),
                "nll_increase": nll - base,
            }
        )
    return {
        "loops": r,
        "epsilon": eps,
        "boundaries": bounds,
        "calibration_tokens": int(sum(x.numel() for x in calibration)),
        "baseline_nll": base,
        "baseline_ppl": _ppl(base),
        "replace": replace,
        "freeze": freeze,
        "calibration_stats": {
            str(j): {"mean_abs_mu": float(mu.abs().mean()), "mean_sigma": float(sd.mean())}
            for j, (mu, sd) in stats.items()
        },
    }


# ------------------------------------------------------------------------------------------------
# registration: looplm analyze --metrics state-shapley,state-replace-freeze
# ------------------------------------------------------------------------------------------------


def _plot_shapley(result: dict, out_dir) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["shares"][0] is None:
        return []
    out = Path(out_dir) / "state-shapley.png"
    shares = [100 * s for s in result["shares"]]
    colors = ["#4C72B0" if k == "feedback" else "#DD8452" for k in result["kinds"]]
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(shares), 3.2))
    bars = ax.bar(result["reads"], shares, color=colors)
    for b, s in zip(bars, shares):
        ax.annotate(f"{s:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("Shapley share of NLL increase (%)")
    ax.set_title(
        f"State reads (K = {result['loops']}): feedback {100 * result['feedback_share']:.1f}%, terminal {100 * result['terminal_share']:.1f}%",
        fontsize=9,
    )
    ax.axhline(0, color="black", lw=0.5)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return [out]


def _plot_replace_freeze(result: dict, out_dir) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result["replace"]:
        return []
    out = Path(out_dir) / "state-replace-freeze.png"
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    xs = [e["source"] for e in result["replace"]]
    ax.plot(
        xs,
        [e["ppl"] for e in result["replace"]],
        "o-",
        label=r"single replacement $S^{i+1} \leftarrow \hat S^{i\to i+1}$",
    )
    ax.plot(xs, [e["ppl"] for e in result["freeze"]], "s-", label=r"frozen $S^i$ at all $j > i$")
    ax.axhline(result["baseline_ppl"], ls="--", color="gray", label="unmodified")
    ax.set_xlabel("source boundary i")
    ax.set_ylabel("PPL")
    ax.set_xticks(xs)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return [out]


@register_analysis(
    "state-shapley",
    plot=_plot_shapley,
    help="StateLoop read masking: exact Shapley shares of the K state reads (Fig. 4a)",
)
def state_shapley(model, batches, options) -> dict:
    return read_masking(model, list(batches), _loops(model, options))


@register_analysis(
    "state-replace-freeze",
    plot=_plot_replace_freeze,
    help="StateLoop calibrated single replacement and freezing of states (eq. 15, Fig. 4b)",
    options=("epsilon",),
)
def state_replace_freeze(model, batches, options) -> dict:
    """``options['calibration_batches']``: the separate calibration sample (default: the first half of
    ``batches`` calibrates and the second half is evaluated)."""
    batches = list(batches)
    calib = options.get("calibration_batches")
    if not calib:
        if len(batches) < 2:
            raise ValueError(
                "state-replace-freeze needs a separate calibration sample: give calibration_batches or at least 2 batches"
            )
        half = len(batches) // 2
        calib, batches = batches[:half], batches[half:]
    return replace_and_freeze(model, batches, list(calib), _loops(model, options), float(options.get("epsilon", EPS)))
