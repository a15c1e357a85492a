"""MEG-XL's criss-cross transformer over channels x time, its sensor embedding and its block masking.

Input: RVQ codes ``[B, C, T', Q]`` of every channel (see :mod:`lightning_modules.meg.tokenizer`) plus sensor
geometry. The embedding concatenates the ``Q`` frozen codebook vectors of each token, projects them to
``d_model``, and adds three sensor embeddings (Gaussian Fourier features of the normalised position and of the
orientation, and a magnetometer/gradiometer type embedding). There is no temporal position embedding: time
enters through RoPE in the temporal attention.

Each :class:`CrissCrossBlock` on ``x [B, C, T', d]`` (pre-norm RMSNorm):

* the first ``d/2`` features attend **over time** within each channel (``B*C`` sequences of ``T'`` tokens,
  bidirectional, RoPE over the token index), through the shared :func:`litctx_kernels.attention`;
* the other ``d/2`` attend **over channels** at each time token (``B*T'`` sequences of ``C`` tokens, no
  positions; channel identity comes from the sensor embeddings);
* the halves are concatenated and added to the residual, then RMSNorm -> FFN (``d -> 4d -> d``, SELU) ->
  residual.

The cost is ``O(C T'^2 + T' C^2)`` instead of ``O((C T')^2)``. MEG-XL does not mask zero-padded channels out of
the spatial attention; ``mask_padded_channels=True`` adds the key-padding mask (default off, for fidelity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from litctx_kernels import attention
from lightning_modules.layers.rope import RotaryEmbedding, apply_rotary

__all__ = ["BackboneConfig", "FourierFeatures", "SensorEmbedding", "CrissCrossBlock", "MEGBackbone",
           "block_time_mask", "masking_plan"]


@dataclass
class BackboneConfig:
    """Sizes of the criss-cross backbone (MEG-XL: d_model 512, 8 layers, 8 heads, Fourier 250)."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    """Total heads; half attend over time, half over channels."""
    mlp_ratio: float = 4.0
    dropout: float = 0.1
    fourier_features: int = 32
    """Fourier features per sensor embedding (even)."""
    pos_scale: float = 1.8
    dir_scale: float = 1.0
    rope_base: float = 10000.0
    mask_padded_channels: bool = False
    """Key-padding mask for zero-padded channels in spatial attention (MEG-XL: off)."""

    def problems(self) -> list:
        """Problems with these sizes (empty when valid); subclasses call it from ``__post_init__``."""
        out = []
        if self.d_model % 2 or (self.d_model // 2) % max(1, self.n_heads // 2):
            out.append(f"d_model={self.d_model}: must be even with d_model/2 divisible by n_heads/2={self.n_heads // 2}")
        if self.n_heads < 2 or self.n_heads % 2:
            out.append(f"n_heads={self.n_heads}: must be even and >= 2 (half temporal, half spatial)")
        elif ((self.d_model // 2) // (self.n_heads // 2)) % 2:
            out.append(f"head size {(self.d_model // 2) // (self.n_heads // 2)} must be even for RoPE")
        if self.n_layers < 1:
            out.append(f"n_layers={self.n_layers}: must be >= 1")
        if self.fourier_features < 2 or self.fourier_features % 2:
            out.append(f"fourier_features={self.fourier_features}: must be even and >= 2")
        return out


class FourierFeatures(nn.Module):
    """Fixed Gaussian Fourier features of ``p [..., in_dim]`` then a linear map: ``[..., in_dim] -> [..., d]``.

    ``B ~ N(0, scale^2)`` of shape ``[in_dim, features/2]`` is a buffer (not trained); features are
    ``[sin(2 pi p B), cos(2 pi p B)]``."""

    def __init__(self, in_dim: int, features: int, d_model: int, scale: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("B", torch.randn(in_dim, features // 2, generator=g) * scale)
        self.proj = nn.Linear(features, d_model)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        angles = 2 * math.pi * p @ self.B
        return self.proj(torch.cat([angles.sin(), angles.cos()], dim=-1))


class SensorEmbedding(nn.Module):
    """Position + orientation Fourier embeddings and a type embedding: ``xyzdir [B, C, 6], types [B, C]`` ->
    ``[B, C, d]``."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.pos = FourierFeatures(3, cfg.fourier_features, cfg.d_model, cfg.pos_scale, seed=1)
        self.dir = FourierFeatures(3, cfg.fourier_features, cfg.d_model, cfg.dir_scale, seed=2)
        self.kind = nn.Embedding(2, cfg.d_model)

    def forward(self, xyzdir: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return self.pos(xyzdir[..., :3]) + self.dir(xyzdir[..., 3:]) + self.kind(types.clamp(0, 1))


class _HalfAttention(nn.Module):
    """Multi-head self-attention on ``[N, L, width]`` sequences, optionally with RoPE and a key mask."""

    def __init__(self, width: int, heads: int, rope: Optional[RotaryEmbedding]) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        L = x.shape[1]
        q, k, v = rearrange(self.qkv(x), "n l (three h e) -> three n h l e", three=3, h=self.heads)
        if self.rope is not None:
            cos, sin = self.rope(L, dtype=q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if key_mask is None:
            o, _ = attention(q, k, v, causal=False)
        else:  # the shared kernels have no key-padding mask: SDPA with a boolean mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out(rearrange(o, "n h l e -> n l (h e)"))


class CrissCrossBlock(nn.Module):
    """One criss-cross layer: ``x [B, C, T, d] -> [B, C, T, d]`` (see the module docstring)."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        d, half_heads = cfg.d_model, cfg.n_heads // 2
        self.half = d // 2
        self.norm1 = nn.RMSNorm(d)
        self.temporal = _HalfAttention(self.half, half_heads, RotaryEmbedding(self.half // half_heads, cfg.rope_base))
        self.spatial = _HalfAttention(d - self.half, half_heads, None)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.RMSNorm(d)
        hidden = int(round(cfg.mlp_ratio * d))
        self.ffn = nn.Sequential(nn.Linear(d, hidden), nn.SELU(), nn.Dropout(cfg.dropout), nn.Linear(hidden, d),
                                 nn.Dropout(cfg.dropout))
        self.mask_padded = cfg.mask_padded_channels

    def forward(self, x: torch.Tensor, sensor_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = x.shape[0], x.shape[2]
        h = self.norm1(x)
        t = self.temporal(rearrange(h[..., : self.half], "b c t e -> (b c) t e"))  # along time, per sensor
        t = rearrange(t, "(b c) t e -> b c t e", b=B)
        s_in = rearrange(h[..., self.half:], "b c t e -> (b t) c e")  # the spatial half attends across sensors
        key_mask = None
        if self.mask_padded and sensor_mask is not None and not bool(sensor_mask.all()):
            key_mask = repeat(sensor_mask.bool(), "b c -> (b t) c", t=T)
        s = rearrange(self.spatial(s_in, key_mask), "(b t) c e -> b c t e", b=B)
        x = x + self.drop(torch.cat([t, s], dim=-1))
        return x + self.ffn(self.norm2(x))


class MEGBackbone(nn.Module):
    """Codes + sensors -> features ``[B, C, T', d]``.

    Args (forward):
        code_vectors: ``[B, C, T', Q, d_cb]`` codebook vectors of the tokens.
        xyzdir, types, sensor_mask: ``[B, C, 6]``, ``[B, C]``, ``[B, C]``.
        token_mask: optional ``[B, C, T']`` bool: those tokens' content is replaced by the mask token.
    """

    def __init__(self, cfg: BackboneConfig, code_features: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.content = nn.Linear(code_features, cfg.d_model)
        self.sensors = SensorEmbedding(cfg)
        self.mask_token = nn.Parameter(torch.zeros(cfg.d_model))
        nn.init.normal_(self.mask_token, std=0.02)
        self.blocks = nn.ModuleList(CrissCrossBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)

    def forward(self, code_vectors: torch.Tensor, xyzdir: torch.Tensor, types: torch.Tensor,
                sensor_mask: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        content = self.content(code_vectors.flatten(-2))  # [B, C, T', d]
        if token_mask is not None:
            content = torch.where(token_mask.unsqueeze(-1), self.mask_token.to(content.dtype), content)
        x = content + self.sensors(xyzdir, types).unsqueeze(2)
        for block in self.blocks:
            x = block(x, sensor_mask)
        return self.norm(x)


def masking_plan(n_tokens: int, n_subsegments: int, mask_tokens: int, mask_ratio: float) -> tuple:
    """``(n_subsegments, subsegment_len, mask_len, n_masked)`` for a context of ``n_tokens`` tokens cut into
    ``n_subsegments`` sub-segments (the context's seconds over ``subsegment_s``, at least 1).

    Each sub-segment holds ``subsegment_len = n_tokens // n_subsegments`` tokens (the tail beyond them is never
    masked); a block of ``mask_len = min(mask_tokens, subsegment_len)`` tokens is placed in ``n_masked =
    max(1, round(mask_ratio * n_subsegments))`` of them. MEG-XL at 150 s: 625 tokens, 50 sub-segments of 12,
    blocks of 12, 20 masked (the last 25 tokens never)."""
    n_sub = max(1, min(n_subsegments, n_tokens))
    sub_len = n_tokens // n_sub
    mask_len = max(1, min(mask_tokens, sub_len))
    n_masked = min(n_sub, max(1, int(round(mask_ratio * n_sub))))
    return n_sub, sub_len, mask_len, n_masked


def block_time_mask(batch: int, n_tokens: int, n_subsegments: int, mask_tokens: int, mask_ratio: float,
                    generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
    """``[batch, n_tokens]`` bool: per sample, ``n_masked`` sub-segments drawn without replacement, each with one
    block of ``mask_len`` tokens at a uniform offset inside it (see :func:`masking_plan`)."""
    n_sub, sub_len, mask_len, n_masked = masking_plan(n_tokens, n_subsegments, mask_tokens, mask_ratio)
    mask = torch.zeros(batch, n_tokens, dtype=torch.bool)
    for b in range(batch):
        chosen = torch.randperm(n_sub, generator=generator)[:n_masked]
        offsets = torch.randint(0, sub_len - mask_len + 1, (n_masked,), generator=generator)
        for s, o in zip(chosen.tolist(), offsets.tolist()):
            start = s * sub_len + o
            mask[b, start:start + mask_len] = True
    return mask.to(device) if device is not None else mask
