"""The dialogue memory: compressed states in slots, and the gradient-free policy that routes turns to them.

A state is the per-layer KV of ``m`` compression tokens, ``keys`` / ``values`` ``[L, Hk, m, d]``, with the keys'
RoPE at the canonical positions ``0 .. m - 1`` (the model re-rotates them to wherever a turn lays them out). A
:class:`Slot` adds its thread key (a unit vector ``[e]``) and its bookkeeping.

:class:`SlotMemory` serves the three compressing arms:

* ``cdic`` - at most K slots. :meth:`SlotMemory.plan` scores the turn's query against every live key, reads the
  top ``r``, and writes the best one when its similarity reaches ``tau`` (a revision); otherwise it opens a new
  thread in a free slot, or makes room by the eviction rule (LRU, least used, or averaging the two most similar
  slots). Optionally, read slots close to the written one are merged into it.
* ``concat`` - one new slot per turn, never rewritten; every slot is read.
* ``merge`` - one slot holding the running mean of the per-turn states (``a_t = 1 / t``).

No decision here takes a gradient. The truncation rule lives in :meth:`SlotMemory.read`: every state knows the
earliest turn its graph reaches (``root``: the turn that wrote it, or earlier when it was computed from states
read with their graphs), and a turn ``t`` reads a state with its graph only when ``root >= t - k2``. So the
gradient of turn ``t``'s loss runs through at most ``k2`` turns of state recurrence, along the slots actually
read; a state whose graph reaches further back is read detached (a graph cannot be cut partway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

__all__ = ["Slot", "Plan", "SlotMemory"]


@dataclass
class Slot:
    """One compressed state.

    Attributes:
        keys, values: ``[L, Hk, m, d]`` (keys at canonical positions ``0 .. m - 1``).
        key: the thread key ``[e]`` (unit norm).
        thread: the data's thread label of the turn that opened it (reports and oracle routing).
        written_at: the turn that last wrote it; created_at: the turn that opened it.
        last_used: the last turn that read or wrote it; uses: reads + writes; writes: writes.
        root: the earliest turn the state's graph reaches (None: no graph, e.g. after a window boundary).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key: torch.Tensor
    thread: Optional[str]
    written_at: int
    created_at: int
    last_used: int
    uses: int = 1
    writes: int = 1
    root: Optional[int] = None


@dataclass
class Plan:
    """One turn's memory decisions.

    Attributes:
        read: slot indices the turn reads, in layout order (oldest write first).
        write: the slot the turn's new state goes to.
        opened: the write opens a new thread (no previous state in ``write``).
        evicted: a slot whose state was dropped to make room (None: none).
        merged: slots folded into ``write`` and freed after the write.
        score: the best key similarity (None: no live slot).
        root: set by :meth:`SlotMemory.read`: the earliest root among the states read with their graphs (None:
            none was).
    """

    read: List[int]
    write: int
    opened: bool
    evicted: Optional[int] = None
    merged: List[int] = field(default_factory=list)
    score: Optional[float] = None
    root: Optional[int] = None


class SlotMemory:
    """See the module docstring. ``kind`` is ``cdic``, ``concat`` or ``merge``."""

    def __init__(self, kind: str, slots: int, read_slots: int, open_threshold: float, routing: str = "retrieval",
                 evict: str = "lru", key_update: str = "mean", merge_threshold: Optional[float] = None) -> None:
        if kind not in ("cdic", "concat", "merge"):
            raise ValueError(f"SlotMemory: kind={kind!r} is not one of cdic, concat, merge")
        self.kind = kind
        self.capacity = slots if kind == "cdic" else (1 if kind == "merge" else None)
        self.read_slots = read_slots
        self.open_threshold = float(open_threshold)
        self.routing = routing
        self.evict = evict
        self.key_update = key_update
        self.merge_threshold = merge_threshold
        self.slots: List[Optional[Slot]] = []

    # ------------------------------------------------------------------ views
    @property
    def live(self) -> List[int]:
        return [i for i, s in enumerate(self.slots) if s is not None]

    def tokens(self) -> int:
        """KV tokens held per layer (live slots x m)."""
        return sum(s.keys.shape[2] for s in self.slots if s is not None)

    def _similarities(self, query: torch.Tensor) -> torch.Tensor:
        live = self.live
        if not live:
            return torch.zeros(0)
        return torch.stack([self.slots[i].key for i in live]) @ query

    # ------------------------------------------------------------------ the policy
    def plan(self, query: torch.Tensor, thread: Optional[str], turn: int) -> Plan:
        """Decide what turn ``turn`` (query ``[e]``, unit norm; ``thread``: the data's label) reads and writes."""
        live = self.live
        sims = self._similarities(query)
        score = float(sims.max()) if len(live) else None
        if self.kind == "concat":
            return Plan(read=self._layout(live), write=len(self.slots), opened=True, score=score)
        if self.kind == "merge":
            return Plan(read=list(live), write=0, opened=not live, score=score)
        order = [live[j] for j in torch.argsort(sims, descending=True, stable=True).tolist()]
        if self.routing == "oracle":
            match = [i for i in live if thread is not None and self.slots[i].thread == thread]
            best = match[0] if match else None
        else:
            best = order[0] if order and score is not None and score >= self.open_threshold else None
        read = ([best] if best is not None else []) + [i for i in order if i != best]
        read = read[:self.read_slots]
        if best is not None:
            merged = []
            if self.merge_threshold is not None:
                merged = [i for i in read if i != best
                          and float(self.slots[i].key @ self.slots[best].key) >= self.merge_threshold]
            return Plan(read=self._layout(read), write=best, opened=False, merged=merged, score=score)
        free = [i for i, s in enumerate(self.slots) if s is None]
        if free:
            return Plan(read=self._layout(read), write=free[0], opened=True, score=score)
        if len(self.slots) < self.capacity:
            return Plan(read=self._layout(read), write=len(self.slots), opened=True, score=score)
        target, evicted = self._make_room(turn)
        read = [i for i in order if i != target and self.slots[i] is not None][:self.read_slots]
        return Plan(read=self._layout(read), write=target, opened=True, evicted=evicted, score=score)

    def _layout(self, indices: List[int]) -> List[int]:
        return sorted(indices, key=lambda i: (self.slots[i].written_at, i))

    def _make_room(self, turn: int) -> Tuple[int, int]:
        """``(slot to write, slot whose state was dropped)`` when every slot is live."""
        live = self.live
        if self.evict == "lru":
            victim = min(live, key=lambda i: (self.slots[i].last_used, i))
            return victim, victim
        if self.evict == "least_used":
            victim = min(live, key=lambda i: (self.slots[i].uses, self.slots[i].last_used, i))
            return victim, victim
        keys = torch.stack([self.slots[i].key for i in live])
        sims = keys @ keys.t()
        sims.fill_diagonal_(-float("inf"))
        flat = int(torch.argmax(sims))
        a, b = live[flat // len(live)], live[flat % len(live)]
        keep, drop = (a, b) if self.slots[a].written_at >= self.slots[b].written_at else (b, a)
        self._fold(keep, [drop])
        return drop, drop

    def _fold(self, keep: int, others: List[int]) -> None:
        """Average ``others`` into slot ``keep`` (states and keys, weighted by writes) and free them."""
        group = [self.slots[keep]] + [self.slots[i] for i in others]
        w = torch.tensor([float(s.writes) for s in group])
        w = w / w.sum()
        s = self.slots[keep]
        s.keys = sum(wi * g.keys for wi, g in zip(w.tolist(), group))
        s.values = sum(wi * g.values for wi, g in zip(w.tolist(), group))
        s.key = _unit(sum(wi * g.key for wi, g in zip(w.tolist(), group)))
        s.writes = sum(g.writes for g in group)
        s.uses = sum(g.uses for g in group)
        s.written_at = max(g.written_at for g in group)
        roots = [g.root for g in group if g.root is not None]
        s.root = min(roots) if roots else None
        for i in others:
            self.slots[i] = None

    # ------------------------------------------------------------------ reading and writing
    def read(self, plan: Plan, turn: int, k2: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The read slots' ``(keys, values)`` in layout order. A state whose graph reaches back further than
        ``turn - k2`` comes back detached (the truncation of backpropagation through the memory); ``plan.root``
        records the earliest root among those read with their graphs."""
        out = []
        for i in plan.read:
            s = self.slots[i]
            s.last_used, s.uses = turn, s.uses + 1
            if s.root is not None and s.root >= turn - k2:
                out.append((s.keys, s.values))
                plan.root = s.root if plan.root is None else min(plan.root, s.root)
            else:
                out.append((s.keys.detach(), s.values.detach()))
        return out

    def write(self, plan: Plan, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
              thread: Optional[str], turn: int, k2: int, gate: Optional[torch.Tensor] = None,
              root: Optional[int] = None) -> None:
        """Write the new state ``keys`` / ``values`` ``[L, Hk, m, d]`` into ``plan.write``; ``root`` is the earliest
        turn its graph reaches (default: ``turn``, or ``plan.root`` when earlier).

        ``cdic``: overwrite, or with ``gate`` ``[L, Hk]`` in (0, 1) ``g S' + (1 - g) S``; ``merge``: the running
        mean ``(1 - 1/t) S + (1/t) S'`` over its ``t`` writes; ``concat``: a new slot. Only ``plan.write`` (and the
        slots ``plan.merged`` frees) change."""
        if root is None:
            root = turn if plan.root is None else min(turn, plan.root)
        if not keys.requires_grad and not values.requires_grad:
            root = None
        if plan.write == len(self.slots):
            self.slots.append(None)
        old = self.slots[plan.write]
        if old is None or plan.opened:
            self.slots[plan.write] = Slot(keys=keys, values=values, key=_unit(query), thread=thread,
                                          written_at=turn, created_at=turn, last_used=turn, root=root)
            return
        if old.root is not None and old.root >= turn - k2:
            prev_k, prev_v = old.keys, old.values
            root = old.root if root is None else min(root, old.root)
        else:
            prev_k, prev_v = old.keys.detach(), old.values.detach()
        if self.kind == "merge":
            a = 1.0 / (old.writes + 1)
            keys, values = (1 - a) * prev_k + a * keys, (1 - a) * prev_v + a * values
        elif gate is not None:
            g = gate.to(keys.dtype)[:, :, None, None]
            keys, values = g * keys + (1 - g) * prev_k, g * values + (1 - g) * prev_v
        old.keys, old.values, old.root = keys, values, root
        old.key = _unit(query) if self.key_update == "latest" else _unit(old.key * old.writes + query)
        old.written_at, old.last_used = turn, turn
        old.writes, old.uses = old.writes + 1, old.uses + 1
        if plan.merged:
            self._fold(plan.write, plan.merged)
            old.written_at = turn

    def detach_(self) -> None:
        """Cut every state from its graph (a window boundary)."""
        for s in self.slots:
            if s is not None:
                s.keys, s.values, s.root = s.keys.detach(), s.values.detach(), None


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm().clamp_min(1e-12)
