"""IndexMem at evaluation, as a Lightning callback (``indexmem``): the config's policy (the trained indexer and
latent memory of ``weights``) installed on the model for validate/test/predict and always removed. From config::

    callbacks:
      kv:
        name: indexmem
        args: {weights: runs/indexmem_smollm2/<run>/indexmem, compression_ratio: 0.8}
"""

from __future__ import annotations

from lightning_modules.indexmem.config import IndexMemConfig
from lightning_modules.llm.kv_policy.callback import KVPolicyCallback, target_model

__all__ = ["IndexMemCallback"]


class IndexMemCallback(KVPolicyCallback):
    """Install :meth:`IndexMemConfig.build` (the bank is loaded once, at construction, and checked against the
    model when the stage starts)."""

    def __init__(self, cfg: IndexMemConfig) -> None:
        if not isinstance(cfg, IndexMemConfig):
            raise TypeError(f"IndexMemCallback takes an IndexMemConfig, got {type(cfg).__name__}")
        from lightning_modules.indexmem.bank import IndexMemBank

        if cfg.weights is None:
            raise ValueError("indexmem.weights: the folder of a trained IndexMem bank is required (train one with "
                             "python -m recipes.fit --recipe indexmem_smollm2; it writes <run dir>/indexmem)")
        self.bank = IndexMemBank.load(cfg.weights)
        super().__init__(policy=cfg.build(self.bank))
        self.cfg = cfg

    def _enter(self, trainer, pl_module, stage):
        self.bank.check_model(target_model(pl_module))
        self.bank.to(next(target_model(pl_module).parameters()).device)
        super()._enter(trainer, pl_module, stage)
