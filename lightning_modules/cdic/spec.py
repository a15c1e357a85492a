"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


CDIC_PAPER = Paper(
    title="Context-Driven Incremental Compression for Multi-turn Dialogue (C-DIC)",
    venue="ICML 2026",
    arxiv="2606.12411",
    code="code not public (\"Code: TBD\"); the slot memory, routing and ra-TBPTT are reconstructed (docs/cdic.md)",
    name="C-DIC",
    entry="cdic",
    docs="docs/cdic.md",
)


METHODS = [
    MethodSpec(
        name="cdic",
        recipe="cdic_smollm2",
        target="lightning_modules.cdic.module:CDICModule",
        config="lightning_modules.cdic.config:CDICConfig",
        paper=CDIC_PAPER,
        description="C-DIC on a frozen LM: K revisable per-thread compression states (KV of m tokens through "
                    "position-conditional LoRA), retrieve -> revise -> write-back per turn, TBPTT over turns; "
                    "baselines full / truncate / concat / merge as memory arms",
        kind="finetune",
        default_data="dialogue",
        tiny={"model": "tiny-llama", "slots": 3, "comp_tokens": 2, "read_slots": 2, "lora_rank": 2,
              "tbptt_k1": 2, "tbptt_k2": 2, "embedder": "hashing", "open_threshold": 0.25},
        requires=("transformers", "safetensors"),
        extra="llm",
        manual_optimization=True,
        tags=("llm", "dialogue", "compression", "memory", "tbptt"),
        logs=("train/loss",) + eval_stages("loss", "ppl", "recall_acc", "recall_acc_revised", "recall_acc_intro",
                                       "memory_tokens", "context_tokens"),
    ),
]
