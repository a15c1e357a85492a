"""FLOPs of attention masks and block layouts (the CPU proxies of speed), from exact pair counts.

The pair counts (``row_pair_counts``, ``mask_pairs``, ``layout_pairs``) live in :mod:`litctx_kernels.layouts` beside
``BlockLayout.density`` (which needs them); this module imports them from there and re-exports them, so the
import runs one way (``flops`` -> ``layouts``).

Conventions (FlashAttention's): a computed (query, key) pair costs ``2 d`` FLOPs for ``q . k`` and ``2 dv``
for ``p v``, so a forward pass is ``2 (d + dv)`` FLOPs per pair (``4 d`` when ``dv = d``); dense causal
attention is ``~ 2 N^2 d`` per head; backward is 2.5x the forward.
"""

from __future__ import annotations

from typing import Optional

from litctx_kernels.layouts import layout_pairs, mask_pairs, row_pair_counts

__all__ = ["row_pair_counts", "mask_pairs", "layout_pairs", "attention_flops", "BACKWARD_FACTOR"]

BACKWARD_FACTOR = 2.5


def attention_flops(pairs, d: int, dv: Optional[int] = None, backward: bool = False) -> float:
    """FLOPs for ``pairs`` computed pairs (forward, or forward + backward when ``backward``)."""
    dv = d if dv is None else dv
    fwd = 2.0 * float(pairs) * (d + dv)
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd
