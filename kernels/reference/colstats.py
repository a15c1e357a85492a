"""Reference per-key attention statistics over a query window (the raw moments behind H2O, SnapKV and the
output-aware OBCache scores).

For the window rows ``i`` (the last ``q_window`` queries) with probabilities ``P_ij`` and outputs ``o_i``:
``p_sum_j = sum_i P_ij``, ``p2_sum_j = sum_i P_ij^2``, ``p2_o_j = sum_i P_ij^2 o_i`` and
``p2_o_norm2_j = sum_i P_ij^2 ||o_i||^2``. Never stores more than ``chunk x Nk`` probabilities per head.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from kernels.layouts import resolve_q_offset
from kernels.reference.attention import _valid_mask, attention_reference, check_qkv

__all__ = ["ColStats", "attention_colstats_reference"]


class ColStats(NamedTuple):
    """Per-key statistics, float32 (float64 for float64 inputs).

    Attributes:
        p_sum: ``[B, Hq, Nk]`` accumulated attention.
        p2_sum: ``[B, Hq, Nk]`` accumulated squared attention.
        p2_o: ``[B, Hq, Nk, dv]`` squared-attention-weighted sum of the window outputs.
        p2_o_norm2: ``[B, Hq, Nk]`` squared-attention-weighted sum of the outputs' squared norms.
    """

    p_sum: torch.Tensor
    p2_sum: torch.Tensor
    p2_o: torch.Tensor
    p2_o_norm2: torch.Tensor


def attention_colstats_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                                 causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                                 q_window: Optional[int] = None, o: Optional[torch.Tensor] = None,
                                 lse: Optional[torch.Tensor] = None, chunk: int = 128) -> ColStats:
    """Statistics of softmax attention of the last ``q_window`` rows of ``q [B, Hq, Nq, d]`` (all rows if None).

    ``o [B, Hq, W, dv]`` and ``lse [B, Hq, W]`` of those rows may be passed (e.g. from the prefill); they are
    computed with :func:`attention_reference` otherwise.
    """
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    w = n_q if q_window is None else int(q_window)
    if not 0 < w <= n_q:
        raise ValueError(f"q_window must be in [1, Nq={n_q}], got {q_window}")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qw = q[:, :, n_q - w:]
    if o is None or lse is None:
        o, lse = attention_reference(qw, k, v, scale=scale, causal=causal, q_offset=off + n_q - w, window=window,
                                     chunk=chunk)
    if tuple(o.shape) != (b, hq, w, dv) or tuple(lse.shape) != (b, hq, w):
        raise ValueError(f"o {list(o.shape)} / lse {list(lse.shape)} must be [B, Hq, W, dv] / [B, Hq, W] with "
                         f"W={w}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    kw = k.to(work)
    g = hq // hk
    p_sum = torch.zeros(b, hq, n_k, dtype=work, device=q.device)
    p2_sum = torch.zeros_like(p_sum)
    p2_o = torch.zeros(b, hq, n_k, dv, dtype=work, device=q.device)
    p2_on = torch.zeros_like(p_sum)
    for start in range(0, w, chunk):
        sl = slice(start, min(start + chunk, w))
        qc = qw[:, :, sl].to(work)
        c = qc.shape[2]
        s = torch.matmul(qc.reshape(b, hk, g * c, d), kw.transpose(-1, -2)).view(b, hq, c, n_k) * scale
        rows = torch.arange(n_q - w + sl.start, n_q - w + sl.stop, device=q.device).view(1, 1, c)
        valid = _valid_mask(rows + off, n_k, causal, window, None, None, None, rows)
        lse_c = lse[:, :, sl].to(work)
        lse_safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
        p = torch.exp(s - lse_safe.unsqueeze(-1)).masked_fill(~valid, 0.0)
        p2 = p * p
        oc = o[:, :, sl].to(work)
        p_sum += p.sum(2)
        p2_sum += p2.sum(2)
        p2_o += torch.einsum("bhcn,bhcd->bhnd", p2, oc)
        p2_on += torch.einsum("bhcn,bhc->bhn", p2, oc.pow(2).sum(-1))
    return ColStats(p_sum, p2_sum, p2_o, p2_on)
