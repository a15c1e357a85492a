"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


SOFTPLUS_PAPER = Paper(
    title="Softplus Attention with Re-weighting Boosts Length Extrapolation in Large Language Models",
    venue="ICML 2026",
    arxiv="2501.13428",
    code="https://github.com/iminfine/freeattn (not inspected; re-implemented from the paper's equations, "
         "log-domain LSSAR)",
    name="Softplus attention (LSSA, LSSAR)",
    entry="lssa_lm",
    docs="docs/softplus_indexmem.md",
)


METHODS = [
    MethodSpec(
        name="lssa_lm",
        recipe="lssa_lm",
        target="lightning_modules.softplus.module:SoftplusLM",
        config="lightning_modules.softplus.module:SoftplusLMConfig",
        paper=SOFTPLUS_PAPER,
        description="a causal LM (from scratch with tiny-*) whose attention is softmax, LSSA (length-scaled "
                    "softplus) or LSSAR (re-weighted); loss at 1x-16x the training length, passkey probes",
        kind="pretrain",
        default_data="text",
        tiny={"model": "tiny-llama", "attention": {"score_mode": "lssar"}},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "attention", "length-extrapolation"),
        logs=("train/loss",) + eval_stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "passkey_acc_len*",
                                       "passkey_loss_len*", "suite_acc*"),
    ),
]
