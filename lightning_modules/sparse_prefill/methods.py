"""Typed configs of the sparse prefill methods; each builds the estimator of a layer.

Common fields: ``min_length`` (prefills of at most this many tokens run dense, as SALE does below 1K) and
``layers`` (layers that go sparse; None = all). Block sizes default to the papers' (128; SALE 64 x 32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from lightning_modules.base import coerce_config
from lightning_modules.sparse_prefill.estimators import (
    DenseEstimator,
    FlexPrefillEstimator,
    MeanPoolEstimator,
    XAttentionEstimator,
)
from lightning_modules.sparse_prefill.prism import PrismEstimator
from lightning_modules.sparse_prefill.sale import SALEEstimator

__all__ = ["SALEEstimateFields", "DensePrefillConfig", "MeanPoolConfig", "XAttentionConfig", "FlexPrefillConfig", "PrismConfig",
           "SALEConfig", "PREFILL_METHODS", "estimator_factory", "prefill_config", "read_tau_table"]


class _Validated:
    def __post_init__(self) -> None:
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        estimator_factory(self)(0)  # builds (and so validates) an estimator


@dataclass
class DensePrefillConfig(_Validated):
    """Dense prefill through the same runner (the baseline; its records give attention time)."""

    min_length: int = 1024
    layers: Optional[List[int]] = None


@dataclass
class MeanPoolConfig(_Validated):
    """Mean-pooled block logits, top-p per row (``block``, ``top_p``)."""

    block: int = 128
    top_p: float = 0.9
    min_length: int = 1024
    layers: Optional[List[int]] = None


@dataclass
class XAttentionConfig(_Validated):
    """XAttention: strided anti-diagonal scoring (``block``, ``stride`` 8, ``threshold`` 0.9)."""

    block: int = 128
    stride: int = 8
    threshold: float = 0.9
    min_length: int = 1024
    layers: Optional[List[int]] = None


@dataclass
class FlexPrefillConfig(_Validated):
    """FlexPrefill: last-query estimates, query-aware or vertical-slash per head (``gamma`` 0.9, ``tau`` 0.1)."""

    block: int = 128
    gamma: float = 0.9
    tau: float = 0.1
    last_q: int = 128
    min_length: int = 1024
    layers: Optional[List[int]] = None


@dataclass
class PrismConfig(_Validated):
    """Prism: dual-band pooled estimate with energy calibration (``top_p`` 0.95, bands 0.5 / 0.75 of the pairs)."""

    block: int = 128
    top_p: float = 0.95
    high_fraction: float = 0.5
    low_fraction: float = 0.75
    calibrate: bool = True
    min_length: int = 1024
    layers: Optional[List[int]] = None


@dataclass
class SALEEstimateFields:
    """SALE's estimate: ``bits`` / ``group_size`` of the quantisation (int4, per token), the ``block_q x block_k``
    tiles (64 x 32) and the exact pass's ``sink`` and ``local`` tokens (32 and 128)."""

    bits: int = 4
    group_size: int = 1
    block_q: int = 64
    block_k: int = 32
    sink: int = 32
    local: int = 128

    def sale_estimator(self, tau: Any = 0.004) -> SALEEstimator:
        return SALEEstimator(tau=tau, bits=self.bits, group_size=self.group_size, block_q=self.block_q,
                             block_k=self.block_k, sink=self.sink, local=self.local)


@dataclass
class SALEConfig(SALEEstimateFields, _Validated):
    """SALE: low-bit estimate, Relative Attention Score threshold per head (estimate fields:
    :class:`SALEEstimateFields`).

    Attributes:
        tau: one threshold for every head, used when ``tau_table`` is None (SALE's README: 0.004).
        tau_table: a JSON file written by the ``sale_calibration`` callback (thresholds per layer and head).
    """

    tau: float = 0.004
    tau_table: Optional[str] = None
    min_length: int = 1024
    layers: Optional[List[int]] = None

    def __post_init__(self) -> None:
        if self.tau_table is not None and not Path(self.tau_table).expanduser().is_file():
            raise ValueError(f"tau_table={self.tau_table!r}: no such file (write one with the sale_calibration "
                             f"callback, or set tau)")
        super().__post_init__()


def read_tau_table(path: str) -> List[List[float]]:
    """Thresholds ``[layer][head]`` from a ``sale_calibration`` JSON file."""
    data = json.loads(Path(path).expanduser().read_text())
    table = data.get("tau") if isinstance(data, dict) else None
    if not isinstance(table, list) or not all(isinstance(row, list) for row in table):
        raise ValueError(f"{path}: expected a JSON object with 'tau': [[threshold per head] per layer]")
    return table


def _sale(cfg: SALEConfig) -> Callable[[int], Any]:
    table = read_tau_table(cfg.tau_table) if cfg.tau_table is not None else None

    def make(layer: int) -> SALEEstimator:
        if table is not None and layer >= len(table):
            raise ValueError(f"tau_table {cfg.tau_table} has {len(table)} layers; layer {layer} has no thresholds")
        return cfg.sale_estimator(table[layer] if table is not None else cfg.tau)
    return make


PREFILL_METHODS: Dict[str, Tuple[Type[Any], Callable[[Any], Callable[[int], Any]]]] = {
    "dense_prefill": (DensePrefillConfig, lambda c: lambda layer: DenseEstimator()),
    "mean_pool_prefill": (MeanPoolConfig, lambda c: lambda layer: MeanPoolEstimator(c.block, c.top_p)),
    "xattention": (XAttentionConfig, lambda c: lambda layer: XAttentionEstimator(c.block, c.stride, c.threshold)),
    "flexprefill": (FlexPrefillConfig, lambda c: lambda layer: FlexPrefillEstimator(c.block, c.gamma, c.tau, c.last_q)),
    "prism": (PrismConfig, lambda c: lambda layer: PrismEstimator(c.block, c.top_p, c.high_fraction, c.low_fraction,
                                                                  c.calibrate)),
    "sale": (SALEConfig, _sale),
}
"""Method name -> (config class, ``config -> (layer -> estimator)``)."""


def estimator_factory(cfg: Any) -> Callable[[int], Any]:
    """``layer -> estimator`` for a method config."""
    for cls, build in PREFILL_METHODS.values():
        if type(cfg) is cls:
            return build(cfg)
    raise TypeError(f"{type(cfg).__name__} is not a sparse prefill config")


def prefill_config(name: str, args: Optional[Dict[str, Any]] = None) -> Any:
    """The config of method ``name`` from a dict of its fields (unknown fields are named in the error)."""
    if name not in PREFILL_METHODS:
        raise ValueError(f"unknown sparse prefill method {name!r}; known: {', '.join(PREFILL_METHODS)}")
    return coerce_config(dict(args or {}), PREFILL_METHODS[name][0])
