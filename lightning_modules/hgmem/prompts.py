"""HGMem's prompts (written for this project) and the readers of their replies.

Every reply is a list of records in the shared delimiter format (``(tag<|>field<|>...)``,
:func:`~lightning_modules.llm.serving.structured.parse_records`); entities inside a field are separated by ``<&>``. A reader
returns what it understood and raises :class:`~lightning_modules.llm.serving.structured.StructuredOutputError` when a reply
holds nothing usable (so the caller retries once with a correction, then logs a rejected step). ``<None>`` is a
valid empty answer.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_modules.llm.serving.structured import StructuredOutputError, parse_records, strip_reasoning

__all__ = ["EVOLVE", "EVOLVE_FLAT", "MERGE", "PLAN", "SUBQUERIES", "DESCRIBE", "ANSWER_SYSTEM", "ANSWER_USER",
           "read_evolve", "lenient_points", "read_flat", "read_merge", "read_plan", "read_subqueries", "read_describe", "read_answer",
           "OBJECT_DELIMITER", "PROMPT_VERSION", "fmt"]

PROMPT_VERSION = "hgmem-prompts-v1"
OBJECT_DELIMITER = "<&>"

EVOLVE = """You keep a working memory while researching a question. The memory is a numbered list of memory points; \
each point links some entities (names) and says what is known about them together.

Question: {question}
Current sub-questions: {subqueries}

Memory points:
{memory}

New evidence:
{evidence}

Record in the memory what the new evidence says that helps to answer the question.
To add a point, write a line: (point<|>Entity A<&>Entity B<|>what the evidence says about them)
To rewrite point N, write a line: (update<|>N<|>Entity A<&>Entity C<|>the new description)
Use entity names exactly as the evidence spells them, and put entities that belong together in one point.
Write only such lines. If nothing in the evidence is worth keeping, write <None>."""

EVOLVE_FLAT = """You keep notes while researching a question.

Question: {question}
Current sub-questions: {subqueries}

Notes so far:
{memory}

New evidence:
{evidence}

Write each new fact from the evidence that helps to answer the question as a line: (fact<|>the fact in one sentence)
Write only such lines. If nothing in the evidence is worth keeping, write <None>."""

MERGE = """Here is a working memory for the question: {question}

Memory points:
{memory}

Some points may describe one connected piece of knowledge. Combine such points into a single point.
Combine only points that together form one coherent fact or chain; do not combine a point that already links more \
than {max_entities} entities.
For each combination write a line: (merge<|>N,M<|>the description of the combined point)
If no points should be combined, write <None>."""

PLAN = """Question: {question}

Memory points:
{memory}

Related facts not yet in the memory:
{extended}

Is the memory enough to answer the question? Reply in one of these three forms.
If it is enough:
[Judgement] 1
If specific memory points need a closer look (up to 3 concerns, each naming the points it is about):
[Judgement] 2.1
(concern<|>N,M<|>what still has to be found out)
If something outside the memory is needed (up to 3 concerns):
[Judgement] 2.2
(concern<|><|>what still has to be found out)"""

SUBQUERIES = """Question: {question}
Searches already made: {previous}

Open concerns:
{concerns}

Write one new search query for each concern, different from the searches already made, as a line:
(subquery<|>the query)"""

DESCRIBE = """Some names in a research memory have no description yet.

Question: {question}
Memory points:
{memory}

Names without a description: {names}

For each name, write a line: (entity<|>NAME<|>TYPE<|>one sentence saying what it is, from the memory)
For any two of these names that are related, write a line: (relationship<|>NAME<|>NAME<|>how they are related)"""

ANSWER_SYSTEM = """Answer the user's question from the research memory and the sources below. Follow chains of facts \
across the sources when the question needs it.

{context}"""

ANSWER_USER = """Question: {question}
Reply with the answer only (a name, a place or a short phrase), on one line, as: Answer: <answer>"""


def _none(text: str) -> bool:
    body = strip_reasoning(text).strip().lower()
    return body in ("", "<none>", "none", "(none)", "none.") or body.startswith("<none>")


def _entities(field: str) -> List[str]:
    parts = field.split(OBJECT_DELIMITER) if OBJECT_DELIMITER in field else re.split(r"\s*[;|]\s*", field)
    return [p.strip() for p in parts if p.strip()]


def _numbers(field: str) -> List[int]:
    return [int(x) for x in re.findall(r"\d+", field)]


def read_evolve(text: str, n_points: int) -> Dict[str, List[Any]]:
    """``{"insert": [(entities, description)], "update": [(index0, entities, description)], "dropped": [str]}``
    (1-based point numbers in the reply become 0-based)."""
    out: Dict[str, List[Any]] = {"insert": [], "update": [], "dropped": []}
    if _none(text):
        return out
    for rec in parse_records(text):
        tag = rec[0].lower()
        if tag == "point" and len(rec) >= 3 and _entities(rec[1]) and rec[2]:
            out["insert"].append((_entities(rec[1]), rec[2]))
        elif tag == "update" and len(rec) >= 4 and _numbers(rec[1]) and rec[3]:
            i = _numbers(rec[1])[0] - 1
            if 0 <= i < n_points:
                out["update"].append((i, _entities(rec[2]), rec[3]))
            else:
                out["dropped"].append(f"update of point {i + 1}: the memory has {n_points} points")
        else:
            out["dropped"].append("<|>".join(rec)[:120])
    if not out["insert"] and not out["update"]:
        raise StructuredOutputError("no (point<|>...) or (update<|>...) line and no <None>" +
                                    (f"; unusable: {out['dropped'][:2]}" if out["dropped"] else ""), text)
    return out


def lenient_points(text: str, names: Sequence[str], limit: int = 5) -> List[Tuple[List[str], str]]:
    """Memory points salvaged from a reply without records: each distinct sentence that names at least one known
    entity (``names``, matched case-insensitively as whole words, longest first) becomes a point over the entities
    it names, the sentence as its description; at most ``limit``."""
    from litctx_common.sentences import split_sentences

    ordered = sorted({n for n in names if n.strip()}, key=lambda n: (-len(n), n))
    patterns = [(n, re.compile(r"(?<![A-Za-z0-9])" + re.escape(n) + r"(?![A-Za-z0-9])", re.I)) for n in ordered]
    out, seen = [], set()
    for sent in split_sentences(strip_reasoning(text)):
        body = " ".join(sent.text.split())
        if body.lower() in seen or len(body.split()) < 3:
            continue
        found, taken = [], body
        for n, rx in patterns:
            if rx.search(taken):
                found.append(n)
                taken = rx.sub(" ", taken)
        if found:
            seen.add(body.lower())
            out.append((found, body))
        if len(out) >= limit:
            break
    return out


def read_flat(text: str) -> List[str]:
    if _none(text):
        return []
    facts = [rec[1] for rec in parse_records(text) if rec[0].lower() == "fact" and len(rec) >= 2 and rec[1]]
    if not facts:
        raise StructuredOutputError("no (fact<|>...) line and no <None>", text)
    return facts


def read_merge(text: str, n_points: int) -> List[Tuple[List[int], str]]:
    """``[(0-based indices, description)]``; groups naming a missing point or fewer than two points are dropped;
    a point used by an earlier group is not used again."""
    if _none(text):
        return []
    out, used = [], set()
    recs = [r for r in parse_records(text) if r[0].lower() == "merge"]
    if not recs:
        raise StructuredOutputError("no (merge<|>...) line and no <None>", text)
    for rec in recs:
        if len(rec) < 3 or not rec[2]:
            continue
        idx = sorted({i - 1 for i in _numbers(rec[1])})
        if len(idx) >= 2 and all(0 <= i < n_points for i in idx) and not used & set(idx):
            used |= set(idx)
            out.append((idx, rec[2]))
    return out


def read_plan(text: str, n_points: int) -> Tuple[str, List[Tuple[List[int], str]]]:
    """``(judgement, concerns)``: judgement ``1``, ``2.1`` or ``2.2``; concerns ``[(0-based points, text)]`` (at
    most 3). A 2.1 concern without valid points makes it a 2.2 concern."""
    body = strip_reasoning(text)
    m = re.search(r"\[\s*judge?ment\s*\]\s*:?\s*(2\.1|2\.2|1)\b", body, flags=re.I) or \
        re.search(r"^\s*(2\.1|2\.2|1)\b", body, flags=re.M)
    if not m:
        raise StructuredOutputError("no [Judgement] 1, 2.1 or 2.2", text)
    judgement = m.group(1)
    concerns = []
    for rec in parse_records(body):
        if rec[0].lower() != "concern":
            continue
        what = rec[-1] if len(rec) >= 2 else ""
        points = [i - 1 for i in _numbers(rec[1])] if len(rec) >= 3 else []
        points = [i for i in points if 0 <= i < n_points]
        if what:
            concerns.append((points, what))
    concerns = concerns[:3]
    if judgement != "1" and not concerns:
        tail = body[m.end():].strip()
        if tail:
            concerns = [([], " ".join(tail.split())[:200])]
        else:
            raise StructuredOutputError(f"judgement {judgement} without a (concern<|>...) line", text)
    if judgement == "2.1" and not any(p for p, _ in concerns):
        judgement = "2.2"
    return judgement, concerns


def read_subqueries(text: str) -> List[str]:
    out = [rec[-1] for rec in parse_records(text) if rec[0].lower() in ("subquery", "query") and len(rec) >= 2
           and rec[-1]]
    if not out:
        lines = [ln.strip(" -*\t") for ln in strip_reasoning(text).splitlines() if ln.strip().endswith("?")]
        out = lines[:3]
    out = [q for q in out if len(q.split()) >= 3 and q.strip().lower() not in ("the query", "the query?")]
    if not out:
        raise StructuredOutputError("no (subquery<|>...) line with a query of three or more words", text)
    return out


def read_describe(text: str) -> Tuple[List[Tuple[str, str, str]], List[Tuple[str, str, str]]]:
    """``(entities [(name, type, description)], relations [(source, target, description)])``."""
    ents, rels = [], []
    for rec in parse_records(text):
        tag = rec[0].lower()
        if tag == "entity" and len(rec) >= 4 and rec[1] and rec[3]:
            ents.append((rec[1], rec[2], rec[3]))
        elif tag in ("relationship", "relation") and len(rec) >= 4 and rec[1] and rec[2]:
            rels.append((rec[1], rec[2], rec[3]))
    return ents, rels


def read_answer(text: str) -> str:
    """The text after ``Answer:`` (its line), else the first non-empty line; trailing period removed."""
    body = strip_reasoning(text)
    m = re.search(r"answer\s*:\s*(.+)", body, flags=re.I)
    line = m.group(1) if m else next((ln for ln in body.splitlines() if ln.strip()), "")
    return line.strip().rstrip(".").strip().strip("*").strip()


def fmt(template: str, **fields: Optional[str]) -> str:
    """``template`` with ``{name}`` fields filled (values are never re-parsed: braces in them are kept)."""
    return re.sub(r"\{(\w+)\}", lambda m: str(fields[m.group(1)]) if m.group(1) in fields else m.group(0), template)

