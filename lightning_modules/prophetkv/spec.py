"""Registry specs of ProphetKV (ICML 2026) and its baselines CacheBlend and EPIC, each a KV-reuse callback with its
own typed config, and ``kv_reuse`` (any selector by name) (torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, Paper


PROPHETKV_PAPER = Paper(
    title="ProphetKV: User-Query-Driven Selective Recomputation for Efficient KV Cache Reuse in Retrieval-Augmented "
          "Generation",
    venue="ICML 2026",
    arxiv="2602.02579",
    code="no official code found; re-implemented from the paper's description (baselines: CacheBlend, EPIC)",
    name="ProphetKV",
    entry="prophetkv",
    docs="docs/rag.md",
)


_REUSE = dict(target="lightning_modules.prophetkv.callback:KVReuseCallback", stages=("validate", "test", "predict"),
              requires=("transformers", "safetensors"), extra="llm")

CALLBACKS = [
    CallbackSpec(
        name="prophetkv",
        recipe="prophetkv_smollm2",
        config="lightning_modules.prophetkv.config:ProphetKVReuseConfig",
        description="ProphetKV: prefill RAG prompts from stored chunk KV and recompute the share of tokens the user "
                    "question attends to most over the stale cache (query-driven selective recomputation)",
        paper=PROPHETKV_PAPER,
        **_REUSE,
    ),
    CallbackSpec(
        name="cacheblend",
        recipe="cacheblend_smollm2",
        config="lightning_modules.prophetkv.config:CacheBlendReuseConfig",
        description="CacheBlend (ProphetKV's baseline): recompute the chunk tokens whose values deviate most from a "
                    "fresh prefill at a check layer, filtered gradually",
        paper=Paper("CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
                    "EuroSys 2025", "2405.16444"),
        **_REUSE,
    ),
    CallbackSpec(
        name="epic",
        recipe="epic_smollm2",
        config="lightning_modules.prophetkv.config:EPICReuseConfig",
        description="EPIC (ProphetKV's baseline): recompute each chunk's initial tokens (position-independent "
                    "context caching)",
        paper=Paper("EPIC: Efficient Position-Independent Context Caching for Serving Large Language Models",
                    "ICML 2025", "2410.15332"),
        **_REUSE,
    ),
    CallbackSpec(
        name="kv_reuse",
        target="lightning_modules.prophetkv.callback:KVReuseCallback",
        config="lightning_modules.prophetkv.reuse:ReuseConfig",
        description="prefill RAG prompts from stored chunk KV (safetensors store) and recompute a share of the "
                    "tokens: ProphetKV (query-driven), CacheBlend, EPIC, random, an oracle, naive reuse or full",
        stages=("validate", "test", "predict"),
        requires=("transformers", "safetensors"),
        extra="llm",
        paper=PROPHETKV_PAPER,
    ),
]
