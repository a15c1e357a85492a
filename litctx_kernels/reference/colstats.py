"""Reference per-key attention statistics over a query window (the raw moments behind H2O, SnapKV and the
output-aware OBCache scores).

For the window rows ``i`` (the last ``q_window`` queries) with probabilities ``P_ij``, scaled logits ``z_ij``
and outputs ``o_i``: ``p_sum_j = sum_i P_ij``, ``p2_sum_j = sum_i P_ij^2``, ``p2_o_j = sum_i P_ij^2 o_i`` and
``p2_o_norm2_j = sum_i P_ij^2 ||o_i||^2``; with ``moments="logit"`` also the logit-weighted moments
``sum_i P_ij^2 z_ij``, ``sum_i P_ij^2 z_ij o_i``, ``sum_i (P_ij z_ij)^2``, ``sum_i (P_ij z_ij)^2 o_i`` and
``sum_i (P_ij z_ij)^2 ||o_i||^2`` (OBCache's key and cross terms). Never stores more than ``chunk x Nk``
probabilities per head, and skips the keys a causal chunk cannot see.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from litctx_kernels.layouts import resolve_q_offset
from litctx_kernels.reference.attention import _valid_mask, attention_reference, check_qkv

__all__ = ["ColStats", "attention_colstats_reference", "decode_attention_colstats", "MOMENTS"]

MOMENTS = ("attention", "output", "logit")
"""Which statistics to compute: ``attention`` (p_sum, p2_sum), ``output`` (+ p2_o, p2_o_norm2), ``logit``
(+ the five logit-weighted moments)."""


class ColStats(NamedTuple):
    """Per-key statistics, float32 (float64 for float64 inputs).

    Attributes:
        p_sum: ``[B, Hq, Nk]`` accumulated attention.
        p2_sum: ``[B, Hq, Nk]`` accumulated squared attention.
        p2_o: ``[B, Hq, Nk, dv]`` squared-attention-weighted sum of the window outputs.
        p2_o_norm2: ``[B, Hq, Nk]`` squared-attention-weighted sum of the outputs' squared norms.
        p2z_sum, p2z_o: ``sum_i P^2 z`` ``[B, Hq, Nk]`` and ``sum_i P^2 z o_i`` ``[B, Hq, Nk, dv]``.
        p2z2_sum, p2z2_o, p2z2_o_norm2: ``sum_i (P z)^2``, ``sum_i (P z)^2 o_i``, ``sum_i (P z)^2 ||o_i||^2``.

    ``p2_o`` / ``p2_o_norm2`` are None for ``moments="attention"``; the logit moments are None unless
    ``moments="logit"``.
    """

    p_sum: torch.Tensor
    p2_sum: torch.Tensor
    p2_o: Optional[torch.Tensor] = None
    p2_o_norm2: Optional[torch.Tensor] = None
    p2z_sum: Optional[torch.Tensor] = None
    p2z_o: Optional[torch.Tensor] = None
    p2z2_sum: Optional[torch.Tensor] = None
    p2z2_o: Optional[torch.Tensor] = None
    p2z2_o_norm2: Optional[torch.Tensor] = None


def attention_colstats_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                                 causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                                 q_window: Optional[int] = None, o: Optional[torch.Tensor] = None,
                                 lse: Optional[torch.Tensor] = None, chunk: int = 128, moments: str = "output",
                                 key_mask: Optional[torch.Tensor] = None) -> ColStats:
    """Statistics of softmax attention of the last ``q_window`` rows of ``q [B, Hq, Nq, d]`` (all rows if None).

    ``o [B, Hq, W, dv]`` and ``lse [B, Hq, W]`` of those rows may be passed (e.g. from the prefill); they are
    computed with :func:`attention_reference` otherwise. ``moments`` picks the statistics (:data:`MOMENTS`).
    ``key_mask`` (boolean ``[B, Hq, Nk]``, True = readable) removes keys per row and head, as in
    :func:`attention_reference`; a passed ``lse`` must come from attention with the same mask.
    """
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    if moments not in MOMENTS:
        raise ValueError(f"moments={moments!r}: valid values are {', '.join(MOMENTS)}")
    if key_mask is not None and tuple(key_mask.shape) != (b, hq, n_k):
        raise ValueError(f"key_mask must be [B, Hq, Nk]=[{b}, {hq}, {n_k}], got {list(key_mask.shape)}")
    w = n_q if q_window is None else int(q_window)
    if not 0 < w <= n_q:
        raise ValueError(f"q_window must be in [1, Nq={n_q}], got {q_window}")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qw = q[:, :, n_q - w:]
    if o is None or lse is None:
        o, lse = attention_reference(qw, k, v, scale=scale, causal=causal, q_offset=off + n_q - w, window=window,
                                     chunk=chunk, key_mask=key_mask)
    if tuple(o.shape) != (b, hq, w, dv) or tuple(lse.shape) != (b, hq, w):
        raise ValueError(f"o {list(o.shape)} / lse {list(lse.shape)} must be [B, Hq, W, dv] / [B, Hq, W] with "
                         f"W={w}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    kw = k.to(work)
    g = hq // hk
    out_m, logit_m = moments in ("output", "logit"), moments == "logit"

    def zeros(*tail):
        return torch.zeros(b, hq, n_k, *tail, dtype=work, device=q.device)

    acc = {"p_sum": zeros(), "p2_sum": zeros()}
    if out_m:
        acc.update(p2_o=zeros(dv), p2_o_norm2=zeros())
    if logit_m:
        acc.update(p2z_sum=zeros(), p2z_o=zeros(dv), p2z2_sum=zeros(), p2z2_o=zeros(dv), p2z2_o_norm2=zeros())
    for start in range(0, w, chunk):
        sl = slice(start, min(start + chunk, w))
        qc = qw[:, :, sl].to(work)
        c = qc.shape[2]
        # a causal chunk sees no key after its last row's position
        last = off + n_q - w + sl.stop - 1
        n_see = min(n_k, last + 1) if causal else n_k
        if n_see <= 0:
            continue
        s = torch.matmul(qc.reshape(b, hk, g * c, d), kw[:, :, :n_see].transpose(-1, -2)).view(b, hq, c, n_see)
        s = s * scale
        rows = torch.arange(n_q - w + sl.start, n_q - w + sl.stop, device=q.device).view(1, 1, c)
        km = key_mask[..., :n_see] if key_mask is not None else None
        valid = _valid_mask(rows + off, n_see, causal, window, None, None, km, rows)
        lse_c = lse[:, :, sl].to(work)
        lse_safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
        p = torch.exp(s - lse_safe.unsqueeze(-1)).masked_fill(~valid, 0.0)
        p2 = p * p
        cols = slice(0, n_see)
        acc["p_sum"][..., cols] += p.sum(2)
        acc["p2_sum"][..., cols] += p2.sum(2)
        if out_m:
            oc = o[:, :, sl].to(work)
            on = oc.pow(2).sum(-1)
            acc["p2_o"][..., cols, :] += torch.einsum("bhcn,bhcd->bhnd", p2, oc)
            acc["p2_o_norm2"][..., cols] += torch.einsum("bhcn,bhc->bhn", p2, on)
        if logit_m:
            p2z = p2 * s.masked_fill(~valid, 0.0)
            p2z2 = p2z * s.masked_fill(~valid, 0.0)
            acc["p2z_sum"][..., cols] += p2z.sum(2)
            acc["p2z_o"][..., cols, :] += torch.einsum("bhcn,bhcd->bhnd", p2z, oc)
            acc["p2z2_sum"][..., cols] += p2z2.sum(2)
            acc["p2z2_o"][..., cols, :] += torch.einsum("bhcn,bhcd->bhnd", p2z2, oc)
            acc["p2z2_o_norm2"][..., cols] += torch.einsum("bhcn,bhc->bhn", p2z2, on)
    return ColStats(**acc)


def decode_attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                              key_mask: Optional[torch.Tensor] = None, moments: str = "attention"):
    """Attention of queries that see every key (a decode step: ``Nq`` is small and there is no causal cut) and
    their per-key statistics in one pass: the probabilities that give the output are the ones summed, so an
    eviction scorer needs no second pass over the keys.

    ``q [B, Hq, Nq, d]``, ``k, v [B, Hk, N, d|dv]`` (GQA without repeating K/V), ``key_mask [B, Hk, N]`` (True =
    readable; shared by a KV head's query heads) or None; ``moments`` ``attention`` or ``output`` (the logit
    moments: :func:`attention_colstats_reference`). Returns ``(o [B, Hq, Nq, dv], lse [B, Hq, Nq], ColStats)`` with
    the statistics of all ``Nq`` queries (what :func:`attention_colstats_reference` gives with
    ``causal=False``); a row with no readable key has ``o = 0``, ``lse = -inf`` and adds nothing."""
    if moments not in MOMENTS[:2]:
        raise ValueError(f"moments={moments!r}: the fused decode statistics give attention or output")
    b, hq, n_q, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"{hq} query heads cannot share {hk} key/value heads")
    g = hq // hk
    s = torch.matmul(q.reshape(b, hk, g * n_q, d) * scale, k.transpose(-1, -2))  # [B, Hk, g Nq, N]
    lse = torch.logsumexp(s, dim=-1, keepdim=True) if key_mask is None else None
    if key_mask is not None:
        if tuple(key_mask.shape) != (b, hk, n):
            raise ValueError(f"key_mask must be [B, Hk, N]=[{b}, {hk}, {n}], got {list(key_mask.shape)}")
        s = s.masked_fill(~key_mask.unsqueeze(2), float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))  # -inf rows: p = 0
    else:  # every key readable: no empty row, one fused softmax
        p = torch.softmax(s, dim=-1)
    o = torch.matmul(p.to(v.dtype), v)  # [B, Hk, g Nq, dv]
    p = p.view(b, hq, n_q, n)
    p2 = p * p
    o_q = o.view(b, hq, n_q, -1)
    stats = ColStats(p.sum(2), p2.sum(2))
    if moments == "output":
        stats = ColStats(stats.p_sum, stats.p2_sum, torch.einsum("bhqn,bhqd->bhnd", p2, o_q),
                         torch.einsum("bhqn,bhq->bhn", p2, o_q.pow(2).sum(-1)))
    return o_q, lse.view(b, hq, n_q), stats
