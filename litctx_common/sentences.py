"""Sentences and chunks of documents, with character offsets into the original text (a citation quotes it verbatim).

:func:`split_sentences` is rule based and offline: a sentence ends at ``.``, ``!``, ``?`` (or the CJK ``。！？；``)
followed by whitespace and a capital, digit, quote or bracket, unless the word before is a known abbreviation
(``e.g.``, ``Dr.``, ``Fig.`` ...) or a single initial (``J.``); a blank line always ends one. This follows what
LongBench-Cite's splitter does (Punkt, then CJK punctuation, then paragraphs as the fall-back) without Punkt's
downloaded data. ``splitter="pysbd"`` uses the ``pysbd`` package instead, when installed.

:func:`chunk_document` packs whole sentences into chunks of at most ``max_tokens`` tokens (a tokenizer's, or
whitespace words), with ``overlap`` sentences repeated between neighbours; a sentence longer than the limit is
a chunk of its own, cut at token boundaries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["Sentence", "Chunk", "split_sentences", "chunk_document", "ABBREVIATIONS", "SPLITTERS"]

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e cf fig figs eq eqs no nos vol pp al approx dept est inc ltd co corp "
    "jan feb mar apr jun jul aug sep sept oct nov dec mt ft u.s u.k a.m p.m ph.d".split())
SPLITTERS = ("regex", "pysbd")

_END = re.compile(r"[.!?。！？；]+[\"'”’)\]]*")
_NEXT = re.compile(r"\s+(?=[\"'“‘(\[]?[A-Z0-9\u00C0-\u024F\u0400-\u04FF\u3040-\u30FF\u4E00-\u9FFF])")
_CJK_END = "。！？；"


@dataclass(frozen=True)
class Sentence:
    """``text[start:end]`` of its document (``text`` is that slice, stripped of surrounding whitespace)."""

    index: int
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Chunk:
    """Consecutive sentences ``sentences`` of document ``doc_id``: ``text`` is ``document[start:end]``."""

    doc_id: str
    index: int
    text: str
    start: int
    end: int
    sentences: Tuple[int, ...]

    @property
    def chunk_id(self) -> str:
        return f"{self.doc_id}#{self.index}"


def _regex_bounds(text: str) -> List[Tuple[int, int]]:
    bounds: List[Tuple[int, int]] = []
    for para in re.finditer(r"\S(?:.*?\S)?(?=\s*\n\s*\n|\s*$)", text, flags=re.S):
        p0, p1 = para.start(), para.end()
        start = p0
        for m in _END.finditer(text, p0, p1):
            end = m.end()
            if end >= p1:
                break
            cjk = text[m.start()] in _CJK_END
            if not cjk:
                nxt = _NEXT.match(text, end)
                if nxt is None:
                    continue
                word = re.search(r"(\S+)$", text[start:m.start() + 1])
                token = word.group(1).lower().rstrip(".").lstrip("\"'“‘([") if word else ""
                if token in ABBREVIATIONS or (len(token) == 1 and token.isalpha()):
                    continue
            bounds.append((start, end))
            start = end
            while start < p1 and text[start].isspace():
                start += 1
        if start < p1:
            bounds.append((start, p1))
    return bounds


def _pysbd_bounds(text: str) -> List[Tuple[int, int]]:
    try:
        import pysbd
    except ImportError:
        raise ImportError("splitter='pysbd' needs the pysbd package: pip install pysbd==0.3.4 (or use "
                          "splitter='regex', the offline default)") from None
    seg = pysbd.Segmenter(language="en", clean=False, char_span=True)
    return [(s.start, s.end) for s in seg.segment(text)]


def split_sentences(text: str, splitter: str = "regex") -> List[Sentence]:
    """The sentences of ``text`` with their character spans (see the module docstring)."""
    if splitter not in SPLITTERS:
        raise ValueError(f"splitter={splitter!r}: valid splitters are {', '.join(SPLITTERS)}")
    bounds = _regex_bounds(text) if splitter == "regex" else _pysbd_bounds(text)
    out: List[Sentence] = []
    for s, e in bounds:
        piece = text[s:e]
        lead = len(piece) - len(piece.lstrip())
        piece = piece.strip()
        if piece:
            out.append(Sentence(len(out), piece, s + lead, s + lead + len(piece)))
    return out


def _counter(tokenizer: Any) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda s: len(s.split())
    return lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])


def chunk_document(doc_id: str, text: str, max_tokens: int = 128, overlap: int = 0, tokenizer: Any = None,
                   sentences: Optional[Sequence[Sentence]] = None, splitter: str = "regex") -> List[Chunk]:
    """Pack ``text``'s sentences into chunks of at most ``max_tokens`` tokens (see the module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"chunk max_tokens={max_tokens}: must be >= 1")
    if overlap < 0:
        raise ValueError(f"chunk overlap={overlap}: must be >= 0 sentences")
    sents = list(sentences) if sentences is not None else split_sentences(text, splitter)
    count = _counter(tokenizer)
    sizes = [count(s.text) for s in sents]
    chunks: List[Chunk] = []
    i = 0
    while i < len(sents):
        j, total = i, 0
        while j < len(sents) and (j == i or total + sizes[j] <= max_tokens):
            total += sizes[j]
            j += 1
        members = sents[i:j]
        chunks.append(Chunk(doc_id, len(chunks), text[members[0].start:members[-1].end], members[0].start,
                            members[-1].end, tuple(s.index for s in members)))
        if j >= len(sents):
            break
        i = j if j - i <= overlap else j - overlap
    return chunks
