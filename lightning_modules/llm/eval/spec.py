"""Registry specs of the shared LLM base's evaluation: the long-context suite as a method, its report and the
``suite_eval`` callback of trained methods (torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, MethodSpec, Paper, eval_stages
from lightning_modules.llm.model.spec import LLM_TINY

RULER_PAPER = Paper(
    title="RULER: What's the Real Context Size of Your Long-Context Language Models?",
    venue="COLM 2024",
    arxiv="2404.06654",
    note="task families re-created on pydoc_data haystacks; protocol after NVIDIA/kvpress",
)


METHODS = [
    MethodSpec(
        name="longctx_eval",
        recipe="longctx_smollm2",
        target="lightning_modules.llm.eval.suite:LongContextEvalModule",
        config="lightning_modules.llm.eval.suite:LongContextEvalConfig",
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
        target="lightning_modules.llm.eval.report:LongContextReport",
        description="the long-context suite's task x length table, records and depth x length heat map",
        stages=("validate", "test", "predict"),
        paper=RULER_PAPER,
    ),
    CallbackSpec(
        name="suite_eval",
        target="lightning_modules.llm.eval.suite_callback:SuiteEvaluation",
        config="lightning_modules.llm.eval.suite_callback:SuiteEvalConfig",
        description="the long-context suite (noisy-context, structured and retrieval families) on a trained "
                    "language model at the end of its test stage; logs <stage>/suite_acc[_<task>]",
        stages=("validate", "test"),
        requires=("transformers",),
        extra="llm",
        paper=RULER_PAPER,
        logs=eval_stages("suite_acc", "suite_acc_*"),
    ),
]
