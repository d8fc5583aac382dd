"""`looplm grid`: the Table 3 / Table 5 layout with exact parameters and FLOPs; running a task grid."""

from pathlib import Path

import pytest
import yaml

from looplm.config import ConfigError
from looplm.tasks.grid import format_table, grid_rows, load_grid
from looplm.info import model_info

REPO = Path(__file__).resolve().parents[1]


def test_table3_grid_matches_the_presets_and_the_iso_relations():
    grid = load_grid(REPO / "configs/grids/looped-mamba-table3.yaml")
    assert [(g.name, g.model) for g in grid.groups] == [
        ("Mamba-2", "mamba2-140m"),
        ("LLaMA-2 Transformer", "llama2-140m"),
    ]
    assert all(g.pairs == [[6, 1], [6, 4], [12, 1], [12, 2], [24, 1]] for g in grid.groups)  # Tab. 3 / 5 rows
    for g in grid.groups:  # three rows per backbone keep the test fast; they carry both iso relations
        g.pairs = [[6, 1], [6, 4], [24, 1]]
    rows = grid_rows(grid)
    by = {(r["group"], r["N"], r["R"]): r for r in rows}
    for arch, preset in (("Mamba-2", "mamba2"), ("LLaMA-2 Transformer", "llama2")):
        info = model_info(f"{preset}-6x4")  # the paper preset, computed on meta
        assert by[(arch, 6, 4)]["params"] == info["params"]
        assert by[(arch, 6, 4)]["flops_per_token"] == info["forward_flops_per_token"]
        # iso-parameter: N⊗R has N⊗1's parameters; iso-FLOPs: N⊗R has (NR)⊗1's FLOPs
        assert by[(arch, 6, 4)]["params"] == by[(arch, 6, 1)]["params"] < by[(arch, 24, 1)]["params"]
        assert (
            by[(arch, 6, 4)]["flops_per_token"]
            == by[(arch, 24, 1)]["flops_per_token"]
            > by[(arch, 6, 1)]["flops_per_token"]
        )
        assert by[(arch, 6, 4)]["relative"] == "6×/24×" and by[(arch, 6, 4)]["model"] == "Loop (6⊗4)"
    assert by[("Mamba-2", 24, 1)]["params"] == 139_520_448  # mamba2-140m
    table = format_table(rows, ["ppl"])
    assert "| Base (24⊗1) | 24×/24× | 139,520,448 |" in table and "**LLaMA-2 Transformer**" in table


def test_task_grid_counts_blocks_per_layer():
    rows = grid_rows(load_grid(REPO / "configs/grids/mano-table1.yaml"))
    by = {(r["N"], r["R"]): r for r in rows}
    assert by[(4, 6)]["effective_depth"] == 48  # 4 layers x 2 Mamba-2 blocks x 6 loops
    assert (
        by[(4, 6)]["flops_per_token"] == by[(24, 1)]["flops_per_token"] and by[(4, 6)]["params"] == by[(4, 1)]["params"]
    )


def test_grid_run_fills_accuracy(tmp_path, capsys):
    from looplm.cli import main

    task = {
        "task": {"name": "phop", "n": 12, "p": 2, "dense_target": True, "eval_count": 30},
        "model": "tiny-llama",
        "optim": {"name": "adamw", "lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "train": {"steps": 2, "batch_size": 4, "seeds": [0], "precision": "fp32", "cpu_threads": 1},
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    (tmp_path / "grid.yaml").write_text(
        yaml.safe_dump(
            {"kind": "task", "task_config": "task.yaml", "groups": [{"name": "T", "pairs": [[1, 1], [1, 2]]}]}
        )
    )
    assert (
        main(
            [
                "grid",
                str(tmp_path / "grid.yaml"),
                "--run",
                "--out",
                str(tmp_path / "runs"),
                "--quiet",
                "--set",
                "train.steps=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| Loop (1⊗2) | 1×/2× |" in out and "%" in out
    import json

    rows = json.loads((tmp_path / "runs" / "grid.json").read_text())
    assert [r["model"] for r in rows] == ["Base (1⊗1)", "Loop (1⊗2)"]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert json.loads((tmp_path / "runs" / "T-1x2" / "results.json").read_text())["model"] == "1⊗2"


def test_bad_grid_files_are_reported(tmp_path):
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump({"kind": "tasks", "groups": [{"name": "x", "pairs": [[0, 1], [3]]}]}))
    with pytest.raises(ConfigError) as e:
        load_grid(f)
    msg = str(e.value)
    assert "kind" in msg and "[0, 1]" in msg and "[3]" in msg
    f.write_text(yaml.safe_dump({"kind": "lm", "groups": [{"name": "x", "pairs": [[1, 1]]}]}))
    with pytest.raises(ConfigError, match="needs a model"):
        load_grid(f)


def test_lm_grid_run_trains_every_row_with_the_train_config(tmp_path):
    from looplm.tasks.grid import run_grid
    from test_train_resume import write_corpus

    corpus = write_corpus(tmp_path / "c.txt", n_docs=60)
    train = {
        "model": "tiny-mamba2",
        "data": {
            "source": "files",
            "paths": [str(corpus)],
            "split_mode": "lines",
            "seq_len": 16,
            "shuffle_buffer": 10,
            "val_every_nth": 5,
        },
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"global_batch_size": 2, "micro_batch_size": 2, "max_steps": 1, "precision": "fp32", "cpu_threads": 1},
        "eval": {"every": 0, "batches": 1, "at_end": True},
        "checkpoint": {"every": 0, "at_end": False},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    (tmp_path / "g.yaml").write_text(
        yaml.safe_dump(
            {
                "kind": "lm",
                "train_config": "train.yaml",
                "groups": [{"name": "M", "model": "tiny-mamba2", "pairs": [[1, 1], [1, 2]]}],
            }
        )
    )
    rows = run_grid(load_grid(tmp_path / "g.yaml"), tmp_path / "runs", quiet=True)
    assert [(r["N"], r["R"]) for r in rows] == [(1, 1), (1, 2)] and all(r["ppl"] > 1 for r in rows)
    assert rows[0]["params"] == rows[1]["params"] and rows[1]["flops_per_token"] > rows[0]["flops_per_token"]
    import json

    mc = json.loads((tmp_path / "runs" / "M-1x2" / "run.json").read_text())["model_config"]
    assert (mc["n_core"], mc["n_loops"]) == (1, 2)  # the row's N⊗R reached the trainer


def test_an_interrupted_grid_run_ends_with_one_line(tmp_path, capsys, monkeypatch):
    """SIGTERM during a row's training (TrainingInterrupted, its checkpoint written): one line, 128 + signal."""
    import looplm.tasks.grid as grid
    from looplm.cli import main
    from looplm.train.trainer import TrainingInterrupted

    def preempted(*args, **kwargs):
        raise TrainingInterrupted(15, 4, 10, tmp_path / "runs" / "ckpt" / "step_000004")

    monkeypatch.setattr(grid, "run_grid", preempted)
    assert main(["grid", str(REPO / "configs/grids/mano-table1.yaml"), "--run", "--out", str(tmp_path / "runs")]) == 143
    assert capsys.readouterr().err.startswith("stopped by SIGTERM after step 4 of 10: wrote checkpoint ")
