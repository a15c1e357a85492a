"""``LCubeModule``: train a causal sequence model on L-CUBE and measure how much of the context it uses.

Batches are dicts from :class:`datamodules.lcube.LCubeDataModule`:

* training: ``{"x": [B, L, D]}``;
* validation/test additionally ``{"cond_mean": [B, L, D], "cond_cov": [B, L, D, D]`` (the exact
  ``p(x_t | x_{<t})``), ``"suffix_mean": [B, L - cut, D], "suffix_cov": [B, L - cut, D, D]`` (the exact
  ``p(x_t | x_{cut:t})``), ``"bmi_true": [B]`` (exact ``I_BP(cut; L)``), ``"cut": [B]``}.

Logged per stage (``val/``, ``test/``): ``loss`` (NLL per token, nats), ``kl`` (conditional KL per token) and
``kl_by_pos/a-b`` by context length, ``bmi`` (the model's estimate of the bipartite MI), ``bmi_true`` and
``utilization = bmi / bmi_true``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from lightning_modules.base import LongContextModule
from lightning_modules.lcube.config import LCubeModelConfig
from lightning_modules.lcube.gaussian import gaussian_kl, gaussian_nll
from lightning_modules.lcube.metrics import ConditionalKL, ContextUtilization
from lightning_modules.lcube.model import SequencePredictor

__all__ = ["LCubeModule"]


class LCubeModule(LongContextModule):
    """Gaussian next-vector prediction on L-CUBE sequences (see the module docstring for batch and logs)."""

    config_class = LCubeModelConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model = SequencePredictor(self.cfg)
        self.kl = self.stage_metrics(ConditionalKL, "kl", stages=("val", "test"))
        self.utilization = self.stage_metrics(ContextUtilization, "utilization", stages=("val", "test"))

    def forward(self, x: torch.Tensor, offset: int = 0):
        """``x`` ``[B, N, D]`` starting at absolute position ``offset`` -> ``(mean, chol)`` of
        ``p(x_t | x_{offset:t})`` for every ``t``."""
        return self.model(x, offset)

    def nll(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Per-position negative log-likelihood ``[B, N]`` in nats."""
        mean, chol = self.model(x, offset)
        return gaussian_nll(x, mean, chol)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        x = batch["x"]
        start = 0
        if self.cfg.random_context_start > 0 and x.shape[1] > 1:
            draw = torch.rand(2).tolist()  # the global generator: seeded, and restored on resume
            if draw[0] < self.cfg.random_context_start:
                start = 1 + int(draw[1] * (x.shape[1] - 1))
        loss = self.nll(x[:, start:], offset=start).mean()
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _evaluate(self, batch: Dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        x = batch["x"]
        mean, chol = self.model(x)
        kl = gaussian_kl(batch["cond_mean"], batch["cond_cov"], mean, chol)
        self.kl[stage].update(kl)
        cut = int(batch["cut"][0])
        if not bool((batch["cut"] == cut).all()):
            raise ValueError("all sequences of a batch must share one bipartite cut")
        mean_s, chol_s = self.model(x[:, cut:], offset=cut)
        kl_suffix = gaussian_kl(batch["suffix_mean"], batch["suffix_cov"], mean_s, chol_s)
        self.utilization[stage].update(kl_suffix, kl[:, cut:], batch["bmi_true"])
        loss = gaussian_nll(x, mean, chol).mean()
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=x.shape[0])
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        return self._evaluate(batch, "val")

    def test_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        return self._evaluate(batch, "test")

    def predict_step(self, batch: Dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0):
        mean, chol = self.model(batch["x"])
        return {"mean": mean, "chol": chol}

    # ------------------------------------------------------------------ epoch ends
    def _log_epoch(self, stage: str) -> None:
        for metric in (self.kl[stage], self.utilization[stage]):
            if metric.update_called:
                self.log_dict({f"{stage}/{k}": v for k, v in metric.compute().items()})
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")
