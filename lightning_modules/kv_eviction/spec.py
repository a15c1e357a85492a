"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import Paper, evaluation_callbacks


OBCACHE_PAPER = Paper(
    title="Optimal Brain Cache: output-aware KV-cache eviction",
    venue="ICML 2026",
    arxiv="2510.07651",
    note="value, key and joint scores as drop-in replacements inside H2O, SnapKV, TOVA and AdaKV",
    name="OBCache",
    entry="obcache",
    docs="docs/kv_eviction.md",
)

_EVICTION_CALLBACKS = [
    ("streaming_llm", "StreamingLLMConfig", "attention sinks + a recent window",
     Paper("Efficient Streaming Language Models with Attention Sinks", "ICLR 2024", "2309.17453")),
    ("h2o", "H2OConfig", "heavy hitters by accumulated attention + recent tokens, at every decode step",
     Paper("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", "NeurIPS 2023", "2306.14048")),
    ("snapkv", "SnapKVConfig", "observation-window votes, 1-D pooled, once after the prefill",
     Paper("SnapKV: LLM Knows What You are Looking for Before Generation", "NeurIPS 2024", "2404.14469")),
    ("tova", "TOVAConfig", "the last query's head-averaged attention, one set per layer, every step",
     Paper("Transformers are Multi-State RNNs", "EMNLP 2024", "2401.06104")),
    ("adakv", "AdaKVConfig", "head-adaptive budgets over any base method's scores",
     Paper("Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", "", "2407.11550")),
    ("obcache", "OBCacheConfig", "output-aware (value / key / joint) scores inside H2O, SnapKV or TOVA",
     OBCACHE_PAPER),
    ("random_eviction", "RandomEvictionConfig", "control: evict uniformly at random", None),
    ("recent_eviction", "RecentEvictionConfig", "control: keep only the most recent entries", None),
]


CALLBACKS = [
    *evaluation_callbacks(_EVICTION_CALLBACKS, "lightning_modules.kv_eviction.callbacks:EvictionCallback",
                           "lightning_modules.kv_eviction.config", "KV eviction",
                         recipes={"obcache": "obcache_smollm2"}),
]
