"""LongBench-Cite scoring and the judges: parsing, span clipping / merging / the 3-citation and 40-statement
limits, recall / precision / F1 on hand-computed cases, the lexical judge's rules and the model judge's verdict
parsing."""

from __future__ import annotations

import pytest

from lightning_modules.guidance.longbench_cite import format_statement, merge_spans, parse_response, score_response
from lightning_modules.llm.eval.judges import LexicalJudge, ModelJudge, build_judge, content_words

SENTENCES = ["Oslo is in Norway.", "Unrelated sentence about cats.", "Norway borders Sweden.", "Cats purr."]


def test_spans_are_clipped_ordered_merged_and_capped():
    assert merge_spans([(5, 3), (4, 6), (8, 8), (-2, 0), (20, 30), (9, 12)], 10) == [(0, 0), (3, 6), (8, 9)]
    assert merge_spans([(1, 1), (3, 3), (5, 5), (7, 7)], 10) == [(1, 1), (3, 3), (5, 5)]
    assert merge_spans([(1, 2), (3, 4)], 10) == [(1, 4)]  # adjacent spans merge
    assert merge_spans([(11, 12)], 10) == [] and merge_spans([(0, 0)], 0) == []


def test_parse_reads_statements_single_numbers_and_loose_text():
    text = ("Intro line. <statement>A fact.<cite>[2][0-1]</cite></statement> trailing words <statement>Empty."
            "<cite></cite></statement>")
    st = parse_response(text, 4)
    assert [(s.text, s.spans) for s in st] == [("Intro line.", []), ("A fact.", [(0, 2)]),
                                               ("trailing words", []), ("Empty.", [])]
    many = "".join(format_statement(f"Fact {i}.", [(0, 0)]) for i in range(50))
    assert len(parse_response(many, 4)) == 40


def test_recall_precision_f1_on_a_hand_computed_response():
    text = (format_statement("Oslo is in Norway.", [(0, 0), (2, 3)]) + format_statement("Hello there.")
            + " Extra sentence with 1921.")
    got = score_response(text, SENTENCES, LexicalJudge(), gold=[0, 1])
    # statement 1: fully supported (oslo, norway both cited) -> 1; spans (0,0) and (2,3) both relevant -> P = 1
    # statement 2: no citation, needs none -> 1; statement 3: no citation but a number -> needs one -> 0
    assert got["recall"] == pytest.approx(2 / 3)
    assert got["precision"] == pytest.approx(1.0)
    assert got["f1"] == pytest.approx(0.8)
    assert got["statements"] == 3 and got["citations"] == 2 and got["gold_recall"] == 0.5
    bad = score_response(format_statement("Cats purr loudly at night.", [(0, 0)]), SENTENCES, LexicalJudge())
    assert bad["precision"] == 0.0 and bad["recall"] == 0.0 and bad["f1"] == 0.0
    none = score_response("No tags at all here.", SENTENCES, LexicalJudge())
    assert none["citations"] == 0 and none["precision"] == 0.0


def test_lexical_judge_rules():
    j = LexicalJudge()
    assert content_words("The cat is on the mat in 1921.") == ["cat", "mat", "1921"]
    assert j.support("Ada was born in Oslo in 1921.", "Ada was born in Oslo in 1921. Other.") == 1.0
    assert j.support("Ada was born in Oslo in 1921.", "Ada lived in Oslo.") == 0.5
    assert j.support("Ada was born in Oslo in 1921.", "Cats purr.") == 0.0
    assert j.relevant("Ada won in 1950.", "The year 1950 was cold.")  # a shared number
    assert not j.relevant("Ada won in 1950.", "Cats purr.")
    assert j.needs_citation("It was founded by Mira.") and not j.needs_citation("Thank you.")


def test_model_judge_reads_bracketed_verdicts_and_counts_what_it_cannot_read(monkeypatch):
    judge = ModelJudge(model=("m", "t"))
    replies = iter(["[[Partially supported]]", "fully supported, I think", "no idea", "[[Irrelevant]]", "[[Yes]]"])
    monkeypatch.setattr(judge, "_ask", lambda prompt: next(replies))
    assert judge.support("s", "e") == 0.5
    assert judge.support("s", "e") == 1.0
    assert judge.support("s", "e") == 0.0 and judge.unparsed == 1
    assert judge.relevant("s", "e") is False
    assert judge.needs_citation("s") is True
    assert judge.name.startswith("model:") and build_judge("lexical").name == "lexical-v1"
    with pytest.raises(ValueError, match="valid judges"):
        build_judge("gpt")
