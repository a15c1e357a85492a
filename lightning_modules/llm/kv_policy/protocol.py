"""The KV-cache policy protocol: scorer -> selector -> action (+ optional compensator), under a budget and a
schedule.

A policy decides, per layer and per KV head, which cache entries stay readable. Its parts:

* :class:`Scorer` - reads a :class:`KVObservation` (what it declares in ``requires``) and returns scores
  ``[B, Hk, N]``, higher = keep; ``update`` accumulates state at every attention call (H2O-style) and
  ``reset`` clears it when a new sequence starts.
* :class:`Budget` - how many entries each KV head keeps: absolute (``keep``) or as a compression ratio, scaled
  per layer and per head; the ``sink`` first and ``window`` most recent entries are protected and counted
  **inside** the budget.
* :class:`Selector` - scores + capacities + protected set -> a keep mask ``[B, Hk, N]`` (per-head top-k, or one
  layer-shared set).
* :class:`Action` - what happens to the rest: ``evict`` (physically removed from the cache: memory saved),
  ``mask`` (kept in memory, never read again), ``sparse_read`` (read only for this step; the cache stays
  whole), ``recompute`` (handed to a driver that recomputes them).
* :class:`Compensator` - optional: receives evicted entries (``write``) and adds its own attention part at
  every later call: merged by log-sum-exp (``read``) or added as a residual before ``o_proj``
  (``read_residual``, ``merge = "residual"``).
* :class:`Schedule` - when the policy acts: once after the first prefill, every N decode steps, or (sparse
  reads) before every decode step.

:func:`lightning_modules.llm.kv_policy.runner.install_policy` runs a policy inside the ``litctx`` attention function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, FrozenSet, List, Optional, Protocol, Tuple, runtime_checkable

import torch

import litctx_kernels

_MOMENTS = ("attention", "output", "logit")
COMPACTIONS = ("inplace", "gather")
_FLOOR_SLACK = 1e-9  # capacities are floor(x + slack): 1000 * (1 - 0.8) is 199.99999999999997 in floats

__all__ = [
    "Action",
    "Budget",
    "Schedule",
    "KVObservation",
    "Scorer",
    "RecentScorer",
    "RandomScorer",
    "Selector",
    "TopKSelector",
    "SharedTopKSelector",
    "top_capacity",
    "Compensator",
    "compensator_merge",
    "OffloadCompensator",
    "KVPolicy",
    "PolicyBatch",
    "protected_mask",
    "SCORERS",
    "SELECTORS",
]


class Action(str, Enum):
    """What happens to the entries a policy does not keep."""

    EVICT = "evict"
    MASK = "mask"
    SPARSE_READ = "sparse_read"
    RECOMPUTE = "recompute"


@dataclass
class Budget:
    """Entries kept per KV head.

    Attributes:
        keep: absolute capacity per KV head (before scaling), or ``None``.
        compression_ratio: fraction of a head's valid entries removed (kvpress convention): capacity
            ``floor(n * (1 - ratio))``. Exactly one of ``keep`` and ``compression_ratio`` is set, or neither
            (unlimited: the policy never removes anything).
        sink: the first ``sink`` entries of each sequence are protected (inside the budget).
        window: the ``window`` most recent entries are protected (inside the budget).
        window_fraction: protect at least this fraction of each head's capacity as recent entries (H2O's
            heavy/recent split: 0.5 keeps half heavy hitters, half recent tokens).

    A ratio is resolved once per sequence, against the valid entries at the policy's first decision (the
    prompt length); later decisions (decode steps, appends) keep that absolute capacity, so a cache evicted
    at every step stays at its budget instead of shrinking by the ratio again.
        layer_scale: optional per-layer multipliers of the capacity (PyramidKV-style curves).
        head_scale: optional per-KV-head multipliers, one list shared by all layers or one list per layer.
        aux_tokens: token equivalents per KV head held by the policy's compensator state (IndexMem's latent
            memory): they count against the budget, so the cache keeps ``capacity - aux_tokens`` entries (at least
            one) and the policy's total memory equals a plain policy's at the same ``keep`` / ratio.
    """

    keep: Optional[int] = None
    compression_ratio: Optional[float] = None
    sink: int = 0
    window: int = 0
    window_fraction: float = 0.0
    layer_scale: Optional[List[float]] = None
    head_scale: Optional[List[Any]] = None
    aux_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.aux_tokens, bool) or not isinstance(self.aux_tokens, int) or self.aux_tokens < 0:
            raise ValueError(f"budget.aux_tokens must be an integer >= 0, got {self.aux_tokens!r}")
        if self.keep is not None and self.compression_ratio is not None:
            raise ValueError("budget: set either keep or compression_ratio, not both")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"budget.keep must be >= 1, got {self.keep}")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"budget.compression_ratio must be in [0, 1), got {self.compression_ratio}")
        if self.sink < 0 or self.window < 0:
            raise ValueError(f"budget.sink and budget.window must be >= 0, got {self.sink}, {self.window}")
        if not 0.0 <= self.window_fraction <= 1.0:
            raise ValueError(f"budget.window_fraction must be in [0, 1], got {self.window_fraction}")
        if self.layer_scale is not None and any(s <= 0 for s in self.layer_scale):
            raise ValueError(f"budget.layer_scale entries must be > 0, got {self.layer_scale}")

    @property
    def unlimited(self) -> bool:
        return self.keep is None and self.compression_ratio is None

    def keep_for(self, n: int) -> int:
        """The unscaled capacity for a sequence of ``n`` valid entries (``keep``, or ``floor(n * (1 - ratio))``;
        ``n`` when unlimited), rounded as :meth:`capacity` rounds; before ``aux_tokens`` and the scales, and not
        capped at ``n``."""
        if self.unlimited:
            return int(n)
        if self.keep is not None:
            return int(self.keep)
        return max(1, math.floor(n * (1.0 - self.compression_ratio) + _FLOOR_SLACK))

    def tag(self) -> str:
        """Short label for names and records, e.g. ``r0.75`` or ``keep64+sink4``."""
        core = "full" if self.unlimited else (f"keep{self.keep}" if self.keep is not None
                                              else f"r{self.compression_ratio:g}")
        extra = [f"sink{self.sink}"] * bool(self.sink) + [f"win{self.window}"] * bool(self.window)
        extra += [f"aux{self.aux_tokens}"] * bool(self.aux_tokens)
        return "+".join([core, *extra])

    def _head_scale(self, layer: int, n_heads: int) -> List[float]:
        if self.head_scale is None:
            return [1.0] * n_heads
        scale = self.head_scale
        if scale and not isinstance(scale[0], (int, float)):
            if layer >= len(scale):
                raise ValueError(f"budget.head_scale has {len(scale)} layer rows; layer {layer} has none")
            scale = scale[layer]
        if len(scale) != n_heads:
            raise ValueError(f"budget.head_scale needs {n_heads} entries (one per KV head), got {len(scale)}")
        return [float(s) for s in scale]

    def capacity(self, n_valid: torch.Tensor, layer: int, n_heads: int) -> torch.Tensor:
        """Capacity ``[B, Hk]`` (long) for ``n_valid [B, Hk]`` valid entries; never above ``n_valid``."""
        n = n_valid.to(torch.float64)
        if self.unlimited:
            return n_valid.long()
        base = torch.full_like(n, float(self.keep)) if self.keep is not None else n * (1.0 - self.compression_ratio)
        if self.layer_scale is not None:
            if layer >= len(self.layer_scale):
                raise ValueError(f"budget.layer_scale has {len(self.layer_scale)} entries; layer {layer} has none")
            base = base * self.layer_scale[layer]
        base = base * torch.tensor(self._head_scale(layer, n_heads), dtype=torch.float64, device=n.device)
        cap = (torch.floor(base + _FLOOR_SLACK).long() - int(self.aux_tokens)).clamp_min(1)
        return torch.minimum(cap, n_valid.long())


@dataclass
class Schedule:
    """When a policy acts.

    Attributes:
        prefill: act once, right after the attention of the first prefill (the cache was empty): kvpress's
            query-agnostic protocol when the prefill holds only the context.
        decode_every: act after every ``decode_every``-th decode step (0 = never); H2O/TOVA use 1.
        append: also act after later multi-token calls on a non-empty cache (e.g. an appended question).
        compaction: how an ``evict`` policy that acts during decoding removes entries: ``inplace`` (the layer's
            cache becomes a :class:`~lightning_modules.llm.runtime.slot_buffer.SlotBufferLayer`; new tokens are written
            into spare room and the few entries past the new length move into the dropped entries' places, so a
            step copies ``O(d)`` numbers, not the cache) or ``gather`` (the kept entries are gathered into a new
            cache at every decision, in stream order). Both keep the same entries (tested); ``docs/results.md``
            has the measured difference.
    """

    prefill: bool = True
    decode_every: int = 0
    append: bool = False
    compaction: str = "inplace"

    def __post_init__(self) -> None:
        if self.decode_every < 0:
            raise ValueError(f"schedule.decode_every must be >= 0, got {self.decode_every}")
        if self.compaction not in COMPACTIONS:
            raise ValueError(f"schedule.compaction={self.compaction!r}: valid values are {', '.join(COMPACTIONS)}")


def protected_mask(valid: torch.Tensor, sink: int, window: Any, capacity: torch.Tensor,
                   slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Entries protected by the budget: the first ``sink`` and last ``window`` valid entries of each
    ``[B, Hk]`` row, trimmed so they fit ``capacity`` (sinks first). ``window`` is an int or a ``[B, Hk]``
    tensor. Order is the entries' order in the row, or, with ``slots [B, Hk, N]`` (each entry's place in the
    token stream, distinct per row), the slots' order: the same thing for a cache in stream order, and the
    right one for a cache whose entries moved (in-place eviction)."""
    sink_eff = torch.clamp(capacity, max=sink).unsqueeze(-1)
    window = window.unsqueeze(-1) if isinstance(window, torch.Tensor) else window
    window_eff = torch.minimum(torch.clamp(capacity.unsqueeze(-1) - sink_eff, min=0),
                               torch.as_tensor(window, device=valid.device))
    if slots is not None and valid.numel():
        bounds = torch.stack([sink_eff.min(), sink_eff.max(), window_eff.min(), window_eff.max()]).tolist()
        if bounds[0] == bounds[1] and bounds[2] == bounds[3]:  # one sink and one window size for every row
            return valid & _slot_ends(valid, slots.long(), int(bounds[0]), int(bounds[2]))
    if slots is None:
        rank = valid.long().cumsum(-1) - 1  # position among the valid entries
    else:
        s = slots.long()
        alive = torch.zeros(*s.shape[:-1], int(s.max()) + 1 if s.numel() else 0, dtype=torch.long,
                            device=s.device).scatter_add_(-1, s, valid.long())
        rank = torch.gather(alive.cumsum(-1), -1, s) - 1  # valid entries with a smaller or equal slot, minus one
    count = valid.long().sum(-1, keepdim=True)
    from_end = count - 1 - rank
    return valid & ((rank < sink_eff) | (from_end < window_eff))


def _slot_ends(valid: torch.Tensor, slots: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """The ``sink`` valid entries with the smallest slots and the ``window`` with the largest, per row of
    ``valid, slots [..., N]`` (slots distinct per row): thresholds from two order statistics, ``O(N)`` per row."""
    n = slots.shape[-1]
    out = torch.zeros_like(valid)
    if sink > 0:
        big = torch.full_like(slots, torch.iinfo(torch.long).max)
        k = min(sink, n)
        out |= slots <= torch.kthvalue(torch.where(valid, slots, big), k, dim=-1, keepdim=True).values
    if window > 0:
        k = max(n - window + 1, 1)
        out |= slots >= torch.kthvalue(torch.where(valid, slots, torch.full_like(slots, -1)), k, dim=-1,
                                       keepdim=True).values
    return out


@dataclass
class KVObservation:
    """What a policy may read at one attention call of one layer.

    Attributes:
        layer: layer index.
        phase: ``prefill`` (first call, empty cache), ``append`` (more tokens on a non-empty cache) or
            ``decode`` (one token).
        q: queries ``[B, Hq, Nq, d]`` after RoPE (the last ``Nq`` positions of the cache view).
        k, v: the cache view ``[B, Hk, N, d]`` (this step's entries included, last).
        slots: ``[B, Hk, N]`` index of each entry in the uncompressed token stream.
        valid: ``[B, Hk, N]`` entries that may be read (not padding, not masked).
        scale: the softmax scale.
        out, lse: this call's attention output ``[B, Hq, Nq, dv]`` and LSE ``[B, Hq, Nq]`` (None before the
            attention ran, i.e. for sparse reads).
        window: the layer's sliding window (None: full attention). On such a layer ``valid`` already excludes
            the entries the next query cannot see; for every remaining entry the window is implied by causality
            for all of this call's queries, so statistics over ``valid`` need no window of their own.
        hidden: the attention module's input hidden states of this call ``[B, Nq, D]`` (after the layer's input
            norm; learned scorers such as IndexMem's indexer read them); None when the caller had none.
    """

    layer: int
    phase: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    scale: float
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    window: Optional[int] = None
    hidden: Optional[torch.Tensor] = None
    _cache: Dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def row(self, b: int) -> "KVObservation":
        """The observation of batch row ``b`` alone (tensors ``[1, ...]``; nothing cached is shared)."""
        sl = slice(b, b + 1)
        return KVObservation(self.layer, self.phase, self.q[sl], self.k[sl], self.v[sl], self.slots[sl],
                             self.valid[sl], self.scale, None if self.out is None else self.out[sl],
                             None if self.lse is None else self.lse[sl], self.window,
                             None if self.hidden is None else self.hidden[sl])

    def _key_mask(self) -> Optional[torch.Tensor]:
        return None if bool(self.valid.all()) else self.valid

    def window_logits(self, window: int) -> torch.Tensor:
        """Scaled logits ``[B, Hq, w, N]`` of the last ``w`` queries (masked entries and the causal future at
        ``-inf``); ``w = min(window, Nq)``."""
        key = ("logits", window)
        if key not in self._cache:
            w = min(window, self.q.shape[2])
            qw = self.q[:, :, -w:].float()
            k = self.k.float().repeat_interleave(self.group, dim=1)
            s = torch.matmul(qw, k.transpose(-1, -2)) * self.scale
            n = self.k.shape[2]
            causal = torch.ones(w, n, dtype=torch.bool, device=s.device).tril(diagonal=n - w)
            live = causal & self.valid.repeat_interleave(self.group, dim=1).unsqueeze(-2)
            self._cache[key] = s.masked_fill(~live, float("-inf"))
        return self._cache[key]

    def window_probs(self, window: int) -> torch.Tensor:
        """Attention probabilities ``[B, Hq, w, N]`` of the last ``w`` queries (rows with no key are zero)."""
        key = ("probs", window)
        if key not in self._cache:
            s = self.window_logits(window)
            live = torch.isfinite(s).any(-1, keepdim=True)
            self._cache[key] = torch.softmax(torch.where(live, s, torch.zeros_like(s)), dim=-1) * live
        return self._cache[key]

    def colstats(self, window: Optional[int] = None, moments: str = "output") -> litctx_kernels.ColStats:
        """Per-key statistics (:class:`litctx_kernels.ColStats`, per query head ``[B, Hq, N(, dv)]``) of the last
        ``window`` queries (None = all of this call's queries) from :func:`litctx_kernels.attention_colstats`,
        without an N x N matrix; ``moments`` in ``attention | output | logit``. Masked entries are excluded.
        The call's own outputs and LSE are reused when the attention already ran."""
        w = self.q.shape[2] if window is None else min(int(window), self.q.shape[2])
        rank = _MOMENTS.index(moments) if moments in _MOMENTS else None
        if rank is None:
            raise ValueError(f"moments={moments!r}: valid values are {', '.join(_MOMENTS)}")
        for richer in _MOMENTS[rank:]:
            if ("colstats", w, richer) in self._cache:
                return self._cache[("colstats", w, richer)]
        o = lse = None
        if self.out is not None and self.lse is not None:
            o, lse = self.out[:, :, -w:], self.lse[:, :, -w:]
        stats = litctx_kernels.attention_colstats(self.q, self.k, self.v, scale=self.scale, causal=True, q_window=w, o=o,
                                           lse=lse, moments=moments, key_mask=self._key_mask())
        self._cache[("colstats", w, moments)] = stats
        return stats


@runtime_checkable
class Scorer(Protocol):
    """Scores ``[B, Hk, N]`` (higher = keep) from an observation."""

    requires: FrozenSet[str]

    def score(self, obs: KVObservation) -> torch.Tensor: ...

    def update(self, obs: KVObservation) -> None: ...

    def reset(self) -> None: ...

    # Optional: ``colstats_request(obs) -> (window, moments)`` names the column statistics the scorer will read
    # from ``obs``; a PolicyBatch replaying one prefill for many rows computes each window once with the richest
    # moments any row asks for.


class _StatelessScorer:
    requires: FrozenSet[str] = frozenset()

    def update(self, obs: KVObservation) -> None:
        return None

    def reset(self) -> None:
        return None


class RecentScorer(_StatelessScorer):
    """Keep the most recent entries (with ``Budget.sink`` this is StreamingLLM's rule)."""

    requires = frozenset({"slots"})

    def score(self, obs: KVObservation) -> torch.Tensor:
        return obs.slots.to(torch.float32)


class RandomScorer(_StatelessScorer):
    """Uniform random scores (a control); seeded per (layer, call) so runs repeat."""

    requires = frozenset()

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self._calls = 0

    def score(self, obs: KVObservation) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + obs.layer * 7919 + self._calls)
        self._calls += 1
        return torch.rand(obs.slots.shape, generator=gen).to(obs.slots.device)

    def reset(self) -> None:
        self._calls = 0


class Selector(Protocol):
    """Scores ``[B, Hk, N]``, capacities ``[B, Hk]``, protected and valid masks ``[B, Hk, N]`` -> keep mask;
    ``slots [B, Hk, N]`` (each entry's place in the token stream) order entries whose places moved (in-place
    eviction) for tie-breaking; None: positions."""

    def select(self, scores: torch.Tensor, capacity: torch.Tensor, protected: torch.Tensor,
               valid: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor: ...


FEW_DROPS = 4
""":func:`top_capacity` removes up to this many entries per row by repeated minima (a decode step's eviction)
instead of sorting the row."""


def top_capacity(scores: torch.Tensor, capacity: torch.Tensor, protected: torch.Tensor,
                 valid: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keep mask ``[..., N]``: per row of ``scores [..., N]``, the ``capacity [...]`` highest-scoring valid entries,
    protected entries ranked first, ties broken by position (or by ``slots [..., N]``, each entry's place in the
    token stream: the same for a cache in stream order), earlier first. The one top-k rule of every selector.

    With ``slots``, a row that drops at most :data:`FEW_DROPS` entries drops its lowest-scoring unprotected valid
    entries one minimum at a time (the latest slot among ties), which is the same set without a sort."""
    n_valid = valid.sum(-1)
    drop = (n_valid - capacity).clamp_min(0)
    if slots is not None:
        most = int(drop.max()) if drop.numel() else 0
        if most == 0:
            return valid.clone()
        if most <= FEW_DROPS and bool(((valid & protected).sum(-1) <= capacity).all()):
            return _drop_minima(scores, drop, protected, valid, slots, most)
        if not bool((slots.diff(dim=-1) > 0).all()):  # moved entries: rank by slot, then by score
            by_slot = torch.argsort(slots, dim=-1, stable=True)
            keep = top_capacity(torch.gather(scores, -1, by_slot), capacity, torch.gather(protected, -1, by_slot),
                                torch.gather(valid, -1, by_slot))
            return torch.empty_like(keep).scatter_(-1, by_slot, keep)
    s = scores.float().masked_fill(~valid, float("-inf"))
    s = torch.where(protected, torch.full_like(s, float("inf")), s)
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return valid & (ranks < capacity.unsqueeze(-1))


def _drop_minima(scores: torch.Tensor, drop: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor,
                 slots: torch.Tensor, most: int) -> torch.Tensor:
    """``valid`` less, per row, its ``drop [...]`` lowest-scoring unprotected entries (ties: the latest slot
    first), removed one minimum at a time (``most`` rounds): the entries a stable descending sort ranks last."""
    keep = valid.clone()
    rest = scores.float().masked_fill(~(valid & ~protected), float("inf"))
    free = valid & ~protected
    late = torch.where(free, slots.long(), torch.full_like(slots, -1, dtype=torch.long))
    for i in range(most):
        low = rest.min(-1, keepdim=True).values
        pick = torch.where((rest == low) & free, late, torch.full_like(late, -1)).argmax(-1, keepdim=True)
        due = (drop > i).unsqueeze(-1)
        keep.scatter_(-1, pick, torch.gather(keep, -1, pick) & ~due)
        free = free.scatter(-1, pick, torch.gather(free, -1, pick) & ~due)
        rest = rest.scatter(-1, pick, torch.where(due, float("inf"), torch.gather(rest, -1, pick)))
    return keep


class TopKSelector:
    """Each KV head keeps its own top-``capacity`` entries (protected ones first)."""

    def select(self, scores, capacity, protected, valid, slots=None):
        return top_capacity(scores, capacity, protected, valid, slots)


class SharedTopKSelector:
    """One set per layer (TOVA-style): scores averaged over the KV heads, the smallest head capacity used. The
    heads hold the same entries at the same places (every decision is shared), so head 0's slots order them."""

    def select(self, scores, capacity, protected, valid, slots=None):
        live = valid.float()
        mean = (scores.float().masked_fill(~valid, 0.0) * live).sum(1, keepdim=True) / live.sum(1, keepdim=True).clamp_min(1)
        shared_valid = valid.any(1, keepdim=True)
        keep = top_capacity(mean, capacity.min(1, keepdim=True).values, protected.any(1, keepdim=True),
                             shared_valid, None if slots is None else slots[:, :1])
        return keep.expand_as(valid) & valid


@runtime_checkable
class Compensator(Protocol):
    """Holds what a policy evicted and contributes its own attention part at later calls.

    ``merge`` says how: ``"lse"`` (the default, and what an object without the attribute does) - ``read``
    returns ``(o, lse)`` of its own attention, merged with the cache's by log-sum-exp (:class:`OffloadCompensator`:
    exact); ``"residual"`` - ``read_residual(layer, q, scale, hidden)`` returns ``r [B, Hq, Nq, dv]`` (or None),
    added to the attention output before ``o_proj`` (IndexMem's gated latent-memory readout)."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              evicted: torch.Tensor) -> None:
        """``keys, values [B, Hk, N, d]`` of the cache view before eviction, ``evicted [B, Hk, N]``."""

    def read(self, layer: int, q: torch.Tensor, scale: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(o [B, Hq, Nq, dv], lse [B, Hq, Nq])`` for queries ``q [B, Hq, Nq, d]`` (None: nothing held)."""

    def reset(self) -> None: ...


def compensator_merge(comp: Any) -> str:
    """``"lse"`` or ``"residual"``: how ``comp``'s contribution joins the attention output."""
    merge = getattr(comp, "merge", "lse")
    if merge not in ("lse", "residual"):
        raise ValueError(f"compensator {type(comp).__name__}.merge={merge!r}: valid values are lse, residual")
    return merge


class OffloadCompensator:
    """Keeps every evicted entry (optionally on another device, e.g. CPU memory next to a GPU cache) and
    attends to it exactly at later calls: eviction plus this compensator reproduces the full cache. The
    reference point for learned compensators (IndexMem's latent memory), and KV offloading in its own right."""

    def __init__(self, device: Optional[str] = None) -> None:
        self.device = device
        self._store: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def write(self, layer, keys, values, slots, evicted):
        dev = self.device or keys.device
        k, v, m = keys.to(dev), values.to(dev), evicted.to(dev)
        if layer in self._store:
            k0, v0, m0 = self._store[layer]
            k, v, m = torch.cat([k0, k], 2), torch.cat([v0, v], 2), torch.cat([m0, m], 2)
        keep = m.any(dim=(0, 1))  # drop columns no row/head evicted
        self._store[layer] = (k[:, :, keep], v[:, :, keep], m[:, :, keep])

    def read(self, layer, q, scale):
        if layer not in self._store:
            return None
        k, v, m = (t.to(q.device) for t in self._store[layer])
        return litctx_kernels.attention(q, k, v, scale=scale, causal=False, key_mask=m)

    def held_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in self._store.values())

    def reset(self) -> None:
        self._store.clear()


SCORERS: Dict[str, Any] = {
    "recent": RecentScorer,
    "random": RandomScorer,
    "accumulated": "lightning_modules.kv_eviction.scorers:AccumulatedScorer",
    "window": "lightning_modules.kv_eviction.scorers:WindowScorer",
}
"""Scorer names usable from config (a plugin table, :mod:`litctx_common.plugins`): a class, or a ``module:Class``
string imported on first use (method packages list theirs here without being imported by this module)."""
SELECTORS: Dict[str, Any] = {
    "topk": TopKSelector,
    "shared_topk": SharedTopKSelector,
    "adakv": "lightning_modules.kv_eviction.selectors:AdaKVSelector",
}


@dataclass
class KVPolicy:
    """A scorer, selector, budget, action and schedule (and optional compensator); ``layers`` limits the
    layers it acts on (None = all). A policy with no scorer or an unlimited budget never changes anything."""

    scorer: Optional[Any] = None
    selector: Any = field(default_factory=TopKSelector)
    budget: Budget = field(default_factory=Budget)
    action: Action = Action.EVICT
    schedule: Schedule = field(default_factory=Schedule)
    compensator: Optional[Any] = None
    layers: Optional[List[int]] = None
    name: str = "policy"

    def __post_init__(self) -> None:
        self.action = Action(self.action)
        if self.compensator is not None and self.action is not Action.EVICT:
            raise ValueError(f"a compensator receives evicted entries; action must be 'evict', got "
                             f"{self.action.value!r}")
        if self.scorer is not None and not isinstance(self.scorer, Scorer):
            raise TypeError(f"scorer {type(self.scorer).__name__} lacks requires/score/update/reset")

    @property
    def is_noop(self) -> bool:
        return self.scorer is None or self.budget.unlimited

    def acts_on(self, layer: int) -> bool:
        return not self.is_noop and (self.layers is None or layer in self.layers)

    def decide(self, obs: KVObservation, scorer: Optional[Any] = None,
               capacity: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Keep mask ``[B, Hk, N]``: at most ``capacity`` valid entries per head, protected ones included.
        ``scorer`` overrides ``self.scorer`` (the installer passes each layer its own stateful copy);
        ``capacity [B, Hk]`` overrides the budget's (the runner passes the capacity fixed at the first
        decision of the sequence, see :class:`Budget`)."""
        scorer = scorer if scorer is not None else self.scorer
        if capacity is None:
            capacity = self.budget.capacity(obs.valid.sum(-1), obs.layer, obs.k.shape[1])
        scores = scorer.score(obs)
        if tuple(scores.shape) != tuple(obs.valid.shape):
            raise ValueError(f"scorer {type(scorer).__name__} returned {list(scores.shape)}; expected "
                             f"[B, Hk, N] = {list(obs.valid.shape)}")
        return self.keep_mask(scores, obs.valid, obs.slots, capacity)

    def keep_mask(self, scores: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor,
                  capacity: torch.Tensor) -> torch.Tensor:
        """The selection of :meth:`decide` from ``scores, valid, slots [R, Hk, N]`` and ``capacity [R, Hk]``
        (rows ``R`` may stack several layers' batches: the session decides a decode step's layers at once)."""
        capacity = torch.minimum(capacity.to(valid.device), valid.sum(-1))
        window = max(self.budget.window, 0)
        if self.budget.window_fraction > 0:
            window = torch.clamp(torch.floor(capacity.double() * self.budget.window_fraction).long(), min=window)
        protected = protected_mask(valid, self.budget.sink, window, capacity, slots)
        return self.selector.select(scores, capacity, protected, valid, slots=slots) & valid


@dataclass
class PolicyBatch:
    """One policy per batch row: row ``b`` of every attention call is served by ``policies[b]`` (its own
    scorer state, budget, selector and schedule). Evaluates several policies on copies of one sequence in a
    single batch, e.g. after one recorded prefill
    (:func:`~lightning_modules.llm.decoding.generate.generate_under_policies` with ``batched=True``).

    A batch of one policy serves every row (it broadcasts, like a size-1 tensor dimension): the installer
    normalises a single :class:`KVPolicy` to that form (:meth:`of`), so the runner has one code path. The
    policies of a batch of several must share one action, ``evict`` or ``mask``, and have no compensator."""

    policies: List[KVPolicy]
    name: str = "batch"

    @classmethod
    def of(cls, policy: Any) -> "PolicyBatch":
        """``policy`` itself if it is a batch, else the batch of one that serves every row with it."""
        return policy if isinstance(policy, PolicyBatch) else cls([policy], name=policy.name)

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("PolicyBatch needs at least one policy")
        if len(self.policies) == 1:
            return
        actions = {p.action for p in self.policies}
        if len(actions) != 1 or next(iter(actions)) not in (Action.EVICT, Action.MASK):
            raise ValueError(f"PolicyBatch policies must share the action evict or mask; got "
                             f"{sorted(a.value for a in actions)}")
        if any(p.compensator is not None for p in self.policies):
            raise ValueError("PolicyBatch does not take policies with a compensator")

    @property
    def action(self) -> Action:
        return self.policies[0].action

    @property
    def compensator(self) -> Optional[Any]:
        return self.policies[0].compensator if len(self.policies) == 1 else None

    @property
    def is_noop(self) -> bool:
        return all(p.is_noop for p in self.policies)

    def acts_on(self, layer: int) -> bool:
        return any(p.acts_on(layer) for p in self.policies)
