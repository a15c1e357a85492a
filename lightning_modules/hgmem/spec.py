"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


HGMEM_PAPER = Paper(
    title="Improving Multi-step RAG with Hypergraph-based Memory for Long-Context Complex Relational Modeling",
    venue="ICML 2026",
    arxiv="2512.23959",
    code="https://github.com/Encyclomen/HGMem (no licence: loop re-implemented from its description, prompts ours)",
    name="HGMem",
    entry="hgmem",
    docs="docs/memory.md",
)


METHODS = [
    MethodSpec(
        name="hgmem",
        recipe="hgmem_smollm2",
        target="lightning_modules.hgmem.module:HGMemEvalModule",
        config="lightning_modules.hgmem.module:HGMemEvalConfig",
        paper=HGMEM_PAPER,
        description="multi-step RAG with a hypergraph working memory (retrieve, evolve, merge, sufficiency check, "
                    "subqueries) over a knowledge-graph index, and the baselines single-step RAG and flat memory "
                    "(loop.strategy); any chat backend",
        kind="inference",
        default_data="multihop",
        tiny={"backend": {"name": "local", "model": "tiny-llama"},
              "loop": {"max_turns": 1, "max_tokens": 8, "answer_max_tokens": 4, "describe_missing_rounds": 1,
                       "evidence_tokens": 200, "chunk_tokens": 200, "answer_tokens": 300},
              "index": {"embedder": "hashing"}, "draw": 1},
        requires=("transformers", "networkx", "json_repair"),
        extra="llm",
        tags=("llm", "rag", "memory", "multi-hop", "evaluation"),
        logs=eval_stages("acc", "calls_per_q", "tokens_per_q", "rounds", "memory_points", "merges", "rejected",
                     "retrieved_recall", "context_recall"),
    ),
]
