"""Where the Triton tests run: the CPU interpreter (``TRITON_INTERPRET=1``) or a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str:
    """``"cpu"`` under ``TRITON_INTERPRET=1``, else ``"cuda"``; skips the calling module when neither works.
    Call at module level, before importing ``litctx_kernels.triton`` kernel modules."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("Triton kernel tests need TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device",
                    allow_module_level=True)
    pytest.importorskip("triton", reason="Triton kernels need the triton package (installed with torch on Linux x86_64)")
    return "cpu" if interpret else "cuda"


def compiled_cuda_device() -> str:
    """``"cuda"`` for the compiled-kernel GPU tests; skips the calling module without a CUDA device, under
    ``TRITON_INTERPRET=1`` (those tests time and compare compiled kernels) or without Triton. Call at module level."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled-kernel tests: unset TRITON_INTERPRET", allow_module_level=True)
    pytest.importorskip("triton", reason="Triton kernels need the triton package (installed with torch on Linux x86_64)")
    return "cuda"


GPU_RATIO = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}
"""Relative-RMS tolerance of a compiled kernel against the float64 reference, per input dtype."""
