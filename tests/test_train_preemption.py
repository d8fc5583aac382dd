"""Preemption: SIGTERM / SIGINT during `looplm train` finish the step, write a complete checkpoint,
print one line naming it and exit 128 + signal; resuming from it is bit-exact; a second signal stops
at once; under torchrun every rank stops at the same step (real signals, real subprocesses)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from looplm.checkpoint_io import verify_checkpoint
from test_train_distributed import _free_port
from test_train_resume import MAX_STEPS, cli_env, read_metrics, train_cmd, train_in_process, write_config, write_corpus

SLOW = ("--set", "train.debug_step_sleep_s=0.3")  # so that the signal lands mid-run, not after the last step


def _start(config: Path, out: Path, log: Path, *extra: str, torchrun: bool = False) -> subprocess.Popen:
    cmd = train_cmd(config, out, *SLOW, *extra)
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "-m",
            "looplm.cli",
            *cmd[3:],
        ]
    return subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _stopped_line(stderr: str, name: str) -> tuple[int, Path]:
    m = re.search(
        rf"^stopped by {name} after step (\d+) of {MAX_STEPS}: wrote checkpoint (\S+); run the same command "
        "again to resume from it$",
        stderr,
        re.M,
    )
    assert m, stderr[-3000:]
    return int(m.group(1)), Path(m.group(2))


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resuming_is_bit_exact(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    config = write_config(tmp_path, corpus)  # checkpoint every 3 steps, eval every 6
    ref_out = tmp_path / "ref"
    train_in_process(config, ref_out)
    ref = read_metrics(ref_out)

    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    proc = _start(config, out, log)
    try:
        _wait_for(proc, lambda: _lines(out / "metrics.jsonl") >= 4, "4 steps were logged")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = log.read_text()
    assert rc == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr
    step, ckpt = _stopped_line(stderr, "SIGTERM")
    assert 4 <= step < MAX_STEPS
    assert ckpt == out / "ckpt" / f"step_{step:06d}" and verify_checkpoint(ckpt)["step"] == step
    got = read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, step + 1))  # the step it stopped at is complete and logged

    summary = train_in_process(config, out)  # resumes from the checkpoint the signal wrote
    assert summary["start_step"] == step
    got = read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, MAX_STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]  # bit-identical to the uninterrupted run
    assert [m["batch_hash"] for m in got] == [m["batch_hash"] for m in ref]
    assert [m.get("val_loss") for m in got] == [m.get("val_loss") for m in ref]


@pytest.mark.slow
def test_ctrl_c_is_one_line_not_a_traceback(tmp_path):
    config = write_config(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    proc = _start(config, out, log, "--set", "checkpoint.every=0")
    try:
        _wait_for(proc, lambda: _lines(out / "metrics.jsonl") >= 2, "2 steps were logged")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = log.read_text()
    assert rc == 128 + signal.SIGINT and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    step, ckpt = _stopped_line(stderr, "SIGINT")
    assert verify_checkpoint(ckpt)["step"] == step == len(read_metrics(out))


_HOLDER = """
import sys, time
from looplm.train.trainer import _StopOnSignal
stop = _StopOnSignal(announce=False)
stop.install()
print("ready", flush=True)
deadline = time.time() + float(sys.argv[1])
seen = False
while time.time() < deadline:
    if stop.signum and not seen:
        seen = print("stopping", flush=True) or True
    time.sleep(0.01)
print("signum", stop.signum, flush=True)
"""


def _holder(seconds: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(seconds)], env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_second_signal_stops_at_once_a_duplicate_does_not():
    # a second signal, later than the duplicate window: the process ends at once, by that signal
    p = _holder(60)
    p.send_signal(signal.SIGTERM)
    assert p.stdout.readline().strip() == "stopping"  # the first signal was handled: a stop request
    time.sleep(0.6)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=10) == -signal.SIGINT
    # the same request delivered twice at once (torchrun forwards the signal its workers got too) is one request
    p = _holder(3)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and out.split() == ["stopping", "signum", str(int(signal.SIGINT))]


def _worker_pid(agent: int, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` (a child of the agent with RANK=rank in its environment)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the torchrun workers through /proc")
def test_torchrun_ranks_stop_at_the_same_step_when_one_is_signalled(tmp_path):
    """SIGTERM to rank 1 only: rank 0 learns of it through the per-step all-reduce, both write the
    checkpoint of the same step (a rank that stopped alone would hang the other's collectives)."""
    config = write_config(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    proc = _start(config, out, log, "--set", "checkpoint.every=0", "--set", "eval.every=0", torchrun=True)
    try:
        _wait_for(proc, lambda: _lines(out / "metrics.jsonl") >= 2, "2 steps were logged")
        rank1 = _worker_pid(proc.pid, 1)
        assert rank1 is not None
        os.kill(rank1, signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = log.read_text()
    step, ckpt = _stopped_line(stderr, "SIGTERM")  # printed by rank 0, which was not signalled itself
    assert stderr.count("stopped by SIGTERM") == 1
    assert verify_checkpoint(ckpt)["step"] == step == len(read_metrics(out)) < MAX_STEPS
