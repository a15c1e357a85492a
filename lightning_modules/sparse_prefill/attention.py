"""Sparse prefill attention: an estimator's selection computed through the shared kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

import litctx_kernels
from litctx_common.timing import Stopwatch

__all__ = ["PrefillStats", "sparse_prefill_attention"]


@dataclass
class PrefillStats:
    """One call: ``density`` (computed causal pairs / all causal pairs, averaged over batch and heads; 1 for
    dense), ``estimate_seconds`` (the estimator), ``compute_seconds`` (attention passes and merging, an
    estimator's exact partial pass included; layout bookkeeping such as the density excluded). Both times come
    from :class:`litctx_common.timing.Stopwatch` (the device is synchronised on CUDA)."""

    density: float
    estimate_seconds: float
    compute_seconds: float
    info: Optional[dict] = None


def sparse_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, estimator: Any, scale: float,
                             **select_kw: Any) -> Tuple[torch.Tensor, torch.Tensor, PrefillStats]:
    """Causal prefill attention of ``q [B, Hq, N, d]`` over ``k, v [B, Hk, N, d]`` on the blocks
    ``estimator.select`` chooses. Returns ``(o [B, Hq, N, dv], lse [B, Hq, N], stats)``."""
    select_watch, compute_watch = Stopwatch(q), Stopwatch(q)  # synchronised on CUDA at every start and stop
    with select_watch:
        sel = estimator.select(q, k, v, scale, **select_kw)
    with compute_watch:  # the attention passes and the merge only; bookkeeping (density) stays outside
        if sel.layout is None:
            o, lse = litctx_kernels.attention(q, k, v, scale=scale, causal=True)
        elif sel.exact is not None:
            rest = sel.exact_layout.complement(within=sel.layout)
            o2, lse2 = litctx_kernels.attention(q, k, v, scale=scale, causal=True, layout=rest)
            o, lse = litctx_kernels.merge_lse(sel.exact[0], sel.exact[1], o2, lse2)
        else:
            o, lse = litctx_kernels.attention(q, k, v, scale=scale, causal=True, layout=sel.layout)
    density = 1.0 if sel.layout is None else sel.layout.density(causal=True)
    # an estimator's own exact pass (SALE's sink + local attention) ran inside select(): it counts as compute
    exact_s = max(select_watch.seconds - sel.seconds, 0.0) if sel.exact is not None else 0.0
    return o, lse, PrefillStats(density, sel.seconds, compute_watch.seconds + exact_s, sel.info or None)
