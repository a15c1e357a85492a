"""Per-query sparse prefix reads for block-diffusion denoising steps: Quest selection per query, the union of the
queries' read sets, attention over that union, and the union-of-pages density (bytes:
``sparse_read.kv_read_bytes``).

Shapes: ``query [B, Hq, n, d]`` (the block queries that read the prefix sparsely), ``key, value [B, Hk, P, d|dv]``
(the committed prefix), ``valid [B, 1|Hk, P]`` (readable prefix entries; padding False), read sets ``[B, Hk, n, P]``
(per KV group: a group's query heads share what they read, as in Quest and the sparse-read kit).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from lightning_modules.llm.kv_policy.protocol import top_capacity
from lightning_modules.llm.sparse_read.kit import page_bounds, page_scores

__all__ = ["quest_per_query", "top_pages_per_query", "union_attention", "union_pages", "page_density"]


def _valid(valid: Optional[torch.Tensor], key: torch.Tensor) -> torch.Tensor:
    b, hk, p = key.shape[:3]
    if valid is None:
        return torch.ones(b, hk, p, dtype=torch.bool, device=key.device)
    if valid.dim() != 3 or valid.shape[0] != b or valid.shape[1] not in (1, hk) or valid.shape[2] != p:
        raise ValueError(f"valid must be boolean [B, 1|Hk, P] = [{b}, 1|{hk}, {p}], got {list(valid.shape)}")
    return valid.bool().expand(b, hk, p)


def _entries_from_pages(page_values: torch.Tensor, p: int, page_size: int) -> torch.Tensor:
    """``[..., n_pages]`` -> ``[..., P]``: every entry carries its page's value."""
    page_of = torch.arange(p, device=page_values.device) // page_size
    return page_values[..., page_of]


def top_pages_per_query(page_score: torch.Tensor, valid: torch.Tensor, budget: int, page_size: int) -> torch.Tensor:
    """Each query's read set under an exact token budget: the valid entries of its best pages in rank order (ties:
    the lower page), the last page cut to its first entries, ``min(budget, |valid|)`` entries in all.

    Args:
        page_score: ``[B, Hk, n, n_pages]`` (higher = read first; ``-inf`` never unless needed to fill).
        valid: ``[B, Hk, P]``.
    Returns ``read [B, Hk, n, P]`` bool."""
    b, hk, n, _ = page_score.shape
    p = valid.shape[-1]
    entry = _entries_from_pages(page_score, p, page_size)
    v = valid.unsqueeze(2).expand(b, hk, n, p)
    capacity = torch.clamp(v.sum(-1), max=int(budget))
    return top_capacity(entry, capacity, torch.zeros_like(v), v)


def quest_per_query(query: torch.Tensor, key: torch.Tensor, valid: Optional[torch.Tensor], budget: int,
                    page_size: int) -> Tuple[torch.Tensor, int]:
    """Quest per query: pages ranked by the upper bound of ``q . k`` from the page's channel-wise key min / max
    (``sparse_read.page_scores``, max over a KV group's query heads), each query reading ``budget`` entries of its
    own top pages. Returns ``(read [B, Hk, n, P], meta_bytes)``: the page metadata read to score (``2 d`` values
    per valid page and KV head)."""
    valid = _valid(valid, key)
    kmin, kmax, page_valid = page_bounds(key, valid, page_size)
    scores = page_scores(query, kmin, kmax, page_valid)  # [B, Hk, n, n_pages]
    read = top_pages_per_query(scores, valid, budget, page_size)
    meta = int(page_valid.sum()) * 2 * key.shape[-1] * key.element_size()
    return read, meta


def union_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, read: torch.Tensor,
                    scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of each query over its own read set, computed on the union of the group's sets
    only (gathered compactly, so the work and the K/V loaded scale with the union, not the prefix).

    Returns ``(o [B, Hq, n, dv], lse [B, Hq, n])`` (float32, or float64 for float64 input); a query with an empty
    set gives ``o = 0``, ``lse = -inf``."""
    b, hq, n, d = query.shape
    hk, p = key.shape[1], key.shape[2]
    if read.shape != (b, hk, n, p):
        raise ValueError(f"read must be [B, Hk, n, P] = {[b, hk, n, p]}, got {list(read.shape)}")
    g = hq // hk
    dtype = torch.promote_types(query.dtype, torch.float32)
    union = read.any(2)  # [B, Hk, P]
    width = max(1, int(union.sum(-1).max()))
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True)[..., :width]  # union entries first, in order
    k_u = torch.gather(key, 2, order.unsqueeze(-1).expand(b, hk, width, d)).to(dtype)
    v_u = torch.gather(value, 2, order.unsqueeze(-1).expand(b, hk, width, value.shape[-1])).to(dtype)
    m_u = torch.gather(read, 3, order.unsqueeze(2).expand(b, hk, n, width))  # [B, Hk, n, W]
    q = query.to(dtype).reshape(b, hk, g, n, d)
    s = (q @ k_u.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, g, n, W]
    s = s.masked_fill(~m_u.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = w @ v_u.unsqueeze(2)
    return o.reshape(b, hq, n, -1), lse.reshape(b, hq, n)


def union_pages(read: torch.Tensor, page_size: int) -> torch.Tensor:
    """``read [B, Hk, n, P]`` -> pages any query reads ``[B, Hk, n_pages]`` bool."""
    b, hk, _, p = read.shape
    n_pages = math.ceil(p / page_size)
    u = torch.nn.functional.pad(read.any(2), (0, n_pages * page_size - p))
    return u.view(b, hk, n_pages, page_size).any(-1)


def page_density(read: torch.Tensor, valid: torch.Tensor, page_size: int) -> torch.Tensor:
    """The union-of-pages density per row and KV head ``[B, Hk]``: pages read by any query / pages holding a valid
    entry."""
    pages = union_pages(read, page_size).sum(-1).float()
    b, hk, p = valid.shape
    total = union_pages(valid.unsqueeze(2), page_size).sum(-1).float()
    return pages / total.clamp_min(1)
