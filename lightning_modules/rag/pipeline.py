"""One RAG answer, end to end: the prompt's pieces prefilled by a KV-reuse method (full prefill by default),
then decoded greedily or by a decoding strategy (Guidance), with the numbers a record keeps.

Used by the evaluation module (:mod:`lightning_modules.rag.module`) and by ``bench/rag.py``, so both run the same
code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import torch

from lightning_modules.rag.prompts import RAGPrompt
from litctx_common.timing import clock

__all__ = ["RAGAnswer", "answer", "answer_distribution_kl"]


@dataclass
class RAGAnswer:
    """Attributes:
        tokens, text: the generated answer (stop token excluded).
        first_logits: ``[V]`` float32 logits of the first answer token (for KL against full prefill).
        ttft_s: seconds to the first token's logits; decode_s: the rest.
        stats: the reuse method's (recomputed tokens, store hits ...) and the decoder's.
    """

    tokens: List[int]
    text: str
    first_logits: torch.Tensor
    ttft_s: float
    decode_s: float
    stats: Dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def answer(prompt: RAGPrompt, reuse: Any, tokenizer: Any, max_new_tokens: int, stop_ids: Sequence[int] = (),
           decoder: Any = None) -> RAGAnswer:
    """Prefill ``prompt`` with ``reuse`` (a :class:`~lightning_modules.prophetkv.reuse.ReusePrefill`) and decode:
    greedily, or with ``decoder.decode(lm, first_logits, prompt, max_new_tokens, stop_ids) -> (tokens, stats)``."""
    res = reuse.prefill(prompt.prefix_ids, [prompt.chunk_ids], [prompt.question_ids])
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
                     decode_s=t1 - t0, stats=stats)


def answer_distribution_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(p_ref || p)`` of the first-token distributions (nats): how far a reuse method moves the answer from
    full prefill's."""
    ref = torch.log_softmax(reference_logits.double(), -1)
    cur = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - cur)).sum())
