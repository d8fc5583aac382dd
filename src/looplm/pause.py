"""Pause tokens (Goyal et al. 2024, "Think before you speak: training language models with pause
tokens"; StateLoop ref. [9]): extra computation per token by *lengthening the sequence* — not a
recurrence rule. StateLoop's "Pause Token" baseline inserts three pause tokens after every input
token and trains on real tokens only.

For input tokens ``x_1 … x_T`` and ``n`` pauses ``p``, the backbone reads

.. code-block:: text

    x_1 p p p x_2 p p p … x_T p p p                                   (T·(1+n) positions)

and the prediction of ``x_{t+1}`` is read at the last pause after ``x_t``; the outputs at every other
position are not trained (labels ``−100``). The pause embedding is a learned row of the embedding
matrix (``pause.token_id``, default the last id — StateLoop's padded GPT-NeoX vocabulary of 50,432
rows has unused rows, so the model keeps Vanilla Looped's 1420.92M parameters, Tab. 1).

:class:`PauseLM` is a :class:`~looplm.model.LoopedLM` whose ``forward`` takes and returns *real*
tokens: it inserts the pauses itself (:func:`insert_pauses`, which a data pipeline can also call),
returns the logits at the prediction positions ``[B, T, V]`` with the pause logit masked (so
``looplm.decode.generate`` — greedy or sampled — never returns a pause, and feeds the ``n`` pauses of every
sampled token through the cache with it), and computes the loss on real tokens only. So the trainer,
``eval ppl`` and ``generate`` need no pause-specific code, and training budgets count real tokens
(as StateLoop's do). ``max_seq_len`` is the backbone's length: a row holds ``max_seq_len // (1+n)``
real tokens.

Choices that are ours: the pause logit is excluded from the softmax of the loss as well (the pause
is never a target, and the loss then equals ``−log p`` of the logits ``generate`` samples from);
pauses follow *every* token including the last one of a prompt; positions count pauses too.

``looplm.build`` returns a :class:`PauseLM` for a config with a ``pause:`` section
(``looplm.build("stateloop-1.4b-pause")``; the choice is :func:`looplm.factory.model_class`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .model import LoopedLM, LoopedLMOutput


def insert_pauses(
    input_ids: torch.Tensor,
    n_pause: int,
    pause_id: int,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``[B, T] -> [B, T·(1+n)]``: ``n_pause`` pause ids after every token.

    Returns ``(ids, labels, attention_mask)``: labels (when given) copied at real positions and
    ``-100`` at pauses — with the model's one-position shift, the last pause after ``x_t`` is trained
    to predict ``x_{t+1}`` and nothing else is trained; the mask repeats each entry ``1+n`` times
    (left padding stays left padding).
    """
    B, T = input_ids.shape
    ids = torch.full((B, T, 1 + n_pause), pause_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids
    out_labels = out_mask = None
    if labels is not None:
        out_labels = torch.full((B, T, 1 + n_pause), -100, dtype=labels.dtype, device=labels.device)
        out_labels[:, :, 0] = labels
        out_labels = out_labels.flatten(1)
    if attention_mask is not None:
        out_mask = attention_mask.repeat_interleave(1 + n_pause, dim=1)
    return ids.flatten(1), out_labels, out_mask


def prediction_positions(T: int, n_pause: int, device=None) -> torch.Tensor:
    """Positions (in the paused sequence) that predict the next real token: the last pause of each."""
    return torch.arange(T, device=device) * (1 + n_pause) + n_pause


class PauseLM(LoopedLM):
    """A looped LM with ``n`` learned pause tokens after every input token (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        if cfg.pause is None:
            raise ValueError("PauseLM needs a model config with `pause:` set (e.g. preset stateloop-1.4b-pause)")
        super().__init__(cfg)
        self.n_pause = cfg.pause.n_pause
        self.pause_id = cfg.pause.token_id if cfg.pause.token_id is not None else cfg.vocab_size - 1

    @property
    def max_real_tokens(self) -> int:
        """Real tokens that fit in ``max_seq_len`` with their pauses."""
        return self.config.max_seq_len // (1 + self.n_pause)

    def new_cache(self, batch_size: int, num_loops: int | None = None, capacity: int | None = None, **kwargs):
        """A decoding cache; ``capacity`` counts real tokens (the slots hold their pauses too)."""
        if capacity is not None:
            kwargs["capacity"] = capacity * (1 + self.n_pause)
        return super().new_cache(batch_size, num_loops, **kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> LoopedLMOutput:
        """Same interface as :meth:`LoopedLM.forward`, on real tokens: logits ``[B, T, V]`` predict the
        next real token (the pause logit is ``-inf``); ``loss`` is the next-token loss on real tokens."""
        if position_ids is not None:
            raise ValueError("PauseLM numbers positions itself (pauses count); do not pass position_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return super().forward(
                input_ids, labels=labels, attention_mask=attention_mask, cache=cache, **kwargs
            )  # its errors
        if not torch.compiler.is_compiling() and bool((input_ids == self.pause_id).any()):
            raise ValueError(f"input_ids contain the pause id {self.pause_id}; PauseLM inserts the pauses itself")
        past = cache.seqlen // (1 + self.n_pause) if cache is not None else 0
        if past + input_ids.shape[1] > self.max_real_tokens:
            raise ValueError(
                f"{past + input_ids.shape[1]} tokens with {self.n_pause} pauses each exceed max_seq_len="
                f"{self.config.max_seq_len}; at most {self.max_real_tokens} real tokens fit"
            )
        kwargs.pop("return_logits", None)  # the selected logits are always returned
        kwargs.pop("logits_to_keep", None)
        ids, _, mask = insert_pauses(input_ids, self.n_pause, self.pause_id, attention_mask=attention_mask)
        out = super().forward(ids, attention_mask=mask, cache=cache, **kwargs)
        pos = prediction_positions(input_ids.shape[1], self.n_pause, device=ids.device)
        logits = out.logits[:, pos].clone()  # [B, T, V]
        logits[..., self.pause_id] = float("-inf")
        loss = None
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # [B, T]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        hidden = out.hidden[:, pos] if out.hidden is not None else None
        new = {"logits": logits, "loss": loss, "lm_loss": loss, "hidden": hidden}  # the rest as the backbone gave it
        fields = {f.name for f in dataclasses.fields(LoopedLMOutput)}
        return dataclasses.replace(out, **{k: v for k, v in new.items() if k in fields})
