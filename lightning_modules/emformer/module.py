"""EMFormer as a LightningModule: one-step pre-training and accumulative-context (rollout) fine-tuning.

* ``mode="pretrain"``: the composite loss of the one-step forecast ``model(x)`` against ``y[:, 0]``.
* ``mode="rollout"`` (manual optimisation, as the released training loop): for ``j = 1 .. rollout_steps`` the
  input is the truth for ``j = 1`` and the (detached) previous prediction afterwards; each step has its own
  backward and optimiser step, so the model learns from its own accumulated errors without back-propagating
  through the rollout. Gradients are clipped *before* the step (the released code clips after it, which
  has no effect).

Validation and test roll the model out ``R`` steps (``R`` = the data's ``eval_rollout``) and report
WeatherBench2's latitude-weighted RMSE and ACC per channel and lead on de-normalised fields
(``{stage}/rmse/<channel>/lead<k>``, ``{stage}/acc/<channel>/lead<k>``) and ``{stage}/rmse_norm`` (mean
normalised RMSE over channels and leads, the checkpoint monitor). ``self.last_scores`` keeps the full
``[R, C]`` tables of the last evaluation.

Data-dependent state (channel statistics, latitude weights, channel names) comes from the DataModule in
``setup`` and is saved in checkpoints as buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from lightning_modules.base import LongContextModule, SharedEvalStages
from lightning_modules.emformer.geo import area_weights, cos_weights
from lightning_modules.emformer.loss import CompositeWeatherLoss
from lightning_modules.emformer.metrics import LatWeightedACC, LatWeightedRMSE

__all__ = ["EMFormerConfig", "EMFormerModule"]


@dataclass
class EMFormerConfig:
    """Attributes:
        model: a timm model name registered by :mod:`lightning_modules.emformer.model`.
        model_args: extra ``timm.create_model`` arguments (e.g. ``embed_dim``, ``mid_depth``).
        in_chans: state channels (must match the data: variables x levels + surface variables).
        img_size: ``[H, W]`` of the grid.
        latitudes: ``[H]`` latitudes in degrees (default: cell centres of an ``H``-row grid, ascending).
        mode: ``pretrain`` or ``rollout``.
        rollout_steps: forecast steps per training sample in rollout mode (the data's ``rollout`` must be >= it).
        detach_rollout: feed detached predictions back (the released code); False back-propagates through
            each step's input (each step still has its own optimiser step).
        lat_weighting: ``area`` (WeatherBench2) or ``cos`` (EMFormer's loss) weights in the loss and metrics.
        theta_init: initial angle of the loss mix (``-pi/2`` = pure generation loss).
        clip_norm: gradient-norm clip of rollout mode (None = off); pretrain uses ``trainer.gradient_clip_val``.
        report_channels: channels logged per lead (all are kept in ``last_scores``).
    """

    model: str = "emformer_tiny"
    model_args: Dict[str, Any] = field(default_factory=dict)
    in_chans: int = 12
    img_size: List[int] = field(default_factory=lambda: [32, 64])
    latitudes: Optional[List[float]] = None
    mode: str = "pretrain"
    rollout_steps: int = 4
    detach_rollout: bool = True
    lat_weighting: str = "area"
    theta_init: float = -math.pi / 2
    clip_norm: Optional[float] = 20.0
    report_channels: List[str] = field(default_factory=lambda: [
        "geopotential@500", "temperature@850", "2m_temperature", "10m_u_component_of_wind"])

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("pretrain", "rollout"):
            problems.append(f"mode={self.mode!r}: must be 'pretrain' or 'rollout'")
        if self.rollout_steps < 1:
            problems.append(f"rollout_steps={self.rollout_steps}: must be >= 1")
        if self.lat_weighting not in ("area", "cos"):
            problems.append(f"lat_weighting={self.lat_weighting!r}: must be 'area' or 'cos'")
        if len(self.img_size) != 2:
            problems.append(f"img_size={list(self.img_size)}: give [H, W]")
        if self.latitudes is not None and len(self.latitudes) != self.img_size[0]:
            problems.append(f"latitudes has {len(self.latitudes)} values for H={self.img_size[0]}")
        if problems:
            raise ValueError("; ".join(problems))


def _default_latitudes(n: int) -> torch.Tensor:
    d = 180.0 / n
    return -90.0 + d / 2 + d * torch.arange(n, dtype=torch.float64)


class EMFormerModule(SharedEvalStages, LongContextModule):
    """See the module docstring."""

    config_class = EMFormerConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        import timm

        import lightning_modules.emformer.model  # noqa: F401  (registers the emformer_* architectures)

        c, (h, w) = self.cfg.in_chans, self.cfg.img_size
        self.model = timm.create_model(self.cfg.model, in_chans=c, img_size=(h, w), **self.cfg.model_args)
        lat = torch.tensor(self.cfg.latitudes, dtype=torch.float64) if self.cfg.latitudes else _default_latitudes(h)
        weights = (area_weights if self.cfg.lat_weighting == "area" else cos_weights)(lat).float()
        self.register_buffer("lat_weights", weights)
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("std", torch.ones(c))
        self.loss_fn = CompositeWeatherLoss(c, weights, self.cfg.theta_init)
        self.channels: List[str] = [f"ch{i}" for i in range(c)]
        self.automatic_optimization = self.cfg.mode == "pretrain"
        self.last_scores: Dict[str, Dict[str, torch.Tensor]] = {}
        self._metrics: Dict[str, Any] = {}

    @property
    def optimizer_steps_per_batch(self) -> int:
        """Optimizer steps per training batch (progress lines use it)."""
        return self.cfg.rollout_steps if self.cfg.mode == "rollout" else 1

    # ------------------------------------------------------------------ data-dependent state
    def setup(self, stage: Optional[str] = None) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "channels"):
            self.prepare_from_datamodule(dm)

    def prepare_from_datamodule(self, dm: Any) -> None:
        """Take channel names, statistics and latitudes from an :class:`~datamodules.era5.ERA5DataModule`."""
        dm.setup()
        c, (h, w) = self.cfg.in_chans, self.cfg.img_size
        if dm.n_channels != c:
            raise ValueError(f"method.args.in_chans={c} but the data has {dm.n_channels} channels "
                             f"({', '.join(dm.channels)}); set in_chans to {dm.n_channels}")
        grid = (len(dm.latitudes), len(dm.longitudes))
        if grid != (h, w):
            raise ValueError(f"method.args.img_size={[h, w]} but the data grid is {list(grid)}")
        self.channels = list(dm.channels)
        self.mean.copy_(torch.as_tensor(dm.mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(dm.std, dtype=torch.float32))
        fn = area_weights if self.cfg.lat_weighting == "area" else cos_weights
        weights = fn(torch.as_tensor(dm.latitudes)).float().to(self.lat_weights.device)
        self.lat_weights.copy_(weights)
        self.loss_fn.lat_weights.copy_(weights.view(-1, 1))

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std.view(-1, 1, 1) + self.mean.view(-1, 1, 1)

    # ------------------------------------------------------------------ forward and rollouts
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @torch.no_grad()
    def rollout(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        """Autoregressive forecast ``[B, steps, C, H, W]`` from ``x [B, C, H, W]`` (normalised)."""
        outs = []
        state = x
        for _ in range(steps):
            state = self.model(state)
            outs.append(state)
        return torch.stack(outs, 1)

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        x, y = batch["x"], batch["y"]
        if self.cfg.mode == "pretrain":
            loss, parts = self.loss_fn(self.model(x), y[:, 0])
            self._log_train(loss, parts)
            return loss
        steps = self.cfg.rollout_steps
        if y.shape[1] < steps:
            raise ValueError(f"rollout mode needs {steps} targets per sample; the data serves {y.shape[1]} "
                             f"(set data.args.rollout >= method.args.rollout_steps)")
        opt = self.optimizers()
        sched = self.lr_schedulers()
        state = x
        total = 0.0
        for j in range(steps):
            pred = self.model(state)
            loss, parts = self.loss_fn(pred, y[:, j])
            opt.zero_grad(set_to_none=True)
            self.manual_backward(loss)
            if self.cfg.clip_norm is not None:
                self.clip_gradients(opt, gradient_clip_val=self.cfg.clip_norm, gradient_clip_algorithm="norm")
            opt.step()
            state = pred.detach() if self.cfg.detach_rollout else pred
            total += float(loss.detach())
        if sched is not None:
            sched.step()  # once per batch, so the schedule spans the run as in pre-training
        self._log_train(torch.tensor(total / steps), parts)
        return None

    def _log_train(self, loss: torch.Tensor, parts: Dict[str, torch.Tensor]) -> None:
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/loss_mix", parts["mix"])
        self.log("train/loss_rmse", parts["rmse"])

    # ------------------------------------------------------------------ evaluation
    def _stage_metrics(self, stage: str, leads: int) -> Dict[str, Any]:
        key = f"{stage}:{leads}"
        if key not in self._metrics:
            c = self.cfg.in_chans
            self._metrics[key] = {
                "rmse": LatWeightedRMSE(self.lat_weights, leads, c).to(self.device),
                "acc": LatWeightedACC(self.lat_weights, leads, c).to(self.device),
                "rmse_norm": LatWeightedRMSE(self.lat_weights, leads, c).to(self.device),
            }
        return self._metrics[key]

    def eval_step(self, stage: str, batch: Dict[str, torch.Tensor]) -> None:
        x, y, clim = batch["x"], batch["y"], batch["clim"]
        pred = self.rollout(x, y.shape[1])
        m = self._stage_metrics(stage, y.shape[1])
        m["rmse_norm"].update(pred, y)
        den = self.denormalize
        m["rmse"].update(den(pred), den(y))
        m["acc"].update(den(pred), den(y), den(clim))

    def eval_epoch_end(self, stage: str) -> None:
        for key in [k for k in self._metrics if k.startswith(stage + ":")]:
            m = self._metrics.pop(key)
            rmse, acc, rmse_norm = m["rmse"].compute(), m["acc"].compute(), m["rmse_norm"].compute()
            self.last_scores[stage] = {"rmse": rmse.cpu(), "acc": acc.cpu(), "rmse_norm": rmse_norm.cpu(),
                                       "channels": list(self.channels)}
            self.log(f"{stage}/rmse_norm", float(rmse_norm.mean()), prog_bar=stage == "val")
            for name in self.cfg.report_channels:
                if name not in self.channels:
                    continue
                c = self.channels.index(name)
                for lead in range(rmse.shape[0]):
                    self.log(f"{stage}/rmse/{name}/lead{lead + 1}", float(rmse[lead, c]))
                    self.log(f"{stage}/acc/{name}/lead{lead + 1}", float(acc[lead, c]))
