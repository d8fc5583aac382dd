"""vLLM's ``MambaMixer2`` as the plugin's Mamba-2 blocks and their per-(loop, layer) states (imports vLLM;
the design: :mod:`looplm.vllm.mamba`). Kept apart from the model classes, which subclass the plugin's model:
:mod:`looplm.vllm.model` builds its blocks from here, so this module must not import it."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

from ..config import ModelConfig
from .mamba_spec import mixer2_kwargs
from .spec import UnsupportedDesign, design_name

__all__ = ["VMamba2", "block_mixer", "mamba_slot"]

# the parameter modules and parameters a slot shares with its block's mixer
_SHARED_MODULES = ("in_proj", "conv1d", "out_proj", "norm")
_SHARED_PARAMS = ("A", "D", "dt_bias")


class VMamba2(MambaMixer2):
    """vLLM's ``MambaMixer2`` called as the plugin's blocks call a mixer: ``mixer(u, positions, slot)``."""

    def forward(self, u: torch.Tensor, positions=None, slot=None, rows=None, store=None, n_all: int = 0):
        """``u [N, d]`` (every token of vLLM's batch) -> ``[N, d]`` through ``slot``, the ``MambaMixer2`` of the
        (loop, layer) being run: its name selects the requests' states and the step's metadata. ``rows`` (the
        per-token exit path) is refused for Mamba designs when the model loads."""
        if rows is not None:
            raise RuntimeError("a Mamba-2 block on a subset of the batch's tokens (per-token exit is refused)")
        return MambaMixer2.forward(self if slot is None else slot, u)


def _new(cfg: ModelConfig, prefix: str, quant_config=None) -> VMamba2:
    vc = get_current_vllm_config()
    return VMamba2(
        **mixer2_kwargs(cfg),
        model_config=vc.model_config,
        cache_config=vc.cache_config,
        quant_config=quant_config,
        prefix=prefix,
    )


def block_mixer(cfg: ModelConfig, prefix: str, quant_config=None) -> VMamba2:
    """The mixer of a Mamba-2 block: its parameters under looplm's names, no state of its own (it leaves
    the static forward context, so vLLM allocates no state for it; the slots do)."""
    m = _new(cfg, prefix, quant_config)
    get_current_vllm_config().compilation_config.static_forward_context.pop(prefix)
    return m


def _block(model: nn.Module, layer: int) -> nn.Module:
    """Physical block ``layer`` of the plugin's model (prelude, core, coda)."""
    c = model.cfg
    if layer < c.n_prelude:
        return model.prelude.blocks[layer]
    if layer < c.n_prelude + c.n_core:
        return model.core.stack.blocks[layer - c.n_prelude]
    return model.coda.blocks[layer - c.n_prelude - c.n_core]


def mamba_slot(model: nn.Module, slot, name: str) -> VMamba2:
    """The Mamba-2 state of ``slot`` (:class:`looplm.vllm.spec.AttentionSlot` of a Mamba-2 block), named ``name``
    (``attn_slots.<index>``): a ``MambaMixer2`` registered under that name, its parameter modules the block
    mixer's. Refused (by name) when the model class does not declare vLLM's state interfaces."""
    if not getattr(type(model), "has_inner_state", False):
        from .mamba_spec import served_architecture

        raise UnsupportedDesign(
            design_name(model.cfg),
            f"Mamba-2 blocks need vLLM's state cache, which vLLM gives the architecture "
            f"{served_architecture(model.cfg)} (the plugin's config class names it); this model was built as "
            f"{type(model).__name__}",
        )
    src = _block(model, slot.layer).mixer
    m = _new(model.cfg, name)
    for k in _SHARED_MODULES:
        setattr(m, k, getattr(src, k))
    for k in _SHARED_PARAMS:
        setattr(m, k, getattr(src, k))
    m.conv_weights = src.conv_weights  # [conv_dim, d_conv], a view of the shared conv1d weight
    return m
