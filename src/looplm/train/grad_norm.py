"""Gradient clipping by the global L2 norm, as ``torch.nn.utils.clip_grad_norm_(params, max_norm)``
defines it, in the two parts the trainer needs:

* :func:`total_norm` — ``‖g‖₂`` over every gradient. On a CPU with looplm's extension it is one op
  (``csrc/reduce.cpp``: squares summed in fp32 runs of 16 per SIMD lane, the runs added in fp64, both
  cores, the result independent of the thread count): 19-22 ms against ``get_total_norm``'s 47-52 ms
  over the 538 MB of fp32 gradients of the SmolLM2-135M shape on a 2-core Xeon, and nearer the exact
  norm (2e-12 relative off the fp64 sum there, against 6e-4 for torch's fp32 reduction). Elsewhere
  (CUDA, DTensor shards, sparse or strided gradients, no extension) it is ``get_total_norm``.
* :func:`clip_factor` — torch's ``clamp(max_norm / (‖g‖ + 1e-6), max=1)``, or ``None`` when it is
  exactly 1 (nothing to scale). The trainer hands it to :meth:`MultiOptimizer.step
  <looplm.train.optim.MultiOptimizer.step>`, where a fused AdamW applies it inside its own pass.
"""

from __future__ import annotations

import torch

__all__ = ["total_norm", "clip_factor"]


def _fast_applies(grads: list[torch.Tensor]) -> bool:
    from ..layers import gemv

    return (
        bool(grads)
        and all(
            type(g) is torch.Tensor  # not a DTensor (FSDP2) or another subclass
            and g.device.type == "cpu"
            and g.layout == torch.strided
            and g.dtype in (torch.float32, torch.bfloat16)
            and g.is_contiguous()
            for g in grads
        )
        and gemv.extension_available()
    )


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all entries of ``grads`` together, a float32 scalar tensor (a DTensor for FSDP2
    shards, as ``torch.nn.utils.get_total_norm`` returns it)."""
    if _fast_applies(grads):
        return torch.ops.looplm_cpu.sum_squares(grads).sqrt().float()
    return torch.nn.utils.get_total_norm(grads, 2.0)


def clip_factor(norm: float, total: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor ``clip_grad_norm_`` multiplies every gradient by: ``min(max_norm / (total + 1e-6), 1)``
    computed in fp32 as torch does, or ``None`` when that is exactly 1. ``norm`` is ``total`` read
    back as a Python float (the trainer reads it anyway, for the log and the NaN policy), so the
    common unclipped case costs no tensor op: the factor can be below 1 only when
    ``norm + 1e-6 > max_norm``, tested with a margin for fp32 rounding."""
    if not norm * (1 + 1e-6) + 1e-6 > max_norm:
        return None
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
