"""IndexMem as a KV policy: the learned indexer as a scorer and the latent memory as a residual compensator.

* :class:`IndexerScorer` - requires the observation's hidden states: at every attention call it scores the
  call's new entries with the layer's indexer (``[B, Hk]`` per token) and stores the scores by stream slot, so the
  score of an entry follows it through evictions; ``score`` gathers them for the cache view.
* :class:`LatentMemory` - the compensator (``merge = "residual"``): ``write`` folds every evicted entry into the
  layer's linear state (``M += phi(k) v^T``, ``z += phi(k)``), ``read_residual`` returns the gated readout of the
  bank's layer (:class:`~lightning_modules.indexmem.bank.IndexMemLayer`), None while nothing was evicted.
  ``token_equivalent`` is what the state costs per KV head, counted against the budget (``Budget.aux_tokens``).

Both hold a reference to one :class:`~lightning_modules.indexmem.bank.IndexMemBank`; copying a scorer (the
session gives each layer its own) shares the bank and starts with empty state. Everything is differentiable, so
the training module streams sequences through the same policy with gradients on.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch

from lightning_modules.indexmem.bank import IndexMemBank, feature_map, memory_token_equivalent
from lightning_modules.llm.kv_policy.protocol import KVObservation

__all__ = ["IndexerScorer", "LatentMemory"]


class IndexerScorer:
    """Scores entries by the bank's learned indexer (higher = keep); see the module docstring."""

    requires: FrozenSet[str] = frozenset({"hidden", "slots"})

    def __init__(self, bank: IndexMemBank) -> None:
        self.bank = bank
        self._scores: Optional[torch.Tensor] = None  # [B, Hk, slots seen]
        self._layer: Optional[int] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "IndexerScorer":
        return IndexerScorer(self.bank)  # one shared bank, fresh per-layer state

    def reset(self) -> None:
        self._scores = None

    def update(self, obs: KVObservation) -> None:
        if obs.hidden is None:
            raise ValueError(f"layer {obs.layer}: the IndexMem indexer needs the attention input hidden states in "
                             f"the observation (installed through install_policy, which records them)")
        n_new = obs.hidden.shape[1]
        with torch.no_grad():  # the indexer is trained on its own targets; eviction is a discrete decision
            new = self.bank.layers[obs.layer].scores(obs.hidden).to(torch.float32)  # [B, Hk, Nq]
        if self._scores is None or obs.phase == "prefill":
            self._scores = new
        else:
            self._scores = torch.cat([self._scores, new], dim=-1)
        if self._scores.shape[-1] < int(obs.slots.max()) + 1:
            raise RuntimeError(f"layer {obs.layer}: indexer scores for {self._scores.shape[-1]} slots, the cache "
                               f"view reaches slot {int(obs.slots.max())} ({n_new} new)")

    def score(self, obs: KVObservation) -> torch.Tensor:
        if self._scores is None:
            raise RuntimeError("IndexerScorer.score before update: the runner scores after observing a call")
        return torch.gather(self._scores.expand(obs.slots.shape[0], -1, -1), 2, obs.slots.long())


class LatentMemory:
    """The latent memory of evicted entries (a residual compensator); see the module docstring."""

    merge = "residual"

    def __init__(self, bank: IndexMemBank, eps: float = 1e-6) -> None:
        self.bank = bank
        self.eps = float(eps)
        self._state: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.written = 0

    @property
    def token_equivalent(self) -> int:
        """KV-cache tokens per KV head one layer's state costs (``d * d + d`` floats)."""
        return memory_token_equivalent(self.bank.shape.head_dim)

    def reset(self) -> None:
        self._state = {}
        self.written = 0

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              evicted: torch.Tensor) -> None:
        """Fold the entries ``evicted [B, Hk, N]`` of ``keys, values [B, Hk, N, d]`` into layer ``layer``'s state."""
        if not bool(evicted.any()):
            return
        w = evicted.to(torch.float32).unsqueeze(-1)
        phi = feature_map(keys) * w  # [B, Hk, N, d]
        mem = torch.matmul(phi.transpose(-1, -2), values.float())  # [B, Hk, d, dv]
        norm = phi.sum(2)  # [B, Hk, d]
        if layer in self._state:
            m0, z0 = self._state[layer]
            mem, norm = m0 + mem, z0 + norm
        self._state[layer] = (mem, norm)
        self.written += int(evicted.sum())

    def state(self, layer: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(M [B, Hk, d, dv], z [B, Hk, d])`` of ``layer`` (None: nothing evicted yet)."""
        return self._state.get(layer)

    def read_residual(self, layer: int, q: torch.Tensor, scale: float,
                      hidden: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        held = self._state.get(layer)
        if held is None:
            return None
        mem, norm = held
        return self.bank.layers[layer].read(q, mem, norm, hidden, eps=self.eps)

    def read(self, layer: int, q: torch.Tensor, scale: float):  # the LSE protocol: not this compensator's
        raise TypeError("LatentMemory is a residual compensator (merge='residual'): use read_residual")

    def held_bytes(self) -> int:
        return sum(m.numel() * m.element_size() + z.numel() * z.element_size() for m, z in self._state.values())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "LatentMemory":
        return LatentMemory(self.bank, self.eps)


