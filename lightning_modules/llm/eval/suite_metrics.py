"""Scoring and summaries of long-context suite records (one dict per evaluated sample).

Metrics of :func:`score_prediction` (a sample's ``metric`` field names one):

* ``any``: 1.0 if some reference occurs in the prediction, else 0.0 (RULER's single-answer match).
* ``all``: the fraction of references that occur in the prediction (RULER's multi-answer match).
* ``ordered``: the fraction of the references recited in order: the length of the longest prefix of the
  reference list whose items occur one after another (each after the end of the previous one) in the
  prediction, divided by the list length. Items are matched as whole words after normalising both sides
  (lower case, punctuation and whitespace runs turned into single spaces), so ``a-b : x y > c-d`` matches
  ``A-B: x, y -> c-d``. Used by ``pointer_chasing``, whose answer is a list of records.

``any`` and ``all`` match case-insensitive substrings (unchanged since the first suite runs).

A record holds at least ``task``, ``length``, ``depth`` (NaN for tasks without a needle), ``score`` in
``[0, 1]`` and ``prediction``; :func:`summarise` turns a list of them into per-task accuracy by length and a
depth x length grid over the needle tasks.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Sequence

from litctx_common.stats import mean_sd, paired_bootstrap  # noqa: F401 - re-exported: the suite's users import it here

__all__ = ["METRICS", "score_prediction", "ordered_prefix", "summarise", "markdown_table", "depth_grid",
           "paired_bootstrap", "mean_prefill_seconds"]


METRICS = ("any", "all", "ordered")

_NON_WORD = re.compile(r"[\W_]+")


def _normalise(text: str) -> str:
    """Lower case, every run of punctuation/whitespace as one space, padded with a space at both ends (so a
    search for ``" item "`` matches whole words only)."""
    return " " + _NON_WORD.sub(" ", text.lower()).strip() + " "


def ordered_prefix(prediction: str, answers: Sequence[str]) -> int:
    """How many leading ``answers`` occur in ``prediction`` one after another (normalised whole-word match;
    each is searched after the end of the previous match). An item that normalises to nothing ends the
    prefix."""
    pred = _normalise(prediction)
    at = 0
    for n, answer in enumerate(answers):
        item = _normalise(str(answer))
        if not item.strip():
            return n
        found = pred.find(item, at)
        if found < 0:
            return n
        at = found + len(item) - 1  # the closing space may open the next match
    return len(answers)


def score_prediction(prediction: str, answers: Sequence[str], metric: str) -> float:
    """Score of one prediction in [0, 1] by ``metric`` (see the module docstring):

    * ``any`` -> 1.0 if some reference occurs in ``prediction`` (case-insensitive);
    * ``all`` -> the fraction of references that occur (case-insensitive);
    * ``ordered`` -> :func:`ordered_prefix` / ``len(answers)``.

    An empty ``answers`` scores 0.0 under ``all`` and ``ordered``.
    """
    if metric == "ordered":
        return ordered_prefix(prediction, answers) / len(answers) if answers else 0.0
    pred = prediction.lower()
    hits = [str(a).lower() in pred for a in answers]
    if metric == "any":
        return float(any(hits))
    if metric == "all":
        return sum(hits) / len(hits) if hits else 0.0
    raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")


def _mean_sem(values: Sequence[float]) -> Dict[str, float]:
    s = mean_sd(values)
    return {"mean": s.mean, "n": s.n, "sem": s.sem}


def summarise(records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """``{"cells": {task: {length: {mean, n, sem}}}, "tasks": {task: {mean, n, sem}}, "lengths": {...},
    "overall": {...}}`` (accuracy in [0, 1]; ``sem`` = standard error of the mean over samples)."""
    if not records:
        raise ValueError("no records to summarise")
    cells: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        cells[str(r["task"])][int(r["length"])].append(float(r["score"]))
    out = {"cells": {t: {n: _mean_sem(v) for n, v in sorted(by.items())} for t, by in sorted(cells.items())}}
    out["tasks"] = {t: _mean_sem([s for v in by.values() for s in v]) for t, by in sorted(cells.items())}
    lengths: Dict[int, List[float]] = defaultdict(list)
    for by in cells.values():
        for n, v in by.items():
            lengths[n].extend(v)
    out["lengths"] = {n: _mean_sem(v) for n, v in sorted(lengths.items())}
    out["overall"] = _mean_sem([float(r["score"]) for r in records])
    return out


def depth_grid(records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Mean score per (depth, length) over records with a depth: ``{"depths": [...], "lengths": [...],
    "grid": [[mean or NaN per length] per depth], "counts": [[n ...] ...]}``."""
    acc: Dict[tuple, List[float]] = defaultdict(list)
    for r in records:
        d = r.get("depth")
        if d is None or (isinstance(d, float) and math.isnan(d)):
            continue
        acc[(round(float(d), 4), int(r["length"]))].append(float(r["score"]))
    depths = sorted({k[0] for k in acc})
    lengths = sorted({k[1] for k in acc})
    grid = [[(sum(acc[(d, n)]) / len(acc[(d, n)])) if acc.get((d, n)) else math.nan for n in lengths] for d in depths]
    counts = [[len(acc.get((d, n), [])) for n in lengths] for d in depths]
    return {"depths": depths, "lengths": lengths, "grid": grid, "counts": counts}


def markdown_table(summary: Mapping[str, Any], percent: bool = True) -> str:
    """Task x length accuracy table (mean +- sem, n) in Markdown."""
    lengths = list(summary["lengths"])
    scale = 100.0 if percent else 1.0

    def cell(c: Mapping[str, float]) -> str:
        return f"{scale * c['mean']:.1f} ± {scale * c['sem']:.1f} (n={c['n']})"

    head = "| task | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths) + " | all |"
    rows = [head, "|" + "---|" * (len(lengths) + 2)]
    for task, by in summary["cells"].items():
        rows.append(f"| {task} | " + " | ".join(cell(by[n]) if n in by else "-" for n in lengths)
                    + f" | {cell(summary['tasks'][task])} |")
    rows.append("| **mean** | " + " | ".join(cell(summary["lengths"][n]) for n in lengths)
                + f" | {cell(summary['overall'])} |")
    return "\n".join(rows)


def mean_prefill_seconds(records: Sequence[Mapping[str, Any]]) -> str:
    """``"1K 2.8 s, 2K 7.8 s, ..."``: the mean recorded ``prefill_s`` per context length, shortest first."""
    by_length: Dict[int, List[float]] = defaultdict(list)
    for r in records:
        by_length[int(r["length"])].append(float(r["prefill_s"]))
    return ", ".join(f"{n // 1024}K {sum(v) / len(v):.1f} s" for n, v in sorted(by_length.items()))
