"""K4: SALE's low-bit block estimate fused in Triton (int8 ``tl.dot``, Relative Attention Score, tile flags).

``_lowbit_estimate_kernel`` - grid ``(query blocks, B * Hq)``. One program owns one ``block_q``-row query block
of one query head: it loads the block's int8 queries ``Qq`` (smoothed, quantised by
:func:`litctx_kernels.reference.lowbit.quantize_qk_lowbit`), their scales and the rows' exact-pass LSE once, then walks
the key blocks its causal prefix can see, ``KB`` key blocks (``KB * block_k`` keys) per step:

    dots   = tl.dot(Qq, Kq^T)                        int8 x int8 -> int32, exact
    S~_ij  = dots_ij * sigma_i * sigma_j + b_j        the estimated raw logit (float32)
    ras_ij = scale * S~_ij - LSE_i                    the Relative Attention Score against the sink + local LSE
    flag   = any valid (i, j) of the tile with ras_ij >= ln tau_h

and writes one int8 flag per (query block, key block). No score tile leaves registers: the output is the
``[B, Hq, Mq, Mk]`` tile mask. The arithmetic follows :func:`~litctx_kernels.reference.lowbit.lowbit_block_estimate_reference`
operation by operation (same products in the same order, float32), so in the interpreter the flags equal the
reference's bit for bit; compiled on CUDA a fused multiply-add may round a pair that sits exactly on the
threshold the other way. ``tau_h = 0`` (``ln tau = -inf``) flags every valid tile: the head runs dense.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from litctx_kernels.layouts import BlockLayout, resolve_q_offset
from litctx_kernels.reference.attention import check_qkv
from litctx_kernels.reference.lowbit import check_estimate_inputs, quantize_qk_lowbit
from litctx_kernels.triton._compat import check_device, device_guard, is_interpret, next_pow2

__all__ = ["triton_lowbit_block_estimate", "lowbit_tiles_supported"]


@triton.jit
def _lowbit_estimate_kernel(
    QI, QS, KI, KS, BIAS, LSE, LOGTAU, KEEP,
    sqb, sqh, sqm, sqd, ssb, ssh, ssm, skb, skh, skn, skd, sxb, sxh, sxn, sbb, sbh, sbn, slb, slh, slm,
    seb, seh, sem, sen,
    n_heads, group, n_q, n_k, n_kb, q_offset, scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    KB: tl.constexpr, CAUSAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    qi = tl.load(QI + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0)
    qs = tl.load(QS + b * ssb + h * ssh + rows * ssm, mask=row_ok, other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + rows * slm, mask=row_ok, other=0.0)
    log_tau = tl.load(LOGTAU + h)
    # key blocks the query block's causal prefix can see
    n_see = n_k
    if CAUSAL:
        last_row = tl.minimum(n_q, (pid_m + 1) * BLOCK_M) - 1
        n_see = tl.minimum(n_k, last_row + q_offset + 1)
    kb_hi = tl.cdiv(n_see, BLOCK_K)
    BLOCK_N: tl.constexpr = BLOCK_K * KB
    ki_base = KI + b * skb + hk * skh
    ks_base = KS + b * sxb + hk * sxh
    bias_base = BIAS + b * sbb + h * sbh
    keep_base = KEEP + b * seb + h * seh + pid_m * sem
    for kb0 in range(0, kb_hi, KB):
        cols = kb0 * BLOCK_K + tl.arange(0, BLOCK_N)
        col_ok = cols < n_k
        ki = tl.load(ki_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None] & d_ok[None, :],
                     other=0)
        ks = tl.load(ks_base + cols * sxn, mask=col_ok, other=0.0)
        bias = tl.load(bias_base + cols * sbn, mask=col_ok, other=0.0)
        dots = tl.dot(qi, tl.trans(ki), out_dtype=tl.int32)  # [BLOCK_M, BLOCK_N], exact
        s_est = dots.to(tl.float32) * qs[:, None] * ks[None, :] + bias[None, :]
        ras = scale * s_est - lse[:, None]
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + q_offset)
        hit = (valid & (ras >= log_tau)).to(tl.int32)
        per_block = tl.max(tl.max(tl.reshape(hit, (BLOCK_M, KB, BLOCK_K)), axis=2), axis=0)  # [KB]
        kbs = kb0 + tl.arange(0, KB)
        tl.store(keep_base + kbs * sen, per_block.to(tl.int8), mask=kbs < n_kb)


def lowbit_tiles_supported(block_q: int, block_k: int) -> bool:
    """The kernel tiles a query block and a key block exactly: both powers of two, at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (block_q, block_k))


def _keys_per_step(block_k: int) -> int:
    """Key blocks per loop step: 128 keys on CUDA (one wide int8 MMA), one block in the interpreter."""
    return 1 if is_interpret() else max(1, 128 // block_k)


def triton_lowbit_block_estimate(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                                 tau: Union[float, Sequence[float], torch.Tensor], *, scale: Optional[float] = None,
                                 block_q: int = 64, block_k: int = 32, bits: int = 4, group_size: int = 1,
                                 causal: bool = True, q_offset: Optional[int] = None,
                                 keys_per_step: Optional[int] = None) -> BlockLayout:
    """Blocks whose estimated Relative Attention Score reaches ``tau`` -> a ``[B, Hq]`` :class:`BlockLayout`;
    the same signature and semantics as :func:`litctx_kernels.reference.lowbit.lowbit_block_estimate_reference`.

    Args:
        q, k: ``[B, Hq, Nq, d]`` and ``[B, Hk, Nk, d]`` (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        lse: ``[B, Hq, Nq]`` natural-log LSE of the exact pass the scores are relative to.
        tau: one threshold or one per query head; 0 runs the head dense.
        block_q, block_k: the selection tile, powers of two >= 16 (the kernel's tile).
        keys_per_step: key blocks per loop step (a power of two; default 128 keys on CUDA, 1 interpreted).
    The quantisation (smoothing, per-token int4/int8 scales) runs in torch; the kernel reads its int8 output.
    """
    b, hq, hk, n_q, n_k, d, _ = check_qkv(q, k, k)
    tau_t = check_estimate_inputs(lse, tau, b, hq, n_q)
    check_device(q, k, lse)
    if not lowbit_tiles_supported(block_q, block_k):
        raise ValueError(f"block_q={block_q} and block_k={block_k}: the Triton estimate needs powers of two >= 16 "
                         "(use litctx_kernels.lowbit_block_estimate, which falls back to torch)")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    lb = quantize_qk_lowbit(q.float() if q.dtype != torch.float32 else q,
                            k.float() if k.dtype != torch.float32 else k, bits, group_size)
    qs, ks, bias = lb.q_scale.float(), lb.k_scale.float(), lb.bias.float()
    log_tau = torch.where(tau_t > 0, torch.log(tau_t.clamp_min(1e-300)), torch.full_like(tau_t, -math.inf))
    log_tau = log_tau.to(torch.float32).to(q.device)
    lse32 = lse.to(torch.float32)
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    keep = torch.zeros(b, hq, mq, mk, dtype=torch.int8, device=q.device)
    if n_q and n_k:
        kb_step = _keys_per_step(block_k) if keys_per_step is None else int(keys_per_step)
        if kb_step < 1 or kb_step & (kb_step - 1):
            raise ValueError(f"keys_per_step must be a power of two >= 1, got {keys_per_step}")
        block_d = max(32, next_pow2(d))  # int8 MMA needs a reduction of >= 32
        qi, ki = lb.q_int, lb.k_int
        with device_guard(q):
            _lowbit_estimate_kernel[(mq, b * hq)](
                qi, qs, ki, ks, bias, lse32, log_tau, keep,
                *qi.stride(), *qs.stride(), *ki.stride(), *ks.stride(), *bias.stride(), *lse32.stride(),
                *keep.stride(),
                hq, hq // hk, n_q, n_k, mk, off, scale,
                HEAD_D=d, BLOCK_D=block_d, BLOCK_M=block_q, BLOCK_K=block_k, KB=kb_step, CAUSAL=causal,
                **({} if is_interpret() else {"num_warps": 4, "num_stages": 2}))
    return BlockLayout.from_block_mask(keep.bool(), block_q, block_k, (n_q, n_k))
