"""``kv='propagate'`` fills carried into the next core pass: one weight stream for the pass and the fill.

Under per-token exit with the ``propagate`` policy (:mod:`looplm.decode.exits`, CALM's propagation) a token that
exits after loop ``k`` needs, for every loop ``k' > k`` it skipped and every attention layer ``j`` of the
core, the key and value its stand-in ``Z^{k+1}`` (what loop ``k + 1`` would have read) gets from that layer::

    K_j, V_j = kv_j(RMSNorm_j(Z^{k+1}))       # the layer's norm, k/v products, QK-norm, RoPE at the token

written at the token's column of loop ``k'``'s slot, for every ``k'``. Computed on its own that is one K/V
product per layer for a few rows: a decode step is weight-bound, so it streams ``W_k`` and ``W_v`` of every
core layer once more (about a sixth of a core pass at d = 1024) — why ``propagate`` missed the wall-time
target where ``copy`` met it.

Nobody reads those entries before the next core pass is over: a later token of the row reads loop
``k' ≥ 1`` of this token's column only after its own loop 0 ran (the token schedule: the next token's first
core pass; continuous depth batching, :mod:`looplm.decode.depth_schedule`: the row's next token starts at loop 0 at the
next pass). So a decoder keeps the fill as a :class:`KVFill` and offers it to its next core call
(:func:`looplm.dispatch.offer_kv_fill`). A fused stack step (:mod:`looplm.kernels.decode`'s
``decode_stack``) takes the stand-ins as extra rows of each layer's own K/V product — the weights it streams
anyway — and marks the fill ``written``; where no step takes it (the reference path, a GPU, a core with
Mamba-2 layers), :meth:`KVFill.write` writes it right after that call: the reference, the same arithmetic
as the fill computed on its own. A decoder that stops decoding (the end of ``generate``, a speculative draft,
the next prompt) writes what it still holds (``flush``), so the cache a caller sees is complete.
"""

from __future__ import annotations

import torch

from ..context import ForwardContext

__all__ = ["KVFill"]


class KVFill:
    """Stand-in rows whose keys and values the attention ``blocks`` of ``stack`` write into their buffers.

    ``buffers[l][j]``: block ``l``'s ``j``-th destination, a :class:`~looplm.layers.attention.KVCache` (its
    ``[rows, H_kv, capacity, hd]`` buffers, read when the fill is written); :meth:`add` appends stand-ins
    ``z [n, 1, d]`` with their rotary tables and their targets (buffer ``j``, rows, columns)."""

    def __init__(self, stack, blocks: list, buffers: list[list]):
        self.stack, self.blocks, self.buffers = stack, blocks, buffers
        self._z: list = []  # [n, 1, d] per add
        self._rope: list = []  # {rot: (cos, sin) [n, 1, rot]} per add
        self._targets: list = []  # [(j, rows [m], cols [m], src [m])] with src global
        self.n = 0  # stand-in rows so far
        self.written = False

    def add(self, z: torch.Tensor, rope: dict, targets: list) -> None:
        """Stand-ins ``z [n, 1, d]`` (one token per row), their tables ``rope`` (rotary dim -> ``(cos, sin)``
        ``[n or 1, 1, rot]``) and ``targets``: ``(j, rows [n·m], cols [n·m] or an int, src [n·m])``, row
        ``src`` of ``z`` written at row ``rows``, column ``cols`` of buffer ``j`` of every block."""
        n = z.shape[0]
        self._z.append(z)
        self._rope.append({r: (c.expand(n, 1, -1), s.expand(n, 1, -1)) for r, (c, s) in rope.items()})
        for j, rows, cols, src in targets:
            cols = torch.full_like(rows, cols) if isinstance(cols, int) else cols
            self._targets.append((j, rows, cols, src + self.n))
        self.n += n

    # the assembled fill --------------------------------------------------------------------------------
    def z(self) -> torch.Tensor:
        """Every stand-in ``[F, 1, d]``."""
        return torch.cat(self._z) if len(self._z) > 1 else self._z[0]

    def rope(self, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[F, 1, rot]`` of every stand-in."""
        parts = [r[rot] for r in self._rope]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def index(self) -> torch.Tensor:
        """``[D, 4]`` int64: ``(buffer, row, column, stand-in row)`` per written entry."""
        return torch.cat([torch.stack((torch.full_like(r, j), r, c, s), 1) for j, r, c, s in self._targets])

    def tables(self) -> ForwardContext:
        """The stand-ins' forward context (their rotary tables; one token each) for the reference."""
        return ForwardContext(rope={r: self.rope(r) for r in self._rope[0]}, is_causal=False)

    def flops_per_row(self) -> float:
        """FLOPs of one stand-in's k / v products over the blocks (what the fill adds, wherever it runs)."""
        return sum(2.0 * (b.mixer.k_proj.weight.numel() + b.mixer.v_proj.weight.numel()) for b in self.blocks)

    # the reference ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def write(self) -> None:
        """Each block's keys and values of the stand-ins (its norm and :meth:`Attention.kv_of`), scattered into
        its buffers: what the fill computed on its own writes."""
        if self.written or self.n == 0:
            self.written = True
            return
        z, fctx = self.z(), self.tables()
        by_buf: dict = {}
        for j, r, c, s in self._targets:
            by_buf.setdefault(j, []).append((r, c, s))
        groups = {j: tuple(torch.cat(p) if len(ps) > 1 else p[0] for p in zip(*ps)) for j, ps in by_buf.items()}
        for blk, bufs in zip(self.blocks, self.buffers):
            k, v = blk.mixer.kv_of(blk.mixer_norm(z), fctx)  # [F, H_kv, 1, hd]
            for j, (rows, cols, src) in groups.items():
                b = bufs[j]
                b._k[rows, :, cols] = k[src, :, 0].to(b._k.dtype)  # [m, H_kv, hd] at (row, column) pairs
                b._v[rows, :, cols] = v[src, :, 0].to(b._v.dtype)
        self.written = True
