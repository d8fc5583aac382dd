"""The names the wire format (:mod:`.protocol`) and the engine share, in a module that imports neither torch nor
pydantic: a bad field of a request, and the most top log-probabilities a token may ask for."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_LOGPROBS", "FieldError"]

MAX_LOGPROBS = 20  # the most top log-probabilities a token may ask for (OpenAI's limit)


@dataclass(frozen=True)
class FieldError:
    """One bad field of a request: its name as the request spells it, and what to do."""

    field: str
    message: str
