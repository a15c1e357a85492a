"""One RAG answer, end to end: the prompt's pieces prefilled by a KV-reuse method (full prefill by default),
then decoded greedily or by a decoding strategy (Guidance), with the numbers a record keeps.

Used by the evaluation module (:mod:`lightning_modules.rag.module`) and by ``bench/rag.py``, so both run the same
code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from lightning_modules.rag.prompts import RAGPrompt
from litctx_common.timing import clock

__all__ = ["RAGAnswer", "answer", "answer_distribution_kl", "teacher_forced_logprob"]


@dataclass
class RAGAnswer:
    """Attributes:
        tokens, text: the generated answer (stop token excluded).
        first_logits: ``[V]`` float32 logits of the first answer token (for KL against full prefill).
        gold_logprob: the teacher-forced log-probability (nats) of the ``gold`` tokens given to :func:`answer`
            (None without them).
        ttft_s: seconds to the first token's logits; decode_s: the rest.
        stats: the reuse method's (recomputed tokens, store hits ...) and the decoder's.
    """

    tokens: List[int]
    text: str
    first_logits: torch.Tensor
    ttft_s: float
    decode_s: float
    stats: Dict[str, Any] = field(default_factory=dict)
    gold_logprob: Optional[float] = None


def teacher_forced_logprob(lm: Any, first_logits: torch.Tensor, gold: Sequence[int]) -> float:
    """``sum_t log p(gold_t | prompt, gold_<t)`` (nats) of one row: ``first_logits [1, V]`` score ``gold[0]``, the
    rest are fed (and taken back: ``lm``, a :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM`, is
    as it was)."""
    if not gold:
        raise ValueError("teacher_forced_logprob: no gold tokens")
    logp = torch.log_softmax(first_logits[0].double(), -1)[int(gold[0])]
    if len(gold) > 1:
        ids = torch.tensor([list(gold)], device=lm.device)
        rest = torch.log_softmax(lm.peek(ids[:, :-1])[0].double(), -1)  # [len(gold) - 1, V]
        logp = logp + rest.gather(1, ids[0, 1:, None].to(rest.device)).sum()
    return float(logp)


@torch.no_grad()
def answer(prompt: RAGPrompt, reuse: Any, tokenizer: Any, max_new_tokens: int, stop_ids: Sequence[int] = (),
           decoder: Any = None, gold: Optional[Sequence[int]] = None) -> RAGAnswer:
    """Prefill ``prompt`` with ``reuse`` (a :class:`~lightning_modules.prophetkv.reuse.ReusePrefill`) and decode:
    greedily, or with ``decoder.decode(lm, first_logits, prompt, max_new_tokens, stop_ids) -> (tokens, stats)``.
    ``gold``: answer tokens whose teacher-forced log-probability is measured first (on the prefilled cache)."""
    res = reuse.prefill(prompt.prefix_ids, [prompt.chunk_ids], [prompt.question_ids], [prompt.question_span])
    gold_lp = teacher_forced_logprob(res.lm, res.first_logits, gold) if gold else None
    t0 = clock(res.lm.device)
    stats = dict(res.stats)
    if decoder is None:
        tokens = res.lm.greedy(res.first_logits, max_new_tokens, stop_ids)[0]
    else:
        tokens, dec_stats = decoder.decode(res.lm, res.first_logits, prompt, max_new_tokens, stop_ids)
        stats.update(dec_stats)
    t1 = clock(res.lm.device)
    return RAGAnswer(tokens=list(tokens), text=tokenizer.decode(tokens, skip_special_tokens=True),
                     first_logits=res.first_logits[0].float().cpu(), ttft_s=float(res.stats["ttft_s"]),
                     decode_s=t1 - t0, stats=stats, gold_logprob=gold_lp)


def answer_distribution_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(p_ref || p)`` of the first-token distributions (nats): how far a reuse method moves the answer from
    full prefill's."""
    ref = torch.log_softmax(reference_logits.double(), -1)
    cur = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - cur)).sum())
