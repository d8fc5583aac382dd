"""Starting a looped model from a pretrained stack: layer map, loop schedule, `looplm train` wiring."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.checkpoint_io import CheckpointError
from looplm.data.tokenizers import ByteTokenizer
from looplm.dataclass_util import ConfigError
from looplm.hf.importer import write_checkpoint
from looplm.hf.retrofit import apply_layer_map, even_core_map, layer_prefix, loops_at


pytestmark = pytest.mark.usefixtures("one_thread")


def _pretrained(tmp_path, n_layers=6, **kw):
    """An unlooped 'pretrained' stack (0, L, 1, 0) with random weights, saved as a checkpoint."""
    torch.manual_seed(0)
    m = looplm.build("tiny-llama", n_core=n_layers, n_loops=1, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval(), write_checkpoint(tmp_path / "pre", m, ByteTokenizer())


def test_layer_map_copies_the_chosen_layers(tmp_path):
    src, ckpt = _pretrained(tmp_path)
    tgt = looplm.build("tiny-llama", n_prelude=1, n_core=2, n_loops=3, n_coda=1, overrides={"rule.name": "injection"})
    rule_before = {k: v.clone() for k, v in tgt.rule.state_dict().items()}
    msg = apply_layer_map(tgt, ckpt, {"prelude": [0], "core": [2, 4], "coda": [5]})
    assert "dropped [1, 3]" in msg
    s = src.state_dict()
    for dst_layer, src_layer in ((0, 0), (1, 2), (2, 4), (3, 5)):
        dp, sp = layer_prefix(tgt.config, dst_layer), layer_prefix(src.config, src_layer)
        for k, v in tgt.state_dict().items():
            if k.startswith(dp):
                assert torch.equal(v, s[sp + k[len(dp) :]]), k
    for k in ("embed.weight", "norm.weight", "lm_head.weight"):
        assert torch.equal(tgt.state_dict()[k], s[k])
    assert all(torch.equal(v, rule_before[k]) for k, v in tgt.rule.state_dict().items())  # new rule keeps its init


def test_identity_map_at_one_loop_reproduces_the_pretrained_model(tmp_path):
    src, ckpt = _pretrained(tmp_path, n_layers=4)
    tgt = looplm.build("tiny-llama", n_prelude=1, n_core=2, n_loops=1, n_coda=1)
    apply_layer_map(tgt, ckpt, {"prelude": [0], "core": [1, 2], "coda": [3]})
    ids = torch.randint(0, 200, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(tgt.eval()(ids).logits, src(ids).logits, rtol=0, atol=1e-6)
        assert not torch.allclose(tgt(ids, num_loops=2).logits, src(ids).logits)  # looping changes it


def test_layer_map_errors(tmp_path):
    _, ckpt = _pretrained(tmp_path, n_layers=3)
    tgt = looplm.build("tiny-llama", n_prelude=0, n_core=2, n_loops=2, n_coda=0)
    with pytest.raises(CheckpointError, match="layers 0..2"):
        apply_layer_map(tgt, ckpt, {"core": [1, 7]})
    with pytest.raises(CheckpointError, match="without pretrained weights"):
        apply_layer_map(tgt, ckpt, {"core": [1]})
    wide = looplm.build("tiny-llama", d_ff=64, n_core=2)
    with pytest.raises(CheckpointError, match="shape"):
        apply_layer_map(wide, ckpt, {"core": [0, 1]})


def test_loop_schedule_and_even_map():
    sched = [[0, 1], [10, 2], [20, 4]]
    assert [loops_at(sched, s) for s in (0, 9, 10, 19, 20, 99)] == [1, 1, 2, 2, 4, 4]
    assert even_core_map(30, 2, 4, 2) == {"prelude": [0, 1], "core": [2, 10, 19, 27], "coda": [28, 29]}


def _train_cfg(corpus, ckpt, **train):
    from looplm.train import load_train_config

    return load_train_config(
        {
            "model": str(ckpt / "model.yaml"),
            "model_overrides": {"n_prelude": 1, "n_core": 2, "n_loops": 3, "n_coda": 1},
            "data": {
                "source": "files",
                "paths": [str(corpus)],
                "split_mode": "lines",
                "seq_len": 16,
                "shuffle_buffer": 10,
                "val_every_nth": 0,
            },
            "train": {
                "global_batch_size": 2,
                "micro_batch_size": 2,
                "max_steps": 4,
                "precision": "fp32",
                "cpu_threads": 1,
                "init_from": str(ckpt),
                **train,
            },
            "eval": {"every": 0, "batches": 1, "at_end": False},
            "checkpoint": {"every": 0, "at_end": True},
            "logging": {"progress_bar": False, "tensorboard": False},
        }
    )


def test_train_config_validates_the_map_and_schedule(tmp_path):
    _, ckpt = _pretrained(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be\n" * 50)
    with pytest.raises(ConfigError) as e:
        _train_cfg(
            corpus,
            ckpt,
            init_map={"prelude": [0], "core": [1], "coda": [5], "middle": [2]},
            loop_schedule=[[5, 1], [2, 0]],
        )
    msg = str(e.value)
    assert "init_map.core: lists 1 layer(s) but the model has n_core=2" in msg and "unknown part(s) ['middle']" in msg
    assert "steps must start at 0" in msg and "loop counts must be >= 1" in msg


def test_looplm_train_retrofits_and_follows_the_schedule(tmp_path):
    from looplm.train import Trainer

    src, ckpt = _pretrained(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i} of a small corpus to be or not to be\n" for i in range(200)))
    cfg = _train_cfg(
        corpus, ckpt, init_map={"prelude": [0], "core": [2, 3], "coda": [5]}, loop_schedule=[[0, 1], [2, 3]]
    )
    Trainer(cfg, tmp_path / "run", quiet=True).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("num_loops") for r in rows] == [1, 1, 3, 3]
    saved = json.loads(next((tmp_path / "run" / "ckpt").glob("step_*/config.json")).read_text())
    assert saved["train"]["train"]["init_map"] == {"prelude": [0], "core": [2, 3], "coda": [5]}
    assert saved["train"]["train"]["loop_schedule"] == [[0, 1], [2, 3]]
    from looplm.hf.retrofit import retrofit_summary

    lines = retrofit_summary(saved)
    assert "core     <- pretrained layers [2, 3]" in "\n".join(lines) and "step 2: r = 3" in lines[-1]
    # `looplm info RUN` shows the model of the run and its layer map
    from looplm.cli import main as cli_main

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["info", str(tmp_path / "run")]) == 0
    text = buf.getvalue()
    assert "(1, 2, " in text and "core     <- pretrained layers [2, 3]" in text and "retrofitted from" in text
