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

from typing import Any, Dict, Tuple

import torch

from lightning_modules.sparse_prefill.estimators import BlockEstimator, expand_kv
from litctx_kernels.block_estimate import prism_layout
from litctx_kernels.reference.estimate import band_dims, pool_blocks, prism_band_logits, prism_block_mask

__all__ = ["PrismEstimator", "band_dims"]


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
        """Calibrated block logits ``[B, H, M, M]`` of each band (``high``, ``low``) and their temperatures
        (:func:`litctx_kernels.reference.estimate.prism_band_logits`)."""
        qb = pool_blocks(q, self.block)
        kb = pool_blocks(expand_kv(k, q.shape[1]), self.block)
        return prism_band_logits(qb, kb, self.high_fraction, self.low_fraction, self.calibrate)

    def block_mask(self, q, k, scale) -> Tuple[torch.Tensor, Dict[str, Any]]:
        mask, bands = prism_block_mask(q, k, block=self.block, top_p=self.top_p, high_fraction=self.high_fraction,
                                       low_fraction=self.low_fraction, calibrate=self.calibrate)
        return mask, {"tau_high": float(bands["tau_high"].mean()), "tau_low": float(bands["tau_low"].mean())}

    def fused_layout(self, q, k, scale):
        """The fused estimate's layout and temperatures ``[B, H, 2]``
        (:func:`litctx_kernels.block_estimate.prism_layout`)."""
        return prism_layout(q, k, block=self.block, top_p=self.top_p, high_fraction=self.high_fraction,
                            low_fraction=self.low_fraction, calibrate=self.calibrate, temperatures=True,
                            backend="triton")

    def fused_info(self, tau):
        return {"tau_high": float(tau[..., 0].mean()), "tau_low": float(tau[..., 1].mean())}
