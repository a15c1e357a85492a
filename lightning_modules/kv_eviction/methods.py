"""The eviction methods as typed configs that build a :class:`~lightning_modules.llm.policy.KVPolicy`.

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

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple, Type

from lightning_modules.base import coerce_config
from lightning_modules.kv_eviction.scores import SCORE_KINDS, check_kind
from lightning_modules.kv_eviction.scorers import AccumulatedScorer, WindowScorer
from lightning_modules.kv_eviction.selectors import AdaKVSelector
from lightning_modules.llm.policy import (
    Budget,
    KVPolicy,
    RandomScorer,
    RecentScorer,
    Schedule,
    SharedTopKSelector,
    TopKSelector,
)

__all__ = [
    "StreamingLLMConfig",
    "H2OConfig",
    "SnapKVConfig",
    "TOVAConfig",
    "AdaKVConfig",
    "OBCacheConfig",
    "RandomEvictionConfig",
    "RecentEvictionConfig",
    "EVICTION_METHODS",
    "build_eviction_policy",
    "method_config",
]


class _Validated:
    """Configs check themselves by building their policy once (scores, pools, budgets, bases)."""

    def __post_init__(self) -> None:
        build_eviction_policy(self)


@dataclass
class _Budgeted(_Validated):
    """Attributes:
        compression_ratio: fraction of each KV head's prompt entries removed, in [0, 1).
        keep: absolute entries kept per KV head (takes precedence over ``compression_ratio``).
    """

    compression_ratio: Optional[float] = 0.5
    keep: Optional[int] = None

    def budget(self, **kw: Any) -> Budget:
        ratio = None if self.keep is not None else self.compression_ratio
        return Budget(keep=self.keep, compression_ratio=ratio, **kw)

    def tag(self) -> str:
        return self.budget().tag()


@dataclass
class StreamingLLMConfig(_Budgeted):
    """StreamingLLM: ``sink`` first tokens + the most recent ones.

    Attributes:
        sink: attention-sink tokens kept (4 in the paper).
        decode: keep the budget during decoding too (a rolling window), not only after the prefill.
    """

    sink: int = 4
    decode: bool = True


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
    """

    recent_fraction: float = 0.5
    score: str = "attention"
    obs_window: Optional[int] = None
    decode: bool = True
    gqa: str = "mean"


@dataclass
class SnapKVConfig(_Budgeted):
    """SnapKV: the last ``window`` prompt queries vote, smoothed by a 1-D pool; the window itself is kept.

    Attributes:
        window: observation queries (SnapKV 32; kvpress 64).
        pool: ``avg`` (SnapKV), ``max`` or ``none``; kernel: pool width (5 in SnapKV, 7 in OBCache's code).
        score: ``attention`` (SnapKV) or an OBCache score.
        gqa: reduction of a GQA group's query heads.
    """

    window: int = 32
    pool: str = "avg"
    kernel: int = 5
    score: str = "attention"
    gqa: str = "mean"


@dataclass
class TOVAConfig(_Budgeted):
    """TOVA: the current (last) query's score averaged over all heads; one kept set per layer.

    Attributes:
        score: ``attention`` (TOVA) or an OBCache score.
        window: most recent entries always kept (0 in TOVA; kvpress keeps 1).
        decode: evict at every decode step (TOVA), not only after the prefill.
    """

    score: str = "attention"
    window: int = 0
    decode: bool = True


@dataclass
class AdaKVConfig(_Validated):
    """AdaKV: a base method's scores with head-adaptive budgets (the layer's total budget is shared).

    Attributes:
        base: ``h2o``, ``snapkv``, ``tova`` or ``streaming_llm``.
        base_args: the base method's config fields (its budget included).
        alpha: safeguard: each head keeps at least ``alpha`` of its own budget (kvpress 0.2).
    """

    base: str = "snapkv"
    base_args: Dict[str, Any] = field(default_factory=dict)
    alpha: float = 0.2


@dataclass
class OBCacheConfig(_Validated):
    """OBCache: a base method with the output-aware score in place of the attention score.

    Attributes:
        base: ``snapkv`` (the ICML release's main variant), ``h2o`` or ``tova``.
        kind: ``v`` (value pruning), ``k`` (key pruning) or ``kv`` (joint).
        adaptive: wrap in AdaKV's head-adaptive selection (the ICML release's usage).
        alpha: AdaKV safeguard when ``adaptive``.
        base_args: the base method's config fields (its budget included).
    """

    base: str = "snapkv"
    kind: str = "kv"
    adaptive: bool = False
    alpha: float = 0.2
    base_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RandomEvictionConfig(_Budgeted):
    """Control: uniform random scores (seeded), with optional protected ``sink`` / ``window``."""

    seed: int = 0
    sink: int = 0
    window: int = 0


@dataclass
class RecentEvictionConfig(_Budgeted):
    """Control: keep only the most recent entries (StreamingLLM without sinks)."""


def _schedule(decode: bool) -> Schedule:
    return Schedule(prefill=True, decode_every=1 if decode else 0)


def _streaming(cfg: StreamingLLMConfig) -> KVPolicy:
    return KVPolicy(scorer=RecentScorer(), selector=TopKSelector(), budget=cfg.budget(sink=cfg.sink),
                    schedule=_schedule(cfg.decode), name=f"streaming_llm@{cfg.tag()}")


def _h2o(cfg: H2OConfig) -> KVPolicy:
    scorer = AccumulatedScorer(score=cfg.score, obs_window=cfg.obs_window, gqa=cfg.gqa)
    return KVPolicy(scorer=scorer, selector=TopKSelector(), budget=cfg.budget(window_fraction=cfg.recent_fraction),
                    schedule=_schedule(cfg.decode), name=f"h2o[{cfg.score}]@{cfg.tag()}")


def _snapkv(cfg: SnapKVConfig) -> KVPolicy:
    scorer = WindowScorer(score=cfg.score, window=cfg.window, pool=cfg.pool, kernel=cfg.kernel, gqa=cfg.gqa)
    return KVPolicy(scorer=scorer, selector=TopKSelector(), budget=cfg.budget(window=cfg.window),
                    schedule=_schedule(False), name=f"snapkv[{cfg.score}]@{cfg.tag()}")


def _tova(cfg: TOVAConfig) -> KVPolicy:
    scorer = WindowScorer(score=cfg.score, window=1, pool="none")
    return KVPolicy(scorer=scorer, selector=SharedTopKSelector(), budget=cfg.budget(window=cfg.window),
                    schedule=_schedule(cfg.decode), name=f"tova[{cfg.score}]@{cfg.tag()}")


ADAPTABLE = ("h2o", "snapkv", "tova", "streaming_llm")


def _adakv(cfg: AdaKVConfig) -> KVPolicy:
    if cfg.base not in ADAPTABLE:
        raise ValueError(f"adakv.base={cfg.base!r}: valid bases are {', '.join(ADAPTABLE)}")
    base = build_eviction_policy(method_config(cfg.base, cfg.base_args))
    return replace(base, selector=AdaKVSelector(cfg.alpha), name=f"adakv({base.name})")


def _obcache(cfg: OBCacheConfig) -> KVPolicy:
    if cfg.base not in ("h2o", "snapkv", "tova"):
        raise ValueError(f"obcache.base={cfg.base!r}: valid bases are h2o, snapkv, tova")
    score = f"obcache_{cfg.kind}"
    if score not in SCORE_KINDS:
        raise ValueError(f"obcache.kind={cfg.kind!r}: valid kinds are v, k, kv")
    if "score" in cfg.base_args:
        raise ValueError("obcache.base_args.score: the score is set by obcache.kind; remove it")
    base_args = {**cfg.base_args, "score": score}
    if cfg.adaptive:
        return _adakv(AdaKVConfig(base=cfg.base, base_args=base_args, alpha=cfg.alpha))
    return build_eviction_policy(method_config(cfg.base, base_args))


def _random(cfg: RandomEvictionConfig) -> KVPolicy:
    return KVPolicy(scorer=RandomScorer(cfg.seed), selector=TopKSelector(),
                    budget=cfg.budget(sink=cfg.sink, window=cfg.window), name=f"random@{cfg.tag()}")


def _recent(cfg: RecentEvictionConfig) -> KVPolicy:
    return KVPolicy(scorer=RecentScorer(), selector=TopKSelector(), budget=cfg.budget(), name=f"recent@{cfg.tag()}")


EVICTION_METHODS: Dict[str, Tuple[Type[Any], Callable[[Any], KVPolicy]]] = {
    "streaming_llm": (StreamingLLMConfig, _streaming),
    "h2o": (H2OConfig, _h2o),
    "snapkv": (SnapKVConfig, _snapkv),
    "tova": (TOVAConfig, _tova),
    "adakv": (AdaKVConfig, _adakv),
    "obcache": (OBCacheConfig, _obcache),
    "random_eviction": (RandomEvictionConfig, _random),
    "recent_eviction": (RecentEvictionConfig, _recent),
}
"""Method name -> (config class, policy builder)."""


def method_config(name: str, args: Optional[Dict[str, Any]] = None) -> Any:
    """The config of method ``name`` from a dict of its fields (unknown fields are named in the error)."""
    if name not in EVICTION_METHODS:
        raise ValueError(f"unknown eviction method {name!r}; known: {', '.join(EVICTION_METHODS)}")
    return coerce_config(dict(args or {}), EVICTION_METHODS[name][0])


def build_eviction_policy(cfg: Any) -> KVPolicy:
    """The :class:`KVPolicy` a method config describes (scores and budgets validated here)."""
    for name, (cls, build) in EVICTION_METHODS.items():
        if type(cfg) is cls:
            if hasattr(cfg, "score"):
                check_kind(cfg.score)
            if hasattr(cfg, "recent_fraction") and not 0.0 <= cfg.recent_fraction <= 1.0:
                raise ValueError(f"recent_fraction must be in [0, 1], got {cfg.recent_fraction}")
            return build(cfg)
    raise TypeError(f"{type(cfg).__name__} is not an eviction method config; known: "
                    f"{', '.join(c.__name__ for c, _ in EVICTION_METHODS.values())}")
