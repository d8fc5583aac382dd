"""Import Hugging Face ``transformers`` models (Llama, Qwen3, Mamba-2) as unlooped ``LoopedLM``s.

``from_transformers(hf_model)`` maps the config and copies the weights: the result has
``(p, s, K, c) = (0, L, 1, 0)`` and matches the source logit for logit (tested in fp32). It is the
reference point for the looped variants (loop the imported stack with ``n_loops=...``, or
``to_config`` to derive a looped config of the same backbone).
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def _rope_params(hf_cfg) -> tuple[float, dict | None]:
    """(theta, llama3 scaling dict or None) from either the transformers-5 ``rope_parameters`` or older fields."""
    rp = getattr(hf_cfg, "rope_parameters", None) or {}
    scaling = getattr(hf_cfg, "rope_scaling", None) or {}
    theta = rp.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    src = rp if rp.get("rope_type", rp.get("type")) not in (None, "default") else scaling
    kind = src.get("rope_type", src.get("type")) if src else None
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"RoPE scaling type {kind!r} is not supported (supported: default, llama3)")
    return float(theta), {
        "factor": float(src["factor"]),
        "low_freq_factor": float(src["low_freq_factor"]),
        "high_freq_factor": float(src["high_freq_factor"]),
        "original_max_position_embeddings": int(src["original_max_position_embeddings"]),
    }


def to_config(hf_cfg, **overrides) -> ModelConfig:
    """A looplm ``ModelConfig`` equivalent to a transformers config (Llama, Qwen3, Mamba2)."""
    mt = getattr(hf_cfg, "model_type", "")
    if mt in ("llama", "qwen3"):
        theta, scaling = _rope_params(hf_cfg)
        if getattr(hf_cfg, "mlp_bias", False):
            raise ValueError("Llama models with mlp_bias=True are not supported")
        if getattr(hf_cfg, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported (looplm projections are bias-free)")
        d = dict(
            name=f"hf-{mt}",
            vocab_size=hf_cfg.vocab_size,
            d_model=hf_cfg.hidden_size,
            n_core=hf_cfg.num_hidden_layers,
            n_loops=1,
            d_ff=hf_cfg.intermediate_size,
            attention=dict(
                n_heads=hf_cfg.num_attention_heads,
                n_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads,
                head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
                qk_norm=mt == "qwen3",
                rope_theta=theta,
                rope_scaling=scaling,
            ),
            norm_eps=hf_cfg.rms_norm_eps,
            tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
            max_seq_len=hf_cfg.max_position_embeddings,
        )
    elif mt == "mamba2":
        d_inner = hf_cfg.expand * hf_cfg.hidden_size
        if hf_cfg.num_heads * hf_cfg.head_dim != d_inner:
            raise ValueError(
                f"Mamba2 config: num_heads*head_dim={hf_cfg.num_heads * hf_cfg.head_dim} != expand*hidden_size={d_inner}"
            )
        if not getattr(hf_cfg, "rms_norm", True):
            raise ValueError("Mamba2 with rms_norm=False (no gated norm) is not supported")
        d = dict(
            name="hf-mamba2",
            vocab_size=hf_cfg.vocab_size,
            d_model=hf_cfg.hidden_size,
            n_core=hf_cfg.num_hidden_layers,
            n_loops=1,
            mixer="mamba2",
            d_ff=0,
            mamba=dict(
                expand=hf_cfg.expand,
                d_state=hf_cfg.state_size,
                d_conv=hf_cfg.conv_kernel,
                headdim=hf_cfg.head_dim,
                ngroups=hf_cfg.n_groups,
                conv_bias=bool(hf_cfg.use_conv_bias),
                bias=bool(hf_cfg.use_bias),
            ),
            norm_eps=hf_cfg.layer_norm_epsilon,
            tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
            max_seq_len=max(int(getattr(hf_cfg, "max_position_embeddings", 0) or 0), 1 << 20),
        )
    else:
        raise ValueError(f"cannot import transformers model_type {mt!r}; supported: llama, qwen3, mamba2")
    from .dataclass_util import apply_overrides

    return ModelConfig.from_dict(apply_overrides(d, overrides) if overrides else d)


def _key_map(mt: str, n_layers: int, tied: bool) -> dict[str, str]:
    """transformers parameter name -> looplm parameter name."""
    m: dict[str, str] = {}
    if mt in ("llama", "qwen3"):
        m["model.embed_tokens.weight"] = "embed.weight"
        m["model.norm.weight"] = "norm.weight"
        for i in range(n_layers):
            src, dst = f"model.layers.{i}.", f"core.stack.blocks.{i}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                m[src + f"self_attn.{proj}.weight"] = dst + f"mixer.{proj}.weight"
            if mt == "qwen3":
                m[src + "self_attn.q_norm.weight"] = dst + "mixer.q_norm.weight"
                m[src + "self_attn.k_norm.weight"] = dst + "mixer.k_norm.weight"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                m[src + f"mlp.{proj}.weight"] = dst + f"mlp.{proj}.weight"
            m[src + "input_layernorm.weight"] = dst + "mixer_norm.weight"
            m[src + "post_attention_layernorm.weight"] = dst + "mlp_norm.weight"
    else:  # mamba2
        m["backbone.embeddings.weight"] = "embed.weight"
        m["backbone.norm_f.weight"] = "norm.weight"
        for i in range(n_layers):
            src, dst = f"backbone.layers.{i}.", f"core.stack.blocks.{i}."
            m[src + "norm.weight"] = dst + "mixer_norm.weight"
            for name in (
                "in_proj.weight",
                "in_proj.bias",
                "conv1d.weight",
                "conv1d.bias",
                "dt_bias",
                "A_log",
                "D",
                "norm.weight",
                "out_proj.weight",
                "out_proj.bias",
            ):
                m[src + "mixer." + name] = dst + "mixer." + name
    if not tied:
        m["lm_head.weight"] = "lm_head.weight"
    return m


def from_transformers(hf_model, **overrides):
    """Build a ``LoopedLM`` with the weights of a transformers Llama / Qwen3 / Mamba2 causal LM.

    ``overrides`` change the config before the weights are copied (e.g. ``n_loops=2`` loops the
    imported stack; shapes must stay the same).
    """
    from .model import LoopedLM

    cfg = to_config(hf_model.config, **overrides)
    p = next(hf_model.parameters())
    with torch.device(p.device):
        model = LoopedLM(cfg)
    model = model.to(p.dtype)
    kmap = _key_map(hf_model.config.model_type, cfg.n_core, cfg.tie_embeddings)
    src = hf_model.state_dict()
    ours = model.state_dict()
    new_state = {}
    for k, v in src.items():
        if k not in kmap:
            if k == "lm_head.weight" and cfg.tie_embeddings:
                continue
            if k.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected transformers parameter {k!r}: this architecture variant is not supported")
        dst = kmap[k]
        if dst not in ours:
            raise ValueError(f"transformers parameter {k!r} maps to {dst!r}, which the looplm model does not have")
        if ours[dst].shape != v.shape:
            raise ValueError(
                f"shape mismatch for {k!r}: transformers {tuple(v.shape)} vs looplm {tuple(ours[dst].shape)}"
            )
        new_state[dst] = v
    missing = [k for k in ours if k not in new_state and not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if missing:
        raise ValueError(f"transformers model lacks parameters for {missing[:5]}{'…' if len(missing) > 5 else ''}")
    model.load_state_dict(new_state, strict=False)
    return model
