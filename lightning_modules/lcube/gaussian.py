"""Gaussian predictive heads and the exact per-position quantities of L-CUBE: NLL and KL."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GaussianHead", "gaussian_nll", "gaussian_kl"]


class GaussianHead(nn.Module):
    """Map features ``[B, N, d_model]`` to a Gaussian over R^D: ``(mean [B, N, D], chol [B, N, D, D])``,
    ``chol`` lower triangular with a positive diagonal (``covariance = chol @ chol.T``).

    ``covariance='full'`` predicts the whole Cholesky factor, ``'diag'`` only its diagonal.
    """

    def __init__(self, d_model: int, dim: int, covariance: str = "full", min_scale: float = 1.0e-3) -> None:
        super().__init__()
        self.dim = dim
        self.full = covariance == "full"
        n_off = dim * (dim - 1) // 2 if self.full else 0
        self.proj = nn.Linear(d_model, 2 * dim + n_off)
        self.min_scale = min_scale
        rows, cols = torch.tril_indices(dim, dim, offset=-1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        with torch.no_grad():  # start from N(mean, I): a random D x D Cholesky factor is badly conditioned
            self.proj.weight[dim:].zero_()
            self.proj.bias[dim:].zero_()
            self.proj.bias[dim : 2 * dim].fill_(math.log(math.expm1(1.0 - min_scale)))

    def forward(self, h: torch.Tensor):
        out = self.proj(h)
        D = self.dim
        mean = out[..., :D]
        diag = F.softplus(out[..., D : 2 * D]) + self.min_scale
        chol = torch.diag_embed(diag)
        if self.full and D > 1:
            lower = torch.zeros_like(chol)
            lower[..., self._rows, self._cols] = out[..., 2 * D :]
            chol = chol + lower
        return mean, chol


def gaussian_nll(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """Negative log density of ``x`` under ``N(mean, chol chol^T)``, in nats. Shapes ``[..., D]``,
    ``[..., D]``, ``[..., D, D]`` -> ``[...]``."""
    D = x.shape[-1]
    z = torch.linalg.solve_triangular(chol, (x - mean).unsqueeze(-1), upper=False).squeeze(-1)
    logdet = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    return 0.5 * D * math.log(2 * math.pi) + logdet + 0.5 * (z * z).sum(-1)


def gaussian_kl(true_mean: torch.Tensor, true_cov: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """``KL( N(true_mean, true_cov) || N(mean, chol chol^T) )`` in nats, ``[...]``.

    ``0.5 [tr(S^-1 C) + (m - mu)^T S^-1 (m - mu) - D + log det S - log det C]`` with ``S = chol chol^T``.
    """
    D = true_mean.shape[-1]
    true_chol = torch.linalg.cholesky(true_cov)
    a = torch.linalg.solve_triangular(chol, true_chol, upper=False)
    trace = (a * a).sum((-2, -1))
    z = torch.linalg.solve_triangular(chol, (mean - true_mean).unsqueeze(-1), upper=False).squeeze(-1)
    logdet_model = 2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    logdet_true = 2 * torch.log(torch.diagonal(true_chol, dim1=-2, dim2=-1)).sum(-1)
    return 0.5 * (trace + (z * z).sum(-1) - D + logdet_model - logdet_true)
