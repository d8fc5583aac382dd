"""looplm — looped (recurrent-depth) language models.

>>> import looplm
>>> model = looplm.build("tiny-llama")
>>> model(input_ids).logits
"""

from . import _moved
from .config import ModelConfig, list_presets, load_model_config
from .factory import build
from .model import LoopedLM, LoopedLMOutput

__version__ = "0.1.0"

_moved.install()  # the old import paths of moved modules (looplm.adaptive_forward -> looplm.decode.exit_forward, ...)


def __getattr__(name: str):  # looplm.<old module name> as an attribute: the moved module, with a DeprecationWarning
    return _moved.moved_attribute(name)


__all__ = ["LoopedLM", "LoopedLMOutput", "ModelConfig", "build", "list_presets", "load_model_config", "__version__"]
