"""StateLoop's own one-token decode step on fused ops (``csrc/decode.cpp``), registered with
:mod:`looplm.dispatch` for :class:`~looplm.recurrence.stateloop.StateLoop`.

The rule's reference methods stay what they are; inside :func:`looplm.dispatch.decode_steps` an eligible
rule (the selective-SSM update without reset, all of its parameters of one CPU dtype, bf16 or fp32, no
hooks anywhere in it) runs two of them as one op each for ``[B, 1, ·]`` rows of that dtype without
autograd:

* ``update_state`` — ``U = RMSNorm_h(H)``, ``P = U W_uᵀ``, ``Δ = softplus(U W_Δᵀ + b_Δ)``,
  ``S̃ = g ⊙ S + (1 − g) ⊙ P`` with ``g = exp(−exp(A_log)⊙Δ)`` (eqs. 2, 5, 6) as ``decode_stateloop_update``;
* ``read`` — ``H + RMSNorm_s(S) Wᵀ`` (eqs. 4, 10) as ``decode_stateloop_read`` (not with a ``read_scale``
  intervention, which takes the reference).

The rounding points of ``SelectiveUpdate`` and the reads are kept (``tests/test_decode_block.py``). The
rule's state mixers (eqs. 8, 9) are residual mixers with a step of their own (:mod:`looplm.kernels.decode`).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..recurrence.stateloop import SelectiveUpdate, StateLoop
from .decode import _eps, fusing, norms_and_params_fit, plain_linear


def stateloop_eligible(module) -> bool:
    """Whether a StateLoop rule's update and reads can run on the fused ops (see the module docstring)."""
    if type(module) is not StateLoop or type(module.update) is not SelectiveUpdate or module.reset:
        return False
    if not all(plain_linear(lin) for lin in (module.W_u, module.update.W_delta, module.W_sz, module.W_out)):
        return False
    return norms_and_params_fit(module, [module.norm_h, module.norm_s])


def _prepare(rule: StateLoop, batch_size: int | None):
    if not stateloop_eligible(rule) or not fusing():
        return None
    return rule.norm_h.weight.dtype


def _rows(dtype: torch.dtype, *ts: torch.Tensor) -> bool:
    """A one-token decode step: ``[B, 1, ·]`` rows of the rule's dtype, no autograd."""
    return not torch.is_grad_enabled() and all(t.dim() == 3 and t.shape[1] == 1 and t.dtype == dtype for t in ts)


def _update_state(rule: StateLoop, dtype, S: torch.Tensor, h: torch.Tensor):
    if not _rows(dtype, h, S):
        return None
    u = rule.update
    return torch.ops.looplm_cpu.decode_stateloop_update(
        h.contiguous(),
        S.contiguous(),
        rule.norm_h.weight,
        _eps(rule.norm_h, dtype),
        rule.W_u.weight,
        u.W_delta.weight,
        u.b_delta,
        u.A_log,
    )


def _read(rule: StateLoop, dtype, W, state: dict, lctx, j: int):
    h, S = state["h"], state["S"]
    if not _rows(dtype, h, S) or rule._read_scale(lctx, j) is not None:
        return None
    return torch.ops.looplm_cpu.decode_stateloop_read(
        h.contiguous(), S.contiguous(), rule.norm_s.weight, _eps(rule.norm_s, dtype), W.weight
    )


def register() -> None:
    """Register StateLoop's fused update and reads."""
    dispatch.register_decode_step(
        dispatch.DecodeStep(
            "stateloop update/read",
            StateLoop,
            _prepare,
            {"update_state": _update_state, "read": _read},
            "looplm.kernels.stateloop",
        )
    )


__all__ = ["register", "stateloop_eligible"]
