"""The HTTP server in its modules (issue 60): ``serving`` (the request path: one base, completions and chat each a
subclass), ``app`` (routes, checks; its ``state`` drains), ``server`` (uvicorn). The old ``looplm.serve.api`` names
are the moved objects themselves; the request path loads without the app, the server or uvicorn; each endpoint
answers through its own subclass and is counted under its own label. In process (FastAPI's TestClient)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402
from test_serve_api import _chat_tokenizer, _model  # noqa: E402

from looplm.serve import Engine, EngineConfig  # noqa: E402
from looplm.serve.app import build_app  # noqa: E402
from looplm.serve.serving import ChatServing, CompletionServing  # noqa: E402

KEY = "k3y"
AUTH = {"authorization": f"Bearer {KEY}"}
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a loop?"}]


def test_the_old_api_names_are_the_moved_objects():
    from looplm.serve import api, app, detokenizer, errors, server

    moved = {
        "APIError": errors.APIError,
        "DEFAULT_MAX_BODY_BYTES": app.DEFAULT_MAX_BODY_BYTES,
        "IncrementalText": detokenizer.IncrementalText,
        "Server": server.Server,
        "build_app": app.build_app,
        "run_server": server.run_server,
    }
    assert sorted(api.__all__) == sorted(moved)
    for name, obj in moved.items():
        assert getattr(api, name) is obj, name
    # nothing is defined there any more (a second copy of a class would not be the one the app raises or runs)
    assert [n for n, v in vars(api).items() if getattr(v, "__module__", None) == api.__name__] == []


def test_the_request_path_loads_without_the_app_the_server_or_uvicorn():
    """``serving`` sits below ``app`` (no import cycle); uvicorn is imported when a server is made, not with the
    app (an app under TestClient needs none)."""
    code = (
        "import json, sys\n"
        "watch = ('looplm.serve.app', 'looplm.serve.server', 'uvicorn')\n"
        "import looplm.serve.serving\n"
        "after_serving = [m for m in watch if m in sys.modules]\n"
        "import looplm.serve.app\n"
        "print(json.dumps([after_serving, [m for m in watch if m in sys.modules]]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    after_serving, after_app = json.loads(r.stdout.strip().splitlines()[-1])
    assert after_serving == []
    assert after_app == ["looplm.serve.app"]


@pytest.fixture(scope="module")
def client():
    tok = _chat_tokenizer()
    eng = Engine(_model(), EngineConfig(max_batch=2, max_waiting=4), eos_token_id=tok.eos_id)
    with TestClient(build_app(eng, tok, "tiny", api_key=KEY)) as c:
        yield c, tok


def _requests_total(c, endpoint: str, outcome: str) -> float:
    text = c.get("/metrics").text
    m = re.search(rf'^looplm_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _spy(calls: list, fn):
    def spied(self, *a, **kw):
        calls.append((type(self).__name__, fn.__name__))
        return fn(self, *a, **kw)

    return spied


def _events(r) -> list[dict]:
    lines = [ln for ln in r.text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


def test_completions_and_chat_answer_through_their_own_serving(client, monkeypatch):
    """Each route reaches its own subclass (its prompts, its body, its stream) and is counted under its label; the
    chat answer is the completion of its template's text (one shared flow below both)."""
    c, tok = client
    calls: list = []
    for cls in (CompletionServing, ChatServing):
        for name in ("prompts", "body", "stream"):
            monkeypatch.setattr(cls, name, _spy(calls, getattr(cls, name)))
    before = {(e, o): _requests_total(c, e, o) for e in ("completions", "chat") for o in ("ok", "unauthorized")}

    text = tok._tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    common = {"max_tokens": 8, "temperature": 0}
    r = c.post("/v1/completions", json={"prompt": text, **common}, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    completion = r.json()
    assert calls == [("CompletionServing", "prompts"), ("CompletionServing", "body")]

    calls.clear()
    r = c.post("/v1/chat/completions", json={"messages": MSGS, **common}, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    chat = r.json()
    assert calls == [("ChatServing", "prompts"), ("ChatServing", "body")]
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"] == completion["usage"]

    calls.clear()
    r = c.post("/v1/completions", json={"prompt": text, "stream": True, **common}, headers=AUTH)
    chunks = _events(r)
    assert {ch["object"] for ch in chunks} == {"text_completion"}
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == completion["choices"][0]["text"]
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "stream": True, **common}, headers=AUTH)
    chunks = _events(r)
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        == chat["choices"][0]["message"]["content"]
    )
    assert calls == [
        ("CompletionServing", "prompts"),
        ("CompletionServing", "stream"),
        ("ChatServing", "prompts"),
        ("ChatServing", "stream"),
    ]

    # the app's checks come first, counted under the endpoint they refused
    assert c.post("/v1/chat/completions", json={"messages": MSGS}).status_code == 401
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert c.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer no"}).status_code == 401
    after = {k: _requests_total(c, *k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {
        ("completions", "ok"): 2,
        ("completions", "unauthorized"): 2,
        ("chat", "ok"): 2,
        ("chat", "unauthorized"): 1,
    }
