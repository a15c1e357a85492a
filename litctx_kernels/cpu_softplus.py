"""LSSA and LSSAR attention on CPU in the direct domain: the path :func:`litctx_kernels.attention` takes for the
softplus score modes on CPU (no layout, no query subset), in place of the log-domain reference.

The reference (:mod:`litctx_kernels.reference.attention`) works with log-weights ``phi`` and checkpointed
64-row chunks so that it is exact in float64 at any length; this path computes the same quantities with fewer
element-wise passes and plain autograd, which a training step of a small model feels (the reference's chunked,
recomputed backward was most of the LSSA/LSSAR overhead over softmax):

* LSSA: ``w_ij = softplus(kappa_i c_ij)`` on the valid keys (0 elsewhere), ``A = w / sum_j w``,
  ``lse_i = log sum_j w_ij``, with cosine logits ``c`` and ``kappa_i = ln(d) ln(N_i)``.
* LSSAR: ``x_ij = relu(N_i A_ij - O_i)``, ``m_i = max_j x_ij``; ``A'_ij = (x_ij / m_i)^p / sum_j (x_ij / m_i)^p``
  (dividing by the row maximum first keeps ``x^p`` finite: ``x <= N_i``) and ``lse_i = p ln m_i + ln sum_j
  (x_ij / m_i)^p``; a row with ``m_i = 0`` (uniform weights) keeps the LSSA output and ``lse``, as the reference.

Computed in float32 (float64 for float64 inputs). Memory: the rows run in chunks of at most
:data:`MAX_ELEMENTS` scores without autograd; a call that needs gradients runs here only when its whole score
tensor fits in :data:`MAX_ELEMENTS` (autograd keeps every chunk's intermediates), else :func:`softplus_fits`
says no and the dispatcher falls back to the reference, whose chunks are recomputed in backward. Also refused
(reference): ``kappa`` large enough for ``softplus(-kappa)`` to underflow, where the direct weights would lose
keys the log domain keeps.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from litctx_kernels.layouts import resolve_q_offset
from litctx_kernels.reference.attention import _key_span, broadcast_key_mask, row_lengths

__all__ = ["softplus_attention_cpu", "softplus_fits", "MAX_ELEMENTS", "MAX_KAPPA"]

MAX_ELEMENTS = 1 << 23
"""Scores ``B x Hq x rows x keys`` per chunk (and in all, for a call with gradients)."""

MAX_KAPPA = 80.0
"""Largest ``kappa = ln(d) ln(N)`` handled here (``softplus(-80)`` ~ 1.8e-35 is still a normal float32)."""


def softplus_fits(q: torch.Tensor, k: torch.Tensor, needs_grad: bool) -> bool:
    """Whether :func:`softplus_attention_cpu` takes ``q [B, Hq, Nq, d]`` over ``k [B, Hk, Nk, d]`` (see the module
    docstring): a small enough score tensor for a call with gradients, and ``kappa <= MAX_KAPPA``."""
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    if n_k > 1 and math.log(d) * math.log(n_k) > MAX_KAPPA:
        return False
    return not needs_grad or b * hq * n_q * n_k <= MAX_ELEMENTS


def softplus_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                           q_offset: Optional[int] = None, window: Optional[int] = None, score_mode: str = "lssa",
                           lssar_power: float = 15.0, lssar_offset_rows: int = 3,
                           key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSSA / LSSAR attention of ``q [B, Hq, Nq, d]`` over ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]`` (GQA when
    ``Hq > Hk``) with the reference's semantics (causal / window element mask, ``q_offset``, boolean ``key_mask
    [B, 1|Hk|Hq, Nk]``, already checked by the caller). Returns ``o [B, Hq, Nq, dv]`` in q's dtype and
    ``lse [B, Hq, Nq]`` (float32, float64 for float64 inputs); a row with no valid key gives ``o = 0``,
    ``lse = -inf``."""
    if score_mode not in ("lssa", "lssar"):
        raise ValueError(f"score_mode must be 'lssa' or 'lssar' here, got {score_mode!r}")
    b, hq, n_q, d = q.shape
    hk, n_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hk
    off = resolve_q_offset(n_q, n_k, q_offset)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qn = F.normalize(q.to(work), dim=-1, eps=1e-12)
    kn = F.normalize(k.to(work), dim=-1, eps=1e-12)
    vw = v.to(work)
    km = None if key_mask is None else broadcast_key_mask(key_mask, hq)  # [B, Hq, Nk]
    rows_per_chunk = max(1, MAX_ELEMENTS // max(1, b * hq * n_k))
    outs, lses = [], []
    for start in range(0, n_q, rows_per_chunk):
        stop = min(n_q, start + rows_per_chunk)
        pos = torch.arange(start, stop, device=q.device) + off  # [c]
        lo, hi = _key_span(torch.arange(start, stop), off, n_k, causal, window)  # the keys these rows may see
        c = stop - start
        o_c, lse_c = _chunk(qn[:, :, start:stop], kn[:, :, lo:hi], vw[:, :, lo:hi], pos, lo, n_k, g,
                            None if km is None else km[..., lo:hi], causal=causal, window=window,
                            lssar=score_mode == "lssar", power=float(lssar_power),
                            offset_rows=int(lssar_offset_rows))
        outs.append(o_c.view(b, hq, c, dv))
        lses.append(lse_c.view(b, hq, c))
    o = torch.cat(outs, 2) if outs else vw.new_zeros(b, hq, 0, dv) + 0 * (qn.sum() + kn.sum() + vw.sum())
    lse = torch.cat(lses, 2) if lses else qn.new_zeros(b, hq, 0)
    return o.to(q.dtype), lse


def _chunk(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, col0: int, n_k: int, g: int,
           km: Optional[torch.Tensor], *, causal: bool, window: Optional[int], lssar: bool, power: float,
           offset_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows ``qc [B, Hq, c, d]`` (normalised) over the key slice ``kc [B, Hk, n, d]`` / ``vc [B, Hk, n, dv]`` that
    starts at key ``col0`` of ``n_k``; ``pos [c]`` the rows' absolute positions; ``km [B, Hq, n]`` or None.
    Returns ``o [B, Hq, c, dv]`` and ``lse [B, Hq, c]``."""
    b, hq, c, d = qc.shape
    hk, n = kc.shape[1], kc.shape[2]
    s = torch.matmul(qc.reshape(b, hk, g * c, d), kc.transpose(-1, -2)).view(b, hq, c, n)
    j = torch.arange(col0, col0 + n, device=qc.device)
    valid = torch.ones(c, n, dtype=torch.bool, device=qc.device)
    if causal:
        valid = j.view(1, n) <= pos.view(c, 1)
        if window is not None:
            valid = valid & (j.view(1, n) > pos.view(c, 1) - window)
    valid = valid.view(1, 1, c, n)
    if km is not None:
        valid = valid & km.unsqueeze(-2)
    n_i = row_lengths(pos, n_k, causal, window).to(s.dtype).view(c, 1)  # [c, 1]
    kappa = math.log(d) * torch.log(n_i.clamp_min(1.0))
    w = F.softplus(kappa * s).masked_fill(~valid, 0.0)
    z = w.sum(-1, keepdim=True)
    has = z > 0
    z_safe = torch.where(has, z, torch.ones_like(z))
    a = w / z_safe
    lse = torch.where(has, torch.log(z_safe), torch.full_like(z, float("-inf")))
    if lssar:
        offset = (pos >= offset_rows).to(s.dtype).view(c, 1)
        x = torch.relu(n_i * a - offset).masked_fill(~valid, 0.0)
        m = x.amax(-1, keepdim=True)
        ok = m > 0
        m_safe = torch.where(ok, m, torch.ones_like(m))
        r = (x / m_safe).pow(power)
        z2 = r.sum(-1, keepdim=True)  # >= 1 where ok (the maximum contributes 1)
        z2_safe = torch.where(ok, z2, torch.ones_like(z2))
        a = torch.where(ok, r / z2_safe, a)
        lse = torch.where(ok, power * torch.log(m_safe) + torch.log(z2_safe), lse)
    o = torch.matmul(a.reshape(b, hk, g * c, n), vc).view(b, hq, c, vc.shape[-1])
    return o, lse.squeeze(-1)
