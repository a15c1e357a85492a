"""Chat backends, structured output, recorded calls, and the HTTP backend against the served model with faults
injected (timeouts, dropped connections, malformed replies)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import pytest

from lightning_modules.llm.serving.chat import (BackendError, GenerationParams, ScriptedBackend, apply_stop, build_backend,
                                        check_messages)
from conftest import free_port
from lightning_modules.llm.serving.chat_records import RecordedBackend
from lightning_modules.llm.serving.structured import (StructuredOutputError, ask_structured, parse_json, parse_records,
                                              split_sections, strip_reasoning)

pytestmark = pytest.mark.usefixtures("torch_seed")

USER = [{"role": "user", "content": "Name a colour."}]


# ---------------------------------------------------------------- protocol pieces
def test_generation_params_errors_name_the_key():
    with pytest.raises(ValueError, match=r"generation\.max_tokns.*max_tokens"):
        GenerationParams.of({"max_tokns": 3})
    with pytest.raises(ValueError, match=r"generation\.temperature=-1"):
        GenerationParams.of({"temperature": -1})
    with pytest.raises(ValueError, match=r"generation\.top_p=0"):
        GenerationParams.of({"top_p": 0})
    assert GenerationParams.of({"stop": "END"}).stop == ("END",)


def test_check_messages_names_the_bad_item():
    with pytest.raises(ValueError, match=r"messages\[1\]\.role='robot'"):
        check_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        check_messages([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty list"):
        check_messages("hello")


def test_build_backend_checks_names_and_keys():
    with pytest.raises(ValueError, match=r"backend\.name='gpt'.*local, openai, scripted"):
        build_backend({"name": "gpt"})
    with pytest.raises(ValueError, match=r"backend\.base_ur.*base_url"):
        build_backend({"name": "openai", "base_ur": "http://x"})
    with pytest.raises(ValueError, match="must start with http"):
        build_backend({"name": "openai", "base_url": "localhost:8000"})


def test_scripted_backend_replies_in_order_then_fails_clearly():
    b = ScriptedBackend(["one", "two STOP three"])
    assert b.complete(USER) == "one"
    assert b.complete(USER, stop=["STOP"]) == "two "
    with pytest.raises(BackendError, match="no reply left for call 3"):
        b.complete(USER)
    assert len(b.calls) == 3 and b.calls[1]["generation"]["stop"] == ["STOP"]


def test_apply_stop_cuts_at_the_earliest():
    assert apply_stop("abc END def STOP", ["STOP", "END"]) == ("abc ", True)
    assert apply_stop("abc", ["x"]) == ("abc", False)


def test_local_backend_greedy_repeats_and_seeded_sampling_repeats():
    from lightning_modules.llm.serving.chat import LocalChatBackend

    b = LocalChatBackend("tiny-llama")
    g1 = b.chat(USER, max_tokens=6)
    assert g1.completion_tokens == 6 and g1.finish_reason == "length" and g1.prompt_tokens > 5
    assert b.complete(USER, max_tokens=6) == g1.text
    s1 = b.complete(USER, max_tokens=8, temperature=1.0, seed=3)
    assert b.complete(USER, max_tokens=8, temperature=1.0, seed=3) == s1
    others = {b.complete(USER, max_tokens=8, temperature=1.0, seed=s) for s in range(4, 8)}
    assert len(others | {s1}) > 1  # a random model's samples differ across seeds
    with pytest.raises(ValueError, match="context of 40 tokens"):
        LocalChatBackend((b.model, b.tokenizer), max_context=40).complete(USER, max_tokens=30)


# ---------------------------------------------------------------- structured output
def test_strip_reasoning_forms():
    assert strip_reasoning("<think>plan</think>Answer") == "Answer"
    assert strip_reasoning("<THINKING a=1>x</THINKING>\nA <reasoning>r</reasoning>B") == "A B"
    assert strip_reasoning("prefilled plan</think> final") == "final"
    assert strip_reasoning("answer <think>cut off") == "answer"


@pytest.mark.parametrize("text,expected", [
    ('{"reasoning": "ok", "score": 2}', 2),
    ('Here:\n```json\n{"reasoning": "a } inside", "score": 5}\n```', 5),
    ("{'reasoning': 'single quotes', 'score': 3,}", 3),          # repaired
    ('{"reasoning": "unclosed", "score": 4', 4),                   # repaired
    ('<think>{"score": 1}</think>{"reasoning": "r", "score": "3"}', 3),  # trace stripped, string coerced
])
def test_parse_json_reads_and_repairs(text, expected):
    assert parse_json(text, {"reasoning": str, "score": int})["score"] == expected


@pytest.mark.parametrize("text,match", [
    ("I think it is fine.", "no JSON object"),
    ('{"reasoning": "r"}', "no key 'score'"),
    ('{"reasoning": "r", "score": "high"}', "key 'score' is str"),
    ("[1, 2]", "no JSON object"),
])
def test_parse_json_rejects_clearly(text, match):
    with pytest.raises(StructuredOutputError, match=match):
        parse_json(text, {"reasoning": str, "score": int})


def test_parse_records_tolerates_malformed_output():
    text = ('Sure.\n1. ("entity"<|>Ada Brandt<|>person<|>keeps the ledger)##\n'
            "(\"relationship\"<|> Ada Brandt <|>Oslo<|>lives in<|>'home'<|>7\n"
            "##\n\n   ## garbage line without delimiters\n"
            '("entity"<|>Oslo<|>geo<|>a city)<|COMPLETE|>("entity"<|>ignored<|>x<|>y)')
    assert parse_records(text) == [["entity", "Ada Brandt", "person", "keeps the ledger"],
                                   ["relationship", "Ada Brandt", "Oslo", "lives in", "home", "7"],
                                   ["entity", "Oslo", "geo", "a city"]]
    assert parse_records("nothing here") == []


def test_split_sections_case_and_missing_headers():
    out = split_sections("[inserted memory points]: a\nb\n[Judgement] 2.1", ["Inserted Memory Points", "Judgement",
                                                                             "Updated Memory Points"])
    assert out == {"Inserted Memory Points": "a\nb", "Judgement": "2.1", "Updated Memory Points": ""}


def test_ask_structured_retries_with_a_correction_then_gives_up():
    b = ScriptedBackend(["no json", '{"score": 2, "reasoning": "r"}'])
    value, attempts = ask_structured(b, USER, lambda t: parse_json(t, {"score": int}), retries=1)
    assert value["score"] == 2 and attempts == 2
    second = b.calls[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": "no json"} and "no JSON object" in second[-1]["content"]
    bad = ScriptedBackend(["nope", "still nope", "never asked"])
    with pytest.raises(StructuredOutputError, match=r"after 2 attempt"):
        ask_structured(bad, USER, lambda t: parse_json(t, {"score": int}), retries=1)
    assert len(bad.calls) == 2


# ---------------------------------------------------------------- recorded calls
def test_recorded_backend_resumes_without_repeating_calls(tmp_path):
    path = tmp_path / "calls.jsonl"
    first = RecordedBackend(ScriptedBackend(["a", "b"]), path)
    assert first.complete(USER) == "a"
    assert first.complete(USER) == "b"  # the same request twice: two records (occurrence 0 and 1)
    assert first.stats["calls"] == 2
    # a "killed" run: a half-written line at the end
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"key": "cut')
    # the new process replays both from the file; the scripted backend would fail if it were called
    again = RecordedBackend(ScriptedBackend([], model="scripted"), path)
    assert [again.complete(USER), again.complete(USER)] == ["a", "b"]
    assert again.stats == {"calls": 0, "replayed": 2, "prompt_tokens": 6, "completion_tokens": 2}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"key": "') and
             line.endswith("}")]
    assert [r["occurrence"] for r in lines] == [0, 1]
    # different generation options or another backend identity are different calls
    other = RecordedBackend(ScriptedBackend(["c"], model="other"), path)
    assert other.complete(USER) == "c"


# ---------------------------------------------------------------- the served model, faults injected
class Faults:
    """ASGI middleware: the next requests to /chat/completions fail as planned (``timeout``: answer after
    ``delay`` s; ``drop``: start a response, then close the connection; ``malformed``: 200 with a body that is not
    JSON; ``wrong_shape``: JSON without choices; ``busy``: 503)."""

    def __init__(self, app, delay: float = 1.5):
        self.app, self.delay, self.plan, self.seen = app, delay, [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions") and self.plan:
            fault = self.plan.pop(0)
            self.seen.append(fault)
            if fault == "timeout":
                await asyncio.sleep(self.delay)
            elif fault == "drop":
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")]})
                await send({"type": "http.response.body", "body": b'{"choi', "more_body": True})
                raise ConnectionResetError("injected drop")
            elif fault in ("malformed", "wrong_shape", "busy"):
                body = {"malformed": b'{"choices": [{"message": ', "wrong_shape": b'{"result": "ok"}',
                        "busy": b'{"error": {"message": "busy"}}'}[fault]
                status = 503 if fault == "busy" else 200
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def served():
    """The app ``recipes.serve`` builds, on a tiny model, behind the fault injector, on 127.0.0.1."""
    from lightning_modules.llm.serving.chat import LocalChatBackend
    from lightning_modules.llm.serving.chat_server import build_app, start_server

    backend = LocalChatBackend("tiny-llama")
    faults = Faults(build_app(backend, "tiny", api_key_env="LITCTX_TEST_SERVE_KEY"))
    port = free_port()
    server, thread = start_server(faults, port=port)
    yield {"url": f"http://127.0.0.1:{port}/v1", "faults": faults, "backend": backend}
    server.should_exit = True
    thread.join(timeout=10)


def client(url, **kw):
    from lightning_modules.llm.serving.chat_http import OpenAIChatBackend

    waits = []
    kw.setdefault("api_key_env", "LITCTX_TEST_SERVE_KEY")
    b = OpenAIChatBackend(base_url=url, model="tiny", sleep=waits.append, **kw)
    return b, waits


SECRET = "sk-litctx-test-0123456789abcdef"


def test_http_backend_matches_the_local_model(served, monkeypatch):
    monkeypatch.setenv("LITCTX_TEST_SERVE_KEY", SECRET)
    b, _ = client(served["url"], timeout=30)
    out = b.chat(USER, max_tokens=5)
    local = served["backend"].chat(USER, max_tokens=5)
    assert (out.text, out.prompt_tokens, out.completion_tokens) == (local.text, local.prompt_tokens,
                                                                    local.completion_tokens)


def test_http_faults_are_retried_and_recorded_once(served, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LITCTX_TEST_SERVE_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    served["faults"].plan = ["timeout", "drop", "malformed", "busy"]
    b, waits = client(served["url"], timeout=0.5, max_retries=4, backoff=0.1, backoff_max=0.25)
    path = tmp_path / "calls.jsonl"
    rec = RecordedBackend(b, path)
    text = rec.complete(USER, max_tokens=4)
    assert served["faults"].seen[-4:] == ["timeout", "drop", "malformed", "busy"]
    assert b.attempts == 5 and waits == [0.1, 0.2, 0.25, 0.25]
    assert text == served["backend"].complete(USER, max_tokens=4)
    lines = path.read_text().splitlines()
    assert len(lines) == 1  # one call, one record, whatever the retries
    # a rerun replays it: no request is sent
    again, _ = client(served["url"])
    assert RecordedBackend(again, path).complete(USER, max_tokens=4) == text and again.attempts == 0
    # the key is never written or logged
    assert SECRET not in path.read_text() and SECRET not in repr(b) and SECRET not in caplog.text


def test_http_gives_up_after_bounded_retries_with_a_clear_error(served, monkeypatch, tmp_path):
    monkeypatch.setenv("LITCTX_TEST_SERVE_KEY", SECRET)
    served["faults"].plan = ["malformed", "wrong_shape", "drop"]
    b, waits = client(served["url"], timeout=5, max_retries=2, backoff=0.0)
    path = tmp_path / "calls.jsonl"
    with pytest.raises(BackendError, match=r"failed after 3 attempt\(s\).*malformed reply.*no 'choices'.*"
                                           r"connection dropped") as err:
        RecordedBackend(b, path).complete(USER, max_tokens=4)
    assert b.attempts == 3 and not path.exists() and SECRET not in str(err.value)


def test_http_auth_and_request_errors_fail_at_once(served, monkeypatch):
    monkeypatch.setenv("LITCTX_TEST_SERVE_KEY", SECRET)
    monkeypatch.setenv("LITCTX_WRONG_KEY", "sk-wrong")
    b, _ = client(served["url"], api_key_env="LITCTX_WRONG_KEY", max_retries=3)
    with pytest.raises(BackendError, match=r"HTTP 401.*Set the API key in \$LITCTX_WRONG_KEY") as err:
        b.complete(USER, max_tokens=2)
    assert b.attempts == 1 and "sk-wrong" not in str(err.value)
    good, _ = client(served["url"])
    with pytest.raises(BackendError, match="HTTP 400.*max_tokens"):
        good.complete(USER, max_tokens=10 ** 9)  # beyond the tiny model's context
    other, _ = client(served["url"].replace("/v1", "/v2"))
    with pytest.raises(BackendError, match="HTTP 404.*Check base_url"):
        other.complete(USER)


def test_http_unreachable_endpoint_says_so():
    b, waits = client(f"http://127.0.0.1:{free_port()}/v1", max_retries=2, backoff=0.05)
    with pytest.raises(BackendError, match=r"unreachable after 3 attempt.*Is the server running"):
        b.complete(USER)
    assert waits == [0.05, 0.1]


def test_server_rejects_bad_requests_with_openai_errors(served, monkeypatch):
    import httpx

    monkeypatch.setenv("LITCTX_TEST_SERVE_KEY", SECRET)
    h = {"Authorization": f"Bearer {SECRET}"}
    url = served["url"] + "/chat/completions"
    cases = [({"messages": [{"role": "user", "content": "x"}], "stream": True}, 400, "stream"),
             ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
             ({"model": "gpt-9", "messages": USER}, 404, "not served here"),
             ({"messages": USER, "temperature": -2}, 400, "temperature")]
    for body, status, text in cases:
        r = httpx.post(url, json=body, headers=h, timeout=10)
        assert r.status_code == status and text in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(url, content=b"{nope", headers={**h, "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(served["url"] + "/models", headers=h, timeout=10).json()["data"][0]["id"] == "tiny"
    assert httpx.get(served["url"].replace("/v1", "/health"), timeout=10).json()["status"] == "ok"


def test_recipes_serve_command_line(tmp_path):
    """The real command: ``python -m recipes.serve`` in a subprocess on 127.0.0.1, then one request."""
    import os
    import subprocess


    from lightning_modules.llm.serving.chat_http import OpenAIChatBackend
    from tests.conftest import REPO

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "recipes.serve", "--model", "tiny-llama", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        b = OpenAIChatBackend(base_url=f"http://127.0.0.1:{port}/v1", model="tiny-llama", api_key_env=None,
                              max_retries=60, backoff=0.5, backoff_max=0.5, timeout=30)
        out = b.chat(USER, max_tokens=3)
        assert out.completion_tokens == 3
    finally:
        proc.terminate()
        text = proc.communicate(timeout=30)[0]
    assert f"at http://127.0.0.1:{port}/v1" in text
    bad = subprocess.run([sys.executable, "-m", "recipes.serve", "--port", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--port 0" in bad.stderr



def test_model_judge_runs_on_any_backend():
    from lightning_modules.llm.eval.judges import ModelJudge

    backend = ScriptedBackend(["<think>hmm</think>[[Fully supported]]", "[[Irrelevant]]"], model="judge")
    judge = ModelJudge(backend=backend)
    assert judge.support("s", "e") == 1.0 and judge.relevant("s", "e") is False
    assert judge.name == "model:scripted:judge:v1" and judge.calls == 2
    assert backend.calls[0]["generation"]["max_tokens"] == judge.max_new_tokens
