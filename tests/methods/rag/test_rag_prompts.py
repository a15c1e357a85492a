"""RAG prompts: the question's own tokens are located inside the tail (fast tokenizer offsets, and the
token-count fallback), an answer prefix goes after the assistant header, and tokens never change because a span
was asked for; generated samples carry an answer prefix (when asked), the gold continuation and their
candidates, and asking for a prefix leaves the sample itself unchanged."""

from __future__ import annotations

import pytest

from datamodules.rag_tasks import RAGDataConfig, RAGDataset
from lightning_modules.rag.prompts import _encode, encode_with_span, build_prompt

from conftest import needs_tokenizer


@pytest.fixture(scope="module")
def tok():
    from lightning_modules.llm.model.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@needs_tokenizer
@pytest.mark.parametrize("chat", [True, False])
def test_the_question_span_spells_the_question_and_the_prefix_ends_the_tail(tok, chat):
    docs = [{"text": "Let AB1 be 4821."}, {"text": "Let CD2 be AB1."}]
    q = "What number is CD2 in the end?"
    p = build_prompt(tok, docs, q, chat=chat, answer_prefix="In the end, CD2 is")
    a, b = p.question_span
    assert tok.decode(p.question_ids[a:b]).strip() == q
    assert tok.decode(p.question_ids).endswith("In the end, CD2 is")
    if chat:
        assert "<|im_start|>assistant\nIn the end, CD2 is" in tok.decode(p.question_ids)
    plain = build_prompt(tok, docs, q, chat=chat)
    assert plain.question_ids == _encode(tok, tok.decode(plain.question_ids))  # the tail encoded whole, as before
    assert tok.decode(plain.question_ids[slice(*plain.question_span)]).strip() == q


@needs_tokenizer
def test_the_span_without_offsets_counts_tokens_to_the_same_place(tok):
    class Slow:  # a tokenizer without offsets (a slow one)
        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
            if return_offsets_mapping:
                raise NotImplementedError
            return tok(text, add_special_tokens=add_special_tokens)

    text = "Question: Who keeps the night desk?\n\nAnswer:"
    start = text.index("Who")
    end = start + len("Who keeps the night desk?")
    assert encode_with_span(Slow(), text, start, end) == encode_with_span(tok, text, start, end)


@pytest.mark.parametrize("source,extra", [("bindings", {"style": "coref"}), ("bindings", {"style": "variables"}),
                                          ("bindings", {"style": "alias"}), ("cite", {})])
def test_generated_samples_carry_prefix_gold_and_candidates_without_changing(source, extra):
    base = RAGDataConfig(source=source, samples=3, distractors=3, chunk_words=20, filler="none", **extra)
    with_prefix = RAGDataConfig(source=source, samples=3, distractors=3, chunk_words=20, filler="none",
                                answer_prefix=True, **extra)
    for i in range(3):
        a, b = RAGDataset(base)[i], RAGDataset(with_prefix)[i]
        assert "answer_prefix" not in a and {k: v for k, v in b.items() if k not in ("answer_prefix", "answer_text")
                                             } == a
        assert b["answer_text"].strip().lower().find(a["answers"][0].lower()) >= 0
        assert a["answers"][0] in a["candidates"] and len(a["candidates"]) >= 2
        text = " ".join(d["text"] for d in a["documents"])
        assert all(c in text for c in a["candidates"])  # every candidate is in the context
