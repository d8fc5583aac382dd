"""Guards around a training run: one trainer per output directory, the tokenizer a checkpoint was
trained with, a limit on consecutive skipped updates, and no silent defaults from an empty YAML."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from looplm.data.tokenizers import TokenizerMismatchError, load_tokenizer, train_bpe
from looplm.dataclass_util import ConfigError
from looplm.train import Trainer, TrainingDivergedError, load_train_config
from looplm.train.cli import main
from looplm.train.run_lock import LOCK_FILE, RunDirLock, RunDirLockedError
from test_train_loop import _restore_threads, corpus, tiny  # noqa: F401  (fixtures)
from test_train_resume import cli_env, read_metrics, write_corpus


# ----------------------------------------------------------------------------------- run directory lock
def test_second_trainer_on_the_same_directory_is_refused_then_resume_works(corpus, tmp_path):
    out = tmp_path / "run"
    first = Trainer(tiny(corpus, "checkpoint.at_end=true", max_steps=3, debug_step_sleep_s=0.3), out, quiet=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(first.fit()))
    thread.start()
    try:
        deadline = time.time() + 60
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert time.time() < deadline and thread.is_alive(), "the first trainer did not start"
            time.sleep(0.02)
        # a second trainer on the same --out fails at once, naming the directory and the holder
        second = tiny(corpus, "checkpoint.at_end=true", max_steps=5)
        with pytest.raises(RunDirLockedError, match=rf"run directory '{out}' is in use by another .*pid {os.getpid()}"):
            Trainer(second, out, quiet=True).fit()
    finally:
        thread.join(timeout=120)
    assert result["steps"] == 3
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]  # untouched by the refused trainer
    # the first run is done: a new run in the same directory resumes from its checkpoint
    summary = Trainer(tiny(corpus, "checkpoint.at_end=true", max_steps=5), out, quiet=True).fit()
    assert (summary["start_step"], summary["steps"]) == (3, 5)
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_cli_refuses_a_locked_directory(corpus, tmp_path, capsys):
    import yaml

    out = tmp_path / "run"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny(corpus, max_steps=1).to_dict()))
    with RunDirLock(out):
        assert main(["train", str(tmp_path / "c.yaml"), "--out", str(out), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: run directory") and f"pid {os.getpid()}" in err
        assert main(["demo", "--config", str(tmp_path / "c.yaml"), "--out", str(out)]) == 1
        assert "is in use by another" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(out), "--quiet"]) == 0


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom looplm.train.run_lock import RunDirLock\n"
            f"lock = RunDirLock({str(out)!r}).acquire()\nprint('locked', flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=rf"pid {holder.pid} on host"):
            RunDirLock(out).acquire()
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with RunDirLock(out) as lock:  # no stale lock after kill -9
        assert lock.held


# ----------------------------------------------------------------------------------- nan_policy: skip
def test_too_many_consecutive_skipped_updates_stop_the_run(corpus, tmp_path):
    cfg = tiny(corpus, debug_nan_at_step=2, debug_nan_steps=10, nan_policy="skip", max_consecutive_skips=3, max_steps=8)
    with pytest.raises(
        TrainingDivergedError,
        match=r"step 4: the loss is nan, and the 3 updates of steps 2-4 were all "
        r"skipped .*max_consecutive_skips=3.*unchanged since step 1",
    ):
        Trainer(cfg, tmp_path / "run", quiet=True).fit()
    recs = read_metrics(tmp_path / "run")
    assert [m["step"] for m in recs] == [1, 2, 3] and [bool(m.get("skipped")) for m in recs] == [False, True, True]
    assert not (tmp_path / "run" / "ckpt").exists()  # no checkpoint of a diverged model
    # fewer skips in a row than the limit: the run continues (the count restarts after a good update)
    cfg = tiny(corpus, debug_nan_at_step=2, debug_nan_steps=2, nan_policy="skip", max_consecutive_skips=3, max_steps=4)
    assert Trainer(cfg, tmp_path / "ok", quiet=True).fit()["steps"] == 4
    with pytest.raises(ConfigError, match="max_consecutive_skips: must be >= 1"):
        tiny(corpus, max_consecutive_skips=0)


# ----------------------------------------------------------------------------------- empty YAML
def test_empty_or_comment_only_yaml_is_refused(corpus, tmp_path, capsys):
    for text in ("", "# only a comment\n\n# and another\n", "{}\n"):
        (tmp_path / "t.yaml").write_text(text)
        with pytest.raises(ConfigError, match=r"t\.yaml: the file is empty or holds only comments"):
            load_train_config(tmp_path / "t.yaml")
    assert main(["train", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "error: invalid training config" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    (tmp_path / "model.yaml").write_text("# a model config still to be written\n")
    with pytest.raises(ConfigError, match=r"model: .*model\.yaml: the file is empty"):
        load_train_config({"model": str(tmp_path / "model.yaml")})


# ----------------------------------------------------------------------------------- tokenizer fingerprint
def _bpe(directory, text):
    return train_bpe(None, 260, directory, texts=[text * 30])  # vocab 260 fits tiny-llama


def test_a_replaced_tokenizer_is_refused_on_resume_eval_and_generate(corpus, tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    original = _bpe(tok_dir, "the loop model state token layer ")
    cfg = tiny(corpus, f"data.tokenizer={tok_dir}", "checkpoint.at_end=true", max_steps=2)
    Trainer(cfg, tmp_path / "run", quiet=True).fit()
    record = json.loads(next((tmp_path / "run" / "ckpt").glob("step_*/config.json")).read_text())
    assert record["tokenizer_fingerprint"] == original.fingerprint()

    replaced = _bpe(tok_dir, "completely other words here ")  # same path, same vocab size
    assert replaced.vocab_size == original.vocab_size and replaced.fingerprint() != original.fingerprint()
    both = rf"{replaced.fingerprint()}.*{original.fingerprint()}"
    with pytest.raises(TokenizerMismatchError, match=rf"tokenizer at '{tok_dir}.*' has fingerprint {both}"):
        Trainer(tiny(corpus, f"data.tokenizer={tok_dir}", max_steps=3), tmp_path / "run", quiet=True).fit()
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]

    from looplm.cli import main as looplm_main

    (tmp_path / "doc.txt").write_text("the loop model")
    assert looplm_main(["eval", "ppl", str(tmp_path / "run"), "--data", str(tmp_path / "doc.txt")]) == 2
    assert f"has fingerprint {replaced.fingerprint()}" in capsys.readouterr().err
    assert looplm_main(["generate", "--checkpoint", str(tmp_path / "run"), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the tokenizer at") and original.fingerprint() in err


def test_checkpoint_without_a_fingerprint_warns(tmp_path):
    import looplm
    from looplm.checkpoint_io import CheckpointWarning, load_model_for_inference
    from looplm.dataclass_util import to_dict
    from looplm.train.checkpoint import save_checkpoint

    _bpe(tmp_path / "tok", "old run words ")
    model = looplm.build("tiny-llama")
    old_record = {"model": to_dict(model.config), "tokenizer": str(tmp_path / "tok")}  # as written before fingerprints
    save_checkpoint(tmp_path / "run" / "ckpt", 1, model, None, {"step": 1}, old_record)
    with pytest.warns(CheckpointWarning, match=r"records no tokenizer fingerprint .*cannot be checked"):
        _, tok = load_model_for_inference(tmp_path / "run")
    assert tok.vocab_size == 260


def test_data_state_and_memmap_record_the_tokenizer(tmp_path):
    from looplm.data import DataConfig, MemmapStream, build_stream, prepare_memmap

    a, b = _bpe(tmp_path / "a", "alpha beta gamma "), _bpe(tmp_path / "b", "delta epsilon zeta ")
    cfg = DataConfig(
        source="files",
        paths=[str(write_corpus(tmp_path / "c.txt"))],
        split_mode="lines",
        seq_len=16,
        shuffle_buffer=4,
        val_every_nth=0,
    )
    stream = build_stream(cfg, a)
    stream.next_batch(2)
    state = stream.state_dict()
    assert state["tokenizer_fingerprint"] == a.fingerprint()
    with pytest.raises(TokenizerMismatchError, match=rf"{b.fingerprint()}.*the saved data state.*{a.fingerprint()}"):
        build_stream(cfg, b).load_state_dict(state)
    del state["tokenizer_fingerprint"]  # a state written before fingerprints: accepted
    build_stream(cfg, a).load_state_dict(state)

    prepare_memmap(cfg, a, tmp_path / "mm")
    MemmapStream(tmp_path / "mm", 16, tokenizer=load_tokenizer(str(tmp_path / "a")))
    with pytest.raises(TokenizerMismatchError, match=r"memmap directory .*re-prepare"):
        MemmapStream(tmp_path / "mm", 16, tokenizer=b)


def test_fingerprints_are_deterministic(tmp_path):
    from looplm.data import ByteTokenizer

    tok = _bpe(tmp_path / "t", "some words to learn merges from ")
    assert load_tokenizer(str(tmp_path / "t")).fingerprint() == tok.fingerprint()  # reloaded from its files
    assert ByteTokenizer().fingerprint() == "sha256:dcd77b8200ad9e6c"  # the same in every process and version
    assert tok.fingerprint() != ByteTokenizer().fingerprint()
