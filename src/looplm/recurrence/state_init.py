"""The recurrent state before the first iteration (a rule's ``begin``): the prelude output, zeros, or a
random state (Huginn / Raven, Geiping et al. 2025: ``s_0 ~ TN(0, σ² I)`` truncated at ``±3σ``, times the
embedding scale — their ``like-init`` state, drawn with the weights' init std ``σ``).

``INIT_STATES``:

* ``prelude`` — ``s_0 = h_0``, the prelude output (every rule's default);
* ``zeros``   — ``s_0 = 0``;
* ``normal``  — ``s_0 = γ · x``, ``x ~ TN(0, σ²)`` on ``[−3σ, 3σ]``, i.i.d. per token and channel;
  ``γ`` = the embedding multiplier (``√d`` with ``embed_scale``), as Huginn scales it.

Where the random numbers come from (``seed``):

* ``None`` — ``torch``'s global generator, a fresh draw at every forward (Huginn's own code). The model
  is then a random function: a cached decode and a full forward see different states.
* an ``int`` — the draw of channel ``c`` of the token at position ``t`` is a fixed function of
  ``(seed, t, c)`` (:func:`position_noise`: a counter-based hash mapped through the truncated normal's
  inverse CDF). Same distribution, but the model is deterministic: cached decoding equals the full forward,
  a left-padded row equals the row alone (positions count real tokens), and every evaluation is repeatable.
"""

from __future__ import annotations

import math

import torch
from torch import nn

INIT_STATES = ("prelude", "zeros", "normal")
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x · c) mod 2³²`` for ``x`` in ``[0, 2³²)`` held in int64 (split in 16-bit halves: no overflow)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds): every input bit reaches every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def position_noise(positions: torch.Tensor, d: int, seed: int, std: float, dtype=torch.float32) -> torch.Tensor:
    """``[B, T, d]`` draws of ``TN(0, std²)`` truncated at ``±3·std``, a fixed function of
    ``(seed, positions[b, t], channel)``: ``u = (hash + ½) / 2³²`` uniform on ``(0, 1)``, then
    ``x = std · Φ⁻¹(Φ(−3) + u (Φ(3) − Φ(−3)))`` (computed in float64)."""
    dev = positions.device
    key = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=dev))
    hp = _mix32((positions.to(torch.int64) & _M32) ^ key)  # [B, T]
    hc = _mix32((torch.arange(d, device=dev, dtype=torch.int64) + 0x632BE5AB) & _M32)  # [d]
    h = _mix32(_mix32(hp[..., None] ^ hc) ^ key)  # [B, T, d]
    u = (h.to(torch.float64) + 0.5) / 4294967296.0
    lo, hi = 0.5 * math.erfc(3 / math.sqrt(2)), 0.5 * math.erfc(-3 / math.sqrt(2))  # Φ(−3), Φ(3)
    return (std * torch.special.ndtri(lo + u * (hi - lo))).to(dtype)


def initial_state(h0: torch.Tensor, lctx, kind: str, std: float, seed: int | None) -> torch.Tensor:
    """``s_0 [B, T, d]`` of kind ``kind`` (see the module docstring) for the prelude output ``h0 [B, T, d]``;
    ``loop_options={"initial_state": s}`` (a ``[B, T, d]`` tensor) overrides it for one forward."""
    given = lctx.loop_options.get("initial_state") if lctx.loop_options else None
    if given is not None:
        if not isinstance(given, torch.Tensor) or tuple(given.shape) != tuple(h0.shape):
            raise ValueError(
                f"loop_options['initial_state'] must be a tensor of shape {tuple(h0.shape)} (batch, tokens, d_model), "
                f"got {tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__}"
            )
        return given.to(h0.dtype)
    if kind == "prelude":
        return h0
    if kind == "zeros" or std == 0:
        return torch.zeros_like(h0)
    if seed is None:
        x = torch.empty_like(h0)
        nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
    else:
        x = position_noise(lctx.positions, h0.shape[-1], seed, std, h0.dtype)
    return x * lctx.embed_multiplier if lctx.embed_multiplier != 1 else x


def init_state_errors(options: dict) -> list[str]:
    """Messages for the ``init_state`` / ``init_std`` / ``init_seed`` options of a rule."""
    errs = []
    kind = options.get("init_state", "prelude")
    if kind not in INIT_STATES:
        errs.append(f"options.init_state: must be one of {list(INIT_STATES)}, got {kind!r}")
    std = options.get("init_std", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std >= 0:
        errs.append(f"options.init_std: must be a number >= 0, got {std!r}")
    seed = options.get("init_seed", 0)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        errs.append(
            f"options.init_seed: must be an integer (deterministic per position) or null (fresh draws), got {seed!r}"
        )
    if kind != "normal":
        extra = [k for k in ("init_std", "init_seed") if k in options]
        if extra:
            errs.append(f"options.{extra[0]}: only used with init_state: normal (got init_state: {kind})")
    return errs


__all__ = ["INIT_STATES", "initial_state", "init_state_errors", "position_noise"]
