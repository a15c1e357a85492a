"""Prompts for retrieval-augmented answering, as token pieces: a shared prefix, one piece per document, and
the question tail (:class:`RAGPrompt`). KV reuse computes each document's piece apart (behind the prefix), so the
pieces are tokenised separately and every method - full prefill included - reads exactly the concatenated tokens.

Two formats:

* ``qa`` - "Answer the question using the documents ... Reply with the answer only." then
  ``Document [i]: <text>`` per document, then ``Question: ...``;
* ``cite`` - LongBench-Cite's: every sentence of the context numbered over the whole prompt as ``<C{i}>sentence``,
  and the answer asked for as ``<statement>...<cite>[s-e]</cite></statement>`` (at most 3 citations each).
  :attr:`RAGPrompt.sentences` maps each number back to its (document, sentence) and text.

With a chat template the whole user turn is rendered once around a marker and cut there, so the prefix ends
where the first document starts and the tail holds the question, the end of the turn and the assistant header.
An ``answer_prefix`` (e.g. ``"Ada Brandt files the ledger under code"``) is appended after the header: the answer
continues it instead of opening with a sentence of its own. :attr:`RAGPrompt.question_span` locates the question's
own tokens within the tail (ProphetKV's Stage I reads those rows, not the template around them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["RAGPrompt", "build_prompt", "encode_with_span", "FORMATS", "QA_INSTRUCTION", "CITE_INSTRUCTION"]

FORMATS = ("qa", "cite")
QA_INSTRUCTION = ("Answer the question using the documents below. Reply with the answer only, in a few words.")
CITE_INSTRUCTION = (
    "Answer the question using the numbered sentences of the documents below. Write the answer as statements. "
    "Put each statement in <statement>...</statement> and end it with the numbers of the sentences that support "
    "it, as <cite>[i-j]</cite> for sentences i to j (at most three ranges, e.g. <cite>[3-3][7-8]</cite>; an "
    "empty <cite></cite> when no sentence supports it). Example: <statement>Oslo is the capital of Norway."
    "<cite>[2-2]</cite></statement>")
_MARK = "\u0000LITCTX_DOCUMENTS\u0000"


@dataclass
class RAGPrompt:
    """Attributes:
        prefix_ids: the shared head (template, instruction).
        chunk_ids: one token list per document (in prompt order).
        question_ids: the tail (question, end of the turn, assistant header).
        fmt: ``qa`` or ``cite``.
        sentences: ``cite``: per global sentence number ``(document index, sentence index, text)``.
        doc_ids: the documents' ids, in prompt order.
        question_span: ``(start, end)``: the tokens ``question_ids[start:end]`` that spell the question itself
            (None: not known; the whole tail stands for it).
    """

    prefix_ids: List[int]
    chunk_ids: List[List[int]]
    question_ids: List[int]
    fmt: str = "qa"
    sentences: List[Tuple[int, int, str]] = field(default_factory=list)
    doc_ids: List[str] = field(default_factory=list)
    question_span: Optional[Tuple[int, int]] = None

    @property
    def ids(self) -> List[int]:
        """The whole prompt's tokens."""
        return self.prefix_ids + [t for c in self.chunk_ids for t in c] + self.question_ids

    @property
    def context_tokens(self) -> int:
        return sum(len(c) for c in self.chunk_ids)


def _split_template(tokenizer: Any, user_head: str, user_tail: str, chat: bool) -> Tuple[str, str]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{user_head}{_MARK}{user_tail}"}],
                                             add_generation_prompt=True, tokenize=False)
        head, tail = text.split(_MARK)
        return head, tail
    return user_head, f"{user_tail}\n\nAnswer:"


def _encode(tokenizer: Any, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_with_span(tokenizer: Any, text: str, start: int, end: int) -> Tuple[List[int], Tuple[int, int]]:
    """``text``'s tokens and the token span covering its characters ``[start, end)`` (the tokens are those of
    ``text`` encoded whole: the span never changes them). Character offsets from a fast tokenizer; otherwise the
    token counts of ``text[:start]`` (its trailing spaces left to the next token, as byte-level BPE and
    SentencePiece attach them) and ``text[:end]``: exact where the span ends on a token boundary, as a question
    before a newline does."""
    ids = _encode(tokenizer, text)
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        offsets = None
    if offsets is not None and len(offsets) == len(ids):
        inside = [i for i, (a, b) in enumerate(offsets) if b > start and a < end]
        if inside:
            return ids, (inside[0], inside[-1] + 1)
    first = min(len(_encode(tokenizer, text[:start].rstrip(" "))), len(ids))
    return ids, (first, max(first + 1, min(len(_encode(tokenizer, text[:end])), len(ids))))


def build_prompt(tokenizer: Any, documents: Sequence[Dict[str, Any]], question: str, fmt: str = "qa",
                 chat: bool = True, instruction: Optional[str] = None,
                 answer_prefix: Optional[str] = None) -> RAGPrompt:
    """The :class:`RAGPrompt` of ``question`` over ``documents`` (dicts with ``text`` and, for ``cite``,
    ``sentences``: ``[{"text"}]``; see :mod:`datamodules.rag_tasks`); ``answer_prefix``: text the answer
    continues, after the assistant header (a sample's ``answer_prefix``)."""
    if fmt not in FORMATS:
        raise ValueError(f"prompt format {fmt!r}: valid formats are {', '.join(FORMATS)}")
    if not documents:
        raise ValueError("build_prompt: no documents (retrieve some first, or check the sample's 'documents')")
    instruction = instruction or (QA_INSTRUCTION if fmt == "qa" else CITE_INSTRUCTION)
    head, tail = _split_template(tokenizer, f"{instruction}\n\n", f"Question: {question}", chat)
    at = tail.find(f"Question: {question}")  # -1 where a template rewrote the text: no span
    if answer_prefix:
        tail += " ".join(str(answer_prefix).split())
    tail_ids, span = _encode(tokenizer, tail), None
    if at >= 0 and question:
        at += len("Question: ")
        tail_ids, span = encode_with_span(tokenizer, tail, at, at + len(question))
    pieces: List[str] = []
    sentences: List[Tuple[int, int, str]] = []
    for d, doc in enumerate(documents):
        if fmt == "qa":
            pieces.append(f"Document [{d + 1}]: {' '.join(str(doc['text']).split())}\n\n")
            continue
        sents = doc.get("sentences") or [{"text": doc["text"]}]
        parts = []
        for j, s in enumerate(sents):
            parts.append(f"<C{len(sentences)}>{s['text']}")
            sentences.append((d, j, str(s["text"])))
        pieces.append(" ".join(parts) + "\n\n")
    return RAGPrompt(prefix_ids=_encode(tokenizer, head), chunk_ids=[_encode(tokenizer, p) for p in pieces],
                     question_ids=tail_ids, fmt=fmt, sentences=sentences,
                     doc_ids=[str(doc.get("doc_id", i)) for i, doc in enumerate(documents)], question_span=span)
