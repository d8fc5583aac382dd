"""Per-request exit thresholds inside stock vLLM: the pure parts (no vLLM import; docs/vllm.md#per-request-thresholds).

A vLLM model's forward never sees a request's ``SamplingParams``. A v1 logits processor does: vLLM hands it each
request that enters the persistent batch, with its ``SamplingParams`` and its batch row, in
``update_state(BatchUpdate)`` — in the worker process that runs the model, before each forward. The plugin's
processor (:class:`looplm.vllm.processor.RequestExitThresholds`, passed with ``--logits-processors``) keeps
row -> threshold in a :class:`RowThresholds` installed in this process; the model's exit loop
(:meth:`looplm.vllm.model._LoopedForCausalLM._exit_loops`) reads it and maps rows to tokens through the step's
``query_start_loc`` (:func:`token_thresholds`): vLLM lays the step's tokens out row after row.

Here: the request field (:data:`FIELD`, :func:`request_threshold`), the row bookkeeping (:class:`RowThresholds`:
removed, then added, then moved or swapped, as vLLM's ``BatchUpdate`` orders them), rows -> tokens, the process-local
registry (:func:`install`, :func:`installed`) and the load-time checks (:func:`processor_listed`,
:func:`server_refusal`). The semantics are looplm serve's (:meth:`looplm.serve.engine.Engine._threshold`): a number
``ε >= 0`` for the server's ``kl`` / ``convergence`` criterion (``0``: full depth), or ``"none"``: full depth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "FIELD",
    "PROCESSOR",
    "RowThresholds",
    "install",
    "installed",
    "per_token",
    "processor_listed",
    "request_threshold",
    "server_refusal",
    "token_thresholds",
]

FIELD = "looplm_exit"  # the request's key in SamplingParams.extra_args (OpenAI: extra_body={"vllm_xargs": {...}})
PROCESSOR = "looplm.vllm.processor:RequestExitThresholds"  # what --logits-processors names
_FULL = ("none", "full")


def request_threshold(extra_args: Mapping[str, Any] | None) -> float | None:
    """A request's threshold from its ``SamplingParams.extra_args``: ``None`` when it sets none (the server's
    applies), ``0.0`` for full depth (``"none"`` or ``0``), else its ``ε > 0``. Raises ``ValueError`` naming the
    value and what to give: a negative, NaN or infinite number, a bool, another string or type, or an unknown
    ``looplm_*`` key (a misspelt field would otherwise be ignored)."""
    if not extra_args:
        return None
    unknown = sorted(k for k in extra_args if isinstance(k, str) and k.startswith("looplm") and k != FIELD)
    if unknown:
        raise ValueError(f"unknown looplm request field(s) {unknown}: the vLLM plugin reads {FIELD!r} only")
    if FIELD not in extra_args:
        return None
    v = extra_args[FIELD]
    want = (
        f"give a finite number ε >= 0 for the server's kl or convergence criterion (0 = full depth) or 'none' "
        f'(full depth), e.g. {{"{FIELD}": 0.01}} in extra_args (an OpenAI request: in vllm_xargs)'
    )
    if isinstance(v, str):
        if v.strip().lower() in _FULL:
            return 0.0
        raise ValueError(f"{FIELD}={v!r} is not a threshold: {want}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{FIELD}={v!r} ({type(v).__name__}) is not a threshold: {want}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{FIELD}={v!r} is not a finite number >= 0: {want}")
    return float(v)


class RowThresholds:
    """Row -> threshold of the requests in vLLM's persistent batch that set one (a row absent: the server's).

    :meth:`update` applies one ``BatchUpdate`` in vLLM's order: ``removed`` rows are emptied, ``added`` rows take
    the new request's value (replacing whatever the row held), then each ``moved`` entry ``(a, b, swap)`` moves
    row ``a`` to ``b`` (``b``'s entry dropped; ``a`` empty after) or, with ``swap``, exchanges them. ``counts``:
    the operations seen (tests read them to know which paths vLLM took)."""

    def __init__(self) -> None:
        self.rows: dict[int, float] = {}
        self.counts = {"removed": 0, "added": 0, "moved": 0, "swapped": 0}

    def update(
        self,
        removed: Iterable[int],
        added: Iterable[tuple[int, float | None]],
        moved: Iterable[tuple[int, int, bool]],
    ) -> None:
        rows, c = self.rows, self.counts
        for i in removed:
            rows.pop(i, None)
            c["removed"] += 1
        for i, value in added:
            if value is None:
                rows.pop(i, None)
            else:
                rows[i] = value
            c["added"] += 1
        for a, b, swap in moved:
            c["swapped" if swap else "moved"] += 1
            va, vb = rows.pop(a, None), rows.pop(b, None)
            if va is not None:
                rows[b] = va
            if swap and vb is not None:
                rows[a] = vb

    def values(self, n_rows: int, default: float) -> list[float]:
        """The thresholds of rows ``0 .. n_rows − 1`` (``default`` where a request set none)."""
        return [self.rows.get(r, default) for r in range(n_rows)]


def per_token(per_request: torch.Tensor, query_start_loc: torch.Tensor, n: int, fill) -> torch.Tensor:
    """``[n]``: each token of the step gets its request's value of ``per_request [R]``. Request ``r``'s tokens are
    ``query_start_loc[r] : query_start_loc[r + 1]`` (``query_start_loc [R + 1]``: vLLM lays the step's tokens out
    request after request); tokens past the last request (padding) get ``fill``. On ``per_request``'s device."""
    qlen = (query_start_loc[1:] - query_start_loc[:-1]).long().to(per_request.device)  # [R]
    tok = torch.repeat_interleave(per_request, qlen)  # [Σ qlen]
    out = torch.full((n,), fill, dtype=per_request.dtype, device=per_request.device)
    m = min(n, tok.numel())
    out[:m] = tok[:m]
    return out


def token_thresholds(
    rows: RowThresholds, query_start_loc: torch.Tensor, n: int, default: float, device=None
) -> torch.Tensor:
    """``[n]`` float32: each token's threshold, from its request's row (:func:`per_token`; padding gets
    ``default``). float32: the criteria's distances are float32, and a Python float threshold is compared in
    float32 too, so the tensor compares as the server's scalar does."""
    R = query_start_loc.numel() - 1
    per_row = torch.tensor(rows.values(R, default), dtype=torch.float32)  # [R]
    out = per_token(per_row, query_start_loc.to("cpu"), n, float(default))
    return out if device is None else out.to(device)


# --- the process-local registry (the processor writes it, the model reads it: one worker process) ----------
_current: RowThresholds | None = None


def install() -> RowThresholds:
    """A fresh :class:`RowThresholds` as this process's (the processor's constructor: one engine per process;
    a later engine's processor replaces an earlier one's)."""
    global _current
    _current = RowThresholds()
    return _current


def installed() -> RowThresholds | None:
    """This process's :class:`RowThresholds`, ``None`` when no processor was constructed here."""
    return _current


# --- load-time checks --------------------------------------------------------------------------------------
def processor_listed(logits_processors: Sequence[Any] | None) -> bool:
    """Whether the plugin's processor is among vLLM's ``model_config.logits_processors`` (``--logits-processors``
    / ``LLM(logits_processors=...)``: FQCN strings, or classes — ours, or a subclass, carry a marker)."""
    for p in logits_processors or ():
        if isinstance(p, str) and p.strip() == PROCESSOR:
            return True
        if isinstance(p, type) and getattr(p, "looplm_exit_thresholds", False):
            return True
    return False


def server_refusal(exit: Mapping[str, Any] | None) -> str | None:
    """Why a server cannot take per-request thresholds (the processor is listed), or ``None``. A request's
    threshold is validated where vLLM admits it (``validate_params``), which sees the request only, not the
    server: so what depends on the server is refused when it starts, never left to pass unseen."""
    fix = f"drop --logits-processors {PROCESSOR} (LLM(logits_processors=...))"
    if exit is None:
        return (
            f"per-request exit thresholds ({PROCESSOR}) need a server with per-token exit; this one runs full "
            f"depth: set the config field looplm_exit, e.g. --hf-overrides "
            f'\'{{"looplm_exit": {{"criterion": "kl", "threshold": 0.01}}}}\', or {fix}'
        )
    if exit["criterion"] == "gate":
        return (
            f"under the gate criterion every row runs the server's q={exit['threshold']:g} (the rule selects its "
            f"output with it), so requests cannot set their own threshold: {fix}, or serve with criterion kl or "
            "convergence"
        )
    return None
