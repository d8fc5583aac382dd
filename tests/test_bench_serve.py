"""``looplm bench serve``: the load generator's bounds and records, the summary, the targets, the command.

A live server on 127.0.0.1 at a free port (tiny-coreloop, random weights); every load is bounded in count
and time. The benchmark's numbers are not tested here (a benchmark, run by hand: docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

import looplm

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from looplm.bench.serve import Load, RequestRecord, _check, held_out_prompts, markdown, run_load, summarize, targets  # noqa: E402
from looplm.data.tokenizers import ByteTokenizer  # noqa: E402
from looplm.serve import Engine, EngineConfig  # noqa: E402
from looplm.serve.app import build_app  # noqa: E402
from looplm.serve.server import Server  # noqa: E402

PROMPTS = ["The loop ", "Once upon a time", "A looped model runs its core again, ", "12345 "]


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    model = looplm.build("tiny-coreloop").eval()
    eng = Engine(model, EngineConfig(max_batch=4, exit="kl:0.006"))
    s = Server(build_app(eng, ByteTokenizer(), "tiny"), host="127.0.0.1", port=0, grace_s=2.0).start()
    try:
        yield s, model.config.n_loops
    finally:
        s.stop()


def test_a_concurrency_load_sends_its_count_and_records_every_stream(server):
    s, K = server
    recs, wall = asyncio.run(run_load(s.url, "tiny", PROMPTS, Load("concurrency", 2), 6, 5, 60.0, {"ignore_eos": True}))
    assert len(recs) == 5 and all(r.ok for r in recs), [r.error for r in recs]
    assert all(r.completion_tokens == 6 and r.prompt_tokens > 0 for r in recs)
    assert all(r.t_send < r.t_first <= r.t_end for r in recs) and all(1 <= r.loops <= K for r in recs)
    out = summarize(recs, wall, kv_bytes_per_position=1000.0)
    assert out["finished"] == 5 and out["completion_tokens"] == 30
    assert out["tokens_per_s"] == pytest.approx(30 / wall) and 0 < out["ttft_ms_p50"] <= out["ttft_ms_p99"]
    assert out["itl_ms_p50"] <= out["itl_ms_p99"] and 1 <= out["loops_per_token"] <= K
    assert out["kv_bytes_per_request"] == pytest.approx(1000.0 * sum(r.prompt_tokens + 6 for r in recs) / 5)


def test_a_rate_load_stops_sending_at_its_duration_and_cancels_what_runs_past_it(server):
    s, _ = server
    t = time.perf_counter()
    # 0.2 requests/s for 0.5 s: the first is sent at once, the next ones (seconds later) never
    recs, _ = asyncio.run(run_load(s.url, "tiny", PROMPTS, Load("rate", 0.2), 4, 10, 0.5, {"ignore_eos": True}, seed=1))
    assert len(recs) == 1 and recs[0].ok and time.perf_counter() - t < 30
    # a request longer than the bound (duration 0.3 s, so at most ~1.3 s for what is in flight) is cancelled
    recs, _ = asyncio.run(
        run_load(
            s.url,
            "tiny",
            PROMPTS,
            Load("concurrency", 1),
            400,
            3,
            0.3,
            {"ignore_eos": True, "looplm": {"exit": "none"}},
        )
    )
    assert len(recs) == 1
    assert recs[0].ok or recs[0].error == "cancelled at the load's time bound"


def test_a_refused_request_is_recorded_not_raised(server):
    s, _ = server
    recs, wall = asyncio.run(run_load(s.url, "no-such-model", PROMPTS, Load("concurrency", 1), 4, 2, 30.0))
    assert len(recs) == 2 and not any(r.ok for r in recs) and all("HTTP 404" in r.error for r in recs)
    out = summarize(recs, wall)
    assert out["finished"] == 0 and out["errors"] and out["tokens_per_s"] != out["tokens_per_s"]  # NaN


def test_targets_and_table_from_rows():
    def row(c, load, tps, loops=None, e2e=100.0, **kw):
        return {
            "contender": c,
            "load": load,
            "sent": 4,
            "finished": 4,
            "tokens_per_s": tps,
            "loops_per_token": loops,
            "e2e_ms_p50": e2e,
            **kw,
        }

    rows = [
        row("full", "c=1", 30.0, 4.0, e2e=210.0),
        row("full", "c=8", 150.0, 4.0),
        row("exit", "c=8", 200.0, 2.5),
        row("one", "c=8", 30.0, 4.0),
        row("generate", "c=1", 32.0, e2e=200.0, paired_server_e2e_ms_p50=212.0),
        row("transformers", "c=8", 100.0),
        row("exit-prefill", "c=8", 240.0, 2.5),
    ]
    batching = next(t for t in targets(rows, K=4) if "one-at-a-time" in t["target"])
    assert batching["target"].startswith("c=8 streams") and batching["met"] and batching["value"] == "5.00x"
    exit_t = next(t for t in targets(rows, 4) if "exit" in t["target"])
    assert exit_t["met"] == (200.0 >= 150.0 / (1.1 * 2.5 / 4))
    prefill_t = next(t for t in targets(rows, 4) if t["target"].startswith("c=8: exit-prefill"))
    assert prefill_t["met"] and prefill_t["value"] == "240.0 vs 218.2 (executed 2.50 / 4)"
    over = next(t for t in targets(rows, 4) if "overhead" in t["target"])
    assert over["value"] == "+6.0%" and over["met"]  # the paired medians, not the loads'
    ahead = next(t for t in targets(rows, 4) if "transformers" in t["target"])
    assert ahead["value"] == "1.50x" and ahead["met"]
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| exit | c=8 | 4/4 | 200.0 | 1.33 |" in table
    assert not [
        t for t in targets(rows, 4) if "vLLM" in t["target"] or "batch" in t["target"]
    ]  # not measured: not judged


def test_vllm_exit_contender_serves_the_plugins_exit_from_the_exit_flag():
    from looplm.bench.serve import vllm_exit_args

    args = vllm_exit_args("convergence:0.05", ["--enforce-eager"])
    assert args[:2] == ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]  # --enforce-eager given already
    assert args[2] == "--hf-overrides"
    assert json.loads(args[3]) == {"looplm_exit": {"criterion": "convergence", "threshold": 0.05}}
    assert vllm_exit_args("kl:0.01", [])[0] == "--enforce-eager"


def test_engine_targets_against_batched_generate_and_vllm():
    def row(c, load, tps, **kw):
        return {"contender": c, "load": load, "sent": 4, "finished": 4, "tokens_per_s": tps, "e2e_ms_p50": 100.0, **kw}

    rows = [
        row("full", "c=1", 20.0, ttft_ms_p50=90.0, itl_ms_p50=52.0),
        row("full", "c=8", 150.0, ttft_ms_p50=300.0),
        row("generate", "c=1", 21.0, itl_ms_p50=50.0),
        row("generate", "c=8", 160.0, itl_ms_p50=48.0),
        row("vllm", "c=1", 21.5, ttft_ms_p50=135.0),
        row("vllm", "c=8", 126.0, ttft_ms_p50=250.0),
    ]
    got = {t["target"]: t for t in targets(rows, 1)}
    assert got["c=8: looplm serve >= 0.9x model.generate at batch 8"]["value"] == "0.94x"
    assert got["c=8: looplm serve >= 0.9x model.generate at batch 8"]["met"]
    assert (
        got["c=8: looplm serve tok/s >= 1.25x vLLM"]["value"] == "1.19x"
        and not got["c=8: looplm serve tok/s >= 1.25x vLLM"]["met"]
    )
    assert not got["c=1: looplm serve tok/s >= 1x vLLM"]["met"]  # 20.0 < 21.5
    assert got["c=1: looplm serve TTFT p50 <= vLLM's"]["met"] and not got["c=8: looplm serve TTFT p50 <= vLLM's"]["met"]
    itl = got["c=1: looplm serve ITL p50 <= 1.05x model.generate's batch-1 step"]
    assert itl["met"] and itl["value"] == "52.0 vs 50.0 ms (1.04x)"
    rows[0] = row("full", "c=1", float("nan"))  # nothing finished: nothing judged at c=1
    assert not [t for t in targets(rows, 1) if t["target"].startswith("c=1")]


def test_prompts_are_held_out_documents_cut_to_their_length(tmp_path):
    docs = [f"speech {i}: " + "word " * (i % 7 + 3) for i in range(200)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs))
    tok = ByteTokenizer()
    got = held_out_prompts(tok, str(tmp_path / "c.txt"), 3, 12)
    assert got == [d[:12] for d in (docs[49], docs[99], docs[149])]
    assert len(held_out_prompts(tok, str(tmp_path / "c.txt"), 6, 12)) == 6  # repeated where there are fewer
    with pytest.raises(ValueError, match="--prompt-len"):
        held_out_prompts(tok, str(tmp_path / "c.txt"), 3, 10_000)
    with pytest.raises(FileNotFoundError, match="--data"):
        held_out_prompts(tok, str(tmp_path / "none.txt"), 3, 12)


def test_bad_arguments_are_one_error_naming_each():
    from argparse import Namespace

    a = Namespace(
        concurrency="1,x",
        rates="",
        contenders="full,fast",
        hf_dir=None,
        requests=0,
        max_tokens=4,
        prompt_len=8,
        max_batch=4,
        threads=1,
        duration_s=-1.0,
    )
    with pytest.raises(ValueError) as e:
        _check(a)
    msg = str(e.value)
    for part in ("--concurrency '1,x'", "--contenders 'full,fast'", "--requests 0", "--duration-s -1.0"):
        assert part in msg
    with pytest.raises(ValueError, match="the transformers contender needs --hf-dir"):
        _check(
            Namespace(
                **{**vars(a), "concurrency": "1", "contenders": "full,transformers", "requests": 2, "duration_s": 5.0}
            )
        )
    with pytest.raises(ValueError) as e:  # vLLM needs the directory and a Python that has it: named before any server
        _check(
            Namespace(
                **{
                    **vars(a),
                    "concurrency": "1",
                    "contenders": "full,vllm",
                    "requests": 2,
                    "duration_s": 5.0,
                    "vllm_python": sys.executable,
                    "vllm_kv_gib": 0.0,
                }
            )
        )
    for part in (
        "the vllm contender needs --hf-dir",
        f"--vllm-python {sys.executable!r} does not import vllm",
        "--vllm-kv-gib 0.0",
    ):
        assert part in str(e.value)
    with pytest.raises(ValueError) as e:  # vllm-exit sets looplm_exit itself, from --exit
        _check(
            Namespace(
                **{
                    **vars(a),
                    "concurrency": "1",
                    "contenders": "full,vllm-exit",
                    "requests": 2,
                    "duration_s": 5.0,
                    "exit": "kl:0.01",
                    "vllm_args": "--hf-overrides '{}'",
                }
            )
        )
    assert "--vllm-args: vllm-exit sets --hf-overrides from --exit" in str(e.value)
    with pytest.raises(ValueError, match="whole number"):
        Load("concurrency", 1.5)
    assert RequestRecord().ok is False


def test_the_command_runs_its_contenders_and_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "looplm.cli",
            "bench",
            "serve",
            "--model",
            "tiny-coreloop",
            "--contenders",
            "full,one,generate",
            "--requests",
            "3",
            "--max-tokens",
            "4",
            "--prompt-len",
            "8",
            "--concurrency",
            "1,2",
            "--threads",
            "1",
            "--duration-s",
            "60",
            "--out",
            str(out),
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    got = {(x["contender"], x["load"]) for x in data["rows"]}
    assert got == {
        ("full", "c=1"),
        ("full", "c=2"),
        ("one", "c=1"),
        ("one", "c=2"),
        ("generate", "c=1"),
        ("generate", "c=2"),
    }
    served = [x for x in data["rows"] if x["load"] == "c=1" or x["contender"] != "generate"]
    assert all(x["finished"] == x["sent"] == 3 for x in served)
    assert all(x["completion_tokens"] == 12 for x in served)
    batched = next(x for x in data["rows"] if x == {**x, "contender": "generate", "load": "c=2"})
    assert (
        batched["finished"] == 2 and batched["completion_tokens"] == 8 and batched["itl_ms_p50"] > 0
    )  # batch 2, 4 tokens each
    assert {t["target"].split(":")[0] for t in data["targets"]} == {"c=2 streams", "1 stream", "c=2", "c=1"}
    assert "| full | c=2 |" in r.stdout and png.stat().st_size > 1000 and data["cpu"] in r.stdout
