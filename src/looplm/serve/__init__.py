"""Serving a looped model: an engine that batches requests continuously, each at its own depth
(:mod:`.engine`), and an OpenAI-compatible HTTP server over it (``looplm serve``): the request path of the
completions and chat endpoints (:mod:`.serving`), the FastAPI app (:mod:`.app`: routes, checks; its state and
drain: :mod:`.state`) and its uvicorn runner (:mod:`.server`). (:mod:`.api` keeps the old imports working.)

Importing ``looplm.serve`` loads neither FastAPI nor uvicorn: the engine is plain PyTorch and threads; the
server's modules import them when a server is built. ``docs/serving.md`` is the user's guide.
"""

from . import engine as _engine
from .engine import (  # noqa: F401
    Engine,
    EngineClosed,
    EngineConfig,
    FieldError,
    FinishEvent,
    PromptEvent,
    QueueFull,
    RequestError,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)

# the engine's names imported above, in the engine's order (the rest of its API is imported from .engine)
__all__ = [name for name in _engine.__all__ if name in globals()]
