"""Float64 brute-force attention for tests: the full N x N matrix, written from the definitions (small N only)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def brute_mask(n_q, n_k, *, causal=True, q_offset=None, window=None, block_mask=None, block_q=None, block_k=None):
    """Boolean ``[B', H', Nq, Nk]`` validity (``block_mask [B, H, Mq, Mk]`` optional)."""
    off = n_k - n_q if q_offset is None else q_offset
    i = torch.arange(n_q).view(-1, 1)
    j = torch.arange(n_k).view(1, -1)
    valid = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        valid &= j <= i + off
        if window is not None:
            valid &= j > i + off - window
    valid = valid[None, None]
    if block_mask is not None:
        valid = valid & block_mask[:, :, i.view(-1) // block_q][..., j.view(-1) // block_k]
    return valid


def row_lengths(n_q, n_k, *, causal=True, q_offset=None, window=None):
    off = n_k - n_q if q_offset is None else q_offset
    pos = torch.arange(n_q) + off
    if not causal:
        return torch.full((n_q,), n_k), pos
    n = torch.clamp(pos + 1, 0, n_k)
    return (n if window is None else torch.clamp(n, max=window)), pos


def brute_attention(q, k, v, valid, *, scale=None, mode="softmax", n_i=None, pos=None, power=15.0,
                    offset_rows=3, dtype=torch.float64):
    """``q [B, Hq, Nq, d]``, ``k, v [B, Hk, Nk, d]`` -> ``(o, lse, P)``; K/V repeated for GQA (fine in a test)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    d = q.shape[-1]
    if mode == "softmax":
        s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
        s = s.masked_fill(~valid, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return p @ v, lse, p
    c = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    n = n_i.to(dtype).view(-1, 1)
    kappa = math.log(d) * torch.log(n.clamp_min(1))
    a = F.softplus(kappa * c) * valid
    z = a.sum(-1, keepdim=True)
    a = a / z
    if mode == "lssa":
        return a @ v, torch.log(z.squeeze(-1)), a
    o_off = (pos >= offset_rows).to(dtype).view(-1, 1)
    w = torch.relu(n * a - o_off) ** power * valid
    w = w / w.sum(-1, keepdim=True)
    return w @ v, None, w
