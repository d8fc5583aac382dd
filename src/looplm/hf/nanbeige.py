"""Nanbeige4.2 (``model_type: nanbeige``, ``NanbeigeForCausalLM``) in its own format: config mapping, tensor
names and shapes, and the way back — registered in :mod:`looplm.hf.public` beside Ouro and Huginn, so
``looplm import hf DIR OUT`` and ``looplm export hf RUN OUT --format original`` read and write it.

The architecture (``modeling_nanbeige.py`` of the release; the llama.cpp, SGLang, vLLM and MLX ports agree)::

    h_0 = W_E[x]                                                   (no embedding scale)
    h_k = N(F_θ(h_{k−1}))   k = 1..K, K = num_loops                 skip_loop_final_norm: false
    h_k = F_θ(h_{k−1}),  output N(h_K)                              skip_loop_final_norm: true
    F_θ: L Llama pre-norm layers   x += Attn(N₁(x));  x += MLP(N₂(x))
    Attn: GQA, head_dim from the config (Nanbeige4.2-3B: 128 while hidden_size / heads = 64, so q_proj
          is d -> H·hd and o_proj H·hd -> d, not square), rotate-half RoPE (θ = rope_theta, fp32 inverse
          frequencies), positions shared by every pass; one KV slot per (loop, layer)
    MLP: SwiGLU (gate, up, down);  logits = W_out N(h_K)  (untied in the release)

looplm: ``norm_placement: pre``, ``(p, s, K, c) = (0, L, K, 0)``, rule ``vanilla`` with ``inter_norm: true`` (the
model's final norm between passes, ``Z^k = N(H^{k−1})``; the head reads ``N(H^{K−1})``) — or without it when
``skip_loop_final_norm`` is true; ``attention.rope_precision: fp32``. Tensor names are Llama's, so the mapping
is one rename per tensor (no permutation, no fusion).

The config class also carries features this checkpoint leaves off — n-gram embeddings, (manifold-constrained)
hyper-connections, depth attention, LoopSplit, loop-shared KV, q/k layer norms, per-loop loss weights, scaled
RoPE, biases. Each one set is refused before any weight is read, naming the field; so is a field this
importer does not know (it may change the math) unless its value is off (``null`` / ``false`` / ``0`` /
empty). Sub-options of an off feature (``num_residual_streams``, ``mhc_sinkhorn_iterations``, ...) are inert.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILY = "nanbeige"
ARCHITECTURE = "NanbeigeForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
    "AutoModel": "modeling_nanbeige.NanbeigeModel",
    "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
}

# fields of the plain looped architecture (read below, or inert for inference)
_PLAIN = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_channels",
    "hidden_act",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "rms_norm_eps",
    "num_loops",
    "loop_loss_weights",
    "skip_loop_final_norm",
    "pretraining_tp",
    "tie_word_embeddings",
    "initializer_range",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "model_type",
    "architectures",
    "auto_map",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tokenizer_class",
    "total_ut_steps",
    "early_exit_threshold",
}

# features this port does not implement: field -> (is it on?, what it is). Refused when on, naming the field.
_FEATURES: dict[str, tuple[Any, str]] = {
    "enable_hyper_connection": (bool, "hyper-connections (residual streams mixed around attention and MLP)"),
    "enable_mhc": (bool, "manifold-constrained hyper-connections (mHC)"),
    "enable_depth_attention": (bool, "depth attention (values mixed from earlier depths)"),
    "enable_double_loop_split": (bool, "LoopSplit (outer layers unlooped, a middle block repeated)"),
    "loop_share_kv": (bool, "loop-shared KV (later passes read the first pass's keys and values)"),
    "qk_layernorm": (bool, "RMSNorm on queries and keys"),
    "ngram_insert_all_layers": (bool, "n-gram embeddings fused into every layer"),
    "insert_ngram_layer_idx": (bool, "n-gram embeddings fused into layers"),
    "mhc_diff_for_loop": (bool, "per-loop hyper-connection modules"),
    "mhc_double_stream_position_for_loop": (lambda v: v is not None, "doubled residual streams"),
    "loop_loss_weights": (bool, "per-loop loss weights (they also set the loop count to len + 1)"),
    "attention_bias": (bool, "biases on the attention projections"),
    "mlp_bias": (bool, "biases on the MLP projections"),
}
# n-gram embeddings are on when all three are set (NanbeigeModel.__init__)
_NGRAM = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio")
# sub-options that do nothing while their feature is off
_INERT = {
    *_NGRAM,
    "emb_tp_num",
    "ngram_layer_downproject_size",
    "ngram_embedding_hidden_size",
    "ngram_fused_mode",
    "ngram_mod_force_prime",
    "ngram_compressed_tokenizer",
    "skip_ngram_for_input",
    "num_residual_streams",
    "mhc_sinkhorn_iterations",
    "mhc_init_gating_factor",
    "enable_h_res_identity",
    "mhc_identity_nohresparam",
    "depth_attention_stride",
    "loop_middle_layers",
}


def _off(v) -> bool:
    return (
        v is None
        or v is False
        or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)
        or (isinstance(v, (str, list, tuple, dict)) and len(v) == 0)
    )


def _rope_theta(c: dict, errs: list[str]) -> float:
    """``rope_theta`` (or transformers 5's ``rope_parameters``); scaled RoPE is refused."""
    theta = c.get("rope_theta")
    for field in ("rope_scaling", "rope_parameters"):
        rs = c.get(field)
        if rs is None:
            continue
        if not isinstance(rs, dict):
            errs.append(f"{field} {rs!r} is not a mapping")
            continue
        kind = rs.get("rope_type", rs.get("type"))
        if kind not in (None, "default"):
            errs.append(
                f"{field} with rope_type {kind!r} (scaled RoPE) is not supported: plain RoPE only (rope_scaling: null)"
            )
        if rs.get("rope_theta") is not None:
            if theta is not None and float(rs["rope_theta"]) != float(theta):
                errs.append(f"{field}.rope_theta={rs['rope_theta']} disagrees with rope_theta={theta}")
            theta = rs["rope_theta"]
    if theta is None:
        errs.append("missing field 'rope_theta'")
        return 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        errs.append(f"rope_theta must be a positive number, got {theta!r}")
        return 10000.0
    return float(theta)


def config_dict(c: dict, errs: list[str]) -> dict:
    """The looplm config dict of a Nanbeige ``config.json`` (problems appended to ``errs``, nothing raised)."""
    from transformers import PretrainedConfig

    # (looplm.hf.public imports this module: its helpers are not imported back, the checks are written here)
    for f in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        if c.get(f) is None:
            errs.append(f"missing field {f!r}")
    for f in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "kv_channels",
        "max_position_embeddings",
        "num_loops",
        "pretraining_tp",
    ):
        v = c.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            errs.append(f"{f} must be a positive integer, got {v!r}")
    v = c.get("rms_norm_eps")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        errs.append(f"rms_norm_eps must be a positive number, got {v!r}")
    for field, (on, what) in _FEATURES.items():
        if field in c and on(c[field]):
            errs.append(
                f"{field}={c[field]!r}: {what} is not implemented by looplm's Nanbeige port; "
                "only checkpoints that leave it off load"
            )
    if all(c.get(f) is not None for f in _NGRAM):
        errs.append(
            f"{' / '.join(_NGRAM)} = {[c[f] for f in _NGRAM]}: n-gram embeddings are not implemented by "
            "looplm's Nanbeige port; only checkpoints that leave them off (any of the three null) load"
        )
    if c.get("hidden_act", "silu") != "silu":
        errs.append(f"hidden_act {c['hidden_act']!r} is not supported (silu: SwiGLU)")
    skip = c.get("skip_loop_final_norm", False)
    if not isinstance(skip, bool):
        errs.append(f"skip_loop_final_norm must be true or false, got {skip!r}")
    known = _PLAIN | set(_FEATURES) | _INERT | set(PretrainedConfig().to_dict())
    for field in sorted(set(c) - known):
        if not _off(c[field]):
            errs.append(
                f"{field}={c[field]!r} is not a field looplm's Nanbeige port knows (it may change the math); "
                "remove it from config.json if it does not"
            )
    theta = _rope_theta(c, errs)
    if errs:
        return {}
    d, L, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd, kvc = c.get("head_dim"), c.get("kv_channels")
    if hd is not None and kvc is not None and int(hd) != int(kvc):
        errs.append(f"head_dim={hd} and kv_channels={kvc} disagree")
    hd = int(hd if hd is not None else kvc if kvc is not None else d // heads)
    if heads % kv:
        errs.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if hd % 2:
        errs.append(f"head_dim={hd} is odd (rotate-half RoPE needs an even head dim)")
    K = int(c.get("num_loops") or 1)  # (absent: 1, as the modelling code's default)
    # fields some ports write (Ouro's names; vLLM-RLT's NanbeigeConfig): harmless when they say the same
    if c.get("total_ut_steps") is not None and c["total_ut_steps"] != K:
        errs.append(f"total_ut_steps={c['total_ut_steps']!r} disagrees with num_loops={K}")
    if c.get("early_exit_threshold") not in (None, 1, 1.0):
        errs.append(f"early_exit_threshold={c['early_exit_threshold']!r}: Nanbeige has no exit gate (1.0: every pass)")
    if errs:
        return {}
    return dict(
        name="nanbeige",
        description=f"Nanbeige (model_type nanbeige): {L} Llama pre-norm layers looped {K} times with shared weights, "
        + ("the final norm once at the end" if skip else "the final norm after every pass"),
        vocab_size=int(c["vocab_size"]),
        d_model=d,
        n_prelude=0,
        n_core=L,
        n_loops=K,
        n_coda=0,
        d_ff=int(c["intermediate_size"]),
        norm_placement="pre",
        attention=dict(
            n_heads=heads, n_kv_heads=kv, head_dim=hd, rope_theta=theta, rope_precision="fp32"
        ),  # its modelling code computes θ^(-2i/hd) in fp32
        rule=dict(name="vanilla", options=dict(inter_norm=not skip)),
        norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),  # PretrainedConfig's default
        max_seq_len=int(c["max_position_embeddings"]),
    )


def misfit(cfg) -> list[str]:
    """What keeps a looplm config from being written as Nanbeige (empty: it fits)."""
    a, ro = cfg.attention, cfg.rule.options
    bad = []
    if cfg.mixer != "attention" or cfg.attn_layer_idx:
        bad.append(f"mixer: attention everywhere (is {cfg.mixer!r}, attn_layer_idx {cfg.attn_layer_idx})")
    if cfg.d_ff <= 0:
        bad.append("d_ff > 0 (a gated MLP in every layer)")
    if cfg.norm_placement != "pre":
        bad.append(f"norm_placement: pre (is {cfg.norm_placement})")
    if cfg.n_prelude or cfg.n_coda:
        bad.append(f"n_prelude = n_coda = 0 (are {cfg.n_prelude}, {cfg.n_coda})")
    if cfg.rule.name != "vanilla" or set(ro) - {"inter_norm"}:
        bad.append(f"rule vanilla, option inter_norm only (is {cfg.rule.name} {ro})")
    if a.qk_norm or a.bias or a.qk_bias or cfg.embed_scale:
        bad.append("no attention.qk_norm / bias / qk_bias / embed_scale")
    if a.rotary_dim is not None and a.rotary_dim != cfg.head_dim:
        bad.append(f"attention.rotary_dim = head_dim (is {a.rotary_dim})")
    if a.sliding_window is not None or a.rope_scaling is not None:
        bad.append("no attention.sliding_window / rope_scaling")
    if a.rope_precision != "fp32":
        bad.append(f"attention.rope_precision: fp32, the release's arithmetic (is {a.rope_precision})")
    if cfg.pause is not None:
        bad.append("no pause tokens")
    return bad


# ------------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------------

# theirs (under model.layers.i.) -> ours (under core.stack.blocks.i.)
_LAYER = {
    "self_attn.q_proj": "mixer.q_proj",
    "self_attn.k_proj": "mixer.k_proj",
    "self_attn.v_proj": "mixer.v_proj",
    "self_attn.o_proj": "mixer.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "mixer_norm",
    "post_attention_layernorm": "mlp_norm",
}


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Nanbeige checkpoint for ``cfg`` (a looplm config) and its shape."""
    d, V, ff = cfg.d_model, cfg.vocab_size, cfg.d_ff
    H, kv, hd = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d)}
    for i in range(cfg.n_core):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (H * hd, d),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.o_proj.weight": (d, H * hd),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    out["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


def derived(cfg) -> tuple[str, ...]:
    """RoPE buffers a checkpoint may carry (persistent in some re-saved copies): not weights, recomputed."""
    return (
        "model.rotary_emb.inv_freq",
        *(f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.n_core)),
    )


def to_looplm_state(cfg, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """looplm's state dict from the checked Nanbeige tensors ``t``: one rename per tensor."""
    sd = {"embed.weight": t["model.embed_tokens.weight"], "norm.weight": t["model.norm.weight"]}
    for i in range(cfg.n_core):
        for theirs, ours in _LAYER.items():
            sd[f"core.stack.blocks.{i}.{ours}.weight"] = t[f"model.layers.{i}.{theirs}.weight"]
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else t["lm_head.weight"]
    return sd


def to_original_state(cfg, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_looplm_state` (a tied head is not written: the release ties it on load)."""
    out = {"model.embed_tokens.weight": sd["embed.weight"]}
    for i in range(cfg.n_core):
        for theirs, ours in _LAYER.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"core.stack.blocks.{i}.{ours}.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def original_config(cfg, tok, dtype: str) -> dict:
    """``config.json`` with the release's field names (Nanbeige4.2-3B's field set, every optional feature off)."""
    a = cfg.attention
    ids = (
        {"pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id} if tok is not None else {}
    )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": FAMILY,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_core,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "kv_channels": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.norm_eps,
        "num_loops": cfg.n_loops,
        "loop_loss_weights": [],
        "skip_loop_final_norm": not cfg.rule.options.get("inter_norm", False),
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        **ids,
        "torch_dtype": dtype,
    }


# ------------------------------------------------------------------------------------------------
# how much the last pass changes each token's prediction (the by-hand exit measurement)
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def last_pass_agreement(model, ids: torch.Tensor, thresholds=(1e-3, 1e-2, 5e-2, 0.1, 0.5), attention_mask=None) -> dict:
    """Per token of ``ids [B, T]``: ``KL(p^{K−1} ‖ p^K)`` between the next-token distributions after the last two
    passes (``p^k = softmax(head(N(H^k)))``; for Nanbeige4.2, pass 1 against pass 2) and whether their argmax agrees.
    Returns the token count, the mean / median / 90th-percentile KL, the top-1 agreement and, for each ``ε`` of
    ``thresholds``, the fraction of tokens with ``KL < ε`` — the tokens a KL exit at ``ε`` *could* let leave after
    pass ``K − 1``. An oracle: deciding it needs pass ``K``'s output (looplm's ``kl`` criterion compares
    successive passes, so at the trained depth it never exits before the last), so it bounds what a learned or
    cheaper criterion could save; it saves nothing itself."""
    K = model.config.n_loops
    if K < 2:
        raise ValueError(f"last_pass_agreement needs a model of >= 2 passes (n_loops is {K})")
    out = model(ids, attention_mask=attention_mask, output_iterations=True)
    a, b = out.iterations[-2], out.iterations[-1]
    lp = [torch.log_softmax(model.lm_head(model.norm(h)).float(), -1) for h in (a, b)]  # [B, T, V]
    kl = (lp[0].exp() * (lp[0] - lp[1])).sum(-1)  # [B, T]
    real = torch.ones_like(kl, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    kl, top1 = kl[real], (lp[0].argmax(-1) == lp[1].argmax(-1))[real]
    q = torch.quantile(kl.double(), torch.tensor([0.5, 0.9], dtype=torch.float64))
    return {
        "tokens": int(kl.numel()),
        "passes": (K - 1, K),
        "kl_mean": float(kl.mean()),
        "kl_median": float(q[0]),
        "kl_p90": float(q[1]),
        "top1_agreement": float(top1.float().mean()),
        "below": {float(e): float((kl < e).float().mean()) for e in thresholds},
    }
