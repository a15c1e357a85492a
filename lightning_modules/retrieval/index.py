"""Search indexes over chunk texts: dense cosine (:class:`VectorIndex`, numpy or faiss) and lexical
(:class:`BM25Index`, Okapi BM25). Both answer ``search(query, k) -> [(row, score)]`` best first, ties broken by
the lower row, so results are deterministic.

BM25 (Robertson and Zaragoza's Okapi form, Lucene's non-negative idf):
``score(q, d) = sum_{t in q} idf(t) * tf(t, d) (k1 + 1) / (tf(t, d) + k1 (1 - b + b |d| / avgdl))`` with
``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))``; defaults ``k1 = 1.5``, ``b = 0.75``. Terms are lower-cased
word tokens; a query term repeated counts once per repetition.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from litctx_common.io import atomic_path

__all__ = ["VectorIndex", "BM25Index", "terms", "BACKENDS"]

BACKENDS = ("numpy", "faiss")
_WORD = re.compile(r"\w+", re.UNICODE)


def terms(text: str) -> List[str]:
    """Lower-cased word tokens."""
    return [w.lower() for w in _WORD.findall(text)]


def _top(scores: np.ndarray, k: int) -> List[Tuple[int, float]]:
    k = min(int(k), scores.shape[0])
    if k <= 0:
        return []
    order = np.lexsort((np.arange(scores.shape[0]), -scores))[:k]
    return [(int(i), float(scores[i])) for i in order]


class VectorIndex:
    """Cosine search over unit vectors ``[n, d]`` (rows as added). ``backend="faiss"`` uses an exact inner-product
    index (``faiss.IndexFlatIP``; install ``faiss-cpu``), same results up to float rounding."""

    def __init__(self, dim: int, backend: str = "numpy") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"vector index backend={backend!r}: valid backends are {', '.join(BACKENDS)}")
        self.dim, self.backend = int(dim), backend
        self.vectors = np.zeros((0, self.dim), dtype=np.float32)
        self._faiss = None
        if backend == "faiss":
            try:
                import faiss
            except ImportError:
                raise ImportError("vector index backend='faiss' needs faiss: pip install faiss-cpu (or use "
                                  "backend='numpy')") from None
            self._faiss = faiss.IndexFlatIP(self.dim)

    def __len__(self) -> int:
        return self.vectors.shape[0]

    def add(self, vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ValueError(f"VectorIndex.add: vectors must be [n, {self.dim}], got {list(vectors.shape)}")
        self.vectors = np.concatenate([self.vectors, vectors])
        if self._faiss is not None:
            self._faiss.add(vectors)

    def scores(self, query: np.ndarray) -> np.ndarray:
        query = np.asarray(query, dtype=np.float32).reshape(-1)
        if query.shape[0] != self.dim:
            raise ValueError(f"VectorIndex.search: query has {query.shape[0]} dimensions, the index {self.dim}")
        return self.vectors @ query

    def search(self, query: np.ndarray, k: int) -> List[Tuple[int, float]]:
        if self._faiss is not None and len(self):
            sims, rows = self._faiss.search(np.asarray(query, dtype=np.float32).reshape(1, -1), min(k, len(self)))
            pairs = [(int(r), float(s)) for r, s in zip(rows[0], sims[0]) if r >= 0]
            return sorted(pairs, key=lambda p: (-round(p[1], 6), p[0]))
        return _top(self.scores(query), k)

    def save(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, self.vectors)

    @classmethod
    def load(cls, path: str | Path, backend: str = "numpy") -> "VectorIndex":
        vectors = np.load(str(path))
        index = cls(vectors.shape[1], backend)
        index.add(vectors)
        return index


class BM25Index:
    """Okapi BM25 over documents' word terms (see the module docstring)."""

    def __init__(self, texts: Sequence[str] = (), k1: float = 1.5, b: float = 0.75) -> None:
        if k1 < 0 or not 0.0 <= b <= 1.0:
            raise ValueError(f"BM25 k1={k1} (must be >= 0), b={b} (must be in [0, 1])")
        self.k1, self.b = float(k1), float(b)
        self.tf: List[Counter] = []
        self.lengths: List[int] = []
        self.df: Counter = Counter()
        for t in texts:
            self.add(t)

    def __len__(self) -> int:
        return len(self.tf)

    def add(self, text: str) -> None:
        counts = Counter(terms(text))
        self.tf.append(counts)
        self.lengths.append(sum(counts.values()))
        self.df.update(counts.keys())

    def idf(self, term: str) -> float:
        n, df = len(self.tf), self.df.get(term, 0)
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> np.ndarray:
        n = len(self.tf)
        out = np.zeros(n, dtype=np.float64)
        if n == 0:
            return out
        avgdl = max(sum(self.lengths) / n, 1e-9)
        lengths = np.asarray(self.lengths, dtype=np.float64)
        norm = self.k1 * (1.0 - self.b + self.b * lengths / avgdl)
        for term in terms(query):
            if term not in self.df:
                continue
            tf = np.asarray([c.get(term, 0) for c in self.tf], dtype=np.float64)
            out += self.idf(term) * tf * (self.k1 + 1.0) / (tf + norm)
        return out

    def search(self, query: str, k: int) -> List[Tuple[int, float]]:
        return _top(self.scores(query), k)

    def vocabulary(self) -> Dict[str, int]:
        return dict(self.df)
