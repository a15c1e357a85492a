"""SALE (arXiv 2505.24179): fine-grained sparse prefill from a low-bit estimate of the attention logits.

Per head: an **exact pass** over the sink (first ``sink`` tokens) and the local band (the ``local`` keys
before each query block, plus its causal diagonal) gives each row's log-sum-exp ``LSE^SL_i``. The
**estimate**: mean-subtracted queries and keys quantised to ``bits`` (int4 by default) give approximate logits
``S~_ij``; the Relative Attention Score ``exp(scale S~_ij - LSE^SL_i)`` over-estimates the true probability
(its denominator is only the sink + local mass), and a ``block_q x block_k`` tile (64 x 32) is computed when
some pair reaches the head's threshold ``tau_h`` (:func:`litctx_kernels.lowbit_block_estimate`: on CUDA the fused
Triton kernel K4, whose flags equal :func:`litctx_kernels.lowbit_block_estimate_reference`; on CPU torch with an exact
tile bound, equal up to ties within float rounding).
``tau_h = 0`` runs the head dense. The **compute pass** covers the selected tiles outside the sink + local
band through :func:`litctx_kernels.attention`, merged with the exact pass by :func:`litctx_kernels.merge_lse` (on
CUDA the routing table may run the 64 x 32 layout at K1's 128 x 64 tile with the fine blocks masked per element,
``triton_tile``: the same output, the selection unchanged).

:func:`calibrate_thresholds` sets ``tau_h`` per head against an error budget ``theta``: starting at
``tau_0 = 0.008``, halve until the summed absolute output error ``sum_{i,d} |O - O~| < theta * N``; a head that
needs ``tau <= 1e-4`` runs dense.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

import litctx_kernels
from litctx_kernels import BlockLayout
from litctx_kernels.layouts import causal_block_mask
from lightning_modules.sparse_prefill.estimators import Selection, _check
from litctx_common.timing import Stopwatch

__all__ = ["SALEEstimator", "sink_local_layout", "calibrate_thresholds"]


def sink_local_layout(n: int, block_q: int, block_k: int, sink: int, local: int, device=None) -> BlockLayout:
    """The exact pass's blocks (``B = H = 1``): key blocks holding the first ``sink`` tokens, and for query
    block ``m`` the key blocks from ``m * block_q - local`` through its diagonal."""
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    kb = torch.arange(mk, device=device).view(1, -1)
    start = torch.clamp(torch.arange(mq, device=device) * block_q - local, min=0).view(-1, 1) // block_k
    keep = (kb < math.ceil(sink / block_k)) | (kb >= start)
    keep &= causal_block_mask(n, n, block_q, block_k, device=device)
    return BlockLayout.from_block_mask(keep[None, None], block_q, block_k, (n, n))


class SALEEstimator:
    """SALE's selection with its exact sink + local pass (see the module docstring).

    Args:
        cfg: SALE's estimate fields, :class:`~lightning_modules.sparse_prefill.config.SALEEstimateFields`
            (``bits`` / ``group_size`` of the quantisation, the ``block_q x block_k`` selection and compute tile,
            the exact pass's ``sink`` and ``local`` tokens), validated there.
        tau: threshold, one value or one per query head (0 = dense head); the method config gives it
            (``SALEConfig.tau`` or a row of its ``tau_table``).
    """

    name = "sale"

    def __init__(self, cfg: Any, tau: Union[float, Sequence[float]]) -> None:
        tau_t = torch.as_tensor(tau, dtype=torch.float64).flatten()
        if tau_t.numel() == 0 or bool((tau_t < 0).any()) or not bool(torch.isfinite(tau_t).all()):
            raise ValueError(f"sale.tau must be finite and >= 0 (one value or one per head), got {tau}")
        self.tau = tau_t
        self.bits, self.group_size = int(cfg.bits), int(cfg.group_size)
        self.block_q, self.block_k, self.sink, self.local = int(cfg.block_q), int(cfg.block_k), int(cfg.sink), int(cfg.local)

    def _tau(self, n_heads: int) -> torch.Tensor:
        if self.tau.numel() == 1:
            return self.tau.expand(n_heads)
        if self.tau.numel() != n_heads:
            raise ValueError(f"SALE has {self.tau.numel()} thresholds for {n_heads} query heads")
        return self.tau

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               tau: Optional[torch.Tensor] = None) -> Selection:
        _check(q, k)
        b, hq, n, _ = q.shape
        exact_layout = sink_local_layout(n, self.block_q, self.block_k, self.sink, self.local, q.device)
        exact = litctx_kernels.attention(q, k, v, scale=scale, causal=True, layout=exact_layout)
        with Stopwatch(q) as sw:  # the estimate only (the exact pass above counts as compute); synced on CUDA
            tau = self._tau(hq) if tau is None else tau
            keep = litctx_kernels.lowbit_block_estimate(q, k, exact[1], tau, scale=scale, block_q=self.block_q,
                                                 block_k=self.block_k, bits=self.bits, group_size=self.group_size)
            layout = BlockLayout.from_block_mask(keep.to_block_mask() | exact_layout.to_block_mask(), self.block_q,
                                                 self.block_k, (n, n))
        return Selection(layout, exact=exact, exact_layout=exact_layout.expand(b, hq), seconds=sw.seconds)


def calibrate_thresholds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, theta: float,
                         estimator: SALEEstimator, tau0: float, tau_min: float) -> torch.Tensor:
    """Per-query-head thresholds ``[Hq]`` (float64) for one prefill of ``q [B, Hq, N, d]``, ``k, v [B, Hk, N,
    d]``: the largest ``tau0 / 2^i`` whose output error ``sum_{i,d} |O - O~|`` stays below ``theta * N`` for
    every batch row; 0 (dense) when none above ``tau_min`` does. ``estimator`` gives the estimate's fields (its
    own ``tau`` is not used); the defaults of ``theta``, ``tau0``, ``tau_min`` live in
    :class:`~lightning_modules.sparse_prefill.callbacks.SALECalibrationConfig`."""
    from lightning_modules.sparse_prefill.attention import sparse_prefill_attention

    if theta <= 0 or tau0 <= 0:
        raise ValueError(f"theta and tau0 must be > 0, got theta={theta}, tau0={tau0}")
    est = estimator
    b, hq, n, _ = q.shape
    dense, _ = litctx_kernels.attention(q, k, v, scale=scale, causal=True)
    result = torch.zeros(hq, dtype=torch.float64)
    open_heads = torch.ones(hq, dtype=torch.bool)
    tau = tau0
    while tau > tau_min and bool(open_heads.any()):
        out, _, _ = sparse_prefill_attention(q, k, v, est, scale, tau=torch.full((hq,), tau, dtype=torch.float64))
        err = (out.float() - dense.float()).abs().sum((-1, -2))  # [B, Hq]
        ok = (err < theta * n).all(0).cpu() & open_heads
        result[ok] = tau
        open_heads &= ~ok
        tau /= 2
    return result
