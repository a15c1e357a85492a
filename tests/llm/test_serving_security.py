"""The chat server is safe by default on loopback (issue 54): JSON content type required, loopback Host names only,
foreign Origins refused, a body-size limit checked before anything is read whole or tokenised, bounded JSON depth,
a bounded queue; and the OpenAI request forms a client sends are accepted. Raw HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import free_port

httpx = pytest.importorskip("httpx", reason="the serving tests need httpx: pip install -e .[dev]")


class Slow:
    """A scripted backend whose replies take ``delay`` seconds (the queue test)."""

    def __init__(self, delay: float = 0.0) -> None:
        from lightning_modules.llm.serving.chat import ScriptedBackend

        self.delay = delay
        self.seen = []
        self.inner = ScriptedBackend(self._reply, model="tiny")

    def _reply(self, messages):
        self.seen.append(messages)
        time.sleep(self.delay)
        return "ok"

    def chat(self, messages, **generation):
        return self.inner.chat(messages, **generation)


def _serve(backend, **limits):
    from lightning_modules.llm.serving.chat_server import ServingLimits, build_app, start_server

    port = free_port()
    server, thread = start_server(build_app(backend, "tiny", limits=ServingLimits(**limits)), port=port)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def keyless():
    backend = Slow()
    url, server, thread = _serve(backend, max_body_bytes=100_000)
    yield url, backend
    server.should_exit = True
    thread.join(timeout=10)


USER = [{"role": "user", "content": "hi"}]


def _post(url, body=None, content=None, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    data = content if content is not None else json.dumps(body).encode()
    return httpx.post(url + "/v1/chat/completions", content=data, headers=h, timeout=20)


def test_a_text_plain_body_from_a_web_page_runs_nothing(keyless):
    url, backend = keyless
    before = len(backend.seen)
    r = _post(url, {"messages": USER}, headers={"Content-Type": "text/plain", "Origin": "https://evil.example"})
    assert r.status_code in (403, 415) and r.json()["error"]["message"]
    r = _post(url, {"messages": USER}, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = _post(url, {"messages": USER}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
    assert len(backend.seen) == before  # no generation ran
    ok = _post(url, {"messages": USER}, headers={"Origin": url})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_only_loopback_host_names_are_answered(keyless):
    url, _ = keyless
    port = url.rsplit(":", 1)[1]
    r = _post(url, {"messages": USER}, headers={"Host": f"rebind.evil.example:{port}"})
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/models", headers={"Host": "attacker.example"}, timeout=10).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert _post(url, {"messages": USER}, headers={"Host": host}).status_code == 200, host


def test_a_huge_body_is_refused_before_it_is_read_or_tokenised(keyless):
    url, backend = keyless
    before = len(backend.seen)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 20_000_000}]}).encode()
    started = time.perf_counter()
    r = _post(url, content=big)
    assert r.status_code == 413 and "100000" in r.json()["error"]["message"]
    assert time.perf_counter() - started < 10 and len(backend.seen) == before


def test_deep_json_is_a_400_in_openai_shape(keyless):
    url, _ = keyless
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post(url, content=deep)
    assert r.status_code in (400, 413)
    assert r.headers["content-type"].startswith("application/json") and "error" in r.json()
    nested = {"messages": USER, "metadata": json.loads("[" * 80 + "]" * 80)}
    r = _post(url, nested)
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]


def test_the_openai_request_forms_are_accepted(keyless):
    url, backend = keyless
    parts = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    r = _post(url, {"model": "tiny", "messages": parts, "n": None})
    assert r.status_code == 200, r.text
    assert backend.seen[-1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = _post(url, {"messages": image})
    assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"]
    one = httpx.get(url + "/v1/models/tiny", timeout=10)
    assert one.status_code == 200 and one.json()["id"] == "tiny"
    assert httpx.get(url + "/v1/models/other", timeout=10).status_code == 404


def test_a_lower_case_bearer_is_a_bearer(monkeypatch):
    monkeypatch.setenv("LITCTX_TEST_SEC_KEY", "sk-sec")
    from lightning_modules.llm.serving.chat_server import build_app, start_server

    port = free_port()
    server, thread = start_server(build_app(Slow(), "tiny", api_key_env="LITCTX_TEST_SEC_KEY"), port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _post(url, {"messages": USER}, headers={"Authorization": "bearer sk-sec"}).status_code == 200
        assert _post(url, {"messages": USER}, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert _post(url, {"messages": USER}).status_code == 401
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_full_queue_answers_503_with_retry_after():
    backend = Slow(delay=1.5)
    url, server, thread = _serve(backend, max_waiting=0)
    try:
        first = {}
        worker = threading.Thread(target=lambda: first.update(r=_post(url, {"messages": USER})))
        worker.start()
        deadline = time.monotonic() + 5
        while not backend.seen and time.monotonic() < deadline:
            time.sleep(0.02)
        r = _post(url, {"messages": USER})
        assert r.status_code == 503 and r.headers.get("retry-after") == "1"
        worker.join(timeout=10)
        assert first["r"].status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_client_that_disconnects_frees_the_model():
    """Issue 54: a client gone mid-generation left the backend lock held (the next 1-token request waited 30 s);
    now the server cancels the generation (a decoder stopping criterion) when the client disconnects."""
    from lightning_modules.llm.serving.chat import LocalChatBackend

    backend = LocalChatBackend("tiny-llama")
    long = backend.chat(USER, max_tokens=200)  # warm up, and check this model does not stop early
    assert long.completion_tokens == 200
    url, server, thread = _serve(backend)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 6000}, timeout=0.5)
        started = time.perf_counter()
        r = _post(url, {"messages": USER, "max_tokens": 1})
        waited = time.perf_counter() - started
        assert r.status_code == 200 and waited < 5.0, waited  # 6000 tokens would take about 18 s
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_official_openai_client_gets_replies_and_clean_errors(keyless):
    openai = pytest.importorskip("openai", reason="the official client test needs openai: pip install -e .[dev]")
    url, _ = keyless
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused-on-a-keyless-server", max_retries=0, timeout=20)
    out = client.chat.completions.create(model="tiny", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert out.choices[0].message.content == "ok" and out.usage.total_tokens >= 1
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="tiny", messages=USER, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
