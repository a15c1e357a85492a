"""Oracle quantities for judging a block selection: the exact attention mass of every block, recall and the
relative output error."""

from __future__ import annotations

import math

import torch

from litctx_kernels import BlockLayout
from lightning_modules.sparse_prefill.estimators import block_attention_mass, expand_kv  # noqa: F401 (re-exported)

__all__ = ["block_attention_mass", "attention_recall", "relative_output_error", "top_block_hit_rate",
           "matched_budget_mask"]


def attention_recall(mass: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Share of the exact attention mass inside the layout's blocks, per (batch, head): ``[B, H]`` in [0, 1]."""
    keep = layout.to_block_mask().to(mass.device).expand_as(mass)
    return (mass * keep).sum((-1, -2)) / mass.sum((-1, -2))


def relative_output_error(o: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``||O - O_ref||_F / ||O_ref||_F`` per (batch, head): ``[B, H]``."""
    diff = (o.double() - reference.double()).pow(2).sum((-1, -2)).sqrt()
    return diff / reference.double().pow(2).sum((-1, -2)).sqrt().clamp_min(1e-300)


def top_block_hit_rate(scores: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor) -> float:
    """How often an estimator's highest-scoring block is one of the target blocks.

    Args:
        scores: ``[M, Mk]`` an estimator's block scores (higher = more likely kept).
        target: ``[M, Mk]`` bool, the blocks that count as a hit (e.g. the blocks a planted slash crosses, or the
            truly heaviest block of each row).
        allowed: ``[M, Mk]`` bool, the candidate blocks of each query row (e.g. off the sink and the diagonal,
            which every selection keeps anyway); only rows with an allowed target are counted.

    Returns:
        the share of those rows whose argmax of ``scores`` over ``allowed`` is a target block.
    """
    if scores.shape != target.shape or allowed.shape != target.shape or target.dim() != 2:
        raise ValueError(f"scores, target and allowed must share one [M, Mk] shape, got {list(scores.shape)}, "
                         f"{list(target.shape)} and {list(allowed.shape)}")
    rows = (target & allowed).any(-1)
    if not rows.any():
        raise ValueError("no query row has an allowed target block")
    pick = scores.double().masked_fill(~allowed, -math.inf).argmax(-1, keepdim=True)
    return float(target.gather(-1, pick).squeeze(-1)[rows].double().mean())


def matched_budget_mask(scores: torch.Tensor, counts: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Per row, the ``counts[r]`` highest-scoring candidate blocks: another estimator's selection at exactly the
    same per-row budget (for comparisons at equal density).

    Args:
        scores: ``[..., M, Mk]`` block scores; candidates: ``[..., M, Mk]`` bool, the blocks that may be chosen;
        counts: ``[..., M]`` blocks to keep per row (clipped to the number of candidates).

    Returns:
        ``[..., M, Mk]`` bool mask.
    """
    s = scores.double().masked_fill(~candidates, -math.inf)
    order = s.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return (ranks < counts.unsqueeze(-1)) & candidates
