"""Dustin's two signals, recorded while speculative decoding runs, in *position space* ``[B, P]``.

Target and draft hold the same token sequence but in different physical layouts (each rolls back its own
rejections), so both signals are indexed by RoPE position (:meth:`~lightning_modules.llm.runtime.cached_lm.CachedLM.entry_positions`).

* :class:`HistoryRecorder` (an ``observe`` runner on the target's chosen layer(s)) keeps the queries of the
  target's latest call at the chosen query heads. The history signal of the next step is the attention of the
  query of the **last token in the target's cache** over that cache, summed over the heads: after a
  verification this is the last accepted token's query, computed by that call (**deviation**: the paper uses
  ``q(x_n)`` of the last committed token, which the target has not computed before it verifies; ours is one
  token older and costs no extra forward).
* :class:`LookaheadRecorder` (an ``observe`` runner on the draft's chosen layers) accumulates, during the
  draft's calls of the current step, the attention of each drafting query (the query whose next-token
  prediction becomes a draft) over the draft's cache at the chosen heads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from lightning_modules.llm.model.attention import mask_to_key_mask
from lightning_modules.llm.runtime.stack import attach_runners

__all__ = ["HistoryRecorder", "LookaheadRecorder", "StepCursor", "entry_valid", "live_positions", "position_width",
           "to_positions", "record_signals"]


def entry_valid(lm: Any, layer: int) -> torch.Tensor:
    """``[B, Hk, N]`` entries of ``lm``'s cache layer that may be read (a policy's bookkeeping when installed)."""
    from lightning_modules.llm.kv_policy.runner import active_session

    session = active_session(lm.model)
    keys = lm.cache.layers[layer].keys
    if session is not None and layer in session.runners and session.runners[layer].state.valid is not None:
        return session.runners[layer].state.valid
    return lm.mask.bool()[:, None, :].expand(-1, keys.shape[1], -1)


def position_width(lm: Any) -> int:
    """Positions ``0 .. width - 1`` cover every column of ``lm``'s cache (the width of position-space signals)."""
    return int(lm.positions.max()) + 1


def live_positions(lm: Any, width: int) -> torch.Tensor:
    """``[B, width]``: positions held by an entry that may be read in some layer (through a policy's slots when
    one is installed; without one every layer holds the same entries, so layer 0 answers)."""
    from lightning_modules.llm.kv_policy.runner import active_session

    live = torch.zeros(lm.positions.shape[0], width, dtype=torch.bool, device=lm.positions.device)
    layers = range(len(lm.cache.layers)) if active_session(lm.model) is not None else range(1)
    for layer in layers:
        pos = lm.entry_positions(layer)
        ok = (pos >= 0) & entry_valid(lm, layer)
        flat = torch.where(ok, pos, torch.full_like(pos, width)).reshape(pos.shape[0], -1)
        hit = torch.zeros(pos.shape[0], width + 1, dtype=torch.bool, device=pos.device)
        hit.scatter_(1, flat, True)
        live |= hit[:, :width]
    return live


class StepCursor:
    """Which query of the target's latest call belongs to the last token in its cache (the history query),
    kept across verification steps: the prompt's last query before the first step, then index ``accepted[b]``
    of each verification (the pending token sits at 0, draft ``i`` at ``i``)."""

    def __init__(self) -> None:
        self.last_index: Optional[torch.Tensor] = None

    def history_index(self, history: "HistoryRecorder") -> torch.Tensor:
        if self.last_index is None:
            if not history.queries:
                raise RuntimeError("dustin: no history query was recorded (the target layer saw no call)")
            q = next(iter(history.queries.values()))
            self.last_index = torch.full((q.shape[0],), q.shape[2] - 1, dtype=torch.long, device=q.device)
        return self.last_index

    def verified(self, accepted: torch.Tensor) -> None:
        self.last_index = accepted.clone()


def to_positions(scores: torch.Tensor, positions: torch.Tensor, width: int, per_head: bool = False) -> torch.Tensor:
    """Sum entry scores ``[B, H, N]`` into positions ``[B, width]`` (``per_head``: ``[B, H, width]``); entries at
    position -1 (padding, holes) are dropped."""
    b, h = scores.shape[:2]
    pos = positions.expand_as(scores)
    if not per_head:
        pos, val = pos.reshape(b, 1, -1), scores.reshape(b, 1, -1)
    else:
        val = scores
    val = val.double()
    keep = (pos >= 0) & (pos < width)
    out = torch.zeros(b, pos.shape[1], width + 1, dtype=torch.float64, device=scores.device)
    out.scatter_add_(2, torch.where(keep, pos, torch.full_like(pos, width)), torch.where(keep, val, torch.zeros_like(val)))
    out = out[..., :width]
    return out if per_head else out[:, 0]


class HistoryRecorder:
    """Observer on target layers: the latest call's queries at ``heads`` (query-head indices) per layer."""

    def __init__(self, layers: Sequence[int], heads: Dict[int, List[int]]) -> None:
        self.layers = list(layers)
        self.heads = heads
        self.queries: Dict[int, torch.Tensor] = {}  # layer -> [B, |H|, n_q, d]
        self.scale: Dict[int, float] = {}

    def observe(self, module, query, key, value, attention_mask, scale, window) -> None:
        layer = module.layer_idx
        if layer in self.heads:
            self.queries[layer] = query[:, self.heads[layer]].detach()
            self.scale[layer] = float(scale)

    def signal(self, lm: Any, last_index: torch.Tensor, width: int, per_head: bool = False) -> Any:
        """History attention ``[B, width]``: for every recorded layer, the query at ``last_index [B]`` of its
        latest call against the layer's valid cache entries, softmax per head, summed over heads and layers.
        ``per_head``: ``{layer: [B, |H|, width]}`` instead (calibration)."""
        total = None
        per: Dict[int, torch.Tensor] = {}
        for layer, q in self.queries.items():
            rows = torch.arange(q.shape[0], device=q.device)
            qs = q[rows, :, last_index.clamp_max(q.shape[2] - 1)]  # [B, |H|, d]
            keys = lm.cache.layers[layer].keys  # [B, Hk, N, d]
            group = lm.model.config.num_attention_heads // keys.shape[1]
            kv = torch.tensor(self.heads[layer], device=keys.device) // group
            k_sel = keys[:, kv]  # [B, |H|, N, d]
            valid = entry_valid(lm, layer)[:, kv]
            logits = torch.einsum("bhd,bhnd->bhn", qs.float(), k_sel.float()) * self.scale[layer]
            probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
            pos = lm.entry_positions(layer)[:, kv]
            if per_head:
                per[layer] = to_positions(probs, pos, width, per_head=True)
                continue
            sig = to_positions(probs, pos, width)
            total = sig if total is None else total + sig
        if per_head:
            return per
        if total is None:
            raise RuntimeError("dustin: no history query was recorded (the target layer saw no call)")
        return total

    def key_bytes(self, lm: Any) -> int:
        """Bytes of the keys the history signal reads: every entry of the KV heads behind the chosen heads."""
        total = 0
        for layer in self.queries:
            keys = lm.cache.layers[layer].keys
            group = lm.model.config.num_attention_heads // keys.shape[1]
            n_kv = len({h // group for h in self.heads[layer]})
            total += keys.shape[0] * n_kv * keys.shape[2] * keys.shape[3] * keys.element_size()
        return total


class LookaheadRecorder:
    """Observer on draft layers: while enabled, each call's last query at ``heads`` attends over the draft's
    cache entries; the probabilities (summed over heads and calls) are accumulated by position."""

    def __init__(self, draft_lm: Any, heads: Dict[int, List[int]], per_head: bool = False) -> None:
        self.lm = draft_lm
        self.heads = heads
        self.per_head = per_head
        self.enabled = False
        self.width = 0
        self.acc: Any = None

    def start(self, width: int) -> None:
        self.enabled, self.width, self.acc = True, int(width), None

    def stop(self) -> torch.Tensor:
        self.enabled = False
        return self.acc

    def observe(self, module, query, key, value, attention_mask, scale, window) -> None:
        layer = module.layer_idx
        if not self.enabled or layer not in self.heads:
            return
        n_q, n_k = query.shape[2], key.shape[2]
        n_old = n_k - n_q
        if n_old == 0:
            return
        heads = self.heads[layer]
        group = query.shape[1] // key.shape[1]
        kv = torch.tensor(heads, device=key.device) // group
        q = query[:, heads, -1].float()  # [B, |H|, d]
        k = key[:, kv, :n_old].float()
        logits = torch.einsum("bhd,bhnd->bhn", q, k) * float(scale)
        # the last query also reads the call's own entries; they are new positions, not in the target's history
        k_new = key[:, kv, n_old:].float()
        logits_new = torch.einsum("bhd,bhnd->bhn", q, k_new) * float(scale)
        valid = self.lm.mask.bool()[:, None, :n_old].expand(-1, len(heads), -1)
        if attention_mask is not None:
            km = mask_to_key_mask(attention_mask, n_q, n_k)
            if km is not None:
                new_valid = km[:, :, n_old:].expand(-1, len(heads), -1)
                logits_new = logits_new.masked_fill(~new_valid, float("-inf"))
        full = torch.cat([logits.masked_fill(~valid, float("-inf")), logits_new], -1)
        probs = torch.softmax(full, -1).nan_to_num(0.0)[..., :n_old]
        pos = self.lm.positions[:, None, :n_old].expand(-1, len(heads), -1)
        if self.per_head:  # {layer: [B, |H|, width]}
            sig = to_positions(probs, pos, self.width, per_head=True)
            self.acc = {} if self.acc is None else self.acc
            self.acc[layer] = sig if layer not in self.acc else self.acc[layer] + sig
            return
        sig = to_positions(probs, pos, self.width)
        self.acc = sig if self.acc is None else self.acc + sig


@contextlib.contextmanager
def record_signals(target: torch.nn.Module, draft: Optional[torch.nn.Module], history: HistoryRecorder,
                   lookahead: Optional[LookaheadRecorder]) -> Iterator[None]:
    """Attach both recorders (``observe`` runners) for the block (no lookahead recorder for a model-free
    draft)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(attach_runners(target, lambda m: _Only(history, m.layer_idx in history.heads),
                                           "dustin history recorder", role="observe"))
        if draft is not None and lookahead is not None:
            stack.enter_context(attach_runners(draft, lambda m: _Only(lookahead, m.layer_idx in lookahead.heads),
                                               "dustin lookahead recorder", role="observe"))
        yield


class _Only:
    """An observer that forwards to ``inner`` on the layers it serves."""

    def __init__(self, inner: Any, active: bool) -> None:
        self.inner, self.active = inner, active

    def observe(self, *args) -> None:
        if self.active:
            self.inner.observe(*args)
