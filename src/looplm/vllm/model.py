"""looplm's looped models as vLLM models, built from vLLM's own layers (imports vLLM; see :mod:`looplm.vllm`).

The forward is looplm's driver (:meth:`looplm.model.LoopedLM.forward`) on vLLM's flat batch: vLLM hands the
model every scheduled token of every request as one ``[N]`` row (``positions [N]``), and the looped
computation runs on it as looplm's ``[B, T] = [1, N]``::

    E = embed(x)·m                                    [N, d]       (m = √d with embed_scale, StateLoop eq. 1)
    h0 = prelude(E)                                                 slots 0 .. p−1
    state = rule.begin(h0)
    for k < r:  Z^k = rule.next_input(state)                        the rule's own module: looplm.recurrence
                H^k = core(Z^k, rule.block_modulation(state))       slots of loop k (per-loop) or of the layer (shared)
                state = rule.step(state, H^k)
    y = coda(rule.finish(state)); hidden = N(y)                     slots after the core
    logits = head(hidden)                                            (vLLM's LogitsProcessor, sampled rows only)

Every block is looplm's residual block (:func:`looplm.blocks._branch`: ``pre`` / ``sandwich`` / ``post-sum``
norms and the rule's modulation hooks) around vLLM layers: ``QKVParallelLinear``, ``RowParallelLinear``,
``MergedColumnParallelLinear`` + ``SiluAndMul``, ``RMSNorm`` (QK-norm too), ``get_rope`` and ``Attention``. Each
attention slot of :attr:`looplm.vllm.spec.PluginSpec.slots` is one vLLM ``Attention`` named
``attn_slots.<index>``, so vLLM pages one KV cache per (loop, layer). A rule with an attention of its own —
StateLoop's ``attention`` state mixer ``X_attn`` (StateLoop eq. 8) — keeps its projections (looplm's modules) and
attends through slots of its own, one per iteration (:class:`VRuleAttention`). The recurrence rules run only where
:func:`looplm.vllm.spec.refusal` found that they act on each token's own state, so running them on the flat
batch is exact: no token of one request reaches another's.

Tensor parallelism (``--tensor-parallel-size tp``): the vLLM layers shard themselves — each rank holds
``n_heads / tp`` query heads and ``n_kv_heads / tp`` KV heads (one KV head replicated on ``tp / n_kv_heads``
ranks when there are fewer), ``d_ff / tp`` MLP channels and a ``V / tp`` slice of the embedding and the head,
and each tensor loads through its parameter's ``weight_loader``, which cuts the rank's shard from the full
tensor. ``o_proj`` and ``down_proj`` (``RowParallelLinear``) and the embedding all-reduce, so every block returns
the full ``[N, d]`` on every rank: the norms (QK-norm is per head), the rule modules and their parameters are
replicated and load whole. What does not split is refused by name first (:func:`looplm.vllm.spec.tp_refusal`).

Pipeline parallelism (``--pipeline-parallel-size P``, :mod:`looplm.vllm.stages`): the looped core runs whole on
one rank (each loop feeds the next); the ranks split between the prelude's blocks, the core and the coda's blocks.
A rank builds its own blocks and slots only (``PPMissingLayer`` elsewhere, which hands its input through) and sends
the next ``hidden_states`` and ``embeds`` (``E``, read by injection rules in the core) as ``IntermediateTensors``.

Per-token exit (config field ``looplm_exit``, :func:`looplm.vllm.spec.exit_spec`; docs/vllm.md#exits): in a step
with decode tokens the loops run as looplm's token schedule on rows ``[N, 1, d]`` (:meth:`_exit_loops`): decode
tokens stop when the criterion holds; later loops run the blocks on the rows still looping only, but every
attention call keeps the whole batch (vLLM's metadata lists every token), an exited token carrying its exit
loop's key and value (``copy``) or its stand-in's (``propagate``) — the call writes looplm's fill into the
skipped slot — and a zero query.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from ..blocks import _branch
from ..config import ModelConfig
from ..context import BlockModulation, ForwardContext, LoopContext, restrict_context
from ..decode.exits import Exit, finish_rest, keep_staying, make_criterion
from ..recurrence import build_rule
from .mamba_spec import is_mamba_slot
from .spec import UnsupportedDesign, design_name, plugin_spec, vllm_param_name
from .thresholds import installed, per_token, processor_listed, server_refusal, token_thresholds

__all__ = ["LoopLMForCausalLM", "OuroForCausalLM", "RavenForCausalLM"]


def _rows(norm: nn.Module, d: int):
    """``norm`` on ``u [..., d]`` as vLLM's ``RMSNorm`` takes it, ``[rows, d]``, reshaped back."""
    return lambda u: norm(u.reshape(-1, d)).view(u.shape)


def _rope(cfg: ModelConfig, head_dim: int, rotary_dim: int):
    """vLLM's rotary embedding of looplm's tables (:mod:`looplm.layers.rope`): ``θ = rope_theta``, Llama-3
    scaling when configured, half-split (neox) on the first ``rotary_dim`` of ``head_dim`` channels."""
    a = cfg.attention
    rope = {"rope_theta": a.rope_theta, "rope_type": "default", "partial_rotary_factor": rotary_dim / head_dim}
    if a.rope_scaling is not None:
        s = a.rope_scaling
        rope |= {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return get_rope(head_dim, max_position=cfg.max_seq_len, is_neox_style=True, rope_parameters=rope)


class VAttention(nn.Module):
    """looplm's :class:`~looplm.layers.attention.Attention` from vLLM layers, without its KV slot: the
    block is handed the vLLM ``Attention`` (slot) of the loop it runs in."""

    def __init__(self, cfg: ModelConfig, prefix: str, quant_config=None):
        super().__init__()
        a = cfg.attention
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = cfg.head_dim
        self.n_heads, self.n_kv_heads = a.n_heads // tp, max(1, cfg.n_kv_heads // tp)
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.d_model,
            self.head_dim,
            a.n_heads,
            cfg.n_kv_heads,
            bias=a.bias or a.qk_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            a.n_heads * self.head_dim, cfg.d_model, bias=a.bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if a.qk_norm else None
        self.rotary_emb = _rope(cfg, self.head_dim, cfg.rotary_dim)

    def kv(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value ``[n, H_kv·hd]`` this layer writes for normed inputs ``u [n, d]`` (QK-norm, RoPE):
        the ``propagate`` fill of a stand-in."""
        qkv, _ = self.qkv_proj(u)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.k_norm is not None:
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        _, k = self.rotary_emb(positions, q, k)
        return k.reshape(-1, self.kv_size), v.reshape(-1, self.kv_size)

    def forward(
        self, u: torch.Tensor, positions: torch.Tensor, attn: Attention, rows=None, store=None, n_all: int = 0
    ) -> torch.Tensor:
        """``u [n, d]`` -> ``[n, d]``. With ``rows [n]`` (per-token exit: the tokens still looping, of ``n_all``)
        the attention call still covers every token of vLLM's batch, as its metadata says: a token that exited
        carries the key and value kept for it in ``store`` (its exit loop's in this layer, or its ``propagate``
        stand-in's) and a zero query whose output is dropped, so the call writes looplm's fill into its slot."""
        qkv, _ = self.qkv_proj(u)  # [n, (H + 2 H_kv)·hd]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # Qwen3 QK-norm per head, before RoPE
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)  # half-split (neox) on the first rotary_dim channels, as looplm
        if rows is None:
            y, _ = self.o_proj(attn(q, k, v))  # softmax(q kᵀ/√hd + causal) v over the slot's paged keys
            return y
        if "k" not in store:
            store["k"], store["v"] = k.new_zeros(n_all, self.kv_size), v.new_zeros(n_all, self.kv_size)
        store["k"].index_copy_(0, rows, k.reshape(-1, self.kv_size))
        store["v"].index_copy_(0, rows, v.reshape(-1, self.kv_size))
        qf = q.new_zeros(n_all, self.q_size).index_copy_(0, rows, q.reshape(-1, self.q_size))
        y, _ = self.o_proj(attn(qf, store["k"], store["v"]).index_select(0, rows))
        return y


class VRuleAttention(nn.Module):
    """The recurrence rule's own attention mixer — StateLoop's ``X_attn(S̃) = S̃ + CausalAttention(RMSNorm_m(S̃))``
    (StateLoop eq. 8), one module shared across iterations with its own slot per iteration — on vLLM's paged
    KV. It keeps looplm's ``q/k/v/o_proj`` modules (the rule's parameters, under their names; replicated on
    every tensor-parallel rank like the rest of the rule) and replaces only the attention itself: vLLM's RoPE on
    the whole head (looplm's ``rotary_dim = mixer_head_dim``) and the ``Attention`` slot of the iteration it runs
    in, which the plugin's loop context hands to the rule's ``loop_slot`` (:class:`_RuleSlots`)."""

    def __init__(self, inner: nn.Module, cfg: ModelConfig):
        super().__init__()
        if inner.q_norm is not None or inner.sliding_window is not None:  # StateLoop builds neither
            raise UnsupportedDesign(design_name(cfg), "a rule attention with QK-norm or a window")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = inner.q_proj, inner.k_proj, inner.v_proj, inner.o_proj
        self.n_heads, self.head_dim = inner.n_heads, inner.head_dim  # as many KV heads (StateLoop's mixer)
        self.rotary_emb = _rope(cfg, inner.head_dim, inner.rotary_dim)

    def forward(self, x: torch.Tensor, fctx: ForwardContext, attn: Attention) -> torch.Tensor:
        """``x [B, T, d_s]`` (the normed state ``RMSNorm_m(S̃)``; ``[1, N, d_s]``: every token of vLLM's batch)
        -> ``[B, T, d_s]``; ``attn``: this iteration's slot."""
        u = x.reshape(-1, x.shape[-1])  # [N, d_s]
        q, k, v = self.q_proj(u), self.k_proj(u), self.v_proj(u)  # [N, H·hd]
        q, k = self.rotary_emb(fctx.positions.reshape(-1), q, k)
        return self.o_proj(attn(q, k, v)).view(x.shape)  # softmax(q kᵀ/√hd + causal) v over the slot's keys


class _RuleSlots:
    """The plugin's stand-in for looplm's decoding cache in the loop context, for a rule with an attention of
    its own: :meth:`looplm.context.LoopContext.loop_slot` asks it for the rule's slot of iteration ``k`` and gets
    that iteration's vLLM ``Attention`` (:attr:`looplm.vllm.spec.PluginSpec.slots`, part ``rule``)."""

    def __init__(self, model: "_LoopedForCausalLM"):
        self.model = model

    def slot(self, key, factory, loop: int, family=None) -> Attention:
        m = self.model
        return m.attn_slots[m.spec.slot_index("rule", None, loop)]


class VMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) ⊙ up(x))`` (:class:`looplm.layers.mlp.SwiGLU`) with vLLM's fused gate/up."""

    def __init__(self, cfg: ModelConfig, prefix: str, quant_config=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.d_model, [cfg.d_ff] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            cfg.d_ff, cfg.d_model, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, d] -> [N, 2 d_ff] -> [N, d_ff] -> [N, d]
        y, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(self.act(y))
        return y


class VBlock(nn.Module):
    """Physical block ``layer`` (:class:`looplm.blocks.Block`): parameter names as looplm's, so the export's
    tensors map by name (:func:`looplm.vllm.spec.vllm_param_name`)."""

    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, quant_config=None):
        super().__init__()
        d, two = cfg.d_model, cfg.norm_placement != "pre"
        self.d, self.post_sum = d, cfg.norm_placement == "post-sum"
        self.mixer_norm = RMSNorm(d, eps=cfg.norm_eps)
        if cfg.mixer_of(layer) == "attention":
            self.mixer = VAttention(cfg, f"{prefix}.mixer", quant_config)
        else:  # Mamba-2: vLLM's MambaMixer2, its state per (loop, layer) in the model's slots (looplm.vllm.mamba)
            from .mamba_layers import block_mixer

            self.mixer = block_mixer(cfg, f"{prefix}.mixer", quant_config)
        self.mixer_out_norm = RMSNorm(d, eps=cfg.norm_eps) if two else None
        if cfg.d_ff > 0:
            self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps)
            self.mlp = VMLP(cfg, f"{prefix}.mlp", quant_config)
            self.mlp_out_norm = RMSNorm(d, eps=cfg.norm_eps) if two else None
        else:
            self.mlp_norm = self.mlp = self.mlp_out_norm = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: Attention,
        mod: BlockModulation | None = None,
        rows=None,
        store=None,
        n_all: int = 0,
    ):
        # x [1, N, d] or [n, 1, d] (per-token exit: the rows still looping; or the rule's residual carrier)
        m, d = mod if mod is not None else BlockModulation(), self.d
        out = None if self.mixer_out_norm is None else _rows(self.mixer_out_norm, d)
        mix = lambda u: self.mixer(u.reshape(-1, d), positions, attn, rows, store, n_all).view(u.shape)  # noqa: E731
        x = _branch(x, _rows(self.mixer_norm, d), mix, m.mixer, out, self.post_sum)
        if self.mlp is not None:
            out = None if self.mlp_out_norm is None else _rows(self.mlp_out_norm, d)
            mlp = lambda u: self.mlp(u.reshape(-1, d)).view(u.shape)  # noqa: E731
            x = _branch(x, _rows(self.mlp_norm, d), mlp, m.mlp, out, self.post_sum)
        return x


class _Stack(nn.Module):
    """``blocks`` of one part (prelude, core, coda) under looplm's names; a block another pipeline rank runs is
    vLLM's ``PPMissingLayer`` (no parameters; called, it hands its input through)."""

    def __init__(self, cfg: ModelConfig, first: int, n: int, prefix: str, quant_config=None, holds=None):
        super().__init__()
        self.blocks = nn.ModuleList(
            VBlock(cfg, first + i, f"{prefix}.blocks.{i}", quant_config)
            if holds is None or holds(first + i)
            else PPMissingLayer()
            for i in range(n)
        )


class _Core(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, quant_config=None, holds=None):
        super().__init__()
        self.stack = _Stack(cfg, cfg.n_prelude, cfg.n_core, f"{prefix}.stack", quant_config, holds)


class _LoopedForCausalLM(nn.Module, SupportsPP):
    """The vLLM model of a :class:`~looplm.vllm.spec.PluginSpec` (see the module docstring)."""

    family: str | None = None  # the original format whose tensor names load_weights maps (looplm.hf.public)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        tp = get_tensor_model_parallel_world_size()
        # refused by name before any layer is built or weight read (tp_refusal: heads, d_ff, PonderLM)
        spec = plugin_spec(hf, where=str(getattr(vllm_config.model_config, "model", "config.json")), tp=tp)
        self.tp = tp
        self.exit = spec.exit
        self.stage = self._pipeline_stage(vllm_config, spec)  # what this pipeline rank holds (stages.py)
        # per-request thresholds: looplm.vllm.processor is among vLLM's logits processors
        self.request_thresholds = processor_listed(getattr(vllm_config.model_config, "logits_processors", None))
        if spec.exit is not None or self.request_thresholds:
            self._check_exit_scheduling(vllm_config, spec, self.request_thresholds)
        # per-token exit: decode tokens seen and the core loops they ran (read by tests_vllm/exit_probe.py)
        self.exit_stats = {"decode_tokens": 0, "executed_loops": 0, "forwards": 0}
        self.spec, self.config = spec, hf
        cfg, quant = spec.config, vllm_config.quant_config
        self.cfg = cfg
        d, V = cfg.d_model, cfg.vocab_size
        st = self.stage
        if st.first or (st.last and cfg.tie_embeddings):  # (the last rank's head is the embedding when tied)
            self.embed = VocabParallelEmbedding(V, d, quant_config=quant, prefix=maybe_prefix(prefix, "embed"))
        else:
            self.embed = PPMissingLayer()
        self.embed_multiplier = d**0.5 if cfg.embed_scale else 1.0
        self.prelude = _Stack(
            cfg, 0, cfg.n_prelude, maybe_prefix(prefix, "prelude"), quant, lambda i: st.holds("prelude", i)
        )
        self.core = _Core(cfg, maybe_prefix(prefix, "core"), quant, lambda i: st.core)
        self.coda = _Stack(
            cfg,
            cfg.n_prelude + cfg.n_core,
            cfg.n_coda,
            maybe_prefix(prefix, "coda"),
            quant,
            lambda i: st.holds("coda", i),
        )
        self.rule = build_rule(cfg)  # looplm's own rule module: its arithmetic, its parameters' names
        mixers = self.rule.loop_slot_mixers()
        if spec.rule_attention is not None:  # StateLoop's X_attn (eq. 8): looplm's projections, vLLM's slots
            self.rule.mixer.mixer = VRuleAttention(self.rule.mixer.mixer, cfg)
        elif mixers:  # a mixer of its own that refusal() does not know
            raise UnsupportedDesign(design_name(cfg), "the rule mixes tokens with a module of its own")
        # the final norm N on every pipeline rank (d weights): rules read it inside the core (Ouro's, Huginn's
        # and Nanbeige's inter-loop and gate norms, lctx.final_norm), wherever the core runs
        self.norm = RMSNorm(d, eps=cfg.norm_eps)
        if st.last:
            self.lm_head = ParallelLMHead(V, d, quant_config=quant, prefix=maybe_prefix(prefix, "lm_head"))
            if cfg.tie_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.embed)
            self.logits_processor = LogitsProcessor(V)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(["hidden_states", "embeds"], d)
        a = cfg.attention
        # (query heads, KV heads, head dim) of a slot on this rank: the blocks' are split over the ranks, the
        # rule's own attention (its module replicated) keeps every head on each rank
        blocks = (a.n_heads // tp, max(1, cfg.n_kv_heads // tp), cfg.head_dim)
        rule = None if spec.rule_attention is None else (spec.rule_attention[0],) * 2 + (spec.rule_attention[1],)
        self.attn_slots = nn.ModuleList(
            PPMissingLayer()  # a slot of a block another pipeline rank runs
            if not st.holds(s.part, s.layer)
            else self._mamba_slot(s, f"{maybe_prefix(prefix, 'attn_slots')}.{s.index}")
            if is_mamba_slot(cfg, s)  # a Mamba-2 block's state of this (loop, layer), not a KV cache
            else Attention(
                H,
                hd,
                hd**-0.5,
                num_kv_heads=H_kv,
                cache_config=vllm_config.cache_config,
                quant_config=quant if s.part != "rule" else None,
                prefix=f"{maybe_prefix(prefix, 'attn_slots')}.{s.index}",
            )
            for s in spec.slots
            for H, H_kv, hd in [rule if s.part == "rule" else blocks]
        )
        self._rule_slots = None if rule is None else _RuleSlots(self)

    @staticmethod
    def _pipeline_stage(vllm_config: VllmConfig, spec):
        """This rank's :class:`looplm.vllm.stages.Stage` (pipeline parallelism; one stage holding everything at
        size 1). A size the model cannot be cut into is refused by name before any layer is built."""
        from .stages import pipeline_refusal, pipeline_stages

        pp = vllm_config.parallel_config.pipeline_parallel_size
        cfg = spec.config
        why = pipeline_refusal(cfg, spec.num_loops, pp, spec.exit)
        if why is not None:
            raise UnsupportedDesign(design_name(cfg), why, str(getattr(vllm_config.model_config, "model", "")))
        return pipeline_stages(cfg, spec.num_loops, pp)[get_pp_group().rank_in_group if pp > 1 else 0]

    def _slot(self, part: str, layer: int, loop: int | None) -> nn.Module:
        """The slot block ``layer`` of ``part`` runs with at core iteration ``loop``: a vLLM ``Attention``, or a
        Mamba-2 state (:mod:`looplm.vllm.mamba`, whose model classes add the per-loop states of ``shared``)."""
        return self.attn_slots[self.spec.slot_index(part, layer, loop)]

    def _mamba_slot(self, s, name: str) -> nn.Module:
        from .mamba_layers import mamba_slot

        return mamba_slot(self, s, name)

    # --- the looped forward --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.reshape(-1, self.cfg.d_model)).view(h.shape)

    def _readout(self, h: torch.Tensor, lctx: LoopContext) -> torch.Tensor:
        """Logits ``[1, N, V]`` of an iterate (PonderLM's feedback; refusal() leaves only models without a coda)."""
        if self.cfg.n_coda:
            raise UnsupportedDesign(design_name(self.cfg), "a readout through the coda inside the loop")
        w = self.lm_head.weight[: self.cfg.vocab_size]  # [V, d] (vLLM pads the vocabulary)
        return self._final_norm(h) @ w.T

    def _part(self, stack: _Stack, part: str, x, positions, loop=None, mods=None, rows=None, stores=None):
        n_all = 0 if rows is None else stores["n_all"]
        for i, blk in enumerate(stack.blocks):
            layer = self._first(part) + i
            attn = self._slot(part, layer, loop)
            store = None if rows is None else stores.setdefault(layer, {})
            x = blk(x, positions, attn, None if mods is None else mods[i], rows, store, n_all)
        return x

    @staticmethod
    def _check_exit_scheduling(vllm_config: VllmConfig, spec, request_thresholds: bool = False) -> None:
        """Per-token exit tells a prompt token from a decode token by its request's query length (one new token
        after at least one cached: decode). A prompt cut into chunks, or one whose prefix came from the prefix
        cache, could run one token after cached ones and take exits that looplm's ``prefill='full'`` never
        takes: both are refused by name. So is a compiled forward (torch.compile / CUDA graphs would trace one
        path through the data-dependent exits): exits run with ``--enforce-eager``. With the per-request
        threshold processor (``request_thresholds``), a server it cannot serve — no ``looplm_exit``, or the
        ``gate`` criterion — is refused too (:func:`looplm.vllm.thresholds.server_refusal`): a request's
        ``validate_params`` sees the request only, so what depends on the server is checked here."""
        if request_thresholds:
            why = server_refusal(spec.exit)
            if why is not None:
                raise ValueError(why)
        on = []
        if getattr(vllm_config.compilation_config, "mode", 0) != 0:  # CompilationMode.NONE
            on.append("compilation (pass --enforce-eager / enforce_eager=True)")
        if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            on.append("prefix caching (pass --no-enable-prefix-caching / enable_prefix_caching=False)")
        if getattr(vllm_config.scheduler_config, "enable_chunked_prefill", False):
            on.append("chunked prefill (pass --no-enable-chunked-prefill / enable_chunked_prefill=False)")
        if on:
            raise ValueError(
                f"looplm_exit {spec.exit} needs an eager forward and every prompt scheduled whole and computed "
                "here; turn off " + " and ".join(on)
            )

    def _step_metadata(self):
        """The step's attention metadata of the first slot (``query_start_loc``, ``seq_lens`` are the same for
        every slot), ``None`` outside a forward context or without metadata (vLLM's profiling run)."""
        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict) or not md:
            return None
        return md.get(self.attn_slots[0].layer_name)

    def _decode_mask(self, n: int) -> torch.Tensor | None:
        """``[n]`` bool: the tokens that may exit — each the one new token of a request with cached tokens
        before it (from the step's attention metadata: ``query_start_loc``, ``seq_lens``); ``None`` when the
        step has none (or no metadata: vLLM's profiling run)."""
        m = self._step_metadata()
        qsl, seq = getattr(m, "query_start_loc", None), getattr(m, "seq_lens", None)
        if qsl is None or seq is None:
            return None
        qlen = qsl[1:] - qsl[:-1]  # [requests]
        dec = (qlen == 1) & (seq[: qlen.numel()] > 1)
        if not bool(dec.any()):
            return None
        return per_token(dec, qsl, n, False)

    def _propagate(self, z: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, stores: dict) -> None:
        """looplm's ``propagate`` fill (:mod:`looplm.decode.kv_fill`) for rows ``g`` leaving with stand-ins
        ``z [n, 1, d]``: each core layer's key and value of ``mixer_norm(z)`` replace the rows' kept ones, so the
        later loops' attention calls write them into the skipped slots (the rule modulates no block: exit_spec)."""
        pos, d = positions.index_select(0, g), self.cfg.d_model
        for i, blk in enumerate(self.core.stack.blocks):
            k, v = blk.mixer.kv(blk.mixer_norm(z.reshape(-1, d)), pos)
            store = stores[self.cfg.n_prelude + i]
            store["k"].index_copy_(0, g, k)
            store["v"].index_copy_(0, g, v)

    def _fill_slots(self, loops: range, stores: dict) -> None:
        """The attention calls of core ``loops`` that no token runs any more (every token of the step left
        earlier): each writes the kept keys and values (``copy``: the exit loop's; ``propagate``: the stand-in's)
        into its slot, with zero queries whose output is dropped — the fill looplm's cache holds for those loops."""
        for k in loops:
            for i, blk in enumerate(self.core.stack.blocks):
                layer = self.cfg.n_prelude + i
                store = stores[layer]
                q = store["k"].new_zeros(store["k"].shape[0], blk.mixer.q_size)  # [N, H·hd]
                self.attn_slots[self.spec.slot_index("core", layer, k)](q, store["k"], store["v"])

    def _exit_loops(self, E: torch.Tensor, positions: torch.Tensor, may_exit: torch.Tensor) -> torch.Tensor:
        """The looped forward with per-token exit (looplm's token schedule, :mod:`looplm.decode.token_schedule`,
        on vLLM's batch): every token is a row ``[N, 1, d]`` (the served rules act on each token's own state);
        after each loop the criterion lets the rows of ``may_exit`` stop (from ``min_loops``), their output is the
        rule's ``finish`` of the exit state, and the later loops run on the rows still looping only — except each
        attention call, which covers the whole batch so that an exited token's slot gets its fill (looplm's
        ``copy``: its exit loop's key and value; ``propagate``: :meth:`_propagate`). Prompt tokens run every loop.
        With the per-request threshold processor (:mod:`looplm.vllm.processor`) each token is checked against
        its own request's threshold (``thr [N]``, by row through ``query_start_loc``; ``0``: full depth).
        -> ``[N, 1, d]`` for the coda."""
        spec, rule, ex = self.spec, self.rule, self.exit
        N = E.shape[0]
        thr, allowed = None, may_exit  # [N]: each token's threshold (None: the server's for all), may it exit
        if self.request_thresholds:
            reg = installed()
            if reg is None:
                raise RuntimeError("looplm.vllm.processor is listed but was not constructed in this process")
            thr = token_thresholds(reg, self._step_metadata().query_start_loc, N, ex["threshold"], E.device)  # [N]
            allowed = may_exit & (thr > 0)  # ε = 0 (or 'none'): full depth, as looplm's Exit with ε = 0
        x = self._part(self.prelude, "prelude", E[:, None], positions)  # [N, 1, d]
        # check_readout: the kl check's (exit_spec refuses kl with a coda or under TP)
        lctx = self._loop_context(E[:, None], positions[:, None], check_readout=self._readout)
        crit = make_criterion(Exit(criterion=ex["criterion"], threshold=ex["threshold"]))
        crit.begin(0)
        state = rule.begin(x, lctx)
        rows, sub, y = torch.arange(N, device=E.device), lctx, None
        stores: dict = {"n_all": N}
        executed = torch.zeros(N, dtype=torch.long, device=E.device)
        R = spec.num_loops
        for k in range(R):
            sub.iteration = k
            n = rows.numel()
            z = sub.core_input = rule.next_input(state, sub)  # Z^k [n, 1, d]
            mods = rule.block_modulation(state, sub)
            h = self._part(self.core.stack, "core", z, positions.index_select(0, rows), k, mods, rows, stores)
            state = rule.step(state, h, sub)
            executed.index_add_(0, rows, torch.ones_like(rows))
            if k == R - 1:
                break
            if thr is not None:  # the rows still looping, each at its request's threshold: distance < ε [n]
                crit.threshold = thr.index_select(0, rows)
            leave = crit.check(k, h, state, sub, rows, self)  # [n]: the criterion of the rows still looping
            if k + 1 < ex["min_loops"]:
                continue
            leave = leave & allowed.index_select(0, rows)
            if not bool(leave.any()):
                continue
            out = leave.nonzero()[:, 0]
            g = rows.index_select(0, out)
            ctx_out = restrict_context(lctx, g)
            ctx_out.iteration = k
            st_out = rule.exit_rows(
                rule.take_rows(state, out, n), torch.ones(out.numel(), 1, dtype=torch.bool, device=E.device), ctx_out
            )
            if y is None:
                y = x.new_zeros(N, 1, x.shape[-1])
            y.index_copy_(0, g, rule.finish(st_out, ctx_out))
            if ex["kv"] == "propagate":  # the skipped loops' slots: the stand-in Z^{k+1} through each core layer
                self._propagate(rule.next_input(st_out, replace(ctx_out, iteration=k + 1)), g, positions, stores)
            state, rows, sub = keep_staying(rule, crit, lctx, state, rows, leave)
            if rows.numel() == 0:  # every token left: the later loops' slots still get their fill
                self._fill_slots(range(k + 1, R), stores)
                break
        if rows.numel():
            if y is None:
                y = rule.finish(state, sub)
            else:
                finish_rest(rule, y, state, sub, rows, None)
        st = self.exit_stats
        st["decode_tokens"] += int(may_exit.sum())
        st["executed_loops"] += int(executed[may_exit].sum())
        return y

    def _first(self, part: str) -> int:
        c = self.cfg
        return {"prelude": 0, "core": c.n_prelude, "coda": c.n_prelude + c.n_core}[part]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_,
    ) -> torch.Tensor:
        """``input_ids, positions [N]`` (every scheduled token of every request) -> hidden states ``[N, d]``
        (on a pipeline rank before the last: ``IntermediateTensors`` of ``hidden_states`` and ``embeds``, each
        ``[N, d]``, for the next rank, which gets them as ``intermediate_tensors``)."""
        st = self.stage
        if st.first:
            E = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [N, d]
            if self.embed_multiplier != 1.0:
                E = E * self.embed_multiplier
            x = E
        else:  # a later pipeline stage: the previous rank's output and E (injection rules read it in the core)
            x, E = intermediate_tensors["hidden_states"], intermediate_tensors["embeds"]
        self.exit_stats["forwards"] += 1
        may_exit = None if self.exit is None else self._decode_mask(E.shape[0])
        if may_exit is not None:  # per-token exit: the decode tokens of this step may stop early (pp = 1)
            y = self._exit_loops(E, positions, may_exit)
            return self._final_norm(self._part(self.coda, "coda", y, positions))[:, 0]  # [N, d]
        E, x = E[None], x[None]  # [1, N, d]: looplm's [B, T]
        x = self._part(self.prelude, "prelude", x, positions)  # (blocks of other ranks hand x through)
        if st.core:
            x = self._core_loops(x, E, positions)
        y = self._part(self.coda, "coda", x, positions)  # [1, N, d]
        if not st.last:
            return IntermediateTensors({"hidden_states": y[0], "embeds": E[0]})
        return self._final_norm(y)[0]  # [N, d]

    def _loop_context(self, E: torch.Tensor, positions: torch.Tensor, **more) -> LoopContext:
        """The rules' loop context for embeddings ``E`` and ``positions`` in looplm's ``[B, T]`` layout (the whole
        batch as ``[1, N]``, or one row per token ``[N, 1]`` on the exit path); ``more``: further fields."""
        cfg = self.cfg
        has_embed = isinstance(self.embed, VocabParallelEmbedding)
        return LoopContext(
            num_loops=self.spec.num_loops,
            train_loops=cfg.n_loops,
            fctx=ForwardContext(positions=positions),
            loop_options=dict(self.spec.loop_options),
            embeddings=E,
            # the rank's vocabulary shard under TP: only PonderLM reads it, and tp_refusal (pipeline_refusal)
            # refuses it under tensor (pipeline) parallelism
            embed_weight=self.embed.weight[: cfg.vocab_size] if self.tp == 1 and has_embed else None,
            embed_multiplier=self.embed_multiplier,
            readout_fn=self._readout,
            final_norm=self._final_norm,
            **more,
        )

    def _core_loops(self, x: torch.Tensor, E: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The looped core on the prelude's output ``x [1, N, d]`` (``E [1, N, d]``: the embeddings) -> the rule's
        ``finish``, the coda's input ``[1, N, d]``."""
        spec = self.spec
        # the rule's own attention slots (StateLoop's X_attn), else None
        lctx = self._loop_context(E, positions[None], cache=self._rule_slots)
        state = self.rule.begin(x, lctx)
        for k in range(spec.num_loops):
            lctx.iteration = k
            z = lctx.core_input = self.rule.next_input(state, lctx)  # Z^k  [1, N, d]
            mods = self.rule.block_modulation(state, lctx)
            h = self._part(self.core.stack, "core", z, positions, loop=k, mods=mods)  # H^k
            state = self.rule.step(state, h, lctx)
        return self.rule.finish(state, lctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # --- weights ---------------------------------------------------------------------------------
    def _looplm_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """``(looplm name, tensor)`` pairs from the directory's tensors (an export: names as stored)."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, w in self._looplm_tensors(weights):
            pname, shard = vllm_param_name(name)
            if pname == "lm_head.weight" and self.cfg.tie_embeddings:
                continue  # the embedding (stored once)
            if pname not in params:
                if not is_pp_missing_parameter(pname, self):  # (a block, slot or head another pipeline rank holds)
                    unknown.append(name)
                continue
            p = params[pname]
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, w) if shard is None else loader(p, w, shard)
            loaded.add(pname)
        if unknown:
            raise ValueError(
                f"tensors the plugin's {design_name(self.cfg)} model has no place for: {unknown[:8]}"
                f"{' ...' if len(unknown) > 8 else ''}; the directory does not match its config.json"
            )
        if self.cfg.attention.qk_bias:  # biases on q and k only: the fused bias's v part is zero
            for pname, p in params.items():
                if pname.endswith("mixer.qkv_proj.bias"):
                    p.weight_loader(p, torch.zeros(self.cfg.n_kv_heads * self.cfg.head_dim, dtype=p.dtype), "v")
        return loaded


class LoopLMForCausalLM(_LoopedForCausalLM):
    """looplm's Hugging Face export (``looplm export hf``): tensors ``looplm.<looplm name>``."""


class _PublicFormat(_LoopedForCausalLM):
    """An original-format directory: its tensors are mapped to looplm's names by looplm's own import
    (:func:`looplm.hf.public.to_looplm_state`, one source of truth), then loaded as an export's."""

    def _looplm_tensors(self, weights):
        from ..hf.public import to_looplm_state

        t = dict(weights)  # the whole state: the mapping splits and permutes fused original tensors
        try:
            sd = to_looplm_state(self.family, self.cfg, t)
        except KeyError as e:
            raise ValueError(f"{self.family} checkpoint is missing the tensor {e.args[0]!r}") from None
        return sd.items()


class OuroForCausalLM(_PublicFormat):
    family = "ouro"


class RavenForCausalLM(_PublicFormat):
    family = "huginn_raven"
