"""Prism (arXiv 2602.08426): spectral-aware block selection.

Mean pooling a block of RoPE-rotated vectors scales RoPE pair ``j`` by ``lambda_j(B)``
(:func:`~lightning_modules.layers.rope.pooled_attenuation`): the fast, high-frequency pairs that
carry relative position (slash / diagonal heads) nearly vanish, so a pooled ``q_bar . k_bar`` cannot see them.
Prism splits the pooled dims into a **high-frequency band** (the first ``high_fraction`` of the pairs) and a
**low-frequency band** (the last ``low_fraction``; the two overlap on the transition pairs), gives each band a
temperature from its energy,

    tau_z = sqrt(d_z / d) * (RMS(Q_bar_z) / RMS(Q_bar)) * (RMS(K_bar_z) / RMS(K_bar)),

scores ``l^z = Q_bar_z K_bar_z^T / (sqrt(d_z) tau_z)`` with a causal block softmax, keeps the top-p blocks of
each band and row, and takes their union plus the sink column and the diagonal. An attenuated band has a
small RMS ratio, hence a small temperature, which amplifies it back.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch

from lightning_modules.sparse_prefill.estimators import (
    BlockEstimator,
    _causal_softmax,
    expand_kv,
    pool_blocks,
    top_p_mask,
)

__all__ = ["PrismEstimator", "band_dims"]


def band_dims(d: int, high_fraction: float, low_fraction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dims of the high band (pairs ``[0, high_fraction * d/2)``) and the low band (pairs
    ``[d/2 - low_fraction * d/2, d/2)``) in the rotate-half layout (pair ``j`` = dims ``j`` and ``j + d/2``)."""
    half = d // 2
    n_high = max(1, round(high_fraction * half))
    n_low = max(1, round(low_fraction * half))
    high_pairs = torch.arange(0, n_high)
    low_pairs = torch.arange(half - n_low, half)
    return (torch.cat([high_pairs, high_pairs + half]), torch.cat([low_pairs, low_pairs + half]))


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS over blocks and dims, per (batch, head): ``[B, H, M, dz] -> [B, H]``."""
    return x.pow(2).mean((-1, -2)).sqrt()


class PrismEstimator(BlockEstimator):
    """Prism's dual-band block estimate (see the module docstring).

    Args:
        cfg: a :class:`~lightning_modules.sparse_prefill.config.PrismConfig`: ``block`` (Prism: 128), ``top_p``
            (the row mass each band must cover; Prism: 0.95 for Llama-3.1, 0.93 for Qwen), ``high_fraction`` /
            ``low_fraction`` (shares of the RoPE pairs in the high band, 0.5: d_high = 64 of d = 128, and the
            low band, 0.75: d_low = 96 of 128, Prism's defaults scaled to any head size) and ``calibrate``
            (energy-based temperatures; False: both temperatures 1).
    """

    name = "prism"

    def __init__(self, cfg: Any) -> None:
        self.block, self.top_p = int(cfg.block), float(cfg.top_p)
        self.high_fraction, self.low_fraction = float(cfg.high_fraction), float(cfg.low_fraction)
        self.calibrate = bool(cfg.calibrate)

    def band_logits(self, q: torch.Tensor, k: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Calibrated block logits ``[B, H, M, M]`` of each band (``high``, ``low``) and their temperatures."""
        d = q.shape[-1]
        qb = pool_blocks(q, self.block)
        kb = pool_blocks(expand_kv(k, q.shape[1]), self.block)
        rq, rk = _rms(qb).clamp_min(1e-30), _rms(kb).clamp_min(1e-30)
        out: Dict[str, torch.Tensor] = {}
        for name, dims in zip(("high", "low"), band_dims(d, self.high_fraction, self.low_fraction)):
            dims = dims.to(q.device)
            qz, kz = qb[..., dims], kb[..., dims]
            dz = dims.numel()
            if self.calibrate:
                tau = math.sqrt(dz / d) * (_rms(qz) / rq) * (_rms(kz) / rk)
            else:
                tau = torch.ones_like(rq)
            tau = tau.clamp_min(1e-6).unsqueeze(-1).unsqueeze(-1)
            out[name] = torch.matmul(qz, kz.transpose(-1, -2)) / (math.sqrt(dz) * tau)
            out[f"tau_{name}"] = tau.squeeze(-1).squeeze(-1)
        return out

    def block_mask(self, q, k, scale) -> Tuple[torch.Tensor, Dict[str, Any]]:
        bands = self.band_logits(q, k)
        mask = None
        for name in ("high", "low"):
            keep = top_p_mask(_causal_softmax(bands[name]), self.top_p)
            mask = keep if mask is None else mask | keep
        return mask, {"tau_high": float(bands["tau_high"].mean()), "tau_low": float(bands["tau_low"].mean())}
