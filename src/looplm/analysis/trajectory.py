"""Trajectory metrics of the recurrence-effectiveness paper (appendix), exactly as defined there.

Notation: effective positions ``ℓ = 1 .. D`` number the block executions in order (prelude, the core
``s`` blocks at each loop, coda); ``x^{(t)}`` is the recurrent state after ``t`` loops (``x^{(0)}`` =
the prelude output), ``z^{(t)}`` the input of the first shared block of loop ``t`` (after any state
injection) and ``y^{(t)}`` the output of its last shared block (before any loop-level mixing);
``L_tr`` is the training loop count ``K``.

* **Normalised angular distance** (:func:`angular_distance`)::

      d(u, v) = arccos( clip( ⟨u, v⟩ / max(‖u‖‖v‖, ε), −1, 1 ) ) / π,     ε = 1e-12

  0 / ½ / 1 for aligned / orthogonal / opposite vectors; the floor gives ½ when either vector is
  zero. Block measurement ``A_ℓ = mean_p d(h_ℓ^in[p], h_ℓ^out[p])`` and loop measurement
  ``A^{(t)} = mean_p d(x^{(t)}[p], x^{(t+1)}[p])``: means of the per-vector distances over tokens ``p``
  (not ``arccos`` of a mean cosine).
* **Relative update norm** (:func:`relative_update_norm`):
  ``ρ^{(t)} = mean_b ‖x_b^{(t+1)} − x_b^{(t)}‖_F / ‖x_b^{(t)}‖_F`` over sequences ``b`` (a mean of
  per-sequence ratios, the Frobenius norm over the sequence's tokens and channels); blocks likewise.
* **Within-token feature variance** (:func:`token_variance`): ``V(h) = mean_p Var_{i}(h_p,i)`` with
  correction one (over the ``m`` hidden coordinates of each token, then averaged over tokens). The
  trajectory is normalised at the training loop count: ``Ṽ(t) = V(x^{(t)}) / V(x^{(L_tr)})``.
* **Amplification factors** inside loop ``t`` (:func:`amplification_factors`): injection
  ``γ_in = V(z^{(t)}) / V(x^{(t)})``, one factor per shared block ``γ_k = V(h_k^out) / V(h_k^in)``
  (``h_1^in = z^{(t)}``, ``h_s^out = y^{(t)}``) and loop-level mixing ``γ_mix = V(x^{(t+1)}) / V(y^{(t)})``.
  For positive variances they telescope exactly: ``γ_in · Π_k γ_k · γ_mix = V(x^{(t+1)}) / V(x^{(t)})``.
  (The paper's equations were lost; this is the decomposition its definitions of ``z`` and ``y`` give.)
* **Skip response** (:func:`skip_response`): for effective positions ``i < j``, run the same inputs
  twice, once replacing the output of block occurrence ``i`` by its input. With the update
  ``u_j = h_j^out − h_j^in`` (each run its own) ::

      N_ij = mean_p ‖ũ_j[p] − u_j[p]‖,   B_j = mean_p ‖u_j[p]‖,   C(i, j) = N_ij / B_j  (0 when B_j <= 1e-8)

  For a core of ``s`` blocks the loop of core position ``j`` is ``r(j) = 1 + ⌊(j − p − 1)/s⌋``; only
  pairs with both ends beyond the ``K`` training loops count. ``P_d`` = pairs with
  ``r(j) − r(i) = d`` (``|P_0| = s(s−1)/2 · (L−K)``, ``|P_d| = s² (L−K−d)``), ``C(d)`` = mean of
  ``C(i, j)`` over ``P_d`` and ``C_D = Σ_{d∈D} Σ_{P_d} C(i, j) / Σ_{d∈D} |P_d|`` (every pair weighted
  equally).

Everything is accumulated over batches as sums and counts, so several batches give the same
definitions over all their tokens / sequences. Registered analyses (``looplm analyze --metrics``):
``angular-distance``, ``update-norm``, ``state-variance`` (with the amplification factors) and
``skip-response``; options: ``loops`` (inference depth ``r``), ``grid`` (timestep-conditioning grid,
passed as a loop option), ``lags`` (the set ``D`` of ``C_D``, default ``1..6`` clipped to the range).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from . import register_analysis
from ..recurrence.base import RecurrenceRule

EPS = 1e-12  # denominator floor of the angular distance (the paper's value was lost)
SKIP_FLOOR = 1e-8  # C(i, j) is recorded as 0 when B_j <= 1e-8 (paper)

__all__ = [
    "angular_distance",
    "relative_update_norm",
    "token_variance",
    "amplification_factors",
    "record_trajectory",
    "skip_response",
    "lag_aggregate",
]


# ------------------------------------------------------------------------------------------------
# the definitions, on tensors
# ------------------------------------------------------------------------------------------------


def angular_distance(u: torch.Tensor, v: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Per-vector normalised angular distance ``[...]`` of ``u, v [..., m]`` (in [0, 1])."""
    u, v = u.double(), v.double()
    cos = (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1)).clamp_min(eps)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi


def relative_update_norm(before: torch.Tensor, after: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Per-sequence ``‖after − before‖_F / ‖before‖_F`` of ``[B, T, m]`` states -> ``[B]``."""
    before, after = before.double(), after.double()
    return (after - before).flatten(1).norm(dim=1) / before.flatten(1).norm(dim=1).clamp_min(eps)


def token_variance(h: torch.Tensor) -> torch.Tensor:
    """Per-token variance over the hidden coordinates, correction one: ``[..., m] -> [...]``.
    ``V(h)`` is its mean over tokens."""
    return h.double().var(dim=-1, correction=1)


def amplification_factors(v_x: float, v_z: float, v_blocks: list[float], v_x_next: float) -> dict:
    """Factors of one loop from token-averaged variances: ``V(x^t)``, ``V(z^t)``, the block outputs
    ``V(h_1^out) .. V(h_s^out)`` (the last is ``V(y^t)``) and ``V(x^{t+1})``. See the module docstring."""
    ins = [v_z] + v_blocks[:-1]
    return {
        "injection": v_z / v_x,
        "blocks": [o / i for o, i in zip(v_blocks, ins)],
        "mixing": v_x_next / v_blocks[-1],
        "total": v_x_next / v_x,
    }


def lag_aggregate(pairs: list[dict], lags) -> float | None:
    """``C_D``: the mean of ``C(i, j)`` over every pair whose lag is in ``lags`` (pairs weighted equally)."""
    vals = [p["C"] for p in pairs if p["lag"] in set(lags)]
    return sum(vals) / len(vals) if vals else None


# ------------------------------------------------------------------------------------------------
# recording a forward pass (hooks on the blocks; a wrapper module around the rule)
# ------------------------------------------------------------------------------------------------


class _RecordingRule(RecurrenceRule):
    """Delegates every hook to ``inner`` and reports ``x^{(t)}``, ``z^{(t)}``, ``y^{(t)}`` to ``sink``."""

    def __init__(self, inner: RecurrenceRule, sink):
        super().__init__(None)
        self.inner, self.sink = inner, sink
        self.rope_dims, self.lm_loss_weight, self.loop_options = (
            inner.rope_dims,
            inner.lm_loss_weight,
            inner.loop_options,
        )
        self.rule_name = inner.rule_name

    @staticmethod
    def _x(state, fallback):
        h = state.get("h") if isinstance(state, dict) else None
        return h if isinstance(h, torch.Tensor) and h.dim() == 3 else fallback

    def begin(self, h0, lctx):
        state = self.inner.begin(h0, lctx)
        self.sink("x", 0, self._x(state, h0))
        return state

    def next_input(self, state, lctx):
        z = self.inner.next_input(state, lctx)
        self.sink("z", lctx.iteration, z)
        return z

    def block_modulation(self, state, lctx):
        return self.inner.block_modulation(state, lctx)

    def step(self, state, h, lctx):
        self.sink("y", lctx.iteration, h)
        new = self.inner.step(state, h, lctx)
        self.sink("x", lctx.iteration + 1, self._x(new, h))
        return new

    def finish(self, state, lctx):
        return self.inner.finish(state, lctx)

    def aux_loss(self, state, lctx):
        return self.inner.aux_loss(state, lctx)

    def halted(self, state, lctx):
        return self.inner.halted(state, lctx)

    def select_rows(self, keep_new, new, old):
        return self.inner.select_rows(keep_new, new, old)


@contextmanager
def _instrumented(model, on_block=None, on_state=None, skip=None):
    """Hooks for one or more forwards. ``on_block(kind, n, x_in, x_out)`` for every block execution
    (``kind`` in prelude / core / coda, ``n`` its running index within that kind); ``on_state(name, t, h)``
    for ``x``, ``z``, ``y``; ``skip``: the running core index whose output is replaced by its input."""
    counters = {"prelude": 0, "core": 0, "coda": 0}
    handles = []

    def hook_for(kind):
        def hook(module, args, output):
            n = counters[kind]
            counters[kind] += 1
            x_in = args[0]
            if kind == "core" and skip is not None and n == skip:
                output = x_in  # skip this occurrence only
            if on_block is not None:
                on_block(kind, n, x_in, output)
            return output

        return hook

    for kind, stack in (("prelude", model.prelude), ("core", model.core.stack), ("coda", model.coda)):
        for blk in stack.blocks:
            handles.append(blk.register_forward_hook(hook_for(kind)))
    inner = model.rule
    if on_state is not None:
        model.rule = _RecordingRule(inner, on_state)
    try:
        yield counters
    finally:
        for h in handles:
            h.remove()
        model.rule = inner


def _loop_options(options: dict) -> dict | None:
    return {"grid": options["grid"]} if options.get("grid") else None


class _Sums:
    """Running sums and counts per key (to average over all tokens / sequences of all batches)."""

    def __init__(self):
        self.s: dict = {}
        self.n: dict = {}

    def add(self, key, values: torch.Tensor):
        self.s[key] = self.s.get(key, 0.0) + float(values.sum())
        self.n[key] = self.n.get(key, 0) + values.numel()

    def mean(self, key):
        return self.s[key] / self.n[key] if self.n.get(key) else None


@torch.no_grad()
def record_trajectory(
    model, batches: list[torch.Tensor], loops: int | None = None, loop_options: dict | None = None
) -> dict:
    """Block- and loop-level angles, relative update norms and variances of ``model`` at ``r = loops``
    over ``batches`` (``[B, T]`` token ids). Returns plain lists (JSON-ready); see the module docstring."""
    cfg = model.config
    r = loops or cfg.n_loops
    p, s, c = cfg.n_prelude, cfg.n_core, cfg.n_coda
    sums = _Sums()
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    for ids in batches:
        prev: dict = {}
        coda_calls: list = []

        def on_block(kind, n, x_in, x_out):
            if kind == "coda":  # keep the last c executions: the final coda (readouts may call it earlier)
                coda_calls.append((x_in, x_out))
                return
            pos = n + 1 if kind == "prelude" else p + n + 1  # effective position ℓ (1-based)
            _block_stats(sums, pos, x_in, x_out)

        def on_state(name, t, h):
            sums.add((f"V_{name}", t), token_variance(h))
            if name == "x":
                if t > 0:
                    x_prev = prev["x"]
                    sums.add(("loop_angle", t - 1), angular_distance(x_prev, h))
                    sums.add(("loop_update", t - 1), relative_update_norm(x_prev, h))
                prev["x"] = h

        with _instrumented(model, on_block=on_block, on_state=on_state):
            model(ids.to(dev), num_loops=r, loop_options=loop_options)
        for k, (x_in, x_out) in enumerate(coda_calls[len(coda_calls) - c :] if c else []):
            _block_stats(sums, p + s * r + k + 1, x_in, x_out)
    model.train(was_training)

    D = p + s * r + c
    K = cfg.n_loops
    V_x = [sums.mean(("V_x", t)) for t in range(r + 1)]
    V_z = [sums.mean(("V_z", t)) for t in range(r)]
    V_out = [sums.mean(("V_out", ell)) for ell in range(1, D + 1)]
    amp = []
    for t in range(r):
        core_out = [V_out[p + t * s + k] for k in range(s)]  # V(h_k^out) of loop t
        amp.append(amplification_factors(V_x[t], V_z[t], core_out, V_x[t + 1]))
    ref = V_x[K] if r >= K else None
    return {
        "layout": {"p": p, "s": s, "K": K, "c": c, "r": r, "effective_depth": D},
        "block_angle": [sums.mean(("block_angle", ell)) for ell in range(1, D + 1)],
        "block_update": [sums.mean(("block_update", ell)) for ell in range(1, D + 1)],
        "block_variance_in": [sums.mean(("V_in", ell)) for ell in range(1, D + 1)],
        "block_variance_out": V_out,
        "loop_angle": [sums.mean(("loop_angle", t)) for t in range(r)],  # x^t -> x^{t+1}, at (t+1)/L_tr
        "loop_update": [sums.mean(("loop_update", t)) for t in range(r)],
        "state_variance": V_x,  # V(x^t), t = 0..r, at t/L_tr
        "state_variance_normalised": [v / ref for v in V_x] if ref else None,  # Ṽ(t), Ṽ(L_tr) = 1
        "input_variance": V_z,
        "core_output_variance": [sums.mean(("V_y", t)) for t in range(r)],
        "amplification": amp,
    }


def _block_stats(sums: _Sums, pos: int, x_in: torch.Tensor, x_out: torch.Tensor) -> None:
    if not (isinstance(x_in, torch.Tensor) and x_in.dim() == 3 and x_in.shape == x_out.shape):
        return  # a rule-owned residual carrier (e.g. several streams): not a [B, T, d] state
    sums.add(("block_angle", pos), angular_distance(x_in, x_out))
    sums.add(("block_update", pos), relative_update_norm(x_in, x_out))
    sums.add(("V_in", pos), token_variance(x_in))
    sums.add(("V_out", pos), token_variance(x_out))


@torch.no_grad()
def skip_response(model, batches: list[torch.Tensor], loops: int, loop_options: dict | None = None, lags=None) -> dict:
    """``C(i, j)`` for every pair of core positions beyond the training loops, ``C(d)`` and ``C_D``
    (module docstring). ``loops`` = ``L``, the inference loop count (must exceed ``K``)."""
    cfg = model.config
    p, s, K, L = cfg.n_prelude, cfg.n_core, cfg.n_loops, loops
    if L <= K:
        raise ValueError(
            f"the skip response uses pairs beyond the {K} training loops: run it with loops > {K} (got {L})"
        )
    first = K * s  # running core index of the first occurrence beyond the training loops
    n_occ = (L - K) * s
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    num = torch.zeros(n_occ, n_occ, dtype=torch.float64)  # Σ_p ‖ũ_j − u_j‖ over all tokens  [i, j]
    base = torch.zeros(n_occ, dtype=torch.float64)  # Σ_p ‖u_j‖
    tokens = 0
    for ids in batches:
        ids = ids.to(dev)
        updates: dict[int, torch.Tensor] = {}

        def keep(kind, n, x_in, x_out, into=updates):
            if kind == "core" and n >= first:
                into[n - first] = (x_out - x_in).double()

        with _instrumented(model, on_block=keep):
            model(ids, num_loops=L, loop_options=loop_options)
        for j, u in updates.items():
            base[j] += u.norm(dim=-1).sum().cpu()
        for i in range(n_occ):
            skipped: dict[int, torch.Tensor] = {}
            with _instrumented(model, on_block=lambda kind, n, a, b: keep(kind, n, a, b, skipped), skip=first + i):
                model(ids, num_loops=L, loop_options=loop_options)
            for j in range(i + 1, n_occ):
                num[i, j] += (skipped[j] - updates[j]).norm(dim=-1).sum().cpu()
        tokens += ids.shape[0] * ids.shape[1]
    model.train(was_training)

    B = base / tokens
    pairs = []
    for i in range(n_occ):
        for j in range(i + 1, n_occ):
            C = float(num[i, j] / tokens / B[j]) if B[j] > SKIP_FLOOR else 0.0
            # effective positions and loops (1-based), r(j) = 1 + ⌊(j − p − 1)/s⌋
            pi, pj = p + first + i + 1, p + first + j + 1
            pairs.append({"i": pi, "j": pj, "lag": (j // s) - (i // s), "C": C, "B_j": float(B[j])})
    by_lag: dict[int, list[float]] = {}
    for pr in pairs:
        by_lag.setdefault(pr["lag"], []).append(pr["C"])
    lags = list(range(1, 7)) if lags is None else list(lags)
    lags = [d for d in lags if d in by_lag]
    return {
        "layout": {"p": p, "s": s, "K": K, "c": cfg.n_coda, "L": L, "effective_depth": p + s * L + cfg.n_coda},
        "lags": sorted(by_lag),
        "C_by_lag": [sum(by_lag[d]) / len(by_lag[d]) for d in sorted(by_lag)],
        "pairs_by_lag": [len(by_lag[d]) for d in sorted(by_lag)],
        "C_D": {"lags": lags, "value": lag_aggregate(pairs, lags)},
        "pairs": pairs,
    }


# ------------------------------------------------------------------------------------------------
# `looplm analyze` entries and paper-style figures
# ------------------------------------------------------------------------------------------------


def _options(options: dict) -> tuple[int | None, dict | None]:
    loops = options.get("loops")
    return (int(loops) if loops else None), _loop_options(options)


def _plot(name: str, draw, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = draw(plt)
    path = Path(out_dir) / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _loop_axis(res: dict, n: int, offset: int) -> list[float]:
    K = res["layout"]["K"]
    return [(t + offset) / K for t in range(n)]


def _plot_angles(res, out_dir):
    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        a.plot(range(1, len(res["block_angle"]) + 1), res["block_angle"], marker=".")
        a.set(xlabel="effective depth ℓ", ylabel="block angle A_ℓ", ylim=(0, None), title="block")
        b.plot(_loop_axis(res, len(res["loop_angle"]), 1), res["loop_angle"], marker="o")
        b.axvline(1.0, color="gray", ls="--", lw=0.8)
        b.set(xlabel="(t+1) / L_tr", ylabel="loop angle A^(t)", ylim=(0, None), title="loop")
        return fig, (a, b)

    return _plot("angular-distance", draw, out_dir)


@register_analysis(
    "angular-distance",
    plot=_plot_angles,
    help="normalised angular distance per block (effective depth) and per loop",
    options=("grid",),
)
def analyze_angular_distance(model, batches, options) -> dict:
    loops, lopts = _options(options)
    tr = record_trajectory(model, batches, loops, lopts)
    return {"layout": tr["layout"], "block_angle": tr["block_angle"], "loop_angle": tr["loop_angle"]}


def _plot_update(res, out_dir):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.plot(_loop_axis(res, len(res["loop_update"]), 1), res["loop_update"], marker="o")
        ax.axvline(1.0, color="gray", ls="--", lw=0.8)
        ax.set(xlabel="(t+1) / L_tr", ylabel="relative update norm ρ^(t)", yscale="log")
        return fig, ax

    return _plot("update-norm", draw, out_dir)


@register_analysis(
    "update-norm",
    plot=_plot_update,
    help="relative update norm per loop and per block (means of per-sequence ratios)",
    options=("grid",),
)
def analyze_update_norm(model, batches, options) -> dict:
    loops, lopts = _options(options)
    tr = record_trajectory(model, batches, loops, lopts)
    return {"layout": tr["layout"], "loop_update": tr["loop_update"], "block_update": tr["block_update"]}


def _plot_variance(res, out_dir):
    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        v = res["state_variance_normalised"] or res["state_variance"]
        a.plot(_loop_axis(res, len(v), 0), v, marker="o")
        a.axvline(1.0, color="gray", ls="--", lw=0.8)
        a.set(xlabel="t / L_tr", ylabel="Ṽ(t)" if res["state_variance_normalised"] else "V(x^(t))", yscale="log")
        t = range(len(res["amplification"]))
        a_in = [f["injection"] for f in res["amplification"]]
        a_core = [math.prod(f["blocks"]) for f in res["amplification"]]
        a_mix = [f["mixing"] for f in res["amplification"]]
        b.plot(t, a_in, marker="o", label="injection V(z)/V(x)")
        b.plot(t, a_core, marker="s", label="core V(y)/V(z)")
        b.plot(t, a_mix, marker="^", label="mixing V(x')/V(y)")
        b.set(xlabel="loop t", ylabel="amplification factor", yscale="log")
        b.legend(fontsize=7)
        return fig, (a, b)

    return _plot("state-variance", draw, out_dir)


@register_analysis(
    "state-variance",
    plot=_plot_variance,
    help="within-token feature variance, normalised at L_tr, and amplification factors",
    options=("grid",),
)
def analyze_state_variance(model, batches, options) -> dict:
    loops, lopts = _options(options)
    tr = record_trajectory(model, batches, loops, lopts)
    keep = (
        "layout",
        "state_variance",
        "state_variance_normalised",
        "input_variance",
        "core_output_variance",
        "block_variance_in",
        "block_variance_out",
        "amplification",
    )
    return {k: tr[k] for k in keep}


def _plot_skip(res, out_dir):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.plot(res["lags"], [max(c, 1e-12) for c in res["C_by_lag"]], marker="o")
        ax.set(
            xlabel="loop lag d",
            ylabel="skip response C(d)",
            yscale="log",
            title=f"L = {res['layout']['L']} (D = {res['layout']['effective_depth']})",
        )
        return fig, ax

    return _plot("skip-response", draw, out_dir)


@register_analysis(
    "skip-response",
    plot=_plot_skip,
    help="skip response C(d) over loop lags beyond the training loops, and C_D",
    options=("grid", "lags"),
)
def analyze_skip_response(model, batches, options) -> dict:
    loops, lopts = _options(options)
    K = model.config.n_loops
    if not loops or loops <= K:
        loops = 2 * K  # the paper's D = 56 for 4 × 7 (L = 14)
    return skip_response(model, batches, loops, lopts, lags=options.get("lags"))
