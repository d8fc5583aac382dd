"""StateLoop: a persistent per-token state carried across loop iterations (StateLoop paper, §3).

Notation of the paper: backbone ``T`` (the shared core), width ``d``, state width ``d_s``, ``K`` loop
iterations indexed ``k = 0 … K−1``; ``H^k [n, d]`` is the backbone output at iteration ``k`` and
``S^k [n, d_s]`` the state after ``k`` updates.

.. code-block:: text

    E = √d·Embed(x),  S^0 = 0,  H^0 = T(E)                                           (1)
    U^k = RMSNorm_h(H^k)                                                             (2)
    S̃^{k+1} = V_φ(S^k, U^k),  S^{k+1} = X_ψ(S̃^{k+1}),  N^{k+1} = RMSNorm_s(S^{k+1})   (3)
    Z^{k+1} = H^k + N^{k+1} W_{s→z}ᵀ,  H^{k+1} = T(Z^{k+1})      for k ≤ K−2            (4)
    P^k = U^k W_uᵀ                                                                   (5)
    Δ^k = softplus(U^k W_Δᵀ + b_Δ),  λ = exp(A_log)
    S̃^{k+1} = exp(−λ⊙Δ^k) ⊙ S^k + (1 − exp(−λ⊙Δ^k)) ⊙ P^k     (selective SSM, V_φ)     (6)
    X_id(S̃) = S̃                                                                     (7)
    X_attn(S̃) = S̃ + CausalAttention(RMSNorm_m(S̃))                                   (8)
    X_mamba(S̃) = Mamba2Block(S̃) = S̃ + Mamba2(RMSNorm_m(S̃))                          (9)
    Y = H^{K−1} + N^K W_{s→out}ᵀ  → LM head                                          (10)

The retention gate is ``g^k = exp(−λ⊙Δ^k)``, the write gate ``η^k = 1 − g^k``; at initialisation
(``W_Δ = 0``, ``b_Δ = log(e^0.3 − 1)``, ``λ`` log-spaced 0.01 … 4 over channels) ``Δ = 0.3`` and the
write rate of channel ``c`` is ``η_c = 1 − exp(−0.3 λ_c)``.

Variants (§4.5, Tab. 4), all options of :class:`StateLoop` except the last:

* ``update="gru"``: ``S̃^{k+1} = GRU(P^k, S^k)`` (Cho et al. 2014) on the same ``P^k``, feedback and
  readout unchanged (``6 d_s² + 6 d_s`` parameters instead of ``W_Δ, b_Δ, A_log``);
* ``reset=True``: the previous state is zeroed before every update, ``S^{k+1} = η^k ⊙ P^k`` (eq. 14);
* ``d_s`` (default ``d``): the state width (Fig. 3: 128 … 1024 at ``d = 1024``);
* ``mixer``: ``identity`` (eq. 7), ``attention`` (eq. 8; heads of ``mixer_head_dim`` with their own RoPE
  tables, no FFN) or ``mamba2`` (eq. 9), one module shared across iterations with its own decoding
  slot per iteration;
* :class:`StateOnlyLoop` (rule ``stateloop-state-only``, eq. 13): the gated state at backbone width is
  the next backbone input, replacing the direct path.

Inference at ``r ≠ K`` loops: the same recurrence runs ``r`` times and the readout (eq. 10) is taken at
the last executed iteration, ``Y = H^{r−1} + N^r W_{s→out}ᵀ``.

Optimizer: the paper names no optimizer (its peak learning rates, 2e-4 / 3e-4, are AdamW-style). The
selective-update parameters ``W_Δ``, ``b_Δ`` and ``A_log`` are gate / rate parameters with a stated
initialisation, so they are marked ``_no_muon`` and go to AdamW (``b_Δ``, ``A_log`` also without weight
decay); the projections ``W_u``, ``W_{s→z}``, ``W_{s→out}``, the GRU and the mixers' matrices are
ordinary hidden matrices and go to Muon when a Muon recipe is used.

Interventions (§5, :mod:`looplm.analysis.interventions`) go through ``loop_options``:

* ``read_scale``: a sequence of ``K`` numbers multiplying the projected state reads
  ``R_1 … R_{K−1}`` (feedback, eq. 4, read ``R_{k+1}`` enters ``Z^{k+1}``) and ``R_K`` (terminal, eq. 10);
  0 masks a read. With ``r ≠ K`` loops the list must have ``r`` entries;
* ``state_hook``: ``fn(j, S^j) -> S^j`` called on every new state ``S^j`` (``j = k + 1``, after the
  mixer), to record, replace or freeze states.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.residual import ResidualMixer
from .base import RecurrenceRule, register_rule

UPDATES = ("ssm", "gru")
MIXERS = ("identity", "attention", "mamba2")


def _loglinear_lambda(n: int, lo: float, hi: float) -> torch.Tensor:
    """``λ_c`` log-spaced from ``lo`` to ``hi`` over ``n`` channels: ``[n]``."""
    if n == 1:
        return torch.tensor([lo])
    return torch.logspace(math.log10(lo), math.log10(hi), n)


class SelectiveUpdate(nn.Module):
    """The selective-SSM update ``V_φ`` of eq. 6 (also the Cell of eq. 13).

    ``Δ = softplus(U W_Δᵀ + b_Δ)``, ``g = exp(−λ⊙Δ)``, ``S̃ = g ⊙ S + (1 − g) ⊙ P``. ``U [.., d_in]``,
    ``S, P [.., d_s]``. ``W_Δ ∈ R^{d_s×d_in}``, ``b_Δ, A_log ∈ R^{d_s}``.
    """

    def __init__(self, d_in: int, d_s: int, *, init_delta: float = 0.3, lambda_range: Sequence[float] = (0.01, 4.0)):
        super().__init__()
        self.init_delta, self.lambda_range = float(init_delta), (float(lambda_range[0]), float(lambda_range[1]))
        self.W_delta = nn.Linear(d_in, d_s, bias=False)
        self.b_delta = nn.Parameter(torch.empty(d_s))
        self.A_log = nn.Parameter(torch.empty(d_s))
        self.W_delta.weight._no_muon = True  # gate parameters: AdamW (see the module docstring)
        for p in (self.b_delta, self.A_log):
            p._no_muon = True
            p._no_weight_decay = True
        self.looplm_init()

    @torch.no_grad()
    def looplm_init(self) -> None:
        """``W_Δ = 0``, ``b_Δ = log(e^Δ0 − 1)`` (so ``Δ = Δ0 = 0.3``), ``λ = exp(A_log)`` log-spaced (§3.2)."""
        if self.A_log.is_meta:
            return
        nn.init.zeros_(self.W_delta.weight)
        self.b_delta.fill_(math.log(math.expm1(self.init_delta)))
        self.A_log.copy_(torch.log(_loglinear_lambda(self.A_log.numel(), *self.lambda_range)))

    def gates(self, U: torch.Tensor) -> torch.Tensor:
        """Retention gate ``g = exp(−λ⊙Δ)`` ``[.., d_s]`` from ``U [.., d_in]``."""
        delta = F.softplus(F.linear(U, self.W_delta.weight, self.b_delta))  # Δ^k = softplus(U W_Δᵀ + b_Δ)
        return torch.exp(delta * -torch.exp(self.A_log))

    def forward(self, S: torch.Tensor | None, U: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
        g = self.gates(U)
        if S is None:  # reset state (eq. 14): η ⊙ P
            return (1 - g) * P
        # g ⊙ S + (1 − g) ⊙ P in one kernel, in the state's dtype (fp32 under autocast, like the residual stream)
        return torch.lerp(P.to(S.dtype), S, g.to(S.dtype))


class GRUUpdate(nn.Module):
    """GRU update (Cho et al. 2014) of the state ``S`` with input ``P`` (Tab. 4 "StateLoop (GRU)")::

        r = σ(W_ir P + b_ir + W_hr S + b_hr),   z = σ(W_iz P + b_iz + W_hz S + b_hz)
        n = tanh(W_in P + b_in + r ⊙ (W_hn S + b_hn)),   S̃ = (1 − z) ⊙ n + z ⊙ S

    ``6 d_s² + 6 d_s`` parameters (the count of Tab. 4: 416.34M − 411.10M + the SSM update's).
    """

    def __init__(self, d_s: int):
        super().__init__()
        self.W_i = nn.Linear(d_s, 3 * d_s, bias=True)  # [W_ir; W_iz; W_in]
        self.W_h = nn.Linear(d_s, 3 * d_s, bias=True)  # [W_hr; W_hz; W_hn]

    def forward(self, S: torch.Tensor | None, U: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
        if S is None:  # reset state: the previous state is zero
            S = torch.zeros_like(P)
        ir, iz, in_ = self.W_i(P).chunk(3, dim=-1)  # each [.., d_s]
        hr, hz, hn = self.W_h(S).chunk(3, dim=-1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * S


def _check(cond: bool, msg: str, errs: list[str]) -> None:
    if not cond:
        errs.append(msg)


def _option_errors(o: dict) -> list[str]:
    """Value checks of the StateLoop options present in ``o`` (unknown keys are checked by the base class)."""
    errs: list[str] = []
    if "d_s" in o:
        _check(
            isinstance(o["d_s"], int) and o["d_s"] >= 0,
            f"options.d_s: the state width must be an int >= 0 (0 = d_model), got {o['d_s']!r}",
            errs,
        )
    if "update" in o:
        _check(o["update"] in UPDATES, f"options.update: must be one of {list(UPDATES)}, got {o['update']!r}", errs)
    if "mixer" in o:
        _check(o["mixer"] in MIXERS, f"options.mixer: must be one of {list(MIXERS)}, got {o['mixer']!r}", errs)
    for k in (
        "mixer_head_dim",
        "mamba_expand",
        "mamba_d_state",
        "mamba_d_conv",
        "mamba_headdim",
        "mamba_ngroups",
        "mamba_chunk_size",
    ):
        if k in o:
            _check(isinstance(o[k], int) and o[k] >= 1, f"options.{k}: must be an int >= 1, got {o[k]!r}", errs)
    if "init_delta" in o:
        _check(
            isinstance(o["init_delta"], (int, float)) and o["init_delta"] > 0,
            f"options.init_delta: Δ at init must be > 0, got {o['init_delta']!r}",
            errs,
        )
    if "lambda_range" in o:
        lr = o["lambda_range"]
        ok = (
            isinstance(lr, (list, tuple))
            and len(lr) == 2
            and all(isinstance(v, (int, float)) for v in lr)
            and 0 < lr[0] <= lr[1]
        )
        _check(ok, f"options.lambda_range: must be [lo, hi] with 0 < lo <= hi, got {lr!r}", errs)
    return errs


@register_rule("stateloop")
class StateLoop(RecurrenceRule):
    """StateLoop (eqs. 1–12) with its update, persistence, width and mixer variants (module docstring).

    Options: ``d_s`` (0 = ``d``), ``update`` (``ssm`` | ``gru``), ``reset`` (eq. 14), ``mixer``
    (``identity`` | ``attention`` | ``mamba2``), ``mixer_head_dim`` (attention: ``d_s / mixer_head_dim``
    heads), ``mamba_*`` (the Mamba-2 mixer: expand, d_state, d_conv, headdim, ngroups, chunk_size),
    ``init_delta`` (Δ at init, 0.3) and ``lambda_range`` ((0.01, 4)).
    """

    interventions = ("read_scale", "state_hook")  # loop_options understood (looplm.analysis.interventions)
    loop_options = interventions

    def __init__(
        self,
        cfg,
        *,
        d_s: int = 0,
        update: str = "ssm",
        reset: bool = False,
        mixer: str = "identity",
        mixer_head_dim: int = 64,
        mamba_expand: int = 2,
        mamba_d_state: int = 128,
        mamba_d_conv: int = 4,
        mamba_headdim: int = 64,
        mamba_ngroups: int = 8,
        mamba_chunk_size: int = 64,
        init_delta: float = 0.3,
        lambda_range: Sequence[float] = (0.01, 4.0),
    ):
        super().__init__(cfg)
        d = cfg.d_model
        ds = d_s or d
        self.d_s, self.update_kind, self.reset, self.mixer_kind = ds, update, bool(reset), mixer
        errs = _option_errors(
            dict(
                d_s=d_s,
                update=update,
                mixer=mixer,
                mixer_head_dim=mixer_head_dim,
                init_delta=init_delta,
                lambda_range=list(lambda_range),
            )
        )
        if mixer == "attention" and mixer_head_dim >= 1:
            _check(ds % mixer_head_dim == 0, f"options.mixer_head_dim: {mixer_head_dim} does not divide d_s={ds}", errs)
        if mixer == "mamba2":
            d_inner = mamba_expand * ds
            _check(
                d_inner % mamba_headdim == 0,
                f"options.mamba_headdim: {mamba_headdim} does not divide mamba_expand*d_s={d_inner}",
                errs,
            )
            nheads = d_inner // max(mamba_headdim, 1)
            _check(
                nheads % max(mamba_ngroups, 1) == 0,
                f"options.mamba_ngroups: {mamba_ngroups} does not divide the mixer's {nheads} heads",
                errs,
            )
        if errs:
            raise ValueError("stateloop rule: " + "; ".join(errs))

        self.norm_h = nn.RMSNorm(d, eps=cfg.norm_eps)  # RMSNorm_h (eq. 2)
        self.W_u = nn.Linear(d, ds, bias=False)  # eq. 5
        if update == "ssm":
            self.update = SelectiveUpdate(d, ds, init_delta=init_delta, lambda_range=lambda_range)  # eq. 6
        else:
            self.update = GRUUpdate(ds)
        self.norm_s = nn.RMSNorm(ds, eps=cfg.norm_eps)  # RMSNorm_s (eq. 3), shared by both reads
        self.W_sz = nn.Linear(ds, d, bias=False)  # feedback read (eq. 4)
        self.W_out = nn.Linear(ds, d, bias=False)  # terminal read (eq. 10)
        if mixer == "attention":
            H = ds // mixer_head_dim
            self.rope_dims = (mixer_head_dim,)  # the model builds rotary tables for the mixer's head dim
            self.mixer = ResidualMixer(
                ds, Attention(ds, H, H, mixer_head_dim, norm_eps=cfg.norm_eps, rotary_dim=mixer_head_dim), cfg.norm_eps
            )
        elif mixer == "mamba2":
            m = Mamba2Mixer(
                ds,
                expand=mamba_expand,
                d_state=mamba_d_state,
                d_conv=mamba_d_conv,
                headdim=mamba_headdim,
                ngroups=mamba_ngroups,
                chunk_size=mamba_chunk_size,
                norm_eps=cfg.norm_eps,
            )
            self.mixer = ResidualMixer(ds, m, cfg.norm_eps)
        else:
            self.mixer = None  # X_id (eq. 7): nothing kept across tokens while decoding

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        return super().validate_options(options) + _option_errors(options)

    # --- the loop protocol -----------------------------------------------------------------------
    def begin(self, h0, lctx):
        """``S^0 = 0`` ``[B, T, d_s]``; ``Z^0 = h0`` (= E without a prelude, so ``H^0 = T(E)``, eq. 1)."""
        return {"h": h0, "S": h0.new_zeros(*h0.shape[:-1], self.d_s)}

    def _read_scale(self, lctx, j: int):
        """The multiplier of read ``R_j`` (1-based) from ``loop_options['read_scale']`` (None = 1)."""
        scales = lctx.loop_options.get("read_scale")
        if scales is None:
            return None
        if len(scales) != lctx.num_loops:
            raise ValueError(
                f"loop_options['read_scale'] needs one entry per read, {lctx.num_loops}, got {len(scales)}"
            )
        return scales[j - 1]

    def read(self, W: nn.Linear, state: dict, lctx, j: int) -> torch.Tensor:
        """``H + R_j`` with the projected state read ``R_j = N^j Wᵀ`` ``[B, T, d]`` (eq. 4 with ``W_{s→z}``,
        eq. 10 with ``W_{s→out}``), ``N^j = RMSNorm_s(S^j)``."""
        R = W(self.norm_s(state["S"]))
        s = self._read_scale(lctx, j)
        return state["h"] + (R if s is None else R * s)

    def update_state(self, S: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``S̃^{k+1}`` from ``S^k`` and ``H^k``: ``U = RMSNorm_h(H)`` (eq. 2), ``P = U W_uᵀ`` (eq. 5), then the
        selective update (eq. 6), its reset form (eq. 14) or the GRU."""
        U = self.norm_h(h)  # U^k (eq. 2)
        P = self.W_u(U)  # P^k (eq. 5)
        return self.update(None if self.reset else S, U, P)  # S̃^{k+1} (eqs. 6, 14, GRU)

    def next_input(self, state, lctx):
        k = lctx.iteration
        if k == 0:
            return state["h"]  # Z^0: T(E) at the first iteration (eq. 1)
        return self.read(self.W_sz, state, lctx, k)  # Z^k = H^{k−1} + N^k W_{s→z}ᵀ (eq. 4)

    def step(self, state, h, lctx):
        S = self.update_state(state["S"], h)  # S̃^{k+1}
        if self.mixer is not None:  # X_ψ, its own decoding slot per iteration (eqs. 8, 9)
            slot = lctx.loop_slot(
                "stateloop-mixer", lambda: self.mixer.new_cache(lctx.cache.batch_size, lctx.cache.capacity)
            )
            S = self.mixer(S, lctx.fctx, slot)
        hook = lctx.loop_options.get("state_hook")
        if hook is not None:
            S = hook(lctx.iteration + 1, S)  # S^{k+1}
        return {"h": h, "S": S}

    def loop_slot_mixers(self):
        return [] if self.mixer is None else [self.mixer.mixer]  # X_ψ's slot per iteration (eqs. 8, 9)

    def finish(self, state, lctx):
        """``Y = H^{r−1} + N^r W_{s→out}ᵀ`` (eq. 10) at the last executed iteration ``r``."""
        return self.read(self.W_out, state, lctx, lctx.num_loops)

    # --- introspection ---------------------------------------------------------------------------
    def write_rate(self, U: torch.Tensor | None = None) -> torch.Tensor:
        """Write gate ``η = 1 − exp(−λ⊙Δ)`` of the SSM update: per channel at ``U = 0`` (``[d_s]``, the
        initial ``1 − exp(−0.3 λ_c)``), or per token for a given ``U [.., d]``."""
        if self.update_kind != "ssm":
            raise ValueError("write_rate is defined for the selective-SSM update (update='ssm')")
        if U is None:
            U = self.W_u.weight.new_zeros(self.W_u.in_features)
        return 1 - self.update.gates(U)

    def extra_repr(self) -> str:
        return f"rule='stateloop', d_s={self.d_s}, update={self.update_kind!r}, reset={self.reset}, mixer={self.mixer_kind!r}"


@register_rule("stateloop-state-only")
class StateOnlyLoop(RecurrenceRule):
    """State-only feedback (StateLoop eq. 13, Tab. 4 "State only"): the gated state replaces the direct path.

    .. code-block:: text

        X^0 = 0,  H^0 = T(E)
        X^{k+1} = Cell(H^k, X^k),  Z^{k+1} = X^{k+1},  H^{k+1} = T(Z^{k+1})     k = 0 … K−2
        Y = H^{K−1}

    Cell is the selective-SSM update of eq. 6 at backbone width ``d`` with ``H^k`` as its input:
    ``P = H W_uᵀ``, ``Δ = softplus(H W_Δᵀ + b_Δ)``, ``X^{k+1} = g⊙X^k + (1 − g)⊙P``. Reading "``H^k`` as
    its input" literally — no RMSNorm_h, no readout projection — gives ``2d² + 2d`` parameters, exactly
    Tab. 4's 409.00M − 406.90M. Initialisation as eq. 6 (``Δ = 0.3``, ``λ`` log-spaced 0.01 … 4). The
    prediction reads the last backbone output ``H^{r−1}`` (at any ``r``).
    """

    interventions = ("state_hook",)  # X^j for j = 1 … r−1 (X^r is never computed)
    loop_options = interventions

    def __init__(self, cfg, *, init_delta: float = 0.3, lambda_range: Sequence[float] = (0.01, 4.0)):
        super().__init__(cfg)
        d = cfg.d_model
        self.W_u = nn.Linear(d, d, bias=False)
        self.update = SelectiveUpdate(d, d, init_delta=init_delta, lambda_range=lambda_range)

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        return super().validate_options(options) + _option_errors(options)

    def begin(self, h0, lctx):
        return {"h": h0, "X": torch.zeros_like(h0)}

    def next_input(self, state, lctx):
        return state["h"] if lctx.iteration == 0 else state["X"]  # Z^0 = E, Z^{k+1} = X^{k+1}

    def step(self, state, h, lctx):
        if lctx.is_last:  # X^K is never read (Y = H^{K−1})
            return {**state, "h": h}
        X = self.update(state["X"], h, self.W_u(h))  # Cell(H^k, X^k)
        hook = lctx.loop_options.get("state_hook")
        if hook is not None:
            X = hook(lctx.iteration + 1, X)
        return {"h": h, "X": X}
