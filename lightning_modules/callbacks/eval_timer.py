"""``EvalTimer``: wall-clock cost of evaluation, per batch, logged next to the stage's metrics.

An inference-side callback in the shape every inference method's callback takes: it acts only in
validate/test/predict, keeps its state on itself (nothing is registered on the model), and clears it at every
stage start, so attaching it to any run changes no result, only adds ``<stage>/seconds_per_batch`` (logged for
validate/test; for predict it is kept in :attr:`summary`, as Lightning does not log during predict).

Each batch is timed by :class:`litctx_common.timing.Stopwatch` on the module's device: on CUDA the device is
synchronised at the batch start and end, so the time is the batch's work, not its kernel launches.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import lightning.pytorch as pl

from litctx_common.timing import Stopwatch

__all__ = ["EvalTimer"]


class EvalTimer(pl.Callback):
    """Time each evaluation batch; ``warmup`` first batches per stage are left out of the mean."""

    def __init__(self, warmup: int = 1) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.warmup = warmup
        self.summary: Dict[str, float] = {}
        self._times: List[float] = []
        self._watch: Optional[Stopwatch] = None

    def _begin(self) -> None:
        self._times = []
        self._watch = None

    def _batch_start(self, pl_module: pl.LightningModule) -> None:
        self._watch = Stopwatch(pl_module.device).start()

    def _batch_end(self) -> None:
        if self._watch is None:  # a batch end without its start (nothing to time)
            return
        self._times.append(self._watch.stop())
        self._watch = None

    def _finish(self, stage: str, pl_module: pl.LightningModule, log: bool) -> None:
        kept = self._times[self.warmup:] or self._times
        if not kept:
            return
        mean = sum(kept) / len(kept)
        self.summary = {f"{stage}/seconds_per_batch": mean, f"{stage}/batches_timed": float(len(kept))}
        if log:
            pl_module.log(f"{stage}/seconds_per_batch", mean, sync_dist=True)

    # validate (also the validation loops inside fit; the sanity check is not timed)
    def on_validation_epoch_start(self, trainer, pl_module):
        self._begin()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._batch_end()

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._finish("val", pl_module, log=True)

    # test
    def on_test_epoch_start(self, trainer, pl_module):
        self._begin()

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(pl_module)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._batch_end()

    def on_test_epoch_end(self, trainer, pl_module):
        self._finish("test", pl_module, log=True)

    # predict
    def on_predict_epoch_start(self, trainer, pl_module):
        self._begin()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(pl_module)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._batch_end()

    def on_predict_epoch_end(self, trainer, pl_module):
        self._finish("predict", pl_module, log=False)
