"""``CheckpointMetadata``: stamp every checkpoint with where it came from."""

from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl

__all__ = ["CheckpointMetadata"]


class CheckpointMetadata(pl.Callback):
    """Store ``payload`` (plain containers only: the resolved config, git revision, versions) under
    ``checkpoint[key]``, so a checkpoint alone says how it was made and still loads with ``weights_only=True``."""

    def __init__(self, payload: Dict[str, Any], key: str = "litctx") -> None:
        self.payload = payload
        self.key = key

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Dict[str, Any]) -> None:
        checkpoint[self.key] = self.payload
