"""The multi-scale convolution of EMFormer: 1x1, 3x3 and 5x5 kernels applied as **one** convolution.

``conv1(x) + conv3(x) + conv5(x)`` (same padding) equals a single 5x5 convolution with the merged kernel
``W = pad2(W1) + pad1(W3) + W5`` (each smaller kernel zero-padded to 5x5 at the centre). The three kernels stay
separate parameters, so autograd gives each its own gradient (the centre crops of the merged kernel's
gradient), and training and inference both run one ``conv2d``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MultiScaleConv2d"]


class MultiScaleConv2d(nn.Module):
    """Sum of same-padded convolutions with odd kernel sizes ``kernel_sizes``, computed as one convolution.

    Args:
        in_channels, out_channels: channel counts (``groups`` must divide both).
        kernel_sizes: odd sizes, e.g. ``(1, 3, 5)``.
        groups: 1 = dense (the released code), ``in_channels`` = depthwise (CPU-friendly).
        bias: one bias (the three biases of separate convolutions would only add up).
        merged: True = one convolution with the merged kernel; False = one convolution per size, summed
            (the baseline of ``bench/emformer.py``; the same numbers).

    Shapes: ``x [B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_sizes: Sequence[int] = (1, 3, 5), groups: int = 1,
                 bias: bool = True, merged: bool = True) -> None:
        super().__init__()
        sizes = [int(k) for k in kernel_sizes]
        if not sizes or any(k < 1 or k % 2 == 0 for k in sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"kernel_sizes must be distinct odd sizes >= 1, got {list(kernel_sizes)}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_sizes = tuple(sorted(sizes))
        self.size = max(self.kernel_sizes)
        self.merged = merged
        self.weights = nn.ParameterList([
            nn.Parameter(torch.empty(out_channels, in_channels // groups, k, k)) for k in self.kernel_sizes])
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.weights:
            nn.init.xavier_uniform_(w)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_channels // self.groups * self.size ** 2)
            nn.init.uniform_(self.bias, -bound, bound)

    def merged_weight(self) -> torch.Tensor:
        """The merged ``[out, in/groups, K, K]`` kernel (K = the largest size)."""
        total = None
        for w, k in zip(self.weights, self.kernel_sizes):
            p = (self.size - k) // 2
            padded = F.pad(w, (p, p, p, p)) if p else w
            total = padded if total is None else total + padded
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected [B, {self.in_channels}, H, W], got {list(x.shape)}")
        if self.merged:
            return F.conv2d(x, self.merged_weight(), self.bias, padding=self.size // 2, groups=self.groups)
        out = None
        for w, k in zip(self.weights, self.kernel_sizes):
            y = F.conv2d(x, w, None, padding=k // 2, groups=self.groups)
            out = y if out is None else out + y
        return out if self.bias is None else out + self.bias.view(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_sizes={self.kernel_sizes}, groups={self.groups}, "
                f"merged={self.merged}")
