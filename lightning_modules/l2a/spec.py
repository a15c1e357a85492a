"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


L2A_PAPER = Paper(
    title="Learning When to Attend: Conditional Memory Access for Long-Context LLMs",
    venue="ICML 2026",
    arxiv="2603.17484",
    code="https://github.com/awslabs/hybrid-model-factory (examples/research/L2A; re-implemented for Llama, Qwen2, "
         "OLMo-2)",
    name="L2A",
    entry="l2a_cpt",
    docs="docs/cpt.md",
)


METHODS = [
    MethodSpec(
        name="l2a_cpt",
        recipe="l2a_cpt",
        target="lightning_modules.l2a.module:L2ACPTModule",
        config="lightning_modules.l2a.module:L2ACPTConfig",
        paper=L2A_PAPER,
        description="continued pretraining with L2A: sliding-window attention plus a learned router that sends "
                    "only some tokens to global attention; rarely used global paths pruned after training",
        kind="finetune",
        default_data="text",
        tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 3}, "l2a": {"window": 16}, "prune_batches": 2},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "continued-pretraining", "sparse-attention", "kv-cache"),
        logs=("train/loss", "train/ce", "train/penalty", "train/lambda", "train/dense_step", "train/route_frac")
        + eval_stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "l2a_skip", "l2a_route_l*", "suite_acc*"),
    ),
]
