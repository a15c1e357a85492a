"""AdaKV's head-adaptive selection: one budget per layer shared by its KV heads (head-varying capacities)."""

from __future__ import annotations

import torch

__all__ = ["AdaKVSelector"]


class AdaKVSelector:
    """AdaKV (kvpress ``AdaKVPress``): each KV head first keeps its top ``floor(alpha * capacity_h)`` entries
    (the safeguard; protected entries rank first), then the rest of the layer's total budget
    ``sum_h capacity_h`` goes to the highest remaining scores across all heads of the layer. Kept counts vary
    by head; their sum equals the layer budget (or every valid entry when fewer).

    Args:
        alpha: safeguard fraction in ``[0, 1]`` (kvpress default 0.2).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)

    def select(self, scores: torch.Tensor, capacity: torch.Tensor, protected: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
        b, hk, n = scores.shape
        s = scores.float().masked_fill(~valid, float("-inf"))
        s = torch.where(protected, torch.full_like(s, float("inf")), s)
        order = torch.argsort(s, dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, order, torch.arange(n, device=s.device).expand_as(order))
        n_prot = protected.sum(-1)
        safe_n = torch.maximum(torch.floor(capacity.double() * self.alpha).long(), n_prot)
        safe = valid & (ranks < safe_n.unsqueeze(-1))
        # the layer's remaining budget, filled by the best remaining scores across heads
        remaining = (capacity.sum(-1) - safe.sum((-1, -2))).clamp_min(0)  # [B]
        rest = s.masked_fill(safe | ~valid, float("-inf")).reshape(b, hk * n)
        rest_order = torch.argsort(rest, dim=-1, descending=True, stable=True)
        rest_rank = torch.empty_like(rest_order)
        rest_rank.scatter_(-1, rest_order, torch.arange(hk * n, device=s.device).expand_as(rest_order))
        chosen = (rest_rank < remaining.unsqueeze(-1)) & torch.isfinite(rest)
        return safe | (chosen.view(b, hk, n) & valid)
