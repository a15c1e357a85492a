"""Where the Triton tests run: the CPU interpreter (``TRITON_INTERPRET=1``) or a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str:
    """``"cpu"`` under ``TRITON_INTERPRET=1``, else ``"cuda"``; skips the calling module when neither works.
    Call at module level, before importing ``kernels.triton`` kernel modules."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("Triton kernel tests need TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device",
                    allow_module_level=True)
    pytest.importorskip("triton")
    return "cpu" if interpret else "cuda"
