"""Perplexity: token level, word level (WikiText style) and bits per byte.

Every document is scored on its own: its tokens ``t_1 .. t_n`` are preceded by the tokenizer's EOS
(the document separator the model saw in training, so the first token is predicted too) and the
sequence ``[EOS, t_1, ..., t_n]`` is cut into windows of at most ``seq_len`` tokens that overlap by
one token (window ``k`` starts at ``k · (seq_len - 1)``), so every token is predicted exactly once,
with the context of its own window. Windows are right-padded into batches; padding is masked.

With ``NLL`` the summed negative log-likelihood (nats) of all ``N`` predicted tokens of all
documents, ``W`` the number of whitespace-separated words and ``Bytes`` the UTF-8 size of the
documents::

    token PPL      = exp(NLL / N)
    word PPL       = exp(NLL / W)           (WikiText convention: tokenizer-independent)
    bits per byte  = NLL / (Bytes · ln 2)

:func:`ppl_from_nll` is the formula; :func:`evaluate_documents` runs a model over documents.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["PPLResult", "word_count", "ppl_from_nll", "document_windows", "evaluate_documents"]


def word_count(text: str) -> int:
    """Number of whitespace-separated words (``len(text.split())``)."""
    return len(text.split())


@dataclass
class PPLResult:
    """Summed NLL (nats) and the counts it is normalised by."""

    nll: float = 0.0
    tokens: int = 0  # predicted tokens
    words: int = 0
    bytes: int = 0
    documents: int = 0
    depth: dict = field(
        default_factory=dict
    )  # exit=: the predicted tokens' depths (adaptive_forward's, token-weighted)

    @property
    def token_ppl(self) -> float:
        return _safe_exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def word_ppl(self) -> float:
        return _safe_exp(self.nll / self.words) if self.words else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll / (self.bytes * math.log(2)) if self.bytes else float("nan")

    @property
    def loss(self) -> float:
        """Mean NLL per token (nats)."""
        return self.nll / self.tokens if self.tokens else float("nan")

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "depth"}
        if self.depth:
            d["adaptive_depth"] = dict(self.depth)
        return {
            **d,
            "loss": self.loss,
            "token_ppl": self.token_ppl,
            "word_ppl": self.word_ppl,
            "bits_per_byte": self.bits_per_byte,
        }


def _safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def ppl_from_nll(nll: float, tokens: int, words: int, n_bytes: int = 0) -> PPLResult:
    """A :class:`PPLResult` from a summed NLL and counts (the formula, without a model)."""
    return PPLResult(nll=float(nll), tokens=int(tokens), words=int(words), bytes=int(n_bytes))


def document_windows(ids: list[int], seq_len: int, prefix_id: int) -> list[list[int]]:
    """Windows over ``[prefix_id] + ids`` of at most ``seq_len`` tokens overlapping by one token.

    Every window predicts all its tokens but the first; together they predict each of ``ids`` once.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 to predict anything, got {seq_len}")
    seq = [prefix_id] + list(ids)
    if len(seq) < 2:
        return []
    stride = seq_len - 1
    return [seq[s : s + seq_len] for s in range(0, len(seq) - 1, stride)]


def _model_logits(model, x: torch.Tensor, num_loops: int | None) -> torch.Tensor:
    out = model(x, num_loops=num_loops) if num_loops is not None else model(x)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def evaluate_documents(
    model,
    tokenizer,
    documents: Iterable[str],
    seq_len: int,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    num_loops: int | None = None,
    exit=None,
) -> PPLResult:
    """Token / word PPL and bits per byte of ``model`` on ``documents`` (see the module docstring).

    Args:
        model: maps ``[B, T]`` ids to an output with ``.logits`` ``[B, T, V]`` (or the logits).
        tokenizer: ``encode`` + ``eos_id`` (the prefix of each document).
        seq_len: window length (at most the model's ``max_seq_len``).
        max_batches: stop after this many batches of windows (whole documents only: a document
            whose windows do not all fit is not counted).
        precision: ``"bf16"`` autocasts the forward; the log-softmax is always fp32.
        exit: per-token exit (an :class:`~looplm.decode.exits.Exit` or its string, ``num_loops`` its ``max_loops``):
            every window's tokens after its first take the exits, in one forward per batch
            (:func:`looplm.decode.exit_forward.adaptive_forward`: what decoding the window token by token gives);
            the predicted tokens' depths are in ``result.depth`` (token-weighted means).
    """
    if exit is not None:  # a bad option, or one the one-forward exit cannot run, is refused before any document
        from ..decode.exits import Exit, forward_support

        exit = Exit.parse(exit)
        if num_loops is not None and exit.max_loops is None:
            exit = exit.with_policies(max_loops=num_loops)
        errs = forward_support(model, exit.resolved(model))
        if errs:
            raise ValueError("exit: " + "; ".join(errs))
    if device is None:
        device = next(model.parameters()).device if hasattr(model, "parameters") else "cpu"
    device = torch.device(device)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    result = PPLResult()
    pending: list[list[int]] = []
    n_batches = 0

    def run(windows: list[list[int]]) -> float:
        L = max(len(w) for w in windows)
        x = torch.zeros(len(windows), L, dtype=torch.long)
        y = torch.full((len(windows), L), -100, dtype=torch.long)
        for i, w in enumerate(windows):
            x[i, : len(w)] = torch.tensor(w)
            y[i, : len(w) - 1] = torch.tensor(w[1:])
        x, y = x.to(device), y.to(device)
        with autocast:
            if exit is None:
                logits = _model_logits(model, x, num_loops)
            else:
                from ..decode.exit_forward import adaptive_forward, add_depth_stats

                lens = torch.tensor([len(w) for w in windows], device=device)
                mask = (
                    torch.arange(L, device=device)[None] < lens[:, None]
                )  # [B, L]: the right-padded windows' own tokens
                out = adaptive_forward(
                    model, x, exit, attention_mask=None if bool(mask.all()) else mask.long(), full_depth_prefix=1
                )
                logits = out.logits
                add_depth_stats(result.depth, out.stats)
        return float(
            F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum"
            )
        )

    try:
        for doc in documents:
            if not doc.strip():
                continue
            ids = tokenizer.encode(doc)
            wins = document_windows(ids, seq_len, tokenizer.eos_id)
            if not wins:
                continue
            if max_batches is not None and n_batches + math.ceil((len(pending) + len(wins)) / batch_size) > max_batches:
                break
            result.tokens += len(ids)
            result.words += word_count(doc)
            result.bytes += len(doc.encode("utf-8"))
            result.documents += 1
            pending.extend(wins)
            while len(pending) >= batch_size:
                result.nll += run(pending[:batch_size])
                pending = pending[batch_size:]
                n_batches += 1
        if pending:
            result.nll += run(pending)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return result
