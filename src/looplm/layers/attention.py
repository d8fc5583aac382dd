"""Causal self-attention with grouped-query heads, RoPE, optional QK-norm and a KV cache.

The attention product itself is :data:`attention`, a dispatch point (:mod:`looplm.dispatch`) whose
reference is ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory efficient kernels
where the device has them) with ``enable_gqa`` so that key/value heads are not materialised
``n_heads / n_kv_heads`` times. (looplm's CPU training path registers its own backward there:
:mod:`looplm.kernels.training`.)

It follows the library's one mixer interface (:mod:`looplm.blocks`): ``attn(u, fctx, cache)`` and
``attn.new_cache(batch_size)``. A recurrence rule can own an ``Attention`` at its own width (e.g.
StateLoop's causal-attention token mixer over the state, at ``d_s``); it declares the head dim in
``rope_dims`` so the model builds rotary tables for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import dispatch
from .linear import linear_group
from .rope import apply_rotary


def _attention_reference(q, k, v, attn_mask=None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, enable_gqa=enable_gqa)``;
    ``q [B, H, T, hd]``, ``k, v [B, H_kv, S, hd]`` -> ``[B, H, T, hd]``. Under CPU autocast the inputs are
    cast to the autocast dtype first, as autocast does for SDPA (so a provider sees one dtype)."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


attention = dispatch.Op("attention", _attention_reference, "softmax(q kᵀ/√d + mask) v")


def _copy_kv_columns_reference(src: list, dst: list, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """``dst[j][rows_i, :, cols_i] = src[j][rows_i, :, cols_i]`` for every pair ``j`` of ``[B, H_kv, capacity,
    hd]`` caches and row ``i`` (``cols [n]``, or ``[1]`` for every row): per-token exit's ``copy`` fill, the
    exit loop's keys and values written into the slots of the loops a token skipped."""
    for a, b in zip(src, dst):
        b[rows, :, cols] = a[rows, :, cols]  # [n, H_kv, hd]


copy_kv_columns = dispatch.Op(
    "copy_kv_columns",
    _copy_kv_columns_reference,
    "keys and values copied between caches at per-row columns (per-token exit's copy fill)",
)


class KVCache:
    """Keys and values of one (loop iteration, physical layer) slot: ``[B, H_kv, T_past, head_dim]``.

    With a ``capacity`` (``generate`` knows prompt + new tokens) the buffers are allocated once, at
    the first update, and each token is written in place; without one they grow by concatenation.
    Implements the cache-slot protocol of :mod:`looplm.cache`: ``seqlen``, ``index_select`` (keep /
    reorder batch rows: beam search, dropping finished rows) and ``crop`` (drop the newest tokens).

    Per-token early exit (:mod:`looplm.decode.token_schedule`) writes one column for *some* rows at a time: a
    :meth:`rows` view writes its rows' keys at column ``seqlen`` without advancing it (``pending``), the
    exit policy fills the other rows' entries there, and :meth:`commit` (called once per token by
    :meth:`looplm.cache.LoopCache.commit`) counts the column.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._k: torch.Tensor | None = None  # [B, H_kv, capacity or T_past, hd]
        self._v: torch.Tensor | None = None
        self._len = 0
        self.pending = 0  # columns written at [_len, _len + pending) by row views / fills, counted at commit

    @property
    def seqlen(self) -> int:
        return self._len

    @property
    def k(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self._len]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self._len]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v [B, H_kv, T, hd]``; return every key and value so far."""
        T = k.shape[2]
        if self.capacity is None:
            self._k = k if self._k is None else torch.cat([self._k, k], dim=2)
            self._v = v if self._v is None else torch.cat([self._v, v], dim=2)
        else:
            if self._len + T > self.capacity:
                raise ValueError(f"KV cache capacity {self.capacity} exceeded ({self._len} + {T} tokens)")
            if self._k is None:
                self.allocate(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], k.dtype, k.device)
            self._k[:, :, self._len : self._len + T] = k
            self._v[:, :, self._len : self._len + T] = v
        self._len += T
        return self.k, self.v

    def allocate(self, batch: int, heads: int, hd: int, hd_v: int, dtype, device) -> None:
        """The ``[batch, heads, capacity, hd]`` buffers (a preallocated cache; no-op once allocated)."""
        if self._k is None:
            if self.capacity is None:
                raise ValueError("a KV slot written row by row needs a capacity (preallocated buffers)")
            self._k = torch.empty(batch, heads, self.capacity, hd, dtype=dtype, device=device)
            self._v = torch.empty(batch, heads, self.capacity, hd_v, dtype=dtype, device=device)

    def append_buffers(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a kernel that writes one new token in place (a fused decode step): the preallocated
        ``[B, H_kv, capacity, hd]`` key and value buffers and the position to write at, or ``None`` when
        there are none to write into (a growing cache, buffers not allocated yet, full, another batch
        size). The writer then calls :meth:`advance`."""
        if self._k is None or self.capacity is None or self._len >= self.capacity or self._k.shape[0] != batch_size:
            return None
        return self._k, self._v, self._len

    def advance(self, n: int = 1) -> None:
        """Count ``n`` tokens written into :meth:`append_buffers`' buffers by someone else."""
        self._len += n

    # --- row subsets (per-token exit) ------------------------------------------------------------
    def rows(self, idx: torch.Tensor, batch: int, cols: torch.Tensor | None = None) -> "KVRows":
        """A view that writes and attends for batch rows ``idx`` only (of a ``batch``-row cache), in place;
        ``cols [n]``: each row's own column (rows at different tokens, :mod:`looplm.decode.depth_schedule`)."""
        return KVRows(self, idx, batch, cols)

    def write_rows(
        self, idx: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, batch: int, cols: torch.Tensor | None = None
    ) -> None:
        """Write ``k, v [n, H_kv, T, hd]`` for rows ``idx [n]`` (``None``: every row) at columns
        ``seqlen .. seqlen + T`` (pending), or one token per row at its own column ``cols [n]`` (not counted:
        a caller that places rows at their own columns keeps their lengths itself)."""
        T = k.shape[2]
        self.allocate(batch, k.shape[1], k.shape[-1], v.shape[-1], k.dtype, k.device)
        if cols is not None:
            if T != 1 or idx is None:
                raise ValueError(f"per-row columns take one token for given rows; got {T} tokens, rows {idx}")
            # (no host-side bound check: it would read cols on the host, a synchronisation per layer on CUDA;
            # a column past the capacity is an index error of the write itself, on the host or the device)
            self._k[idx, :, cols] = k[:, :, 0].to(self._k.dtype)  # [n, H_kv, hd] at (row idx_i, column cols_i)
            self._v[idx, :, cols] = v[:, :, 0].to(self._v.dtype)
            return
        if self._len + T > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({self._len} + {T} tokens)")
        cols = slice(self._len, self._len + T)
        if idx is None:
            self._k[:, :, cols] = k
            self._v[:, :, cols] = v
        else:
            self._k[:, :, cols].index_copy_(
                0, idx, k if k.dtype == self._k.dtype else k.to(self._k.dtype)
            )  # in place: a view
            self._v[:, :, cols].index_copy_(0, idx, v if v.dtype == self._v.dtype else v.to(self._v.dtype))
        self.pending = max(self.pending, T)

    def commit(self) -> None:
        """Count the pending columns (every row has its entry there now)."""
        self._len += self.pending
        self.pending = 0

    def index_select(self, idx: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k.index_select(0, idx), self._v.index_select(0, idx)

    def keep_columns(self, idx: torch.Tensor | None, length: int) -> None:
        """Row ``b`` keeps columns ``idx[b]`` (``[B, length]``, in order) as its first ``length`` (``None``: a crop):
        speculative decoding reclaiming its rejected drafts' columns (:meth:`looplm.cache.LoopCache.keep_columns`)."""
        if idx is None or self._k is None:
            self.crop(length)
            return
        if self.pending or length > self._len:
            raise ValueError(f"keep_columns: {length} of {self._len} columns ({self.pending} pending)")
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            kept = _take_columns(buf.contiguous(), idx)  # [B, H_kv, length, hd] (a cropped growing buffer is copied)
            if self.capacity is None:
                setattr(self, name, kept)
            else:
                buf[:, :, :length] = kept  # (gathered first: the rows' columns move left within one buffer)
        self._len = length

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a KV cache of {self._len} tokens to {length}")
        if self._k is not None and self.capacity is None:
            self._k, self._v = self._k[:, :, :length], self._v[:, :, :length]
        self._len = length
        self.pending = 0


def _take_columns(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Row ``b``'s columns ``idx[b]`` of a contiguous ``buf [B, H, C, hd]``: ``[B, H, n, hd]`` for ``idx [B, n]``.
    One ``index_select`` over the buffer's flat ``[B·H·C, hd]`` rows (each a contiguous copy): ~4× faster on a
    CPU than ``gather`` with the index expanded over heads and features (2.3 against 9.6 ms for a
    ``[8, 16, 280, 64]`` fp32 slot), which walks every element through its index."""
    B, H, C, hd = buf.shape
    flat = (torch.arange(B * H, device=buf.device).view(B, H, 1) * C + idx[:, None, :]).flatten()  # [B·H·n]
    return buf.view(B * H * C, hd).index_select(0, flat).view(B, H, idx.shape[1], hd)


class KVRows:
    """Rows ``idx`` of a :class:`KVCache` (or of a loop-shared slot, :class:`looplm.cache.SharedKV`): the
    active rows of one loop iteration under per-token exit.

    :meth:`attend` writes the rows' new keys and values into the base buffers at column ``seqlen``
    (pending until the token is committed) and attends over each row's own keys *in place*: the queries
    are scattered into a ``[B, H, T, hd]`` tensor (zeros for the rows that wait), one attention runs over
    the whole buffer, and the active rows' outputs are gathered. No key or value is copied; the waiting
    rows' attention is computed and thrown away (on the reference path; the fused CPU step attends the
    active rows only, :mod:`looplm.kernels.decode`). When the rows are under a third of the buffer's (a
    flat ``[R·B, ...]`` buffer of every loop, :mod:`looplm.decode.depth_schedule`, at R = 32 for Huginn), their keys
    and values are gathered instead: ``3·n`` rows of memory traffic (read, write, attend) against ``B``.
    """

    def __init__(self, base: KVCache, idx: torch.Tensor, batch: int, cols: torch.Tensor | None = None):
        self.base, self.idx, self.batch, self.cols = base, idx, batch, cols

    @property
    def seqlen(self) -> int:
        return self.base.seqlen

    def attend(self, q, k, v, attn_mask, enable_gqa: bool) -> torch.Tensor:
        """``q [n, H, T, hd]``, ``k, v [n, H_kv, T, hd]`` of rows ``idx``; ``attn_mask`` ``None`` or bool
        ``[n, 1, T, seqlen + T]`` -> ``[n, H, T, hd]``. With per-row columns (``cols``) one token per row is
        written at its own column and the mask ``[n, 1, 1, L]`` says which of the first ``L`` each row reads."""
        base, n, T = self.base, q.shape[0], q.shape[2]
        base.write_rows(self.idx, k, v, self.batch, self.cols)
        if self.cols is not None and attn_mask is None:
            raise ValueError("a row view with per-row columns needs the mask of each row's keys")
        L = base.seqlen + T if self.cols is None else attn_mask.shape[-1]
        K, V = base._k[:, :, :L], base._v[:, :, :L]  # [B, H_kv, L, hd]: views, every row's own keys
        if attn_mask is None and T > 1:  # several new tokens without a mask: causal among themselves
            attn_mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)[None, None].expand(n, 1, T, L)
        if 3 * n < self.batch:  # a few rows of a large buffer: their keys gathered, [n, H_kv, L, hd]
            return attention(
                q,
                K.index_select(0, self.idx),
                V.index_select(0, self.idx),
                attn_mask=attn_mask,
                is_causal=False,
                enable_gqa=enable_gqa,
            )
        q_all = q.new_zeros(self.batch, *q.shape[1:]).index_copy_(0, self.idx, q)  # [B, H, T, hd]
        mask = None
        if attn_mask is not None:
            mask = torch.ones(self.batch, 1, T, L, dtype=torch.bool, device=q.device).index_copy_(
                0, self.idx, attn_mask
            )
        y = attention(q_all, K, V, attn_mask=mask, is_causal=False, enable_gqa=enable_gqa)  # [B, H, T, hd]
        return y.index_select(0, self.idx)

    def append_buffers(self, batch_size: int):
        """The fused step's write target: ``(k_buf, v_buf, pos)`` of the base (``batch_size`` = the active
        rows; the op writes row ``i`` into buffer row ``idx[i]``), or ``None``. With per-row columns the
        caller passes ``cols`` and ``pos`` is the mask's (the op's ``cols`` argument, :mod:`looplm.kernels.decode`)."""
        return self.base.append_buffers(self.batch)

    def advance(self, n: int = 1) -> None:
        if self.cols is None:  # per-row columns are counted by their caller
            self.base.pending = max(self.base.pending, n)

    def index_select(self, idx):  # pragma: no cover - views live for one loop iteration
        raise TypeError("a row view of a KV slot cannot be reordered; reorder the cache")

    def crop(self, length):  # pragma: no cover
        raise TypeError("a row view of a KV slot cannot be cropped; crop the cache")


class Attention(nn.Module):
    """Multi-head causal self-attention (GQA). Parameter names follow HF Llama/Qwen3.

    ``q = W_q x``, ``k = W_k x``, ``v = W_v x`` split into heads; optional per-head RMSNorm of q and k
    (Qwen3 QK-norm) *before* RoPE on the first ``rotary_dim`` channels (``None`` = no RoPE);
    ``softmax(q kᵀ / √hd + mask) v``; output projection ``W_o``. ``bias``: biases on all four
    projections; ``qk_bias``: on ``W_q`` and ``W_k`` only (Huginn). ``sliding_window = w``: query ``i``
    attends to keys ``j`` with ``i − w < j <= i`` only (local attention, Ouro's ``sliding_attention`` layers).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        bias: bool = False,
        qk_bias: bool = False,
        rotary_dim: int | None = None,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias or qk_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias or qk_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def new_cache(self, batch_size: int, device=None, dtype=None, capacity: int | None = None) -> KVCache:
        """An empty KV slot, allocated at its first update (``capacity`` tokens, or growing when ``None``)."""
        return KVCache(capacity)

    def kv_of(self, x: torch.Tensor, fctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, H_kv, T, hd]`` that :meth:`forward` would cache for ``x [B, T, d_model]``
        (projections, QK-norm, RoPE at ``fctx``'s positions), without the query side (per-token exit's
        ``propagate`` fill, :mod:`looplm.decode.exits`)."""
        B, T, _ = x.shape
        k, v = linear_group(x, (self.k_proj, self.v_proj))
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, hd]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.rotary_dim is not None:
            cos, sin = fctx.rope_for(self.rotary_dim)  # [B, T, rot]
            k = apply_rotary(k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, fctx, cache: KVCache | None = None) -> torch.Tensor:
        """``x [B, T, d_model]`` -> ``[B, T, d_model]``; masks and rotary tables come from ``fctx``."""
        B, T, _ = x.shape
        q, k, v = linear_group(x, (self.q_proj, self.k_proj, self.v_proj))  # a dispatch point (looplm.dispatch)
        # [B, T, H*hd] -> [B, H, T, hd]
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is not None:
            cos, sin = fctx.rope_for(self.rotary_dim)  # [B, T, rot]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if cache is not None and hasattr(
            cache, "attend"
        ):  # rows of a batch (per-token exit): the slot attends in place
            mask = fctx.attn_mask
            if self.sliding_window is not None:
                S = cache.seqlen + T
                mask = self._window_mask(mask, T, S, x.device).expand(B, 1, T, S)
            y = cache.attend(q, k, v, mask, gqa)  # [B, H, T, hd]
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.update(k, v)  # [B, H_kv, T_past + T, hd]
        mask, causal = fctx.attn_mask, fctx.is_causal and fctx.attn_mask is None
        if self.sliding_window is not None:
            mask, causal = self._window_mask(mask, T, k.shape[2], x.device), False
        y = attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=gqa,
        )  # [B, H, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _window_mask(self, mask: torch.Tensor | None, T: int, S: int, device) -> torch.Tensor:
        """The forward's mask (``None`` = causal) and the window band ``i − w < j <= i``: bool
        ``[B or 1, 1, T, S]`` for the ``T`` new queries (the last ``T`` of ``S`` positions). Left padding
        only precedes the real tokens, so index distance is token distance within a row."""
        q_idx = torch.arange(S - T, S, device=device)[:, None]
        k_idx = torch.arange(S, device=device)[None, :]
        band = ((k_idx <= q_idx) & (k_idx > q_idx - self.sliding_window))[None, None]  # [1, 1, T, S]
        # the forward's mask keeps every query's own position (a padding row: finite garbage, never NaN); so does the band
        return band if mask is None else mask & band
