"""Hugging Face interoperability: export to / import from transformers model directories, and the
layer maps that start a looped model from a pretrained stack.

* :func:`export_hf` (``looplm export hf``) — a checkpoint as a self-contained transformers model
  directory: remote code (:mod:`looplm.hf.remote`) and looplm's own model code copied flat beside it
  (:mod:`looplm.hf.bundle`), loadable offline with ``trust_remote_code=True`` where only torch and
  transformers are installed;
* :func:`import_hf` (``looplm import hf``) — a looplm export, or a Llama / Qwen3 / Mamba-2 model
  (safetensors or GGUF), as a looplm checkpoint;
* :func:`register_auto_classes` — make ``AutoConfig`` / ``AutoModelForCausalLM`` know ``looplm``
  without remote code (done by :func:`export_hf` and the harness);
* :mod:`looplm.hf.retrofit` — ``train.init_from`` with a layer map: pretrained layers -> prelude /
  core / coda (retrofitting recurrence into a pretrained model).
"""

from __future__ import annotations

__all__ = ["export_hf", "import_hf", "register_auto_classes"]


def export_hf(*args, **kwargs):
    """See :func:`looplm.hf.export.export_hf`."""
    from .export import export_hf as _export

    return _export(*args, **kwargs)


def import_hf(*args, **kwargs):
    """See :func:`looplm.hf.importer.import_hf`."""
    from .importer import import_hf as _import

    return _import(*args, **kwargs)


_REGISTERED = False


def register_auto_classes() -> None:
    """Register ``LoopLMConfig`` / ``LoopLMForCausalLM`` under ``model_type: looplm`` with the transformers
    Auto classes (idempotent), so exports load in this process without ``trust_remote_code``."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from .remote.configuration_looplm import LoopLMConfig
    from .remote.modeling_looplm import LoopLMForCausalLM

    try:
        AutoConfig.register("looplm", LoopLMConfig)
        AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM)
    except ValueError:  # already registered (e.g. by another copy of these classes)
        pass
    _REGISTERED = True
