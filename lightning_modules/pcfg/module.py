"""``PCFGModule``: a causal transformer predicting PCFG tokens; metric: KL to the exact next-token conditionals.

Batches from :class:`datamodules.pcfg.PCFGDataModule`. The model reads ``[BOS, x_0, ..., x_{n-2}]`` and predicts
``x_0, ..., x_{n-1}``. Logged per stage: ``loss`` (cross-entropy per token, nats); on validation/test also
``kl`` (mean ``KL(p_grammar(.|x_<t) || q_model(.|x_<t))`` per token) and ``excess_ce`` (cross-entropy minus the
exact conditional entropy of the observed tokens, averaged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_modules.base import LongContextModule
from lightning_modules.layers.transformer import CausalTransformer

__all__ = ["PCFGModelConfig", "PCFGModule", "conditional_kl"]


@dataclass
class PCFGModelConfig:
    vocab: int = 8
    """Grammar symbols (tokens); one more id is used for BOS."""
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.vocab < 2:
            problems.append(f"vocab={self.vocab}: must be >= 2")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_layers < 1:
            problems.append(f"n_layers={self.n_layers}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


def conditional_kl(true_logp: torch.Tensor, model_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per position ``[..., n]`` from true log-probs and model logits ``[..., n, v]``."""
    logq = F.log_softmax(model_logits.float(), dim=-1)
    p = true_logp.exp()
    return (p * (true_logp - logq)).nan_to_num(0.0).sum(-1)


class PCFGModule(LongContextModule):
    config_class = PCFGModelConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        self.embed = nn.Embedding(c.vocab + 1, c.d_model)
        self.body = CausalTransformer(c.d_model, c.n_layers, c.n_heads, dropout=c.dropout)
        self.head = nn.Linear(c.d_model, c.vocab)
        self.kl = self.stage_metrics(MeanMetric, "kl", stages=("val", "test"))
        self.excess = self.stage_metrics(MeanMetric, "excess", stages=("val", "test"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, n]`` tokens -> logits ``[B, n, v]`` for each position given the tokens before it."""
        bos = torch.full_like(x[:, :1], self.cfg.vocab)
        h = self.body(self.embed(torch.cat([bos, x[:, :-1]], dim=1)))
        return self.head(h)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        logits = self(batch["x"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["x"].flatten())
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _eval(self, batch: Dict[str, torch.Tensor], stage: str) -> None:
        x, cond = batch["x"], batch["cond"]
        logits = self(x)
        ce = F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction="none").view_as(x)
        true_nll = -torch.gather(cond, -1, x.unsqueeze(-1)).squeeze(-1)
        self.kl[stage].update(conditional_kl(cond, logits))
        self.excess[stage].update(ce - true_nll)
        self.log(f"{stage}/loss", ce.mean(), on_step=False, on_epoch=True)
        self.log(f"{stage}/kl", self.kl[stage], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/excess_ce", self.excess[stage], on_step=False, on_epoch=True)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")
