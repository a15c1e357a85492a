"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


PERSISTBENCH_PAPER = Paper(
    title="PersistBench: When Should Long-Term Memories Be Forgotten by LLMs?",
    venue="ICML 2026",
    arxiv="2602.01146",
    code="https://github.com/ivaxi0s/PersistBench (no licence: samples, prompts and rubrics written anew here)",
    name="PersistBench",
    entry="persistbench",
    docs="docs/memory.md",
)


METHODS = [
    MethodSpec(
        name="persistbench",
        recipe="persistbench_smollm2",
        target="lightning_modules.persistbench.module:PersistBenchModule",
        config="lightning_modules.persistbench.module:PersistBenchConfig",
        paper=PERSISTBENCH_PAPER,
        description="long-term-memory safety of a chat model (cross-domain leakage, memory-induced sycophancy, "
                    "beneficial use): memories in the system prompt, judged generations, FR@K; the model and "
                    "the judge are chat backends (local, or any OpenAI-compatible endpoint)",
        kind="inference",
        default_data="persistbench",
        tiny={"backend": {"name": "local", "model": "tiny-llama"}, "max_tokens": 4,
              "generations": {"cross_domain": 2, "sycophancy": 1, "beneficial_memory_usage": 1}, "k": 2},
        requires=("transformers", "httpx", "json_repair"),
        extra="llm",
        tags=("llm", "memory", "safety", "judge", "evaluation"),
        logs=eval_stages(*[f"{p}_{t}" for p in ("fr", "fr1") for t in ("cross_domain", "sycophancy", "beneficial",
                                                                      "all")], "invalid"),
    ),
]
