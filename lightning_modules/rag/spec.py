"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, eval_stages
from lightning_modules.prophetkv.spec import PROPHETKV_PAPER



METHODS = [
    MethodSpec(
        name="rag_eval",
        recipe="rag_smollm2",
        target="lightning_modules.rag.module:RAGEvalModule",
        config="lightning_modules.rag.module:RAGEvalConfig",
        paper=PROPHETKV_PAPER,
        description="retrieval-augmented QA and citation evaluation of a pretrained causal LM; KV reuse "
                    "(kv_reuse: ProphetKV, CacheBlend, EPIC ...) and citation guidance (guidance) attach as "
                    "callbacks (none = full prefill, greedy)",
        kind="inference",
        default_data="rag_tasks",
        tiny={"model": "tiny-llama", "max_new_tokens": 4, "retrieval": {"method": "bm25", "k": 2,
                                                                      "max_tokens": 64}},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "rag", "kv-cache", "citation", "evaluation"),
        logs=eval_stages("acc_running", "acc", "citation_f1", "citation_recall", "citation_precision",
                     "citation_gold_recall", "ttft_s"),
    ),
]
