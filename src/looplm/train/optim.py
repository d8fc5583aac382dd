"""Optimizers: Muon for hidden weight matrices, AdamW for everything else.

Parameter grouping (recurrence-effectiveness paper, §3 "Optimization"):

* **Muon** (``torch.optim.Muon``: momentum 0.95, Nesterov, 5 Newton–Schulz steps) takes every 2-D
  parameter — attention, MLP and recurrence-rule projection matrices — *except* those marked
  ``p._no_muon = True`` by the model (token embedding and LM head).
* **AdamW** takes the rest: embeddings, head, norm weights, biases, vectors and scalars.
* Decoupled weight decay (0.1 by default) applies to every parameter except the *no-decay* ones:
  all parameters with fewer than 2 dimensions (norm weights, biases, gates, scalars) unless marked
  ``p._weight_decay = True`` (the injection scales of the recurrence-effectiveness paper), every
  parameter of a normalisation module, and every parameter marked ``p._no_weight_decay = True``
  (e.g. Mamba-2's ``A_log``, ``D``, ``dt_bias``).

With ``optim.name: adamw`` (the Looped-Mamba recipe) everything goes to AdamW with the same decay
rule.

``MultiOptimizer`` presents the two torch optimizers as one object with ``step``, ``zero_grad``,
``state_dict`` and ``load_state_dict``. Every parameter group stores its peak learning rate in
``group["peak_lr"]``; the schedule sets ``group["lr"] = peak_lr · λ(t)`` (see ``schedule.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ParamPlan", "plan_param_groups", "build_optimizer", "MultiOptimizer", "freeze_parameters"]

MUON = "muon"
MUON_NO_DECAY = "muon_no_decay"
ADAMW_DECAY = "adamw_decay"
ADAMW_NO_DECAY = "adamw_no_decay"


def _is_norm(module: nn.Module) -> bool:
    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)
    return isinstance(module, norm_types) or "norm" in type(module).__name__.lower()


@dataclass
class ParamPlan:
    """Which optimizer group each parameter (by fully-qualified name) belongs to."""

    group_of: dict[str, str] = field(default_factory=dict)

    def names(self, group: str) -> list[str]:
        return [n for n, g in self.group_of.items() if g == group]

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.group_of.values():
            out[g] = out.get(g, 0) + 1
        return out


def plan_param_groups(model: nn.Module, use_muon: bool = True) -> ParamPlan:
    """Assign every trainable parameter of ``model`` to a group (see module docstring).

    Call this on the *unwrapped* model (before DDP / FSDP): FSDP2 replaces parameters by sharded
    ones and the ``_no_muon`` / ``_no_weight_decay`` marks live on the original tensors. Names stay
    the same, so the plan can be applied to the wrapped model afterwards.
    """
    norm_params: set[int] = set()
    for module in model.modules():
        if _is_norm(module):
            norm_params.update(id(p) for p in module.parameters(recurse=False))
    plan = ParamPlan()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # vectors and scalars are not decayed unless a module asks (``p._weight_decay = True``, e.g. the
        # injection scales a, δ_a, b: decay pulls them towards the paper's "state scale" of zero / one)
        small = p.ndim < 2 and not getattr(p, "_weight_decay", False)
        no_decay = small or id(p) in norm_params or getattr(p, "_no_weight_decay", False)
        muon = use_muon and p.ndim == 2 and not getattr(p, "_no_muon", False) and id(p) not in norm_params
        if muon:
            plan.group_of[name] = MUON_NO_DECAY if no_decay else MUON
        else:
            plan.group_of[name] = ADAMW_NO_DECAY if no_decay else ADAMW_DECAY
    return plan


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Freeze the parameters named by ``train.freeze``: ``fnmatch`` patterns, and ``!pattern`` for
    exceptions (``["*", "!rule.*"]`` = everything but the recurrence rule's parameters). A frozen
    parameter gets ``requires_grad = False``, so :func:`plan_param_groups` leaves it out of the
    optimizer: no update, no weight decay, no optimizer state. Returns the frozen names; a pattern
    matching nothing is an error (a typo would silently train everything)."""
    import fnmatch

    names = [n for n, _ in model.named_parameters()]
    keep = [pat[1:] for pat in patterns if pat.startswith("!")]
    take = [pat for pat in patterns if not pat.startswith("!")]
    unmatched = [pat for pat in take + keep if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unmatched:
        raise ValueError(
            f"train.freeze: pattern(s) {unmatched} match no parameter of the model (names look like {names[:3]})"
        )
    frozen = []
    for n, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(n, t) for t in take) and not any(fnmatch.fnmatchcase(n, k) for k in keep):
            p.requires_grad_(False)
            frozen.append(n)
    return frozen


class MultiOptimizer:
    """Several ``torch.optim.Optimizer`` objects stepped together (Muon + AdamW).

    ``optimizers`` is an ordered ``{name: optimizer}`` dict; ``param_groups`` lists the groups of all
    of them, so code that adjusts learning rates can treat this like a single optimizer.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("MultiOptimizer needs at least one optimizer (the model has no trainable parameters?)")
        self.optimizers = dict(optimizers)

    def __iter__(self):
        return iter(self.optimizers.values())

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, grad_factor: torch.Tensor | None = None) -> None:
        """Step every optimizer. ``grad_factor`` (a scalar tensor, e.g. gradient clipping's
        ``max_norm / (norm + 1e-6)``) multiplies every gradient first: a fused Adam / AdamW folds it
        into its own pass over the parameters (torch's ``grad_scale``, which divides each gradient by
        ``1 / grad_factor`` — equal to the product up to fp32 rounding), saving clipping's separate
        read-and-write of every gradient (29 ms of a 1.1 s step at the SmolLM2-135M shape on a
        2-core Xeon, against 4 ms more in the fused step); other optimizers get their gradients
        scaled in place first. The gradients are left scaled either way."""
        for opt in self.optimizers.values():
            if grad_factor is None:
                opt.step()
            elif folds_grad_factor(opt):
                p0 = opt.param_groups[0]["params"][0]
                opt.grad_scale = (1.0 / grad_factor.float()).to(p0.device)  # read by Adam(W).step (fused only)
                try:
                    opt.step()
                finally:
                    del opt.grad_scale
            else:
                grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, grad_factor.to(grads[0].device))
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """Per-optimizer state dicts keyed by optimizer name (parameter *indices*, not names).

        Checkpoints use the name-keyed form from ``looplm.train.checkpoint`` instead, which also
        works across DDP / FSDP and world sizes.
        """
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.optimizers) - set(state)
        if missing:
            raise KeyError(f"optimizer state has no entry for {sorted(missing)} (has {sorted(state)})")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def lrs(self) -> dict[str, float]:
        """Current learning rate of each optimizer's first group (for logging)."""
        return {name: opt.param_groups[0]["lr"] for name, opt in self.optimizers.items()}


def folds_grad_factor(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` can apply a gradient factor inside its own step (:meth:`MultiOptimizer.step`):
    torch's fused Adam / AdamW, whose kernel divides each gradient by ``opt.grad_scale`` (the hook
    ``torch.amp.GradScaler`` uses)."""
    # the groups' flag, not opt.defaults: load_state_dict brings the saving run's groups (a checkpoint
    # of an FSDP2 run, whose DTensors took the unfused AdamW, resumes unfused on one process)
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in opt.param_groups)


def _fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` takes these parameters: plain floating tensors on CPU
    or CUDA. DTensors (FSDP2 shards) keep torch's default implementation."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        DTensor = ()  # noqa: N806
    return bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def build_optimizer(model: nn.Module, cfg, plan: ParamPlan | None = None) -> MultiOptimizer:
    """Build the optimizer(s) described by an ``OptimConfig`` for ``model``.

    Args:
        model: the model whose ``named_parameters()`` names match ``plan`` (pass the inner module
            of a DDP wrapper; FSDP2-sharded modules keep their names).
        cfg: ``OptimConfig`` (name ``muon_adamw`` or ``adamw``).
        plan: grouping computed on the unwrapped model; computed from ``model`` when omitted.
    """
    use_muon = cfg.name == "muon_adamw"
    if plan is None:
        plan = plan_param_groups(model, use_muon=use_muon)
    params = dict(model.named_parameters())
    unknown = [n for n in plan.group_of if n not in params]
    if unknown:
        raise KeyError(
            f"parameter plan names {unknown[:5]} are not parameters of the model; build the plan on the same model"
        )

    def pick(*groups: str) -> list[torch.Tensor]:
        return [params[n] for n, g in plan.group_of.items() if g in groups]

    optimizers: dict[str, torch.optim.Optimizer] = {}
    muon_groups = []
    if pick(MUON):
        muon_groups.append({"params": pick(MUON), "weight_decay": cfg.weight_decay, "peak_lr": cfg.muon_lr})
    if pick(MUON_NO_DECAY):
        muon_groups.append({"params": pick(MUON_NO_DECAY), "weight_decay": 0.0, "peak_lr": cfg.muon_lr})
    if muon_groups:
        if not use_muon:
            raise ValueError("plan puts parameters in Muon groups but optim.name is 'adamw'")
        optimizers["muon"] = torch.optim.Muon(
            muon_groups,
            lr=cfg.muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
        )
    adam_groups = []
    if pick(ADAMW_DECAY):
        adam_groups.append({"params": pick(ADAMW_DECAY), "weight_decay": cfg.weight_decay, "peak_lr": cfg.lr})
    if pick(ADAMW_NO_DECAY):
        adam_groups.append({"params": pick(ADAMW_NO_DECAY), "weight_decay": 0.0, "peak_lr": cfg.lr})
    if adam_groups:
        fused = cfg.fused
        if fused is None:
            fused = cfg.foreach is None and _fused_adamw_supported([p for g in adam_groups for p in g["params"]])
        optimizers["adamw"] = torch.optim.AdamW(
            adam_groups,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=cfg.foreach,
            fused=fused or None,
        )
    return MultiOptimizer(optimizers)
