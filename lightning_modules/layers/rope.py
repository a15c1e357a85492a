"""Rotary position embedding (RoPE), in the half-split ("NeoX"/Llama) convention."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., N, d]`` by angles given as ``cos``/``sin`` ``[N, d]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for RoPE with base ``base`` over head dimension ``dim`` (even).

    ``forward(n, offset=0)`` returns ``(cos, sin)`` of shape ``[n, dim]`` for positions ``offset..offset+n-1``.
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, n: int, offset: int = 0, dtype: torch.dtype = torch.float32):
        pos = torch.arange(offset, offset + n, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
