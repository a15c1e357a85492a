"""Prefill -> decode drivers: greedy decoding over a :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM`,
a recorded prefill decoded under several KV policies (:class:`RecordedPrefill`), a held prompt reused across
calls (:class:`HeldPrompt`), and :class:`GenerationResult`, the one value every driver returns (its tokens, the
synchronised prefill and decode seconds, the cache bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from lightning_modules.llm.runtime.stack import active_session
from litctx_common.timing import clock
from lightning_modules.llm.runtime.cached_lm import CachedLM, Prefilled, prefill

__all__ = ["GenerationResult", "greedy_generate", "RecordedPrefill", "record_prefill", "HeldPrompt", "hold_prompt", "check_held", "generate_under_policies"]


@dataclass
class GenerationResult:
    """Greedy continuation of a batch: ``tokens[b]`` excludes the stop token."""

    tokens: List[List[int]]
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    cache_bytes: int = 0
    compressed_bytes: int = 0
    compress_seconds: float = 0.0
    stats: Dict[str, Any] = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps * len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def greedy_generate(model: torch.nn.Module, context_ids: torch.Tensor, context_mask: Optional[torch.Tensor],
                    max_new_tokens: int, stop_ids: Sequence[int] = (), question_ids: Optional[torch.Tensor] = None,
                    question_mask: Optional[torch.Tensor] = None, held: Optional[HeldPrompt] = None) -> GenerationResult:
    """Prefill ``context_ids [B, n]``, append ``question_ids [B, m]`` when given, decode greedily.
    ``held`` (:func:`hold_prompt` of ``context_ids``): start from that shared prefill instead.

    Timing (:func:`litctx_common.timing.clock`: the device is synchronised before each reading):
    ``prefill_seconds`` covers the context (and the question; a held prompt's shared prefill plus its last
    column), ``decode_seconds`` the decode steps; ``cache_bytes`` is the cache size after the prefill and
    question (before decoding)."""
    if held is not None:
        check_held(held, model, context_ids, question_ids)
        start = held.start()
    else:
        start = prefill(model, context_ids, context_mask, question_ids, question_mask)
    size = start.lm.cache_bytes()
    t1 = clock(start.lm.device)
    tokens = start.lm.greedy(start.first_logits, max_new_tokens, stop_ids)
    t2 = clock(start.lm.device)
    steps = max((len(t) for t in tokens), default=0)
    return GenerationResult(tokens=tokens, prefill_seconds=start.seconds, decode_seconds=t2 - t1, decode_steps=steps,
                            cache_bytes=size)


@dataclass
class RecordedPrefill:
    """A context prefilled once under a recording no-op policy (:func:`record_prefill`), ready to be
    compressed by any number of policies: :meth:`generate` returns the cache to the end of this prefill for
    every policy (the recorded tensors are never modified; lazily computed statistics are shared)."""

    lm: CachedLM
    snapshot: Dict[str, Any]
    observations: Dict[int, Any]
    first_logits: torch.Tensor
    seconds: float

    def generate(self, policies: Mapping[str, Any], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 question_ids: Optional[torch.Tensor] = None, question_mask: Optional[torch.Tensor] = None,
                 batched: bool = False) -> Dict[str, GenerationResult]:
        """For each ``policies[name]``: compress the recorded prefill as the policy would have
        (:meth:`~lightning_modules.llm.kv_policy.runner.PolicySession.replay_prefill`), append ``question_ids`` (if any)
        and decode greedily under it. ``batched=True`` (a one-row context) runs the policies as the rows of one
        batch (:class:`~lightning_modules.llm.kv_policy.protocol.PolicyBatch`): one forward per decode step for all;
        tokens agree with separate runs up to floating-point ties, timings are shared by the rows (measure
        speed unbatched), and rows are padded to the longest, so batch policies of similar budgets."""
        from lightning_modules.llm.kv_policy.runner import install_policy

        lm, q_ids, q_mask = self.lm, question_ids, question_mask
        if batched:
            return self._generate_batched(policies, max_new_tokens, stop_ids, q_ids, q_mask)
        results: Dict[str, GenerationResult] = {}
        for name, policy in policies.items():
            lm.restore(self.snapshot)
            with install_policy(lm.model, policy) as session:
                t1 = clock(lm.device)
                session.replay_prefill(self.observations, lm.cache)
                t2 = clock(lm.device)
                compressed = lm.cache_bytes()
                logits = self.first_logits
                if q_ids is not None and q_ids.shape[1] > 0:
                    logits = lm.feed(q_ids, q_mask)
                t3 = clock(lm.device)
                size = lm.cache_bytes()
                tokens = lm.greedy(logits, max_new_tokens, stop_ids)
                t4 = clock(lm.device)
            results[name] = GenerationResult(tokens=tokens, prefill_seconds=self.seconds + (t3 - t2),
                                             decode_seconds=t4 - t3, decode_steps=max((len(t) for t in tokens), default=0),
                                             cache_bytes=size, compressed_bytes=compressed, compress_seconds=t2 - t1)
        lm.restore(self.snapshot)
        return results

    def _generate_batched(self, policies, max_new_tokens, stop_ids, question_ids, question_mask):
        from lightning_modules.llm.kv_policy.protocol import PolicyBatch
        from lightning_modules.llm.kv_policy.runner import install_policy

        lm = self.lm
        if self.first_logits.shape[0] != 1:
            raise ValueError(f"batched evaluation of policies needs a one-row context, got "
                             f"{self.first_logits.shape[0]} rows")
        names = list(policies)
        b = len(names)
        lm.restore(self.snapshot)
        lm.mask = self.snapshot["mask"].expand(b, -1)
        lm.positions = self.snapshot["positions"].expand(b, -1)
        lm.next_position = self.snapshot["next_position"].expand(b)
        with install_policy(lm.model, PolicyBatch([policies[n] for n in names])) as session:
            t1 = clock(lm.device)
            session.replay_prefill(self.observations, lm.cache)
            t2 = clock(lm.device)
            compressed = _row_bytes(session, lm.cache)
            logits = self.first_logits.expand(b, -1)
            if question_ids is not None and question_ids.shape[1] > 0:
                q_mask = question_mask.expand(b, -1) if question_mask is not None else None
                logits = lm.feed(question_ids.expand(b, -1), q_mask)
            t3 = clock(lm.device)
            size = _row_bytes(session, lm.cache)
            tokens = lm.greedy(logits, max_new_tokens, stop_ids)
            t4 = clock(lm.device)
        lm.restore(self.snapshot)
        return {n: GenerationResult(tokens=[tokens[i]], prefill_seconds=self.seconds + (t3 - t2),
                                    decode_seconds=t4 - t3, decode_steps=len(tokens[i]), cache_bytes=size[i],
                                    compressed_bytes=compressed[i], compress_seconds=(t2 - t1) / b)
                for i, n in enumerate(names)}


def record_prefill(model: torch.nn.Module, context_ids: torch.Tensor,
                   context_mask: Optional[torch.Tensor] = None) -> RecordedPrefill:
    """Prefill ``context_ids [B, n]`` once under a recording no-op policy (for the query-aware protocol the
    question is part of the context). Every prefill query's attention column sums are taken from the prefill's
    own attention call where a fused path exists (``install_policy(prefill_sums=True)``: one more ``Q K^T`` sweep
    per query block on CPU), so that replayed H2O-style scores need no second pass over the queries."""
    from lightning_modules.llm.kv_policy.protocol import KVPolicy
    from lightning_modules.llm.kv_policy.runner import install_policy

    with install_policy(model, KVPolicy(), record_prefill=True, prefill_sums=True) as recorder:
        start = prefill(model, context_ids, context_mask)
    return RecordedPrefill(start.lm, start.lm.snapshot(), recorder.prefill_observations, start.first_logits,
                           start.seconds)


@dataclass
class HeldPrompt:
    """A prompt ``ids [B, n]`` prefilled once up to, not including, its last column, so that many decodes start
    from it (the arms of a benchmark, several samplings): :meth:`resume` returns the cache to that point and
    feeds the last column, under whatever the caller installed on the model at that moment (a read method,
    signal recorders, a KV policy: an installed policy first compresses the held prefill as if it had been
    installed during it, :meth:`~lightning_modules.llm.kv_policy.runner.PolicySession.replay_prefill`). Every decode
    therefore sees the call that produces its first logits, as it would after its own prefill. Built by
    :func:`hold_prompt`; the held tensors are never modified.

    Deviation from a prefill of its own: a policy's observation window ends one token before the prompt's end.
    """

    recorded: RecordedPrefill
    ids: torch.Tensor  # [B, n] the whole prompt
    mask: torch.Tensor  # [B, n]

    @property
    def seconds(self) -> float:
        """Seconds of the shared prefill (the last column is timed by each decode)."""
        return self.recorded.seconds

    @property
    def model(self) -> torch.nn.Module:
        return self.recorded.lm.model

    def resume(self) -> "tuple[CachedLM, torch.Tensor]":
        """``(lm, first_logits [B, V])``: the held cache restored (and compressed by an installed policy), then
        the prompt's last column fed."""
        lm = self.recorded.lm
        lm.restore(self.recorded.snapshot)
        session = active_session(lm.model)
        if session is not None:
            session.replay_prefill(self.recorded.observations, lm.cache)
        return lm, lm.feed(self.ids[:, -1:], self.mask[:, -1:])

    def start(self) -> Prefilled:
        """:meth:`resume`, timed: its :class:`Prefilled` counts the shared prefill's seconds plus this call's."""
        t0 = clock(self.recorded.lm.device)
        lm, logits = self.resume()
        return Prefilled(lm, logits, clock(lm.device) - t0 + self.seconds)


def hold_prompt(model: torch.nn.Module, ids: torch.Tensor, mask: Optional[torch.Tensor] = None) -> HeldPrompt:
    """Prefill ``ids [B, n]`` (left-padded; ``n >= 2``) but its last column once, recording what a KV policy
    needs to compress it later (:func:`record_prefill`); see :class:`HeldPrompt`."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"hold_prompt needs ids [B, n] with n >= 2, got {list(ids.shape)}")
    mask = torch.ones_like(ids) if mask is None else mask
    if mask.shape != ids.shape:
        raise ValueError(f"mask {list(mask.shape)} must match ids {list(ids.shape)}")
    if not bool(mask[:, -1].bool().all()):
        rows = (~mask[:, -1].bool()).nonzero().flatten().tolist()
        raise ValueError(f"hold_prompt needs left padding: the last column of rows {rows} is padding")
    return HeldPrompt(record_prefill(model, ids[:, :-1], mask[:, :-1]), ids, mask)


def check_held(held: HeldPrompt, model: torch.nn.Module, context_ids: torch.Tensor,
               question_ids: Optional[torch.Tensor]) -> None:
    """A held prompt must be ``model``'s and hold exactly ``context_ids`` (the question included in it)."""
    if held.model is not model:
        raise ValueError("held prompt was prefilled on another model")
    if question_ids is not None and question_ids.shape[1] > 0:
        raise ValueError("a held prompt includes its question: pass question_ids=None")
    if context_ids.shape != held.ids.shape or not torch.equal(context_ids.to(held.ids.device), held.ids):
        raise ValueError(f"context_ids {list(context_ids.shape)} are not the held prompt {list(held.ids.shape)}")


def generate_under_policies(model: torch.nn.Module, context_ids: torch.Tensor, context_mask: Optional[torch.Tensor],
                            policies: Mapping[str, Any], max_new_tokens: int, stop_ids: Sequence[int] = (),
                            question_ids: Optional[torch.Tensor] = None,
                            question_mask: Optional[torch.Tensor] = None,
                            batched: bool = False) -> Dict[str, GenerationResult]:
    """Prefill once, compress that prefill with each policy, then ask and decode greedily under it
    (:func:`record_prefill` then :meth:`RecordedPrefill.generate`). A no-op ``KVPolicy()`` gives the full
    cache. Results equal running each policy on its own (tested) at one prefill's cost.

    ``prefill_seconds`` of every result is the shared prefill (plus its own question); ``compress_seconds``
    the policy's scoring and eviction; ``compressed_bytes`` the cache right after compression and
    ``cache_bytes`` after the question (batched: the bytes the row would hold on its own, i.e. its largest
    head's entries times the heads, per layer).
    """
    return record_prefill(model, context_ids, context_mask).generate(policies, max_new_tokens, stop_ids,
                                                                      question_ids, question_mask, batched)


def _row_bytes(session: Any, cache: Any) -> List[int]:
    """Per batch row: bytes of its kept entries stored as a cache of its own (largest head x heads, per layer)."""
    total: List[int] = []
    for layer, runner in session.runners.items():
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        per_entry = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
        counts = runner.state.valid.sum(-1).amax(-1) * runner.state.valid.shape[1]  # [B]
        rows = [int(c) * per_entry for c in counts]
        total = rows if not total else [a + r for a, r in zip(total, rows)]
    return total

