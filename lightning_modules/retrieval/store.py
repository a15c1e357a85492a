"""A document store and its retriever: documents (a folder of ``.txt`` / ``.md`` / ``.jsonl``, or records in
memory) split into sentences and chunks once, searched by a dense embedder, BM25 or both fused by reciprocal rank
(``1 / (60 + rank)`` summed over the two lists, Cormack et al.'s constant).

    store = DocumentStore.from_folder("my_docs", max_tokens=128)
    hits = Retriever(store, method="hybrid").search("who signed the treaty?", k=4)
    hits[0].chunk.text, hits[0].chunk.doc_id, hits[0].score

Every sentence keeps its character span in its document (:class:`~lightning_modules.retrieval.text.Sentence`),
so a citation can quote it verbatim and name it by ``(doc_id, sentence index)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from litctx_common.documents import Document, read_records
from lightning_modules.retrieval.embedders import build_embedder
from lightning_modules.retrieval.index import BM25Index, VectorIndex
from lightning_modules.retrieval.text import Chunk, Sentence, chunk_document, split_sentences

__all__ = ["DocumentStore", "Retriever", "Hit", "METHODS", "RRF_K"]

METHODS = ("dense", "bm25", "hybrid")
RRF_K = 60


@dataclass
class DocumentStore:
    """Documents with their sentences and chunks (built by :meth:`from_documents` / :meth:`from_folder`)."""

    documents: List[Document]
    sentences: Dict[str, List[Sentence]]
    chunks: List[Chunk]

    @classmethod
    def from_documents(cls, documents: Sequence[Document], max_tokens: int = 128, overlap: int = 0,
                       tokenizer: Any = None, splitter: str = "regex") -> "DocumentStore":
        docs = list(documents)
        ids = [d.doc_id for d in docs]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"DocumentStore: document ids must be unique; repeated: {dup[:5]}")
        sentences: Dict[str, List[Sentence]] = {}
        chunks: List[Chunk] = []
        for d in docs:
            sentences[d.doc_id] = split_sentences(d.text, splitter)
            chunks.extend(chunk_document(d.doc_id, d.text, max_tokens, overlap, tokenizer, sentences[d.doc_id]))
        return cls(docs, sentences, chunks)

    @classmethod
    def from_folder(cls, path: str, text_field: str = "text", encoding: str = "utf-8", **kwargs: Any) -> "DocumentStore":
        """The documents of a folder (or one file) of ``.txt`` / ``.md`` / ``.jsonl``, decoded strictly in
        ``encoding`` (:func:`litctx_common.documents.read_records`)."""
        return cls.from_documents(read_records(path, text_field, key="documents", encoding=encoding), **kwargs)

    def document(self, doc_id: str) -> Document:
        for d in self.documents:
            if d.doc_id == doc_id:
                return d
        raise KeyError(f"no document {doc_id!r} in the store (it holds {len(self.documents)})")


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float
    rank: int


@dataclass
class Retriever:
    """Search a :class:`DocumentStore`'s chunks (``method``: ``dense``, ``bm25`` or ``hybrid``; ``embedder``:
    a name for :func:`~lightning_modules.retrieval.embedders.build_embedder` or an object)."""

    store: DocumentStore
    method: str = "dense"
    embedder: Any = "minilm"
    backend: str = "numpy"
    _vectors: Optional[VectorIndex] = field(default=None, init=False, repr=False)
    _bm25: Optional[BM25Index] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"retrieval method={self.method!r}: valid methods are {', '.join(METHODS)}")
        if not self.store.chunks:
            raise ValueError("Retriever: the store holds no chunks")
        texts = [c.text for c in self.store.chunks]
        if self.method in ("dense", "hybrid"):
            if isinstance(self.embedder, str):
                self.embedder = build_embedder(self.embedder)
            self._vectors = VectorIndex(self.embedder.dim, self.backend)
            self._vectors.add(self.embedder.encode(texts))
        if self.method in ("bm25", "hybrid"):
            self._bm25 = BM25Index(texts)

    def _ranked(self, query: str, k: int) -> List[Tuple[int, float]]:
        n = len(self.store.chunks)
        if self.method == "dense":
            return self._vectors.search(self.embedder.encode([query])[0], k)
        if self.method == "bm25":
            return self._bm25.search(query, k)
        dense = self._vectors.search(self.embedder.encode([query])[0], n)
        lexical = self._bm25.search(query, n)
        fused = np.zeros(n)
        for ranking in (dense, lexical):
            for rank, (row, _) in enumerate(ranking):
                fused[row] += 1.0 / (RRF_K + rank + 1)
        order = np.lexsort((np.arange(n), -fused))[:k]
        return [(int(i), float(fused[i])) for i in order]

    def search(self, query: str, k: int = 4) -> List[Hit]:
        """The ``k`` best chunks for ``query``, best first."""
        if k < 1:
            raise ValueError(f"retrieval k={k}: must be >= 1")
        return [Hit(self.store.chunks[row], score, rank) for rank, (row, score) in enumerate(self._ranked(query, k))]
