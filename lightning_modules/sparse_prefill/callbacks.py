"""Sparse prefill as Lightning callbacks.

:class:`SparsePrefillCallback` switches the model's long prefills to a method's estimator for
validate/test/predict and always switches back; it logs the mean density (``<stage>/prefill_density``, and per
layer) and the estimator and attention seconds, prints a per-layer table, and writes
``sparse_prefill_<stage>.json`` into the run directory. :class:`SALECalibrationCallback` is SALE's calibration
as its own step: run it with validate or predict on calibration prompts; it writes the per-(layer, head)
threshold table that ``sale``'s ``tau_table`` reads::

    python -m recipes.evaluate --recipe longctx_smollm2 --stage validate \\
        'callbacks.cal={name: sale_calibration, args: {theta: 0.4, output: sale_tau.json}}'
    python -m recipes.evaluate --recipe longctx_smollm2 \\
        'callbacks.sp={name: sale, args: {tau_table: runs/longctx_smollm2/<run>/sale_tau.json}}'
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Optional

import torch

from lightning_modules.base import check_field, is_int, is_number, run_path
from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.llm.kv_policy.callback import target_model
from lightning_modules.llm.runtime.stack import attach_runners
from lightning_modules.sparse_prefill.config import PrefillConfig, SALEEstimateFields
from lightning_modules.sparse_prefill.sale import calibrate_thresholds
from lightning_modules.sparse_prefill.session import _unpadded, install_sparse_prefill
from litctx_common.io import atomic_open

__all__ = ["SparsePrefillCallback", "SALECalibrationConfig", "SALECalibrationCallback"]


class SparsePrefillCallback(EvalStageSwitch):
    """A sparse prefill method (any config of :data:`~lightning_modules.sparse_prefill.config.PREFILL_METHODS`)
    for validate/test/predict (see the module docstring): installs ``cfg.build()`` on ``cfg.layers`` for
    prefills longer than ``cfg.min_length``."""

    def __init__(self, cfg: PrefillConfig) -> None:
        super().__init__()
        if not isinstance(cfg, PrefillConfig):
            raise TypeError(f"SparsePrefillCallback takes a sparse prefill method config (PREFILL_METHODS), got "
                            f"{type(cfg).__name__}")
        self.cfg = cfg
        self.factory = cfg.build()
        self.session = None

    def _enter(self, trainer, pl_module, stage):
        self.session = self._stack.enter_context(install_sparse_prefill(
            target_model(pl_module), self.factory, min_length=self.cfg.min_length, layers=self.cfg.layers))

    def _log(self, pl_module, stage: str) -> None:
        summary = self.session.summary() if self.session is not None else {"calls": 0}
        if not summary["calls"]:
            return
        pl_module.log(f"{stage}/prefill_density", summary["density"], rank_zero_only=True)
        pl_module.log(f"{stage}/prefill_estimate_s", summary["estimate_seconds"], rank_zero_only=True)
        pl_module.log(f"{stage}/prefill_attention_s", summary["attention_seconds"], rank_zero_only=True)
        for layer, dens in summary["density_by_layer"].items():
            pl_module.log(f"{stage}/prefill_density_layer{layer}", dens, rank_zero_only=True)

    def on_validation_epoch_end(self, trainer, pl_module):
        self._log(pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module):
        self._log(pl_module, "test")

    def _report(self, trainer, pl_module, stage):
        if self.session is None:
            return
        summary = self.session.summary()
        if not summary["calls"]:
            print(f"[litctx] sparse prefill {type(self.cfg).__name__}: no prefill longer than "
                  f"{self.cfg.min_length} tokens ran sparse ({stage})", flush=True)
            return
        lines = [f"[litctx] sparse prefill {type(self.cfg).__name__} ({stage}): {summary['calls']} layer calls, "
                 f"density {100 * summary['density']:.1f}%, estimator {summary['estimate_seconds']:.2f} s, "
                 f"attention {summary['attention_seconds']:.2f} s",
                 "  layer  density  estimator s"]
        est = summary["estimate_seconds_by_layer"]
        lines += [f"  {layer:5d}  {100 * d:6.1f}%  {est[layer]:11.3f}" for layer, d in summary["density_by_layer"].items()]
        print("\n".join(lines), flush=True)
        if trainer.is_global_zero:
            path = run_path(trainer, f"sparse_prefill_{stage}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(path, "w") as f:
                json.dump({"method": type(self.cfg).__name__, "config": asdict(self.cfg), "summary": summary,
                           "records": self.session.records}, f, indent=1, default=str)


@dataclass
class SALECalibrationConfig(SALEEstimateFields):
    """Attributes (and SALE's estimate fields, :class:`~lightning_modules.sparse_prefill.config.SALEEstimateFields`):
        theta: error budget: a head's threshold is accepted when ``sum_{i,d} |O - O~| < theta * N``
            (SALE: 0.4 for Llama-3.1-8B).
        output: the threshold table (JSON); a relative path lands in the run directory.
        tau0, tau_min: first threshold (halved each step) and the floor below which a head runs dense.
        min_length: prompts of at most this many tokens are not used.
    """

    method: ClassVar[str] = "sale_calibration"
    theta: float = 0.4
    output: str = "sale_tau.json"
    tau0: float = 0.008
    tau_min: float = 1e-4
    min_length: int = 1024

    def __post_init__(self) -> None:
        m = self.method
        for name in ("theta", "tau0"):
            value = getattr(self, name)
            check_field(is_number(value) and value > 0, m, name, value, "must be > 0")
        check_field(is_number(self.tau_min) and 0 <= self.tau_min < self.tau0, m, "tau_min", self.tau_min,
                    f"must be in [0, tau0={self.tau0})")
        check_field(is_int(self.min_length) and self.min_length >= 0, m, "min_length", self.min_length,
                    "must be an integer >= 0")
        self.check_estimate()


class _CalibrationRunner:
    """Exact attention (the model's outputs do not change) + the threshold search on every long prefill."""

    def __init__(self, layer: int, owner: "SALECalibrationCallback") -> None:
        self.layer, self.owner = layer, owner

    def attend(self, module, query, key, value, attention_mask, scale, window=None):
        from lightning_modules.llm.model.attention import causal_attention

        n_q, n_k = query.shape[2], key.shape[2]
        if n_q == n_k and n_q > self.owner.cfg.min_length and _unpadded(attention_mask, n_q, window):
            if window is None or n_q <= window:
                self.owner.observe(self.layer, query, key, value, scale)
            else:  # a sliding-window layer beyond its window stays exact under ``sale``: record it dense
                self.owner.record(self.layer, torch.zeros(query.shape[1], dtype=torch.float64))
        return causal_attention(query, key, value, attention_mask, scale, window=window)


class SALECalibrationCallback(EvalStageSwitch):
    """SALE's per-(layer, head) threshold calibration as a validate/predict step (see the module docstring).
    Across prompts a head keeps the smallest threshold any prompt needed (the conservative choice)."""

    def __init__(self, cfg: Optional[SALECalibrationConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else SALECalibrationConfig(**kwargs)
        self.estimator = self.cfg.sale_estimator(self.cfg.tau0)  # the search passes its own thresholds
        self.table: Dict[int, torch.Tensor] = {}
        self.prompts = 0

    def observe(self, layer: int, q, k, v, scale) -> None:
        self.record(layer, calibrate_thresholds(q, k, v, scale, self.cfg.theta, self.estimator, self.cfg.tau0,
                                                self.cfg.tau_min))

    def record(self, layer: int, tau: torch.Tensor) -> None:
        """Layer ``layer``'s thresholds ``[Hq]`` from one prompt (0 = dense; a head keeps its smallest)."""
        self.table[layer] = tau if layer not in self.table else torch.minimum(self.table[layer], tau)
        if layer == min(self.table):
            self.prompts += 1

    def _enter(self, trainer, pl_module, stage):
        self.table, self.prompts = {}, 0
        self._stack.enter_context(attach_runners(target_model(pl_module), lambda m: _CalibrationRunner(m.layer_idx, self),
                                                 "SALE calibration"))

    def output_path(self, trainer) -> Path:
        return run_path(trainer, self.cfg.output)

    def _report(self, trainer, pl_module, stage):
        if not self.table:
            print(f"[litctx] sale_calibration: no prompt longer than {self.cfg.min_length} tokens; no table written",
                  flush=True)
            return
        layers = sorted(self.table)
        if layers != list(range(len(layers))):
            raise RuntimeError(f"sale_calibration saw layers {layers}; expected every layer from 0")
        rows = [[float(t) for t in self.table[layer]] for layer in layers]
        dense = sum(t == 0.0 for row in rows for t in row)
        path = self.output_path(trainer)
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(path, "w") as f:
                json.dump({"theta": self.cfg.theta, "prompts": self.prompts, "config": asdict(self.cfg),
                           "tau": rows}, f, indent=1)
        print(f"[litctx] sale_calibration: thresholds for {len(rows)} layers x {len(rows[0])} heads from "
              f"{self.prompts} prompts ({dense} heads dense) -> {path}", flush=True)


