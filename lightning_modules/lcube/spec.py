"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


LCUBE_PAPER = Paper(
    title="L-CUBE: Isolating Long-Context Capacity from Knowledge with Controllable Mutual Information Scaling",
    venue="ICML 2026",
    code="https://github.com/LSquaredM/L-CUBE (README only; generator reconstructed here)",
    note="theory: L2M, arXiv:2503.04725",
    name="L-CUBE",
    entry="lcube",
    docs="docs/lcube.md",
)


METHODS = [
    MethodSpec(
        name="lcube",
        recipe="lcube",
        target="lightning_modules.lcube.module:LCubeModule",
        config="lightning_modules.lcube.config:LCubeModelConfig",
        paper=LCUBE_PAPER,
        description="next-vector Gaussian prediction on L-CUBE sequences (causal transformer or GRU)",
        default_data="lcube",
        tiny={"d_model": 16, "n_layers": 1, "n_heads": 2, "rnn_hidden": 16},
        fsdp_wrap=("lightning_modules.layers.transformer:TransformerBlock",),
        tags=("benchmark", "synthetic", "long-context"),
        logs=("train/loss",) + eval_stages("loss", "kl", "kl_by_pos/*", "bmi", "bmi_true", "utilization"),
    ),
]
