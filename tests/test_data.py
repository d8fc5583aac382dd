"""The data layer: config checks, sources, the shuffle/pack pipeline, exact resume, memmap, CLI."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
import torch

from looplm.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    EmptyCorpusError,
    ListSource,
    MemmapStream,
    Packer,
    Selection,
    ShuffleBuffer,
    StreamExhausted,
    TokenStream,
    build_stream,
    iter_val_batches,
    make_source,
    pack_documents,
    prepare_memmap,
    read_meta,
    shard_batch,
)
from looplm.data.stdlib_corpus import collect_stdlib_docs
from looplm.dataclass_util import ConfigError, from_dict

BYTE = ByteTokenizer()
EOS = BYTE.eos_id


def make_docs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of random letters, of very different lengths (3 .. ~115 bytes)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return [f"d{i}:" + "".join(rng.choices(letters, k=rng.choice([0, 1, 3, 10, 40, 110]))) for i in range(n)]


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")
    return path


def tokens_of(docs):
    out = []
    for d in docs:
        out += list(d.encode()) + [EOS]
    return out


def drain_docs(stream: TokenStream) -> list[str]:
    return list(stream.iter_documents())


# ----------------------------------------------------------------------------------- config
def test_config_validation_reports_everything():
    with pytest.raises(ConfigError) as e:
        from_dict(DataConfig, {"source": "files", "seq_len": 1, "shufle_buffer": 3, "val_every_nth": 1, "max_docs": 0})
    msg = str(e.value)
    assert "seq_len: must be >= 2, got 1" in msg
    assert "shufle_buffer: unknown key (did you mean 'shuffle_buffer'" in msg
    assert "paths: source 'files' needs at least one path" in msg
    assert "val_every_nth: must be 0 (no hold-out) or >= 2, got 1" in msg
    assert "max_docs: must be >= 1" in msg
    with pytest.raises(ConfigError, match="source: must be one of"):
        from_dict(DataConfig, {"source": "web"})
    with pytest.raises(ConfigError, match="seq_len: must be >= 2"):  # a config built by hand is checked too
        build_stream(DataConfig(seq_len=1), BYTE)
    with pytest.raises(ConfigError, match="exactly one directory"):
        from_dict(DataConfig, {"source": "memmap", "paths": ["a", "b"]})
    cfg = from_dict(DataConfig, {"source": "files", "paths": ["x.jsonl"], "val_first_n": 10})
    assert cfg.holdout() == ("first_n", 10)
    assert DataConfig().holdout() == ("every_nth", 50)
    assert DataConfig(val_every_nth=0).holdout() == ("none", 0)
    assert from_dict(DataConfig, {"source": "files", "paths": ["d"], "format": "memmap"}).kind == "memmap"
    assert DataConfig(source="files", paths=["hf:org/name"]).kind == "hf"


# ---------------------------------------------------------------------------------- sources
def test_sources_txt_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("first doc\nline two\n\nsecond para\n", encoding="utf-8")
    (tmp_path / "txt" / "b.txt").write_text("other file", encoding="utf-8")
    docs = list(make_source(DataConfig(source="files", paths=[str(tmp_path / "txt")])))
    assert docs == ["first doc\nline two\n\nsecond para\n", "other file"]  # one file = one document
    cfg = DataConfig(source="files", paths=[str(tmp_path / "txt" / "*.txt")], split_mode="blank_lines")
    assert list(make_source(cfg)) == ["first doc\nline two", "second para", "other file"]

    write_jsonl(tmp_path / "b.jsonl", ["j1", "j2"], field="body")
    write_jsonl(tmp_path / "a.jsonl", ["j0"], field="body")
    src = make_source(DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], text_field="body"))
    assert list(src) == ["j0", "j1", "j2"]  # sorted file order
    assert list(src.iter_from(2)) == ["j2"]  # the resume position: documents consumed
    with pytest.raises(DataError, match="no field 'text'.*'body'"):
        list(make_source(DataConfig(source="files", paths=[str(tmp_path / "a.jsonl")])))

    pq.write_table(pa.table({"content": ["p0", "p1", "p2"], "n": [0, 1, 2]}), tmp_path / "t.parquet")
    cfg = DataConfig(source="files", paths=[str(tmp_path / "t.parquet")], text_field="content", max_docs=2)
    assert list(make_source(cfg)) == ["p0", "p1"]


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no files match '.*data/\*\.jsonl'"):
        make_source(DataConfig(source="files", paths=[str(tmp_path / "data" / "*.jsonl")]))
    (tmp_path / "a.txt").write_text("x")
    write_jsonl(tmp_path / "b.jsonl", ["y"])
    with pytest.raises(ValueError, match="mix file formats"):
        make_source(DataConfig(source="files", paths=[str(tmp_path)]))
    (tmp_path / "c.csv").write_text("z")
    with pytest.raises(ValueError, match="cannot tell the format"):
        make_source(DataConfig(source="files", paths=[str(tmp_path / "c.csv")]))
    # an empty corpus is reported when the stream starts, not as an endless loop
    write_jsonl(tmp_path / "empty.jsonl", ["", "  ", "\n"])
    cfg = DataConfig(source="files", paths=[str(tmp_path / "empty.jsonl")], val_every_nth=0, seq_len=4)
    with pytest.raises(EmptyCorpusError, match="no non-empty documents"):
        build_stream(cfg, BYTE).next_batch(1)


def test_hub_dataset_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stream = build_stream(DataConfig(source="files", paths=["hf:org/name"], seq_len=8), BYTE)
    with pytest.raises(ValueError, match="hub is not reachable"):
        stream.next_batch(1)


def test_stdlib_corpus():
    docs = collect_stdlib_docs()
    assert len(docs) > 2000, len(docs)
    assert len(set(docs)) == len(docs) and min(map(len, docs)) >= 40
    assert sum(map(len, docs)) > 500_000
    assert collect_stdlib_docs() is docs  # cached in memory, nothing on disk
    src = make_source(DataConfig(max_docs=100))
    assert list(src) == docs[:100]


# ----------------------------------------------------------------------------- pack + shuffle
def test_no_bos_eos_packing_and_tail_dropped():
    src = ListSource(["ab", "c", "", "defg"])  # the empty document is skipped
    stream = TokenStream(src, BYTE, 3, shuffle_buffer=0, epochs=1)
    a, b, c, d, e, f, g = (ord(ch) for ch in "abcdefg")
    assert stream.next_batch(2).tolist() == [[a, b, EOS], [ord("c"), EOS, d]]
    assert stream.next_batch(1).tolist() == [[e, f, g]]
    with pytest.raises(StreamExhausted):  # only [EOS] is left: the incomplete tail is dropped
        stream.next_batch(1, allow_partial=True)
    assert pack_documents([[1, 2], [3]], 2, 9) == [[1, 2], [9, 3]]  # tail [9] dropped
    p = Packer(4, 0)
    p.add_document([5, 6, 7, 8, 9])
    assert p.rows_ready() == 1 and p.take(1) == [5, 6, 7, 8] and p.state_dict()["carry"] == [9, 0]


def test_shuffle_buffer_permutation_seeds_and_state():
    items = list(range(500))
    out42 = list(ShuffleBuffer(64, 42).shuffle(items))
    assert sorted(out42) == items and out42 != items
    assert list(ShuffleBuffer(64, 42).shuffle(items)) == out42
    assert list(ShuffleBuffer(64, 7).shuffle(items)) != out42
    assert list(ShuffleBuffer(0, 42).shuffle(items)) == items
    # save in the middle, restore into a fresh buffer (through JSON), continue identically
    a = ShuffleBuffer(64, 42)
    got = [x for x in (a.push(i) for i in range(100)) if x is not None]
    state = json.loads(json.dumps(a.state_dict()))
    b = ShuffleBuffer(64, 42)
    b.load_state_dict(state)
    rest_a = list(a.shuffle(range(100, 500)))
    assert list(b.shuffle(range(100, 500))) == rest_a
    assert sorted(got + rest_a) == items
    with pytest.raises(ValueError, match="same data.shuffle_buffer"):
        ShuffleBuffer(32, 42).load_state_dict(state)


# --------------------------------------------------------------------------------- resume
def check_exact_resume(make_stream, batch_size, steps, save_points, sizes=None):
    """Run a reference stream; at each save point, a fresh stream restored from JSON must match."""
    ref = make_stream()
    states, batches, partial = {}, [], False
    for step in range(steps):
        if step in save_points:
            states[step] = json.dumps(ref.state_dict())
            shuffle_state = getattr(ref, "shuffle", None)
            if isinstance(shuffle_state, ShuffleBuffer) and 0 < len(shuffle_state) < shuffle_state.size:
                partial = True
        batches.append(ref.next_batch(batch_size))
    for step, blob in states.items():
        fresh = make_stream()
        fresh.load_state_dict(json.loads(blob))
        for k in range(step, steps):
            assert torch.equal(fresh.next_batch(batch_size), batches[k]), f"diverged at batch {k} (saved at {step})"
    return batches, partial


def test_exact_resume_files(tmp_path):
    docs = make_docs(120)
    write_jsonl(tmp_path / "a.jsonl", docs[:70])
    write_jsonl(tmp_path / "b.jsonl", docs[70:])
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], seq_len=16, shuffle_buffer=20, val_every_nth=10)
    # ~3.4k train tokens per epoch -> ~27 batches of 8x16 per epoch: 70 steps cross 2 epoch ends,
    # save points fall mid-document, while the buffer drains (partially filled) and after a new epoch
    batches, partial = check_exact_resume(lambda: build_stream(cfg, BYTE), 8, 70, {0, 1, 5, 23, 25, 26, 27, 40, 55})
    assert partial, "no save point caught a partially filled shuffle buffer"
    flat = torch.cat(batches).flatten().tolist()
    assert flat.count(EOS) > 100  # documents really cross row and batch boundaries
    # the training stream never contains a held-out (every 10th) document
    train_docs = drain_docs(build_stream(cfg, BYTE, epochs=1))
    val_docs = drain_docs(build_stream(cfg, BYTE, split="val"))
    assert val_docs == docs[9::10]
    assert sorted(train_docs + val_docs) == sorted(docs) and train_docs != [d for d in docs if d not in val_docs]


def test_exact_resume_stdlib():
    cfg = DataConfig(source="stdlib", seq_len=64, shuffle_buffer=50, max_docs=150)
    check_exact_resume(lambda: build_stream(cfg, BYTE), 4, 40, {0, 3, 17, 33})


def test_resume_rejects_other_config(tmp_path):
    cfg = DataConfig(source="stdlib", seq_len=32, shuffle_buffer=10, max_docs=60)
    state = build_stream(cfg, BYTE).state_dict()
    with pytest.raises(ValueError, match="seq_len: saved 32, now 64"):
        longer = DataConfig(source="stdlib", seq_len=64, shuffle_buffer=10, max_docs=60)
        build_stream(longer, BYTE).load_state_dict(state)
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    other = DataConfig(source="files", paths=[str(tmp_path / "a.jsonl")], seq_len=32, shuffle_buffer=10)
    with pytest.raises(ValueError, match="saved for source 'stdlib'"):
        build_stream(other, BYTE).load_state_dict(state)


def test_distributed_global_batch_and_world_size_change():
    cfg = DataConfig(source="stdlib", seq_len=32, shuffle_buffer=30, max_docs=120)
    single = build_stream(cfg, BYTE)
    reference = [single.next_batch(8) for _ in range(6)]
    # two ranks: each builds the same global stream and keeps its rows
    ranks = [build_stream(cfg, BYTE) for _ in range(2)]
    for k in range(3):
        parts = [shard_batch(r.next_batch(8), i, 2) for i, r in enumerate(ranks)]
        assert torch.equal(torch.cat(parts), reference[k])
    # resume the 2-rank run on 4 ranks
    state = json.loads(json.dumps(ranks[0].state_dict()))
    four = [build_stream(cfg, BYTE) for _ in range(4)]
    for r in four:
        r.load_state_dict(state)
    for k in range(3, 6):
        parts = [shard_batch(r.next_batch(8), i, 4) for i, r in enumerate(four)]
        assert torch.equal(torch.cat(parts), reference[k])
    with pytest.raises(ValueError, match="multiple of the world size"):
        shard_batch(reference[0], 0, 3)


# ------------------------------------------------------------------------------ validation
def test_validation_splits(tmp_path):
    docs = make_docs(60)
    write_jsonl(tmp_path / "train.jsonl", docs)
    write_jsonl(tmp_path / "val.jsonl", ["held out one", "held out two"])
    base = dict(source="files", paths=[str(tmp_path / "train.jsonl")], seq_len=8, shuffle_buffer=0)
    held = Selection("every_nth", 4, "val")
    assert [i for i in range(12) if held.keep(i)] == [3, 7, 11]  # the 4th, 8th, 12th documents
    assert Selection("first_n", 5, "train").start == 5 and Selection("first_n", 5, "val").stop == 5
    # first N documents
    cfg = DataConfig(**base, val_first_n=5)
    assert drain_docs(build_stream(cfg, BYTE, split="val")) == docs[:5]
    assert drain_docs(build_stream(cfg, BYTE, epochs=1)) == docs[5:]
    # separate files: training uses everything
    cfg = DataConfig(**base, val_paths=[str(tmp_path / "val.jsonl")])
    assert drain_docs(build_stream(cfg, BYTE, split="val")) == ["held out one", "held out two"]
    assert drain_docs(build_stream(cfg, BYTE, epochs=1)) == docs
    # deterministic: the same batches every time, last batch partial, stream finite
    cfg = DataConfig(**base, val_every_nth=4)
    runs = [list(iter_val_batches(cfg, BYTE, None, 4)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and len(runs[0]) == len(runs[1])
    assert torch.cat(runs[0]).flatten().tolist() == tokens_of(docs[3::4])[: len(torch.cat(runs[0]).flatten())]
    assert len(list(iter_val_batches(cfg, BYTE, 1, 4))) == 1
    with pytest.raises(ValueError, match="no validation split"):
        build_stream(DataConfig(**base, val_every_nth=0), BYTE, split="val")


def test_stdlib_validation_every_50th():
    cfg = DataConfig(source="stdlib", seq_len=64, max_docs=500)
    assert drain_docs(build_stream(cfg, BYTE, split="val")) == collect_stdlib_docs()[49:500:50]


# ----------------------------------------------------------------------------------- memmap
@pytest.fixture()
def prepared(tmp_path):
    docs = make_docs(200, seed=1)
    write_jsonl(tmp_path / "c.jsonl", docs)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "c.jsonl")], shuffle_buffer=32, val_every_nth=20)
    meta = prepare_memmap(cfg, BYTE, tmp_path / "mm", shard_tokens=1000)
    return docs, cfg, meta, tmp_path / "mm"


def test_prepare_memmap_layout(prepared):
    docs, cfg, meta, out = prepared
    assert meta == read_meta(out)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == {
        "name": "byte",
        "vocab_size": 259,
        "eos_id": 256,
        "bos_id": 257,
        "fingerprint": BYTE.fingerprint(),
    }
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["docs"] == 190 and val["docs"] == 10
    assert len(train["files"]) > 1 and all(s == 1000 for s in train["shard_sizes"][:-1])
    # the train tokens are exactly the shuffled document stream (no BOS, EOS after each document)
    train_docs = drain_docs(build_stream(cfg, BYTE, epochs=1))
    on_disk = np.concatenate([np.fromfile(out / f, dtype=np.uint16) for f in train["files"]]).tolist()
    assert on_disk == tokens_of(train_docs) and train["tokens"] == len(on_disk)
    val_disk = np.concatenate([np.fromfile(out / f, dtype=np.uint16) for f in val["files"]]).tolist()
    assert val_disk == tokens_of(docs[19::20])
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare_memmap(cfg, BYTE, out)


def test_memmap_stream_epochs_and_resume(prepared):
    docs, cfg, meta, out = prepared
    seq = 24
    mcfg = DataConfig(source="memmap", paths=[str(out)], seq_len=seq, seed=3)
    stream = build_stream(mcfg, BYTE)
    assert isinstance(stream, MemmapStream)
    n = stream.n_windows
    assert n == meta["splits"]["train"]["tokens"] // seq
    all_tokens = np.concatenate(
        [np.fromfile(out / f, dtype=np.uint16) for f in meta["splits"]["train"]["files"]]
    ).astype(np.int64)
    windows = {tuple(all_tokens[i * seq : (i + 1) * seq].tolist()): i for i in range(n)}
    assert len(windows) == n  # windows are distinct, so a row tells us which window it is
    rows = torch.cat([stream.next_batch(1) for _ in range(2 * n)])
    ids = [windows[tuple(r)] for r in rows.tolist()]  # every row is a window (crossing shards too)
    epoch0, epoch1 = ids[:n], ids[n:]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))  # each exactly once
    assert epoch0 != epoch1  # a new permutation per epoch
    # same seed -> same order; exact resume with batches crossing the epoch boundary
    check_exact_resume(lambda: build_stream(mcfg, BYTE), 5, 2 * n // 5 + 3, {0, 7, n // 5, n // 5 + 1})
    # the format: memmap spelling selects the same stream
    same = build_stream(DataConfig(source="files", format="memmap", paths=[str(out)], seq_len=seq, seed=3), BYTE)
    assert torch.equal(same.next_batch(4), rows[:4])
    # validation windows: in order, finite
    val = list(iter_val_batches(mcfg, BYTE, None, 4))
    flat_val = torch.cat(val).flatten().tolist()
    val_tokens = tokens_of(docs[19::20])
    assert flat_val == val_tokens[: len(flat_val)] and len(flat_val) == seq * (len(val_tokens) // seq)
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'"):
        build_stream(mcfg, _FakeTokenizer(70000))
    with pytest.raises(ValueError, match="memmap"):
        build_stream(DataConfig(source="stdlib", seq_len=seq), BYTE).load_state_dict(stream.state_dict())


class _FakeTokenizer(ByteTokenizer):
    """A byte tokenizer pretending to have a big vocabulary (exercises the uint32 path)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.name, self.vocab_size, self.eos_id = "fake", vocab_size, vocab_size - 1


def test_memmap_uint32_and_errors(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["hello world", "more"])
    meta = prepare_memmap([str(tmp_path / "a.jsonl")], _FakeTokenizer(70000), tmp_path / "mm")
    assert meta["dtype"] == "uint32" and "val" not in meta["splits"]
    arr = np.fromfile(tmp_path / "mm" / "tokens-00000.bin", dtype=np.uint32).tolist()
    assert arr == list(b"hello world") + [69999] + list(b"more") + [69999]
    stream = MemmapStream(tmp_path / "mm", 4, tokenizer=_FakeTokenizer(70000), shuffle=False)
    assert stream.next_batch(2).tolist() == [arr[:4], arr[4:8]]
    with pytest.raises(ValueError, match="no 'val' split"):
        MemmapStream(tmp_path / "mm", 4, split="val")
    with pytest.raises(EmptyCorpusError, match="fewer than one window"):
        MemmapStream(tmp_path / "mm", 1000)
    with pytest.raises(FileNotFoundError, match="looplm data prepare"):
        MemmapStream(tmp_path, 4)


# -------------------------------------------------------------------------------------- CLI
def test_cli_data_prepare(tmp_path, capsys):
    from looplm.data.cli import register

    parser = argparse.ArgumentParser(prog="looplm")
    register(parser.add_subparsers(dest="command", required=True))
    write_jsonl(tmp_path / "a.jsonl", make_docs(100))
    args = parser.parse_args(
        ["data", "prepare", "--out", str(tmp_path / "mm"), "--seq-len", "16", str(tmp_path / "a.jsonl")]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "train: 98 docs" in out and "val  : 2 docs" in out and "windows of 16" in out
    assert read_meta(tmp_path / "mm")["seq_len_hint"] == 16
    args = parser.parse_args(
        ["data", "prepare", "--stdlib", "--max-docs", "200", "--val-every-nth", "0", "--out", str(tmp_path / "std")]
    )
    assert args.func(args) == 0
    assert read_meta(tmp_path / "std")["splits"]["train"]["docs"] == 200
    args = parser.parse_args(["data", "prepare", "--stdlib", "--out", str(tmp_path / "std")])
    with pytest.raises(SystemExit, match="overwrite"):
        args.func(args)
    args = parser.parse_args(["data", "prepare", "--out", str(tmp_path / "x"), str(tmp_path / "none*.jsonl")])
    with pytest.raises(SystemExit, match="no files match"):
        args.func(args)


# ------------------------------------------------------------------------------- bad input files
def files_cfg(path, **kw):
    return DataConfig(source="files", paths=[str(path)], val_every_nth=0, seq_len=4, shuffle_buffer=0, **kw)


def test_rows_without_text_fail_by_default_with_count_and_line(tmp_path):
    rows = [{"text": "a0"}, {"body": "no text"}, {"text": "a2"}, {"text": None}, {"text": "a4"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataError,
        match=r"m\.jsonl: 2 row\(s\) have no 'text' value \(missing or null\), the first at "
        r"line 2 \(its fields: \['body'\]\).*missing_text: skip",
    ):
        list(build_stream(files_cfg(tmp_path / "m.jsonl"), BYTE, epochs=1).iter_documents())
    # skip-with-warning: the other rows, in order; the skipped rows still count as source positions
    with pytest.warns(UserWarning) as caught:
        docs = list(build_stream(files_cfg(tmp_path / "m.jsonl", missing_text="skip"), BYTE, epochs=1).iter_documents())
    assert docs == ["a0", "a2", "a4"]
    messages = [str(w.message) for w in caught]
    assert any("skipping rows without text" in m and "first at line 2" in m for m in messages)
    assert any("skipped 2 row(s) without a 'text' value" in m for m in messages)
    with pytest.raises(ConfigError, match="missing_text: must be one of"):
        from_dict(DataConfig, {"missing_text": "drop"})


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EmptyCorpusError, match=r"empty\.jsonl: the file\(s\) are empty"):
        build_stream(files_cfg(tmp_path / "empty.jsonl"), BYTE).next_batch(1)
    (tmp_path / "latin1.txt").write_bytes("fine line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt line 2 is not valid UTF-8 \(byte 0xe9 at column 4\)"):
        build_stream(files_cfg(tmp_path / "latin1.txt"), BYTE).next_batch(1)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(DataError, match=r"broken\.jsonl line 2 is not valid JSON"):
        build_stream(files_cfg(tmp_path / "broken.jsonl"), BYTE).next_batch(1)
    write_jsonl(tmp_path / "body.jsonl", ["x", "y"], field="body")
    with pytest.raises(DataError, match=r"no field 'text'; their fields are \['body', 'id'\]"):
        build_stream(files_cfg(tmp_path / "body.jsonl"), BYTE).next_batch(1)


def test_cli_reports_bad_data_without_a_traceback(tmp_path, capsys):
    from looplm.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "m.jsonl").write_text('{"text": "a"}\n{"other": 1}\n')
    for name, expected in [
        ("empty.jsonl", r"error: .*the file\(s\) are empty"),
        ("m.jsonl", "error: .*the first at line 2"),
    ]:
        with pytest.raises(SystemExit, match=expected):  # a message and exit status 1, no traceback
            main(["data", "prepare", "--out", str(tmp_path / "mm"), str(tmp_path / name)])
    cfg = {
        "model": "tiny-llama",
        "data": {"source": "files", "paths": [str(tmp_path / "m.jsonl")], "seq_len": 8},
        "train": {"max_steps": 1, "precision": "fp32"},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    (tmp_path / "t.yaml").write_text(json.dumps(cfg))
    assert main(["train", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "m.jsonl: 1 row(s) have no 'text' value" in err


def test_stream_modules_import_no_cycle():
    """memmap (the reader) and pipeline share looplm.data.stream instead of importing each other."""
    import ast
    import importlib

    def local_imports(module):
        tree = ast.parse(open(importlib.import_module(module).__file__).read())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}

    assert local_imports("looplm.data.memmap") <= {"sources", "stream", "tokenizers", "config"}
    assert "prepare" not in local_imports("looplm.data.pipeline")
    assert {"memmap", "pipeline", "stream"} <= local_imports("looplm.data.prepare")
