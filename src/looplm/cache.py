"""Decoding caches for looped models: one slot per (loop iteration, physical layer).

A looped model runs the same core block at every iteration, but on different hidden states, so
the keys/values (attention) and (conv, ssm) states (Mamba-2) of iteration ``k`` belong to iteration
``k`` only: a token decoded at iteration ``k`` attends to the iteration-``k`` keys of its prefix.

Slot keys:

* ``(0, i)``                     prelude block ``i`` (physical index ``i``), run once,
* ``(k, p + j)``                 core block ``j`` at loop iteration ``k``,
* ``(0, p + s + j)``             coda block ``j`` on the final output,
* ``("readout", k, p + s + j)``  coda block ``j`` when a rule reads out iterate ``k`` (``lctx.readout``),
* ``("rule", key)``              slots owned by the recurrence rule (e.g. StateLoop's token-axis mixers,
  one per iteration).

The cache-slot protocol
-----------------------
Every slot implements :class:`CacheSlot`: ``seqlen`` (tokens absorbed), ``index_select(idx)`` (keep or
reorder batch rows, e.g. drop finished rows or reorder beams) and ``crop(length)`` (drop the newest
tokens; a recurrent state can only "crop" to its own length and says so). :meth:`LoopCache.slot`
checks this when a slot is created, so a rule cannot hand in a bare tensor that would silently keep all
its rows when the batch is reordered: wrap such a tensor in :class:`TensorSlot`.

Per-token early exit at decode time (not built yet) needs more than filling slots. A token that exits
after iteration ``k*`` must still leave an entry in every later iteration's slots, because later tokens
attend to it (attention) or carry a state through it (Mamba-2):

* an attention slot of iteration ``k > k*`` needs the token's key/value there, i.e. the input of that
  block at iteration ``k``. For the first core block a choice of stand-in input (the exit state, as
  in CALM-style state copying) suffices; the blocks after it need the output of the blocks before
  them, so the remaining blocks must run on the stand-in (cheaper only by skipping the MLPs and the
  query side), or the skipped entries must be marked and masked out for later tokens;
* a Mamba-2 slot needs a real mixer step on some input (its state cannot be left "unchanged" without
  desynchronising the conv window and ``seqlen``), so the exit saves nothing in SSM layers unless the
  state is simply carried over (``dt = 0``), which changes the model;
* rule slots follow the rule's own semantics.

``seqlen`` is tracked per cache; every slot of a complete cache has the same length.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class CacheSlot(Protocol):
    """What every decoding slot provides (see the module docstring)."""

    @property
    def seqlen(self) -> int: ...

    def index_select(self, idx: torch.Tensor) -> None: ...

    def crop(self, length: int) -> None: ...


class TensorSlot:
    """A slot holding one tensor whose dim 0 is the batch and dim ``time_dim`` (or none) the tokens.

    For rule state that must persist across decoding calls (e.g. a per-token running summary).
    ``value`` is ``None`` until first written.
    """

    def __init__(self, time_dim: int | None = 1):
        self.value: torch.Tensor | None = None
        self.time_dim = time_dim
        self._len = 0  # tokens absorbed when there is no time axis

    @property
    def seqlen(self) -> int:
        if self.time_dim is None or self.value is None:
            return self._len
        return self.value.shape[self.time_dim]

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate ``x`` along the time axis (or replace when there is none); returns the whole."""
        if self.time_dim is None:
            self.value = x
            self._len += 1
        else:
            self.value = x if self.value is None else torch.cat([self.value, x], dim=self.time_dim)
        return self.value

    def index_select(self, idx: torch.Tensor) -> None:
        if self.value is not None:
            self.value = self.value.index_select(0, idx)

    def crop(self, length: int) -> None:
        if self.time_dim is None:
            if length != self._len:
                raise ValueError(f"cannot crop a {type(self).__name__} without a time axis from {self._len} to {length}")
            return
        if self.value is not None:
            self.value = self.value.narrow(self.time_dim, 0, length)


class LoopCache:
    """All decoding state of one batch. Created by :meth:`LoopedLM.new_cache` or lazily by ``generate``."""

    def __init__(self, num_loops: int, batch_size: int, device=None, dtype=None, capacity: int | None = None):
        self.num_loops = num_loops
        self.batch_size = batch_size
        self.capacity = capacity  # most tokens any slot will hold (preallocated KV), None = grow
        self.device, self.dtype = device, dtype
        self.seqlen = 0  # tokens absorbed so far
        self.slots: dict[Any, Any] = {}
        # the shapes of the model it belongs to (set by new_cache or the first forward): a cache of
        # another model is refused up front (LoopedLM._check_inputs), not deep inside a block
        self.model_signature: dict | None = None

    def slot(self, key, factory: Callable[[], Any]):
        """The slot under ``key``, created by ``factory()`` on first use (checked against :class:`CacheSlot`)."""
        s = self.slots.get(key)
        if s is None:
            s = factory()
            if not isinstance(s, CacheSlot):
                raise TypeError(
                    f"cache slot {key!r}: {type(s).__name__} does not implement the cache-slot protocol "
                    "(seqlen, index_select, crop); wrap a plain tensor in looplm.cache.TensorSlot"
                )
            self.slots[key] = s
        return s

    def index_select(self, idx: torch.Tensor) -> None:
        """Keep (or reorder) batch rows ``idx`` in every slot."""
        for s in self.slots.values():
            s.index_select(idx)
        self.batch_size = len(idx)

    def crop(self, length: int) -> None:
        """Drop every token after the first ``length`` in every slot."""
        if not 0 <= length <= self.seqlen:
            raise ValueError(f"cannot crop a cache of {self.seqlen} tokens to {length}")
        for s in self.slots.values():
            s.crop(length)
        self.seqlen = length

    def __repr__(self) -> str:
        return f"LoopCache(num_loops={self.num_loops}, seqlen={self.seqlen}, slots={len(self.slots)})"
