"""PonderLM (Zeng et al. 2026, "PonderLM: pretraining language models to ponder in continuous space";
StateLoop ref. [29]): the whole backbone is run several times per token; between passes the model
"ponders" by feeding back the *expected* token embedding under its own predicted distribution.

With ``E = embed(x)`` (scaled as the backbone scales it), ``W_E ∈ R^{V×d}`` the embedding matrix and
``f`` the full backbone up to the final norm and head,

.. code-block:: text

    e^0     = E
    P^k     = softmax( head(norm(f(e^k))) / τ )              [B, T, V]   predicted next-token distribution
    e^{k+1} = e^k + P^k · (m · W_E)                          the pondering embedding (expected embedding)
    logits  = head(norm(f(e^{K−1})))                         after K passes = K − 1 pondering steps

(PonderLM writes ``s`` pondering steps followed by one final pass; the StateLoop comparison "applies
the full backbone for four iterations", so ``K = 4`` passes here = ``s = 3``.) Each pass attends
causally within itself, so with a decoding cache pass ``k`` of a new token reads the pass-``k``
keys/values of its prefix — exactly what a full forward computes.

Mapped onto the driver: ``p = c = 0`` and the core is the whole backbone; ``next_input`` returns
``e^k``; ``step`` reads the iterate out through ``lctx.readout`` (coda, final norm and head — the same
head the model predicts with) and adds the expected embedding ``softmax(logits) @ W_E``
(``lctx.embed_weight``, times ``lctx.embed_multiplier``). No parameters of its own: the model has the
Vanilla Looped size (1420.92M, StateLoop Tab. 1).

Choices that are ours: the feedback is added to the running input (PonderLM's residual form
``e^{k+1} = e^k + P W_E``; its code's optional ``e^0 · s`` pre-scaling is off); the temperature ``τ``
defaults to 1; no readout is computed after the last pass (nothing reads it). ``stop_gradient``
(off by default, as in PonderLM) detaches ``P^k`` if the feedback should not be trained through.
"""

from __future__ import annotations

from .base import RecurrenceRule, register_rule


@register_rule("ponderlm")
class PonderLM(RecurrenceRule):
    """``Z^0 = E``, ``Z^{k+1} = Z^k + softmax(readout(H^k)/τ) · W_E``; output ``H^{r−1}``."""

    def __init__(self, cfg, *, temperature: float = 1.0, stop_gradient: bool = False):
        super().__init__(cfg)
        if temperature <= 0:
            raise ValueError(f"ponderlm: temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.stop_gradient = stop_gradient

    def begin(self, h0, lctx):
        return {"e": h0, "h": h0}  # h0 = E when p = 0 (the StateLoop preset); the prelude output otherwise

    def next_input(self, state, lctx):
        return state["e"]  # e^k

    def expected_embedding(self, logits, lctx):
        """``softmax(logits / τ) @ (m · W_E)``: ``[B, T, V] -> [B, T, d]``."""
        p = (logits.float() / self.temperature).softmax(-1).to(lctx.embed_weight.dtype)
        if self.stop_gradient:
            p = p.detach()
        return (p @ lctx.embed_weight) * lctx.embed_multiplier

    def step(self, state, h, lctx):
        if lctx.is_last:
            return {**state, "h": h}
        feedback = self.expected_embedding(lctx.readout(h), lctx)  # [B, T, d]
        return {"e": state["e"] + feedback, "h": h}
