"""looplm's vLLM plugin, its pure parts (looplm.vllm.spec, looplm.vllm.configs): no vLLM needed or imported.

The plugin served by vLLM is tested against looplm by ``make test-vllm`` (tests_vllm/, its own venv)."""

from __future__ import annotations

import json
import sys

import pytest

import looplm
from looplm.config import load_model_config
from looplm.vllm.spec import (
    ARCHITECTURES,
    UnsupportedDesign,
    design_name,
    plugin_spec,
    refusal,
    vllm_param_name,
)


def _export_config(preset: str, overrides: dict | None = None, **top) -> dict:
    """A config.json as `looplm export hf` writes it (the fields the plugin reads)."""
    cfg = load_model_config(preset, overrides)
    return {
        "architectures": ["LoopLMForCausalLM"],
        "model_type": "looplm",
        "looplm": cfg.to_dict(),
        "num_loops": cfg.n_loops,
        **top,
    }


def test_importing_the_plugin_imports_no_vllm():
    import looplm.vllm  # noqa: F401
    import looplm.vllm.configs  # noqa: F401

    assert "vllm" not in sys.modules
    assert all(not m.startswith("vllm.") for m in sys.modules)
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "import looplm, sys; print('looplm.vllm' in sys.modules, 'vllm' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["False", "False"]  # `import looplm` never imports the plugin


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-coreloop", "tiny-stateloop"])
def test_attention_presets_map(preset):
    spec = plugin_spec(_export_config(preset))
    c = spec.config
    assert c == load_model_config(preset)
    assert spec.num_loops == c.n_loops and spec.kv_policy == "per-loop" and spec.architecture == "LoopLMForCausalLM"
    slots = spec.slots
    assert len(slots) == c.n_prelude + c.n_loops * c.n_core + c.n_coda  # one Attention per (loop, layer)
    assert [s.index for s in slots] == list(range(len(slots)))
    for s in slots:
        assert spec.slot_index(s.part, s.layer, s.loop) == s.index


def test_slots_in_run_order_per_loop_and_shared():
    raw = _export_config("tiny-coreloop")  # (p, s, K, c) = (1, 2, 3, 1)
    per_loop = plugin_spec(raw)
    assert [(s.part, s.layer, s.loop) for s in per_loop.slots] == [
        ("prelude", 0, None),
        ("core", 1, 0),
        ("core", 2, 0),
        ("core", 1, 1),
        ("core", 2, 1),
        ("core", 1, 2),
        ("core", 2, 2),
        ("coda", 3, None),
    ]
    shared = plugin_spec({**raw, "looplm_kv_policy": "shared"})
    assert [(s.part, s.layer, s.loop) for s in shared.slots] == [
        ("prelude", 0, None),
        ("core", 1, None),
        ("core", 2, None),
        ("coda", 3, None),
    ]
    assert {shared.slot_index("core", 2, k) for k in range(3)} == {2}  # every loop writes the layer's one slot
    assert shared.slot_index("coda", 3) == 3 and per_loop.slot_index("coda", 3) == 7
    assert plugin_spec(raw, kv_policy="shared").kv_policy == "shared"  # the argument wins over the config


def test_stateloop_attention_mixer_gets_a_slot_per_iteration():
    """StateLoop's X_attn (eq. 8): one slot per iteration after that iteration's core layers (looplm's
    ``loop_slot``), one for every iteration under ``shared``; its heads from d_s / mixer_head_dim."""
    over = {"rule.options.mixer": "attention", "rule.options.d_s": 96, "rule.options.mixer_head_dim": 32}
    raw = _export_config("tiny-stateloop", over)  # (p, s, K, c) = (0, 2, 4, 0)
    spec = plugin_spec(raw)
    assert spec.rule_attention == (3, 32)
    assert [(s.part, s.layer, s.loop) for s in spec.slots] == [
        (part, layer, k) for k in range(4) for part, layer in (("core", 0), ("core", 1), ("rule", None))
    ]
    for s in spec.slots:
        assert spec.slot_index(s.part, s.layer, s.loop) == s.index
    shared = plugin_spec({**raw, "looplm_kv_policy": "shared"})
    assert [(s.part, s.layer, s.loop) for s in shared.slots] == [
        ("core", 0, None),
        ("core", 1, None),
        ("rule", None, None),
    ]
    assert {shared.slot_index("rule", None, k) for k in range(4)} == {2}
    coda = plugin_spec(
        _export_config("tiny-coreloop", {"rule": {"name": "stateloop", "options": {"mixer": "attention"}}})
    )
    assert coda.rule_attention == (1, 64)  # d_s = d = 64, mixer_head_dim 64 by default
    assert [s.part for s in coda.slots] == ["prelude"] + ["core", "core", "rule"] * 3 + ["coda"]
    assert coda.slot_index("coda", 3) == 10 and coda.slot_index("rule", None, 1) == 6
    assert plugin_spec(_export_config("tiny-stateloop")).rule_attention is None  # the identity mixer has none
    with pytest.raises(ValueError, match="has no rule attention slot"):
        plugin_spec(_export_config("tiny-stateloop")).slot_index("rule", None, 0)
    with pytest.raises(UnsupportedDesign, match="attention state mixer attends across the batch"):
        plugin_spec({**raw, "looplm_exit": {"criterion": "convergence", "threshold": 0.1}})


def test_served_loop_count_and_exit_threshold_come_from_the_config():
    spec = plugin_spec(_export_config("tiny-llama", num_loops=5))
    assert spec.num_loops == 5 and len(spec.slots) == 5 * 2
    assert plugin_spec({**_export_config("tiny-llama"), "num_loops": None}).num_loops == 3  # None = K
    gate = {"rule": {"name": "exit_gate", "options": {"threshold": 0.5}}}
    spec = plugin_spec(_export_config("tiny-llama", gate, exit_threshold=0.8))
    assert spec.loop_options == {"exit_threshold": 0.8}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_loops": 0}, "num_loops must be a positive int, got 0"),
        ({"num_loops": True}, "num_loops must be a positive int, got True"),
        ({"looplm_kv_policy": "per_loop"}, "looplm_kv_policy must be one of ['per-loop', 'shared'], got 'per_loop'"),
        ({"loop_options": {"grid": "prefix"}}, "loop_options ['grid'] are not read by the rule 'vanilla'"),
        ({"looplm": {}}, "needs the looplm ModelConfig under 'looplm'"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "architecture 'LlamaForCausalLM'"),
    ],
)
def test_bad_configs_are_refused_with_the_value(bad, message):
    with pytest.raises(ValueError) as e:
        plugin_spec({**_export_config("tiny-llama"), **bad})
    assert message in str(e.value)


_SERVED = [
    ("tiny-llama", {"rule": {"name": "injection", "options": {"form": "dense", "init_state": "normal"}}}),
    ("tiny-llama", {"rule": {"name": "history", "options": {"window": 2}}}),
    ("tiny-llama", {"rule": {"name": "timestep", "options": {"gating": "branch"}}}),
    ("tiny-llama", {"rule": {"name": "hyperloop", "options": {"n_streams": 2}}}),
    ("tiny-llama", {"rule": {"name": "mesh", "options": {"n_slots": 3}}}),
    ("tiny-llama", {"rule": {"name": "parcae"}}),
    ("tiny-llama", {"rule": {"name": "ponderlm"}}),
    ("tiny-llama", {"rule": {"name": "exit_gate"}, "norm_placement": "sandwich"}),
    ("tiny-llama", {"rule": {"name": "vanilla", "options": {"inter_norm": True}}, "norm_placement": "post-sum"}),
    ("tiny-llama", {"attention.qk_bias": True, "attention.rotary_dim": 8, "embed_scale": True}),
]


@pytest.mark.parametrize("preset, overrides", _SERVED)
def test_per_token_rules_are_served(preset, overrides):
    cfg = load_model_config(preset, overrides)
    assert refusal(cfg) is None
    assert plugin_spec(_export_config(preset, overrides)).config.rule.name == cfg.rule.name


_REFUSED = [
    # Mamba-2 designs are served (tests/test_vllm_mamba.py); what of them is refused is tested there
    ("tiny-stateloop", {"rule.options.mixer": "mamba2"}, "StateLoop's 'mamba2' state mixer mixes tokens"),
    ("tiny-llama", {"pause": {"n_pause": 2}}, "pause tokens"),
    ("tiny-llama", {"attention.sliding_window": 8}, "sliding-window attention"),
    (
        "tiny-llama",
        {"rule": {"name": "injection", "options": {"form": "dense", "init_state": "normal", "init_seed": None}}},
        "drawn afresh each forward",
    ),
    ("tiny-coreloop", {"rule": {"name": "ponderlm"}}, "PonderLM reads out every iteration through the coda"),
]


@pytest.mark.parametrize("preset, overrides, reason", _REFUSED)
def test_unservable_designs_are_refused_by_name_and_reason(preset, overrides, reason):
    cfg = load_model_config(preset, overrides)
    with pytest.raises(UnsupportedDesign) as e:
        plugin_spec(_export_config(preset, overrides), where="/models/x/config.json")
    msg = str(e.value)
    assert msg.startswith(f"/models/x/config.json: looplm's vLLM plugin cannot serve {design_name(cfg)}: ")
    assert reason in msg and f"rule {cfg.rule.name!r}" in msg and "looplm serve" in msg
    assert e.value.design == design_name(cfg) and reason in e.value.reason


@pytest.mark.parametrize(
    "preset, overrides, tp",
    [
        ("tiny-llama", {}, 2),  # 4 query heads, 2 KV heads: 2 and 1 per rank
        ("tiny-llama", {}, 4),  # 1 and 1, the 2 KV heads each replicated on 2 ranks
        ("tiny-coreloop", {}, 2),  # 1 KV head replicated on both ranks (vLLM's QKVParallelLinear does)
        ("tiny-qwen3", {"rule": {"name": "injection", "options": {"form": "dense"}}}, 2),  # rule weights replicated
        ("tiny-llama", {"rule": {"name": "timestep", "options": {"gating": "adaln"}}}, 2),
    ],
)
def test_tensor_parallel_sizes_that_split_are_served(preset, overrides, tp):
    cfg = load_model_config(preset, overrides)
    assert refusal(cfg, tp=tp) is None
    assert plugin_spec(_export_config(preset, overrides), tp=tp).config == cfg


_TP_REFUSED = [
    ("tiny-llama", {"attention.n_heads": 6, "attention.n_kv_heads": 2, "attention.head_dim": 16}, 4, "6 query heads"),
    ("tiny-llama", {"attention.n_heads": 6, "attention.n_kv_heads": 3, "attention.head_dim": 16}, 2, "3 KV heads"),
    ("tiny-llama", {"d_ff": 170}, 4, "d_ff = 170"),
    ("tiny-llama", {"rule": {"name": "ponderlm"}}, 2, "PonderLM feeds back softmax(logits)"),
]


@pytest.mark.parametrize("preset, overrides, tp, reason", _TP_REFUSED)
def test_tensor_parallel_sizes_that_do_not_split_are_refused_by_name(preset, overrides, tp, reason):
    cfg = load_model_config(preset, overrides)
    assert refusal(cfg) is None  # served at TP 1
    with pytest.raises(UnsupportedDesign) as e:
        plugin_spec(_export_config(preset, overrides), tp=tp, where="/models/x/config.json")
    msg = str(e.value)
    assert msg.startswith(f"/models/x/config.json: looplm's vLLM plugin cannot serve {design_name(cfg)}: ")
    assert reason in msg and "tensor-parallel" in msg, msg
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor-parallel size must be a positive int"):
            refusal(cfg, tp=bad)


def test_exit_setting_maps_to_looplm_exit():
    raw = _export_config("tiny-coreloop", looplm_exit={"criterion": "convergence", "threshold": 0.5})
    assert plugin_spec(raw).exit == {"criterion": "convergence", "threshold": 0.5, "kv": "copy", "min_loops": 1}
    assert plugin_spec(_export_config("tiny-coreloop")).exit is None  # default: every token runs every loop
    over = {"rule": {"name": "exit_gate", "options": {"threshold": 0.5}}}
    raw = _export_config("tiny-llama", over, exit_threshold=0.5, looplm_exit={"criterion": "gate", "threshold": 0.3})
    spec = plugin_spec(raw)
    assert spec.exit["criterion"] == "gate" and spec.loop_options["exit_threshold"] == 0.3  # q selects the output too
    raw = _export_config("tiny-llama", looplm_exit={"criterion": "kl", "threshold": 0.1, "min_loops": 2})
    assert plugin_spec(raw).exit["min_loops"] == 2


@pytest.mark.parametrize(
    "setting, message",
    [
        ("kl", "looplm_exit must be a dict"),
        ({"criterion": "entropy", "threshold": 1.0}, "criterion must be one of ['gate', 'kl', 'convergence']"),
        ({"criterion": "kl"}, "threshold for 'kl' must be a number, ε >= 0; got None"),
        ({"criterion": "kl", "threshold": -1}, "got -1"),
        ({"criterion": "kl", "threshold": 0.1, "kv": "shared"}, "kv must be one of ['copy', 'propagate']"),
        ({"criterion": "kl", "threshold": 0.1, "min_loops": 9}, "min_loops must be an int in [1, 3], got 9"),
        ({"criterion": "kl", "threshold": 0.1, "when": 1}, "unknown keys ['when']"),
    ],
)
def test_bad_exit_settings_are_refused_with_the_value(setting, message):
    with pytest.raises(ValueError) as e:
        plugin_spec(_export_config("tiny-llama", looplm_exit=setting))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "preset, setting, top, reason",
    [
        ("tiny-llama", {"criterion": "gate", "threshold": 0.5}, {}, "reads the exit gate of rule 'exit_gate'"),
        ("tiny-coreloop", {"criterion": "kl", "threshold": 0.1}, {}, "reads out every loop through the coda"),
        ("tiny-llama", {"criterion": "kl", "threshold": 0.1}, {"looplm_kv_policy": "shared"}, "per-loop KV policy"),
    ],
)
def test_exits_a_model_cannot_take_are_refused_by_name(preset, setting, top, reason):
    with pytest.raises(UnsupportedDesign) as e:
        plugin_spec(_export_config(preset, looplm_exit=setting, **top))
    assert reason in str(e.value) and design_name(load_model_config(preset)) in str(e.value)


def test_propagate_fill_only_where_no_rule_modulates_the_blocks():
    ok = _export_config("tiny-coreloop", looplm_exit={"criterion": "convergence", "threshold": 0.5, "kv": "propagate"})
    assert plugin_spec(ok).exit["kv"] == "propagate"
    over = {"rule": {"name": "timestep", "options": {"gating": "adaln"}}}
    bad = _export_config("tiny-llama", over, looplm_exit={"criterion": "kl", "threshold": 0.1, "kv": "propagate"})
    with pytest.raises(UnsupportedDesign, match="per-loop block modulation"):
        plugin_spec(bad)


def test_weight_names_map_to_the_fused_vllm_projections():
    assert vllm_param_name("looplm.core.stack.blocks.1.mixer.q_proj.weight") == (
        "core.stack.blocks.1.mixer.qkv_proj.weight",
        "q",
    )
    assert vllm_param_name("prelude.blocks.0.mixer.k_proj.bias") == ("prelude.blocks.0.mixer.qkv_proj.bias", "k")
    assert vllm_param_name("coda.blocks.0.mixer.v_proj.weight") == ("coda.blocks.0.mixer.qkv_proj.weight", "v")
    assert vllm_param_name("looplm.core.stack.blocks.0.mlp.gate_proj.weight") == (
        "core.stack.blocks.0.mlp.gate_up_proj.weight",
        0,
    )
    assert vllm_param_name("core.stack.blocks.0.mlp.up_proj.weight") == (
        "core.stack.blocks.0.mlp.gate_up_proj.weight",
        1,
    )
    for plain in (
        "looplm.embed.weight",
        "norm.weight",
        "lm_head.weight",
        "core.stack.blocks.0.mixer.o_proj.weight",
        "core.stack.blocks.0.mixer.q_norm.weight",
        "core.stack.blocks.0.mlp_out_norm.weight",
        "rule.inject.proj.weight",
        "rule.W_pre.0.weight",
    ):
        assert vllm_param_name(plain) == (plain.removeprefix("looplm."), None)


@pytest.mark.parametrize("preset", ["tiny-coreloop", "tiny-qwen3"])
def test_every_looplm_tensor_has_one_place(preset):
    from looplm.hf.export import hf_state_dict

    model = looplm.build(preset)
    names = list(hf_state_dict(model))  # what the export stores
    targets = [vllm_param_name(n) for n in names]
    assert len(set(targets)) == len(targets)  # no two tensors load into the same place
    fused = {t for t in targets if t[1] is not None}
    c = model.config
    blocks = c.n_physical
    assert len([t for t in fused if t[0].endswith("qkv_proj.weight")]) == 3 * blocks
    assert len([t for t in fused if t[0].endswith("gate_up_proj.weight")]) == 2 * blocks
    assert ("lm_head.weight", None) not in targets if c.tie_embeddings else ("lm_head.weight", None) in targets


@pytest.mark.parametrize("family, arch", [("ouro", "OuroForCausalLM"), ("huginn", "RavenForCausalLM")])
def test_original_formats_map_as_looplm_imports_them(tmp_path, family, arch):
    from looplm.hf.public import export_original, public_config
    from looplm.vllm.configs import CONFIG_CLASSES

    preset, over = {"ouro": ("ouro-1.4b", {}), "huginn": ("huginn-0125", {"n_prelude": 1, "n_coda": 1})}[family]
    over = {
        **over,
        "vocab_size": 260,
        "d_model": 64,
        "n_core": 2,
        "n_loops": 3,
        "d_ff": 128,
        "attention.n_heads": 2,
        "attention.n_kv_heads": 2,
        "attention.head_dim": 32,
        "max_seq_len": 512,
    }
    export_original(looplm.build(load_model_config(preset, over)), tmp_path, tokenizer="byte")
    raw = json.loads((tmp_path / "config.json").read_text())
    spec = plugin_spec(raw)
    assert spec.architecture == arch == raw["architectures"][0] and ARCHITECTURES[arch].endswith(f":{arch}")
    assert spec.config == public_config(raw) and spec.num_loops == 3
    hf = CONFIG_CLASSES[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    assert (hf.hidden_size, hf.num_attention_heads, hf.max_position_embeddings, hf.vocab_size) == (64, 2, 512, 260)
    assert plugin_spec(hf).config == spec.config  # the config object vLLM holds maps the same
    assert (
        CONFIG_CLASSES[raw["model_type"]]().to_dict()["model_type"] == raw["model_type"]
    )  # transformers makes a default one
    assert (
        json.loads(hf.to_json_string())["n_layers" if family == "huginn" else "num_hidden_layers"]
        == raw["n_layers" if family == "huginn" else "num_hidden_layers"]
    )
