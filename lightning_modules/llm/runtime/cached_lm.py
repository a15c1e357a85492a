"""A causal LM with its KV cache as one object: feed tokens, peek without committing, snapshot and restore
(:class:`CachedLM`), the runtime every driver and method builds on; and :class:`Prefilled`, the one value every
prefill -> decode driver starts decoding from (:func:`prefill` makes the plain one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from lightning_modules.llm.runtime.stack import active_session
from lightning_modules.llm.runtime.stack import cache_bytes
from litctx_common.timing import clock

__all__ = ["CachedLM", "Prefilled", "prefill"]


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
        from lightning_modules.llm.decoding.step import StepDecoder

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


@dataclass
class Prefilled:
    """What a prefill hands its decoder, whichever way it was made (one forward, a held prompt, stored chunk KV):

    Attributes:
        lm: the prefilled :class:`CachedLM`.
        first_logits: ``[B, V]``, the logits of each row's last prompt token.
        seconds: the prefill's wall time (the device synchronised before each clock reading).
    """

    lm: CachedLM
    first_logits: torch.Tensor
    seconds: float


@torch.no_grad()
def prefill(model: torch.nn.Module, context_ids: torch.Tensor, context_mask: Optional[torch.Tensor] = None,
            question_ids: Optional[torch.Tensor] = None, question_mask: Optional[torch.Tensor] = None,
            lm: Optional["CachedLM"] = None) -> Prefilled:
    """Prefill ``context_ids [B, n]`` (left padding in ``context_mask``) into a fresh cache (``lm``'s, when the
    caller made it already, e.g. to install hooks on it), then append ``question_ids [B, m]`` when given (a KV
    policy compresses the context before it sees the question). The one timed prefill of every driver."""
    lm = CachedLM(model) if lm is None else lm
    t0 = clock(lm.device)
    logits = lm.feed(context_ids, context_mask)
    if question_ids is not None and question_ids.shape[1] > 0:
        logits = lm.feed(question_ids, question_mask)
    return Prefilled(lm, logits, clock(lm.device) - t0)

