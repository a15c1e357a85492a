"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


PCFG_PAPER = Paper(
    title="How Transformers Represent Hierarchies: A Local-to-Global Mechanism",
    venue="ICML 2026",
    code="no public code or full text found; grammars and exact conditionals are the classical algorithms",
    name="PCFG local-to-global mechanism",
    entry="pcfg",
    docs="docs/architecture.md",
)


METHODS = [
    MethodSpec(
        name="pcfg",
        recipe="pcfg",
        target="lightning_modules.pcfg.module:PCFGModule",
        config="lightning_modules.pcfg.module:PCFGModelConfig",
        paper=PCFG_PAPER,
        description="causal transformer on fixed-depth PCFG strings, KL to the exact next-token conditionals",
        default_data="pcfg",
        tiny={"d_model": 16, "n_layers": 1, "n_heads": 2},
        fsdp_wrap=("lightning_modules.layers.transformer:TransformerBlock",),
        tags=("synthetic", "hierarchy"),
        logs=("train/loss",) + eval_stages("loss", "kl", "excess_ce"),
    ),
]
