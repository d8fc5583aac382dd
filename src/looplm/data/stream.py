"""What every batch stream shares: the base class, the end-of-data exception, the state version,
config checking, tokenizer resolution, and the JSON form of a ``random.Random`` state.

Both stream kinds build on this module and on nothing of each other:

* :class:`~looplm.data.pipeline.TokenStream` -- documents -> shuffle -> tokens -> packed rows;
* :class:`~looplm.data.memmap.MemmapStream` -- windows of pre-tokenized memmap shards.

:func:`~looplm.data.pipeline.build_stream` picks one of them for a :class:`DataConfig`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..dataclass_util import ConfigError
from .config import DataConfig
from .tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "STATE_VERSION",
    "BatchStream",
    "StreamExhausted",
    "check_config",
    "resolve_tokenizer",
    "rng_state_to_json",
    "rng_state_from_json",
]

STATE_VERSION = 1  # version of the JSON states of TokenStream and MemmapStream


class StreamExhausted(EOFError):
    """A finite stream (validation, one-epoch pass) has no more full batches."""


class BatchStream:
    """A stream of token batches ``LongTensor [n, seq_len]`` with a JSON state.

    Subclasses implement :meth:`next_batch`, :meth:`state_dict` and :meth:`load_state_dict`;
    :meth:`iter_batches` comes for free.
    """

    seq_len: int

    def next_batch(self, n: int, allow_partial: bool = False) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def state_dict(self) -> dict:  # pragma: no cover
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def iter_batches(self, n_batches: int | None, batch_size: int) -> Iterator[torch.Tensor]:
        """Yield up to ``n_batches`` batches (``None`` = until a finite stream ends).

        The last batch of a finite stream may have fewer than ``batch_size`` rows.
        """
        i = 0
        while n_batches is None or i < n_batches:
            try:
                yield self.next_batch(batch_size, allow_partial=True)
            except StreamExhausted:
                return
            i += 1


def check_config(cfg: DataConfig) -> None:
    """Raise one ``ConfigError`` listing every problem of a ``DataConfig`` built by hand."""
    errors = cfg.validate()
    if errors:
        raise ConfigError(errors, "data config")


def resolve_tokenizer(cfg: DataConfig, tokenizer: Tokenizer | str | None) -> Tokenizer:
    """``tokenizer`` itself, :func:`load_tokenizer` of a spec string, or of ``cfg.tokenizer`` if ``None``."""
    if tokenizer is None:
        return load_tokenizer(cfg.tokenizer)
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    return tokenizer


def rng_state_to_json(state: tuple) -> list:
    """``random.Random.getstate()`` as a JSON list (``[version, [internal...], gauss_next]``)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_state_from_json(data: list) -> tuple:
    """Inverse of :func:`rng_state_to_json`: a state for ``random.Random.setstate``."""
    version, internal, gauss = data
    return (int(version), tuple(int(x) for x in internal), gauss)
