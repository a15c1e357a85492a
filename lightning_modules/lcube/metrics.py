"""L-CUBE metrics as torchmetrics: conditional KL by context position, and long-context utilization.

Both keep sums (``dist_reduce_fx="sum"``) so they are exact under DDP.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torchmetrics import Metric

__all__ = ["ConditionalKL", "ContextUtilization", "position_buckets"]


def position_buckets(max_log2: int = 31) -> List[int]:
    """Bucket edges ``[0, 1, 2, 4, ..., 2**max_log2]``: position 0, then doubling context lengths."""
    return [0] + [2**i for i in range(max_log2 + 1)]


class ConditionalKL(Metric):
    """Mean KL from the exact conditional to the model's predictive, overall and per context-position bucket.

    ``update(kl)`` takes per-position KL values ``[B, N]`` (see
    :func:`lightning_modules.lcube.gaussian.gaussian_kl`). ``compute()`` returns ``{"kl": mean,
    "kl_by_pos/a-b": mean over positions a <= t < b, ...}`` for the buckets that received data; the bucket
    edges are 0, 1, 2, 4, 8, ... (the last one capped at the longest sequence seen).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, max_log2: int = 31, **kwargs) -> None:
        super().__init__(**kwargs)
        self.edges = position_buckets(max_log2)
        n = len(self.edges) - 1
        self.add_state("bucket_sum", default=torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bucket_count", default=torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("longest", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, kl: torch.Tensor) -> None:
        if kl.dim() != 2:
            raise ValueError(f"ConditionalKL.update expects [B, N] per-position KL, got {list(kl.shape)}")
        N = kl.shape[1]
        if N > self.edges[-1]:
            raise ValueError(f"sequence length {N} exceeds the metric's largest bucket edge {self.edges[-1]}")
        per_pos = kl.detach().to(torch.float64).sum(0)
        for i, (a, b) in enumerate(zip(self.edges[:-1], self.edges[1:])):
            if a >= N:
                break
            self.bucket_sum[i] += per_pos[a:min(b, N)].sum()
            self.bucket_count[i] += kl.shape[0] * (min(b, N) - a)
        self.longest = torch.maximum(self.longest, torch.tensor(float(N), dtype=torch.float64, device=self.longest.device))

    def compute(self) -> Dict[str, torch.Tensor]:
        out = {"kl": self.bucket_sum.sum() / self.bucket_count.sum().clamp_min(1)}
        longest = int(self.longest)
        width = len(str(longest))
        for i, (a, b) in enumerate(zip(self.edges[:-1], self.edges[1:])):
            if self.bucket_count[i] > 0:
                out[f"kl_by_pos/{a:0{width}d}-{min(b, longest):0{width}d}"] = self.bucket_sum[i] / self.bucket_count[i]
        return {k: v.float() for k, v in out.items()}


class ContextUtilization(Metric):
    """Long-context utilization ``U = I_hat_BP(cut; L) / I_BP(cut; L)``.

    ``I_hat_BP`` is the L2M estimate of the bipartite mutual information a model extracts: the sum over
    positions after the cut of ``NLL(x_t | x_{cut:t}) - NLL(x_t | x_{<t})`` (the model run on the suffix
    alone and on the full sequence). Writing each NLL as exact entropy plus KL to the exact conditional,

        I_hat_BP = I_BP + sum_{t >= cut} (KL_t^suffix - KL_t^full),

    which is what ``update`` accumulates: the same estimator in expectation, without the sampling noise of
    the entropy terms (they are known exactly here).

    ``update(kl_suffix, kl_full, bmi_true)``: ``[B, N - cut]``, ``[B, N - cut]``, ``[B]``.
    ``compute()`` returns ``{"bmi": I_hat, "bmi_true": I, "utilization": I_hat / I}``.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("bmi_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("true_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, kl_suffix: torch.Tensor, kl_full: torch.Tensor, bmi_true: torch.Tensor) -> None:
        if kl_suffix.shape != kl_full.shape or kl_suffix.dim() != 2:
            raise ValueError(
                f"kl_suffix and kl_full must both be [B, N - cut], got {list(kl_suffix.shape)} and {list(kl_full.shape)}"
            )
        if bmi_true.shape != kl_suffix.shape[:1]:
            raise ValueError(f"bmi_true must be [B] = [{kl_suffix.shape[0]}], got {list(bmi_true.shape)}")
        true = bmi_true.detach().to(torch.float64)
        self.bmi_sum += (true + (kl_suffix.detach() - kl_full.detach()).to(torch.float64).sum(1)).sum()
        self.true_sum += true.sum()
        self.count += kl_suffix.shape[0]

    def compute(self) -> Dict[str, torch.Tensor]:
        n = self.count.clamp_min(1)
        bmi, true = self.bmi_sum / n, self.true_sum / n
        return {"bmi": bmi.float(), "bmi_true": true.float(), "utilization": (bmi / true).float()}
