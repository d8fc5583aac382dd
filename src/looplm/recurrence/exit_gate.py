"""Exit gate with output selection (Looped-Mamba paper, §3.1 "Exit-gated inference", App. B, E.5, E.6).

A linear gate reads each recurrent step's hidden state ``h_i^(r)`` (the core output ``H^k``,
``r = k + 1``) and predicts the instantaneous exit probability (App. B)::

    λ_i^(r) = σ(Linear_φ(h_i^(r)))                 r = 1..R−1       (bias initialised to −2.0, App. E.5)
    S_i^(0) = 1,   S_i^(r) = Π_{j<=r} (1 − λ_i^(j))                    survival
    π_i^(r) = λ_i^(r) S_i^(r−1)                    r = 1..R−1       (eq. 1)
    π_i^(R) = S_i^(R−1)                                              remainder on the last step

(implemented as ``λ^(R) := 1``, so ``Σ_r π^(r) = 1`` exactly and ``CDF(R) = 1`` exactly; ``R`` is the
loop count of the forward — per row when depths are given per sequence.)

**Stage 1** (App. B, entropy-regularised expected loss, ``stage: 1``)::

    L_stage1 = 1/M Σ_i ( Σ_r π_i^(r) ℓ_i^(r) − β H_i ),   H_i = −Σ_r π_i^(r) log(π_i^(r) + ε),   β = 0.25

with ``ℓ_i^(r)`` the next-token loss of the readout of step ``r`` (``lctx.readout``: coda, final norm,
head) and ``M`` the valid (non-ignored) positions. The final-loop LM loss is not used
(``lm_loss_weight = 0``): the objective is the auxiliary loss.

**Expected logits** (``objective: expected_logits``, stage 1 only; the training loss of Ouro's released
modelling code)::

    L = 1/M Σ_i CE( Σ_r π_i^(r) z_i^(r),  y_i ) − β/M Σ_i H_i        z^(r): the readout logits of step r

**Stage 2** (App. B eq. 2, focused gate training, ``stage: 2``; backbone, embeddings, norm and head
frozen by the trainer's ``train.freeze``)::

    I_i^(r) = max(0, sg(ℓ_i^(r)) − sg(ℓ_i^(r+1))),    w_i^(r) = σ(κ (I_i^(r) − γ))     κ = 50, γ = 0.005
    L_stage2 = 1/(R−1) Σ_{r<R} 1/M Σ_i BCE(1 − λ_i^(r), w_i^(r))

(the per-step losses are computed without autograd and the gate reads a detached ``h`` in this stage,
so its backward never enters the backbone).

**Threshold inference** (App. B): ``z_i(q) = min{r : CDF_i(r) >= q}``, ``CDF_i(r) = Σ_{j<=r} π_i^(j)``;
``q`` is the rule option ``threshold`` or ``loop_options={"exit_threshold": q}`` per forward. The
comparison is made on the survival, ``CDF(r) >= q  ⟺  log S^(r) <= log(1 − q)``, with
``log S^(r) = Σ_{j<=r} log σ(−g^(j))`` summed in float64 (``−∞`` at ``R``, where ``λ^(R) := 1``). So
``z(1.0) = R`` and ``z(q → 0) = 1`` whatever the gate's saturation: ``1 − S`` in float32 reaches 1.0 once
``S < 6e-8`` (a gate bias of +10 selected step 2 at q = 1.0) and stays 0.0 while ``λ < 6e-8`` (a bias of
−20 missed step 1 at any tiny q).
**Ouro's gate** (options ``gate_norm`` and ``inter_norm``, both reading the model's final RMSNorm ``N``,
``lctx.final_norm``, with its weights): the gate reads the normed state, ``λ^(r) = σ(Linear_φ(N(h^(r))))``,
and the next step reads ``N(h^(r))`` instead of ``h^(r)`` (``Z^k = N(H^{k−1})`` for ``k >= 1``, ``Z^0 = h_0``);
the head still reads ``N(h^(z))`` through the model's own final norm, so every step's logits are
``head(N(h^(r)))`` as in Ouro (its norm at the end of every recurrent step feeds the next one).
Output-selection semantics (§3.1): in a forward **all R steps run** (every SSM / KV state chain stays
complete), the gate only picks whose hidden state reaches the head. The selected depth ("Iter") is
therefore no compute saving; the executed depth is the forward's loop count. Decoding that stops a
token's loop at its exit (and fills the state of the loops it skips) is :mod:`looplm.decode.token_schedule`; it
reads the gate through :meth:`ExitGate.exit_log_survival` (the ``gate`` criterion of :mod:`looplm.decode.exits`)
and ends a token's selection with :meth:`ExitGate.exit_rows`. After every forward
:attr:`ExitGate.last_exit` holds the per-token selected depth, expected exit step
``s_i = Σ_r r π_i^(r)`` and exit entropy ``H_i`` (detached), and :meth:`ExitGate.exit_summary` their
means over real tokens next to the executed depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LoopContext, RecurrenceRule, register_rule


@register_rule("exit_gate")
class ExitGate(RecurrenceRule):
    """Vanilla recurrence ``h^(r) = M_θ(h^(r−1))`` plus a per-token exit gate (see module docstring).

    Options: ``stage`` (1: expected loss − β·entropy; 2: improvement-target BCE), ``beta``, ``kappa``,
    ``gamma``, ``bias_init``, ``threshold`` (default ``q`` for inference), ``entropy_eps`` (the ε in
    ``log(π + ε)``, App. E.5); ``objective`` (stage 1: ``expected_loss`` Σ π ℓ, or ``expected_logits``
    CE(Σ π z), Ouro's), ``gate_norm`` (the gate reads ``N(h)``) and ``inter_norm`` (the next step reads ``N(h)``).
    """

    loop_options = ("exit_threshold",)  # q per forward, instead of the option `threshold`

    def __init__(
        self,
        cfg,
        *,
        stage: int = 1,
        beta: float = 0.25,
        kappa: float = 50.0,
        gamma: float = 0.005,
        bias_init: float = -2.0,
        threshold: float = 1.0,
        entropy_eps: float = 1e-10,
        objective: str = "expected_loss",
        gate_norm: bool = False,
        inter_norm: bool = False,
    ):
        super().__init__(cfg)
        if stage not in (1, 2):
            raise ValueError(f"exit_gate option stage must be 1 or 2, got {stage!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"exit_gate option objective must be one of {list(OBJECTIVES)}, got {objective!r}")
        _check_threshold(threshold, "exit_gate option threshold")
        self.stage, self.beta, self.kappa, self.gamma = stage, float(beta), float(kappa), float(gamma)
        self.bias_init, self.threshold, self.entropy_eps = float(bias_init), float(threshold), float(entropy_eps)
        self.objective, self.gate_norm, self.inter_norm = objective, bool(gate_norm), bool(inter_norm)
        self.gate = nn.Linear(cfg.d_model, 1)  # Linear_φ
        self.gate.weight._no_muon = True  # the gate is a vector: AdamW, as in the paper (Tab. 10, 11)
        self.lm_loss_weight = 0.0  # both stages' objectives are the auxiliary loss
        self.last_exit: dict | None = None

    @classmethod
    def validate_options(cls, options: dict) -> list[str]:
        errs = super().validate_options(options)
        if options.get("stage", 1) not in (1, 2):
            errs.append(f"options.stage: must be 1 or 2, got {options.get('stage')!r}")
        q = options.get("threshold", 1.0)
        if not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            errs.append(f"options.threshold: must be a number in [0, 1], got {q!r}")
        for k in ("beta", "gamma", "entropy_eps"):
            if k in options and (not isinstance(options[k], (int, float)) or options[k] < 0):
                errs.append(f"options.{k}: must be a number >= 0, got {options[k]!r}")
        if "kappa" in options and (not isinstance(options["kappa"], (int, float)) or options["kappa"] <= 0):
            errs.append(f"options.kappa: must be a number > 0, got {options['kappa']!r}")
        obj = options.get("objective", "expected_loss")
        if obj not in OBJECTIVES:
            errs.append(f"options.objective: must be one of {list(OBJECTIVES)}, got {obj!r}")
        elif obj == "expected_logits" and options.get("stage", 1) != 1:
            errs.append("options.objective: expected_logits is a stage-1 objective (stage 2 trains the gate by BCE)")
        for k in ("gate_norm", "inter_norm"):
            if k in options and not isinstance(options[k], bool):
                errs.append(f"options.{k}: must be true or false, got {options[k]!r}")
        return errs

    def looplm_init(self):
        nn.init.constant_(self.gate.bias, self.bias_init)  # conservative initial exit probability σ(−2) ≈ 0.12

    # ------------------------------------------------------------------------------------------
    def begin(self, h0: torch.Tensor, lctx: LoopContext) -> dict:
        B, T, _ = h0.shape
        f32 = dict(device=h0.device, dtype=torch.float32)
        state = {
            "h": h0,
            "S": torch.ones(B, T, **f32),  # S^(r−1)
            "sel": torch.zeros_like(h0),  # h^(z_i(q)) once chosen
            "chosen": torch.zeros(B, T, dtype=torch.bool, device=h0.device),
            "depth": torch.zeros(B, T, dtype=torch.long, device=h0.device),  # z_i(q)
            "log_S": torch.zeros(B, T, dtype=torch.float64, device=h0.device),  # log S^(r−1), for the selection
            "exp_step": torch.zeros(B, T, **f32),  # Σ r π^(r)
            "entropy": torch.zeros(B, T, **f32),  # −Σ π log(π + ε)
        }
        if lctx.targets is not None:
            if self.stage == 1 and self.objective == "expected_logits":
                state["exp_logits"] = None  # Σ_r π^(r) z^(r)  [B, T, V], from the first step on
                state["exp_ent"] = torch.zeros(B, T, **f32)  # H with its gradient (for − β H)
            elif self.stage == 1:
                state["exp_loss"] = torch.zeros(B, T, **f32)  # Σ_r π^(r) ℓ^(r) − β H (per token)
            else:
                state.update(
                    bce=torch.zeros(B, T, **f32),
                    n_bce=torch.zeros(B, T, **f32),
                    prev_logit=torch.zeros(B, T, **f32),
                    prev_loss=torch.zeros(B, T, **f32),
                )
        return state

    def _last_step(self, lctx: LoopContext, batch: int, device) -> torch.Tensor:
        """``[B, 1]`` bool: this iteration is the row's last (it takes the remainder π^(R) = S^(R−1))."""
        if lctx.loops_per_row is None:
            return torch.full((batch, 1), lctx.is_last, dtype=torch.bool, device=device)
        return (lctx.loops_per_row == lctx.iteration + 1).view(batch, 1)

    def _token_loss(self, h: torch.Tensor, lctx: LoopContext) -> torch.Tensor:
        """``ℓ^(r)`` ``[B, T]``: next-token loss of this step's readout (0 where the target is ignored)."""
        logits = lctx.readout(h)  # [B, T, V]
        B, T, V = logits.shape
        return F.cross_entropy(
            logits.reshape(B * T, V).float(), lctx.targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(B, T)

    def next_input(self, state: dict, lctx: LoopContext) -> torch.Tensor:
        """``Z^k``: ``h^(k)``, or ``N(h^(k))`` with ``inter_norm`` (Ouro; ``Z^0 = h_0`` either way)."""
        if self.inter_norm and lctx.iteration > 0:
            return lctx.final_norm(state["h"])  # [B, T, d]
        return state["h"]

    def gate_logit(self, h: torch.Tensor, lctx: LoopContext) -> torch.Tensor:
        """``g = Linear_φ(h)`` ``[B, T]`` (fp32) from the step's hidden state ``h [B, T, d]`` (λ = σ(g));
        ``Linear_φ(N(h))`` with ``gate_norm`` (Ouro)."""
        return self.gate(lctx.final_norm(h) if self.gate_norm else h).squeeze(-1).float()

    def step(self, state: dict, h: torch.Tensor, lctx: LoopContext) -> dict:
        B = h.shape[0]
        r = lctx.iteration + 1
        # stage 2 trains φ only (App. E.6): the gate reads a detached h, so nothing backpropagates into the backbone
        u = h.detach() if self.stage == 2 and lctx.targets is not None else h
        g = self.gate_logit(u, lctx)  # [B, T]
        last = self._last_step(lctx, B, h.device)  # [B, 1]
        lam = torch.where(last, torch.ones_like(g), torch.sigmoid(g))  # λ^(r); λ^(R) := 1 (remainder)
        S_prev = state["S"]
        pi = lam * S_prev  # π^(r) = λ^(r) S^(r−1)       (eq. 1)
        S = S_prev * (1.0 - lam)  # S^(r); exactly 0 after the last step
        # log S^(r) = log S^(r−1) + log σ(−g^(r)) in float64, −∞ at the last step: CDF(r) >= q ⟺ log S^(r) <= log(1 − q)
        log_S = state["log_S"] + torch.where(last, float("-inf"), F.logsigmoid(-g.detach().double()))
        q = _check_threshold(lctx.loop_options.get("exit_threshold", self.threshold), "exit_threshold")
        pick = ~state["chosen"] & reaches(log_S, q)  # z_i(q) = min{r : CDF_i(r) >= q}
        new = {
            **state,
            **_select(state, pick, h, r),
            "h": h,
            "S": S,
            "log_S": log_S,
            "exp_step": state["exp_step"] + r * pi.detach(),
            "entropy": state["entropy"] - (pi * torch.log(pi + self.entropy_eps)).detach(),
        }
        if lctx.targets is None:
            return new
        if self.stage == 1 and self.objective == "expected_logits":
            term = pi.unsqueeze(-1) * lctx.readout(h).float()  # π^(r) z^(r)  [B, T, V]
            new["exp_logits"] = term if state["exp_logits"] is None else state["exp_logits"] + term
            new["exp_ent"] = state["exp_ent"] - pi * torch.log(pi + self.entropy_eps)
        elif self.stage == 1:
            ent = -pi * torch.log(pi + self.entropy_eps)
            new["exp_loss"] = state["exp_loss"] + pi * self._token_loss(h, lctx) - self.beta * ent
        else:
            with torch.no_grad():
                loss = self._token_loss(h, lctx)  # sg(ℓ^(r))
            if r > 1:  # the term of step r−1: did going on to step r help?
                improve = (state["prev_loss"] - loss).clamp(min=0.0)  # I^(r−1)
                w = torch.sigmoid(self.kappa * (improve - self.gamma))  # continuation target w^(r−1)
                # BCE(1 − λ, w) with 1 − λ = σ(−g): binary_cross_entropy_with_logits on −g
                bce = F.binary_cross_entropy_with_logits(-state["prev_logit"], w, reduction="none")
                new["bce"] = state["bce"] + bce
                new["n_bce"] = state["n_bce"] + 1.0
            new["prev_logit"], new["prev_loss"] = g, loss
        return new

    def exit_log_survival(self, state: dict, lctx: LoopContext) -> torch.Tensor:
        """``log S^(r) = log(1 − CDF(r))`` ``[B, T]`` (float64) after the step just taken: the ``gate`` exit
        criterion leaves at the first ``r`` with ``log S^(r) <= log(1 − q)``, i.e. at ``z(q)``."""
        return state["log_S"]

    def exit_rows(self, state: dict, exiting: torch.Tensor, lctx: LoopContext) -> dict:
        """Tokens ``exiting [B, T]`` stop after this step (adaptive decoding): those not selected yet select
        it, ``h^(r)`` (what ``num_loops = r`` selects with ``λ^(r) := 1``)."""
        return {**state, **_select(state, exiting & ~state["chosen"], state["h"], lctx.iteration + 1)}

    def finish(self, state: dict, lctx: LoopContext) -> torch.Tensor:
        pad = lctx.fctx.pad_mask if lctx.fctx is not None else None
        self.last_exit = {
            "selected_depth": state["depth"].detach(),  # z_i(q)   [B, T]
            "expected_step": state["exp_step"].detach(),  # s_i      [B, T]
            "entropy": state["entropy"].detach(),  # H_i      [B, T]
            "real": pad if pad is not None else torch.ones_like(state["chosen"]),
            "executed_loops": lctx.num_loops if lctx.loops_per_row is None else lctx.loops_per_row.detach(),
        }
        return state["sel"]  # output selection: h^(z_i(q)) reaches the coda / norm / head

    def aux_loss(self, state: dict, lctx: LoopContext) -> torch.Tensor | None:
        if lctx.targets is None:
            return None
        valid = lctx.targets != -100  # the M valid next-token positions
        if self.stage == 1 and self.objective == "expected_logits":
            z = state["exp_logits"]  # [B, T, V]
            ce = F.cross_entropy(
                z.reshape(-1, z.shape[-1]), lctx.targets.reshape(-1), ignore_index=-100, reduction="none"
            ).view_as(valid)
            per_token = ce - self.beta * state["exp_ent"] if self.beta else ce
        elif self.stage == 1:
            per_token = state["exp_loss"]  # Σ_r π ℓ − β H
        else:
            per_token = state["bce"] / state["n_bce"].clamp(min=1.0)  # 1/(R−1) Σ_r BCE
        n = valid.sum().clamp(min=1)
        return (per_token * valid).sum() / n

    # ------------------------------------------------------------------------------------------
    def exit_summary(self) -> dict:
        """Means over real tokens of the last forward: ``iter`` (selected depth), ``expected_step``,
        ``exit_entropy``; ``executed_depth`` is the loop count that actually ran (all of it)."""
        if self.last_exit is None:
            raise RuntimeError("no forward has run yet")
        e = self.last_exit
        real = e["real"]
        n = real.sum().clamp(min=1)
        ex = e["executed_loops"]
        executed = float(ex) if not isinstance(ex, torch.Tensor) else float(ex.float().mean())
        return {
            "iter": float((e["selected_depth"] * real).sum() / n),
            "expected_step": float((e["expected_step"] * real).sum() / n),
            "exit_entropy": float((e["entropy"] * real).sum() / n),
            "executed_depth": executed,
        }

    def train_metrics(self) -> dict:
        """What the trainer logs per update (App. E.5: exit entropy and expected exit step, Fig. 2-3)."""
        if self.last_exit is None:
            return {}
        s = self.exit_summary()
        return {"exit_entropy": s["exit_entropy"], "expected_exit_step": s["expected_step"], "exit_iter": s["iter"]}


OBJECTIVES = ("expected_loss", "expected_logits")


def _select(state: dict, pick: torch.Tensor, h: torch.Tensor, r: int) -> dict:
    """Tokens ``pick [B, T]`` select step ``r`` (its hidden state ``h``): the fields ``sel``, ``chosen``, ``depth``."""
    return {
        "sel": torch.where(pick.unsqueeze(-1), h, state["sel"]),
        "chosen": state["chosen"] | pick,
        "depth": torch.where(pick, torch.full_like(state["depth"], r), state["depth"]),
    }


def reaches(log_S: torch.Tensor, q: float) -> torch.Tensor:
    """``CDF(r) >= q`` from the log survival ``log S^(r) = log(1 − CDF(r))``: exact at both ends (``q = 1``
    only where ``S`` is exactly 0, i.e. at ``R``; any ``q > 0`` at a step with ``λ > 0`` once ``q`` is small)."""
    return log_S <= math.log1p(-q) if q < 1.0 else torch.isneginf(log_S)


def _check_threshold(q, what: str) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= float(q) <= 1.0:
        raise ValueError(f"{what} q must be a number in [0, 1], got {q!r}")
    return float(q)
