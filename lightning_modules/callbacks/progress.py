"""``LogLines``: progress as one line every N steps, for SLURM logs, CI and pipes where a bar floods output.

Example line::

    [litctx] step 120/2000 (6%) epoch 1 | train/loss 1.2345 | lr 3.0e-04 | 12.3 it/s | eta 2m31s
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Dict, Optional, TextIO

import lightning.pytorch as pl
import torch

__all__ = ["LogLines", "format_duration"]


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _scalar(value: Any) -> Optional[float]:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


class LogLines(pl.Callback):
    """Print training progress and validation/test metrics as plain lines on global rank 0.

    Args:
        every_n_steps: print a training line every this many optimizer steps (and at the last step).
        stream: where to print (default ``sys.stdout``).
    """

    def __init__(self, every_n_steps: int = 50, stream: Optional[TextIO] = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.stream = stream
        self._t0 = 0.0
        self._step0 = 0

    def _print(self, trainer: pl.Trainer, text: str) -> None:
        if trainer.is_global_zero:
            print(f"[litctx] {text}", file=self.stream or sys.stdout, flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.monotonic()
        self._step0 = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # modules that take several optimizer steps per batch (manual rollouts) say how many
        total = trainer.estimated_stepping_batches * getattr(pl_module, "optimizer_steps_per_batch", 1)
        last = math.isfinite(total) and step >= total
        if step == 0 or (step % self.every_n_steps and not last):
            return
        elapsed = time.monotonic() - self._t0
        rate = (step - self._step0) / elapsed if elapsed > 0 else float("nan")
        parts = [f"step {step}" + (f"/{int(total)} ({100 * step / total:.0f}%)" if math.isfinite(total) else "")]
        parts[0] += f" epoch {trainer.current_epoch}"
        loss = _scalar(outputs.get("loss")) if isinstance(outputs, dict) else _scalar(outputs)
        if loss is None:  # manual optimization returns nothing; its logged loss stands in
            loss = _scalar(trainer.callback_metrics.get("train/loss"))
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        for key, value in trainer.callback_metrics.items():
            if key.startswith("train/") and key != "train/loss":
                v = _scalar(value)
                if v is not None:
                    parts.append(f"{key} {v:.4g}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        if math.isfinite(rate):
            parts.append(f"{rate:.1f} it/s")
            if math.isfinite(total) and rate > 0:
                parts.append(f"eta {format_duration((total - step) / rate)}")
        self._print(trainer, " | ".join(parts))

    def _metrics_line(self, trainer: pl.Trainer, prefix: str) -> None:
        shown: Dict[str, float] = {}
        for key, value in trainer.callback_metrics.items():
            if key.startswith(prefix) and key.count("/") == 1:  # skip breakdowns such as val/kl_by_pos/...
                v = _scalar(value)
                if v is not None:
                    shown[key] = v
        if shown:
            self._print(trainer, f"step {trainer.global_step} " + " | ".join(f"{k} {v:.4g}" for k, v in sorted(shown.items())))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._metrics_line(trainer, "val/")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._metrics_line(trainer, "test/")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = time.monotonic() - self._t0
        self._print(trainer, f"training finished at step {trainer.global_step} in {format_duration(elapsed)}")
