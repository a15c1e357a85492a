"""Fast CPU block-sparse attention: skips the blocks it does not compute, forward and backward.

Inference (fp32, no gradient needed, no ``key_mask``): a native forward (:func:`native_kernel`, C++ compiled once
per machine) runs one task per (batch, query head, query block) with the whole 128-row query tile: for each listed
key block, ``S = QK^T`` straight from K's memory (one BLAS call, no gather), the element mask on boundary blocks
only, an online softmax, ``O += PV``; it returns the same ``(o, lse)`` (compiled FlexAttention cannot return the
LSE on CPU). Timings against the flash-call path and compiled FlexAttention: ``bench/attention_cpu.py``.
Everything else runs the flash-call path below.

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
``block_q = d + dv``); rows whose every key is masked get ``o = 0``, ``lse = -inf``. A gradient flowing into the returned LSE is
handled by recomputing that backward with the chunked reference.
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



# --- native fp32 forward (inference) -----------------------------------------------------------------------------
NATIVE_ENV = "LITCTX_CPU_SPARSE_NATIVE"
"""Set to ``0`` to keep inference calls on the flash-call path (the native kernel's kill switch)."""

_NATIVE_CPP = r"""
#include <torch/extension.h>
""" + r"""#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <limits>
#include <vector>
#include <algorithm>
#include <atomic>

extern "C" int mkl_set_num_threads_local(const int*);  // the exported symbol is the by-reference form
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

// column-major BLAS: C[m x n] = alpha op(A) op(B) + beta C
static inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                        const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  const int M = m, N = n, K = k, LA = lda, LB = ldb, LC = ldc;
  sgemm_(&tA, &tB, &M, &N, &K, &alpha, a, &LA, b, &LB, &beta, c, &LC);
}

// How many threads at::parallel_for runs on here (the forward's parallel loop); 1 means the build lost OpenMP.
int64_t parallel_threads(int64_t items) {
  std::atomic<int64_t> most{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num() + 1;
    int64_t cur = most.load();
    while (t > cur && !most.compare_exchange_weak(cur, t)) {}
  });
  return most.load();
}

// Block-sparse softmax attention forward (fp32), one task per (batch, query head, query block). The listed key
// blocks are taken in groups of up to kv_tile keys: a group's K rows (gathered into one buffer unless the blocks
// are adjacent in memory) give one wide tile S = scale * Q K^T (one gemm, so Q is packed once per group, not once
// per block), the element mask on boundary blocks only, one online-softmax update per row, then O += P V (one
// gemm over the group's V rows). Returns o [B, Hq, Nq, d] and lse [B, Hq, Nq]; with colstats, also the column
// statistics p_sum, p2_sum [B, Hq, Nk] (sum over the queries of P_ij and P_ij^2, P the final probabilities): once a
// query block's LSE is known, a second sweep over its key groups recomputes S (no P V) and adds exp(S - lse) to
// per-thread column sums, reduced at the end.
std::vector<at::Tensor> bsa_forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor kv_num, at::Tensor kv_idx,
                                    int64_t bq, int64_t bk, double scale, bool causal, int64_t q_offset,
                                    int64_t window, int64_t kv_tile, bool colstats) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat);
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  kv_num = kv_num.to(at::kInt).contiguous(); kv_idx = kv_idx.to(at::kInt).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), Nk = k.size(2), Dv = v.size(3);
  const int64_t G = Hq / Hk;
  const int64_t Mq = (Nq + bq - 1) / bq;
  const int64_t E = B * Hq * Mq;
  const int64_t kmax = kv_idx.size(-1);
  const int64_t KW = std::max<int64_t>(1, kv_tile / bk) * bk;  // keys per group: a whole number of blocks
  const int64_t NG = KW / bk;
  TORCH_CHECK(kv_num.numel() == E && kv_idx.numel() == E * kmax, "layout does not match the shapes");
  auto o = at::empty({B, Hq, Nq, Dv}, q.options());
  auto lse = at::empty({B, Hq, Nq}, q.options());
  const int64_t T = colstats ? at::get_num_threads() : 0;
  auto cs = at::zeros({std::max<int64_t>(T, 1), 2, B * Hq, colstats ? Nk : 0}, q.options());  // per-thread sums
  float* csp = cs.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int32_t* nump = kv_num.data_ptr<int32_t>();
  const int32_t* idxp = kv_idx.data_ptr<int32_t>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
    const int one = 1;
    const int mkl_prev = mkl_set_num_threads_local(&one);  // one BLAS thread per task: no nested oversubscription
    std::vector<float> sbuf(bq * KW), kbuf(KW * D), vbuf(KW * Dv), acc(bq * Dv), mrow(bq), lrow(bq), lsev(bq);
    std::vector<float> col1(colstats ? KW : 0), col2(colstats ? KW : 0);
    std::vector<int64_t> gc0(NG), gcols(NG), goff(NG);
    std::vector<char> gfull(NG);
    using Vec = at::vec::Vectorized<float>;
    constexpr int64_t W = Vec::size();
    const int64_t tid = colstats ? std::min<int64_t>(at::get_thread_num(), T - 1) : 0;
    for (int64_t e = begin; e < end; ++e) {
      const int64_t m = e % Mq, bh = e / Mq, h = bh % Hq, b = bh / Hq;
      const int64_t r0 = m * bq, rows = std::min(bq, Nq - r0);
      const float* qt = qp + ((b * Hq + h) * Nq + r0) * D;
      const int64_t kvh = b * Hk + h / G;
      const float* kh = kp + kvh * Nk * D;
      const float* vh = vp + kvh * Nk * Dv;
      const int64_t p0 = r0 + q_offset, p1 = r0 + rows - 1 + q_offset;
      const int32_t cnt = nump[e];
      int64_t ng = 0, width = 0;
      bool any_partial = false;
      // the next group of listed key blocks that the causal / window bounds do not rule out (from block t on)
      auto collect = [&](int32_t& t) {
        ng = 0; width = 0; any_partial = false;
        while (t < cnt && ng < NG) {
          const int64_t j = idxp[e * kmax + t];
          ++t;
          const int64_t c0 = j * bk, cols = std::min(bk, Nk - c0);
          const int64_t c1 = c0 + cols - 1;
          bool full = true;
          if (causal) {
            if (c0 > p1) continue;
            if (window > 0 && c1 <= p0 - window) continue;
            full = c1 <= p0 && (window <= 0 || c0 > p1 - window);
          }
          gc0[ng] = c0; gcols[ng] = cols; goff[ng] = width; gfull[ng] = full;
          any_partial = any_partial || !full;
          width += cols; ++ng;
        }
      };
      // S[rows x width] (row-major, ld = width) = scale * Q K_group^T, masked entries -inf; returns the V rows
      auto scores = [&](float* S) -> const float* {
        bool adjacent = true;
        for (int64_t i = 1; i < ng; ++i) adjacent = adjacent && gc0[i] == gc0[0] + goff[i];
        const float* ks = kh + gc0[0] * D;
        const float* vs = vh + gc0[0] * Dv;
        if (!adjacent) {
          for (int64_t i = 0; i < ng; ++i) {
            std::copy(kh + gc0[i] * D, kh + (gc0[i] + gcols[i]) * D, kbuf.data() + goff[i] * D);
            std::copy(vh + gc0[i] * Dv, vh + (gc0[i] + gcols[i]) * Dv, vbuf.data() + goff[i] * Dv);
          }
          ks = kbuf.data(); vs = vbuf.data();
        }
        gemm(true, false, width, rows, D, sc, ks, D, qt, D, 0.f, S, width);
        if (any_partial) {
          for (int64_t r = 0; r < rows; ++r) {
            float* s = S + r * width;
            const int64_t pos = r0 + r + q_offset;
            for (int64_t i = 0; i < ng; ++i) {
              if (gfull[i]) continue;
              float* sb = s + goff[i];
              for (int64_t c = 0; c < gcols[i]; ++c) {
                const int64_t col = gc0[i] + c;
                const bool ok = col <= pos && (window <= 0 || col > pos - window);
                if (!ok) sb[c] = ninf;
              }
            }
          }
        }
        return vs;
      };
      std::fill(mrow.begin(), mrow.begin() + rows, ninf);
      std::fill(lrow.begin(), lrow.begin() + rows, 0.f);
      std::fill(acc.begin(), acc.begin() + rows * Dv, 0.f);
      bool started = false;
      int32_t t = 0;
      while (t < cnt) {
        collect(t);
        if (ng == 0) break;
        float* S = sbuf.data();
        const float* vs = scores(S);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = S + r * width;
          Vec vmx(ninf);
          int64_t c = 0;
          for (; c + W <= width; c += W) vmx = at::vec::maximum(vmx, Vec::loadu(s + c));
          float mx = ninf;
          if (c < width) vmx = at::vec::maximum(vmx, Vec::set(Vec(ninf), Vec::loadu(s + c, width - c), width - c));
          {
            alignas(64) float tmp[W];
            vmx.store(tmp);
            for (int64_t i = 0; i < W; ++i) mx = std::max(mx, tmp[i]);
          }
          const float mold = mrow[r];
          const float mnew = std::max(mold, mx);
          if (mnew == ninf) {  // nothing valid yet in this row
            std::fill(s, s + width, 0.f);
            continue;
          }
          const Vec vm(mnew);
          Vec vsum(0.f);
          c = 0;
          for (; c + W <= width; c += W) {
            Vec p = (Vec::loadu(s + c) - vm).exp_u20();
            p.store(s + c);
            vsum = vsum + p;
          }
          float sum = 0.f;
          {
            alignas(64) float tmp[W];
            vsum.store(tmp);
            for (int64_t i = 0; i < W; ++i) sum += tmp[i];
          }
          for (; c < width; ++c) {
            const float p = std::exp(s[c] - mnew);
            s[c] = p;
            sum += p;
          }
          const float alpha = (mold == ninf) ? 0.f : std::exp(mold - mnew);
          lrow[r] = lrow[r] * alpha + sum;
          mrow[r] = mnew;
          if (started && alpha != 1.f) {
            float* a = acc.data() + r * Dv;
            const Vec va(alpha);
            int64_t cc = 0;
            for (; cc + W <= Dv; cc += W) (Vec::loadu(a + cc) * va).store(a + cc);
            for (; cc < Dv; ++cc) a[cc] *= alpha;
          }
        }
        // acc[rows x Dv] += P[rows x width] V_group[width x Dv]
        gemm(false, false, Dv, rows, width, 1.f, vs, Dv, S, width, started ? 1.f : 0.f, acc.data(), Dv);
        started = true;
      }
      float* ot = op + ((b * Hq + h) * Nq + r0) * Dv;
      float* lt = lp + (b * Hq + h) * Nq + r0;
      bool any_row = false;
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = ot + r * Dv;
        if (!started || mrow[r] == ninf || lrow[r] <= 0.f) {
          for (int64_t c = 0; c < Dv; ++c) dst[c] = 0.f;
          lt[r] = ninf;
          lsev[r] = ninf;
          continue;
        }
        const float inv = 1.f / lrow[r];
        const float* a = acc.data() + r * Dv;
        for (int64_t c = 0; c < Dv; ++c) dst[c] = a[c] * inv;
        lt[r] = mrow[r] + std::log(lrow[r]);
        lsev[r] = lt[r];
        any_row = true;
      }
      if (!colstats || !any_row) continue;
      // second sweep: the final probabilities exp(S - lse), summed per key column (and squared)
      float* c1p = csp + ((tid * 2 + 0) * B * Hq + b * Hq + h) * Nk;
      float* c2p = csp + ((tid * 2 + 1) * B * Hq + b * Hq + h) * Nk;
      t = 0;
      while (t < cnt) {
        collect(t);
        if (ng == 0) break;
        float* S = sbuf.data();
        scores(S);
        std::fill(col1.begin(), col1.begin() + width, 0.f);
        std::fill(col2.begin(), col2.begin() + width, 0.f);
        for (int64_t r = 0; r < rows; ++r) {
          if (lsev[r] == ninf) continue;
          const float* s = S + r * width;
          const Vec vl(lsev[r]);
          int64_t c = 0;
          for (; c + W <= width; c += W) {
            const Vec p = (Vec::loadu(s + c) - vl).exp_u20();
            (Vec::loadu(col1.data() + c) + p).store(col1.data() + c);
            (Vec::loadu(col2.data() + c) + p * p).store(col2.data() + c);
          }
          for (; c < width; ++c) {
            const float p = std::exp(s[c] - lsev[r]);
            col1[c] += p;
            col2[c] += p * p;
          }
        }
        for (int64_t i = 0; i < ng; ++i) {
          for (int64_t c = 0; c < gcols[i]; ++c) {
            c1p[gc0[i] + c] += col1[goff[i] + c];
            c2p[gc0[i] + c] += col2[goff[i] + c];
          }
        }
      }
    }
    mkl_set_num_threads_local(&mkl_prev);
  });
  if (!colstats) return {o, lse};
  auto sums = cs.sum(0);  // [2, B * Hq, Nk]
  return {o, lse, sums[0].view({B, Hq, Nk}), sums[1].view({B, Hq, Nk})};
}

"""

NATIVE_KV_TILE = 512
"""Keys per tile of the native forward: listed key blocks are processed in groups of ``NATIVE_KV_TILE // block_k``
(one Q K^T and one P V gemm per group). Chosen by a one-off timing at N = 16K, 10% density, 128 x 128 blocks on
2 cores: 256-1024 keys ran alike and about 10% faster than one block per gemm (128)."""

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


def native_kernel():
    """The compiled native forward module, or None (kill switch, no compiler, failed build: the reason is in
    :func:`native_status`). Built once per machine with ``torch.utils.cpp_extension.load_inline`` (~40 s on 2
    cores; cached on disk under the torch extensions directory, so later processes load it in well under a
    second) and once per process."""
    if os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if "module" in _native_state:
        return _native_state["module"]
    import logging
    import time

    log = logging.getLogger("litctx.kernels")
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline(name="litctx_cpu_sparse_fwd_v5", cpp_sources=[_NATIVE_CPP], functions=["bsa_forward", "parallel_threads"],
                          extra_cflags=_native_flags(),
                          extra_ldflags=["-fopenmp"] if torch.backends.openmp.is_available() else [],
                          verbose=False)
        _native_state.update(module=mod, reason="built", seconds=time.perf_counter() - t0)
        log.info("litctx_kernels.cpu_sparse: native block-sparse forward ready (%.1f s)", _native_state["seconds"])
    except Exception as exc:  # noqa: BLE001 - no compiler or a failed build: the flash-call path serves the call
        _native_state.update(module=None, reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                             seconds=time.perf_counter() - t0)
        log.warning("litctx_kernels.cpu_sparse: native forward unavailable, using the flash-call path (%s)",
                    _native_state["reason"])
    return _native_state["module"]


def native_status() -> dict:
    """``{"module": ..., "reason": ..., "seconds": build/load time}`` after the first :func:`native_kernel` call."""
    return dict(_native_state)


def native_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
    """The native forward serves fp32 CPU calls without a key mask when no gradient is needed."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (not needs_grad and key_mask is None and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu")


def _native_forward(mod, q, k, v, layout: BlockLayout, *, scale: float, causal: bool, q_offset: int,
                    window: Optional[int], kv_tile: int = NATIVE_KV_TILE, colstats: bool = False) -> List[torch.Tensor]:
    """``[o, lse]`` of the native forward (``[o, lse, p_sum, p2_sum]`` with ``colstats``)."""
    b, hq = q.shape[:2]
    lay = layout.expand(b, hq)
    kv_num = lay.kv_num_blocks.to(torch.int32).reshape(-1).contiguous()
    kv_idx = lay.kv_indices.to(torch.int32).reshape(kv_num.numel(), -1).contiguous()
    return mod.bsa_forward(q, k, v, kv_num, kv_idx, layout.block_q, layout.block_k, float(scale), bool(causal),
                           int(q_offset), -1 if window is None else int(window), int(kv_tile), bool(colstats))


def native_attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                              causal: bool = True, q_offset: Optional[int] = None, block: int = 128,
                              layout: Optional[BlockLayout] = None
                              ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Attention and its per-key statistics in one native call (fp32 CPU inference, no key mask, no window):
    ``o [B, Hq, Nq, dv]``, ``lse [B, Hq, Nq]`` and ``p_sum``, ``p2_sum [B, Hq, Nk]`` (the sums over every query of
    the final probabilities and of their squares, :func:`litctx_kernels.reference.attention_colstats_reference` with
    ``moments="attention"``). The statistics cost one more ``Q K^T`` sweep per query block after its LSE is
    known, inside the same call (no second pass over the queries from Python). ``layout`` (default: the full
    causal or dense layout in ``block`` x ``block`` tiles) restricts both. None when the native forward is not
    available or the call is not eligible (the caller then runs attention and statistics separately)."""
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    if d != dv or not native_eligible(q, k, v, None):
        return None
    mod = native_kernel()
    if mod is None:
        return None
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if layout is None:
        layout = (BlockLayout.causal(n_q, n_k, block, block, q_offset=off) if causal
                  else BlockLayout.full(n_q, n_k, block, block))
    return tuple(_native_forward(mod, q.contiguous(), k.contiguous(), v.contiguous(), layout, scale=scale,
                                 causal=causal, q_offset=off, window=None, colstats=True))


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
    if d != dv:  # the CPU flash kernel needs one head size: zero-pad to the larger (exact), slice the output
        width = max(d, dv)
        o, lse = block_sparse_attention_cpu(F.pad(q, (0, width - d)), F.pad(k, (0, width - d)),
                                            F.pad(v, (0, width - dv)), layout, scale=scale, causal=causal,
                                            q_offset=off, window=window, max_workspace_bytes=max_workspace_bytes,
                                            key_mask=key_mask, native=native)
        return o[..., :dv], lse
    if native and native_eligible(q, k, v, key_mask):
        mod = native_kernel()
        if mod is not None:
            return tuple(_native_forward(mod, q.contiguous(), k.contiguous(), v.contiguous(), layout, scale=scale,
                                         causal=causal, q_offset=off, window=window))
    plan = plan_buckets(layout, b, hq, hk, causal=causal, q_offset=off, window=window, dtype=q.dtype)
    fn = _BlockSparseCPU
    o, lse = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, layout, (causal, off, window),
                      int(max_workspace_bytes), key_mask)
    return o, lse
