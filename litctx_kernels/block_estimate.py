"""Pooled block estimates for sparse prefill (Prism's dual band, the mean-pooled estimate, XAttention) as a
finished :class:`~litctx_kernels.layouts.BlockLayout`, with the backend chosen like the other kernels.

``triton`` (CUDA tensors by default; CPU tensors only when asked for under ``TRITON_INTERPRET=1``) runs the fused
kernels of :mod:`litctx_kernels.triton.estimate` (two launches for Prism and the mean-pooled estimate, one for
XAttention, no host synchronisation); ``torch`` and ``reference`` run the torch implementation of
:mod:`litctx_kernels.reference.estimate` (the estimators' own code: on CPU it is the fast path, several
vectorised torch ops per layer). Both give the same blocks, up to the float-rounding tie rule documented in
:mod:`litctx_kernels.triton.estimate`.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from litctx_kernels.layouts import BlockLayout
from litctx_kernels.reference.estimate import (
    mean_pool_layout_reference,
    prism_layout_reference,
    xattention_layout_reference,
)

__all__ = ["block_estimate_backend", "prism_layout", "mean_pool_layout", "xattention_layout"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def block_estimate_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """``"triton"``, ``"torch"`` or ``"reference"`` for a pooled estimate of ``q`` (the dispatcher's choice:
    ``backend`` > ``LITCTX_KERNEL_BACKEND`` > auto = Triton for CUDA tensors); Triton only for fp16/bf16/fp32."""
    from litctx_kernels.dispatch import select_backend

    if q.dtype not in _DTYPES:
        if (backend or "").strip().lower() == "triton":
            raise RuntimeError(f"litctx_kernels.block_estimate: the triton backend takes fp16/bf16/fp32, got {q.dtype}")
        return select_backend("block_estimate", q, "reference" if backend == "reference" else "torch")
    return select_backend("block_estimate", q, backend)


def prism_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float, high_fraction: float,
                 low_fraction: float, calibrate: bool = True, temperatures: bool = False,
                 backend: Optional[str] = None) -> Union[BlockLayout, Tuple[BlockLayout, torch.Tensor]]:
    """Prism's finished selection as a ``[B, Hq]`` layout (``temperatures=True``: also ``tau [B, Hq, 2]``)."""
    kw = dict(block=block, top_p=top_p, high_fraction=high_fraction, low_fraction=low_fraction,
              calibrate=calibrate, temperatures=temperatures)
    if block_estimate_backend(q, backend) == "triton":
        from litctx_kernels.triton.estimate import triton_prism_layout

        return triton_prism_layout(q, k, **kw)
    return prism_layout_reference(q, k, **kw)


def mean_pool_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, top_p: float, scale: float,
                     backend: Optional[str] = None) -> BlockLayout:
    """The mean-pooled estimate's finished selection as a ``[B, Hq]`` layout."""
    if block_estimate_backend(q, backend) == "triton":
        from litctx_kernels.triton.estimate import triton_mean_pool_layout

        return triton_mean_pool_layout(q, k, block=block, top_p=top_p, scale=scale)
    return mean_pool_layout_reference(q, k, block=block, top_p=top_p, scale=scale)


def xattention_layout(q: torch.Tensor, k: torch.Tensor, *, block: int, stride: int, threshold: float, scale: float,
                      chunk_blocks: int = 16, backend: Optional[str] = None) -> BlockLayout:
    """XAttention's finished selection as a ``[B, Hq]`` layout (``chunk_blocks``: the torch path's memory knob)."""
    if block_estimate_backend(q, backend) == "triton":
        from litctx_kernels.triton.estimate import triton_xattention_layout

        return triton_xattention_layout(q, k, block=block, stride=stride, threshold=threshold, scale=scale)
    return xattention_layout_reference(q, k, block=block, stride=stride, threshold=threshold, scale=scale,
                                       chunk_blocks=chunk_blocks)
