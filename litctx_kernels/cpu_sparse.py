"""Fast CPU block-sparse attention: skips the blocks it does not compute, forward and backward.

fp32 calls without a ``key_mask`` run the native kernels (:func:`native_kernel`, C++ compiled once per machine, no
BLAS): one task per (batch, query head, query block); the query tile is transposed once, and for each group of
listed key blocks a register-tiled micro-kernel gives the transposed scores ``S^T = K Q^T`` reading K in place (no
gather), the element mask applies on boundary blocks only, one online-softmax step runs over all the tile's rows
as plain vector operations (base 2, a 9-instruction vector ``exp2``), and a second micro-kernel adds ``P V``
reading V in place. They return the same ``(o, lse)`` (compiled FlexAttention cannot return the LSE on CPU).
Calls that need a gradient save ``o`` and ``lse`` and run the native backward (FlashAttention-2's on the same key
groups and micro-kernels: one task per kv head, so dK / dV accumulate without locks in a fixed order; a gradient
through ``lse`` is folded into ``dS`` exactly). Timings against SDPA, the flash-call path and compiled
FlexAttention: ``bench/attention_cpu.py``. Everything else (key masks, other dtypes, ``native=False``, the kill
switches :data:`NATIVE_ENV` and :data:`NATIVE_BACKWARD_ENV`) runs the flash-call path below.

The work is one fused flash-attention call (PyTorch's CPU flash kernel, which also returns the LSE) per
*bucket* of query blocks: query blocks of every batch element and head that visit the same number of fully
valid key blocks and the same sequence of boundary blocks (the causal diagonal, window edges, a ragged last
block) share one call (split into chunks whose gathers fit the workspace). Their selected key and value
blocks are gathered with one ``index_select`` each into reused workspaces; boundary blocks go last so a single small ``[block_q, c * block_k]``
additive mask, broadcast over the bucket, applies the element mask. Because each query block's whole key set
is in one call, the kernel's output and LSE are final: no merging, and the backward is the flash backward
on the same gathered inputs, scattered back with ``index_add_`` (GQA groups accumulate into their kv head).

Memory: one gather holds at most ``max_workspace_bytes`` of K and V (default 4 MiB: a gather that stays in cache
measured faster than one large gather); no ``N x N`` tensor is built.
Supports softmax scores, causal / sliding-window / non-causal masks, any ``q_offset``, GQA, ragged lengths,
fp32/fp64/fp16/bf16 (whatever the CPU flash kernel accepts), and a per-key mask ``key_mask [B, Hq, Nk]``
(padding, KV-policy masks): its blocks are gathered beside K and V and added to the bucket's element mask, giving
one ``[n, 1, block_q, c * block_k]`` additive mask per chunk (the size of the chunk's gathered K/V at
``block_q = d + dv``); rows whose every key is masked get ``o = 0``, ``lse = -inf``. On this path a gradient flowing
into the returned LSE is handled by recomputing that backward with the chunked reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from litctx_kernels.layouts import BlockLayout, resolve_q_offset
from litctx_kernels.reference.attention import check_qkv, expand_key_mask

__all__ = ["block_sparse_attention_cpu", "plan_buckets", "BucketPlan"]

_MAX_WORKSPACE_BYTES = 4 * 2**20  # small gathers stay in cache: 7.2x vs 6.1x at 256 MiB (16K, 10%)


@dataclass
class Bucket:
    """Query blocks computed by one flash call.

    Attributes:
        q_ids: ``[n]`` flat query-block ids into ``B * Hq * Mq``.
        kv_ids: ``[n, c]`` flat key-block ids into ``B * Hk * Mk`` (full blocks first, boundary blocks last).
        mask: additive ``[1, 1, block_q, c * block_k]`` mask, or None when every block is fully valid.
        empty_rows: ``[block_q]`` bool, rows with no valid key (their LSE is set to ``-inf``), or None.
    """

    q_ids: torch.Tensor
    kv_ids: torch.Tensor
    mask: Optional[torch.Tensor]
    empty_rows: Optional[torch.Tensor]


@dataclass
class BucketPlan:
    buckets: List[Bucket]
    empty_q_ids: torch.Tensor  # query blocks with no block to visit
    padded: Tuple[int, int]  # (Mq * block_q, Mk * block_k)


def _tile_mask(delta: int, ncols: int, bq: int, bk: int, causal: bool, window: Optional[int]) -> torch.Tensor:
    """Boolean ``[bq, bk]``: element validity of a block whose first row sits ``delta`` key positions after
    its first column (``row a`` may see ``col b`` iff ``b <= a + delta``, and ``b > a + delta - window``)."""
    a = torch.arange(bq).view(bq, 1)
    b = torch.arange(bk).view(1, bk)
    ok = b < ncols
    if causal:
        ok = ok & (b <= a + delta)
        if window is not None:
            ok = ok & (b > a + delta - window)
    return ok


def plan_buckets(layout: BlockLayout, batch: int, heads_q: int, heads_k: int, *, causal: bool, q_offset: int,
                 window: Optional[int], dtype: torch.dtype) -> BucketPlan:
    """Group the layout's query blocks into flash calls (see the module docstring)."""
    n_q, n_k = layout.seq_lens
    bq, bk = layout.block_q, layout.block_k
    mq, mk = layout.num_q_blocks, layout.num_k_blocks
    lay = layout.expand(batch, heads_q)
    nb = lay.kv_num_blocks.long().cpu().reshape(-1)  # [E]
    ix = lay.kv_indices.long().cpu().reshape(nb.numel(), -1)  # [E, Kmax]
    e_count, kmax = ix.shape
    listed = torch.arange(kmax).view(1, kmax) < nb.view(-1, 1)
    j = ix.clamp_min(0)
    m = torch.arange(e_count) % mq
    r0 = m * bq
    r1 = torch.clamp(r0 + bq, max=n_q) - 1
    c0 = j * bk
    c1 = torch.clamp(c0 + bk, max=n_k) - 1
    ncols = c1 - c0 + 1
    if causal:
        p0 = (r0 + q_offset).view(-1, 1)
        p1 = (r1 + q_offset).view(-1, 1)
        empty = c0 > p1
        full = c1 <= p0
        if window is not None:
            empty |= c1 <= p0 - window
            full &= c0 > p1 - window
        delta = p0 - c0
    else:
        empty = torch.zeros_like(listed)
        full = torch.ones_like(listed)
        delta = torch.zeros_like(c0)
    full &= ncols == bk
    use = listed & ~empty
    is_full = use & full
    is_part = use & ~full
    n_full = is_full.sum(1)
    n_part = is_part.sum(1)
    pmax = int(n_part.max()) if e_count else 0
    # order each entry's blocks: full (ascending j) first, then boundary blocks, then unused
    rank = torch.where(is_full, 0, torch.where(is_part, 1, 2)) * (mk + 1) + j
    order = rank.argsort(dim=1, stable=True)
    j_sorted = torch.gather(j, 1, order)
    part_pos = torch.arange(kmax).view(1, kmax) - n_full.view(-1, 1)
    sig_src = torch.stack([torch.gather(delta, 1, order), torch.gather(ncols, 1, order)], -1)  # [E, Kmax, 2]
    # bucket key: (n_full, signatures of the boundary blocks in order)
    key_cols = [n_full.view(-1, 1)]
    for p in range(pmax):
        sel = (part_pos == p) & (p < n_part.view(-1, 1))
        pick = torch.where(sel.any(1), sel.float().argmax(1), torch.zeros(e_count, dtype=torch.long))
        sig = sig_src[torch.arange(e_count), pick]  # [E, 2]
        has = (p < n_part).view(-1, 1)
        key_cols.append(torch.where(has, sig, torch.full_like(sig, -(2**40))))
    keys = torch.cat(key_cols, 1)
    total = n_full + n_part
    empty_q = torch.nonzero(total == 0).flatten()
    active = torch.nonzero(total > 0).flatten()
    buckets: List[Bucket] = []
    if active.numel():
        uniq, inv = torch.unique(keys[active], dim=0, return_inverse=True)
        b_idx = torch.arange(e_count) // (heads_q * mq)
        h_idx = (torch.arange(e_count) // mq) % heads_q
        kv_head = b_idx * heads_k + h_idx // (heads_q // heads_k)
        for u in range(uniq.shape[0]):
            members = active[inv == u]
            nf = int(uniq[u, 0])
            np_ = int(n_part[members[0]])
            c = nf + np_
            kv_ids = kv_head[members].view(-1, 1) * mk + j_sorted[members, :c]
            mask = None
            empty_rows = None
            if np_:
                okm = torch.ones(bq, c * bk, dtype=torch.bool)
                for p in range(np_):
                    dlt, nc = int(uniq[u, 1 + 2 * p]), int(uniq[u, 2 + 2 * p])
                    okm[:, (nf + p) * bk:(nf + p + 1) * bk] = _tile_mask(dlt, nc, bq, bk, causal, window)
                mask = torch.zeros(bq, c * bk, dtype=dtype).masked_fill_(~okm, float("-inf"))[None, None]
                if nf == 0:
                    rows_empty = ~okm.any(1)
                    empty_rows = rows_empty if rows_empty.any() else None
            buckets.append(Bucket(members, kv_ids, mask, empty_rows))
    return BucketPlan(buckets, empty_q, (mq * bq, mk * bk))


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[2] == n else F.pad(x, (0, 0, 0, n - x.shape[2]))


def _chunks(bucket: Bucket, per_entry_bytes: int, limit: int):
    """Split a bucket's entries so one gather stays under ``limit`` bytes."""
    n = bucket.q_ids.numel()
    step = max(1, min(n, limit // max(per_entry_bytes, 1)))
    for s in range(0, n, step):
        yield slice(s, min(n, s + step))


class _BlockSparseCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BucketPlan, scale: float, layout: BlockLayout, mask_args: tuple, limit: int,
                key_mask: Optional[torch.Tensor]):
        bq, bk = layout.block_q, layout.block_k
        b, hq, n_q, d = q.shape
        dv = v.shape[-1]
        pq, pk = plan.padded
        q_blocks = _pad_rows(q, pq).reshape(-1, bq, d)  # [B*Hq*Mq, bq, d]
        k_blocks = _pad_rows(k, pk).reshape(-1, bk, d)  # [B*Hk*Mk, bk, d]
        v_blocks = _pad_rows(v, pk).reshape(-1, bk, dv)
        o_blocks = q.new_empty(q_blocks.shape[0], bq, dv)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse_blocks = q.new_empty(q_blocks.shape[0], bq, dtype=lse_dtype)
        if plan.empty_q_ids.numel():
            o_blocks.index_fill_(0, plan.empty_q_ids, 0.0)
            lse_blocks.index_fill_(0, plan.empty_q_ids, float("-inf"))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        km_blocks = _key_mask_blocks(key_mask, pk, bk, q.dtype)
        mask_rows = 0 if km_blocks is None else bq  # each chunk then builds an additive [n, 1, bq, c * bk] mask
        k_ws = _workspace(plan, bk, d, k.dtype, limit, d + dv, mask_rows=mask_rows)
        v_ws = _workspace(plan, bk, dv, v.dtype, limit, d + dv, mask_rows=mask_rows)
        mq = pq // bq
        for bucket in plan.buckets:
            c = bucket.kv_ids.shape[1]
            for sl in _chunks(bucket, _entry_bytes(c, bk, d + dv, k.element_size(), mask_rows),
                              limit):
                ids = bucket.q_ids[sl]
                n = ids.numel()
                flat = bucket.kv_ids[sl].reshape(-1)
                kg, vg = _gather_kv(k_blocks, v_blocks, flat, n, c, k_ws, v_ws)
                qg = q_blocks.index_select(0, ids).unsqueeze(1)
                mask = bucket.mask
                if km_blocks is not None:
                    mask = _chunk_mask(km_blocks, bucket, sl, mq, pk // bk)
                og, lg = flash(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scale)
                if km_blocks is not None:
                    dead = torch.isneginf(mask).all(-1)  # [n, 1, bq]: every key of the row masked
                    if bool(dead.any()):
                        lg = lg.masked_fill(dead, float("-inf"))
                        og = og.masked_fill(dead.unsqueeze(-1), 0.0)
                elif bucket.empty_rows is not None:
                    lg = lg.masked_fill(bucket.empty_rows, float("-inf"))
                o_blocks.index_copy_(0, ids, og.view(n, bq, dv))
                lse_blocks.index_copy_(0, ids, lg.view(n, bq).to(lse_dtype))
        o = o_blocks.view(b, hq, pq, dv)[:, :, :n_q]
        lse = lse_blocks.view(b, hq, pq)[:, :, :n_q]
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.scale, ctx.bq, ctx.bk, ctx.limit = plan, scale, bq, bk, limit
        ctx.layout, ctx.key_mask = layout, key_mask
        ctx.causal, ctx.q_offset, ctx.window = mask_args
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        if grad_lse is not None and bool((grad_lse != 0).any()):
            return _reference_backward(ctx, q, k, v, grad_o, grad_lse)
        plan, scale, bq, bk, limit = ctx.plan, ctx.scale, ctx.bq, ctx.bk, ctx.limit
        b, hq, n_q, d = q.shape
        dv = v.shape[-1]
        pq, pk = plan.padded
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        q_blocks = _pad_rows(q, pq).reshape(-1, bq, d)
        o_blocks = _pad_rows(o, pq).reshape(-1, bq, dv)
        go_blocks = _pad_rows(grad_o.to(q.dtype).contiguous(), pq).reshape(-1, bq, dv)
        # rows without keys: P = exp(s - (+inf)) = 0 gives them zero gradient
        lse_b = _pad_rows(lse.unsqueeze(-1), pq).squeeze(-1).reshape(-1, bq)
        lse_b = torch.where(torch.isneginf(lse_b), torch.full_like(lse_b, float("inf")), lse_b)
        k_blocks = _pad_rows(k, pk).reshape(-1, bk, d)
        v_blocks = _pad_rows(v, pk).reshape(-1, bk, dv)
        dq_blocks = torch.zeros_like(q_blocks)
        dk_blocks, dv_blocks = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        km_blocks = _key_mask_blocks(ctx.key_mask, pk, bk, q.dtype)
        mask_rows = 0 if km_blocks is None else bq
        k_ws = _workspace(plan, bk, d, k.dtype, limit, d + dv, mask_rows=mask_rows)
        v_ws = _workspace(plan, bk, dv, v.dtype, limit, d + dv, mask_rows=mask_rows)
        mq = pq // bq
        for bucket in plan.buckets:
            c = bucket.kv_ids.shape[1]
            for sl in _chunks(bucket, _entry_bytes(c, bk, d + dv, k.element_size(), mask_rows),
                              limit):
                ids = bucket.q_ids[sl]
                n = ids.numel()
                flat = bucket.kv_ids[sl].reshape(-1)
                kg, vg = _gather_kv(k_blocks, v_blocks, flat, n, c, k_ws, v_ws)
                mask = bucket.mask if km_blocks is None else _chunk_mask(km_blocks, bucket, sl, mq, pk // bk)
                dqg, dkg, dvg = flash_bwd(go_blocks.index_select(0, ids).unsqueeze(1),
                                          q_blocks.index_select(0, ids).unsqueeze(1), kg, vg,
                                          o_blocks.index_select(0, ids).unsqueeze(1),
                                          lse_b.index_select(0, ids).unsqueeze(1),
                                          0.0, False, attn_mask=mask, scale=scale)
                dq_blocks.index_copy_(0, ids, dqg.view(n, bq, d))
                dk_blocks.index_add_(0, flat, dkg.reshape(n * c, bk, d))  # GQA heads add into their kv head
                dv_blocks.index_add_(0, flat, dvg.reshape(n * c, bk, dv))
        dq = dq_blocks.view(b, hq, pq, d)[:, :, :n_q]
        hk, n_k = k.shape[1], k.shape[2]
        dk = dk_blocks.view(b, hk, pk, d)[:, :, :n_k]
        dvv = dv_blocks.view(b, hk, pk, dv)[:, :, :n_k]
        return dq, dk, dvv, None, None, None, None, None, None


def _key_mask_blocks(key_mask: Optional[torch.Tensor], pk: int, bk: int,
                     dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Boolean ``key_mask [B, Hq, Nk]`` -> additive ``[B * Hq * Mk, bk]`` (0 / -inf; padded keys -inf)."""
    if key_mask is None:
        return None
    keep = F.pad(key_mask, (0, pk - key_mask.shape[-1]), value=False)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).reshape(-1, bk)


def _chunk_mask(km_blocks: torch.Tensor, bucket: Bucket, sl: slice, mq: int, mk: int) -> torch.Tensor:
    """The additive ``[n, 1, bq, c * bk]`` mask of one chunk: the bucket's element mask plus each entry's key-mask
    blocks (entry ``e`` = flat query block of head row ``e // Mq``; its key block ``j`` = ``kv_id % Mk``)."""
    ids, kv_ids = bucket.q_ids[sl], bucket.kv_ids[sl]
    n, c = kv_ids.shape
    rows = (ids // mq).view(-1, 1) * mk + kv_ids % mk  # [n, c] into [B * Hq * Mk]
    km = km_blocks.index_select(0, rows.reshape(-1)).view(n, 1, 1, -1)  # [n, 1, 1, c * bk]
    return km if bucket.mask is None else bucket.mask + km


def _gather_kv(k_blocks: torch.Tensor, v_blocks: torch.Tensor, flat: torch.Tensor, n: int, c: int,
               k_ws: torch.Tensor, v_ws: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather ``n x c`` key and value blocks into the workspaces -> ``[n, 1, c * bk, d]`` and ``[.., dv]``."""
    bk, d, dv = k_blocks.shape[1], k_blocks.shape[2], v_blocks.shape[2]
    kg = torch.index_select(k_blocks, 0, flat, out=k_ws[: n * c * bk * d].view(n * c, bk, d))
    vg = torch.index_select(v_blocks, 0, flat, out=v_ws[: n * c * bk * dv].view(n * c, bk, dv))
    return kg.view(n, 1, c * bk, d), vg.view(n, 1, c * bk, dv)


def _entry_bytes(c: int, bk: int, kv_width: int, elem: int, mask_rows: int = 0) -> int:
    """Bytes one bucket entry gathers: its ``c`` K/V blocks (``kv_width = d + dv`` per key) and, with a key mask
    (``mask_rows = bq``), its additive ``[bq, c * bk]`` chunk mask (:func:`_chunk_mask`, q's dtype)."""
    return c * bk * (kv_width + mask_rows) * elem


def _workspace(plan: BucketPlan, bk: int, width: int, dtype: torch.dtype, limit: int,
               chunk_width: Optional[int] = None, mask_rows: int = 0) -> torch.Tensor:
    """One flat buffer sized for the largest gather (reused across buckets: fresh pages cost more than copies).
    ``chunk_width`` is the per-row width the bucket chunking uses (K and V together); ``mask_rows``: rows of the
    key-mask tile each chunk entry builds (counted as :func:`_entry_bytes` does)."""
    elem = torch.empty((), dtype=dtype).element_size()
    need = 0
    for bucket in plan.buckets:
        n, c = bucket.kv_ids.shape
        per = _entry_bytes(c, bk, chunk_width or width, elem, mask_rows)
        rows = max(1, min(n, limit // max(per, 1)))
        need = max(need, rows * c * bk * width)
    return torch.empty(need, dtype=dtype)


def _reference_backward(ctx, q, k, v, grad_o, grad_lse):
    from litctx_kernels.reference.attention import attention_reference

    with torch.enable_grad():
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, lse = attention_reference(qr, kr, vr, scale=ctx.scale, causal=ctx.causal, q_offset=ctx.q_offset,
                                     window=ctx.window, layout=ctx.layout, key_mask=ctx.key_mask)
        outs, grads = [], []
        if grad_o is not None:
            outs.append(o)
            grads.append(grad_o)
        outs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
        dq, dk, dv = torch.autograd.grad(outs, (qr, kr, vr), grads, allow_unused=True)
    return dq, dk, dv, None, None, None, None, None, None



# --- native fp32 kernels (forward and backward) --------------------------------------------------------------------
NATIVE_ENV = "LITCTX_CPU_SPARSE_NATIVE"
"""Set to ``0`` to keep every call on the flash-call path (the native kernels' kill switch)."""
NATIVE_BACKWARD_ENV = "LITCTX_CPU_SPARSE_NATIVE_BACKWARD"
"""Set to ``0`` to send calls that need a gradient to the flash-call path (native forward and backward) while
inference calls keep the native forward."""

_NATIVE_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <limits>
#include <vector>
#include <algorithm>
#include <atomic>
#include <numeric>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
static const float kNegInf = -std::numeric_limits<float>::infinity();
static const float kPosInf = std::numeric_limits<float>::infinity();
static constexpr float kLn2 = 0.693147180559945309f;
static constexpr double kLog2eD = 1.4426950408889634;

// Register tiles of the two micro-kernels (32 vector registers with AVX-512, 16 with AVX2).
constexpr int QK_KB = 4;                  // scores: keys per tile
constexpr int QK_RV = W >= 16 ? 4 : 2;    // scores: query-row vectors per tile
constexpr int ACC_RB = 4;                 // accumulation: output rows per tile
constexpr int ACC_NV = W >= 16 ? 4 : 2;   // accumulation: output vectors (W columns each) per tile

// 2^x for a vector: x = n + f with n = round(x), |f| <= 1/2, a degree-5 polynomial for 2^f (minimax for the relative
// error, p(0) = 1), then scalef (p * 2^n in one instruction); x below -126 (and -inf, NaN) gives 0 (no denormals).
// 9 instructions against 19 for Vectorized::exp_u20 (the kernels keep scores in base 2: log2(e) is folded into the
// scores' scale); relative error within 3e-7 of std::exp2 (tests/kernels/test_cpu_sparse.py).
// its coefficients, highest degree first (Horner)
static constexpr float kExp2Poly[6] = {0.001326472731307149f, 0.009671512991189957f, 0.05550733581185341f,
                                       0.24022242426872253f, 0.6931470036506653f, 1.0f};
static inline Vec vexp2(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = x;
  const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return Vec(_mm512_maskz_scalef_ps(keep, p, n));
#elif defined(CPU_CAPABILITY_AVX2)  // the same polynomial; 2^n from the exponent bits (x above 127 saturates)
  const __m256 v = x;
  const __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return Vec(_mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep));
#else  // scalar fallback (builds without AVX2)
  alignas(64) float a[W];
  x.store(a);
  for (int64_t i = 0; i < W; ++i) a[i] = a[i] >= -126.f ? std::exp2(a[i]) : 0.f;  // NaN compares false: 0
  return Vec::loadu(a);
#endif
}

// test hook: the vector 2^x on a float32 tensor
at::Tensor vexp2_test(at::Tensor x) {
  x = x.contiguous();
  auto y = at::empty_like(x);
  const float* a = x.data_ptr<float>();
  float* b = y.data_ptr<float>();
  const int64_t n = x.numel();
  int64_t i = 0;
  for (; i + W <= n; i += W) vexp2(Vec::loadu(a + i)).store(b + i);
  if (i < n) vexp2(Vec::loadu(a + i, n - i)).store(b + i, n - i);
  return y;
}

static inline float hsum(const Vec& v) {
  alignas(64) float tmp[W];
  v.store(tmp);
  float s = 0.f;
  for (int64_t i = 0; i < W; ++i) s += tmp[i];
  return s;
}

// --- micro-kernels ------------------------------------------------------------------------------------------------
// Scores: C[i][j] = alpha sum_d A[i][d] BT[d][j] for KB rows i of A (row-major, ld lda; keys) and RV vectors of
// columns j (BT = a transposed query tile, ld ldb; query rows): KB x RV accumulators in registers, A broadcast
// straight from its rows (no packing of K or V: they are read in place, block by block).
template <int KB, int RV>
static inline void qk_tile(const float* __restrict A, int64_t lda, const float* __restrict BT, int64_t ldb,
                           int64_t depth, float alpha, float* __restrict C, int64_t ldc) {
  Vec acc[KB][RV];
#pragma GCC unroll 8
  for (int i = 0; i < KB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RV; ++j) acc[i][j] = Vec(0.f);
  for (int64_t d = 0; d < depth; ++d) {
    Vec b[RV];
#pragma GCC unroll 8
    for (int j = 0; j < RV; ++j) b[j] = Vec::loadu(BT + d * ldb + W * j);
#pragma GCC unroll 8
    for (int i = 0; i < KB; ++i) {
      const Vec a(A[i * lda + d]);
#pragma GCC unroll 8
      for (int j = 0; j < RV; ++j) acc[i][j] = at::vec::fmadd(a, b[j], acc[i][j]);
    }
  }
  const Vec va(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < KB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RV; ++j) (acc[i][j] * va).store(C + i * ldc + W * j);
}

template <int KB>
static void qk_rows(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t depth, int64_t nvec,
                    float alpha, float* C, int64_t ldc) {
  for (int64_t j = 0; j < nvec; j += QK_RV) {
    const int64_t o = j * W;
    switch (std::min<int64_t>(QK_RV, nvec - j)) {
      case 4: qk_tile<KB, 4>(A, lda, BT + o, ldb, depth, alpha, C + o, ldc); break;
      case 3: qk_tile<KB, 3>(A, lda, BT + o, ldb, depth, alpha, C + o, ldc); break;
      case 2: qk_tile<KB, 2>(A, lda, BT + o, ldb, depth, alpha, C + o, ldc); break;
      default: qk_tile<KB, 1>(A, lda, BT + o, ldb, depth, alpha, C + o, ldc); break;
    }
  }
}

// C[rows x (nvec W)] (ld ldc) = alpha A[rows x depth] BT[depth x nvec W]
static void qk_block(const float* A, int64_t rows, int64_t lda, const float* BT, int64_t ldb, int64_t depth,
                     int64_t nvec, float alpha, float* C, int64_t ldc) {
  for (int64_t i = 0; i < rows; i += QK_KB) {
    const float* a = A + i * lda;
    float* c = C + i * ldc;
    switch (std::min<int64_t>(QK_KB, rows - i)) {
      case 4: qk_rows<4>(a, lda, BT, ldb, depth, nvec, alpha, c, ldc); break;
      case 3: qk_rows<3>(a, lda, BT, ldb, depth, nvec, alpha, c, ldc); break;
      case 2: qk_rows<2>(a, lda, BT, ldb, depth, nvec, alpha, c, ldc); break;
      default: qk_rows<1>(a, lda, BT, ldb, depth, nvec, alpha, c, ldc); break;
    }
  }
}

// One reduction segment of an accumulation: coefficient (i, k) = P[i * si + k * sk], row k of the right factor at
// V + k * ldv, k < n.
struct Seg {
  const float* P;
  const float* V;
  int64_t n;
};

// Accumulation: Out[i][c] += alpha sum_seg sum_k coef(i, k) V[k][c] for RB output rows i and NV vectors of columns c:
// RB x NV accumulators in registers over every segment, the right factor read in place row by row.
template <int RB, int NV>
static inline void acc_tile(const Seg* seg, int64_t nseg, int64_t si, int64_t sk, int64_t ldv, int64_t col,
                            float alpha, float* __restrict out, int64_t ldo) {
  Vec acc[RB][NV];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = Vec(0.f);
  for (int64_t s = 0; s < nseg; ++s) {
    const float* __restrict p = seg[s].P;
    const float* __restrict v = seg[s].V + col;
    const int64_t n = seg[s].n;
    for (int64_t k = 0; k < n; ++k) {
      Vec b[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) b[j] = Vec::loadu(v + k * ldv + W * j);
#pragma GCC unroll 8
      for (int i = 0; i < RB; ++i) {
        const Vec a(p[i * si + k * sk]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(a, b[j], acc[i][j]);
      }
    }
  }
  const Vec va(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      float* o = out + i * ldo + col + W * j;
      at::vec::fmadd(acc[i][j], va, Vec::loadu(o)).store(o);
    }
}

template <int RB>
static void acc_cols(const Seg* seg, int64_t nseg, int64_t si, int64_t sk, int64_t ldv, int64_t nvec, float alpha,
                     float* out, int64_t ldo) {
  for (int64_t j = 0; j < nvec; j += ACC_NV) {
    const int64_t col = j * W;
    switch (std::min<int64_t>(ACC_NV, nvec - j)) {
      case 4: acc_tile<RB, 4>(seg, nseg, si, sk, ldv, col, alpha, out, ldo); break;
      case 3: acc_tile<RB, 3>(seg, nseg, si, sk, ldv, col, alpha, out, ldo); break;
      case 2: acc_tile<RB, 2>(seg, nseg, si, sk, ldv, col, alpha, out, ldo); break;
      default: acc_tile<RB, 1>(seg, nseg, si, sk, ldv, col, alpha, out, ldo); break;
    }
  }
}

// Out[rows x nvec W] (ld ldo) += alpha sum_seg Coef_seg[rows x n_seg] V_seg[n_seg x nvec W]; tmp is scratch (the
// per-row-tile offsets of the coefficients).
static void acc_block(const Seg* seg, int64_t nseg, int64_t rows, int64_t si, int64_t sk, int64_t ldv, int64_t nvec,
                      float alpha, float* out, int64_t ldo, Seg* tmp) {
  for (int64_t i = 0; i < rows; i += ACC_RB) {
    for (int64_t s = 0; s < nseg; ++s) tmp[s] = Seg{seg[s].P + i * si, seg[s].V, seg[s].n};
    float* o = out + i * ldo;
    switch (std::min<int64_t>(ACC_RB, rows - i)) {
      case 4: acc_cols<4>(tmp, nseg, si, sk, ldv, nvec, alpha, o, ldo); break;
      case 3: acc_cols<3>(tmp, nseg, si, sk, ldv, nvec, alpha, o, ldo); break;
      case 2: acc_cols<2>(tmp, nseg, si, sk, ldv, nvec, alpha, o, ldo); break;
      default: acc_cols<1>(tmp, nseg, si, sk, ldv, nvec, alpha, o, ldo); break;
    }
  }
}

// One online-softmax step (base 2) for NVC vectors of query rows over a key group's transposed scores ST[width x .]
// (ld ls): the running max m and sum l are updated, ST is overwritten with P = 2^(S - m_new), alpha = 2^(m_old -
// m_new) is stored for the output rescale (0 where m_old = -inf; rows with nothing valid yet keep P = 0).
template <int NVC>
static inline void softmax_update(float* ST, int64_t ls, int64_t width, float* m, float* l, float* alpha_out) {
  Vec mx[NVC];
#pragma GCC unroll 8
  for (int j = 0; j < NVC; ++j) mx[j] = Vec(kNegInf);
  for (int64_t c = 0; c < width; ++c) {
    const float* s = ST + c * ls;
#pragma GCC unroll 8
    for (int j = 0; j < NVC; ++j) mx[j] = at::vec::maximum(mx[j], Vec::loadu(s + W * j));
  }
  Vec msub[NVC], sum[NVC];
#pragma GCC unroll 8
  for (int j = 0; j < NVC; ++j) {
    const Vec mold = Vec::loadu(m + W * j);
    const Vec mnew = at::vec::maximum(mold, mx[j]);
    msub[j] = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
    Vec::blendv(vexp2(mold - msub[j]), Vec(0.f), mold == Vec(kNegInf)).store(alpha_out + W * j);
    mnew.store(m + W * j);
    sum[j] = Vec(0.f);
  }
  for (int64_t c = 0; c < width; ++c) {
    float* s = ST + c * ls;
#pragma GCC unroll 8
    for (int j = 0; j < NVC; ++j) {
      const Vec p = vexp2(Vec::loadu(s + W * j) - msub[j]);
      p.store(s + W * j);
      sum[j] = sum[j] + p;
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NVC; ++j) (Vec::loadu(l + W * j) * Vec::loadu(alpha_out + W * j) + sum[j]).store(l + W * j);
}

// dst[d][r] = src[r][d] for r < rows (ld_src = depth), 0 for rows <= r < rp (ld_dst = rp)
static void transpose_pad(const float* src, int64_t rows, int64_t depth, int64_t rp, float* dst) {
  for (int64_t d = 0; d < depth; ++d) std::fill(dst + d * rp + rows, dst + (d + 1) * rp, 0.f);
  at::vec::transpose_mxn<float>(src, depth, dst, rp, static_cast<int>(rows), static_cast<int>(depth));
}

// How many threads at::parallel_for runs on here (the kernels' parallel loops); 1 means the build lost OpenMP.
int64_t parallel_threads(int64_t items) {
  std::atomic<int64_t> most{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num() + 1;
    int64_t cur = most.load();
    while (t > cur && !most.compare_exchange_weak(cur, t)) {}
  });
  return most.load();
}

// Runs task(slot, i) for i in [0, n) on every at::parallel_for thread, handing out the next index from an atomic
// counter (dynamic scheduling: a thread that finishes early takes more); slot < slots identifies the worker.
template <typename F>
static void run_dynamic(int64_t n, int64_t slots, const F& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, slots, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t slot = s0; slot < s1; ++slot) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) task(slot, i);
    }
  });
}

struct Geometry {
  int64_t B, Hq, Hk, G, Nq, Nk, D, Dv, Mq, kmax, bq, bk, q_offset, window, KW, NG, RP, LS;
  bool causal;
};

static Geometry geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_num,
                         const at::Tensor& kv_idx, int64_t bq, int64_t bk, bool causal, int64_t q_offset,
                         int64_t window, int64_t kv_tile) {
  Geometry g;
  g.B = q.size(0); g.Hq = q.size(1); g.Nq = q.size(2); g.D = q.size(3);
  g.Hk = k.size(1); g.Nk = k.size(2); g.Dv = v.size(3);
  TORCH_CHECK(g.Hq % g.Hk == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(g.D % W == 0 && g.Dv % W == 0, "head sizes must be multiples of ", W, " (the caller pads)");
  g.G = g.Hq / g.Hk;
  g.bq = bq; g.bk = bk;
  g.Mq = (g.Nq + bq - 1) / bq;
  g.kmax = kv_idx.size(-1);
  g.KW = std::max<int64_t>(1, kv_tile / bk) * bk;  // keys per group: a whole number of blocks
  g.NG = g.KW / bk;
  g.RP = (bq + W - 1) / W * W;  // query rows of a tile, padded to whole vectors
  g.LS = g.RP + W;  // row stride of the transposed score tiles (not a power of two: no cache-set aliasing)
  g.causal = causal; g.q_offset = q_offset; g.window = window;
  const int64_t E = g.B * g.Hq * g.Mq;
  TORCH_CHECK(kv_num.numel() == E && kv_idx.numel() == E * g.kmax, "layout does not match the shapes");
  return g;
}

// The listed key blocks of one query block, taken in groups of up to NG blocks (KW keys) that the causal / window
// bounds do not rule out.
struct Groups {
  const Geometry& g;
  const int32_t* idx = nullptr;
  int32_t cnt = 0;
  int64_t p0 = 0, p1 = 0;
  std::vector<int64_t> c0, cols, off;
  std::vector<char> full;
  int64_t ng = 0, width = 0;
  bool any_partial = false;
  explicit Groups(const Geometry& geo) : g(geo), c0(geo.NG), cols(geo.NG), off(geo.NG), full(geo.NG) {}
  void reset(const int32_t* idx_, int32_t cnt_, int64_t r0, int64_t rows) {
    idx = idx_; cnt = cnt_;
    p0 = r0 + g.q_offset; p1 = r0 + rows - 1 + g.q_offset;
  }
  // the next group from list position t on; false when none is left
  bool next(int32_t& t) {
    ng = 0; width = 0; any_partial = false;
    while (t < cnt && ng < g.NG) {
      const int64_t j = idx[t];
      ++t;
      const int64_t a = j * g.bk, n = std::min(g.bk, g.Nk - a);
      const int64_t b = a + n - 1;
      bool f = true;
      if (g.causal) {
        if (a > p1) continue;
        if (g.window > 0 && b <= p0 - g.window) continue;
        f = b <= p0 && (g.window <= 0 || a > p1 - g.window);
      }
      c0[ng] = a; cols[ng] = n; off[ng] = width; full[ng] = f;
      any_partial = any_partial || !f;
      width += n; ++ng;
    }
    return ng > 0;
  }
  // ST[width x RP] (ld LS, key-major): -inf where key c may not be seen by query row r, on boundary blocks only
  // (row r sits at position p0 + r; key c is valid iff c <= p0 + r and, with a window, c > p0 + r - window)
  void mask(float* ST) const {
    if (!any_partial) return;
    for (int64_t i = 0; i < ng; ++i) {
      if (full[i]) continue;
      for (int64_t c = 0; c < cols[i]; ++c) {
        float* s = ST + (off[i] + c) * g.LS;
        const int64_t first = c0[i] + c - p0;  // first valid row
        const int64_t lo = std::min<int64_t>(g.RP, std::max<int64_t>(0, first));
        const int64_t hi = g.window > 0 ? std::min<int64_t>(g.RP, std::max<int64_t>(lo, first + g.window)) : g.RP;
        std::fill(s, s + lo, kNegInf);
        std::fill(s + hi, s + g.RP, kNegInf);
      }
    }
  }
  // ST[width x RP] = alpha A_group Q^T for A = K (or V) rows of the head (ld lda), QT [depth x RP] (ld RP)
  void scores(const float* head, int64_t lda, const float* QT, int64_t depth, float alpha, float* ST) const {
    for (int64_t i = 0; i < ng; ++i)
      qk_block(head + c0[i] * lda, cols[i], lda, QT, g.RP, depth, g.RP / W, alpha, ST + off[i] * g.LS, g.LS);
  }
};

// Block-sparse softmax attention forward (fp32), one task per (batch, query head, query block), handed out
// dynamically in (batch, head) order with each head's heaviest (last) query blocks first. BLAS-free: two register-
// tiled micro-kernels (at::vec, so AVX-512, AVX2 or the scalar fallback) read K and V in place. Per query tile the
// queries are transposed once (Q^T [d x rows], rows padded to whole vectors); the listed key blocks are taken in
// groups of up to kv_tile keys: S^T = log2(e) scale K Q^T (key-major, so the softmax statistics of all the tile's
// rows are plain vector operations over the keys), the element mask on boundary blocks only (a fill of each key's
// invalid row range), one online-softmax update (base 2), then O += P V. Returns o [B, Hq, Nq, dv] and lse
// [B, Hq, Nq]; with colstats, also p_sum, p2_sum [B, Hq, Nk] (sum over the queries of P_ij and P_ij^2, P the final
// probabilities): once a query tile's LSE is known, a second sweep over its key groups recomputes S^T (no P V) and
// adds exp(S - lse) to per-worker column sums, reduced at the end.
std::vector<at::Tensor> bsa_forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor kv_num, at::Tensor kv_idx,
                                    int64_t bq, int64_t bk, double scale, bool causal, int64_t q_offset,
                                    int64_t window, int64_t kv_tile, bool colstats) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat);
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  kv_num = kv_num.to(at::kInt).contiguous(); kv_idx = kv_idx.to(at::kInt).contiguous();
  const Geometry g = geometry(q, k, v, kv_num, kv_idx, bq, bk, causal, q_offset, window, kv_tile);
  const int64_t B = g.B, Hq = g.Hq, Hk = g.Hk, Nq = g.Nq, Nk = g.Nk, D = g.D, Dv = g.Dv, Mq = g.Mq;
  const int64_t RP = g.RP, LS = g.LS, NV = RP / W;
  const int64_t E = B * Hq * Mq;
  auto o = at::empty({B, Hq, Nq, Dv}, q.options());
  auto lse = at::empty({B, Hq, Nq}, q.options());
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  auto cs = at::zeros({colstats ? T : 1, 2, B * Hq, colstats ? Nk : 0}, q.options());  // per-worker sums
  float* csp = cs.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int32_t* nump = kv_num.data_ptr<int32_t>();
  const int32_t* idxp = kv_idx.data_ptr<int32_t>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc2 = static_cast<float>(scale * kLog2eD);  // scores in base 2
  struct Scratch {
    std::vector<float> st, qt, acc, m, l, alpha, col;
    std::vector<Seg> seg, tmp;
  };
  std::vector<Scratch> scratch(T);
  run_dynamic(E, T, [&](int64_t slot, int64_t i) {
    Scratch& w = scratch[slot];
    if (w.st.empty()) {
      w.st.resize(g.KW * LS); w.qt.resize(D * RP); w.acc.resize(RP * Dv);
      w.m.resize(RP); w.l.resize(RP); w.alpha.resize(RP); w.col.resize(2 * g.KW);
      w.seg.resize(g.NG); w.tmp.resize(g.NG);
    }
    const int64_t e = (i / Mq) * Mq + (Mq - 1 - i % Mq);  // heads in order, each head's last blocks first
    const int64_t m = e % Mq, bh = e / Mq, h = bh % Hq, b = bh / Hq;
    const int64_t r0 = m * bq, rows = std::min(bq, Nq - r0);
    const int64_t kvh = b * Hk + h / g.G;
    const float* kh = kp + kvh * Nk * D;
    const float* vh = vp + kvh * Nk * Dv;
    float* ST = w.st.data();
    float* QT = w.qt.data();
    float* acc = w.acc.data();
    float* mr = w.m.data();
    float* lr = w.l.data();
    transpose_pad(qp + ((b * Hq + h) * Nq + r0) * D, rows, D, RP, QT);
    std::fill(mr, mr + RP, kNegInf);
    std::fill(lr, lr + RP, 0.f);
    std::fill(acc, acc + RP * Dv, 0.f);
    Groups grp(g);
    grp.reset(idxp + e * g.kmax, nump[e], r0, rows);
    bool started = false;
    int32_t t = 0;
    while (grp.next(t)) {
      const int64_t width = grp.width;
      grp.scores(kh, D, QT, D, sc2, ST);
      grp.mask(ST);
      for (int64_t j = 0; j < NV; j += 8) {  // up to 8 vectors of query rows at a time, keys streamed in order
        switch (std::min<int64_t>(8, NV - j)) {
          case 8: softmax_update<8>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 7: softmax_update<7>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 6: softmax_update<6>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 5: softmax_update<5>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 4: softmax_update<4>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 3: softmax_update<3>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          case 2: softmax_update<2>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
          default: softmax_update<1>(ST + j * W, LS, width, mr + j * W, lr + j * W, w.alpha.data() + j * W); break;
        }
      }
      const bool rescale = started;
      if (rescale) {
        for (int64_t r = 0; r < rows; ++r) {
          const float a = w.alpha[r];
          if (a == 1.f) continue;
          const Vec va(a);
          float* x = acc + r * Dv;
          for (int64_t c = 0; c < Dv; c += W) (Vec::loadu(x + c) * va).store(x + c);
        }
      }
      // O[rows x Dv] += P[rows x width] V_group[width x Dv]: coefficient (r, key) = ST[key][r]
      for (int64_t s = 0; s < grp.ng; ++s) w.seg[s] = Seg{ST + grp.off[s] * LS, vh + grp.c0[s] * Dv, grp.cols[s]};
      acc_block(w.seg.data(), grp.ng, rows, 1, LS, Dv, Dv / W, 1.f, acc, Dv, w.tmp.data());
      started = true;
    }
    float* ot = op + ((b * Hq + h) * Nq + r0) * Dv;
    float* lt = lp + (b * Hq + h) * Nq + r0;
    bool any_row = false;
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = ot + r * Dv;
      if (!started || mr[r] == kNegInf || !(lr[r] > 0.f)) {
        std::fill(dst, dst + Dv, 0.f);
        lt[r] = kNegInf;
        mr[r] = kPosInf;  // the statistics sweep's reference: P = 0
        continue;
      }
      const Vec vi(1.f / lr[r]);
      const float* a = acc + r * Dv;
      for (int64_t c = 0; c < Dv; c += W) (Vec::loadu(a + c) * vi).store(dst + c);
      mr[r] += std::log2(lr[r]);  // the row's LSE in base 2
      lt[r] = mr[r] * kLn2;
      any_row = true;
    }
    if (!colstats || !any_row) return;
    std::fill(mr + rows, mr + RP, kPosInf);  // padding rows
    // second sweep: the final probabilities exp(S - lse), summed per key column (and squared)
    float* c1p = csp + ((slot * 2 + 0) * B * Hq + b * Hq + h) * Nk;
    float* c2p = csp + ((slot * 2 + 1) * B * Hq + b * Hq + h) * Nk;
    t = 0;
    while (grp.next(t)) {
      grp.scores(kh, D, QT, D, sc2, ST);
      grp.mask(ST);
      for (int64_t s = 0; s < grp.ng; ++s) {
        for (int64_t c = 0; c < grp.cols[s]; ++c) {
          const float* x = ST + (grp.off[s] + c) * LS;
          Vec s1(0.f), s2(0.f);
          for (int64_t j = 0; j < NV; ++j) {
            const Vec p = vexp2(Vec::loadu(x + j * W) - Vec::loadu(mr + j * W));
            s1 = s1 + p;
            s2 = at::vec::fmadd(p, p, s2);
          }
          c1p[grp.c0[s] + c] += hsum(s1);
          c2p[grp.c0[s] + c] += hsum(s2);
        }
      }
    }
  });
  if (!colstats) return {o, lse};
  auto sums = cs.sum(0);  // [2, B * Hq, Nk]
  return {o, lse, sums[0].view({B, Hq, Nk}), sums[1].view({B, Hq, Nk})};
}

// The backward of bsa_forward (FlashAttention-2's, on the same key groups and micro-kernels): given o, lse (from
// the forward), grad_o and grad_lse (an empty tensor for none), returns dq, dk, dv. Tasks are (batch, kv head,
// partition): a task owns its kv head's dK / dV (partition 0 writes into dk / dv, partition p > 0 into its own
// zeroed copy, summed at the end; one partition unless there are fewer than two kv heads per thread), so the
// accumulation order is fixed (deterministic) and no locks are needed. Per query tile (rows i) of the task's query
// heads: Q^T and dO^T once, D_i = rowsum(dO_i * O_i) - grad_lse_i; per key group: S^T = log2(e) scale K Q^T,
// P^T = 2^(S^T - log2(e) lse) (0 on masked entries and rows without keys), dP^T = V dO^T, dS^T = P^T (dP^T - D), then
// per key block dV += P^T dO and dK += scale dS^T Q (straight into the task's accumulators), and dQ += scale dS K.
std::vector<at::Tensor> bsa_backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor o, at::Tensor lse,
                                     at::Tensor grad_o, at::Tensor grad_lse, at::Tensor kv_num, at::Tensor kv_idx,
                                     int64_t bq, int64_t bk, double scale, bool causal, int64_t q_offset,
                                     int64_t window, int64_t kv_tile) {
  for (const auto& x : {q, k, v, o, lse, grad_o}) TORCH_CHECK(x.scalar_type() == at::kFloat, "fp32 only");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous(); o = o.contiguous(); lse = lse.contiguous();
  grad_o = grad_o.contiguous();
  const bool has_glse = grad_lse.defined() && grad_lse.numel() > 0;
  if (has_glse) grad_lse = grad_lse.to(at::kFloat).contiguous();
  kv_num = kv_num.to(at::kInt).contiguous(); kv_idx = kv_idx.to(at::kInt).contiguous();
  const Geometry g = geometry(q, k, v, kv_num, kv_idx, bq, bk, causal, q_offset, window, kv_tile);
  const int64_t B = g.B, Hq = g.Hq, Hk = g.Hk, Nq = g.Nq, Nk = g.Nk, D = g.D, Dv = g.Dv, Mq = g.Mq, G = g.G;
  const int64_t RP = g.RP, LS = g.LS, NV = RP / W;
  TORCH_CHECK(o.sizes() == at::IntArrayRef({B, Hq, Nq, Dv}) && grad_o.sizes() == o.sizes() &&
              lse.numel() == B * Hq * Nq, "o, grad_o or lse do not match the shapes");
  TORCH_CHECK(!has_glse || grad_lse.numel() == B * Hq * Nq, "grad_lse does not match lse");
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  // partitions per kv head: enough tasks for two per thread
  const int64_t P = std::min<int64_t>(std::max<int64_t>(1, (2 * T + B * Hk - 1) / (B * Hk)), std::max<int64_t>(1, Mq));
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);  // zeroed per kv head by the task that owns it
  auto dv = at::empty_like(v);
  at::Tensor dk_extra, dv_extra;
  if (P > 1) {
    dk_extra = at::zeros({P - 1, B * Hk, Nk, D}, k.options());
    dv_extra = at::zeros({P - 1, B * Hk, Nk, Dv}, v.options());
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* opp = o.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  const float* gop = grad_o.data_ptr<float>();
  const float* glp = has_glse ? grad_lse.data_ptr<float>() : nullptr;
  const int32_t* nump = kv_num.data_ptr<int32_t>();
  const int32_t* idxp = kv_idx.data_ptr<int32_t>();
  float* dqp = dq.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float sc2 = static_cast<float>(scale * kLog2eD);  // S in base 2, as in the forward
  // tasks, heaviest first (longest-processing-time order over the dynamic schedule)
  const int64_t NT = B * Hk * P;
  std::vector<int64_t> work(NT, 0), order(NT);
  for (int64_t e = 0; e < B * Hq * Mq; ++e) {
    const int64_t m = e % Mq, bh = e / Mq, h = bh % Hq, b = bh / Hq;
    work[(b * Hk + h / G) * P + m % P] += nump[e];
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return work[a] > work[c]; });
  struct Scratch {
    std::vector<float> st, dpt, qt, dot, dqa, dm, l2;
    std::vector<Seg> seg, tmp;
  };
  std::vector<Scratch> scratch(T);
  run_dynamic(NT, T, [&](int64_t slot, int64_t i) {
    Scratch& w = scratch[slot];
    if (w.st.empty()) {
      w.st.resize(g.KW * LS); w.dpt.resize(g.KW * LS); w.qt.resize(D * RP); w.dot.resize(Dv * RP);
      w.dqa.resize(RP * D); w.dm.resize(RP); w.l2.resize(RP);
      w.seg.resize(g.NG); w.tmp.resize(g.NG);
    }
    const int64_t task = order[i];
    const int64_t part = task % P, kvh = task / P, b = kvh / Hk, hk = kvh % Hk;
    const float* kh = kp + kvh * Nk * D;
    const float* vh = vp + kvh * Nk * Dv;
    float* dkh = (part == 0 ? dk.data_ptr<float>() : dk_extra.data_ptr<float>() + (part - 1) * B * Hk * Nk * D) +
                 kvh * Nk * D;
    float* dvh = (part == 0 ? dv.data_ptr<float>() : dv_extra.data_ptr<float>() + (part - 1) * B * Hk * Nk * Dv) +
                 kvh * Nk * Dv;
    if (part == 0) {
      std::fill(dkh, dkh + Nk * D, 0.f);
      std::fill(dvh, dvh + Nk * Dv, 0.f);
    }
    float* ST = w.st.data();
    float* dPT = w.dpt.data();
    float* QT = w.qt.data();
    float* dOT = w.dot.data();
    float* dqa = w.dqa.data();
    float* dm = w.dm.data();
    float* l2 = w.l2.data();
    Groups grp(g);
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t h = hk * G + hh;
      for (int64_t m = part; m < Mq; m += P) {
        const int64_t e = (b * Hq + h) * Mq + m;
        const int64_t r0 = m * bq, rows = std::min(bq, Nq - r0);
        const int64_t row0 = (b * Hq + h) * Nq + r0;
        const float* qt = qp + row0 * D;
        const float* ot = opp + row0 * Dv;
        const float* got = gop + row0 * Dv;
        std::fill(dm, dm + RP, 0.f);
        std::fill(l2, l2 + RP, kPosInf);  // rows without keys and padding rows: P = 0, no gradient
        for (int64_t r = 0; r < rows; ++r) {
          const float l = lp[row0 + r];
          if (!(l > kNegInf)) continue;  // -inf (no valid key) or NaN
          l2[r] = static_cast<float>(static_cast<double>(l) * kLog2eD);
          Vec a(0.f);
          for (int64_t c = 0; c < Dv; c += W)
            a = at::vec::fmadd(Vec::loadu(got + r * Dv + c), Vec::loadu(ot + r * Dv + c), a);
          dm[r] = hsum(a) - (glp ? glp[row0 + r] : 0.f);
        }
        grp.reset(idxp + e * g.kmax, nump[e], r0, rows);
        std::fill(dqa, dqa + RP * D, 0.f);
        bool any = false;
        int32_t t = 0;
        while (grp.next(t)) {
          if (!any) {
            transpose_pad(qt, rows, D, RP, QT);
            transpose_pad(got, rows, Dv, RP, dOT);
            any = true;
          }
          const int64_t width = grp.width;
          grp.scores(kh, D, QT, D, sc2, ST);   // S^T = log2(e) scale K Q^T
          grp.mask(ST);
          grp.scores(vh, Dv, dOT, Dv, 1.f, dPT);  // dP^T = V dO^T
          for (int64_t c = 0; c < width; ++c) {
            float* s = ST + c * LS;
            float* ds = dPT + c * LS;
            for (int64_t j = 0; j < NV; ++j) {
              const Vec p = vexp2(Vec::loadu(s + j * W) - Vec::loadu(l2 + j * W));
              p.store(s + j * W);
              (p * (Vec::loadu(ds + j * W) - Vec::loadu(dm + j * W))).store(ds + j * W);
            }
          }
          for (int64_t s = 0; s < grp.ng; ++s) {
            const int64_t a = grp.c0[s], n = grp.cols[s], off = grp.off[s];
            // dV[a:a+n] += P^T dO, dK[a:a+n] += scale dS^T Q: coefficient (key, row) = X^T[key][row]
            const Seg pv{ST + off * LS, got, rows};
            acc_block(&pv, 1, n, LS, 1, Dv, Dv / W, 1.f, dvh + a * Dv, Dv, w.tmp.data());
            const Seg pk{dPT + off * LS, qt, rows};
            acc_block(&pk, 1, n, LS, 1, D, D / W, sc, dkh + a * D, D, w.tmp.data());
          }
          // dQ += scale dS K_group: coefficient (row, key) = dS^T[key][row]
          for (int64_t s = 0; s < grp.ng; ++s) w.seg[s] = Seg{dPT + grp.off[s] * LS, kh + grp.c0[s] * D, grp.cols[s]};
          acc_block(w.seg.data(), grp.ng, rows, 1, LS, D, D / W, sc, dqa, D, w.tmp.data());
        }
        std::copy(dqa, dqa + rows * D, dqp + row0 * D);
      }
    }
  });
  if (P > 1) {
    dk.view({B * Hk, Nk, D}).add_(dk_extra.sum(0));
    dv.view({B * Hk, Nk, Dv}).add_(dv_extra.sum(0));
  }
  return {dq, dk, dv};
}
"""

NATIVE_KV_TILE = 512
"""Keys per group of the native kernels: listed key blocks are processed in groups of ``NATIVE_KV_TILE // block_k``
(one online-softmax step per group; the micro-kernels read K and V in place either way). 256-1024 ran alike
forward at N = 16K, 10% density, 128 x 128 blocks; the backward measured 512 faster than 256."""

NATIVE_HEAD_MULTIPLE = 16
"""The native kernels take head sizes in whole vectors (16 floats with AVX-512, 8 with AVX2): other sizes are
zero-padded to a multiple of this (exact: padded query/key columns add 0 to every score, padded value columns are
sliced off)."""

_native_state: dict = {}


def _native_flags() -> List[str]:
    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    flags = ["-O3"]
    if cap == "AVX512":
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
                  "-mavx512bw", "-mfma"]
    elif cap == "AVX2":
        flags += ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma"]
    if torch.backends.openmp.is_available():
        # at::parallel_for is a header-inline `#pragma omp parallel`: without -fopenmp it silently runs on one
        # thread. libgomp.so.1 resolves to the runtime torch already loaded (same soname), so no second pool.
        flags.append("-fopenmp")
    return flags


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def native_kernel():
    """The compiled native module (forward and backward), or None (kill switch, no compiler, failed build: the
    reason is in :func:`native_status`). Built once per machine with ``torch.utils.cpp_extension.load_inline``
    (~40 s on 2 cores; cached on disk under the torch extensions directory, so later processes load it in well
    under a second) and once per process."""
    if _env_off(NATIVE_ENV):
        return None
    if "module" in _native_state:
        return _native_state["module"]
    import logging
    import time

    log = logging.getLogger("litctx.kernels")
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline(name="litctx_cpu_sparse_v6", cpp_sources=[_NATIVE_CPP],
                          functions=["bsa_forward", "bsa_backward", "parallel_threads", "vexp2_test"],
                          extra_cflags=_native_flags(),
                          extra_ldflags=["-fopenmp"] if torch.backends.openmp.is_available() else [],
                          verbose=False)
        _native_state.update(module=mod, reason="built", seconds=time.perf_counter() - t0)
        log.info("litctx_kernels.cpu_sparse: native block-sparse kernels ready (%.1f s)", _native_state["seconds"])
    except Exception as exc:  # noqa: BLE001 - no compiler or a failed build: the flash-call path serves the call
        _native_state.update(module=None, reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                             seconds=time.perf_counter() - t0)
        log.warning("litctx_kernels.cpu_sparse: native kernels unavailable, using the flash-call path (%s)",
                    _native_state["reason"])
    return _native_state["module"]


def native_status() -> dict:
    """``{"module": ..., "reason": ..., "seconds": build/load time}`` after the first :func:`native_kernel` call."""
    return dict(_native_state)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _native_inputs_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
    return (key_mask is None and q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu")


def native_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
    """The native kernels serve fp32 CPU calls without a key mask: inference calls through the forward, calls that
    need a gradient through the forward and the native backward (unless ``LITCTX_CPU_SPARSE_NATIVE_BACKWARD=0``)."""
    if not _native_inputs_ok(q, k, v, key_mask):
        return False
    return not _needs_grad(q, k, v) or not _env_off(NATIVE_BACKWARD_ENV)


def _pad_heads(*tensors: torch.Tensor) -> List[torch.Tensor]:
    """Zero-pad the last dimension to a multiple of :data:`NATIVE_HEAD_MULTIPLE` (differentiable; a no-op when
    it already is one)."""
    out = []
    for t in tensors:
        extra = -t.shape[-1] % NATIVE_HEAD_MULTIPLE
        out.append(F.pad(t, (0, extra)) if extra else t)
    return out


def _layout_tensors(layout: BlockLayout, b: int, hq: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kv_num [B * Hq * Mq]``, ``kv_idx [B * Hq * Mq, Kmax]`` as the native kernels take them."""
    lay = layout.expand(b, hq)
    kv_num = lay.kv_num_blocks.to(torch.int32).reshape(-1).contiguous()
    kv_idx = lay.kv_indices.to(torch.int32).reshape(kv_num.numel(), -1).contiguous()
    return kv_num, kv_idx


def _native_forward(mod, q, k, v, layout: BlockLayout, *, scale: float, causal: bool, q_offset: int,
                    window: Optional[int], kv_tile: int = NATIVE_KV_TILE, colstats: bool = False) -> List[torch.Tensor]:
    """``[o, lse]`` of the native forward (``[o, lse, p_sum, p2_sum]`` with ``colstats``); head sizes must be
    multiples of :data:`NATIVE_HEAD_MULTIPLE`."""
    kv_num, kv_idx = _layout_tensors(layout, q.shape[0], q.shape[1])
    return mod.bsa_forward(q, k, v, kv_num, kv_idx, layout.block_q, layout.block_k, float(scale), bool(causal),
                           int(q_offset), -1 if window is None else int(window), int(kv_tile), bool(colstats))


def _native_backward(mod, q, k, v, o, lse, grad_o, grad_lse: Optional[torch.Tensor], layout: BlockLayout, *,
                     scale: float, causal: bool, q_offset: int, window: Optional[int],
                     kv_tile: int = NATIVE_KV_TILE) -> List[torch.Tensor]:
    """``[dq, dk, dv]`` of the native backward from the forward's ``o`` and ``lse``; ``grad_lse`` None (or all
    zero) for no gradient through the LSE."""
    kv_num, kv_idx = _layout_tensors(layout, q.shape[0], q.shape[1])
    if grad_lse is None or not bool((grad_lse != 0).any()):
        grad_lse = torch.empty(0)
    return mod.bsa_backward(q, k, v, o, lse, grad_o, grad_lse, kv_num, kv_idx, layout.block_q, layout.block_k,
                            float(scale), bool(causal), int(q_offset), -1 if window is None else int(window),
                            int(kv_tile))


class _NativeBlockSparse(torch.autograd.Function):
    """The native forward with the native backward (fp32, no key mask): ``o`` and ``lse`` are saved, the backward
    recomputes the scores per key group (FlashAttention-2) and folds a gradient through ``lse`` into ``dS`` exactly
    (``dS = P (dP - rowsum(dO * O) + grad_lse)``), so no call falls back to the reference."""

    @staticmethod
    def forward(ctx, q, k, v, mod, layout: BlockLayout, scale: float, causal: bool, q_offset: int,
                window: Optional[int]):
        o, lse = _native_forward(mod, q, k, v, layout, scale=scale, causal=causal, q_offset=q_offset, window=window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mod, ctx.layout, ctx.args = mod, layout, (scale, causal, q_offset, window)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        scale, causal, q_offset, window = ctx.args
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        dq, dk, dv = _native_backward(ctx.mod, q, k, v, o, lse, grad_o.float(), grad_lse, ctx.layout, scale=scale,
                                      causal=causal, q_offset=q_offset, window=window)
        return dq, dk, dv, None, None, None, None, None, None


def native_attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                              causal: bool = True, q_offset: Optional[int] = None, block: int = 128,
                              layout: Optional[BlockLayout] = None
                              ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Attention and its per-key statistics in one native call (fp32 CPU inference, no key mask, no window):
    ``o [B, Hq, Nq, dv]``, ``lse [B, Hq, Nq]`` and ``p_sum``, ``p2_sum [B, Hq, Nk]`` (the sums over every query of
    the final probabilities and of their squares, :func:`litctx_kernels.reference.attention_colstats_reference` with
    ``moments="attention"``). The statistics cost one more ``Q K^T`` sweep per query block after its LSE is
    known, inside the same call (no second pass over the queries from Python). ``layout`` (default: the full
    causal or dense layout in ``block`` x ``block`` tiles) restricts both. None when the native kernels are not
    available or the call is not eligible (the caller then runs attention and statistics separately)."""
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    if not _native_inputs_ok(q, k, v, None) or _needs_grad(q, k, v):
        return None
    mod = native_kernel()
    if mod is None:
        return None
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if layout is None:
        layout = (BlockLayout.causal(n_q, n_k, block, block, q_offset=off) if causal
                  else BlockLayout.full(n_q, n_k, block, block))
    qp, kp, vp = _pad_heads(q.contiguous(), k.contiguous(), v.contiguous())
    o, lse, p_sum, p2_sum = _native_forward(mod, qp, kp, vp, layout, scale=scale, causal=causal, q_offset=off,
                                            window=None, colstats=True)
    return o[..., :dv], lse, p_sum, p2_sum


def block_sparse_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, *,
                               scale: Optional[float] = None, causal: bool = True, q_offset: Optional[int] = None,
                               window: Optional[int] = None, max_workspace_bytes: int = _MAX_WORKSPACE_BYTES,
                               key_mask: Optional[torch.Tensor] = None,
                               native: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [B, Hq, Nq, d]`` over the blocks of ``layout`` (and the element mask) with
    ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]`` on CPU tensors; ``key_mask`` (boolean ``[B, 1|Hk|Hq, Nk]``,
    True = attend) removes keys per batch row and head.

    Returns ``o [B, Hq, Nq, dv]`` (q's dtype) and ``lse [B, Hq, Nq]`` (float32; float64 for float64); rows with no valid key give
    ``o = 0``, ``lse = -inf``. Differentiable in q, k, v (and through ``lse``).
    """
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    if q.device.type != "cpu":
        raise ValueError(f"block_sparse_attention_cpu needs CPU tensors, got {q.device}")
    if tuple(layout.seq_lens) != (n_q, n_k):
        raise ValueError(f"layout.seq_lens={tuple(layout.seq_lens)} does not match (Nq, Nk)=({n_q}, {n_k})")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if key_mask is not None:
        key_mask = expand_key_mask(key_mask, q, k)  # boolean [B, Hq, Nk]; float / additive masks are rejected
    if native and native_eligible(q, k, v, key_mask):
        mod = native_kernel()
        if mod is not None:
            qp, kp, vp = (t.contiguous() for t in _pad_heads(q, k, v))
            if _needs_grad(q, k, v):
                o, lse = _NativeBlockSparse.apply(qp, kp, vp, mod, layout, scale, causal, off, window)
            else:
                o, lse = _native_forward(mod, qp, kp, vp, layout, scale=scale, causal=causal, q_offset=off,
                                         window=window)
            return (o if o.shape[-1] == dv else o[..., :dv]), lse
    if d != dv:  # the CPU flash kernel needs one head size: zero-pad to the larger (exact), slice the output
        width = max(d, dv)
        o, lse = block_sparse_attention_cpu(F.pad(q, (0, width - d)), F.pad(k, (0, width - d)),
                                            F.pad(v, (0, width - dv)), layout, scale=scale, causal=causal,
                                            q_offset=off, window=window, max_workspace_bytes=max_workspace_bytes,
                                            key_mask=key_mask, native=native)
        return o[..., :dv], lse
    plan = plan_buckets(layout, b, hq, hk, causal=causal, q_offset=off, window=window, dtype=q.dtype)
    fn = _BlockSparseCPU
    o, lse = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, layout, (causal, off, window),
                      int(max_workspace_bytes), key_mask)
    return o, lse
