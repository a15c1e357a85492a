"""K1 / K2: generalised FlashAttention-2 forward and backward in Triton.

One tiled kernel pair serves dense, causal, sliding-window, block-sparse (:class:`~litctx_kernels.layouts.BlockLayout`)
and query-subset (:class:`~litctx_kernels.layouts.QueryIndex`) attention, in softmax or LSSA ("length-scaled softplus
attention") score mode, with grouped-query heads and a log-sum-exp output. See :func:`triton_attention`.

Kernels (all with plain pointer arithmetic and masked loads/stores, so they also run under ``TRITON_INTERPRET=1``):

* ``_attn_fwd_kernel`` - grid ``(query tiles, B * Hq)``. The query tile stays in registers; key tiles are
  visited in three runs (masked / unmasked interior / masked) per key range, where the key range is the
  causal/window band, or each listed layout block intersected with it. Online softmax in base 2 with fp32
  accumulators; rows with no valid key produce ``O = 0`` and ``LSE = -inf``.
* ``_attn_bwd_dq_kernel`` - grid ``(query tiles, B * Hq)``, same iteration as the forward, accumulates dQ.
* ``_attn_bwd_dkdv_kernel`` - grid ``(key tiles, B * Hk)``: one program owns a key tile of one kv head and loops
  over the query heads of its GQA group and over the query tiles that can see the key tile (from the
  transposed layout when one is given), so dK/dV are summed over the group without atomics (deterministic).

Score transform (``LSSA`` constexpr): with ``c = qhat . khat`` (q, k L2-normalised by the wrapper) and
``kappa_i = ln(d) ln(N_i)``, the logit is ``phi = log softplus(kappa_i c)``, computed stably; the backward multiplies
dS by ``phi'(c) = kappa_i sigmoid(kappa_i c) / softplus(kappa_i c)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from litctx_kernels.layouts import BlockLayout, QueryIndex, resolve_q_offset
from litctx_kernels.reference.attention import check_key_mask
from litctx_kernels.triton._compat import (KernelConfig, attention_config, check_device, check_offsets, device_guard,
                                          kernel_dtype, next_pow2)

__all__ = ["triton_attention", "triton_attention_backward"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ------------------------------------------------------------------------------------------------------------
# shared device helpers (also used by gather.py and colstats.py)
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _log1p_pos(u):
    """``log(1 + u)`` for ``u >= 0``, accurate for tiny ``u`` (Goldberg's trick, no libdevice needed)."""
    w = 1.0 + u
    small = w == 1.0
    den = tl.where(small, 1.0, w - 1.0)
    return tl.where(small, u, tl.log(w) * (u / den))


@triton.jit
def _lssa_logits(c, kappa_row):
    """LSSA logits in base 2 and the backward factor, for cosines ``c [BM, BN]`` and ``kappa_row [BM, 1]``-
    broadcastable (or ``[1, BM]`` in the transposed orientation).

    Returns ``(t, fac)``: ``t = log2(softplus(x))`` with ``x = kappa c`` and ``fac = kappa sigmoid(x) / softplus(x)``.
    """
    x = c * kappa_row
    e = tl.exp(-tl.abs(x))
    l1p = _log1p_pos(e)                       # log(1 + exp(-|x|))
    sp = tl.maximum(x, 0.0) + l1p             # softplus(x) > 0
    log_sp = tl.where(x < -15.0, x - 0.5 * e, tl.log(tl.maximum(sp, 1e-30)))
    log_sig = tl.minimum(x, 0.0) - l1p        # log sigmoid(x)
    fac = kappa_row * tl.exp(log_sig - log_sp)
    return log_sp * 1.4426950408889634, fac


@triton.jit
def _lssa_kappa(pos, n_k, window, log_d, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``kappa_i = ln(d) ln(N_i)`` with ``N_i`` the number of keys the causal/window mask alone allows (>= 1)."""
    if CAUSAL:
        n_i = tl.minimum(pos + 1, n_k)
        if HAS_WINDOW:
            n_i = tl.minimum(n_i, window)
    else:
        n_i = pos * 0 + n_k
    n_i = tl.maximum(n_i, 1)
    return log_d * tl.log(n_i.to(tl.float32))


@triton.jit
def _key_range(pos_min, pos_max, n_k, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
    """Key columns a query tile with key positions in ``[pos_min, pos_max]`` may see.

    Returns ``(lo, hi, full_lo, full_hi)``: visit ``[lo, hi)`` (``lo`` tile-aligned); tiles inside
    ``[full_lo, full_hi)`` (both tile-aligned) are valid for every row and need no element mask.
    """
    if CAUSAL:
        hi = tl.minimum(pos_max + 1, n_k)
        full_hi = tl.maximum(tl.minimum(pos_min + 1, n_k), 0)
    else:
        hi = pos_max * 0 + n_k
        full_hi = pos_max * 0 + n_k
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(pos_min - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(pos_max - window + 1, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    else:
        lo = pos_max * 0
        full_lo = pos_max * 0
    return lo, hi, full_lo, full_hi


@triton.jit
def _pair_mask(cols, pos, n_k, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Element mask of the valid (row, key) pairs; ``cols`` and ``pos`` already broadcast against each other."""
    valid = cols < n_k
    if CAUSAL:
        valid = valid & (cols <= pos)
    if HAS_WINDOW:
        valid = valid & (cols > pos - window)
    return valid


# ------------------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tile(acc, l_i, m_i, q, kappa, pos, extra, start_n, k_base, v_base, skn, skd, svn, svd, km_base, skmn, n_k,
              window, qk_scale, offs_n, offs_d, offs_dv,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              MASKED: tl.constexpr, USE_EXTRA: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
              HAS_KMASK: tl.constexpr):
    cols = start_n + offs_n
    col_in = cols < n_k
    kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                 mask=col_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
    s = tl.dot(q, kt, input_precision=DOT_PREC)
    if LSSA:
        t, _fac = _lssa_logits(s, kappa[:, None])
    else:
        t = s * qk_scale
    if HAS_KMASK:
        kcol = tl.load(km_base + cols * skmn, mask=col_in, other=0) != 0
    if MASKED:
        valid = _pair_mask(cols[None, :], pos[:, None], n_k, window, CAUSAL, HAS_WINDOW)
        if USE_EXTRA:
            valid = valid & extra  # [BLOCK_M, 1] (a row's block flag) or [BLOCK_M, BLOCK_N] (fine blocks)
        if HAS_KMASK:
            valid = valid & kcol[None, :]
        t = tl.where(valid, t, float("-inf"))
    elif HAS_KMASK:
        t = tl.where(kcol[None, :], t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(t - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :] * svd,
                mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_range(acc, l_i, m_i, q, kappa, pos, lo, hi, full_lo, full_hi, k_base, v_base, skn, skd, svn, svd, km_base,
               skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr, HAS_KMASK: tl.constexpr):
    """Keys ``[lo, hi)`` (``lo`` tile-aligned): masked tiles before ``full_lo``, unmasked ones up to ``full_hi``,
    masked ones after."""
    b1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    c1 = tl.minimum(tl.maximum(full_hi, b1), hi)
    for start_n in range(lo, b1, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd,
                                  km_base, skmn,
                                  n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL,
                                  HAS_WINDOW, True, False, LSSA, DOT_PREC, HAS_KMASK)
    for start_n in range(b1, c1, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd,
                                  km_base, skmn,
                                  n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL,
                                  HAS_WINDOW, False, False, LSSA, DOT_PREC, HAS_KMASK)
    for start_n in range(c1, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd,
                                  km_base, skmn,
                                  n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL,
                                  HAS_WINDOW, True, False, LSSA, DOT_PREC, HAS_KMASK)
    return acc, l_i, m_i


@triton.jit
def _query_rows(QIDX, b, h, sib, sih, sim, pid_m, n_q, n_out, q_offset, BLOCK_M: tl.constexpr,
                HAS_QIDX: tl.constexpr):
    """Rows of query tile ``pid_m``: ``(offs_m, qrow, row_ok, pos_min, pos_max)``. ``offs_m`` indexes the output
    (compacted when ``HAS_QIDX``), ``qrow`` the query sequence; ``pos_*`` span the valid rows' key positions."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if HAS_QIDX:
        qi = tl.load(QIDX + b * sib + h * sih + offs_m * sim, mask=offs_m < n_out, other=-1)
        row_ok = qi >= 0
        qrow = tl.where(row_ok, qi, 0)
        pos = qrow + q_offset
        pos_min = tl.min(tl.where(row_ok, pos, 1073741824), 0)
        pos_max = tl.max(tl.where(row_ok, pos, -1073741824), 0)
    else:
        row_ok = offs_m < n_q
        qrow = offs_m
        pos_min = pid_m * BLOCK_M + q_offset
        pos_max = tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_q) - 1 + q_offset
    return offs_m, qrow, row_ok, pos_min, pos_max


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, OUT, LSE, QIDX, KVNUM, KVIDX, BMASK, KMASK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sob, soh, som, sod, slb, slh, slm,
    sib, sih, sim, snb, snh, snm, sxb, sxh, sxm, sxk, smb, smh, smq, smk, skmb, skmh, skmn,
    n_heads, group, n_q, n_k, n_out, q_offset, window, qk_scale, log_d, block_q, block_k,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_QIDX: tl.constexpr, LAYOUT: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_KMASK: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last, causal) query tiles first
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    hk = h // group

    offs_m, qrow, row_ok, pos_min, pos_max = _query_rows(QIDX, b, h, sib, sih, sim, pid_m, n_q, n_out, q_offset,
                                                         BLOCK_M, HAS_QIDX)
    pos = qrow + q_offset
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + qrow[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    if LSSA:
        kappa = _lssa_kappa(pos, n_k, window, log_d, CAUSAL, HAS_WINDOW)
    else:
        kappa = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    km_base = KMASK + b * skmb + h * skmh  # the query head's key mask (read only when HAS_KMASK)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, hi, full_lo, full_hi = _key_range(pos_min, pos_max, n_k, window, BLOCK_N, CAUSAL, HAS_WINDOW)

    if LAYOUT == 0:
        acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, kappa, pos, lo, hi, full_lo, full_hi, k_base, v_base,
                                   skn, skd, svn, svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv,
                                   HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, HAS_WINDOW, LSSA, DOT_PREC, HAS_KMASK)
    elif LAYOUT == 1:
        # block lists: the tile lies inside one layout query block (BLOCK_M divides block_q)
        # one flat loop over every key tile of the listed blocks (a loop per block defeats software
        # pipelining: measured 2x slower than dense at full density); every tile takes the element mask
        qb = (pid_m * BLOCK_M) // block_q
        cnt = tl.load(KVNUM + b * snb + h * snh + qb * snm)
        tiles_per_block = block_k // BLOCK_N
        idx_base = KVIDX + b * sxb + h * sxh + qb * sxm
        for t in range(0, cnt * tiles_per_block):
            kb = tl.load(idx_base + (t // tiles_per_block) * sxk)
            start_n = kb * block_k + (t % tiles_per_block) * BLOCK_N
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn,
                                      svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D,
                                      HEAD_DV, CAUSAL, HAS_WINDOW, True, False, LSSA, DOT_PREC, HAS_KMASK)
    elif LAYOUT == 3:
        # a fine layout at this tile (blocks smaller than BLOCK_M x BLOCK_N, e.g. SALE's 64 x 32 at 128 x 64):
        # the coarse lists (BlockLayout.coarsen(BLOCK_M, BLOCK_N): one list per query tile, one key tile per
        # entry) name the tiles, and the fine block mask drops every element outside the fine blocks its row and
        # column fall in, so the result equals the fine layout's
        cnt = tl.load(KVNUM + b * snb + h * snh + pid_m * snm)
        idx_base = KVIDX + b * sxb + h * sxh + pid_m * sxm
        bm_rows = BMASK + b * smb + h * smh + (qrow // block_q) * smq
        for t in range(0, cnt):
            start_n = tl.load(idx_base + t * sxk) * BLOCK_N
            cols = start_n + offs_n
            fine = tl.load(bm_rows[:, None] + (cols // block_k)[None, :] * smk,
                           mask=row_ok[:, None] & (cols < n_k)[None, :], other=0) != 0
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, fine, start_n, k_base, v_base, skn, skd, svn,
                                      svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D,
                                      HEAD_DV, CAUSAL, HAS_WINDOW, True, True, LSSA, DOT_PREC, HAS_KMASK)
    else:
        # compacted rows + layout: per-row lookup of the dense block mask, tiles nobody needs are skipped
        bm_row = BMASK + b * smb + h * smh + (qrow // block_q) * smq
        for start_n in range(lo, hi, BLOCK_N):
            blk_ok = tl.load(bm_row + (start_n // block_k) * smk, mask=row_ok, other=0) != 0
            if tl.max(blk_ok.to(tl.int32), 0) > 0:
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, kappa, pos, blk_ok[:, None], start_n, k_base, v_base,
                                          skn, skd, svn, svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d,
                                          offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, True, LSSA, DOT_PREC,
                                          HAS_KMASK)

    ok = row_ok & (l_i > 0.0)
    l_safe = tl.where(ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    o = tl.where(ok[:, None], o, 0.0)
    lse = tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    out_in = offs_m < n_out
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod, o.to(OUT.dtype.element_ty),
             mask=out_in[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(LSE + b * slb + h * slh + offs_m * slm, lse, mask=out_in)


# ------------------------------------------------------------------------------------------------------------
# backward: dQ
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _dq_tile(dq, q, do, lse2, delta, kappa, pos, extra, start_n, k_base, v_base, skn, skd, svn, svd, km_base, skmn,
             n_k, window, qk_scale, offs_n, offs_d, offs_dv,
             HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             MASKED: tl.constexpr, USE_EXTRA: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
             HAS_KMASK: tl.constexpr):
    cols = start_n + offs_n
    col_in = cols < n_k
    kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                 mask=col_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
    vt = tl.load(v_base + cols[None, :] * svn + offs_dv[:, None] * svd,
                 mask=col_in[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)
    s = tl.dot(q, kt, input_precision=DOT_PREC)
    if LSSA:
        t, fac = _lssa_logits(s, kappa[:, None])
    else:
        t = s * qk_scale
    if HAS_KMASK:
        kcol = tl.load(km_base + cols * skmn, mask=col_in, other=0) != 0
    if MASKED:
        valid = _pair_mask(cols[None, :], pos[:, None], n_k, window, CAUSAL, HAS_WINDOW)
        if USE_EXTRA:
            valid = valid & extra[:, None]
        if HAS_KMASK:
            valid = valid & kcol[None, :]
        t = tl.where(valid, t, float("-inf"))
    elif HAS_KMASK:
        t = tl.where(kcol[None, :], t, float("-inf"))
    p = tl.exp2(t - lse2[:, None])
    dp = tl.dot(do, vt, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    if LSSA:
        ds = ds * fac
        if MASKED:
            ds = tl.where(valid, ds, 0.0)
        elif HAS_KMASK:
            ds = tl.where(kcol[None, :], ds, 0.0)
    dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_range(dq, q, do, lse2, delta, kappa, pos, lo, hi, full_lo, full_hi, k_base, v_base, skn, skd, svn, svd,
              km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr, HAS_KMASK: tl.constexpr):
    b1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    c1 = tl.minimum(tl.maximum(full_hi, b1), hi)
    for start_n in range(lo, b1, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd, km_base,
                      skmn, n_k,
                      window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False,
                      LSSA, DOT_PREC, HAS_KMASK)
    for start_n in range(b1, c1, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd, km_base,
                      skmn, n_k,
                      window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, False, False,
                      LSSA, DOT_PREC, HAS_KMASK)
    for start_n in range(c1, hi, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd, km_base,
                      skmn, n_k,
                      window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False,
                      LSSA, DOT_PREC, HAS_KMASK)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QIDX, KVNUM, KVIDX, BMASK, KMASK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdob, sdoh, sdom, sdod, slb, slh, slm, sdqb, sdqh, sdqm, sdqd,
    sib, sih, sim, snb, snh, snm, sxb, sxh, sxm, sxk, smb, smh, smq, smk, skmb, skmh, skmn,
    n_heads, group, n_q, n_k, n_out, q_offset, window, qk_scale, log_d, block_q, block_k,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_QIDX: tl.constexpr, LAYOUT: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_KMASK: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last, causal) query tiles first
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    hk = h // group

    offs_m, qrow, row_ok, pos_min, pos_max = _query_rows(QIDX, b, h, sib, sih, sim, pid_m, n_q, n_out, q_offset,
                                                         BLOCK_M, HAS_QIDX)
    pos = qrow + q_offset
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + qrow[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + offs_m * slm, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634, float("inf"))
    delta = tl.load(DELTA + b * slb + h * slh + offs_m * slm, mask=row_ok, other=0.0)
    if LSSA:
        kappa = _lssa_kappa(pos, n_k, window, log_d, CAUSAL, HAS_WINDOW)
    else:
        kappa = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    km_base = KMASK + b * skmb + h * skmh  # the query head's key mask (read only when HAS_KMASK)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi, full_lo, full_hi = _key_range(pos_min, pos_max, n_k, window, BLOCK_N, CAUSAL, HAS_WINDOW)
    if LAYOUT == 0:
        dq = _dq_range(dq, q, do, lse2, delta, kappa, pos, lo, hi, full_lo, full_hi, k_base, v_base, skn, skd,
                       svn, svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV,
                       BLOCK_N, CAUSAL, HAS_WINDOW, LSSA, DOT_PREC, HAS_KMASK)
    elif LAYOUT == 1:
        # one flat loop over the listed blocks' key tiles (as in the forward), every tile masked
        qb = (pid_m * BLOCK_M) // block_q
        cnt = tl.load(KVNUM + b * snb + h * snh + qb * snm)
        tiles_per_block = block_k // BLOCK_N
        idx_base = KVIDX + b * sxb + h * sxh + qb * sxm
        for t in range(0, cnt * tiles_per_block):
            kb = tl.load(idx_base + (t // tiles_per_block) * sxk)
            start_n = kb * block_k + (t % tiles_per_block) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse2, delta, kappa, pos, pos, start_n, k_base, v_base, skn, skd, svn, svd,
                          km_base, skmn, n_k,
                          window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False,
                          LSSA, DOT_PREC, HAS_KMASK)
    else:
        bm_row = BMASK + b * smb + h * smh + (qrow // block_q) * smq
        for start_n in range(lo, hi, BLOCK_N):
            blk_ok = tl.load(bm_row + (start_n // block_k) * smk, mask=row_ok, other=0) != 0
            if tl.max(blk_ok.to(tl.int32), 0) > 0:
                dq = _dq_tile(dq, q, do, lse2, delta, kappa, pos, blk_ok, start_n, k_base, v_base, skn, skd, svn,
                              svd, km_base, skmn, n_k, window, qk_scale, offs_n, offs_d, offs_dv, HEAD_D, HEAD_DV,
                              CAUSAL, HAS_WINDOW, True, True, LSSA, DOT_PREC, HAS_KMASK)
    if not LSSA:
        dq = dq * (qk_scale * 0.6931471805599453)
    tl.store(DQ + b * sdqb + h * sdqh + qrow[:, None] * sdqm + offs_d[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


# ------------------------------------------------------------------------------------------------------------
# backward: dK, dV (key-major, loops over the query heads of the GQA group)
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_tile(dk, dv, k, v, offs_n, offs_m, qrow, row_ok, extra, kcol, q_base, do_base, lse_base, delta_base,
               sqm, sqd, sdom, sdod, slm, q_offset, n_k, window, qk_scale, log_d, offs_d, offs_dv,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               MASKED: tl.constexpr, USE_EXTRA: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
               HAS_KMASK: tl.constexpr):
    q = tl.load(q_base + qrow[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(lse_base + offs_m * slm, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634, float("inf"))
    delta = tl.load(delta_base + offs_m * slm, mask=row_ok, other=0.0)
    pos = qrow + q_offset
    st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)          # [BLOCK_N, BLOCK_M]
    if LSSA:
        kappa = _lssa_kappa(pos, n_k, window, log_d, CAUSAL, HAS_WINDOW)
        tt, fac = _lssa_logits(st, kappa[None, :])
    else:
        tt = st * qk_scale
    if MASKED:
        valid = _pair_mask(offs_n[:, None], pos[None, :], n_k, window, CAUSAL, HAS_WINDOW)
        if USE_EXTRA:
            valid = valid & extra[None, :]
        if HAS_KMASK:
            valid = valid & kcol[:, None]
        tt = tl.where(valid, tt, float("-inf"))
    elif HAS_KMASK:
        tt = tl.where(kcol[:, None], tt, float("-inf"))
    pt = tl.exp2(tt - lse2[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    if LSSA:
        dst = dst * fac
        if MASKED:
            dst = tl.where(valid, dst, 0.0)
        elif HAS_KMASK:
            dst = tl.where(kcol[:, None], dst, 0.0)
    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_range(dk, dv, k, v, offs_n, kcol, lo, hi, full_lo, full_hi, q_base, do_base, lse_base, delta_base,
                sqm, sqd, sdom, sdod, slm, n_q, q_offset, n_k, window, qk_scale, log_d, offs_d, offs_dv,
                HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr, HAS_KMASK: tl.constexpr):
    """Query rows ``[lo, hi)`` (``lo`` tile-aligned), split into masked / unmasked / masked runs."""
    b1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    c1 = tl.minimum(tl.maximum(full_hi, b1), hi)
    for start_m in range(lo, b1, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        dk, dv = _dkdv_tile(dk, dv, k, v, offs_n, offs_m, offs_m, offs_m < n_q, offs_m < n_q, kcol, q_base, do_base,
                            lse_base, delta_base, sqm, sqd, sdom, sdod, slm, q_offset, n_k, window, qk_scale, log_d,
                            offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False, LSSA, DOT_PREC,
                            HAS_KMASK)
    for start_m in range(b1, c1, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        dk, dv = _dkdv_tile(dk, dv, k, v, offs_n, offs_m, offs_m, offs_m < n_q, offs_m < n_q, kcol, q_base, do_base,
                            lse_base, delta_base, sqm, sqd, sdom, sdod, slm, q_offset, n_k, window, qk_scale, log_d,
                            offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, False, False, LSSA, DOT_PREC,
                            HAS_KMASK)
    for start_m in range(c1, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        dk, dv = _dkdv_tile(dk, dv, k, v, offs_n, offs_m, offs_m, offs_m < n_q, offs_m < n_q, kcol, q_base, do_base,
                            lse_base, delta_base, sqm, sqd, sdom, sdod, slm, q_offset, n_k, window, qk_scale, log_d,
                            offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False, LSSA, DOT_PREC,
                            HAS_KMASK)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QIDX, QNUM, QIDXL, BMASK, KMASK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdob, sdoh, sdom, sdod, slb, slh, slm, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    sib, sih, sim, snb, snh, snm, sxb, sxh, sxm, sxk, smb, smh, smq, smk, skmb, skmh, skmn,
    n_kv_heads, group, n_q, n_k, n_out, q_offset, window, qk_scale, log_d, block_q, block_k,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_QIDX: tl.constexpr, LAYOUT: tl.constexpr, LSSA: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_KMASK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hk = (pid_bh % n_kv_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_in = offs_n < n_k
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=col_in[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # query rows that may see this key tile (dense rows; positions = row + q_offset)
    end_n = tl.minimum(start_n + BLOCK_N, n_k)
    if CAUSAL:
        r_lo = tl.maximum(start_n - q_offset, 0)
        r_lo = (r_lo // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - q_offset, 0)
        full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        r_lo = start_n * 0
        full_lo = start_n * 0
    if HAS_WINDOW:
        r_hi = tl.minimum(end_n - 1 + window - q_offset, n_q)
        full_hi = tl.maximum(start_n + window - q_offset, 0)
        full_hi = (full_hi // BLOCK_M) * BLOCK_M
    else:
        r_hi = start_n * 0 + n_q
        full_hi = start_n * 0 + n_q
    if start_n + BLOCK_N > n_k:
        full_hi = start_n * 0  # ragged key tile: every query tile needs the column mask

    for gi in range(0, group):
        h = hk * group + gi
        if HAS_KMASK:
            kcol = tl.load(KMASK + b * skmb + h * skmh + offs_n * skmn, mask=col_in, other=0) != 0
        else:
            kcol = col_in
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        lse_base = LSE + b * slb + h * slh
        delta_base = DELTA + b * slb + h * slh
        if HAS_QIDX:
            for start_m in range(0, n_out, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                qi = tl.load(QIDX + b * sib + h * sih + offs_m * sim, mask=offs_m < n_out, other=-1)
                row_ok = qi >= 0
                qrow = tl.where(row_ok, qi, 0)
                pos = qrow + q_offset
                pmin = tl.min(tl.where(row_ok, pos, 1073741824), 0)
                pmax = tl.max(tl.where(row_ok, pos, -1073741824), 0)
                need = pmax >= pmin
                if CAUSAL:
                    need = need & (pmax >= start_n)
                if HAS_WINDOW:
                    need = need & (pmin < end_n - 1 + window)
                if LAYOUT == 2:
                    blk_ok = tl.load(BMASK + b * smb + h * smh + (qrow // block_q) * smq + (start_n // block_k) * smk,
                                     mask=row_ok, other=0) != 0
                    need = need & (tl.max(blk_ok.to(tl.int32), 0) > 0)
                else:
                    blk_ok = row_ok
                if need:
                    dk, dv = _dkdv_tile(dk, dv, k, v, offs_n, offs_m, qrow, row_ok, blk_ok, kcol, q_base, do_base,
                                        lse_base, delta_base, sqm, sqd, sdom, sdod, slm, q_offset, n_k, window,
                                        qk_scale, log_d, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True,
                                        LAYOUT == 2, LSSA, DOT_PREC, HAS_KMASK)
        elif LAYOUT == 1:
            # one flat loop over the query tiles of the query blocks that list this key block, every tile masked
            kb = start_n // block_k
            cnt = tl.load(QNUM + b * snb + h * snh + kb * snm)
            tiles_per_block = block_q // BLOCK_M
            idx_base = QIDXL + b * sxb + h * sxh + kb * sxm
            for t in range(0, cnt * tiles_per_block):
                qb = tl.load(idx_base + (t // tiles_per_block) * sxk)
                offs_m = qb * block_q + (t % tiles_per_block) * BLOCK_M + tl.arange(0, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, offs_n, offs_m, offs_m, offs_m < n_q, offs_m < n_q, kcol, q_base,
                                    do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, slm, q_offset, n_k, window,
                                    qk_scale, log_d, offs_d, offs_dv, HEAD_D, HEAD_DV, CAUSAL, HAS_WINDOW, True, False,
                                    LSSA, DOT_PREC, HAS_KMASK)
        else:
            dk, dv = _dkdv_range(dk, dv, k, v, offs_n, kcol, r_lo, r_hi, full_lo, full_hi, q_base, do_base, lse_base,
                                 delta_base, sqm, sqd, sdom, sdod, slm, n_q, q_offset, n_k, window, qk_scale, log_d,
                                 offs_d, offs_dv, HEAD_D, HEAD_DV, BLOCK_M, CAUSAL, HAS_WINDOW, LSSA, DOT_PREC,
                                 HAS_KMASK)
    if not LSSA:
        dk = dk * (qk_scale * 0.6931471805599453)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
             mask=col_in[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd, dv.to(DV.dtype.element_ty),
             mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV))


# ------------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------------
def _bstrides(t: torch.Tensor, n: int):
    """Strides of the first ``n`` dims with 0 where the dim has size 1 (broadcast)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(n)] + [t.stride(i) for i in range(n, t.dim())]


@dataclass(frozen=True)
class _Spec:
    """Everything but q/k/v that a launch needs (kept on the autograd ctx)."""

    scale: float
    causal: bool
    q_offset: int
    window: Optional[int]
    layout: Optional[BlockLayout]
    q_index: Optional[QueryIndex]
    lssa: bool
    key_mask: Optional[torch.Tensor] = None  # int8 [B, 1|Hq, Nk] on q's device (1 = attend)
    tile: Optional[Tuple[int, int]] = None  # the forward's (BLOCK_M, BLOCK_N) for a layout finer than it


def _coarse_tile(spec: _Spec) -> Optional[Tuple[int, int]]:
    """The tile at which the forward runs ``spec.layout`` with the fine block mask applied per element (layout
    mode 3), or None: only with a layout and no query subset, when the tile is a multiple of the layout's blocks
    and larger in at least one dimension."""
    lay, tile = spec.layout, spec.tile
    if tile is None or lay is None or spec.q_index is not None:
        return None
    bm, bn = tile
    if bm % lay.block_q or bn % lay.block_k or (bm, bn) == (lay.block_q, lay.block_k):
        return None
    return bm, bn


class _Launch:
    """Per-call index tensors and constexpr flags shared by the three kernels."""

    def __init__(self, spec: _Spec, q: torch.Tensor, tile: Optional[Tuple[int, int]] = None):
        dev = q.device
        self.dummy = q  # stands in for pointer arguments a constexpr flag switches off (never dereferenced)
        self.has_qidx = spec.q_index is not None
        lay = spec.layout
        self.layout_mode = 0 if lay is None else (2 if self.has_qidx else 3 if tile is not None else 1)
        d0 = [0, 0, 0]
        self.qidx = self.dummy
        self.qidx_strides = d0
        if self.has_qidx:
            self.qidx = spec.q_index.idx.to(device=dev, dtype=torch.int32)
            self.qidx_strides = _bstrides(self.qidx, 2)
            self.n_out = self.qidx.shape[-1]
        else:
            self.n_out = q.shape[2]
        self.kvnum, self.kvidx, self.bmask = self.dummy, self.dummy, self.dummy
        self.kvnum_strides, self.kvidx_strides, self.bmask_strides = d0, [0, 0, 0, 0], [0, 0, 0, 0]
        self.block_q = self.block_k = 16
        if lay is not None:
            self.block_q, self.block_k = lay.block_q, lay.block_k
            if self.layout_mode in (1, 3):
                lists = lay if self.layout_mode == 1 else lay.coarsen(*tile)
                self.kvnum = lists.kv_num_blocks.to(device=dev, dtype=torch.int32)
                self.kvidx = lists.kv_indices.to(device=dev, dtype=torch.int32)
                self.kvnum_strides = _bstrides(self.kvnum, 2)
                self.kvidx_strides = _bstrides(self.kvidx, 2)
            if self.layout_mode in (2, 3):
                self.bmask = lay.to_block_mask().to(device=dev, dtype=torch.int8)
                self.bmask_strides = _bstrides(self.bmask, 2)
        self.has_kmask = spec.key_mask is not None
        self.kmask, self.kmask_strides = self.dummy, [0, 0, 0]
        if self.has_kmask:
            self.kmask = spec.key_mask
            self.kmask_strides = _bstrides(self.kmask, 2)

    def transposed_lists(self, spec: _Spec, dev):
        """``(q_num_blocks, q_indices)`` for the key-major backward (layout mode 1 only)."""
        if self.layout_mode != 1:
            return self.dummy, self.dummy, [0, 0, 0], [0, 0, 0, 0]
        qnum, qidx = spec.layout.transpose()
        qnum = qnum.to(device=dev, dtype=torch.int32)
        qidx = qidx.to(device=dev, dtype=torch.int32)
        return qnum, qidx, _bstrides(qnum, 2), _bstrides(qidx, 2)

    def flags(self, spec: _Spec, q: torch.Tensor, v: torch.Tensor) -> dict:
        d, dv = q.shape[-1], v.shape[-1]
        return dict(
            HEAD_D=d, HEAD_DV=dv, BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
            CAUSAL=spec.causal, HAS_WINDOW=spec.window is not None, HAS_QIDX=self.has_qidx,
            LAYOUT=self.layout_mode, LSSA=spec.lssa, HAS_KMASK=self.has_kmask,
            DOT_PREC="ieee" if q.dtype == torch.float32 else None,
        )

    def scalars(self, spec: _Spec, q: torch.Tensor, k: torch.Tensor, heads: int) -> list:
        qk_scale = 1.0 if spec.lssa else spec.scale * _LOG2E
        return [heads, q.shape[1] // k.shape[1], q.shape[2], k.shape[2], self.n_out, spec.q_offset,
                spec.window if spec.window is not None else 0, qk_scale, math.log(q.shape[-1]),
                self.block_q, self.block_k]


def _configs(spec: _Spec, kind: str, q: torch.Tensor):
    bq = spec.layout.block_q if spec.layout is not None else None
    bk = spec.layout.block_k if spec.layout is not None else None
    return attention_config(kind, q.shape[-1], q.dtype, bq, bk)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: _Spec) -> Tuple[torch.Tensor, torch.Tensor]:
    b, hq, _, _ = q.shape
    tile = _coarse_tile(spec)
    ln = _Launch(spec, q, tile)
    o = torch.empty((b, hq, ln.n_out, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, ln.n_out), dtype=torch.float32, device=q.device)
    if o.numel() == 0 and lse.numel() == 0:
        return o, lse
    if tile is None:
        cfg = _configs(spec, "fwd", q)
    else:  # the tile asked for, with the warps and stages tuned for the unreduced tile
        tuned = attention_config("fwd", q.shape[-1], q.dtype)
        cfg = KernelConfig(tile[0], tile[1], tuned.num_warps, tuned.num_stages)
    grid = (triton.cdiv(ln.n_out, cfg.block_m), b * hq)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, ln.qidx, ln.kvnum, ln.kvidx, ln.bmask, ln.kmask,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        *ln.qidx_strides, *ln.kvnum_strides, *ln.kvidx_strides, *ln.bmask_strides, *ln.kmask_strides,
        *ln.scalars(spec, q, k, hq),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **ln.flags(spec, q, v), **cfg.launch_kwargs(),
    )
    return o, lse


def _backward(q, k, v, o, lse, do, dlse, spec: _Spec, need_dq: bool, need_dkv: bool):
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    ln = _Launch(spec, q)
    do = do.to(q.dtype)
    delta = (do.float() * o.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    lse = lse.contiguous()
    flags = ln.flags(spec, q, v)
    dq = dk = dv = None
    if need_dq:
        # rows a q_index does not list get no gradient: zero-filled here, listed rows written by the kernel
        dq = (torch.zeros if ln.has_qidx else torch.empty)((b, hq, n_q, d), dtype=q.dtype, device=q.device)
        cfg = _configs(spec, "dq", q)
        if ln.n_out > 0 and dq.numel() > 0:
            grid = (triton.cdiv(ln.n_out, cfg.block_m), b * hq)
            _attn_bwd_dq_kernel[grid](
                q, k, v, do, lse, delta, dq, ln.qidx, ln.kvnum, ln.kvidx, ln.bmask, ln.kmask,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dq.stride(),
                *ln.qidx_strides, *ln.kvnum_strides, *ln.kvidx_strides, *ln.bmask_strides, *ln.kmask_strides,
                *ln.scalars(spec, q, k, hq),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags, **cfg.launch_kwargs(),
            )
    if need_dkv:
        dk = torch.empty((b, hk, n_k, d), dtype=k.dtype, device=k.device)
        dv = torch.empty((b, hk, n_k, v.shape[-1]), dtype=v.dtype, device=v.device)
        cfg = _configs(spec, "dkdv", q)
        qnum, qidxl, qnum_strides, qidxl_strides = ln.transposed_lists(spec, q.device)
        if dk.numel() > 0 or dv.numel() > 0:
            grid = (triton.cdiv(n_k, cfg.block_n), b * hk)
            _attn_bwd_dkdv_kernel[grid](
                q, k, v, do, lse, delta, dk, dv, ln.qidx, qnum, qidxl, ln.bmask, ln.kmask,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dk.stride(), *dv.stride(),
                *ln.qidx_strides, *qnum_strides, *qidxl_strides, *ln.bmask_strides, *ln.kmask_strides,
                *ln.scalars(spec, q, k, hk),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags, **cfg.launch_kwargs(),
            )
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: _Spec):
        with device_guard(q):
            o, lse = _forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.spec = spec
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        need_dq = ctx.needs_input_grad[0]
        need_dkv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if do is None:
            do = torch.zeros_like(o)
        with device_guard(q):
            dq, dk, dv = _backward(q, k, v, o, lse, do, dlse, ctx.spec, need_dq, need_dkv)
        return dq, dk, (dv if ctx.needs_input_grad[2] else None), None


def _validate(q, k, v, causal, window, layout, q_index, score_mode):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [B, H, N, d], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    b, hq, n_q, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"k head dim {k.shape[-1]} != q head dim {d} (q {list(q.shape)}, k {list(k.shape)})")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(f"v {list(v.shape)} must share heads and length with k {list(k.shape)}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {k.shape[1]} (GQA)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if score_mode not in ("softmax", "lssa"):
        raise ValueError(f"score_mode must be 'softmax' or 'lssa', got {score_mode!r} (LSSAR runs on the torch "
                         "reference)")
    if window is not None:
        if not causal:
            raise ValueError("window requires causal=True (a sliding window is a causal band)")
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
    n_k = k.shape[2]
    if layout is not None:
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
        if tuple(layout.seq_lens) != (n_q, n_k):
            raise ValueError(f"layout.seq_lens={tuple(layout.seq_lens)} does not match (N_q, N_k)=({n_q}, {n_k})")
        lb, lh = layout.shape
        if lb not in (1, b) or lh not in (1, hq):
            raise ValueError(f"layout (B, H)=({lb}, {lh}) must be (1 or {b}, 1 or {hq}) for q {list(q.shape)}")
        if layout.device != q.device:
            raise ValueError(f"layout is on {layout.device}, q on {q.device}")
    if q_index is not None:
        if not isinstance(q_index, QueryIndex):
            raise TypeError(f"q_index must be a QueryIndex, got {type(q_index).__name__}")
        ib, ih, _ = q_index.idx.shape
        if ib not in (1, b) or ih not in (1, hq):
            raise ValueError(f"q_index.idx {list(q_index.idx.shape)} must be [1 or {b}, 1 or {hq}, Nc]")
        if q_index.n_q != n_q:
            raise ValueError(f"q_index.n_q={q_index.n_q} does not match q's length {n_q}")
        if q_index.idx.device != q.device:
            raise ValueError(f"q_index is on {q_index.idx.device}, q on {q.device}")


def _key_mask_int8(key_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``key_mask [B, 1|Hk|Hq, Nk]`` as int8 ``[B, 1|Hq, Nk]`` on q's device (kv head ``j`` serves query heads
    ``j*g .. j*g+g-1``; a shared ``[B, 1, Nk]`` mask stays one row, read with a zero head stride)."""
    hq, hk = q.shape[1], k.shape[1]
    km = check_key_mask(key_mask, q, k)  # boolean on q's device; float / additive masks are rejected
    if km.shape[1] not in (1, hq):
        km = km.repeat_interleave(hq // hk, dim=1)
    return km.contiguous().view(torch.int8)  # bool and int8 share a byte: no copy when already contiguous


def _check_tile(tile, layout: Optional[BlockLayout]) -> Tuple[int, int]:
    """``tile`` as two ints, or ValueError naming what would be valid."""
    ok = isinstance(tile, (tuple, list)) and len(tile) == 2 and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 16 and t & (t - 1) == 0 for t in tile)
    if not ok:
        raise ValueError(f"tile={tile!r}: expected (BLOCK_M, BLOCK_N), two powers of two >= 16, e.g. (128, 64)")
    bm, bn = tile
    if layout is not None and (bm % layout.block_q or bn % layout.block_k):
        raise ValueError(f"tile={tuple(tile)} must be a multiple of the layout's blocks ({layout.block_q}, "
                         f"{layout.block_k}) in each dimension (the tile covers whole fine blocks)")
    return int(bm), int(bn)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                     causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                     layout: Optional[BlockLayout] = None, q_index: Optional[QueryIndex] = None,
                     score_mode: str = "softmax", key_mask: Optional[torch.Tensor] = None,
                     tile: Optional[Tuple[int, int]] = None,
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 style attention (K1 forward, K2 backward) with masks, block layouts and query subsets.

    Args:
        q: ``[B, Hq, Nq, d]``; k: ``[B, Hk, Nk, d]``; v: ``[B, Hk, Nk, dv]`` (``Hq % Hk == 0``: query head ``h`` reads
            kv head ``h // (Hq // Hk)``; K/V are never repeated). Any strides (e.g. transposed ``[B, N, H, d]``
            views). float16 / float32 (and bfloat16: compiled on CUDA; cast to float32 in the interpreter).
            ``dv`` may differ from ``d``; any head dim (tiles are padded to a power of two >= 16 and masked).
        scale: softmax scale, default ``1/sqrt(d)`` (ignored by ``lssa``).
        causal: key ``j`` is valid for query row ``i`` only if ``j <= i + q_offset``.
        q_offset: key position of query row 0; default ``Nk - Nq`` (bottom-right alignment).
        window: sliding window (requires ``causal``): also ``j > i + q_offset - window``.
        layout: :class:`BlockLayout` with ``seq_lens == (Nq, Nk)``, ``(B, H)`` equal to ``(B, Hq)`` or 1; only the
            listed (query block, key block) pairs are computed, intersected with the causal/window mask.
            Block sizes must be multiples of 16.
        q_index: :class:`QueryIndex` (``idx [B or 1, Hq or 1, Nc]``, ``n_q == Nq``): compute only the listed rows;
            the outputs are compacted to ``Nc`` rows, a row's position is its index value, padded slots give
            ``O = 0`` and ``LSE = -inf``; dq of unlisted rows is 0. Combines with ``layout``
            (then the key range is the causal band with a per-row block lookup, not the layout's lists).
        score_mode: ``"softmax"`` or ``"lssa"`` (q, k L2-normalised here in fp32, cosine logits,
            ``phi = log softplus(ln(d) ln(N_i) c)``, see module docs).
        key_mask: boolean ``[B, 1|Hk|Hq, Nk]`` (True = attend), on top of every other mask: each kernel loads
            the query head's mask for each key tile (int8, one load per tile) and sets masked logits to
            ``-inf`` before the online softmax (forward) or the recomputed probabilities (backward). A row whose
            every key is masked gives ``O = 0``, ``LSE = -inf`` and no gradient. (LSSA keeps ``N_i`` from the
            causal/window mask alone, as in the reference.)
        tile: ``(BLOCK_M, BLOCK_N)``, powers of two >= 16, for the forward of a ``layout`` whose blocks are
            smaller (each a multiple of the layout's ``block_q`` / ``block_k``; e.g. SALE's 64 x 32 blocks at the
            128 x 64 tile K1 runs fast on Hopper): the kernel visits the tiles of
            ``layout.coarsen(BLOCK_M, BLOCK_N)`` and masks every element outside the fine blocks, so the result
            equals the fine layout's. Default None: tiles that divide the layout's blocks. Ignored without a
            layout, with ``q_index``, when the tile equals the blocks, and by the backward (fine tiles).

    Returns:
        ``(o, lse)``: ``o [B, Hq, Nq or Nc, dv]`` in q's dtype and ``lse [B, Hq, Nq or Nc]`` float32, the
        natural-log normaliser of each row (``-inf`` for rows with no valid key, whose ``o`` is 0).
        Differentiable in q, k, v through both outputs (gradients flowing into ``lse`` are supported).

    Raises:
        ValueError / TypeError on inconsistent shapes, dtypes, layouts (block sizes not multiples of 16), an unknown
        ``score_mode`` (``"lssar"`` has no kernel: use the reference), ``window`` without ``causal``, or per-head
        offsets beyond int32; RuntimeError for CPU tensors outside the interpreter (``TRITON_INTERPRET=1``).
        The backward is once-differentiable (no double backward).
    """
    _validate(q, k, v, causal, window, layout, q_index, score_mode)
    if tile is not None:
        tile = _check_tile(tile, layout)
    check_device(q, k, v)
    km = None if key_mask is None else _key_mask_int8(key_mask, q, k)
    check_offsets(q=q, k=k, v=v)
    n_q, d = q.shape[2], q.shape[3]
    n_k = k.shape[2]
    kd = kernel_dtype(q.dtype)
    out_dtype = q.dtype
    lssa = score_mode == "lssa"
    if lssa:
        q = torch.nn.functional.normalize(q.float(), dim=-1, eps=1e-12)
        k = torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-12)
    q, k, v = q.to(kd), k.to(kd), v.to(kd)
    spec = _Spec(
        scale=float(1.0 / math.sqrt(d) if scale is None else scale),
        causal=bool(causal), q_offset=resolve_q_offset(n_q, n_k, q_offset),
        window=None if window is None else int(window), layout=layout, q_index=q_index, lssa=lssa, key_mask=km,
        tile=tile,
    )
    o, lse = _TritonAttention.apply(q, k, v, spec)
    return o.to(out_dtype), lse


def triton_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              do: torch.Tensor, dlse: Optional[torch.Tensor], *, scale: Optional[float] = None,
                              causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                              key_mask: Optional[torch.Tensor] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K2 alone: ``(dq, dk, dv)`` of softmax attention from a forward computed elsewhere (another kernel's
    ``o [B, Hq, Nq, dv]`` and natural-log ``lse [B, Hq, Nq]``), with ``do`` the gradient of ``o`` and ``dlse``
    (or None) the gradient of ``lse``. Shapes and masks as :func:`triton_attention` (dense / causal / window,
    ``key_mask``); K/V gradients have the kv heads of ``k``, ``v``."""
    _validate(q, k, v, causal, window, None, None, "softmax")
    check_device(q, k, v)
    km = None if key_mask is None else _key_mask_int8(key_mask, q, k)
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[3]
    kd = kernel_dtype(q.dtype)
    spec = _Spec(scale=float(1.0 / math.sqrt(d) if scale is None else scale), causal=bool(causal),
                 q_offset=resolve_q_offset(n_q, n_k, q_offset), window=None if window is None else int(window),
                 layout=None, q_index=None, lssa=False, key_mask=km)
    with device_guard(q):
        dq, dk, dv = _backward(q.to(kd), k.to(kd), v.to(kd), o.to(kd), lse.float(), do.to(kd), dlse, spec, True,
                               True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
