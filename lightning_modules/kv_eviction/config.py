"""The eviction methods as typed configs: each config is the method. It is the single source of the method's
defaults, validates itself in ``__post_init__`` (errors name ``<method>.<field>`` and the valid values) and
``build()`` returns the :class:`~lightning_modules.llm.kv_policy.protocol.KVPolicy` that runs, wired from exactly its
fields (``tests/methods/kv_eviction/test_kv_eviction.py`` checks every field of every registered method).

Each config names what its paper varies; every scored method takes ``score`` (``attention`` or an OBCache
score, :data:`~lightning_modules.kv_eviction.scores.SCORE_KINDS`), which is how OBCache replaces the attention
score of its base. Budgets are per KV head: ``compression_ratio`` (kvpress convention: the fraction removed,
resolved against the prompt and then held fixed) or an absolute ``keep`` (takes precedence); sinks, windows
and recent tokens count inside the budget.

========================  =======================================================  ==========================
method                    scorer / selector                                        acts
========================  =======================================================  ==========================
``streaming_llm``         recent entries + ``sink`` first tokens                   prefill, every decode step
``h2o``                   accumulated score of every query (heavy) + recent split  prefill, every decode step
``snapkv``                last ``window`` queries, 1-D pooled; window protected    prefill
``tova``                  last query, averaged over heads, one set per layer       prefill, every decode step
``adakv``                 any base above with AdaKV's head-adaptive selection      as the base
``obcache``               a base with an OBCache score (``kind`` v / k / kv)        as the base
``random_eviction``       uniform random scores (control)                          prefill
``recent_eviction``       the most recent entries only (control)                   prefill
========================  =======================================================  ==========================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, Mapping, Optional, Sequence, Tuple, Type

from lightning_modules.base import check_field as _check, coerce_config, is_int as _is_int, is_number
from lightning_modules.kv_eviction.scores import GQA_REDUCTIONS, SCORE_KINDS
from lightning_modules.kv_eviction.scorers import POOLS, AccumulatedScorer, WindowScorer
from lightning_modules.kv_eviction.selectors import AdaKVSelector
from lightning_modules.llm.kv_policy.protocol import (
    COMPACTIONS,
    Budget,
    KVPolicy,
    RandomScorer,
    RecentScorer,
    Schedule,
    SharedTopKSelector,
    TopKSelector,
)
from litctx_common.plugins import plugin_args

__all__ = [
    "EvictionConfig",
    "StreamingLLMConfig",
    "H2OConfig",
    "SnapKVConfig",
    "TOVAConfig",
    "AdaKVConfig",
    "OBCacheConfig",
    "RandomEvictionConfig",
    "RecentEvictionConfig",
    "EVICTION_METHODS",
    "ADAPTABLE",
    "OBCACHE_BASES",
    "method_config",
    "policy_grid",
]

_BASES = "lightning_modules.kv_eviction.config:EVICTION_METHODS"
"""The plugin table of ``base_args`` (:mod:`litctx_common.plugins`): a base method's config by name."""
ADAPTABLE: Tuple[str, ...] = ("h2o", "snapkv", "tova", "streaming_llm")
"""Bases AdaKV's head-adaptive selection can wrap."""
OBCACHE_BASES: Tuple[str, ...] = ("h2o", "snapkv", "tova")
"""Bases whose attention score OBCache replaces."""
OBCACHE_KINDS: Tuple[str, ...] = tuple(k[len("obcache_"):] for k in SCORE_KINDS if k.startswith("obcache_"))
"""OBCache's kinds (``v``, ``k``, ``kv``): the ``obcache_<kind>`` scores of :data:`SCORE_KINDS`."""


def _schedule(decode: bool, compaction: str = "inplace") -> Schedule:
    return Schedule(prefill=True, decode_every=1 if decode else 0, compaction=compaction)


def _check_compaction(cfg: Any) -> None:
    _check(cfg.compaction in COMPACTIONS, cfg.method, "compaction", cfg.compaction,
           f"valid values are {', '.join(COMPACTIONS)}")


@dataclass
class EvictionConfig(ABC):
    """Base of the eviction methods: ``method`` is the registry name, :meth:`build` the policy."""

    method: ClassVar[str] = "eviction"

    @abstractmethod
    def build(self) -> KVPolicy:
        """The :class:`KVPolicy` this config describes (a fresh one per call: scorers hold state)."""

    @abstractmethod
    def with_compression_ratio(self, ratio: float) -> "EvictionConfig":
        """A copy at compression ratio ``ratio`` (an absolute ``keep`` is dropped)."""


@dataclass
class _Budgeted(EvictionConfig):
    """Attributes:
        compression_ratio: fraction of each KV head's prompt entries removed, in [0, 1).
        keep: absolute entries kept per KV head (takes precedence over ``compression_ratio``).
    """

    compression_ratio: Optional[float] = 0.5
    keep: Optional[int] = None

    def __post_init__(self) -> None:
        m = self.method
        _check(self.compression_ratio is None or (is_number(self.compression_ratio)
                                                 and 0.0 <= self.compression_ratio < 1.0), m, "compression_ratio",
               self.compression_ratio, "must be in [0, 1) or null")
        _check(self.keep is None or (_is_int(self.keep) and self.keep >= 1), m, "keep", self.keep,
               "must be an integer >= 1 or null")

    def budget(self, **kw: Any) -> Budget:
        """The per-KV-head budget (``keep`` wins over ``compression_ratio``) plus ``kw`` (sink, window, ...)."""
        ratio = None if self.keep is not None else self.compression_ratio
        return Budget(keep=self.keep, compression_ratio=ratio, **kw)

    def tag(self) -> str:
        return self.budget().tag()

    def with_compression_ratio(self, ratio: float) -> "_Budgeted":
        return replace(self, compression_ratio=ratio, keep=None)


def _check_score(cfg: Any) -> None:
    _check(cfg.score in SCORE_KINDS, cfg.method, "score", cfg.score, f"valid scores are {', '.join(SCORE_KINDS)}")


def _check_gqa(cfg: Any) -> None:
    _check(cfg.gqa in GQA_REDUCTIONS, cfg.method, "gqa", cfg.gqa,
           f"valid reductions are {', '.join(GQA_REDUCTIONS)}")


@dataclass
class StreamingLLMConfig(_Budgeted):
    """StreamingLLM: ``sink`` first tokens + the most recent ones.

    Attributes:
        sink: attention-sink tokens kept (4 in the paper).
        decode: keep the budget during decoding too (a rolling window), not only after the prefill.
        compaction: how a decode step's eviction is applied (:class:`~lightning_modules.llm.kv_policy.protocol.Schedule`):
            ``inplace`` (the new entry takes the dropped one's place) or ``gather`` (the cache is rebuilt).
    """

    method: ClassVar[str] = "streaming_llm"
    sink: int = 4
    decode: bool = True
    compaction: str = "inplace"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(_is_int(self.sink) and self.sink >= 0, self.method, "sink", self.sink, "must be an integer >= 0")
        _check_compaction(self)

    def build(self) -> KVPolicy:
        return KVPolicy(scorer=RecentScorer(), selector=TopKSelector(), budget=self.budget(sink=self.sink),
                        schedule=_schedule(self.decode, self.compaction), name=f"streaming_llm@{self.tag()}")


@dataclass
class H2OConfig(_Budgeted):
    """H2O: heavy hitters by accumulated score + a recent window.

    Attributes:
        recent_fraction: share of the budget for the most recent tokens (0.5: half heavy, half recent).
        score: ``attention`` (H2O) or an OBCache score.
        obs_window: prefill queries that count (None = every one, as H2O; OBCache's released H2O variants
            score the prefill with the recent window only).
        decode: evict at every decode step (H2O), not only after the prefill.
        gqa: reduction of a GQA group's query heads (``mean``, ``sum``, ``max``).
        compaction: how a decode step's eviction is applied: ``inplace`` or ``gather`` (see StreamingLLM).
    """

    method: ClassVar[str] = "h2o"
    recent_fraction: float = 0.5
    score: str = "attention"
    obs_window: Optional[int] = None
    decode: bool = True
    gqa: str = "mean"
    compaction: str = "inplace"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(is_number(self.recent_fraction) and 0.0 <= self.recent_fraction <= 1.0, self.method,
               "recent_fraction", self.recent_fraction, "must be in [0, 1]")
        _check_score(self)
        _check(self.obs_window is None or (_is_int(self.obs_window) and self.obs_window >= 1), self.method,
               "obs_window", self.obs_window, "must be an integer >= 1 or null")
        _check_gqa(self)
        _check_compaction(self)

    def build(self) -> KVPolicy:
        scorer = AccumulatedScorer(score=self.score, obs_window=self.obs_window, gqa=self.gqa)
        return KVPolicy(scorer=scorer, selector=TopKSelector(),
                        budget=self.budget(window_fraction=self.recent_fraction),
                        schedule=_schedule(self.decode, self.compaction), name=f"h2o[{self.score}]@{self.tag()}")


@dataclass
class SnapKVConfig(_Budgeted):
    """SnapKV: the last ``window`` prompt queries vote, smoothed by a 1-D pool; the window itself is kept.

    Attributes:
        window: observation queries (SnapKV 32; kvpress 64).
        pool: ``avg`` (SnapKV), ``max`` or ``none``; kernel: pool width (5 in SnapKV, 7 in OBCache's code).
        score: ``attention`` (SnapKV) or an OBCache score.
        gqa: reduction of a GQA group's query heads.
    """

    method: ClassVar[str] = "snapkv"
    window: int = 32
    pool: str = "avg"
    kernel: int = 5
    score: str = "attention"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(_is_int(self.window) and self.window >= 1, self.method, "window", self.window,
               "must be an integer >= 1")
        _check(self.pool in POOLS, self.method, "pool", self.pool, f"valid pools are {', '.join(POOLS)}")
        _check(_is_int(self.kernel) and self.kernel >= 1 and self.kernel % 2 == 1, self.method, "kernel",
               self.kernel, "must be a positive odd integer")
        _check_score(self)
        _check_gqa(self)

    def build(self) -> KVPolicy:
        scorer = WindowScorer(score=self.score, window=self.window, pool=self.pool, kernel=self.kernel,
                              gqa=self.gqa)
        return KVPolicy(scorer=scorer, selector=TopKSelector(), budget=self.budget(window=self.window),
                        schedule=_schedule(False), name=f"snapkv[{self.score}]@{self.tag()}")


@dataclass
class TOVAConfig(_Budgeted):
    """TOVA: the current (last) query's score averaged over all heads; one kept set per layer.

    Attributes:
        score: ``attention`` (TOVA) or an OBCache score.
        window: most recent entries always kept (0 in TOVA; kvpress keeps 1).
        decode: evict at every decode step (TOVA), not only after the prefill.
        compaction: how a decode step's eviction is applied: ``inplace`` or ``gather`` (see StreamingLLM).
    """

    method: ClassVar[str] = "tova"
    score: str = "attention"
    window: int = 0
    decode: bool = True
    compaction: str = "inplace"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_score(self)
        _check(_is_int(self.window) and self.window >= 0, self.method, "window", self.window,
               "must be an integer >= 0")
        _check_compaction(self)

    def build(self) -> KVPolicy:
        # TOVA's score is the last query only, unpooled, averaged over every head (group mean, then the
        # shared selector's mean over KV heads)
        scorer = WindowScorer(score=self.score, window=1, pool="none", kernel=1, gqa="mean")
        return KVPolicy(scorer=scorer, selector=SharedTopKSelector(), budget=self.budget(window=self.window),
                        schedule=_schedule(self.decode, self.compaction), name=f"tova[{self.score}]@{self.tag()}")


def _base_config(method: str, base: str, base_args: Mapping[str, Any], valid: Sequence[str]) -> "_Budgeted":
    _check(base in valid, method, "base", base, f"valid bases are {', '.join(valid)}")
    if not isinstance(base_args, Mapping):
        raise ValueError(f"{method}.base_args: expected a mapping of {base}'s fields, got {type(base_args).__name__}")
    try:
        return coerce_config(dict(base_args), EVICTION_METHODS[base])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{method}.base_args: {err}") from None


def _check_alpha(cfg: Any) -> None:
    _check(is_number(cfg.alpha) and 0.0 <= cfg.alpha <= 1.0, cfg.method, "alpha", cfg.alpha, "must be in [0, 1]")


def _adaptive(base: KVPolicy, alpha: float) -> KVPolicy:
    """``base`` with AdaKV's head-adaptive selection (safeguard ``alpha``)."""
    return replace(base, selector=AdaKVSelector(alpha), name=f"adakv({base.name})")


def _ratio_args(base_args: Mapping[str, Any], ratio: float) -> Dict[str, Any]:
    return {**{k: v for k, v in base_args.items() if k != "keep"}, "compression_ratio": ratio}


@dataclass
class AdaKVConfig(EvictionConfig):
    """AdaKV: a base method's scores with head-adaptive budgets (the layer's total budget is shared).

    Attributes:
        base: ``h2o``, ``snapkv``, ``tova`` or ``streaming_llm``.
        base_args: the base method's config fields (its budget included).
        alpha: safeguard: each head keeps at least ``alpha`` of its own budget (kvpress 0.2).
    """

    method: ClassVar[str] = "adakv"
    base: str = "snapkv"
    base_args: Dict[str, Any] = plugin_args(_BASES, name_field="base", kind="base method")
    alpha: float = 0.2

    def __post_init__(self) -> None:
        _check_alpha(self)
        self.base_config()

    def base_config(self) -> "_Budgeted":
        """The base method's config from ``base`` and ``base_args`` (validated)."""
        return _base_config(self.method, self.base, self.base_args, ADAPTABLE)

    def build(self) -> KVPolicy:
        return _adaptive(self.base_config().build(), self.alpha)

    def with_compression_ratio(self, ratio: float) -> "AdaKVConfig":
        return replace(self, base_args=_ratio_args(self.base_args, ratio))


@dataclass
class OBCacheConfig(EvictionConfig):
    """OBCache: a base method with the output-aware score in place of the attention score.

    Attributes:
        base: ``snapkv`` (the ICML release's main variant), ``h2o`` or ``tova``.
        kind: ``v`` (value pruning), ``k`` (key pruning) or ``kv`` (joint).
        adaptive: wrap in AdaKV's head-adaptive selection (the ICML release's usage).
        alpha: AdaKV safeguard when ``adaptive``.
        base_args: the base method's config fields (its budget included).
    """

    method: ClassVar[str] = "obcache"
    base: str = "snapkv"
    kind: str = "kv"
    adaptive: bool = False
    alpha: float = 0.2
    base_args: Dict[str, Any] = plugin_args(_BASES, name_field="base", skip=("score",), kind="base method")

    def __post_init__(self) -> None:
        _check(self.kind in OBCACHE_KINDS, self.method, "kind", self.kind,
               f"valid kinds are {', '.join(OBCACHE_KINDS)}")
        _check_alpha(self)
        if isinstance(self.base_args, Mapping) and "score" in self.base_args:
            raise ValueError("obcache.base_args.score: the score is set by obcache.kind; remove it")
        self.base_config()

    def base_config(self) -> "_Budgeted":
        """The base method's config with the OBCache score (validated)."""
        args = {**dict(self.base_args), "score": f"obcache_{self.kind}"} if isinstance(self.base_args, Mapping) \
            else self.base_args
        return _base_config(self.method, self.base, args, OBCACHE_BASES)

    def build(self) -> KVPolicy:
        base = self.base_config().build()
        return _adaptive(base, self.alpha) if self.adaptive else base

    def with_compression_ratio(self, ratio: float) -> "OBCacheConfig":
        return replace(self, base_args=_ratio_args(self.base_args, ratio))


@dataclass
class RandomEvictionConfig(_Budgeted):
    """Control: uniform random scores (seeded), with optional protected ``sink`` / ``window``.

    Attributes:
        seed: scorer seed; sink, window: protected first / most recent entries.
    """

    method: ClassVar[str] = "random_eviction"
    seed: int = 0
    sink: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(_is_int(self.seed), self.method, "seed", self.seed, "must be an integer")
        for name in ("sink", "window"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, self.method, name, value, "must be an integer >= 0")

    def build(self) -> KVPolicy:
        return KVPolicy(scorer=RandomScorer(self.seed), selector=TopKSelector(),
                        budget=self.budget(sink=self.sink, window=self.window), name=f"random@{self.tag()}")


@dataclass
class RecentEvictionConfig(_Budgeted):
    """Control: keep only the most recent entries (StreamingLLM without sinks)."""

    method: ClassVar[str] = "recent_eviction"

    def build(self) -> KVPolicy:
        return KVPolicy(scorer=RecentScorer(), selector=TopKSelector(), budget=self.budget(),
                        name=f"recent@{self.tag()}")


EVICTION_METHODS: Dict[str, Type[EvictionConfig]] = {
    cls.method: cls
    for cls in (StreamingLLMConfig, H2OConfig, SnapKVConfig, TOVAConfig, AdaKVConfig, OBCacheConfig,
                RandomEvictionConfig, RecentEvictionConfig)
}
"""Method name -> config class (the config builds the policy: ``EVICTION_METHODS[name](**args).build()``)."""


def method_config(name: str, args: Optional[Mapping[str, Any]] = None) -> EvictionConfig:
    """The config of method ``name`` from a dict of its fields (unknown fields are named in the error)."""
    if name not in EVICTION_METHODS:
        raise ValueError(f"unknown eviction method {name!r}; known: {', '.join(EVICTION_METHODS)}")
    return coerce_config(dict(args or {}), EVICTION_METHODS[name])


def policy_grid(methods: Mapping[str, Tuple[str, Mapping[str, Any]]], ratios: Sequence[float], *,
                full: bool = True) -> Dict[Tuple[str, float], KVPolicy]:
    """One policy per (label, compression ratio).

    Args:
        methods: ``label -> (method name, config fields)``; the budget fields are replaced by each ratio (for
            ``adakv`` / ``obcache`` inside ``base_args``).
        ratios: compression ratios in [0, 1).
        full: also add ``("full", 0.0)``: the no-op policy (the full cache).

    Returns:
        ``{(label, ratio): KVPolicy}`` in the order of ``methods`` then ``ratios``.
    """
    grid: Dict[Tuple[str, float], KVPolicy] = {("full", 0.0): KVPolicy()} if full else {}
    for label, (name, args) in methods.items():
        cfg = method_config(name, args)
        for r in ratios:
            grid[(label, r)] = cfg.with_compression_ratio(r).build()
    return grid
