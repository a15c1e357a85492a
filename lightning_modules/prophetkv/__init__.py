"""ProphetKV: query-driven selective recomputation for reusing retrieved chunks' KV, with its baselines (naive
reuse, random, EPIC, CacheBlend, an oracle) on the shared cache surgery (:mod:`lightning_modules.llm.runtime.cache_surgery`)."""
