"""Hyperloop (Zeitoun, Torroba-Hennigen, Kim 2026, "Hyperloop transformers"; StateLoop ref. [27]):
a begin–middle–end looped Transformer — only the middle block is applied recurrently — whose loop
carries ``n`` residual streams, connected to the middle block by *loop-level* hyper-connections
(in the manifold-constrained hyper-connection form of Xie et al.: read ``H^pre``, write ``H^post``,
stream retention ``H^res``), applied once per loop rather than around every layer.

Begin / middle / end are the driver's prelude / core / coda. With ``X^k ∈ R^{n×d}`` the streams of a
token before loop ``k`` (``X^0 = [h0; …; h0]``, ``h0`` the begin block's output) and
``x̃ = RMSNorm(vec X^k) ∈ R^{nd}`` (no learned scale),

.. code-block:: text

    H^pre_k  = softmax_n(W^pre_k x̃)       ∈ R^n      read weights   (a convex mix of the streams)
    H^post_k = 2·σ(W^post_k x̃)            ∈ R^n      write weights
    H^res_k  = 2·σ(W^res_k x̃)             ∈ R^n      per-stream retention
    Z^k      = Σ_i H^pre_k,i X^k_i + p_k             middle-block input; p_k a loop-position embedding
    F^k      = M(Z^k) − Z^k                          the middle block's residual increment
    X^{k+1}  = H^res_k ⊙ X^k + H^post_k ⊗ F^k
    y        = mean_i X^r_i                          → end block

All of ``W^pre_k, W^post_k, W^res_k ∈ R^{n×nd}`` and ``p_k ∈ R^d`` are loop-specific
(``K`` of each; at inference past ``K`` the last loop's are reused). Parameters: ``K·(3n²d + d)``
— with ``n = 4``, ``K = 4``, ``d = 2048``: 401,408, giving 1,421,322,240 = 1421.32M (StateLoop Tab. 1).

Why no per-layer hook: Hyperloop applies its hyper-connections *only after each loop*, so the
middle block itself runs as a plain residual stack on ``Z^k``; ``lctx.core_input`` gives ``Z^k`` back to
``step``. (A per-layer variant would use :class:`~looplm.blocks.BranchModulation` ``read``/``write``
hooks, as the test double ``StreamsDouble`` in ``tests/test_rule_interface.py`` shows.)

Choices that are ours (the public descriptions do not fix them):

* ``H^pre`` is a softmax over the streams and ``H^res`` a per-stream gate ``2σ(·)`` (the mHC form
  uses ``σ`` for ``H^pre`` and a Sinkhorn-normalised ``n×n`` ``H^res``); with these choices and zero
  ``W``, ``p`` the model *is* the vanilla looped model (tested), and the default N(0, 0.02) init of the
  ``W`` breaks the symmetry between the identical initial streams;
* no biases and a parameter-free RMSNorm on ``vec X``, ``y`` = the stream mean;
* the loop embedding ``p_k`` is added to the middle block's input;
* the split of the 24 layers into begin / middle / end (the preset uses 2 / 20 / 2 with ``K = 4``;
  StateLoop does not print it — the parameter count does not depend on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import RecurrenceRule, register_rule


@register_rule("hyperloop")
class Hyperloop(RecurrenceRule):
    """``n`` residual streams across loops with loop-specific read / write / retention weights."""

    def __init__(self, cfg, *, n_streams: int = 4):
        super().__init__(cfg)
        if n_streams < 1:
            raise ValueError(f"hyperloop: n_streams must be >= 1, got {n_streams}")
        d, K, n = cfg.d_model, cfg.n_loops, n_streams
        self.n = n
        self.eps = cfg.norm_eps
        self.W_pre = nn.ModuleList(nn.Linear(n * d, n, bias=False) for _ in range(K))
        self.W_post = nn.ModuleList(nn.Linear(n * d, n, bias=False) for _ in range(K))
        self.W_res = nn.ModuleList(nn.Linear(n * d, n, bias=False) for _ in range(K))
        self.loop_embed = nn.Parameter(torch.zeros(K, d))  # p_k
        self.loop_embed._no_muon = True  # one vector per loop, not a matrix to orthogonalise

    def looplm_init(self):
        nn.init.zeros_(self.loop_embed)

    def _k(self, lctx) -> int:
        return min(lctx.iteration, len(self.W_pre) - 1)

    def _coefficients(self, X, k):
        """``H^pre, H^post, H^res`` ``[B, T, n]`` from the streams ``X [B, T, n, d]``."""
        x = F.rms_norm(X.flatten(-2), (X.shape[-2] * X.shape[-1],), eps=self.eps)  # [B, T, n·d]
        pre = self.W_pre[k](x).float().softmax(-1).to(X.dtype)
        post = 2 * torch.sigmoid(self.W_post[k](x))
        res = 2 * torch.sigmoid(self.W_res[k](x))
        return pre, post, res

    def begin(self, h0, lctx):
        X = h0.unsqueeze(-2).expand(*h0.shape[:-1], self.n, h0.shape[-1]).contiguous()  # [B, T, n, d]
        return {"X": X}

    def next_input(self, state, lctx):
        k = self._k(lctx)
        pre, _, _ = self._coefficients(state["X"], k)
        return torch.einsum("btn,btnd->btd", pre, state["X"]) + self.loop_embed[k]  # Z^k  [B, T, d]

    def step(self, state, h, lctx):
        X = state["X"]
        _, post, res = self._coefficients(X, self._k(lctx))
        F_k = h - lctx.core_input  # the middle block's increment  [B, T, d]
        return {"X": res.unsqueeze(-1) * X + post.unsqueeze(-1) * F_k.unsqueeze(-2)}

    def finish(self, state, lctx):
        return state["X"].mean(-2)  # [B, T, d]
