"""Pooled block estimates for sparse prefill in plain torch: the one implementation of every piece, and the
references the fused Triton kernels (:mod:`litctx_kernels.triton.estimate`) are checked against.

Each estimate reads the post-RoPE ``q [B, Hq, N, d]`` and ``k [B, Hk, N, d]`` of one prefill call (queries =
keys, causal) and scores the ``M x M`` (query block, key block) tiles of ``M = ceil(N / block)`` blocks:

* **mean pooling** (:func:`pool_blocks`): the float32 mean of each block of ``block`` rows (the ragged last block
  averages its real rows); keys are pooled once per kv head and shared by the query heads of the group (GQA).
* **pooled scores** (:func:`mean_pool_block_mask`): ``Q_bar K_bar^T * scale``, a causal block softmax per row
  (:func:`causal_block_softmax`), top-p per row (:func:`top_p_mask`).
* **Prism's dual band** (:func:`prism_band_logits`, :func:`prism_block_mask`): the pooled dims split into a
  high-frequency and a low-frequency band (:func:`band_dims`, rotate-half layout), each scored
  ``Q_bar_z K_bar_z^T / (sqrt(d_z) tau_z)`` with the energy temperature ``tau_z = sqrt(d_z / d) (RMS(Q_bar_z) /
  RMS(Q_bar)) (RMS(K_bar_z) / RMS(K_bar))`` (RMS over the blocks and dims of one head), a causal block softmax and
  top-p per band, and the union of the two bands.
* **XAttention's anti-diagonal scores** (:func:`xattention_block_scores`): with stride ``S`` the dot product of
  the reshaped rows ``[q[rS + S - 1], ..., q[rS]]`` and ``[k[cS], ..., k[cS + S - 1]]`` sums an anti-diagonal of an
  ``S x S`` tile; scaled by ``scale / S``, a causal softmax over the ``N_pad / S`` columns (zero-padded to whole
  blocks: the padded rows and columns take part, as in XAttention), probabilities summed per block; each row keeps
  its largest blocks until ``threshold`` of its mass (:func:`cumulative_threshold_mask`).
* :func:`finish_block_mask`: the causal restriction plus the sink column (key block 0) and the diagonal.

The ``*_layout_reference`` functions return the finished selection as a ``[B, Hq]``
:class:`~litctx_kernels.layouts.BlockLayout` built without a host synchronisation (``kv_indices`` padded to ``M``
columns, :meth:`~litctx_kernels.layouts.BlockLayout.from_block_mask` with ``sync=False``); their signatures are
those of the fused ``triton_*_layout`` functions.

**Top-p and ties.** Entry ``r`` of a row sorted in descending order (stable: equal values keep their index
order) is kept iff the mass before it is ``< p``, and zero entries are never kept. The Triton kernels apply the
same rule without sorting (a threshold search, then equal values ranked by index), so equal values are broken the
same way; both compute the mass before an entry in float32 but sum it in different orders, so an entry whose
mass before it lies within float rounding of ``p`` may be kept by one and not the other.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple, Union

import torch
import torch.nn.functional as F

from litctx_kernels.layouts import BlockLayout, causal_block_mask

__all__ = [
    "pool_blocks",
    "causal_block_softmax",
    "top_p_mask",
    "cumulative_threshold_mask",
    "finish_block_mask",
    "band_dims",
    "band_pairs",
    "band_rms",
    "prism_band_logits",
    "prism_block_mask",
    "mean_pool_block_mask",
    "xattention_block_scores",
    "xattention_block_mask",
    "check_estimate_qk",
    "check_mass",
    "expand_heads",
    "prism_layout_reference",
    "mean_pool_layout_reference",
    "xattention_layout_reference",
]


def check_estimate_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """``q [B, Hq, N, d]`` and ``k [B, Hk, N, d]`` of one prefill (queries = keys), ``Hk`` dividing ``Hq``."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q [B, Hq, N, d] and k [B, Hk, N, d] expected, got {list(q.shape)} and {list(k.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"sparse prefill estimates a prefill (queries = keys); got Nq={q.shape[2]}, Nk={k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")


def check_mass(name: str, p: float) -> float:
    """``p`` as a float in ``(0, 1]`` (a top-p mass or a threshold), else a ``ValueError`` naming ``name``."""
    p = float(p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {p}")
    return p


def pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of each block of ``block`` rows of ``x [..., N, d]`` -> ``[..., ceil(N / block), d]`` (float32; the
    last block averages its real rows only: ``F.avg_pool1d`` with ``ceil_mode=True`` and no padding)."""
    *lead, n, d = x.shape
    rows = x.float().reshape(-1, n, d).transpose(1, 2)  # [R, d, N]: pool along the sequence
    pooled = F.avg_pool1d(rows, block, stride=block, ceil_mode=True)
    return pooled.transpose(1, 2).reshape(*lead, pooled.shape[-1], d)


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[B, Hk, ...]`` -> ``[B, n_heads, ...]`` (GQA: query head ``h`` reads kv head ``h // (n_heads / Hk)``); a
    copy unless ``Hk == n_heads``."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def causal_block_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of each row of ``logits [..., M, M]`` over its causal key blocks (``j <= i``)."""
    m = logits.shape[-1]
    causal = torch.ones(m, m, dtype=torch.bool, device=logits.device).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of ``probs [..., M]``: the shortest set of largest entries whose mass reaches ``p`` (entry ``r``
    of the sorted row is kept iff the mass before it is ``< p``; zero entries are never kept)."""
    check_mass("top-p threshold", p)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = (before < p) & (sorted_p > 0)
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def cumulative_threshold_mask(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per row of non-negative ``scores [..., M]``: the largest entries until their sum reaches
    ``threshold x row total`` (XAttention's rule; :func:`top_p_mask` on the normalised row)."""
    total = scores.sum(-1, keepdim=True)
    probs = torch.where(total > 0, scores / total.clamp_min(1e-30), torch.zeros_like(scores))
    return top_p_mask(probs, threshold)


def finish_block_mask(mask: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Restrict ``mask [B, H, M, M]`` to causal blocks and add the sink column and the diagonal."""
    m = mask.shape[-1]
    causal = causal_block_mask(n, n, block, block, device=mask.device)
    out = mask.clone()
    out[..., :, 0] = True
    idx = torch.arange(m, device=mask.device)
    out[..., idx, idx] = True
    return out & causal


def band_dims(d: int, high_fraction: float, low_fraction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dims of the high band (pairs ``[0, high_fraction * d/2)``) and the low band (pairs
    ``[d/2 - low_fraction * d/2, d/2)``) in the rotate-half layout (pair ``j`` = dims ``j`` and ``j + d/2``)."""
    half = d // 2
    n_high, n_low = band_pairs(d, high_fraction, low_fraction)
    high_pairs = torch.arange(0, n_high)
    low_pairs = torch.arange(half - n_low, half)
    return (torch.cat([high_pairs, high_pairs + half]), torch.cat([low_pairs, low_pairs + half]))


def band_pairs(d: int, high_fraction: float, low_fraction: float) -> Tuple[int, int]:
    """RoPE pairs in the high and the low band (each at least one)."""
    half = d // 2
    return max(1, round(high_fraction * half)), max(1, round(low_fraction * half))


def band_rms(x: torch.Tensor) -> torch.Tensor:
    """RMS over blocks and dims, per (batch, head): ``[B, H, M, dz] -> [B, H]``."""
    return x.pow(2).mean((-1, -2)).sqrt()


def prism_band_logits(qb: torch.Tensor, kb: torch.Tensor, high_fraction: float, low_fraction: float,
                      calibrate: bool) -> Dict[str, torch.Tensor]:
    """Prism's calibrated block logits ``[B, H, M, M]`` of each band (``high``, ``low``) from the pooled
    ``qb``, ``kb [B, H, M, d]`` (``kb`` already expanded to the query heads), and the temperatures
    ``tau_high``, ``tau_low [B, H]`` (1 when ``calibrate`` is False)."""
    d = qb.shape[-1]
    rq, rk = band_rms(qb).clamp_min(1e-30), band_rms(kb).clamp_min(1e-30)
    out: Dict[str, torch.Tensor] = {}
    for name, dims in zip(("high", "low"), band_dims(d, high_fraction, low_fraction)):
        dims = dims.to(qb.device)
        qz, kz = qb[..., dims], kb[..., dims]
        dz = dims.numel()
        if calibrate:
            tau = math.sqrt(dz / d) * (band_rms(qz) / rq) * (band_rms(kz) / rk)
        else:
            tau = torch.ones_like(rq)
        tau = tau.clamp_min(1e-6).unsqueeze(-1).unsqueeze(-1)
        out[name] = torch.matmul(qz, kz.transpose(-1, -2)) / (math.sqrt(dz) * tau)
        out[f"tau_{name}"] = tau.squeeze(-1).squeeze(-1)
    return out


def prism_block_mask(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float, high_fraction: float,
                     low_fraction: float, calibrate: bool) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Prism's choice ``[B, Hq, M, M]`` (the union of the two bands' top-p blocks, before
    :func:`finish_block_mask`) and its band logits (:func:`prism_band_logits`)."""
    qb = pool_blocks(q, block)
    kb = expand_heads(pool_blocks(k, block), q.shape[1])
    bands = prism_band_logits(qb, kb, high_fraction, low_fraction, calibrate)
    mask = None
    for name in ("high", "low"):
        keep = top_p_mask(causal_block_softmax(bands[name]), top_p)
        mask = keep if mask is None else mask | keep
    return mask, bands


def mean_pool_block_mask(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float,
                         scale: float) -> torch.Tensor:
    """Mean-pooled block logits ``Q_bar K_bar^T * scale`` over all dims, causal block softmax, top-p per row:
    ``[B, Hq, M, M]`` before :func:`finish_block_mask`."""
    qb = pool_blocks(q, block)
    kb = expand_heads(pool_blocks(k, block), q.shape[1])
    return top_p_mask(causal_block_softmax(torch.matmul(qb, kb.transpose(-1, -2)) * scale), top_p)


def xattention_block_scores(q: torch.Tensor, k: torch.Tensor, *, block: int, stride: int, scale: float,
                            chunk_blocks: int = 16) -> torch.Tensor:
    """XAttention's ``[B, Hq, M, M]`` block scores (see the module docstring); ``chunk_blocks`` query blocks are
    scored per matmul, each chunk against only the key prefix it can see (memory only: the scores do not depend
    on it)."""
    if block % stride:
        raise ValueError(f"XAttention's block ({block}) must be a multiple of its stride ({stride})")
    b, hq, n, d = q.shape
    s = stride
    m = math.ceil(n / block)
    n_pad = m * block
    kq = expand_heads(k, hq).float()
    qf = q.float()
    if n_pad > n:
        qf = torch.cat([qf, qf.new_zeros(b, hq, n_pad - n, d)], 2)
        kq = torch.cat([kq, kq.new_zeros(b, hq, n_pad - n, d)], 2)
    r = n_pad // s
    q_rows = qf.view(b, hq, r, s, d).flip(3).reshape(b, hq, r, s * d)  # q[rS + S-1-s] for s = 0..S-1
    k_rows = kq.view(b, hq, r, s * d)  # k[cS + s]
    t = block // s
    block_scores = q_rows.new_zeros(b, hq, m, m)
    for m0 in range(0, m, chunk_blocks):  # query blocks in chunks, each against its causal key prefix
        m1 = min(m, m0 + chunk_blocks)
        logits = torch.matmul(q_rows[:, :, m0 * t:m1 * t], k_rows[:, :, :m1 * t].transpose(-1, -2)) * (scale / s)
        causal = torch.ones((m1 - m0) * t, m1 * t, dtype=torch.bool, device=q.device).tril(diagonal=m0 * t)
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        block_scores[:, :, m0:m1, :m1] = probs.view(b, hq, m1 - m0, t, m1, t).sum((3, 5))
    return block_scores


def xattention_block_mask(q: torch.Tensor, k: torch.Tensor, *, block: int, stride: int, threshold: float,
                          scale: float, chunk_blocks: int = 16) -> torch.Tensor:
    """XAttention's choice ``[B, Hq, M, M]`` before :func:`finish_block_mask`."""
    scores = xattention_block_scores(q, k, block=block, stride=stride, scale=scale, chunk_blocks=chunk_blocks)
    return cumulative_threshold_mask(scores, threshold)


def _layout(mask: torch.Tensor, n: int, block: int) -> BlockLayout:
    return BlockLayout.from_block_mask(finish_block_mask(mask, n, block), block, block, (n, n), sync=False)


def prism_layout_reference(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float, high_fraction: float,
                           low_fraction: float, calibrate: bool = True, temperatures: bool = False
                           ) -> Union[BlockLayout, Tuple[BlockLayout, torch.Tensor]]:
    """Prism's finished selection as a ``[B, Hq]`` layout (sink column, diagonal, causal); with
    ``temperatures=True`` also ``tau [B, Hq, 2]`` (high band, low band)."""
    check_estimate_qk(q, k)
    check_mass("top_p", top_p)
    mask, bands = prism_block_mask(q, k, block=block, top_p=top_p, high_fraction=high_fraction,
                                   low_fraction=low_fraction, calibrate=calibrate)
    layout = _layout(mask, q.shape[2], block)
    if temperatures:
        return layout, torch.stack([bands["tau_high"], bands["tau_low"]], -1)
    return layout


def mean_pool_layout_reference(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float,
                               scale: float) -> BlockLayout:
    """The mean-pooled estimate's finished selection as a ``[B, Hq]`` layout."""
    check_estimate_qk(q, k)
    return _layout(mean_pool_block_mask(q, k, block=block, top_p=top_p, scale=scale), q.shape[2], block)


def xattention_layout_reference(q: torch.Tensor, k: torch.Tensor, *, block: int, stride: int, threshold: float,
                                scale: float, chunk_blocks: int = 16) -> BlockLayout:
    """XAttention's finished selection as a ``[B, Hq]`` layout."""
    check_estimate_qk(q, k)
    check_mass("threshold", threshold)
    mask = xattention_block_mask(q, k, block=block, stride=stride, threshold=threshold, scale=scale,
                                 chunk_blocks=chunk_blocks)
    return _layout(mask, q.shape[2], block)
