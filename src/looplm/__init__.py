"""looplm — looped (recurrent-depth) language models.

>>> import looplm
>>> model = looplm.build("tiny-llama")
>>> model(input_ids).logits
"""

from .config import ModelConfig, list_presets, load_model_config
from .factory import build
from .model import LoopedLM, LoopedLMOutput

__version__ = "0.1.0"

__all__ = ["LoopedLM", "LoopedLMOutput", "ModelConfig", "build", "list_presets", "load_model_config", "__version__"]
