"""transformers config classes of the directories the plugin serves, registered with ``AutoConfig`` by
:func:`looplm.vllm.register` so that vLLM reads their ``config.json`` without ``--trust-remote-code`` and
runs no code from the model directory (imports transformers, not vLLM).

* ``looplm`` -> :class:`VllmLoopLMConfig`: the export's own config class
  (:class:`looplm.hf.remote.configuration_looplm.LoopLMConfig`, the same source the export carries), which
  names the served architecture of a Mamba-2 or hybrid design;
* ``ouro`` / ``huginn_raven`` -> :class:`OuroConfig` / :class:`HuginnRavenConfig`: the original fields as they
  are, plus transformers' usual names (``hidden_size``, ``num_attention_heads``, ``max_position_embeddings``, ...)
  derived from the looplm config looplm's import maps them to (:func:`looplm.hf.public.public_config`),
  where the original has none — what vLLM reads for its own bookkeeping.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..hf.remote.configuration_looplm import LoopLMConfig, derived_fields

__all__ = ["CONFIG_CLASSES", "HuginnRavenConfig", "LoopLMConfig", "OuroConfig", "VllmLoopLMConfig"]


class VllmLoopLMConfig(LoopLMConfig):
    """looplm's export config as vLLM reads it: :class:`LoopLMConfig` itself, except that a design with Mamba-2
    blocks names the architecture vLLM builds for it (``LoopLMHybridForCausalLM`` / ``LoopLMMambaForCausalLM``,
    :func:`looplm.vllm.mamba_spec.served_architecture`: vLLM reads a model's state interfaces from its class) and
    carries ``mamba_chunk_size`` for vLLM's Mamba-2 metadata. The export itself still says ``LoopLMForCausalLM``."""

    model_type = "looplm"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not self.looplm:
            return  # a default-constructed config (transformers makes one to diff against)
        from ..config import ModelConfig
        from .mamba_spec import mamba_layers, served_architecture

        cfg = ModelConfig.from_dict(dict(self.looplm))
        if mamba_layers(cfg):
            self.architectures = [served_architecture(cfg)]
            self.mamba_chunk_size = cfg.mamba.chunk_size


class _PublicConfig(PretrainedConfig):
    """An original-format config: every field kept, transformers' names filled in where missing."""

    model_type = ""

    def __init__(self, **kwargs):
        from ..hf.public import public_config

        super().__init__(**kwargs)
        if not kwargs.keys() & {"hidden_size", "n_embd"}:
            return  # a default-constructed config (transformers makes one to diff against): no model to map
        original = {**kwargs, "model_type": self.model_type}
        cfg = public_config(original)  # every unsupported or missing field named (PublicFormatError)
        for k, v in derived_fields(cfg).items():
            if k not in kwargs and k not in ("rope_scaling", "tie_word_embeddings"):
                setattr(self, k, v)


# transformers 5 makes config classes dataclasses: a subclass without an __init__ of its own would get a generated
# one instead of _PublicConfig's
class OuroConfig(_PublicConfig):
    model_type = "ouro"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class HuginnRavenConfig(_PublicConfig):
    model_type = "huginn_raven"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "looplm": VllmLoopLMConfig,
    "ouro": OuroConfig,
    "huginn_raven": HuginnRavenConfig,
}
