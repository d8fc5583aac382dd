"""``looplm serve``'s HTTP API, through the ``openai`` client, against a live server on 127.0.0.1 at a free port.

Every answer is checked against ``model.generate`` of its prompt alone (on a second copy of the same weights: the
engine owns the served model): completions, chat, streaming, ``n`` and seeds, stop strings, log-probabilities and
echo, the ``looplm`` extension fields, 16 concurrent clients. Then the errors (each field named), 401 / 404 / 429 /
504, a disconnect freeing its row (the metrics show it) and the shutdown (the in-process drain and SIGTERM of
``looplm serve``). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import looplm

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from looplm.data.tokenizers import ByteTokenizer, HFTokenizer  # noqa: E402
from looplm.serve import Engine, EngineConfig  # noqa: E402
from looplm.serve.app import build_app  # noqa: E402
from looplm.serve.server import Server  # noqa: E402

N = 12  # tokens per answer
EXIT = "kl:0.006"  # the served engine's criterion (a mix of depths on tiny-coreloop)


def _model(name="tiny-coreloop"):
    torch.manual_seed(0)
    return looplm.build(name).eval()


def _chat_tokenizer() -> HFTokenizer:
    """Bytes, with the special tokens and a chat template (a transformers tokenizer, as a run's would be)."""
    from looplm.hf.tokenizer import byte_backend

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_backend(), eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return HFTokenizer(fast, "bytes-chat", kind="transformers")


def _serve(model, tok, slow_s: float = 0.0, api_key=None, request_timeout_s=60.0, grace_s=5.0, **cfg):
    """A started server on 127.0.0.1 at a free port. ``slow_s``: every decode step sleeps that long (a request
    that would otherwise finish before the test can act on it)."""
    if slow_s:
        model.norm.register_forward_pre_hook(lambda mod, args: time.sleep(slow_s))
    eng = Engine(model, EngineConfig(**cfg), eos_token_id=tok.eos_id)
    app = build_app(eng, tok, "tiny", api_key=api_key, request_timeout_s=request_timeout_s)
    return Server(app, host="127.0.0.1", port=0, grace_s=grace_s).start()


def _client(server, key="none", **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, timeout=60.0, max_retries=0, **kw)


@pytest.fixture(scope="module")
def served():
    """One server (4 rows, kl exit under the depth schedule) for the answers' tests; its reference model."""
    tok = _chat_tokenizer()
    server = _serve(_model(), tok, max_batch=4, exit=EXIT, prefill_chunk=8, max_waiting=64)
    ref = _model()
    try:
        yield server, _client(server), ref, tok
    finally:
        server.stop()


def _alone(ref, tok, prompt_ids, n=N, exit=EXIT, **kw):
    """``generate`` of one prompt alone: its new tokens, up to (not with) an EOS."""
    out = ref.generate(torch.tensor([prompt_ids]), n, exit=exit, eos_token_id=tok.eos_id, **kw)[
        0, len(prompt_ids) :
    ].tolist()
    return out[: out.index(tok.eos_id)] if tok.eos_id in out else out


PROMPTS = ["The loop ", "Once upon a time", "x", "A looped model runs its core again and again, ", "12345 "]


# ------------------------------------------------------------------------------------------------ answers
def test_models_and_greedy_completions_equal_generate_alone(served):
    server, client, ref, tok = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for p in PROMPTS:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, logprobs=0)
        want = _alone(ref, tok, tok.encode(p))
        ch = r.choices[0]
        assert ch.logprobs.tokens == [tok.decode([t]) for t in want], p
        assert ch.text == tok.decode(want)
        assert ch.finish_reason == ("length" if len(want) == N else "stop")
        assert r.usage.prompt_tokens == len(tok.encode(p)) and r.usage.completion_tokens >= len(want)
        assert 1 <= ch.model_extra["looplm"]["loops"] <= ref.config.n_loops
    # a batch of prompts in one request (token ids and strings), choices in prompt order
    ids = tok.encode(PROMPTS[1])
    r = client.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[3]], max_tokens=N, temperature=0)
    assert [c.text for c in r.choices] == [
        tok.decode(_alone(ref, tok, tok.encode(p))) for p in (PROMPTS[0], PROMPTS[3])
    ]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=N, temperature=0)
    assert r.choices[0].text == tok.decode(_alone(ref, tok, ids))


def test_chat_applies_the_template_and_equals_generate_alone(served):
    server, client, ref, tok = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a loop?"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2
    )
    prompt = tok.encode(tok._tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    want = _alone(ref, tok, prompt)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == tok.decode(want)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in want]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert r.usage.prompt_tokens == len(prompt)
    # streamed: the same text, a role chunk first, usage last
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(want)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_without_a_template_is_a_clear_400():
    server = _serve(_model(), ByteTokenizer(), max_batch=1)
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template") as e:
            _client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "no_chat_template"
        r = _client(server).completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        server.stop()


def test_streaming_completions_end_with_done_and_equal_the_whole_answer(served):
    server, client, ref, tok = served
    p = PROMPTS[3]
    whole = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, logprobs=1)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=N,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    toks = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert toks == whole.choices[0].logprobs.tokens
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # the wire: server-sent events ending with [DONE]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=30,
        json={"prompt": p, "max_tokens": 4, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert all("choices" in json.loads(ln[6:]) for ln in lines[:-1])


def test_streamed_connections_send_each_chunk_at_once():
    """TCP_NODELAY on every accepted connection: asyncio sets it only where the listening socket's proto is
    IPPROTO_TCP. Without it (proto 0) Nagle held each chunk of a stream on a reused keep-alive connection
    until the client's delayed ACK, ~40 ms, and a whole stream arrived at its end."""
    import asyncio
    import socket

    from looplm.serve.server import _bind

    async def accepted_nodelay():
        sock = _bind("127.0.0.1", 0)
        got = asyncio.get_running_loop().create_future()

        class P(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(P, sock=sock)
        try:
            _, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(got, 10)
            w.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_n_samples_and_seeds_are_each_generate_alone_with_their_seed(served):
    server, client, ref, tok = served
    p = PROMPTS[1]
    ids = tok.encode(p)
    kw = dict(temperature=0.9, top_p=0.95)
    r = client.completions.create(model="tiny", prompt=p, max_tokens=N, n=3, seed=11, extra_body={"top_k": 40}, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):  # sample i draws from seed + i
        want = _alone(ref, tok, ids, do_sample=True, top_k=40, generator=torch.Generator().manual_seed(11 + i), **kw)
        assert c.text == tok.decode(want), i
    assert len({c.text for c in r.choices}) > 1
    again = client.completions.create(model="tiny", prompt=p, max_tokens=N, seed=12, extra_body={"top_k": 40}, **kw)
    assert again.choices[0].text == r.choices[1].text


def test_stop_strings_cut_the_text_also_across_tokens(served):
    server, client, ref, tok = served
    p = PROMPTS[3]
    full = tok.decode(_alone(ref, tok, tok.encode(p), n=24))
    stop = full[5:8]  # three characters: spans tokens (one byte each)
    cut = full[: full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model="tiny", prompt=p, max_tokens=24, temperature=0, stop=[stop, "\x00never"], stream=stream
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut, stream
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    r = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stop=stop, logprobs=0)
    assert r.choices[0].text == cut and "".join(r.choices[0].logprobs.tokens).startswith(cut)


def test_echo_scores_the_prompt_as_a_full_forward_does(served):
    """``echo`` with ``logprobs`` and ``max_tokens=0`` (how lm-eval scores loglikelihoods): each prompt token's
    log-probability given the ones before equals a full-depth forward's log-softmax of the prompt (the server's
    exit applies to generated tokens only) to 1e-5; the first token has none."""
    server, client, ref, tok = served
    for p in ("The loop runs", PROMPTS[3]):
        ids = tok.encode(p)
        r = client.completions.create(model="tiny", prompt=p, max_tokens=0, echo=True, logprobs=1, temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == p and lp.tokens == [tok.decode([t]) for t in ids]
        with torch.no_grad():
            logits = ref(torch.tensor([ids]))
            logits = logits.logits if hasattr(logits, "logits") else logits
        want = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-5)
        assert lp.text_offset == list(range(len(ids)))  # one byte per token, one character each (ASCII)
        assert r.usage.completion_tokens == 0
    # echo with generated tokens: the prompt's text, then the answer's
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text == "abc" + tok.decode(_alone(ref, tok, tok.encode("abc"), n=4))


def test_a_stop_token_has_its_logprob_after_an_echoed_prompt(served):
    """lm-eval's ``local-completions`` sends ``echo`` + ``max_tokens=1`` and drops the last log-probability as
    the generated token's. Where that token is an EOS or a stop token id, it is still in the log-probabilities
    (its text is not shown): otherwise the prompt's last token was dropped and the score was wrong."""
    server, client, ref, tok = served
    ids = tok.encode(PROMPTS[1])
    nxt = _alone(ref, tok, ids, n=1, exit=None)[0]  # the greedy next token: made a stop token here
    r = client.completions.create(
        model="tiny",
        prompt=[ids],
        max_tokens=1,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"stop_token_ids": [nxt], "looplm": {"exit": "none"}},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == PROMPTS[1] and r.usage.completion_tokens == 1
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.text_offset[-1] == len(PROMPTS[1])
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
    assert lp.token_logprobs[-1] == pytest.approx(want[-1, nxt].item(), abs=1e-5)
    # the continuation's score, as lm-eval sums it (token_logprobs[ctxlen:-1]), is the prompt's own
    assert sum(lp.token_logprobs[2:-1]) == pytest.approx(
        sum(want[i - 1, ids[i]].item() for i in range(2, len(ids))), abs=1e-4
    )


def test_the_looplm_extension_fields(served):
    server, client, ref, tok = served
    ids = tok.encode(PROMPTS[0])
    K = ref.config.n_loops
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=N,
        temperature=0,
        extra_body={"looplm": {"exit": "none", "loops": K}},
    )
    assert r.choices[0].text == tok.decode(_alone(ref, tok, ids, exit=None))
    assert r.choices[0].model_extra["looplm"]["loops"] == K
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, extra_body={"looplm": {"exit": "kl:0.002"}}
    )
    assert r.choices[0].text == tok.decode(_alone(ref, tok, ids, exit="kl:0.002"))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt="x", extra_body={"looplm": {"loops": K + 1, "exit": "gate:0.5", "speed": 3}}
        )
    assert "looplm.speed" in e.value.body["param"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", extra_body={"looplm": {"loops": K + 1, "exit": "gate:0.5"}})
    assert {"looplm.loops", "looplm.exit"} <= set(e.value.body["param"].split(", "))
    card = client.models.retrieve("tiny")
    assert card.model_extra["looplm"]["K"] == K and "kl" in card.model_extra["looplm"]["engine"]


def test_sixteen_concurrent_clients_are_each_exact(served):
    """16 clients in threads, arriving over ~0.3 s (so that requests join a running batch), each with its own
    prompt, length, stream or not, greedy or seeded: every answer equals its prompt decoded alone."""
    server, client, ref, tok = served
    jobs = []
    for i in range(16):
        p = f"{PROMPTS[i % len(PROMPTS)]}{i}"
        n = 4 + (i * 5) % 13
        sampled = i % 3 == 0
        jobs.append((p, n, sampled, i % 2 == 1))
    out: dict[int, str] = {}
    errors: list = []

    def one(i, p, n, sampled, stream):
        try:
            time.sleep(0.02 * i)
            kw = dict(temperature=0.8, seed=100 + i) if sampled else dict(temperature=0)
            r = client.completions.create(model="tiny", prompt=p, max_tokens=n, stream=stream, **kw)
            out[i] = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        except Exception as e:  # reported below
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i, *job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(out) == 16
    for i, (p, n, sampled, _) in enumerate(jobs):
        kw = dict(do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(100 + i)) if sampled else {}
        assert out[i] == tok.decode(_alone(ref, tok, tok.encode(p), n=n, **kw)), i


# ------------------------------------------------------------------------------------------------ errors
def test_bad_fields_are_one_400_naming_each(served):
    server, client, ref, tok = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny",
            prompt="x",
            temperature=5,
            top_p=0,
            n=0,
            max_tokens=-1,
            presence_penalty=0.5,
            extra_body={"mystery": 1},
        )
    body = e.value.body
    named = set(body["param"].split(", "))
    assert {"temperature", "top_p", "n", "max_tokens", "presence_penalty", "mystery"} <= named, body
    assert all(f["message"] for f in body["fields"])
    # a prompt longer than the context
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="y" * (ref.config.max_seq_len + 5), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "prompt" in e.value.body["param"]
    # not JSON at all
    r = httpx.post(
        server.url + "/v1/completions", content=b"{nope", timeout=10, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]
    assert httpx.get(server.url + "/v1/nothing", timeout=10).status_code == 404
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_api_key():
    server = _serve(_model(), ByteTokenizer(), max_batch=1, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            _client(server, key="wrong").models.list()
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
        assert [m.id for m in _client(server, key="s3cret").models.list().data] == ["tiny"]
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # open for probes
    finally:
        server.stop()


def _metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def _until(pred, timeout_s=20.0):
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_full_queue_is_429_a_timeout_504_and_a_disconnect_frees_its_row():
    """One row, no waiting room, each decode step slowed to 20 ms: a second request while the first runs gets
    429 with Retry-After; a client that goes away mid-stream frees its row at once (the metrics show it running
    0, its choice aborted) though its request had 400 tokens to go; a request past the timeout gets 504."""
    server = _serve(_model(), ByteTokenizer(), slow_s=0.02, max_batch=1, max_waiting=0, request_timeout_s=1.5)
    try:
        body = {"prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            it = r.iter_lines()
            assert next(line for line in it if line.startswith("data: "))  # the first token: the row is taken
            assert _metric(server, "looplm_requests_running") == 1
            busy = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
        # the stream was closed after a few tokens: the row frees long before 400 × 20 ms
        assert _until(lambda: _metric(server, "looplm_requests_running") == 0, 5.0)
        assert _until(lambda: _metric(server, "looplm_choices_finished_total", '{reason="abort"}') == 1, 5.0)
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0}, timeout=10
        )
        assert r.status_code == 200  # the row is free again
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 5.0
        assert _until(lambda: _metric(server, "looplm_requests_running") == 0, 5.0)
        text = httpx.get(server.url + "/metrics", timeout=10).text
        for name in (
            "looplm_time_to_first_token_seconds_bucket",
            "looplm_inter_token_latency_seconds_bucket",
            "looplm_kv_tokens_used",
            "looplm_kv_budget_tokens",
            "looplm_kv_usage_ratio",
            "looplm_preemptions_total",
            "looplm_exits_total",
            "looplm_generation_tokens_total",
        ):
            assert name in text, name
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------ shutdown
def test_stop_drains_new_requests_get_503_and_the_rest_an_error_event():
    """The drain (what SIGTERM runs): a request in flight that fits the grace period finishes whole; a new one gets
    503; one that does not fit ends with an error event and ``[DONE]`` (no hanging connection)."""
    server = _serve(_model(), ByteTokenizer(), slow_s=0.01, max_batch=2, grace_s=2.0)
    events: dict[str, list] = {"short": [], "long": []}

    def stream(name, n):
        body = {"prompt": "hi", "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            for ln in r.iter_lines():
                if ln:
                    events[name].append(ln)

    threads = [threading.Thread(target=stream, args=a, daemon=True) for a in (("short", 20), ("long", 480))]
    for t in threads:
        t.start()
    assert _until(lambda: len(events["short"]) > 1 and len(events["long"]) > 1, 10.0)
    stopper = threading.Thread(target=server.stop, daemon=True)
    stopper.start()
    assert _until(lambda: server.app.state.looplm.draining, 5.0)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    for t in threads + [stopper]:
        t.join(30)
        assert not t.is_alive()
    short = [json.loads(ln[6:]) for ln in events["short"] if ln != "data: [DONE]"]
    assert events["short"][-1] == "data: [DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"].encode("utf-8", "surrogatepass")) > 0 for c in short) >= 1
    assert events["long"][-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events["long"][-2][6:])["error"]["message"]


def test_looplm_serve_restarts_itself_with_libgomps_unthrottled_spin(monkeypatch):
    """``looplm serve`` (the program, not a caller of ``looplm.cli.main``) respawns with OPENMP_SPIN_ENV where torch
    runs on libgomp and the user set neither variable; never when one is set, never inside another program."""
    from looplm.serve import cli

    for k in cli.OPENMP_SPIN_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(cli, "_uses_libgomp", lambda: True)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/looplm", "serve", "tiny-llama", "--port", "0"])
    assert cli.openmp_spin_respawn() == [sys.executable, "-m", "looplm.cli", "serve", "tiny-llama", "--port", "0"]
    assert cli.openmp_spin_respawn("/src/looplm/cli.py") is not None  # python -m looplm.cli
    assert cli.openmp_spin_respawn("/venv/bin/pytest") is None  # a program calling main(): never replaced
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's choice stands
    assert cli.openmp_spin_respawn() is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(cli, "_uses_libgomp", lambda: False)  # another OpenMP runtime: nothing to tune
    assert cli.openmp_spin_respawn() is None


def test_looplm_serve_on_sigterm_finishes_in_flight_and_exits_0():
    """The command: ``looplm serve PRESET --port 0`` (127.0.0.1), a streamed request in flight when SIGTERM comes
    finishes whole, the process exits 0 within the grace period."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "looplm.cli",
            "serve",
            "tiny-coreloop",
            "--port",
            "0",
            "--grace-s",
            "20",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        url, t_end = None, time.monotonic() + 120
        while url is None and time.monotonic() < t_end and proc.poll() is None:
            line = proc.stderr.readline()
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "the server did not start"
        from looplm.serve.cli import OPENMP_SPIN_ENV, _uses_libgomp

        if _uses_libgomp() and not any(k in os.environ for k in OPENMP_SPIN_ENV):  # it restarted itself in place
            environ = dict(
                kv.split("=", 1) for kv in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in kv
            )
            assert {k: environ.get(k) for k in OPENMP_SPIN_ENV} == OPENMP_SPIN_ENV
        lines = []
        body = {"prompt": "hi", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for ln in r.iter_lines():
                if ln:
                    lines.append(ln)
                if len(lines) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
