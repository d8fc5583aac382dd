"""Looped Mamba-2 blocks on vLLM's Mamba-2 layer and state cache (imports vLLM; docs/vllm.md).

vLLM's ``MambaMixer2`` is looplm's :class:`~looplm.layers.mamba2.Mamba2Mixer` in the same arithmetic::

    [z, xBC, dt] = in_proj(u)                              u [N, d] -> [N, d_inner + conv_dim + H]
    xBC = silu(causal depthwise conv1d(xBC))               the request's conv window from its state
    [x, B, C] = split(xBC);  dt = softplus(dt + dt_bias);  A = −exp(A_log)   (vLLM stores A itself)
    y = SSD(x, dt, A, B, C) + D·x                          from the request's SSM state, written back
    out = out_proj(RMSNorm_groupwise(y · silu(z)))         norm after the gate, ngroups groups

It keeps each request's conv window and SSM state in vLLM's state cache, keyed by the layer's name (its
``prefix``: it registers itself in the compilation config's static forward context, and the step's metadata
comes per name). A looped block must keep one state per (loop, layer), like the attention slots, so:

* the block's mixer (:class:`VMamba2`, under looplm's parameter names ``...blocks.<i>.mixer.in_proj`` ...)
  holds the parameters and no state: it is taken out of the static forward context after construction;
* each Mamba slot of :attr:`looplm.vllm.spec.PluginSpec.slots` (prelude and coda layers: one; a core layer:
  one per loop) is one more ``MambaMixer2`` named ``attn_slots.<index>``, whose parameter modules are the
  block mixer's own (:func:`mamba_slot` ties them after construction: the weights load once, and
  ``named_parameters()`` lists them once, under the block's names);
* at loop ``k`` the block calls its mixer with that loop's slot, which runs vLLM's forward on the slot:
  the slot's name selects its state and metadata;
* under the ``shared`` KV policy (looplm's ``kv_shared``: attention slots shared across loops, SSM states not)
  a core layer's loop-0 state is its one slot of ``PluginSpec.slots`` and its later loops' states are
  ``mamba_loop_slots`` (:func:`looplm.vllm.mamba_spec.shared_loop_slots`), picked by the model's ``_slot``.

The model classes (:class:`LoopLMHybridForCausalLM`, :class:`LoopLMMambaForCausalLM`) are the plugin's model
with vLLM's class-level flags (``HasInnerState`` and ``IsHybrid`` / ``IsAttentionFree``) and the state shapes
vLLM asks the class for before it builds the model (:mod:`looplm.vllm.mamba_spec` says which is served).
"""

from __future__ import annotations

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid
from vllm.model_executor.models.utils import maybe_prefix

from .mamba_layers import mamba_slot
from .mamba_spec import mamba_refusal, mixer2_kwargs, shared_loop_slots
from .model import LoopLMForCausalLM
from .spec import AttentionSlot, UnsupportedDesign, design_name, plugin_spec

__all__ = ["LoopLMHybridForCausalLM", "LoopLMMambaForCausalLM"]


class _MambaStates:
    """The state shapes, dtypes and copy functions vLLM asks the model class for (before it builds the
    model: to size the state cache and, for a hybrid, to align attention pages with state pages), and the
    refusals that depend on how vLLM serves it (prefix caching, pipeline parallelism, speculative decoding),
    checked before any layer is built."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        where = str(getattr(vllm_config.model_config, "model", "config.json"))
        spec = plugin_spec(vllm_config.model_config.hf_config, where=where)
        why = mamba_refusal(
            spec.config,
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
            pp=vllm_config.parallel_config.pipeline_parallel_size,
            speculative=vllm_config.speculative_config is not None,
        )
        if why is not None:
            raise UnsupportedDesign(design_name(spec.config), why, where)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # the shared KV policy: a core Mamba-2 layer's states at loops >= 1 (loop 0's is its slot in attn_slots)
        self._loop_slot_of = shared_loop_slots(self.spec)
        name = maybe_prefix(prefix, "attn_slots")
        self.mamba_loop_slots = nn.ModuleList(
            mamba_slot(self, AttentionSlot(i, "core", layer, k), f"{name}.{i}")
            for (layer, k), i in self._loop_slot_of.items()
        )
        first = min(self._loop_slot_of.values(), default=0)
        self._loop_slot_of = {key: i - first for key, i in self._loop_slot_of.items()}  # -> mamba_loop_slots

    def _slot(self, part: str, layer: int, loop: int | None) -> nn.Module:
        i = self._loop_slot_of.get((layer, loop)) if part == "core" else None
        return super()._slot(part, layer, loop) if i is None else self.mamba_loop_slots[i]

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        cfg = plugin_spec(vllm_config.model_config.hf_config).config
        kw = mixer2_kwargs(cfg)
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
            intermediate_size=kw["intermediate_size"],
            n_groups=kw["n_groups"],
            num_heads=kw["num_heads"],
            head_dim=kw["head_dim"],
            state_size=kw["ssm_state_size"],
            conv_kernel=kw["conv_kernel_size"],
            num_spec=vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()


class LoopLMHybridForCausalLM(_MambaStates, LoopLMForCausalLM, HasInnerState, IsHybrid):
    """A looplm export with Mamba-2 and attention blocks (``config.json`` says ``LoopLMForCausalLM``; the
    plugin's config class names this one)."""


class LoopLMMambaForCausalLM(_MambaStates, LoopLMForCausalLM, HasInnerState, IsAttentionFree):
    """A looplm export with Mamba-2 blocks only."""
