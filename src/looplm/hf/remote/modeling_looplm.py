"""``LoopLMForCausalLM``: a looplm model behind the Hugging Face ``PreTrainedModel`` / ``generate`` API.

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads an export written by
``looplm export hf`` with only ``torch`` and ``transformers`` installed: the export carries looplm's own
plain-PyTorch model code next to this file (flat sibling modules generated from looplm's source,
``looplm/hf/bundle.py``), and this file is one of them — in looplm's source tree it imports looplm's
modules, in an export their copies. The computation is looplm's :class:`~looplm.model.LoopedLM` (or
:class:`~looplm.pause.PauseLM`): the same driver and recurrence rule as in training, so the logits are
looplm's exactly, for every registered rule. Around it this file adds what transformers needs:

* **which code runs** (:func:`looplm_implementation`, ``config.looplm_code``): ``bundled`` — the
  export's copy; ``installed`` — an installed looplm (with its compiled CPU fast paths for
  ``generate``); ``auto`` (default) — the installed looplm when its source is byte for byte the one the
  export was made from (the manifest's digest), else the copy. Either way the same code, so the same
  logits; ``model.looplm_implementation`` says which;
* the loop count ``r`` — ``generate(..., num_loops=r)`` / ``forward(num_loops=r)``, default
  ``config.num_loops`` (the trained ``K`` unless exported with another); ``r > K`` works;
* the exit threshold ``q`` — ``generate(..., exit_threshold=q)`` / ``config.exit_threshold``, passed
  to the rule as ``loop_options={"exit_threshold": q}`` (rules without an exit gate ignore it);
* ``generate()`` on looplm's lean decode path: whenever the request is one looplm's
  :func:`~looplm.decode.generate.generate` decodes the same way transformers would — greedy or sampling with
  temperature / top-k / top-p, one EOS id, left padding, no beams, no logits processors, streamers or
  ``return_dict_in_generate`` — it runs that function (preallocated KV, the head on the last position
  only, no host synchronisation per token but the all-finished check; on an installed looplm its fused
  CPU decode steps): the same tokens as transformers' loop over :meth:`forward` (greedy: identical;
  sampling: the same draws from the same probabilities, up to float rounding at a top-p boundary).
  Any other request goes to transformers' ``generate``, whose steps call :meth:`forward` with a
  :class:`LoopLMCache` preallocated for the whole generation. Extra keyword arguments that looplm's
  ``generate`` accepts (``num_loops``, ``loop_options``, ``generator``, ...) pass straight through.
  Both paths refuse a request longer than the model's context before decoding anything;
* adaptive depth (``docs/adaptive-depth.md``): ``generate(..., exit="gate:0.8")`` (or ``"kl:5e-4"``,
  ``"convergence:0.05"``, an :class:`~looplm.decode.exits.Exit`) decodes each token until its exit, skipping the
  loops after it; ``generate(..., speculative={"draft_loops": 1, "k": 4})`` is lossless self-speculative
  decoding. Both run on the lean path only (a request that leaves it is refused, naming why); with
  ``exit="gate:q"`` the gate's ``q`` is also the output selection (``config.exit_threshold`` is not applied);
* :class:`LoopLMCache`: the decoding cache, one slot per (loop iteration, physical layer) created on
  first use — so a request for more loops than the training count makes more slots. A token decoded at
  iteration ``k`` attends to the iteration-``k`` keys of its prefix (``looplm.cache``);
* ``output_hidden_states=True``: transformers' layout — the embeddings, then the output of every block
  in the order it ran (prelude, each core block at every loop iteration, coda), the last one replaced by
  the final normed state — ``1 + p + s·r + c`` tensors ``[B, T, d]``;
* loading refuses an incomplete export (a tensor the model needs missing from the safetensors, or one it
  does not know): transformers would leave the missing ones as uninitialised memory.

Version notes: transformers 5.x calls the cache argument ``cache`` (4.x: ``past_key_values``); both
are accepted and both output fields are filled. ``_supports_default_dynamic_cache`` returns False so
that neither version builds its own ``DynamicCache`` (a per-layer cache cannot hold per-loop state).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from ...config import ModelConfig
from ...factory import model_class
from ...decode.generate import generate as looplm_generate
from .configuration_looplm import LOOPLM_CODE_CHOICES, LoopLMConfig
from .looplm_source import installed_package_dir, sources_digest

try:
    from .looplm_manifest import MANIFEST  # written next to this file in an export (looplm/hf/bundle.py)
except ImportError:  # looplm's own source tree: this module runs on looplm itself
    MANIFEST = None

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


# ------------------------------------------------------------------------------------------------ which code
@dataclass(frozen=True)
class Implementation:
    """The looplm code an exported model runs on (see :func:`looplm_implementation`)."""

    name: str  # "bundled" (the export's copy) | "installed" (an installed looplm) | "looplm" (looplm's own tree)
    ModelConfig: type
    model_class: Callable
    generate: Callable
    note: str = ""


_HERE = Implementation("bundled" if MANIFEST is not None else "looplm", ModelConfig, model_class, looplm_generate)


def _installed(note: str) -> Implementation:
    cfg, fac = (importlib.import_module(f"looplm.{m}") for m in ("config", "factory"))
    try:  # looplm.decode.generate since looplm's decode package; looplm.generate in the looplm before it
        gen = importlib.import_module("looplm.decode.generate")
    except ModuleNotFoundError:
        gen = importlib.import_module("looplm.generate")
    return Implementation("installed", cfg.ModelConfig, fac.model_class, gen.generate, note)


def looplm_implementation(choice: str = "auto") -> Implementation:
    """The code that runs an exported model: ``"bundled"`` (the export's copy of looplm's model code),
    ``"installed"`` (an installed looplm: its CPU fast paths decode), or ``"auto"``: the installed looplm if
    its source is the one the export was made from (the manifest's digest), else the copy."""
    if choice not in LOOPLM_CODE_CHOICES:
        raise ValueError(f"looplm_code must be one of {LOOPLM_CODE_CHOICES}, got {choice!r}")
    if MANIFEST is None or choice == "bundled":
        return _HERE
    pkg = installed_package_dir()
    same = pkg is not None and sources_digest(pkg, MANIFEST["sources"].values()) == MANIFEST["source_digest"]
    if choice == "installed":
        if pkg is None:
            raise ImportError("looplm_code='installed' needs looplm installed (pip install looplm); or use 'bundled'")
        if not same:
            warnings.warn(
                f"the installed looplm ({pkg}) is not the source this export was made from (looplm "
                f"{MANIFEST['looplm_version']}, {MANIFEST['source_digest'][:19]}...); its model code runs it as asked",
                stacklevel=3,
            )
        return _installed(f"looplm at {pkg}" + ("" if same else " (another source than the export's)"))
    return _installed(f"looplm at {pkg} (the export's source)") if same else _HERE


# ------------------------------------------------------------------------------------------------ cache
class LoopLMCache:
    """The decoding cache of an exported looped model: a looplm ``LoopCache`` (one slot per (loop
    iteration, layer), created when first used) with the methods ``generate`` calls on caches.

    Its loop count is fixed once it holds tokens (the prefix's keys exist for those iterations only);
    an empty cache takes whatever loop count the first forward asks for.
    """

    is_compileable = False  # transformers checks this before compiling the decoding step

    def __init__(self, model, batch_size: int, num_loops: int, capacity: int | None = None):
        self.inner = model.new_cache(batch_size, num_loops, capacity=capacity)

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


class IncompleteExportError(ValueError):
    """An export's safetensors lack tensors the model needs, or hold tensors it does not know."""


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
        """Weights come from the checkpoint; only computed buffers (rotary tables) are rebuilt here (a fresh
        model — ``from_config`` — was initialised by looplm itself; a tensor missing from a checkpoint is
        refused by :meth:`from_pretrained`)."""
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, refusing an incomplete export (:class:`IncompleteExportError`)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
        if missing or unexpected:
            where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} tensor(s) the model needs are missing ({', '.join(missing[:8])}"
                    f"{', ...' if len(missing) > 8 else ''}): transformers would leave them as uninitialised memory"
                )
            if unexpected:
                parts.append(f"{len(unexpected)} tensor(s) are not the model's ({', '.join(unexpected[:8])})")
            raise IncompleteExportError(
                f"the export {str(where)!r} does not fit its config: "
                + "; ".join(parts)
                + ". Export the checkpoint again (looplm export hf CHECKPOINT OUT)"
            )
        return (model, info) if want_info else model


class LoopLMForCausalLM(LoopLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = (
        {"looplm.lm_head.weight": "looplm.embed.weight"} if _TRANSFORMERS_MAJOR >= 5 else ["looplm.lm_head.weight"]
    )

    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        self.looplm_implementation = looplm_implementation(getattr(config, "looplm_code", "auto"))
        impl = self.looplm_implementation
        cfg = impl.ModelConfig.from_dict(dict(config.looplm))
        self.looplm = impl.model_class(cfg)(cfg)
        self._capacity: int | None = None  # tokens a generate() call will hold (preallocated KV on the HF path)
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

    def _loop_options(self, exit_threshold, loop_options, config_q: bool = True) -> dict | None:
        opts = dict(self.config.loop_options or {})
        opts.update(loop_options or {})
        q = exit_threshold if exit_threshold is not None or not config_q else self.config.exit_threshold
        if q is not None:
            opts["exit_threshold"] = q
        return opts or None

    def _max_tokens(self) -> int:
        """Real tokens one sequence may hold (a pause model's context holds its pauses too)."""
        return getattr(self.looplm, "max_real_tokens", self.looplm.config.max_seq_len)

    def _as_loop_cache(self, cache, batch: int, r, create: bool) -> LoopLMCache | None:
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
        loops = int(r.max()) if isinstance(r, torch.Tensor) else int(r)
        return LoopLMCache(self.looplm, batch, loops, capacity=self._capacity)

    # --- forward ---
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
        and the rule's inference options for this call. ``output_hidden_states``: see the module docstring.
        """
        if inputs_embeds is not None:
            raise ValueError(
                "LoopLMForCausalLM takes input_ids (a looped model's rules may read the token ids' embeddings)"
            )
        if input_ids is None:
            raise ValueError("input_ids is required")
        r = self._loops(num_loops)
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and labels is None and not self.training
        cache = self._as_loop_cache(cache if cache is not None else past_key_values, input_ids.shape[0], r, use_cache)
        inner = cache.inner if cache is not None else None
        if attention_mask is not None and bool(attention_mask.bool().all()):
            attention_mask = None  # no padding: the plain causal path (identical results, faster)
        want_states = bool(
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        with _block_outputs(self.looplm) if want_states else contextlib.nullcontext() as states:
            out = self.looplm(
                input_ids,
                labels=labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=inner,
                num_loops=r,
                loop_options=self._loop_options(exit_threshold, loop_options),
                logits_to_keep=logits_to_keep or None,
                output_hidden=want_states,
                validate=inner is None or inner.seqlen == 0,  # ids of the prompt; later steps are sampled ids
            )
        hidden = _hidden_states_tuple(self.looplm, states, out.hidden, input_ids) if want_states else None
        res = LoopLMOutput(
            loss=out.loss,
            logits=out.logits,
            **({"cache": cache} if _TRANSFORMERS_MAJOR >= 5 else {"past_key_values": cache}),
            hidden_states=hidden,
            aux_loss=out.aux_loss,
            executed_loops=out.executed_loops,
        )
        return res if return_dict is not False else res.to_tuple()

    # --- generation ---
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
            input_ids = input_ids[:, c.get_seq_length() :]
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache": c,
            "use_cache": use_cache,
            "num_loops": num_loops,
            "exit_threshold": exit_threshold,
            "loop_options": loop_options,
            "logits_to_keep": logits_to_keep if logits_to_keep is not None else 1,
        }
        if kwargs.get("output_hidden_states"):
            out["output_hidden_states"] = True
        return out

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        """transformers' ``generate``, on looplm's lean decode path wherever that decodes the same tokens
        (see the module docstring); every other request runs transformers' own loop over :meth:`forward`."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        gc, model_kwargs = _resolve_generation_config(self, generation_config, kwargs)
        lean = None if not isinstance(ids, torch.Tensor) else self._lean_request(ids, gc, model_kwargs, kwargs)
        n_new = _new_tokens(gc, ids)
        if (
            isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and n_new is not None
            and ids.shape[1] + n_new > self._max_tokens()
        ):
            raise ValueError(
                f"generate: prompt length {ids.shape[1]} + {n_new} new tokens exceeds the model's context of "
                f"{self._max_tokens()} tokens; shorten the prompt or ask for at most "
                f"{max(0, self._max_tokens() - ids.shape[1])} new tokens (max_new_tokens)"
            )
        if lean is not None:
            return self.looplm_implementation.generate(self.looplm, **lean)
        adaptive = [k for k in _LOOPLM_ONLY_ARGUMENTS if kwargs.get(k) is not None]
        if adaptive:  # transformers' loop would only say "not used by the model"
            raise ValueError(
                f"generate({', '.join(f'{k}=...' for k in adaptive)}) runs on looplm's own decode path (docs/adaptive-depth.md), "
                "which this request leaves: it asks for something only transformers' loop does (beam search, logits "
                "processors, stopping criteria, a streamer, a repetition penalty, several EOS ids, ...). Drop those "
                "arguments, or decode at full depth without " + " / ".join(adaptive)
            )
        self._capacity = ids.shape[1] + n_new if isinstance(ids, torch.Tensor) and ids.dim() == 2 and n_new else None
        try:
            return super().generate(inputs, generation_config=generation_config, **kwargs)
        finally:
            self._capacity = None

    def _lean_request(self, ids: torch.Tensor, gc: GenerationConfig, model_kwargs: dict, raw: dict) -> dict | None:
        """The arguments of looplm's ``generate`` that decode what transformers' ``generate`` would for this
        request, or ``None`` when it asks for something only transformers' loop does."""
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.shape[0] == 0 or ids.shape[1] == 0:
            return None
        if any(raw.get(k) is not None for k in _HF_ONLY_ARGUMENTS):
            return None
        if _non_default_generation_fields(gc):
            return None
        n_new = _new_tokens(gc, ids)
        eos = gc.eos_token_id
        if isinstance(eos, (list, tuple)):
            if len(eos) > 1:
                return None  # looplm's generate stops at one id
            eos = eos[0] if eos else None
        if isinstance(eos, torch.Tensor):
            return None
        if n_new is None or n_new < 1 or (gc.do_sample and not gc.temperature):
            return None  # transformers' own warnings and errors
        pad = gc.pad_token_id if gc.pad_token_id is not None else eos
        mask = model_kwargs.pop("attention_mask", None)
        if mask is None and pad is not None and pad != eos and bool((ids == pad).any()):
            return None  # transformers infers a mask from the pad id
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
                return None
            m = mask.to(torch.long)
            if bool((m[:, 1:] < m[:, :-1]).any()):
                return None  # right padding: transformers warns and decodes it its way
            mask = None if bool(m.all()) else m.to(ids.device)
        lg_params = inspect.signature(self.looplm_implementation.generate).parameters
        extra = {}
        exit_threshold = model_kwargs.pop("exit_threshold", None)
        loop_options = model_kwargs.pop("loop_options", None)
        num_loops = model_kwargs.pop("num_loops", None)
        for k, v in model_kwargs.items():
            if k in ("use_cache", "output_attentions", "output_hidden_states") or v is None:
                continue
            if k not in lg_params or k in _SET_BY_US:
                return None  # transformers validates (and names) an argument no forward takes
            extra[k] = v
        dev = self.looplm.embed.weight.device
        return dict(
            input_ids=ids.to(dev),
            max_new_tokens=n_new,
            do_sample=bool(gc.do_sample),
            temperature=float(gc.temperature) if gc.temperature is not None else 1.0,
            top_k=gc.top_k if gc.do_sample else None,
            top_p=gc.top_p if gc.do_sample else None,
            eos_token_id=eos,
            pad_token_id=pad,
            attention_mask=mask,
            num_loops=self._loops(num_loops),
            use_cache=gc.use_cache is not False,
            **extra,
            # a per-token exit by the gate takes its q from exit=: the config's default q is not forced on it
            loop_options=self._loop_options(exit_threshold, loop_options, config_q=extra.get("exit") is None),
        )

    def _reorder_cache(self, cache, beam_idx):  # transformers 4.x beam search on legacy caches
        cache.reorder_cache(beam_idx)
        return cache


# looplm's generate() options that only its own decode path runs (adaptive depth, speculative decoding)
_LOOPLM_ONLY_ARGUMENTS = ("exit", "speculative", "return_stats")
# transformers' generate() arguments outside the generation config: any of them means its own loop
_HF_ONLY_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
    "assistant_tokenizer",
    "inputs_embeds",
    "past_key_values",
    "cache",
)
_SET_BY_US = frozenset(
    {
        "input_ids",
        "max_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "eos_token_id",
        "pad_token_id",
        "attention_mask",
    }
)
# generation-config fields the lean path honours; any other field away from its default means transformers' loop
_LEAN_FIELDS = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "transformers_version",
    }
)


def _resolve_generation_config(model, generation_config, kwargs) -> tuple[GenerationConfig, dict]:
    """The generation config transformers would decode with (model defaults, then the call's arguments) and the
    arguments that are not generation-config fields — without changing ``kwargs``."""
    kw = {k: v for k, v in kwargs.items() if k not in _HF_ONLY_ARGUMENTS and k != "input_ids"}
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            gc, model_kwargs = prepare(
                copy.deepcopy(generation_config) if generation_config is not None else None, **kw
            )
            return gc, dict(model_kwargs)
        except (TypeError, ValueError):
            pass  # another transformers signature, or its own error (raised again by its generate)
    gc = copy.deepcopy(generation_config or model.generation_config)
    return gc, dict(gc.update(**kw))


def _global_generation_defaults() -> GenerationConfig:
    d = GenerationConfig()
    params = getattr(GenerationConfig, "_get_default_generation_params", None)
    if params is not None:  # transformers >= 5: unset fields take these values in generate()
        for k, v in params().items():
            if getattr(d, k, None) is None:
                setattr(d, k, v)
    return d


def _non_default_generation_fields(gc: GenerationConfig) -> list[str]:
    """Fields of ``gc`` (other than :data:`_LEAN_FIELDS`) that differ from transformers' defaults."""
    ref = _global_generation_defaults().to_dict()
    out = []
    for k, v in gc.to_dict().items():
        if k.startswith("_") or k in _LEAN_FIELDS:
            continue
        if v != ref.get(k) and not (v is None and k not in ref):
            out.append(k)
    return out


def _new_tokens(gc: GenerationConfig, ids) -> int | None:
    """How many tokens transformers' ``generate`` would add (``max_new_tokens``, else ``max_length − T``)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if gc.max_new_tokens is not None:
        return int(gc.max_new_tokens)
    if gc.max_length is not None:
        return int(gc.max_length) - ids.shape[1]
    return None


# ------------------------------------------------------------------------------------------------ hidden states
@contextlib.contextmanager
def _block_outputs(model):
    """Record, during one forward, the embeddings ``E`` and the output of every prelude / core / coda block
    call, in call order: ``{"embeddings": [E], "prelude": [...], "core": [...], "coda": [...]}`` (a rule's
    readouts call the coda too: the final pass is its last ``c`` calls)."""
    rec = {"embeddings": [], "prelude": [], "core": [], "coda": []}
    handles = [
        model.embed.register_forward_hook(lambda _m, _a, out: rec["embeddings"].append(out * model.embed_multiplier))
    ]
    stacks = {"prelude": model.prelude.blocks, "core": model.core.stack.blocks, "coda": model.coda.blocks}
    for part, blocks in stacks.items():
        for blk in blocks:
            handles.append(blk.register_forward_hook(lambda _m, _a, out, part=part: rec[part].append(out)))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def _hidden_states_tuple(model, rec: dict, final: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' ``hidden_states`` layout: ``(E, block 1, ..., block n-1, norm(final))`` over the ``n``
    blocks in the order they ran — ``1 + p + s·r + c`` tensors, each ``[B, T, d]`` (a pause model's: at the
    positions that predict the next real token)."""
    c = len(model.coda.blocks)
    blocks = rec["prelude"] + rec["core"] + (rec["coda"][len(rec["coda"]) - c :] if c else [])
    n_pause = getattr(model, "n_pause", 0)
    if n_pause:  # [B, T·(1+n), d] -> the last pause after each real token
        pos = torch.arange(ids.shape[1], device=final.device) * (1 + n_pause) + n_pause
        blocks = [b[:, pos] for b in blocks]
    if rec["embeddings"]:
        E = rec["embeddings"][-1][:, pos] if n_pause else rec["embeddings"][-1]
    else:  # the model looked the embeddings up without the module (its sparse-gradient training path)
        w = model.embed.weight
        E = (w[model.pause_id].expand(*ids.shape, -1) if n_pause else w[ids]) * model.embed_multiplier
    return (E,) + tuple(blocks[:-1]) + (final,)


__all__ = [
    "Implementation",
    "IncompleteExportError",
    "LoopLMCache",
    "LoopLMConfig",
    "LoopLMForCausalLM",
    "LoopLMOutput",
    "LoopLMPreTrainedModel",
    "looplm_implementation",
]
