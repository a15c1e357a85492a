"""Step-wise causal LM inference on a cache: prefill, append, greedy decoding with continued positions.

:class:`CachedLM` owns one ``DynamicCache`` and the running positions of a (left-padded) batch, and feeds
token chunks the way kvpress's pipeline does: the context is prefilled first (an installed KV policy acts at
the end of that prefill), the question is appended with positions continuing from the *original* context
length (so evicted entries leave gaps rather than shifting RoPE), then tokens are decoded greedily.

Masks: without a policy the running 2-D padding mask is passed to the model as usual. With a policy
installed, the policy's per-layer bookkeeping is authoritative for entries already cached (they may have
been evicted), so the model gets ones over the physical cache plus the new tokens' own padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from lightning_modules.llm.session import active_session, cache_bytes
from litctx_common.timing import clock

__all__ = ["CachedLM", "GenerationResult", "HeldPrompt", "RecordedPrefill", "greedy_generate",
           "generate_under_policies", "hold_prompt", "record_prefill", "stop_token_ids"]


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


class CachedLM:
    """A model plus one growing cache for a batch of ``B`` sequences (see the module docstring).

    Bookkeeping, one column per cache entry: ``mask [B, T]`` (1 = a real token that may be read) and
    ``positions [B, T]`` (its RoPE position; -1 where ``mask`` is 0). Without a KV policy the columns are the
    physical cache entries; with one they are the token stream (the policy's runners map their entries to it by
    slot), because the policy may have evicted or reordered physical entries.

    Per-row rollback (:meth:`rollback`): speculative decoding rejects a different number of drafted tokens in
    each row. The rejected entries become holes (``mask`` 0; with a policy, invalid in every layer's
    bookkeeping), the columns every row rejected are cut from the cache's tail, and once holes take more than
    ``compact_after`` columns the cache is compacted (each row's live entries moved right, in order: the holes
    become left padding). The other rows are never touched.
    """

    def __init__(self, model: torch.nn.Module, compact_after: int = 64) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask: Optional[torch.Tensor] = None  # [B, T] of every token fed so far
        self.positions: Optional[torch.Tensor] = None  # [B, T] RoPE position of each column, -1 = none
        self.next_position: Optional[torch.Tensor] = None  # [B] RoPE position of the next real token
        self.compact_after = int(compact_after)
        self.calls = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def batch_size(self) -> Optional[int]:
        return None if self.mask is None else self.mask.shape[0]

    def feed(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Feed ``input_ids [B, n]`` (left padding marked by ``attention_mask [B, n]``); returns the logits of
        each row's last position ``[B, V]``."""
        return self.feed_logits(input_ids, attention_mask, 1)[:, -1]

    def feed_logits(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                    n_logits: int = 1, grad: bool = False) -> torch.Tensor:
        """Feed ``input_ids [B, n]`` and return the float32 logits of the last ``n_logits`` positions
        ``[B, n_logits, V]`` (a verification call reads all of them). ``grad``: keep the autograd graph (a
        training driver streaming a sequence through a compressed cache, IndexMem's); otherwise no graph."""
        with torch.set_grad_enabled(bool(grad) and torch.is_grad_enabled()):
            return self._feed_logits(input_ids, attention_mask, n_logits)

    def _feed_logits(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     n_logits: int) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, n], got {list(input_ids.shape)}")
        b, n = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids {list(input_ids.shape)}")
        if self.mask is not None and self.mask.shape[0] != b:
            raise ValueError(f"batch size changed from {self.mask.shape[0]} to {b} within one cache")
        if not 1 <= n_logits <= n:
            raise ValueError(f"n_logits={n_logits}: must be in 1..{n} (the tokens fed)")
        device = self.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device).long()
        start = self.next_position if self.next_position is not None else torch.zeros(b, dtype=torch.long,
                                                                                       device=device)
        positions = (start.unsqueeze(1) + attention_mask.cumsum(-1) - 1).clamp_min(0)
        full_mask = attention_mask if self.mask is None else torch.cat([self.mask, attention_mask], dim=1)
        if active_session(self.model) is not None and self.mask is not None:
            physical = self.cache.get_seq_length()
            model_mask = torch.cat([torch.ones(b, physical, dtype=torch.long, device=device), attention_mask], 1)
        else:
            model_mask = full_mask
        out = self.model(input_ids=input_ids, attention_mask=model_mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=n_logits)
        new_positions = torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1))
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], 1)
        self.mask = full_mask
        self.next_position = start + attention_mask.sum(-1)
        self.calls += 1
        return out.logits[:, -n_logits:].float()

    def peek(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run ``input_ids [B, n]`` against the cache and return the float32 logits of all ``n`` positions
        ``[B, n, V]`` without keeping them: afterwards the cache, mask and positions are what they were (a
        block-diffusion denoising step reads the committed prefix and appends nothing). Refused under a KV policy
        (its per-layer bookkeeping would move)."""
        if active_session(self.model) is not None:
            raise RuntimeError("peek() with a KV policy installed: the policy's runners would record the entries")
        state = self.snapshot()
        calls = self.calls
        try:
            return self.feed_logits(input_ids, attention_mask, input_ids.shape[1])
        finally:
            self.restore(state)
            self.calls = calls + 1

    @torch.no_grad()
    def greedy(self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: Iterable[int] = ()) -> List[List[int]]:
        """Greedy tokens after ``first_logits [B, V]``, stopping per row at a stop id (not included)."""
        from lightning_modules.llm.decoding import StepDecoder

        return StepDecoder(self).run(first_logits, max_new_tokens, stop_ids).tokens

    # ------------------------------------------------------------------ rollback
    def rollback(self, n: torch.Tensor) -> None:
        """Forget the last ``n[b]`` real tokens of each row ``b`` (``n [B]`` long, 0 = keep the row as is): their
        entries stop being read, and the row's next token takes the position of the first one removed."""
        n = torch.as_tensor(n, dtype=torch.long, device=self.device).reshape(-1)
        if self.mask is None:
            if bool((n > 0).any()):
                raise ValueError("rollback on an empty cache")
            return
        if n.shape[0] != self.mask.shape[0]:
            raise ValueError(f"rollback needs one count per row ({self.mask.shape[0]}), got {n.shape[0]}")
        live = self.mask.bool()
        have = live.sum(-1)
        if bool((n < 0).any()) or bool((n > have).any()):
            raise ValueError(f"rollback counts {n.tolist()} must be in 0..live tokens per row {have.tolist()}")
        if not bool((n > 0).any()):
            return
        self._refuse_sliding()
        from_end = live.flip(-1).long().cumsum(-1).flip(-1)  # live tokens at or after each column
        removed = live & (from_end <= n.unsqueeze(1))
        self.mask = self.mask.masked_fill(removed, 0)
        self.positions = self.positions.masked_fill(removed, -1)
        self.next_position = self.next_position - n
        session = active_session(self.model)
        if session is not None:
            session.rollback(removed)
            return
        self._crop_dead_tail()
        holes = int((~self.mask.bool()).any(0).sum())
        if holes > self.compact_after:
            self.compact()

    def _refuse_sliding(self) -> None:
        config = getattr(self.model, "config", None)
        types = getattr(config, "layer_types", None) or []
        sliding = any(getattr(layer, "is_sliding", False) for layer in getattr(self.cache, "layers", []))
        sliding = sliding or any("sliding" in str(t) for t in types)
        if sliding:
            raise NotImplementedError(
                f"per-row rollback on sliding-window cache layers is not supported ({type(self.model).__name__} "
                f"has them): the window is counted in cache entries, which holes would shift")

    def _crop_dead_tail(self) -> None:
        """Cut the trailing columns no row can read (every row rejected them)."""
        live_cols = self.mask.bool().any(0)
        keep = int(live_cols.nonzero().max()) + 1 if bool(live_cols.any()) else 0
        if keep == self.mask.shape[1]:
            return
        for layer in self.cache.layers:
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4:
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        self.mask, self.positions = self.mask[:, :keep], self.positions[:, :keep]

    def compact(self) -> None:
        """Move each row's live entries to the right end (in order) and drop the columns no row uses: holes
        left by rollbacks become left padding. Exact: entries keep their RoPE-rotated keys, and attention
        reads the same set. Only without a KV policy (a policy's runners own the physical layout)."""
        if self.mask is None:
            return
        if active_session(self.model) is not None:
            raise RuntimeError("compact() with a KV policy installed: the policy's runners own the cache layout")
        live = self.mask.bool()
        order = torch.argsort(live.to(torch.int8), dim=-1, stable=True)  # holes first, live entries in order
        width = int(live.sum(-1).max())
        order = order[:, order.shape[1] - width:]
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                continue
            idx = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            layer.keys = torch.gather(keys, 2, idx).contiguous()
            vidx = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[-1])
            layer.values = torch.gather(layer.values, 2, vidx).contiguous()
        self.mask = torch.gather(self.mask, 1, order)
        self.positions = torch.gather(self.positions, 1, order)

    def entry_positions(self, layer: int) -> torch.Tensor:
        """RoPE position of every entry of cache layer ``layer``: ``[B, Hk, N]`` (-1 = padding, hole or an
        invalid slot). With a KV policy the runner's slots map entries to the stream columns."""
        session = active_session(self.model)
        keys = self.cache.layers[layer].keys
        if session is None or layer not in session.runners or session.runners[layer].state.slots is None:
            return self.positions[:, None, :].expand(-1, keys.shape[1], -1)
        st = session.runners[layer].state
        pos = torch.gather(self.positions.unsqueeze(1).expand(-1, st.slots.shape[1], -1), 2,
                           st.slots.clamp_max(self.positions.shape[1] - 1))
        return torch.where(st.valid, pos, torch.full_like(pos, -1))

    def cache_bytes(self) -> int:
        return cache_bytes(self.cache)

    def snapshot(self) -> Dict[str, Any]:
        """The running state (positions, mask, every layer's key/value tensors) so that :meth:`restore` can
        return to this point, e.g. to compress one prefill several ways. Tensors are referenced, not copied:
        the cache replaces rather than edits them."""
        return {"mask": self.mask, "positions": self.positions, "next_position": self.next_position,
                "layers": [(layer.keys, layer.values) for layer in self.cache.layers]}

    def restore(self, state: Dict[str, Any]) -> None:
        """Return to a :meth:`snapshot` (later layers the snapshot did not have are emptied)."""
        if len(state["layers"]) != len(self.cache.layers):
            raise ValueError(f"snapshot has {len(state['layers'])} cache layers, this cache {len(self.cache.layers)}")
        self.mask, self.next_position = state["mask"], state["next_position"]
        self.positions = state.get("positions")
        for layer, (keys, values) in zip(self.cache.layers, state["layers"]):
            layer.keys, layer.values = keys, values


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
        t0 = clock(held.recorded.lm.device)
        lm, logits = held.resume()
        t0 -= held.seconds
    else:
        lm = CachedLM(model)
        t0 = clock(lm.device)
        logits = lm.feed(context_ids, context_mask)
        if question_ids is not None and question_ids.shape[1] > 0:
            logits = lm.feed(question_ids, question_mask)
    t1 = clock(lm.device)
    size = lm.cache_bytes()
    tokens = lm.greedy(logits, max_new_tokens, stop_ids)
    t2 = clock(lm.device)
    steps = max((len(t) for t in tokens), default=0)
    return GenerationResult(tokens=tokens, prefill_seconds=t1 - t0, decode_seconds=t2 - t1, decode_steps=steps,
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
        (:meth:`~lightning_modules.llm.session.PolicySession.replay_prefill`), append ``question_ids`` (if any)
        and decode greedily under it. ``batched=True`` (a one-row context) runs the policies as the rows of one
        batch (:class:`~lightning_modules.llm.policy.PolicyBatch`): one forward per decode step for all;
        tokens agree with separate runs up to floating-point ties, timings are shared by the rows (measure
        speed unbatched), and rows are padded to the longest, so batch policies of similar budgets."""
        from lightning_modules.llm.session import install_policy

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
        from lightning_modules.llm.policy import PolicyBatch
        from lightning_modules.llm.session import install_policy

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
    from lightning_modules.llm.policy import KVPolicy
    from lightning_modules.llm.session import install_policy

    lm = CachedLM(model)
    t0 = clock(lm.device)
    with install_policy(model, KVPolicy(), record_prefill=True, prefill_sums=True) as recorder:
        first_logits = lm.feed(context_ids, context_mask)
    return RecordedPrefill(lm, lm.snapshot(), recorder.prefill_observations, first_logits, clock(lm.device) - t0)


@dataclass
class HeldPrompt:
    """A prompt ``ids [B, n]`` prefilled once up to, not including, its last column, so that many decodes start
    from it (the arms of a benchmark, several samplings): :meth:`resume` returns the cache to that point and
    feeds the last column, under whatever the caller installed on the model at that moment (a read method,
    signal recorders, a KV policy: an installed policy first compresses the held prefill as if it had been
    installed during it, :meth:`~lightning_modules.llm.session.PolicySession.replay_prefill`). Every decode
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


def _eos_ids(source: Any) -> List[int]:
    """``eos_token_id`` (an int, a list of ints or None) of a model's generation config / config, or of a
    ``GenerationConfig`` itself."""
    if source is None:
        return []
    configs = [source] if not hasattr(source, "generation_config") else [source.generation_config,
                                                                          getattr(source, "config", None)]
    for cfg in configs:
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def _turn_end_ids(tokenizer: Any) -> List[int]:
    """The special tokens the chat template writes after an assistant message (``<|im_end|>`` for SmolLM2,
    ``<end_of_turn>`` for Gemma, ``<|eot_id|>`` for Llama 3): one user + assistant exchange is rendered, and the
    special tokens after the assistant's text are taken. Empty without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "litctx-stop-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects this exchange has no usable turn end
        return []
    if not isinstance(text, str) or marker not in text:
        return []
    tail = text[text.rindex(marker) + len(marker):]
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids if int(i) in special]


def stop_token_ids(tokenizer: Any, model_or_generation_config: Any = None) -> List[int]:
    """The token ids that end a greedy answer, sorted: the model's ``generation_config.eos_token_id`` (an int or
    a list; ``config.eos_token_id`` when the generation config has none), the tokenizer's ``eos_token_id``, and
    the special token(s) the chat template writes to close an assistant turn.

    Args:
        tokenizer: a Hugging Face tokenizer (its chat template is rendered once).
        model_or_generation_config: a model (``.generation_config``), a ``GenerationConfig``, or None.
    """
    ids = set(_eos_ids(model_or_generation_config))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(_turn_end_ids(tokenizer))
    return sorted(ids)
