"""Scorers of the eviction baselines, each taking any score of :mod:`lightning_modules.kv_eviction.scores`
(``attention`` or an OBCache score) so that OBCache is a drop-in replacement inside the same machinery.

* :class:`AccumulatedScorer` (H2O) - the score of every query so far, summed per cache entry: the prefill's
  queries (or its last ``obs_window``) at the first call, then each appended / decoded query.
* :class:`WindowScorer` (SnapKV; TOVA with ``window=1`` and no pooling) - the score of the last ``window``
  queries of the current call, optionally smoothed by a 1-D pool over cache positions.

Scores are per KV head ``[B, Hk, N]`` (query heads of a GQA group reduced by ``gqa``). The constructors have no
defaults of their own: the method configs of :mod:`~lightning_modules.kv_eviction.config` hold them.
"""

from __future__ import annotations

from typing import FrozenSet, Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.kv_eviction.scores import check_gqa, check_kind, group_heads, moments_for, token_scores
from lightning_modules.llm.kv_policy.protocol import KVObservation

__all__ = ["AccumulatedScorer", "WindowScorer", "POOLS"]

POOLS = ("avg", "max", "none")


def _observed_scores(obs: KVObservation, window: Optional[int], kind: str, gqa: str) -> torch.Tensor:
    """``[B, Hk, N]`` scores of the last ``window`` queries of the call (None = all); 0 on masked entries."""
    stats = obs.colstats(window, moments=moments_for(kind))
    scores = group_heads(token_scores(stats, obs.v, kind), obs.k.shape[1], gqa)
    return scores.masked_fill(~obs.valid, 0.0)


ACC_GROWTH = 256
"""Spare slots :class:`AccumulatedScorer` adds when its accumulator grows (a decode step adds one slot)."""


class AccumulatedScorer:
    """H2O's heavy-hitter score: per cache entry, the sum of a score over every query that has seen it.

    Args (keyword-only, no defaults: :class:`~lightning_modules.kv_eviction.config.H2OConfig` holds them):
        score: ``attention`` (H2O) or an OBCache score.
        obs_window: at the first (prefill) call only the last ``obs_window`` queries count (None = all of them,
            as H2O; OBCache's released H2O variants use the recent window); later calls count all their queries.
        gqa: reduction over a GQA group (``mean``, ``sum``, ``max``).
    """

    requires: FrozenSet[str] = frozenset({"colstats"})

    def __init__(self, *, score: str, obs_window: Optional[int], gqa: str) -> None:
        self.score_kind = check_kind(score)
        if obs_window is not None and obs_window < 1:
            raise ValueError(f"obs_window must be >= 1 or None, got {obs_window}")
        self.obs_window = obs_window
        self.gqa = check_gqa(gqa)
        self._acc: Optional[torch.Tensor] = None  # [B, Hk, S] by slot of the uncompressed stream

    def update(self, obs: KVObservation) -> None:
        window = self.obs_window if obs.phase == "prefill" else None
        scores = _observed_scores(obs, window, self.score_kind, self.gqa)
        n_slots = int(obs.slots.max()) + 1 if obs.slots.numel() else 0
        b, hk = scores.shape[:2]
        if self._acc is None or self._acc.shape[:2] != (b, hk):
            self._acc = torch.zeros(b, hk, n_slots + ACC_GROWTH, dtype=torch.float32, device=scores.device)
        elif self._acc.shape[-1] < n_slots:  # room for the next steps' slots too (one copy per ACC_GROWTH steps)
            self._acc = F.pad(self._acc, (0, n_slots - self._acc.shape[-1] + ACC_GROWTH))
        self._acc.scatter_add_(-1, obs.slots.long(), scores)

    def colstats_request(self, obs: KVObservation) -> Tuple[Optional[int], str]:
        """The ``(window, moments)`` of the column statistics :meth:`update` will read from ``obs``."""
        return (self.obs_window if obs.phase == "prefill" else None), moments_for(self.score_kind)

    def score(self, obs: KVObservation) -> torch.Tensor:
        if self._acc is None:
            raise RuntimeError("AccumulatedScorer.score before any update; the policy installer calls update first")
        return torch.gather(self._acc, -1, obs.slots.long())

    def reset(self) -> None:
        self._acc = None


class WindowScorer:
    """SnapKV's observation-window score (TOVA: ``window=1``, ``pool="none"``).

    Args (keyword-only, no defaults: :class:`~lightning_modules.kv_eviction.config.SnapKVConfig` holds them):
        score: ``attention`` or an OBCache score.
        window: observation queries, the last ``window`` of the call (SnapKV 32, kvpress 64; TOVA 1).
        pool: ``avg`` (SnapKV), ``max`` or ``none`` over cache positions; kernel: pool width (odd).
        gqa: reduction over a GQA group.
    """

    requires: FrozenSet[str] = frozenset({"colstats"})

    def __init__(self, *, score: str, window: int, pool: str, kernel: int, gqa: str) -> None:
        self.score_kind = check_kind(score)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if pool not in POOLS:
            raise ValueError(f"pool={pool!r}: valid pools are {', '.join(POOLS)}")
        if pool != "none" and (kernel < 1 or kernel % 2 == 0):
            raise ValueError(f"kernel must be a positive odd width, got {kernel}")
        self.window, self.pool, self.kernel, self.gqa = int(window), pool, int(kernel), check_gqa(gqa)

    def score(self, obs: KVObservation) -> torch.Tensor:
        scores = _observed_scores(obs, self.window, self.score_kind, self.gqa)
        if self.pool == "none" or self.kernel == 1:
            return scores
        b, hk, n = scores.shape
        flat = scores.reshape(b * hk, 1, n)
        pad = self.kernel // 2
        if self.pool == "avg":
            pooled = F.avg_pool1d(flat, self.kernel, stride=1, padding=pad)
        else:
            pooled = F.max_pool1d(flat, self.kernel, stride=1, padding=pad)
        return pooled.view(b, hk, n)

    def update(self, obs: KVObservation) -> None:
        return None

    def colstats_request(self, obs: KVObservation) -> Tuple[Optional[int], str]:
        """The ``(window, moments)`` of the column statistics :meth:`score` will read from ``obs``."""
        return self.window, moments_for(self.score_kind)

    def reset(self) -> None:
        return None
