"""``SequencePredictor``: a causal model of ``p(x_t | x_{<t})`` for vector sequences (transformer or GRU)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_modules.layers.transformer import CausalTransformer
from lightning_modules.lcube.config import LCubeModelConfig
from lightning_modules.lcube.gaussian import GaussianHead

__all__ = ["SequencePredictor", "sinusoidal_positions"]


def sinusoidal_positions(n: int, d: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[n, d]`` fixed sinusoidal position codes (Vaswani et al.), frequencies ``1 / 10000**(2i/d)``."""
    pos = torch.arange(n, device=device, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    out = torch.zeros(n, d, device=device)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return out.to(dtype)


class SequencePredictor(nn.Module):
    """Predict every token of ``x`` ``[B, N, D]`` from the tokens before it.

    The input is shifted right behind a learned start vector, so the prediction at position ``t`` sees
    exactly ``x_{0..t-1}`` (position 0 sees nothing). Returns ``(mean [B, N, D], chol [B, N, D, D])``.

    ``offset`` is the absolute position of ``x[:, 0]``: a suffix ``x[:, c:]`` run with ``offset=c`` is the same
    tokens at the same places with the context before ``c`` removed (what the bipartite-MI estimate needs).
    """

    def __init__(self, cfg: LCubeModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.dim, cfg.d_model)
        self.start = nn.Parameter(torch.zeros(cfg.d_model))
        self.pos = nn.Embedding(cfg.max_positions, cfg.d_model) if cfg.position_embedding == "learned" else None
        if self.pos is not None:
            nn.init.normal_(self.pos.weight, std=0.02)
        if cfg.backbone == "transformer":
            self.backbone = CausalTransformer(
                cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_ratio, cfg.dropout, cfg.rope_base,
                cfg.attention_window,
            )
            self.rnn = None
            features = cfg.d_model
        else:
            self.backbone = None
            self.rnn = nn.GRU(cfg.d_model, cfg.rnn_hidden, num_layers=cfg.rnn_layers, batch_first=True,
                              dropout=cfg.dropout if cfg.rnn_layers > 1 else 0.0)
            features = cfg.rnn_hidden
        self.head = GaussianHead(features, cfg.dim, cfg.covariance, cfg.min_scale)

    def forward(self, x: torch.Tensor, offset: int = 0):
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"expected x of shape [B, N, {self.cfg.dim}], got {list(x.shape)}")
        B, N, _ = x.shape
        h = torch.cat([self.start.expand(B, 1, -1), self.embed(x[:, :-1])], dim=1)
        if self.cfg.position_embedding == "learned":
            if offset + N > self.cfg.max_positions:
                raise ValueError(f"positions up to {offset + N} exceed max_positions={self.cfg.max_positions}")
            h = h + self.pos.weight[offset : offset + N]
        elif self.cfg.position_embedding == "sinusoidal":
            h = h + sinusoidal_positions(offset + N, self.cfg.d_model, h.device, h.dtype)[offset:]
        if self.backbone is not None:
            h = self.backbone(h)
        else:
            h, _ = self.rnn(h)
        return self.head(h)
