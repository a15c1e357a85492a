"""The KV-policy runner: install a :class:`~lightning_modules.llm.kv_policy.protocol.KVPolicy` on a Hugging Face model,
and always remove it.

``with install_policy(model, policy) as session:`` switches the model to the ``litctx`` attention function,
puts a :class:`LayerRunner` on every attention module (through the generic runner stack of
:mod:`lightning_modules.llm.runtime.stack`) and restores everything on exit, also when the body raises.

Each runner keeps the bookkeeping of its layer's cache: ``slots [B, Hk, N]`` (index of each entry in the
uncompressed token stream) and ``valid [B, Hk, N]`` (readable: not padding, not masked). A call on an empty
cache starts a new sequence (the scorer and compensator are reset). Attention is computed by
:func:`litctx_kernels.attention` with ``key_mask = valid`` and bottom-right causal alignment (new entries are
appended last, and kept entries stay in sequence order), then the policy acts according to its schedule:

* ``evict`` gathers the kept entries into the cache's ``keys``/``values`` (memory really shrinks; heads with
  fewer kept entries are padded with invalid slots up to the largest head);
* ``mask`` only clears ``valid``; ``sparse_read`` masks entries for the current decode step only;
* ``recompute`` records the entries a driver should recompute (:meth:`PolicySession.recompute_sets`).

Padding: in the first prefill the per-key validity comes from transformers' mask (causal x padding); after
that the runner's ``valid`` is authoritative for old entries and new single tokens are always valid, so a
driver passes a mask of ones over the (possibly compressed) cache plus the new tokens' own padding.

One code path: a single policy is installed as the :class:`~lightning_modules.llm.kv_policy.protocol.PolicyBatch`
of one that serves every row; a batch of several serves row ``b`` with ``policies[b]``.

Sliding-window layers (transformers passes ``sliding_window=W``): attention reads, for query ``i``, the valid
entries with ``slot_i - W < slot <= slot_i`` (:func:`window_attention`); entries the next query cannot see are
invalid before the policy scores, and leading entries no row can read leave the cache. transformers'
``DynamicSlidingWindowLayer`` (which cuts its own tail) is replaced by a plain ``DynamicLayer`` at the first
call, so the runner alone decides what the layer holds.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

import litctx_kernels
from litctx_kernels.reference.colstats import MOMENTS as COLSTATS_MOMENTS, decode_attention_colstats
from lightning_modules.llm.model.attention import (mask_to_key_mask)
from lightning_modules.llm.kv_policy.protocol import (Action, KVObservation, KVPolicy, PolicyBatch, Schedule,
                                         SharedTopKSelector, TopKSelector, compensator_merge)
from lightning_modules.llm.runtime.slot_buffer import SlotBufferLayer, as_slot_buffer
from lightning_modules.llm.runtime.stack import (SESSION_ATTR, RunnerStack, active_session, attach_runners,
                                                 attention_modules, check_window, phase_of, window_attention)

__all__ = ["SESSION_ATTR", "BATCHED_SELECTORS", "IN_PLACE_MIN", "IN_PLACE_FRACTION", "LayerState", "LayerRunner", "PolicySession", "active_session", "install_policy"]




BATCHED_SELECTORS = (TopKSelector, SharedTopKSelector)


"""Selectors whose decode-step decisions are batched across layers (they act per ``[B, Hk]`` row of a view,
so stacking layers along the batch axis changes nothing)."""


IN_PLACE_MIN = 8


IN_PLACE_FRACTION = 8


"""An in-place eviction (``schedule.compaction == "inplace"``) moves the tail entries into the dropped ones'
places when at most ``max(IN_PLACE_MIN, N // IN_PLACE_FRACTION)`` entries lie past the new length (a decode
step's); a larger compaction (after the prefill) gathers the kept entries in stream order."""


@dataclass
class LayerState:
    slots: Optional[torch.Tensor] = None  # [B, Hk, N] long
    valid: Optional[torch.Tensor] = None  # [B, Hk, N] bool
    seen: int = 0  # tokens of the uncompressed stream so far
    decode_steps: int = 0
    recompute: Optional[torch.Tensor] = None  # [B, Hk, N] bool, the last RECOMPUTE decision
    capacity: Optional[List[Optional[torch.Tensor]]] = None  # per policy of the batch: [B|1, Hk] long, fixed at


class LayerRunner:
    """Runs one layer's attention under a policy (see the module docstring).

    The policy is held as a :class:`PolicyBatch` (a single :class:`KVPolicy` is the batch of one that serves
    every row), so one code path serves both: each policy of the batch has its own copy of the scorer (stateful
    scorers keep per-layer state) and decides for the rows it serves."""

    def __init__(self, layer: int, policy: Any, session: "PolicySession") -> None:
        self.layer = layer
        self.policy = PolicyBatch.of(policy)
        self.scorers = [copy.deepcopy(p.scorer) for p in self.policy.policies]
        self.session = session
        self.state = LayerState()
        self.cache: Any = None
        self.hidden: Optional[torch.Tensor] = None  # this call's attention input [B, Nq, D] (the pre-hook's)

    # ------------------------------------------------------------------ bookkeeping
    def _start(self) -> None:
        self.state = LayerState()
        for scorer in self.scorers:
            if scorer is not None:
                scorer.reset()
        if self.policy.compensator is not None and self.layer == self.session.first_layer:
            self.policy.compensator.reset()

    def _new_entries(self, attention_mask: Optional[torch.Tensor], b: int, hk: int, n_q: int,
                     device: torch.device, window: Optional[int]):
        new_valid = torch.ones(b, hk, n_q, dtype=torch.bool, device=device)
        if attention_mask is not None and n_q > 1:
            # transformers builds one mask for every layer (of a type) from one layer's cache length; layers whose
            # caches differ in size (head-adaptive or per-layer budgets, sliding windows) read the new tokens'
            # columns, the last n_q (older entries' validity is the runner's own)
            n_mask = attention_mask.shape[-1]
            key_mask = mask_to_key_mask(attention_mask, n_q, n_mask, window=window)
            if key_mask is None:
                shape = "causal" if window is None else f"causal x sliding window {window}"
                raise ValueError(f"layer {self.layer}: a KV policy needs a {shape} x per-key (padding) mask; got "
                                 f"a mask of shape {list(attention_mask.shape)} that does not factor that way")
            # transformers' masks are shared by the heads ([B, 1, Nq, Nk]); entries are per KV head here
            new_valid = key_mask[:, 0, n_mask - n_q:].unsqueeze(1).expand(b, hk, n_q).clone()
        slots = (self.state.seen + torch.arange(n_q, device=device)).view(1, 1, n_q).expand(b, hk, n_q)
        return slots, new_valid

    def _views(self, obs: KVObservation) -> List[Tuple[int, KVPolicy, KVObservation]]:
        """``(index, policy, its observation)`` for every policy of the batch: a batch of one serves the whole
        observation; otherwise policy ``i`` serves row ``i``, and a one-row observation (a replayed prefill)
        stands for every row."""
        policies = self.policy.policies
        if len(policies) == 1:
            return [(0, policies[0], obs)]
        rows = obs.k.shape[0]
        if rows not in (1, len(policies)):
            raise RuntimeError(f"layer {self.layer}: {len(policies)} policies for a batch of {rows} rows")
        return [(i, p, obs if rows == 1 else obs.row(i)) for i, p in enumerate(policies)]

    def _rows(self, n_obs_rows: int) -> int:
        """Batch rows this layer's cache holds after a call with ``n_obs_rows`` observed rows."""
        n = len(self.policy.policies)
        return n_obs_rows if n == 1 else n

    # ------------------------------------------------------------------ the attention call
    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float, window: Optional[int] = None,
               stack: Optional["RunnerStack"] = None, phase_hint: Optional[str] = None) -> torch.Tensor:
        """``query [B, Hq, Nq, d]`` over the cache view ``key, value [B, Hk, Nk, d]`` (this call's entries last);
        ``window`` is the layer's sliding window (None: full causal attention). ``stack`` (the module's
        :class:`RunnerStack`) computes the attention over the entries this policy lets the call read (a prefill
        method, a read subset); ``phase_hint`` is the driver's mark (``verify``). Returns ``[B, Hq, Nq, dv]``."""
        n_q = query.shape[2]
        n_old = key.shape[2] - n_q
        window = self._begin_call(key, value, n_old, window)
        st = self.state
        phase = phase_of(n_old, n_q, phase_hint)
        new_slots, new_valid = self._new_entries(attention_mask, key.shape[0], key.shape[1], n_q, key.device, window)
        slots = new_slots if n_old == 0 else torch.cat([st.slots, new_slots], dim=-1)
        valid = new_valid if n_old == 0 else torch.cat([st.valid, new_valid], dim=-1)
        # this call's attention input (the pre-hook's), when it belongs to these queries
        hidden = self.hidden if self.hidden is not None and self.hidden.shape[1] == n_q else None
        call = KVObservation(self.layer, phase, query, key, value, slots, valid, scale, window=window, hidden=hidden)
        read = self._read_set(call, n_old)
        o, lse, colstats = self._attention(module, call, read, attention_mask, stack)
        if window is not None:
            # entries the next query cannot see (slot <= next slot - window) are dead: never read again
            valid = valid & (slots > st.seen + n_q - window)
        o, lse = self._compensate(query, scale, hidden, o, lse)
        obs = KVObservation(self.layer, phase, query, key, value, slots, valid, scale, out=o, lse=lse,
                            window=window, hidden=hidden)
        if colstats is not None:
            obs._cache[colstats[0]] = colstats[1]
        if phase == "prefill" and self.session.record_prefill:
            self.session.prefill_observations[self.layer] = obs
        self._after_attention(obs)
        return o

    def _begin_call(self, key: torch.Tensor, value: torch.Tensor, n_old: int, window: Optional[int]) -> Optional[int]:
        """Check the call against the tracked state (a first call starts it afresh) and own a sliding layer's
        cache; returns the checked ``window``."""
        window = check_window(self.layer, window)
        if window is not None:
            if self.policy.compensator is not None and self.policy.acts_on(self.layer):
                raise ValueError(f"layer {self.layer} is a sliding-window layer (window {window}): a compensator "
                                 f"would read evicted entries outside the window; limit the policy's layers to "
                                 f"full-attention layers")
            self._own_sliding_cache(key, value)
        st = self.state
        if n_old == 0:
            self._start()
        elif st.slots is None or st.slots.shape[-1] != n_old or st.slots.shape[0] != key.shape[0]:
            have = None if st.slots is None else list(st.slots.shape)
            raise RuntimeError(f"layer {self.layer}: the cache holds {n_old} entries for batch {key.shape[0]} but "
                               f"the policy tracked {have}; a cache that was filled before the policy was installed, "
                               f"or edited outside it, cannot be served (start from an empty cache)")
        return window

    def _read_set(self, call: KVObservation, n_old: int) -> torch.Tensor:
        """``[B, Hk, Nk]``: the entries this call reads (every valid one, unless a sparse-read policy decides)."""
        pol = self.policy
        if not (pol.action is Action.SPARSE_READ and call.phase in ("decode", "verify") and pol.acts_on(self.layer)):
            return call.valid
        read = self._combine([p.decide(ob, self.scorers[i]) if p.acts_on(self.layer) else ob.valid
                              for i, p, ob in self._views(call)])
        # the call's own entries are always read (a verification's queries attend to each other causally)
        read = torch.cat([read[..., :n_old], call.valid[..., n_old:]], -1)
        self.session.record(self.layer, call.phase, read, call.valid)
        return read

    def _attention(self, module: torch.nn.Module, call: KVObservation, read: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], stack: Optional["RunnerStack"]):
        """The attention of ``call``'s queries over the ``read`` entries: ``(out [B, Hq, Nq, dv], lse [B, Hq, Nq],
        colstats)``, where ``colstats`` is ``(cache key, sums)`` of the column sums a fused path computed on the way
        for the scorers to reuse (None otherwise, and with a compensator, whose output the sums would not match)."""
        q, k, v, scale, window, phase = call.q, call.k, call.v, call.scale, call.window, call.phase
        n_q = q.shape[2]
        dense = bool(read.all())
        plain = KVObservation(self.layer, phase, q, k, v, call.slots, call.valid, scale)
        if (phase == "decode" and n_q == 1 and window is None and self.policy.acts_on(self.layer)
                and (stack is None or "read" not in stack.parts)):
            fused = self._decode_moments(plain)
            if fused is not None:
                # one pass gives the output and the probabilities the scorers sum (no second pass over the keys)
                o, lse, stats = decode_attention_colstats(q, k, v, scale=scale, key_mask=None if dense else read,
                                                          moments=fused)
                return o, lse, ((("colstats", 1, fused), stats) if self.policy.compensator is None else None)
        if dense and self._prefill_sums_wanted(lambda: plain, phase, window, stack, n_q):
            # attention and every query's column sums from one call (H2O's scores, or a recorded prefill that
            # policies will read) instead of a second pass over the queries (never with a compensator); None
            # where no fused path serves these shapes
            fused_prefill = litctx_kernels.fused_attention_colstats(q, k, v, scale=scale, causal=True)
            if fused_prefill is not None:
                o, lse, sums = fused_prefill
                return o, lse, (("colstats", n_q, "attention"), sums)
        first = self.state.seen
        if stack is not None:
            o, lse = stack.compute(module, q, k, v, read, scale, window, phase, attention_mask, call.slots,
                                   first_slot=first)
        elif window is None:
            o, lse = litctx_kernels.attention(q, k, v, scale=scale, causal=True, key_mask=None if dense else read)
        else:
            o, lse = window_attention(q, k, v, call.slots, read, scale, window, first_slot=first)
        return o, lse, None

    def _compensate(self, query: torch.Tensor, scale: float, hidden: Optional[torch.Tensor], o: torch.Tensor,
                    lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` with the policy's compensator (if any) added: as a residual, or merged by LSE."""
        comp = self.policy.compensator
        if comp is not None and compensator_merge(comp) == "residual":
            extra = comp.read_residual(self.layer, query, scale, hidden)
            if extra is not None:
                o = o + extra.to(o.dtype)
        elif comp is not None:
            extra = comp.read(self.layer, query, scale)
            if extra is not None:
                o, lse = litctx_kernels.merge_lse(o, lse, extra[0].to(o.dtype), extra[1].to(lse.dtype))
        return o, lse

    def _prefill_sums_wanted(self, pre: Callable[[], KVObservation], phase: str, window: Optional[int],
                             stack: Optional["RunnerStack"], n_q: int) -> bool:
        """Whether a prefill call should compute every query's attention column sums with its attention: a
        full-attention layer without a prefill method or compensator, whose session asks for them
        (``prefill_sums``: a recorded prefill that eviction policies will replay) or whose acting scorer reads
        the sums of all of the call's queries with ``moments="attention"`` (H2O); ``pre()`` builds the
        observation the scorers' requests read."""
        if phase != "prefill" or window is not None or n_q < 2 or self.policy.compensator is not None:
            return False
        if stack is not None and "prefill" in stack.parts:
            return False
        if self.session.prefill_sums:
            return True
        obs = None
        for pol, scorer in zip(self.policy.policies, self.scorers):
            request = getattr(scorer, "colstats_request", None)
            if request is None or not pol.acts_on(self.layer) or pol.action is Action.SPARSE_READ:
                continue
            obs = pre() if obs is None else obs
            w, moments = request(obs)
            if (w is None or w >= n_q) and moments == COLSTATS_MOMENTS[0]:
                return True
        return False

    def _decode_moments(self, pre: KVObservation) -> Optional[str]:
        """The column statistics (``attention`` or ``output``) the acting scorers read at a decode step, when a
        fused decode pass can give them (one query, no logit moments); None otherwise."""
        want = None
        for pol, scorer in zip(self.policy.policies, self.scorers):
            request = getattr(scorer, "colstats_request", None)
            if request is None or not pol.acts_on(self.layer) or pol.action is Action.SPARSE_READ:
                continue
            moments = request(pre)[1]
            if moments not in COLSTATS_MOMENTS[:2]:
                return None
            want = moments if want is None else COLSTATS_MOMENTS[max(COLSTATS_MOMENTS.index(want),
                                                                      COLSTATS_MOMENTS.index(moments))]
        return want

    def _combine(self, keeps: List[torch.Tensor]) -> torch.Tensor:
        return keeps[0] if len(keeps) == 1 else torch.cat(keeps, 0)

    def _after_attention(self, obs: KVObservation) -> None:
        """Update the scorers, count the step, and act where a policy's schedule says so (evict / mask /
        recompute); on a sliding-window layer, drop the dead entries every row has left behind."""
        st = self.state
        views = self._views(obs)
        st.seen += obs.q.shape[2]
        if obs.phase in ("decode", "verify"):
            st.decode_steps += 1
        if st.capacity is None:
            st.capacity = [None] * len(self.policy.policies)
        shared = len(views) > 1 and obs.k.shape[0] == 1
        if shared:
            self._prefetch_colstats(obs)
        keeps, acted = [], False
        for i, pol, ob in views:
            if not pol.acts_on(self.layer):
                keeps.append(ob.valid)
                continue
            self.scorers[i].update(ob)
            if pol.action is Action.SPARSE_READ or not self._due(obs.phase, pol.schedule):
                keeps.append(ob.valid)
                continue
            if pol.budget.compression_ratio is None:
                capacity = None  # an absolute keep: decided afresh each time (a first decision on a short stream
                # must not freeze the capacity at that call's few entries)
            else:
                if st.capacity[i] is None:
                    st.capacity[i] = pol.budget.capacity(ob.valid.sum(-1), self.layer, ob.valid.shape[1])
                capacity = st.capacity[i]
            if len(views) == 1 and self._deferrable(obs, pol):
                # a decode step's eviction waits for the step's other layers: one batched decision for all
                if capacity is None:
                    capacity = pol.budget.capacity(ob.valid.sum(-1), self.layer, ob.valid.shape[1])
                st.slots, st.valid = obs.slots, obs.valid
                self.session.defer(self, obs, pol, capacity)
                if self.layer == self.session.last_layer:
                    self.session.flush()
                return
            keeps.append(pol.decide(ob, self.scorers[i], capacity))
            acted = True
        rows = self._rows(obs.k.shape[0])
        slots, valid = obs.slots.expand(rows, -1, -1), obs.valid.expand(rows, -1, -1)
        if acted:
            keep = self._combine(keeps) & valid
            self.session.record(self.layer, obs.phase, keep, valid)
            slots, valid = self._apply(keep, obs.k.expand(rows, -1, -1, -1), obs.v.expand(rows, -1, -1, -1),
                                       slots, valid, obs.window)
        if obs.window is not None:
            slots, valid = self._drop_dead_prefix(slots, valid)
        st.slots, st.valid = slots, valid
        if self.session.pending and self.layer == self.session.last_layer:
            self.session.flush()

    def _deferrable(self, obs: KVObservation, pol: KVPolicy) -> bool:
        """Whether this call's decision may wait for the step's last layer (:meth:`PolicySession.flush`): a
        one-token decode step of a single in-place evicting policy with a per-head or shared top-k selector, no
        compensator and no sliding window. Waiting is exact: a layer's decision reads only its own entries and
        is applied before the layer's next call."""
        return (obs.phase == "decode" and obs.q.shape[2] == 1 and obs.window is None
                and pol.action is Action.EVICT and pol.compensator is None
                and pol.schedule.compaction == "inplace" and type(pol.selector) in BATCHED_SELECTORS)

    def finish(self, obs: KVObservation, keep: torch.Tensor) -> None:
        """Apply a deferred decision ``keep [B, Hk, N]`` over this layer's view ``obs``."""
        keep = keep & obs.valid
        self.session.record(self.layer, obs.phase, keep, obs.valid)
        self.state.slots, self.state.valid = self._apply(keep, obs.k, obs.v, obs.slots, obs.valid, None)

    def _prefetch_colstats(self, obs: KVObservation) -> None:
        """A shared observation serves every row's scorer: compute each window's column statistics once, with
        the richest moments any row asks for (a scorer that needs fewer reads them from the same pass)."""
        want: Dict[Optional[int], int] = {}
        for pol, scorer in zip(self.policy.policies, self.scorers):
            request = getattr(scorer, "colstats_request", None)
            if request is None or not pol.acts_on(self.layer):
                continue
            window, moments = request(obs)
            want[window] = max(want.get(window, 0), COLSTATS_MOMENTS.index(moments))
        for window, rank in want.items():
            obs.colstats(window, moments=COLSTATS_MOMENTS[rank])

    def replay_prefill(self, obs: KVObservation, cache: Any) -> None:
        """Act on a prefill recorded under another policy (see :meth:`PolicySession.replay_prefill`): the
        layer's cache is reset to the recorded full keys and values, then treated as if this policy had
        been installed during that prefill."""
        layer_cache = cache.layers[self.layer]
        rows = self._rows(obs.k.shape[0])
        layer_cache.keys = obs.k.expand(rows, -1, -1, -1)
        layer_cache.values = obs.v.expand(rows, -1, -1, -1)
        self.cache = cache
        self._start()
        self._after_attention(obs)

    def rollback(self, removed: torch.Tensor) -> None:
        """Stop reading the entries of the stream columns ``removed [B, S]`` (rejected drafts): every entry whose
        slot is marked becomes invalid in every head (evicted ones are already gone)."""
        st = self.state
        if st.slots is None:
            return
        if self.state.slots.shape[0] != removed.shape[0]:
            raise RuntimeError(f"layer {self.layer}: rollback of {removed.shape[0]} rows, the cache holds "
                               f"{st.slots.shape[0]}")
        width = removed.shape[1]
        inside = st.slots < width
        hit = torch.gather(removed.unsqueeze(1).expand(-1, st.slots.shape[1], -1), 2, st.slots.clamp_max(width - 1))
        st.valid = st.valid & ~(hit & inside)

    def _due(self, phase: str, schedule: Schedule) -> bool:
        if phase == "prefill":
            return schedule.prefill
        if phase == "append":
            return schedule.append
        return schedule.decode_every > 0 and self.state.decode_steps % schedule.decode_every == 0

    def _layer_cache(self) -> Any:
        layers = getattr(self.cache, "layers", None)
        return layers[self.layer] if layers is not None and self.layer < len(layers) else None

    def _own_sliding_cache(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A sliding-window cache layer (transformers' ``DynamicSlidingWindowLayer`` keeps the last ``W - 1``
        entries it was given) would cut entries the runner tracks; replace it by a plain ``DynamicLayer``
        holding this call's full view. The runner then removes dead entries itself, and every layer reports its
        physical length, so transformers sizes every mask from layer 0, as the driver's mask is."""
        layer_cache = self._layer_cache()
        if layer_cache is None or not getattr(layer_cache, "is_sliding", False):
            return
        from transformers.cache_utils import DynamicLayer

        plain = DynamicLayer()
        plain.lazy_initialization(key, value)
        plain.keys, plain.values = key, value
        self.cache.layers[self.layer] = plain

    def _drop_dead_prefix(self, slots: torch.Tensor, valid: torch.Tensor):
        """Sliding-window layers: the leading entries that no row can read any more leave the cache (memory stays
        at the window, as with transformers' own sliding cache)."""
        n_dead = int((~valid).long().cumprod(-1).sum(-1).min()) if valid.numel() else 0
        layer_cache = self._layer_cache()
        if n_dead == 0 or layer_cache is None:
            return slots, valid
        if not (isinstance(getattr(layer_cache, "keys", None), torch.Tensor)
                and layer_cache.keys.shape[-2] == slots.shape[-1]):
            return slots, valid  # a cache layer that does not hold this view: leave it alone
        layer_cache.keys = layer_cache.keys[:, :, n_dead:]
        layer_cache.values = layer_cache.values[:, :, n_dead:]
        if self.state.recompute is not None:  # prefix-aligned with the view (later entries are appended)
            self.state.recompute = self.state.recompute[..., n_dead:]
        return slots[..., n_dead:], valid[..., n_dead:]

    def _in_place(self) -> bool:
        """Whether this layer's evictions fill the dropped entries' places in place (a :class:`SlotBufferLayer`)
        rather than gathering the kept entries: every acting policy evicts during decoding with
        ``schedule.compaction == "inplace"``."""
        acting = [p for p in self.policy.policies if p.acts_on(self.layer)]
        return bool(acting) and all(p.schedule.decode_every > 0 and p.schedule.compaction == "inplace"
                                    for p in acting)

    def _apply(self, keep: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
               valid: torch.Tensor, window: Optional[int] = None):
        action = self.policy.action
        if action is Action.MASK:
            return slots, valid & keep
        if action is Action.RECOMPUTE:
            self.state.recompute = valid & ~keep
            return slots, valid
        # EVICT: gather the kept entries (in sequence order) of every head into the cache
        if self.cache is None or not hasattr(self.cache, "layers"):
            raise RuntimeError(f"layer {self.layer}: eviction needs a transformers Cache with .layers (pass "
                               f"use_cache=True / past_key_values=DynamicCache()); got {type(self.cache).__name__}")
        layer_cache = self.cache.layers[self.layer]
        if not (isinstance(getattr(layer_cache, "keys", None), torch.Tensor)
                and layer_cache.keys.shape == key.shape):
            raise RuntimeError(f"layer {self.layer}: cache layer {type(layer_cache).__name__} does not hold the "
                               f"full key view {list(key.shape)}; eviction supports DynamicCache layers")
        if self.policy.compensator is not None:
            self.policy.compensator.write(self.layer, key, value, slots, valid & ~keep)
        n_keep = int(keep.sum(-1).max())
        n = keep.shape[-1]
        if window is None and self._in_place():
            buffer = as_slot_buffer(self.cache, self.layer)
            if 0 < n - n_keep <= max(IN_PLACE_MIN, n // IN_PLACE_FRACTION):
                return self._fill_holes(buffer, keep, slots, n_keep)
            layer_cache = buffer  # a large compaction (the prefill's): gathered in order, then adopted
        # kept entries first (in order), then the rest; the first n_keep columns hold every kept entry
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :n_keep]
        idx = order.unsqueeze(-1)
        layer_cache.keys = torch.gather(key, 2, idx.expand(-1, -1, -1, key.shape[-1])).contiguous()
        layer_cache.values = torch.gather(value, 2, idx.expand(-1, -1, -1, value.shape[-1])).contiguous()
        return torch.gather(slots, 2, order), torch.gather(keep, 2, order)

    @staticmethod
    def _fill_holes(buffer: SlotBufferLayer, keep: torch.Tensor, slots: torch.Tensor, n_keep: int):
        """In-place eviction: the kept entries past position ``n_keep`` (the tail, ``T = N - n_keep`` entries, a
        decode step's one) move into the places of the dropped entries before it, per head, and the buffers are
        cut to ``n_keep``. Moves ``O(T d)`` numbers; the bookkeeping is ``O(N)`` on ``[B, Hk, N]`` masks. A head
        that keeps fewer than ``n_keep`` entries keeps its extra places as invalid entries (as the gather pads).
        Returns the new ``(slots, valid)`` ``[B, Hk, n_keep]``."""
        t = keep.shape[-1] - n_keep
        movers = keep[..., n_keep:]  # [B, Hk, T]
        holes = ~keep[..., :n_keep]  # [B, Hk, n_keep]
        if t == 1:  # a decode step: the new entry (when kept) takes the first hole
            first = holes.to(torch.uint8).argmax(-1, keepdim=True)
            dest = torch.where(movers, first, torch.full_like(first, n_keep))
            buffer.fill(dest, n_keep, n_keep)
            new_slots = slots[..., :n_keep].scatter(-1, first, torch.where(movers, slots[..., n_keep:],
                                                                           slots.gather(-1, first)))
            head = keep[..., :n_keep]
            return new_slots, head.scatter(-1, first, head.gather(-1, first) | movers)
        hole_rank = holes.long().cumsum(-1) - 1
        # the position of each head's r-th hole (r < T; later holes land in a spare column)
        positions = torch.arange(n_keep, device=keep.device).expand_as(hole_rank)
        at = torch.where(holes & (hole_rank < t), hole_rank, torch.full_like(hole_rank, t))
        hole_at = torch.zeros(*keep.shape[:2], t + 1, dtype=torch.long, device=keep.device).scatter_(-1, at, positions)
        mover_rank = (movers.long().cumsum(-1) - 1).clamp_min(0)
        own = torch.arange(n_keep, n_keep + t, device=keep.device).expand_as(movers)
        dest = torch.where(movers, torch.gather(hole_at[..., :t], -1, mover_rank), own)  # every mover has a hole
        buffer.fill(dest, n_keep, n_keep)
        new_slots = slots.clone().scatter_(-1, dest, slots[..., n_keep:].clone())[..., :n_keep]
        new_valid = keep.clone().scatter_(-1, dest, movers)[..., :n_keep]
        return new_slots, new_valid






@dataclass
class PolicySession:
    """The installed policy of one model: runners per layer and what they decided."""

    model: torch.nn.Module
    policy: KVPolicy
    runners: Dict[int, LayerRunner] = field(default_factory=dict)
    first_layer: int = 0
    decisions: List[Dict[str, Any]] = field(default_factory=list)
    keep_log: bool = False
    record_prefill: bool = False
    prefill_sums: bool = False
    prefill_observations: Dict[int, KVObservation] = field(default_factory=dict)
    pending: List[Tuple["LayerRunner", KVObservation, KVPolicy, torch.Tensor]] = field(default_factory=list)

    @property
    def last_layer(self) -> int:
        """The last layer a forward step calls (where deferred decisions are made)."""
        return max(self.runners) if self.runners else -1

    def defer(self, runner: "LayerRunner", obs: KVObservation, policy: KVPolicy, capacity: torch.Tensor) -> None:
        """Hold a layer's decode-step decision until :meth:`flush` (see :meth:`LayerRunner._deferrable`)."""
        self.pending.append((runner, obs, policy, capacity))

    def flush(self) -> None:
        """Make the held decisions: layers whose views have one shape and one policy are decided together (one
        set of tensor ops over ``[L * B, Hk, N]`` instead of one set per layer), then each layer applies its
        own."""
        pending, self.pending = self.pending, []
        groups: Dict[Any, List[Tuple["LayerRunner", KVObservation, KVPolicy, torch.Tensor]]] = {}
        for item in pending:
            groups.setdefault((id(item[2]), tuple(item[1].valid.shape)), []).append(item)
        for items in groups.values():
            policy = items[0][2]
            b, hk, n = items[0][1].valid.shape
            scores = torch.stack([r.scorers[0].score(o).float() for r, o, _, _ in items]).view(-1, hk, n)
            valid = torch.stack([o.valid for _, o, _, _ in items]).view(-1, hk, n)
            slots = torch.stack([o.slots for _, o, _, _ in items]).view(-1, hk, n)
            capacity = torch.stack([c.to(valid.device).expand(b, hk) for _, _, _, c in items]).view(-1, hk)
            keep = policy.keep_mask(scores, valid, slots, capacity).view(len(items), b, hk, n) & valid.view(
                len(items), b, hk, n)
            if not self._finish_decode_steps(items, keep, slots.view(len(items), b, hk, n)):
                for (runner, obs, _, _), k in zip(items, keep):
                    runner.finish(obs, k)

    def _finish_decode_steps(self, items, keep: torch.Tensor, slots: torch.Tensor) -> bool:
        """Apply ``keep [L, B, Hk, N]`` to the ``L`` layers of ``items`` at once when every layer drops exactly
        the one entry a decode step added beyond its budget (the common case): the bookkeeping of
        :meth:`LayerRunner._fill_holes` runs once over ``[L, B, Hk, N]`` and each layer only moves its new entry
        into its hole. False (nothing done) when some layer needs the general path."""
        n = keep.shape[-1]
        n_keep = keep.sum(-1).flatten(1).amax(-1)  # [L]
        if n < 2 or bool((n_keep != n - 1).any()):
            return False
        runners = [r for r, _, _, _ in items]
        if not all(r._in_place() and r.cache is not None and hasattr(r.cache, "layers") for r in runners):
            return False
        if any(r.policy.compensator is not None or r.policy.action is not Action.EVICT for r in runners):
            return False
        m = n - 1
        movers = keep[..., m:]  # [L, B, Hk, 1]
        head = keep[..., :m]
        first = (~head).to(torch.uint8).argmax(-1, keepdim=True)  # the first hole of each head
        dest = torch.where(movers, first, torch.full_like(first, m))
        new_slots = slots[..., :m].scatter(-1, first, torch.where(movers, slots[..., m:], slots[..., :m].gather(-1, first)))
        new_valid = head.scatter(-1, first, head.gather(-1, first) | movers)
        for i, (runner, obs, _, _) in enumerate(items):
            self.record(runner.layer, obs.phase, keep[i], obs.valid)
            as_slot_buffer(runner.cache, runner.layer).fill(dest[i], m, m)
            runner.state.slots, runner.state.valid = new_slots[i], new_valid[i]
        return True

    def replay_prefill(self, observations: Dict[int, KVObservation], cache: Any) -> None:
        """Compress a prefill that ran earlier under another policy (typically a no-op one installed with
        ``record_prefill=True``): every layer's cache is reset to the recorded full keys and values and this
        policy acts as it would have at the end of that prefill. Prefill once, compress many ways (the
        recorded tensors are never modified, and lazily computed statistics are shared). ``cache`` is the
        transformers cache the prefill filled; its later calls run under this policy."""
        missing = sorted(set(self.runners) - set(observations))
        if missing:
            raise ValueError(f"replay_prefill: no recorded observation for layers {missing} (record the prefill with "
                             f"install_policy(..., record_prefill=True) on the same model)")
        for layer, runner in self.runners.items():
            obs = observations[layer]
            if obs.phase != "prefill":
                raise ValueError(f"replay_prefill: layer {layer} recorded a {obs.phase!r} call, not a prefill")
            runner.replay_prefill(obs, cache)

    def record(self, layer: int, phase: str, keep: torch.Tensor, valid: torch.Tensor) -> None:
        if self.keep_log:
            total = int(valid.sum())
            self.decisions.append({"layer": layer, "phase": phase, "kept": int((keep & valid).sum()),
                                   "valid": total})

    def rollback(self, removed: torch.Tensor) -> None:
        """Per-row rollback (:meth:`~lightning_modules.llm.runtime.cached_lm.CachedLM.rollback`): the stream columns
        ``removed [B, S]`` are no longer read in any layer."""
        for runner in self.runners.values():
            runner.rollback(removed)

    def kept_fraction(self) -> float:
        """Kept / valid over every decision recorded (``keep_log=True``)."""
        valid = sum(d["valid"] for d in self.decisions)
        return sum(d["kept"] for d in self.decisions) / valid if valid else math.nan

    def recompute_sets(self) -> Dict[int, torch.Tensor]:
        """Per layer, the entries ``[B, Hk, N]`` (over the cache view) that the last ``recompute`` decision
        selected for recomputation by a driver."""
        return {i: r.state.recompute for i, r in self.runners.items() if r.state.recompute is not None}


@contextlib.contextmanager
def install_policy(model: torch.nn.Module, policy: KVPolicy, keep_log: bool = False,
                   record_prefill: bool = False, prefill_sums: bool = False) -> Iterator[PolicySession]:
    """Run ``model`` under ``policy`` inside the block; hooks, attributes and the attention implementation
    are restored on exit, whatever happens. ``record_prefill`` keeps each layer's prefill observation
    (queries, full keys/values, outputs) in ``session.prefill_observations`` for
    :meth:`PolicySession.replay_prefill`; ``prefill_sums`` also computes every prefill query's attention column
    sums inside the prefill's attention call (where a fused path exists), so that a replayed H2O needs no
    second pass."""
    if active_session(model) is not None:
        raise RuntimeError("a KV-cache policy is already installed on this model; remove it first (one policy at "
                           "a time; compose scorers inside one policy instead)")
    modules = attention_modules(model)
    session = PolicySession(model=model, policy=policy, first_layer=modules[0].layer_idx if modules else 0,
                            keep_log=keep_log, record_prefill=record_prefill, prefill_sums=prefill_sums)
    handles = []

    def make_runner(module: torch.nn.Module) -> LayerRunner:
        runner = LayerRunner(module.layer_idx, policy, session)
        session.runners[module.layer_idx] = runner

        def grab_cache(mod, args, kwargs):
            if session.pending and any(item[0] is runner for item in session.pending):
                session.flush()  # a step that ended before its last layer: decide before the cache grows again
            runner.cache = kwargs.get("cache", kwargs.get("past_key_values"))
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            runner.hidden = hidden if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None

        handles.append(module.register_forward_pre_hook(grab_cache, with_kwargs=True))
        return runner

    try:
        with attach_runners(model, make_runner, "a KV policy", role="policy"):
            setattr(model, SESSION_ATTR, session)
            yield session
    finally:
        for h in handles:
            h.remove()
        if getattr(model, SESSION_ATTR, None) is session:
            delattr(model, SESSION_ATTR)
        for r in session.runners.values():
            r.cache = None

