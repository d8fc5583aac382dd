"""``LoopLMConfig``: the Hugging Face config of an exported looplm model.

The whole looplm ``ModelConfig`` travels in one field, ``looplm`` (a dict: ``(p, s, K, c)``, mixers,
the recurrence rule's ``name`` and ``options``, ...), so every rule exports without any code here
knowing about it. It is the truth; everything else at the top level is derived from it (validated by
looplm's own ``ModelConfig``) for the tools that read the usual names:

* transformers' names: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` and ``rope_parameters``
  (transformers 5's form, ``llama3`` scaling and ``partial_rotary_factor`` included; 4.x: ``rope_scaling``
  and ``partial_rotary_factor``), ``attention_bias``, ``hidden_act``, ``max_position_embeddings`` (real
  tokens: a pause model's ``max_seq_len`` holds its pauses too), ``tie_word_embeddings``,
  ``layer_types`` (the mixer of each physical block: ``attention`` / ``sliding_attention`` / ``mamba``,
  which transformers 5 names ``full_attention`` / ``sliding_attention`` / ``linear_attention``) and
  ``sliding_window``;
* the loop structure ``(p, s, K, c)``: ``num_prelude_layers``, ``num_core_layers``,
  ``num_coda_layers``, ``trained_num_loops`` (``K``); ``num_hidden_layers`` counts physical blocks
  ``p + s + c`` (as Ouro's config does) and ``effective_num_hidden_layers`` is ``p + s·r + c`` at the
  inference loop count ``r``.

Two inference settings are top-level fields, also accepted by ``generate()`` and ``forward()``
(which override them per call):

* ``num_loops`` — the loop count ``r`` at inference (written as ``K`` unless the export chose
  another; ``None`` also means ``K``) — Ouro's ``total_ut_steps``, Huginn's ``mean_recurrence``;
* ``exit_threshold`` — ``q`` for rules with an exit gate (``loop_options={"exit_threshold": q}``),
  written where the rule has one.

``looplm_code`` picks the code that runs the model (``auto`` | ``bundled`` | ``installed``, see
:func:`modeling_looplm.looplm_implementation`); pass it to ``from_pretrained`` to override.

Written for transformers 4.57 and 5.x: ``__init__`` is explicit (5.x configs are dataclasses but
accept a custom ``__init__``), and ``use_cache`` is set here because the 5.x base config no longer
defines it.
"""

from __future__ import annotations

import transformers
from transformers import PretrainedConfig

from ...config import ModelConfig

LOOPLM_CODE_CHOICES = ("auto", "bundled", "installed")
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def derived_fields(cfg: ModelConfig, num_loops: int | None = None) -> dict:
    """The top-level fields tools read, from a looplm ``ModelConfig`` (at ``num_loops`` = r, default K)."""
    a = cfg.attention
    r = num_loops if num_loops is not None else cfg.n_loops
    n_real = cfg.max_seq_len // (1 + cfg.pause.n_pause) if cfg.pause is not None else cfg.max_seq_len
    s = a.rope_scaling
    scaling = (
        None
        if s is None
        else {
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    )
    partial = (a.rotary_dim / cfg.head_dim) if a.rotary_dim else 1.0
    out = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_parameters": {
            "rope_type": "default" if scaling is None else "llama3",
            "rope_theta": a.rope_theta,
            **(scaling or {}),
            "partial_rotary_factor": partial,
        },
        "rope_scaling": None if scaling is None else {"rope_type": "llama3", **scaling},  # transformers 4.x
        "partial_rotary_factor": partial,
        "attention_bias": a.bias,
        "hidden_act": "silu",
        "max_position_embeddings": n_real,
        "layer_types": [_layer_type(cfg, i) for i in range(cfg.n_physical)],
        "sliding_window": a.sliding_window,
        "num_hidden_layers": cfg.n_physical,
        "num_prelude_layers": cfg.n_prelude,
        "num_core_layers": cfg.n_core,
        "num_coda_layers": cfg.n_coda,
        "trained_num_loops": cfg.n_loops,
        "effective_num_hidden_layers": cfg.effective_depth(r),
    }
    return out


def _layer_type(cfg: ModelConfig, i: int) -> str:
    """transformers' name for physical block ``i``'s mixer (4.x names; transformers 5 maps them to its own)."""
    if cfg.mixer_of(i) == "mamba2":
        return "mamba"
    return "sliding_attention" if cfg.sliding_window_of(i) is not None else "attention"


class LoopLMConfig(PretrainedConfig):
    model_type = "looplm"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        looplm: dict | None = None,
        num_loops: int | None = None,
        exit_threshold: float | None = None,
        loop_options: dict | None = None,
        use_cache: bool = True,
        looplm_version: str | None = None,
        looplm_code: str = "auto",
        **kwargs,
    ):
        self.looplm = dict(looplm or {})
        cfg = ModelConfig.from_dict(dict(self.looplm))  # every bad field in one error
        if num_loops is not None and (isinstance(num_loops, bool) or not isinstance(num_loops, int) or num_loops < 1):
            raise ValueError(
                f"num_loops must be a positive int (or None = the trained {cfg.n_loops}), got {num_loops!r}"
            )
        if looplm_code not in LOOPLM_CODE_CHOICES:
            raise ValueError(f"looplm_code must be one of {LOOPLM_CODE_CHOICES}, got {looplm_code!r}")
        self.num_loops = num_loops
        self.exit_threshold = exit_threshold
        self.loop_options = dict(loop_options or {})
        self.use_cache = use_cache
        self.looplm_version = looplm_version
        self.looplm_code = looplm_code
        # derived, for tools that read the usual names (never read back: `looplm` is the truth)
        for k, v in derived_fields(cfg, num_loops).items():
            kwargs.pop(k, None)
            if k == "rope_scaling" and _TRANSFORMERS_MAJOR >= 5:
                continue  # a deprecated alias of rope_parameters there
            setattr(self, k, v)
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=bool(cfg.tie_embeddings), **kwargs)
