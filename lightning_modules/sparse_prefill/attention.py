"""Sparse prefill attention: an estimator's selection computed through the shared kernels."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

import kernels

__all__ = ["PrefillStats", "sparse_prefill_attention"]


@dataclass
class PrefillStats:
    """One call: ``density`` (computed causal pairs / all causal pairs, averaged over batch and heads; 1 for
    dense), ``estimate_seconds`` (the estimator), ``compute_seconds`` (attention passes and merging)."""

    density: float
    estimate_seconds: float
    compute_seconds: float
    info: Optional[dict] = None


def sparse_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, estimator: Any, scale: float,
                             **select_kw: Any) -> Tuple[torch.Tensor, torch.Tensor, PrefillStats]:
    """Causal prefill attention of ``q [B, Hq, N, d]`` over ``k, v [B, Hk, N, d]`` on the blocks
    ``estimator.select`` chooses. Returns ``(o [B, Hq, N, dv], lse [B, Hq, N], stats)``."""
    t0 = time.perf_counter()
    sel = estimator.select(q, k, v, scale, **select_kw)
    t1 = time.perf_counter()
    if sel.layout is None:
        o, lse = kernels.attention(q, k, v, scale=scale, causal=True)
        density = 1.0
    elif sel.exact is not None:
        rest = sel.exact_layout.complement(within=sel.layout)
        o2, lse2 = kernels.attention(q, k, v, scale=scale, causal=True, layout=rest)
        o, lse = kernels.merge_lse(sel.exact[0], sel.exact[1], o2, lse2)
        density = sel.layout.density(causal=True)
    else:
        o, lse = kernels.attention(q, k, v, scale=scale, causal=True, layout=sel.layout)
        density = sel.layout.density(causal=True)
    t2 = time.perf_counter()
    exact_s = (t1 - t0) - sel.seconds  # an estimator's own exact pass counts as compute
    return o, lse, PrefillStats(density, sel.seconds, (t2 - t1) + exact_s, sel.info or None)
