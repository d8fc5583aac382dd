"""Decoding caches for looped models: one slot per (loop iteration, physical layer).

A looped model runs the same core block at every iteration, but on different hidden states, so
the keys/values (attention) and (conv, ssm) states (Mamba-2) of iteration ``k`` belong to iteration
``k`` only: a token decoded at iteration ``k`` attends to the iteration-``k`` keys of its prefix.

Slot keys:

* ``(0, i)``        prelude block ``i`` (physical index ``i``), run once,
* ``(k, p + j)``    core block ``j`` at loop iteration ``k``,
* ``(0, p + s + j)`` coda block ``j``,
* ``("rule", key)`` slots owned by the recurrence rule (e.g. StateLoop's token-axis mixers, per iteration).

Planned per-token early exit at decode time: a token that exits after iteration ``k*`` still has to
leave entries in the slots of iterations ``k > k*`` (e.g. its exit state passed through the remaining
core blocks' key/value projections) so later tokens can attend to it. Slots are addressed by key, so
that filling needs nothing beyond writing those slots; ``seqlen`` is tracked per cache, and every slot
of a complete cache has the same length.
"""

from __future__ import annotations

from typing import Any, Callable


class LoopCache:
    """All decoding state of one batch. Created by :meth:`LoopedLM.new_cache` or lazily by ``generate``."""

    def __init__(self, num_loops: int, batch_size: int, device=None, dtype=None):
        self.num_loops = num_loops
        self.batch_size = batch_size
        self.device, self.dtype = device, dtype
        self.seqlen = 0  # tokens absorbed so far
        self.slots: dict[Any, Any] = {}

    def slot(self, key, factory: Callable[[], Any]):
        """The slot under ``key``, created by ``factory()`` on first use."""
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = factory()
        return s

    def index_select(self, idx) -> None:
        """Keep batch rows ``idx`` in every slot."""
        for s in self.slots.values():
            s.index_select(idx)
        self.batch_size = len(idx)

    def __repr__(self) -> str:
        return f"LoopCache(num_loops={self.num_loops}, seqlen={self.seqlen}, slots={len(self.slots)})"
