"""Two gloo processes (torchrun, DDP and FSDP2) train like one process with the same global batch,
and a checkpoint written by 2 FSDP2 processes resumes on 1 process."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_resume import cli_env, read_metrics, train_cmd, train_in_process, write_config, write_corpus

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
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
        *train_cmd(config, out, *extra)[3:],
    ]
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    corpus = write_corpus(tmp / "corpus.txt")
    # global batch 8 = 1 process x 2 micro-batches of 4 = 2 processes x 1 micro-batch of 4
    config = write_config(tmp, corpus, max_steps=STEPS)
    sets = ["eval.batch_size=8", "eval.every=2", "checkpoint.every=2", "checkpoint.keep_last=0"]
    common = [a for s in sets for a in ("--set", s)]
    ref = tmp / "one"
    train_in_process(config, ref, sets)
    return tmp, config, common, sets, read_metrics(ref)


def _close(a, b, rtol):
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.kernels
@pytest.mark.slow
def test_ddp_bf16_tied_with_cpu_products_matches_one(setup):
    """bf16 on the CPU products (train.cpu_gemm: the stacked q/k/v and gate/up products, whose weight
    gradients are row blocks of one tensor) and a tied embedding (its sparse lookup gradient added into the
    head's): two DDP processes give one process's losses."""
    tmp, config, _, _, _ = setup
    sets = [
        "eval.batch_size=8",
        "eval.every=0",
        "checkpoint.every=0",
        "model_overrides.tie_embeddings=true",
        "train.precision=bf16",
        "train.cpu_gemm=true",
    ]
    train_in_process(config, tmp / "one-bf16", sets)
    ref = read_metrics(tmp / "one-bf16")
    r = _torchrun(config, tmp / "ddp-bf16", *[a for s in sets for a in ("--set", s)], "--set", "train.parallel=ddp")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp / "ddp-bf16" / "run.json").read_text())["tuned_linears"] > 0
    got = read_metrics(tmp / "ddp-bf16")
    assert _close([m["loss"] for m in got], [m["loss"] for m in ref], 1e-3), (
        [m["loss"] for m in got],
        [m["loss"] for m in ref],
    )


@pytest.mark.slow
def test_ddp_two_processes_match_one(setup):
    tmp, config, common, sets, ref = setup
    out = tmp / "ddp"
    r = _torchrun(config, out, *common, "--set", "train.parallel=ddp")
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_metrics(out)
    assert [m["batch_hash"] for m in got] == [m["batch_hash"] for m in ref]  # same global batches
    assert _close([m["loss"] for m in got], [m["loss"] for m in ref], 1e-4), (
        [m["loss"] for m in got],
        [m["loss"] for m in ref],
    )
    assert _close(
        [m["val_loss"] for m in got if "val_loss" in m], [m["val_loss"] for m in ref if "val_loss" in m], 1e-4
    )
    assert json.loads((out / "run.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_and_resume_on_one(setup):
    tmp, config, common, sets, ref = setup
    out = tmp / "fsdp"
    r = _torchrun(config, out, *common, "--set", "train.parallel=fsdp")
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_metrics(out)
    assert [m["batch_hash"] for m in got] == [m["batch_hash"] for m in ref]
    # FSDP2 reduces gradients and runs Muon's Newton-Schulz (bf16 inside torch.optim.Muon) on sharded
    # DTensors: equal up to float rounding, not bit for bit
    assert _close([m["loss"] for m in got], [m["loss"] for m in ref], 1e-4), (
        [m["loss"] for m in got],
        [m["loss"] for m in ref],
    )

    # a checkpoint written by 2 FSDP2 ranks resumes on a single process (different world size)
    resumed = tmp / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(out / "ckpt" / "step_000002", resumed / "ckpt" / "step_000002")
    train_in_process(config, resumed, sets)
    after = read_metrics(resumed)
    assert [m["step"] for m in after] == [3, 4]
    assert [m["batch_hash"] for m in after] == [m["batch_hash"] for m in ref[2:]]
    assert _close([m["loss"] for m in after], [m["loss"] for m in ref[2:]], 1e-4)
