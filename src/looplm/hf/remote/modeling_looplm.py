"""``LoopLMForCausalLM``: a looplm model behind the Hugging Face ``PreTrainedModel`` / ``generate`` API.

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads an export written by
``looplm export hf``. The computation is looplm's own :class:`looplm.model.LoopedLM` (or
:class:`looplm.pause.PauseLM`), built from ``config.looplm`` — the same driver and the same
recurrence rule as in training, so the logits are looplm's exactly and every registered rule works.
This file adds only what transformers needs around it:

* the loop count ``r`` — ``generate(..., num_loops=r)`` / ``forward(num_loops=r)``, default
  ``config.num_loops`` (``None`` = the training count ``K``); ``r > K`` works (looped models
  extrapolate in depth);
* the exit threshold ``q`` — ``generate(..., exit_threshold=q)`` / ``config.exit_threshold``, passed
  to the rule as ``loop_options={"exit_threshold": q}`` (rules without an exit gate ignore it);
* :class:`LoopLMCache`: the decoding cache, one slot per (loop iteration, physical layer) created on
  first use — so a request for more loops than the training count simply makes more slots. A token
  decoded at iteration ``k`` attends to the iteration-``k`` keys of its prefix (``looplm.cache``);
  without this, a looped model produces garbage after the first decoded tokens;
* ``prepare_inputs_for_generation`` that feeds only the new tokens once the cache holds the prefix,
  and left-padding masks (a padded row equals the row alone).

Version notes: transformers 5.x calls the cache argument ``cache`` (4.x: ``past_key_values``); both
are accepted and both output fields are filled. ``_supports_default_dynamic_cache`` returns False so
that neither version builds its own ``DynamicCache`` (a per-layer cache cannot hold per-loop state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_looplm import LoopLMConfig

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def build_looplm_model(cfg_dict: dict):
    """The looplm module for a config dict: ``PauseLM`` when pause tokens are configured, else ``LoopedLM``."""
    from looplm.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(cfg_dict))
    if cfg.pause is not None:
        from looplm.pause import PauseLM

        return PauseLM(cfg)
    from looplm.model import LoopedLM

    return LoopedLM(cfg)


class LoopLMCache:
    """The decoding cache of an exported looped model: a :class:`looplm.cache.LoopCache` (one slot per
    (loop iteration, layer), created when first used) with the methods ``generate`` calls on caches.

    Its loop count is fixed once it holds tokens (the prefix's keys exist for those iterations only);
    an empty cache takes whatever loop count the first forward asks for.
    """

    is_compileable = False  # transformers checks this before compiling the decoding step

    def __init__(self, model, batch_size: int, num_loops: int):
        self.inner = model.new_cache(batch_size, num_loops)

    @property
    def num_loops(self) -> int:
        return self.inner.num_loops

    def ensure_loops(self, r: int) -> None:
        """Make the cache serve ``r`` loops: an empty cache grows (or shrinks) to ``r`` slots per layer."""
        if r == self.inner.num_loops:
            return
        if self.inner.seqlen > 0:
            raise ValueError(
                f"this cache holds {self.inner.seqlen} tokens computed with {self.inner.num_loops} loops; "
                f"it cannot serve {r} loops (start a new generate() call, or pass num_loops={self.inner.num_loops})"
            )
        self.inner.num_loops = r
        self.inner.slots.clear()

    # --- what transformers' generate (and users) call on a cache ---
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.inner.seqlen

    def get_max_cache_shape(self, layer_idx: int = 0):
        return None

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.inner.index_select(beam_idx.to(self.inner.device or beam_idx.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.inner.index_select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        idx = torch.arange(self.inner.batch_size, device=self.inner.device).repeat_interleave(repeats)
        self.inner.index_select(idx)

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.inner.seqlen + max_length
        self.inner.crop(max_length)

    def __len__(self) -> int:
        return self.inner.seqlen

    def __repr__(self) -> str:
        return f"LoopLMCache({self.inner!r})"


if _TRANSFORMERS_MAJOR >= 5:

    @dataclass
    class LoopLMOutput(ModelOutput):
        """``logits [B, T, V]``, the loss with labels, and the :class:`LoopLMCache` (``cache``)."""

        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        cache: LoopLMCache | None = None
        hidden_states: tuple[torch.Tensor, ...] | None = None
        aux_loss: torch.Tensor | None = None
        executed_loops: int | None = None

else:  # transformers 4.x names the cache `past_key_values`

    @dataclass
    class LoopLMOutput(ModelOutput):
        """``logits [B, T, V]``, the loss with labels, and the :class:`LoopLMCache` (``past_key_values``)."""

        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        past_key_values: LoopLMCache | None = None
        hidden_states: tuple[torch.Tensor, ...] | None = None
        aux_loss: torch.Tensor | None = None
        executed_loops: int | None = None


class LoopLMPreTrainedModel(PreTrainedModel):
    config_class = LoopLMConfig
    base_model_prefix = "looplm"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # we bring our own per-(loop, layer) cache
        return False

    def _init_weights(self, module):
        """Weights come from the checkpoint; only computed buffers (rotary tables) are rebuilt."""
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


class LoopLMForCausalLM(LoopLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = (
        {"looplm.lm_head.weight": "looplm.embed.weight"} if _TRANSFORMERS_MAJOR >= 5 else ["looplm.lm_head.weight"]
    )

    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        self.looplm = build_looplm_model(config.looplm)
        self.post_init()

    # --- embeddings (transformers ties and resizes through these) ---
    def get_input_embeddings(self):
        return self.looplm.embed

    def set_input_embeddings(self, value):
        self.looplm.embed = value

    def get_output_embeddings(self):
        return self.looplm.lm_head

    def set_output_embeddings(self, value):
        self.looplm.lm_head = value

    # --- loops ---
    def _loops(self, num_loops):
        """``num_loops`` argument > ``config.num_loops`` > the training count ``K``."""
        if num_loops is None:
            num_loops = self.config.num_loops
        return num_loops if num_loops is not None else self.looplm.config.n_loops

    def _loop_options(self, exit_threshold, loop_options) -> dict | None:
        opts = dict(self.config.loop_options or {})
        opts.update(loop_options or {})
        q = exit_threshold if exit_threshold is not None else self.config.exit_threshold
        if q is not None:
            opts["exit_threshold"] = q
        return opts or None

    def _as_loop_cache(self, cache, batch: int, r: int, create: bool) -> LoopLMCache | None:
        """Our cache, or a new one when ``cache`` is absent or an empty foreign cache (a ``DynamicCache``)."""
        if isinstance(cache, LoopLMCache):
            cache.ensure_loops(int(r.max()) if isinstance(r, torch.Tensor) else int(r))
            return cache
        if cache is not None:
            seen = cache.get_seq_length() if hasattr(cache, "get_seq_length") else None
            if seen not in (0, None):
                raise TypeError(
                    f"a looped model needs its own per-(loop, layer) cache; got a {type(cache).__name__} holding "
                    f"{seen} tokens. Pass no cache (generate makes a LoopLMCache) or the cache a previous call returned."
                )
        if not create:
            return None
        return LoopLMCache(self.looplm, batch, int(r.max()) if isinstance(r, torch.Tensor) else int(r))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LoopLMCache | None = None,
        past_key_values: LoopLMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_loops: int | torch.Tensor | None = None,
        exit_threshold: float | None = None,
        loop_options: dict | None = None,
        logits_to_keep: int = 0,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> LoopLMOutput:
        """Logits ``[B, T, V]`` (and the loss when ``labels`` are given, shifted inside as usual).

        ``attention_mask`` covers the cached prefix and the new tokens, ``[B, past + T]``, 1 = token,
        0 = left padding. ``num_loops`` / ``exit_threshold`` / ``loop_options`` set the loop count
        and the rule's inference options for this call.
        """
        if inputs_embeds is not None:
            raise ValueError("LoopLMForCausalLM takes input_ids (a looped model's rules may read the token ids' embeddings)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        r = self._loops(num_loops)
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and labels is None and not self.training
        cache = self._as_loop_cache(cache if cache is not None else past_key_values, input_ids.shape[0], r, use_cache)
        inner = cache.inner if cache is not None else None
        if attention_mask is not None and bool(attention_mask.bool().all()):
            attention_mask = None  # no padding: the plain causal path (identical results, faster)
        out = self.looplm(
            input_ids,
            labels=labels,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=inner,
            num_loops=r,
            loop_options=self._loop_options(exit_threshold, loop_options),
            logits_to_keep=logits_to_keep or None,
            output_hidden=bool(output_hidden_states),
        )
        return LoopLMOutput(
            loss=out.loss,
            logits=out.logits,
            **({"cache": cache} if _TRANSFORMERS_MAJOR >= 5 else {"past_key_values": cache}),
            hidden_states=(out.hidden,) if output_hidden_states else None,
            aux_loss=out.aux_loss,
            executed_loops=out.executed_loops,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: LoopLMCache | None = None,
        past_key_values: LoopLMCache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
        num_loops: int | torch.Tensor | None = None,
        exit_threshold: float | None = None,
        loop_options: dict | None = None,
        logits_to_keep: int | None = None,
        **kwargs,
    ) -> dict:
        """Only the tokens the cache has not seen, the full mask, and our cache (made on the first step)."""
        r = self._loops(num_loops)
        c = self._as_loop_cache(cache if cache is not None else past_key_values, input_ids.shape[0], r, use_cache)
        if c is not None and c.get_seq_length() > 0:
            input_ids = input_ids[:, c.get_seq_length():]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache": c,
            "use_cache": use_cache,
            "num_loops": num_loops,
            "exit_threshold": exit_threshold,
            "loop_options": loop_options,
            "logits_to_keep": logits_to_keep if logits_to_keep is not None else 1,
        }

    def _reorder_cache(self, cache, beam_idx):  # transformers 4.x beam search on legacy caches
        cache.reorder_cache(beam_idx)
        return cache


__all__ = ["LoopLMCache", "LoopLMConfig", "LoopLMForCausalLM", "LoopLMOutput", "LoopLMPreTrainedModel"]
