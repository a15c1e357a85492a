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

Validation and test RMSE follow ``rmse_sqrt_before_mean`` (False: WB2's ``RMSE``, the square root of the
time-mean weighted MSE; True: WB2's ``RMSESqrtBeforeTimeAvg``).

Data-determined args: ``in_chans``, ``img_size`` and ``latitudes`` default to null, which ``recipes`` fills from the
DataModule's ``method_hints()`` (built directly, set ``in_chans`` and ``img_size``). A grid the architecture cannot
take (e.g. WB2's 121 x 240) is fitted by ``grid_fit``: ``pad`` runs the model on the smallest larger grid it takes
(latitude rows replicated, longitude wrapped) and keeps only the real cells of every step's output, so loss,
metrics and the next rollout input never see padded cells; ``crop`` keeps the largest smaller grid (centred
rows, the first longitudes) and scores those cells; ``error`` refuses. Shapes: the data grid ``[H, W]``, the
prediction grid ``[H_out, W_out]`` (= ``[H, W]`` except for ``crop``), the model grid ``self.grid.model``.

Data-dependent state (channel statistics, latitude weights, channel names) comes from the DataModule in
``setup`` and is saved in checkpoints as buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from lightning_modules.base import LongContextModule, SharedEvalStages
from lightning_modules.emformer.geo import area_weights, cos_weights
from lightning_modules.emformer.loss import CompositeWeatherLoss
from lightning_modules.emformer.metrics import LatWeightedACC, LatWeightedRMSE

__all__ = ["EMFormerConfig", "EMFormerModule", "GridPlan", "plan_grid"]


GRID_FITS = ("pad", "crop", "error")


@dataclass
class EMFormerConfig:
    """Attributes:
        model: a timm model name registered by :mod:`lightning_modules.emformer.model` (``emformer_tiny``,
            ``emformer_small``, ``emformer_base``).
        model_args: extra architecture arguments (``EMFormer``'s, e.g. ``embed_dim``, ``mid_depth``,
            ``patch_size``, ``windows``; not ``in_chans``/``img_size``, set below); an unknown key is a config error.
        in_chans: state channels; None = from the data (``recipes`` fills it from the DataModule's
            ``method_hints``: variables x levels + surface variables). A set value must match the data.
        img_size: ``[H, W]`` of the data grid; None = from the data (as ``in_chans``). A set value must match.
        latitudes: ``[H]`` latitudes in degrees; None = from the data through ``recipes`` (built directly:
            cell centres of an ``H``-row grid, ascending; the DataModule's latitudes replace them in ``setup``).
        grid_fit: how an ``H x W`` grid the architecture cannot take (``patch_size`` multiple, even token-grid
            lengths at every hourglass level, windows tiling the middle grid) is fitted to the nearest size it
            can: ``pad`` (the smallest larger grid: longitude wrapped circularly, the grid being global; latitude
            rows replicated at both edges; the model's output on the padded cells is dropped every step, so
            the loss, the metrics and the next rollout input use the real cells only), ``crop`` (the largest
            smaller grid: rows centred, columns from the first longitude; loss and metrics on the kept cells,
            latitude weights those of the kept rows renormalised to mean 1) or ``error``.
        mode: ``pretrain`` or ``rollout``.
        rollout_steps: forecast steps per training sample in rollout mode (the data's ``rollout`` must be >= it).
        detach_rollout: feed detached predictions back (the released code); False back-propagates through
            each step's input (each step still has its own optimiser step).
        lat_weighting: ``area`` (WeatherBench2) or ``cos`` (EMFormer's loss) weights in the loss and metrics.
        rmse_sqrt_before_mean: the RMSE convention of the evaluation (``rmse`` and ``rmse_norm``): False =
            square root of the mean over forecast times of the latitude-weighted MSE (WeatherBench2's ``RMSE``,
            its headline scores); True = mean over forecast times of each time's RMSE (WeatherBench2's
            ``RMSESqrtBeforeTimeAvg``, as EMFormer's code reports).
        theta_init: initial angle of the loss mix (``-pi/2`` = pure generation loss).
        clip_norm: gradient-norm clip of rollout mode (None = off); pretrain uses ``trainer.gradient_clip_val``.
        report_channels: channels logged per lead (all are kept in ``last_scores``).
    """

    model: str = "emformer_tiny"
    model_args: Dict[str, Any] = field(default_factory=dict)
    in_chans: Optional[int] = None
    img_size: Optional[List[int]] = None
    latitudes: Optional[List[float]] = None
    grid_fit: str = "pad"
    mode: str = "pretrain"
    rollout_steps: int = 4
    detach_rollout: bool = True
    lat_weighting: str = "area"
    rmse_sqrt_before_mean: bool = False
    theta_init: float = -math.pi / 2
    clip_norm: Optional[float] = 20.0
    report_channels: List[str] = field(default_factory=lambda: [
        "geopotential@500", "temperature@850", "2m_temperature", "10m_u_component_of_wind"])

    def __post_init__(self) -> None:
        from lightning_modules.emformer.model import VARIANTS, EMFormer
        from litctx_common.options import accepted_keywords, check_options

        problems = []
        if self.model not in VARIANTS:
            problems.append(f"model={self.model!r}: must be one of {', '.join(VARIANTS)}")
        check_options(self.model_args, accepted_keywords(EMFormer, skip=("in_chans", "img_size")),
                      "method.args.model_args")
        if self.mode not in ("pretrain", "rollout"):
            problems.append(f"mode={self.mode!r}: must be 'pretrain' or 'rollout'")
        if self.grid_fit not in GRID_FITS:
            problems.append(f"grid_fit={self.grid_fit!r}: must be one of {', '.join(GRID_FITS)}")
        if self.rollout_steps < 1:
            problems.append(f"rollout_steps={self.rollout_steps}: must be >= 1")
        if self.lat_weighting not in ("area", "cos"):
            problems.append(f"lat_weighting={self.lat_weighting!r}: must be 'area' or 'cos'")
        if self.in_chans is not None and self.in_chans < 1:
            problems.append(f"in_chans={self.in_chans}: must be >= 1 (or null: from the data)")
        if self.img_size is not None and len(self.img_size) != 2:
            problems.append(f"img_size={list(self.img_size)}: give [H, W] (or null: from the data)")
        elif self.latitudes is not None and self.img_size is not None and len(self.latitudes) != self.img_size[0]:
            problems.append(f"latitudes has {len(self.latitudes)} values for H={self.img_size[0]}")
        if problems:
            raise ValueError("; ".join(problems))
        if self.img_size is not None and self.model in VARIANTS:
            plan_grid(self)  # raises when the grid cannot be fitted (grid_fit=error, or nothing fits)


@dataclass(frozen=True)
class GridPlan:
    """How the data grid ``data [H, W]`` maps onto the model's ``model [Hm, Wm]``: predictions live on
    ``out`` (``data`` for pad/exact, ``model`` for crop); ``rows``/``cols`` index the kept (crop) or the
    source (pad) cells."""

    data: Tuple[int, int]
    model: Tuple[int, int]
    out: Tuple[int, int]
    mode: str  # "exact", "pad" or "crop"
    row0: int = 0  # crop: first kept row; pad: rows added above (the rest go below)


def plan_grid(cfg: EMFormerConfig) -> GridPlan:
    """The :class:`GridPlan` of ``cfg`` (its ``img_size``, ``model``, ``model_args`` and ``grid_fit``).

    Raises:
        ValueError: ``grid_fit=error`` and the grid does not fit, or no grid fits (naming the grid and why).
    """
    from lightning_modules.emformer.model import architecture_args, grid_problem

    arch = architecture_args(cfg.model, **cfg.model_args)
    h, w = int(cfg.img_size[0]), int(cfg.img_size[1])
    p, levels = int(arch["patch_size"]), list(arch["levels"])
    windows, depth, alt = arch["windows"], int(arch["mid_depth"]), int(arch["alternate_min_depth"])

    def problem(hm: int, wm: int) -> Optional[str]:
        return grid_problem((hm, wm), p, levels, windows, depth, alt)

    why = problem(h, w)
    if why is None:
        return GridPlan((h, w), (h, w), (h, w), "exact")
    if cfg.grid_fit == "error":
        raise ValueError(f"the {h}x{w} grid does not fit {cfg.model} ({why}); set method.args.grid_fit=pad or "
                         f"crop, or change model_args (patch_size, levels, windows)")
    from math import lcm

    dims = [int(v) for win in windows for v in win] or [1]
    span = p * 2 ** len(levels) * lcm(*dims)  # a multiple of this fits whatever the halving order
    sign = 1 if cfg.grid_fit == "pad" else -1
    best = None
    for hm in range(h, h + sign * span, sign):
        if hm < p or hm % p:
            continue
        for wm in range(w, w + sign * span, sign):
            if wm < p or wm % p or problem(hm, wm):
                continue
            score = (sign * hm * wm, abs(hm - h) + abs(wm - w))
            if best is None or score < best[0]:
                best = (score, hm, wm)
            break  # larger |wm - w| only moves away from the best for this hm
    if best is None:
        raise ValueError(f"no grid near {h}x{w} fits {cfg.model} by grid_fit={cfg.grid_fit} ({why}); try "
                         f"grid_fit=pad or smaller patch_size/windows/levels in model_args")
    _, hm, wm = best
    if cfg.grid_fit == "pad":
        return GridPlan((h, w), (hm, wm), (h, w), "pad", (hm - h) // 2)
    return GridPlan((h, w), (hm, wm), (hm, wm), "crop", (h - hm) // 2)


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

        missing = [k for k in ("in_chans", "img_size") if getattr(self.cfg, k) is None]
        if missing:
            raise ValueError(
                f"EMFormerModule: method.args {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} null "
                f"(= from the data) and no data is at hand; set in_chans and img_size (e.g. in_chans=12, "
                f"img_size=[32, 64]), or build through recipes (recipes.api.build, python -m recipes.fit), which "
                f"takes them from the DataModule's method_hints()")
        c, (h, w) = self.cfg.in_chans, self.cfg.img_size
        self.grid = plan_grid(self.cfg)
        self.model = timm.create_model(self.cfg.model, in_chans=c, img_size=self.grid.model, **self.cfg.model_args)
        lat = torch.tensor(self.cfg.latitudes, dtype=torch.float64) if self.cfg.latitudes else _default_latitudes(h)
        weights = self._weights(lat)
        self.register_buffer("lat_weights", weights)
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("std", torch.ones(c))
        self.loss_fn = CompositeWeatherLoss(c, weights, self.cfg.theta_init)
        self.channels: List[str] = [f"ch{i}" for i in range(c)]
        self.automatic_optimization = self.cfg.mode == "pretrain"
        self.last_scores: Dict[str, Dict[str, torch.Tensor]] = {}
        self._metrics: Dict[str, Any] = {}
        h_out, w_out = self.grid.out
        if self.grid.mode == "pad":
            rows = (torch.arange(self.grid.model[0]) - self.grid.row0).clamp(0, h - 1)  # latitude: replicate
            cols = torch.arange(self.grid.model[1]) % w  # longitude: circular
        else:
            rows = torch.arange(h_out) + self.grid.row0
            cols = torch.arange(w_out)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)

    def _weights(self, lat: torch.Tensor) -> torch.Tensor:
        """Latitude weights ``[H_out]`` of the prediction grid from the data's ``[H]`` latitudes (crop: the kept
        rows' weights renormalised to mean 1)."""
        w = (area_weights if self.cfg.lat_weighting == "area" else cos_weights)(lat)
        if self.grid.mode == "crop":
            w = w[self.grid.row0:self.grid.row0 + self.grid.out[0]]
            w = w / w.mean()
        return w.float()

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
                             f"({', '.join(dm.channels)}); set in_chans to {dm.n_channels} (or null: from the data)")
        grid = (len(dm.latitudes), len(dm.longitudes))
        if grid != (h, w):
            raise ValueError(f"method.args.img_size={[h, w]} but the data grid is {list(grid)}; set img_size to "
                             f"{list(grid)} (or null: from the data)")
        self.channels = list(dm.channels)
        self.mean.copy_(torch.as_tensor(dm.mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(dm.std, dtype=torch.float32))
        weights = self._weights(torch.as_tensor(dm.latitudes, dtype=torch.float64)).to(self.lat_weights.device)
        self.lat_weights.copy_(weights)
        self.loss_fn.lat_weights.copy_(weights.view(-1, 1))

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std.view(-1, 1, 1) + self.mean.view(-1, 1, 1)

    # ------------------------------------------------------------------ forward and rollouts
    def fit_grid(self, t: torch.Tensor) -> torch.Tensor:
        """Data grid ``[..., H, W]`` -> prediction grid ``[..., H_out, W_out]`` (the kept cells for
        ``grid_fit=crop``; unchanged otherwise)."""
        if self.grid.mode != "crop":
            return t
        return t.index_select(-2, self._rows).index_select(-1, self._cols)

    def pad_grid(self, t: torch.Tensor) -> torch.Tensor:
        """Prediction grid ``[..., H, W]`` -> the model's ``[..., Hm, Wm]`` (``grid_fit=pad``: latitude rows
        replicated, longitude wrapped; unchanged otherwise)."""
        if self.grid.mode != "pad":
            return t
        return t.index_select(-2, self._rows).index_select(-1, self._cols)

    def unpad_grid(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pad_grid` on the real cells: ``[..., Hm, Wm]`` -> ``[..., H, W]``."""
        if self.grid.mode != "pad":
            return t
        h, w = self.grid.data
        return t[..., self.grid.row0:self.grid.row0 + h, :w]

    def step(self, state: torch.Tensor) -> torch.Tensor:
        """One forecast step on the prediction grid ``[B, C, H_out, W_out]`` -> the same shape (padded cells
        are rebuilt from the real ones at every step and the model's output there is dropped)."""
        return self.unpad_grid(self.model(self.pad_grid(state)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, C, H, W]`` (data grid, normalised) -> the next state ``[B, C, H_out, W_out]``."""
        return self.step(self.fit_grid(x))

    @torch.no_grad()
    def rollout(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        """Autoregressive forecast ``[B, steps, C, H_out, W_out]`` from ``x [B, C, H, W]`` (normalised; the
        prediction grid is the data grid except for ``grid_fit=crop``)."""
        outs = []
        state = self.fit_grid(x)
        for _ in range(steps):
            state = self.step(state)
            outs.append(state)
        return torch.stack(outs, 1)

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int):
        x, y = batch["x"], batch["y"]
        if self.cfg.mode == "pretrain":
            loss, parts = self.loss_fn(self(x), self.fit_grid(y[:, 0]))
            self._log_train(loss, parts)
            return loss
        steps = self.cfg.rollout_steps
        if y.shape[1] < steps:
            raise ValueError(f"rollout mode needs {steps} targets per sample; the data serves {y.shape[1]} "
                             f"(set data.args.rollout >= method.args.rollout_steps)")
        opt = self.optimizers()
        sched = self.lr_schedulers()
        state = self.fit_grid(x)
        total = 0.0
        for j in range(steps):
            pred = self.step(state)
            loss, parts = self.loss_fn(pred, self.fit_grid(y[:, j]))
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
            c, sqrt_first = self.cfg.in_chans, self.cfg.rmse_sqrt_before_mean
            self._metrics[key] = {
                "rmse": LatWeightedRMSE(self.lat_weights, leads, c, sqrt_first).to(self.device),
                "acc": LatWeightedACC(self.lat_weights, leads, c).to(self.device),
                "rmse_norm": LatWeightedRMSE(self.lat_weights, leads, c, sqrt_first).to(self.device),
            }
        return self._metrics[key]

    def eval_step(self, stage: str, batch: Dict[str, torch.Tensor]) -> None:
        x, y, clim = batch["x"], self.fit_grid(batch["y"]), self.fit_grid(batch["clim"])
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
