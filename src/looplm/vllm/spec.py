"""The plugin's pure parts: what a model directory's ``config.json`` becomes inside vLLM, without vLLM.

Everything here is plain looplm and the standard library, so the main test suite checks it where vLLM is
not installed (``tests/test_vllm_plugin.py``); :mod:`looplm.vllm.model` builds the vLLM modules from it.

* :func:`plugin_spec` — a ``config.json`` (looplm's Hugging Face export, or an Ouro / Huginn directory in its
  original format) -> :class:`PluginSpec`: the looplm :class:`~looplm.config.ModelConfig`, the loop count
  ``r`` served, the recurrence rule's inference options, and the attention slots vLLM pages a KV cache
  for, in the order they run;
* :func:`refusal` — why a design cannot be served (``None`` when it can); :func:`plugin_spec` raises it as
  :class:`UnsupportedDesign` before any weight is read;
* :func:`vllm_param_name` — a looplm parameter name -> the plugin's parameter and its fused shard.

Attention slots (the KV caches vLLM allocates, one per vLLM ``Attention`` layer)::

    per-loop (default)  prelude l (p) | core (k, l) for k < r, l < s [, rule k] | coda l (c)   p + r·(s + m) + c slots
    shared              prelude l (p) | core l [, rule], every loop writes and reads them | coda l     p + s + m + c slots

``rule`` is the recurrence rule's own attention (StateLoop's ``attention`` state mixer ``X_attn``, StateLoop
eq. 8; ``m = 1`` with it, else 0): one module shared across iterations with one slot per iteration, written
after the core layers of that iteration, as looplm's :meth:`~looplm.context.LoopContext.loop_slot` keeps it.

``shared`` is looplm's ``kv_shared`` cache (:class:`looplm.cache.SharedKV`): each loop overwrites the
token's entry, so an earlier token is seen at the last loop it ran. Choose it with the config field
``looplm_kv_policy`` (``vllm serve DIR --hf-overrides '{"looplm_kv_policy": "shared"}'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ModelConfig
from .mamba_spec import MAMBA_ARCHITECTURES, mamba_refusal, served_architecture

__all__ = [
    "ARCHITECTURES",
    "KV_POLICIES",
    "AttentionSlot",
    "PluginSpec",
    "UnsupportedDesign",
    "design_name",
    "exit_spec",
    "plugin_spec",
    "refusal",
    "rule_attention",
    "tp_refusal",
    "vllm_param_name",
]

# architecture name in config.json -> the plugin's module:class (vLLM's lazy registration form)
ARCHITECTURES = {
    "LoopLMForCausalLM": "looplm.vllm.model:LoopLMForCausalLM",
    "OuroForCausalLM": "looplm.vllm.model:OuroForCausalLM",
    "RavenForCausalLM": "looplm.vllm.model:RavenForCausalLM",
}
KV_POLICIES = ("per-loop", "shared")
EXPORT_PREFIX = "looplm."  # looplm.hf.export.PREFIX (not imported: that module imports torch only, but keep this leaf)

# fused vLLM projections: looplm's separate Linear -> (vLLM parameter, shard id)
_FUSED = {
    ".mixer.q_proj.": (".mixer.qkv_proj.", "q"),
    ".mixer.k_proj.": (".mixer.qkv_proj.", "k"),
    ".mixer.v_proj.": (".mixer.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
_BLOCK_PARTS = ("prelude.blocks.", "core.stack.blocks.", "coda.blocks.")


class UnsupportedDesign(ValueError):
    """A design the plugin cannot serve exactly; raised when the model loads, naming design and reason."""

    def __init__(self, design: str, reason: str, where: str = "config.json"):
        self.design, self.reason = design, reason
        super().__init__(
            f"{where}: looplm's vLLM plugin cannot serve {design}: {reason}. It is refused rather than served "
            "differently from looplm; serve it with `looplm serve` instead (docs/vllm.md lists what vLLM runs)"
        )


@dataclass(frozen=True)
class AttentionSlot:
    """One vLLM ``Attention`` layer (one paged KV cache): ``index`` is its place in the run order (the one
    integer in its vLLM layer name), ``part`` ``prelude`` / ``core`` / ``coda`` / ``rule`` (the rule's own
    attention mixer), ``layer`` the physical block (0-based over ``p + s + c``; ``None`` for ``rule``), ``loop``
    the core iteration ``k`` (``None`` outside the core, and for every core and rule slot under the ``shared``
    policy)."""

    index: int
    part: str
    layer: int | None
    loop: int | None


@dataclass(frozen=True)
class PluginSpec:
    """What the vLLM model is built from (see the module docstring)."""

    config: ModelConfig
    num_loops: int  # r, every request runs r loops
    kv_policy: str  # "per-loop" | "shared"
    loop_options: dict[str, Any] = field(default_factory=dict)  # the rule's inference options (exit_threshold)
    architecture: str = "LoopLMForCausalLM"
    exit: dict | None = (
        None  # per-token exit (config field looplm_exit; exit_spec): criterion, threshold, kv, min_loops
    )

    @property
    def rule_attention(self) -> tuple[int, int] | None:
        """``(heads, head_dim)`` of the rule's own attention mixer (StateLoop's ``X_attn``, eq. 8: ``d_s /
        mixer_head_dim`` heads, as many KV heads), ``None`` when the rule has none."""
        return rule_attention(self.config)

    @property
    def slots(self) -> tuple[AttentionSlot, ...]:
        """Every attention slot, in the order the forward runs them."""
        c, out = self.config, []
        for i in range(c.n_prelude):
            out.append(AttentionSlot(len(out), "prelude", i, None))
        loops = range(self.num_loops) if self.kv_policy == "per-loop" else [None]
        for k in loops:
            for i in range(c.n_core):
                out.append(AttentionSlot(len(out), "core", c.n_prelude + i, k))
            if self.rule_attention is not None:  # the rule's step runs after the core layers of loop k
                out.append(AttentionSlot(len(out), "rule", None, k))
        for i in range(c.n_coda):
            out.append(AttentionSlot(len(out), "coda", c.n_prelude + c.n_core + i, None))
        return tuple(out)

    def slot_index(self, part: str, layer: int | None, loop: int | None = None) -> int:
        """The slot a block of ``part`` at physical ``layer`` (``part='rule'``: the rule's own attention,
        ``layer`` ignored) attends with at core iteration ``loop``."""
        c = self.config
        if part == "prelude":
            return layer
        per = c.n_core + (self.rule_attention is not None)  # slots of one loop
        k = 0 if self.kv_policy == "shared" else loop
        if part == "core":
            return c.n_prelude + k * per + layer - c.n_prelude
        if part == "rule":
            if self.rule_attention is None:
                raise ValueError(f"{design_name(c)} has no rule attention slot")
            return c.n_prelude + k * per + c.n_core
        n_core_slots = per * (1 if self.kv_policy == "shared" else self.num_loops)
        return c.n_prelude + n_core_slots + (layer - c.n_prelude - c.n_core)


def rule_attention(cfg: ModelConfig) -> tuple[int, int] | None:
    """``(heads, head_dim)`` of ``cfg``'s rule's own attention mixer (StateLoop ``mixer: attention``, eq. 8),
    or ``None``. Read from the options as :class:`looplm.recurrence.stateloop.StateLoop` reads them: ``d_s``
    (0 = ``d``) and ``mixer_head_dim`` (default 64)."""
    o = cfg.rule.options
    if cfg.rule.name != "stateloop" or o.get("mixer", "identity") != "attention":
        return None
    ds = o.get("d_s", 0) or cfg.d_model
    hd = o.get("mixer_head_dim", 64)
    return ds // hd, hd


def design_name(cfg: ModelConfig) -> str:
    """``rule 'vanilla' (p, s, K, c) = (0, 2, 3, 0)`` with the rule's options and mixers, for messages."""
    opts = ", ".join(f"{k}={v!r}" for k, v in sorted(cfg.rule.options.items()))
    rule = f"rule {cfg.rule.name!r}" + (f" ({opts})" if opts else "")
    mixers = sorted({cfg.mixer_of(i) for i in range(cfg.n_physical)})
    return (
        f"{cfg.name!r}: {rule}, (p, s, K, c) = ({cfg.n_prelude}, {cfg.n_core}, {cfg.n_loops}, {cfg.n_coda}), "
        f"mixers {'/'.join(mixers)}"
    )


def refusal(cfg: ModelConfig, num_loops: int | None = None, tp: int = 1) -> str | None:
    """Why the plugin cannot serve ``cfg`` exactly on ``tp`` tensor-parallel ranks, or ``None``.

    Served: attention blocks at any ``(p, s, K, c)``, every norm placement, GQA, QK-norm, biases, partial
    RoPE and Llama-3 scaling, and the rules that act on each token's own state (their arithmetic is looplm's
    rule module itself): ``vanilla``, ``injection`` (seeded states), ``history``, ``timestep``, ``stateloop`` with
    the identity or the attention state mixer (its attention on slots of its own), ``stateloop-state-only``,
    ``hyperloop``, ``mesh``, ``parcae``, ``ponderlm`` without
    a coda, ``exit_gate`` (every loop runs; the gate selects each token's output). Mamba-2 blocks, alone or with
    attention blocks, through vLLM's Mamba-2 layer with one state per (loop, layer) (what of them is refused:
    :func:`looplm.vllm.mamba_spec.mamba_refusal`).

    Tensor parallelism (``tp > 1``, :func:`tp_refusal`): vLLM's parallel layers shard the heads, the MLP
    and the vocabulary, and every ``RowParallelLinear`` all-reduces, so each rank holds the full hidden state
    ``[N, d]``; the rule modules act on it and stay replicated (each rank loads their full weights)."""
    why = mamba_refusal(cfg, tp=tp)  # Mamba-2 blocks: vLLM's Mamba-2 layer, one state per (loop, layer)
    if why is not None:
        return why
    if cfg.pause is not None:
        return (
            "pause tokens: looplm inserts pauses after every input token inside the model, which changes the "
            "sequence vLLM schedules and caches"
        )
    if cfg.attention.sliding_window is not None:
        return (
            "sliding-window attention layers: vLLM's window is not yet checked against looplm's band "
            f"(window {cfg.attention.sliding_window})"
        )
    name, o = cfg.rule.name, cfg.rule.options
    if name in ("stateloop", "stateloop-state-only") and o.get("mixer", "identity") not in ("identity", "attention"):
        return (
            f"StateLoop's {o['mixer']!r} state mixer mixes tokens with a Mamba-2 layer of its own, shared across "
            "loops with one SSM state per iteration; the plugin has no vLLM layers for it yet (the identity and "
            "attention mixers are served)"
        )
    if name == "injection" and o.get("init_state") == "normal" and o.get("init_seed", 0) is None:
        return (
            "the initial state is drawn afresh each forward (init_seed null): a request would get different "
            "random states at prefill and at every decoding step; seed it (init_seed: 0) to serve it"
        )
    if name == "ponderlm" and cfg.n_coda > 0:
        return (
            "PonderLM reads out every iteration through the coda, whose attention would need a KV cache per "
            f"(iteration, coda layer); served without a coda only (this model has c = {cfg.n_coda})"
        )
    known = {
        "vanilla",
        "injection",
        "history",
        "timestep",
        "stateloop",
        "stateloop-state-only",
        "hyperloop",
        "mesh",
        "parcae",
        "ponderlm",
        "exit_gate",
    }
    if name not in known:
        return (
            f"the recurrence rule {name!r} is not known to the plugin; a rule is served only once it is checked "
            "to act on each token's own state (no token mixing of its own)"
        )
    return tp_refusal(cfg, tp)


def tp_refusal(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``cfg`` cannot be split over ``tp`` tensor-parallel ranks, or ``None``.

    vLLM's ``QKVParallelLinear`` gives each rank ``n_heads / tp`` query heads and ``n_kv_heads / tp`` KV heads
    (or one KV head replicated on ``tp / n_kv_heads`` ranks when ``tp`` is a multiple of ``n_kv_heads``), and
    ``MergedColumnParallelLinear`` ``d_ff / tp`` MLP channels: anything else does not split. PonderLM's
    feedback ``softmax(logits) · W_E`` needs the whole vocabulary on each rank, which vLLM shards."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel size must be a positive int, got {tp!r}")
    if tp == 1:
        return None
    a, kv = cfg.attention, cfg.n_kv_heads
    fix = f"serve it with --tensor-parallel-size 1, or a size that divides it (tensor-parallel size {tp})"
    if cfg.uses_attention and a.n_heads % tp:  # (a Mamba-2-only model has no attention heads to split)
        return f"its {a.n_heads} query heads do not split over {tp} tensor-parallel ranks; {fix}"
    if cfg.uses_attention and kv % tp and tp % kv:
        return (
            f"its {kv} KV heads neither split over {tp} tensor-parallel ranks nor replicate evenly on them "
            f"(vLLM needs n_kv_heads % tp == 0 or tp % n_kv_heads == 0); {fix}"
        )
    if cfg.d_ff > 0 and cfg.d_ff % tp:
        return f"its MLP width d_ff = {cfg.d_ff} does not split over {tp} tensor-parallel ranks; {fix}"
    if cfg.rule.name == "ponderlm":
        return (
            "PonderLM feeds back softmax(logits) · W_E, which needs the whole vocabulary on each rank, and "
            f"vLLM shards the embedding and the head over the {tp} tensor-parallel ranks; serve it with "
            "--tensor-parallel-size 1"
        )
    return None


EXIT_CRITERIA = ("gate", "kl", "convergence")
EXIT_KV = ("copy", "propagate")


def exit_spec(
    raw: Any, cfg: ModelConfig, num_loops: int, *, tp: int = 1, kv_policy: str = "per-loop", where: str = "config.json"
) -> dict | None:
    """The per-token exit of the config field ``looplm_exit`` (``None``: every token runs every loop), as
    ``{"criterion", "threshold", "kv", "min_loops"}`` — looplm's :class:`~looplm.decode.exits.Exit` with the token
    schedule and ``prefill='full'``: decode tokens stop at the criterion, prompt tokens run every loop.

    ``criterion``: ``gate`` (the exit gate's ``q`` in (0, 1]), ``kl`` or ``convergence`` (``ε >= 0``);
    ``kv``: ``copy`` (each skipped loop's KV slot holds the exit loop's key and value) or ``propagate`` (the key
    and value of the stand-in ``Z^{r+1}`` through each core layer's norm and K/V projections; rules without
    per-loop block modulation); ``min_loops`` >= 1.
    Raises ``ValueError`` for a malformed setting, :class:`UnsupportedDesign` for a model it cannot apply to."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where}: looplm_exit must be a dict such as {{'criterion': 'kl', 'threshold': 0.01}}, got {raw!r}"
        )
    unknown = sorted(set(raw) - {"criterion", "threshold", "kv", "min_loops"})
    if unknown:
        raise ValueError(
            f"{where}: looplm_exit has unknown keys {unknown}; it takes criterion, threshold, kv, min_loops"
        )
    crit = raw.get("criterion")
    if crit not in EXIT_CRITERIA:
        raise ValueError(f"{where}: looplm_exit criterion must be one of {list(EXIT_CRITERIA)}, got {crit!r}")
    t = raw.get("threshold")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 or (crit == "gate" and not 0 < t <= 1):
        want = "q in (0, 1]" if crit == "gate" else "ε >= 0"
        raise ValueError(f"{where}: looplm_exit threshold for {crit!r} must be a number, {want}; got {t!r}")
    kv = raw.get("kv", "copy")
    if kv not in EXIT_KV:
        raise ValueError(
            f"{where}: looplm_exit kv must be one of {list(EXIT_KV)} (looplm's 'shared' and 'full' are not exits "
            f"the plugin runs), got {kv!r}"
        )
    m = raw.get("min_loops", 1)
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= num_loops:
        raise ValueError(f"{where}: looplm_exit min_loops must be an int in [1, {num_loops}], got {m!r}")
    why = None
    if crit == "gate" and cfg.rule.name != "exit_gate":
        why = (
            f"the 'gate' exit criterion reads the exit gate of rule 'exit_gate'; this model's rule is {cfg.rule.name!r}"
        )
    elif crit == "kl" and cfg.n_coda:
        why = (
            f"the 'kl' exit criterion reads out every loop through the coda ({cfg.n_coda} layers), whose attention "
            "would need a KV write per loop; use 'convergence' here"
        )
    elif crit == "kl" and tp > 1:
        why = (
            f"the 'kl' exit criterion reads out the whole vocabulary, which is sharded over {tp} tensor-parallel ranks"
        )
    elif kv_policy != "per-loop":
        why = f"per-token exit is checked against looplm with the per-loop KV policy only (this is {kv_policy!r})"
    elif kv == "propagate" and _modulates_blocks(cfg.rule.name):
        why = (
            f"the 'propagate' fill of rule {cfg.rule.name!r}, whose per-loop block modulation would need the "
            "stand-in's key and value once per skipped loop: not built; use kv 'copy'"
        )
    elif cfg.rule.name in ("ponderlm",):
        why = "PonderLM's per-loop readout is not checked with per-token exit"
    elif rule_attention(cfg) is not None:
        why = (
            "StateLoop's attention state mixer attends across the batch's tokens at every loop; the exit path runs "
            "the rule on the tokens still looping only, which vLLM's attention metadata (every token) cannot serve"
        )
    if why is not None:
        raise UnsupportedDesign(design_name(cfg), why, where)
    return {"criterion": crit, "threshold": float(t), "kv": kv, "min_loops": m}


def _modulates_blocks(rule: str) -> bool:
    """Whether rule ``rule`` overrides ``block_modulation`` (its blocks may differ per loop), as
    :func:`looplm.decode.exits._modulates` asks of a built rule."""
    from ..recurrence import RULES
    from ..recurrence.base import RecurrenceRule

    return RULES[rule].block_modulation is not RecurrenceRule.block_modulation


def _as_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a config.json dict or a transformers config, got {type(hf_config).__name__}")


def _positive_int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{what} must be a positive int, got {v!r}")
    return v


def plugin_spec(hf_config: Any, *, kv_policy: str | None = None, where: str = "config.json", tp: int = 1) -> PluginSpec:
    """The :class:`PluginSpec` of a model directory's config (a ``config.json`` dict or its transformers
    config), served on ``tp`` tensor-parallel ranks. ``kv_policy`` overrides the config's ``looplm_kv_policy``
    (default ``per-loop``).

    Raises :class:`UnsupportedDesign` for a design :func:`refusal` refuses, ``ValueError`` for a config
    that is not one of :data:`ARCHITECTURES` or is malformed."""
    c = _as_dict(hf_config)
    arch = (c.get("architectures") or [None])[0]
    mt = c.get("model_type")
    if arch in ("LoopLMForCausalLM", *MAMBA_ARCHITECTURES) or (arch is None and mt == "looplm"):
        raw = c.get("looplm")
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError(
                f"{where}: a LoopLMForCausalLM config needs the looplm ModelConfig under 'looplm' "
                "(written by `looplm export hf`); re-export the checkpoint"
            )
        cfg = ModelConfig.from_dict(dict(raw))
        r = c.get("num_loops")
        r = cfg.n_loops if r is None else _positive_int(r, f"{where}: num_loops")
        opts = dict(c.get("loop_options") or {})
        if c.get("exit_threshold") is not None:
            opts.setdefault("exit_threshold", float(c["exit_threshold"]))
        arch = served_architecture(cfg)  # LoopLMForCausalLM, or its Mamba-2 / hybrid form (mamba_spec)
    elif arch in ("OuroForCausalLM", "RavenForCausalLM") or mt in ("ouro", "huginn_raven"):
        from ..hf.public import detect, public_config

        if detect(c) is None:
            raise ValueError(
                f"{where}: architecture {arch!r} with model_type {mt!r}; Ouro's is 'ouro', Huginn's 'huginn_raven'"
            )
        cfg = public_config(c, where)
        r = cfg.n_loops  # total_ut_steps / mean_recurrence: what looplm's import runs by default
        opts = {}
        arch = "OuroForCausalLM" if mt == "ouro" else "RavenForCausalLM"
    else:
        raise ValueError(
            f"{where}: architecture {arch!r} (model_type {mt!r}) is not one the looplm plugin serves; "
            f"it serves {sorted(ARCHITECTURES)}"
        )
    policy = kv_policy if kv_policy is not None else c.get("looplm_kv_policy", "per-loop")
    if policy not in KV_POLICIES:
        raise ValueError(
            f"looplm_kv_policy must be one of {list(KV_POLICIES)}, got {policy!r} "
            '(set it with --hf-overrides \'{"looplm_kv_policy": "shared"}\')'
        )
    why = refusal(cfg, r, tp) or mamba_refusal(cfg, tp=tp, exit=c.get("looplm_exit"))
    if why is not None:
        raise UnsupportedDesign(design_name(cfg), why, where)
    if opts:
        from ..recurrence import RULES

        unknown = [k for k in opts if k not in RULES[cfg.rule.name].loop_options]
        if unknown:
            raise ValueError(
                f"{where}: loop_options {unknown} are not read by the rule {cfg.rule.name!r} "
                f"(it reads {list(RULES[cfg.rule.name].loop_options)})"
            )
    ex = exit_spec(c.get("looplm_exit"), cfg, r, tp=tp, kv_policy=policy, where=where)
    if ex is not None and ex["criterion"] == "gate":
        # its q is also the gate's output selection, as in looplm's generate: it replaces the config's
        # exit_threshold (an export writes the rule's trained default there)
        opts["exit_threshold"] = ex["threshold"]
    return PluginSpec(cfg, r, policy, opts, arch, ex)


def vllm_param_name(name: str) -> tuple[str, str | int | None]:
    """A looplm parameter name (``core.stack.blocks.0.mixer.q_proj.weight``; the export's ``looplm.`` prefix
    accepted) -> the plugin's parameter name and the shard id of a fused vLLM projection (``None``: a plain
    copy). ``q/k/v_proj`` -> ``qkv_proj`` shards ``q`` / ``k`` / ``v``; ``gate/up_proj`` -> ``gate_up_proj`` 0 / 1."""
    name = name.removeprefix(EXPORT_PREFIX)
    if name.startswith(_BLOCK_PARTS):
        if name.endswith(".mixer.A_log"):  # Mamba-2: vLLM's A, its loader stores −exp(A_log)
            return name.removesuffix("A_log") + "A", None
        for ours, (theirs, shard) in _FUSED.items():
            if ours in name:
                return name.replace(ours, theirs, 1), shard
    return name, None
