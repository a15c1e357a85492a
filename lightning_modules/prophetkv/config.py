"""The KV-reuse methods of the ProphetKV paper, each with its own typed config: ``prophetkv`` (the paper's
method), and its baselines ``cacheblend`` and ``epic``.

Each config is the selector's own config (:mod:`lightning_modules.prophetkv.selectors`, where every knob's
default is stated once) plus the shared :class:`~lightning_modules.prophetkv.reuse.ReuseSettings` (``ratio``, the
store), so ``callbacks.reuse={name: prophetkv, args: {ratio: 0.2, layer_fusion: mean}}`` records every knob of the
method in ``config.yaml``. :meth:`ReuseMethod.build` makes the same :class:`~lightning_modules.prophetkv.reuse.
ReusePrefill` as the generic ``kv_reuse`` callback with ``selector: <name>``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from lightning_modules.prophetkv.reuse import ReuseConfig, ReusePrefill, ReuseSettings
from lightning_modules.prophetkv.selectors import CacheBlendConfig, EPICConfig, ProphetKVConfig

__all__ = ["ReuseMethod", "ProphetKVReuseConfig", "CacheBlendReuseConfig", "EPICReuseConfig"]


class ReuseMethod(ReuseSettings):
    """Mixin of the per-method configs: the selector's fields (its config class, the second base) and the shared
    settings, turned into the generic :class:`ReuseConfig`."""

    method: str  # the selector's name (a ClassVar of its config class)

    def __post_init__(self) -> None:
        super().__post_init__()  # the selector config's own checks
        self.check_settings(self.method)

    def reuse_config(self) -> ReuseConfig:
        """The equivalent ``kv_reuse`` config (``selector`` = this method, its fields as ``selector_args``)."""
        settings = {f.name for f in fields(ReuseSettings)}
        selector_args = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in settings}
        return ReuseConfig(selector=self.method, selector_args=selector_args, ratio=self.ratio,
                           store_dir=self.store_dir, store_max_bytes=self.store_max_bytes)

    @property
    def name(self) -> str:
        return self.reuse_config().name

    def build(self, model: Any, store: Optional[Any] = None) -> ReusePrefill:
        return self.reuse_config().build(model, store)


@dataclass
class ProphetKVReuseConfig(ReuseMethod, ProphetKVConfig):
    """ProphetKV: the question's attention over the stale cache (stage I, fused over layers) picks the ``ratio``
    share of chunk tokens to recompute (stage II). Attributes: ``ratio``, ``store_dir``, ``store_max_bytes``
    (:class:`ReuseSettings`), ``layer_fusion`` and ``query_span`` (:class:`ProphetKVConfig`)."""


@dataclass
class CacheBlendReuseConfig(ReuseMethod, CacheBlendConfig):
    """CacheBlend (baseline): the tokens whose values deviate most at ``check_layer``, filtered gradually.
    Attributes: ``ratio``, the store, ``check_layer``, ``filter_layers``, ``start_factor``."""


@dataclass
class EPICReuseConfig(ReuseMethod, EPICConfig):
    """EPIC (baseline): each chunk's initial tokens. Attributes: ``ratio``, the store, ``tokens_per_chunk``."""
