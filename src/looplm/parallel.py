"""Things applied to a model from outside: per-loop activation checkpointing and torch.compile.

(Data parallelism — DDP / FSDP2 — lives with the trainer in :mod:`looplm.train.distributed`.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class CheckpointedCore(nn.Module):
    """A loop core whose every iteration is recomputed in the backward pass.

    Holds the same ``stack`` as the :class:`~looplm.model.LoopCore` it replaces, so parameter names and
    state-dict keys (``core.stack.…``) are unchanged: checkpoints move freely between runs with and
    without activation checkpointing. Decoding (a cache) and no-grad forwards run the stack directly.
    """

    def __init__(self, core: nn.Module):
        super().__init__()
        self.stack = core.stack

    def forward(self, z, fctx, caches=None, mods=None):
        if caches is not None or not torch.is_grad_enabled():  # decoding / eval: nothing to save
            return self.stack(z, fctx, caches, mods)
        return checkpoint(self.stack, z, fctx, caches, mods, use_reentrant=False)


def apply_activation_checkpointing(model) -> None:
    """Recompute each loop iteration in the backward pass instead of storing its activations.

    Replaces ``model.core`` (the shared blocks, run once per iteration) by a :class:`CheckpointedCore`:
    the forward keeps only the input of each iteration, so activation memory is nearly flat in the loop
    count K (the rule's per-iteration tensors remain). Idempotent.
    """
    if not isinstance(model.core, CheckpointedCore):
        model.core = CheckpointedCore(model.core)


def compile_model(model, **kwargs):
    """``torch.compile`` the whole looped forward (the loop unrolls at a fixed K; no graph breaks)."""
    return torch.compile(model, **kwargs)


def compile_blocks(model, **kwargs) -> None:
    """Compile every block in place (``nn.Module.compile``), leaving the loop itself in Python.

    A looped core calls the same blocks ``r`` times, and blocks of one shape share one compiled graph
    (torch inlines module parameters as graph inputs), so the core compiles once, not ``K`` times, and
    random loop counts or ``num_grad_loops`` never trigger a recompile after warm-up (only a change of
    grad mode adds one variant). Works under per-loop activation checkpointing too.
    """
    from .blocks import Block

    for m in model.modules():
        if isinstance(m, Block):
            m.compile(**kwargs)


def uncompile_blocks(model) -> None:
    """Undo :func:`compile_blocks`: every block runs eagerly again (``nn.Module.compile`` keeps the
    compiled call in ``_compiled_call_impl``; ``None`` there is the module's eager call)."""
    from .blocks import Block

    for m in model.modules():
        if isinstance(m, Block):
            m._compiled_call_impl = None
