"""A small pre-norm causal transformer (RoPE attention + GELU MLP) shared by the synthetic benchmarks.

Full causal attention runs through ``torch.nn.functional.scaled_dot_product_attention`` (with attention
dropout); an optional sliding window (the "windowed attention" architecture of L-CUBE's comparisons)
restricts each query to the last ``window`` keys, itself included, and runs through :func:`litctx_kernels.attention`,
which skips the blocks outside the window instead of masking an ``N x N`` matrix. Attention dropout is not
available with a window (use residual/MLP dropout).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from litctx_kernels import attention
from lightning_modules.layers.rope import RotaryEmbedding, apply_rotary

__all__ = ["CausalSelfAttention", "TransformerBlock", "CausalTransformer"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE. Input and output ``[B, N, d_model]``."""

    def __init__(self, d_model: int, n_heads: int, rope_base: float = 10000.0, dropout: float = 0.0,
                 window: Optional[int] = None) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, rope_base)
        if window is not None and dropout > 0:
            raise ValueError(f"attention dropout ({dropout}) is not supported with window={window}; set dropout=0")
        self.dropout = dropout
        self.window = window

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, _ = h.shape
        q, k, v = self.qkv(h).view(B, N, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = self.rope(N, dtype=q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            o, _ = attention(q, k, v, causal=True, window=self.window)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``. ``[B, N, d] -> [B, N, d]``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 rope_base: float = 10000.0, window: Optional[int] = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base, dropout, window)
        self.norm2 = nn.LayerNorm(d_model)
        hidden = int(round(mlp_ratio * d_model))
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model), nn.Dropout(dropout))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class CausalTransformer(nn.Module):
    """A stack of :class:`TransformerBlock` with a final LayerNorm. ``[B, N, d] -> [B, N, d]``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 rope_base: float = 10000.0, window: Optional[int] = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, mlp_ratio, dropout, rope_base, window) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.norm(h)
