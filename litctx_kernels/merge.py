"""Merging partial attention results by their log-sum-exp (split key sets, cached + fresh prefixes).

If ``(o_1, lse_1)`` and ``(o_2, lse_2)`` are softmax attention over disjoint key sets, attention over the
union is ``o = e^{lse_1 - lse} o_1 + e^{lse_2 - lse} o_2`` with ``lse = logaddexp(lse_1, lse_2)``. The
operation is associative and commutative; an empty part (``lse = -inf``) is the identity.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["merge_lse", "merge_lse_many"]


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``o* [..., N, dv]``, ``lse* [..., N]`` -> merged ``(o, lse)``; rows empty in both stay ``(0, -inf)``."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(f"merge_lse: shapes differ: o1 {list(o1.shape)}, lse1 {list(lse1.shape)}, "
                         f"o2 {list(o2.shape)}, lse2 {list(lse2.shape)}")
    lse = torch.logaddexp(lse1, lse2)
    finite = torch.isfinite(lse)
    ref = torch.where(finite, lse, torch.zeros_like(lse))
    w1 = torch.where(finite, torch.exp(lse1 - ref), torch.zeros_like(lse)).unsqueeze(-1)
    w2 = torch.where(finite, torch.exp(lse2 - ref), torch.zeros_like(lse)).unsqueeze(-1)
    o = (w1 * o1.to(w1.dtype) + w2 * o2.to(w2.dtype)).to(o1.dtype)
    return o, lse


def merge_lse_many(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of ``(o, lse)`` parts (left fold of :func:`merge_lse`)."""
    if not parts:
        raise ValueError("merge_lse_many needs at least one (o, lse) part")
    o, lse = parts[0]
    for o2, lse2 in parts[1:]:
        o, lse = merge_lse(o, lse, o2, lse2)
    return o, lse
