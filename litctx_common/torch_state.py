"""Scoped changes of torch's process-wide state (torch is imported inside the function, not at import)."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op torch threads, then restore the previous count (also on an exception)."""
    import torch

    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"torch_threads: n must be an integer >= 1, got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
