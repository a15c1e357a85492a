"""Reference low-bit block estimate (SALE's selection pass): smoothed, symmetrically quantised Q/K logits and
the Relative Attention Score test per (query block, key block).

Smoothing: ``Khat = K - mean_seq(K)`` (softmax-invariant), ``Qhat = Q - mean_seq(Q)`` and a per-key bias
``b_j = mean(Q) . Khat_j`` so that ``q_i . Khat_j = Qhat_i . Khat_j + b_j`` exactly. Quantisation: per group of
``group_size`` consecutive rows, ``sigma = max|x| / qmax`` (``qmax = 2^(bits-1) - 1``: 7 for int4, 127 for
int8) and ``xq = round(x / sigma)``. Estimated raw logits ``S~_ij = (Qq_i . Kq_j) sigma_i sigma_j + b_j``.
A block is kept when some valid pair has ``scale * S~_ij - lse_i >= ln(tau_h)`` where ``lse_i`` is the LSE of an
exact pass over a subset of keys (SALE: sink + local window) and ``tau_h`` the head's threshold; ``tau_h = 0``
keeps every block the causal mask touches (the head runs dense).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

from litctx_kernels.layouts import BlockLayout, causal_block_mask, resolve_q_offset
from litctx_kernels.reference.attention import _valid_mask, check_qkv

__all__ = ["LowBitQK", "quantize_lowbit", "quantize_qk_lowbit", "lowbit_scores_reference",
           "lowbit_block_estimate_reference"]


def quantize_lowbit(x: torch.Tensor, bits: int = 4, group_size: int = 1):
    """Symmetric quantisation of ``x [..., N, d]`` with one scale per ``group_size`` rows.

    Returns ``(xq [..., N, d] int8, sigma [..., N] float)`` with ``x ~= xq * sigma[..., None]``; ``|xq| <= qmax``.
    """
    if bits not in (2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"bits must be in 2..8, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    qmax = 2 ** (bits - 1) - 1
    n = x.shape[-2]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.to(work)
    pad = (-n) % group_size
    if pad:
        xw_p = torch.cat([xw, xw.new_zeros(*xw.shape[:-2], pad, xw.shape[-1])], dim=-2)
    else:
        xw_p = xw
    groups = xw_p.reshape(*xw.shape[:-2], -1, group_size * xw.shape[-1])
    amax = groups.abs().amax(-1)
    sigma = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    sigma_rows = sigma.repeat_interleave(group_size, dim=-1)[..., :n]
    xq = torch.round(xw / sigma_rows.unsqueeze(-1)).clamp(-qmax, qmax).to(torch.int8)
    return xq, sigma_rows


class LowBitQK(NamedTuple):
    """Quantised, smoothed queries and keys: ``q_int [B, Hq, Nq, d]`` int8, ``q_scale [B, Hq, Nq]``,
    ``k_int [B, Hk, Nk, d]`` int8, ``k_scale [B, Hk, Nk]``, ``bias [B, Hq, Nk]`` (``mean(Q) . Khat_j``)."""

    q_int: torch.Tensor
    q_scale: torch.Tensor
    k_int: torch.Tensor
    k_scale: torch.Tensor
    bias: torch.Tensor


def quantize_qk_lowbit(q: torch.Tensor, k: torch.Tensor, bits: int = 4, group_size: int = 1) -> LowBitQK:
    """Smooth (mean-subtract) and quantise ``q [B, Hq, Nq, d]`` and ``k [B, Hk, Nk, d]``."""
    b, hq, hk, _, _, d, _ = check_qkv(q, k, k)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw = q.to(work), k.to(work)
    mu_q = qw.mean(dim=2, keepdim=True)
    khat = kw - kw.mean(dim=2, keepdim=True)
    g = hq // hk
    bias = torch.matmul(mu_q.reshape(b, hk, g, d), khat.transpose(-1, -2)).reshape(b, hq, -1)
    q_int, q_scale = quantize_lowbit(qw - mu_q, bits, group_size)
    k_int, k_scale = quantize_lowbit(khat, bits, group_size)
    return LowBitQK(q_int, q_scale, k_int, k_scale, bias)


def lowbit_scores_reference(lb: LowBitQK, rows: Optional[slice] = None) -> torch.Tensor:
    """Estimated raw logits ``S~ [B, Hq, rows, Nk]`` (before the softmax scale). Integer dot products are
    accumulated in floating point, which is exact for int8 values and ``d <= 1024``."""
    rows = rows or slice(None)
    qi, qs = lb.q_int[:, :, rows], lb.q_scale[:, :, rows]
    b, hq, c, d = qi.shape
    hk = lb.k_int.shape[1]
    work = lb.bias.dtype
    dots = torch.matmul(qi.to(work).reshape(b, hk, (hq // hk) * c, d),
                        lb.k_int.to(work).transpose(-1, -2)).view(b, hq, c, -1)
    ks = lb.k_scale.repeat_interleave(hq // hk, dim=1)
    return dots * qs.unsqueeze(-1) * ks.unsqueeze(-2) + lb.bias.unsqueeze(-2)


def check_estimate_inputs(lse: torch.Tensor, tau: Union[float, Sequence[float], torch.Tensor], b: int, hq: int,
                          n_q: int) -> torch.Tensor:
    """Validate an estimate's ``lse [B, Hq, Nq]`` and thresholds; returns ``tau`` as ``[Hq]`` float64."""
    if tuple(lse.shape) != (b, hq, n_q):
        raise ValueError(f"lse must be [B, Hq, Nq]=[{b}, {hq}, {n_q}], got {list(lse.shape)}")
    tau_t = torch.as_tensor(tau, dtype=torch.float64).flatten()
    if tau_t.numel() == 1:
        tau_t = tau_t.expand(hq)
    if tau_t.numel() != hq or (tau_t < 0).any():
        raise ValueError(f"tau must be one non-negative value or {hq} (one per query head), got {tau_t.tolist()}")
    return tau_t


def lowbit_block_estimate_reference(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                                    tau: Union[float, Sequence[float], torch.Tensor], *,
                                    scale: Optional[float] = None, block_q: int = 64, block_k: int = 32,
                                    bits: int = 4, group_size: int = 1, causal: bool = True,
                                    q_offset: Optional[int] = None) -> BlockLayout:
    """Blocks whose estimated Relative Attention Score reaches ``tau`` -> a ``[B, Hq]`` :class:`BlockLayout`.

    Args:
        q, k: ``[B, Hq, Nq, d]`` and ``[B, Hk, Nk, d]``.
        lse: ``[B, Hq, Nq]`` natural-log LSE of the exact pass the scores are relative to.
        tau: one threshold, or one per query head (``[Hq]``); 0 keeps every (causal) block of that head.
    Processes one query block at a time: memory ``O(block_q x Nk)`` per head.
    """
    b, hq, _, n_q, n_k, d, _ = check_qkv(q, k, k)
    tau_t = check_estimate_inputs(lse, tau, b, hq, n_q)
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lb = quantize_qk_lowbit(q, k, bits, group_size)
    work = lb.bias.dtype
    log_tau = torch.where(tau_t > 0, torch.log(tau_t.clamp_min(1e-300)), torch.full_like(tau_t, -math.inf))
    log_tau = log_tau.to(work).to(q.device).view(1, hq, 1, 1)
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    keep = torch.zeros(b, hq, mq, mk, dtype=torch.bool, device=q.device)
    kb = torch.arange(n_k, device=q.device) // block_k
    for m in range(mq):
        sl = slice(m * block_q, min((m + 1) * block_q, n_q))
        rows = torch.arange(sl.start, sl.stop, device=q.device).view(1, 1, -1)
        valid = _valid_mask(rows + off, n_k, causal, None, None, None, None, rows)  # [1, 1, c, Nk]
        ras = scale * lowbit_scores_reference(lb, sl) - lse[:, :, sl].to(work).unsqueeze(-1)
        hit = (ras >= log_tau) & valid  # [B, Hq, c, Nk]
        col_hit = hit.any(dim=2)  # [B, Hq, Nk]
        keep[:, :, m] = _any_per_block(col_hit, kb, mk)
    if causal:
        keep &= causal_block_mask(n_q, n_k, block_q, block_k, q_offset=off, device=q.device)
    return BlockLayout.from_block_mask(keep, block_q, block_k, (n_q, n_k))


def _any_per_block(col_hit: torch.Tensor, kb: torch.Tensor, mk: int) -> torch.Tensor:
    """``[..., Nk]`` bool -> ``[..., Mk]``: any True within each key block."""
    out = torch.zeros(*col_hit.shape[:-1], mk, dtype=torch.int32, device=col_hit.device)
    out.index_add_(-1, kb, col_hit.to(torch.int32))
    return out > 0
