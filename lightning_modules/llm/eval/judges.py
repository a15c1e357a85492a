"""Judges: the questions an evaluation asks about generated text, behind one protocol, answered by rules (offline,
deterministic: tests and CI) or by a language model the toolkit loads.

The citation questions (LongBench-Cite's): does the cited evidence support a statement fully, partly or not
(1 / 0.5 / 0); is one cited sentence relevant to it; does a statement need a citation at all. PersistBench and
HGMem ask their own questions through the same backends (:mod:`lightning_modules.persistbench.judges`).

* :class:`LexicalJudge` - content-word overlap: a statement's content words (lower-cased words and numbers minus
  stop words) found in the evidence; ``>= full`` of them is full support, ``>= partial`` partial; a cited
  sentence is relevant when it shares ``>= relevant`` of them, or a number or a capitalised name; a statement
  needs a citation when it states something checkable (a number, a capitalised name past its first word, or at
  least ``min_claim_words`` content words). A proxy, not a reader: it rewards verbatim quotes.
* :class:`ModelJudge` - asks a language model through any chat backend (:mod:`lightning_modules.llm.serving.chat`: a local
  model :func:`~lightning_modules.llm.model.loading.load_causal_lm` loads, greedy, chat template; or an OpenAI-compatible
  endpoint) with our own rubric prompts and reads a bracketed verdict (``[[Fully supported]]``
  ...). An unreadable verdict counts as the lowest score and is counted in ``unparsed``. The judge's name and
  prompt version go with every record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Protocol

__all__ = ["Judge", "LexicalJudge", "ModelJudge", "content_words", "JUDGES", "build_judge", "STOP_WORDS"]

STOP_WORDS = frozenset("""a an the and or but if then else of to in on at by for with from as is are was were be been
being it its this that these those he she they them his her their we you i me my our your not no nor so than too very
can could would should will shall may might must do does did done has have had having which who whom whose what when
where why how all any both each few more most other some such only own same just also into over under again further
once here there about above below between through during before after up down out off there's it's""".split())

_TOKEN = re.compile(r"[A-Za-z\u00C0-\u024F]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")


def content_words(text: str) -> List[str]:
    """Lower-cased words and numbers of ``text`` without stop words."""
    return [w.lower() for w in _TOKEN.findall(text) if w.lower() not in STOP_WORDS]


def _names_and_numbers(text: str) -> set:
    words = _TOKEN.findall(text)
    out = {w for w in words if w[0].isdigit()}
    out |= {w.lower() for i, w in enumerate(words) if i > 0 and w[0].isupper()}
    return out


class Judge(Protocol):
    name: str

    def support(self, statement: str, evidence: str) -> float:
        """1.0 fully supported, 0.5 partially, 0.0 not."""

    def relevant(self, statement: str, evidence: str) -> bool:
        ...

    def needs_citation(self, statement: str) -> bool:
        ...


@dataclass
class LexicalJudge:
    """Content-word overlap (see the module docstring)."""

    full: float = 0.8
    partial: float = 0.4
    relevant_share: float = 0.3
    min_claim_words: int = 4
    name: str = "lexical-v1"

    def _share(self, statement: str, evidence: str) -> float:
        words = content_words(statement)
        if not words:
            return 0.0
        have = set(content_words(evidence))
        return sum(w in have for w in words) / len(words)

    def support(self, statement: str, evidence: str) -> float:
        share = self._share(statement, evidence)
        return 1.0 if share >= self.full else 0.5 if share >= self.partial else 0.0

    def relevant(self, statement: str, evidence: str) -> bool:
        if self._share(statement, evidence) >= self.relevant_share:
            return True
        shared = _names_and_numbers(statement) & {w.lower() for w in _TOKEN.findall(evidence)}
        return bool(shared)

    def needs_citation(self, statement: str) -> bool:
        return bool(_names_and_numbers(statement)) or len(content_words(statement)) >= self.min_claim_words


PROMPTS = {
    "support": ("You check whether evidence backs a statement.\n\nEvidence:\n{evidence}\n\nStatement:\n{statement}\n\n"
                "Does the evidence support the statement? Reply with exactly one of [[Fully supported]], "
                "[[Partially supported]], [[No support]]."),
    "relevant": ("You check whether a quoted sentence is relevant to a statement.\n\nSentence:\n{evidence}\n\n"
                 "Statement:\n{statement}\n\nIs the sentence relevant to the statement? Reply with exactly one of "
                 "[[Relevant]], [[Irrelevant]]."),
    "needs_citation": ("Statement:\n{statement}\n\nDoes this statement assert a fact that a reader would want a "
                       "source for (not a greeting, a transition or an opinion)? Reply with exactly one of [[Yes]], "
                       "[[No]]."),
}
PROMPT_VERSION = "v1"


@dataclass
class ModelJudge:
    """A language model as the judge, through any chat backend (see the module docstring).

    Args:
        model: a name or folder for the local backend (``load_causal_lm``), or a loaded ``(model, tokenizer)``
            pair; used when ``backend`` is None.
        backend: a chat backend spec (``{name: openai, base_url: ..., model: ...}``, see
            :func:`~lightning_modules.llm.serving.chat.build_backend`) or object; it overrides ``model``.
        max_new_tokens: the verdict's length cap.
    """

    model: Any = "smollm2-135m"
    backend: Any = None
    max_new_tokens: int = 12
    unparsed: int = 0
    calls: int = 0
    _backend: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend is not None:
            from lightning_modules.llm.serving.chat import backend_options_check

            backend_options_check(self.backend, "judge_args.backend")
            label = getattr(self.backend, "identity", None) or (self.backend if isinstance(self.backend, str)
                                                               else self.backend.get("name", "local"))
        elif isinstance(self.model, tuple):
            label = type(self.model[0]).__name__
        else:
            label = str(self.model)
        self.name = f"model:{label}:{PROMPT_VERSION}"

    @property
    def chat(self) -> Any:
        """The chat backend (built on first use)."""
        if self._backend is None:
            from lightning_modules.llm.serving.chat import LocalChatBackend, build_backend

            self._backend = (build_backend(self.backend, "judge_args.backend") if self.backend is not None
                             else LocalChatBackend(self.model))
        return self._backend

    def _ask(self, prompt: str) -> str:
        from lightning_modules.llm.serving.structured import strip_reasoning

        reply = self.chat.complete([{"role": "user", "content": prompt}], max_tokens=self.max_new_tokens)
        self.calls += 1
        return strip_reasoning(reply)

    def _verdict(self, reply: str, options: Dict[str, float], default: float) -> float:
        low = reply.lower()
        for label, value in options.items():
            if f"[[{label}]]" in low:
                return value
        for label, value in options.items():  # a verdict without its brackets
            if label in low:
                return value
        self.unparsed += 1
        return default

    def support(self, statement: str, evidence: str) -> float:
        reply = self._ask(PROMPTS["support"].format(statement=statement, evidence=evidence))
        return self._verdict(reply, {"fully supported": 1.0, "partially supported": 0.5, "no support": 0.0}, 0.0)

    def relevant(self, statement: str, evidence: str) -> bool:
        reply = self._ask(PROMPTS["relevant"].format(statement=statement, evidence=evidence))
        return self._verdict(reply, {"irrelevant": 0.0, "relevant": 1.0}, 0.0) > 0.5

    def needs_citation(self, statement: str) -> bool:
        reply = self._ask(PROMPTS["needs_citation"].format(statement=statement))
        return self._verdict(reply, {"yes": 1.0, "no": 0.0}, 1.0) > 0.5


JUDGES = {"lexical": LexicalJudge, "model": ModelJudge}


def build_judge(name: str = "lexical", **kwargs: Any) -> Judge:
    if name not in JUDGES:
        raise ValueError(f"judge {name!r}: valid judges are {', '.join(JUDGES)}")
    return JUDGES[name](**kwargs)
