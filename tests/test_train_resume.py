"""Kill -9 during training, resume: identical per-step losses (bit-exact, CPU fp32) and data order.

Runs the real command line (``python -m looplm.cli train``) in subprocesses.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 12
CKPT_EVERY = 3


def write_corpus(path: Path, n_docs: int = 300, seed: int = 0) -> Path:
    """A deterministic toy corpus (one document per line), independent of the Python version."""
    rng = random.Random(seed)
    words = "the a loop model state token layer weight train data core block learns small large runs fast slow".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "." for _ in range(n_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(tmp: Path, corpus: Path, **train) -> Path:
    import yaml

    cfg = {
        "model": "tiny-llama",
        "data": {
            "source": "files",
            "paths": [str(corpus)],
            "split_mode": "lines",
            "seq_len": 32,
            "shuffle_buffer": 50,
            "val_every_nth": 10,
        },
        "optim": {"name": "muon_adamw", "lr": 3e-3, "muon_lr": 3e-3},
        "schedule": {"name": "wsd"},
        "train": {
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "max_steps": MAX_STEPS,
            "precision": "fp32",
            "cpu_threads": 1,
            **train,
        },
        "eval": {"every": 6, "batches": 1},
        "checkpoint": {"every": CKPT_EVERY, "keep_last": 2},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def train_cmd(config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "looplm.cli", "train", str(config), "--out", str(out), "--quiet", *extra]


def train_in_process(config: Path, out: Path, overrides: list[str] | None = None) -> dict:
    """The same training as ``looplm train`` without a new interpreter (restores torch's thread count)."""
    import torch

    from looplm.train import Trainer, load_train_config

    threads = torch.get_num_threads()
    try:
        return Trainer(load_train_config(config, overrides), out, quiet=True).fit()
    finally:
        torch.set_num_threads(threads)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _complete_steps(out: Path) -> list[int]:
    root = out / "ckpt"
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "COMPLETE").exists())


@pytest.mark.slow
def test_kill9_then_resume_is_bit_exact(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    config = write_config(tmp_path, corpus)

    # reference: one uninterrupted run (in this process: same code, same thread count)
    ref_out = tmp_path / "ref"
    train_in_process(config, ref_out)
    ref = read_metrics(ref_out)
    assert [m["step"] for m in ref] == list(range(1, MAX_STEPS + 1))

    # interrupted run: SIGKILL at a random step after the first checkpoint was written
    kill_after = random.Random(os.getpid()).randint(CKPT_EVERY + 1, MAX_STEPS - 2)
    out = tmp_path / "run"
    slow = ("--set", "train.debug_step_sleep_s=0.15")  # so that the poll below never misses the moment
    proc = subprocess.Popen(
        train_cmd(config, out, *slow), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            n = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").exists() else 0
            if n >= kill_after and _complete_steps(out):
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"run finished before it could be killed: {proc.stderr.read()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = len(read_metrics(out))
    resumed_from = max(_complete_steps(out))
    assert resumed_from < MAX_STEPS and killed_at < MAX_STEPS

    r = subprocess.run(train_cmd(config, out), env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = read_metrics(out)
    # the file holds every step exactly once (lines after the checkpoint were dropped, then re-appended)
    assert [m["step"] for m in got] == list(range(1, MAX_STEPS + 1)), (killed_at, resumed_from)
    # per-step losses identical to the uninterrupted run, bit for bit
    assert [m["loss"] for m in got] == [m["loss"] for m in ref], (killed_at, resumed_from)
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    assert [m.get("val_loss") for m in got] == [m.get("val_loss") for m in ref]
    # the same batches in the same order: no token seen twice, none skipped
    assert [m["batch_hash"] for m in got] == [m["batch_hash"] for m in ref]
    assert len({m["batch_hash"] for m in got}) == MAX_STEPS
    assert [m["tokens"] for m in got] == [8 * 32 * s for s in range(1, MAX_STEPS + 1)]
    # keep_last: 2 complete checkpoints remain, and no temporary directory
    assert _complete_steps(out) == [MAX_STEPS - CKPT_EVERY, MAX_STEPS]
    assert not list((out / "ckpt").glob(".tmp-*"))
    run = json.loads((out / "run.json").read_text())
    assert run["resumed_from_step"] == resumed_from and run["previous"]
    from looplm.utils import cpu_malloc

    assert run["cpu_malloc_kept"] == cpu_malloc.supported()  # train.cpu_malloc auto: on for a CPU run under glibc
