"""looplm's vLLM plugin with Mamba-2 blocks, its pure parts (looplm.vllm.mamba_spec, spec, configs): no vLLM.

Served through vLLM's Mamba-2 layer with one state per (loop, layer); checked against looplm by
tests_vllm/test_mamba.py (vLLM's venv). Here: which architecture vLLM builds, the slots, the weight names,
the constructor arguments of vLLM's layer and what is refused, by name and reason."""

from __future__ import annotations

import json

import pytest

import looplm
from looplm.config import load_model_config
from looplm.vllm.mamba_spec import (
    MAMBA_ARCHITECTURES,
    is_mamba_slot,
    mamba_layers,
    mamba_refusal,
    mixer2_kwargs,
    served_architecture,
    shared_loop_slots,
)
from looplm.vllm.spec import ARCHITECTURES, UnsupportedDesign, design_name, plugin_spec, refusal, vllm_param_name


def _export_config(preset: str, overrides: dict | None = None, **top) -> dict:
    """A config.json as `looplm export hf` writes it (the fields the plugin reads)."""
    cfg = load_model_config(preset, overrides)
    return {"architectures": ["LoopLMForCausalLM"], "model_type": "looplm", "looplm": cfg.to_dict(), **top}


@pytest.mark.parametrize(
    "preset, arch",
    [
        ("tiny-llama", "LoopLMForCausalLM"),
        ("tiny-coreloop", "LoopLMForCausalLM"),
        ("tiny-hybrid", "LoopLMHybridForCausalLM"),
        ("mamba2-hybrid-140m-loop4", "LoopLMHybridForCausalLM"),
        ("tiny-mamba2", "LoopLMMambaForCausalLM"),
        ("mamba2-6x4", "LoopLMMambaForCausalLM"),
    ],
)
def test_the_served_architecture_follows_the_design(preset, arch):
    cfg = load_model_config(preset)
    assert served_architecture(cfg) == arch
    spec = plugin_spec(_export_config(preset))
    assert spec.architecture == arch
    assert arch in ARCHITECTURES or MAMBA_ARCHITECTURES[arch] == f"looplm.vllm.mamba:{arch}"
    # the renamed config (what vLLM reads through the plugin's config class) is read back the same
    assert plugin_spec(_export_config(preset) | {"architectures": [arch]}).config == cfg


def test_the_config_class_names_the_served_architecture_and_the_export_is_unchanged(tmp_path):
    from looplm.hf.export import export_hf
    from looplm.vllm.configs import CONFIG_CLASSES, LoopLMConfig, VllmLoopLMConfig

    assert CONFIG_CLASSES["looplm"] is VllmLoopLMConfig and issubclass(VllmLoopLMConfig, LoopLMConfig)
    for preset, arch, chunk in [
        ("tiny-hybrid", "LoopLMHybridForCausalLM", 16),
        ("tiny-mamba2", "LoopLMMambaForCausalLM", 16),
        ("tiny-llama", "LoopLMForCausalLM", None),
    ]:
        out = tmp_path / preset
        export_hf(looplm.build(preset), out, tokenizer="byte")
        raw = json.loads((out / "config.json").read_text())
        assert raw["architectures"] == ["LoopLMForCausalLM"]  # looplm export hf writes what it always wrote
        hf = VllmLoopLMConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        assert hf.architectures == [arch]
        assert getattr(hf, "mamba_chunk_size", None) == chunk
        assert plugin_spec(hf).architecture == arch
    assert VllmLoopLMConfig().to_dict()["model_type"] == "looplm"  # default-constructed: nothing to name


def test_one_state_per_loop_and_layer():
    """tiny-hybrid: (0, 3, 2, 0), attention at layer 1: per loop two Mamba-2 states (layers 0, 2) and one KV
    cache, each (loop, layer) its own slot, in run order."""
    spec = plugin_spec(_export_config("tiny-hybrid"))
    cfg = spec.config
    kinds = [(s.loop, s.layer, is_mamba_slot(cfg, s)) for s in spec.slots]
    assert kinds == [(0, 0, True), (0, 1, False), (0, 2, True), (1, 0, True), (1, 1, False), (1, 2, True)]
    assert [s.index for s in spec.slots] == list(range(6))
    for k in range(2):
        for layer in range(3):
            assert spec.slot_index("core", layer, k) == 3 * k + layer
    # prelude and coda layers: one state each
    spec = plugin_spec(_export_config("tiny-hybrid", {"n_prelude": 1, "n_coda": 1, "attn_layer_idx": [2]}))
    mamba = [(s.part, s.layer, s.loop) for s in spec.slots if is_mamba_slot(spec.config, s)]
    assert mamba == [("prelude", 0, None), ("core", 1, 0), ("core", 3, 0), ("core", 1, 1), ("core", 3, 1)] + [
        ("coda", 4, None)
    ]
    assert mamba_layers(spec.config) == [0, 1, 3, 4]


def test_shared_policy_shares_the_attention_slots_only():
    """looplm's kv_shared: one attention slot per layer for every loop, one SSM state per (loop, layer). Under
    ``shared`` the Mamba-2 layers' loops >= 1 get slots after ``spec.slots``; ``per-loop`` needs none."""
    assert shared_loop_slots(plugin_spec(_export_config("tiny-hybrid"))) == {}
    spec = plugin_spec(_export_config("tiny-hybrid", looplm_kv_policy="shared"))  # (0, 3, 2, 0), attention at 1
    assert [(s.layer, s.loop, is_mamba_slot(spec.config, s)) for s in spec.slots] == [
        (0, None, True),
        (1, None, False),
        (2, None, True),
    ]
    assert shared_loop_slots(spec) == {(0, 1): 3, (2, 1): 4}
    spec = plugin_spec(
        _export_config("tiny-hybrid", {"n_prelude": 1, "n_coda": 1, "n_loops": 3}, looplm_kv_policy="shared")
    )  # (1, 3, 3, 1): slots prelude 0, core 1..3 (attention at 1), coda 4; Mamba-2 core layers 2 and 3
    assert len(spec.slots) == 5 and spec.config.attn_layer_idx == [1]
    assert shared_loop_slots(spec) == {(2, 1): 5, (3, 1): 6, (2, 2): 7, (3, 2): 8}
    ids = [s.index for s in spec.slots] + list(shared_loop_slots(spec).values())
    assert sorted(ids) == list(range(len(ids)))  # one integer per vLLM layer name


def test_mamba_weight_names_map_to_vllms_mamba_mixer2():
    from looplm.hf.export import hf_state_dict

    model = looplm.build("tiny-hybrid")
    names = list(hf_state_dict(model))
    targets = [vllm_param_name(n) for n in names]
    assert len(set(targets)) == len(targets)
    assert vllm_param_name("looplm.core.stack.blocks.0.mixer.A_log") == ("core.stack.blocks.0.mixer.A", None)
    for plain in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "D", "norm.weight", "out_proj.weight"):
        n = f"core.stack.blocks.2.mixer.{plain}"
        assert vllm_param_name(n) == (n, None)
    assert not any(t[0].endswith("A_log") for t in targets)
    assert len([t for t in targets if t[0].endswith("mixer.A")]) == len(mamba_layers(model.config)) == 2


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mamba2", "mamba2-hybrid-140m"])
def test_mixer2_arguments_match_looplms_mixer(preset):
    cfg = load_model_config(preset)
    kw = mixer2_kwargs(cfg)
    mixer = looplm.build(preset).core.stack.blocks[mamba_layers(cfg)[0] - cfg.n_prelude].mixer
    assert (kw["intermediate_size"], kw["num_heads"], kw["head_dim"]) == (mixer.d_inner, mixer.nheads, mixer.headdim)
    assert (kw["ssm_state_size"], kw["n_groups"], kw["conv_kernel_size"]) == (
        mixer.d_state,
        mixer.ngroups,
        mixer.d_conv,
    )
    assert kw["rms_norm_eps"] == mixer.norm.eps and kw["use_rms_norm"] and kw["activation"] == "silu"
    assert kw["use_conv_bias"] == (mixer.conv1d.bias is not None) and kw["use_bias"] == (mixer.in_proj.bias is not None)
    # vLLM's in_proj rows [z | x | B | C | dt] and conv channels [x | B | C]: looplm's split, same sizes
    gn = kw["n_groups"] * kw["ssm_state_size"]
    assert mixer.in_proj.out_features == 2 * kw["intermediate_size"] + 2 * gn + kw["num_heads"]
    assert tuple(mixer.conv1d.weight.shape) == (kw["intermediate_size"] + 2 * gn, 1, kw["conv_kernel_size"])
    assert mixer.norm.group_size == kw["intermediate_size"] // kw["n_groups"]  # the gated norm's groups


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mamba2"])
def test_mamba_designs_are_served(preset):
    cfg = load_model_config(preset)
    assert refusal(cfg) is None and mamba_refusal(cfg) is None
    spec = plugin_spec(_export_config(preset))
    assert spec.kv_policy == "per-loop" and spec.config == cfg


_REFUSED = [
    ({"looplm_exit": {"criterion": "convergence", "threshold": 0.1}}, {}, "per-token exit (looplm_exit)"),
]


@pytest.mark.parametrize("top, kw, reason", _REFUSED)
def test_what_of_a_mamba_design_is_refused_by_name_and_reason(top, kw, reason):
    cfg = load_model_config("tiny-hybrid")
    with pytest.raises(UnsupportedDesign) as e:
        plugin_spec(_export_config("tiny-hybrid", **top), where="/models/x/config.json", **kw)
    msg = str(e.value)
    assert msg.startswith(f"/models/x/config.json: looplm's vLLM plugin cannot serve {design_name(cfg)}: ")
    assert reason in msg and "mixers attention/mamba2" in msg, msg


def test_prefix_caching_is_refused_with_mamba_blocks():
    """vLLM's Mamba-2 prefill checkpoints (prefix caching) fail on its CPU build: the plugin's config hook turns
    prefix caching off (looplm.vllm.mamba_config); should it be on when the model loads, it is refused."""
    hybrid, attn = load_model_config("tiny-hybrid"), load_model_config("tiny-llama")
    why = mamba_refusal(hybrid, prefix_caching=True)
    assert "prefix caching with Mamba-2 blocks" in why and "--no-enable-prefix-caching" in why
    assert "--pipeline-parallel-size 1" in mamba_refusal(hybrid, pp=2)
    assert "speculative decoding with Mamba-2 blocks" in mamba_refusal(hybrid, speculative=True)
    assert mamba_refusal(attn, prefix_caching=True, tp=2, pp=2, speculative=True) is None  # attention: untouched


@pytest.mark.parametrize(
    "preset, tp, reason",
    [
        ("tiny-mamba2", 3, "its 8 Mamba-2 heads (Mamba-2 blocks at physical layers [0, 1]) do not split over 3"),
        ("tiny-mamba2", 4, "its 2 Mamba-2 groups (Mamba-2 blocks at physical layers [0, 1]) neither split over 4"),
    ],
)
def test_tensor_parallel_sizes_that_do_not_split_the_mamba_layers_are_refused(preset, tp, reason):
    with pytest.raises(UnsupportedDesign, match="tensor-parallel") as e:
        plugin_spec(_export_config(preset), tp=tp)
    assert reason in str(e.value), str(e.value)


@pytest.mark.parametrize("preset, tp", [("tiny-mamba2", 2), ("tiny-hybrid", 2), ("tiny-hybrid", 4)])
def test_tensor_parallel_sizes_that_split_the_mamba_layers_are_served(preset, tp):
    """tiny-mamba2: 8 heads, 2 groups (one per rank at TP 2); tiny-hybrid: 8 heads, 1 group (on every rank), 4
    attention heads. A Mamba-2-only model has no attention heads to split (its config's defaults are not read)."""
    assert refusal(load_model_config(preset), tp=tp) is None
    assert plugin_spec(_export_config(preset), tp=tp).config == load_model_config(preset)
    assert refusal(load_model_config("tiny-mamba2", {"attention.n_heads": 3, "attention.head_dim": 16}), tp=2) is None
