"""Prepared memmap data: a meta.json never makes training read a file outside its directory, and a
`looplm data prepare` that fails leaves the output directory as it found it."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

from looplm.cli import main as cli_main
from looplm.data import DataConfig, MemmapStream, prepare_memmap, read_meta
from looplm.data.sources import DataError
from looplm.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()


def _jsonl(path: Path, n: int = 60) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} about loops and tokens"}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def prepared(tmp_path) -> Path:
    cfg = DataConfig(source="files", paths=[str(_jsonl(tmp_path / "c.jsonl"))], shuffle_buffer=0, val_every_nth=10)
    prepare_memmap(cfg, BYTE, tmp_path / "mm", shard_tokens=500)
    return tmp_path / "mm"


def _set_files(mm: Path, files: list[str], split: str = "train") -> Path:
    meta = json.loads((mm / "meta.json").read_text())
    meta["splits"][split]["files"] = files
    (mm / "meta.json").write_text(json.dumps(meta))
    return mm / "meta.json"


def test_a_shard_outside_the_directory_is_refused(prepared, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x01\x00" * 100)
    files = read_meta(prepared)["splits"]["train"]["files"]
    for entry, what in [
        (str(secret), "is an absolute path"),
        ("../secret.bin", "is a '..' path leading out of"),
        ("sub/../../secret.bin", "is a '..' path leading out of"),
    ]:
        meta = _set_files(prepared, [files[0], entry])
        with pytest.raises(DataError) as e:
            MemmapStream(prepared, 8)
        assert f"{meta}: splits.train.files entry {entry!r} {what}" in str(e.value)
    (prepared / "link.bin").symlink_to(secret)
    _set_files(prepared, ["link.bin"])
    with pytest.raises(DataError, match=r"entry 'link.bin' is a symbolic link leading out of .*secret.bin"):
        MemmapStream(prepared, 8)
    (prepared / "inside.bin").symlink_to(prepared / files[0])  # a link that stays inside is a shard like any
    _set_files(prepared, ["inside.bin", "./" + files[1]])
    assert MemmapStream(prepared, 8).n_windows > 0


def test_the_cli_refuses_it_in_one_line(prepared, tmp_path, capsys):
    _set_files(prepared, ["/etc/hostname"], split="val")
    cfg = {
        "model": "tiny-llama",
        "data": {"source": "memmap", "paths": [str(prepared)], "seq_len": 8},
        "train": {"max_steps": 1, "precision": "fp32", "global_batch_size": 2, "micro_batch_size": 2},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    (tmp_path / "t.yaml").write_text(json.dumps(cfg))
    assert cli_main(["train", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "splits.val.files entry '/etc/hostname' is an absolute path" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("splits"), "'splits' must map split names to their shards"),
        (lambda m: m["splits"]["train"].pop("files"), "splits.train.files must be a list"),
        (lambda m: m.update(dtype="float64"), "'dtype' must be 'uint16' or 'uint32', got 'float64'"),
        (lambda m: m["tokenizer"].pop("vocab_size"), "'tokenizer' must record the integers vocab_size and eos_id"),
    ],
)
def test_a_malformed_meta_json_is_named(prepared, edit, message):
    meta = json.loads((prepared / "meta.json").read_text())
    edit(meta)
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=message):
        MemmapStream(prepared, 8)


def test_a_corrupt_meta_json_or_truncated_shard_is_named(prepared):
    shard = prepared / read_meta(prepared)["splits"]["train"]["files"][0]
    with open(shard, "ab") as f:
        f.write(b"\x00")  # half a uint16 token
    with pytest.raises(DataError, match=rf"shard {shard} .* has 1001 bytes, not a whole number of uint16 tokens"):
        MemmapStream(prepared, 8)
    (prepared / "meta.json").write_text('{"format": "looplm-memmap", ')
    with pytest.raises(DataError, match=rf"{prepared / 'meta.json'} is not valid JSON"):
        read_meta(prepared)


# ------------------------------------------------------------------------------------ prepare
def _fail_midway(monkeypatch, after_shards: int = 2, exc: BaseException | None = None):
    """The shard writer fails after ``after_shards`` shards (a full disk, by default)."""
    from looplm.data import prepare

    real = prepare._ShardWriter._open_next

    def open_next(self):
        if len(self.files) >= after_shards:
            raise exc or OSError(errno.ENOSPC, "No space left on device")
        real(self)

    monkeypatch.setattr(prepare._ShardWriter, "_open_next", open_next)


def test_a_failed_prepare_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """The bug: tokens-00000.bin was left in --out."""
    src = _jsonl(tmp_path / "c.jsonl")
    _fail_midway(monkeypatch)
    out = tmp_path / "mm"
    rc = cli_main(["data", "prepare", "--out", str(out), "--shard-tokens", "200", str(src)])
    assert rc == 2 and "No space left on device" in capsys.readouterr().err
    assert not out.exists()  # it created the directory: gone too
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokens-00000.bin").write_bytes(b"someone else's")  # there before the command: kept
    with pytest.raises(KeyboardInterrupt):
        _fail_midway(monkeypatch, exc=KeyboardInterrupt())
        prepare_memmap([str(src)], BYTE, out, shard_tokens=200)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "tokens-00000.bin"]
    assert (out / "tokens-00000.bin").read_bytes() == b"someone else's"


def test_a_failed_overwrite_keeps_the_data_it_was_to_replace(prepared, tmp_path, monkeypatch):
    before = {p.name: p.read_bytes() for p in prepared.iterdir()}
    _fail_midway(monkeypatch, after_shards=1)
    with pytest.raises(OSError, match="No space left"):
        prepare_memmap([str(tmp_path / "c.jsonl")], BYTE, prepared, shard_tokens=100, overwrite=True)
    assert {p.name: p.read_bytes() for p in prepared.iterdir()} == before
    monkeypatch.undo()
    meta = prepare_memmap([str(tmp_path / "c.jsonl")], BYTE, prepared, shard_tokens=100_000, overwrite=True)
    assert sorted(p.name for p in prepared.iterdir()) == ["meta.json", "tokens-00000.bin"]  # the old shards replaced
    assert meta == read_meta(prepared) and MemmapStream(prepared, 8).n_windows > 0


def test_a_killed_prepares_temporary_directory_is_cleared(tmp_path):
    out = tmp_path / "mm"
    (out / ".prepare-999999999.tmp").mkdir(parents=True)  # no such process
    prepare_memmap([str(_jsonl(tmp_path / "c.jsonl"))], BYTE, out)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens-00000.bin"]
    assert np.fromfile(out / "tokens-00000.bin", dtype=np.uint16).size == read_meta(out)["splits"]["train"]["tokens"]
