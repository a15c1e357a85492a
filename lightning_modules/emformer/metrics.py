"""WeatherBench2 metrics as torchmetrics, per lead time and channel, on physical (de-normalised) fields.

With latitude weights ``w_h`` (mean 1) and fields ``[B, L, C, H, W]`` (L lead times, C channels):

* :class:`LatWeightedRMSE` - ``sqrt( mean_samples mean_{h,w}( w_h (f - o)^2 ) )`` (the mean over samples is
  taken before the square root, WB2's default ``RMSE``); ``sqrt_before_mean=True`` gives
  ``RMSESqrtBeforeTimeAvg`` (EMFormer's code).
* :class:`LatWeightedACC` - per sample ``sum w f' o' / sqrt(sum w f'^2 * sum w o'^2)`` with anomalies against a
  climatology (``f' = f - c``, ``o' = o - c``), averaged over samples; a sample whose forecast or truth
  anomaly is identically zero counts as 0.

``compute()`` returns ``[L, C]``.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

__all__ = ["LatWeightedRMSE", "LatWeightedACC"]


def _check(name: str, x: torch.Tensor, leads: int, channels: int, height: int) -> None:
    if x.dim() != 5 or tuple(x.shape[1:4]) != (leads, channels, height):
        raise ValueError(f"{name} must be [B, {leads}, {channels}, {height}, W], got {list(x.shape)}")


class LatWeightedRMSE(Metric):
    full_state_update = False

    def __init__(self, lat_weights: torch.Tensor, leads: int, channels: int, sqrt_before_mean: bool = False) -> None:
        super().__init__()
        self.leads, self.channels, self.sqrt_before_mean = leads, channels, sqrt_before_mean
        self.register_buffer("w", torch.as_tensor(lat_weights, dtype=torch.float64).view(-1, 1), persistent=False)
        self.add_state("total", torch.zeros(leads, channels, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        _check("pred", pred, self.leads, self.channels, self.w.shape[0])
        _check("target", target, self.leads, self.channels, self.w.shape[0])
        mse = ((pred.double() - target.double()) ** 2 * self.w).mean(dim=(-2, -1))  # [B, L, C]
        self.total += (mse.sqrt() if self.sqrt_before_mean else mse).sum(0)
        self.count += pred.shape[0]

    def compute(self) -> torch.Tensor:
        mean = self.total / self.count.clamp_min(1)
        return mean if self.sqrt_before_mean else mean.sqrt()


class LatWeightedACC(Metric):
    full_state_update = False

    def __init__(self, lat_weights: torch.Tensor, leads: int, channels: int) -> None:
        super().__init__()
        self.leads, self.channels = leads, channels
        self.register_buffer("w", torch.as_tensor(lat_weights, dtype=torch.float64).view(-1, 1), persistent=False)
        self.add_state("total", torch.zeros(leads, channels, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, target: torch.Tensor, climatology: torch.Tensor) -> None:
        for name, x in (("pred", pred), ("target", target), ("climatology", climatology)):
            _check(name, x, self.leads, self.channels, self.w.shape[0])
        f = pred.double() - climatology.double()
        o = target.double() - climatology.double()
        num = (self.w * f * o).sum(dim=(-2, -1))
        den = torch.sqrt((self.w * f * f).sum(dim=(-2, -1)) * (self.w * o * o).sum(dim=(-2, -1)))
        acc = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
        self.total += acc.sum(0)
        self.count += pred.shape[0]

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp_min(1)
