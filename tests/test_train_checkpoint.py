"""Checkpoints: atomic layout, newest complete one wins, keep_last, pickle-free loading, and clear
errors naming the file for truncated / corrupted / incomplete checkpoints."""

import json

import pytest
import torch

import looplm
from looplm.checkpoint_io import CheckpointWarning
from looplm.train.checkpoint import (
    MARKER,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_for_inference,
    load_model_weights,
    resolve_checkpoint,
    save_checkpoint,
)
from looplm.train.config import OptimConfig
from looplm.train.optim import build_optimizer


def _trained(steps=2, seed=0):
    torch.manual_seed(seed)
    model = looplm.build("tiny-llama")
    opt = build_optimizer(model, OptimConfig())
    x = torch.randint(0, 256, (2, 16))
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, x


def _save(root, step, model, opt, keep_last=0):
    cfg = {"model": looplm.dataclass_util.to_dict(model.config), "tokenizer": "byte"}
    return save_checkpoint(
        root, step, model, list(opt), {"step": step, "tokens": 123, "data": {"pos": step}}, cfg, keep_last
    )


def test_layout_roundtrip_and_exact_continuation(tmp_path):
    model, opt, x = _trained()
    path = _save(tmp_path / "ckpt", 2, model, opt)
    assert path.name == "step_000002"
    files = {p.name for p in path.iterdir()}
    assert files == {
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "rng.safetensors",
        "trainer_state.json",
        "config.json",
        MARKER,
    }
    manifest = json.loads((path / MARKER).read_text())
    assert set(manifest["files"]) == files - {MARKER} and manifest["step"] == 2
    model2 = looplm.build("tiny-llama")
    opt2 = build_optimizer(model2, OptimConfig())
    state = load_checkpoint(path, model2, list(opt2))
    assert state["step"] == 2 and state["tokens"] == 123 and state["data"] == {"pos": 2}
    for _ in range(2):  # continuing from the checkpoint is bit-identical to continuing in memory
        losses = []
        for m, o in ((model, opt), (model2, opt2)):
            loss = m(x, labels=x).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model, opt, _ = _trained(1)
    path = _save(tmp_path / "ckpt", 1, model, opt)

    def forbidden(*a, **k):
        raise AssertionError("checkpoint loading must not call torch.load / pickle")

    import pickle

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    m2 = looplm.build("tiny-llama")
    load_checkpoint(path, m2, list(build_optimizer(m2, OptimConfig())))
    loaded, tok = load_model_for_inference(path)
    assert tok.vocab_size == 259
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_newest_complete_wins_and_keep_last(tmp_path):
    model, opt, _ = _trained(1)
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(root, step, model, opt, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [2, 3]  # keep_last=2 pruned step 1
    (root / "step_000003" / MARKER).unlink()  # an interrupted save: no COMPLETE marker
    assert latest_checkpoint(root).name == "step_000002"
    assert resolve_checkpoint(tmp_path).name == "step_000002"  # a run directory resolves too
    with pytest.raises(CheckpointError, match=r"step_000003.*incomplete"):
        load_checkpoint(root / "step_000003", looplm.build("tiny-llama"))
    _save(root, 3, model, opt, keep_last=2)  # saving the same step again replaces the leftover
    assert latest_checkpoint(root).name == "step_000003"
    assert not list(root.glob(".tmp-*"))


@pytest.mark.parametrize(
    "victim", ["model.safetensors", "optimizer.safetensors", "optimizer.json", "trainer_state.json"]
)
def test_truncated_file_is_named(tmp_path, victim):
    model, opt, _ = _trained(1)
    path = _save(tmp_path / "ckpt", 1, model, opt)
    f = path / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    m2 = looplm.build("tiny-llama")
    with pytest.raises(CheckpointError, match=rf"{victim}.*truncated"):
        load_checkpoint(path, m2, list(build_optimizer(m2, OptimConfig())))


def test_corrupted_and_missing_files_are_named(tmp_path):
    model, opt, _ = _trained(1)
    path = _save(tmp_path / "ckpt", 1, model, opt)
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF  # same size, flipped bits in the weights
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted.*SHA-256"):
        load_checkpoint(path, looplm.build("tiny-llama"))
    # without hash verification, a truncated safetensors file still fails with the file's name
    path2 = _save(tmp_path / "ckpt2", 1, model, opt)
    f2 = path2 / "model.safetensors"
    f2.write_bytes(f2.read_bytes()[:100])
    (path2 / MARKER).unlink()
    with (
        pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupted)"),
        pytest.warns(CheckpointWarning, match="no COMPLETE manifest"),
    ):  # it cannot be verified, and says so
        load_model_weights(path2, looplm.build("tiny-llama"), verify=False)
    (path / "optimizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.json.*missing"):
        load_checkpoint(path, looplm.build("tiny-llama"), verify=False)


def test_wrong_model_is_a_clear_error(tmp_path):
    model, opt, _ = _trained(1)
    path = _save(tmp_path / "ckpt", 1, model, opt)
    other = looplm.build("tiny-llama", d_model=32, d_ff=64)
    with pytest.raises(CheckpointError, match="do not fit this model"):
        load_model_weights(path, other)
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "empty_run")
