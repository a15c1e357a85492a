"""Attention kernels shared by every litctx method: layouts, pure-torch references, a fast CPU block-sparse
path, Triton kernels and the dispatcher that picks among them.

Public layout ``[B, H, N, d]``; GQA by head mapping (query head ``h`` reads kv head ``h // (Hq / Hk)``);
bottom-right causal alignment (``q_offset = N_k - N_q``); every op returns the output and a natural-log LSE.

* :mod:`litctx_kernels.layouts` - ``BlockLayout``, ``QueryIndex``, ``TokenIndex`` (what to compute).
* :mod:`litctx_kernels.reference` - chunked, differentiable, float64-capable references (the oracle).
* :mod:`litctx_kernels.cpu_sparse` - block-sparse attention on CPU that skips unlisted blocks.
* :mod:`litctx_kernels.triton` - K1/K2 (attention forward/backward), K3 (gather), K5 (column statistics), K6 (LSSAR),
  K4 (SALE's low-bit estimate), the fused pooled estimates (:mod:`litctx_kernels.triton.estimate`).
* :mod:`litctx_kernels.dispatch` - ``attention``, ``gather_attention``, ``attention_colstats``, ``fused_attention_colstats`` with backend choice
  (``LITCTX_KERNEL_BACKEND`` = auto | torch | triton | reference); ``attention`` takes a per-key ``key_mask``
  (fused on CPU and in the Triton kernels).
* :mod:`litctx_kernels.lowbit_estimate` - SALE's low-bit block estimate without per-element rescaling (torch, any
  device; an exact tile bound skips tiles on CPU) or fused in Triton K4 on CUDA.
* :mod:`litctx_kernels.block_estimate` - pooled block estimates for sparse prefill (Prism's dual band, mean pooling,
  XAttention) straight to a ``BlockLayout``: fused Triton kernels on CUDA, the torch implementation of
  :mod:`litctx_kernels.reference.estimate` elsewhere.
* :mod:`litctx_kernels.merge`, :mod:`litctx_kernels.flops`, :mod:`litctx_kernels.testing`.

Importing this package imports torch only; triton is imported when a Triton kernel is first used.
"""

from litctx_kernels.dispatch import attention, attention_colstats, fused_attention_colstats, gather_attention, select_backend
from litctx_kernels.block_estimate import mean_pool_layout, prism_layout, xattention_layout
from litctx_kernels.flops import attention_flops, layout_pairs, mask_pairs
from litctx_kernels.layouts import BlockLayout, QueryIndex, TokenIndex
from litctx_kernels.lowbit_estimate import lowbit_block_estimate
from litctx_kernels.merge import merge_lse, merge_lse_many
from litctx_kernels.reference import ColStats, lowbit_block_estimate_reference, quantize_qk_lowbit

__all__ = [
    "attention",
    "gather_attention",
    "attention_colstats",
    "fused_attention_colstats",
    "select_backend",
    "BlockLayout",
    "QueryIndex",
    "TokenIndex",
    "ColStats",
    "merge_lse",
    "merge_lse_many",
    "mask_pairs",
    "layout_pairs",
    "attention_flops",
    "quantize_qk_lowbit",
    "lowbit_block_estimate_reference",
    "lowbit_block_estimate",
    "prism_layout",
    "mean_pool_layout",
    "xattention_layout",
]
