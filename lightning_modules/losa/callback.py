"""LoSA and its baselines at evaluation, as Lightning callbacks on a block-diffusion LM (``losa``, ``block_quest``,
``block_fixed``, ``block_dense``): the arm's runners are installed on the module's model for validate / test /
predict, the step hook joins the module's sampler hooks, and every evaluation batch logs the arm's union density
(``{stage}/density``, all denoising steps; ``{stage}/density_later``, the steps after the first), the K/V bytes
read per denoising step (``{stage}/kv_bytes_per_step`` and its dense counterpart) and the active share. From
config::

    callbacks:
      sparse: {name: losa, args: {active: 5, budget: 64}}
"""

from __future__ import annotations

from typing import Any

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.losa.config import BLOCK_SPARSE_METHODS
from lightning_modules.losa.method import install_block_sparse

__all__ = ["BlockSparseCallback"]


class BlockSparseCallback(EvalStageSwitch):
    """Install ``cfg`` (one of :data:`BLOCK_SPARSE_METHODS`' configs) for evaluation stages."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if getattr(cfg, "method", None) not in BLOCK_SPARSE_METHODS:
            raise TypeError(f"BlockSparseCallback takes one of {sorted(BLOCK_SPARSE_METHODS)} configs, got "
                            f"{type(cfg).__name__}")
        self.cfg = cfg
        self.session = None

    def _enter(self, trainer, pl_module, stage):
        hooks = getattr(pl_module, "sampler_hooks", None)
        if hooks is None:
            raise TypeError(f"{self.cfg.method} runs on a block-diffusion LM's sampler (the bdlm method); "
                            f"{type(pl_module).__name__} has none")
        self.session, hook = self._stack.enter_context(install_block_sparse(pl_module.model, self.cfg))
        hooks.append(hook)
        self._stack.callback(lambda: hooks.remove(hook) if hook in hooks else None)

    def _log(self, pl_module, stage: str, batch, dataloader_idx: int) -> None:
        if self.session is None or not self.session.records:
            return
        summary = self.session.summary()
        self.session.records.clear()
        lengths = batch.get("length") if isinstance(batch, dict) else None
        suffix = "" if not dataloader_idx or not lengths else f"_len{int(lengths[0])}"  # as the module's metrics
        rows = int(batch["input_ids"].shape[0]) if isinstance(batch, dict) and "input_ids" in batch else 1
        kw = dict(on_step=False, on_epoch=True, add_dataloader_idx=False, batch_size=rows)
        values = {"density": summary["density"], "density_later": summary["density_later"],
                  "kv_bytes_per_step": summary["bytes_per_step"],
                  "dense_kv_bytes_per_step": summary["dense_bytes_per_step"]}
        shares = list(summary["active_share_by_layer"].values())
        if shares:
            values["active_share"] = sum(shares) / len(shares)
        for name, value in values.items():
            if value is not None:
                pl_module.log(f"{stage}/{name}{suffix}", float(value), **kw)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, "val", batch, dataloader_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, "test", batch, dataloader_idx)
