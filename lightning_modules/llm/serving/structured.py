"""Structured output from free text: reasoning traces stripped, JSON found and repaired, delimiter records parsed,
and a bounded retry that tells the model what was wrong.

* :func:`strip_reasoning` - removes ``<think>...</think>`` (also ``thinking``, ``reasoning``, ``reflection``) blocks;
  an unclosed opening tag drops the rest of the text, and a closing tag without its opening (the template opened
  it) drops everything before it.
* :func:`parse_json` - the first JSON object (a fenced ```json block first), repaired with ``json_repair`` when it
  does not parse (trailing commas, single quotes, a missing brace), checked against ``required`` keys and types;
  :class:`StructuredOutputError` otherwise, quoting the start of the text and saying what was expected.
* :func:`parse_records` - LightRAG-style records: ``("entity"<|>Ada<|>person<|>...)`` separated by ``##`` and ended
  by ``<|COMPLETE|>``; tolerant of missing parentheses, quotes, stray whitespace and a missing completion marker.
* :func:`split_sections` - text under bracketed headers (``[Inserted Memory Points]`` ...).
* :func:`ask_structured` - call a backend, parse; on a parse error append the reply and a correction and ask again,
  at most ``retries`` more times, then raise the last error.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

__all__ = ["StructuredOutputError", "strip_reasoning", "parse_json", "parse_records", "split_sections",
           "ask_structured", "REASONING_TAGS", "TUPLE_DELIMITER", "RECORD_DELIMITER", "COMPLETION_MARKER"]

REASONING_TAGS = ("think", "thinking", "reasoning", "reflection")
TUPLE_DELIMITER = "<|>"
RECORD_DELIMITER = "##"
COMPLETION_MARKER = "<|COMPLETE|>"
T = TypeVar("T")


class StructuredOutputError(ValueError):
    """A reply that could not be read as the structure asked for. ``text``: the reply."""

    def __init__(self, message: str, text: str = "") -> None:
        super().__init__(message)
        self.text = text


def _excerpt(text: str, n: int = 160) -> str:
    flat = " ".join(text.split())
    return repr(flat[:n] + ("..." if len(flat) > n else ""))


def strip_reasoning(text: str, tags: Sequence[str] = REASONING_TAGS) -> str:
    """``text`` without reasoning traces (see the module docstring), stripped of surrounding whitespace."""
    out = text
    for tag in tags:
        out = re.sub(rf"<{tag}\b[^>]*>.*?</{tag}\s*>", "", out, flags=re.S | re.I)
        close = re.search(rf"</{tag}\s*>", out, flags=re.I)
        if close:  # the opening tag was in the prompt (a template that starts the assistant turn thinking)
            out = out[close.end():]
        opened = re.search(rf"<{tag}\b[^>]*>", out, flags=re.I)
        if opened:  # never closed: the reply ran out while thinking
            out = out[:opened.start()]
    return out.strip()


def _candidates(text: str) -> List[str]:
    """JSON-looking spans: fenced blocks first, then each balanced ``{...}`` from the first brace."""
    out = [m.group(1) for m in re.finditer(r"```(?:json|JSON)?\s*(.*?)```", text, flags=re.S)]
    start = text.find("{")
    while start >= 0:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
                continue
            if c == '"':
                in_str = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:i + 1])
                    break
        else:
            out.append(text[start:])  # unbalanced: repair may close it
            break
        start = text.find("{", i + 1)
    return out


def _check(obj: Any, required: Mapping[str, Any], text: str) -> Dict[str, Any]:
    if not isinstance(obj, dict):
        raise StructuredOutputError(f"expected a JSON object, got {type(obj).__name__} in {_excerpt(text)}", text)
    for key, kind in required.items():
        if key not in obj:
            raise StructuredOutputError(f"the JSON object has no key {key!r} (keys: {sorted(obj)}; expected "
                                        f"{', '.join(required)}) in {_excerpt(text)}", text)
        if kind is not None and not isinstance(obj[key], kind):
            if kind in (int, float, (int, float)) and isinstance(obj[key], str):
                try:
                    obj[key] = int(obj[key].strip()) if kind is int else float(obj[key].strip())
                    continue
                except ValueError:
                    pass
            if kind is int and isinstance(obj[key], float) and obj[key].is_integer():
                obj[key] = int(obj[key])
                continue
            name = getattr(kind, "__name__", str(kind))
            raise StructuredOutputError(f"key {key!r} is {type(obj[key]).__name__} {obj[key]!r}, expected {name} "
                                        f"in {_excerpt(text)}", text)
    return obj


def parse_json(text: str, required: Optional[Mapping[str, Any]] = None, repair: bool = True) -> Dict[str, Any]:
    """The JSON object in ``text`` (see the module docstring). ``required``: key -> type (or None for any)."""
    body = strip_reasoning(text)
    candidates = _candidates(body)
    if not candidates:
        raise StructuredOutputError(f"no JSON object (no '{{') in the reply {_excerpt(body)}", text)
    errors = []
    for cand in candidates:
        try:
            obj = json.loads(cand)
        except json.JSONDecodeError as err:
            if not repair:
                errors.append(f"{err.msg} at {err.pos}")
                continue
            try:
                import json_repair
            except ImportError:  # pragma: no cover - an extra of llm
                errors.append(f"{err.msg} (install json-repair to repair it)")
                continue
            obj = json_repair.loads(cand)
            if obj in ("", None, [], {}) and cand.strip() not in ("{}",):
                errors.append(f"{err.msg}; not repairable")
                continue
        if isinstance(obj, dict):
            return _check(obj, required or {}, text)
        errors.append(f"a JSON {type(obj).__name__}, not an object")
    raise StructuredOutputError(f"no readable JSON object in the reply {_excerpt(body)} ({'; '.join(errors[:3])})", text)


def parse_records(text: str, tuple_delimiter: str = TUPLE_DELIMITER, record_delimiter: str = RECORD_DELIMITER,
                  completion: str = COMPLETION_MARKER) -> List[List[str]]:
    """Records of delimited fields (see the module docstring): each record's fields, stripped of whitespace,
    quotes and the surrounding parentheses; empty records dropped; text after the completion marker ignored."""
    body = strip_reasoning(text)
    if completion and completion in body:
        body = body[:body.index(completion)]
    pieces = re.split(re.escape(record_delimiter) + "|\n", body) if record_delimiter else body.splitlines()
    out = []
    for piece in pieces:
        s = piece.strip()
        if not s or tuple_delimiter not in s and not (s.startswith("(") and s.endswith(")")):
            continue
        s = re.sub(r"^[-*\d.\s]*\(", "(", s)  # "1. (" / "- (" list markers
        if s.startswith("(") and s.endswith(")"):
            s = s[1:-1]
        elif s.startswith("("):
            s = s[1:]
        fields = [f.strip().strip('"').strip("'").strip() for f in s.split(tuple_delimiter)]
        if any(fields):
            out.append(fields)
    return out


def split_sections(text: str, names: Sequence[str]) -> Dict[str, str]:
    """The text under each ``[Name]`` header (case-insensitive, optional ``:`` after it), up to the next known
    header; a header that does not occur maps to ``""``."""
    body = strip_reasoning(text)
    pattern = "|".join(re.escape(n) for n in names)
    marks = [(m.start(), m.end(), m.group(1)) for m in
             re.finditer(rf"\[\s*({pattern})\s*\]\s*:?", body, flags=re.I)]
    out = {n: "" for n in names}
    lookup = {n.lower(): n for n in names}
    for i, (_, end, name) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else len(body)
        key = lookup[name.lower()]
        out[key] = (out[key] + "\n" + body[end:stop]).strip()
    return out


def ask_structured(backend: Any, messages: Sequence[Dict[str, str]], parse: Callable[[str], T], retries: int = 1,
                   correction: str = "Your reply could not be read: {error}. Answer again in exactly the format asked "
                                     "for, with nothing else.",
                   **generation: Any) -> Tuple[T, int]:
    """``(parse(reply), attempts)``. On a :class:`StructuredOutputError` (or ``ValueError``) the reply and a
    correction naming the error are appended and the backend asked again, at most ``retries`` more times; the last
    error is raised with the attempt count."""
    convo = list(messages)
    last: Optional[Exception] = None
    for attempt in range(retries + 1):
        reply = backend.complete(convo, **generation)
        try:
            return parse(reply), attempt + 1
        except ValueError as err:
            last = err
            convo = convo + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": correction.format(error=str(err)[:300])}]
    raise StructuredOutputError(f"{last} (after {retries + 1} attempt(s))", getattr(last, "text", ""))
