"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, MethodSpec, Paper, eval_stages


INDEXMEM_PAPER = Paper(
    title="IndexMem: Learned KV-Cache Eviction with Latent Memory",
    venue="ICML 2026",
    arxiv="2605.25475",
    code="no public code; our instantiation of the abstract (MLP indexer on hidden states, linear-attention memory "
         "with a gated residual readout)",
    name="IndexMem",
    entry="indexmem_train",
    docs="docs/softplus_indexmem.md",
)


METHODS = [
    MethodSpec(
        name="indexmem_train",
        recipe="indexmem_smollm2",
        target="lightning_modules.indexmem.module:IndexMemModule",
        config="lightning_modules.indexmem.config:IndexMemTrainConfig",
        paper=INDEXMEM_PAPER,
        description="IndexMem training with the LLM frozen: per-layer learned indexers (teacher attention "
                    "targets) and latent-memory readouts, streaming each sample through the evicting policy",
        kind="finetune",
        default_data="longctx_suite",
        tiny={"model": "tiny-llama", "keep": 48, "compression_ratio": None, "chunk": 32, "window": 4},
        requires=("transformers", "safetensors"),
        extra="llm",
        tags=("llm", "kv-cache", "eviction", "learned"),
        logs=("train/loss", "train/answer", "train/indexer", "train/recall", "train/gate")
        + eval_stages("answer", "answer_full", "indexer", "recall"),
    ),
]

CALLBACKS = [
    CallbackSpec(
        name="indexmem",
        target="lightning_modules.indexmem.callback:IndexMemCallback",
        config="lightning_modules.indexmem.config:IndexMemConfig",
        description="IndexMem: a trained indexer picks the kept KV entries, evicted ones fold into a latent "
                    "memory read back as a gated residual (its state counts against the budget)",
        stages=("validate", "test", "predict"),
        requires=("transformers", "safetensors"),
        extra="llm",
        paper=INDEXMEM_PAPER,
    ),
]
