"""The public looped models in their own formats: Ouro (ByteDance) and Huginn / Raven (Geiping et al.).

``looplm import hf DIR OUT`` recognises both by ``config.json``'s ``model_type`` and loads them into looplm's
own driver (:func:`load_public`); ``looplm export hf RUN OUT --format original`` writes a looplm model of
either architecture back in its original format (:func:`export_original`), so the original modelling
code and other engines read it. Nanbeige4.2 (``model_type: nanbeige``, Llama layers looped with the final norm
between passes) goes through the same functions; its mapping is :mod:`looplm.hf.nanbeige`.

Ouro (``model_type: ouro``; Ouro-1.4B / 2.6B and their Thinking variants)::

    h_0 = E = W_E[x]                                             (no embedding scale)
    h_k = N(F_θ(h_{k−1}))  k = 1..K                              K = total_ut_steps; F_θ: L sandwich layers
    layer: x += N₂(Attn(N₁(x))); x += N₄(MLP(N₃(x)))             four RMSNorms per layer
    λ_k = σ(w·h_k + b)  (early_exit_gate), exit pdf p_k = λ_k Π_{j<k}(1 − λ_j), p_K = Π_{j<K}(1 − λ_j)
    logits_k = W_out h_k;  output: logits_K, or those of the step exit_at_step / exit_threshold select

looplm: ``norm_placement: sandwich``, ``(p, s, K, c) = (0, L, K, 0)``, rule ``exit_gate`` with ``gate_norm``
and ``inter_norm`` (the final norm ``N`` is the model's: after every step its output feeds the next step
and the gate; the head reads ``N(h)``), ``threshold = early_exit_threshold``, ``objective:
expected_logits`` (the loss of its modelling code: CE of ``Σ_k p_k logits_k``). ``exit_at_step = j`` is
``num_loops = j + 1`` (``--loops``): step ``j``'s logits do not depend on later steps. Sliding-window layers
(``use_sliding_window``, ``layer_types``) map to ``attention.sliding_window`` / ``sliding_layer_idx``.

Huginn / Raven (``model_type: huginn_raven``; huginn-0125)::

    e = γ W_E[x]                  γ = init_values.embed_scale (√n_embd)
    h_0 = prelude(e)              p post-sum ("SandwichBlock") layers:
                                  x = N₂(Attn(N₁(x)) + x); x = N₄(MLP(N₃(x)) + x)
    s_0 ~ γ·TN(0, σ², ±3σ)        σ = init_values.std  (state_init: like-init)
    s_k = core(A [s_{k−1}; h_0])  k = 1..r, A = adapter Linear(2d → d), r = mean_recurrence at inference
    y = N_f(coda(N_f(s_r)))       ln_f used twice; logits = W_out y (tied to W_E)
    attention: fused Wqkv, q/k biases (qk_bias [2, 1, H, hd]), RoPE on interleaved pairs (2i, 2i+1)

looplm: ``norm_placement: post-sum``, rule ``injection`` (``form: dense`` — its ``[W_h W_0]`` *is* the
adapter on ``[state; prelude output]`` —, ``init_state: normal`` with ``init_std = σ``, ``finish_norm``);
``attention.qk_bias``; ``Wqkv`` and ``fc`` split into q/k/v and gate/up; the q/k rows of every head permuted
from interleaved pairs to looplm's half-split RoPE (``i ← 2i``, ``i + hd/2 ← 2i + 1``: scores ``q·k`` are
unchanged because both sides move alike). The random state is drawn per token position from a fixed seed
by default (``init_seed: 0``: deterministic, caches exact); ``init_seed: null`` draws afresh each forward
as Huginn's own code does. Not mapped (refused when set): ``test_time_noise > 0``, an adapter bias,
injection types other than ``linear``, state inits other than ``like-init`` / ``zero``; its adaptive-compute
exit criteria (KL, latent difference) and KV-sharing lookup strategies have no looplm counterpart yet.

Checks before anything is loaded (one error naming every problem): the config's required fields; then
every tensor the architecture needs, against the files' headers — missing, unexpected and mis-shaped tensors
listed together (:mod:`looplm.hf.weights`, shared with the other importers). Weights come from
``model.safetensors`` or exactly the shards ``model.safetensors.index.json`` names (never a pickle); bf16,
fp16 and fp32 tensors load (cast to ``dtype``, fp32 by default).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from . import nanbeige as _nanbeige
from .weights import WEIGHTS_FILE

__all__ = [
    "FAMILIES",
    "PublicFormatError",
    "detect",
    "export_original",
    "family_of",
    "load_public",
    "public_config",
    "read_tensors",
    "to_original_state",
]

FAMILIES = {"ouro": "Ouro", "huginn_raven": "Huginn", "nanbeige": "Nanbeige"}  # nanbeige: looplm.hf.nanbeige


class PublicFormatError(ValueError):
    """A checkpoint directory that is not a complete Ouro / Huginn checkpoint; the message lists every problem."""

    def __init__(self, problems: list[str], where: str, what: str = "cannot load it"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{where}: {what} ({len(self.problems)} problem(s)):\n{lines}")


def detect(hf_config: dict) -> str | None:
    """The family (``ouro`` / ``huginn_raven``) of a ``config.json`` dict, or ``None``."""
    mt = hf_config.get("model_type")
    return mt if mt in FAMILIES else None


# ------------------------------------------------------------------------------------------------
# config.json -> looplm ModelConfig
# ------------------------------------------------------------------------------------------------


def _require(c: dict, fields: list[str | tuple[str, ...]], errs: list[str]) -> None:
    for f in fields:
        names = f if isinstance(f, tuple) else (f,)
        if not any(n in c and c[n] is not None for n in names):
            errs.append(f"missing field {' / '.join(repr(n) for n in names)}")


# sizes that must be >= 1 where present (0 heads would divide by zero, 0 layers / loops build nothing);
# the layer counts of Huginn's prelude and coda may be 0
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "total_ut_steps",
    "sliding_window",
    "n_embd",
    "n_heads",
    "padded_vocab_size",
    "n_layers_in_recurrent_block",
    "mean_recurrence",
    "block_size",
)


def _types(c: dict, ints: tuple[str, ...], numbers: tuple[str, ...], errs: list[str]) -> None:
    """The numeric fields that are present have numeric values (named otherwise); sizes are positive."""
    for f in ints:
        v = c.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            errs.append(f"{f} must be a non-negative integer, got {v!r}")
        elif v is not None and v < 1 and f in _POSITIVE:
            errs.append(f"{f} must be a positive integer, got {v!r}")
    for f in numbers:
        v = c.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            errs.append(f"{f} must be a number, got {v!r}")


def _bools(c: dict, names: tuple[str, ...], errs: list[str]) -> None:
    """The flags that are present are JSON booleans (``bool("false")`` is True: a string would flip them)."""
    for f in names:
        v = c.get(f)
        if v is not None and not isinstance(v, bool):
            errs.append(f"{f} must be true or false, got {v!r}")


def _get(c: dict, *names, default=None):
    return next((c[n] for n in names if c.get(n) is not None), default)


def _ouro_rope(c: dict, errs: list[str]) -> tuple[float, dict | None]:
    from types import SimpleNamespace

    from ..interop import _rope_params

    if "rope_theta" in c and c["rope_theta"] is None and not c.get("rope_parameters"):
        errs.append("rope_theta is null (the RoPE base is needed)")
        return 10000.0, None
    try:
        return _rope_params(
            SimpleNamespace(
                rope_theta=c.get("rope_theta", 10000.0),
                rope_scaling=c.get("rope_scaling"),
                rope_parameters=c.get("rope_parameters"),
            )
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # AttributeError: a string where a mapping goes
        errs.append(f"rope_scaling {c.get('rope_scaling')!r}: {e}")
        return float(c.get("rope_theta", 10000.0)), None


def _ouro_config(c: dict, errs: list[str]) -> dict:
    _require(
        c,
        [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "rms_norm_eps",
            "max_position_embeddings",
            "total_ut_steps",
        ],
        errs,
    )
    _types(
        c,
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "total_ut_steps",
            "sliding_window",
            "max_window_layers",
        ),
        ("rms_norm_eps", "rope_theta"),
        errs,
    )
    _bools(c, ("tie_word_embeddings", "use_sliding_window", "attention_bias"), errs)
    if errs:
        return {}
    if c.get("hidden_act", "silu") != "silu":
        errs.append(f"hidden_act {c['hidden_act']!r} is not supported (Ouro's MLP is SwiGLU: silu)")
    if c.get("attention_bias"):
        errs.append("attention_bias=true is not part of Ouro's architecture (its projections are bias-free)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        errs.append(f"partial_rotary_factor {c['partial_rotary_factor']} is not supported (1.0 only)")
    L, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    types = c.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        errs.append(f"layer_types must be a list of strings (one per layer), got {types!r}")
        types = None
    if types is not None and len(types) != L:
        errs.append(f"layer_types has {len(types)} entries for num_hidden_layers={L}")
    if window is not None:
        if types is not None:
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            sliding = [i for i in range(L) if i >= int(c.get("max_window_layers", 28))]
    else:
        sliding = []
    unknown_types = sorted({t for t in types or [] if t not in ("full_attention", "sliding_attention")})
    if unknown_types:
        errs.append(f"layer_types {unknown_types} are not known (full_attention, sliding_attention)")
    q = c.get("early_exit_threshold", 1.0)
    if q is None:
        q = 1.0
    if not isinstance(q, (int, float)) or not 0.0 <= float(q) <= 1.0:
        errs.append(f"early_exit_threshold must be a number in [0, 1], got {q!r}")
        q = 1.0
    theta, scaling = _ouro_rope(c, errs)
    K = int(c["total_ut_steps"])
    return dict(
        name="ouro",
        description=f"Ouro (model_type ouro): {L} sandwich-norm layers looped {K} times, learned exit gate on the normed state",
        vocab_size=int(c["vocab_size"]),
        d_model=int(c["hidden_size"]),
        n_prelude=0,
        n_core=L,
        n_loops=K,
        n_coda=0,
        d_ff=int(c["intermediate_size"]),
        norm_placement="sandwich",
        attention=dict(
            n_heads=heads,
            n_kv_heads=int(_get(c, "num_key_value_heads", default=heads)),
            head_dim=int(_get(c, "head_dim", default=int(c["hidden_size"]) // heads)),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_precision="fp32",  # its modelling code computes θ^(-2i/d) in fp32
            sliding_window=int(window) if window is not None and sliding else None,
            sliding_layer_idx=sliding if window is not None else [],
        ),
        rule=dict(
            name="exit_gate",
            options=dict(gate_norm=True, inter_norm=True, threshold=float(q), objective="expected_logits", beta=0.0),
        ),
        norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c["max_position_embeddings"]),
    )


def huginn_values(c: dict) -> dict:
    """Huginn's derived values as ``RavenConfig`` computes them (a value in ``config.json`` wins): heads, kv
    heads, head dim, vocabulary rows, init std σ and embedding scale γ."""
    d = int(c["n_embd"])
    heads = int(_get(c, "num_attention_heads", "n_heads"))
    iv = c.get("init_values") or {}
    return dict(
        d=d,
        heads=heads,
        kv=int(_get(c, "num_key_value_heads", default=heads)),
        hd=d // heads,
        vocab=int(_get(c, "padded_vocab_size", "vocab_size")),
        std=float(iv.get("std", math.sqrt(2 / (5 * d)))),
        embed_scale=float(iv.get("embed_scale", math.sqrt(d))),
    )


def _huginn_config(c: dict, errs: list[str]) -> dict:
    _require(
        c,
        [
            "n_embd",
            ("num_attention_heads", "n_heads"),
            "intermediate_size",
            ("padded_vocab_size", "vocab_size"),
            "n_layers_in_prelude",
            "n_layers_in_recurrent_block",
            "n_layers_in_coda",
            "mean_recurrence",
            "norm_eps",
            "rope_base",
            "block_size",
        ],
        errs,
    )
    _types(
        c,
        (
            "n_embd",
            "num_attention_heads",
            "n_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "padded_vocab_size",
            "vocab_size",
            "n_layers",
            "n_layers_in_prelude",
            "n_layers_in_recurrent_block",
            "n_layers_in_coda",
            "mean_recurrence",
            "block_size",
        ),
        ("norm_eps", "rope_base", "test_time_noise"),
        errs,
    )
    _bools(c, ("qk_bias", "bias", "tie_embeddings", "tie_word_embeddings"), errs)
    iv = c.get("init_values")
    if iv is not None and not (
        isinstance(iv, dict) and all(isinstance(iv.get(k, 0.0), (int, float)) for k in ("std", "embed_scale"))
    ):
        errs.append(f"init_values must be a mapping with numeric std / embed_scale, got {iv!r}")
    if errs:
        return {}
    v = huginn_values(c)
    p, s, cd = int(c["n_layers_in_prelude"]), int(c["n_layers_in_recurrent_block"]), int(c["n_layers_in_coda"])
    if c.get("n_layers") is not None and int(c["n_layers"]) != p + s + cd:
        errs.append(f"n_layers={c['n_layers']} is not n_layers_in_prelude + _recurrent_block + _coda = {p + s + cd}")
    if v["d"] % v["heads"]:
        errs.append(f"num_attention_heads={v['heads']} does not divide n_embd={v['d']}")
    if c.get("head_dim") is not None and v["d"] % v["heads"] == 0 and int(c["head_dim"]) != v["hd"]:
        errs.append(
            f"head_dim={c['head_dim']} is not n_embd // num_attention_heads = {v['hd']} (what the modelling code uses)"
        )
    qk_bias = bool(c.get("qk_bias", True))
    if qk_bias and v["kv"] != v["heads"]:
        errs.append(
            f"qk_bias with num_key_value_heads={v['kv']} != num_attention_heads={v['heads']} (its k bias has one row per query head)"
        )
    if c.get("bias"):
        errs.append("bias=true (an adapter bias) is not supported: looplm's dense injection is bias-free")
    if c.get("injection_type", "linear") != "linear":
        errs.append(
            f"injection_type {c['injection_type']!r} is not supported (linear: the adapter on [state; prelude output])"
        )
    state_init = c.get("state_init", "like-init")
    if state_init not in ("like-init", "zero"):
        errs.append(f"state_init {state_init!r} is not supported (like-init, zero)")
    if float(c.get("test_time_noise", 0) or 0) > 0:
        errs.append(
            f"test_time_noise={c['test_time_noise']} (noise injected into every recurrence) is not supported; set it to 0"
        )
    for field, want in (("block_class_name", "SandwichBlock"), ("mlp_class_name", "GatedMLP"), ("nonlin_name", "SiLU")):
        if c.get(field) is not None and c[field] != want:
            errs.append(f"{field} {c[field]!r} is not supported ({want})")
    if c.get("norm_class_name") is not None and "RMSNorm" not in str(c["norm_class_name"]):
        errs.append(f"norm_class_name {c['norm_class_name']!r} is not an RMSNorm")
    gamma = v["embed_scale"]
    if math.isclose(gamma, math.sqrt(v["d"]), rel_tol=1e-12):
        embed_scale = True
    elif gamma == 1.0:
        embed_scale = False
    else:
        errs.append(f"init_values.embed_scale={gamma} is neither 1 nor sqrt(n_embd)={math.sqrt(v['d'])}")
        embed_scale = False
    rule_opts: dict[str, Any] = dict(form="dense", finish_norm=True)
    if state_init == "zero" or v["std"] == 0:
        rule_opts.update(init_state="zeros")
    else:
        rule_opts.update(init_state="normal", init_std=v["std"], init_seed=0)
    K = int(c["mean_recurrence"])
    return dict(
        name="huginn",
        description=f"Huginn / Raven (model_type huginn_raven): prelude {p}, recurrent core {s} x {K}, coda {cd}; "
        "post-sum norms, adapter on [state; prelude output], random initial state",
        vocab_size=v["vocab"],
        d_model=v["d"],
        n_prelude=p,
        n_core=s,
        n_loops=K,
        n_coda=cd,
        d_ff=int(c["intermediate_size"]),
        norm_placement="post-sum",
        embed_scale=embed_scale,
        attention=dict(
            n_heads=v["heads"],
            n_kv_heads=v["kv"],
            head_dim=v["hd"],
            qk_bias=qk_bias,
            rope_theta=float(c["rope_base"]),
            rope_precision="fp32",
        ),
        rule=dict(name="injection", options=rule_opts),
        norm_eps=float(c["norm_eps"]),
        tie_embeddings=bool(_get(c, "tie_embeddings", "tie_word_embeddings", default=True)),
        max_seq_len=int(c["block_size"]),
    )


def public_config(hf_config: dict, where: str = "config.json", **overrides):
    """The looplm :class:`~looplm.config.ModelConfig` of an Ouro / Huginn ``config.json`` dict
    (:class:`PublicFormatError` naming every missing or unsupported field)."""
    from ..config import ModelConfig
    from ..dataclass_util import ConfigError, apply_overrides

    fam = detect(hf_config)
    if fam is None:
        raise PublicFormatError([f"model_type {hf_config.get('model_type')!r} is not one of {sorted(FAMILIES)}"], where)
    errs: list[str] = []
    d = {"ouro": _ouro_config, "huginn_raven": _huginn_config, "nanbeige": _nanbeige.config_dict}[fam](hf_config, errs)
    if errs:
        raise PublicFormatError(errs, where)
    try:
        return ModelConfig.from_dict(apply_overrides(d, overrides) if overrides else d)
    except ConfigError as e:
        raise PublicFormatError([f"the looplm config it maps to is invalid: {e}"], where) from e


def family_of(cfg) -> str:
    """Which original format a looplm config can be written in (``ouro`` / ``huginn_raven``); a
    :class:`PublicFormatError` naming, for each family, every field that does not fit it."""
    a, ro, hd = cfg.attention, cfg.rule.options, cfg.head_dim
    common = []
    if cfg.mixer != "attention" or cfg.attn_layer_idx:
        common.append(f"mixer: attention everywhere (is {cfg.mixer!r}, attn_layer_idx {cfg.attn_layer_idx})")
    if cfg.d_ff <= 0:
        common.append("d_ff > 0 (a gated MLP in every layer)")
    if a.qk_norm or a.bias:
        common.append("no attention.qk_norm / attention.bias")
    if a.rotary_dim is not None and a.rotary_dim != hd:
        common.append(f"attention.rotary_dim = head_dim (is {a.rotary_dim})")
    if cfg.pause is not None:
        common.append("no pause tokens")
    ouro = list(common)
    if cfg.norm_placement != "sandwich":
        ouro.append(f"norm_placement: sandwich (is {cfg.norm_placement})")
    if cfg.n_prelude or cfg.n_coda:
        ouro.append(f"n_prelude = n_coda = 0 (are {cfg.n_prelude}, {cfg.n_coda})")
    if cfg.rule.name != "exit_gate" or not ro.get("gate_norm") or not ro.get("inter_norm"):
        ouro.append(f"rule exit_gate with gate_norm and inter_norm (is {cfg.rule.name} {ro})")
    if a.qk_bias or cfg.embed_scale:
        ouro.append("no attention.qk_bias / embed_scale")
    if not ouro:
        return "ouro"
    huginn = list(common)
    if cfg.norm_placement != "post-sum":
        huginn.append(f"norm_placement: post-sum (is {cfg.norm_placement})")
    if (
        cfg.rule.name != "injection"
        or ro.get("form") != "dense"
        or not ro.get("finish_norm")
        or ro.get("init_state", "prelude") == "prelude"
    ):
        huginn.append(
            f"rule injection with form dense, finish_norm and init_state normal or zeros (is {cfg.rule.name} {ro})"
        )
    if hd * a.n_heads != cfg.d_model:
        huginn.append(f"head_dim = d_model / n_heads (is {hd})")
    if a.sliding_window is not None:
        huginn.append("no attention.sliding_window")
    if a.qk_bias and cfg.n_kv_heads != a.n_heads:
        huginn.append("n_kv_heads = n_heads with qk_bias")
    if not huginn:
        return "huginn_raven"
    nanbeige = _nanbeige.misfit(cfg)
    if not nanbeige:
        return "nanbeige"
    raise PublicFormatError(
        [
            f"as Ouro it needs {'; '.join(ouro)}",
            f"as Huginn it needs {'; '.join(huginn)}",
            f"as Nanbeige it needs {'; '.join(nanbeige)}",
        ],
        f"model {cfg.name!r}",
        "cannot be written in an original format",
    )


# ------------------------------------------------------------------------------------------------
# tensor names and shapes
# ------------------------------------------------------------------------------------------------


def _rope_perm(hd: int) -> torch.Tensor:
    """Interleaved pairs ``(2i, 2i+1)`` -> half-split ``(i, i + hd/2)``: ``ours = theirs[perm]`` per head."""
    return torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])


def _expected_shapes(fam: str, cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the original format for ``cfg`` (a looplm config) and its shape."""
    if fam == "nanbeige":
        return _nanbeige.expected_shapes(cfg)
    d, V, ff = cfg.d_model, cfg.vocab_size, cfg.d_ff
    H, kv, hd = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {}
    if fam == "ouro":
        out["model.embed_tokens.weight"] = (V, d)
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
            }
            for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
                out[p + n + ".weight"] = (d,)
        out |= {"model.norm.weight": (d,), "model.early_exit_gate.weight": (1, d), "model.early_exit_gate.bias": (1,)}
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = (V, d)
        return out
    out["transformer.wte.weight"] = (V, d)
    for prefix, n in (("prelude", cfg.n_prelude), ("core_block", cfg.n_core), ("coda", cfg.n_coda)):
        for i in range(n):
            p = f"transformer.{prefix}.{i}."
            out |= {
                p + "attn.Wqkv.weight": ((H + 2 * kv) * hd, d),
                p + "attn.proj.weight": (d, H * hd),
                p + "mlp.fc.weight": (2 * ff, d),
                p + "mlp.proj.weight": (d, ff),
            }
            if cfg.attention.qk_bias:
                out[p + "attn.qk_bias"] = (2, 1, H, hd)
            for k in range(1, 5):
                out[p + f"norm_{k}.weight"] = (d,)
    out |= {"transformer.adapter.weight": (d, 2 * d), "transformer.ln_f.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


# tensors the original checkpoints may carry that are derived, not weights (checked by name only)
_DERIVED = {"ouro": ("model.rotary_emb.inv_freq",), "huginn_raven": ("freqs_cis",)}


def _huginn_prefix(their_prefix: str) -> str:
    """``transformer.{prelude,core_block,coda}.i.`` -> looplm's ``{prelude.blocks,core.stack.blocks,coda.blocks}.i.``"""
    _, part, i = their_prefix.rstrip(".").split(".")
    return {"prelude": "prelude.blocks.", "core_block": "core.stack.blocks.", "coda": "coda.blocks."}[part] + i + "."


def to_looplm_state(fam: str, cfg, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The looplm state dict from the original tensors ``t`` (already checked against :func:`_expected_shapes`)."""
    if fam == "nanbeige":
        return _nanbeige.to_looplm_state(cfg, t)
    sd: dict[str, torch.Tensor] = {}
    if fam == "ouro":
        sd["embed.weight"] = t["model.embed_tokens.weight"]
        names = {
            "self_attn.q_proj": "mixer.q_proj",
            "self_attn.k_proj": "mixer.k_proj",
            "self_attn.v_proj": "mixer.v_proj",
            "self_attn.o_proj": "mixer.o_proj",
            "mlp.gate_proj": "mlp.gate_proj",
            "mlp.up_proj": "mlp.up_proj",
            "mlp.down_proj": "mlp.down_proj",
            "input_layernorm": "mixer_norm",
            "input_layernorm_2": "mixer_out_norm",
            "post_attention_layernorm": "mlp_norm",
            "post_attention_layernorm_2": "mlp_out_norm",
        }
        for i in range(cfg.n_core):
            for theirs, ours in names.items():
                sd[f"core.stack.blocks.{i}.{ours}.weight"] = t[f"model.layers.{i}.{theirs}.weight"]
        sd |= {
            "norm.weight": t["model.norm.weight"],
            "rule.gate.weight": t["model.early_exit_gate.weight"],
            "rule.gate.bias": t["model.early_exit_gate.bias"],
        }
        sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else t["lm_head.weight"]
        return sd
    d, H, kv, hd, ff = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    perm = _rope_perm(hd)
    sd["embed.weight"] = t["transformer.wte.weight"]
    for part, n in (("prelude", cfg.n_prelude), ("core_block", cfg.n_core), ("coda", cfg.n_coda)):
        for i in range(n):
            src = f"transformer.{part}.{i}."
            dst = _huginn_prefix(src)
            wq, wk, wv = t[src + "attn.Wqkv.weight"].split([H * hd, kv * hd, kv * hd], dim=0)
            sd[dst + "mixer.q_proj.weight"] = wq.view(H, hd, d)[:, perm].reshape(
                H * hd, d
            )  # [H·hd, d], half-split rows
            sd[dst + "mixer.k_proj.weight"] = wk.view(kv, hd, d)[:, perm].reshape(kv * hd, d)
            sd[dst + "mixer.v_proj.weight"] = wv
            if cfg.attention.qk_bias:
                qb, kb = t[src + "attn.qk_bias"].unbind(0)  # each [1, H, hd]
                sd[dst + "mixer.q_proj.bias"] = qb[0][:, perm].reshape(H * hd)
                sd[dst + "mixer.k_proj.bias"] = kb[0][:, perm].reshape(H * hd)
            sd[dst + "mixer.o_proj.weight"] = t[src + "attn.proj.weight"]
            gate, up = t[src + "mlp.fc.weight"].split([ff, ff], dim=0)  # chunk(2): SiLU on the first half
            sd[dst + "mlp.gate_proj.weight"], sd[dst + "mlp.up_proj.weight"] = gate, up
            sd[dst + "mlp.down_proj.weight"] = t[src + "mlp.proj.weight"]
            for k, ours in zip(range(1, 5), ("mixer_norm", "mixer_out_norm", "mlp_norm", "mlp_out_norm")):
                sd[dst + ours + ".weight"] = t[src + f"norm_{k}.weight"]
    sd |= {"rule.inject.proj.weight": t["transformer.adapter.weight"], "norm.weight": t["transformer.ln_f.weight"]}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else t["lm_head.weight"]
    return sd


def to_original_state(fam: str, model) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_looplm_state`: a looplm model's tensors under the original names."""
    cfg = model.config
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    if fam == "nanbeige":
        return {k: v.contiguous() for k, v in _nanbeige.to_original_state(cfg, sd).items()}
    out: dict[str, torch.Tensor] = {}
    if fam == "ouro":
        out["model.embed_tokens.weight"] = sd["embed.weight"]
        names = {
            "mixer.q_proj": "self_attn.q_proj",
            "mixer.k_proj": "self_attn.k_proj",
            "mixer.v_proj": "self_attn.v_proj",
            "mixer.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj",
            "mlp.up_proj": "mlp.up_proj",
            "mlp.down_proj": "mlp.down_proj",
            "mixer_norm": "input_layernorm",
            "mixer_out_norm": "input_layernorm_2",
            "mlp_norm": "post_attention_layernorm",
            "mlp_out_norm": "post_attention_layernorm_2",
        }
        for i in range(cfg.n_core):
            for ours, theirs in names.items():
                out[f"model.layers.{i}.{theirs}.weight"] = sd[f"core.stack.blocks.{i}.{ours}.weight"]
        out |= {
            "model.norm.weight": sd["norm.weight"],
            "model.early_exit_gate.weight": sd["rule.gate.weight"],
            "model.early_exit_gate.bias": sd["rule.gate.bias"],
        }
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
    else:
        d, H, kv, hd = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
        inv = torch.argsort(_rope_perm(hd))  # half-split -> interleaved
        out["transformer.wte.weight"] = sd["embed.weight"]
        for part, n in (("prelude", cfg.n_prelude), ("core_block", cfg.n_core), ("coda", cfg.n_coda)):
            for i in range(n):
                dst = f"transformer.{part}.{i}."
                src = _huginn_prefix(dst)
                wq = sd[src + "mixer.q_proj.weight"].view(H, hd, d)[:, inv].reshape(H * hd, d)
                wk = sd[src + "mixer.k_proj.weight"].view(kv, hd, d)[:, inv].reshape(kv * hd, d)
                out[dst + "attn.Wqkv.weight"] = torch.cat([wq, wk, sd[src + "mixer.v_proj.weight"]], dim=0)
                if cfg.attention.qk_bias:
                    qb = sd[src + "mixer.q_proj.bias"].view(H, hd)[:, inv]
                    kb = sd[src + "mixer.k_proj.bias"].view(H, hd)[:, inv]
                    out[dst + "attn.qk_bias"] = torch.stack([qb, kb])[:, None]  # [2, 1, H, hd]
                out[dst + "attn.proj.weight"] = sd[src + "mixer.o_proj.weight"]
                out[dst + "mlp.fc.weight"] = torch.cat(
                    [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]]
                )
                out[dst + "mlp.proj.weight"] = sd[src + "mlp.down_proj.weight"]
                for k, ours in zip(range(1, 5), ("mixer_norm", "mixer_out_norm", "mlp_norm", "mlp_out_norm")):
                    out[dst + f"norm_{k}.weight"] = sd[src + ours + ".weight"]
        out |= {
            "transformer.adapter.weight": sd["rule.inject.proj.weight"],
            "transformer.ln_f.weight": sd["norm.weight"],
        }
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
        out["freqs_cis"] = _freqs_cis(hd, cfg.max_seq_len, cfg.attention.rope_theta)
    return {k: v.contiguous() for k, v in out.items()}


def _freqs_cis(hd: int, n: int, theta: float) -> torch.Tensor:
    """Huginn's persistent RoPE buffer ``[1, n, 1, hd/2, 2]`` (cos, sin of ``t · θ^(−2i/hd)``)."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.outer(torch.arange(n, dtype=torch.float32), inv)  # [n, hd/2]
    return torch.stack([f.cos(), f.sin()], dim=-1)[None, :, None]


# ------------------------------------------------------------------------------------------------
# reading: the files, then every tensor checked before any is loaded
# ------------------------------------------------------------------------------------------------


def read_tensors(
    src: Path,
    expected: dict[str, tuple[int, ...]],
    derived=(),
    tied_head: str | None = None,
    tie_to: str | None = None,
    dtype=torch.float32,
    what: str = "the model",
) -> dict[str, torch.Tensor]:
    """Every tensor of ``expected`` from ``src``'s safetensors (exactly the files the format names,
    :func:`looplm.hf.weights.weight_files`), cast to ``dtype`` — after checking the names and shapes of all of
    them from the headers: every missing, unexpected and mis-shaped tensor in one error. ``derived`` names may be
    present (ignored); ``tied_head`` may be present when the head is tied to ``tie_to`` (then it must equal it)."""
    from safetensors import safe_open

    from .weights import read_shapes, refuse_mismatch, weight_files

    files = weight_files(src)
    shapes = read_shapes(files)
    optional = set(derived) | ({tied_head} if tied_head else set())
    mismatched = [(n, shapes[n], s) for n, s in expected.items() if n in shapes and shapes[n] != s]
    if tied_head and tied_head in shapes and shapes[tied_head] != expected[tie_to]:
        mismatched.append((tied_head, shapes[tied_head], expected[tie_to]))
    refuse_mismatch(
        src,
        [n for n in expected if n not in shapes],
        [n for n in shapes if n not in expected and n not in optional],
        mismatched,
        what=what,
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():
                if n in expected or n == tied_head:
                    t = fh.get_tensor(n)
                    if not t.is_floating_point():
                        raise PublicFormatError([f"{n}: dtype {t.dtype} is not a floating-point weight"], str(src))
                    out[n] = t.to(dtype)
    if tied_head and tied_head in out:
        head = out.pop(tied_head)
        if not torch.equal(head, out[tie_to]):
            raise PublicFormatError(
                [f"the config ties the head to {tie_to!r}, but {tied_head!r} holds other values"], str(src)
            )
    return out


def _tokenizer(src: Path):
    """The checkpoint's own tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, chat template included)."""
    from ..data.tokenizers import HFTokenizer

    from .tokenizer import check_tokenizer_dir

    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer.json").is_symlink():
        raise PublicFormatError(["no tokenizer.json (the tokenizer is copied with the weights)"], str(src))
    check_tokenizer_dir(src)  # JSON files, no auto_map naming code, a tokenizer.json the library reads
    # by the generic fast class: AutoTokenizer would read config.json, whose model_type transformers does not know
    from transformers import PreTrainedTokenizerFast

    from ..data.tokenizers import EOS_CANDIDATES

    try:
        backend = PreTrainedTokenizerFast.from_pretrained(str(src), trust_remote_code=False)
    except Exception as e:  # transformers' TypeError / ValueError about a field, naming no file
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise PublicFormatError(
            [
                f"the tokenizer could not be loaded ({type(e).__name__}: {first}): tokenizer_config.json "
                "or special_tokens_map.json holds a value of the wrong kind"
            ],
            str(src),
        ) from e
    guess = None if backend.eos_token else next((t for t in EOS_CANDIDATES if t in backend.get_vocab()), None)
    return HFTokenizer(backend, str(src), kind="transformers", eos_token=guess)


def read_config(src: Path) -> dict:
    p = src / "config.json"
    if not p.is_file():
        raise PublicFormatError(["no config.json"], str(src))
    try:
        c = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PublicFormatError([f"config.json is not valid JSON ({e})"], str(src)) from e
    except RecursionError as e:  # json's parser recurses per nesting level
        raise PublicFormatError(
            [
                "config.json nests its arrays / objects too deeply to be read (a corrupted or "
                "hostile file; no real config nests more than a few levels)"
            ],
            str(src),
        ) from e
    if not isinstance(c, dict):
        raise PublicFormatError(["config.json is not a JSON object"], str(src))
    return c


def load_public(
    src: str | Path, *, dtype=torch.float32, allow_deep: bool = False, allow_large: bool = False, **overrides
):
    """``(model, tokenizer, origin)`` of an Ouro / Huginn checkpoint directory: the config mapped
    (:func:`public_config`) and checked (:func:`looplm.hf.weights.preflight`: the loop count, the memory),
    every tensor checked, then loaded into a looplm model (in ``dtype``).
    ``overrides`` change the config first (``n_loops=8``; shapes must stay the same)."""
    from ..factory import build
    from .weights import preflight

    src = Path(src)
    hf = read_config(src)
    fam = detect(hf)
    cfg = public_config(hf, str(src / "config.json"), **overrides)
    loops_field = (
        "n_loops (--set)"
        if "n_loops" in overrides
        else {"ouro": "total_ut_steps", "huginn_raven": "mean_recurrence"}.get(fam, "the loop count")
    )
    preflight(
        cfg,
        dtype,
        where=str(src / "config.json"),
        loops_field=loops_field,
        allow_deep=allow_deep,
        allow_large=allow_large,
    )
    expected = _expected_shapes(fam, cfg)
    tie_to = "transformer.wte.weight" if fam == "huginn_raven" else "model.embed_tokens.weight"
    derived = _nanbeige.derived(cfg) if fam == "nanbeige" else _DERIVED[fam]
    tensors = read_tensors(
        src,
        expected,
        derived,
        tied_head="lm_head.weight" if cfg.tie_embeddings else None,
        tie_to=tie_to,
        dtype=dtype,
        what=f"its {FAMILIES[fam]} config",
    )
    if fam == "huginn_raven":
        _check_stored_rope(src, cfg)
    tok = _tokenizer(src)
    # built without memory, then every tensor assigned (no random init of billions of weights to overwrite)
    model = build(cfg, device="meta")
    sd = to_looplm_state(fam, cfg, tensors)
    ours = model.state_dict()
    if set(sd) != set(ours) or any(sd[k].shape != ours[k].shape for k in ours):
        raise RuntimeError(f"internal mapping error for {fam}: {sorted(set(sd) ^ set(ours))}")
    model.load_state_dict(sd, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for rot in model.rotary.values():  # RoPE tables are not weights: computed again off the meta device
        rot.inv_freq = torch.empty(0)
        rot.reset_buffers()
    origin = {
        "imported_from": str(src.resolve()),
        "imported_kind": fam,
        "original_config": {k: v for k, v in hf.items() if k not in ("auto_map",)},
    }
    return model.eval(), tok, origin


def _check_stored_rope(src: Path, cfg) -> None:
    """Warn when Huginn's stored RoPE table ``freqs_cis`` is not the fp32 table looplm computes: the original
    code rotates with the stored one (bf16 in some releases), looplm recomputes it in fp32, so logits differ
    (by ~4e-2 for a bf16 table). The warning says the measured largest difference of the two tables."""
    import warnings

    from safetensors import safe_open

    from .weights import weight_files

    for f in weight_files(src):
        with safe_open(str(f), framework="pt") as fh:
            if "freqs_cis" not in fh.keys():
                continue
            stored = fh.get_tensor("freqs_cis")
        if (
            stored.dim() != 5
            or stored.shape[-1] != 2
            or stored.shape[-2] != cfg.head_dim // 2
            or not stored.is_floating_point()
        ):
            raise PublicFormatError(
                [
                    f"freqs_cis has shape {list(stored.shape)} and dtype {stored.dtype}; Huginn's RoPE "
                    f"table is [1, T, 1, {cfg.head_dim // 2}, 2] floats"
                ],
                str(src),
            )
        n = stored.shape[1]
        ours = _freqs_cis(cfg.head_dim, n, cfg.attention.rope_theta)
        diff = (stored.float() - ours).abs().max().item() if n else 0.0
        if not diff <= 1e-6:  # NaN in the table counts as a difference too
            warnings.warn(
                f"{str(f)!r}: its RoPE table freqs_cis ({str(stored.dtype).removeprefix('torch.')}, {n} positions) "
                f"differs from the fp32 table looplm computes by up to {diff:.3g}; Huginn's own code rotates with "
                "the stored table, looplm with the computed one, so their logits differ accordingly",
                stacklevel=3,
            )
        return


# ------------------------------------------------------------------------------------------------
# writing the original format
# ------------------------------------------------------------------------------------------------


def _original_config(fam: str, cfg, tok, dtype: str) -> dict:
    a = cfg.attention
    if fam == "nanbeige":
        return _nanbeige.original_config(cfg, tok, dtype)
    ids = (
        {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id} if tok is not None else {}
    )
    if fam == "ouro":
        sliding = (
            set(cfg.attention.sliding_layer_idx)
            if a.sliding_window is not None and a.sliding_layer_idx
            else (set(range(cfg.n_core)) if a.sliding_window is not None else set())
        )
        rope_scaling = None
        if a.rope_scaling is not None:
            rope_scaling = {"rope_type": "llama3", **a.rope_scaling.__dict__}
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_core,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": cfg.tie_embeddings,
            "total_ut_steps": cfg.n_loops,
            "early_exit_threshold": float(cfg.rule.options.get("threshold", 1.0)),
            "use_sliding_window": a.sliding_window is not None,
            "sliding_window": a.sliding_window,
            "max_window_layers": cfg.n_core,
            "layer_types": ["sliding_attention" if i in sliding else "full_attention" for i in range(cfg.n_core)],
            "attention_dropout": 0.0,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "torch_dtype": dtype,
            **ids,
        }
    ro = cfg.rule.options
    std = float(ro.get("init_std", 0.02)) if ro.get("init_state") == "normal" else 0.0
    d = cfg.d_model
    return {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "n_embd": d,
        "n_heads": a.n_heads,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.vocab_size,
        "n_layers": cfg.n_physical,
        "n_layers_in_prelude": cfg.n_prelude,
        "n_layers_in_recurrent_block": cfg.n_core,
        "n_layers_in_coda": cfg.n_coda,
        "mean_recurrence": cfg.n_loops,
        "injection_type": "linear",
        "state_init": "like-init" if std > 0 else "zero",
        "norm_eps": cfg.norm_eps,
        "qk_bias": a.qk_bias,
        "bias": False,
        "tie_embeddings": cfg.tie_embeddings,
        "rope_base": a.rope_theta,  # (RavenConfig derives tie_word_embeddings)
        "block_size": cfg.max_seq_len,
        "block_class_name": "SandwichBlock",
        "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "test_time_noise": 0,
        "init_values": {"std": std, "embedding": std, "embed_scale": math.sqrt(d) if cfg.embed_scale else 1.0},
        "torch_dtype": dtype,
        **ids,
    }


_AUTO_MAP = {
    "ouro": {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "huginn_raven": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "nanbeige": _nanbeige.AUTO_MAP,
}


def export_original(
    source,
    out: str | Path,
    *,
    tokenizer=None,
    dtype: str | torch.dtype | None = None,
    reference_code: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a looplm model of the Ouro or Huginn architecture (an import, or one trained from the
    ``ouro-*`` / ``huginn-0125`` presets) in its original format: ``config.json`` with the original field
    names, ``model.safetensors`` with the original tensor names (Huginn: q/k rows back to interleaved RoPE
    pairs, ``Wqkv`` / ``fc`` fused, ``freqs_cis``), the tokenizer. ``reference_code``: a directory holding the
    original modelling files (``modeling_ouro.py`` ... / ``raven_*_minimal.py``), copied next to the weights
    with an ``auto_map`` so ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads it."""
    from safetensors.torch import save_file

    from ..data.tokenizers import load_tokenizer

    if dtype is not None:  # checked before anything is read (getattr(torch, "int8") would truncate every weight)
        named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        if not (isinstance(named, torch.dtype) and named.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch dtype such as 'bfloat16', got {dtype!r}")
        dtype = named
    if isinstance(source, (str, Path)):
        from ..checkpoint_io import load_model_for_inference

        model, tok = load_model_for_inference(source, tokenizer=tokenizer)
    else:
        model = source
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    fam = family_of(model.config)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) or another directory"
        )
    if reference_code is not None:  # checked before anything is written
        ref = Path(reference_code)
        absent = [
            m.split(".")[0] + ".py" for m in _AUTO_MAP[fam].values() if not (ref / (m.split(".")[0] + ".py")).is_file()
        ]
        if absent:
            raise FileNotFoundError(f"reference code directory {str(ref)!r} lacks {absent}")
    out.mkdir(parents=True, exist_ok=True)
    sd = to_original_state(fam, model)
    dt = (getattr(torch, dtype) if isinstance(dtype, str) else dtype) or next(iter(sd.values())).dtype
    sd = {k: (v if k == "freqs_cis" else v.to(dt)) for k, v in sd.items()}
    save_file(sd, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    hf = _original_config(fam, model.config, tok, str(dt).removeprefix("torch."))
    if reference_code is not None:
        for f in sorted(Path(reference_code).glob("*.py")):
            shutil.copyfile(f, out / f.name)
        hf["auto_map"] = _AUTO_MAP[fam]
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tok is not None:
        if getattr(tok, "name", None) == "byte" or getattr(tok, "_kind", None) != "transformers":
            from .tokenizer import save_pretrained_tokenizer

            save_pretrained_tokenizer(tok, out)
        else:
            tok._tok.save_pretrained(str(out))
            from .tokenizer import make_portable

            make_portable(out)  # a tokenizer_class transformers 4.x has too (5.x records TokenizersBackend)
    return out
