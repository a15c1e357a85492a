"""Rotary position embedding (RoPE) in the half-split ("NeoX"/Llama/Hugging Face "rotate-half") layout, and
what mean pooling does to it. The one RoPE implementation: the trained transformers (L-CUBE, PCFG, MEG-XL) use
:class:`RotaryEmbedding` + :func:`apply_rotary`; the sparse-prefill test bed and Prism's analysis use
:func:`apply_rope`, :func:`pooled_attenuation` and :func:`pair_amplitudes`.

Pair ``j`` (``j = 0 .. d/2 - 1``) is the two dims ``j`` and ``j + d/2``, rotated by ``t * theta_j`` at position
``t`` with ``theta_j = base^(-2j/d)`` (pair 0 turns fastest). Mean-pooling ``B`` consecutive positions of a
vector whose un-rotated value is constant scales pair ``j``'s amplitude by the geometric-series factor
``lambda_j(B) = |sin(B theta_j / 2) / (B sin(theta_j / 2))|`` (Prism's attenuation): high-frequency pairs
cancel, low-frequency pairs survive.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["rope_frequencies", "rotary_tables", "apply_rotary", "apply_rope", "RotaryEmbedding",
           "pooled_attenuation", "pair_amplitudes"]


def rope_frequencies(d: int, base: float = 10000.0, dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """``theta [d/2]``, ``theta_j = 1 / base^(2j/d)``, computed in ``dtype`` (float64 by default)."""
    if d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got d={d}")
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=dtype, device=device) / d))


def rotary_tables(positions: torch.Tensor, theta: torch.Tensor, dtype: torch.dtype) -> tuple:
    """``(cos, sin)`` of shape ``[N, d]`` (each half repeated) for ``positions [N]`` and ``theta [d/2]``: the
    angles are formed in ``theta``'s dtype and the tables cast to ``dtype``."""
    angles = torch.outer(positions.to(theta.dtype), theta)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., N, d]`` by angles given as ``cos``/``sin`` ``[N, d]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x [..., N, d]`` at ``positions [N]`` (angles in float64); same dtype as ``x``."""
    theta = rope_frequencies(x.shape[-1], base, device=x.device)
    cos, sin = rotary_tables(positions.to(x.device), theta, x.dtype)
    return apply_rotary(x, cos, sin)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for RoPE with base ``base`` over head dimension ``dim`` (even), in float32.

    ``forward(n, offset=0)`` returns ``(cos, sin)`` of shape ``[n, dim]`` for positions ``offset..offset+n-1``.
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_frequencies(dim, base, dtype=torch.float32), persistent=False)

    def forward(self, n: int, offset: int = 0, dtype: torch.dtype = torch.float32):
        pos = torch.arange(offset, offset + n, device=self.inv_freq.device, dtype=torch.float32)
        return rotary_tables(pos, self.inv_freq, dtype)


def pooled_attenuation(theta: torch.Tensor, block: int) -> torch.Tensor:
    """``lambda_j(B)`` for frequencies ``theta [...]``: the amplitude left after mean-pooling ``block``
    rotated copies of one vector (1 at ``theta = 0``)."""
    half = theta.to(torch.float64) / 2
    num = torch.sin(block * half)
    den = block * torch.sin(half)
    safe = den.abs() > 1e-300
    return torch.where(safe, (num / torch.where(safe, den, torch.ones_like(den))).abs(), torch.ones_like(den))


def pair_amplitudes(x: torch.Tensor) -> torch.Tensor:
    """Amplitude of each RoPE pair of ``x [..., d]``: ``sqrt(x_j^2 + x_{j+d/2}^2)`` -> ``[..., d/2]``."""
    d = x.shape[-1]
    return torch.sqrt(x[..., : d // 2] ** 2 + x[..., d // 2:] ** 2)
