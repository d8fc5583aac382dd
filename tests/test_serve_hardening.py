"""``looplm serve`` under abusive and careless requests (issue 60's probe): every refusal is a 4xx that names what
to fix, never a 500, and the refusals that cost nothing come before any tokenizing, copying or engine work
(the engine's ``check`` / ``submit`` and the tokenizer are counted). In process (FastAPI's TestClient) unless a
test needs a live server on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402
from test_serve_api import _chat_tokenizer, _client, _metric, _model, _serve  # noqa: E402

from looplm.data.tokenizers import ByteTokenizer  # noqa: E402
from looplm.serve import Engine, EngineConfig  # noqa: E402
from looplm.serve.app import build_app  # noqa: E402
from looplm.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402

SERVE = Path(__file__).resolve().parents[1] / "src" / "looplm" / "serve"
BODY_LIMIT = 64 * 1024


class _Counted:
    """The engine and the tokenizer of the app, with a count of the work they were asked for."""

    def __init__(self, engine, tok):
        self.calls = {"submit": 0, "check": 0, "encode": 0, "template": 0}
        for obj, name in (
            (engine, "submit"),
            (engine, "submit_group"),
            (engine, "check"),
            (tok, "encode"),
            (tok._tok, "apply_chat_template"),
        ):
            if hasattr(obj, name):
                self._wrap(obj, name)

    def _wrap(self, obj, name):
        inner = getattr(obj, name)
        key = {"apply_chat_template": "template", "submit_group": "submit"}.get(name, name)

        def counted(*a, **kw):
            self.calls[key] += 1
            return inner(*a, **kw)

        setattr(obj, name, counted)

    def reset(self):
        self.calls = dict.fromkeys(self.calls, 0)


@pytest.fixture(scope="module")
def app():
    """A tiny model's app (2 rows + 2 waiting: it holds 4 engine requests; context 64) with counted work."""
    tok = _chat_tokenizer()
    eng = Engine(_model(), EngineConfig(max_batch=2, max_waiting=2, max_model_len=64), eos_token_id=tok.eos_id)
    counted = _Counted(eng, tok)
    with TestClient(build_app(eng, tok, "tiny", max_body_bytes=BODY_LIMIT)) as client:
        yield client, counted


def _post(client, body, path="/v1/completions", **kw):
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return client.post(path, content=body, headers=headers, **kw)


def _fields(r) -> dict[str, str]:
    err = r.json()["error"]
    return {f["param"]: f["message"] for f in err.get("fields") or []} or {err["param"]: err["message"]}


# ------------------------------------------------------------------------------------------------ protocol
def test_protocol_imports_neither_torch_nor_the_engine():
    """``serve/protocol.py`` (and the ``fields`` module it takes FieldError from) loaded as a package of its own,
    with torch made unimportable: it loads, parses a request, and neither torch nor the engine was imported.
    (``import looplm.serve.protocol`` itself would run ``looplm/__init__``, which imports the model and torch.)"""
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, sys, types

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch.") or name.endswith(".engine"):
                    raise ImportError("the wire format must not import " + name)
        sys.meta_path.insert(0, NoTorch())
        pkg = types.ModuleType("wire")
        pkg.__path__ = [{str(SERVE)!r}]
        sys.modules["wire"] = pkg
        protocol = importlib.import_module("wire.protocol")
        req, errs = protocol.parse_request(b'{{"prompt": "hi", "n": 2}}', protocol.CompletionRequest)
        assert req is not None and req.n == 2 and not errs, errs
        assert "torch" not in sys.modules and not any(m.endswith("engine") for m in sys.modules)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ cost nothing
def test_refusals_by_size_and_count_come_before_any_work(app):
    client, counted = app
    cases = [
        ({"prompt": "x", "n": 1_000_000}, "n"),  # the protocol's bound on n
        ({"prompt": "x", "n": 5}, "n"),  # more samples than the server ever holds (2 rows + 2 waiting): 400, not 429
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),
        ({"prompt": ["a"] * 5}, "prompt"),
        ({"prompt": "y" * 20_000, "n": 4}, "prompt"),  # characters the context's 64 tokens cannot hold
        ({"prompt": [[1] * 65, "ok"]}, "prompt[0]"),  # more token ids than the context
        ({"messages": [{"role": "user", "content": "z" * 50_000}]}, "messages"),
        ({"messages": [{"role": "user", "content": ""}] * 65}, "messages"),  # more messages than the context's tokens
    ]
    for body, field in cases:
        counted.reset()
        t0 = time.perf_counter()
        r = _post(client, body, "/v1/chat/completions" if "messages" in body else "/v1/completions")
        assert r.status_code == 400, (body, r.text)
        assert field in _fields(r), (field, r.json())
        assert counted.calls == dict.fromkeys(counted.calls, 0), (
            field,
            counted.calls,
        )  # no template, tokenizing, check
        assert time.perf_counter() - t0 < 1.0
    # what is too long in characters may still fit when it is near the bound: it is tokenized and checked
    counted.reset()
    r = _post(client, {"prompt": "y" * 70, "max_tokens": 1})
    assert r.status_code == 400 and _fields(r)["prompt"].find("context") >= 0
    assert counted.calls["encode"] == 1 and counted.calls["submit"] == 0


def test_a_body_over_the_bound_is_413_read_no_further(app):
    client, counted = app
    counted.reset()
    big = json.dumps({"prompt": "p" * (BODY_LIMIT + 10)})
    r = _post(client, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in r.json()["error"]["message"]
    # without a Content-Length (chunked): refused once the bound is passed
    sent = []

    def chunks():
        for i in range(0, len(big), 8192):
            sent.append(i)
            yield big[i : i + 8192].encode()

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert counted.calls == dict.fromkeys(counted.calls, 0)
    # a body under the bound is read and answered
    assert _post(client, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_content_type_must_be_json(app):
    client, counted = app
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    counted.reset()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, ctype
        assert (
            "application/json" in r.json()["error"]["message"] and r.json()["error"]["code"] == "unsupported_media_type"
        )
    assert counted.calls == dict.fromkeys(counted.calls, 0)
    r = client.post("/v1/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


# ------------------------------------------------------------------------------------------------ 400, not 500
BAD_BODIES = [
    b'{"prompt": "x", "stop": 5}',
    b'{"max_tokens": 3}',  # no prompt
    b'{"prompt": [1.0, 2]}',
    b'{"prompt": "\\ud800"}',  # a lone surrogate
    b'{"prompt": "x", "model": "\\udfff"}',
    b'\xef\xbb\xbf{"prompt": "x", "n": 0}',  # a BOM (ignored), then a bad field
    '{"prompt": "x"}'.encode("utf-16"),
    b"[" * 30_000 + b"]" * 30_000,  # (the 100,000 deep one of the probe is over this app's body bound)
    b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "x", "looplm": {"speculative": ' + b"[" * 150 + b"]" * 150 + b"}}",
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b"",
    b"null",
    b'{"prompt": [[]]}',
    b'{"prompt": [-1]}',
    b'{"prompt": "x", "n": true}',
    b'{"prompt": "x", "seed": 100000000000000000000000000000}',
    b'{"prompt": "x", "max_tokens": 100000000000000000000000000000}',
    b'{"prompt": "x", "logprobs": 100000000000000000000000000000}',
    b'{"prompt": "x", "stop_token_ids": [100000000000000000000000000000]}',
    b'{"prompt": "x", "temperature": 1e999}',
    b'{"prompt": "x", "looplm": 5}',
    b'{"prompt": "x", "logit_bias": {"1": "a"}}',
    b'{"prompt": "x", "stream_options": {"include_usage": true}}',
]


def test_client_errors_are_400s_with_a_message_never_500(app):
    client, counted = app
    counted.reset()
    for body in BAD_BODIES:
        r = _post(client, body)
        assert r.status_code == 400, (body[:60], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["param"], body[:60]
        r.content.decode("ascii")  # a quoted value is escaped
    for body in (b'{"messages": []}', b'{"messages": [{"role": "robot", "content": "x"}]}', b'{"messages": "\\ud800"}'):
        r = _post(client, body, "/v1/chat/completions")
        assert r.status_code == 400, (body, r.text)
    assert counted.calls["submit"] == 0
    assert client.get("/v1/models/%ED%A0%80").status_code == 404
    assert client.get("/health").json()["status"] == "ok"


def test_one_message_per_bad_field_and_the_seed_as_sent(app):
    client, _ = app
    r = _post(client, b'{"prompt": "x", "top_k": -5, "max_tokens": -1, "temperature": NaN}')
    assert r.status_code == 400
    fields = r.json()["error"]["fields"]
    assert sorted(f["param"] for f in fields) == ["max_tokens", "temperature", "top_k"]  # once each
    assert "got -5" in _fields(r)["top_k"] and "nan" in _fields(r)["temperature"]
    seed = 2**63 - 1
    r = _post(client, {"prompt": "x", "seed": seed, "n": 2})
    msg = _fields(r)["seed"]
    assert r.status_code == 400 and str(seed) in msg and str(seed + 1) not in msg


def test_null_is_the_default_where_openai_allows_it(app):
    client, _ = app
    r = _post(client, {"prompt": "hi", "max_tokens": 1, "n": None, "stream": None, "echo": None, "ignore_eos": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    r = _post(
        client,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": None, "logprobs": None, "stream": None},
        "/v1/chat/completions",
    )
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_stop_strings_are_bounded(app):
    client, _ = app
    r = _post(client, {"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)})
    assert r.status_code == 400 and str(MAX_STOP_STRINGS) in _fields(r)["stop"]
    r = _post(client, {"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)})
    assert r.status_code == 400 and str(MAX_STOP_CHARS) in _fields(r)["stop"]
    stops = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]  # the most allowed: served
    r = _post(client, {"prompt": "hi", "max_tokens": 2, "stop": stops, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_the_chat_template_and_the_tokenizer_run_off_the_event_loop(app):
    client, counted = app
    tok = client.app.state.looplm.tokenizer
    seen = []

    def on_loop():
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    template, encode = tok._tok.apply_chat_template, tok.encode
    tok._tok.apply_chat_template = lambda *a, **kw: (seen.append(("template", on_loop())), template(*a, **kw))[1]
    tok.encode = lambda *a, **kw: (seen.append(("encode", on_loop())), encode(*a, **kw))[1]
    try:
        assert (
            _post(
                client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, "/v1/chat/completions"
            ).status_code
            == 200
        )
        assert _post(client, {"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        tok._tok.apply_chat_template, tok.encode = template, encode
    assert ("template", False) in seen and ("encode", False) in seen and not any(flag for _, flag in seen), seen


# ------------------------------------------------------------------------------------------------ live server
def test_a_request_that_times_out_in_the_queue_is_told_so():
    """One row, held by a long request submitted to the engine directly (no HTTP deadline), each step slowed: a
    request waits in the queue past the timeout; its 504 says it waited (retry later), not "ask for fewer
    tokens". One that was generating when its time ran out is still told to ask for fewer tokens."""
    from looplm.serve import SamplingParams

    server = _serve(_model(), ByteTokenizer(), slow_s=0.02, max_batch=1, max_waiting=1, request_timeout_s=1.0)
    eng = server.app.state.looplm.engine
    started = []
    hold = eng.submit([104, 105], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), started.append)
    try:
        t_end = time.monotonic() + 20
        while not started and time.monotonic() < t_end:  # the row is taken
            time.sleep(0.01)
        assert started
        queued = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert queued.status_code == 504
        msg = queued.json()["error"]["message"]
        assert "waited" in msg and "retry" in msg and "fewer tokens" not in msg, msg
        hold.abort()
        body = {"prompt": "x", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        running = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert running.status_code == 504 and "fewer tokens" in running.json()["error"]["message"]
    finally:
        hold.abort()
        server.stop()


# ------------------------------------------------------------------------------------------------ the CLI
def _parser():
    from looplm.serve.cli import register

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p


def test_api_key_help_says_ps_shows_it_and_names_the_environment_variable():
    sub = _parser()._subparsers._group_actions[0].choices
    for cmd in ("serve", "chat"):
        action = next(a for a in sub[cmd]._actions if "--api-key" in a.option_strings)
        assert "LOOPLM_API_KEY" in action.help and "ps" in action.help.split(), (cmd, action.help)
    args = _parser().parse_args(["serve", "tiny-coreloop", "--max-body-mib", "2"])
    assert args.max_body_mib == 2.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "tiny-coreloop", "--max-body-mib", "0"])


def test_chat_without_a_template_continues_the_first_message(monkeypatch, capsys):
    """``looplm chat`` on a tokenizer without a chat template: the first line is sent as a completion (not
    dropped), and so are the next."""
    from looplm.serve.cli import _chat_loop

    server = _serve(_model(), ByteTokenizer(), max_batch=1)
    lines = iter(["first line", "second line"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    try:
        args = argparse.Namespace(system=None, completion=False, max_tokens=3, temperature=0.0)
        _chat_loop(_client(server), "tiny", args)
        assert _metric(server, "looplm_requests_total", '{endpoint="completions",outcome="ok"}') == 2
        assert _metric(server, "looplm_requests_total", '{endpoint="chat",outcome="bad_request"}') == 1
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert "continuing" in err and "first line" in err


def test_a_100000_turn_chat_is_refused_before_validating_a_message(monkeypatch):
    from looplm.serve.protocol import ChatRequest, parse_request

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()

    def no_validation(*a, **kw):
        raise AssertionError("the messages were validated")

    monkeypatch.setattr(ChatRequest, "model_validate", no_validation)
    req, errs = parse_request(body, ChatRequest, max_messages=64)
    assert req is None and [e.field for e in errs] == ["messages"] and "100000" in errs[0].message
