"""Fast low-bit block estimate (SALE's selection pass) in plain torch, for CPU and any device without a fused
kernel.

Same quantities as :func:`kernels.reference.lowbit.lowbit_block_estimate_reference` (see its module docstring):
a block is kept when some valid pair has ``scale * S~_ij - lse_i >= ln(tau_h)`` with
``S~_ij = (Qq_i . Kq_j) sigma_i sigma_j + b_j``. Three rewrites make it cheap without changing the test:

* **one matmul per chunk**: ``S~_ij = q'_i . k'_j`` with the augmented vectors ``q'_i = [sigma_i Qq_i, 1]`` and
  ``k'_j = [sigma_j Kq_j, b_j]`` (``d + 1`` columns; the bias depends on the query head, so ``k'`` is per query
  head);
* **a per-row threshold**: the test is ``S~_ij >= t_i = (lse_i + ln tau_h) / scale``, so no exponential and no
  per-element rescaling;
* **pool before comparing**: the maximum of ``S~`` over each key block's columns, compared once per
  (row, key block); then any row of the query block.

Queries are processed ``chunk_rows`` at a time against only the keys their causal prefix can see (the masked
tail of the boundary columns is set to ``-inf``), so memory stays ``O(chunk_rows x Nk)`` per head and about half
of the causal square is skipped. The flags equal the reference's except where a block's best pair sits within
float rounding of the threshold (the two forms round differently).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from kernels.layouts import BlockLayout, causal_block_mask, resolve_q_offset
from kernels.reference.attention import check_qkv
from kernels.reference.lowbit import check_estimate_inputs, quantize_qk_lowbit

__all__ = ["lowbit_block_estimate"]


def lowbit_block_estimate(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                          tau: Union[float, Sequence[float], torch.Tensor], *, scale: Optional[float] = None,
                          block_q: int = 64, block_k: int = 32, bits: int = 4, group_size: int = 1,
                          causal: bool = True, q_offset: Optional[int] = None, chunk_rows: int = 512) -> BlockLayout:
    """Blocks whose estimated Relative Attention Score reaches ``tau`` -> a ``[B, Hq]`` :class:`BlockLayout`.

    Args:
        q, k: ``[B, Hq, Nq, d]`` and ``[B, Hk, Nk, d]``.
        lse: ``[B, Hq, Nq]`` natural-log LSE of the exact pass the scores are relative to.
        tau: one threshold, or one per query head (``[Hq]``); 0 keeps every (causal) block of that head.
        scale: softmax scale (default ``1/sqrt(d)``); block_q, block_k: the selection tile; bits, group_size:
            the quantisation (int4 per token by default); causal, q_offset: the mask (bottom-right aligned).
        chunk_rows: query rows per matmul (rounded up to a multiple of ``block_q``).
    """
    b, hq, hk, n_q, n_k, d, _ = check_qkv(q, k, k)
    tau_t = check_estimate_inputs(lse, tau, b, hq, n_q)
    if min(block_q, block_k, chunk_rows) < 1:
        raise ValueError(f"block_q, block_k and chunk_rows must be >= 1, got {block_q}, {block_k}, {chunk_rows}")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    lb = quantize_qk_lowbit(q, k, bits, group_size)
    work = lb.bias.dtype
    g = hq // hk
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    n_kp = mk * block_k
    # augmented operands: S~ = q' k'^T exactly as the reference defines it (up to rounding)
    qa = torch.cat([lb.q_int.to(work) * lb.q_scale.unsqueeze(-1), torch.ones(b, hq, n_q, 1, dtype=work,
                                                                              device=q.device)], dim=-1)
    ks = (lb.k_int.to(work) * lb.k_scale.unsqueeze(-1)).repeat_interleave(g, dim=1)
    ka = torch.cat([ks, lb.bias.unsqueeze(-1)], dim=-1)  # [B, Hq, Nk, d + 1]
    if n_kp > n_k:
        ka = torch.cat([ka, ka.new_zeros(b, hq, n_kp - n_k, d + 1)], dim=-2)
    dense_head = (tau_t == 0).to(q.device)
    log_tau = torch.log(tau_t.clamp_min(1e-300)).to(work).to(q.device).view(1, hq, 1)
    thr = (lse.to(work) + log_tau) / scale  # [B, Hq, Nq]
    thr = torch.where(torch.isfinite(lse), thr, torch.full_like(thr, math.inf))  # a row with no exact key: no hit
    keep = torch.zeros(b, hq, mq, mk, dtype=torch.bool, device=q.device)
    step = max(1, math.ceil(chunk_rows / block_q)) * block_q
    cols = torch.arange(n_kp, device=q.device)
    for r0 in range(0, n_q, step):
        r1 = min(n_q, r0 + step)
        rows = torch.arange(r0, r1, device=q.device)
        n_see = min(n_k, off + r1) if causal else n_k
        if n_see <= 0:
            continue
        kb_see = math.ceil(n_see / block_k)
        s = torch.matmul(qa[:, :, r0:r1], ka[:, :, :kb_see * block_k].transpose(-1, -2))  # [B, Hq, c, kb*bk]
        # mask what some row of the chunk may not see: padded keys and (causal) keys after the row
        first_bad = min(n_k, off + r0 + 1) if causal else n_k
        if first_bad < kb_see * block_k:
            tail = cols[first_bad:kb_see * block_k]
            bad = tail.view(1, -1) >= n_k
            if causal:
                bad = bad | (tail.view(1, -1) > (rows + off).view(-1, 1))
            s[..., first_bad:] = s[..., first_bad:].masked_fill(bad, -math.inf)
        pooled = s.view(b, hq, r1 - r0, kb_see, block_k).amax(-1)  # [B, Hq, c, kb]
        hit = pooled >= thr[:, :, r0:r1].unsqueeze(-1)
        c = r1 - r0
        pad = (-c) % block_q
        if pad:
            hit = torch.cat([hit, hit.new_zeros(b, hq, pad, kb_see)], dim=2)
        m0 = r0 // block_q
        keep[:, :, m0:m0 + (c + pad) // block_q, :kb_see] = hit.view(b, hq, -1, block_q, kb_see).any(3)
    if bool(dense_head.any()):
        keep[:, dense_head] = True
    if causal:
        keep &= causal_block_mask(n_q, n_k, block_q, block_k, q_offset=off, device=q.device)
    return BlockLayout.from_block_mask(keep, block_q, block_k, (n_q, n_k))
