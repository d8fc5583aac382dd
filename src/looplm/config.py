"""Model configuration: typed, validated dataclasses and the presets registry.

A looped model is described by ``(p, s, K, c)`` (recurrence-effectiveness paper, §2):

* ``n_prelude = p`` non-recurrent blocks run once,
* ``n_core = s`` blocks whose parameters are reused at every loop iteration,
* ``n_loops = K`` the training-time loop count of the core,
* ``n_coda = c`` non-recurrent blocks run once after the loop.

Physical depth ``L_phys = p + s + c``; effective depth at ``r`` loops ``L_eff = p + s·r + c``.
The Looped-Mamba paper's ``N⊗R`` is ``(0, N, R, 0)``.

Each component has its own dataclass (``AttentionConfig``, ``Mamba2Config``, ``RuleConfig``) nested
in ``ModelConfig``. ``ModelConfig.from_dict`` reports every bad field in one ``ConfigError``.

This module is a leaf: it imports nothing of looplm but the dataclass helpers. What a section means
elsewhere is checked by the code that owns it, through :func:`register_validator` — the recurrence-rule
registry checks ``rule.name`` and ``rule.options`` (:mod:`looplm.recurrence`) — and reported in the
same one error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .dataclass_util import ConfigError, apply_overrides, from_dict, to_dict

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass
class RopeScaling:
    """Llama-3 RoPE frequency scaling (``rope_type: llama3`` in transformers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self) -> list[str]:
        errs = []
        if self.factor <= 0:
            errs.append(f"factor: must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            errs.append("high_freq_factor: must be > low_freq_factor")
        if self.original_max_position_embeddings < 1:
            errs.append("original_max_position_embeddings: must be >= 1")
        return errs


@dataclass
class AttentionConfig:
    """Causal self-attention: GQA, RoPE (optionally Llama-3 scaled, optionally partial), QK-norm."""

    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (MHA)
    head_dim: int | None = None  # None = d_model // n_heads
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k (per head) before RoPE
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # arithmetic of the inverse frequencies θ^(-2i/d) before rounding to fp32 (looplm.layers.rope.rope_inv_freq):
    # fp64 (looplm's default) or fp32 (the modelling code of Ouro, Huginn and transformers; set by their imports)
    rope_precision: Literal["fp64", "fp32"] = "fp64"
    rotary_dim: int | None = None  # None = head_dim; hybrid Mamba models use 64
    bias: bool = False  # biases on the q, k, v and output projections
    qk_bias: bool = False  # biases on the q and k projections only (Huginn's ``qk_bias``)
    # sliding-window (local) causal attention: a query attends to the last ``sliding_window`` positions
    # (itself included) in the physical layers ``sliding_layer_idx`` (0-based over prelude+core+coda;
    # empty = every attention layer). None = full causal attention everywhere (Ouro's ``layer_types``).
    sliding_window: int | None = None
    sliding_layer_idx: list[int] = field(default_factory=list)

    def validate(self) -> list[str]:
        errs = []
        if self.n_heads < 1:
            errs.append(f"n_heads: must be >= 1, got {self.n_heads}")
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        if kv < 1:
            errs.append(f"n_kv_heads: must be >= 1, got {kv}")
        elif self.n_heads >= 1 and self.n_heads % kv:
            errs.append(f"n_kv_heads: {kv} does not divide n_heads={self.n_heads}")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            errs.append(f"head_dim: must be an even number >= 2, got {self.head_dim}")
        if self.rotary_dim is not None:
            if self.rotary_dim % 2 or self.rotary_dim < 2:
                errs.append(f"rotary_dim: must be an even number >= 2, got {self.rotary_dim}")
            elif self.head_dim is not None and self.rotary_dim > self.head_dim:
                errs.append(f"rotary_dim: {self.rotary_dim} exceeds head_dim={self.head_dim}")
        if not (0 < self.rope_theta < math.inf):  # inf: every frequency but the first would be 0 (no rotation)
            errs.append(f"rope_theta: must be a finite number > 0, got {self.rope_theta}")
        if self.bias and self.qk_bias:
            errs.append("qk_bias: bias already puts biases on q, k, v and the output; set one of the two")
        if self.sliding_window is not None and self.sliding_window < 1:
            errs.append(f"sliding_window: must be >= 1 (or null = full attention), got {self.sliding_window}")
        if self.sliding_layer_idx and self.sliding_window is None:
            errs.append(f"sliding_layer_idx: {self.sliding_layer_idx} given without a sliding_window")
        return errs


@dataclass
class Mamba2Config:
    """Mamba-2 mixer hyper-parameters (defaults = the mamba_ssm ``Mamba2`` reference defaults)."""

    expand: int = 2
    d_state: int = 128
    d_conv: int = 4
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 64  # pure-torch SSD chunk; 64 measured fastest on our CPUs
    conv_bias: bool = True
    bias: bool = False

    def validate(self) -> list[str]:
        errs = []
        for name in ("expand", "d_state", "d_conv", "headdim", "ngroups", "chunk_size"):
            if getattr(self, name) < 1:
                errs.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        return errs


@dataclass
class RuleConfig:
    """Which recurrence rule passes information between loop iterations, and its options.

    ``name`` selects a class registered in ``looplm.recurrence``; ``options`` are passed to it. Both are
    checked by the rule registry (:func:`register_validator`).
    """

    name: str = "vanilla"
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> list[str]:
        return [] if self.name else ["rule.name: must name a recurrence rule (e.g. vanilla)"]


@dataclass
class PauseConfig:
    """Pause tokens (Goyal et al. 2024): ``n_pause`` copies of a learned pause token after every input
    token, the loss on real tokens only (:class:`looplm.pause.PauseLM`). The pause embedding is row
    ``token_id`` of the embedding (default: the last id, ``vocab_size − 1`` — keep it unused by the
    tokenizer, as the padding rows of a padded vocabulary are)."""

    n_pause: int = 3
    token_id: int | None = None

    def validate(self) -> list[str]:
        errs = []
        if self.n_pause < 1:
            errs.append(f"n_pause: must be >= 1, got {self.n_pause}")
        if self.token_id is not None and self.token_id < 0:
            errs.append(f"token_id: must be >= 0 (or null = vocab_size - 1), got {self.token_id}")
        return errs


@dataclass
class ModelConfig:
    """A looped language model ``embed → prelude(p) → core(s) × K → coda(c) → norm → head``."""

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 64
    # (p, s, K, c)
    n_prelude: int = 0
    n_core: int = 2
    n_loops: int = 1
    n_coda: int = 0
    # mixer of each physical block: "attention" or "mamba2"; attn_layer_idx (0-based over the physical
    # stack prelude+core+coda) switches individual blocks to attention (hybrid Mamba-2/attention stacks)
    mixer: Literal["attention", "mamba2"] = "attention"
    attn_layer_idx: list[int] = field(default_factory=list)
    d_ff: int = 0  # SwiGLU hidden width; 0 = no MLP sub-layer (Mamba-2 blocks)
    # where each block's RMSNorms sit (looplm.blocks): "pre" x + f(N(x)) (Llama); "sandwich"
    # x + N'(f(N(x))) (Ouro: four norms per layer); "post-sum" N'(x + f(N(x))) (Huginn's sandwich block)
    norm_placement: Literal["pre", "sandwich", "post-sum"] = "pre"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mamba: Mamba2Config = field(default_factory=Mamba2Config)
    rule: RuleConfig = field(default_factory=RuleConfig)
    pause: PauseConfig | None = None  # pause tokens after every input token (looplm.pause); None = off
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (StateLoop eq. 1)
    max_seq_len: int = 2048
    init_std: float = 0.02
    description: str = ""

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def n_physical(self) -> int:
        """Physical depth ``L_phys = p + s + c``."""
        return self.n_prelude + self.n_core + self.n_coda

    def effective_depth(self, num_loops: int | None = None) -> int:
        """Effective depth ``L_eff = p + s·r + c`` (r defaults to the training loop count K)."""
        r = self.n_loops if num_loops is None else num_loops
        return self.n_prelude + self.n_core * r + self.n_coda

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.attention.n_kv_heads or self.attention.n_heads

    def mixer_of(self, layer: int) -> str:
        """Mixer kind of physical block ``layer`` (0-based over prelude+core+coda)."""
        return "attention" if layer in self.attn_layer_idx else self.mixer

    def sliding_window_of(self, layer: int) -> int | None:
        """The attention window of physical block ``layer`` (``None`` = full causal attention)."""
        a = self.attention
        if a.sliding_window is None or (a.sliding_layer_idx and layer not in a.sliding_layer_idx):
            return None
        return a.sliding_window

    @property
    def uses_attention(self) -> bool:
        """Whether any physical block mixes tokens with attention."""
        return any(self.mixer_of(i) == "attention" for i in range(self.n_physical))

    @property
    def rotary_dim(self) -> int:
        """Channels of each attention head that RoPE rotates (``attention.rotary_dim`` or the head dim)."""
        return self.attention.rotary_dim or self.head_dim

    @property
    def rope_dims(self) -> tuple[int, ...]:
        """Rotary dims the backbone's attention layers need tables for (empty without attention).
        The model adds the dims its recurrence rule declares in ``RecurrenceRule.rope_dims``."""
        return (self.rotary_dim,) if self.uses_attention else ()

    def validate(self) -> list[str]:
        errs: list[str] = []
        if self.vocab_size < 1:
            errs.append(f"vocab_size: must be >= 1, got {self.vocab_size}")
        if self.d_model < 1:
            errs.append(f"d_model: must be >= 1, got {self.d_model}")
        for n in ("n_prelude", "n_coda", "d_ff"):
            if getattr(self, n) < 0:
                errs.append(f"{n}: must be >= 0, got {getattr(self, n)}")
        if self.n_core < 1:
            errs.append(f"n_core: the recurrent core needs at least one block, got {self.n_core}")
        if self.n_loops < 1:
            errs.append(f"n_loops: loops must be >= 1, got {self.n_loops}")
        if self.max_seq_len < 1:
            errs.append(f"max_seq_len: must be >= 1, got {self.max_seq_len}")
        if not (0 < self.norm_eps < math.inf):  # inf: every norm's output would be 0
            errs.append(f"norm_eps: must be a finite number > 0, got {self.norm_eps}")
        bad_idx = [i for i in self.attn_layer_idx if not 0 <= i < self.n_physical]
        if bad_idx:
            errs.append(
                f"attn_layer_idx: {bad_idx} out of range for {self.n_physical} physical layers (0..{self.n_physical - 1})"
            )
        if self.mixer == "attention" or self.attn_layer_idx:  # validated even when the depth is also wrong
            a = self.attention
            if a.head_dim is None and a.n_heads >= 1 and self.d_model % a.n_heads:
                errs.append(
                    f"attention.n_heads: {a.n_heads} does not divide d_model={self.d_model} (or set attention.head_dim)"
                )
            errs += [f"attention.{e}" for e in a.validate()]
            if a.rope_scaling is not None:
                errs += [f"attention.rope_scaling.{e}" for e in a.rope_scaling.validate()]
            if (
                a.rotary_dim is not None
                and a.head_dim is None
                and a.n_heads >= 1
                and a.rotary_dim > self.d_model // a.n_heads
            ):
                errs.append(f"attention.rotary_dim: {a.rotary_dim} exceeds head_dim={self.d_model // a.n_heads}")
            bad_sw = [i for i in a.sliding_layer_idx if not 0 <= i < self.n_physical or self.mixer_of(i) != "attention"]
            if bad_sw:
                errs.append(
                    f"attention.sliding_layer_idx: {bad_sw} are not attention layers of the {self.n_physical} physical layers"
                )
        uses_mamba = self.mixer == "mamba2" and len(set(self.attn_layer_idx)) < self.n_physical
        if uses_mamba:
            m = self.mamba
            errs += [f"mamba.{e}" for e in m.validate()]
            if m.expand >= 1 and m.headdim >= 1 and (m.expand * self.d_model) % m.headdim:
                errs.append(f"mamba.headdim: {m.headdim} does not divide d_inner={m.expand * self.d_model}")
            if (
                m.ngroups >= 1
                and m.expand >= 1
                and m.headdim >= 1
                and ((m.expand * self.d_model) // m.headdim) % m.ngroups
            ):
                errs.append(
                    f"mamba.ngroups: {m.ngroups} does not divide the number of heads {(m.expand * self.d_model) // m.headdim}"
                )
        if self.pause is not None and self.pause.token_id is not None and self.pause.token_id >= self.vocab_size:
            errs.append(f"pause.token_id: {self.pause.token_id} is outside the vocabulary [0, {self.vocab_size})")
        errs += self.rule.validate()
        for check in _VALIDATORS:  # sections owned elsewhere (the rule registry: rule.name, rule.options)
            errs += check(self)
        return errs

    def __post_init__(self):  # direct construction in Python is validated too (from_dict validates itself)
        errs = self.validate()
        if errs:
            raise ConfigError(errs, "model config")

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        return from_dict(cls, data, what="model config")

    def to_dict(self) -> dict:
        return to_dict(self)

    def replace(self, **overrides) -> "ModelConfig":
        """A new validated config with ``overrides`` (dotted keys allowed: ``attention.n_heads=2``)."""
        return ModelConfig.from_dict(apply_overrides(self.to_dict(), overrides))


_VALIDATORS: list[Callable[[ModelConfig], list[str]]] = []


def register_validator(check: Callable[[ModelConfig], list[str]]) -> None:
    """Add ``check(cfg) -> [messages]`` to :meth:`ModelConfig.validate` (for a section whose meaning lives in
    another module: the recurrence rules' registry validates ``rule``). Messages name their field."""
    if check not in _VALIDATORS:
        _VALIDATORS.append(check)


# ------------------------------------------------------------------------------------------------
# presets registry: one YAML per model under looplm/presets/ (shipped with the package)
# ------------------------------------------------------------------------------------------------


def _preset_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PRESET_DIR.rglob("*.yaml"))}


def list_presets() -> list[str]:
    """Names of every shipped preset."""
    return sorted(_preset_files())


def _read_yaml(path: Path) -> dict:
    from .dataclass_util import read_yaml_file

    data = read_yaml_file(path, "model config")  # bad YAML, empty / comment-only, not a mapping
    # presets may carry documentation keys that are not part of the model config
    data = dict(data)
    data.pop("reference", None)
    inherit = data.pop("inherit", None)
    if inherit:
        parent = _preset_files().get(inherit)
        if parent is None:
            raise ConfigError([f"{path}: inherit: unknown preset {inherit!r}"], "model config")
        base = _read_yaml(parent)
        data = _deep_merge(base, data)
    return data


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "options":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def preset_dict(name: str) -> dict:
    """The raw (merged) dict of a preset, with ``name`` filled in."""
    files = _preset_files()
    if name not in files:
        from .dataclass_util import _suggest

        raise ValueError(f"unknown preset {name!r}{_suggest(name, list(files))}. Run `looplm presets` to list them.")
    data = _read_yaml(files[name])
    data["name"] = name
    return data


def load_model_config(
    spec: "str | Path | dict | ModelConfig", overrides: dict | list[str] | None = None
) -> ModelConfig:
    """Resolve a preset name, a YAML path, a dict or a ``ModelConfig`` plus overrides into a config.

    ``overrides`` are ``{"attention.n_heads": 2}`` or ``["attention.n_heads=2", ...]``.
    """
    if isinstance(spec, ModelConfig):
        data = spec.to_dict()
    elif isinstance(spec, dict):
        data = dict(spec)
    else:
        p = Path(spec)
        if p.suffix in (".yaml", ".yml") or p.exists():
            if not p.exists():
                raise FileNotFoundError(f"model config file {str(p)!r} does not exist")
            data = _read_yaml(p)
            data.setdefault("name", p.stem)
            if "model" in data and isinstance(data["model"], dict):  # a training config: take its model
                data = data["model"]
        else:
            data = preset_dict(str(spec))
    if overrides:
        data = apply_overrides(data, overrides)
    return ModelConfig.from_dict(data)


def swiglu_hidden(d: int, multiple_of: int = 64) -> int:
    """LLaMA's SwiGLU width rule: ``8d/3`` rounded up to a multiple (5504 for d=2048, 2752 for d=1024)."""
    return multiple_of * math.ceil(8 * d / 3 / multiple_of)


__all__ = [
    "AttentionConfig",
    "Mamba2Config",
    "ModelConfig",
    "RopeScaling",
    "PauseConfig",
    "RuleConfig",
    "ConfigError",
    "list_presets",
    "register_validator",
    "load_model_config",
    "preset_dict",
    "swiglu_hidden",
]
