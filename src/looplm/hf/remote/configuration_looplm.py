"""``LoopLMConfig``: the Hugging Face config of an exported looplm model.

The whole looplm ``ModelConfig`` travels in one field, ``looplm`` (a dict: ``(p, s, K, c)``, mixers,
the recurrence rule's ``name`` and ``options``, ...), so every rule exports without any code here
knowing about it. The usual transformers fields (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
``max_position_embeddings``, ``tie_word_embeddings``, ``use_cache``) are derived from it for tools
that read them. Two inference settings are top-level fields, also accepted by ``generate()`` and
``forward()``:

* ``num_loops`` — the loop count ``r`` at inference (default: the training count ``K``);
* ``exit_threshold`` — ``q`` for rules with an exit gate (``loop_options={"exit_threshold": q}``).

Written for transformers 4.57 and 5.x: ``__init__`` is explicit (5.x configs are dataclasses but
accept a custom ``__init__``), and ``use_cache`` is set here because the 5.x base config no longer
defines it.
"""

from __future__ import annotations

from transformers import PretrainedConfig


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
        **kwargs,
    ):
        self.looplm = dict(looplm or {})
        d = self.looplm
        self.num_loops = num_loops
        self.exit_threshold = exit_threshold
        self.loop_options = dict(loop_options or {})
        self.use_cache = use_cache
        self.looplm_version = looplm_version
        # derived, for tools that read the usual names (never read back: `looplm` is the truth)
        self.vocab_size = d.get("vocab_size", 256)
        self.hidden_size = d.get("d_model", 64)
        self.num_hidden_layers = d.get("n_prelude", 0) + d.get("n_core", 2) + d.get("n_coda", 0)
        self.max_position_embeddings = d.get("max_seq_len", 2048)
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=bool(d.get("tie_embeddings", False)), **kwargs)
