"""Things applied to a model from outside: per-loop activation checkpointing and torch.compile.

(Data parallelism — DDP / FSDP2 — lives with the trainer in :mod:`looplm.train.distributed`.)
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model) -> None:
    """Recompute each loop iteration in the backward pass instead of storing its activations.

    Wraps ``model.core`` (the shared blocks, run once per iteration): the forward keeps only the
    input of each iteration, so activation memory is nearly flat in the loop count K (the rule's
    per-iteration tensors remain). Idempotent.
    """
    core = model.core
    if getattr(core, "_looplm_checkpointed", False):
        return
    inner = core.forward

    def forward(z, fctx, caches=None, mods=None):
        if caches is not None or not torch.is_grad_enabled():  # decoding / eval: nothing to save
            return inner(z, fctx, caches, mods)
        return checkpoint(inner, z, fctx, caches, mods, use_reentrant=False)

    core.forward = forward
    core._looplm_checkpointed = True


def compile_model(model, **kwargs):
    """``torch.compile`` the whole looped forward (the loop unrolls at a fixed K; no graph breaks)."""
    return torch.compile(model, **kwargs)
