"""EMFormer's composite loss with the sinusoid weight and its learnable angle.

For predictions and targets ``[B, C, H, W]`` (normalised units) and latitude weights ``w_h`` (mean 1):

* ``L_gen = mean_{b,c}[ mean_{h,w}(e^2) / exp(s_c) + s_c ]`` with a learnable log-variance ``s_c`` per channel
  (uncertainty weighting, initialised to 0);
* ``L_rmse = mean_{b,c} sqrt( mean_{h,w}(w_h e^2) )``;
* ``L = (1 - a) L_gen + a L_rmse`` with ``a = (sin(theta) + 1) / 2`` and a learnable angle ``theta``
  initialised to ``-pi/2`` (``a = 0``: training starts on ``L_gen``; ``dL/dtheta = cos(theta)(L_rmse - L_gen)/2``).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import nn

__all__ = ["CompositeWeatherLoss"]


class CompositeWeatherLoss(nn.Module):
    """See the module docstring. ``lat_weights [H]`` (mean 1) is a buffer."""

    def __init__(self, channels: int, lat_weights: torch.Tensor, theta_init: float = -math.pi / 2) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(channels))
        self.theta = nn.Parameter(torch.tensor(float(theta_init)))
        self.register_buffer("lat_weights", torch.as_tensor(lat_weights, dtype=torch.float32).view(-1, 1))

    @property
    def mix(self) -> torch.Tensor:
        """The weight ``a`` of ``L_rmse`` (in [0, 1])."""
        return (torch.sin(self.theta) + 1) / 2

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        if pred.shape != target.shape or pred.dim() != 4:
            raise ValueError(f"pred and target must be equal [B, C, H, W]; got {list(pred.shape)}, {list(target.shape)}")
        if pred.shape[1] != self.log_var.numel() or pred.shape[2] != self.lat_weights.shape[0]:
            raise ValueError(f"expected [B, {self.log_var.numel()}, {self.lat_weights.shape[0]}, W], got "
                             f"{list(pred.shape)}")
        err2 = (pred.float() - target.float()) ** 2
        mse = err2.mean(dim=(-2, -1))  # [B, C]
        s = self.log_var.view(1, -1)
        l_gen = (mse / torch.exp(s) + s).mean()
        l_rmse = torch.sqrt((err2 * self.lat_weights).mean(dim=(-2, -1)) + 1e-12).mean()
        a = self.mix
        loss = (1 - a) * l_gen + a * l_rmse
        return loss, {"gen": l_gen.detach(), "rmse": l_rmse.detach(), "mix": a.detach()}
