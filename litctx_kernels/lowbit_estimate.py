"""Fast low-bit block estimate (SALE's selection pass) in plain torch, for CPU and any device without a fused
kernel.

Same quantities as :func:`litctx_kernels.reference.lowbit.lowbit_block_estimate_reference` (see its module docstring):
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

**Exact tile skipping** (``prune=True``): for each key block, the box ``c_b +- r_b`` (per-dim centre and half
range of its augmented keys) bounds every logit of a row against it, ``q'_i . k'_j <= q'_i . c_b + |q'_i| . r_b``
(two ``[rows, d+1] x [d+1, Mk]`` products, ``2 / block_k`` of the estimate's own). A (query block, key block)
tile whose bound, plus a margin far above float32 rounding of both products, is below the threshold of every row
of the query block cannot be flagged, so its scores are never computed; the remaining key blocks of a head are
gathered and multiplied as before. The flags are the same as without skipping (tested), only cheaper when the
bound prunes. Measured on SmolLM2-135M at 8K (``python -m bench.sparse_prefill --parts timing``, the tile-bound
table in ``docs/results.md``): with the bound the estimate is 4-6% slower than without it at every threshold
(tau 0.004-10), i.e. it rules out too few tiles on real prompts to pay for its own products and gathers; hence
``prune=False`` by default.

On CUDA (or with ``backend="triton"`` under ``TRITON_INTERPRET=1``) the call runs the fused Triton kernel
:func:`litctx_kernels.triton.lowbit.triton_lowbit_block_estimate` (K4), whose flags equal the reference's exactly.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from litctx_kernels.layouts import BlockLayout, causal_block_mask, resolve_q_offset
from litctx_kernels.reference.attention import check_qkv
from litctx_kernels.reference.lowbit import check_estimate_inputs, lowbit_block_estimate_reference, quantize_qk_lowbit

__all__ = ["lowbit_block_estimate"]


def lowbit_block_estimate(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                          tau: Union[float, Sequence[float], torch.Tensor], *, scale: Optional[float] = None,
                          block_q: int = 64, block_k: int = 32, bits: int = 4, group_size: int = 1,
                          causal: bool = True, q_offset: Optional[int] = None, chunk_rows: int = 512,
                          prune: bool = False, backend: Optional[str] = None) -> BlockLayout:
    """Blocks whose estimated Relative Attention Score reaches ``tau`` -> a ``[B, Hq]`` :class:`BlockLayout`.

    Args:
        q, k: ``[B, Hq, Nq, d]`` and ``[B, Hk, Nk, d]``.
        lse: ``[B, Hq, Nq]`` natural-log LSE of the exact pass the scores are relative to.
        tau: one threshold, or one per query head (``[Hq]``); 0 keeps every (causal) block of that head.
        scale: softmax scale (default ``1/sqrt(d)``); block_q, block_k: the selection tile; bits, group_size:
            the quantisation (int4 per token by default); causal, q_offset: the mask (bottom-right aligned).
        chunk_rows: query rows per matmul (rounded up to a multiple of ``block_q``).
        prune: skip the tiles the exact bound rules out (torch path; the flags do not change). Off by default:
            on SmolLM2 prompts the bound rules out too few tiles to pay for itself (see below).
        backend: ``auto`` (Triton K4 for CUDA tensors when the tiles are powers of two >= 16, else torch),
            ``torch``, ``triton`` or ``reference``; default from ``LITCTX_KERNEL_BACKEND`` (see
            :mod:`litctx_kernels.dispatch`).
    """
    b, hq, hk, n_q, n_k, d, _ = check_qkv(q, k, k)
    tau_t = check_estimate_inputs(lse, tau, b, hq, n_q)
    if min(block_q, block_k, chunk_rows) < 1:
        raise ValueError(f"block_q, block_k and chunk_rows must be >= 1, got {block_q}, {block_k}, {chunk_rows}")
    chosen = _estimate_backend(q, backend, block_q, block_k)
    kw = dict(scale=scale, block_q=block_q, block_k=block_k, bits=bits, group_size=group_size, causal=causal,
              q_offset=q_offset)
    if chosen == "triton":
        from litctx_kernels.triton.lowbit import triton_lowbit_block_estimate

        return triton_lowbit_block_estimate(q, k, lse, tau_t, **kw)
    if chosen == "reference":
        return lowbit_block_estimate_reference(q, k, lse, tau_t, **kw)
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
    thr[:, dense_head] = math.inf  # nothing to compute: a dense head's blocks are all set at the end
    keep = torch.zeros(b, hq, mq, mk, dtype=torch.bool, device=q.device)
    box = _key_boxes(ka, block_k) if prune else None
    step = max(1, math.ceil(chunk_rows / block_q)) * block_q
    cols = torch.arange(n_kp, device=q.device)
    for r0 in range(0, n_q, step):
        r1 = min(n_q, r0 + step)
        rows = torch.arange(r0, r1, device=q.device)
        n_see = min(n_k, off + r1) if causal else n_k
        if n_see <= 0:
            continue
        kb_see = math.ceil(n_see / block_k)
        # key blocks every row of the chunk sees whole (no mask needed) come before the boundary blocks
        first_bad = min(n_k, off + r0 + 1) if causal else n_k
        kb_full = min(kb_see, first_bad // block_k)
        c = r1 - r0
        pad = (-c) % block_q
        m0, n_mb = r0 // block_q, (c + pad) // block_q
        qa_c, thr_c = qa[:, :, r0:r1], thr[:, :, r0:r1]
        kb_lo = 0
        if box is not None and kb_full > 0:
            _pruned_full_blocks(qa_c, thr_c, ka, box, kb_full, block_q, block_k, keep[:, :, m0:m0 + n_mb])
            kb_lo = kb_full
        s = torch.matmul(qa_c, ka[:, :, kb_lo * block_k:kb_see * block_k].transpose(-1, -2))  # [B, Hq, c, kb*bk]
        # mask what some row of the chunk may not see: padded keys and (causal) keys after the row
        if first_bad < kb_see * block_k:
            tail = cols[first_bad:kb_see * block_k]
            bad = tail.view(1, -1) >= n_k
            if causal:
                bad = bad | (tail.view(1, -1) > (rows + off).view(-1, 1))
            lo = first_bad - kb_lo * block_k
            s[..., lo:] = s[..., lo:].masked_fill(bad, -math.inf)
        pooled = s.view(b, hq, c, kb_see - kb_lo, block_k).amax(-1)  # [B, Hq, c, kb]
        hit = pooled >= thr_c.unsqueeze(-1)
        keep[:, :, m0:m0 + n_mb, kb_lo:kb_see] = _any_per_query_block(hit, block_q, pad)
    if bool(dense_head.any()):
        keep[:, dense_head] = True
    if causal:
        keep &= causal_block_mask(n_q, n_k, block_q, block_k, q_offset=off, device=q.device)
    return BlockLayout.from_block_mask(keep, block_q, block_k, (n_q, n_k))


BOUND_MARGIN = 1e-4
"""Relative slack of the tile bound (``x ||q'|| x ||box||``): float32 rounding of a ``d + 1``-term product is
below ``(d + 1) x 6e-8`` of the same scale, so a bound below the threshold by more than this margin cannot hide a
flagged pair."""


def _estimate_backend(q: torch.Tensor, backend: Optional[str], block_q: int, block_k: int) -> str:
    """The estimate's backend: the dispatcher's choice, with Triton only for tiles the kernel can take."""
    from litctx_kernels.dispatch import select_backend

    wanted = backend if backend is not None else None
    if (wanted or "").strip().lower() == "triton" or q.device.type == "cuda":
        from litctx_kernels.triton.lowbit import lowbit_tiles_supported

        if not lowbit_tiles_supported(block_q, block_k):
            if (wanted or "").strip().lower() == "triton":
                raise RuntimeError(f"litctx_kernels.lowbit_block_estimate: the triton backend needs block_q and block_k "
                                   f"powers of two >= 16, got {block_q} x {block_k}")
            return "torch"
    return select_backend("lowbit_estimate", q, backend)


def _key_boxes(ka: torch.Tensor, block_k: int):
    """Per key block of ``ka [B, Hq, Mk * block_k, d + 1]``: the box centre and half range ``[B, Hq, Mk, d+1]``
    and the norm of ``|centre| + half range`` ``[B, Hq, Mk]`` (the margin's scale)."""
    b, hq, n_kp, w = ka.shape
    blocks = ka.view(b, hq, n_kp // block_k, block_k, w)
    hi, lo = blocks.amax(3), blocks.amin(3)
    centre, half = (hi + lo) / 2, (hi - lo) / 2
    return centre, half, (centre.abs() + half).norm(dim=-1)


def _pruned_full_blocks(qa_c: torch.Tensor, thr_c: torch.Tensor, ka: torch.Tensor, box, kb_full: int, block_q: int,
                        block_k: int, keep_c: torch.Tensor) -> None:
    """Flags of the key blocks ``[0, kb_full)`` (every row of the chunk sees them whole) for one row chunk,
    computing only the tiles the box bound cannot rule out; writes ``keep_c [B, Hq, chunk blocks, Mk]``."""
    centre, half, scale_b = (x[:, :, :kb_full] for x in box)
    b, hq, c, w = qa_c.shape
    pad = (-c) % block_q
    bound = torch.matmul(qa_c, centre.transpose(-1, -2)) + torch.matmul(qa_c.abs(), half.transpose(-1, -2))
    bound = bound + BOUND_MARGIN * qa_c.norm(dim=-1, keepdim=True) * scale_b.unsqueeze(-2)  # [B, Hq, c, kbf]
    maybe = _any_per_query_block(bound >= thr_c.unsqueeze(-1), block_q, pad)  # [B, Hq, mb, kbf]
    need = maybe.any(2)  # [B, Hq, kbf]: key blocks some query block of the chunk may flag
    n_need = int(need.sum(-1).max())
    if n_need == 0:
        keep_c[..., :kb_full] = False
        return
    # the needed key blocks of each head first (stable), padded with a repeat of the head's own blocks
    order = torch.sort((~need).to(torch.int8), dim=-1, stable=True).indices[..., :n_need]  # [B, Hq, n_need]
    blocks = ka[:, :, :kb_full * block_k].view(b, hq, kb_full, block_k, w)
    sel = torch.gather(blocks, 2, order.view(b, hq, n_need, 1, 1).expand(-1, -1, -1, block_k, w))
    s = torch.matmul(qa_c, sel.view(b, hq, n_need * block_k, w).transpose(-1, -2))  # [B, Hq, c, n_need*bk]
    pooled = s.view(b, hq, c, n_need, block_k).amax(-1)
    hit = _any_per_query_block(pooled >= thr_c.unsqueeze(-1), block_q, pad)  # [B, Hq, mb, n_need]
    hit &= torch.gather(maybe, 3, order.unsqueeze(2).expand(-1, -1, hit.shape[2], -1))
    flags = torch.zeros_like(maybe)
    flags.scatter_(3, order.unsqueeze(2).expand(-1, -1, hit.shape[2], -1), hit)  # repeats write the same value
    keep_c[..., :kb_full] = flags


def _any_per_query_block(hit: torch.Tensor, block_q: int, pad: int) -> torch.Tensor:
    """``[B, Hq, rows, X]`` -> ``[B, Hq, ceil(rows / block_q), X]``: any True within each query block."""
    b, hq, c, x = hit.shape
    if pad:
        hit = torch.cat([hit, hit.new_zeros(b, hq, pad, x)], dim=2)
    return hit.view(b, hq, -1, block_q, x).any(3)
