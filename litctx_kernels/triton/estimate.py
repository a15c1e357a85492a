"""Fused block estimates for sparse prefill: Prism's dual band, the mean-pooled estimate and XAttention, each
from ``q, k`` to a finished :class:`~litctx_kernels.layouts.BlockLayout` in two launches (Prism, mean pooling) or
one (XAttention), with no host synchronisation.

The quantities are those of :mod:`litctx_kernels.reference.estimate` (its ``*_layout_reference`` functions have the
same signatures):

* ``_pool_kernel`` - grid ``(M, B * Hk)``: one program pools key block ``m`` of one kv head and the same block of
  the group's query heads (float32 sums of the block's rows divided by its real row count), writes them to
  ``QB [B, Hq, M, d]`` / ``KB [B, Hk, M, d]`` and, for Prism, the block's energies (sums of squares of the pooled
  vector over all dims, the high band's and the low band's) to ``QE``/``KE [B, H, M, 3]``.
* ``_pooled_row_kernel`` - grid ``(M, B * Hq)``: one program owns query block ``I`` of one head. It sums the head's
  block energies into the band temperatures (Prism), computes the row's pooled logits against key blocks
  ``0..I`` (one vector of ``M`` scores per band, in registers), the causal softmax, the top-p selection, the union
  of the bands, the sink column and the diagonal, and writes ``kv_num_blocks[b, h, I]`` and the ascending
  ``kv_indices[b, h, I, :]`` (``-1`` padded to ``M`` columns) directly.
* ``_xattention_row_kernel`` - grid ``(M, B * Hq)``: one program owns query block ``I`` (``T = block / S``
  reshaped query rows). Two passes over the key blocks ``0..I`` (``KB`` blocks per step): the first takes each
  reshaped row's softmax maximum and normaliser (online), the second sums the probabilities per key block; the
  reshaped dot products are ``S`` MMAs of ``[T, d] x [d, KB T]`` on strided rows (``q[rS + S - 1 - s]`` against
  ``k[cS + s]``), zero-padded past ``N`` as the reference pads. Then the cumulative threshold and the same
  layout writing.

**Top-p without sorting** (``_top_p_keep``): an entry is kept iff the mass of the entries sorted before it (larger
values, then equal values with a smaller index: a stable descending sort) is ``< p``, zero entries never. The
kept entries are those above a threshold ``t*`` plus a prefix (by index) of the entries equal to ``t*``:
``t*`` is the smallest row value whose strictly larger entries weigh ``< p``, found exactly by bisection on the
bit pattern of non-negative float32 (31 steps, each one masked sum over the row), then the ties at ``t*`` are ranked
by index (a cumulative sum) and kept while ``G(t*) + rank t* < p``. Exact ties are thus broken as the reference's
stable sort breaks them; the masses are float32 sums in a different order than the reference's sorted cumulative
sum, so an entry whose mass before it lies within float rounding of ``p`` can go either way (and the kernels'
probabilities themselves differ from torch's by rounding).
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import torch
import triton
import triton.language as tl

from litctx_kernels.layouts import BlockLayout
from litctx_kernels.reference.estimate import band_pairs, check_estimate_qk, check_mass
from litctx_kernels.triton._compat import check_device, device_guard, is_interpret, kernel_dtype, next_pow2

__all__ = ["triton_prism_layout", "triton_mean_pool_layout", "triton_xattention_layout", "triton_pool_blocks"]


@triton.jit
def _pool_block(base, s_n, s_d, r0, n, block, count, offs_d, d_ok, BLOCK_R: tl.constexpr):
    """Mean of rows ``[r0, min(n, r0 + block))`` of one head (float32 sum, divided by the real row count)."""
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros(offs_d.shape, dtype=tl.float32)
    for r in range(0, block, BLOCK_R):
        rows = r0 + r + offs_r
        ok = (rows < n) & (r + offs_r < block)
        x = tl.load(base + rows[:, None] * s_n + offs_d[None, :] * s_d, mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    return acc / count


@triton.jit
def _store_pooled(out, energy, mean, d_ok, high, low, ENERGY: tl.constexpr):
    tl.store(out, mean, mask=d_ok)
    if ENERGY:  # sums of squares over all dims, the high band and the low band
        sq = mean * mean
        tl.store(energy, tl.sum(sq, axis=0))
        tl.store(energy + 1, tl.sum(tl.where(high, sq, 0.0), axis=0))
        tl.store(energy + 2, tl.sum(tl.where(low, sq, 0.0), axis=0))


@triton.jit
def _pool_kernel(
    Q, K, QB, KB, QE, KE,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,
    spqb, spqh, spqm, spkb, spkh, spkm, seqb, seqh, seqm, sekb, sekh, sekm,
    n, n_kv_heads, group, block, half, n_high, n_low,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, ENERGY: tl.constexpr,
):
    m = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // n_kv_heads).to(tl.int64)
    hk = (pid % n_kv_heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    pair = tl.where(offs_d < half, offs_d, offs_d - half)
    in_pairs = offs_d < 2 * half
    high = in_pairs & (pair < n_high)
    low = in_pairs & (pair >= half - n_low)
    r0 = m * block
    count = (tl.minimum(n, r0 + block) - r0).to(tl.float32)
    # the kv head's key block once, then the same block of each query head of its group
    mean = _pool_block(K + b * skb + hk * skh, skn, skd, r0, n, block, count, offs_d, d_ok, BLOCK_R)
    _store_pooled(KB + b * spkb + hk * spkh + m * spkm + offs_d, KE + b * sekb + hk * sekh + m * sekm, mean, d_ok,
                  high, low, ENERGY)
    for j in range(0, group):
        h = hk * group + j
        mean = _pool_block(Q + b * sqb + h * sqh, sqn, sqd, r0, n, block, count, offs_d, d_ok, BLOCK_R)
        _store_pooled(QB + b * spqb + h * spqh + m * spqm + offs_d, QE + b * seqb + h * seqh + m * seqm, mean,
                      d_ok, high, low, ENERGY)


@triton.jit
def _top_p_keep(p, top_p):
    """Keep flags of the row ``p`` (non-negative, float32): the reference's stable-sort top-p rule."""
    total = tl.sum(p, axis=0)
    lo = tl.full([], 0, tl.int32)  # G(0) = total >= top_p (else every positive entry is kept, below)
    hi = tl.max(p, axis=0).to(tl.int32, bitcast=True)  # G(max) = 0 < top_p
    for _ in range(31):  # bit patterns of non-negative floats are ordered like the floats
        mid = lo + (hi - lo) // 2
        t = mid.to(tl.float32, bitcast=True)
        g = tl.sum(tl.where(p > t, p, 0.0), axis=0)
        below = g < top_p
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    t_star = hi.to(tl.float32, bitcast=True)  # the smallest value whose larger entries weigh < top_p
    above = p > t_star
    g_star = tl.sum(tl.where(above, p, 0.0), axis=0)
    tie = (p == t_star).to(tl.int32)
    rank = tl.cumsum(tie, axis=0) - tie  # equal values in index order, as a stable sort puts them
    keep = above | ((tie > 0) & (g_star + rank.to(tl.float32) * t_star < top_p))
    return tl.where(total < top_p, p > 0.0, keep)


@triton.jit
def _write_row(keep, jj, row, n_blocks, NUM, IDX, num_off, idx_base, s_idx):
    """Add the sink column and the diagonal, restrict to causal blocks, write the row's count and its ascending
    indices (``-1`` past the count)."""
    keep = (keep | (jj == 0) | (jj == row)) & (jj <= row)
    k32 = keep.to(tl.int32)
    count = tl.sum(k32, axis=0)
    pos = tl.cumsum(k32, axis=0) - k32
    tl.store(NUM + num_off, count)
    tl.store(IDX + idx_base + pos * s_idx, jj, mask=keep)
    tl.store(IDX + idx_base + jj * s_idx, tl.full(jj.shape, -1, tl.int32), mask=(jj >= count) & (jj < n_blocks))


@triton.jit
def _softmax_row(x, valid):
    x = tl.where(valid, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def _pooled_row_kernel(
    QB, KB, QE, KE, NUM, IDX, TAU,
    spqb, spqh, spqm, spkb, spkh, spkm, seqb, seqh, seqm, sekb, sekh, sekm,
    snb, snh, snm, sib, sih, sim, sik,
    n_heads, group, n_blocks, half, n_high, n_low, scale, top_p, c_high, c_low, sqrt_high, sqrt_low,
    cnt_all, cnt_high, cnt_low,
    HEAD_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, PRISM: tl.constexpr,
    CALIBRATE: tl.constexpr,
):
    row = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // n_heads).to(tl.int64)
    h = (pid % n_heads).to(tl.int64)
    hk = h // group
    jj = tl.arange(0, BLOCK_M)
    valid = jj <= row
    q_base = QB + b * spqb + h * spqh + row * spqm
    k_base = KB + b * spkb + hk * spkh
    l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, HEAD_D, CHUNK_D):
        offs = d0 + tl.arange(0, CHUNK_D)
        d_ok = offs < HEAD_D
        qv = tl.load(q_base + offs, mask=d_ok, other=0.0)
        kt = tl.load(k_base + jj[:, None] * spkm + offs[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        prod = kt * qv[None, :]
        if PRISM:
            pair = tl.where(offs < half, offs, offs - half)
            in_pairs = offs < 2 * half
            l1 += tl.sum(tl.where((in_pairs & (pair < n_high))[None, :], prod, 0.0), axis=1)
            l2 += tl.sum(tl.where((in_pairs & (pair >= half - n_low))[None, :], prod, 0.0), axis=1)
        else:
            l1 += tl.sum(prod, axis=1)
    if PRISM:
        tau_h = tl.full([], 1.0, tl.float32)
        tau_l = tl.full([], 1.0, tl.float32)
        if CALIBRATE:
            in_m = jj < n_blocks
            qe = QE + b * seqb + h * seqh + jj * seqm
            ke = KE + b * sekb + hk * sekh + jj * sekm
            eq = tl.sum(tl.load(qe, mask=in_m, other=0.0), axis=0)
            eq_h = tl.sum(tl.load(qe + 1, mask=in_m, other=0.0), axis=0)
            eq_l = tl.sum(tl.load(qe + 2, mask=in_m, other=0.0), axis=0)
            ek = tl.sum(tl.load(ke, mask=in_m, other=0.0), axis=0)
            ek_h = tl.sum(tl.load(ke + 1, mask=in_m, other=0.0), axis=0)
            ek_l = tl.sum(tl.load(ke + 2, mask=in_m, other=0.0), axis=0)
            # RMS over blocks and dims: sqrt(sum of squares / count); tau = c (rms_qz / rq) (rms_kz / rk)
            rq = tl.maximum(tl.sqrt(eq / cnt_all), 1e-30)
            rk = tl.maximum(tl.sqrt(ek / cnt_all), 1e-30)
            tau_h = c_high * (tl.sqrt(eq_h / cnt_high) / rq) * (tl.sqrt(ek_h / cnt_high) / rk)
            tau_l = c_low * (tl.sqrt(eq_l / cnt_low) / rq) * (tl.sqrt(ek_l / cnt_low) / rk)
        tau_h = tl.maximum(tau_h, 1e-6)
        tau_l = tl.maximum(tau_l, 1e-6)
        if row == 0:
            tl.store(TAU + pid * 2, tau_h)
            tl.store(TAU + pid * 2 + 1, tau_l)
        keep = _top_p_keep(_softmax_row(l1 / (sqrt_high * tau_h), valid), top_p)
        keep = keep | _top_p_keep(_softmax_row(l2 / (sqrt_low * tau_l), valid), top_p)
    else:
        keep = _top_p_keep(_softmax_row(l1 * scale, valid), top_p)
    _write_row(keep, jj, row, n_blocks, NUM, IDX, b * snb + h * snh + row * snm, b * sib + h * sih + row * sim, sik)


@triton.jit
def _xattention_row_kernel(
    Q, K, NUM, IDX, SCORES,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,
    snb, snh, snm, sib, sih, sim, sik, ssb, ssh, ssm, ssk,
    n, n_heads, group, n_blocks, xscale, threshold,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr,
    TP: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
):
    row = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // n_heads).to(tl.int64)
    h = (pid % n_heads).to(tl.int64)
    hk = h // group
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + hk * skh
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    r = tl.arange(0, BLOCK_T)
    row_ok = r < T
    big_r = row * T + r  # reshaped query row
    KC: tl.constexpr = KB * TP
    c = tl.arange(0, KC)
    u = c % TP
    col_ok = u < T
    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    jj = tl.arange(0, BLOCK_M)
    scores = tl.zeros([BLOCK_M], dtype=tl.float32)
    for second in tl.static_range(2):
        if second == 1:  # rows past T are padding of the tile: neutral normaliser
            m_i = tl.where(row_ok, m_i, 0.0)
            l_i = tl.where(row_ok, l_i, 1.0)
        for j0 in range(0, row + 1, KB):
            big_c = (j0 + c // TP) * T + u  # reshaped key column
            acc = tl.zeros([BLOCK_T, KC], dtype=tl.float32)
            for s in range(STRIDE):  # a runtime loop: one set of shared-memory operand buffers
                q_pos = big_r * STRIDE + (STRIDE - 1 - s)
                k_pos = big_c * STRIDE + s
                qs = tl.load(q_base + q_pos[:, None] * sqn + offs_d[None, :] * sqd,
                             mask=(row_ok & (q_pos < n))[:, None] & d_ok[None, :], other=0.0)
                ks = tl.load(k_base + k_pos[:, None] * skn + offs_d[None, :] * skd,
                             mask=(col_ok & (k_pos < n))[:, None] & d_ok[None, :], other=0.0)
                acc += tl.dot(qs, tl.trans(ks), input_precision=DOT_PREC)
            x = acc * xscale
            ok = row_ok[:, None] & col_ok[None, :] & (big_c[None, :] <= big_r[:, None])
            x = tl.where(ok, x, float("-inf"))
            if second == 0:
                m_new = tl.maximum(m_i, tl.max(x, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
                m_i = m_new
            else:
                p = tl.exp(x - m_i[:, None]) / l_i[:, None]
                per_block = tl.sum(tl.sum(tl.reshape(p, (BLOCK_T, KB, TP)), axis=2), axis=0)  # [KB]
                kbs = j0 + tl.arange(0, KB)
                scores += tl.sum(tl.where(jj[None, :] == kbs[:, None], per_block[:, None], 0.0), axis=0)
    if WRITE_SCORES:
        tl.store(SCORES + b * ssb + h * ssh + row * ssm + jj * ssk, scores, mask=jj < n_blocks)
    total = tl.sum(scores, axis=0)
    probs = tl.where(total > 0, scores / tl.maximum(total, 1e-30), 0.0)
    keep = _top_p_keep(probs, threshold)
    _write_row(keep, jj, row, n_blocks, NUM, IDX, b * snb + h * snh + row * snm, b * sib + h * sih + row * sim, sik)


def _prepare(q: torch.Tensor, k: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    check_estimate_qk(q, k)
    check_device(q, k)
    if int(block) < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    dt = kernel_dtype(q.dtype)  # bf16 is read as fp32 in the interpreter (its bf16 loads are wrong)
    return q.to(dt), k.to(dt)


def _layout_tensors(b: int, h: int, m: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(b, h, m, dtype=torch.int32, device=device),
            torch.empty(b, h, m, m, dtype=torch.int32, device=device))


def _pool(q: torch.Tensor, k: torch.Tensor, block: int, energy: bool, high_fraction: float = 0.5,
          low_fraction: float = 0.5):
    b, hq, n, d = q.shape
    hk = k.shape[1]
    m = math.ceil(n / block)
    qb = torch.empty(b, hq, m, d, dtype=torch.float32, device=q.device)
    kb = torch.empty(b, hk, m, d, dtype=torch.float32, device=q.device)
    qe = torch.zeros(b, hq, m, 3, dtype=torch.float32, device=q.device) if energy else qb
    ke = torch.zeros(b, hk, m, 3, dtype=torch.float32, device=q.device) if energy else kb
    half = d // 2
    n_high, n_low = band_pairs(d, high_fraction, low_fraction)
    block_d = next_pow2(d)
    block_r = max(1, min(next_pow2(block), 128 if is_interpret() else max(1, 4096 // block_d)))
    with device_guard(q):
        _pool_kernel[(m, b * hk)](
            q, k, qb, kb, qe, ke, *q.stride(), *k.stride(), *qb.stride()[:3], *kb.stride()[:3],
            *qe.stride()[:3], *ke.stride()[:3],
            n, hk, hq // hk, block, half, n_high, n_low,
            HEAD_D=d, BLOCK_D=block_d, BLOCK_R=block_r, ENERGY=energy,
            **({} if is_interpret() else {"num_warps": 4}))
    return qb, kb, qe, ke, (n_high, n_low)


def triton_pool_blocks(q: torch.Tensor, k: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused pooling alone: ``(Q_bar [B, Hq, M, d], K_bar [B, Hk, M, d])`` in float32, the block means of
    :func:`litctx_kernels.reference.estimate.pool_blocks` (keys once per kv head)."""
    q, k = _prepare(q, k, block)
    qb, kb, *_ = _pool(q, k, int(block), False)
    return qb, kb


def _row_launch(q, k, block, *, top_p, prism, scale=1.0, high_fraction=0.5, low_fraction=0.75, calibrate=True):
    b, hq, n, d = q.shape
    hk = k.shape[1]
    m = math.ceil(n / block)
    qb, kb, qe, ke, (n_high, n_low) = _pool(q, k, block, prism and calibrate, high_fraction, low_fraction)
    num, idx = _layout_tensors(b, hq, m, q.device)
    tau = torch.ones(b, hq, 2, dtype=torch.float32, device=q.device)
    block_m = next_pow2(m)
    # [block_m, chunk_d] key tile per step: 4096 elements keep the compiled kernel out of local memory (sm_90)
    chunk_d = max(1, min(next_pow2(d), 4096 // block_m if not is_interpret() else 64))
    with device_guard(q):
        _pooled_row_kernel[(m, b * hq)](
            qb, kb, qe, ke, num, idx, tau, *qb.stride()[:3], *kb.stride()[:3], *qe.stride()[:3], *ke.stride()[:3],
            *num.stride(), *idx.stride(),
            hq, hq // hk, m, d // 2, n_high, n_low, float(scale), float(top_p),
            math.sqrt(2 * n_high / d), math.sqrt(2 * n_low / d), math.sqrt(2 * n_high), math.sqrt(2 * n_low),
            float(m * d), float(m * 2 * n_high), float(m * 2 * n_low),
            HEAD_D=d, CHUNK_D=chunk_d, BLOCK_M=block_m, PRISM=prism, CALIBRATE=bool(calibrate),
            **({} if is_interpret() else {"num_warps": 8 if block_m >= 128 else 4}))
    return BlockLayout.trusted(num, idx, block, block, (n, n)), tau


def triton_prism_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float, high_fraction: float,
                        low_fraction: float, calibrate: bool = True, temperatures: bool = False
                        ) -> Union[BlockLayout, Tuple[BlockLayout, torch.Tensor]]:
    """Prism's finished selection (both bands' top-p blocks, sink column, diagonal, causal) as a ``[B, Hq]``
    layout with ``kv_indices`` padded to ``M`` columns; with ``temperatures=True`` also ``tau [B, Hq, 2]``.
    Same signature and blocks as :func:`litctx_kernels.reference.estimate.prism_layout_reference` (up to the
    tie rule in the module docstring)."""
    q, k = _prepare(q, k, block)
    top_p = check_mass("top_p", top_p)
    for name, f in (("high_fraction", high_fraction), ("low_fraction", low_fraction)):
        check_mass(name, f)
    layout, tau = _row_launch(q, k, int(block), top_p=top_p, prism=True, high_fraction=float(high_fraction),
                              low_fraction=float(low_fraction), calibrate=calibrate)
    return (layout, tau) if temperatures else layout


def triton_mean_pool_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float,
                            scale: float) -> BlockLayout:
    """The mean-pooled estimate's finished selection (``softmax(Q_bar K_bar^T scale)`` per row over causal
    blocks, top-p) as a ``[B, Hq]`` layout; see :func:`litctx_kernels.reference.estimate.mean_pool_layout_reference`."""
    q, k = _prepare(q, k, block)
    return _row_launch(q, k, int(block), top_p=check_mass("top_p", top_p), prism=False, scale=float(scale))[0]


def triton_xattention_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, stride: int, threshold: float,
                             scale: float, scores: bool = False
                             ) -> Union[BlockLayout, Tuple[BlockLayout, torch.Tensor]]:
    """XAttention's finished selection as a ``[B, Hq]`` layout (see
    :func:`litctx_kernels.reference.estimate.xattention_layout_reference`); with ``scores=True`` also the
    block scores ``[B, Hq, M, M]`` (float32, zero above the causal diagonal)."""
    q, k = _prepare(q, k, block)
    threshold = check_mass("threshold", threshold)
    block, stride = int(block), int(stride)
    if stride < 1 or block % stride:
        raise ValueError(f"XAttention's block ({block}) must be a multiple of its stride ({stride})")
    b, hq, n, d = q.shape
    hk = k.shape[1]
    m = math.ceil(n / block)
    t = block // stride
    tp = next_pow2(t)
    kb = max(1, 64 // tp)  # 64 reshaped key columns per step (at least one block)
    block_m = next_pow2(m)
    num, idx = _layout_tensors(b, hq, m, q.device)
    out = torch.zeros(b, hq, m, m, dtype=torch.float32, device=q.device) if scores else num
    s_out = out.stride() if scores else (0, 0, 0, 0)
    with device_guard(q):
        _xattention_row_kernel[(m, b * hq)](
            q, k, num, idx, out, *q.stride(), *k.stride(), *num.stride(), *idx.stride(), *s_out,
            n, hq, hq // hk, m, float(scale) / stride, threshold,
            HEAD_D=d, BLOCK_D=max(16, next_pow2(d)), STRIDE=stride, T=t, BLOCK_T=max(16, tp), TP=tp, KB=kb,
            BLOCK_M=block_m, DOT_PREC="ieee" if q.dtype == torch.float32 else None, WRITE_SCORES=scores,
            **({} if is_interpret() else {"num_warps": 8 if q.dtype == torch.float32 else 4, "num_stages": 2}))
    layout = BlockLayout.trusted(num, idx, block, block, (n, n))
    return (layout, out) if scores else layout
