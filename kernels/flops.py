"""Exact pair counts, density and FLOPs of attention masks and block layouts (the CPU proxies of speed).

Conventions (FlashAttention's): a computed (query, key) pair costs ``2 d`` FLOPs for ``q . k`` and ``2 dv``
for ``p v``, so a forward pass is ``2 (d + dv)`` FLOPs per pair (``4 d`` when ``dv = d``); dense causal
attention is ``~ 2 N^2 d`` per head; backward is 2.5x the forward.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.layouts import BlockLayout, resolve_q_offset

__all__ = ["row_pair_counts", "mask_pairs", "layout_pairs", "attention_flops", "BACKWARD_FACTOR"]

BACKWARD_FACTOR = 2.5


def row_pair_counts(rows: torch.Tensor, c0, c1, n_k: int, *, causal: bool, q_offset: int,
                    window: Optional[int]) -> torch.Tensor:
    """Valid keys of query rows ``rows`` within key columns ``[c0, c1]`` (inclusive; broadcastable tensors)."""
    lo = torch.as_tensor(c0, device=rows.device)
    hi = torch.clamp(torch.as_tensor(c1, device=rows.device), max=n_k - 1)
    if causal:
        p = rows + q_offset
        hi = torch.minimum(hi, p)
        if window is not None:
            lo = torch.maximum(lo, p - window + 1)
    return torch.clamp(hi - lo + 1, min=0) + torch.zeros_like(rows)


def mask_pairs(n_q: int, n_k: int, *, causal: bool = True, q_offset: Optional[int] = None,
               window: Optional[int] = None) -> int:
    """Pairs allowed by the dense causal / window mask (exact)."""
    off = resolve_q_offset(n_q, n_k, q_offset)
    rows = torch.arange(n_q, dtype=torch.int64)
    return int(row_pair_counts(rows, 0, n_k - 1, n_k, causal=causal, q_offset=off, window=window).sum())


def layout_pairs(layout: BlockLayout, *, causal: bool = True, q_offset: Optional[int] = None,
                 window: Optional[int] = None) -> torch.Tensor:
    """Computed pairs per (batch, head) of a layout under the element mask: ``[B, H]`` int64 (exact).

    Cost ``O(blocks x block_q)``; the N x N mask is never built.
    """
    n_q, n_k = layout.seq_lens
    off = resolve_q_offset(n_q, n_k, q_offset)
    bm = layout.to_block_mask().cpu()  # [B, H, Mq, Mk]
    mq, mk = bm.shape[-2:]
    c0 = (torch.arange(mk) * layout.block_k).view(1, mk)
    c1 = torch.clamp(c0 + layout.block_k, max=n_k) - 1
    per_block = torch.zeros(mq, mk, dtype=torch.int64)
    q0 = torch.arange(mq) * layout.block_q
    for t in range(layout.block_q):
        rows = (q0 + t).view(mq, 1)
        cnt = row_pair_counts(rows, c0, c1, n_k, causal=causal, q_offset=off, window=window)
        per_block += torch.where(rows < n_q, cnt, torch.zeros_like(cnt))
    return (bm.to(torch.int64) * per_block).sum(dim=(-1, -2))


def attention_flops(pairs, d: int, dv: Optional[int] = None, backward: bool = False) -> float:
    """FLOPs for ``pairs`` computed pairs (forward, or forward + backward when ``backward``)."""
    dv = d if dv is None else dv
    fwd = 2.0 * float(pairs) * (d + dv)
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd
