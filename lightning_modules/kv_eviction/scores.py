"""Per-token eviction scores from per-key attention statistics (:class:`litctx_kernels.ColStats`).

For one query head, observation queries ``i`` (a window, the last query, or every query so far), a token
``p`` with value ``v_p``, probabilities ``A_ip``, scaled logits ``z_ip`` and attention outputs ``o_i``
(before ``o_proj``):

* ``attention`` - accumulated attention ``sum_i A_ip`` (H2O, SnapKV, TOVA).
* ``obcache_v`` - OBCache value pruning ``S^V_p = sum_i A_ip^2 ||v_p||^2``: the exact squared output change
  when ``v_p`` is zeroed.
* ``obcache_k`` - OBCache key pruning ``S^K_p = sum_i (A_ip z_ip)^2 ||v_p - o_i||^2``: the first-order squared
  output change when ``z_ip -> 0``, expanded as ``||v_p||^2 sum (Az)^2 - 2 v_p . sum (Az)^2 o_i + sum (Az)^2
  ||o_i||^2``.
* ``obcache_kv`` - joint pruning ``S^V + S^K + S^x`` with the cross term
  ``S^x_p = 2 sum_i A_ip^2 z_ip (||v_p||^2 - v_p . o_i)``; the expansion of ``||A_ip v_p + z_ip A_ip (v_p - o_i)||^2``.

Every score is computed from column sums, never from an N x N matrix. Scores are per query head
``[B, Hq, N]``; :func:`group_heads` reduces them to the KV heads that share a cache entry.
"""

from __future__ import annotations

from typing import Tuple

import torch
from einops import repeat

import litctx_kernels

__all__ = ["SCORE_KINDS", "GQA_REDUCTIONS", "moments_for", "token_scores", "group_heads"]

SCORE_KINDS: Tuple[str, ...] = ("attention", "obcache_v", "obcache_k", "obcache_kv")
GQA_REDUCTIONS: Tuple[str, ...] = ("mean", "sum", "max")


def check_kind(kind: str) -> str:
    if kind not in SCORE_KINDS:
        raise ValueError(f"score={kind!r}: valid scores are {', '.join(SCORE_KINDS)}")
    return kind


def check_gqa(reduce: str) -> str:
    if reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa={reduce!r}: valid reductions are {', '.join(GQA_REDUCTIONS)}")
    return reduce


def moments_for(kind: str) -> str:
    """The :func:`litctx_kernels.attention_colstats` moments a score needs."""
    return "logit" if check_kind(kind) in ("obcache_k", "obcache_kv") else "attention"


def token_scores(stats: litctx_kernels.ColStats, values: torch.Tensor, kind: str) -> torch.Tensor:
    """Scores ``[B, Hq, N]`` (float32; higher = keep) from statistics over ``[B, Hq, N]`` keys and the values
    ``[B, Hk, N, dv]`` (GQA: query head ``h`` reads kv head ``h // (Hq / Hk)``)."""
    check_kind(kind)
    if kind == "attention":
        return stats.p_sum.float()
    b, hq, n = stats.p_sum.shape
    if values.dim() != 4 or values.shape[0] != b or values.shape[2] != n or hq % values.shape[1]:
        raise ValueError(f"values must be [B, Hk, N, dv] with B={b}, N={n} and Hk dividing Hq={hq}; got "
                         f"{list(values.shape)}")
    work = stats.p_sum.dtype
    v = repeat(values.to(work), "b hk n e -> b (hk g) n e", g=hq // values.shape[1])  # [B, Hq, N, dv]
    v_norm2 = v.pow(2).sum(-1)
    s_v = stats.p2_sum * v_norm2
    if kind == "obcache_v":
        return s_v.float()
    if stats.p2z2_sum is None:
        raise ValueError(f"score {kind!r} needs the logit moments: attention_colstats(..., moments='logit')")
    s_k = v_norm2 * stats.p2z2_sum - 2.0 * (v * stats.p2z2_o).sum(-1) + stats.p2z2_o_norm2
    if kind == "obcache_k":
        return s_k.clamp_min(0.0).float()
    s_x = 2.0 * (v_norm2 * stats.p2z_sum - (v * stats.p2z_o).sum(-1))
    return (s_v + s_k + s_x).clamp_min(0.0).float()


def group_heads(scores: torch.Tensor, n_kv_heads: int, reduce: str = "mean") -> torch.Tensor:
    """``[B, Hq, N]`` query-head scores -> ``[B, Hk, N]`` per KV head (the group of ``Hq / Hk`` query heads
    that reads one cache entry): ``mean`` (kvpress), ``sum`` (total output perturbation of the group) or
    ``max``."""
    check_gqa(reduce)
    b, hq, n = scores.shape
    if hq % n_kv_heads:
        raise ValueError(f"{hq} query heads cannot be grouped into {n_kv_heads} KV heads")
    grouped = scores.view(b, n_kv_heads, hq // n_kv_heads, n)
    if reduce == "max":
        return grouped.amax(2)
    return grouped.sum(2) if reduce == "sum" else grouped.mean(2)
