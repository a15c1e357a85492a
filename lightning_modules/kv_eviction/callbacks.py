"""Each eviction method as a Lightning callback: the method's config builds a KV policy, installed on the
model for validate/test/predict and always removed (see
:class:`~lightning_modules.llm.kv_policy.callback.KVPolicyCallback`). From config::

    callbacks:
      kv:
        name: snapkv
        args: {compression_ratio: 0.75, window: 32, score: obcache_kv}
"""

from __future__ import annotations

from lightning_modules.kv_eviction.config import EvictionConfig
from lightning_modules.llm.kv_policy.callback import KVPolicyCallback

__all__ = ["EvictionCallback"]


class EvictionCallback(KVPolicyCallback):
    """A KV eviction method (any config of :data:`~lightning_modules.kv_eviction.config.EVICTION_METHODS`)
    for validate/test/predict: installs ``cfg.build()``. Logs the fraction of entries kept at each stage end."""

    def __init__(self, cfg: EvictionConfig) -> None:
        if not isinstance(cfg, EvictionConfig):
            raise TypeError(f"EvictionCallback takes an eviction method config (EVICTION_METHODS), got "
                            f"{type(cfg).__name__}")
        super().__init__(policy=cfg.build())
        self.cfg = cfg
