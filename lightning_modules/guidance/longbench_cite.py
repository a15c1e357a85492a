"""LongBench-Cite's citation metrics for one response, with any :class:`~lightning_modules.llm.eval.judges.Judge`.

A response is a sequence of ``<statement>TEXT<cite>[s-e][s-e]</cite></statement>``; text outside the tags is
split into sentences that count as statements without citations. Citation spans are clipped to the context's
sentence numbers, reversed spans are put in order, overlapping or adjacent spans merged, and at most
``max_citations`` (3) merged spans are kept per statement; at most ``max_statements`` (40) statements are scored.

* **recall** (per response: the mean over statements) - a statement with citations scores the judge's support of
  it by the cited sentences together (1 / 0.5 / 0); one without scores ``1 - needs_citation``.
* **precision** - the mean over all the response's citations (one per merged span) of whether the span's
  sentences are relevant to their statement (0 when the response cites nothing).
* **F1** = ``2 R P / (R + P)`` (0 when both are 0).

With known gold sentences (the generated citation task) ``gold_recall`` is the share of gold sentences cited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from litctx_common.sentences import split_sentences

__all__ = ["Statement", "parse_response", "merge_spans", "score_response", "format_statement"]

_STATEMENT = re.compile(r"<statement>(.*?)</statement>", re.S)
_SPAN = re.compile(r"\[\s*(\d+)\s*(?:-\s*(\d+)\s*)?\]")


@dataclass
class Statement:
    text: str
    spans: List[Tuple[int, int]] = field(default_factory=list)


def format_statement(text: str, spans: Sequence[Tuple[int, int]] = ()) -> str:
    """``<statement>text<cite>[s-e]...</cite></statement>``."""
    return f"<statement>{text}<cite>{''.join(f'[{s}-{e}]' for s, e in spans)}</cite></statement>"


def merge_spans(spans: Sequence[Tuple[int, int]], n_sentences: int, max_citations: int = 3) -> List[Tuple[int, int]]:
    """Clip to ``0 .. n_sentences - 1``, order each span, merge overlapping / adjacent ones (in order of first
    sentence), keep the first ``max_citations``."""
    if n_sentences <= 0:
        return []
    clipped = []
    for s, e in spans:
        s, e = sorted((int(s), int(e)))
        if e < 0 or s > n_sentences - 1:
            continue
        clipped.append((max(0, s), min(n_sentences - 1, e)))
    merged: List[Tuple[int, int]] = []
    for s, e in sorted(clipped):
        if merged and s <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged[:max_citations]


def parse_response(text: str, n_sentences: int, max_statements: int = 40, max_citations: int = 3) -> List[Statement]:
    """The statements of a response (see the module docstring)."""
    out: List[Statement] = []
    pos = 0
    for m in _STATEMENT.finditer(text):
        out += _loose(text[pos:m.start()])
        body = m.group(1)
        stmt, _, cites = body.partition("<cite>")
        cites = cites.split("</cite>")[0]
        spans = [(int(a), int(b) if b else int(a)) for a, b in _SPAN.findall(cites)]
        stmt = stmt.strip()
        if stmt:
            out.append(Statement(stmt, merge_spans(spans, n_sentences, max_citations)))
        pos = m.end()
    out += _loose(text[pos:])
    return out[:max_statements]


def _loose(text: str) -> List[Statement]:
    text = re.sub(r"</?(statement|cite)>", " ", text)
    return [Statement(s.text) for s in split_sentences(text) if re.search(r"\w", s.text)]


def score_response(text: str, sentences: Sequence[str], judge: Any, gold: Optional[Sequence[int]] = None,
                   max_statements: int = 40, max_citations: int = 3) -> Dict[str, Any]:
    """``{recall, precision, f1, statements, citations[, gold_recall]}`` of one response over the context's
    ``sentences`` (numbered as in the prompt)."""
    stmts = parse_response(text, len(sentences), max_statements, max_citations)
    recalls, precisions = [], []
    for st in stmts:
        if st.spans:
            evidence = " ".join(sentences[i] for s, e in st.spans for i in range(s, e + 1))
            recalls.append(float(judge.support(st.text, evidence)))
            for s, e in st.spans:
                precisions.append(float(judge.relevant(st.text, " ".join(sentences[s:e + 1]))))
        else:
            recalls.append(0.0 if judge.needs_citation(st.text) else 1.0)
    recall = sum(recalls) / len(recalls) if recalls else 0.0
    precision = sum(precisions) / len(precisions) if precisions else 0.0
    f1 = 2 * recall * precision / (recall + precision) if recall + precision > 0 else 0.0
    out: Dict[str, Any] = {"recall": recall, "precision": precision, "f1": f1, "statements": len(stmts),
                           "citations": len(precisions), "judge": getattr(judge, "name", type(judge).__name__)}
    if gold is not None:
        cited = {i for st in stmts for s, e in st.spans for i in range(s, e + 1)}
        out["gold_recall"] = sum(g in cited for g in gold) / len(gold) if gold else None
    return out
