"""K3: attention over per-kv-head token lists (decode, sparse verification, retained KV sets), forward only.

``_gather_fwd_kernel`` - grid ``(query-row tiles, B * Hk)``. One program owns ``ROWS`` query rows of *every* query
head of one GQA group: a ``[BLOCK_M = G_PAD * ROWS, d]`` tile (``G_PAD`` = group size rounded up to a power of two;
tile row ``r`` is head ``r // ROWS``, query row ``r % ROWS``), so each
listed K/V row is gathered from memory once per group and row tile. It walks the token list in tiles of
``BLOCK_N`` entries, loads the integer positions, gathers K/V rows by offset (plain pointer arithmetic, so the
interpreter runs it too), applies ``position <= i + q_offset`` when causal, and runs the online softmax in base 2
with fp32 accumulators. Rows with no valid token give ``O = 0`` and ``LSE = -inf``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from litctx_kernels.layouts import TokenIndex, resolve_q_offset
from litctx_kernels.triton._compat import attention_config, check_device, check_offsets, device_guard, kernel_dtype, next_pow2

__all__ = ["triton_gather_attention"]


@triton.jit
def _gather_fwd_kernel(
    Q, K, V, OUT, LSE, IDX, CNT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sob, soh, som, sod, slb, slh, slm, sib, sih, sis, scb, sch,
    n_kv_heads, group, n_q, q_offset, qk_scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hk = (pid_bh % n_kv_heads).to(tl.int64)

    offs_r = tl.arange(0, BLOCK_M)
    gi = offs_r // ROWS
    qrow = pid_m * ROWS + offs_r % ROWS
    row_ok = (gi < group) & (qrow < n_q)
    h = hk * group + gi
    pos = qrow + q_offset
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + qrow[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)

    cnt = tl.load(CNT + b * scb + hk * sch)
    idx_base = IDX + b * sib + hk * sih
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start in range(0, cnt, BLOCK_N):
        offs_s = start + offs_n
        tok_in = offs_s < cnt
        tok = tl.load(idx_base + offs_s * sis, mask=tok_in, other=0)
        tok_ok = tok_in & (tok >= 0)
        tok = tl.where(tok_ok, tok, 0)
        kt = tl.load(k_base + tok[None, :] * skn + offs_d[:, None] * skd,
                     mask=tok_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        t = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        valid = tok_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            valid = valid & (tok[None, :] <= pos[:, None])
        t = tl.where(valid, t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(t - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + tok[:, None] * svn + offs_dv[None, :] * svd,
                    mask=tok_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    ok = row_ok & (l_i > 0.0)
    l_safe = tl.where(ok, l_i, 1.0)
    o = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(OUT + b * sob + h[:, None] * soh + qrow[:, None] * som + offs_dv[None, :] * sod, o.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(LSE + b * slb + h * slh + qrow * slm, lse, mask=row_ok)


class _GatherForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, token_index, scale, causal, q_offset):
        with device_guard(q):
            return _gather_forward(q, k, v, token_index, scale, causal, q_offset)

    @staticmethod
    def backward(ctx, do, dlse):
        raise NotImplementedError("triton_gather_attention is forward-only (K3 has no backward kernel); for "
                                  "gradients use litctx_kernels.reference.gather_attention_reference or triton_attention "
                                  "with a layout")


def _gather_forward(q, k, v, token_index: TokenIndex, scale: float, causal: bool, q_offset: int):
    b, hq, n_q, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    g = hq // hk
    o = torch.empty((b, hq, n_q, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0 and lse.numel() == 0:
        return o, lse
    idx = token_index.idx.to(device=q.device, dtype=torch.int32)
    cnt = token_index.counts.to(device=q.device, dtype=torch.int32)
    cfg = attention_config("gather", d, q.dtype)
    g_pad = next_pow2(g)
    rows = max(1, min(next_pow2(n_q), max(1, cfg.block_m // g_pad)))
    rows = max(rows, 16 // g_pad if g_pad < 16 else 1)  # tl.dot needs >= 16 rows per tile
    grid = (triton.cdiv(n_q, rows), b * hk)
    _gather_fwd_kernel[grid](
        q, k, v, o, lse, idx, cnt,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(), *idx.stride(), *cnt.stride(),
        hk, g, n_q, q_offset, scale * 1.4426950408889634,
        HEAD_D=d, HEAD_DV=dv, BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
        ROWS=rows, BLOCK_M=rows * g_pad, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
        DOT_PREC="ieee" if q.dtype == torch.float32 else None, **cfg.launch_kwargs(),
    )
    return o, lse


def triton_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: TokenIndex, *,
                            scale: Optional[float] = None, causal: bool = True,
                            q_offset: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its kv head's token list (K3, forward only).

    Args:
        q: ``[B, Hq, Nq, d]``; k: ``[B, Hk, Nk, d]``; v: ``[B, Hk, Nk, dv]``, ``Hq % Hk == 0`` (query head ``h`` reads
            kv head ``h // (Hq // Hk)``). Any strides. float16 / float32 (bfloat16 compiled on CUDA; cast to float32
            in the interpreter).
        token_index: :class:`TokenIndex` with ``idx [B, Hk, S]`` (ascending, ``-1`` padded), ``counts [B, Hk]``,
            ``n_k == Nk``: query row ``i`` of head ``h`` attends to ``idx[b, h // G, :counts[b, h // G]]``.
        scale: default ``1/sqrt(d)``.
        causal: skip listed keys after the query's position ``i + q_offset``.
        q_offset: default ``Nk - Nq``.

    Returns:
        ``(o [B, Hq, Nq, dv]`` in q's dtype, ``lse [B, Hq, Nq]`` float32 natural log); rows with no valid token
        have ``o = 0`` and ``lse = -inf``.

    The result is not differentiable: calling ``backward`` through it raises ``NotImplementedError`` (use the
    torch reference, or :func:`litctx_kernels.triton.triton_attention` with a layout, when gradients are needed).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [B, H, N, d], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    b, hq, n_q, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[-1] != d or tuple(v.shape[1:3]) != tuple(k.shape[1:3]):
        raise ValueError(f"inconsistent shapes: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         "(need k [B, Hk, Nk, d], v [B, Hk, Nk, dv])")
    hk, n_k = k.shape[1], k.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hk} (GQA)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(token_index, TokenIndex):
        raise TypeError(f"token_index must be a TokenIndex, got {type(token_index).__name__}")
    if tuple(token_index.idx.shape[:2]) != (b, hk) or token_index.n_k != n_k:
        raise ValueError(f"token_index (idx {list(token_index.idx.shape)}, n_k={token_index.n_k}) must be "
                         f"[B, Hk, S]=[{b}, {hk}, S] over Nk={n_k} keys")
    if token_index.idx.device != q.device:
        raise ValueError(f"token_index is on {token_index.idx.device}, q on {q.device}")
    check_device(q, k, v)
    check_offsets(q=q, k=k, v=v)
    kd = kernel_dtype(q.dtype)
    out_dtype = q.dtype
    sc = float(1.0 / math.sqrt(d) if scale is None else scale)
    off = resolve_q_offset(n_q, n_k, q_offset)
    o, lse = _GatherForwardOnly.apply(q.to(kd), k.to(kd), v.to(kd), token_index, sc, bool(causal), off)
    return o.to(out_dtype), lse
