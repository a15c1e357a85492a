"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


REPO_PAPER = Paper(
    title="RePo: Language Models with Context Re-Positioning",
    venue="ICML 2026",
    arxiv="2512.14391",
    code="https://github.com/SakanaAI/repo (re-implemented on stock transformers; the released parameter names and "
         "pe_config keys)",
    name="RePo",
    entry="repo_cpt",
    docs="docs/cpt.md",
)


METHODS = [
    MethodSpec(
        name="repo_cpt",
        recipe="repo_cpt",
        target="lightning_modules.repo.module:RePoCPTModule",
        config="lightning_modules.repo.module:RePoCPTConfig",
        paper=REPO_PAPER,
        description="continued pretraining with RePo: from layer L0 on a learned map gives each token a real "
                    "position per head, fed into RoPE",
        kind="finetune",
        default_data="text",
        tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 3}, "repo": {"start_layer": 1}},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "continued-pretraining", "positions"),
        logs=("train/loss", "train/repo_z_*") + eval_stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*",
                                                        "suite_acc*"),
    ),
]
