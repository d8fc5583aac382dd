"""Per-request exit thresholds in stock vLLM: the v1 logits processor that carries them (imports vLLM).

Pass it explicitly — ``vllm serve DIR --logits-processors looplm.vllm.processor:RequestExitThresholds`` or
``LLM(logits_processors=["looplm.vllm.processor:RequestExitThresholds"])`` — on a server with ``looplm_exit``;
a request then sets ``extra_args={"looplm_exit": ε}`` (OpenAI: ``extra_body={"vllm_xargs": {"looplm_exit": ε}}``).
It is not registered through the ``vllm.logits_processors`` entry point: vLLM refuses custom logits processors
with speculative decoding, so an auto-loaded one would break speculative decoding for every model.

It never touches the logits (``apply`` returns them as they are; argmax invariant). What it does:

* ``validate_params`` (a classmethod vLLM calls when it admits a request, in the front end, before any work):
  parses the field (:func:`looplm.vllm.thresholds.request_threshold`) and raises ``VLLMValidationError``,
  which the OpenAI server answers with HTTP 400 and the offline ``LLM`` raises;
* ``update_state`` (in the worker, before each forward): keeps row -> threshold of the persistent batch in the
  process's :class:`~looplm.vllm.thresholds.RowThresholds`, which the model's exit loop reads.

Docs: docs/vllm.md#per-request-thresholds.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .spec import ARCHITECTURES
from .thresholds import FIELD, PROCESSOR, install, request_threshold

__all__ = ["RequestExitThresholds"]


class RequestExitThresholds(LogitsProcessor):
    """Each request's exit threshold (``extra_args["looplm_exit"]``) for looplm's vLLM models (module docstring)."""

    looplm_exit_thresholds = True  # the marker looplm.vllm.thresholds.processor_listed looks for on a class

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        hf = vllm_config.model_config.hf_config
        archs = list(getattr(hf, "architectures", None) or [])
        if not set(archs) & set(ARCHITECTURES):
            raise ValueError(
                f"{PROCESSOR} sets per-request exit thresholds of looplm's models ({sorted(ARCHITECTURES)}); this "
                f"model's architectures are {archs}: drop --logits-processors {PROCESSOR}"
            )
        self.rows = install()  # read by the model's forward, in this process

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            request_threshold(sampling_params.extra_args)
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter=FIELD) from None

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.rows.update(
            batch_update.removed,
            ((i, request_threshold(p.extra_args)) for i, p, _, _ in batch_update.added),
            ((a, b, d == MoveDirectionality.SWAP) for a, b, d in batch_update.moved),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
