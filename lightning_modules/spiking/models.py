"""Spiking networks in multi-step mode over ``[T, B, ...]``.

``SpikingConvNet``: Conv(2 -> c, 3x3, stride 2) [-> BatchNorm] -> neuron -> Linear(c * (H/2) * (W/2) -> hidden)
[-> BatchNorm] -> neuron -> Linear(hidden -> classes), read out as the mean over T of the last layer's output (or
its last step); the layout of the research note's CPU-scale model, with spikingjelly's usual batch norm over
``T x B`` before each neuron (``norm=True``: without it the sparse event frames leave the network nearly silent
at initialisation, measured 0.04% first-layer firing). The neuron is LIF or TS (``make_neuron``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from lightning_modules.spiking.neurons import LIF, LIFConfig, TSConfig, TSNeuron

__all__ = ["make_neuron", "detach_state", "SpikingConvNet", "SpikingMLP", "SpikingSelfAttention", "SpikingTransformerBlock"]


def make_neuron(kind: str, channels: int, options: Dict[str, Any]) -> nn.Module:
    """``lif`` or ``ts`` with ``options`` (fields of :class:`LIFConfig` / :class:`TSConfig`)."""
    if kind == "lif":
        return LIF(LIFConfig(**options))
    if kind == "ts":
        return TSNeuron(TSConfig(channels=channels, **options))
    raise ValueError(f"neuron={kind!r}: expected 'lif' or 'ts'")


class SpikingConvNet(nn.Module):
    """``[T, B, C_in, H, W]`` frames -> ``[B, classes]`` logits."""

    def __init__(self, in_channels: int, size: int, classes: int, conv_channels: int, hidden: int, neuron: str,
                 neuron_options: Dict[str, Any], readout: str = "mean", norm: bool = True) -> None:
        super().__init__()
        if readout not in ("mean", "last"):
            raise ValueError(f"readout={readout!r}: expected 'mean' or 'last'")
        self.conv = nn.Conv2d(in_channels, conv_channels, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(conv_channels) if norm else nn.Identity()
        self.n1 = make_neuron(neuron, conv_channels, neuron_options)
        side = (size + 1) // 2
        self.fc1 = nn.Linear(conv_channels * side * side, hidden)
        self.bn2 = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.n2 = make_neuron(neuron, hidden, neuron_options)
        self.fc2 = nn.Linear(hidden, classes)
        self.readout = readout

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        out, _ = self.forward_seq(frames)  # [T, B, classes]
        return out.mean(0) if self.readout == "mean" else out[-1]

    def forward_seq(self, frames: torch.Tensor, state: Optional[tuple] = None, total_steps: Optional[int] = None):
        """``[T, B, C, H, W]`` -> ``(per-step outputs [T, B, classes], neuron states)``; pass the states back to
        continue the sequence (truncated BPTT)."""
        t, b = frames.shape[:2]
        s1, s2 = state if state is not None else (None, None)
        h = self.bn1(self.conv(frames.flatten(0, 1)))  # [T*B, c, H/2, W/2]: one norm over time and batch
        h, s1 = _run(self.n1, h.view(t, b, *h.shape[1:]), s1, total_steps)
        h = self.bn2(self.fc1(h.flatten(2)).flatten(0, 1))
        h, s2 = _run(self.n2, h.view(t, b, -1), s2, total_steps)
        return self.fc2(h), (s1, s2)


class SpikingMLP(nn.Module):
    """``[T, B, C]`` inputs (time series) -> ``[B, classes]``: Linear -> BN -> neuron -> Linear -> BN -> neuron ->
    Linear, read out as the mean over T (or the last step); ``forward_seq`` as in :class:`SpikingConvNet`."""

    def __init__(self, in_features: int, classes: int, hidden: int, neuron: str, neuron_options: Dict[str, Any],
                 readout: str = "mean", norm: bool = True) -> None:
        super().__init__()
        if readout not in ("mean", "last"):
            raise ValueError(f"readout={readout!r}: expected 'mean' or 'last'")
        self.fc1, self.fc2 = nn.Linear(in_features, hidden), nn.Linear(hidden, hidden)
        self.bn1 = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.bn2 = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.n1 = make_neuron(neuron, hidden, neuron_options)
        self.n2 = make_neuron(neuron, hidden, neuron_options)
        self.out = nn.Linear(hidden, classes)
        self.readout = readout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.forward_seq(x)
        return out.mean(0) if self.readout == "mean" else out[-1]

    def forward_seq(self, x: torch.Tensor, state: Optional[tuple] = None, total_steps: Optional[int] = None):
        t, b = x.shape[:2]
        s1, s2 = state if state is not None else (None, None)
        h, s1 = _run(self.n1, self.bn1(self.fc1(x.flatten(2)).flatten(0, 1)).view(t, b, -1), s1, total_steps)
        h, s2 = _run(self.n2, self.bn2(self.fc2(h).flatten(0, 1)).view(t, b, -1), s2, total_steps)
        return self.out(h), (s1, s2)


def _run(neuron: nn.Module, x: torch.Tensor, state, total_steps: Optional[int]):
    """``(spikes, state)`` of a LIF or TS neuron continuing from ``state``."""
    if isinstance(neuron, TSNeuron):
        return neuron.forward_with_state(x, state, total_steps=total_steps)
    return neuron.forward_with_state(x, state)


def detach_state(state):
    """Detach every tensor of a (nested) neuron state (the truncation in truncated BPTT)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, tuple):
        return tuple(detach_state(s) for s in state)
    return state


class _SpikingLinear(nn.Module):
    """Linear -> BatchNorm over (T x B x N) -> neuron, on ``[T, B, N, D]``."""

    def __init__(self, d_in: int, d_out: int, neuron: str, options: Dict[str, Any]) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm = nn.BatchNorm1d(d_out)
        self.neuron = make_neuron(neuron, d_out, options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, n, _ = x.shape
        h = self.norm(self.linear(x).flatten(0, 2))  # [T*B*N, D]
        return self.neuron(h.view(t, b * n, -1)).view(t, b, n, -1)  # neurons see [T, B*N, D]: per-feature gains


class SpikingSelfAttention(nn.Module):
    """Spikformer-style spiking self-attention on ``[T, B, N, D]``: spike-valued Q, K, V (linear -> BN -> neuron),
    ``(Q K^T) V * scale`` per head without softmax (all entries are non-negative spike counts), a neuron on the
    result, then a linear -> BN -> neuron projection."""

    def __init__(self, dim: int, heads: int, neuron: str, options: Dict[str, Any], scale: float = 0.125) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.scale = heads, scale
        self.q = _SpikingLinear(dim, dim, neuron, options)
        self.k = _SpikingLinear(dim, dim, neuron, options)
        self.v = _SpikingLinear(dim, dim, neuron, options)
        opts = dict(options)
        opts.setdefault("v_threshold", 0.5)  # Spikformer's attention neuron fires at half the usual threshold
        self.attn_neuron = make_neuron(neuron, dim, opts)
        self.proj = _SpikingLinear(dim, dim, neuron, options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, n, d = x.shape
        split = lambda z: z.view(t, b, n, self.heads, d // self.heads).transpose(2, 3)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))  # [T, B, H, N, dh]
        y = (q @ k.transpose(-1, -2)) @ v * self.scale  # [T, B, H, N, dh]
        y = y.transpose(2, 3).reshape(t, b * n, d)
        y = self.attn_neuron(y).view(t, b, n, d)
        return self.proj(y)


class SpikingTransformerBlock(nn.Module):
    """``x + SSA(x)`` then ``x + MLP(x)`` (spiking MLP: two linear -> BN -> neuron layers); ``[T, B, N, D]``."""

    def __init__(self, dim: int, heads: int, neuron: str, options: Dict[str, Any], mlp_ratio: float = 4.0) -> None:
        super().__init__()
        hidden = int(round(dim * mlp_ratio))
        self.attn = SpikingSelfAttention(dim, heads, neuron, options)
        self.mlp = nn.Sequential(_SpikingLinear(dim, hidden, neuron, options),
                                 _SpikingLinear(hidden, dim, neuron, options))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)
