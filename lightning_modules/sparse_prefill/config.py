"""Typed configs of the sparse prefill methods: each config is the method.

A config is the single source of its method's defaults, validates itself in ``__post_init__`` (errors name
``<method>.<field>`` and the valid values) and builds what runs: :meth:`PrefillConfig.build` returns the
``layer -> estimator`` factory that :func:`~lightning_modules.sparse_prefill.session.install_sparse_prefill`
takes, and :meth:`PrefillConfig.estimator` one layer's estimator. Estimator constructors take the config and have
no defaults of their own.

Common fields: ``min_length`` (prefills of at most this many tokens run dense, as SALE does below 1K) and
``layers`` (layers that go sparse; None = all). Block sizes default to the papers' (128; SALE 64 x 32).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Type

from lightning_modules.base import check_field as _check, coerce_config, is_int as _is_int, is_number
from lightning_modules.sparse_prefill.estimators import (
    DenseEstimator,
    FlexPrefillEstimator,
    MeanPoolEstimator,
    OracleBlockEstimator,
    XAttentionEstimator,
)
from lightning_modules.sparse_prefill.prism import PrismEstimator
from lightning_modules.sparse_prefill.sale import SALEEstimator

__all__ = ["PrefillConfig", "SALEEstimateFields", "DensePrefillConfig", "MeanPoolConfig", "XAttentionConfig",
           "FlexPrefillConfig", "PrismConfig", "SALEConfig", "OracleBlocksConfig", "PREFILL_METHODS", "prefill_config",
           "read_tau_table"]


def _check_int(cfg: Any, name: str, low: int) -> None:
    value = getattr(cfg, name)
    _check(_is_int(value) and value >= low, cfg.method, name, value, f"must be an integer >= {low}")


def _check_mass(cfg: Any, name: str, what: str = "the top-p mass to cover") -> None:
    value = getattr(cfg, name)
    _check(is_number(value) and 0.0 < value <= 1.0, cfg.method, name, value, f"must be in (0, 1] ({what})")


@dataclass
class PrefillConfig(ABC):
    """Base of the sparse prefill methods: ``method`` is the registry name.

    Attributes:
        min_length: prefills of at most this many tokens run dense.
        layers: the layers that go sparse (None = all).
    """

    method: ClassVar[str] = "prefill"
    min_length: int = 1024
    layers: Optional[List[int]] = None

    def __post_init__(self) -> None:
        _check_int(self, "min_length", 0)
        _check(self.layers is None or (isinstance(self.layers, (list, tuple))
                                       and all(_is_int(x) and x >= 0 for x in self.layers)),
               self.method, "layers", self.layers, "must be a list of layer indices >= 0 or null (every layer)")
        self.check()

    def check(self) -> None:
        """Validate the method's own fields (errors name the field and its valid values)."""

    @abstractmethod
    def estimator(self, layer: int = 0) -> Any:
        """The estimator of layer ``layer`` (a ``select(q, k, v, scale) -> Selection`` object)."""

    def build(self) -> Callable[[int], Any]:
        """``layer -> estimator``, the factory :func:`install_sparse_prefill` takes."""
        return self.estimator


@dataclass
class DensePrefillConfig(PrefillConfig):
    """Dense prefill through the same runner (the baseline; its records give attention time)."""

    method: ClassVar[str] = "dense_prefill"

    def estimator(self, layer: int = 0) -> DenseEstimator:
        return DenseEstimator()


@dataclass
class MeanPoolConfig(PrefillConfig):
    """Mean-pooled block logits, top-p per row.

    Attributes:
        block: block size (query and key); top_p: the row mass to cover.
    """

    method: ClassVar[str] = "mean_pool_prefill"
    block: int = 128
    top_p: float = 0.9

    def check(self) -> None:
        _check_int(self, "block", 1)
        _check_mass(self, "top_p")

    def estimator(self, layer: int = 0) -> MeanPoolEstimator:
        return MeanPoolEstimator(self)


@dataclass
class OracleBlocksConfig(PrefillConfig):
    """A reference arm, not a method: the exact block attention mass (one dense pass per layer), top-p per row;
    what a perfect block estimate keeps at the same top-p.

    Attributes:
        block: block size (query and key); top_p: the row mass to cover.
    """

    method: ClassVar[str] = "oracle_blocks"
    block: int = 128
    top_p: float = 0.95

    def check(self) -> None:
        _check_int(self, "block", 1)
        _check_mass(self, "top_p")

    def estimator(self, layer: int = 0) -> OracleBlockEstimator:
        return OracleBlockEstimator(self)


@dataclass
class XAttentionConfig(PrefillConfig):
    """XAttention: strided anti-diagonal scoring.

    Attributes:
        block: block size, a multiple of ``stride``; stride: ``S`` (8 in XAttention); threshold: the cumulative
            row mass ``tau`` (0.9).
        chunk_blocks: query blocks scored per matmul (memory only: the selection does not depend on it).
    """

    method: ClassVar[str] = "xattention"
    block: int = 128
    stride: int = 8
    threshold: float = 0.9
    chunk_blocks: int = 16

    def check(self) -> None:
        _check_int(self, "stride", 1)
        _check(_is_int(self.block) and self.block >= 1 and self.block % self.stride == 0, self.method, "block",
               self.block, f"must be a multiple of stride ({self.stride})")
        _check_mass(self, "threshold")
        _check_int(self, "chunk_blocks", 1)

    def estimator(self, layer: int = 0) -> XAttentionEstimator:
        return XAttentionEstimator(self)


@dataclass
class FlexPrefillConfig(PrefillConfig):
    """FlexPrefill: last-query estimates, query-aware or vertical-slash per head.

    Attributes:
        block: block size; gamma: the mass each pattern covers (0.9); tau: the Jensen-Shannon threshold below
            which a head is query-aware (0.1); last_q: queries of the exact slice (FlexPrefill: one block of 128).
    """

    method: ClassVar[str] = "flexprefill"
    block: int = 128
    gamma: float = 0.9
    tau: float = 0.1
    last_q: int = 128

    def check(self) -> None:
        _check_int(self, "block", 1)
        _check_mass(self, "gamma")
        _check(isinstance(self.tau, (int, float)) and self.tau >= 0, self.method, "tau", self.tau, "must be >= 0")
        _check_int(self, "last_q", 1)

    def estimator(self, layer: int = 0) -> FlexPrefillEstimator:
        return FlexPrefillEstimator(self)


@dataclass
class PrismConfig(PrefillConfig):
    """Prism: dual-band pooled estimate with energy calibration.

    Attributes:
        block: block size (Prism: 128); top_p: the row mass each band covers (0.95).
        high_fraction, low_fraction: shares of the RoPE pairs in the high band (0.5) and the low band (0.75).
        calibrate: energy-based band temperatures (False: both 1).
    """

    method: ClassVar[str] = "prism"
    block: int = 128
    top_p: float = 0.95
    high_fraction: float = 0.5
    low_fraction: float = 0.75
    calibrate: bool = True

    def check(self) -> None:
        _check_int(self, "block", 1)
        _check_mass(self, "top_p")
        for name in ("high_fraction", "low_fraction"):
            _check_mass(self, name, "the share of the RoPE pairs in the band")

    def estimator(self, layer: int = 0) -> PrismEstimator:
        return PrismEstimator(self)


@dataclass
class SALEEstimateFields:
    """SALE's estimate: ``bits`` / ``group_size`` of the quantisation (int4, per token), the ``block_q x block_k``
    tiles (64 x 32) and the exact pass's ``sink`` and ``local`` tokens (32 and 128). Shared by the ``sale`` method
    and the ``sale_calibration`` callback."""

    method: ClassVar[str] = "sale"
    bits: int = 4
    group_size: int = 1
    block_q: int = 64
    block_k: int = 32
    sink: int = 32
    local: int = 128

    def check_estimate(self) -> None:
        _check(_is_int(self.bits) and 2 <= self.bits <= 8, self.method, "bits", self.bits,
               "must be an integer in 2..8")
        for name, low in (("group_size", 1), ("block_q", 1), ("block_k", 1), ("sink", 0), ("local", 0)):
            _check_int(self, name, low)

    def sale_estimator(self, tau: Any) -> SALEEstimator:
        """A :class:`SALEEstimator` with these fields and threshold(s) ``tau``."""
        return SALEEstimator(self, tau)


@dataclass
class SALEConfig(SALEEstimateFields, PrefillConfig):
    """SALE: low-bit estimate, Relative Attention Score threshold per head (estimate fields:
    :class:`SALEEstimateFields`).

    Attributes:
        tau: one threshold for every head, used when ``tau_table`` is None (SALE's README: 0.004).
        tau_table: a JSON file written by the ``sale_calibration`` callback (thresholds per layer and head).
    """

    method: ClassVar[str] = "sale"
    tau: float = 0.004
    tau_table: Optional[str] = None

    def check(self) -> None:
        # the parsed table: a plain attribute, not a field (asdict / the run records keep the path only)
        self._table: Optional[List[List[float]]] = None
        self.check_estimate()
        _check(isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau >= 0, self.method,
               "tau", self.tau, "must be a finite threshold >= 0 (0 runs every head dense)")
        if self.tau_table is not None:
            if not Path(self.tau_table).expanduser().is_file():
                raise ValueError(f"sale.tau_table={self.tau_table!r}: no such file (write one with the "
                                 f"sale_calibration callback, or set tau)")
            self._table = read_tau_table(self.tau_table)  # parsed once, here

    def estimator(self, layer: int = 0) -> SALEEstimator:
        table = self._table
        if table is None:
            return self.sale_estimator(self.tau)
        if layer >= len(table):
            raise ValueError(f"sale.tau_table={self.tau_table!r} has {len(table)} layers; layer {layer} has "
                             f"no thresholds")
        return self.sale_estimator(table[layer])


def read_tau_table(path: str) -> List[List[float]]:
    """Thresholds ``[layer][head]`` from a ``sale_calibration`` JSON file."""
    data = json.loads(Path(path).expanduser().read_text())
    table = data.get("tau") if isinstance(data, dict) else None
    if not isinstance(table, list) or not all(isinstance(row, list) for row in table):
        raise ValueError(f"{path}: expected a JSON object with 'tau': [[threshold per head] per layer]")
    return table


PREFILL_METHODS: Dict[str, Type[PrefillConfig]] = {
    cls.method: cls
    for cls in (DensePrefillConfig, MeanPoolConfig, XAttentionConfig, FlexPrefillConfig, PrismConfig, SALEConfig,
                OracleBlocksConfig)
}
"""Method name -> config class (``PREFILL_METHODS[name](**args).build()`` is the ``layer -> estimator`` factory)."""


def prefill_config(name: str, args: Optional[Mapping[str, Any]] = None) -> PrefillConfig:
    """The config of method ``name`` from a dict of its fields (unknown fields are named in the error)."""
    if name not in PREFILL_METHODS:
        raise ValueError(f"unknown sparse prefill method {name!r}; known: {', '.join(PREFILL_METHODS)}")
    return coerce_config(dict(args or {}), PREFILL_METHODS[name])
