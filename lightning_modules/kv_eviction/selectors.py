"""AdaKV's head-adaptive selection: one budget per layer shared by its KV heads (head-varying capacities)."""

from __future__ import annotations

from typing import Optional

import torch

from lightning_modules.llm.kv_policy.protocol import top_capacity

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
               valid: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``slots [B, Hk, N]`` (each entry's place in the stream; None: the positions) break ties, earlier first;
        across heads the order is (head, slot), the flattened layout of a cache in stream order."""
        b, hk, n = scores.shape
        # the safeguard: each head's top floor(alpha * capacity_h) (at least its protected entries)
        safe_n = torch.maximum(torch.floor(capacity.double() * self.alpha).long(), protected.sum(-1))
        safe = top_capacity(scores, safe_n, protected, valid, slots)
        # the layer's remaining budget, filled by the best remaining scores across heads (protected entries are
        # all in the safeguard already)
        remaining = (capacity.sum(-1) - safe.sum((-1, -2))).clamp_min(0)  # [B]
        rest = scores.float().masked_fill(safe | ~valid, float("-inf")).reshape(b, 1, hk * n)
        flat_slots = None
        if slots is not None:
            span = int(slots.max()) + 1 if slots.numel() else 1
            head = torch.arange(hk, device=slots.device).view(1, hk, 1) * span
            flat_slots = (slots.long() + head).reshape(b, 1, hk * n)
        chosen = top_capacity(rest, remaining.view(b, 1), torch.zeros_like(rest, dtype=torch.bool),
                              torch.isfinite(rest), flat_slots)
        return safe | (chosen.view(b, hk, n) & valid)
