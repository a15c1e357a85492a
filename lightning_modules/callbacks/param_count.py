"""``ParameterCount``: the method's parameter count once the trainer's setup has built every part."""

from __future__ import annotations

from typing import Callable, Optional

import lightning.pytorch as pl

from lightning_modules.base import count_parameters

__all__ = ["ParameterCount"]


class ParameterCount(pl.Callback):
    """Report the parameter count after setup when it differs from ``counted`` (the run header's, taken when the
    module was constructed): methods that build layers in ``setup`` (MEG-XL's word head needs the data's
    vocabulary) would otherwise show a count that is off by orders of magnitude. Reports once, on global rank
    zero, at the first stage start (``on_fit_start`` runs after ``setup`` and ``configure_optimizers``)."""

    def __init__(self, counted: int, printer: Optional[Callable[[str], None]] = None) -> None:
        self.counted = int(counted)
        self.after_setup: Optional[int] = None
        self._print = printer or (lambda line: print(line, flush=True))

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.after_setup is not None:
            return
        self.after_setup = count_parameters(pl_module)
        if self.after_setup != self.counted and trainer.is_global_zero:
            self._print(f"[litctx] method parameters after setup: {self.after_setup:,} (the header's "
                        f"{self.counted:,} was counted before setup built the rest)")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module)
