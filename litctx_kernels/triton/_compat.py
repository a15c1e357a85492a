"""Triton availability, interpreter detection and the fixed tile configurations of the attention kernels.

Nothing here imports triton at module import time: :data:`HAS_TRITON` is computed with
``importlib.util.find_spec`` and the kernel modules import triton themselves when they are imported.

``TRITON_INTERPRET=1`` must be set *before* a kernel module is imported (the ``@triton.jit`` decorator decides
at decoration time whether it returns an interpreted function); :func:`is_interpret` reads the variable at
call time, so the wrappers pick the interpreter tile sizes and the bf16 -> fp32 cast consistently with it.

No autotuning: every kernel launches with one fixed configuration chosen by :func:`attention_config` from
the head dim, the dtype and (for block layouts) the layout's block sizes. In the interpreter the tiles are
small (16-32) so tests stay quick and still cover several tiles per layout block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["HAS_TRITON", "is_interpret", "KernelConfig", "attention_config", "pow2_divisor", "next_pow2",
           "check_device", "check_offsets", "device_guard", "kernel_dtype"]

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def is_interpret() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels run in the Triton interpreter on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    """Smallest power of two ``>= max(x, 1)``."""
    return 1 << max(int(x) - 1, 0).bit_length()


def pow2_divisor(block: int, cap: int) -> int:
    """Largest power of two ``<= cap`` that divides ``block`` (``block`` a positive integer)."""
    t = 1
    while t * 2 <= cap and block % (t * 2) == 0:
        t *= 2
    return t


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: query tile rows, key tile columns, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def launch_kwargs(self) -> dict:
        """``num_warps``/``num_stages`` for a compiled launch; the interpreter ignores them (none passed)."""
        return {} if is_interpret() else {"num_warps": self.num_warps, "num_stages": self.num_stages}


# kind -> (BLOCK_M, BLOCK_N) in the interpreter: small tiles, several per layout block and per sequence
_INTERPRET_TILES = {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32), "gather": (16, 16), "colstats": (16, 32)}

# CUDA: kind -> (BLOCK_M, BLOCK_N, num_warps, num_stages) per regime. Chosen from ptxas register/spill reports
# for sm_90 (fp16/bf16 d <= 64: no spills; d = 128: at most a few bytes); fp32 is the parity path (ieee dots) and
# uses small tiles to stay out of local memory.
_CUDA_CONFIGS = {
    "half_d64": {"fwd": (128, 64, 8, 3), "dq": (128, 32, 4, 3), "dkdv": (32, 128, 8, 3), "gather": (64, 64, 4, 2),
                 "colstats": (64, 64, 4, 2)},
    "half_d128": {"fwd": (64, 64, 4, 3), "dq": (64, 32, 8, 3), "dkdv": (32, 128, 8, 2), "gather": (64, 32, 4, 2),
                  "colstats": (32, 64, 4, 2)},
    "small": {"fwd": (32, 32, 4, 2), "dq": (64, 32, 8, 2), "dkdv": (32, 64, 8, 2), "gather": (32, 32, 4, 2),
              "colstats": (32, 32, 4, 2)},
}


def attention_config(kind: str, head_dim: int, dtype: torch.dtype, block_q: Optional[int] = None,
                     block_k: Optional[int] = None) -> KernelConfig:
    """The fixed tile configuration of kernel ``kind`` (``fwd``, ``dq``, ``dkdv``, ``gather``, ``colstats``).

    ``block_q``/``block_k`` are a block layout's block sizes: the query tile must divide ``block_q`` and the key
    tile ``block_k`` (each logical block is covered by whole tiles), so the defaults are reduced to the largest
    power-of-two divisor; a layout block that is not a multiple of 16 cannot be tiled and raises ``ValueError``.
    ``BLOCK_M`` always means "query rows" and ``BLOCK_N`` "key columns" (also for the key-major ``dkdv``; for
    ``gather`` ``BLOCK_M`` caps the rows x heads of a program and ``BLOCK_N`` is the token tile).
    """
    if kind not in _INTERPRET_TILES:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {sorted(_INTERPRET_TILES)}")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None and (blk < 16 or blk % 16):
            raise ValueError(f"layout {name}={blk} is not a multiple of 16: the Triton kernels tile each layout "
                             "block with whole 16-aligned tiles")
    if is_interpret():
        bm, bn = _INTERPRET_TILES[kind]
        warps, stages = 4, 1
    else:
        if dtype == torch.float32 or head_dim > 128:
            regime = "small"
        else:
            regime = "half_d64" if head_dim <= 64 else "half_d128"
        bm, bn, warps, stages = _CUDA_CONFIGS[regime][kind]
    base = bm * bn
    if block_q is not None:
        bm = pow2_divisor(block_q, bm)
    if block_k is not None:
        bn = pow2_divisor(block_k, bn)
    if bm * bn * 4 <= base:  # much smaller tile than tuned for: fewer warps
        warps = 4
    return KernelConfig(bm, bn, warps, stages)


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; raise otherwise."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch reference backend (litctx_kernels.reference)")
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and is_interpret():
        return
    raise RuntimeError(f"the Triton kernels need CUDA tensors (got {dev}); CPU tensors run only under "
                       "TRITON_INTERPRET=1 (tests) - use the torch reference backend on CPU")


def check_offsets(**tensors: torch.Tensor) -> None:
    """The kernels index within one (batch, head) slice with int32 offsets (batch/head offsets are int64); raise
    if a ``[B, H, N, d]`` tensor's per-head span ``(N - 1) * stride_N + (d - 1) * stride_d`` does not fit."""
    for name, t in tensors.items():
        span = sum((n - 1) * st for n, st in zip(t.shape[2:], t.stride()[2:]) if n > 0)
        if span >= 2 ** 31:
            raise ValueError(f"{name} {list(t.shape)} with strides {list(t.stride())}: offsets within one head exceed "
                             "int32 (N x row stride >= 2^31); make it contiguous [B, H, N, d] or split the sequence")


def device_guard(t: torch.Tensor):
    """Make ``t``'s CUDA device current for a launch (Triton launches on the current device); a no-op on CPU."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: bf16 becomes fp32 in the interpreter (its bf16 loads and dots are
    wrong, triton-lang/triton#4972, #11584); fp16/fp32 (and bf16 on CUDA) pass through."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {dtype}; the attention kernels take float16, bfloat16 or float32")
    if dtype == torch.bfloat16 and is_interpret():
        return torch.float32
    return dtype
