"""looplm's out-of-tree vLLM plugin: looplm's looped models on stock vLLM (docs/vllm.md).

Installed with looplm, it is found by vLLM through the ``vllm.general_plugins`` entry point
(``looplm = "looplm.vllm:register"``); vLLM calls :func:`register` in each of its processes. ``import looplm``
never imports this package, and importing this package does not import vLLM (only :func:`register` and
:mod:`looplm.vllm.model` do), so its pure parts (:mod:`looplm.vllm.spec`) are usable and tested without vLLM.

Served architectures (:data:`looplm.vllm.spec.ARCHITECTURES`): ``LoopLMForCausalLM`` (``looplm export hf``),
``OuroForCausalLM`` and ``RavenForCausalLM`` (Ouro's and Huginn's directories in their original formats);
an export with Mamba-2 blocks is built as ``LoopLMHybridForCausalLM`` / ``LoopLMMambaForCausalLM``
(:data:`looplm.vllm.mamba_spec.MAMBA_ARCHITECTURES`, named by the plugin's config class).
"""

from __future__ import annotations

from .spec import ARCHITECTURES, KV_POLICIES, PluginSpec, UnsupportedDesign, plugin_spec, refusal

__all__ = ["ARCHITECTURES", "KV_POLICIES", "PluginSpec", "UnsupportedDesign", "plugin_spec", "refusal", "register"]


def register() -> None:
    """Register the architectures with vLLM's ``ModelRegistry`` (lazily, ``"module:Class"``: the model module
    is imported only when vLLM builds one) and their config classes with transformers' ``AutoConfig``.
    Idempotent: vLLM calls it once per process, tests and users may call it again."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .configs import CONFIG_CLASSES

    for model_type, cls in CONFIG_CLASSES.items():
        AutoConfig.register(model_type, cls, exist_ok=True)
    have = getattr(ModelRegistry, "models", {})
    from .mamba_spec import MAMBA_ARCHITECTURES

    for arch, target in {**ARCHITECTURES, **MAMBA_ARCHITECTURES}.items():
        current = have.get(arch)
        if (
            current is not None
            and f"{getattr(current, 'module_name', '')}:{getattr(current, 'class_name', '')}" == target
        ):
            continue  # already ours
        ModelRegistry.register_model(arch, target)
    # vLLM's per-architecture config hook of the Mamba-2 forms (looplm.vllm.mamba_config): prefix caching off,
    # SSM states in float32, and a pure Mamba model's state-cache options (a hybrid gets those from vLLM)
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .mamba_config import LoopLMMambaFormConfig

    for arch in MAMBA_ARCHITECTURES:
        MODELS_CONFIG_MAP[arch] = LoopLMMambaFormConfig
