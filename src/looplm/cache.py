"""Decoding caches for looped models: one slot per (loop iteration, physical layer).

A looped model runs the same core block at every iteration, but on different hidden states, so
the keys/values (attention) and (conv, ssm) states (Mamba-2) of iteration ``k`` belong to iteration
``k`` only: a token decoded at iteration ``k`` attends to the iteration-``k`` keys of its prefix.

Slot keys:

* ``(0, i)``                     prelude block ``i`` (physical index ``i``), run once,
* ``(k, p + j)``                 core block ``j`` at loop iteration ``k``,
* ``(0, p + s + j)``             coda block ``j`` on the final output,
* ``("readout", k, p + s + j)``  coda block ``j`` when a rule reads out iterate ``k`` (``lctx.readout``;
  ``("exit-check", k, p + s + j)`` for the ``kl`` exit criterion's own readouts),
* ``("rule", key)``              slots owned by the recurrence rule; ``("rule", name, k)`` one per iteration
  (``lctx.loop_slot``, e.g. StateLoop's token-axis mixers).

The cache-slot protocol
-----------------------
Every slot implements :class:`CacheSlot`: ``seqlen`` (tokens absorbed), ``index_select(idx)`` (keep or
reorder batch rows, e.g. drop finished rows or reorder beams) and ``crop(length)`` (drop the newest
tokens; a recurrent state can only "crop" to its own length and says so). :meth:`LoopCache.slot`
checks this when a slot is created, so a rule cannot hand in a bare tensor that would silently keep all
its rows when the batch is reordered: wrap such a tensor in :class:`TensorSlot`.

Per-token early exit (:mod:`looplm.decode.token_schedule`)
--------------------------------------------
A token that exits after iteration ``k*`` must still leave an entry in every later iteration's slots,
because later tokens attend to it (attention) or carry a state through it (Mamba-2). So slots of one
*family* (a core layer, a readout's coda layer, a rule's per-iteration mixer) are registered with their
loop index (:meth:`LoopCache.slot` ``loop=``, ``family=``), and the exit policy fills the skipped loops'
slots of each family from the exit (``copy``, ``propagate``; SSM: ``freeze``, ``propagate``, ``decay``)
— see ``docs/adaptive-depth.md``. Under ``kv_shared=True`` (the ``shared`` policy) a family's attention
slots are one :class:`SharedKV` buffer for every loop: each loop overwrites the token's column, so a
later token reads every earlier token at the last loop it ran (memory ÷ K).

Within one token the active rows of a loop write through row views (``slot.rows(idx, batch)``) at column
``seqlen`` without advancing it; :meth:`LoopCache.commit` counts the column once every row has its entry.
Under continuous depth batching (:mod:`looplm.decode.depth_schedule`) rows are at different tokens: a row view with
per-row columns (``slot.rows(idx, batch, cols)``, :meth:`LoopCache.rows` ``cols=``) writes each row's token
at its own column, and the driver keeps each row's length itself.

``seqlen`` is tracked per cache; every slot of a complete cache has the same length.

Reclaiming columns (:mod:`looplm.decode.speculative`)
----------------------------------------------
A batched speculative round writes ``k + 1`` columns per row and keeps each row's accepted ones: the rest
become holes, masked like left padding. :meth:`LoopCache.keep_columns` gives the cache back its holes —
row ``b`` keeps columns ``idx[b]`` (in order) as its first ``length`` columns — through the slots' optional
``keep_columns(idx, length)`` (:class:`~looplm.layers.attention.KVCache` gathers its columns per row,
:class:`~looplm.layers.mamba2.Mamba2State` holds no columns and only recounts, :class:`TensorSlot`
gathers along its time axis). Positions count a row's unmasked columns, so a row reads the same keys at
the same positions after it.
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

    def keep_columns(self, idx: torch.Tensor | None, length: int) -> None:
        """Row ``b`` keeps time steps ``idx[b]`` (``[B, length]``, in order; ``None``: the first ``length``)."""
        if self.time_dim is None or self.value is None:
            self._len = length
            return
        if idx is None:
            self.value = self.value.narrow(self.time_dim, 0, length)
            return
        v, t = self.value, self.time_dim % self.value.dim()
        shape = [1] * v.dim()
        shape[0], shape[t] = idx.shape
        sizes = list(v.shape)
        sizes[t] = length
        self.value = v.gather(t, idx.view(shape).expand(sizes))  # [B, .., length, ..]

    def crop(self, length: int) -> None:
        if self.time_dim is None:
            if length != self._len:
                raise ValueError(
                    f"cannot crop a {type(self).__name__} without a time axis from {self._len} to {length}"
                )
            return
        if self.value is not None:
            self.value = self.value.narrow(self.time_dim, 0, length)


class SharedKV:
    """One loop's view of a family's single KV slot (``kv_shared``): writes go to the token's columns at
    ``seqlen`` (overwriting the previous loop's entry) and count at :meth:`commit`; reads see every
    committed column (each earlier token at the last loop it ran) and the columns just written."""

    def __init__(self, base):
        self.base = base

    @property
    def seqlen(self) -> int:
        return self.base.seqlen

    def update(self, k: torch.Tensor, v: torch.Tensor):
        b = self.base
        b.write_rows(None, k, v, k.shape[0])  # every row's columns at seqlen, pending until commit
        L = b.seqlen + k.shape[2]
        return b._k[:, :, :L], b._v[:, :, :L]

    def rows(self, idx: torch.Tensor, batch: int, cols: torch.Tensor | None = None):
        return self.base.rows(idx, batch, cols)

    def append_buffers(self, batch_size: int):
        return self.base.append_buffers(batch_size)

    def advance(self, n: int = 1) -> None:
        self.base.pending = max(self.base.pending, n)

    def commit(self) -> None:
        self.base.commit()

    def index_select(self, idx: torch.Tensor) -> None:
        pass  # the LoopCache reorders the base once

    def crop(self, length: int) -> None:
        pass  # the LoopCache crops the base once


class LoopCache:
    """All decoding state of one batch. Created by :meth:`LoopedLM.new_cache` or lazily by ``generate``.

    ``kv_shared``: one KV buffer per family for every loop (the ``shared`` exit policy, see the module
    docstring); ``loop_slots[family][k]`` lists the loop-indexed slots."""

    def __init__(
        self,
        num_loops: int,
        batch_size: int,
        device=None,
        dtype=None,
        capacity: int | None = None,
        kv_shared: bool = False,
    ):
        self.num_loops = num_loops
        self.batch_size = batch_size
        self.capacity = capacity  # most tokens any slot will hold (preallocated KV), None = grow
        self.device, self.dtype = device, dtype
        self.seqlen = 0  # tokens absorbed so far
        self.slots: dict[Any, Any] = {}
        # the shapes of the model it belongs to (set by new_cache or the first forward): a cache of
        # another model is refused up front (LoopedLM.check_inputs), not deep inside a block
        self.model_signature: dict | None = None
        self.kv_shared = kv_shared
        if kv_shared and capacity is None:
            raise ValueError("kv_shared needs a capacity (one preallocated buffer per family)")
        self.loop_slots: dict[Any, dict[int, Any]] = {}  # family -> {loop: slot}
        self.shared: dict[Any, Any] = {}  # family -> the one KV buffer of its loops (kv_shared)

    def slot(self, key, factory: Callable[[], Any], loop: int | None = None, family=None):
        """The slot under ``key``, created by ``factory()`` on first use (checked against :class:`CacheSlot`).
        ``loop`` / ``family``: the slot is family ``family``'s at loop iteration ``loop`` (per-token exit
        fills a family's skipped loops; ``kv_shared`` gives a family's attention slots one buffer)."""
        s = self.slots.get(key)
        if s is None:
            s = factory()
            if not isinstance(s, CacheSlot):
                raise TypeError(
                    f"cache slot {key!r}: {type(s).__name__} does not implement the cache-slot protocol "
                    "(seqlen, index_select, crop); wrap a plain tensor in looplm.cache.TensorSlot"
                )
            if loop is not None:
                if self.kv_shared and hasattr(s, "write_rows"):  # an attention slot: the family's one buffer
                    s = SharedKV(self.shared.setdefault(family, s))
                self.loop_slots.setdefault(family, {})[loop] = s
            self.slots[key] = s
        return s

    def physical_slots(self) -> list:
        """Every distinct buffer once (a shared family's buffer, not its per-loop views)."""
        out = [s for s in self.slots.values() if not isinstance(s, SharedKV)]
        return out + list(self.shared.values())

    def lacking(self, method: str) -> dict[str, str]:
        """``{key: type name}`` of the distinct buffers (:meth:`physical_slots`) that have no ``method``."""
        named = [(k, s) for k, s in self.slots.items() if not isinstance(s, SharedKV)] + list(self.shared.items())
        return {str(k): type(s).__name__ for k, s in named if not hasattr(s, method)}

    def rows(self, idx: torch.Tensor, cols: torch.Tensor | None = None) -> "RowsCache":
        """The cache as rows ``idx`` of the batch see it for one loop iteration (per-token exit); ``cols
        [n]``: each row's token at its own column (rows at different tokens, :mod:`looplm.decode.depth_schedule`)."""
        return RowsCache(self, idx, cols)

    def commit(self, n: int) -> None:
        """``n`` new tokens absorbed: count the columns row views and fills wrote (every slot)."""
        for s in self.physical_slots():
            c = getattr(s, "commit", None)
            if c is not None:
                c()
        self.seqlen += n

    def index_select(self, idx: torch.Tensor) -> None:
        """Keep (or reorder) batch rows ``idx`` in every slot."""
        for s in self.physical_slots():
            s.index_select(idx)
        self.batch_size = len(idx)

    def crop(self, length: int) -> None:
        """Drop every token after the first ``length`` in every slot."""
        if not 0 <= length <= self.seqlen:
            raise ValueError(f"cannot crop a cache of {self.seqlen} tokens to {length}")
        for s in self.physical_slots():
            s.crop(length)
        self.seqlen = length

    def keep_columns(self, idx: torch.Tensor | None, length: int) -> None:
        """Row ``b`` keeps columns ``idx[b]`` (``[B, length]`` long, increasing) as its columns ``0 .. length − 1``
        in every slot; ``idx=None``: the first ``length`` columns (a crop of columns every row discards, which a
        Mamba-2 state allows too: it has absorbed only its rows' kept tokens). See the module docstring."""
        if not 0 < length <= self.seqlen or (idx is not None and tuple(idx.shape) != (self.batch_size, length)):
            shape = None if idx is None else tuple(idx.shape)
            raise ValueError(
                f"keep_columns: length {length} of a cache of {self.seqlen} tokens, idx shape {shape} "
                f"(want [{self.batch_size}, length] or None)"
            )
        missing = sorted(set(self.lacking("keep_columns").values()))
        if missing:
            raise TypeError(f"cache slots of type {missing} cannot drop columns (no keep_columns(idx, length))")
        for s in self.physical_slots():
            s.keep_columns(idx, length)
        self.seqlen = length

    def __repr__(self) -> str:
        return f"LoopCache(num_loops={self.num_loops}, seqlen={self.seqlen}, slots={len(self.slots)})"


class RowsCache:
    """Rows ``idx`` of a :class:`LoopCache` for one loop iteration: every slot it hands out is a row view
    of the full batch's slot (``slot.rows(idx, batch)``), so a loop over the active rows writes and reads
    those rows' entries in place."""

    def __init__(self, cache: LoopCache, idx: torch.Tensor, cols: torch.Tensor | None = None):
        self.cache, self.idx, self.cols = cache, idx, cols
        self.num_loops, self.capacity, self.seqlen = cache.num_loops, cache.capacity, cache.seqlen
        self.batch_size = cache.batch_size  # slots are made for the whole batch (their rows are viewed)
        self.device, self.dtype = cache.device, cache.dtype

    def slot(self, key, factory: Callable[[], Any], loop: int | None = None, family=None):
        s = self.cache.slot(key, factory, loop, family)
        view = getattr(s, "rows", None)
        if view is None:
            raise TypeError(
                f"cache slot {key!r}: {type(s).__name__} has no row view; per-token exit cannot run its rows"
            )
        if self.cols is None:
            return view(self.idx, self.cache.batch_size)
        return view(self.idx, self.cache.batch_size, cols=self.cols)
