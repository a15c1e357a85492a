"""Oracle quantities for judging a block selection: the exact attention mass of every block, recall and the
relative output error."""

from __future__ import annotations

import math

import torch

from kernels import BlockLayout
from lightning_modules.sparse_prefill.estimators import expand_kv

__all__ = ["block_attention_mass", "attention_recall", "relative_output_error"]


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_q: int, block_k: int,
                         chunk: int = 256) -> torch.Tensor:
    """``[B, Hq, Mq, Mk]``: the summed exact causal attention probabilities of each (query block, key block),
    computed in float64 one chunk of query rows at a time (each row sums to 1, so the whole tensor sums to N)."""
    b, hq, n, d = q.shape
    kq = expand_kv(k, hq).double()
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    out = torch.zeros(b, hq, mq, mk, dtype=torch.float64, device=q.device)
    kb = torch.arange(n, device=q.device) // block_k
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(n, start + chunk), device=q.device)
        s = torch.matmul(q[:, :, rows].double(), kq.transpose(-1, -2)) * scale
        s = s.masked_fill(torch.arange(n, device=q.device).view(1, -1) > rows.view(-1, 1), float("-inf"))
        p = torch.softmax(s, -1)  # [B, H, c, N]
        per_key_block = torch.zeros(b, hq, rows.numel(), mk, dtype=torch.float64, device=q.device)
        per_key_block.index_add_(-1, kb, p)
        qb = rows // block_q
        out.index_add_(2, qb, per_key_block)
    return out


def attention_recall(mass: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Share of the exact attention mass inside the layout's blocks, per (batch, head): ``[B, H]`` in [0, 1]."""
    keep = layout.to_block_mask().to(mass.device).expand_as(mass)
    return (mass * keep).sum((-1, -2)) / mass.sum((-1, -2))


def relative_output_error(o: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``||O - O_ref||_F / ||O_ref||_F`` per (batch, head): ``[B, H]``."""
    diff = (o.double() - reference.double()).pow(2).sum((-1, -2)).sqrt()
    return diff / reference.double().pow(2).sum((-1, -2)).sqrt().clamp_min(1e-300)
