"""transformers config classes of the directories the plugin serves, registered with ``AutoConfig`` by
:func:`looplm.vllm.register` so that vLLM reads their ``config.json`` without ``--trust-remote-code`` and
runs no code from the model directory (imports transformers, not vLLM).

* ``looplm`` -> :class:`looplm.hf.remote.configuration_looplm.LoopLMConfig`, the export's own config class
  (the same source the export carries);
* ``ouro`` / ``huginn_raven`` -> :class:`OuroConfig` / :class:`HuginnRavenConfig`: the original fields as they
  are, plus transformers' usual names (``hidden_size``, ``num_attention_heads``, ``max_position_embeddings``, ...)
  derived from the looplm config looplm's import maps them to (:func:`looplm.hf.public.public_config`),
  where the original has none — what vLLM reads for its own bookkeeping.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..hf.remote.configuration_looplm import LoopLMConfig, derived_fields

__all__ = ["CONFIG_CLASSES", "HuginnRavenConfig", "LoopLMConfig", "OuroConfig"]


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
    "looplm": LoopLMConfig,
    "ouro": OuroConfig,
    "huginn_raven": HuginnRavenConfig,
}
