"""Per-token exit criteria and the state policies of the loops a token skips (one interface, any rule).

:class:`Exit` is the option of a call (``generate(..., exit=...)``, ``looplm generate --exit ...``):
*when* a token stops looping (the criterion, ``min_loops`` / ``max_loops``) and *what later tokens see*
in the loops it skipped (``kv`` for attention slots, ``ssm`` for Mamba-2 slots). The decode-time driver
that acts on it is :mod:`looplm.decode.token_schedule`; ``docs/adaptive-depth.md`` is the user's guide.

Criteria (``r`` = the loop just run, 1-based; a token may exit after loop ``r >= min_loops``, and every
token exits at ``max_loops``, default the trained ``K``):

* ``gate`` (``q`` in (0, 1]): the rule's learned exit distribution (the exit gate, Looped-Mamba App. B):
  exit at ``z(q) = min{r : CDF(r) >= q}``, read through ``rule.exit_log_survival`` (``log(1 − CDF(r))``);
  ``q = 1`` runs every loop (``z(1) = R``). A rule without a gate is refused.
* ``kl`` (``ε >= 0``, Huginn's zero-shot criterion): exit when ``KL(p^{r−1} ‖ p^r) < ε`` for the next-token
  distributions ``p^r = softmax(readout(H^r))`` of successive iterates (from ``r = 2``). It needs a readout
  (coda, final norm, head) at every loop a token runs: the check cost, counted.
* ``convergence`` (``ε >= 0``): exit when the relative update ``‖H^r − H^{r−1}‖ / ‖H^{r−1}‖ < ε``
  (from ``r = 2``; no readout).
* ``replay`` (``depths``): given depths — an int (every token), a ``[B]`` tensor (per row) or a
  ``[B, N]`` tensor (per row and decoded token ``t < N``) — for tests and studies.

``ε = 0`` and ``q = 1`` switch a criterion off (every token runs ``max_loops``).

KV policies (attention slots of skipped loops; see :mod:`looplm.cache`):

* ``copy`` — the exit loop's key/value copied into every deeper loop's slot (no FLOPs; bytes);
* ``propagate`` — the stand-in state through each skipped layer's norm and K/V projections (CALM's
  propagation): the core input the next loop would read, ``Z^{r+1} = next_input(state)``, for core
  layers; the exit iterate ``H^r`` for readout (coda) layers. Computed once per layer when the rule
  puts nothing loop-dependent into the blocks (else once per layer and loop, with the rule's scale /
  shift);
* ``shared`` — one KV slot per layer for all loops (memory ÷ K): a token writes its column at every loop
  it runs, later tokens read each earlier token at the last loop it ran (Huginn's zero-shot sharing).
  It changes the model even at full depth;
* ``full`` — the exited token keeps running every loop (today's behaviour: exact caches); only its
  output comes from the exit. No compute saved.

SSM policies (Mamba-2 slots of skipped loops; attention-free layers hold a state, not a list):

* ``freeze`` — state and conv window untouched (the skipped loops never see the token);
* ``propagate`` — the stand-in through the layer's norm, ``in_proj``, the conv window and the state
  update ``S ← exp(Δ·A)·S + Δ·x ⊗ B`` (``out_proj`` and everything after it skipped);
* ``decay`` — ``S ← exp(Δ·A)·S`` only (``Δ`` from the stand-in's dt projection), conv window untouched.

The prompt (``prefill``): ``full`` — every loop (the default); ``exit`` — its tokens after the first take the
exits too, all at once (:func:`looplm.decode.exit_forward.adaptive_forward`: one loop at a time over the
positions still looping), leaving the caches decoding the prompt token by token after its first would leave.

Schedules (how a batch's rows share the core passes):

* ``token`` — the rows decode one token together: at each loop only the rows still looping run the core,
  rows that exited wait at the coda for the slowest row (:mod:`looplm.decode.token_schedule`). Wall time follows the
  loops the *batch* runs (the deepest row), not each row's depth;
* ``depth`` — continuous depth batching (:mod:`looplm.decode.depth_schedule`): each core pass runs every row at its
  own loop of its own token; a row that exits goes through the coda and starts its next token at the next
  pass, so the passes a batch needs follow the mean depth. Mamba-2 layers in the core only; no sliding
  window, no rule-owned per-loop slots, not with ``kv='full'``;
* ``static`` — the same at fixed shapes (:mod:`looplm.decode.static_schedule`): every pass runs all rows, each at
  its own loop, with no host read of a device value (for CUDA, where each read is a synchronisation); it
  also refuses ``propagate`` / a Mamba-2 fill with per-loop block modulation, ``kl`` with coda layers, and rules whose
  state changes structure over the loops.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

__all__ = [
    "CRITERIA",
    "DEEP_LOOPS_FACTOR",
    "Exit",
    "KV_POLICIES",
    "PREFILLS",
    "SCHEDULES",
    "SSM_POLICIES",
    "finish_rest",
    "forward_support",
    "keep_staying",
    "make_criterion",
]

CRITERIA = ("gate", "kl", "convergence", "replay")
KV_POLICIES = ("copy", "propagate", "shared", "full")
SSM_POLICIES = ("freeze", "propagate", "decay")
SCHEDULES = ("token", "depth", "static")
PREFILLS = ("full", "exit")
_DEFAULT_THRESHOLD = {"gate": 1.0, "kl": 0.0, "convergence": 0.0}
# a loop count above this many times the trained K must be asked for (allow_deep=True, --allow-deep): the cost
# of a forward grows with it without bound, and a typo (--loops 100000) should not run for hours
DEEP_LOOPS_FACTOR = 64


def deep_loops_error(name: str, value: int, K: int, allow_deep: bool = False) -> str | None:
    """Why ``value`` loops (asked for as ``name``) are refused on a model trained with ``K``, or ``None``."""
    if allow_deep or value <= DEEP_LOOPS_FACTOR * K:
        return None
    return (
        f"{name}={value} is more than {DEEP_LOOPS_FACTOR}x the model's trained K = {K} loops (at most "
        f"{DEEP_LOOPS_FACTOR * K} without asking); pass allow_deep=True (looplm: --allow-deep) to run that deep"
    )


@dataclass(frozen=True)
class Exit:
    """When tokens stop looping and what the skipped loops hold (module docstring)."""

    criterion: str = "gate"
    threshold: float | None = None  # q (gate) or ε (kl, convergence); None = off (q = 1, ε = 0)
    depths: int | torch.Tensor | None = None  # replay
    min_loops: int = 1
    max_loops: int | None = None  # default: the trained K
    kv: str = "copy"
    ssm: str = "freeze"
    schedule: str = "token"  # token | depth (continuous depth batching, looplm.decode.depth_schedule) | static (looplm.decode.static_schedule)
    # schedule 'depth': rows decoded at once (None: the whole batch); the batch's other prompts queue and each
    # takes the row of one that finished (request refill: looplm.decode.depth_schedule)
    max_batch: int | None = None
    # the prompt: 'full' (every loop) | 'exit' (its tokens after the first take the exits, in one parallel
    # forward: looplm.decode.exit_forward; the caches are what decoding the prompt token by token leaves)
    prefill: str = "full"
    # schedule 'static': run each fixed-shape pass through torch.compile (looplm.decode.static_schedule; the first decode
    # of a model and batch shape compiles, seconds to tens of seconds)
    compile: bool = False
    # more than DEEP_LOOPS_FACTOR x K loops (max_loops, replay depths) asked for on purpose (else refused)
    allow_deep: bool = False
    # the model (a weak reference) and batch this exit was checked for (:meth:`resolved`); not a field of the spec:
    # ``replace`` / :meth:`with_policies` give an exit that is checked again
    _checked: tuple | None = field(default=None, init=False, compare=False, repr=False)

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec) -> "Exit":
        """An :class:`Exit` from itself, a dict of its fields, or a string ``criterion[:value]``
        (``gate:0.8``, ``kl:5e-4``, ``convergence:0.03``, ``replay:2``)."""
        if isinstance(spec, Exit):
            return spec
        if isinstance(spec, dict):
            options = sorted(n for n, f in cls.__dataclass_fields__.items() if f.init)
            unknown = sorted(set(spec) - set(options))
            if unknown:
                raise ValueError(f"exit: unknown option(s) {unknown}; options are {options}")
            return cls(**spec)
        if isinstance(spec, str):
            name, _, value = spec.partition(":")
            name = name.strip()
            if name not in CRITERIA:
                raise ValueError(
                    f"exit criterion {name!r} is unknown; use one of {list(CRITERIA)} (e.g. 'gate:0.8', 'kl:5e-4')"
                )
            if not value:
                return cls(criterion=name)
            try:
                num = float(value)
            except ValueError:
                raise ValueError(f"exit {spec!r}: {value!r} is not a number") from None
            if name == "replay":
                if num != int(num):
                    raise ValueError(f"exit {spec!r}: replay depth must be an integer, got {value!r}")
                return cls(criterion=name, depths=int(num))
            return cls(criterion=name, threshold=num)
        raise TypeError(f"exit must be an Exit, a dict or a string like 'gate:0.8', got {type(spec).__name__}")

    def with_policies(
        self,
        kv: str | None = None,
        ssm: str | None = None,
        min_loops: int | None = None,
        max_loops: int | None = None,
        schedule: str | None = None,
        prefill: str | None = None,
        compile: bool | None = None,
        allow_deep: bool | None = None,
    ) -> "Exit":
        """A copy with the given fields replaced (``None`` keeps them)."""
        kw = dict(
            kv=kv,
            ssm=ssm,
            min_loops=min_loops,
            max_loops=max_loops,
            schedule=schedule,
            prefill=prefill,
            compile=compile,
            allow_deep=allow_deep,
        )
        kw = {k: v for k, v in kw.items() if v is not None}
        return replace(self, **kw)

    # --- checks ------------------------------------------------------------------------------------
    def resolved(self, model, batch_size: int | None = None) -> "Exit":
        """This exit checked against ``model`` (and the batch), ``max_loops`` and the threshold filled in; a
        ``ValueError`` naming the option and what to do otherwise — before any decoding work.

        The checks run once per decoding call, at its entry (:func:`looplm.decode.generate.generate`, a front
        end's :func:`~looplm.decode.generate.adaptive_options`, a decoder or :func:`adaptive_forward` called on
        its own): an exit already resolved for this model — and, where its replay depths are a tensor, for
        this batch — is returned as it is, so the floors below hand the one :class:`Exit` down unchanged."""
        if self.is_resolved_for(model, batch_size):
            return self
        e = self._check(model, batch_size)
        object.__setattr__(e, "_checked", (weakref.ref(model), batch_size, self.max_loops is None))
        return e

    def is_resolved_for(self, model, batch_size: int | None = None) -> bool:
        """:meth:`resolved` checked this exit for ``model`` (and ``batch_size``, where that matters)."""
        c = self._checked
        if c is None or c[0]() is not model:
            return False
        return batch_size is None or c[1] == batch_size or not isinstance(self.depths, torch.Tensor)

    @property
    def default_depth(self) -> bool:
        """``max_loops`` is the model's trained K because none was given (unresolved: ``max_loops is None``); a
        caller's ``num_loops`` may then set it (:func:`looplm.decode.generate.generate`)."""
        return self.max_loops is None or (self._checked is not None and self._checked[2])

    def for_one_forward(self) -> "Exit":
        """This exit as one parallel forward reads it (:func:`looplm.decode.exit_forward.adaptive_forward`):
        ``schedule='token'``, no refill, ``prefill='full'``, no compiled pass — options of decoding, not of
        a forward. Each of them only adds refusals, so a resolved exit stays resolved without them."""
        e = replace(self, schedule="token", max_batch=None, prefill="full", compile=False)
        object.__setattr__(e, "_checked", self._checked)
        return e

    def _check(self, model, batch_size: int | None) -> "Exit":
        """:meth:`resolved`'s checks (every one, each error named)."""
        errs = []
        K = model.config.n_loops
        if self.criterion not in CRITERIA:
            errs.append(f"exit criterion {self.criterion!r} is unknown; use one of {list(CRITERIA)}")
        t = self.threshold
        if self.criterion == "gate":
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0):
                errs.append(f"exit threshold q must be in (0, 1] for the gate criterion (1 = every loop), got {t!r}")
            if type(model.rule).exit_log_survival is _base_exit_log_survival():
                errs.append(
                    f"exit criterion 'gate' needs a rule with a learned exit gate (rule exit_gate); this model's rule is "
                    f"{model.config.rule.name!r}: use 'kl:EPS' or 'convergence:EPS'"
                )
        elif self.criterion in ("kl", "convergence"):
            if t is not None and (
                isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or math.isinf(t)
            ):
                errs.append(
                    f"exit threshold ε must be a finite number >= 0 for the {self.criterion} criterion (0 = every loop), got {t!r}"
                )
        if self.criterion == "replay":
            d = self.depths
            if d is None:
                errs.append("exit criterion 'replay' needs depths (an int, a [B] or a [B, N] integer tensor)")
            elif isinstance(d, torch.Tensor):
                if d.dtype.is_floating_point or d.dtype == torch.bool or d.dim() not in (1, 2):
                    errs.append(
                        f"exit depths must be an integer tensor [B] or [B, N], got dtype {d.dtype} shape {tuple(d.shape)}"
                    )
                elif batch_size is not None and d.shape[0] != batch_size:
                    errs.append(f"exit depths have {d.shape[0]} rows, the batch has {batch_size}")
                elif d.numel() and int(d.min()) < 1:
                    errs.append(f"exit depths must be >= 1, got a minimum of {int(d.min())}")
            elif isinstance(d, bool) or not isinstance(d, int) or d < 1:
                errs.append(f"exit depths must be an int >= 1 or an integer tensor, got {d!r}")
        elif self.depths is not None:
            errs.append(f"exit depths are for the replay criterion, not {self.criterion!r}")
        R = K if self.max_loops is None else self.max_loops
        if isinstance(R, bool) or not isinstance(R, int) or R < 1:
            errs.append(f"exit max_loops must be an int >= 1 (default: the trained {K}), got {self.max_loops!r}")
            R = K
        elif (why := deep_loops_error("exit max_loops", R, K, self.allow_deep is True)) is not None:
            errs.append(why)
        if not isinstance(self.allow_deep, bool):
            errs.append(f"exit allow_deep must be True or False, got {self.allow_deep!r}")
        # replay depths past max_loops would be cut to it without a word: refused, naming the depth and the bound
        d = self.depths
        deepest = None
        if self.criterion == "replay" and isinstance(d, int) and not isinstance(d, bool) and d >= 1:
            deepest = d
        elif (
            self.criterion == "replay"
            and isinstance(d, torch.Tensor)
            and d.numel()
            and not d.dtype.is_floating_point
            and d.dtype != torch.bool
        ):
            deepest = int(d.max())
        if deepest is not None and deepest > R:
            bound = f"the model's trained K = {K}" if self.max_loops is None else f"max_loops = {R}"
            errs.append(
                f"exit replay depth {deepest} exceeds {bound}: ask for at most {R} loops, or raise max_loops "
                f"(looplm: --max-loops {deepest})"
            )
        if isinstance(self.min_loops, bool) or not isinstance(self.min_loops, int) or not 1 <= self.min_loops:
            errs.append(f"exit min_loops must be an int >= 1, got {self.min_loops!r}")
        elif self.min_loops > R:
            errs.append(f"exit min_loops={self.min_loops} exceeds max_loops={R}")
        if self.kv not in KV_POLICIES:
            errs.append(f"exit kv policy {self.kv!r} is unknown; use one of {list(KV_POLICIES)}")
        if self.ssm not in SSM_POLICIES:
            errs.append(f"exit ssm policy {self.ssm!r} is unknown; use one of {list(SSM_POLICIES)}")
        if self.schedule not in SCHEDULES:
            errs.append(f"exit schedule {self.schedule!r} is unknown; use one of {list(SCHEDULES)}")
        mb = self.max_batch
        if mb is not None:
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
                errs.append(f"exit max_batch must be an int >= 1 (rows decoded at once) or None, got {mb!r}")
            elif self.schedule != "depth":
                errs.append(
                    f"exit max_batch (request refill) runs under schedule='depth' only, got schedule={self.schedule!r}"
                )
        if not isinstance(self.compile, bool):
            errs.append(f"exit compile must be True or False, got {self.compile!r}")
        elif self.compile and self.schedule != "static":
            errs.append(
                f"exit compile=True compiles the fixed-shape pass of schedule 'static'; the schedule is {self.schedule!r}: use "
                "schedule='static', or compile=False (looplm generate --compile compiles the blocks instead)"
            )
        if self.prefill not in PREFILLS:
            errs.append(
                f"exit prefill {self.prefill!r} is unknown; use one of {list(PREFILLS)} ('exit': the prompt's tokens "
                "take the exits too)"
            )
        elif self.prefill == "exit" and isinstance(self.depths, torch.Tensor) and self.depths.dim() == 2:
            errs.append(
                "exit prefill='exit' with per-token replay depths [B, N]: those index decoded tokens, not the "
                "prompt's; give an int or [B] depths, or prefill='full'"
            )
        if getattr(model, "n_pause", 0):
            errs.append(
                "per-token exit does not run pause-token models (PauseLM inserts pause positions in its own forward)"
            )
        if not errs:
            errs += _policy_support(model, self.kv, self.ssm)
        if not errs and self.schedule in ("depth", "static"):
            errs += _depth_schedule_support(model, self.kv, self.schedule)
        if not errs and self.schedule == "static":
            errs += _static_schedule_support(model, self.kv, self.criterion, self.ssm)
        if not errs and self.prefill == "exit":
            errs += [f"prefill='exit': {m}" for m in forward_support(model, self)]
        if errs:
            raise ValueError("exit: " + "; ".join(errs))
        th = _DEFAULT_THRESHOLD.get(self.criterion) if t is None else float(t)
        return replace(self, max_loops=R, threshold=th)

    def is_off(self, model) -> bool:
        """No token can exit before the trained depth and the caches are the ordinary ones: ``generate``
        then takes today's path (the same ops, bit for bit)."""
        e = self.resolved(model)
        off = {"gate": e.threshold == 1.0, "kl": e.threshold == 0.0, "convergence": e.threshold == 0.0}.get(
            e.criterion, False
        )
        return off and e.max_loops == model.config.n_loops and e.kv != "shared"


def _base_exit_log_survival():
    from ..recurrence.base import RecurrenceRule

    return RecurrenceRule.exit_log_survival


def _policy_support(model, kv: str, ssm: str) -> list[str]:
    """Why ``model`` cannot run the policies ``kv`` / ``ssm`` (empty: it can)."""
    from ..layers.attention import Attention
    from ..layers.mamba2 import Mamba2Mixer

    errs = []
    for mixer in model.rule.loop_slot_mixers():
        kind = (
            "attention"
            if isinstance(mixer, Attention)
            else "mamba2"
            if isinstance(mixer, Mamba2Mixer)
            else type(mixer).__name__
        )
        if kind == "attention" and kv == "propagate":
            errs.append(
                f"kv policy 'propagate' cannot fill the rule {model.config.rule.name!r}'s own attention slots (its state "
                "mixer reads the rule's state, not a block input); use kv='copy', 'shared' or 'full'"
            )
        elif kind == "mamba2" and ssm != "freeze" and kv != "full":
            errs.append(
                f"ssm policy {ssm!r} cannot fill the rule {model.config.rule.name!r}'s own Mamba-2 slots; use ssm='freeze' or kv='full'"
            )
        elif kind not in ("attention", "mamba2"):
            errs.append(f"the rule's per-iteration slots of a {kind} cannot be filled by any policy; use kv='full'")
    if kv == "propagate" and _modulation_owns_carrier(model):
        errs.append(
            f"kv policy 'propagate' needs plain block inputs; the rule {model.config.rule.name!r} replaces a block's "
            "residual stream (read / write hooks); use kv='copy' or 'full'"
        )
    return errs


def _depth_schedule_support(model, kv: str, schedule: str = "depth") -> list[str]:
    """Why ``model`` cannot decode under ``schedule`` (``depth`` or ``static``) with policy ``kv`` (empty: it can)."""
    cfg, errs = model.config, []
    if kv == "full":
        errs.append(
            f"schedule {schedule!r} batches rows by the loops they skip; kv='full' runs every loop (nothing to skip): "
            "use kv='copy', 'propagate' or 'shared', or schedule='token'"
        )
    ssm_layers = _ssm_layers(cfg)
    core = range(model.core.stack.first, model.core.stack.first + len(model.core.stack.blocks))
    outside = [i for i in ssm_layers if i not in core]
    if outside:
        errs.append(
            f"schedule {schedule!r} runs Mamba-2 layers in the core only (a prelude or coda state is one per row, "
            f"rewritten as rows start and exit); layers {outside} are Mamba-2: use schedule='token'"
        )
    windowed = [
        i for i in range(cfg.n_physical) if cfg.mixer_of(i) == "attention" and cfg.sliding_window_of(i) is not None
    ]
    if windowed:
        errs.append(
            f"schedule {schedule!r} has no sliding-window band for rows at different tokens (layers {windowed}): use schedule='token'"
        )
    if model.rule.loop_slot_mixers():
        errs.append(
            f"schedule {schedule!r} cannot run the rule {cfg.rule.name!r}'s own per-loop slots (its state mixers): use schedule='token'"
        )
    if _modulation_owns_carrier(model):
        errs.append(
            f"schedule {schedule!r} needs plain block inputs; the rule {cfg.rule.name!r} replaces a block's residual "
            "stream (read / write hooks): use schedule='token'"
        )
    return errs


def forward_support(model, e: Exit) -> list[str]:
    """Why ``model`` cannot take the exit ``e`` in one parallel forward (:func:`looplm.decode.exit_forward.adaptive_forward`,
    ``prefill='exit'``; empty: it can)."""
    from ..layers.attention import Attention

    cfg, errs = model.config, []
    if e.kv == "shared":
        errs.append(
            "kv policy 'shared' gives every loop one slot, so a token reads the earlier tokens at the last loop "
            "they ran: tokens one after another, not one loop over all of them; use kv='copy', 'propagate' or "
            "'full', or score the text token by token (AdaptiveDecoder.score)"
        )
    core = model.core.stack.blocks
    # the coda runs per loop too when a readout goes through it: the kl check's, or the rule's own (PonderLM)
    read = len(model.coda.blocks) > 0 and (e.criterion == "kl" or _rule_reads_out(model))
    looped = list(core) + (list(model.coda.blocks) if read else [])
    ssm = [b.layer_idx for b in looped if not isinstance(b.mixer, Attention)]
    if ssm and e.ssm != "freeze" and e.kv != "full":
        errs.append(
            f"ssm policy {e.ssm!r} feeds an exited token's stand-in into each skipped loop's scan; in one forward "
            f"the Mamba-2 layers {ssm} of each loop scan the looping tokens only (an exited token leaves the scan: "
            "'freeze'): use ssm='freeze' or kv='full', or score the text token by token (AdaptiveDecoder.score)"
        )
    windowed = [b.layer_idx for b in looped if isinstance(b.mixer, Attention) and b.mixer.sliding_window is not None]
    if windowed:
        errs.append(
            f"a per-token exit in one forward has no sliding-window band for the packed positions (layers "
            f"{windowed}): score the text token by token (AdaptiveDecoder.score)"
        )
    if model.rule.loop_slot_mixers():
        errs.append(
            f"a per-token exit in one forward cannot run the rule {cfg.rule.name!r}'s own per-loop slots (its state "
            "mixers): score the text token by token (AdaptiveDecoder.score)"
        )
    if _modulation_owns_carrier(model):
        errs.append(
            f"a per-token exit in one forward needs plain block inputs; the rule {cfg.rule.name!r} replaces a "
            "block's residual stream (read / write hooks): score the text token by token (AdaptiveDecoder.score)"
        )
    if e.kv == "propagate" and _modulates(model.rule):
        errs.append(
            f"kv policy 'propagate' writes one stand-in per exited token for every loop it skips; the rule "
            f"{cfg.rule.name!r} modulates its blocks per loop: use kv='copy' or 'full'"
        )
    return errs


def _static_schedule_support(model, kv: str, criterion: str, ssm: str = "freeze") -> list[str]:
    """Why ``model`` cannot decode under ``schedule='static'`` (beyond :func:`_depth_schedule_support`)."""
    cfg, errs = model.config, []
    if _modulates(model.rule):  # per-loop blocks
        if kv == "propagate":
            errs.append(
                f"schedule 'static' propagates one stand-in per row for every skipped loop; the rule {cfg.rule.name!r} "
                "modulates its blocks per loop: use kv='copy' or 'shared', or schedule='depth'"
            )
        if ssm != "freeze" and _ssm_layers(cfg):
            errs.append(
                f"schedule 'static' fills the Mamba-2 layers' skipped loops with one stand-in per row; the rule "
                f"{cfg.rule.name!r} modulates its blocks per loop: use ssm='freeze', or schedule='depth'"
            )
    if criterion == "kl" and len(model.coda.blocks):
        errs.append(
            "schedule 'static' reads out every row once per pass; the kl criterion's coda layers keep a readout "
            "slot per loop: use criterion 'convergence', or schedule='depth'"
        )
    why = _state_varies_over_loops(model)
    if why:
        errs.append(
            f"schedule 'static' merges each row's own loop's state with the rule's select_rows; the rule "
            f"{cfg.rule.name!r}'s state {why}: use schedule='depth'"
        )
    return errs


def _state_varies_over_loops(model) -> str:
    """Why the rule's state cannot be selected row by row across loops (probed on two zero tokens through
    every loop): a field whose structure or non-tensor value changes from one loop to the next, or a tensor
    without the batch as its first dim. Empty: it can."""
    K = model.config.n_loops
    with torch.no_grad():
        h0, lctx = _probe(model, 2)
        state = model.rule.begin(h0, lctx)
        sigs = []
        for k in range(K):
            lctx.iteration = k
            lctx.core_input = model.rule.next_input(state, lctx)
            state = model.rule.step(state, h0, lctx)
            sig, bad = _signature(state)
            if bad:
                return f"holds {bad}"
            sigs.append(sig)
    for k in range(1, K):
        if sigs[k] != sigs[0]:
            return f"changes over the loops (after loop 1: {sigs[0]}; after loop {k + 1}: {sigs[k]})"
    return ""


def _signature(x, path: str = "state"):
    """``(structure, problem)`` of a rule state: dicts, lists and tuples by their items, tensors by their
    shape (their first dim must be the probe's batch of 2), anything else by its value."""
    if isinstance(x, dict):
        parts = {str(k): _signature(x[k], f"{path}[{k!r}]") for k in sorted(x, key=str)}
        return {k: s for k, (s, _) in parts.items()}, next((b for _, b in parts.values() if b), "")
    if isinstance(x, (list, tuple)):
        parts = [_signature(v, f"{path}[{i}]") for i, v in enumerate(x)]
        return [s for s, _ in parts], next((b for _, b in parts if b), "")
    if isinstance(x, torch.Tensor):
        bad = "" if x.dim() and x.shape[0] == 2 else f"{path}, a tensor of shape {tuple(x.shape)} without a batch dim"
        return ("tensor", tuple(x.shape), str(x.dtype)), bad
    return repr(x), ""


def _modulates(rule) -> bool:
    """Whether the rule overrides ``block_modulation`` (its blocks may differ per loop)."""
    from ..recurrence.base import RecurrenceRule

    return type(rule).block_modulation is not RecurrenceRule.block_modulation


def output_is_core(model) -> bool:
    """Whether a token that exits after loop ``k`` hands the core output ``H^k`` itself to the coda: the base
    rule's ``step`` / ``exit_rows`` / ``finish`` (``Y = H^k``; the step probed on one zero token). Rules with
    their own ``finish`` or ``exit_rows`` (the exit gate's selection, a final norm, StateLoop's read) are not
    probed: their output is theirs to make."""
    from ..recurrence.base import RecurrenceRule

    rule = model.rule
    if type(rule).finish is not RecurrenceRule.finish or type(rule).exit_rows is not RecurrenceRule.exit_rows:
        return False
    with torch.no_grad():
        h0, lctx = _probe(model, 1)
        state = rule.begin(h0, lctx)
        lctx.core_input = rule.next_input(state, lctx)
        h = lctx.core_input.clone()  # a core output: a tensor of its own
        return rule.step(state, h, lctx).get("h") is h


def readout_is_output(model) -> bool:
    """Whether a ``kl`` check's readout of ``H^k`` (final norm, head) is the logits of a token that exits after
    loop ``k``: no coda, and the rule's output is the core output (:func:`output_is_core`); then the exit need
    not run the head again."""
    return len(model.coda.blocks) == 0 and output_is_core(model)


def _probe(model, batch: int):
    """``(h0, lctx)`` for probing the rule on ``batch`` zero tokens: a zero prelude output ``[batch, 1, d]``
    and the loop context a decoding call would give it (no cache)."""
    from ..context import LoopContext

    p = next(model.parameters())
    K = model.config.n_loops
    h0 = torch.zeros(batch, 1, model.config.d_model, device=p.device, dtype=p.dtype)
    fctx = model.forward_context(torch.zeros(batch, 1, dtype=torch.long, device=p.device), None, None, 0)
    lctx = LoopContext(
        num_loops=K,
        train_loops=K,
        fctx=fctx,
        embeddings=h0,
        embed_weight=model.embed.weight,
        embed_multiplier=model.embed_multiplier,
        final_norm=model.norm,
        readout_fn=model.readout,
    )
    return h0, lctx


def _ssm_layers(cfg) -> list[int]:
    """The model's Mamba-2 layers (physical indices)."""
    return [i for i in range(cfg.n_physical) if cfg.mixer_of(i) != "attention"]


def _modulation_owns_carrier(model) -> bool:
    """Whether the rule's block modulation reads / writes a carrier of its own (probed on one zero token)."""
    if not _modulates(model.rule):
        return False
    with torch.no_grad():
        h0, lctx = _probe(model, 1)
        mods = model.rule.block_modulation(model.rule.begin(h0, lctx), lctx) or []
    return any(
        m is not None and b is not None and (b.read is not None or b.write is not None)
        for m in mods
        for b in (m.mixer, m.mlp)
    )


# ------------------------------------------------------------------------------------------------
# the criteria (stateful over one token's loops)
# ------------------------------------------------------------------------------------------------


class Criterion:
    """One token's exit test over its loops. ``check`` gets the loop just run (``k``, 0-based), the core
    output ``h [n, T, d]`` of the rows still looping (global row ids ``rows [n]``), the rule state after
    the step and the loop context of those rows; it returns ``[n]`` bool (``True`` = may exit now) and
    counts its own cost in ``flops``. ``take(keep)`` keeps the memory of rows ``keep`` (local ids)."""

    readout = False  # whether it reads out every iterate (KL)

    def __init__(self, threshold: float | None):
        self.threshold = threshold
        self.flops = 0.0

    def begin(self, token: int) -> None:
        self.token = token

    def check(self, k, h, state, lctx, rows, model) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def take(self, keep: torch.Tensor) -> None:
        pass


class GateCriterion(Criterion):
    def check(self, k, h, state, lctx, rows, model):
        from ..recurrence.exit_gate import reaches

        log_S = model.rule.exit_log_survival(state, lctx)  # [n, T]
        self.flops += 2 * h.shape[0] * h.shape[-1]  # the gate's linear d -> 1 (computed in the rule's step)
        return reaches(log_S[:, -1], self.threshold)


class _SuccessiveCriterion(Criterion):
    """A test between successive iterates of a token: :meth:`value` of loop ``r`` against the one of loop
    ``r − 1`` (kept per row), ``distance(prev, cur) < ε``; nobody leaves after the first loop."""

    def begin(self, token):
        super().begin(token)
        self.prev = None  # the previous loop's value of each row still looping

    def measure(self, h, lctx, model) -> torch.Tensor:  # pragma: no cover - interface
        """The compared value of the rows' iterate ``h [n, T, d]``, its cost not counted."""
        raise NotImplementedError

    def value(self, k, h, lctx, model) -> torch.Tensor:  # pragma: no cover - interface
        """:meth:`measure`, its cost counted in ``flops``."""
        raise NotImplementedError

    def distance(self, prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def check(self, k, h, state, lctx, rows, model, cur=None):
        """``cur``: :meth:`value` of these rows, computed by the caller with other rows' (one readout for a
        depth-batched pass, :mod:`looplm.decode.depth_schedule`)."""
        if cur is None:
            cur = self.value(k, h, lctx, model)
        if self.prev is None:
            out = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        else:
            out = self.distance(self.prev, cur) < self.threshold
        self.prev = cur
        return out

    def take(self, keep):
        if self.prev is not None:
            self.prev = self.prev.index_select(0, keep)


class KLCriterion(_SuccessiveCriterion):
    readout = True
    terms = None  # the readout's FLOP terms (coda, head), computed once

    def measure(self, h, lctx, model):  # log p^r [n, V], uncounted (the static schedule counts per pass)
        # every position reads out (a prompt's readout slots need each token); the last one is compared
        read = lctx.check_readout or (lambda x, c: model.readout(x, c, family="exit-check"))
        self.logits = read(h, lctx)[:, -1]  # [n, V] (an exit's own: readout_is_output)
        return torch.log_softmax(self.logits.float(), -1)  # [n, V]

    def value(self, k, h, lctx, model):  # log p^r [n, V]
        logp = self.measure(h, lctx, model)
        if self.terms is None:
            self.terms = stack_flop_terms(model.coda), 2.0 * model.lm_head.weight.numel()
        (w, a), head = self.terms
        self.flops += (
            h.shape[0] * h.shape[1] * (w + a * (lctx.cache.seqlen + 1 if lctx.cache is not None else 1) + head)
        )
        return logp

    def distance(self, prev, cur):  # KL(p^{r−1} ‖ p^r) = Σ p^{r−1} (log p^{r−1} − log p^r)
        return F.kl_div(cur, prev, reduction="none", log_target=True).sum(-1)  # (exp(prev) · (prev − cur), one call)


class ConvergenceCriterion(_SuccessiveCriterion):
    def measure(self, h, lctx, model):  # H^r at the last position [n, d], uncounted
        return h[:, -1].float()

    def value(self, k, h, lctx, model):  # H^r at the last position [n, d]
        cur = self.measure(h, lctx, model)
        self.flops += 4 * cur.shape[0] * cur.shape[1]
        return cur

    def distance(self, prev, cur):  # ‖H^r − H^{r−1}‖ / ‖H^{r−1}‖
        return (cur - prev).norm(dim=-1) / prev.norm(dim=-1).clamp_min(1e-30)


class ReplayCriterion(Criterion):
    def __init__(self, depths):
        super().__init__(None)
        self.depths = depths

    def depth_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Depth of the rows' current tokens (``self.token``: one index for all rows, or one per row ``[n]``
        under continuous depth batching, where rows are at different tokens)."""
        d = self.depths
        if isinstance(d, int):
            return torch.full_like(rows, d)
        d = d.to(rows.device)
        if d.dim() == 1:
            return d[rows]
        t = self.token
        last = int(t.max()) if isinstance(t, torch.Tensor) else t
        if last >= d.shape[1]:
            raise ValueError(f"exit depths give {d.shape[1]} tokens per row; decoding reached token {last}")
        return d[rows, t]

    def check(self, k, h, state, lctx, rows, model):
        return self.depth_of(rows) <= k + 1

    def take(self, keep):
        if isinstance(self.token, torch.Tensor):
            self.token = self.token.index_select(0, keep)


def _rule_reads_out(model) -> bool:
    """Whether the rule reads an iterate out at inference (``lctx.readout`` in its hooks, e.g. PonderLM's
    feedback): probed on one zero token at loop 0 of the trained ``K``, with a readout that records its call."""
    calls = []
    with torch.no_grad():
        h0, lctx = _probe(model, 1)
        lctx.readout_fn = lambda h, c: calls.append(1) or model.readout(h, replace(c, cache=None))
        state = model.rule.begin(h0, lctx)
        lctx.core_input = model.rule.next_input(state, lctx)
        model.rule.block_modulation(state, lctx)
        model.rule.step(state, lctx.core_input.clone(), lctx)
    return bool(calls)


def keep_staying(rule, crit, lctx, state, rows: torch.Tensor, leave: torch.Tensor):
    """After the exits ``leave [n]`` of the ``n`` rows still looping (global ids ``rows``): ``(state, rows,
    their loop context)`` of the rows that stay, the criterion's memory kept for them (``rows`` empty when none
    stays; the state and context are then the old ones)."""
    from ..context import restrict_context

    stay = (~leave).nonzero()[:, 0]
    if stay.numel() == 0:
        return state, rows[:0], lctx
    crit.take(stay)
    rows = rows.index_select(0, stay)
    return rule.take_rows(state, stay, leave.shape[0]), rows, restrict_context(lctx, rows)


def finish_rest(rule, y: torch.Tensor, state, sub, rows: torch.Tensor, exited: torch.Tensor | None) -> None:
    """``y[rows] = rule.finish(state)`` for the rows still looping after the last loop; with ``exited``
    (``kv='full'``: rows that exited and kept looping) those keep the output they exited with."""
    keep = None if exited is None else ~exited.index_select(0, rows)
    y_rest = rule.finish(state, sub)  # their output
    if keep is None or bool(keep.all()):
        y.index_copy_(0, rows, y_rest)
    else:
        sel = keep.nonzero()[:, 0]
        y.index_copy_(0, rows.index_select(0, sel), y_rest.index_select(0, sel))


def make_criterion(e: Exit) -> Criterion:
    """The criterion object of a resolved :class:`Exit`."""
    if e.criterion == "replay":
        return ReplayCriterion(e.depths)
    return {"gate": GateCriterion, "kl": KLCriterion, "convergence": ConvergenceCriterion}[e.criterion](e.threshold)


# ------------------------------------------------------------------------------------------------
# FLOPs (counted where the work runs; products 2·m·n·k, attention 4·H·hd·L per query)
# ------------------------------------------------------------------------------------------------


def stack_flops(stack, context: int) -> float:
    """FLOPs of one token through ``stack``'s blocks with ``context`` keys per attention layer."""
    w, a = stack_flop_terms(stack)
    return w + a * context


def stack_flop_terms(stack) -> tuple[float, float]:
    """``(weights, per key)``: one token through ``stack`` costs ``weights + per_key · context`` FLOPs
    (2 per weight of every product; 4·H·hd per attention layer and key)."""
    from ..layers.attention import Attention

    w = a = 0.0
    for blk in stack.blocks:
        w += 2.0 * sum(p.numel() for p in blk.parameters() if p.dim() == 2)
        if isinstance(blk.mixer, Attention):
            a += 4.0 * blk.mixer.n_heads * blk.mixer.head_dim
    return w, a
