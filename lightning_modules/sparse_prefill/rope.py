"""Rotary position embeddings in the Hugging Face "rotate-half" layout, and what mean pooling does to them.

Pair ``j`` (``j = 0 .. d/2 - 1``) is the two dims ``j`` and ``j + d/2``, rotated by ``t * theta_j`` at position
``t`` with ``theta_j = base^(-2j/d)`` (pair 0 turns fastest). Mean-pooling ``B`` consecutive positions of a
vector whose un-rotated value is constant scales pair ``j``'s amplitude by the geometric-series factor
``lambda_j(B) = |sin(B theta_j / 2) / (B sin(theta_j / 2))|`` (Prism's attenuation): high-frequency pairs
cancel, low-frequency pairs survive.
"""

from __future__ import annotations

import torch

__all__ = ["rope_frequencies", "apply_rope", "pooled_attenuation", "pair_amplitudes"]


def rope_frequencies(d: int, base: float = 10000.0) -> torch.Tensor:
    """``theta [d/2]`` (float64), ``theta_j = base^(-2j/d)``."""
    if d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got d={d}")
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x [..., N, d]`` at ``positions [N]`` (rotate-half layout); same dtype as ``x``."""
    d = x.shape[-1]
    theta = rope_frequencies(d, base).to(x.device)
    ang = positions.to(torch.float64).unsqueeze(-1) * theta  # [N, d/2]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
