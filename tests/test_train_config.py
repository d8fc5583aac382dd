"""TrainConfig: YAML + overrides, one error listing every problem, every shipped YAML is valid."""

from pathlib import Path

import pytest
import torch

import looplm
from looplm.dataclass_util import ConfigError
from looplm.train.config import TrainConfig, load_train_config
from looplm.train.optim import MUON, plan_param_groups

REPO = Path(__file__).resolve().parents[1]
# the training configs, and the bench's language models (`looplm bench adaptive --lm-config`)
SHIPPED = sorted((REPO / "configs" / "train").glob("*.yaml")) + sorted(
    (REPO / "configs" / "bench").glob("adaptive-lm*.yaml")
)


def test_defaults_and_overrides():
    cfg = load_train_config(
        {"model": "tiny-llama"},
        ["optim.lr=1e-3", "train.max_steps=7", "train.random_loops.max=5", "schedule.name=cosine", "data.seq_len=32"],
    )
    assert isinstance(cfg, TrainConfig)
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 7 and cfg.schedule.name == "cosine"
    assert cfg.train.random_loops is not None and cfg.train.random_loops.max == 5 and cfg.train.random_loops.min == 1
    assert (
        cfg.optim.weight_decay == 0.1 and cfg.optim.momentum == 0.95 and cfg.optim.nesterov and cfg.optim.ns_steps == 5
    )
    assert cfg.train.grad_clip == 1.0 and cfg.train.seed == 42 and cfg.train.precision == "bf16"
    assert cfg.to_dict()["optim"]["betas"] == [0.9, 0.95]


def test_unknown_keys_one_error_with_suggestions():
    bad = {
        "model": "tiny-llama",
        "optim": {"learning_rate": 1e-3, "wieght_decay": 0.1},
        "trian": {},
        "train": {"max_step": 3, "precision": "fp16"},
        "data": {"seq_lenn": 64},
        "schedule": {"name": "linear"},
    }
    with pytest.raises(ConfigError) as ei:
        load_train_config(bad)
    msg = str(ei.value)
    errors = ei.value.errors
    assert len(errors) == 7, msg
    assert "optim.wieght_decay: unknown key (did you mean 'weight_decay'?)" in msg
    assert "trian: unknown key (did you mean 'train'?)" in msg
    assert "train.max_step: unknown key (did you mean 'max_steps'?)" in msg
    assert "data.seq_lenn: unknown key (did you mean 'seq_len'?)" in msg
    assert "optim.learning_rate: unknown key" in msg
    assert "train.precision" in msg and "fp16" in msg
    assert "schedule.name" in msg


def test_cross_section_and_model_errors_are_reported():
    with pytest.raises(ConfigError) as ei:
        load_train_config(
            {
                "model": "tiny-llama",
                "model_overrides": {"n_loopz": 2},
                "train": {"global_batch_size": 6, "micro_batch_size": 4},
            }
        )
    msg = str(ei.value)
    assert "n_loopz" in msg and "n_loops" in msg  # model override typo, with a suggestion
    assert "global_batch_size" in msg
    with pytest.raises(ConfigError, match="max_seq_len"):
        load_train_config({"model": "tiny-llama", "data": {"seq_len": 100000}})
    with pytest.raises(ConfigError, match="unknown preset"):
        load_train_config({"model": "tiny-lama"})


def test_yaml_file_and_set_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model: tiny-llama\ntrain: {max_steps: 5}\n")
    cfg = load_train_config(p, ["train.max_steps=9", "model_overrides.n_loops=2"])
    assert cfg.train.max_steps == 9 and cfg.model_config().n_loops == 2
    with pytest.raises(FileNotFoundError):
        load_train_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_train_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_is_valid(path):
    cfg = load_train_config(path)
    mcfg = cfg.model_config()
    assert cfg.data.seq_len <= mcfg.max_seq_len
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    tiny = mcfg.d_model <= 256
    model = looplm.build(mcfg, device=None if tiny else "meta")  # big models: no memory
    assert model.num_params() > 0
    plan = plan_param_groups(model, use_muon=cfg.optim.name == "muon_adamw")
    if cfg.optim.name == "muon_adamw":
        assert plan.names(MUON)
    else:
        assert not plan.names(MUON)


def test_paper_recipes_match_the_papers():
    q = load_train_config(REPO / "configs/train/qwen3-baseloop-wsd.yaml")
    assert (
        q.optim.name,
        q.schedule.name,
        q.schedule.warmup_fraction,
        q.schedule.decay_fraction,
        q.schedule.min_ratio,
    ) == ("muon_adamw", "wsd", 0.05, 0.1, 0.1)
    assert (q.optim.momentum, q.optim.nesterov, q.optim.ns_steps, q.optim.weight_decay) == (0.95, True, 5, 0.1)
    assert (q.train.grad_clip, q.train.precision, q.train.seed, q.data.shuffle_buffer, q.data.seq_len) == (
        1.0,
        "bf16",
        42,
        10000,
        2048,
    )
    assert q.train.global_batch_size // q.train.micro_batch_size == 8 * 8  # 8 GPUs x 8 accumulation steps
    m = load_train_config(REPO / "configs/train/looped-mamba-cosine.yaml")
    assert (m.optim.name, tuple(m.optim.betas), m.optim.weight_decay, m.optim.lr) == ("adamw", (0.9, 0.95), 0.1, 8e-4)
    assert (m.schedule.name, m.schedule.warmup_fraction, m.schedule.min_ratio) == ("cosine", 0.1, 0.1)
    assert (m.train.global_batch_size, m.train.seed, m.train.precision) == (1024, 3407, "bf16")


def test_tiny_demo_config_is_the_stable_interface():
    cfg = load_train_config(REPO / "configs/train/tiny.yaml")
    assert cfg.model == "tiny-llama" and cfg.data.source == "stdlib" and cfg.train.precision in ("auto", "bf16")
    assert torch.device(cfg.train.device if cfg.train.device != "auto" else "cpu").type == "cpu"


# ------------------------------------------------------------------------------------- hostile YAML
BOMB = (
    "\n".join(  # 9 levels of 9 aliases: ~390 million values once expanded, a few hundred bytes on disk
        [f"l0: &l0 [{', '.join(['lol'] * 9)}]"]
        + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
        + ["model_overrides: *l8", "model: tiny-llama"]
    )
    + "\n"
)


def test_an_alias_bomb_is_refused_at_parse_time_with_a_short_message(tmp_path):
    import time

    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 700
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as ei:
        load_train_config(tmp_path / "bomb.yaml")
    assert time.perf_counter() - t0 < 2  # was: about a minute and gigabytes, then an empty MemoryError
    msg = str(ei.value)
    assert "bomb.yaml" in msg and "aliases expand to more than 100,000 values" in msg and len(msg) < 1000
    # a recursive alias is refused too; aliases within the limit (and merge keys) still work
    (tmp_path / "rec.yaml").write_text("model: tiny-llama\nmodel_overrides: &a {x: *a}\n")
    with pytest.raises(ConfigError, match="recursive alias"):
        load_train_config(tmp_path / "rec.yaml")
    (tmp_path / "ok.yaml").write_text(
        "base: &b {max_steps: 3, seed: 1}\nmodel: tiny-llama\ntrain:\n  <<: *b\n  seed: 2\n"
    )
    data = looplm.dataclass_util.read_yaml_file(tmp_path / "ok.yaml", "x")
    assert data["train"] == {"max_steps": 3, "seed": 2}


def test_error_messages_show_a_bounded_summary_of_a_value():
    huge = [list(range(1000))] * 1000  # a million values behind one key
    with pytest.raises(ConfigError) as ei:
        load_train_config({"model": "tiny-llama", "train": {"max_steps": huge}, "optim": {"name": "x" * 100_000}})
    assert len(str(ei.value)) < 1000 and "train.max_steps: expected an integer, got [[0, 1, 2" in str(ei.value)


def test_a_duplicate_key_is_refused_naming_both_lines(tmp_path):
    (tmp_path / "dup.yaml").write_text("model: tiny-llama\ntrain:\n  max_steps: 3\n  seed: 1\n  max_steps: 5\n")
    with pytest.raises(ConfigError) as ei:
        load_train_config(tmp_path / "dup.yaml")
    msg = str(ei.value)
    assert "found the key 'max_steps' twice (first on line 3)" in msg and "line 5" in msg


def test_python_tags_stay_refused(tmp_path):
    (tmp_path / "py.yaml").write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="could not determine a constructor"):
        load_train_config(tmp_path / "py.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.grad_clip=nan", "train.grad_clip: got NaN"),  # would switch clipping off
        ("train.grad_clip=.inf", "grad_clip: must be a finite number"),
        ("optim.lr=inf", "lr / muon_lr: must be finite numbers >= 0, got inf"),  # was accepted until step 2
        ("optim.muon_lr=nan", "optim.muon_lr: got NaN"),
        ("optim.weight_decay=inf", "weight_decay: must be a finite number"),
        ("schedule.warmup_fraction=nan", "schedule.warmup_fraction: got NaN"),
    ],
)
def test_non_finite_numbers_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("/", "/")):
        load_train_config({"model": "tiny-llama"}, [override])
