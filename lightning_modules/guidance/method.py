"""Guidance: sentence-level citation enforcement by Prefix-Tail guidance during decoding (training-free).

The paper's abstract gives the mechanism (an offline fact pool of Prefix-Tail pairs; the model's intent predicted
by lookahead; on a match with a context prefix, the output replaced by the verified fact with its citation); the
knobs below are our reconstruction (``research/llm_memory_methods.md`` section 4.1).

* **Fact pool** (:class:`FactPool`): every context sentence ``j`` (the prompt's ``<Cj>`` numbering) of at least
  ``min_words`` words, normalised (lower case, words and numbers only); its *prefix* is the first
  ``prefix_words`` words, its *tail* the rest. Prefixes are indexed for exact lookup.
* **Decoding** (:class:`GuidedCitationDecoder`, on the shared step-wise decoder): at every statement start (the
  response's start, and after each sentence or ``</statement>`` the model ends) the decoder generates a
  lookahead of ``lookahead`` tokens from a snapshot of the cache and takes it back. The lookahead, stripped of
  markup, is matched against the pool: **exact** when its first words equal a sentence's prefix (at least
  ``min_match_words`` words), else **fuzzy** when the best ``difflib`` ratio of the normalised texts reaches
  ``fuzzy``. On a match with sentence ``j`` the decoder emits ``<statement>{sentence j verbatim}<cite>[j-j]
  </cite></statement>`` in one forward (forced, committed) and goes to the next statement start; a sentence is
  forced at most once. Without a match the model decodes freely up to its next sentence end.

:class:`GuidanceConfig` holds the defaults and builds the decoder; the ``guidance`` callback installs it on the
RAG evaluation module.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from lightning_modules.guidance.longbench_cite import format_statement
from lightning_modules.llm.decoding.step import StepDecoder, StopOnPattern

__all__ = ["FactPool", "GuidedCitationDecoder", "normalise"]

_WORD = re.compile(r"[a-z0-9\u00C0-\u024F]+")
_MARKUP = re.compile(r"<\/?statement>|<cite>.*?<\/cite>|<\/?cite>|<C\d+>")
_BOUNDARY = re.compile(r"</statement>|[.!?](?:\s|$)|\n")


def normalise(text: str) -> List[str]:
    """Lower-cased words and numbers of ``text`` (markup removed)."""
    return _WORD.findall(_MARKUP.sub(" ", text).lower())


class FactPool:
    """The Prefix-Tail pairs of the context sentences (see the module docstring)."""

    def __init__(self, sentences: Sequence[str], prefix_words: int, min_words: int) -> None:
        self.sentences = [str(s) for s in sentences]
        self.words = [normalise(s) for s in self.sentences]
        self.prefix_words = int(prefix_words)
        self.index: Dict[Tuple[str, ...], List[int]] = {}
        for j, w in enumerate(self.words):
            if len(w) >= min_words:
                self.index.setdefault(tuple(w[:prefix_words]), []).append(j)
        self.eligible = sorted(j for js in self.index.values() for j in js)

    def prefix(self, j: int) -> List[str]:
        return self.words[j][:self.prefix_words]

    def tail(self, j: int) -> List[str]:
        return self.words[j][self.prefix_words:]

    def match(self, text: str, min_match_words: int, fuzzy: float,
              exclude: Sequence[int] = ()) -> Tuple[Optional[int], str]:
        """``(sentence, "exact" | "fuzzy")`` for a lookahead text, or ``(None, "")``."""
        words = normalise(text)
        if len(words) < min_match_words:
            return None, ""
        head = tuple(words[:self.prefix_words])
        banned = set(exclude)
        if len(head) == self.prefix_words:
            for j in self.index.get(head, []):
                if j not in banned:
                    return j, "exact"
        else:  # a lookahead shorter than a prefix: it must open a sentence
            for j in self.eligible:
                if j not in banned and tuple(self.words[j][:len(head)]) == head:
                    return j, "exact"
        if fuzzy >= 1.0:
            return None, ""
        probe = " ".join(words)
        best, best_j = 0.0, None
        for j in self.eligible:
            if j in banned:
                continue
            target = " ".join(self.words[j][:max(len(words), self.prefix_words)])
            r = difflib.SequenceMatcher(None, probe, target, autojunk=False).ratio()
            if r > best:
                best, best_j = r, j
        return (best_j, "fuzzy") if best_j is not None and best >= fuzzy else (None, "")




class GuidedCitationDecoder:
    """Guidance's decoding loop for one row (see the module docstring); ``decode(...) -> (tokens, stats)``."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:  # cfg: guidance.config.GuidanceConfig
        self.cfg, self.tok = cfg, tokenizer
        self.name = cfg.name

    def _encode(self, text: str) -> List[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def decode(self, lm: Any, first_logits: torch.Tensor, prompt: Any, max_new_tokens: int,
               stop_ids: Sequence[int] = ()) -> Tuple[List[int], Dict[str, Any]]:
        """Decode one row (``first_logits [1, V]``) over ``prompt.sentences`` (a :class:`RAGPrompt` of format
        ``cite``)."""
        if first_logits.shape[0] != 1:
            raise ValueError(f"Guidance decodes one row at a time; got {first_logits.shape[0]}")
        cfg = self.cfg
        pool = FactPool([t for _, _, t in prompt.sentences], cfg.prefix_words, cfg.min_words)
        tokens: List[int] = []
        logits = first_logits
        forced, used = [], []
        stats = {"lookaheads": 0, "exact": 0, "fuzzy": 0, "free_runs": 0, "forced_tokens": 0}
        statements = 0
        stop = set(int(s) for s in stop_ids)
        while len(tokens) < max_new_tokens and statements < cfg.max_statements:
            snap = lm.snapshot()
            look = StepDecoder(lm).run(logits, min(cfg.lookahead, max_new_tokens - len(tokens)), stop_ids).tokens[0]
            lm.restore(snap)
            stats["lookaheads"] += 1
            j, kind = pool.match(self.tok.decode(look, skip_special_tokens=True), cfg.min_match_words, cfg.fuzzy,
                                 exclude=used) if look else (None, "")
            if j is not None:
                text = format_statement(pool.sentences[j], [(j, j)])
                ids = self._encode(("" if not tokens else " ") + text)[: max_new_tokens - len(tokens)]
                logits = lm.feed(torch.tensor([ids], device=lm.device))
                tokens += ids
                used.append(j)
                forced.append(j)
                stats[kind] += 1
                stats["forced_tokens"] += len(ids)
                statements += 1
                continue
            # no fact ahead: the model writes freely to its next sentence end
            boundary = StopOnPattern(self.tok, _BOUNDARY)  # the first sentence end (or </statement>) ends the run
            run = StepDecoder(lm).run(logits, min(cfg.max_free_tokens, max_new_tokens - len(tokens)), stop_ids,
                                      stopping=[boundary])
            new = run.tokens[0]
            stats["free_runs"] += 1
            tokens += new
            statements += 1
            if not new or not boundary.hit or len(tokens) >= max_new_tokens:
                break  # a stop token, or the limit: the answer is over
            logits = lm.feed(torch.tensor([[new[-1]]], device=lm.device))
            if new[-1] in stop:
                break
        stats["cited"] = forced
        stats["decoding"] = self.name
        return tokens, stats
