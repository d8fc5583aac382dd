"""Linear layers that read one input: the ``linear_group`` dispatch point (:mod:`looplm.dispatch`).

Attention's q / k / v projections and SwiGLU's gate and up read the same ``x``; they are called through
:data:`linear_group`, whose reference calls each layer in turn. A provider may compute them as one
product (looplm's CPU training path stacks the weights: :mod:`looplm.kernels.gemm`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import dispatch


def _linear_group_reference(x: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(x) for lin in linears)``."""
    return tuple(lin(x) for lin in linears)


linear_group = dispatch.Op("linear_group", _linear_group_reference, "linears that read one input (q/k/v, gate/up)")

__all__ = ["linear_group"]
