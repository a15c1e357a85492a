"""Block estimators for sparse prefill: which (query block, key block) tiles of causal attention to compute.

Every estimator reads the post-RoPE ``q [B, Hq, N, d]`` and ``k [B, Hk, N, d]`` of one prefill call and returns
a :class:`Selection` (a ``[B, Hq]`` :class:`litctx_kernels.BlockLayout`, plus any exact partial pass it already ran);
:func:`lightning_modules.sparse_prefill.attention.sparse_prefill_attention` computes the selected blocks
through :func:`litctx_kernels.attention` and merges partial passes with :func:`litctx_kernels.merge_lse`.

* :class:`DenseEstimator` - every causal block (the reference point).
* :class:`MeanPoolEstimator` - block-mean-pooled ``Q K^T`` (all dims), causal block softmax, top-p per row
  (the pooled estimate of FlexPrefill's query-aware mode and MInference's block-sparse pattern).
* :class:`XAttentionEstimator` - XAttention's strided anti-diagonal scores summed per block, threshold on the
  cumulative row mass.
* :class:`FlexPrefillEstimator` - FlexPrefill: the last queries' exact attention decides between a pooled
  query-aware pattern and a vertical-slash pattern (Jensen-Shannon test), each covering ``gamma`` of the mass.
* :class:`OracleBlockEstimator` - a reference, not a method: the exact block attention mass (a dense pass),
  normalised per query-block row, top-p per row: what a perfect estimate at the same top-p would keep (it tells
  an estimator's error from the cost of the sparsity itself).
* Prism and SALE live in :mod:`~lightning_modules.sparse_prefill.prism` and
  :mod:`~lightning_modules.sparse_prefill.sale`.

All selections keep the sink column (key block 0) and the causal diagonal block of every query row.

The pooling, scoring and selection helpers live in :mod:`litctx_kernels.reference.estimate` (re-exported here). On
CUDA, the mean-pooled, XAttention and Prism estimates run fused Triton kernels that write the layout directly
(:mod:`litctx_kernels.block_estimate`, same blocks up to float-rounding near ties); on CPU the torch path.

Every estimator is built from its method config (:mod:`~lightning_modules.sparse_prefill.config`, e.g.
``MeanPoolEstimator(MeanPoolConfig(block=64))`` or ``MeanPoolConfig(block=64).estimator()``): the constructors
have no defaults of their own, so a default lives only in the config dataclass, which also validates it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from litctx_kernels import BlockLayout
from litctx_kernels.block_estimate import block_estimate_backend, mean_pool_layout, xattention_layout
from litctx_kernels.reference.estimate import (  # noqa: F401  (pool_blocks ... finish_block_mask: re-exported)
    causal_block_softmax as _causal_softmax,
    check_estimate_qk as _check,
    expand_heads as expand_kv,
    cumulative_threshold_mask,
    finish_block_mask,
    mean_pool_block_mask,
    pool_blocks,
    top_p_mask,
    xattention_block_mask,
)
from litctx_common.timing import Stopwatch

__all__ = [
    "Selection",
    "BlockEstimator",
    "DenseEstimator",
    "MeanPoolEstimator",
    "XAttentionEstimator",
    "FlexPrefillEstimator",
    "OracleBlockEstimator",
    "block_attention_mass",
    "pool_blocks",
    "expand_kv",
    "top_p_mask",
    "cumulative_threshold_mask",
    "finish_block_mask",
]


@dataclass
class Selection:
    """What an estimator chose for one prefill call.

    Attributes:
        layout: the blocks attention covers (``[B, Hq]``; None = dense causal), exact partial passes included.
        exact: ``(o, lse)`` of an exact pass the estimator already ran (SALE's sink + local pass), or None.
        exact_layout: the blocks of that pass (a subset of ``layout``).
        seconds: wall time of the estimate itself (the exact pass excluded), from
            :class:`litctx_common.timing.Stopwatch` (synchronised on CUDA).
        info: estimator-specific details (e.g. FlexPrefill's per-head mode).
    """

    layout: Optional[BlockLayout]
    exact: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    exact_layout: Optional[BlockLayout] = None
    seconds: float = 0.0
    info: Dict[str, Any] = field(default_factory=dict)


class BlockEstimator(ABC):
    """Base: ``select(q, k, v, scale) -> Selection``; subclasses set ``block`` and implement :meth:`block_mask`.

    An estimator with a fused kernel (Prism, mean pooling, XAttention) also implements :meth:`fused_layout`;
    :meth:`select` runs it when :func:`litctx_kernels.block_estimate.block_estimate_backend` picks ``triton``
    (CUDA tensors by default; CPU tensors only with ``backend = "triton"`` under ``TRITON_INTERPRET=1``), and the
    torch path (:meth:`block_mask`) otherwise. Both select the same blocks (up to float-rounding ties,
    :mod:`litctx_kernels.triton.estimate`).
    """

    name = "estimator"
    block: int
    backend: Optional[str] = None
    """The estimate's backend: None (``LITCTX_KERNEL_BACKEND``, else auto: fused for CUDA tensors), ``torch``,
    ``triton`` or ``reference`` (= torch here)."""

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Selection:
        _check(q, k)
        n = q.shape[2]
        if n <= self.block:  # a single block: nothing to skip (nothing estimated)
            return Selection(None)
        if self._use_fused(q):
            with Stopwatch(q) as sw:  # the fused kernels: no host synchronisation inside
                layout, extra = self.fused_layout(q, k, scale)
            return Selection(layout, seconds=sw.seconds, info=self.fused_info(extra))  # info read after the sync
        with Stopwatch(q) as sw:  # synchronised on CUDA: the estimate's work, not its kernel launches
            mask, info = self._finished_block_mask(q, k, scale)  # q, k checked above
            layout = BlockLayout.from_block_mask(mask, self.block, self.block, (n, n))
        return Selection(layout, seconds=sw.seconds, info=info)

    def fused_layout(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> Tuple[BlockLayout, Any]:
        """The finished selection from the fused Triton estimate, and what :meth:`fused_info` turns into the
        details dict; estimators without a fused kernel do not override it."""
        raise NotImplementedError(f"{type(self).__name__} has no fused estimate")

    def fused_info(self, extra: Any) -> Dict[str, Any]:
        return {}

    def _use_fused(self, q: torch.Tensor) -> bool:
        if type(self).fused_layout is BlockEstimator.fused_layout:
            return False
        return block_estimate_backend(q, self.backend) == "triton"

    @abstractmethod
    def block_mask(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """The estimator's own choice for ``q [B, Hq, N, d]``, ``k [B, Hk, N, d]``: a boolean ``[B, Hq, M, M]``
        over ``M = ceil(N / block)`` query x key blocks (before the causal restriction and the forced sink
        column and diagonal), and a dict of estimator-specific details."""

    def selected_block_mask(self, q: torch.Tensor, k: torch.Tensor,
                            scale: float) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """Exactly the blocks :meth:`select` computes: :meth:`block_mask` restricted to causal blocks, plus the
        sink column and the diagonal (``[B, Hq, M, M]`` bool), and the details dict."""
        _check(q, k)
        return self._finished_block_mask(q, k, scale)

    def _finished_block_mask(self, q: torch.Tensor, k: torch.Tensor,
                             scale: float) -> Tuple[torch.Tensor, Dict[str, Any]]:
        mask, info = self.block_mask(q, k, scale)
        return finish_block_mask(mask, q.shape[2], self.block), info


class DenseEstimator:
    """Every causal block: plain causal attention (no estimate, so no block mask: not a :class:`BlockEstimator`)."""

    name = "dense"

    def select(self, q, k, v, scale):
        _check(q, k)
        return Selection(None)


class MeanPoolEstimator(BlockEstimator):
    """Mean-pooled block logits ``Q_bar K_bar^T * scale`` over all dims, causal block softmax, top-p per row.

    Args:
        cfg: a :class:`~lightning_modules.sparse_prefill.config.MeanPoolConfig` (``block``: block size, query
            and key; ``top_p``: row mass to cover).
    """

    name = "mean_pool"

    def __init__(self, cfg: Any) -> None:
        self.block, self.top_p = int(cfg.block), float(cfg.top_p)

    def block_mask(self, q, k, scale):
        return mean_pool_block_mask(q, k, block=self.block, top_p=self.top_p, scale=scale), {}

    def fused_layout(self, q, k, scale):
        return mean_pool_layout(q, k, block=self.block, top_p=self.top_p, scale=scale, backend="triton"), None


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_q: int, block_k: int,
                         chunk: int = 256, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[B, Hq, Mq, Mk]``: the summed exact causal attention probabilities of each (query block, key block),
    computed in ``dtype`` (float64 by default: the metrics' exact reference; the oracle estimator selects in
    float32) one chunk of query rows at a time (each row sums to 1, so the whole tensor sums to N)."""
    b, hq, n, d = q.shape
    kq = expand_kv(k, hq).to(dtype)
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    out = torch.zeros(b, hq, mq, mk, dtype=dtype, device=q.device)
    cols = torch.arange(n, device=q.device)
    pad = mk * block_k - n
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(n, start + chunk), device=q.device)
        s = torch.matmul(q[:, :, rows].to(dtype), kq.transpose(-1, -2)) * scale
        s = s.masked_fill(cols.view(1, -1) > rows.view(-1, 1), float("-inf"))
        p = torch.softmax(s, -1)  # [B, H, c, N]
        if pad:
            p = torch.nn.functional.pad(p, (0, pad))
        per_key_block = p.reshape(b, hq, rows.numel(), mk, block_k).sum(-1)  # [B, H, c, Mk]
        out.index_add_(2, rows // block_q, per_key_block)
    return out


class OracleBlockEstimator(BlockEstimator):
    """The exact causal attention mass of every (query block, key block) tile (float32: a selection, not a
    measurement; :func:`block_attention_mass`), each query-block row normalised to 1, top-p per row.

    Args:
        cfg: an :class:`~lightning_modules.sparse_prefill.config.OracleBlocksConfig` (``block``, ``top_p``).
    """

    name = "oracle_blocks"

    def __init__(self, cfg: Any) -> None:
        self.block, self.top_p = int(cfg.block), float(cfg.top_p)

    def block_mask(self, q, k, scale):
        mass = block_attention_mass(q, k, scale, self.block, self.block, dtype=torch.float32)
        probs = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
        return top_p_mask(probs, self.top_p), {}


class XAttentionEstimator(BlockEstimator):
    """XAttention: with stride ``S``, row ``r`` of the reshaped queries concatenates ``q[rS + S - 1 - s]`` and
    row ``c`` of the reshaped keys ``k[cS + s]`` (``s = 0 .. S-1``), so one dot product sums an anti-diagonal of
    an ``S x S`` tile; scaled by ``scale / S``, causal softmax over the ``N / S`` columns, probabilities summed per
    block; each row keeps its largest blocks until ``threshold`` of its mass.

    Args:
        cfg: a :class:`~lightning_modules.sparse_prefill.config.XAttentionConfig` (``block``: a multiple of
            ``stride``; ``stride``: ``S``; ``threshold``: ``tau``; ``chunk_blocks``: query blocks scored per
            matmul, each chunk against only the key prefix it can see).
    """

    name = "xattention"

    def __init__(self, cfg: Any) -> None:
        self.block, self.stride, self.threshold = int(cfg.block), int(cfg.stride), float(cfg.threshold)
        self.chunk_blocks = int(cfg.chunk_blocks)

    def block_mask(self, q, k, scale):
        return xattention_block_mask(q, k, block=self.block, stride=self.stride, threshold=self.threshold,
                                     scale=scale, chunk_blocks=self.chunk_blocks), {}

    def fused_layout(self, q, k, scale):
        return xattention_layout(q, k, block=self.block, stride=self.stride, threshold=self.threshold, scale=scale,
                                 backend="triton"), None


class FlexPrefillEstimator(BlockEstimator):
    """FlexPrefill: exact attention of the last ``last_q`` queries gives the true vertical (column) and slash
    (diagonal) distributions. Per head, if the square-root Jensen-Shannon divergence between the pooled
    estimate ``softmax(mean(q_last) K_bar^T * scale)`` and the true block-vertical distribution is below
    ``tau``, the head is query-aware: per query block, pooled attention covering ``gamma`` of the mass;
    otherwise vertical-slash: the columns and diagonals covering ``gamma`` of their masses.

    Args:
        cfg: a :class:`~lightning_modules.sparse_prefill.config.FlexPrefillConfig` (``block``; ``gamma``: mass
            to cover, Prism's comparison uses 0.95; ``tau``: JSD threshold; ``last_q``: queries of the exact
            slice, FlexPrefill: one block of 128).
    """

    name = "flexprefill"

    def __init__(self, cfg: Any) -> None:
        self.block, self.gamma, self.tau, self.last_q = int(cfg.block), float(cfg.gamma), float(cfg.tau), int(cfg.last_q)

    def block_mask(self, q, k, scale):
        b, hq, n, d = q.shape
        bs = self.block
        m = math.ceil(n / bs)
        kq = expand_kv(k, hq).float()
        w = min(self.last_q, n)
        q_last = q[:, :, n - w:].float()
        logits = torch.matmul(q_last, kq.transpose(-1, -2)) * scale  # [B, H, w, N]
        rows = torch.arange(n - w, n, device=q.device).view(-1, 1)
        cols = torch.arange(n, device=q.device).view(1, -1)
        a_last = torch.softmax(logits.masked_fill(cols > rows, float("-inf")), -1)
        vertical = a_last.mean(2)  # [B, H, N]
        block_idx = torch.arange(n, device=q.device) // bs
        true_blocks = torch.zeros(b, hq, m, device=q.device).index_add_(-1, block_idx, vertical)
        kb = pool_blocks(kq, bs)
        est = torch.softmax(torch.matmul(q_last.mean(2, keepdim=True), kb.transpose(-1, -2)).squeeze(2) * scale, -1)
        mix = 0.5 * (est + true_blocks)

        def kl(p, r):
            return (p * (torch.log(p.clamp_min(1e-30)) - torch.log(r.clamp_min(1e-30)))).sum(-1)

        jsd = (0.5 * kl(est, mix) + 0.5 * kl(true_blocks, mix)).clamp_min(0).sqrt()  # [B, H]
        query_aware = jsd < self.tau
        # query-aware pattern: pooled attention per query block
        qb = pool_blocks(q, bs)
        qa_mask = top_p_mask(_causal_softmax(torch.matmul(qb, kb.transpose(-1, -2)) * scale), self.gamma)
        # vertical-slash pattern
        col_keep = top_p_mask(vertical, self.gamma)  # [B, H, N]
        diag = rows - cols  # offset i - j of every (row, column) of the slice
        flat = a_last.masked_fill(diag < 0, 0.0).reshape(b * hq, w * n)
        offsets = torch.zeros(b * hq, n, device=q.device).index_add_(-1, diag.clamp_min(0).flatten(), flat)
        offsets = offsets.view(b, hq, n)
        slash_keep = top_p_mask(offsets / offsets.sum(-1, keepdim=True).clamp_min(1e-30), self.gamma)
        vs = torch.zeros(b, hq, m, m, dtype=torch.bool, device=q.device)
        col_blocks = torch.zeros(b, hq, m, dtype=torch.int32, device=q.device).index_add_(
            -1, block_idx, col_keep.to(torch.int32)) > 0
        vs |= col_blocks.unsqueeze(-2)
        # a diagonal at offset o crosses key blocks I - o // bs and, unless aligned, I - o // bs - 1
        o = torch.arange(n, device=q.device)
        block_off = torch.zeros(b, hq, m + 1, dtype=torch.int32, device=q.device)
        block_off.index_add_(-1, o // bs, slash_keep.to(torch.int32))
        block_off.index_add_(-1, torch.where(o % bs > 0, o // bs + 1, o // bs), slash_keep.to(torch.int32))
        delta_keep = block_off[..., :m] > 0  # [B, H, m]: diagonal offsets (in blocks) to keep
        i_idx = torch.arange(m, device=q.device).view(-1, 1)
        j_idx = torch.arange(m, device=q.device).view(1, -1)
        delta = (i_idx - j_idx).clamp(min=0, max=m - 1)
        vs |= torch.gather(delta_keep.unsqueeze(-2).expand(b, hq, m, m), -1,
                           delta.expand(b, hq, m, m)) & (j_idx <= i_idx)
        mask = torch.where(query_aware.view(b, hq, 1, 1), qa_mask, vs)
        return mask, {"query_aware_heads": float(query_aware.float().mean())}
