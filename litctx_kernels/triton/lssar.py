"""K6: the LSSAR forward in Triton - log-domain re-weighted softplus attention in two passes.

LSSAR (``../shared/research/attention_kernels.md`` section 5.2) re-weights the LSSA weights ``A_ij`` of a row as
``relu(N_i A_ij - O_i)^p`` and normalises again. Raising to ``p = 15`` overflows fp32 for sharp heads, so the
kernel works in the log domain: the weight of key ``j`` is ``exp(phi_ij)`` with
``phi_ij = p log(N_i A_ij - O_i)`` (``-inf`` where ``N_i A_ij <= O_i``) and an online softmax over ``phi``.

* **Pass 1** is the LSSA forward of K1 (:mod:`litctx_kernels.triton.attention`, ``LSSA`` mode): its natural-log LSE is
  ``log Z_i = log sum_j softplus(kappa_i c_ij)``, so ``log A_ij = log softplus(kappa_i c_ij) - log Z_i``; its
  output is the fallback of rows whose weights are all exactly uniform (every ``phi = -inf``), as in the reference.
* **Pass 2** (``_lssar_fwd_kernel``, grid ``(query tiles, B * Hq)``): recomputes the cosines of each key tile,
  ``u = N_i exp(log A) - O_i`` and ``phi = p log2(u)`` (base 2 for ``exp2``), and accumulates ``softmax(phi) V``
  with fp32 running max / sum.

Cost: pass 1 is a full LSSA forward, pass 2 another QK^T and PV: about 2x a softmax forward (the PV of pass 1 is
kept for the fallback rows). Masks: dense, causal (bottom-right ``q_offset``) and sliding windows, GQA; key masks,
block layouts and query subsets run the reference (the dispatcher decides). The backward recomputes the torch
reference under autograd (``litctx_kernels.reference.attention_reference``, chunked and checkpointed), as planned in the
research note: a Triton backward for LSSAR is future work.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from litctx_kernels.layouts import resolve_q_offset
from litctx_kernels.triton._compat import attention_config, check_device, check_offsets, device_guard, kernel_dtype, next_pow2
from litctx_kernels.triton.attention import _Spec, _forward, _key_range, _lssa_kappa, _lssa_logits, _pair_mask, _validate

__all__ = ["triton_lssar_attention"]

_LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: compiled kernels may read only constexpr globals


@triton.jit
def _lssar_fwd_kernel(
    Q, K, V, O1, LSE1, OUT, LSE,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    s1b, s1h, s1m, s1d, sl1b, sl1h, sl1m, sob, soh, som, sod, slb, slh, slm,
    n_heads, group, n_q, n_k, q_offset, window, log_d, power, offset_rows,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    hk = h // group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_q
    pos = offs_m + q_offset
    pos_min = pid_m * BLOCK_M + q_offset
    pos_max = tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_q) - 1 + q_offset
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    kappa = _lssa_kappa(pos, n_k, window, log_d, CAUSAL, HAS_WINDOW)
    if CAUSAL:
        n_i = tl.minimum(pos + 1, n_k)
        if HAS_WINDOW:
            n_i = tl.minimum(n_i, window)
    else:
        n_i = pos * 0 + n_k
    n_i = tl.maximum(n_i, 1).to(tl.float32)
    off_i = tl.where(pos >= offset_rows, 1.0, 0.0)
    lse1 = tl.load(LSE1 + b * sl1b + h * sl1h + offs_m * sl1m, mask=row_ok, other=0.0)
    lse1 = tl.where(lse1 == float("-inf"), 0.0, lse1)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, hi, _full_lo, _full_hi = _key_range(pos_min, pos_max, n_k, window, BLOCK_N, CAUSAL, HAS_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_in = cols < n_k
        kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=col_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PREC)
        t2, _fac = _lssa_logits(s, kappa[:, None])             # log2 softplus(kappa c)
        u = n_i[:, None] * tl.exp(t2 * _LN2 - lse1[:, None]) - off_i[:, None]
        valid = _pair_mask(cols[None, :], pos[:, None], n_k, window, CAUSAL, HAS_WINDOW) & row_ok[:, None]
        valid = valid & (u > 0.0)
        t = tl.where(valid, power * tl.log2(tl.where(valid, u, 1.0)), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(t - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :] * svd,
                    mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    ok = row_ok & (l_i > 0.0)
    l_safe = tl.where(ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    # rows whose LSSA weights are all exactly uniform: the LSSA output and LSE (the reference's convention)
    o1 = tl.load(O1 + b * s1b + h * s1h + offs_m[:, None] * s1m + offs_dv[None, :] * s1d,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0).to(tl.float32)
    lse1_raw = tl.load(LSE1 + b * sl1b + h * sl1h + offs_m * sl1m, mask=row_ok, other=float("-inf"))
    o = tl.where(ok[:, None], o, o1)
    lse = tl.where(ok, (m_i + tl.log2(l_safe)) * _LN2, lse1_raw)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod, o.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(LSE + b * slb + h * slh + offs_m * slm, lse, mask=row_ok)


def _lssar_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int,
                   window: Optional[int], power: float, offset_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both passes on normalised ``q, k`` (kernel dtype); returns ``(o, lse)``."""
    spec = _Spec(scale=1.0, causal=causal, q_offset=q_offset, window=window, layout=None, q_index=None, lssa=True)
    o1, lse1 = _forward(q, k, v, spec)  # pass 1: the LSSA output and log Z
    b, hq, n_q, d = q.shape
    dv = v.shape[-1]
    o = torch.empty((b, hq, n_q, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, n_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    cfg = attention_config("fwd", d, q.dtype)
    grid = (triton.cdiv(n_q, cfg.block_m), b * hq)
    _lssar_fwd_kernel[grid](
        q, k, v, o1, lse1, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o1.stride(), *lse1.stride(), *o.stride(), *lse.stride(),
        hq, hq // k.shape[1], n_q, k.shape[2], q_offset, window if window is not None else 0, math.log(d),
        float(power), int(offset_rows),
        HEAD_D=d, HEAD_DV=dv, BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else None, **cfg.launch_kwargs(),
    )
    return o, lse


class _TritonLSSAR(torch.autograd.Function):
    """Triton forward; the backward differentiates the torch reference recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, v, causal, q_offset, window, power, offset_rows):
        kd = kernel_dtype(q.dtype)
        qn = torch.nn.functional.normalize(q.float(), dim=-1, eps=1e-12).to(kd)
        kn = torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-12).to(kd)
        with device_guard(q):
            o, lse = _lssar_forward(qn, kn, v.to(kd), causal=causal, q_offset=q_offset, window=window, power=power,
                                    offset_rows=offset_rows)
        ctx.save_for_backward(q, k, v)
        ctx.args = (causal, q_offset, window, power, offset_rows)
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, dlse):
        from litctx_kernels.reference.attention import attention_reference

        q, k, v = ctx.saved_tensors
        causal, q_offset, window, power, offset_rows = ctx.args
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
            o, lse = attention_reference(qr, kr, vr, causal=causal, q_offset=q_offset, window=window,
                                         score_mode="lssar", lssar_power=power, lssar_offset_rows=offset_rows)
            outs, grads = [], []
            if do is not None:
                outs.append(o)
                grads.append(do.to(o.dtype))
            if dlse is not None:
                finite = torch.isfinite(lse)
                outs.append(torch.where(finite, lse, torch.zeros_like(lse)))
                grads.append(torch.where(finite, dlse.to(lse.dtype), torch.zeros_like(lse)))
            dq, dk, dv = torch.autograd.grad(outs, (qr, kr, vr), grads, allow_unused=True)
        return dq, dk, dv, None, None, None, None, None


def triton_lssar_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                           q_offset: Optional[int] = None, window: Optional[int] = None, power: float = 15.0,
                           offset_rows: int = 3) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSSAR attention of ``q [B, Hq, Nq, d]`` over ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]`` (GQA), the
    semantics of :func:`litctx_kernels.reference.attention_reference` with ``score_mode="lssar"``.

    Args:
        causal, q_offset, window: the element mask (``q_offset`` default ``Nk - Nq``, bottom-right); ``N_i`` counts
            the keys the causal/window mask allows row ``i`` by absolute position.
        power: the sharpening power ``p``; offset_rows: positions below this have offset ``O_i = 0``.

    Returns:
        ``(o [B, Hq, Nq, dv]`` in q's dtype, ``lse [B, Hq, Nq]`` float32: ``log sum_j relu(N_i A_ij - O_i)^p``,
        natural log; the LSSA LSE for rows that fall back to the LSSA output).
    """
    _validate(q, k, v, causal, window, None, None, "lssa")
    check_device(q, k, v)
    check_offsets(q=q, k=k, v=v)
    if power <= 0:
        raise ValueError(f"power must be > 0, got {power}")
    off = resolve_q_offset(q.shape[2], k.shape[2], q_offset)
    return _TritonLSSAR.apply(q, k, v, bool(causal), off, None if window is None else int(window), float(power),
                              int(offset_rows))
