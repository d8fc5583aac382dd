"""Mamba-2 mixer in plain PyTorch: a readable reference scan, the chunked (SSD) training scan and the
single-token decoding step, plus the optional ``mamba_ssm`` CUDA kernels.

The state space model (Dao & Gu 2024, "Transformers are SSMs", the SSD layer)
----------------------------------------------------------------------------
Per head ``h`` the layer keeps a state ``H_t`` of shape ``[P, N]`` (head dim x state dim). With a scalar,
negative ``A_h`` and input dependent ``dt_t > 0``, ``B_t, C_t ∈ R^N`` (shared by the heads of a group)::

    H_t = exp(dt_t · A) · H_{t-1} + dt_t · x_t ⊗ B_t          (x_t ∈ R^P, outer product -> [P, N])
    y_t = H_t · C_t + D · x_t                                  (contract N -> [P])

Unrolled, this is a causal "attention" with a decaying mask (the SSD duality)::

    y_t = Σ_{s≤t} (C_t · B_s) · exp(Σ_{i=s+1..t} dt_i A) · dt_s · x_s + D · x_t

Three implementations, all computing exactly this:

* :func:`ssd_sequential` - a plain loop over time; the readable reference.
* :func:`ssd_chunked`    - the training path. The sequence is cut into chunks of length ``Q``; inside a
  chunk the quadratic (attention-like) form is used, across chunks the state is passed on. Cost is
  ``O(T·Q)`` instead of ``O(T²)`` and everything is a batched matrix product.
* :func:`ssd_step`       - one token of the recurrence; the decoding path.

The mixer (:class:`Mamba2Mixer`) wraps the scan like mamba_ssm's ``Mamba2`` block::

    [z, xBC, dt] = in_proj(u)
    xBC          = silu(causal_depthwise_conv1d(xBC));  [x, B, C] = split(xBC)
    dt           = softplus(dt + dt_bias);  A = -exp(A_log)
    y            = SSD(x, dt, A, B, C) + D·x
    out          = out_proj(RMSNorm_groupwise(y · silu(z)))

Its parameter names equal those of ``mamba_ssm.modules.mamba2.Mamba2`` and transformers'
``Mamba2Mixer``, so their weights load 1:1.

Shapes (used in every comment): ``b`` batch, ``T``/``t`` time, ``h`` heads (``H``), ``p`` head dim (``P``),
``g`` groups (``G``), ``k`` heads per group (``K = H / G``), ``n`` state dim (``N``), ``c`` chunks,
``l``/``s`` positions inside a chunk (``Q`` = chunk size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Optional CUDA kernels (state-spaces/mamba). The torch code below stays the reference.
try:  # pragma: no cover - not installed on CPU machines
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as _kernel_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as _kernel_chunk_scan
except Exception:  # ImportError, or a broken triton / CUDA install
    _kernel_state_update = _kernel_chunk_scan = None
try:  # pragma: no cover
    from causal_conv1d import causal_conv1d_fn as _kernel_causal_conv1d
except Exception:
    _kernel_causal_conv1d = None

KERNELS_AVAILABLE = _kernel_chunk_scan is not None and _kernel_state_update is not None

__all__ = [
    "KERNELS_AVAILABLE",
    "Mamba2Mixer",
    "Mamba2State",
    "RMSNormGated",
    "ssd_chunked",
    "ssd_sequential",
    "ssd_step",
]


# ----------------------------------------------------------------------------------------------------
# The scan: reference, chunked, step
# ----------------------------------------------------------------------------------------------------


def _heads_per_group(x: Tensor, B: Tensor) -> int:
    nheads, ngroups = x.shape[-2], B.shape[-2]
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    return nheads // ngroups


def _d_skip(D: Tensor, x: Tensor) -> Tensor:
    """``D · x`` for D of shape [H] or [H, P]; x [..., H, P] (float32)."""
    D = D.float()
    return x * (D[:, None] if D.dim() == 1 else D)


def ssd_sequential(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference scan: the recurrence, one time step after the other (slow, obviously correct).

    x [b,T,h,p], dt [b,T,h] (already ``softplus(dt + dt_bias)``), A [h] (negative), B, C [b,T,g,n],
    D [h] or [h,p], initial_state [b,h,p,n]. Returns ``y`` [b,T,h,p] (dtype of x) and the final state
    [b,h,p,n] (float32). Computed in float32.
    """
    batch, seqlen, nheads, headdim = x.shape
    K = _heads_per_group(x, B)
    with torch.autocast(x.device.type, enabled=False):
        xf, dtf, Af = x.float(), dt.float(), A.float()
        Bh = B.float().repeat_interleave(K, dim=2)  # [b,T,g,n] -> [b,T,h,n]
        Ch = C.float().repeat_interleave(K, dim=2)  # [b,T,g,n] -> [b,T,h,n]
        if initial_state is None:
            state = x.new_zeros(batch, nheads, headdim, B.shape[-1], dtype=torch.float32)
        else:
            state = initial_state.float()  # [b,h,p,n]
        ys = []
        for t in range(seqlen):
            decay = torch.exp(dtf[:, t] * Af)  # [b,h]
            # H_t = exp(dt A) H_{t-1} + dt x_t ⊗ B_t                         [b,h,p,n]
            state = state * decay[:, :, None, None] + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))  # y_t = H_t C_t   [b,h,p]
        y = torch.stack(ys, dim=1) if ys else xf.new_zeros(xf.shape)  # [b,T,h,p]
        if D is not None:
            y = y + _d_skip(D, xf)
    return y.to(x.dtype), state


def ssd_step(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token of the recurrence (decoding).

    state [b,h,p,n], x [b,h,p], dt [b,h], A [h], B, C [b,g,n], D [h] or [h,p].
    Returns ``y`` [b,h,p] (dtype of x) and the new state [b,h,p,n] (float32); ``state`` is not modified.
    """
    K = _heads_per_group(x, B)
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        Ch = C.float().repeat_interleave(K, dim=1)  # [b,g,n] -> [b,h,n]
        new_state = ssd_state_update(state, x, dt, A, B)  # H_t = exp(dt A) H_{t-1} + dt x ⊗ B   [b,h,p,n]
        y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)  # y = H_t C_t                 [b,h,p]
        if D is not None:
            y = y + _d_skip(D, xf)
    return y.to(x.dtype), new_state


def ssd_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """The state half of :func:`ssd_step`: ``H_t = exp(dt·A)·H_{t-1} + dt·x ⊗ B`` (float32), shapes as there."""
    K = _heads_per_group(x, B)
    with torch.autocast(x.device.type, enabled=False):
        xf, dtf = x.float(), dt.float()
        Bh = B.float().repeat_interleave(K, dim=1)  # [b,g,n] -> [b,h,n]
        decay = torch.exp(dtf * A.float())  # [b,h]
        return state.float() * decay[:, :, None, None] + (dtf[:, :, None] * xf)[..., None] * Bh[:, :, None, :]


def _segsum(a: Tensor) -> Tensor:
    """Segment sums of log-decays: ``a [..., L] -> S [..., L, L]`` with ``S[i, j] = Σ_{m=j+1..i} a[m]``
    for ``i ≥ j`` (0 on the diagonal) and ``-inf`` above it, so ``exp(S)`` is the causal decay matrix.

    Computed as a masked cumulative sum (no difference of two long cumsums: stable in float32).
    """
    L = a.size(-1)
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    a = a[..., :, None].expand(*a.shape, L)  # [..., i, j] = a[i]
    a = a.masked_fill(~strict, 0.0)  # keep a[i] only where i > j
    S = a.cumsum(dim=-2)  # [..., i, j] = Σ_{j < m ≤ i} a[m]
    return S.masked_fill(~causal, float("-inf"))


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan (the training path; same arguments and results as :func:`ssd_sequential`).

    The sequence is split into ``c`` chunks of ``Q = chunk_size`` steps (the tail is padded with
    ``dt = 0``: no decay, no input, so padding changes neither outputs nor the final state). With
    ``a_t = dt_t · A`` and ``cs_l = Σ_{i≤l} a_i`` (cumsum inside the chunk) the output splits into

    1. the *diagonal blocks* - inputs of the same chunk, the quadratic "attention" form::

           y_l += Σ_{s≤l} (C_l · B_s) · exp(cs_l - cs_s) · dt_s x_s

    2. *chunk states* - what each chunk alone leaves in the state at its end::

           S_c = Σ_s exp(cs_{Q-1} - cs_s) · dt_s x_s ⊗ B_s

    3. the *inter-chunk recurrence* on chunk boundaries (a short scan over ``c``, done as a ``c×c``
       decay matrix)::

           H_c = exp(cs^{(c-1)}_{Q-1}) · H_{c-1} + S_{c-1},   H_0 = initial_state

    4. the *off-diagonal blocks* - the state entering the chunk, read out by C::

           y_l += exp(cs_l) · C_l · H_c

    All decays and sums are in float32 (autocast is switched off inside). No ``.item()`` and no
    data-dependent branching: traces into one graph under ``torch.compile``.
    """
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[-2], B.shape[-1]
    K = _heads_per_group(x, B)
    Q = chunk_size
    pad = (-seqlen) % Q
    nchunks = (seqlen + pad) // Q
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        # pad time to a multiple of Q, then cut into chunks
        #   x [b,T,h,p] -> [b,c,l,g,k,p]   dt [b,T,h] -> [b,c,l,g,k]   B, C [b,T,g,n] -> [b,c,l,g,n]
        xc = F.pad(xf, (0, 0, 0, 0, 0, pad)).view(batch, nchunks, Q, ngroups, K, headdim)
        dtc = F.pad(dt.float(), (0, 0, 0, pad)).view(batch, nchunks, Q, ngroups, K)
        Bc = F.pad(B.float(), (0, 0, 0, 0, 0, pad)).view(batch, nchunks, Q, ngroups, dstate)
        Cc = F.pad(C.float(), (0, 0, 0, 0, 0, pad)).view(batch, nchunks, Q, ngroups, dstate)
        Ag = A.float().view(ngroups, K)  # [h] -> [g,k]

        xdt = xc * dtc[..., None]  # dt_s x_s                                  [b,c,l,g,k,p]
        a = (dtc * Ag).permute(0, 1, 3, 4, 2)  # log-decay a_l = dt_l A      [b,c,g,k,l]
        a_cs = a.cumsum(dim=-1)  # cs_l                                        [b,c,g,k,l]
        decay = torch.exp(_segsum(a))  # exp(cs_l - cs_s), 0 for s > l        [b,c,g,k,l,s]

        # 1. diagonal blocks: y_l = Σ_s (C_l·B_s) decay[l,s] dt_s x_s
        CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)  # C_l · B_s, shared by the group's heads [b,c,g,l,s]
        scores = CB[:, :, :, None] * decay  # [b,c,g,k,l,s]
        y_diag = torch.einsum("bcgkls,bcsgkp->bclgkp", scores, xdt)  # [b,c,l,g,k,p]

        # 2. chunk states: S_c = Σ_s exp(cs_{Q-1} - cs_s) dt_s x_s ⊗ B_s
        decay_to_end = decay[..., -1, :].permute(0, 1, 4, 2, 3)  # row l = Q-1 -> [b,c,s,g,k]
        states = torch.einsum("bcsgkp,bcsgn->bcgkpn", xdt * decay_to_end[..., None], Bc)  # [b,c,g,k,p,n]

        # 3. inter-chunk recurrence: H_c for every chunk c, plus the final state H_{c_last + 1}
        if initial_state is None:
            h0 = states.new_zeros(batch, 1, ngroups, K, headdim, dstate)
        else:
            h0 = initial_state.float().view(batch, 1, ngroups, K, headdim, dstate)  # [b,h,p,n] -> [b,1,g,k,p,n]
        states = torch.cat([h0, states], dim=1)  # [H_0, S_0, ..., S_{c-1}]               [b,c+1,g,k,p,n]
        chunk_a = F.pad(a_cs[..., -1], (0, 0, 0, 0, 1, 0))  # total log-decay per chunk, 0 first [b,c+1,g,k]
        chunk_decay = torch.exp(_segsum(chunk_a.permute(0, 2, 3, 1)))  # [b,g,k,c+1(z),c+1(y)]
        states = torch.einsum("bgkzy,bygkpn->bzgkpn", chunk_decay, states)  # H_z = Σ_y decay S_y [b,c+1,g,k,p,n]
        chunk_start, final_state = states[:, :-1], states[:, -1]  # [b,c,g,k,p,n], [b,g,k,p,n]

        # 4. off-diagonal blocks: y_l += exp(cs_l) C_l · H_c
        decay_in = torch.exp(a_cs).permute(0, 1, 4, 2, 3)  # exp(cs_l)          [b,c,l,g,k]
        y_off = torch.einsum("bclgn,bcgkpn->bclgkp", Cc, chunk_start) * decay_in[..., None]  # [b,c,l,g,k,p]

        y = (y_diag + y_off).reshape(batch, nchunks * Q, nheads, headdim)[:, :seqlen]  # [b,T,h,p]
        if D is not None:
            y = y + _d_skip(D, xf)
        final_state = final_state.reshape(batch, nheads, headdim, dstate)  # [b,h,p,n]
    return y.to(x.dtype), final_state


# ----------------------------------------------------------------------------------------------------
# The mixer
# ----------------------------------------------------------------------------------------------------


class Mamba2State:
    """Decoding state of one (loop iteration, layer) slot (the cache-slot protocol of :mod:`looplm.cache`).

    ``conv_state`` [B, conv_dim, d_conv]: the last ``d_conv`` inputs of the convolution, oldest first.
    ``ssm_state`` [B, nheads, headdim, d_state]: the SSM state ``H``, float32.
    ``seqlen_offset``: tokens already absorbed (0 = empty; contents are then ignored).

    Two additions serve adaptive decoding (:mod:`looplm.decode.token_schedule`, :mod:`looplm.decode.speculative`):

    * :meth:`rows` — a view of some batch rows whose one-token step reads and writes those rows' states
      only (per-token exit: the rows still looping at this iteration); the token is counted once, at
      :meth:`commit`;
    * :meth:`begin_recording` / :meth:`rollback` — a recurrent state cannot forget a token, so a
      speculative round keeps a snapshot after every token it absorbs and each row returns to the
      snapshot of its own accepted length.
    """

    def __init__(self, conv_state: Tensor, ssm_state: Tensor, seqlen_offset: int = 0):
        self.conv_state, self.ssm_state = conv_state, ssm_state
        self._seqlen = seqlen_offset
        self.pending = 0  # a token absorbed by row views / fills, counted at commit
        self.snapshots: list[tuple[Tensor, Tensor]] | None = None  # (conv, ssm) after each recorded token

    @property
    def seqlen_offset(self) -> int:
        return self._seqlen

    @seqlen_offset.setter
    def seqlen_offset(self, n: int) -> None:
        if self.snapshots is not None:  # every absorbed token leaves a snapshot while recording
            for _ in range(n - self._seqlen):
                self.snapshots.append((self.conv_state.clone(), self.ssm_state.clone()))
        self._seqlen = n

    @property
    def seqlen(self) -> int:
        return self._seqlen

    def index_select(self, idx: Tensor) -> None:
        """Keep batch rows ``idx`` (reordering for beam search, dropping finished rows)."""
        self.conv_state = self.conv_state.index_select(0, idx)
        self.ssm_state = self.ssm_state.index_select(0, idx)
        if self.snapshots is not None:
            self.snapshots = [(c.index_select(0, idx), s.index_select(0, idx)) for c, s in self.snapshots]

    def crop(self, length: int) -> None:
        """A recurrent state cannot forget tokens: only a no-op crop (``length == seqlen``) is allowed."""
        if length != self._seqlen:
            raise ValueError(
                f"cannot crop a Mamba-2 state from {self._seqlen} to {length} tokens: the SSM state has "
                "absorbed them; re-run the prefix from an empty cache instead (speculative decoding rolls "
                "back through snapshots: begin_recording / rollback)"
            )

    def keep_columns(self, idx: Tensor | None, length: int) -> None:
        """The cache dropping columns (rejected speculative drafts, :meth:`looplm.cache.LoopCache.keep_columns`):
        the state has absorbed only its rows' kept tokens (:meth:`rollback`), so only the count changes."""
        if self.snapshots is not None or self.pending:
            raise ValueError("keep_columns in the middle of a speculative round (roll back first)")
        self._seqlen = length

    # --- row subsets (per-token exit) ------------------------------------------------------------
    def rows(self, idx: Tensor, batch: int) -> "Mamba2Rows":
        return Mamba2Rows(self, idx)

    def commit(self) -> None:
        """Count a token absorbed row by row (every row has taken its step or its exit policy's fill)."""
        if self.pending:
            self.seqlen_offset = self._seqlen + self.pending
            self.pending = 0

    # --- snapshots (speculative rounds) ------------------------------------------------------------
    def begin_recording(self) -> None:
        """Start a round: snapshot 0 is the state now; each token absorbed from here adds one."""
        self.snapshots = [(self.conv_state.clone(), self.ssm_state.clone())]

    def restart_recording(self) -> None:
        """Back to snapshot 0 for every row, dropping the round's tokens (the coda before verification)."""
        c, s = self.snapshots[0]
        self.conv_state, self.ssm_state = c.clone(), s.clone()
        self._seqlen -= len(self.snapshots) - 1
        self.snapshots = self.snapshots[:1]

    def rollback(self, keep: Tensor) -> None:
        """Row ``b`` returns to its state after ``keep[b]`` of the round's tokens; recording ends."""
        n = len(self.snapshots) - 1
        if int(keep.min()) < 0 or int(keep.max()) > n:
            raise ValueError(f"rollback to {keep.tolist()} tokens, but the round absorbed {n}")
        rows = torch.arange(keep.shape[0], device=keep.device)
        self.conv_state = torch.stack([c for c, _ in self.snapshots])[keep, rows].contiguous()  # [B, conv_dim, d_conv]
        self.ssm_state = torch.stack([s for _, s in self.snapshots])[keep, rows].contiguous()  # [B, h, p, n]
        self.snapshots = None  # seqlen keeps counting the round's columns (the attention slots mask the dropped ones)


class Mamba2Rows:
    """Rows ``idx`` of a :class:`Mamba2State` for one single-token step: ``conv_state`` / ``ssm_state``
    read those rows (a gather: the step's own input) and assigning them writes the rows back in place;
    the token is counted at :meth:`Mamba2State.commit`. ``keep [n]`` (bool): write back only those rows,
    the others keep their state (``torch.where``, at fixed shapes: :mod:`looplm.decode.static_schedule`)."""

    def __init__(self, base: Mamba2State, idx: Tensor, keep: Tensor | None = None):
        self.base, self.idx, self.keep = base, idx, keep

    def _write(self, buf: Tensor, value: Tensor) -> None:
        value = value.to(buf.dtype)
        if self.keep is not None:
            value = torch.where(self.keep.view(-1, *([1] * (value.dim() - 1))), value, buf.index_select(0, self.idx))
        buf.index_copy_(0, self.idx, value)

    @property
    def conv_state(self) -> Tensor:
        return self.base.conv_state.index_select(0, self.idx)

    @conv_state.setter
    def conv_state(self, value: Tensor) -> None:
        self._write(self.base.conv_state, value)

    @property
    def ssm_state(self) -> Tensor:
        return self.base.ssm_state.index_select(0, self.idx)

    @ssm_state.setter
    def ssm_state(self, value: Tensor) -> None:
        self._write(self.base.ssm_state, value)

    @property
    def seqlen_offset(self) -> int:
        return self.base.seqlen_offset

    @seqlen_offset.setter
    def seqlen_offset(self, n: int) -> None:
        self.base.pending = max(self.base.pending, n - self.base.seqlen_offset)

    @property
    def seqlen(self) -> int:
        return self.base.seqlen


class RMSNormGated(nn.Module):
    """``RMSNorm(y · silu(z)) · weight``, normalised over groups of ``group_size`` channels
    (mamba_ssm ``RMSNormGated`` with ``norm_before_gate=False``). Computed in float32."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim ({dim}) must be a multiple of group_size ({group_size})")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(z.float())  # [..., d]
        yg = y.unflatten(-1, (-1, self.group_size))  # [..., groups, group_size]
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        return (yg.flatten(-2) * self.weight.float()).to(dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 token mixer (``[B, T, d_model] -> [B, T, d_model]``); see the module docstring.

    ``forward(x, pad_mask=None, state=None)``:

    * ``state is None`` - training / evaluation: chunked scan from a zero state, nothing kept.
    * ``state.seqlen_offset == 0`` - prefill: chunked scan, then the final conv / SSM state are written
      into ``state``.
    * ``state.seqlen_offset > 0`` - continue: ``T == 1`` runs the single-step recurrence, ``T > 1`` the
      chunked scan from ``state.ssm_state`` with the convolution prefixed by ``state.conv_state``.

    ``pad_mask`` (bool ``[B, T]``, True = real token) is for left padding: the conv stream is zeroed at
    pad positions before and after the convolution and ``dt`` is zeroed there (no decay, no input), so
    pad positions leave the SSM state untouched and a left-padded row gives, on its real tokens, the
    outputs of the row alone. Outputs at pad positions are meaningless.
    """

    def __init__(
        self,
        d_model: int,
        *,
        expand: int = 2,
        d_state: int = 128,
        d_conv: int = 4,
        headdim: int = 64,
        ngroups: int = 1,
        chunk_size: int = 64,
        conv_bias: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-5,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        use_kernels: bool | None = None,
    ):
        super().__init__()
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"expand*d_model ({d_inner}) must be a multiple of headdim ({headdim})")
        nheads = d_inner // headdim
        if nheads % ngroups:
            raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
        if use_kernels and not KERNELS_AVAILABLE:
            raise ImportError("use_kernels=True needs mamba_ssm (pip install mamba-ssm)")
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, d_inner, d_state, d_conv
        self.headdim, self.nheads, self.ngroups, self.chunk_size = headdim, nheads, ngroups, chunk_size
        self.conv_dim = d_inner + 2 * ngroups * d_state
        self.use_kernels = use_kernels
        self.A_init_range, self.dt_min, self.dt_max, self.dt_init_floor = A_init_range, dt_min, dt_max, dt_init_floor

        # [z (d_inner), xBC (conv_dim), dt (nheads)]
        self.in_proj = nn.Linear(d_model, d_inner + self.conv_dim + nheads, bias=bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1, bias=conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(nheads))
        self.A_log = nn.Parameter(torch.empty(nheads))
        self.D = nn.Parameter(torch.empty(nheads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = RMSNormGated(d_inner, group_size=d_inner // ngroups, eps=norm_eps)
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """mamba_ssm's Mamba2 init of dt_bias, A_log and D (Linear / Conv keep PyTorch's default init).

        ``dt ~ exp(U[log dt_min, log dt_max])`` floored at ``dt_init_floor``, ``dt_bias = softplus⁻¹(dt)
        = dt + log(1 - exp(-dt))``;  ``A ~ U[A_init_range]``, ``A_log = log A``;  ``D = 1``.
        """
        if self.A_log.is_meta:  # nothing to initialise (parameter counting); meta ops would import dynamo
            return
        lo, hi = math.log(self.dt_min), math.log(self.dt_max)
        dt = torch.exp(torch.rand(self.nheads) * (hi - lo) + lo).clamp(min=self.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log.copy_(torch.log(torch.empty(self.nheads).uniform_(*self.A_init_range)))
        self.D.fill_(1.0)

    def new_cache(self, batch_size: int, device=None, dtype=None, capacity: int | None = None) -> Mamba2State:
        """An empty (all zero, ``seqlen_offset = 0``) decoding state (fixed size: ``capacity`` is unused)."""
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        return Mamba2State(
            conv_state=torch.zeros(batch_size, self.conv_dim, self.d_conv, device=device, dtype=dtype),
            ssm_state=torch.zeros(
                batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=torch.float32
            ),
            seqlen_offset=0,
        )

    def _kernels_for(self, x: Tensor) -> bool:
        return x.is_cuda and KERNELS_AVAILABLE and self.use_kernels is not False

    # -- pieces shared by the paths ------------------------------------------------------------------

    def _split_ssm_inputs(self, xBC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """xBC [..., conv_dim] -> x [..., h, p], B [..., g, n], C [..., g, n]."""
        gn = self.ngroups * self.d_state
        xs, B, C = xBC.split([self.d_inner, gn, gn], dim=-1)
        return (
            xs.unflatten(-1, (self.nheads, self.headdim)),
            B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)),
        )

    def _dt(self, dt_raw: Tensor, mask: Tensor | None) -> Tensor:
        """dt = softplus(dt_raw + dt_bias) in float32, 0 at pad positions. [..., h] -> [..., h]"""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        return dt if mask is None else dt * mask

    def _causal_conv(self, xBC_t: Tensor) -> Tensor:
        """silu(depthwise conv) of a stream already left-padded / prefixed by ``d_conv - 1`` steps:
        [b,conv_dim,d_conv-1+T] -> [b,T,conv_dim] (dtype of the input).

        Runs in float32 outside autocast: the conv is tiny, and on CPU a bf16 depthwise conv falls back to
        a per-channel loop that is orders of magnitude slower than the whole rest of the layer.
        """
        with torch.autocast(xBC_t.device.type, enabled=False):
            bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
            out = F.conv1d(xBC_t.float(), self.conv1d.weight.float(), bias, groups=self.conv_dim)  # [b,conv_dim,T]
            return F.silu(out).transpose(1, 2).to(xBC_t.dtype)

    # -- forward ---------------------------------------------------------------------------------------

    def forward(
        self, x: Tensor, fctx=None, cache: Mamba2State | None = None, *, pad_mask: Tensor | None = None
    ) -> Tensor:
        """``x [b, T, d_model]`` -> ``[b, T, d_model]`` (the mixer interface of :mod:`looplm.blocks`).

        ``fctx.pad_mask`` (or ``pad_mask``) ``[b, T]`` marks real tokens under left padding; ``cache``
        is this slot's :class:`Mamba2State`, updated in place (a single token on a non-empty state takes
        the recurrent step).
        """
        if pad_mask is None and fctx is not None:
            pad_mask = fctx.pad_mask
        state = cache
        if state is not None and state.seqlen_offset > 0 and x.shape[1] == 1:
            return self._step(x, pad_mask, state)
        if state is not None and state.seqlen_offset > 0 and getattr(state, "snapshots", None) is not None:
            # a speculative round records the state after every token: the tokens one step at a time
            return torch.cat(
                [
                    self._step(x[:, t : t + 1], None if pad_mask is None else pad_mask[:, t : t + 1], state)
                    for t in range(x.shape[1])
                ],
                dim=1,
            )
        batch, seqlen, _ = x.shape
        kernels = self._kernels_for(x)
        zxbcdt = self.in_proj(x)  # [b,T,d_in_proj]
        z, xBC, dt_raw = zxbcdt.split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
        mask = None if pad_mask is None else pad_mask[..., None].to(zxbcdt.dtype)  # [b,T,1]
        if mask is not None:
            xBC = xBC * mask  # pad tokens enter the conv as zeros (= the conv's own zero padding)

        # causal depthwise conv over time, channels first: [b,T,conv_dim] -> [b,conv_dim,T]
        xBC_t = xBC.transpose(1, 2)
        if state is None:
            if kernels and _kernel_causal_conv1d is not None:  # pragma: no cover - CUDA only
                xBC = _kernel_causal_conv1d(
                    xBC_t, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu"
                ).transpose(1, 2)
            else:
                xBC = self._causal_conv(F.pad(xBC_t, (self.d_conv - 1, 0)))  # [b,T,conv_dim]
        else:
            # prefix the last d_conv inputs seen so far (zeros for an empty state)
            prev = state.conv_state if state.seqlen_offset > 0 else torch.zeros_like(state.conv_state)
            full = torch.cat([prev.to(xBC_t.dtype), xBC_t], dim=-1)  # [b,conv_dim,d_conv+T]
            state.conv_state = full[..., -self.d_conv :].to(state.conv_state.dtype)
            xBC = self._causal_conv(full[..., 1:])  # [b,T,conv_dim]
        if mask is not None:
            xBC = xBC * mask  # conv output at pad positions (bias, tails of real tokens) -> 0

        xs, B, C = self._split_ssm_inputs(xBC)  # [b,T,h,p], [b,T,g,n], [b,T,g,n]
        dt = self._dt(dt_raw, mask)  # [b,T,h] float32
        A = -torch.exp(self.A_log.float())  # [h]
        init = state.ssm_state if state is not None and state.seqlen_offset > 0 else None
        if kernels:  # pragma: no cover - CUDA only
            y, final = _kernel_chunk_scan(
                xs, dt, A, B, C, self.chunk_size, D=self.D.float(), initial_states=init, return_final_states=True
            )
        else:
            y, final = ssd_chunked(xs, dt, A, B, C, self.chunk_size, D=self.D, initial_state=init)
        if state is not None:
            state.ssm_state = final.float()
            state.seqlen_offset += seqlen

        y = self.norm(y.reshape(batch, seqlen, self.d_inner), z)  # [b,T,d_inner]
        return self.out_proj(y.to(x.dtype))

    def _step_inputs(self, x: Tensor, pad_mask: Tensor | None, state, zxbcdt: Tensor | None = None):
        """The first half of a one-token step: ``in_proj`` (unless given), the conv window slid by the new
        input (written into ``state``), SiLU, the split and ``dt``. Returns ``z [b,d_inner]``,
        ``x [b,h,p]``, ``B, C [b,g,n]``, ``dt [b,h]`` and ``A [h]``."""
        if zxbcdt is None:
            zxbcdt = self.in_proj(x[:, 0])  # [b,d_in_proj]
        z, xBC, dt_raw = zxbcdt.split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
        mask = None if pad_mask is None else pad_mask[:, 0, None].to(zxbcdt.dtype)  # [b,1]
        if mask is not None:
            xBC = xBC * mask

        # conv: slide the window by one and take the dot product with the kernel
        conv_state = torch.cat([state.conv_state[..., 1:], xBC[..., None].to(state.conv_state.dtype)], dim=-1)
        state.conv_state = conv_state  # [b,conv_dim,d_conv]
        out = (conv_state.float() * self.conv1d.weight[:, 0, :].float()).sum(-1)  # [b,conv_dim], float32 like the conv
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()
        xBC = F.silu(out).to(xBC.dtype)
        if mask is not None:
            xBC = xBC * mask

        xs, B, C = self._split_ssm_inputs(xBC)  # [b,h,p], [b,g,n], [b,g,n]
        dt = self._dt(dt_raw, mask)  # [b,h]
        A = -torch.exp(self.A_log.float())  # [h]
        return z, xs, B, C, dt, A

    def _step(self, x: Tensor, pad_mask: Tensor | None, state: Mamba2State) -> Tensor:
        """One token from a non-empty state: x [b,1,d_model] -> [b,1,d_model]."""
        batch = x.shape[0]
        z, xs, B, C, dt, A = self._step_inputs(x, pad_mask, state)
        if self._kernels_for(x):  # pragma: no cover - CUDA only
            ssm_state = state.ssm_state.float().contiguous()  # updated in place by the kernel
            H, P, N = self.nheads, self.headdim, self.d_state
            y = _kernel_state_update(
                ssm_state,
                xs,
                dt[..., None].expand(batch, H, P),
                A[:, None, None].expand(H, P, N),
                B,
                C,
                D=self.D.float()[:, None].expand(H, P),
            )
        else:
            y, ssm_state = ssd_step(state.ssm_state, xs, dt, A, B, C, D=self.D)
        state.ssm_state = ssm_state
        state.seqlen_offset += 1

        y = self.norm(y.reshape(batch, 1, self.d_inner), z[:, None])  # [b,1,d_inner]
        return self.out_proj(y.to(x.dtype))

    def absorb(self, x: Tensor, state, mode: str = "propagate", zxbcdt: Tensor | None = None) -> None:
        """The state of a token that skips this layer (per-token exit, :mod:`looplm.decode.exits`): ``x [b,1,d_model]``
        is the stand-in mixer input (the normed block input), ``state`` the slot (or its rows).

        * ``propagate``: the step's state half: the conv window slid by ``in_proj(x)``'s conv input, then
          ``S ← exp(dt·A)·S + dt·x ⊗ B`` — what :meth:`_step` leaves in ``state`` (``out_proj`` skipped);
        * ``decay``: ``S ← exp(dt·A)·S`` with ``dt`` from the dt rows of ``in_proj`` only; conv untouched.

        ``zxbcdt``: ``in_proj(x[:, 0])`` when the caller computed it once for several loops' slots."""
        if mode == "propagate":
            _, xs, B, _, dt, A = self._step_inputs(x, None, state, zxbcdt)
            state.ssm_state = ssd_state_update(state.ssm_state, xs, dt, A, B)
        elif mode == "decay":
            H = self.nheads
            if zxbcdt is not None:
                dt_raw = zxbcdt[:, -H:]
            else:
                w, b = self.in_proj.weight[-H:], None if self.in_proj.bias is None else self.in_proj.bias[-H:]
                dt_raw = F.linear(x[:, 0], w, b)  # [b, h]: the dt rows of in_proj
            dt = self._dt(dt_raw, None)
            A = -torch.exp(self.A_log.float())
            S = state.ssm_state
            state.ssm_state = S.float() * torch.exp(dt * A)[:, :, None, None]  # H ← exp(dt·A)·H
        else:
            raise ValueError(f"Mamba2Mixer.absorb: mode must be 'propagate' or 'decay', got {mode!r}")
        state.seqlen_offset += 1

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_inner={self.d_inner}, nheads={self.nheads}, headdim={self.headdim}, "
            f"d_state={self.d_state}, ngroups={self.ngroups}, d_conv={self.d_conv}, chunk_size={self.chunk_size}"
        )
