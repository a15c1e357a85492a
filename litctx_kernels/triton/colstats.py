"""K5: per-key attention statistics over a query window (KV eviction scores, indexer targets), in Triton.

``_colstats_kernel`` - grid ``(key tiles, B * Hq)``. One program owns a key tile of one query head and walks the
window rows that can see it (causal / sliding-window band), recomputing ``P_ij = exp(s_ij - LSE_i)`` from the
stored LSE (no ``N^2`` storage), and accumulates per key ``j``: ``sum_i P_ij``, ``sum_i P_ij^2``,
``sum_i P_ij^2 o_i`` (a ``P^2^T O`` product, fp32) and ``sum_i P_ij^2 ||o_i||^2``. All accumulators are fp32; every
output element (also keys no window row sees) is written. With ``LOGIT`` (``moments="logit"``) it also
accumulates the logit-weighted moments of OBCache (``sum_i P^2 z``, ``sum_i P^2 z o_i``, ``sum_i (P z)^2``,
``sum_i (P z)^2 o_i``, ``sum_i (P z)^2 ||o_i||^2`` with ``z`` the scaled natural-log logit).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from litctx_kernels.layouts import resolve_q_offset
from litctx_kernels.reference.colstats import MOMENTS, ColStats
from litctx_kernels.triton._compat import attention_config, check_device, check_offsets, device_guard, kernel_dtype, next_pow2
from litctx_kernels.triton.attention import _pair_mask, triton_attention

__all__ = ["ColStats", "triton_attention_colstats"]


@triton.jit
def _colstats_kernel(
    Q, K, OUT, LSE, PSUM, P2SUM, P2O, P2ON, ZSUM, ZO, Z2SUM, Z2O, Z2ON,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, sob, soh, som, sod, slb, slh, slm,
    spb, sph, spn, sxb, sxh, sxn, sxd,
    n_heads, group, n_q, n_k, row0, q_offset, window, qk_scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr, LOGIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    hk = h // group
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_in = offs_n < n_k
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=col_in[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)

    p_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    p2_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    p2_on = tl.zeros([BLOCK_N], dtype=tl.float32)
    p2_o = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    z_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    z2_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    z2_on = tl.zeros([BLOCK_N], dtype=tl.float32)
    z_o = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    z2_o = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # window rows [row0, n_q) that can see this key tile
    end_n = tl.minimum(start_n + BLOCK_N, n_k)
    r_lo = start_n * 0 + row0
    r_hi = start_n * 0 + n_q
    if CAUSAL:
        r_lo = tl.maximum(r_lo, start_n - q_offset)
    if HAS_WINDOW:
        r_hi = tl.minimum(r_hi, end_n - 1 + window - q_offset)
    q_base = Q + b * sqb + h * sqh
    o_base = OUT + b * sob + h * soh
    l_base = LSE + b * slb + h * slh
    for start_m in range(r_lo, r_hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < r_hi
        w_rows = rows - row0  # index into the window outputs o / lse
        q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
        o = tl.load(o_base + w_rows[:, None] * som + offs_dv[None, :] * sod,
                    mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0).to(tl.float32)
        lse = tl.load(l_base + w_rows * slm, mask=row_ok, other=float("-inf"))
        lse2 = tl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634, float("inf"))
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale      # [BLOCK_N, BLOCK_M]
        valid = _pair_mask(offs_n[:, None], rows[None, :] + q_offset, n_k, window, CAUSAL, HAS_WINDOW)
        valid = valid & row_ok[None, :]
        pt = tl.where(valid, tl.exp2(st - lse2[None, :]), 0.0)
        p2 = pt * pt
        p_sum += tl.sum(pt, 1)
        p2_sum += tl.sum(p2, 1)
        on = tl.sum(o * o, 1)
        p2_on += tl.sum(p2 * on[None, :], 1)
        p2_o += tl.dot(p2, o, input_precision="ieee")
        if LOGIT:
            z = tl.where(valid, st * 0.6931471805599453, 0.0)  # natural-log scaled logit
            p2z = p2 * z
            p2z2 = p2z * z
            z_sum += tl.sum(p2z, 1)
            z2_sum += tl.sum(p2z2, 1)
            z2_on += tl.sum(p2z2 * on[None, :], 1)
            z_o += tl.dot(p2z, o, input_precision="ieee")
            z2_o += tl.dot(p2z2, o, input_precision="ieee")

    tl.store(PSUM + b * spb + h * sph + offs_n * spn, p_sum, mask=col_in)
    tl.store(P2SUM + b * spb + h * sph + offs_n * spn, p2_sum, mask=col_in)
    tl.store(P2ON + b * spb + h * sph + offs_n * spn, p2_on, mask=col_in)
    tl.store(P2O + b * sxb + h * sxh + offs_n[:, None] * sxn + offs_dv[None, :] * sxd, p2_o,
             mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV))
    if LOGIT:
        tl.store(ZSUM + b * spb + h * sph + offs_n * spn, z_sum, mask=col_in)
        tl.store(Z2SUM + b * spb + h * sph + offs_n * spn, z2_sum, mask=col_in)
        tl.store(Z2ON + b * spb + h * sph + offs_n * spn, z2_on, mask=col_in)
        tl.store(ZO + b * sxb + h * sxh + offs_n[:, None] * sxn + offs_dv[None, :] * sxd, z_o,
                 mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV))
        tl.store(Z2O + b * sxb + h * sxh + offs_n[:, None] * sxn + offs_dv[None, :] * sxd, z2_o,
                 mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV))


def triton_attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                              causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                              q_window: Optional[int] = None, o: Optional[torch.Tensor] = None,
                              lse: Optional[torch.Tensor] = None, moments: str = "output") -> ColStats:
    """Per-key statistics of softmax attention over the last ``q_window`` query rows (K5; no gradients).

    Args:
        q: ``[B, Hq, Nq, d]``; k: ``[B, Hk, Nk, d]``; v: ``[B, Hk, Nk, dv]`` (GQA by head mapping; any strides).
        scale: default ``1/sqrt(d)``.
        causal, q_offset, window: the element mask of :func:`~litctx_kernels.triton.triton_attention` (no layout);
            ``q_offset`` (default ``Nk - Nq``) refers to the full ``q``.
        q_window: the window = the last ``q_window`` rows of ``q`` (``None``: all rows).
        o, lse: ``[B, Hq, W, dv]`` / ``[B, Hq, W]`` attention output and natural-log LSE of the window rows
            (``W = q_window``); computed with :func:`triton_attention` when either is missing.
        moments: ``attention`` / ``output`` give the four statistics below (the kernel computes them
            together); ``logit`` adds the logit-weighted moments of :class:`ColStats`.

    Returns:
        :class:`ColStats` of float32 tensors: ``p_sum [B, Hq, Nk]``, ``p2_sum [B, Hq, Nk]``,
        ``p2_o [B, Hq, Nk, dv]``, ``p2_o_norm2 [B, Hq, Nk]`` (sums over the window rows ``i`` of ``P_ij``,
        ``P_ij^2``, ``P_ij^2 o_i``, ``P_ij^2 ||o_i||^2``).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [B, H, N, d], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    b, hq, n_q, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[-1] != d or tuple(v.shape[1:3]) != tuple(k.shape[1:3]):
        raise ValueError(f"inconsistent shapes: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    hk, n_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hk} (GQA)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if window is not None and (not causal or int(window) < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1")
    if moments not in MOMENTS:
        raise ValueError(f"moments={moments!r}: valid values are {', '.join(MOMENTS)}")
    logit = moments == "logit"
    w = n_q if q_window is None else int(q_window)
    if not 0 < w <= n_q:
        raise ValueError(f"q_window must be in [1, Nq={n_q}], got {q_window}")
    check_device(q, k, v)
    check_offsets(q=q, k=k, v=v)
    off = resolve_q_offset(n_q, n_k, q_offset)
    sc = float(1.0 / math.sqrt(d) if scale is None else scale)
    row0 = n_q - w
    with torch.no_grad(), device_guard(q):
        if o is None or lse is None:
            o, lse = triton_attention(q[:, :, row0:], k, v, scale=sc, causal=causal, q_offset=off + row0,
                                      window=window)
        if tuple(o.shape) != (b, hq, w, dv) or tuple(lse.shape) != (b, hq, w):
            raise ValueError(f"o {list(o.shape)} / lse {list(lse.shape)} must be [B, Hq, W, dv] / [B, Hq, W] "
                             f"with W=q_window={w}")
        check_offsets(o=o)
        kd = kernel_dtype(q.dtype)
        qk, kk = q.to(kd), k.to(kd)
        o = o.to(torch.float32) if o.dtype == torch.bfloat16 and kd == torch.float32 else o
        lse = lse.to(device=q.device, dtype=torch.float32)
        p_sum = torch.empty((b, hq, n_k), dtype=torch.float32, device=q.device)
        p2_sum = torch.empty((b, hq, n_k), dtype=torch.float32, device=q.device)
        p2_on = torch.empty((b, hq, n_k), dtype=torch.float32, device=q.device)
        p2_o = torch.empty((b, hq, n_k, dv), dtype=torch.float32, device=q.device)
        extra = [torch.empty_like(t) for t in (p_sum, p2_o, p_sum, p2_o, p_sum)] if logit else [p_sum] * 5
        if p_sum.numel() == 0:
            return ColStats(p_sum, p2_sum, p2_o, p2_on, *(extra if logit else ()))
        cfg = attention_config("colstats", d, kd)
        grid = (triton.cdiv(n_k, cfg.block_n), b * hq)
        _colstats_kernel[grid](
            qk, kk, o, lse, p_sum, p2_sum, p2_o, p2_on, *extra,
            *qk.stride(), *kk.stride(), *o.stride(), *lse.stride(), *p_sum.stride(), *p2_o.stride(),
            hq, hq // hk, n_q, n_k, row0, off, int(window) if window is not None else 0, sc * 1.4426950408889634,
            HEAD_D=d, HEAD_DV=dv, BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
            DOT_PREC="ieee" if kd == torch.float32 else None, LOGIT=logit, **cfg.launch_kwargs(),
        )
    return ColStats(p_sum, p2_sum, p2_o, p2_on, *(extra if logit else ()))
