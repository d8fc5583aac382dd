"""Resuming and checkpointing refuse what no run writes, instead of training on it: a hand-edited
trainer_state.json (negative step, a learning rate outside the schedule's range), a changed model config,
and a checkpoint write that fails on a full disk (no traceback, no .tmp-step_* left, the previous one intact)."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from looplm.cli import main as cli_main
from looplm.train import Trainer, load_train_config
from looplm.train.checkpoint import MARKER, CheckpointError, latest_checkpoint


def _config(tmp_path: Path, **train) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the loop model learns token {i} of the small data." for i in range(200)) + "\n")
    cfg = {
        "model": "tiny-llama",
        "data": {
            "source": "files",
            "paths": [str(corpus)],
            "split_mode": "lines",
            "seq_len": 16,
            "shuffle_buffer": 8,
            "val_every_nth": 0,
        },
        "optim": {"name": "adamw", "lr": 1e-2},
        "schedule": {"name": "wsd", "warmup_steps": 1},
        "train": {
            "global_batch_size": 2,
            "micro_batch_size": 2,
            "max_steps": 2,
            "precision": "fp32",
            "cpu_threads": 1,
            "compile": False,
            **train,
        },
        "eval": {"at_end": False},
        "checkpoint": {"every": 1, "keep_last": 0},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, out: Path, overrides: list[str] | None = None) -> dict:
    import torch

    threads = torch.get_num_threads()
    try:
        return Trainer(load_train_config(config, overrides), out, quiet=True).fit()
    finally:
        torch.set_num_threads(threads)


def _edit_state(ckpt: Path, **changes) -> None:
    """Edit trainer_state.json and re-hash it in COMPLETE (so only the values can be wrong)."""
    f = ckpt / "trainer_state.json"
    state = json.loads(f.read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            state[k] = {**state.get(k, {}), **v}
        else:
            state[k] = v
    f.write_text(json.dumps(state))
    manifest = json.loads((ckpt / MARKER).read_text())
    manifest["files"]["trainer_state.json"] = {
        "bytes": f.stat().st_size,
        "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
    }
    (ckpt / MARKER).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-step run with a checkpoint at each step (copied per test: resume attempts may write)."""
    tmp = tmp_path_factory.mktemp("run")
    config = _config(tmp)
    _train(config, tmp / "out")
    return config, tmp / "out"


@pytest.fixture
def run(trained, tmp_path) -> tuple[Path, Path]:
    import shutil

    config, out = trained
    shutil.copytree(out, tmp_path / "out")
    return config, tmp_path / "out"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"step": -5}, "has step=-5: must be a whole number >= 0"),
        ({"step": 1}, "has step=1, but the checkpoint is step_000002"),
        ({"tokens": -1}, "has tokens=-1: must be a whole number >= 0"),
        ({"step": "2"}, "has step='2': must be a whole number >= 0"),
        (
            {"schedule": {"multiplier_next": -1.0}},
            "schedule.multiplier_next gives the multiplier -1.0, a learning rate of -0.01, outside the schedule's range [0, 0.01]",
        ),
        ({"schedule": {"multiplier_next": float("nan")}}, "outside the schedule's range [0, 0.01]"),
    ],
)
def test_a_resumed_state_no_run_writes_is_refused(run, changes, message):
    config, out = run
    ckpt = latest_checkpoint(out / "ckpt")
    _edit_state(ckpt, **changes)
    with pytest.raises(CheckpointError) as e:
        _train(config, out, ["train.max_steps=4"])
    assert str(ckpt / "trainer_state.json") in str(e.value) and message in str(e.value)


def test_a_negative_step_never_trains_with_a_negative_lr(run, capsys):
    """The issue's case through the command line: one line, exit 1, no step trained."""
    config, out = run
    ckpt = latest_checkpoint(out / "ckpt")
    _edit_state(ckpt, step=-5)
    lines = (out / "metrics.jsonl").read_text()
    rc = cli_main(["train", str(config), "--out", str(out), "--quiet", "--max-steps", "4"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: checkpoint file") and "step=-5" in err and "Traceback" not in err
    assert (out / "metrics.jsonl").read_text() == lines


def test_a_step_beyond_max_steps_is_refused(run):
    config, out = run
    with pytest.raises(CheckpointError, match=r"has step=2, beyond train.max_steps=1: nothing is left to train"):
        _train(config, out, ["train.max_steps=1"])
    assert _train(config, out)["start_step"] == 2  # the same max_steps: a finished run, nothing to do


def test_a_changed_model_config_is_refused_naming_each_field(run, capsys):
    config, out = run
    ckpt = latest_checkpoint(out / "ckpt")
    with pytest.raises(CheckpointError) as e:
        _train(config, out, ["model_overrides.n_loops=5", "train.max_steps=3"])
    msg = str(e.value)
    assert f"checkpoint {str(ckpt)!r} was trained with another model config: n_loops 3 -> 5" in msg
    assert "--allow-model-change" in msg
    rc = cli_main(
        [
            "train",
            str(config),
            "--out",
            str(out),
            "--quiet",
            "--max-steps",
            "3",
            "--set",
            "model_overrides.n_loops=5",
            "--set",
            "model_overrides.max_seq_len=64",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "n_loops 3 -> 5" in err and "max_seq_len" in err and "Traceback" not in err
    assert latest_checkpoint(out / "ckpt") == ckpt  # nothing trained


def test_an_allowed_model_change_is_warned_and_recorded(run, capsys):
    config, out = run
    rc = cli_main(
        [
            "train",
            str(config),
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--set",
            "model_overrides.n_loops=5",
            "--allow-model-change",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (
        "warning: resuming" in err and "with a changed model config (train.allow_model_change): n_loops 3 -> 5" in err
    )
    run_json = json.loads((out / "run.json").read_text())
    change = run_json["model_changed_on_resume"]
    assert change["changes"] == {"n_loops": [3, 5]} and change["checkpoint"].endswith("step_000002")
    assert run_json["model_config"]["n_loops"] == 5


def test_a_full_disk_while_checkpointing_says_so_and_leaves_nothing(run, monkeypatch, capsys):
    """ENOSPC in the middle of a checkpoint: no traceback, no .tmp-step_* directory, and the message names the
    file, the reason and the previous complete checkpoint (intact)."""
    import safetensors.torch

    config, out = run
    prev = latest_checkpoint(out / "ckpt")
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if Path(filename).name == "optimizer.safetensors":
            Path(filename).write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    rc = cli_main(["train", str(config), "--out", str(out), "--quiet", "--max-steps", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert err.startswith("error: could not write checkpoint step_000003: writing ")
    assert "step_000003" in err and "optimizer.safetensors' failed (No space left on device, ENOSPC)" in err
    assert f"the previous complete checkpoint {str(prev)!r} is intact" in err
    assert not list((out / "ckpt").glob(".tmp-step_*")) and not (out / "ckpt" / "step_000003").exists()
    assert latest_checkpoint(out / "ckpt") == prev
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert _train(config, out, ["train.max_steps=3"])["start_step"] == 2  # resumes from the intact one


def test_a_full_disk_at_the_first_checkpoint_says_there_is_none(tmp_path, monkeypatch):
    import looplm.train.checkpoint as ck

    config = _config(tmp_path)

    def full_disk(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "_write_json", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"optimizer.json' failed \(No space left on device, ENOSPC\).*there is no earlier complete checkpoint",
    ):
        _train(config, tmp_path / "out")
    assert not list((tmp_path / "out" / "ckpt").glob(".tmp-step_*"))


# ------------------------------------------------------------------ bad values of `looplm train` / `looplm plot`
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "schedule.warmup_steps=5",
            r"schedule: warmup \(5\) \+ decay \(0\) exceed the 2 training updates.*train.max_steps=2",
        ),
        ("train.seed=99999999999999999999999", r"train.seed: must be in \[0, 2\*\*63\)"),
        ("train.cpu_threads=100000", r"train.cpu_threads: must be in \[1, 1024\] or null, got 100000"),
        (
            "train.random_loops={'distribution': 'poisson', 'mean': 1e300}",
            r"random_loops.mean: the poisson distribution needs a mean in \(0, 1e6\]",
        ),
    ],
)
def test_values_that_failed_mid_run_are_config_errors(tmp_path, override, message):
    """Each reached a traceback (an overflow, a thread that could not start, a float32 overflow at the first
    step) or was said only after the model was built; now the config is refused as it is read."""
    from looplm.dataclass_util import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_train_config(_config(tmp_path), [override])


def test_a_cuda_device_on_a_machine_without_one_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    rc = cli_main(
        ["train", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--quiet", "--set", "train.device=cuda"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err == "error: train.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'\n"


def test_missing_val_paths_are_refused_before_training(tmp_path, capsys):
    """They were read at the first evaluation: after the whole run had trained."""
    rc = cli_main(
        [
            "train",
            str(_config(tmp_path)),
            "--out",
            str(tmp_path / "out"),
            "--quiet",
            "--set",
            f"data.val_paths=['{tmp_path}/no-such-val.txt']",
            "--set",
            "eval.at_end=true",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no files match" in err and "no-such-val.txt" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not (tmp_path / "out" / "metrics.jsonl").read_text()


def test_lines_of_metrics_jsonl_that_are_not_records_are_dropped(tmp_path, capsys):
    """A metrics.jsonl with JSON lines that are not records (an edit, another tool) stopped `looplm train`
    (AttributeError in truncate_metrics) and `looplm plot`."""
    from looplm.train.metrics import read_metrics, truncate_metrics

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('5\n[1]\n{"step": "x"}\n{"step": 1, "loss": 2.0}\n{"step": 3, "loss": 1.0}\n')
    assert read_metrics(out)[-2:] == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.0}]
    assert truncate_metrics(out / "metrics.jsonl", 1) == 4
    assert read_metrics(out) == [{"step": 1, "loss": 2.0}]
    (out / "metrics.jsonl").write_text("5\n[1]\n")
    rc = cli_main(["plot", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{out / 'metrics.jsonl'} has no training steps to plot" in err
    assert _train(_config(tmp_path), out)["steps"] == 2  # a fresh run clears them


def test_plot_without_matplotlib_is_one_line(run, monkeypatch, capsys):
    import sys

    _, out = run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli_main(["plot", str(out)]) == 1
    assert capsys.readouterr().err == "error: plotting needs matplotlib: pip install 'looplm[plot]'\n"


def test_a_data_state_the_stream_cannot_read_names_the_file(run):
    config, out = run
    ckpt = latest_checkpoint(out / "ckpt")
    _edit_state(ckpt, data={"packer": 5})  # (merged into the state: its kind and fingerprint are still right)
    with pytest.raises(
        CheckpointError, match=r"trainer_state.json': its 'data' entry is not a data-stream state this run can read"
    ):
        _train(config, out, ["train.max_steps=3"])
