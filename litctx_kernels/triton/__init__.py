"""Triton kernels of the shared attention package (compiled on CUDA; interpreted on CPU for tests).

Public functions (same signatures and semantics as the torch references in :mod:`litctx_kernels.reference`):

* :func:`triton_attention` (K1 forward + K2 backward, :mod:`litctx_kernels.triton.attention`) - dense / causal /
  sliding-window / block-layout / query-subset attention, softmax or LSSA scores, GQA, returns ``(o, lse)``.
* :func:`triton_lssar_attention` (K6 forward, :mod:`litctx_kernels.triton.lssar`) - LSSAR in the log domain, two
  passes (LSSA's LSE, then the re-weighted online softmax); the backward recomputes the torch reference.
* :func:`triton_gather_attention` (K3, :mod:`litctx_kernels.triton.gather`) - attention over per-kv-head token lists,
  forward only.
* :func:`triton_attention_colstats` (K5, :mod:`litctx_kernels.triton.colstats`) - per-key attention statistics over a
  query window, returns :class:`ColStats`.
* :func:`triton_lowbit_block_estimate` (K4, :mod:`litctx_kernels.triton.lowbit`) - SALE's low-bit block estimate fused
  (int8 ``tl.dot``, Relative Attention Score, tile flags), returns a :class:`~litctx_kernels.layouts.BlockLayout`.
* :func:`triton_prism_layout`, :func:`triton_mean_pool_layout`, :func:`triton_xattention_layout`
  (:mod:`litctx_kernels.triton.estimate`) - the pooled block estimates of sparse prefill fused (pooling, scores, causal
  softmax, top-p / threshold and the layout rows in two launches, one for XAttention), return a ``BlockLayout``.

Importing this package does not import triton: the names above are resolved lazily on first access (PEP 562),
so ``import litctx_kernels.triton`` is safe on machines without triton, and :data:`HAS_TRITON` / :func:`is_interpret`
(from :mod:`litctx_kernels.triton._compat`) can be checked first. Set ``TRITON_INTERPRET=1`` *before* the first access
to run the kernels in the interpreter on CPU tensors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from litctx_kernels.triton._compat import HAS_TRITON, is_interpret

if TYPE_CHECKING:  # pragma: no cover
    from litctx_kernels.triton.attention import triton_attention
    from litctx_kernels.triton.colstats import ColStats, triton_attention_colstats
    from litctx_kernels.triton.gather import triton_gather_attention
    from litctx_kernels.triton.lowbit import triton_lowbit_block_estimate
    from litctx_kernels.triton.estimate import triton_mean_pool_layout, triton_prism_layout, triton_xattention_layout
    from litctx_kernels.triton.lssar import triton_lssar_attention

__all__ = ["HAS_TRITON", "is_interpret", "triton_attention", "triton_gather_attention",
           "triton_attention_colstats", "ColStats",
           "triton_lssar_attention", "triton_lowbit_block_estimate", "triton_prism_layout",
           "triton_mean_pool_layout", "triton_xattention_layout"]

_LAZY = {
    "triton_attention": "litctx_kernels.triton.attention",
    "triton_gather_attention": "litctx_kernels.triton.gather",
    "triton_attention_colstats": "litctx_kernels.triton.colstats",
    "ColStats": "litctx_kernels.triton.colstats",
    "triton_lssar_attention": "litctx_kernels.triton.lssar",
    "triton_lowbit_block_estimate": "litctx_kernels.triton.lowbit",
    "triton_prism_layout": "litctx_kernels.triton.estimate",
    "triton_mean_pool_layout": "litctx_kernels.triton.estimate",
    "triton_xattention_layout": "litctx_kernels.triton.estimate",
}


def __getattr__(name: str):
    if name in _LAZY:
        if not HAS_TRITON:
            raise ImportError(f"litctx_kernels.triton.{name} needs triton, which is not installed; use litctx_kernels.reference")
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
