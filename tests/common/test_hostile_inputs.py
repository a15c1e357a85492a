"""Hostile inputs, generated (issue 54): property-based tests over the record loaders, the chat server's request
parser and the config layer. Whatever the input, the answer is a correct result or a one-line error that names
where the problem is; never another exception type, a hang, or a silent coercion. Fixed example counts,
derandomised: the same cases on every run."""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="property tests need hypothesis: pip install -e .[dev]")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

FIXED = settings(max_examples=60, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def loaded_or_refused(tmp_path_factory, name, text, load, error=ValueError, where=None):
    """``load(path)`` of ``text`` written to a file ``name``; None when it was refused with a one-line ``error``
    naming the file (or ``where``). Any other exception, or a multi-line message, fails the test."""
    path = tmp_path_factory.mktemp("in") / name
    path.write_text(text)
    try:
        return load(path)
    except error as err:
        message = str(err)
        assert "\n" not in message and (name in message or (where and where in message)), message
        return None


def jsonl(records):
    return "\n".join(json.dumps(r) for r in records) + "\n"


question_records = st.fixed_dictionaries({}, optional={"question": json_values, "answers": json_values,
                                                       "answer": json_values, "id": json_values}) | json_values


@FIXED
@given(st.lists(question_records, min_size=1, max_size=4))
def test_questions_loader_returns_strings_or_names_the_line(tmp_path_factory, records):
    from datamodules.rag_tasks import load_questions

    out = loaded_or_refused(tmp_path_factory, "q.jsonl", jsonl(records), lambda p: load_questions(str(p)))
    if out is None:
        return
    for q in out:  # accepted: every field has the type it claims, nothing coerced from a container or null
        assert isinstance(q["question"], str) and q["question"].strip()
        assert all(isinstance(a, str) for a in q["answers"])
    for r in records:
        assert isinstance(r, dict) and isinstance(r.get("question"), str)


@FIXED
@given(st.lists(json_values | st.fixed_dictionaries({"id": st.text(max_size=4)}, optional={
    "turns": json_values, "sessions": json_values, "qa": json_values}), min_size=1, max_size=3))
def test_dialogue_reader_answers_or_names_the_line(tmp_path_factory, dialogues):
    from datamodules.dialogue import read_dialogue_file
    from litctx_common.errors import DataError

    out = loaded_or_refused(tmp_path_factory, "d.jsonl", jsonl(dialogues), lambda p: read_dialogue_file(str(p)),
                            DataError)
    if out is None:
        return
    for d in out:
        assert all(isinstance(t["user"], str) and isinstance(t["assistant"], str) for t in d["turns"])


@FIXED
@given(json_values)
def test_the_request_parser_answers_or_refuses_in_openai_shape(body):
    from lightning_modules.llm.serving.chat_server import _check_request

    body = body if isinstance(body, dict) else {"messages": body}
    checked, refused = _check_request(body, "tiny")
    if refused is not None:
        payload = json.loads(refused.body)
        assert 400 <= refused.status_code < 500 and payload["error"]["message"] and "\n" not in payload["error"]["message"]
        return
    messages, gen = checked
    assert messages and all(isinstance(m["content"], str) and m["role"] in ("system", "user", "assistant")
                            for m in messages)


keys = st.sampled_from(["method.args.max_new_tokens", "method.args.retrieval.k", "method.args.judge_args.full",
                        "data.args.samples", "trainer.max_epochs", "method.args.nope", "data.args.encoding",
                        "method.args.retrieval", "seed", "callbacks.x.name"])
values = st.sampled_from(["1", "-3", "0.5", "abc", "null", "[1, 2]", "{a: 1}", "true", "''", "1e9"])


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=2))
def test_the_config_layer_answers_or_refuses_in_one_line(pairs):
    from recipes.config import ConfigError, load_config

    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        load_config("rag_smollm2", overrides)
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).strip(), overrides


document_records = st.fixed_dictionaries({}, optional={"text": json_values, "id": json_values, "doc_id": json_values,
                                                       "title": json_values}) | json_values


@FIXED
@given(st.lists(document_records, min_size=1, max_size=4))
def test_the_documents_loader_returns_strings_or_names_the_line(tmp_path_factory, records):
    from litctx_common.documents import read_records

    docs = loaded_or_refused(tmp_path_factory, "docs.jsonl", jsonl(records), lambda p: read_records(p.parent),
                             where="data.path")
    if docs is None:
        return
    assert all(isinstance(d.text, str) and d.text.strip() for d in docs)
    assert all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in records)


lbc_records = st.fixed_dictionaries({}, optional={"query": json_values, "context": json_values, "answer": json_values,
                                                  "idx": json_values, "dataset": json_values}) | json_values


@FIXED
@given(st.lists(lbc_records, min_size=1, max_size=3), st.booleans())
def test_the_longbench_cite_loader_returns_strings_or_names_the_record(tmp_path_factory, records, as_list):
    from datamodules.rag_tasks import load_longbench_cite

    text = json.dumps(records) if as_list else jsonl(records)
    out = loaded_or_refused(tmp_path_factory, "lbc.json", text, lambda p: load_longbench_cite(str(p)))
    if out is None:
        return
    for s in out:
        assert isinstance(s["question"], str) and all(isinstance(a, str) for a in s["answers"])
        assert isinstance(s["documents"][0]["text"], str)


words = st.text(st.characters(categories=["L"]), min_size=1, max_size=6)


def mostly(valid, hostile):
    """``valid`` three times in four: a record must get past its first fields for the later ones to be tried."""
    return st.one_of(valid, valid, valid, hostile)


persistbench_records = mostly(st.fixed_dictionaries(
    {"memories": mostly(st.lists(words, min_size=1, max_size=3), json_values), "query": mostly(words, json_values)},
    optional={"failure_type": mostly(st.sampled_from(["cross_domain", "sycophancy", "beneficial_memory_usage"]),
                                     json_values),
              "active": mostly(st.lists(st.integers(0, 1), max_size=2), st.lists(st.integers(-1, 3) | st.booleans(),
                                                                                max_size=3) | json_values),
              "hints": mostly(st.dictionaries(st.sampled_from(["leak_terms", "use_terms"]), st.lists(words)),
                              json_values),
              "id": json_values, "query_domain": json_values}), json_values)


@FIXED
@given(st.lists(persistbench_records, min_size=1, max_size=2))
def test_the_persistbench_loader_returns_samples_or_names_the_line(tmp_path_factory, records):
    from datamodules.persistbench import FAILURE_TYPES, HINT_KEYS, load_samples

    out = loaded_or_refused(tmp_path_factory, "pb.jsonl", jsonl(records), lambda p: load_samples(str(p)))
    if out is None:
        return
    for s, r in zip(out, records):  # accepted: each field had the type the sample claims, nothing coerced
        assert isinstance(r, dict)
        assert s["memories"] == r["memories"] and all(isinstance(m, str) and m.strip() for m in s["memories"])
        assert isinstance(r["query"], str) and s["query"] == r["query"]
        assert s["failure_type"] in FAILURE_TYPES
        if r.get("active") is not None:  # indices, never booleans read as 0/1
            assert all(type(i) is int and 0 <= i < len(s["memories"]) for i in r["active"])
        assert all(k in HINT_KEYS for k in s["hints"])
        if "id" in r:
            assert type(r["id"]) in (str, int) and s["id"] == str(r["id"])
        assert isinstance(r.get("query_domain", ""), str)
